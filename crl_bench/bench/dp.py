"""``crl-bench bench dp``: one policy update of a model on the same batch, in this process
(:class:`~crl_bench.trainer.policy.PolicyUpdater`, ``train.workers=1``) against N data-parallel workers
(:class:`~crl_bench.trainer.data_parallel.DataParallelUpdater`, gloo on CPU / NCCL on GPUs), interleaved
repeat by repeat so that machine load hits both alike; prints the ratio, where the data-parallel time
goes (the workers' compute, gathering and copying back the weights, the rest of the Ray round trip),
and how far the two updates' weights are apart after the first update."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, get_args

from crl_bench.bench.options import DEFAULT_MODEL, gpu_list, non_negative_int, positive_int
from crl_bench.config import Sharding

__all__ = ["HELP", "add_parser", "bench_dp", "format_dp", "run", "synthetic_batch"]

HELP = "one update in-process vs N data-parallel workers"


def synthetic_batch(tokenizer: Any, groups: int, group_size: int, prompt_tokens: int, response_tokens: int,
                    seed: int = 0) -> list:
    """``groups * group_size`` one-turn episodes (one sequence each): a shared system prompt, a per-group
    task (prompts about ``prompt_tokens`` long, the group's episodes share it, as GRPO groups do),
    random response tokens of ``response_tokens`` (+-25 %), advantages +-1 alternating, behaviour
    log-probs 0 (the update recomputes them: ``recompute_old_logprobs``).  Returns TokenSamples."""
    import random

    from crl_bench.trainer.policy import TokenSample

    rng = random.Random(seed)
    system = tokenizer.encode("<|im_start|>system\nYou are an agent in a text game. Think, then answer "
                              "with one admissible action in <answer></answer>.<|im_end|>\n")
    vocab = range(1000, 20000)
    out = []
    for g in range(groups):
        task = [rng.choice(vocab) for _ in range(max(1, prompt_tokens - len(system)))]
        for k in range(group_size):
            r = max(1, int(response_tokens * rng.uniform(0.75, 1.25)))
            resp = [rng.choice(vocab) for _ in range(r)]
            out.append(TokenSample(system + task, resp, [0.0] * r, 1.0 if (g + k) % 2 else -1.0,
                                   sequence=g * group_size + k))
    return out


def bench_dp(model: str = DEFAULT_MODEL, workers: int = 2, sharding: str = "ddp", groups: int = 4,
             group_size: int = 4, prompt_tokens: int = 256, response_tokens: int = 32,
             micro_batch_size: int = 4, repeats: int = 3, threads: int = 0,
             sequential: bool = False, gpus: list[int] | None = None) -> dict[str, Any]:
    """Time one update (the default training settings: AdamW, ``seq-mean-token-mean``, recomputed old
    log-probs folded into the forward, shared prompt prefixes, clip 1.0) of ``model`` on one
    :func:`synthetic_batch`, in-process and with ``workers`` workers, ``repeats`` times each, after
    one untimed warm-up update each (both from the same starting weights: their results are compared).

    Args:
        threads: torch threads of the in-process arm (0: the cores this process may use); each worker gets
            ``threads // workers`` (at least 1), so both arms use the same cores.
        sequential: time all in-process updates, free that arm, then start the workers and time
            theirs (peak memory: one arm); default: both arms resident, updates interleaved
            (in-process, workers, workers, in-process, ...), so load drift hits both alike.
        gpus: on CUDA, the workers' GPUs (one per worker, reserved in a Ray placement group as
            ``devices.actor_train`` places a run's ranks); ``None``: Ray picks. Ignored without CUDA.  Memory:
            each arm holds the model, its gradients and AdamW's two moments per replica (DDP: per
            worker), about 4 x 4 bytes x parameters each (the 135M default: ~2.2 GB).

    Returns:
        dict with ``single_s`` / ``dp_s`` (lists of seconds per update), their means, ``ratio`` (mean
        single / mean data-parallel: > 1 means the workers are faster), ``dp_parts`` (mean
        ``last_timing`` parts), ``setup_s`` (starting the workers), ``rank_devices`` (each worker's device
        and visible GPUs), ``max_weight_diff`` (largest
        absolute weight difference after the first update), ``trained_tokens``, the settings.
    """
    import copy
    import gc

    import torch

    from crl_bench.config_devices import placed
    from crl_bench.llm.hf_engine import load_model_and_tokenizer
    from crl_bench.trainer.data_parallel import DataParallelUpdater
    from crl_bench.trainer.policy import PolicyUpdater

    if threads <= 0:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, threads))
    threads = torch.get_num_threads()
    base, tok = load_model_and_tokenizer(model, "float32")
    samples = synthetic_batch(tok, groups, group_size, prompt_tokens, response_tokens)
    kw = dict(micro_batch_size=micro_batch_size, loss_agg="seq-mean-token-mean", recompute_old_logprobs=True,
              max_grad_norm=1.0)
    times: dict[str, list[float]] = {"single": [], "dp": []}
    parts: list[dict[str, float]] = []
    arms: dict[str, Any] = {}

    def start_single() -> None:
        m1 = copy.deepcopy(base)
        arms["single"] = PolicyUpdater(m1, torch.optim.AdamW(m1.parameters(), lr=1e-6), tok.pad_token_id, **kw)
        arms["s1"] = arms["single"].update(samples)                      # warm-up, and the weight check
        arms["w1"] = {n: p.detach().clone() for n, p in m1.named_parameters()}

    def start_dp() -> None:
        t0 = time.perf_counter()
        arms["dp"] = DataParallelUpdater(base, torch.optim.AdamW(base.parameters(), lr=1e-6), tok.pad_token_id,
                                         **kw, workers=workers, sharding=sharding,
                                         threads=max(1, threads // workers),
                                         gpus=placed(gpus or []))
        arms["setup_s"] = time.perf_counter() - t0
        arms["devices"] = arms["dp"].rank_devices()
        arms["s2"] = arms["dp"].update(samples)                          # warm-up
        arms["diff"] = max(float((arms["w1"][n] - p.detach()).abs().max()) for n, p in base.named_parameters())

    def timed(arm: str) -> None:
        t = time.perf_counter()
        arms[arm].update(samples)
        times[arm].append(time.perf_counter() - t)
        if arm == "dp":
            parts.append(dict(arms["dp"].last_timing))

    try:
        start_single()
        if sequential:              # free the in-process arm (model copy, gradients, AdamW) first
            for _ in range(repeats):
                timed("single")
            del arms["single"]
            gc.collect()
            start_dp()
            for _ in range(repeats):
                timed("dp")
        else:
            start_dp()
            for r in range(repeats):
                for arm in (("single", "dp") if r % 2 == 0 else ("dp", "single")):
                    timed(arm)
    finally:
        if "dp" in arms:
            arms["dp"].close()
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    dp_parts = {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]} if parts else {}
    s1, s2 = arms["s1"], arms["s2"]
    return {"model": model, "workers": workers, "sharding": sharding, "threads": threads,
            "worker_threads": max(1, threads // workers), "samples": len(samples),
            "trained_tokens": int(s1["trained_tokens"]), "micro_batch_size": micro_batch_size,
            "order": "sequential" if sequential else "interleaved",
            "single_s": times["single"], "dp_s": times["dp"], "single_mean_s": mean["single"],
            "dp_mean_s": mean["dp"], "ratio": mean["single"] / max(mean["dp"], 1e-9), "dp_parts": dp_parts,
            "setup_s": arms["setup_s"], "rank_devices": arms["devices"], "max_weight_diff": arms["diff"],
            "loss": (s1["loss"], s2["loss"]), "grad_norm": (s1["grad_norm"], s2["grad_norm"])}


def format_dp(res: dict[str, Any]) -> str:
    """The ``bench dp`` table."""
    p = res["dp_parts"]
    lines = [f"dp bench: {res['model']}, {res['samples']} samples ({res['trained_tokens']} trained tokens), "
             f"micro-batches of {res['micro_batch_size']}; in-process {res['threads']} torch threads, "
             f"{res['workers']} {res['sharding']} workers x {res['worker_threads']} threads; arms timed "
             f"{res['order']}",
             f"{'arm':22s} {'mean s':>8s}  per repeat",
             f"{'in-process (1 worker)':22s} {res['single_mean_s']:8.2f}  "
             + " ".join(f"{t:.2f}" for t in res["single_s"]),
             f"{str(res['workers']) + ' workers':22s} {res['dp_mean_s']:8.2f}  "
             + " ".join(f"{t:.2f}" for t in res["dp_s"]),
             f"in-process / {res['workers']} workers: {res['ratio']:.2f}x "
             f"({'faster' if res['ratio'] > 1 else 'slower'} with workers)"]
    if p:
        rest = p["call_s"] - p["compute_s"] - p["weights_s"]
        lines.append(f"{res['workers']}-worker update split: workers' compute {p['compute_s']:.2f} s, weights "
                     f"gathered {p['weights_s']:.2f} s, Ray round trip (samples, results, weights) {rest:.2f} s, "
                     f"weights copied into the driver's model {p['load_s']:.2f} s")
    lines.append(f"starting the workers (actors, process group, model shipped): {res['setup_s']:.1f} s; ranks on "
                 + ", ".join(res.get("rank_devices", [])))
    lines.append(f"after the first update: max |weight difference| {res['max_weight_diff']:.2e}; loss "
                 f"{res['loss'][0]:.6f} vs {res['loss'][1]:.6f}, grad norm {res['grad_norm'][0]:.6f} vs "
                 f"{res['grad_norm'][1]:.6f}")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``dp`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("dp", help=HELP, description="One policy update of the same batch in-process "
                              "vs N data-parallel workers (Ray actors, one torch.distributed group).")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--workers", type=positive_int, default=2, help="data-parallel workers (default 2)")
    p.add_argument("--sharding", choices=get_args(Sharding), default="ddp")
    p.add_argument("--groups", type=positive_int, default=4, help="groups (prompts) in the batch")
    p.add_argument("--group-size", type=positive_int, default=4, help="episodes per group")
    p.add_argument("--prompt-tokens", type=positive_int, default=256)
    p.add_argument("--response-tokens", type=positive_int, default=32)
    p.add_argument("--micro-batch-size", type=positive_int, default=4)
    p.add_argument("--repeats", type=positive_int, default=3, help="timed updates per arm")
    p.add_argument("--threads", type=non_negative_int, default=0, help="torch threads in-process (0: default); "
                   "each worker gets threads / workers")
    p.add_argument("--gpus", type=gpu_list, default=None, help="on CUDA, the workers' GPUs, comma-separated "
                   "(one per worker, placed as devices.actor_train places a run's ranks; default: Ray picks)")
    p.add_argument("--sequential", action="store_true", help="time the in-process arm, free it, then the "
                   "workers (lower peak memory; default: interleaved)")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``crl-bench bench dp`` with the options of :func:`add_parser` and print :func:`format_dp`'s
    table; returns 0."""
    print(format_dp(bench_dp(args.model, args.workers, args.sharding, args.groups, args.group_size,
                             args.prompt_tokens, args.response_tokens, args.micro_batch_size, args.repeats,
                             args.threads, args.sequential, args.gpus)))
    return 0
