"""``crl-bench bench rollout``: generated tokens/s of one batched rollout over N envs against the same N
episodes rolled out one env at a time (with and without the prefix cache), same model, tasks, seeds and
sampling; with ``--engine vllm``, the same batched rollout through vLLM against the transformers engine;
with ``--decode``, the transformers engine's own decode loop against ``model.generate``.

``--engine vllm`` (:func:`bench_engines`) measures what a training step sees: the trainer's constrained
replies and prompts, prefix caching on in both engines, and for vLLM the weight sync that follows every
actor update (timed, and counted in a second ratio)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from crl_bench.bench.options import add_model_and_env, first_env, positive_int

__all__ = ["ARMS", "DECODE_ARMS", "ENGINE_ARMS", "HELP", "add_parser", "bench_decode", "bench_engines",
           "bench_rollout", "run"]

HELP = "batched vs sequential"

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
    ``dtype`` is the compute dtype (``model.dtype``; ``auto`` by default).  After the arms, the
    roofline of the same model and dtype (:func:`crl_bench.bench.roofline.measure_roofline`, decode at
    batch 1 and ``n_envs``) is measured, and each arm is stated as a share of it
    (:func:`~crl_bench.bench.roofline.roofline_share` of the arm's computed prompt tokens, the engine's
    ``prefill_tokens`` counter, and generated tokens over its generate seconds, at batch ``n_envs``
    for ``batched`` and 1 for the others).

    Returns:
        dict with per-arm tokens, prefill tokens, generate/wall seconds, tokens/s, ``share_of_pure`` and
        ``share_of_matmul``, the ratios ``tokens_per_s_ratio`` (batched / sequential, same engine
        settings) and ``tokens_per_s_ratio_vs_naive`` (batched / sequential-nocache), and ``roofline``.
    """
    import torch

    from crl_bench.bench.roofline import measure_roofline, roofline_share
    from crl_bench.llm.base import SamplingParams
    from crl_bench.llm.hf_engine import HFEngine, load_model_and_tokenizer
    from crl_bench.llm.precision import DTYPES, resolve_dtype
    from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner
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
    arms = {name: {"tokens": 0, "prefill_tokens": 0, "generate_s": 0.0, "wall_s": 0.0} for name in ARMS}
    names = list(ARMS)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            torch.manual_seed(1234 + r)
            per_call = ARMS[name][0] or len(specs)
            for start in range(0, len(specs), per_call):
                computed = _prefill_count(runners[name].engine)
                runners[name].collect(specs[start:start + per_call])
                st = runners[name].last_stats
                arms[name]["tokens"] += st.generated_tokens
                arms[name]["prefill_tokens"] += _prefill_count(runners[name].engine) - computed
                arms[name]["generate_s"] += st.generate_s
                arms[name]["wall_s"] += st.wall_s
    pool.close()
    roof = measure_roofline(policy, dtype, batches=(1, n_envs), train_tokens=0)
    out: dict[str, Any] = {"env": env_id, "envs": n_envs, "max_steps": max_steps, "repeats": repeats,
                           "threads": torch.get_num_threads(), "dtype": str(dtype).replace("torch.", ""),
                           "roofline": roof}
    for name, a in arms.items():
        out[name] = {**a, "tokens_per_s": a["tokens"] / a["generate_s"] if a["generate_s"] else 0.0}
        if a["generate_s"] > 0:
            share = roofline_share(roof, prefill_tokens=a["prefill_tokens"], generated_tokens=a["tokens"],
                                   seconds=a["generate_s"], batch=n_envs if ARMS[name][0] is None else 1)
            out[name].update(share_of_pure=share["share_of_pure"], share_of_matmul=share["share_of_matmul"])
    out["tokens_per_s_ratio"] = out["batched"]["tokens_per_s"] / max(out["sequential"]["tokens_per_s"], 1e-9)
    out["tokens_per_s_ratio_vs_naive"] = (out["batched"]["tokens_per_s"]
                                          / max(out["sequential-nocache"]["tokens_per_s"], 1e-9))
    return out


def _prefill_count(engine: Any) -> int:
    """Prompt tokens ``engine`` has computed so far (its ``prefill_tokens`` counter; 0 without one)."""
    return int(getattr(engine, "counters", {}).get("prefill_tokens", 0))


ENGINE_ARMS = ("transformers", "vllm")


