"""``crl-bench bench overhead``: rollout-collection wall time of ``complementary`` against ``grpo`` (same
tasks, seeds and batch, one process), and of ``complementary`` while distillation runs beside it, split
into what any guided prompt costs and what the experience mechanism costs."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from crl_bench.bench.options import add_model_and_env, first_env, positive_int

__all__ = ["HELP", "add_parser", "bench_overhead", "run"]

HELP = "complementary vs grpo rollout time"


def bench_overhead(model: str, env_id: str, groups: int, group_size: int, max_steps: int, rounds: int = 2,
                   threads: int = 0, seed: int = 0) -> dict[str, Any]:
    """Rollout-collection wall time of complementary vs grpo: same tasks, seeds and batch, one process.

    One actor is shared by the arms.  A warm-up round fills the bank.  Each round then times, on the
    same episode specs: ``grpo`` (plain collection, nothing in the background), ``complementary``
    (guided episodes retrieve through the manager; the distillation queue is empty),
    ``grpo+guidance`` (the grpo runner given, as fixed text, the guidance each episode of the
    ``complementary`` arm retrieved: the same prompts, hence with the same seed the same replies,
    without retrieval) and ``complementary+distill`` (``complementary`` while the previous round's
    episodes are being distilled in the background, as in training).  Only ``collect`` is timed.

    The ratios split the overhead: ``prompt_ratio = grpo+guidance / grpo`` is what any guided prompt
    costs (the experience text's extra prefill, and any change of the replies it causes), whatever
    produced the text; ``mechanism_ratio = complementary+distill / grpo+guidance`` is what the
    paper's claim of a cheap experience track is about (retrieval latency, the distillation queue, the
    actor's waits for the background extractor and the CPU it takes).  The distillation the rollout
    left queued is then drained, timed apart (``gate.drain_after_s``): in training the next step's
    flush (``experience.flush_before_rollout``) waits for it.

    Returns:
        dict with per-arm wall seconds, the ratios to ``grpo`` and the two split ratios.
    """
    import torch

    from crl_bench.config import build_config, preset_data
    from crl_bench.trainer.loop import Trainer

    base = {"rollout": {"mix": env_id, "max_steps": max_steps},
            "train": {"groups_per_step": groups, "group_size": group_size, "seed": seed},
            "model": {"threads": threads, "name": model}, "eval": {"episodes": 0}}
    grpo = Trainer(build_config([preset_data("default"), base, {"method": "grpo"}]))
    # the bench's own first round is the warm-up (it fills the bank), so every timed round retrieves
    comp = Trainer(build_config([preset_data("default"), base,
                                 {"method": "complementary", "experience": {"warmup_steps": 0}}]),
                   model=grpo.model, tokenizer=grpo.tokenizer)
    track = comp.experience
    arms = {"grpo": 0.0, "complementary": 0.0, "grpo+guidance": 0.0, "complementary+distill": 0.0}
    gate_wait = {"actor_waited_s": 0.0, "distill_waited_s": 0.0, "drain_after_s": 0.0}
    try:
        specs = comp.episode_specs()
        hooks = comp.rollout_hooks(training=True)                       # as in training
        trajs = comp.runner.collect(specs, **hooks)                       # warm-up: fill the bank
        track.after_rollout(trajs, 0, warmup=True)
        track.manager.drain()
        for r in range(rounds):
            specs = comp.episode_specs()
            free = [dataclasses.replace(s, subgroup="free", retrieve=False) for s in specs]
            torch.manual_seed(seed + r)
            t0 = time.perf_counter()
            grpo.runner.collect(free)
            arms["grpo"] += time.perf_counter() - t0
            torch.manual_seed(seed + r)
            t0 = time.perf_counter()
            trajs = comp.runner.collect(specs, **hooks)
            arms["complementary"] += time.perf_counter() - t0
            texts = [dataclasses.replace(s, retrieve=False, guidance=t.guidance) for s, t in zip(specs, trajs)]
            torch.manual_seed(seed + r)
            t0 = time.perf_counter()
            grpo.runner.collect(texts)
            arms["grpo+guidance"] += time.perf_counter() - t0
            track.after_rollout(trajs, r + 1)                             # distillation starts now
            torch.manual_seed(seed + r)
            w0, b0 = comp.gate.foreground_wait_s, comp.gate.background_wait_s
            t0 = time.perf_counter()
            comp.runner.collect(specs, **hooks)
            arms["complementary+distill"] += time.perf_counter() - t0
            gate_wait["actor_waited_s"] += comp.gate.foreground_wait_s - w0
            gate_wait["distill_waited_s"] += comp.gate.background_wait_s - b0
            backlog = track.manager.backlog()
            t0 = time.perf_counter()
            track.manager.drain()                 # what the rollout left: the next step's flush waits for it
            gate_wait["drain_after_s"] += time.perf_counter() - t0
        stats = track.manager.stats()
    finally:
        comp.close()
        grpo.close()
    return {"env": env_id, "episodes_per_round": groups * group_size, "rounds": rounds,
            "max_steps": max_steps, "wall_s": arms, "bank_size": stats["bank_size"],
            "distill_backlog_after_last_round": backlog, "gate": gate_wait,
            "ratio": arms["complementary"] / max(arms["grpo"], 1e-9),
            "ratio_with_distill": arms["complementary+distill"] / max(arms["grpo"], 1e-9),
            "prompt_ratio": arms["grpo+guidance"] / max(arms["grpo"], 1e-9),
            "mechanism_ratio": arms["complementary+distill"] / max(arms["grpo+guidance"], 1e-9)}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``overhead`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("overhead", help=HELP, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    add_model_and_env(p, "env id (default minihack-room)")
    p.add_argument("--envs", type=positive_int, default=8,
                   help="episodes per round: 2 groups of max(2, ENVS // 2) episodes")
    p.add_argument("--max-steps", type=positive_int, default=4, help="actions per episode")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``crl-bench bench overhead`` with the options of :func:`add_parser` and print its figures;
    returns 0."""
    env_id = first_env(args)
    res = bench_overhead(args.model, env_id, groups=2, group_size=max(2, args.envs // 2),
                         max_steps=args.max_steps)
    print(f"overhead bench: {env_id}, {res['episodes_per_round']} episodes x up to {res['max_steps']} "
          f"actions, {res['rounds']} rounds, bank of {res['bank_size']} entries")
    for arm, w in res["wall_s"].items():
        print(f"{arm:24s} rollout wall {w:8.2f} s")
    print(f"ratio complementary / grpo: {res['ratio']:.3f} (retrieval + guided prompts)")
    print(f"ratio complementary / grpo with distillation running beside it: {res['ratio_with_distill']:.3f}")
    print(f"  (the actor waited {res['gate']['actor_waited_s']:.2f} s for running distillation steps; "
          f"distillation waited {res['gate']['distill_waited_s']:.2f} s for the actor; "
          f"{res['distill_backlog_after_last_round']} requests still queued after the last round; "
          f"draining what each round left took {res['gate']['drain_after_s']:.2f} s in all, "
          f"outside the rollout)")
    print(f"split: guided prompts (grpo+guidance / grpo) {res['prompt_ratio']:.3f}; experience mechanism "
          f"(complementary+distill / grpo+guidance: retrieval, queueing, waits) {res['mechanism_ratio']:.3f}")
    return 0
