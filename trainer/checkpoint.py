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
        meta.json          step, format, the byte length of metrics.jsonl and episodes.jsonl when the
                           checkpoint was taken; written last

**Atomic.** A checkpoint is written into ``checkpoints/.step-000004.tmp``; every file is fsynced,
then the folder is renamed to ``step-000004`` and the parent folder fsynced. Only folders named
``step-<N>`` holding a ``meta.json`` whose step is ``N`` are ever loaded, so a kill at any moment
leaves either the previous checkpoint or the new one, never a torn one (leftover ``.tmp`` folders
are removed by the next save or resume).

**What a resume restores.** :func:`restore_run_files` cuts metrics.jsonl and episodes.jsonl back to
their length at the checkpoint (no duplicate or torn line survives: the lines of the step that was
cut short are written again by its replay) and puts the checkpoint's bank copy in place of
``experience.sqlite``; the SQLite file is the bank's source of truth and the FAISS index is rebuilt
from its stored embeddings when the bank opens. Bank writes made after the checkpoint (the
distillation of the step the kill cut short) are rolled back with it and made again by the replay,
so every entry the checkpoint acknowledged is in the bank exactly once and none is written twice.
:func:`load_checkpoint` then loads weights, optimisers, generators and counters into a freshly built
:class:`~crl_bench.trainer.loop.Trainer`. On the CPU with the same seed, the resumed run's next step
equals the uninterrupted run's (tests/test_resume.py); a checkpoint clears the engines' prefix
stores (a cache of the same weights: outputs are unchanged, their float rounding can differ), so both
runs continue from the same state.

Checkpoint files are Python pickles (``torch.save``): load only checkpoints your own runs wrote.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = 1
"""Checkpoint layout version, stored in meta.json; a resume refuses another."""

CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded into this run (other format, other model, other method)."""


def checkpoint_name(step: int) -> str:
    """``step-000004`` for step 4 (names sort by step)."""
    return f"step-{int(step):06d}"


def read_meta(path: Path) -> dict[str, Any] | None:
    """meta.json of a complete checkpoint folder, or ``None`` when the folder is not one (no or a
    torn meta.json, or its step does not match the folder name)."""
    m = _NAME.match(path.name)
    if m is None or not path.is_dir():
        return None
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("step") != int(m.group(1)):
        return None
    return meta


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run folder, oldest first (:func:`read_meta` accepts them)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(read_meta(p), p) for p in root.iterdir()]
    return [p for meta, p in sorted(((m, p) for m, p in found if m is not None), key=lambda x: x[0]["step"])]


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


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of the parameters that train (all of them for full fine-tuning, the
    adapters with LoRA); tied weights appear once (``named_parameters``)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable(model: Any, state: dict[str, torch.Tensor], what: str) -> None:
    """Copy :func:`trainable_state` output into ``model`` in place (dtype and device of ``model``).

    Raises:
        CheckpointError: names or shapes differ (``what`` names the model in the message).
    """
    params = dict(model.named_parameters())
    want = {n for n, p in params.items() if p.requires_grad}
    missing, unexpected = sorted(want - set(state)), sorted(set(state) - want)
    if missing or unexpected:
        raise CheckpointError(f"{what} checkpoint does not fit this model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]} (another model or LoRA setting?)")
    with torch.no_grad():
        for n, t in state.items():
            if params[n].shape != t.shape:
                raise CheckpointError(f"{what} checkpoint: {n} has shape {tuple(t.shape)}, "
                                      f"the model {tuple(params[n].shape)}")
            params[n].copy_(t)


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


def save_checkpoint(trainer: Any, run_dir: str | Path, keep: int = 2) -> Path:
    """Write one checkpoint of ``trainer`` (a :class:`~crl_bench.trainer.loop.Trainer` between
    steps) into ``run_dir/checkpoints/step-<N>`` atomically, then delete all but the newest ``keep``.

    Waits for queued distillation first (the bank copy and the extraction buffers then agree) and
    clears the engines' prefix stores (module docstring). Returns the checkpoint folder.

    Raises:
        OSError: the disk is full or not writable, naming the folder and the free space (torch's
            own error, a RuntimeError for a full disk, is chained); the temporary folder is removed
            and earlier checkpoints stay.
    """
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    root.mkdir(exist_ok=True)
    for stale in root.glob(".step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    step = int(trainer.step)
    final = root / checkpoint_name(step)
    tmp = root / f".{checkpoint_name(step)}.tmp"
    tmp.mkdir()
    try:
        track = trainer.experience
        if track is not None:
            track.flush()
        trainer.clear_prefix_stores()
        torch.save(trainable_state(trainer.model), tmp / "actor.pt")
        torch.save(trainer.state_dict(), tmp / "trainer.pt")
        if track is not None:
            if track.updater is not None:
                torch.save(trainable_state(track.model), tmp / "extractor.pt")
            torch.save(track.state_dict(), tmp / "experience.pt")
            track.save_bank(tmp / "experience.sqlite")
        meta = {"format": FORMAT, "step": step, "method": trainer.cfg.method, "model": trainer.cfg.model.name,
                "metrics_bytes": _size(run_dir / "metrics.jsonl"), "episodes_bytes": _size(run_dir / "episodes.jsonl"),
                "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
        if final.exists():                  # a checkpoint of this step from before a resume
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(root)
    except (OSError, RuntimeError) as exc:   # torch.save reports a full disk as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(root).free / 2**30
        raise OSError(f"could not write the checkpoint {final} ({free:.1f} GiB free on that disk; "
                      f"earlier checkpoints are kept): {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-max(1, int(keep))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def restore_run_files(run_dir: str | Path, checkpoint: Path | None, has_bank: bool) -> None:
    """Put a run folder's files back to how they were when ``checkpoint`` was taken, before the
    trainer is built: metrics.jsonl and episodes.jsonl cut to the checkpoint's lengths and the bank
    replaced by the checkpoint's copy (``has_bank``: the method keeps one). With ``checkpoint=None``
    (killed before its first checkpoint) the run starts over: both files emptied, the bank removed.

    Raises:
        CheckpointError: the checkpoint's format is not :data:`FORMAT`, or a file is shorter than
            the checkpoint says (the folder was edited by hand).
    """
    run_dir = Path(run_dir)
    meta = read_meta(checkpoint) if checkpoint is not None else {"metrics_bytes": 0, "episodes_bytes": 0}
    if meta is None:
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint")
    if checkpoint is not None and meta.get("format") != FORMAT:
        raise CheckpointError(f"{checkpoint} has format {meta.get('format')}, this version reads {FORMAT}")
    for name, key in (("metrics.jsonl", "metrics_bytes"), ("episodes.jsonl", "episodes_bytes")):
        path, length = run_dir / name, int(meta[key])
        if _size(path) < length:
            raise CheckpointError(f"{path} is shorter ({_size(path)} bytes) than at {checkpoint} ({length})")
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


def load_checkpoint(trainer: Any, checkpoint: Path) -> dict[str, Any]:
    """Load ``checkpoint`` into a freshly built ``trainer`` of the same run (after
    :func:`restore_run_files`): actor and extractor weights, both optimisers, the scheduler, every
    generator, the task sampler, the step counter, the next step's episodes and the experience
    track's buffers. Returns the checkpoint's meta.json.

    Raises:
        CheckpointError: the checkpoint is of another method or model, or its weights do not fit.
    """
    meta = read_meta(checkpoint)
    if meta is None:
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint")
    if meta.get("method") != trainer.cfg.method:
        raise CheckpointError(f"{checkpoint} was written by method {meta.get('method')!r}, "
                              f"this run is {trainer.cfg.method!r}")
    load_trainable(trainer.model, torch.load(checkpoint / "actor.pt", map_location="cpu", weights_only=True),
                   "actor")
    trainer.load_state_dict(torch.load(checkpoint / "trainer.pt", map_location="cpu", weights_only=False))
    track = trainer.experience
    if track is not None:
        if track.updater is not None:
            load_trainable(track.model, torch.load(checkpoint / "extractor.pt", map_location="cpu",
                                                   weights_only=True), "extractor")
        track.load_state_dict(torch.load(checkpoint / "experience.pt", map_location="cpu", weights_only=False))
    return meta