def bench_engines(model: str, env_id: str, n_envs: int, max_steps: int, repeats: int = 2,
                  threads: int = 0, dtype: str = "auto") -> dict[str, Any]:
    """Batched rollout through vLLM against the transformers engine: same model, tasks, prompts and
    sampling (constrained replies, temperature 1, 16 new tokens), both with their prefix cache.

    Each repeat rolls the ``n_envs`` train tasks out once per engine (the order alternates); before each
    vLLM rollout the model's weights are synced into vLLM, as after every actor update, and timed.
    One warm-up rollout per engine is not counted.

    Args:
        model: model name or folder (the default model unless the command line names another).
        env_id: env whose first ``n_envs`` train tasks are rolled out.
        n_envs: episodes in the batch; max_steps: actions per episode.
        repeats: rollouts per engine; threads: torch threads (0: the cores available).
        dtype: ``model.dtype`` of both engines (``auto``: bf16 where the CPU or GPU has bf16 units).

    Returns:
        ``{"transformers": arm, "vllm": arm, "sync_s": ..., "tokens_per_s_ratio": vllm / transformers,
        "tokens_per_s_ratio_with_sync": ...}`` where an arm holds ``tokens``, ``generate_s``,
        ``wall_s`` and ``tokens_per_s`` (tokens / generate seconds), and ``sync_s`` is the mean seconds
        of one weight sync.

    Raises:
        ImportError: vLLM is not installed.
    """
    import time

    import torch

    from crl_bench.config import GenerationConfig, ModelConfig
    from crl_bench.llm.base import SamplingParams
    from crl_bench.llm.hf_engine import HFEngine, load_model_and_tokenizer
    from crl_bench.llm.precision import DTYPES, resolve_dtype
    from crl_bench.llm.vllm_engine import VLLMEngine, vllm_on_cpu
    from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner
    from crl_bench.trainer.loop import set_threads

    set_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy, tok = load_model_and_tokenizer(model, dtype="float32", device=device)
    name = resolve_dtype(dtype, device)
    vllm = VLLMEngine.from_model(policy, tok, ModelConfig(name=model, dtype=name), GenerationConfig(), seed=0)
    engines = {"transformers": HFEngine(policy, tok, batch_size=max(n_envs, 1), prefix_cache=True,
                                        compute_dtype=DTYPES[name]),
               "vllm": vllm}
    pool = EnvPool(max_steps=max_steps)
    specs = [EpisodeSpec(env_id, task) for task in range(n_envs)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)
    runners = {k: RolloutRunner(e, PromptBuilder(tok), pool, sampling, constrained=True) for k, e in engines.items()}
    for runner in runners.values():
        runner.collect(specs)                 # warm-up (vLLM's first requests, the HF kernels)
    arms = {k: {"tokens": 0, "generate_s": 0.0, "wall_s": 0.0} for k in ENGINE_ARMS}
    syncs = []
    try:
        for r in range(repeats):
            for k in (ENGINE_ARMS if r % 2 == 0 else ENGINE_ARMS[::-1]):
                torch.manual_seed(1234 + r)
                if k == "vllm":
                    t0 = time.perf_counter()
                    vllm.sync_weights(policy)
                    syncs.append(time.perf_counter() - t0)
                runners[k].collect(specs)
                st = runners[k].last_stats
                arms[k]["tokens"] += st.generated_tokens
                arms[k]["generate_s"] += st.generate_s
                arms[k]["wall_s"] += st.wall_s
    finally:
        pool.close()
        vllm.close()
    out: dict[str, Any] = {"env": env_id, "envs": n_envs, "max_steps": max_steps, "repeats": repeats,
                           "threads": torch.get_num_threads(), "dtype": name, "device": device,
                           "vllm_backend": "cpu" if vllm_on_cpu() else "gpu"}
    for k, a in arms.items():
        out[k] = {**a, "tokens_per_s": a["tokens"] / a["generate_s"] if a["generate_s"] else 0.0}
    out["sync_s"] = sum(syncs) / len(syncs) if syncs else 0.0
    hf_rate = max(out["transformers"]["tokens_per_s"], 1e-9)
    out["tokens_per_s_ratio"] = out["vllm"]["tokens_per_s"] / hf_rate
    with_sync = out["vllm"]["tokens"] / max(out["vllm"]["generate_s"] + sum(syncs), 1e-9)
    out["tokens_per_s_ratio_with_sync"] = with_sync / hf_rate
    return out


DECODE_ARMS = {
    # name: HFEngine attributes
    "generate": {"decode_loop": False},
    "loop-padded": {"decode_loop": True, "group_prefill": False},
    "loop": {"decode_loop": True, "group_prefill": True},
}


