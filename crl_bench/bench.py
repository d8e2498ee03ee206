"""``crl-bench bench NAME``: speed benchmarks printed as ratios measured side by side in one run.

* ``env``: steps/s of each text env against its raw simulator (see :mod:`crl_bench.bench_envs`).
* ``rollout``: generated tokens/s of one batched rollout over N envs against the same N episodes
  rolled out one env at a time (with and without the prefix cache), same model, tasks, seeds and
  sampling.
* ``step``: whole training steps (rollout + update) of a preset and mix, ``before`` (float32
  compute, only the batch-wide prompt head cached: this project's engine before issue 13) against
  ``after`` (the defaults: ``model.dtype: auto``, per-group heads, per-episode reuse for multi-turn
  prompts), interleaved step by step; and the share of pure-torch prefill/decode throughput the
  rollout reaches.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch

from crl_bench.llm.base import SamplingParams
from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner
from crl_bench.trainer.policy import TokenSample

ARMS = {
    # name: (episodes per collect call, prefix cache)
    "batched": (None, True),
    "sequential": (1, True),
    "sequential-nocache": (1, False),
}


def bench_rollout(model: str, env_id: str, n_envs: int, max_steps: int, repeats: int = 1,
                  threads: int = 0, dtype: str = "auto") -> dict[str, Any]:
    """Batched rollout (one generate per turn across ``n_envs`` live episodes) vs one env at a time.

    Three arms roll out the same ``n_envs`` train tasks with the same sampling seed: ``batched`` and
    ``sequential`` use the engine as the trainer does (prefix cache on); ``sequential-nocache`` is the
    naive loop (one env at a time, no prefix cache).  Arms alternate order over ``repeats``.
    ``dtype`` is the compute dtype (``model.dtype``; ``auto`` by default).

    Returns:
        dict with per-arm tokens, generate/wall seconds and tokens/s, and the ratios
        ``tokens_per_s_ratio`` (batched / sequential, same engine settings) and
        ``tokens_per_s_ratio_vs_naive`` (batched / sequential-nocache).
    """
    from crl_bench.llm.hf_engine import HFEngine, load_model_and_tokenizer
    from crl_bench.llm.precision import DTYPES, resolve_dtype
    from crl_bench.trainer.loop import set_threads

    set_threads(threads)
    policy, tok = load_model_and_tokenizer(model)
    dtype = DTYPES[resolve_dtype(dtype)]
    pool = EnvPool(max_steps=max_steps)
    specs = [EpisodeSpec(env_id, task) for task in range(n_envs)]
    runners = {name: RolloutRunner(HFEngine(policy, tok, batch_size=max(n_envs, 1), prefix_cache=cache,
                                            compute_dtype=dtype),
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
                           "threads": torch.get_num_threads(), "dtype": str(dtype).replace("torch.", "")}
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
    gate_wait = {"actor_waited_s": 0.0, "distill_waited_s": 0.0}
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
            w0, b0 = comp.gate.foreground_wait_s, comp.gate.background_wait_s
            t0 = time.perf_counter()
            comp.runner.collect(specs, guide=track.guide)
            arms["complementary+distill"] += time.perf_counter() - t0
            gate_wait["actor_waited_s"] += comp.gate.foreground_wait_s - w0
            gate_wait["distill_waited_s"] += comp.gate.background_wait_s - b0
            backlog = track.manager.backlog()
            track.manager.drain()
        stats = track.manager.stats()
    finally:
        comp.close()
        grpo.close()
    return {"env": env_id, "episodes_per_round": groups * group_size, "rounds": rounds,
            "max_steps": max_steps, "wall_s": arms, "bank_size": stats["bank_size"],
            "distill_backlog_after_last_round": backlog, "gate": gate_wait,
            "ratio": arms["complementary"] / max(arms["grpo"], 1e-9),
            "ratio_with_distill": arms["complementary+distill"] / max(arms["grpo"], 1e-9)}


def pure_throughput(model: Any, dtype: torch.dtype, batch: int = 8, prompt: int = 512, context: int = 300,
                    decode_steps: int = 32) -> dict[str, float]:
    """Tokens/s of the bare model (no engine, no sampling): prefill of ``batch x prompt`` random
    tokens, and greedy-free decode (one token per row per forward, key/value cache on) after a
    ``context``-token prompt.  ``model`` is used as is (its weights' dtype), under autocast to
    ``dtype`` when that differs.  The upper bound the rollout's generate time is compared with."""
    from transformers import DynamicCache

    from crl_bench.llm.precision import autocast

    model.eval()
    dev = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad(), autocast(dev, dtype):
        ids = torch.randint(100, vocab, (batch, prompt), generator=gen).to(dev)
        model(input_ids=ids[:, :16], logits_to_keep=1)                  # warm-up
        t0 = time.perf_counter()
        model(input_ids=ids, logits_to_keep=1)
        prefill = batch * prompt / (time.perf_counter() - t0)
        cache = DynamicCache()
        out = model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(decode_steps):
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        decode = batch * decode_steps / (time.perf_counter() - t0)
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "batch": batch, "prompt": prompt,
            "context": context}


