"""``crl-bench bench checkpoint-io``: what a resumable checkpoint costs on this machine's disk, extrapolated to
the paper's models.

Two measurements, side by side in one run:

* **the law**: the bytes a checkpoint writes per trainable parameter. A small model of the actor's
  architecture (Qwen2.5-7B-shaped, narrowed; random weights) takes one AdamW step and its trainable weights
  and optimiser state are saved as trainer/checkpoint.py saves them (``torch.save`` of
  :func:`~crl_bench.llm.weights.trainable_state` and of the optimiser's ``state_dict``); the law is
  :data:`BYTES_PER_PARAM` (float32 weights and AdamW's two float32 moments), which ``needed_bytes`` and the
  docs count, within :data:`LAW_TOLERANCE`;
* **the disk**: ``--gib`` GiB of float32 tensors written the way a checkpoint writes them (``torch.save``,
  then ``fsync``), hashed the way it records and verifies them (:func:`crl_bench.data.sha256_file`), and read
  back the way a resume reads them (``torch.load``); each in GB/s. The page cache is not dropped (that needs
  root): a read right after the write may come from memory, so the read rate is an upper bound.

The extrapolation: a checkpoint of the paper's actor and extractor (Qwen2.5-7B and Qwen3-4B shapes,
:data:`~crl_bench.bench.update_peak.SHAPES`) at the law's bytes per parameter, minutes to save (write and
hash) and to resume (hash and read), and the checkpoints and terabytes of a ``paper``-preset run (its
``train.steps``, ``train.checkpoint_every``, the step-0 checkpoint after the first evaluation).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["BYTES_PER_PARAM", "HELP", "LAW_TOLERANCE", "add_parser", "bench_checkpoint_io", "checkpoints_per_run",
           "format_checkpoint_io", "run"]

HELP = "a checkpoint's bytes per parameter and this disk's save/resume rates"

#: bytes a checkpoint holds per trainable parameter: float32 weight + AdamW's exp_avg and exp_avg_sq
BYTES_PER_PARAM = 12
#: relative tolerance of the law (the files' own headers and the optimiser's step counters)
LAW_TOLERANCE = 0.01


def checkpoints_per_run(steps: int, every: int, at_start: bool = True) -> int:
    """Checkpoints a run of ``steps`` writes with ``train.checkpoint_every`` = ``every`` (trainer/lifecycle.py):
    one after the step-0 evaluation (``eval.at_start``), one every ``every`` steps, one after the last step when
    ``every`` does not divide ``steps``; 0 when ``every`` is 0."""
    if every <= 0:
        return 0
    return int(at_start) + steps // every + (1 if steps % every else 0)


def _law(layers: int, hidden: int, dir_: Path) -> dict[str, float]:
    """Bytes per trainable parameter of a checkpoint of a narrowed Qwen2.5-7B-shaped model after one AdamW step."""
    import torch
    from transformers import AutoModelForCausalLM

    from crl_bench.bench.update_peak import shape_config
    from crl_bench.llm.weights import trainable_state

    cfg = shape_config("qwen2.5-7b", layers, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=8192)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    torch.save(trainable_state(model), dir_ / "actor.pt")
    torch.save(opt.state_dict(), dir_ / "optimizer.pt")
    written = sum((dir_ / f).stat().st_size for f in ("actor.pt", "optimizer.pt"))
    return {"law_params": params, "law_bytes": written, "bytes_per_param": written / params}


def bench_checkpoint_io(gib: float = 1.0, dir: str | None = None, steps: int = 512, every: int = 100,
                        law_layers: int = 2, law_hidden: int = 256) -> dict[str, Any]:
    """Measure the law and the disk (module docstring) and extrapolate.

    Args:
        gib: GiB of float32 tensors for the disk rates (written in tensors of at most 256 MiB).
        dir: where to write (a temporary folder inside it, removed after); default the system's temporary folder.
            Point it at the disk runs write to.
        steps, every: the run the extrapolation counts checkpoints for (default: the ``paper`` preset's).
        law_layers, law_hidden: the narrowed model of the law.

    Returns:
        dict with ``bytes_per_param`` (and ``law_params`` / ``law_bytes``), ``law_ok``, ``write_gbs`` (torch.save
        and fsync), ``hash_gbs`` (sha256), ``read_gbs`` (torch.load), ``paper_params`` (actor + extractor),
        ``checkpoint_gb``, ``save_min`` (write + hash), ``resume_min`` (hash + read), ``checkpoints``, ``run_tb``,
        and the settings.

    Raises:
        ValueError: ``gib`` not positive.
        OSError: the folder cannot be written (or the disk is full).
    """
    import torch

    from crl_bench.bench.update_peak import shape_config
    from crl_bench.data import sha256_file
    from crl_bench.trainer.memory_plan import ModelShape

    if not gib > 0:
        raise ValueError(f"gib must be positive, got {gib!r}")
    with tempfile.TemporaryDirectory(prefix="crl-checkpoint-io-", dir=dir) as tmp:
        root = Path(tmp)
        law = _law(law_layers, law_hidden, root)
        total = max(1, int(gib * 2**30 / 4))            # float32 elements, in tensors of at most 256 MiB
        chunk = min(total, 64 * 2**20)
        state = {f"t{i}": torch.rand(chunk) for i in range(max(1, total // chunk))}
        path = root / "state.pt"
        t0 = time.perf_counter()
        torch.save(state, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        t1 = time.perf_counter()
        sha256_file(path)
        t2 = time.perf_counter()
        back = torch.load(path, weights_only=True)
        t3 = time.perf_counter()
        size = path.stat().st_size
        if not torch.equal(back["t0"], state["t0"]):
            raise RuntimeError(f"{path} read back other data than was written")
        del state, back
    paper = sum(ModelShape.from_config(shape_config(s), s).params for s in ("qwen2.5-7b", "qwen3-4b"))
    ckpt = BYTES_PER_PARAM * paper
    write, hashing, read = size / (t1 - t0), size / (t2 - t1), size / (t3 - t2)
    count = checkpoints_per_run(steps, every)
    return {**law, "law_ok": abs(law["bytes_per_param"] / BYTES_PER_PARAM - 1) <= LAW_TOLERANCE,
            "bytes": size, "write_gbs": write / 1e9, "hash_gbs": hashing / 1e9, "read_gbs": read / 1e9,
            "paper_params": paper, "checkpoint_gb": ckpt / 1e9, "save_min": (ckpt / write + ckpt / hashing) / 60,
            "resume_min": (ckpt / hashing + ckpt / read) / 60, "steps": steps, "every": every, "checkpoints": count,
            "run_tb": count * ckpt / 1e12, "dir": dir or tempfile.gettempdir()}


def format_checkpoint_io(res: dict[str, Any]) -> str:
    """The ``bench checkpoint-io`` table."""
    return "\n".join([
        f"checkpoint-io bench in {res['dir']}",
        f"law: {res['law_bytes']:,} bytes for {res['law_params']:,} trainable parameters = "
        f"{res['bytes_per_param']:.3f} B/param (float32 weight + AdamW's 2 moments: {BYTES_PER_PARAM}) -> "
        f"{'PASS' if res['law_ok'] else 'FAIL'}",
        f"disk, {res['bytes'] / 2**30:.2f} GiB of float32: write+fsync {res['write_gbs']:.2f} GB/s, sha256 "
        f"{res['hash_gbs']:.2f} GB/s, read {res['read_gbs']:.2f} GB/s (page cache not dropped: an upper bound)",
        f"paper (Qwen2.5-7B actor + Qwen3-4B extractor, {res['paper_params'] / 1e9:.2f} B trainable parameters): "
        f"{res['checkpoint_gb']:.1f} GB per checkpoint, {res['save_min']:.1f} min to save (write, hash), "
        f"{res['resume_min']:.1f} min to resume (hash, read)",
        f"a run of {res['steps']} steps checkpointing every {res['every']}: {res['checkpoints']} checkpoints, "
        f"{res['run_tb']:.2f} TB written"])


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``checkpoint-io`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    from crl_bench.bench.options import non_negative_int, positive_int

    p = subparsers.add_parser("checkpoint-io", help=HELP, description="A checkpoint's bytes per trainable "
                              "parameter (asserted with --check) and this disk's save and resume rates, "
                              "extrapolated to the paper's models and run.")
    p.add_argument("--gib", type=float, default=1.0, help="GiB of float32 tensors written and read (default 1)")
    p.add_argument("--dir", default=None, help="folder on the disk to measure (default: the temporary folder)")
    p.add_argument("--steps", type=positive_int, default=512, help="steps of the extrapolated run (paper: 512)")
    p.add_argument("--every", type=non_negative_int, default=100, help="its train.checkpoint_every (paper: 100)")
    p.add_argument("--check", action="store_true", help="exit 1 when the law fails")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``crl-bench bench checkpoint-io`` and print :func:`format_checkpoint_io`'s table; returns 0, or 1 with
    ``--check`` when the law fails."""
    res = bench_checkpoint_io(args.gib, args.dir, args.steps, args.every)
    print(format_checkpoint_io(res))
    return 1 if args.check and not res["law_ok"] else 0
