"""``crl-bench bench step``: whole training steps (rollout + update) of a preset and mix, ``before``
(float32 compute, only the batch-wide prompt head cached, transformers' ``generate``: no bf16, no
per-group heads, no per-episode reuse, not the engine's own decode loop) against
``after`` (the defaults: ``model.dtype: auto``, per-group heads, per-episode reuse for multi-turn
prompts), interleaved step by step; and the share of pure-torch prefill/decode throughput the rollout
reaches.  With ``--engines transformers,vllm`` the arms are one trainer per ``generation.engine``
(:data:`ENGINE_ARMS`) instead, run by the same loop (issue 58: the default CPU engine is decided on
whole steps, not on the rollout alone)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from crl_bench.bench.options import add_model_and_env, first_env, positive_int
from crl_bench.bench.roofline import pure_throughput  # noqa: F401 - its old home; callers may import it here
from crl_bench.prompts import PROMPT_LAYOUTS

__all__ = ["ENGINE_ARMS", "HELP", "STEP_ARMS", "add_parser", "bench_step", "engine_arms", "format_step", "run"]

HELP = "training steps without (before) vs with (after) bf16 and prefix reuse"


STEP_ARMS = {
    # name: (config overrides, engine attributes)
    "before": ({"model": {"dtype": "float32"}}, {"group_heads": False, "keep_sequences": False,
                                                 "decode_loop": False}),
    "after": ({}, {}),
}

#: ``--engines`` arms: one trainer per ``generation.engine``, everything else the preset's defaults
ENGINE_ARMS = {name: ({"generation": {"engine": name}}, {}) for name in ("transformers", "vllm")}


def engine_arms(text: str) -> dict[str, tuple[dict, dict]]:
    """The arms of ``--engines`` (``"transformers,vllm"``): :data:`ENGINE_ARMS` in the order given, the
    first the baseline of the ratios.

    Raises:
        argparse.ArgumentTypeError: an unknown engine, a repeated one, or fewer than two.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINE_ARMS]
    if unknown or len(set(names)) != len(names) or len(names) < 2:
        raise argparse.ArgumentTypeError(f"expected distinct engines among {', '.join(ENGINE_ARMS)} "
                                         f"(at least two, comma-separated), got {text!r}")
    return {n: ENGINE_ARMS[n] for n in names}


def _timed_sync(engine: Any, sums: dict[str, float]) -> None:
    """Wrap ``engine.sync_weights`` so that its seconds add up in ``sums["time_sync_s"]`` (the sync
    runs inside the trainer's update time, after every optimiser step)."""
    sync = engine.sync_weights

    def timed(model: Any) -> None:
        t0 = time.perf_counter()
        try:
            sync(model)
        finally:
            sums["time_sync_s"] += time.perf_counter() - t0

    engine.sync_weights = timed


