"""ALFWorld data: the paper's task lists and the TextWorld games, located, verified and unpacked.

Under the data dir (:func:`crl_bench.data.data_dir`), ``alfworld/`` holds:

* ``splits/train_1466.jsonl`` and ``splits/eval_134.jsonl``: the paper's task lists (one JSON object a
  line; ``additional_info.description`` = ``<task-folder>/<trial>``), from the authors' release
  (pUmpKin-Co/ComplementaryRL, ``roll/pipeline/agentic/env/alfworld/data/``).
* the games: ``json_2.1.1/{train,valid_unseen,valid_seen}/<task-folder>/<trial>/game.tw-pddl``, either unpacked
  in the data dir (what ``crl-bench data download alfworld`` writes, from the ALFWorld 0.4.0 release
  asset ``json_2.1.2_tw-pddl.zip``) or packed as ``json_2.1.1.tar.xz`` (the offline copy in
  ``../shared/data``), which is unpacked once into ``<cache>/alfworld`` on first use.

The third list, ``eval_seen_140.jsonl`` (every game of ALFWorld's ``valid_seen``, the split verl-agent
and the papers built on it evaluate, sorted by folder name, with the goal each game states at reset),
has no upstream file: it ships with the package (``crl_bench/data_manifests/``), written by
:func:`crl_bench.envs.alfworld.expert.build_seen_list` and checked against the manifest like the others.

``crl-bench data download alfworld`` runs :func:`download_alfworld` (declared as the ``alfworld`` entry
point of the ``crl_bench.datasets`` group).

A games folder is complete or refused: it is unpacked into a ``.staging-*`` folder beside its place,
every game checked (size bounded before it is read, path confined to the folder, sha256 against the
manifest), a completion marker holding the manifest's digest written into it
(:data:`crl_bench.data.COMPLETE_MARKER`), and only then renamed into place. :func:`alfworld_games_root`
refuses a ``json_2.1.1/`` without that marker (a download killed by an older version, or edited by
hand) and names ``crl-bench data download alfworld``, which re-hashes the games already there and
keeps them when they all match, else unpacks them again. A game the manifest lists that is not in a
folder is an error (the one trial the release lacks, ``null`` in the manifest, is skipped).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from crl_bench.data import (
    ChecksumError,
    DataMissingError,
    data_dir,
    download_url,
    file_lock,
    folder_lock,
    load_manifest,
    local_source,
    manifest_digest,
    read_marker,
    remove_stale,
    sha256_file,
    write_marker,
)
from crl_bench.llm.default_model import cache_dir

ALFWORLD_SPLIT_FILES = {"train": "train_1466.jsonl", "eval": "eval_134.jsonl", "eval_seen": "eval_seen_140.jsonl"}
ALFWORLD_GAME_FOLDERS = {"train": "train", "eval": "valid_unseen", "eval_seen": "valid_seen"}
#: Task lists that ship with the package (``crl_bench/data_manifests/alfworld_<file>``) instead of
#: being downloaded into the data dir: ALFWorld has no list file for ``valid_seen``.
ALFWORLD_PACKAGED_SPLITS = frozenset({"eval_seen"})
ALFWORLD_ROOT = "json_2.1.1"
ALFWORLD_ARCHIVE = "json_2.1.1.tar.xz"
#: Largest game file unpacked (the release's largest is about 140 kB); a larger member is refused
#: before it is read.
MAX_GAME_BYTES = 8 << 20
#: Largest local archive ``--source`` read, and the most a download reads without ``verify``.
MAX_ARCHIVE_BYTES = 8 << 30
_DESCRIPTION = re.compile(r"^[A-Za-z0-9_.\-]+/[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class AlfWorldTask:
    """One line of an ALFWorld split list.

    Attributes:
        index: line number in the split file (0-based).
        split: ``"train"``, ``"eval"`` (valid_unseen) or ``"eval_seen"`` (valid_seen).
        description: ``<task-folder>/<trial>``.
        goal: the task text, e.g. ``"put some creditcard on diningtable."``.
        difficulty: ``"easy"``/``"hard"`` as labelled in the split file (``""`` where it has none).
    """

    index: int
    split: str
    description: str
    goal: str
    difficulty: str

    @property
    def member(self) -> str:
        """Path of the game file relative to the data set folder."""
        return f"{ALFWORLD_ROOT}/{ALFWORLD_GAME_FOLDERS[self.split]}/{self.description}/game.tw-pddl"

    @property
    def task_type(self) -> str:
        """E.g. ``"pick_and_place_simple"`` (the task folder's first field)."""
        return self.description.split("-", 1)[0]


def alfworld_dir(override: str | os.PathLike | None = None) -> Path:
    return data_dir(override) / "alfworld"


def split_file(split: str, splits_root: Path) -> Path:
    """Where the task list of ``split`` is: ``<splits_root>/splits/<file>`` for the downloaded lists,
    the package's copy for :data:`ALFWORLD_PACKAGED_SPLITS`. Raises ``KeyError`` for an unknown split."""
    fname = ALFWORLD_SPLIT_FILES[split]
    if split in ALFWORLD_PACKAGED_SPLITS:
        return Path(str(resources.files("crl_bench.data_manifests").joinpath(f"alfworld_{fname}")))
    return splits_root / "splits" / fname


def _missing(what: str, where: Path) -> DataMissingError:
    return DataMissingError(
        f"ALFWorld {what} not found in {where}. Run `crl-bench data download alfworld` (downloads the "
        f"games and task lists into the data dir and verifies them), or point CRL_BENCH_DATA (or the "
        f"env's data_dir) at a folder whose alfworld/ holds splits/{ALFWORLD_SPLIT_FILES['train']}, "
        f"splits/{ALFWORLD_SPLIT_FILES['eval']} and {ALFWORLD_ROOT}/ (or {ALFWORLD_ARCHIVE}).")


def alfworld_tasks(split: str, override: str | os.PathLike | None = None) -> list[AlfWorldTask]:
    """The task list of ``split`` (``"train"``: 1,466 tasks, ``"eval"``: 134 of valid_unseen,
    ``"eval_seen"``: 140 of valid_seen), in file order.

    Raises:
        KeyError: unknown split.
        DataMissingError: the split file is absent.
        ChecksumError: the split file differs from the paper's list.
    """
    if split not in ALFWORLD_SPLIT_FILES:
        raise KeyError(f"alfworld: unknown split {split!r}; known: {sorted(ALFWORLD_SPLIT_FILES)}")
    path = split_file(split, alfworld_dir(override))
    if not path.is_file():
        raise _missing(f"task list {path.name}", path.parent)
    expected = load_manifest("alfworld")["splits"][ALFWORLD_SPLIT_FILES[split]]["sha256"]
    if sha256_file(path) != expected:
        raise ChecksumError(f"{path}: not the {split} list crl-bench was verified with (sha256 differs from "
                            f"{expected})")
    tasks = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            row = json.loads(line)
            tasks.append(AlfWorldTask(i, split, row["additional_info"]["description"], row["goal"],
                                      row.get("difficulty", "")))
    return tasks


def games_digest() -> str:
    """Digest of the manifest's content (split and game checksums, not URLs) that a games folder's
    completion marker records (:func:`crl_bench.data.manifest_digest`)."""
    man = load_manifest("alfworld")
    return manifest_digest({"splits": {n: m["sha256"] for n, m in man["splits"].items()}, "games": man["games"]})


def _description(line: str, fname: str, i: int) -> str:
    """The ``<task-folder>/<trial>`` of one split line, refused unless it is two plain path parts (an
    edited split list cannot name a path outside the games folder, even without verification)."""
    try:
        desc = json.loads(line)["additional_info"]["description"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise ChecksumError(f"{fname} line {i + 1}: not a task line") from None
    if not isinstance(desc, str) or not _DESCRIPTION.match(desc) or ".." in desc.split("/"):
        raise ChecksumError(f"{fname} line {i + 1}: description {str(desc)[:80]!r} is not <task-folder>/<trial>")
    return desc


def game_hashes(splits_root: Path) -> dict[str, str]:
    """``{game member path: sha256}`` of every split game, from the manifest (which lists the hashes
    in split-file order, ``null`` for the trial the release lacks) and the split files under
    ``splits_root/splits``.

    Raises:
        ChecksumError: a split line is not a task or names a path that is not ``<task-folder>/<trial>``,
            or a split file has another number of tasks than the manifest.
    """
    games = load_manifest("alfworld")["games"]
    out = {}
    for split, fname in ALFWORLD_SPLIT_FILES.items():
        with open(split_file(split, splits_root), encoding="utf-8") as f:
            rows = [_description(line, fname, i) for i, line in enumerate(f)]
        if len(rows) != len(games[split]):
            raise ChecksumError(f"{fname}: {len(rows)} tasks, the manifest has {len(games[split])}")
        for desc, digest in zip(rows, games[split]):
            if digest is not None:
                out[f"{ALFWORLD_ROOT}/{ALFWORLD_GAME_FOLDERS[split]}/{desc}/game.tw-pddl"] = digest
    return out


def alfworld_games_root(override: str | os.PathLike | None = None) -> Path:
    """Folder that holds ``json_2.1.1/...`` with every game of the split lists.

    Unpacked games in the data dir are used when their completion marker names this manifest
    (module docstring); otherwise the packed ``json_2.1.1.tar.xz`` (the offline copy, which may lie
    in a read-only folder) is unpacked (split games only, checksums verified) into
    ``<cache>/alfworld/<key>`` once: staged beside it, marked complete, renamed into place, under a
    file lock so that concurrent workers wait for one unpacking.

    Raises:
        DataMissingError: neither the unpacked games nor the archive are there, or the unpacked games
            have no completion marker for this manifest (the message names the command that fixes it).
        ChecksumError: an unpacked game differs from the manifest.
    """
    root = alfworld_dir(override)
    digest = games_digest()
    if (root / ALFWORLD_ROOT).is_dir():
        why = read_marker(root / ALFWORLD_ROOT, digest)
        if why is not None:
            raise DataMissingError(f"ALFWorld games are incomplete or unchecked: {why}. Run `crl-bench data "
                                   f"download alfworld` (it re-hashes the games there and keeps or replaces them)")
        return root
    archive = root / ALFWORLD_ARCHIVE
    if not archive.is_file():
        raise _missing("games", root)
    key = hashlib.sha256(str(archive.resolve()).encode()).hexdigest()[:12]
    parent = cache_dir() / "alfworld"
    target = parent / key
    if read_marker(target / ALFWORLD_ROOT, digest) is None:
        return target
    with file_lock(parent / f"{key}.lock"):
        if read_marker(target / ALFWORLD_ROOT, digest) is not None:
            for split in ALFWORLD_SPLIT_FILES:                                 # verifies the lists
                alfworld_tasks(split, override)
            for stale in [*parent.glob(f".{key}-*"), *parent.glob(f".old-{key}-*")]:   # one killed earlier
                shutil.rmtree(stale, ignore_errors=True)
            stage = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=parent))
            try:
                hashes = game_hashes(root)
                unpack_alfworld_games(archive, stage, hashes)
                _check_all_there(stage, hashes, archive)
                write_marker(stage / ALFWORLD_ROOT, digest, True, len(hashes))
                _swap_in(stage, target)
            finally:
                shutil.rmtree(stage, ignore_errors=True)
    return target


