"""``crl-bench bench NAME``: speed benchmarks printed as ratios measured side by side in one run.

* ``env``: steps/s of each text env against its raw simulator (see :mod:`crl_bench.bench_envs`).
* ``rollout``: generated tokens/s of one batched rollout over N envs against the same N episodes
  rolled out one env at a time (with and without the prefix cache), same model, tasks, seeds and
  sampling.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch

from crl_bench.llm.base import SamplingParams
from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner


ARMS = {
    # name: (episodes per collect call, prefix cache)
    "batched": (None, True),
    "sequential": (1, True),
    "sequential-nocache": (1, False),
}


def bench_rollout(model: str, env_id: str, n_envs: int, max_steps: int, repeats: int = 1,
                  threads: int = 0) -> dict[str, Any]:
    """Batched rollout (one generate per turn across ``n_envs`` live episodes) vs one env at a time.

    Three arms roll out the same ``n_envs`` train tasks with the same sampling seed: ``batched`` and
    ``sequential`` use the engine as the trainer does (prefix cache on); ``sequential-nocache`` is the
    naive loop (one env at a time, no prefix cache).  Arms alternate order over ``repeats``.

    Returns:
        dict with per-arm tokens, generate/wall seconds and tokens/s, and the ratios
        ``tokens_per_s_ratio`` (batched / sequential, same engine settings) and
        ``tokens_per_s_ratio_vs_naive`` (batched / sequential-nocache).
    """
    from crl_bench.llm.hf_engine import HFEngine, load_model_and_tokenizer
    from crl_bench.trainer.loop import set_threads

    set_threads(threads)
    policy, tok = load_model_and_tokenizer(model)
    pool = EnvPool(max_steps=max_steps)
    specs = [EpisodeSpec(env_id, task) for task in range(n_envs)]
    runners = {name: RolloutRunner(HFEngine(policy, tok, batch_size=max(n_envs, 1), prefix_cache=cache),
                                   PromptBuilder(tok), pool, SamplingParams(temperature=1.0, max_new_tokens=16))
               for name, (_, cache) in ARMS.items()}
    for runner in runners.values():          # warm-up: one-off costs hit no arm
        runner.collect(specs[:1])
    arms = {name: {"tokens": 0, "generate_s": 0.0, "wall_s": 0.0} for name in ARMS}
    names = list(ARMS)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            torch.manual_seed(1234 + r)
            per_call = ARMS[name][0] or len(specs)
            for start in range(0, len(specs), per_call):
                runners[name].collect(specs[start:start + per_call])
                st = runners[name].last_stats
                arms[name]["tokens"] += st.generated_tokens
                arms[name]["generate_s"] += st.generate_s
                arms[name]["wall_s"] += st.wall_s
    pool.close()
    out: dict[str, Any] = {"env": env_id, "envs": n_envs, "max_steps": max_steps, "repeats": repeats,
                           "threads": torch.get_num_threads()}
    for name, a in arms.items():
        out[name] = {**a, "tokens_per_s": a["tokens"] / a["generate_s"] if a["generate_s"] else 0.0}
    out["tokens_per_s_ratio"] = out["batched"]["tokens_per_s"] / max(out["sequential"]["tokens_per_s"], 1e-9)
    out["tokens_per_s_ratio_vs_naive"] = (out["batched"]["tokens_per_s"]
                                          / max(out["sequential-nocache"]["tokens_per_s"], 1e-9))
    return out


def bench_overhead(model: str, env_id: str, groups: int, group_size: int, max_steps: int, rounds: int = 2,
                   threads: int = 0, seed: int = 0) -> dict[str, Any]:
    """Rollout-collection wall time of complementary vs grpo: same tasks, seeds and batch, one process.

    One actor is shared by both arms.  A warm-up round fills the bank.  Each round then times, on the
    same episode specs: ``grpo`` (plain collection, nothing in the background), ``complementary``
    (guided episodes retrieve through the manager; the distillation queue is empty) and
    ``complementary+distill`` (the same while the previous round's episodes are being distilled in the
    background, as in training).  Only ``collect`` is timed.

    Returns:
        dict with per-arm wall seconds and the ratios to ``grpo``.
    """
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
    arms = {"grpo": 0.0, "complementary": 0.0, "complementary+distill": 0.0}
    try:
        specs = comp.episode_specs()
        trajs = comp.runner.collect(specs, guide=track.guide)             # warm-up: fill the bank
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
            trajs = comp.runner.collect(specs, guide=track.guide)
            arms["complementary"] += time.perf_counter() - t0
            track.after_rollout(trajs, r + 1)                             # distillation starts now
            torch.manual_seed(seed + r)
            t0 = time.perf_counter()
            comp.runner.collect(specs, guide=track.guide)
            arms["complementary+distill"] += time.perf_counter() - t0
            backlog = track.manager.pending()
            track.manager.drain()
        stats = track.manager.stats()
    finally:
        comp.close()
        grpo.close()
    return {"env": env_id, "episodes_per_round": groups * group_size, "rounds": rounds,
            "max_steps": max_steps, "wall_s": arms, "bank_size": stats["bank_size"],
            "distill_backlog_after_last_round": backlog,
            "ratio": arms["complementary"] / max(arms["grpo"], 1e-9),
            "ratio_with_distill": arms["complementary+distill"] / max(arms["grpo"], 1e-9)}


#: envs with a bench of their own (worker processes, scripted episodes), run only when named
OWN_BENCH_ENVS = ("alfworld", "webshop")


def main(args: argparse.Namespace) -> int:
    """Entry of ``crl-bench bench``; prints a table of the measured figures."""
    if args.name == "retrieval":
        from crl_bench.bench_retrieval import main as retrieval_main

        return retrieval_main(args.extra)
    if args.name == "overhead":
        env_id = (args.env or ["minihack-room"])[0]
        res = bench_overhead(args.model, env_id, groups=2, group_size=max(2, args.envs // 2),
                             max_steps=args.max_steps)
        print(f"overhead bench: {env_id}, {res['episodes_per_round']} episodes x up to {res['max_steps']} "
              f"actions, {res['rounds']} rounds, bank of {res['bank_size']} entries")
        for arm, w in res["wall_s"].items():
            print(f"{arm:24s} rollout wall {w:8.2f} s")
        print(f"ratio complementary / grpo: {res['ratio']:.3f} (retrieval + guided prompts)")
        print(f"ratio complementary / grpo with distillation running beside it: {res['ratio_with_distill']:.3f}")
        return 0
    if args.name == "env":
        from crl_bench.bench_envs import bench_env, format_table
        from crl_bench.env_api import list_envs

        ids = args.env or [e for e in list_envs() if e not in OWN_BENCH_ENVS]
        if "alfworld" in ids:
            from crl_bench.bench_alfworld import bench_alfworld, format_result

            print(format_result(bench_alfworld(workers=args.workers, episodes=args.episodes or 8)))
            ids = [e for e in ids if e != "alfworld"]
        if "webshop" in ids:
            from crl_bench.bench_webshop import bench_webshop, format_result as format_webshop

            print(format_webshop(bench_webshop(episodes=args.episodes or 200)))
            ids = [e for e in ids if e != "webshop"]
        if ids:
            print(format_table(bench_env(ids, args.steps)))
        if not args.env:
            print(f"(not included by default: {', '.join(OWN_BENCH_ENVS)}; use --env ID)")
        return 0
    env_id = (args.env or ["minihack-room"])[0]
    res = bench_rollout(args.model, env_id, args.envs, args.max_steps)
    print(f"rollout bench: {env_id}, {res['envs']} episodes x up to {res['max_steps']} actions, "
          f"{res['threads']} torch threads")
    print(f"{'arm':20s} {'tokens':>8s} {'generate s':>11s} {'wall s':>8s} {'tok/s':>8s}")
    for name in ARMS:
        a = res[name]
        print(f"{name:20s} {a['tokens']:8d} {a['generate_s']:11.2f} {a['wall_s']:8.2f} {a['tokens_per_s']:8.2f}")
    print(f"tokens/s ratio, batched / one env at a time (same engine): {res['tokens_per_s_ratio']:.2f}x")
    print(f"tokens/s ratio, batched / naive one env at a time (no prefix cache): "
          f"{res['tokens_per_s_ratio_vs_naive']:.2f}x")
    return 0