def bench_step(model: str, mix: str, preset: str, steps: int, threads: int = 0, seed: int = 0,
               overrides: dict | None = None, update_probe: bool = True,
               arms: dict[str, tuple[dict, dict]] | None = None) -> dict[str, Any]:
    """Training steps of ``preset`` on ``mix``, arms ``arms`` (default :data:`STEP_ARMS`; or
    :func:`engine_arms`), interleaved (before, after, after, before, ...) so that machine load hits
    all alike.  The first arm is the baseline of the ratios, the last one their target.

    Each arm is its own :class:`~crl_bench.trainer.loop.Trainer` (same seed, same starting weights,
    method ``grpo``) running ``steps`` real steps; its rollouts follow its own sampled actions, so
    rates (tokens/s) are compared, and step times as means.  With the ``after`` arm's generator the
    roofline (:func:`crl_bench.bench.roofline.measure_roofline`: pure-torch prefill and decode at the
    rollout's batch, matmul FLOP/s) is measured in the same run, and each arm's rollout is stated as
    a share of it (:func:`~crl_bench.bench.roofline.roofline_share`: ``share_of_pure``, the time
    pure-torch forwards need for the arm's prefill and generated tokens over its generate seconds,
    and ``share_of_matmul``).  The roofline needs a transformers generator: it is measured with the
    target arm's engine, or the baseline's where the target's has none (vLLM).  An arm whose engine
    counts no prefill tokens (vLLM, which keeps its own prefix cache) gets no shares (``None``):
    its prompt tokens would overstate the prefill it computed.  ``update_probe=False`` skips the
    same-batch update comparison (it costs about as much as the steps themselves on big presets).
    Weight syncs are timed per arm (``time_sync_s``, ``sync_s_mean``; part of the update seconds).

    Returns:
        dict with per-arm sums (steps, generated tokens, prompt and prefill tokens, rollout /
        generate / update / sync / step seconds), rates, shares of the roofline, ratios
        ``target / baseline``, the arm names (``arms``, ``baseline``, ``target``, ``roofline_arm``),
        the roofline (``roofline``) and the pure-torch rates at the rollout's batch (``pure``).

    Raises:
        ConfigError: an arm's configuration is invalid; with a ``generation.engine: vllm`` arm, a
            preset or override with ``model.lora: true`` or ``backend: ray`` (vLLM needs full
            fine-tuning and the local backend), before any model is loaded.
    """
    import torch

    from crl_bench.bench.roofline import measure_roofline, roofline_share
    from crl_bench.config import ConfigError, build_config, preset_data
    from crl_bench.trainer.loop import Trainer, set_threads
    from crl_bench.trainer.policy import SEQUENCE_LAYOUTS, episode_samples

    set_threads(threads)
    base = {"rollout": {"mix": mix}, "train": {"seed": seed, "steps": steps + 1},
            "model": {"threads": threads, "name": model}, "eval": {"episodes": 0}, "method": "grpo"}
    arms = STEP_ARMS if arms is None else arms
    names = list(arms)
    baseline, target = names[0], names[-1]
    layers = [preset_data(preset), overrides or {}, base]
    if any(over.get("generation", {}).get("engine") == "vllm" for over, _ in arms.values()):
        plain = build_config(layers)
        if plain.model.lora or plain.backend == "ray":
            raise ConfigError(f"bench step --engines: generation.engine=vllm needs full fine-tuning and "
                              f"backend=local, preset {preset!r} has model.lora={str(plain.model.lora).lower()}, "
                              f"backend={plain.backend}")
    configs = {name: build_config([*layers, cfg_over]) for name, (cfg_over, _) in arms.items()}
    trainers, sums = {}, {}
    for name, (_, engine_attrs) in arms.items():
        tr = Trainer(configs[name])
        trainers[name] = tr
        for k, v in engine_attrs.items():
            setattr(tr.engine, k, v)
        sums[name] = {"steps": 0, "generated_tokens": 0, "prompt_tokens": 0, "prefill_tokens": 0,
                      "time_rollout_s": 0.0, "time_generate_s": 0.0, "time_update_s": 0.0,
                      "time_step_s": 0.0, "optimizer_steps": 0.0, "time_sync_s": 0.0}
        _timed_sync(tr.engine, sums[name])      # after the engine's start-up sync: steps' syncs only
    roof_arm = target if hasattr(trainers[target].engine, "generator") else baseline
    last = None
    try:
        for r in range(steps):
            for name in (names if r % 2 == 0 else names[::-1]):
                torch.manual_seed(seed + r)
                res = trainers[name].train_step()
                for k in sums[name]:
                    if k != "time_sync_s":
                        sums[name][k] += res.metrics.get(k, 0) if k != "steps" else 1
                if name == target:
                    last = res.trajectories
        # one update of each arm on the same batch (the last rollout of the target, advantages +-1 by
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
        cfg = trainers[roof_arm].cfg
        batch = min(cfg.generation.batch_size, cfg.train.groups_per_step * cfg.train.group_size,
                    cfg.rollout.max_concurrent or cfg.generation.batch_size)
        roof = measure_roofline(trainers[roof_arm].engine.generator, trainers[roof_arm].compute_dtype,
                                batches=(batch,), train_tokens=cfg.train.micro_batch_tokens or 2304,
                                checkpointing=cfg.model.gradient_checkpointing)
        dtypes = {n: str(t.compute_dtype).replace("torch.", "") for n, t in trainers.items()}
        counted = {n: hasattr(t.engine, "counters") for n, t in trainers.items()}
    finally:
        for tr in trainers.values():
            tr.close()
    out: dict[str, Any] = {"mix": mix, "preset": preset, "steps": steps, "threads": torch.get_num_threads(),
                           "dtype": dtypes, "roofline": roof, "arms": names, "baseline": baseline,
                           "target": target, "roofline_arm": roof_arm,
                           "pure": {"prefill_tok_s": roof["prefill"]["tok_s"],
                                    "decode_tok_s": roof["decode"][0]["tok_s"], "batch": batch,
                                    "prefill_batch": roof["prefill"]["batch"],
                                    "prompt": roof["prefill"]["prompt"], "context": roof["decode"][0]["context"]}}
    for name, a in sums.items():
        n = max(a["steps"], 1)
        out[name] = {**a, "tokens_per_s": a["generated_tokens"] / a["time_generate_s"] if a["time_generate_s"] else 0.0,
                     "step_s_mean": a["time_step_s"] / n, "rollout_s_mean": a["time_rollout_s"] / n,
                     "update_s_mean": a["time_update_s"] / n, "sync_s_mean": a["time_sync_s"] / n,
                     "update_s_per_1k_tokens": 1000 * a["time_update_s"] / max(a["generated_tokens"], 1)}
        if not counted[name]:
            out[name]["share_of_pure"] = out[name]["share_of_matmul"] = None
            continue
        share = (roofline_share(roof, prefill_tokens=a["prefill_tokens"], generated_tokens=a["generated_tokens"],
                                seconds=a["time_generate_s"], batch=batch) if a["time_generate_s"] > 0 else {})
        out[name]["share_of_pure"] = share.get("share_of_pure", 0.0)
        out[name]["share_of_matmul"] = share.get("share_of_matmul", 0.0)
    b, f = out[baseline], out[target]
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


