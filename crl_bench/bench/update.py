"""``crl-bench bench update``: one actor update with padded against packed micro-batches
(``train.packing``), on the same batch, per prompt layout.

For each prompt layout one batch of a preset's episodes is rolled out once; then the trainer's own
updater runs on that batch with ``packing`` off and on, interleaved (off, on, on, off, ...) so that
machine load hits both alike, at learning rate 0 so that every update starts from the same weights and
computes the same loss.  ``window`` prompts are trained one sample per turn, ``multiturn`` prompts one
sequence per episode (``train.sequences: episode``), so the layouts' rows also compare the tokens the
two layouts put through the update (docs/performance.md, "Packed micro-batches").
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

from crl_bench.bench.options import add_model_and_env, first_env, positive_int
from crl_bench.prompts import PROMPT_LAYOUTS

__all__ = ["HELP", "PeakRSS", "add_parser", "bench_update", "format_update", "run"]

HELP = "one update, padded vs packed micro-batches, on the same batch per prompt layout"


class PeakRSS:
    """Context manager sampling this process's resident memory every ``interval`` seconds (Linux
    ``/proc/self/statm``); ``peak_gb`` is the highest sample minus the one at entry (GB), 0 elsewhere."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peak_gb = 0.0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _rss(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self._high = max(self._high, self._rss())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        self._base = self._high = self._rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_gb = max(0, self._high - self._base) / 1e9


def bench_update(model: str, mix: str, preset: str, groups: int, layouts: tuple[str, ...] = ("window", "multiturn"),
                 repeats: int = 2, threads: int = 0, seed: int = 0, overrides: dict | None = None) -> dict[str, Any]:
    """Per prompt layout: roll out ``groups`` groups of ``preset`` on ``mix`` once, then ``repeats``
    rounds of one update with ``packing`` off and one with it on (order alternating per round).

    Advantages are +-1 by episode (every sample trains, as in ``bench step``'s update probe).  Each
    update row holds its seconds, ``update_forward_tokens`` (padding included), ``update_input_tokens``
    (real tokens), trained tokens, micro-batches, the loss (equal across arms up to float rounding) and
    the resident-memory peak over the update's start (GB, :class:`PeakRSS`).

    Returns:
        dict with ``preset``, ``mix``, ``groups``, ``threads``, ``dtype``, ``checkpointing`` and per layout
        ``{"episodes", "samples", "sequences", "padded": [rows], "packed": [rows]}``.
    """
    import torch

    from crl_bench.config import build_config, preset_data
    from crl_bench.trainer.loop import Trainer, set_threads
    from crl_bench.trainer.policy import _checkpointing, episode_samples

    set_threads(threads)
    out: dict[str, Any] = {"preset": preset, "mix": mix, "groups": groups, "threads": torch.get_num_threads()}
    for layout in layouts:
        sequences = "episode" if layout == "multiturn" else "turn"
        base = {"rollout": {"mix": mix, "prompt": layout},
                "train": {"seed": seed, "steps": 1, "groups_per_step": groups, "lr": 0.0, "lr_warmup_steps": 0,
                          "sequences": sequences},
                "model": {"threads": threads, "name": model}, "eval": {"episodes": 0}, "method": "grpo"}
        tr = Trainer(build_config([preset_data(preset), overrides or {}, base]))
        try:
            torch.manual_seed(seed)
            trajs = tr.runner.collect(tr.episode_specs(), tr.sampling)
            advs = [1.0 if k % 2 else -1.0 for k in range(len(trajs))]
            samples = episode_samples(trajs, advs, sequences)
            print(f"{layout}: {len(trajs)} episodes rolled out, {len(samples)} samples", file=sys.stderr, flush=True)
            res: dict[str, Any] = {"episodes": len(trajs), "samples": len(samples), "sequences": sequences,
                                   "padded": [], "packed": []}
            out["dtype"] = str(tr.compute_dtype).replace("torch.", "")
            out["checkpointing"] = _checkpointing(tr.model)
            for r in range(repeats):
                for packing in ((False, True) if r % 2 == 0 else (True, False)):
                    tr.updater.packing = packing
                    micros = sum(len(m) for m in tr.updater.plan(samples))
                    with PeakRSS() as mem:
                        t0 = time.perf_counter()
                        upd = tr.updater.update(samples)
                        dt = time.perf_counter() - t0
                    res["packed" if packing else "padded"].append({
                        "update_s": dt, "forward_tokens": int(upd["update_forward_tokens"]),
                        "input_tokens": int(upd["update_input_tokens"]),
                        "trained_tokens": int(upd["trained_tokens"]), "micro_batches": micros,
                        "loss": float(upd["loss"]), "peak_gb": mem.peak_gb})
                    # progress on stderr: a bench of the cpu preset runs for an hour on a shared machine
                    print(f"{layout} {'packed' if packing else 'padded'}: {dt:.1f} s, "
                          f"{int(upd['update_forward_tokens'])} forward tokens", file=sys.stderr, flush=True)
            out[layout] = res
        finally:
            tr.close()
    return out


