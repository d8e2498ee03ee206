"""Training checkpoints, and resuming a run that was killed (``crl-bench run --resume RUN_DIR``).

Every ``train.checkpoint_every`` steps, after the final step, and after the step-0 evaluation
(``eval.at_start``), the trainer writes one checkpoint into the run folder and keeps the last
``train.keep_checkpoints`` of them::

    checkpoints/step-000004/
        actor.pt           the actor's trainable parameters (float32 master weights; LoRA: the adapters)
        trainer.pt         AdamW state, lr scheduler, the update's shuffling generator, the task
                           sampler's generator, the next step's already-drawn episodes, the step counter,
                           and the Python, NumPy and torch (CPU and CUDA) generator states
        extractor.pt       the extractor's trainable parameters (methods that train it)
        experience.pt      the experience track (ExperienceTrack.state_dict): extractions waiting for
                           reward, credited extractions waiting for the CISPO update, the CISPO
                           optimiser, the retriever's generators, the manager's counters
        experience.sqlite  a copy of the bank (SQLite's online backup; methods with a bank)
        meta.json          step, format, method, model, the byte length of metrics.jsonl and
                           episodes.jsonl when the checkpoint was taken, the size and sha256 of every
                           other file, and the sha256 of the run's config.yaml; written last

**Atomic.** A checkpoint is written into ``checkpoints/.step-000004.tmp``; every file is fsynced,
then the folder is renamed to ``step-000004`` and the parent folder fsynced. A kill at any moment
leaves either the previous checkpoint or the new one (leftover ``.tmp`` folders are removed by the
next save or resume).

**Verified before use.** :func:`verify_checkpoint` accepts a folder only when its meta.json parses,
names the folder's step and a readable format, and every file it lists has the recorded size and
sha256; :func:`read_checkpoint` then deserialises the files into memory. A resume
(:func:`select_checkpoint`, used by ``trainer/loop.py``'s ``resume_training``) tries the checkpoints
newest first and falls back to the previous complete one, naming why each newer one was skipped;
nothing in the run folder changes until one of them has been read this way.

**What a resume restores.** :func:`restore_run_files` cuts metrics.jsonl and episodes.jsonl back to
their length at the checkpoint (no duplicate or torn line survives: the lines of the step that was
cut short are written again by its replay) and puts the checkpoint's bank copy in place of
``experience.sqlite``; the SQLite file is the bank's source of truth and the FAISS index is rebuilt
from its stored embeddings when the bank opens. Bank writes made after the checkpoint (the
distillation of the step the kill cut short) are rolled back with it and made again by the replay,
so every entry the checkpoint acknowledged is in the bank exactly once and none is written twice.
:func:`apply_checkpoint` then loads weights, optimisers, generators and counters into a freshly built
:class:`~crl_bench.trainer.loop.Trainer`. On the CPU with the same seed, the resumed run's next step
equals the uninterrupted run's (tests/trainer/test_resume.py); a checkpoint clears the engines' prefix
stores (a cache of the same weights: outputs are unchanged, their float rounding can differ), so both
runs continue from the same state.

**Loaded without code.** Every ``.pt`` file holds only tensors and plain data (``trainer.pt`` and
``experience.pt`` go through :func:`crl_bench.trainer.plain_state.encode`: dataclasses, NumPy arrays
and sets become tagged plain dicts) and every one is read with ``torch.load(weights_only=True)``, torch's
allow-list unpickler, so a crafted checkpoint cannot make a resume import or call anything; the
dataclasses are rebuilt by :func:`~crl_bench.trainer.plain_state.decode`, which knows only
``crl_bench``'s own.  Checkpoints of formats 1 and 2 (older versions) pickled Python objects and are
refused with a message saying so (resume them with the version that wrote them, or ``--start-over``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crl_bench.data import sha256_file
from crl_bench.llm.weights import WeightsMismatchError, load_trainable, trainable_state
from crl_bench.results.run_folder import StorageError
from crl_bench.trainer.plain_state import PlainStateError, decode, encode

FORMAT = 3
"""Checkpoint layout version written to meta.json (2: with the size and sha256 of every file; 3: the
state files hold plain data only, read with ``weights_only=True``)."""

READABLE_FORMATS = (3,)
"""Formats a resume reads.  Formats 1 and 2 pickled Python objects (loading them could run code)."""

PICKLED_FORMATS = (1, 2)
"""Formats of older versions, refused with a message naming the version change."""

CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"^step-(\d+)$")


_PLAIN = ("trainer", "experience")
"""State files written through :func:`~crl_bench.trainer.plain_state.encode` (the others hold tensors)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded into this run (other format, other model, other method)."""


def _check_format(path: Path, meta: dict[str, Any]) -> None:
    fmt = meta.get("format")
    if fmt in PICKLED_FORMATS:
        raise CheckpointError(f"{path} was written by an older crl-bench (checkpoint format {fmt}, which stores "
                              f"pickled Python objects); this version reads format {FORMAT} only, loaded "
                              f"without running code: resume it with the version that wrote it, or start over")
    if fmt not in READABLE_FORMATS:
        raise CheckpointError(f"{path} has format {fmt!r}, this version reads "
                              f"{', '.join(map(str, READABLE_FORMATS))}")


def checkpoint_name(step: int) -> str:
    """``step-000004`` for step 4 (names sort by step)."""
    return f"step-{int(step):06d}"


def read_meta(path: Path) -> dict[str, Any] | None:
    """meta.json of a checkpoint folder, or ``None`` when the folder is not one (no or a torn
    meta.json, or its step does not match the folder name). The files are not checked here
    (:func:`verify_checkpoint` does)."""
    try:
        return _meta(path)
    except CheckpointError:
        return None


def _meta(path: Path) -> dict[str, Any]:
    m = _NAME.match(path.name)
    if m is None or not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint folder (step-<N>)")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no meta.json (a save that did not finish?)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/meta.json cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("step") != int(m.group(1)):
        step = meta.get("step") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}/meta.json names step {step!r}, not the folder's {int(m.group(1))}")
    return meta


def checkpoint_folders(run_dir: str | Path) -> list[Path]:
    """Every ``checkpoints/step-<N>`` folder of a run, complete or not, newest (highest N) first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def config_sha256(run_dir: str | Path) -> str | None:
    """sha256 of a run folder's config.yaml as data (the parsed mapping, keys sorted, as JSON), so a
    re-saved file with the same settings has the same hash; ``None`` when there is no config.yaml.

    Raises:
        CheckpointError: config.yaml exists but is not valid YAML.
    """
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check a checkpoint folder without loading it: meta.json parses and names the folder's step and
    a format of :data:`READABLE_FORMATS`; every file it lists is there with the recorded size and
    sha256. Returns meta.json.

    Raises:
        CheckpointError: saying what is wrong (the file, the size or hash found and expected; an
            older version's pickled format, :data:`PICKLED_FORMATS`).
    """
    meta = _meta(path)
    _check_format(path, meta)
    files = meta.get("files")
    if not isinstance(files, dict) or "actor.pt" not in files:
        raise CheckpointError(f"{path}/meta.json lists no files")
    for name, want in files.items():
        f = path / name
        if not isinstance(name, str) or "/" in name or name.startswith(".") or not f.is_file() or f.is_symlink():
            raise CheckpointError(f"{f} is missing (or not a plain file)")
        if not isinstance(want, dict):
            raise CheckpointError(f"{path}/meta.json records no size and sha256 for {name}")
        size = f.stat().st_size
        if size != want.get("bytes"):
            raise CheckpointError(f"{f} has {size} bytes, {want.get('bytes')} when it was saved (truncated?)")
        if sha256_file(f) != want.get("sha256"):
            raise CheckpointError(f"{f} does not match the sha256 recorded when it was saved (corrupted)")
    return meta


@dataclass
class LoadedCheckpoint:
    """A checkpoint read into memory by :func:`read_checkpoint`: its folder, meta.json and the
    deserialised ``actor``, ``trainer`` and (when saved) ``extractor`` and ``experience`` states."""

    path: Path
    meta: dict[str, Any]
    states: dict[str, Any] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def read_checkpoint(path: Path, method: str | None = None, model: str | None = None) -> LoadedCheckpoint:
    """:func:`verify_checkpoint`, then check it is of ``method`` and ``model`` (when given) and
    deserialise every state file (``torch.load`` on the CPU, memory-mapped copy-on-write: the
    tensors are read from the page cache when applied, the file is never written). Reads only.

    Raises:
        CheckpointError: not a complete, verified checkpoint, of another method or model, or a file
            that does not deserialise (the file and torch's reason are named).
    """
    meta = verify_checkpoint(path)
    if method is not None and meta.get("method") != method:
        raise CheckpointError(f"{path} was written by method {meta.get('method')!r}, this run is {method!r}")
    if model is not None and meta.get("model") not in (None, model):
        raise CheckpointError(f"{path} was written for model {meta.get('model')!r}, this run uses {model!r}")
    states: dict[str, Any] = {}
    for key in ("actor", "trainer", "extractor", "experience"):
        f = path / f"{key}.pt"
        if not f.is_file():
            continue
        try:
            # weights_only: torch's allow-list unpickler (tensors and plain containers), so the file
            # cannot name a callable to run; memory-mapped (copy-on-write): the states cost page
            # cache, not a second copy in RAM, while the trainer is built
            raw = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - torch reports torn zips and refused pickles in many types
            lines = [ln.strip() for ln in str(e).splitlines()] or [""]
            # a refused pickle: torch's own reason is its "WeightsUnpickler error: ..." line
            why = next((ln.split(":", 1)[1].strip().split(". ")[0] for ln in lines
                        if ln.startswith("WeightsUnpickler error")), lines[0])[:200]
            raise CheckpointError(f"{f} cannot be loaded as plain data, refused ({type(e).__name__}: "
                                  f"{why})") from None
        try:
            states[key] = decode(raw) if key in _PLAIN else raw
        except PlainStateError as e:
            raise CheckpointError(f"{f}: {e}") from None
    if "experience" in states and not (path / "experience.sqlite").is_file():
        raise CheckpointError(f"{path} has experience.pt but no experience.sqlite")
    return LoadedCheckpoint(path, meta, states)


def select_checkpoint(run_dir: str | Path, method: str | None = None, model: str | None = None
                      ) -> tuple[LoadedCheckpoint | None, list[tuple[Path, str]]]:
    """The newest checkpoint of a run folder that :func:`read_checkpoint` accepts and whose logs
    (:func:`check_logs`) are intact, and every newer folder it skipped with the reason.
    ``(None, skipped)`` when none is usable (``skipped`` is empty when there are no checkpoint
    folders at all). Reads only.
    """
    skipped: list[tuple[Path, str]] = []
    for folder in checkpoint_folders(run_dir):
        try:
            loaded = read_checkpoint(folder, method, model)
            check_logs(Path(run_dir), loaded.meta, folder)
            return loaded, skipped
        except CheckpointError as e:
            skipped.append((folder, str(e)))
    return None, skipped


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run folder, oldest first (:func:`read_meta` accepts them)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return [p for p in reversed(checkpoint_folders(run_dir)) if read_meta(p) is not None]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run folder, or ``None``."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_states() -> dict[str, Any]:
    """The global generators: Python ``random``, NumPy's legacy global, torch CPU and every CUDA device."""
    out: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                           "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore :func:`rng_states` (CUDA states only when both the checkpoint and this machine have them)."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def needed_bytes(trainer: Any, run_dir: str | Path) -> int:
    """About how many bytes the next checkpoint of ``trainer`` takes: the size of the run's newest
    checkpoint when there is one, else 12 bytes per trainable parameter of the actor (and of the
    extractor when it trains: float32 weights and AdamW's two moments) plus the bank file, plus 1 MiB
    for the small state files."""
    last = latest_checkpoint(run_dir)
    if last is not None:
        return sum(f.stat().st_size for f in last.iterdir() if f.is_file())
    models = [trainer.model]
    track = getattr(trainer, "experience", None)
    if track is not None and track.updater is not None:
        models.append(track.model)
    params = sum(p.numel() for m in models for p in m.parameters() if p.requires_grad)
    return 12 * params + _size(Path(run_dir) / "experience.sqlite") + (1 << 20)


def save_checkpoint(trainer: Any, run_dir: str | Path, keep: int = 2) -> Path:
    """Write one checkpoint of ``trainer`` (a :class:`~crl_bench.trainer.loop.Trainer` between
    steps) into ``run_dir/checkpoints/step-<N>`` atomically, then delete all but the newest ``keep``.

    Waits for queued distillation first (the bank copy and the extraction buffers then agree) and
    clears the engines' prefix stores (module docstring). Returns the checkpoint folder.

    Raises:
        StorageError: (an OSError) the disk has less free space than :func:`needed_bytes` (checked
            before anything is written; the message gives both numbers), or is full or not writable,
            naming the folder and the free space (torch's own error, a RuntimeError for a full disk,
            is chained); the temporary folder is removed and earlier checkpoints stay.
    """
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    root.mkdir(exist_ok=True)
    for stale in [*root.glob(".step-*.tmp"), *root.glob(".step-*.old")]:
        shutil.rmtree(stale, ignore_errors=True)
    step = int(trainer.step)
    final = root / checkpoint_name(step)
    need, free = needed_bytes(trainer, run_dir), shutil.disk_usage(root).free
    if free < need:
        raise StorageError(f"not enough free space for the checkpoint {final}: about {need} bytes needed, "
                           f"{free} free on that disk; free some space (earlier checkpoints are kept)")
    tmp = root / f".{checkpoint_name(step)}.tmp"
    tmp.mkdir()
    try:
        track = trainer.experience
        if track is not None:
            track.flush()
        trainer.clear_prefix_stores()
        trainer.refresh_models()
        torch.save(trainable_state(trainer.model), tmp / "actor.pt")
        torch.save(encode(trainer.state_dict()), tmp / "trainer.pt")
        if track is not None:
            if track.updater is not None:
                torch.save(trainable_state(track.model), tmp / "extractor.pt")
            torch.save(encode(track.state_dict()), tmp / "experience.pt")
            track.save_bank(tmp / "experience.sqlite")
        for f in tmp.iterdir():
            _fsync_file(f)
        files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(tmp.iterdir())}
        meta = {"format": FORMAT, "step": step, "method": trainer.cfg.method, "model": trainer.cfg.model.name,
                "metrics_bytes": _size(run_dir / "metrics.jsonl"), "episodes_bytes": _size(run_dir / "episodes.jsonl"),
                "config_sha256": config_sha256(run_dir), "files": files,
                "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        _fsync_file(tmp / "meta.json")
        _fsync_dir(tmp)
        old = root / f".{checkpoint_name(step)}.old"
        if final.exists():                  # a checkpoint of this step from before a resume: moved
            shutil.rmtree(old, ignore_errors=True)      # aside first, so one of the two is always there
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError) as exc:   # torch.save reports a full disk as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(root).free / 2**30
        raise StorageError(f"could not write the checkpoint {final} ({free:.1f} GiB free on that disk; "
                           f"earlier checkpoints are kept): {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-max(1, int(keep))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def check_logs(run_dir: Path, meta: dict[str, Any], checkpoint: Path | None = None) -> None:
    """Check that metrics.jsonl and episodes.jsonl are at least as long as when the checkpoint with
    ``meta`` was taken (they only grow between checkpoints).

    Raises:
        CheckpointError: a log is shorter (edited or truncated by hand), or meta.json has no lengths.
    """
    for name, key in (("metrics.jsonl", "metrics_bytes"), ("episodes.jsonl", "episodes_bytes")):
        path = Path(run_dir) / name
        try:
            length = int(meta[key])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{checkpoint}/meta.json has no valid {key}") from None
        if _size(path) < length:
            raise CheckpointError(f"{path} is shorter ({_size(path)} bytes) than at {checkpoint} ({length})")


def restore_run_files(run_dir: str | Path, checkpoint: Path | None, has_bank: bool) -> None:
    """Put a run folder's files back to how they were when ``checkpoint`` was taken, before the
    trainer is built: metrics.jsonl and episodes.jsonl cut to the checkpoint's lengths and the bank
    replaced by the checkpoint's copy (``has_bank``: the method keeps one). With ``checkpoint=None``
    (killed before its first checkpoint) the run starts over: both files emptied, the bank removed.

    Raises:
        CheckpointError: the checkpoint's meta.json is unreadable or of a format not in
            :data:`READABLE_FORMATS`, or a log is shorter than the checkpoint says (the folder was
            edited by hand); nothing is changed then.
    """
    run_dir = Path(run_dir)
    meta = _meta(checkpoint) if checkpoint is not None else {"metrics_bytes": 0, "episodes_bytes": 0}
    if checkpoint is not None:
        _check_format(checkpoint, meta)
    check_logs(run_dir, meta, checkpoint)
    for name, key in (("metrics.jsonl", "metrics_bytes"), ("episodes.jsonl", "episodes_bytes")):
        path, length = run_dir / name, int(meta[key])
        if path.is_file():
            with open(path, "r+b") as f:
                f.truncate(length)
                f.flush()
                os.fsync(f.fileno())
    bank = run_dir / "experience.sqlite"
    for p in (bank, bank.with_name(bank.name + "-wal"), bank.with_name(bank.name + "-shm")):
        p.unlink(missing_ok=True)
    if has_bank and checkpoint is not None:
        shutil.copyfile(checkpoint / "experience.sqlite", bank)


def apply_checkpoint(trainer: Any, loaded: LoadedCheckpoint) -> dict[str, Any]:
    """Load a :class:`LoadedCheckpoint` into a freshly built ``trainer`` of the same run (after
    :func:`restore_run_files`): actor and extractor weights, both optimisers, the scheduler, every
    generator, the task sampler, the step counter, the next step's episodes and the experience
    track's buffers. Returns the checkpoint's meta.json.

    Raises:
        CheckpointError: the checkpoint is of another method, lacks a state file or a key this trainer
            needs (the message names the file and the key), or its weights do not fit.
    """
    path, states = loaded.path, loaded.states
    if loaded.meta.get("method") != trainer.cfg.method:
        raise CheckpointError(f"{path} was written by method {loaded.meta.get('method')!r}, "
                              f"this run is {trainer.cfg.method!r}")
    track = trainer.experience
    need = ["actor", "trainer"] + (["experience"] if track is not None else []) \
        + (["extractor"] if track is not None and track.updater is not None else [])
    missing = [f"{k}.pt" for k in need if k not in states]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}")
    try:
        load_trainable(trainer.model, states["actor"], "actor")
        if track is not None and track.updater is not None:
            load_trainable(track.model, states["extractor"], "extractor")
    except WeightsMismatchError as e:
        raise CheckpointError(f"{path}: {e}") from None
    for key, target in (("trainer", trainer), ("experience", track)):
        if target is None:
            continue
        try:
            target.load_state_dict(states[key])
        except KeyError as e:
            raise CheckpointError(f"{path}/{key}.pt lacks the state {e.args[0]!r} this run needs "
                                  f"(an edited or foreign checkpoint)") from None
        except (TypeError, ValueError, IndexError, AttributeError) as e:
            raise CheckpointError(f"{path}/{key}.pt holds a state this run cannot use "
                                  f"({type(e).__name__}: {str(e)[:200]})") from None
    return loaded.meta


def load_checkpoint(trainer: Any, checkpoint: Path) -> dict[str, Any]:
    """:func:`read_checkpoint` then :func:`apply_checkpoint` into ``trainer`` (after
    :func:`restore_run_files`). Returns the checkpoint's meta.json.

    Raises:
        CheckpointError: as those two functions.
    """
    return apply_checkpoint(trainer, read_checkpoint(checkpoint, trainer.cfg.method))
