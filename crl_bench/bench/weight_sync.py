"""``crl-bench bench weight-sync``: one weight sync from N data-parallel ranks into a vLLM engine, through the
driver (``devices.weight_sync: host``: rank 0's full state to the driver's model over Ray, then into the engine)
against straight over the weight channel (``direct``: rank 0 broadcasts each tensor to the engine's workers,
crl_bench/llm/weight_channel.py), on the same ranks and engine, interleaved sync by sync, with the bytes each
moves through the driver's memory. After the timing, the engine (last synced directly) serves greedy log-probs
that are checked against a transformers forward of the ranks' weights."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, get_args

from crl_bench.bench.options import DEFAULT_MODEL, gpu_list, positive_int
from crl_bench.config import Sharding

__all__ = ["HELP", "add_parser", "bench_weight_sync", "format_weight_sync", "run"]

HELP = "a weight sync through the driver vs straight from the ranks"

#: largest per-token |log-prob difference| between the engine and a transformers forward of the ranks' weights
#: that passes the check (float32 engine; a bf16 engine is compared at its own precision, :data:`BF16_TOL`)
F32_TOL = 1e-3
#: the same for an engine in bfloat16 (its weights and matmuls round to 8 bits of mantissa)
BF16_TOL = 0.25


def bench_weight_sync(model: str = DEFAULT_MODEL, workers: int = 2, sharding: str = "fsdp", repeats: int = 3,
                      dtype: str = "float32", gpus: list[int] | None = None,
                      engine_gpus: list[int] | None = None) -> dict[str, Any]:
    """Time ``repeats`` syncs of each path, interleaved (host, direct, direct, host, ...), after one untimed
    sync of each, on one :class:`~crl_bench.trainer.data_parallel.DataParallelUpdater` (``workers`` ranks of
    ``model``, float32 master weights) and one :class:`~crl_bench.llm.vllm_engine.VLLMEngine` in ``dtype``.

    Args:
        gpus: on CUDA, the ranks' GPUs (``devices.actor_train``); ``None``: Ray picks. Ignored without CUDA.
        engine_gpus: on CUDA, the engine's GPUs (its own process; ``devices.actor_engine``); ``None``: in this
            process. Over NCCL, rank 0's GPU must not be one of them.

    Returns:
        dict with ``host_s`` / ``direct_s`` (seconds per sync), their means, ``ratio`` (host / direct: > 1 means
        the direct path is faster), ``host_bytes`` (through the driver per host sync: the float32 state in, the
        engine's dtype out) and ``direct_bytes`` (sent over the channel, none through the driver), the channel's
        ``backend``, ``max_logprob_diff`` (engine vs a transformers forward of the ranks' weights, greedy reply)
        and ``passed`` (that difference under :data:`F32_TOL` / :data:`BF16_TOL`), and the settings.

    Raises:
        ImportError: vLLM or Ray is not installed.
    """
    import torch

    from crl_bench.config import GenerationConfig, ModelConfig
    from crl_bench.config_devices import placed
    from crl_bench.llm.base import SamplingParams
    from crl_bench.llm.hf_engine import load_model_and_tokenizer
    from crl_bench.llm.vllm_engine import VLLMEngine
    from crl_bench.trainer.data_parallel import DataParallelUpdater

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    base, tok = load_model_and_tokenizer(model, "float32")
    params = sum(p.numel() for p in base.parameters() if p.requires_grad)
    with torch.no_grad():               # the ranks' weights differ from the engine's start: a sync must show
        for p in base.parameters():
            p.mul_(1.01)
    up = DataParallelUpdater(base, torch.optim.AdamW(base.parameters(), lr=1e-6), tok.pad_token_id,
                             workers=workers, sharding=sharding, threads=max(1, threads // workers),
                             gpus=placed(gpus or []))
    engine = None
    try:
        engine = VLLMEngine.from_model(base, tok, ModelConfig(name=model, dtype=dtype),
                                       GenerationConfig(vllm_gpu_memory_utilization=0.3), seed=0,
                                       gpus=placed(engine_gpus or []))
        engine.weights_from(up)
        direct = engine.direct
        times: dict[str, list[float]] = {"host": [], "direct": []}

        def sync(arm: str, record: bool) -> None:
            t = time.perf_counter()
            if arm == "host":
                engine.direct = None                    # through the driver: rank 0's state, then the engine
                up.model_stale = True
                up.refresh_model()
                engine.sync_weights(base)
                engine.direct = direct
            else:
                engine.sync_weights(base)
            if record:
                times[arm].append(time.perf_counter() - t)

        sync("host", False)
        sync("direct", False)
        for r in range(repeats):
            for arm in (("host", "direct") if r % 2 == 0 else ("direct", "host")):
                sync(arm, True)
        sync("direct", False)
        ids = tok.apply_chat_template([{"role": "user", "content": "Name a colour in one word."}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        (gen,) = engine.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=12, stop=()))
        up.model_stale = True
        up.refresh_model()
        full = torch.tensor([list(ids) + list(gen.response_ids)], device=next(base.parameters()).device)
        with torch.no_grad():
            logits = base(full).logits[0, len(ids) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(1, full[0, len(ids):, None]).squeeze(1).cpu()
        diff = float((ref - torch.tensor(gen.logprobs)).abs().max()) if gen.response_ids else 0.0
        backend = up.backend
    finally:
        if engine is not None:
            engine.close()
        up.close()
    itemsize = 4 if dtype == "float32" else 2
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    return {"model": model, "workers": workers, "sharding": sharding, "dtype": dtype, "params": params,
            "backend": backend, "host_s": times["host"], "direct_s": times["direct"],
            "host_mean_s": mean["host"], "direct_mean_s": mean["direct"],
            "ratio": mean["host"] / max(mean["direct"], 1e-9),
            "host_bytes": params * (4 + itemsize), "direct_bytes": params * itemsize,
            "max_logprob_diff": diff, "passed": diff < (F32_TOL if dtype == "float32" else BF16_TOL)}


def format_weight_sync(res: dict[str, Any]) -> str:
    """The ``bench weight-sync`` table."""
    gib = 2**30
    return "\n".join([
        f"weight-sync bench: {res['model']} ({res['params'] / 1e6:.0f} M trainable parameters), {res['workers']} "
        f"{res['sharding']} ranks -> a vLLM engine in {res['dtype']}; channel backend {res['backend']}",
        f"{'arm':30s} {'mean s':>8s}  per repeat",
        f"{'host (ranks -> driver -> vLLM)':30s} {res['host_mean_s']:8.2f}  "
        + " ".join(f"{t:.2f}" for t in res["host_s"]),
        f"{'direct (ranks -> vLLM)':30s} {res['direct_mean_s']:8.2f}  "
        + " ".join(f"{t:.2f}" for t in res["direct_s"]),
        f"host / direct: {res['ratio']:.2f}x ({'faster' if res['ratio'] > 1 else 'slower'} direct); through the "
        f"driver's memory per sync: host {res['host_bytes'] / gib:.2f} GiB, direct 0 "
        f"({res['direct_bytes'] / gib:.2f} GiB over the channel)",
        f"served after a direct sync vs a transformers forward of the ranks' weights: max |log-prob difference| "
        f"{res['max_logprob_diff']:.2e} -> {'PASS' if res['passed'] else 'FAIL'}"])


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``weight-sync`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("weight-sync", help=HELP, description="One weight sync from data-parallel ranks "
                              "into a vLLM engine through the driver (devices.weight_sync: host) vs straight "
                              "over the weight channel (direct), interleaved.")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--workers", type=positive_int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument("--sharding", choices=get_args(Sharding), default="fsdp")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed syncs per arm")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the engine's dtype")
    p.add_argument("--gpus", type=gpu_list, default=None, help="on CUDA, the ranks' GPUs, comma-separated")
    p.add_argument("--engine-gpus", type=gpu_list, default=None, help="on CUDA, the engine's GPUs (its own "
                   "process; default: in this process)")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``crl-bench bench weight-sync`` and print :func:`format_weight_sync`'s table; returns 0, or 1 when the
    served log-probs fail the check."""
    res = bench_weight_sync(args.model, args.workers, args.sharding, args.repeats, args.dtype, args.gpus,
                            args.engine_gpus)
    print(format_weight_sync(res))
    return 0 if res["passed"] else 1
