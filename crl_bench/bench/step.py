"""``crl-bench bench step``: whole training steps (rollout + update) of a preset and mix, ``before``
(float32 compute, only the batch-wide prompt head cached, transformers' ``generate``: no bf16, no
per-group heads, no per-episode reuse, not the engine's own decode loop) against
``after`` (the defaults: ``model.dtype: auto``, per-group heads, per-episode reuse for multi-turn
prompts), interleaved step by step; and the share of pure-torch prefill/decode throughput the rollout
reaches."""

from __future__ import annotations

import argparse
import time
from typing import Any

from crl_bench.bench.options import add_model_and_env, first_env, positive_int
from crl_bench.bench.roofline import pure_throughput  # noqa: F401 - its old home; callers may import it here
from crl_bench.rollout import PROMPT_LAYOUTS

__all__ = ["HELP", "STEP_ARMS", "add_parser", "bench_step", "format_step", "run"]

HELP = "training steps without (before) vs with (after) bf16 and prefix reuse"


STEP_ARMS = {
    # name: (config overrides, engine attributes)
    "before": ({"model": {"dtype": "float32"}}, {"group_heads": False, "keep_sequences": False,
                                                 "decode_loop": False}),
    "after": ({}, {}),
}


def bench_step(model: str, mix: str, preset: str, steps: int, threads: int = 0, seed: int = 0,
               overrides: dict | None = None, update_probe: bool = True) -> dict[str, Any]:
    """Training steps of ``preset`` on ``mix``, arms :data:`STEP_ARMS`, interleaved (before, after,
    after, before, ...) so that machine load hits both alike.

    Each arm is its own :class:`~crl_bench.trainer.loop.Trainer` (same seed, same starting weights,
    method ``grpo``) running ``steps`` real steps; its rollouts follow its own sampled actions, so
    rates (tokens/s) are compared, and step times as means.  With the ``after`` arm's generator the
    roofline (:func:`crl_bench.bench.roofline.measure_roofline`: pure-torch prefill and decode at the
    rollout's batch, matmul FLOP/s) is measured in the same run, and each arm's rollout is stated as
    a share of it (:func:`~crl_bench.bench.roofline.roofline_share`: ``share_of_pure``, the time
    pure-torch forwards need for the arm's prefill and generated tokens over its generate seconds,
    and ``share_of_matmul``).  ``update_probe=False`` skips the same-batch update comparison (it costs
    about as much as the steps themselves on big presets).

    Returns:
        dict with per-arm sums (steps, generated tokens, prompt and prefill tokens, rollout /
        generate / update / step seconds), rates, shares of the roofline, ratios ``after / before``,
        the roofline (``roofline``) and the pure-torch rates at the rollout's batch (``pure``).
    """
    import torch

    from crl_bench.bench.roofline import measure_roofline, roofline_share
    from crl_bench.config import build_config, preset_data
    from crl_bench.trainer.loop import Trainer, set_threads
    from crl_bench.trainer.policy import SEQUENCE_LAYOUTS, episode_samples

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
        # episode) per sequence layout: per-turn samples, then one sequence per episode where the
        # prompts are append-only; update times compare even when the steps above had no signal
        advs = [1.0 if k % 2 else -1.0 for k in range(len(last or []))]
        for name in names:
            for layout in (SEQUENCE_LAYOUTS if update_probe and last else ()):
                counts: dict[str, int] = {}
                samples = episode_samples(last, advs, layout, counts)
                t0 = time.perf_counter()
                upd = trainers[name].updater.update(samples) if samples else {}
                probe = {"update_s": time.perf_counter() - t0,
                         "trained_tokens": int(upd.get("trained_tokens", 0)),
                         "input_tokens": int(upd.get("update_input_tokens", 0)),
                         "episode_sequences": counts.get("episode_sequences", 0), "samples": len(samples)}
                probe["tokens_per_trained"] = probe["input_tokens"] / max(probe["trained_tokens"], 1)
                sums[name][f"probe_{layout}"] = probe
                for k in ("behaviour_logprob_abs_diff", "behaviour_ratio_std", "behaviour_ratio_min",
                          "behaviour_ratio_max"):
                    if k in upd and layout == "turn":
                        sums[name][k] = upd[k]
        cfg = trainers["after"].cfg
        batch = min(cfg.generation.batch_size, cfg.train.groups_per_step * cfg.train.group_size,
                    cfg.rollout.max_concurrent or cfg.generation.batch_size)
        roof = measure_roofline(trainers["after"].engine.generator, trainers["after"].compute_dtype,
                                batches=(batch,), train_tokens=cfg.train.micro_batch_tokens or 2304,
                                checkpointing=cfg.model.gradient_checkpointing)
        dtypes = {n: str(t.compute_dtype).replace("torch.", "") for n, t in trainers.items()}
    finally:
        for tr in trainers.values():
            tr.close()
    out: dict[str, Any] = {"mix": mix, "preset": preset, "steps": steps, "threads": torch.get_num_threads(),
                           "dtype": dtypes, "roofline": roof,
                           "pure": {"prefill_tok_s": roof["prefill"]["tok_s"],
                                    "decode_tok_s": roof["decode"][0]["tok_s"], "batch": batch,
                                    "prefill_batch": roof["prefill"]["batch"],
                                    "prompt": roof["prefill"]["prompt"], "context": roof["decode"][0]["context"]}}
    for name, a in sums.items():
        n = max(a["steps"], 1)
        out[name] = {**a, "tokens_per_s": a["generated_tokens"] / a["time_generate_s"] if a["time_generate_s"] else 0.0,
                     "step_s_mean": a["time_step_s"] / n, "rollout_s_mean": a["time_rollout_s"] / n,
                     "update_s_mean": a["time_update_s"] / n,
                     "update_s_per_1k_tokens": 1000 * a["time_update_s"] / max(a["generated_tokens"], 1)}
        share = (roofline_share(roof, prefill_tokens=a["prefill_tokens"], generated_tokens=a["generated_tokens"],
                                seconds=a["time_generate_s"], batch=batch) if a["time_generate_s"] > 0 else {})
        out[name]["share_of_pure"] = share.get("share_of_pure", 0.0)
        out[name]["share_of_matmul"] = share.get("share_of_matmul", 0.0)
    b, f = out["before"], out["after"]
    out["ratios"] = {
        "tokens_per_s": f["tokens_per_s"] / max(b["tokens_per_s"], 1e-9),
        "step_s": b["step_s_mean"] / max(f["step_s_mean"], 1e-9),
        "rollout_s": b["rollout_s_mean"] / max(f["rollout_s_mean"], 1e-9),
    }
    if update_probe and "probe_turn" in b:
        out["ratios"]["update_same_batch"] = b["probe_turn"]["update_s"] / max(f["probe_turn"]["update_s"], 1e-9)
        for name in names:
            t, e = out[name]["probe_turn"], out[name]["probe_episode"]
            out["ratios"][f"{name}_episode_vs_turn_update"] = t["update_s"] / max(e["update_s"], 1e-9)
    return out


