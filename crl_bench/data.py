"""Benchmark data: where it lives, how it is checked, and ``crl-bench data download``.

The data dir is ``$CRL_BENCH_DATA`` when set (tests and CI point it at ``../shared/data``), else
``<cache>/data`` (``$CRL_BENCH_CACHE`` or ``~/.cache/crl-bench``). An env's ``data_dir`` setting
overrides both. Each data set has its own folder below it (``alfworld/``, ``webshop/``, ...).

Downloads go to the original public sources and are verified against the checksums shipped in
``crl_bench/data_manifests/`` before anything is used; a mismatch is an error naming the file. A
download reads at most the size its manifest gives (or :data:`DOWNLOAD_MAX_BYTES` where none is
known), so a source that never ends (``--source /dev/zero``) cannot fill the disk; a local source must
be a regular file or folder (:func:`local_source`).

A data set unpacked into a folder of many files (ALFWorld's games) is staged beside its place and
renamed into it whole, with a completion marker (:data:`COMPLETE_MARKER`) holding the digest of the
manifest it was checked against (:func:`write_marker`, :func:`read_marker`); a folder without it is
refused. Leftovers of a download that was killed (``.staging-*``, ``.old-*``, ``*.part``) are removed
by the next one (:func:`remove_stale`).

Each env keeps its own data code beside it (``crl_bench.envs.alfworld.data``,
``crl_bench.envs.swebench.instances``, ``crl_bench.envs.webshop.products``) and declares its downloader
as an entry point of the group ``crl_bench.datasets`` (``name = "module:function"``, called as
``function(dest_root, source=None, verify=True) -> Path``), which ``crl-bench data download NAME``
finds through :func:`downloader`; this module keeps the generic helpers: the data dir, checksums,
manifests, a file lock and a verified download.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import stat
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

from crl_bench.llm.default_model import cache_dir


class DataMissingError(FileNotFoundError):
    """A data set an env needs is not in the data dir; the message names the command to run."""


class ChecksumError(RuntimeError):
    """A downloaded or unpacked file does not match the checksum shipped with crl-bench."""


class DataInvalidError(ValueError):
    """A data file in the data dir cannot be read as the data set it should be (not JSON, nested too
    deeply); the message names the file and the command that fetches it again."""


#: Most bytes one download reads when its manifest gives no size (a runaway source is cut off there).
DOWNLOAD_MAX_BYTES = 4 << 30
#: The completion marker of an unpacked data folder (JSON: ``manifest``, ``verified``, ``files``).
COMPLETE_MARKER = ".crl-bench-complete.json"
_STALE = re.compile(r"^(\.staging-.*|\.old-.*|tmp[a-z0-9_]{8}|.*\.part)$")


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """The data root: ``override``, else ``$CRL_BENCH_DATA``, else ``<cache>/data``."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get("CRL_BENCH_DATA")
    if env:
        return Path(env).expanduser()
    return cache_dir() / "data"


def data_checksums(data_files: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """``{env id: {name: sha256}}`` of ``{env id: {name relative to the data root: path}}`` (the
    trainer's ``data_files``, from ``TextEnv.data_files``); envs without data files are left out."""
    return {env_id: {name: sha256_file(path) for name, path in sorted(files.items())}
            for env_id, files in data_files.items() if files}


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def load_manifest(name: str) -> dict:
    """The checksum manifest ``crl_bench/data_manifests/<name>.json``."""
    return json.loads(resources.files("crl_bench.data_manifests").joinpath(f"{name}.json").read_text())


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if needed), so that several processes (env
    workers, parallel test runs) unpack a data set once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def folder_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on the folder ``path`` itself (created if needed; no lock file is
    left in it), held while a download fills it, so that two downloads of one data set take turns and
    the second finds the first one's result."""
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)                        # closing the descriptor releases the lock


def download_url(url: str, dest: Path, expected_size: int | None = None,
                 expected_sha256: str | None = None, progress: bool = True,
                 max_bytes: int = DOWNLOAD_MAX_BYTES) -> Path:
    """Download ``url`` to ``dest`` (through a temporary file; nothing partial is left at ``dest``).

    Reading stops one byte past ``expected_size`` (else past ``max_bytes``): a larger source is an
    error, not a full disk.

    Raises:
        ChecksumError: the size or sha256 differs from the expected one, or the source is larger than
            ``max_bytes`` (the file is removed).
        urllib.error.URLError: the source cannot be reached.
    """
    from tqdm import tqdm

    limit = expected_size if expected_size is not None else max_bytes
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as resp:
            total = int(resp.headers.get("Content-Length") or 0) or expected_size
            if total and total > limit:
                raise ChecksumError(f"{url}: the source announces {total} bytes, expected at most {limit}")
            got = 0
            with tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, disable=not progress) as bar:
                while block := resp.read(min(1 << 20, limit + 1 - got)):
                    out.write(block)
                    got += len(block)
                    bar.update(len(block))
                    if got > limit:
                        raise ChecksumError(f"{url}: more than the {limit} bytes expected; stopped reading")
        size = os.path.getsize(tmp)
        if expected_size is not None and size != expected_size:
            raise ChecksumError(f"{url}: got {size} bytes, expected {expected_size}")
        if expected_sha256 is not None:
            got = sha256_file(tmp)
            if got != expected_sha256:
                raise ChecksumError(f"{url}: sha256 {got}, expected {expected_sha256}")
        # mkstemp makes the file private (0600); a data set is read by others (env workers under
        # another user, a shared cache), so it gets the mode a plain new file would have
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dest)
        return dest
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