def _pct(value: float | None, width: int) -> str:
    """``value`` as a percentage in ``width`` columns; ``-`` where there is none (an arm without a
    prefill count)."""
    return f"{'-':>{width}s}" if value is None else f"{value:{width}.1%}"


def format_step(res: dict[str, Any]) -> str:
    """The ``bench step`` table: per arm the steps' rollout and update, then the same-batch update
    probe per sequence layout (tokens put through the update per trained token, update seconds).
    With ``--engines`` arms, also each arm's weight-sync seconds per step and a note on the shares."""
    names = res.get("arms", list(STEP_ARMS))
    baseline, target = res.get("baseline", names[0]), res.get("target", names[-1])
    roof_arm = res.get("roofline_arm", target)
    w = max(8, *(len(n) for n in names))
    lines = [f"step bench: {res['mix']} / preset {res['preset']}, {res['steps']} steps per arm, "
             f"{res['threads']} torch threads; compute dtype "
             + " ".join(f"{n}={res['dtype'][n]}" for n in names),
             f"{'arm':{w}s} {'gen tok':>8s} {'prefill':>8s} {'prompt':>8s} {'tok/s':>7s} {'step s':>8s} "
             f"{'rollout s':>9s} {'update s':>9s} {'upd s/1k tok':>12s} {'of pure':>8s} {'of matmul':>9s}"]
    for name in names:
        a = res[name]
        lines.append(f"{name:{w}s} {a['generated_tokens']:8d} {a['prefill_tokens']:8d} {a['prompt_tokens']:8d} "
                     f"{a['tokens_per_s']:7.1f} {a['step_s_mean']:8.1f} {a['rollout_s_mean']:9.1f} "
                     f"{a['update_s_mean']:9.1f} {a['update_s_per_1k_tokens']:12.2f} {_pct(a['share_of_pure'], 8)} "
                     f"{_pct(a.get('share_of_matmul', 0.0), 9)}")
    p = res["pure"]
    r = res["ratios"]
    rd = res["dtype"][roof_arm]
    lines.append(f"pure torch ({rd}): prefill {p['prefill_tok_s']:.0f} tok/s "
                 f"(batch {p.get('prefill_batch', p['batch'])} x {p['prompt']}), decode {p['decode_tok_s']:.0f} tok/s "
                 f"(batch {p['batch']}, {p['context']}-token context)")
    if "roofline" in res:
        roof = res["roofline"]
        lines.append(f"matmul limit ({rd}): {roof['matmul_flop_s'] / 1e9:.0f} GFLOP/s, "
                     f"{roof['flops_per_token'] / 1e9:.3f} GFLOP per generated token; 'of matmul' = the "
                     f"rollout's FLOPs / (generate s x that rate); crl-bench bench roofline for the whole table")
        if roof.get("train"):
            t = roof["train"]
            lines.append(f"pure torch forward+backward: {t['tok_s']:.0f} tok/s ({t['rows']} x {t['length']} tokens, "
                         f"{'with' if t['checkpointing'] else 'no'} checkpointing; compute limit "
                         f"{t['compute_bound_tok_s']:.0f} tok/s)")
    if any(res[n].get("share_of_pure", 0.0) is None for n in names):
        lines.append("no shares ('-') for " + ", ".join(n for n in names if res[n].get("share_of_pure", 0.0) is None)
                     + ": its engine counts no prefill tokens (its own prefix cache), and its prompt tokens "
                       "would overstate the prefill it computed")
    if set(names) <= set(ENGINE_ARMS):
        lines.append("weight sync per step (part of update s): "
                     + ", ".join(f"{n} {res[n]['sync_s_mean']:.2f} s" for n in names))
    lines.append(f"{target} / {baseline}: rollout tok/s {r['tokens_per_s']:.2f}x, step time {r['step_s']:.2f}x "
                 f"faster, rollout time {r['rollout_s']:.2f}x faster")
    if "update_same_batch" in r:
        b, f = res[baseline]["probe_turn"], res[target]["probe_turn"]
        lines.append(f"one update on the same batch ({b['trained_tokens']} trained tokens, recomputed old "
                     f"log-probs), per-turn samples: {baseline} {b['update_s']:.1f} s, {target} {f['update_s']:.1f} s: "
                     f"{r['update_same_batch']:.2f}x faster")
        lines.append(f"{'arm':{w}s} {'sequences':9s} {'samples':>7s} {'whole eps':>9s} {'input tok':>9s} "
                     f"{'trained':>8s} {'tok/trained':>11s} {'update s':>8s}")
        for name in names:
            for layout in ("turn", "episode"):
                q = res[name][f"probe_{layout}"]
                lines.append(f"{name:{w}s} {'per-' + layout:9s} {q['samples']:7d} {q['episode_sequences']:9d} "
                             f"{q['input_tokens']:9d} {q['trained_tokens']:8d} {q['tokens_per_trained']:11.1f} "
                             f"{q['update_s']:8.1f}")
            lines.append(f"{name}: per-episode update {r[name + '_episode_vs_turn_update']:.2f}x faster than per-turn")
    for name in names:
        a = res[name]
        if "behaviour_logprob_abs_diff" in a:
            lines.append(f"{name}: sampler vs trainer log-probs: mean |diff| {a['behaviour_logprob_abs_diff']:.4f}, "
                         f"ratio std {a['behaviour_ratio_std']:.4f}, min {a['behaviour_ratio_min']:.3f}, "
                         f"max {a['behaviour_ratio_max']:.3f}")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``step`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("step", help=HELP, description="Whole training steps of a preset and mix, "
                              "before (float32, batch-wide prompt head only) vs after (the defaults); "
                              "with --engines, one arm per generation.engine.")
    add_model_and_env(p, "env id (default minihack-room), the mix when --mix is not given")
    p.add_argument("--mix", default=None, help="env id or mixture (default: --env or minihack-room)")
    p.add_argument("--preset", default="smoke", help="preset (smoke, default, paper)")
    p.add_argument("--train-steps", type=positive_int, default=2, help="training steps per arm")
    p.add_argument("--engines", type=engine_arms, default=None, metavar="E1,E2",
                   help="arms by generation.engine instead of before/after, e.g. transformers,vllm (the "
                        "first is the baseline of the ratios; the rest of the config is the preset's)")
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
    table; returns 0 (a refused arm set raises :class:`~crl_bench.config.ConfigError`, exit 2)."""
    overrides: dict[str, dict] = {}
    rollout = {k: v for k, v in (("prompt", args.prompt), ("max_steps", args.max_actions)) if v is not None}
    if rollout:
        overrides["rollout"] = rollout
    if args.micro_batch_tokens:
        overrides["train"] = {"micro_batch_tokens": args.micro_batch_tokens}
    extra = {"arms": args.engines} if args.engines else {}
    print(format_step(bench_step(args.model, args.mix or first_env(args), args.preset, args.train_steps,
                                 overrides=overrides or None, update_probe=not args.no_update_probe, **extra)))
    return 0