def _check_all_there(folder: Path, hashes: dict[str, str], source: Path | str) -> None:
    missing = [m for m in hashes if not (folder / m).is_file()]
    if missing:
        raise ChecksumError(f"{source}: {len(missing)} of the {len(hashes)} split games are missing, e.g. "
                            f"{missing[0]}")


def _swap_in(new: Path, place: Path) -> None:
    """Rename the folder ``new`` to ``place``; a folder already at ``place`` is renamed aside first and
    removed after, so ``place`` is at every moment either the old folder or the new one."""
    old = place.with_name(f".old-{place.name}-{new.name.lstrip('.')}")
    if place.exists():
        place.rename(old)
    new.rename(place)
    shutil.rmtree(old, ignore_errors=True)


def _verify_member(path: Path, member: str, hashes: dict[str, str]) -> None:
    want = hashes.get(member)
    if want is not None and sha256_file(path) != want:
        raise ChecksumError(f"{member}: sha256 differs from the manifest ({want}); the game files are "
                            f"not the ALFWorld release crl-bench was verified against")


def unpack_alfworld_games(archive: Path, target: Path, hashes: dict[str, str],
                          verify: bool = True) -> int:
    """Unpack the split games of ``archive`` (``.tar.xz``/``.tar.gz`` or ``.zip``) into ``target``,
    verifying each against ``hashes`` (``{member: sha256}``, see :func:`game_hashes`) unless
    ``verify`` is off. Returns the number of games written.

    Each member's size is checked against :data:`MAX_GAME_BYTES` before it is read (and the read
    stops there), and its path must stay inside ``target`` (with or without ``verify``).

    Raises:
        ChecksumError: a game differs from the manifest, is larger than :data:`MAX_GAME_BYTES`, or
            names a path outside ``target``.
        DataMissingError: none of the wanted games is in the archive.
    """
    wanted = set(hashes)
    target.mkdir(parents=True, exist_ok=True)
    base = target.resolve()
    written = 0

    def write(member: str, size: int, read: Callable[[int], bytes]) -> None:
        nonlocal written
        dest = target / member
        if ".." in Path(member).parts or Path(member).is_absolute() or \
                not Path(os.path.normpath(base / member)).is_relative_to(base):
            raise ChecksumError(f"{archive}: member {member[:120]!r} lies outside {target}; refused")
        if size > MAX_GAME_BYTES:
            raise ChecksumError(f"{archive}: member {member} has {size} bytes, more than a game's "
                                f"{MAX_GAME_BYTES}; refused")
        data = read(MAX_GAME_BYTES + 1)
        if len(data) > MAX_GAME_BYTES:
            raise ChecksumError(f"{archive}: member {member} is larger than it says; refused")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(".part")
        tmp.write_bytes(data)
        if verify:
            _verify_member(tmp, member, hashes)
        os.replace(tmp, dest)
        written += 1

    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if info.filename in wanted and not info.is_dir():
                    with zf.open(info) as f:
                        write(info.filename, info.file_size, f.read)
    else:
        with tarfile.open(archive, "r:*") as tf:
            for info in tf:
                if info.isfile() and info.name in wanted:
                    f = tf.extractfile(info)
                    assert f is not None
                    write(info.name, info.size, f.read)
    if written == 0:
        raise DataMissingError(f"{archive}: none of the {len(wanted)} ALFWorld split games is in it")
    return written