STEP_ARMS = {
    # name: (config overrides, engine attributes)
    "before": ({"model": {"dtype": "float32"}}, {"group_heads": False, "keep_sequences": False}),
    "after": ({}, {}),
}


def bench_step(model: str, mix: str, preset: str, steps: int, threads: int = 0, seed: int = 0,
               overrides: dict | None = None, update_probe: bool = True) -> dict[str, Any]:
    """Training steps of ``preset`` on ``mix``, arms :data:`STEP_ARMS`, interleaved (before, after,
    after, before, ...) so that machine load hits both alike.

    Each arm is its own :class:`~crl_bench.trainer.loop.Trainer` (same seed, same starting weights,
    method ``grpo``) running ``steps`` real steps; its rollouts follow its own sampled actions, so
    rates (tokens/s) are compared, and step times as means.  With the ``after`` arm's generator the
    pure-torch throughput (:func:`pure_throughput`) is measured in the same run, and the rollout's
    share of it is ``(prefill tokens / pure prefill rate + generated tokens / pure decode rate) /
    generate seconds``.  ``update_probe=False`` skips the same-batch update comparison (it costs
    about as much as the steps themselves on big presets).

    Returns:
        dict with per-arm sums (steps, generated tokens, prompt and prefill tokens, rollout /
        generate / update / step seconds), rates, ratios ``after / before`` and the pure throughput.
    """
    from crl_bench.config import build_config, preset_data
    from crl_bench.trainer.loop import Trainer, set_threads

    set_threads(threads)
    base = {"rollout": {"mix": mix}, "train": {"seed": seed, "steps": steps + 1},
            "model": {"threads": threads, "name": model}, "eval": {"episodes": 0}, "method": "grpo"}
    trainers, sums = {}, {}
    for name, (cfg_over, engine_attrs) in STEP_ARMS.items():
        tr = Trainer(build_config([preset_data(preset), overrides or {}, base, cfg_over]))
        for k, v in engine_attrs.items():
            setattr(tr.engine, k, v)
        trainers[name] = tr
        sums[name] = {"steps": 0, "generated_tokens": 0, "prompt_tokens": 0, "prefill_tokens": 0,
                      "time_rollout_s": 0.0, "time_generate_s": 0.0, "time_update_s": 0.0,
                      "time_step_s": 0.0, "optimizer_steps": 0.0}
    names = list(STEP_ARMS)
    last = None
    try:
        for r in range(steps):
            for name in (names if r % 2 == 0 else names[::-1]):
                torch.manual_seed(seed + r)
                res = trainers[name].train_step()
                for k in sums[name]:
                    sums[name][k] += res.metrics.get(k, 0) if k != "steps" else 1
                if name == "after":
                    last = res.trajectories
        # one update of each arm on the same batch (the last rollout of "after", advantages +-1 by
        # episode), so update times compare even when the steps above had no learning signal
        samples = [TokenSample(t.prompt_ids, t.response_ids, t.logprobs, 1.0 if k % 2 else -1.0, sequence=k)
                   for k, tr in enumerate(last or []) for t in tr.turns if t.response_ids] if update_probe else []
        for name in names:
            t0 = time.perf_counter()
            upd = trainers[name].updater.update(samples) if samples else {}
            sums[name]["update_probe_s"] = time.perf_counter() - t0
            sums[name]["update_probe_tokens"] = int(upd.get("trained_tokens", 0))
            for k in ("behaviour_logprob_abs_diff", "behaviour_ratio_std", "behaviour_ratio_min",
                      "behaviour_ratio_max"):
                if k in upd:
                    sums[name][k] = upd[k]
        pure = pure_throughput(trainers["after"].engine.generator, trainers["after"].compute_dtype)
        dtypes = {n: str(t.compute_dtype).replace("torch.", "") for n, t in trainers.items()}
    finally:
        for tr in trainers.values():
            tr.close()
    out: dict[str, Any] = {"mix": mix, "preset": preset, "steps": steps, "threads": torch.get_num_threads(),
                           "dtype": dtypes, "pure": pure}
    for name, a in sums.items():
        n = max(a["steps"], 1)
        out[name] = {**a, "tokens_per_s": a["generated_tokens"] / a["time_generate_s"] if a["time_generate_s"] else 0.0,
                     "step_s_mean": a["time_step_s"] / n, "rollout_s_mean": a["time_rollout_s"] / n,
                     "update_s_mean": a["time_update_s"] / n,
                     "update_s_per_1k_tokens": 1000 * a["time_update_s"] / max(a["generated_tokens"], 1)}
        ideal = a["prefill_tokens"] / pure["prefill_tok_s"] + a["generated_tokens"] / pure["decode_tok_s"]
        out[name]["share_of_pure"] = ideal / a["time_generate_s"] if a["time_generate_s"] else 0.0
    b, f = out["before"], out["after"]
    out["ratios"] = {
        "tokens_per_s": f["tokens_per_s"] / max(b["tokens_per_s"], 1e-9),
        "step_s": b["step_s_mean"] / max(f["step_s_mean"], 1e-9),
        "rollout_s": b["rollout_s_mean"] / max(f["rollout_s_mean"], 1e-9),
    }
    if update_probe:
        out["ratios"]["update_same_batch"] = b["update_probe_s"] / max(f["update_probe_s"], 1e-9)
    return out


