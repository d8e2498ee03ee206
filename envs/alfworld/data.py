"""ALFWorld data: the paper's task lists and the TextWorld games, located, verified and unpacked.

Under the data dir (:func:`crl_bench.data.data_dir`), ``alfworld/`` holds:

* ``splits/train_1466.jsonl`` and ``splits/eval_134.jsonl``: the paper's task lists (one JSON object a
  line; ``additional_info.description`` = ``<task-folder>/<trial>``), from the authors' release
  (pUmpKin-Co/ComplementaryRL, ``roll/pipeline/agentic/env/alfworld/data/``).
* the games: ``json_2.1.1/{train,valid_unseen}/<task-folder>/<trial>/game.tw-pddl``, either unpacked
  in the data dir (what ``crl-bench data download alfworld`` writes, from the ALFWorld 0.4.0 release
  asset ``json_2.1.2_tw-pddl.zip``) or packed as ``json_2.1.1.tar.xz`` (the offline copy in
  ``../shared/data``), which is unpacked once into ``<cache>/alfworld`` on first use.

``crl-bench data download alfworld`` runs :func:`download_alfworld` (declared as the ``alfworld`` entry
point of the ``crl_bench.datasets`` group).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from crl_bench.data import (
    ChecksumError,
    DataMissingError,
    data_dir,
    download_url,
    file_lock,
    load_manifest,
    sha256_file,
)
from crl_bench.llm.default_model import cache_dir

ALFWORLD_SPLIT_FILES = {"train": "train_1466.jsonl", "eval": "eval_134.jsonl"}
ALFWORLD_GAME_FOLDERS = {"train": "train", "eval": "valid_unseen"}
ALFWORLD_ROOT = "json_2.1.1"
ALFWORLD_ARCHIVE = "json_2.1.1.tar.xz"


@dataclass(frozen=True)
class AlfWorldTask:
    """One line of an ALFWorld split list.

    Attributes:
        index: line number in the split file (0-based).
        split: ``"train"`` or ``"eval"``.
        description: ``<task-folder>/<trial>``.
        goal: the task text, e.g. ``"put some creditcard on diningtable."``.
        difficulty: ``"easy"``/``"hard"`` as labelled in the split file.
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


def _missing(what: str, where: Path) -> DataMissingError:
    return DataMissingError(
        f"ALFWorld {what} not found in {where}. Run `crl-bench data download alfworld` (downloads the "
        f"games and task lists into the data dir and verifies them), or point CRL_BENCH_DATA (or the "
        f"env's data_dir) at a folder whose alfworld/ holds splits/{ALFWORLD_SPLIT_FILES['train']}, "
        f"splits/{ALFWORLD_SPLIT_FILES['eval']} and {ALFWORLD_ROOT}/ (or {ALFWORLD_ARCHIVE}).")


def alfworld_tasks(split: str, override: str | os.PathLike | None = None) -> list[AlfWorldTask]:
    """The task list of ``split`` (``"train"``: 1,466 tasks, ``"eval"``: 134), in file order.

    Raises:
        KeyError: unknown split.
        DataMissingError: the split file is absent.
        ChecksumError: the split file differs from the paper's list.
    """
    if split not in ALFWORLD_SPLIT_FILES:
        raise KeyError(f"alfworld: unknown split {split!r}; known: {sorted(ALFWORLD_SPLIT_FILES)}")
    path = alfworld_dir(override) / "splits" / ALFWORLD_SPLIT_FILES[split]
    if not path.is_file():
        raise _missing(f"task list {path.name}", path.parent)
    expected = load_manifest("alfworld")["splits"][ALFWORLD_SPLIT_FILES[split]]["sha256"]
    if sha256_file(path) != expected:
        raise ChecksumError(f"{path}: not the paper's {split} list (sha256 differs from {expected})")
    tasks = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            row = json.loads(line)
            tasks.append(AlfWorldTask(i, split, row["additional_info"]["description"], row["goal"],
                                      row.get("difficulty", "")))
    return tasks


def _game_hashes(splits_root: Path) -> dict[str, str]:
    """``{game member path: sha256}`` of every split game, from the manifest (which lists the hashes
    in split-file order, ``null`` for the trial the release lacks) and the split files under
    ``splits_root/splits``."""
    games = load_manifest("alfworld")["games"]
    out = {}
    for split, fname in ALFWORLD_SPLIT_FILES.items():
        with open(splits_root / "splits" / fname, encoding="utf-8") as f:
            rows = [json.loads(line)["additional_info"]["description"] for line in f]
        if len(rows) != len(games[split]):
            raise ChecksumError(f"{fname}: {len(rows)} tasks, the manifest has {len(games[split])}")
        for desc, digest in zip(rows, games[split]):
            if digest is not None:
                out[f"{ALFWORLD_ROOT}/{ALFWORLD_GAME_FOLDERS[split]}/{desc}/game.tw-pddl"] = digest
    return out