def download_alfworld(dest_root: Path | None = None, source: str | None = None, progress: bool = True,
                      verify: bool = True) -> Path:
    """``crl-bench data download alfworld``: the task lists and the split games into the data dir.

    Holds a lock on ``<dest_root>/alfworld`` for the whole download and first removes what a killed
    one left there (:func:`crl_bench.data.remove_stale`). Games already unpacked are re-hashed (with
    ``verify``) and kept when every one is there and matches; then the marker is written if missing.
    Otherwise the games are unpacked into a staging folder, checked, marked complete and renamed into
    place (module docstring).

    Args:
        dest_root: the data dir (default :func:`data_dir`); files go to ``<dest_root>/alfworld``.
        source: a local archive (zip or tar, a regular file of at most :data:`MAX_ARCHIVE_BYTES`) of the
            games to use instead of downloading the release asset, e.g. ``json_2.1.1.tar.xz``.
        verify: check sizes and sha256 against the manifest (off only for a trusted mirror whose
            archive differs byte-wise; member sizes and paths are checked either way).

    Returns the ``alfworld`` folder.

    Raises:
        ChecksumError: a file does not match the manifest, a game is missing from the archive, or a
            member is too large or outside the folder (nothing unverified is left in place).
        DataInvalidError: ``source`` is missing or not a regular file.
        urllib.error.URLError: a source cannot be reached.
    """
    man = load_manifest("alfworld")
    root = (dest_root or data_dir()) / "alfworld"
    archive_src = local_source(source) if source is not None else None
    if archive_src is not None and archive_src.stat().st_size > MAX_ARCHIVE_BYTES:
        raise ChecksumError(f"{archive_src}: more than {MAX_ARCHIVE_BYTES} bytes; not a games archive")
    root.mkdir(parents=True, exist_ok=True)
    with folder_lock(root):
        remove_stale(root)
        remove_stale(root / "splits")
        (root / "splits").mkdir(exist_ok=True)
        for name, meta in man["splits"].items():
            if meta.get("url") is None:                # a list that ships with the package
                continue
            dest = root / "splits" / name
            if dest.is_file() and (not verify or sha256_file(dest) == meta["sha256"]):
                continue
            download_url(meta["url"], dest, expected_sha256=meta["sha256"] if verify else None,
                         progress=progress, max_bytes=64 << 20)
        hashes = game_hashes(root)
        digest = games_digest()
        games = root / ALFWORLD_ROOT
        if games.is_dir() and _games_match(games.parent, hashes, verify):
            if read_marker(games, digest) is not None:
                write_marker(games, digest, verify, len(hashes))
            return root
        stage = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
        try:
            if archive_src is None:
                rel = man["release"]
                archive = download_url(rel["url"], stage / Path(rel["url"]).name,
                                       expected_size=rel["size"] if verify else None, progress=progress,
                                       max_bytes=MAX_ARCHIVE_BYTES)
            else:
                archive = archive_src
            staged = stage / "unpacked"
            unpack_alfworld_games(archive, staged, hashes, verify=verify)
            _check_all_there(staged, hashes, archive)
            write_marker(staged / ALFWORLD_ROOT, digest, verify, len(hashes))
            _swap_in(staged / ALFWORLD_ROOT, games)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return root