class _Recorder:
    """An engine wrapper that records every ``generate`` call (prompts, params, allowed replies)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.calls: list[tuple] = []

    def generate(self, prompts, params, allowed=None):
        self.calls.append(([list(p) for p in prompts], params, None if allowed is None else list(allowed)))
        return self.engine.generate(prompts, params, allowed)

    def sync_weights(self, model: Any) -> None:
        self.engine.sync_weights(model)


def bench_decode(model: str, env_id: str, batches: Sequence[int], max_steps: int, repeats: int = 3,
                 threads: int = 0, dtype: str = "auto", temperature: float = 0.0,
                 max_new_tokens: int = 16) -> dict[str, Any]:
    """The transformers engine's decode loop against ``model.generate`` on a rollout's generate calls.

    For each ``b`` in ``batches``: one batched rollout of the first ``b`` train tasks of ``env_id``
    (constrained replies, ``max_new_tokens``, ``max_steps`` actions) through the ``generate`` arm
    records its generate calls (the prompts of each turn); then each repeat replays those calls in
    order through every arm of :data:`DECODE_ARMS`, arms interleaved call by call (order alternating),
    each engine's prefix store emptied at the start of a repeat (as a step's weight sync does), so all
    arms see the same prompts and the same prefix reuse, and machine load hits them alike.  An arm's
    time for a call is its least over the repeats.  At temperature 0 the arms must give the same
    replies (counted in ``mismatches``).  The roofline of the same generator
    (:func:`crl_bench.bench.roofline.measure_roofline`: prefill, decode at batch ``b`` after a prompt of
    the calls' mean length, the matmul limit), measured right after, gives each arm's share of it
    (:func:`crl_bench.bench.roofline.roofline_share`: ``share_of_pure``, ``share_of_matmul``).

    Returns:
        ``{"batches": {b: {arm: {tokens, prefill_tokens, prefill_positions, generate_s, tokens_per_s, share_of_pure,
        share_of_matmul}, "roofline": ..., "calls": ..., "context": ..., "mismatches": ..., "ratio": {arm: tok/s over
        generate's}}}, ...}``.
    """
    import time

    import torch

    from crl_bench.bench.roofline import measure_roofline, roofline_share
    from crl_bench.llm.base import SamplingParams
    from crl_bench.llm.hf_engine import HFEngine, load_model_and_tokenizer
    from crl_bench.llm.precision import DTYPES, resolve_dtype
    from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner
    from crl_bench.trainer.loop import set_threads

    set_threads(threads)
    policy, tok = load_model_and_tokenizer(model)
    cdtype = DTYPES[resolve_dtype(dtype)]
    pool = EnvPool(max_steps=max_steps)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    engines = {name: HFEngine(policy, tok, batch_size=max(batches), compute_dtype=cdtype, **attrs)
               for name, attrs in DECODE_ARMS.items()}
    out: dict[str, Any] = {"env": env_id, "max_steps": max_steps, "repeats": repeats, "temperature": temperature,
                           "threads": torch.get_num_threads(), "dtype": str(cdtype).replace("torch.", ""),
                           "batches": {}}
    names = list(DECODE_ARMS)
    try:
        for name in names:                    # warm-up: one-off costs hit no arm
            RolloutRunner(engines[name], PromptBuilder(tok), pool, sampling).collect([EpisodeSpec(env_id, 0)])
        for b in batches:
            rec = _Recorder(engines["generate"])
            engines["generate"].clear_prefix_cache()
            torch.manual_seed(1234)
            RolloutRunner(rec, PromptBuilder(tok), pool, sampling).collect(
                [EpisodeSpec(env_id, task) for task in range(b)])
            calls = rec.calls
            best = {n: [float("inf")] * len(calls) for n in names}
            arms = {n: {"tokens": 0, "prefill_tokens": 0, "prefill_positions": 0} for n in names}
            mismatches = 0
            for r in range(repeats):
                for e in engines.values():
                    e.clear_prefix_cache()
                replies: dict[str, list] = {}
                for k, (prompts, params, allowed) in enumerate(calls):
                    order = names if (r + k) % 2 == 0 else names[::-1]
                    for name in order:
                        eng = engines[name]
                        before, positions = _computed(eng), eng.counters["prefill_positions"]
                        torch.manual_seed(1234 + 1000 * r + k)
                        t0 = time.perf_counter()
                        gens = eng.generate(prompts, params, allowed)
                        best[name][k] = min(best[name][k], time.perf_counter() - t0)
                        replies[name] = [g.response_ids for g in gens]
                        if r == 0:
                            arms[name]["tokens"] += sum(len(g) for g in replies[name])
                            arms[name]["prefill_tokens"] += _computed(eng) - before
                            arms[name]["prefill_positions"] += eng.counters["prefill_positions"] - positions
                    if temperature <= 0:
                        mismatches += sum(replies[n] != replies["generate"] for n in names)
            context = int(sum(len(p) for c in calls for p in c[0]) / max(sum(len(c[0]) for c in calls), 1))
            roof = measure_roofline(engines["generate"].generator, cdtype, batches=(b,),
                                    prompt=max(16, min(context, 4096 // b)), context=min(context, 512),
                                    decode_steps=16, train_tokens=0, prefill_batch=b)
            row: dict[str, Any] = {"roofline": roof, "context": context, "calls": len(calls),
                                   "mismatches": mismatches}
            for name, a in arms.items():
                secs = sum(best[name])
                share = roofline_share(roof, prefill_tokens=a["prefill_tokens"], generated_tokens=a["tokens"],
                                       seconds=secs, batch=b) if secs else {"share_of_pure": 0.0,
                                                                            "share_of_matmul": 0.0}
                row[name] = {**a, "generate_s": secs, "tokens_per_s": a["tokens"] / secs if secs else 0.0,
                             "share_of_pure": share["share_of_pure"], "share_of_matmul": share["share_of_matmul"]}
            base = max(row["generate"]["tokens_per_s"], 1e-9)
            row["ratio"] = {name: row[name]["tokens_per_s"] / base for name in names}
            out["batches"][b] = row
    finally:
        pool.close()
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``rollout`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("rollout", help=HELP, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    add_model_and_env(p, "env id (default minihack-room)")
    p.add_argument("--envs", type=positive_int, default=8, help="episodes in the batch")
    p.add_argument("--max-steps", type=positive_int, default=4, help="actions per episode")
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="vllm: the batched rollout through vLLM against the transformers engine")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="rollouts per arm (--engine vllm, default 2) or replays per arm (--decode, default 3)")
    p.add_argument("--dtype", default="auto", help="model.dtype of both engines (--engine vllm, --decode)")
    p.add_argument("--decode", action="store_true",
                   help="the transformers engine's own decode loop vs model.generate, at each of --batches")
    p.add_argument("--batches", type=_batch_list, default=(8, 32, 64),
                   help="comma-separated batch sizes of --decode (default 8,32,64)")
    p.add_argument("--threads", type=int, default=0, help="torch threads of --decode (0: the cores available)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of --decode (0: greedy, every arm generates the same replies)")
    return p


def _computed(engine: Any) -> int:
    """Prompt tokens ``engine`` has put through the model so far (its prefills and shared heads)."""
    return engine.counters["prefill_tokens"] + engine.counters["head_tokens"]


def _batch_list(text: str) -> tuple[int, ...]:
    """``8,32,64`` -> ``(8, 32, 64)``; argparse turns the ValueError into a one-line usage error."""
    out = tuple(positive_int(x) for x in text.split(",") if x.strip())
    if not out:
        raise ValueError("no batch size")
    return out


def run(args: argparse.Namespace) -> int:
    """Run ``crl-bench bench rollout`` with the options of :func:`add_parser` and print its table;
    returns 0."""
    env_id = first_env(args)
    if getattr(args, "decode", False):
        return _run_decode(args, env_id)
    if getattr(args, "engine", "transformers") == "vllm":
        return _run_engines(args, env_id)
    res = bench_rollout(args.model, env_id, args.envs, args.max_steps)
    print(f"rollout bench: {env_id}, {res['envs']} episodes x up to {res['max_steps']} actions, "
          f"{res['threads']} torch threads, compute dtype {res['dtype']}")
    _print_arms(res, "arm", ARMS, 20)
    roof = res.get("roofline")
    if roof:
        dec = ", ".join(f"{d['tok_s']:.0f} at batch {d['batch']}" for d in roof["decode"])
        print(f"roofline ({res['dtype']}): pure torch prefill {roof['prefill']['tok_s']:.0f} tok/s, decode {dec} "
              f"tok/s; matmul {roof['matmul_flop_s'] / 1e9:.0f} GFLOP/s ('of pure', 'of matmul': "
              f"crl_bench/bench/roofline.py)")
    print(f"tokens/s ratio, batched / one env at a time (same engine): {res['tokens_per_s_ratio']:.2f}x")
    print(f"tokens/s ratio, batched / naive one env at a time (no prefix cache): "
          f"{res['tokens_per_s_ratio_vs_naive']:.2f}x")
    return 0


def _print_arms(res: dict[str, Any], head: str, names: Sequence[str], width: int) -> None:
    """One table row per arm: tokens, generate seconds, wall seconds, tokens/s; and the shares of the
    roofline (pure-torch forwards, matmul limit) where the arms have them."""
    shares = all("share_of_pure" in res[name] for name in names)
    extra = f" {'of pure':>8s} {'of matmul':>9s}" if shares else ""
    print(f"{head:{width}s} {'tokens':>8s} {'generate s':>11s} {'wall s':>8s} {'tok/s':>8s}{extra}")
    for name in names:
        a = res[name]
        extra = f" {a['share_of_pure']:8.1%} {a['share_of_matmul']:9.1%}" if shares else ""
        print(f"{name:{width}s} {a['tokens']:8d} {a['generate_s']:11.2f} {a['wall_s']:8.2f} {a['tokens_per_s']:8.2f}"
              f"{extra}")


def _run_engines(args: argparse.Namespace, env_id: str) -> int:
    import os

    from crl_bench.llm.precision import cpu_bf16_units

    res = bench_engines(args.model, env_id, args.envs, args.max_steps, repeats=args.repeats or 2, dtype=args.dtype)
    print(f"rollout bench, engines: {env_id}, {res['envs']} episodes x up to {res['max_steps']} actions, "
          f"constrained replies, {res['repeats']} rollouts per engine, device {res['device']} "
          f"(vLLM's {res['vllm_backend']} backend), {res['threads']} torch threads, dtype {res['dtype']}")
    if res["device"] == "cpu":
        units = cpu_bf16_units()
        print(f"CPU: {os.cpu_count()} cores, bf16 units: {', '.join(units) if units else 'none (AVX2 or older)'}")
    _print_arms(res, "engine", ENGINE_ARMS, 14)
    print(f"weight sync into vLLM: {res['sync_s']:.2f} s each")
    print(f"tokens/s ratio, vllm / transformers: {res['tokens_per_s_ratio']:.2f}x "
          f"({res['tokens_per_s_ratio_with_sync']:.2f}x counting one weight sync per rollout)")
    return 0


def _run_decode(args: argparse.Namespace, env_id: str) -> int:
    """Print :func:`bench_decode`'s table."""
    import platform

    res = bench_decode(args.model, env_id, args.batches, args.max_steps, repeats=args.repeats or 3,
                       threads=args.threads, dtype=args.dtype, temperature=args.temperature)
    print(f"decode bench: {env_id}, episodes x up to {res['max_steps']} actions, constrained replies, "
          f"temperature {res['temperature']}; each batch's rollout replayed {res['repeats']}x per arm, arms "
          f"interleaved call by call, least time per call; "
          f"{res['threads']} torch threads, dtype {res['dtype']}, CPU {_cpu_name() or platform.processor()}; "
          f"prefill: prompt tokens computed, positions: the generation prefills' positions, padding included")
    print(f"{'batch':>5s} {'arm':11s} {'tokens':>7s} {'prefill':>8s} {'positions':>9s} {'generate s':>10s} "
          f"{'tok/s':>7s} {'vs generate':>11s} {'of pure':>8s} {'of matmul':>9s}")
    for b, row in res["batches"].items():
        for name in DECODE_ARMS:
            a = row[name]
            print(f"{b:5d} {name:11s} {a['tokens']:7d} {a['prefill_tokens']:8d} {a['prefill_positions']:9d} "
                  f"{a['generate_s']:10.2f} "
                  f"{a['tokens_per_s']:7.2f} {row['ratio'][name]:10.2f}x {a['share_of_pure']:8.1%} "
                  f"{a['share_of_matmul']:9.1%}")
        if res["temperature"] <= 0:
            print(f"{b:5d} {row['calls']} generate calls; replies differing from generate's: {row['mismatches']}")
        r = row["roofline"]
        print(f"{b:5d} pure torch: prefill {r['prefill']['tok_s']:.0f} tok/s ({b} x {r['prefill']['prompt']}), "
              f"decode {r['decode'][0]['tok_s']:.0f} tok/s ({row['context']}-token mean prompt, "
              f"{r['decode'][0]['context']} used); matmul {r['matmul_flop_s'] / 1e9:.0f} GFLOP/s")
    return 0


def _cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