def alfworld_games_root(override: str | os.PathLike | None = None) -> Path:
    """Folder that holds ``json_2.1.1/...`` with every game of both split lists.

    Unpacked games in the data dir are used as they are; otherwise the packed ``json_2.1.1.tar.xz``
    is unpacked (split games only, checksums verified) into ``<cache>/alfworld`` once, under a file
    lock so that concurrent workers wait for one unpacking.

    Raises:
        DataMissingError: neither the unpacked games nor the archive are there.
        ChecksumError: an unpacked game differs from the manifest.
    """
    root = alfworld_dir(override)
    if (root / ALFWORLD_ROOT).is_dir():
        return root
    archive = root / ALFWORLD_ARCHIVE
    if not archive.is_file():
        raise _missing("games", root)
    key = hashlib.sha256(str(archive.resolve()).encode()).hexdigest()[:12]
    target = cache_dir() / "alfworld" / key
    done = target / ".complete"
    if done.is_file():
        return target
    with file_lock(target.parent / f"{key}.lock"):
        if not done.is_file():
            alfworld_tasks("train", override), alfworld_tasks("eval", override)  # verifies the lists
            unpack_alfworld_games(archive, target, _game_hashes(root))
            done.write_text(str(archive.resolve()) + "\n")
    return target


def _verify_member(path: Path, member: str, hashes: dict[str, str]) -> None:
    want = hashes.get(member)
    if want is not None and sha256_file(path) != want:
        raise ChecksumError(f"{member}: sha256 differs from the manifest ({want}); the game files are "
                            f"not the ALFWorld release crl-bench was verified against")


def unpack_alfworld_games(archive: Path, target: Path, hashes: dict[str, str],
                          verify: bool = True) -> int:
    """Unpack the split games of ``archive`` (``.tar.xz``/``.tar.gz`` or ``.zip``) into ``target``,
    verifying each against ``hashes`` (``{member: sha256}``, see :func:`_game_hashes`) unless
    ``verify`` is off. Returns the number of games written.

    Raises:
        ChecksumError: a game differs from the manifest.
        DataMissingError: none of the wanted games is in the archive.
    """
    wanted = set(hashes)
    target.mkdir(parents=True, exist_ok=True)
    written = 0

    def write(member: str, read: Callable[[], bytes]) -> None:
        nonlocal written
        dest = target / member
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(".part")
        tmp.write_bytes(read())
        if verify:
            _verify_member(tmp, member, hashes)
        os.replace(tmp, dest)
        written += 1

    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if name in wanted:
                    write(name, lambda n=name: zf.read(n))
    else:
        with tarfile.open(archive, "r:*") as tf:
            for info in tf:
                if info.isfile() and info.name in wanted:
                    f = tf.extractfile(info)
                    assert f is not None
                    write(info.name, f.read)
    if written == 0:
        raise DataMissingError(f"{archive}: none of the {len(wanted)} ALFWorld split games is in it")
    return written


def download_alfworld(dest_root: Path | None = None, source: str | None = None, progress: bool = True,
                      verify: bool = True) -> Path:
    """``crl-bench data download alfworld``: the task lists and the split games into the data dir.

    Args:
        dest_root: the data dir (default :func:`data_dir`); files go to ``<dest_root>/alfworld``.
        source: a local archive (zip or tar) of the games to use instead of downloading the release
            asset, e.g. ``json_2.1.1.tar.xz``.
        verify: check sizes and sha256 against the manifest (off only for a trusted mirror whose
            archive differs byte-wise).

    Returns the ``alfworld`` folder.

    Raises:
        ChecksumError: a file does not match the manifest (nothing unverified is left in place).
        urllib.error.URLError: a source cannot be reached.
    """
    man = load_manifest("alfworld")
    root = (dest_root or data_dir()) / "alfworld"
    (root / "splits").mkdir(parents=True, exist_ok=True)
    for name, meta in man["splits"].items():
        dest = root / "splits" / name
        if dest.is_file() and (not verify or sha256_file(dest) == meta["sha256"]):
            continue
        download_url(meta["url"], dest, expected_sha256=meta["sha256"] if verify else None, progress=progress)
    hashes = _game_hashes(root)
    games = root / ALFWORLD_ROOT
    if games.is_dir() and all((root / m).is_file() for m in hashes):
        return root
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        if source is None:
            rel = man["release"]
            archive = download_url(rel["url"], Path(tmp) / Path(rel["url"]).name,
                                   expected_size=rel["size"] if verify else None, progress=progress)
        else:
            archive = Path(source)
        staged = Path(tmp) / "staged"
        unpack_alfworld_games(archive, staged, hashes, verify=verify)
        missing = [m for m in hashes if not (staged / m).is_file()]
        if missing and verify:
            raise ChecksumError(f"{archive}: {len(missing)} split games missing, e.g. {missing[0]}")
        shutil.copytree(staged / ALFWORLD_ROOT, games, dirs_exist_ok=True)
    return root


def build_alfworld_manifest(splits_dir: Path, games_root: Path, out: Path, urls: dict) -> dict:
    """Maintainers' tool: write the ALFWorld manifest from verified local copies.

    ``games_root`` holds ``json_2.1.1/...``; every game named by the split lists is hashed, in
    split-file order (``null`` for a trial absent from the release, which the env then skips).
    """
    man: dict = {"release": urls["release"], "splits": {}, "games": {}}
    for split, fname in ALFWORLD_SPLIT_FILES.items():
        p = splits_dir / fname
        man["splits"][fname] = {"url": urls["splits"][fname], "sha256": sha256_file(p)}
        digests: list[str | None] = []
        with open(p, encoding="utf-8") as f:
            for line in f:
                desc = json.loads(line)["additional_info"]["description"]
                member = games_root / ALFWORLD_ROOT / ALFWORLD_GAME_FOLDERS[split] / desc / "game.tw-pddl"
                digests.append(sha256_file(member) if member.is_file() else None)
        man["games"][split] = digests
    out.write_text(json.dumps(man, indent=1) + "\n")
    return man


