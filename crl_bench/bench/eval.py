"""``crl-bench bench eval``: one evaluation run per-mode waves (before) against one stream (after).

The same trainer (model, weights, bank, tasks) evaluates the same modes twice per repeat, arms
interleaved (waves, stream, stream, waves, ...) so that machine load hits both alike:

* ``waves``: ``eval.stream: false``, each mode its own pass, in waves of ``rollout.max_concurrent``
  that wait for their slowest episode (the evaluation before the stream);
* ``stream``: ``eval.stream: true``, every mode's episodes in one queue with continuous batching
  (:meth:`~crl_bench.rollout.RolloutRunner.collect_streams`, trainer/evaluation.py).

Each arm prints its wall time (and each round's: on a shared machine the rounds of one arm can differ
several-fold), episodes/s, generated and prefill tokens, generate calls, turns per generate call (how
full the slots were: a count, free of machine load) and its share of the machine's limit for those
tokens (:func:`crl_bench.bench.roofline.roofline_share`, pure torch and matmul); the last line says
how many episodes the two arms played alike (at temperature 0 with an engine whose replies do not
depend on the batch: all of them; the real model's batched forward can round a near-tie the other way).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from crl_bench.bench.options import DEFAULT_ENV, DEFAULT_MODEL, positive_int

HELP = "an evaluation as per-mode waves (before) vs one stream (after)"

ARMS = ("waves", "stream")


def _record(t: Any) -> tuple:
    return (t.env_id, t.task, t.success, t.reward, t.steps, t.experience_ids,
            tuple((tuple(x.response_ids), x.action) for x in t.turns))


def bench_eval(model: str, mix: str, preset: str, episodes: int, modes: list[str] | None = None,
               method: str = "grpo", train_steps: int = 0, repeats: int = 1, seed: int = 0,
               overrides: dict | None = None) -> dict[str, Any]:
    """Evaluate ``episodes`` tasks per env of ``mix`` in ``modes`` (default: the method's modes) with a
    ``method`` trainer of ``preset`` (after ``train_steps`` training steps, e.g. to fill a bank), arms
    :data:`ARMS` interleaved over ``repeats`` rounds.

    Returns:
        dict with per-arm sums (``episodes``, ``wall_s``, ``generated_tokens``, ``prefill_tokens``,
        ``generate_calls``, ``turns``) and each round's seconds (``rounds_s``), rates (``episodes_per_s``,
        ``tokens_per_s``), ``mean_batch`` (turns per generate call: how full the slots were; free of
        machine load), ``share_of_pure`` and ``share_of_matmul`` (``roofline``: the limits measured),
        ``ratio`` (waves wall time / stream wall time), ``same_episodes`` / ``compared`` (episodes of
        the two arms' first round played alike) and the setting (batch sizes, threads, dtype).

    Raises:
        ValueError: an unknown mode, or a mode with experience for a method without a bank.
        ConfigError: an unknown method (a ``ValueError``).
    """
    import dataclasses

    import torch

    from crl_bench.config import RunConfig, build_config, preset_data
    from crl_bench.trainer.evaluation import EVAL_MODES
    from crl_bench.trainer.loop import Trainer

    spec = RunConfig(method=method).method_spec        # checked before the model loads
    for mode in modes or ():
        if mode not in EVAL_MODES:
            raise ValueError(f"unknown eval mode {mode!r}; known: {', '.join(EVAL_MODES)}")
        if mode != "free" and not spec.uses_experience:
            raise ValueError(f"{mode} evaluation needs an experience bank; method {method!r} has none")

    base = {"rollout": {"mix": mix}, "train": {"seed": seed, "steps": max(train_steps, 1)},
            "model": {"name": model}, "eval": {"episodes": episodes}, "method": method}
    tr = Trainer(build_config([preset_data(preset), overrides or {}, base]))
    try:
        for _ in range(train_steps):
            tr.train_step()
        modes = list(modes or tr.evaluator.modes)
        sums = {a: {"episodes": 0, "wall_s": 0.0, "generated_tokens": 0, "prefill_tokens": 0,
                    "generate_calls": 0, "turns": 0, "rounds_s": []} for a in ARMS}
        played: dict[str, dict[str, list[tuple]]] = {}
        runner, engine = tr.runner, tr.engine
        real_streams, real_block = runner.collect_streams, tr.evaluator._block
        current: dict[str, Any] = {}

        def collect_streams(*a: Any, **kw: Any) -> Any:
            out = real_streams(*a, **kw)
            st = runner.last_stats
            current["generated_tokens"] += st.generated_tokens
            current["generate_calls"] += st.generate_calls
            return out

        def block(plan: dict, tasks: Any, trajs: list, *rest: Any) -> dict:
            current["records"][plan["mode"]] = [_record(t) for t in trajs]
            return real_block(plan, tasks, trajs, *rest)

        runner.collect_streams, tr.evaluator._block = collect_streams, block
        counters = getattr(engine, "counters", {})
        for r in range(repeats):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                tr.cfg.eval = dataclasses.replace(tr.cfg.eval, stream=arm == "stream")
                current.update(generated_tokens=0, generate_calls=0, records={})
                before = counters.get("prefill_tokens", 0) + counters.get("head_tokens", 0)
                t0 = time.perf_counter()
                ev = tr.evaluator.evaluate_modes(modes)
                s = sums[arm]
                s["rounds_s"].append(time.perf_counter() - t0)
                s["wall_s"] += s["rounds_s"][-1]
                s["episodes"] += sum(ev[m]["episodes"] for m in modes)
                s["generated_tokens"] += current["generated_tokens"]
                s["generate_calls"] += current["generate_calls"]
                s["turns"] += sum(len(r[-1]) for recs in current["records"].values() for r in recs)
                s["prefill_tokens"] += counters.get("prefill_tokens", 0) + counters.get("head_tokens", 0) - before
                played.setdefault(arm, current["records"])
        from crl_bench.bench.roofline import measure_roofline, roofline_share

        batch = tr.cfg.generation.batch_size
        roof = measure_roofline(tr.engine.generator if hasattr(tr.engine, "generator") else tr.model,
                                tr.compute_dtype, batches=tuple(sorted({8, batch})), train_tokens=0)
        for s in sums.values():
            s["episodes_per_s"] = s["episodes"] / s["wall_s"] if s["wall_s"] else 0.0
            s["tokens_per_s"] = s["generated_tokens"] / s["wall_s"] if s["wall_s"] else 0.0
            s["mean_batch"] = s["turns"] / s["generate_calls"] if s["generate_calls"] else 0.0
            share = roofline_share(roof, prefill_tokens=s["prefill_tokens"], generated_tokens=s["generated_tokens"],
                                   seconds=s["wall_s"], batch=max(1, min(batch, round(s["mean_batch"]))))
            s["share_of_pure"], s["share_of_matmul"] = share["share_of_pure"], share["share_of_matmul"]
        pairs = [(a, b) for m in modes for a, b in zip(played["waves"][m], played["stream"][m])]
        same = sum(1 for a, b in pairs if a == b)
        out = {"mix": mix, "preset": preset, "method": method, "modes": modes, "episodes": episodes,
               "repeats": repeats, "threads": torch.get_num_threads(),
               "dtype": str(tr.compute_dtype).replace("torch.", ""),
               "max_concurrent": tr.cfg.rollout.max_concurrent, "batch_size": tr.cfg.generation.batch_size,
               "temperature": tr.cfg.eval.temperature, **sums,
               "ratio": sums["waves"]["wall_s"] / max(sums["stream"]["wall_s"], 1e-9),
               "same_episodes": same, "compared": len(pairs)}
        out["roofline"] = roof
        return out
    finally:
        tr.close()


def format_eval(res: dict[str, Any]) -> str:
    """The ``bench eval`` table: one row per arm, then the ratio and how many episodes were alike."""
    lines = [f"eval bench: {res['mix']} / preset {res['preset']}, method {res['method']}, modes "
             f"{','.join(res['modes'])}, {res['episodes']} tasks per env, {res['repeats']} round(s) per arm; "
             f"rollout.max_concurrent {res['max_concurrent'] or 'all'}, generation.batch_size {res['batch_size']}, "
             f"{res['threads']} torch threads, {res['dtype']}, temperature {res['temperature']}",
             f"{'arm':7s} {'episodes':>8s} {'wall s':>8s} {'ep/s':>7s} {'gen tok':>8s} {'prefill':>8s} "
             f"{'gen calls':>9s} {'mean batch':>10s} {'gen tok/s':>9s} {'of pure':>8s} {'of matmul':>9s}"]
    for arm in ARMS:
        a = res[arm]
        lines.append(f"{arm:7s} {a['episodes']:8d} {a['wall_s']:8.1f} {a['episodes_per_s']:7.2f} "
                     f"{a['generated_tokens']:8d} {a['prefill_tokens']:8d} {a['generate_calls']:9d} "
                     f"{a['mean_batch']:10.1f} "
                     f"{a['tokens_per_s']:9.1f} {a['share_of_pure']:8.1%} {a['share_of_matmul']:9.1%}")
    if "roofline" in res:
        r = res["roofline"]
        decode = ", ".join(f"{d['tok_s']:.0f} at batch {d['batch']}" for d in r["decode"])
        lines.append(f"roofline ({res['dtype']}): pure-torch prefill {r['prefill']['tok_s']:.0f} tok/s, decode "
                     f"{decode} tok/s; matmul {r['matmul_flop_s'] / 1e9:.0f} GFLOP/s "
                     "(crl-bench bench roofline; 'of pure' at the arm's mean batch)")
    for arm in ARMS:
        lines.append(f"{arm} rounds: " + ", ".join(f"{x:.1f} s" for x in res[arm]["rounds_s"]))
    lines.append(f"stream / waves: {res['ratio']:.2f}x faster (wall time)")
    lines.append(f"episodes played alike by the two arms: {res['same_episodes']} of {res['compared']}")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``eval`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("eval", help=HELP, description="One evaluation as per-mode waves (before) vs "
                              "one stream with continuous batching (after), arms interleaved.")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--mix", default=DEFAULT_ENV, help=f"env id or mixture (default {DEFAULT_ENV})")
    p.add_argument("--preset", default="cpu", help="preset (default cpu)")
    p.add_argument("--method", default="grpo", help="method (default grpo: free only; a method with a bank "
                   "evaluates guided and the controls too)")
    p.add_argument("--modes", default=None, help="comma-separated eval modes (default: the method's)")
    p.add_argument("--episodes", type=positive_int, default=16, help="eval tasks per env")
    p.add_argument("--train-steps", type=int, default=0, help="training steps first (to fill a bank)")
    p.add_argument("--repeats", type=positive_int, default=1, help="rounds per arm")
    p.add_argument("--max-concurrent", type=positive_int, default=None,
                   help="rollout.max_concurrent (default: the preset's)")
    p.add_argument("--max-actions", type=positive_int, default=None,
                   help="rollout.max_steps, actions per episode (default: the preset's)")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``crl-bench bench eval`` with the options of :func:`add_parser` and print :func:`format_eval`'s
    table; returns 0 (2 with a one-line error for a mode the method cannot evaluate)."""
    import sys

    rollout = {k: v for k, v in (("max_concurrent", args.max_concurrent), ("max_steps", args.max_actions))
               if v is not None}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else None
    try:
        res = bench_eval(args.model, args.mix, args.preset, args.episodes, modes, args.method,
                         max(0, args.train_steps), args.repeats, overrides={"rollout": rollout} if rollout else None)
    except (ValueError, KeyError) as e:
        print(f"crl-bench bench eval: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    print(format_eval(res))
    return 0