def format_step(res: dict[str, Any]) -> str:
    """The ``bench step`` table."""
    lines = [f"step bench: {res['mix']} / preset {res['preset']}, {res['steps']} steps per arm, "
             f"{res['threads']} torch threads; compute dtype before={res['dtype']['before']} "
             f"after={res['dtype']['after']}",
             f"{'arm':8s} {'gen tok':>8s} {'prefill':>8s} {'prompt':>8s} {'tok/s':>7s} {'step s':>8s} "
             f"{'rollout s':>9s} {'update s':>9s} {'upd s/1k tok':>12s} {'of pure':>8s}"]
    for name in STEP_ARMS:
        a = res[name]
        lines.append(f"{name:8s} {a['generated_tokens']:8d} {a['prefill_tokens']:8d} {a['prompt_tokens']:8d} "
                     f"{a['tokens_per_s']:7.1f} {a['step_s_mean']:8.1f} {a['rollout_s_mean']:9.1f} "
                     f"{a['update_s_mean']:9.1f} {a['update_s_per_1k_tokens']:12.2f} {a['share_of_pure']:8.1%}")
    p = res["pure"]
    r = res["ratios"]
    lines.append(f"pure torch ({res['dtype']['after']}): prefill {p['prefill_tok_s']:.0f} tok/s "
                 f"(batch {p['batch']} x {p['prompt']}), decode {p['decode_tok_s']:.0f} tok/s "
                 f"(batch {p['batch']}, {p['context']}-token context)")
    lines.append(f"after / before: rollout tok/s {r['tokens_per_s']:.2f}x, step time {r['step_s']:.2f}x faster, "
                 f"rollout time {r['rollout_s']:.2f}x faster")
    if "update_same_batch" in r:
        lines.append(f"one update on the same batch ({res['before']['update_probe_tokens']} trained tokens, "
                     f"recomputed old log-probs): before {res['before']['update_probe_s']:.1f} s, after "
                     f"{res['after']['update_probe_s']:.1f} s: {r['update_same_batch']:.2f}x faster")
    for name in STEP_ARMS:
        a = res[name]
        if "behaviour_logprob_abs_diff" in a:
            lines.append(f"{name}: sampler vs trainer log-probs: mean |diff| {a['behaviour_logprob_abs_diff']:.4f}, "
                         f"ratio std {a['behaviour_ratio_std']:.4f}, min {a['behaviour_ratio_min']:.3f}, "
                         f"max {a['behaviour_ratio_max']:.3f}")
    return "\n".join(lines)


