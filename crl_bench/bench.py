"""``crl-bench bench NAME``: speed benchmarks printed as ratios measured side by side in one run.

* ``env``: steps/s of each text env against its raw simulator (see :mod:`crl_bench.bench_envs`).
* ``rollout``: generated tokens/s of one batched rollout over N envs against the same N episodes
  rolled out one env at a time, same model, tasks, seeds and sampling.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from crl_bench.llm.base import SamplingParams
from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner


def bench_rollout(model: str, env_id: str, n_envs: int, max_steps: int, repeats: int = 1,
                  threads: int = 0) -> dict[str, Any]:
    """Batched (one generate per turn across ``n_envs`` live episodes) vs sequential rollout.

    Both arms roll out the same ``n_envs`` train tasks with the same seeds; arms alternate
    ``repeats`` times so that machine noise hits both.

    Returns:
        dict with tokens, generate seconds and wall seconds per arm, tokens/s per arm and the ratios
        ``tokens_per_s_ratio`` (batched / sequential) and ``wall_ratio`` (sequential / batched).
    """
    from crl_bench.llm.hf_engine import HFEngine, load_model_and_tokenizer
    from crl_bench.trainer.loop import set_threads

    set_threads(threads)
    policy, tok = load_model_and_tokenizer(model)
    engine = HFEngine(policy, tok, batch_size=max(n_envs, 1))
    pool = EnvPool(max_steps=max_steps)
    runner = RolloutRunner(engine, PromptBuilder(tok), pool, SamplingParams(temperature=1.0, max_new_tokens=16))
    specs = [EpisodeSpec(env_id, task) for task in range(n_envs)]
    # warm-up so that one-off costs (allocator, kernels) hit neither arm
    runner.collect(specs[:1])
    arms = {"batched": {"tokens": 0, "generate_s": 0.0, "wall_s": 0.0},
            "sequential": {"tokens": 0, "generate_s": 0.0, "wall_s": 0.0}}
    for r in range(repeats):
        for arm in ("batched", "sequential") if r % 2 == 0 else ("sequential", "batched"):
            torch.manual_seed(1234 + r)
            groups = [specs] if arm == "batched" else [[s] for s in specs]
            for g in groups:
                runner.collect(g)
                st = runner.last_stats
                arms[arm]["tokens"] += st.generated_tokens
                arms[arm]["generate_s"] += st.generate_s
                arms[arm]["wall_s"] += st.wall_s
    pool.close()
    out: dict[str, Any] = {"env": env_id, "envs": n_envs, "max_steps": max_steps, "repeats": repeats,
                           "threads": torch.get_num_threads()}
    for arm, a in arms.items():
        out[arm] = {**a, "tokens_per_s": a["tokens"] / a["generate_s"] if a["generate_s"] else 0.0}
    out["tokens_per_s_ratio"] = out["batched"]["tokens_per_s"] / max(out["sequential"]["tokens_per_s"], 1e-9)
    out["wall_ratio"] = out["sequential"]["wall_s"] / max(out["batched"]["wall_s"], 1e-9)
    return out


def main(args: argparse.Namespace) -> int:
    """Entry of ``crl-bench bench``; prints a table of the measured figures."""
    if args.name == "env":
        from crl_bench.bench_envs import bench_env, format_table

        rows = bench_env(args.env, args.steps)
        print(format_table(rows))
        return 0
    env_id = (args.env or ["minihack-room"])[0]
    res = bench_rollout(args.model, env_id, args.envs, args.max_steps)
    b, s = res["batched"], res["sequential"]
    print(f"rollout bench: {env_id}, {res['envs']} episodes x up to {res['max_steps']} actions, "
          f"{res['threads']} torch threads")
    print(f"{'arm':12s} {'tokens':>8s} {'generate s':>11s} {'wall s':>8s} {'tok/s':>8s}")
    for name, a in (("batched", b), ("sequential", s)):
        print(f"{name:12s} {a['tokens']:8d} {a['generate_s']:11.2f} {a['wall_s']:8.2f} {a['tokens_per_s']:8.2f}")
    print(f"tokens/s ratio (batched / one env at a time): {res['tokens_per_s_ratio']:.2f}x   "
          f"wall ratio: {res['wall_ratio']:.2f}x")
    return 0
