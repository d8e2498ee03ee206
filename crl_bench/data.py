"""Benchmark data: where it lives, how it is checked, and ``crl-bench data download``.

The data dir is ``$CRL_BENCH_DATA`` when set (tests and CI point it at ``../shared/data``), else
``<cache>/data`` (``$CRL_BENCH_CACHE`` or ``~/.cache/crl-bench``). An env's ``data_dir`` setting
overrides both. Each data set has its own folder below it (``alfworld/``, ``webshop/``, ...).

Downloads go to the original public sources and are verified against the checksums shipped in
``crl_bench/data_manifests/`` before anything is used; a mismatch is an error naming the file.

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


def download_url(url: str, dest: Path, expected_size: int | None = None,
                 expected_sha256: str | None = None, progress: bool = True) -> Path:
    """Download ``url`` to ``dest`` (through a temporary file; nothing partial is left at ``dest``).

    Raises:
        ChecksumError: the size or sha256 differs from the expected one (the file is removed).
        urllib.error.URLError: the source cannot be reached.
    """
    from tqdm import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as resp:
            total = int(resp.headers.get("Content-Length") or 0) or expected_size
            with tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, disable=not progress) as bar:
                for block in iter(lambda: resp.read(1 << 20), b""):
                    out.write(block)
                    bar.update(len(block))
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