def format_step(res: dict[str, Any]) -> str:
    """The ``bench step`` table: per arm the steps' rollout and update, then the same-batch update
    probe per sequence layout (tokens put through the update per trained token, update seconds)."""
    lines = [f"step bench: {res['mix']} / preset {res['preset']}, {res['steps']} steps per arm, "
             f"{res['threads']} torch threads; compute dtype before={res['dtype']['before']} "
             f"after={res['dtype']['after']}",
             f"{'arm':8s} {'gen tok':>8s} {'prefill':>8s} {'prompt':>8s} {'tok/s':>7s} {'step s':>8s} "
             f"{'rollout s':>9s} {'update s':>9s} {'upd s/1k tok':>12s} {'of pure':>8s} {'of matmul':>9s}"]
    for name in STEP_ARMS:
        a = res[name]
        lines.append(f"{name:8s} {a['generated_tokens']:8d} {a['prefill_tokens']:8d} {a['prompt_tokens']:8d} "
                     f"{a['tokens_per_s']:7.1f} {a['step_s_mean']:8.1f} {a['rollout_s_mean']:9.1f} "
                     f"{a['update_s_mean']:9.1f} {a['update_s_per_1k_tokens']:12.2f} {a['share_of_pure']:8.1%} "
                     f"{a.get('share_of_matmul', 0.0):9.1%}")
    p = res["pure"]
    r = res["ratios"]
    lines.append(f"pure torch ({res['dtype']['after']}): prefill {p['prefill_tok_s']:.0f} tok/s "
                 f"(batch {p.get('prefill_batch', p['batch'])} x {p['prompt']}), decode {p['decode_tok_s']:.0f} tok/s "
                 f"(batch {p['batch']}, {p['context']}-token context)")
    if "roofline" in res:
        roof = res["roofline"]
        lines.append(f"matmul limit ({res['dtype']['after']}): {roof['matmul_flop_s'] / 1e9:.0f} GFLOP/s, "
                     f"{roof['flops_per_token'] / 1e9:.3f} GFLOP per generated token; 'of matmul' = the "
                     f"rollout's FLOPs / (generate s x that rate); crl-bench bench roofline for the whole table")
        if roof.get("train"):
            t = roof["train"]
            lines.append(f"pure torch forward+backward: {t['tok_s']:.0f} tok/s ({t['rows']} x {t['length']} tokens, "
                         f"{'with' if t['checkpointing'] else 'no'} checkpointing; compute limit "
                         f"{t['compute_bound_tok_s']:.0f} tok/s)")
    lines.append(f"after / before: rollout tok/s {r['tokens_per_s']:.2f}x, step time {r['step_s']:.2f}x faster, "
                 f"rollout time {r['rollout_s']:.2f}x faster")
    if "update_same_batch" in r:
        b, f = res["before"]["probe_turn"], res["after"]["probe_turn"]
        lines.append(f"one update on the same batch ({b['trained_tokens']} trained tokens, recomputed old "
                     f"log-probs), per-turn samples: before {b['update_s']:.1f} s, after {f['update_s']:.1f} s: "
                     f"{r['update_same_batch']:.2f}x faster")
        lines.append(f"{'arm':8s} {'sequences':9s} {'samples':>7s} {'whole eps':>9s} {'input tok':>9s} "
                     f"{'trained':>8s} {'tok/trained':>11s} {'update s':>8s}")
        for name in STEP_ARMS:
            for layout in ("turn", "episode"):
                q = res[name][f"probe_{layout}"]
                lines.append(f"{name:8s} {'per-' + layout:9s} {q['samples']:7d} {q['episode_sequences']:9d} "
                             f"{q['input_tokens']:9d} {q['trained_tokens']:8d} {q['tokens_per_trained']:11.1f} "
                             f"{q['update_s']:8.1f}")
            lines.append(f"{name}: per-episode update {r[name + '_episode_vs_turn_update']:.2f}x faster than per-turn")
    for name in STEP_ARMS:
        a = res[name]
        if "behaviour_logprob_abs_diff" in a:
            lines.append(f"{name}: sampler vs trainer log-probs: mean |diff| {a['behaviour_logprob_abs_diff']:.4f}, "
                         f"ratio std {a['behaviour_ratio_std']:.4f}, min {a['behaviour_ratio_min']:.3f}, "
                         f"max {a['behaviour_ratio_max']:.3f}")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``step`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("step", help=HELP, description="Whole training steps of a preset and mix, "
                              "before (float32, batch-wide prompt head only) vs after (the defaults).")
    add_model_and_env(p, "env id (default minihack-room), the mix when --mix is not given")
    p.add_argument("--mix", default=None, help="env id or mixture (default: --env or minihack-room)")
    p.add_argument("--preset", default="smoke", help="preset (smoke, default, paper)")
    p.add_argument("--train-steps", type=positive_int, default=2, help="training steps per arm")
    p.add_argument("--no-update-probe", action="store_true",
                   help="skip the same-batch update comparison (costly on big presets)")
    p.add_argument("--prompt", choices=PROMPT_LAYOUTS, default=None,
                   help="rollout.prompt (default: the preset's); multiturn episodes are append-only, "
                        "so the update probe compares per-turn samples with one sequence per episode")
    p.add_argument("--max-actions", type=positive_int, default=None,
                   help="rollout.max_steps, actions per episode (default: the preset's)")
    p.add_argument("--micro-batch-tokens", type=positive_int, default=None,
                   help="train.micro_batch_tokens, a bound on each update forward's padded tokens "
                        "(default: the preset's); bounds the update's memory on long multi-turn episodes")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``crl-bench bench step`` with the options of :func:`add_parser` and print :func:`format_step`'s
    table; returns 0."""
    overrides: dict[str, dict] = {}
    rollout = {k: v for k, v in (("prompt", args.prompt), ("max_steps", args.max_actions)) if v is not None}
    if rollout:
        overrides["rollout"] = rollout
    if args.micro_batch_tokens:
        overrides["train"] = {"micro_batch_tokens": args.micro_batch_tokens}
    print(format_step(bench_step(args.model, args.mix or first_env(args), args.preset, args.train_steps,
                                 overrides=overrides or None, update_probe=not args.no_update_probe)))
    return 0