def _games_match(root: Path, hashes: dict[str, str], verify: bool) -> bool:
    """Whether every game of ``hashes`` is under ``root`` (and, with ``verify``, has its sha256)."""
    for member, want in hashes.items():
        f = root / member
        if not f.is_file() or f.is_symlink() or (verify and sha256_file(f) != want):
            return False
    return True


def build_alfworld_manifest(splits_dir: Path, games_root: Path, out: Path, urls: dict) -> dict:
    """Maintainers' tool: write the ALFWorld manifest from verified local copies.

    ``games_root`` holds ``json_2.1.1/...``; every game named by the split lists is hashed, in
    split-file order (``null`` for a trial absent from the release, which the env then skips). The
    packaged lists (:data:`ALFWORLD_PACKAGED_SPLITS`) are read from the package and get ``url: null``.
    """
    man: dict = {"release": urls["release"], "splits": {}, "games": {}}
    for split, fname in ALFWORLD_SPLIT_FILES.items():
        p = split_file(split, splits_dir.parent) if split in ALFWORLD_PACKAGED_SPLITS else splits_dir / fname
        man["splits"][fname] = {"url": urls["splits"].get(fname), "sha256": sha256_file(p)}
        digests: list[str | None] = []
        with open(p, encoding="utf-8") as f:
            for line in f:
                desc = json.loads(line)["additional_info"]["description"]
                member = games_root / ALFWORLD_ROOT / ALFWORLD_GAME_FOLDERS[split] / desc / "game.tw-pddl"
                digests.append(sha256_file(member) if member.is_file() else None)
        man["games"][split] = digests
    out.write_text(json.dumps(man, indent=1) + "\n")
    return man


