"""``crl-bench bench update-peak``: the peak memory of an actor update of a model shaped like the paper's,
measured, against what ``crl-bench plan`` counts for it (trainer/memory_plan.py), and extrapolated to all
of the model's layers.

The model is built from a shape's configuration with random weights and fewer decoder layers (no download:
:data:`SHAPES` holds Qwen2.5-7B's and Qwen3-4B's configurations), float32 master weights, activation
checkpointing, AdamW, bf16 compute where the device has it; one sequence of ``tokens`` tokens (one prompt
token, the rest trained) in one micro-batch. The update runs twice and the second one is measured: AdamW's
moments exist from the first update on, so this is the steady state a run's updates reach. The plan counts
the same update as ``16 bytes x parameters`` (weights, gradients, two moments) plus the checkpointed
activations and the log-prob peak of the micro-batch; the law checked is that the measured peak lies
within :data:`PLAN_BOUNDS` of that count. Two layer counts give the per-layer slope, which with the
measured peak of the smaller model gives the full model's peak, printed beside the plan's figure for it.

Where it measures: on CUDA, the caching allocator's peak (``torch.cuda.max_memory_allocated``) minus what
was allocated before the model was built; on CPU the case runs in a subprocess (bench memory's
``MALLOC_ENV``) and the figure is its peak resident size during the second update minus the resident size
before the model was built.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from crl_bench.bench.options import positive_int

__all__ = ["HELP", "PLAN_BOUNDS", "SHAPES", "add_parser", "bench_update_peak", "format_update_peak", "run",
           "shape_config"]

HELP = "one steady-state update of a paper-shaped model (fewer layers), measured against the plan's count"

#: the paper's models as transformers configurations (the published config.json values that size memory)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-7b": ("Qwen2Config", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152_064,
                                       tie_word_embeddings=False, max_position_embeddings=32_768)),
    "qwen3-4b": ("Qwen3Config", dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                     vocab_size=151_936, tie_word_embeddings=True, max_position_embeddings=262_144)),
}
#: measured / counted: the plan may overstate an update (it counts every log-prob transient at once) but must
#: not understate it by more than the allocator's rounding
PLAN_BOUNDS = (0.5, 1.05)
GIB = 1024 ** 3


def shape_config(shape: str, layers: int | None = None, **overrides: Any) -> Any:
    """The transformers configuration of ``shape`` (:data:`SHAPES`) with ``layers`` decoder layers (default: its
    own) and any field overridden (e.g. a smaller ``hidden_size`` for a CPU check).

    Raises:
        KeyError: an unknown shape.
    """
    import transformers

    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cls, fields = SHAPES[shape]
    values = {**fields, **overrides}
    if layers is not None:
        values["num_hidden_layers"] = int(layers)
    return getattr(transformers, cls)(**values)


def counted(config: Any, tokens: int) -> dict[str, float]:
    """What the plan counts for a one-process update of ``config``'s model on a micro-batch of ``tokens``
    tokens (bytes): ``states`` (16 per parameter), ``activations``, ``logprobs`` and their ``total``."""
    from crl_bench.trainer.memory_plan import ModelShape, micro_batch_peak

    shape = ModelShape.from_config(config)
    act, lp = micro_batch_peak(shape, tokens)
    states = 16.0 * shape.params
    return {"params": float(shape.params), "states": states, "activations": act * GIB, "logprobs": lp * GIB,
            "total": states + (act + lp) * GIB}


def measure_here(shape: str, layers: int, tokens: int, device: str, overrides: dict[str, Any]) -> int:
    """Peak bytes of the second of two updates of ``shape`` with ``layers`` layers in this process, beyond what
    was live before its model was built (module docstring)."""
    import torch

    from crl_bench.llm.memory import hwm_gb, reset_peak_rss, rss_gb, trim_heap
    from crl_bench.llm.precision import DTYPES, resolve_dtype
    from crl_bench.trainer.policy import PolicyUpdater, TokenSample

    cuda = device.startswith("cuda")
    torch.manual_seed(0)
    config = shape_config(shape, layers, **overrides)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    else:
        trim_heap()
        base = (rss_gb() or 0.0) * 1e9
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    updater = PolicyUpdater(model, torch.optim.AdamW(model.parameters(), lr=1e-6), pad_id=0, micro_batch_size=1,
                            micro_batch_tokens=tokens, loss_agg="seq-mean-token-mean",
                            compute_dtype=DTYPES[resolve_dtype("auto", torch.device(device))])
    rng = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=rng).tolist()
    sample = TokenSample(ids[:1], ids[1:], [0.0] * (tokens - 1), 1.0)
    updater.update([sample])                    # AdamW's moments from here on
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        trim_heap()
        if not reset_peak_rss():
            raise RuntimeError("the peak resident size cannot be reset here (/proc/self/clear_refs): measure on CUDA")
    updater.update([sample])
    if cuda:
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    peak = hwm_gb()
    if peak is None:
        raise RuntimeError("no peak resident size here (/proc/self/status): measure on CUDA")
    return int(peak * 1e9 - base)


def _measure(shape: str, layers: list[int], tokens: int, device: str, overrides: dict[str, Any]) -> list[int]:
    """:func:`measure_here` for each layer count, in this process on CUDA, in one subprocess on CPU."""
    if device.startswith("cuda"):
        return [measure_here(shape, n, tokens, device, overrides) for n in layers]
    from crl_bench.bench.memory import MALLOC_ENV

    case = json.dumps({"shape": shape, "layers": layers, "tokens": tokens, "device": device, "overrides": overrides})
    proc = subprocess.run([sys.executable, "-m", "crl_bench.bench.update_peak", "--case", case], capture_output=True,
                          text=True, env={**os.environ, **MALLOC_ENV})
    if proc.returncode != 0:
        raise RuntimeError(f"update-peak case {case} failed: {proc.stderr[-2000:]}")
    return [int(v) for v in json.loads(proc.stdout.strip().splitlines()[-1])]


def bench_update_peak(shape: str = "qwen2.5-7b", layers: tuple[int, int] = (1, 2), tokens: int = 4096,
                      device: str = "cuda", **overrides: Any) -> dict[str, Any]:
    """Measure the steady-state update of ``shape`` at two layer counts and compare each with the plan's count
    (module docstring).

    Returns:
        dict with ``shape``, ``device``, ``tokens``, ``layers``, ``full_layers``, per layer count ``measured``
        and ``counted`` (bytes; :func:`counted`'s parts), ``ratio`` (measured / counted), the per-layer
        ``slope`` measured and counted, ``full_measured`` (the smaller model's peak plus the slope times the
        layers it lacks) and ``full_counted`` (the plan's count for the whole model), and ``violations``
        (ratios outside :data:`PLAN_BOUNDS`).

    Raises:
        ValueError: the two layer counts are not distinct and at least 1.
        KeyError: an unknown shape.
    """
    lo, hi = sorted(layers)
    if lo < 1 or lo == hi:
        raise ValueError(f"two distinct layer counts >= 1, got {layers}")
    full = shape_config(shape, **overrides)
    measured = _measure(shape, [lo, hi], tokens, device, overrides)
    count = [counted(shape_config(shape, n, **overrides), tokens) for n in (lo, hi)]
    ratio = [m / c["total"] for m, c in zip(measured, count)]
    slope = (measured[1] - measured[0]) / (hi - lo)
    slope_counted = (count[1]["total"] - count[0]["total"]) / (hi - lo)
    missing = full.num_hidden_layers - lo
    violations = [f"{n} layers: measured / counted {r:.2f} outside {PLAN_BOUNDS}"
                  for n, r in zip((lo, hi), ratio) if not PLAN_BOUNDS[0] <= r <= PLAN_BOUNDS[1]]
    return {"shape": shape, "device": device, "tokens": tokens, "layers": [lo, hi],
            "full_layers": full.num_hidden_layers, "overrides": overrides, "measured": measured, "counted": count,
            "ratio": ratio, "slope": slope, "slope_counted": slope_counted,
            "full_measured": measured[0] + slope * missing, "full_counted": counted(full, tokens)["total"],
            "violations": violations}


def format_update_peak(res: dict[str, Any]) -> str:
    """The ``bench update-peak`` table."""
    g = GIB
    small = f" ({', '.join(f'{k}={v}' for k, v in res['overrides'].items())})" if res["overrides"] else ""
    lines = [f"update peak on {res['device']}: {res['shape']}{small}, random weights, one micro-batch of "
             f"{res['tokens']:,} tokens, the second of two updates (AdamW's moments resident)",
             f"{'layers':>6s} {'params':>10s} {'measured GiB':>13s} {'plan GiB':>9s} {'ratio':>6s}  plan's parts "
             "(states / activations / log-probs)"]
    for n, m, c, r in zip(res["layers"], res["measured"], res["counted"], res["ratio"]):
        lines.append(f"{n:6d} {c['params'] / 1e9:9.3f}B {m / g:13.2f} {c['total'] / g:9.2f} {r:6.2f}  "
                     f"{c['states'] / g:.2f} / {c['activations'] / g:.2f} / {c['logprobs'] / g:.2f}")
    lines.append(f"per layer: measured {res['slope'] / g:.3f} GiB, plan {res['slope_counted'] / g:.3f} GiB")
    lines.append(f"all {res['full_layers']} layers: measured (extrapolated) {res['full_measured'] / g:.1f} GiB, "
                 f"plan {res['full_counted'] / g:.1f} GiB")
    lines.append("law holds: the measured peak is within "
                 f"{PLAN_BOUNDS[0]}-{PLAN_BOUNDS[1]} of the plan's count" if not res["violations"]
                 else "LAW VIOLATED: " + "; ".join(res["violations"]))
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``update-peak`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("update-peak", help=HELP, description=__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    p.add_argument("--layers", type=positive_int, nargs=2, default=[1, 2], help="two layer counts (default 1 2)")
    p.add_argument("--tokens", type=positive_int, default=4096, help="tokens of the micro-batch (default 4096)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--check", action="store_true", help="exit 1 when the law does not hold")
    p.add_argument("--json", help="also write the result to this file")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``crl-bench bench update-peak``; returns 1 with ``--check`` when the law does not hold, else 0."""
    res = bench_update_peak(args.shape, tuple(args.layers), args.tokens, args.device)
    print(format_update_peak(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if args.check and res["violations"] else 0


def _case(text: str) -> None:
    import gc

    c = json.loads(text)
    out = []
    for n in c["layers"]:
        out.append(measure_here(c["shape"], n, c["tokens"], c["device"], c["overrides"]))
        gc.collect()                        # the model, its gradients and AdamW's moments go before the next
    print(json.dumps(out))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    _case(p.parse_args().case)