def format_update(res: dict[str, Any]) -> str:
    """The ``bench update`` table: per layout and arm the mean update seconds, tokens through the
    forwards (padding included), real tokens, trained tokens, micro-batches, loss and memory peak; then
    packed / padded ratios and the layouts' tokens through the update."""
    lines = [f"update bench: {res['mix']} / preset {res['preset']}, {res['groups']} groups, {res['threads']} torch "
             f"threads, compute {res.get('dtype')}, gradient checkpointing {res.get('checkpointing')}; arms "
             f"interleaved on the same batch, learning rate 0",
             f"{'layout':9s} {'arm':6s} {'samples':>7s} {'update s':>16s} {'fwd tok':>8s} {'real tok':>8s} "
             f"{'trained':>7s} {'micro':>5s} {'loss':>9s} {'peak GB':>7s}"]
    layouts = [k for k in PROMPT_LAYOUTS if k in res]
    for layout in layouts:
        q = res[layout]
        for arm in ("padded", "packed"):
            rows = q[arm]
            ts = [x["update_s"] for x in rows]
            x = rows[0]
            lines.append(f"{layout:9s} {arm:6s} {q['samples']:7d} {sum(ts) / len(ts):7.1f} "
                         f"({'/'.join(f'{t:.0f}' for t in ts):>7s}) {x['forward_tokens']:8d} {x['input_tokens']:8d} "
                         f"{x['trained_tokens']:7d} {x['micro_batches']:5d} {x['loss']:9.5f} "
                         f"{max(r['peak_gb'] for r in rows):7.2f}")
        p = sum(x["update_s"] for x in q["padded"]) / max(sum(x["update_s"] for x in q["packed"]), 1e-9)
        f = q["padded"][0]["forward_tokens"] / max(q["packed"][0]["forward_tokens"], 1)
        lines.append(f"{layout}: packed {p:.2f}x faster than padded, {f:.2f}x fewer forward tokens")
    if "window" in res and "multiturn" in res:
        w, m = res["window"]["packed"][0], res["multiturn"]["packed"][0]
        lines.append(f"multiturn (one sequence per episode) vs window (one sample per turn), packed: "
                     f"{w['input_tokens'] / max(m['input_tokens'], 1):.2f}x fewer tokens through the update, "
                     f"{w['input_tokens'] / max(w['trained_tokens'], 1):.1f} vs "
                     f"{m['input_tokens'] / max(m['trained_tokens'], 1):.1f} per trained token (different episodes)")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``update`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("update", help=HELP, description="One actor update with padded against packed "
                              "micro-batches (train.packing) on the same rolled-out batch, per prompt layout.")
    add_model_and_env(p, "env id (default minihack-room), the mix when --mix is not given")
    p.add_argument("--mix", default=None, help="env id or mixture (default: --env or minihack-room)")
    p.add_argument("--preset", default="cpu", help="preset (default cpu)")
    p.add_argument("--groups", type=positive_int, default=2, help="groups rolled out per layout (default 2)")
    p.add_argument("--prompt", choices=PROMPT_LAYOUTS, action="append", default=None,
                   help="prompt layout(s) to roll out (repeatable; default window and multiturn)")
    p.add_argument("--repeats", type=positive_int, default=2, help="updates per arm (default 2)")
    p.add_argument("--micro-batch-tokens", type=positive_int, default=None,
                   help="train.micro_batch_tokens (default: the preset's)")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``crl-bench bench update`` with the options of :func:`add_parser` and print :func:`format_update`'s
    table; returns 0."""
    overrides = {"train": {"micro_batch_tokens": args.micro_batch_tokens}} if args.micro_batch_tokens else None
    layouts = tuple(args.prompt or ("window", "multiturn"))
    print(format_update(bench_update(args.model, args.mix or first_env(args), args.preset, args.groups, layouts,
                                     args.repeats, overrides=overrides)))
    return 0