#: envs with a bench of their own (worker processes, scripted episodes), run only when named
OWN_BENCH_ENVS = ("alfworld", "webshop")


def main(args: argparse.Namespace) -> int:
    """Entry of ``crl-bench bench``; prints a table of the measured figures."""
    if args.name == "retrieval":
        from crl_bench.bench_retrieval import main as retrieval_main

        return retrieval_main(args.extra)
    if args.name == "step":
        env_id = (args.env or ["minihack-room"])[0]
        print(format_step(bench_step(args.model, args.mix or env_id, args.preset, args.train_steps,
                                     update_probe=not args.no_update_probe)))
        return 0
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
        print(f"  (the actor waited {res['gate']['actor_waited_s']:.2f} s for running distillation steps; "
              f"distillation waited {res['gate']['distill_waited_s']:.2f} s for the actor; "
              f"{res['distill_backlog_after_last_round']} requests still queued after the last round)")
        return 0
    if args.name == "env":
        from crl_bench.bench_envs import bench_env, format_skipped, format_table
        from crl_bench.env_api import list_envs

        ids = args.env or [e for e in list_envs() if e not in OWN_BENCH_ENVS]
        if "alfworld" in ids:
            from crl_bench.bench_alfworld import bench_alfworld, format_result

            print(format_result(bench_alfworld(workers=args.workers, episodes=args.episodes or 8)))
            ids = [e for e in ids if e != "alfworld"]
        if "webshop" in ids:
            from crl_bench.bench_webshop import bench_webshop
            from crl_bench.bench_webshop import format_result as format_webshop

            print(format_webshop(bench_webshop(episodes=args.episodes or 200)))
            ids = [e for e in ids if e != "webshop"]
        # every env (no --env): one that cannot run here (no Docker daemon or SWE-bench images, a
        # missing extra or data set, an open action set) is skipped and listed with the reason
        skipped: list[tuple[str, str]] | None = None if args.env else []
        if ids:
            print(format_table(bench_env(ids, args.steps, skipped=skipped)))
        if skipped:
            print(format_skipped(skipped))
        if not args.env:
            print(f"(not included by default: {', '.join(OWN_BENCH_ENVS)}; use --env ID)")
        return 0
    env_id = (args.env or ["minihack-room"])[0]
    res = bench_rollout(args.model, env_id, args.envs, args.max_steps)
    print(f"rollout bench: {env_id}, {res['envs']} episodes x up to {res['max_steps']} actions, "
          f"{res['threads']} torch threads, compute dtype {res['dtype']}")
    print(f"{'arm':20s} {'tokens':>8s} {'generate s':>11s} {'wall s':>8s} {'tok/s':>8s}")
    for name in ARMS:
        a = res[name]
        print(f"{name:20s} {a['tokens']:8d} {a['generate_s']:11.2f} {a['wall_s']:8.2f} {a['tokens_per_s']:8.2f}")
    print(f"tokens/s ratio, batched / one env at a time (same engine): {res['tokens_per_s_ratio']:.2f}x")
    print(f"tokens/s ratio, batched / naive one env at a time (no prefix cache): "
          f"{res['tokens_per_s_ratio_vs_naive']:.2f}x")
    return 0