DATASETS_GROUP = "crl_bench.datasets"


def dataset_names() -> list[str]:
    """Names of the data sets declared in :data:`DATASETS_GROUP` (nothing is imported)."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=DATASETS_GROUP)})


def downloader(name: str) -> Callable[..., Path]:
    """The downloader of the data set ``name``, from the entry points of the group
    :data:`DATASETS_GROUP` (an env package declares its own; only that one module is imported).  It is
    called as ``fn(dest_root, source=None, verify=True)`` and returns the folder it filled.

    Raises:
        KeyError: no data set of that name (the message lists the known ones).
        ImportError: its module cannot be imported (the message names it).
    """
    eps = [ep for ep in importlib.metadata.entry_points(group=DATASETS_GROUP) if ep.name == name]
    if not eps:
        raise KeyError(f"unknown data set {name!r}; known: {', '.join(dataset_names())}")
    try:
        return eps[0].load()
    except ImportError as e:
        raise ImportError(f"data set {name!r}: cannot import its downloader {eps[0].value!r}: {e}") from e


def local_source(path: str | os.PathLike, folder: bool = False) -> Path:
    """A ``--source`` on this machine, checked before it is read: it must exist and be a regular file
    (``folder``: a folder), so a device or a FIFO (``/dev/zero``) is refused at once.

    Raises:
        DataInvalidError: missing, or not a regular file (a folder).
    """
    p = Path(path).expanduser()
    try:
        st = os.stat(p)
    except OSError as e:
        raise DataInvalidError(f"--source {str(p)!r} cannot be read ({e.strerror or e})") from None
    ok = stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)
    if not ok:
        raise DataInvalidError(f"--source {str(p)!r} is not a {'folder' if folder else 'regular file'}; refused")
    return p


def remove_stale(folder: Path) -> list[str]:
    """Remove what a killed download left in ``folder``: ``.staging-*`` and ``.old-*`` folders,
    ``tmpXXXXXXXX`` folders of older versions and ``*.part`` files. Call it holding the data set's
    download lock (:func:`folder_lock`), so no running download loses its files. Returns the names removed."""
    removed = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        if not _STALE.match(p.name) or p.is_symlink():
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p.name)
    return removed


def manifest_digest(content: dict) -> str:
    """sha256 of the part of a manifest that defines a data set's content (``content``: the checksums,
    not the URLs), as canonical JSON; a completion marker records it."""
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_marker(folder: Path, digest: str, verified: bool, files: int) -> None:
    """Write ``folder``'s completion marker (:data:`COMPLETE_MARKER`), fsynced, before the folder is
    renamed into place."""
    path = folder / COMPLETE_MARKER
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"manifest": digest, "verified": bool(verified), "files": int(files)}, f)
        f.flush()
        os.fsync(f.fileno())


def read_marker(folder: Path, digest: str) -> str | None:
    """Why ``folder`` is not a complete data folder for the manifest with ``digest``, or None when
    its marker says it is (written after every file was unpacked and checked)."""
    path = folder / COMPLETE_MARKER
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{folder} has no completion marker ({COMPLETE_MARKER}): an unpacking that did not finish, " \
               f"or one of an older crl-bench"
    except (OSError, ValueError) as e:
        return f"{path} cannot be read ({type(e).__name__})"
    if not isinstance(data, dict) or data.get("manifest") != digest:
        return f"{folder} was unpacked for another version of the data set's manifest"
    return None


def read_data_json(path: Path, fix: str) -> object:
    """Parse the JSON data file ``path`` (a data set's own file, possibly large).

    Raises:
        DataInvalidError: not UTF-8 JSON, or nested too deeply for the parser; the message names the
            file and ``fix`` (the command that fetches the data set again).
    """
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except RecursionError:
        problem = "nested too deeply to be a data file"
    except (ValueError, UnicodeDecodeError) as e:
        problem = f"not a JSON file ({str(e)[:120]})"
    raise DataInvalidError(f"{path}: {problem}; run `{fix}` to fetch it again")
