"""``crl-bench bench roofline``: this machine's limits for a model, measured: matmul FLOP/s in the compute
dtype at the model's own shapes, memory bandwidth, the model's FLOPs per token, pure-torch prefill and
decode tokens/s with the model's own key/value cache, forward+backward tokens/s of a training
micro-batch, and the bounds they imply.

The other benches state their arms as a share of it (:func:`roofline_share`): ``share of pure`` (how
close an engine comes to bare transformers forwards of the same model for the same tokens) and ``share of
matmul`` (how close it comes to the FLOPs the CPU's matrix units can do). Run it alone on the machine:
its numbers are absolute rates, which other processes on the same cores lower.

FLOPs are counted as ``2 x`` the multiply-accumulates of the model's linear layers (every ``nn.Linear``:
attention projections, MLP, the LM head) plus the attention scores and weighted values
(``4 x layers x heads x head_dim x context`` per token); norms, activations, RoPE and the embedding
lookup are left out (well under 1 % of a decoder's FLOPs). A prefill computes the LM head for one
position per row (as the engines do), a decode step for every token.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from crl_bench.bench.options import DEFAULT_MODEL, non_negative_int

__all__ = ["DEFAULT_BATCHES", "HELP", "add_parser", "cpu_model_name", "format_roofline", "measure_roofline",
           "model_flops", "pure_throughput", "roofline_share", "run"]

HELP = "this machine's matmul, bandwidth and pure-torch forward limits for a model"

#: decode batch sizes measured unless ``--batches`` names others (the rollout's usual batches)
DEFAULT_BATCHES = (8, 32, 64)


def cpu_model_name() -> str:
    """The CPU's model name (``model name`` of ``/proc/cpuinfo``; ``platform.processor()`` where that
    file is missing), or ``"unknown"``."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def model_flops(model: Any) -> dict[str, Any]:
    """The FLOPs of one token through ``model`` (a transformers decoder LM), from its modules and config.

    Returns:
        dict: ``layers``, ``heads``, ``kv_heads``, ``head_dim``, ``hidden``, ``vocab``;
        ``body_params`` (weights of every ``nn.Linear`` but the LM head), ``head_params`` (the LM
        head's: ``vocab x hidden``, tied to the embedding or not), ``linear_flops`` (``2 x
        (body + head)``: FLOPs of one token's matmuls), ``body_flops`` (``2 x body``),
        ``attention_flops_per_context`` (FLOPs of one token's attention per token of context:
        ``4 x layers x heads x head_dim``), ``kv_elements_per_token`` (key/value elements one token adds
        to the cache: ``2 x layers x kv_heads x head_dim``; times the cache dtype's bytes).
    """
    import torch

    cfg = model.config
    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not head)
    head_params = head.weight.numel() if head is not None else 0
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    layers = int(cfg.num_hidden_layers)
    return {"layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "hidden": int(cfg.hidden_size), "vocab": int(cfg.vocab_size),
            "body_params": body, "head_params": head_params,
            "linear_flops": 2 * (body + head_params), "body_flops": 2 * body,
            "attention_flops_per_context": 4 * layers * heads * head_dim,
            "kv_elements_per_token": 2 * layers * kv_heads * head_dim}


def _timed(fn: Callable[[], Any], min_seconds: float) -> float:
    """Seconds per call of ``fn``: one untimed call (warm-up), then chunks of calls (each about a
    quarter of ``min_seconds``) until ``min_seconds`` have passed and at least two chunks ran (one
    when a single call takes ``min_seconds``); the best chunk's mean, so that a chunk slowed by another
    process on the cores does not count."""
    t0 = time.perf_counter()
    fn()
    warm = time.perf_counter() - t0
    n = max(1, int(min_seconds / 4 / max(warm, 1e-9)))
    best, total, chunks = math.inf, 0.0, 0
    while total < min_seconds or (chunks < 2 and warm < min_seconds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - t0
        best, total, chunks = min(best, elapsed / n), total + elapsed, chunks + 1
    return best


def _matmul_flop_s(m: int, k: int, n: int, dtype: Any, device: Any, min_seconds: float) -> float:
    """FLOP/s of ``(m x k) @ (k x n)`` in ``dtype`` as a linear layer computes it (``F.linear`` with an
    ``(n, k)`` weight): ``2 m k n`` FLOPs per call."""
    import torch

    x = torch.randn(m, k, device=device).to(dtype)
    w = torch.randn(n, k, device=device).to(dtype)
    with torch.no_grad():
        return 2.0 * m * k * n / _timed(lambda: torch.nn.functional.linear(x, w), min_seconds)


def _bandwidth(mib: int, device: Any, min_seconds: float) -> dict[str, float]:
    """Memory bandwidth in GB/s (10^9 bytes) from float32 tensors of ``mib`` MiB each: ``copy``
    (``dst.copy_(src)``: the bytes read + written, 2 x the tensor) and ``add`` (``c = a + b`` into a
    preallocated ``c``: 3 x the tensor)."""
    import torch

    n = max(1, mib * 2**20 // 4)
    a, b, c = (torch.rand(n, device=device) for _ in range(3))
    nbytes = n * 4
    copy_gb_s = 2 * nbytes / _timed(lambda: c.copy_(a), min_seconds) / 1e9
    add_gb_s = 3 * nbytes / _timed(lambda: torch.add(a, b, out=c), min_seconds) / 1e9
    return {"copy_gb_s": copy_gb_s, "add_gb_s": add_gb_s, "mib": mib}


def _inference_model(model: Any, dtype: Any) -> Any:
    """``model`` itself when its floating-point weights are in ``dtype`` already, else a copy cast to
    ``dtype`` (as the transformers engine keeps one for generation; buffers stay as they are)."""
    from crl_bench.llm.precision import cast_parameters

    if all(p.dtype == dtype for p in model.parameters() if p.is_floating_point()):
        return model
    import torch

    with torch.no_grad():
        return cast_parameters(copy.deepcopy(model), dtype).eval()


def _decode_rate(model: Any, dtype: Any, batch: int, context: int, steps: int, vocab: int) -> float:
    """Decode tokens/s at ``batch`` rows after a ``context``-token prompt: the prompt's keys and values
    are computed once for one row and repeated over the batch (the cost of attending to them does not
    depend on their values), two untimed steps warm up, then ``steps`` forwards of one token per row
    are timed one by one (greedy next token, the model's ``DynamicCache``); the rate is ``batch`` over
    the median step, so that a step slowed by another process on the cores does not count."""
    import torch
    from transformers import DynamicCache

    from crl_bench.llm.precision import autocast

    dev = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(min(100, vocab - 1), vocab, (1, context), generator=gen).to(dev)
    with torch.no_grad(), autocast(dev, dtype):
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(batch)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True).expand(batch, 1).contiguous()
        for _ in range(2):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def pure_throughput(model: Any, dtype: Any, batch: int = 8, prompt: int = 512, context: int = 300,
                    decode_steps: int = 32) -> dict[str, float]:
    """Tokens/s of the bare model (no engine, no sampling): prefill of ``batch x prompt`` random tokens
    (LM head on the last position only), and decode at ``batch`` rows (one token per row per forward,
    the model's key/value cache) after a ``context``-token prompt.  ``model`` is used as is (its
    weights' dtype), under autocast to ``dtype`` when that differs.  The upper bound an engine's
    generate time is compared with.

    Returns:
        ``{"prefill_tok_s", "decode_tok_s", "batch", "prompt", "context"}`` (tokens per second).
    """
    import torch

    from crl_bench.llm.precision import autocast

    model.eval()
    dev = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad(), autocast(dev, dtype):
        ids = torch.randint(min(100, vocab - 1), vocab, (batch, prompt), generator=gen).to(dev)
        model(input_ids=ids[:, :16], logits_to_keep=1)                  # warm-up
        t0 = time.perf_counter()
        model(input_ids=ids, logits_to_keep=1)
        prefill = batch * prompt / (time.perf_counter() - t0)
    decode = _decode_rate(model, dtype, batch, context, decode_steps, vocab)
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "batch": batch, "prompt": prompt,
            "context": context}


def _train_rate(model: Any, dtype: Any, tokens: int, length: int, response: int, checkpointing: bool,
                min_seconds: float) -> dict[str, Any]:
    """Forward+backward tokens/s of one training micro-batch as trainer/policy.py runs it: a float32
    copy of ``model`` in train mode, the forward under autocast to ``dtype`` (no weight-cast cache), logits of
    the last ``response + 1`` positions (``logits_to_keep``), their chunked float32 log-probs
    (:func:`crl_bench.trainer.losses.token_logprobs`), the backward of the
    mean log-prob of random targets; activation checkpointing (non-reentrant) when ``checkpointing``.
    ``rows = max(1, tokens // length)`` sequences of ``length`` tokens; the weights are not changed."""
    import torch

    from crl_bench.llm.precision import autocast, cast_parameters
    from crl_bench.trainer.losses import token_logprobs

    with torch.no_grad():
        net = cast_parameters(copy.deepcopy(model), torch.float32)
    for p in net.parameters():
        p.requires_grad_(p.is_floating_point())
    if checkpointing:
        if hasattr(net, "activation_checkpointing_enable"):
            net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    dev = next(net.parameters()).device
    vocab = net.config.vocab_size
    rows, keep = max(1, tokens // length), min(response + 1, length)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(min(100, vocab - 1), vocab, (rows, length), generator=gen).to(dev)
    targets = ids[:, length - keep + 1:]

    def step() -> None:
        with autocast(dev, dtype, cache=False):      # as the trainer's update (trainer/policy.py)
            logits = net(input_ids=ids, logits_to_keep=keep, use_cache=False).logits[:, :-1]
        (-token_logprobs(logits, targets).mean()).backward()
        net.zero_grad(set_to_none=True)

    return {"tok_s": rows * length / _timed(step, min_seconds), "rows": rows, "length": length, "logits_kept": keep,
            "checkpointing": checkpointing}


def measure_roofline(model: Any, dtype: Any, batches: Sequence[int] = DEFAULT_BATCHES, prompt: int = 512,
                     context: int = 300, decode_steps: int = 32, train_tokens: int = 2304,
                     checkpointing: bool = True, *, prefill_batch: int | None = None, train_length: int = 576,
                     train_response: int = 64, square: int = 2048, bandwidth_mib: int = 256,
                     min_seconds: float = 0.2) -> dict[str, Any]:
    """Measure this machine's limits for ``model`` in the compute dtype ``dtype``.

    Args:
        model: a transformers decoder LM (e.g. float32 master weights as the trainer loads them).
            Inference runs on it when its weights are in ``dtype``, else on a copy cast to ``dtype``
            (as the transformers engine generates); training runs on a float32 copy under autocast.
            ``model`` itself is not changed (it is put in eval mode).
        dtype: the compute dtype (``torch.float32`` / ``torch.bfloat16`` / ``torch.float16``).
        batches: decode batch sizes (rows per forward) to measure decode at.
        prompt: tokens per row of the timed prefill; ``context``: tokens of the prompt before decoding.
        decode_steps: timed decode forwards per batch.
        train_tokens: tokens of the training micro-batch (``train.micro_batch_tokens``); 0 skips it.
        checkpointing: activation checkpointing in the training forward (``model.gradient_checkpointing``).
        prefill_batch: rows of the timed prefill (default: the smallest of ``batches``, at most 8).
        train_length, train_response: tokens per training row and response tokens whose logits are
            kept (rows = ``train_tokens // train_length``).
        square: size of the square matmul; ``bandwidth_mib``: MiB per tensor of the bandwidth probe;
        min_seconds: least time each matmul/bandwidth/training probe repeats for.

    Returns:
        dict (rates in tokens/s, FLOP/s, GB/s = 10^9 bytes/s): ``model`` (:func:`model_flops`),
        ``dtype``, ``torch``, ``threads``, ``cpu``, ``cpu_bf16_units``, ``device``, ``date`` (UTC, ISO);
        ``matmul``: a list of ``{"name", "m", "k", "n", "flop_s"}`` (the model's MLP up-projection
        ``hidden x intermediate`` and LM head ``hidden x vocab`` at ``m`` = each decode batch and =
        the prefill's rows x prompt, and a ``square`` matmul); ``matmul_flop_s`` (the best of them:
        the attainable rate); ``bandwidth`` (:func:`_bandwidth`) and ``bandwidth_gb_s`` (the better
        of copy and add); ``weight_bytes`` (bytes of the linear weights in ``dtype``: what one
        decode step reads); ``kv_bytes_per_token``; ``flops_per_token`` (a decode token at
        ``context``: linear + attention), ``flops_per_prefill_token`` (body + attention at half the
        prompt + the LM head once per row); ``prefill`` ``{"batch", "prompt", "tok_s",
        "compute_bound_tok_s"}``; ``decode``: a list per batch ``{"batch", "context", "tok_s",
        "compute_bound_tok_s", "weights_bound_tok_s", "weights_kv_bound_tok_s"}`` (bandwidth /
        bytes read per step x batch, without and with the key/value cache); ``train`` (None when
        ``train_tokens`` is 0) ``{"tokens", "rows", "length", "logits_kept", "checkpointing",
        "tok_s", "flops_per_token", "compute_bound_tok_s"}`` where ``flops_per_token`` is 3 x a
        forward's (forward + backward), plus one more forward of the body with checkpointing;
        ``load`` ``{"start", "end", "cpus"}`` (1-minute load averages around the measurement, and the
        CPU count).

    Raises:
        ValueError: an empty ``batches``, or a size below 1.
    """
    import torch

    from crl_bench.llm.precision import cpu_bf16_units

    batches = sorted({int(b) for b in batches})
    if not batches or batches[0] < 1 or min(prompt, context, decode_steps, square, bandwidth_mib) < 1:
        raise ValueError("roofline: batches, prompt, context, decode_steps, square and bandwidth_mib must be >= 1")
    prefill_batch = prefill_batch or min(batches[0], 8)
    load_start = _load_average()
    model.eval()
    dev = next(model.parameters()).device
    fl = model_flops(model)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    out: dict[str, Any] = {
        "model": fl, "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpu": cpu_model_name(), "cpu_bf16_units": cpu_bf16_units(),
        "device": dev.type, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    hidden, inter = fl["hidden"], int(getattr(model.config, "intermediate_size", 4 * fl["hidden"]))
    shapes = [(f"mlp up, decode {b}", b, hidden, inter) for b in batches]
    shapes += [(f"lm head, decode {b}", b, hidden, fl["vocab"]) for b in batches]
    rows = prefill_batch * prompt
    shapes += [(f"mlp up, prefill {prefill_batch}x{prompt}", rows, hidden, inter),
               (f"lm head, {rows} rows", rows, hidden, fl["vocab"]), (f"square {square}", square, square, square)]
    out["matmul"] = [{"name": name, "m": m, "k": k, "n": n,
                      "flop_s": _matmul_flop_s(m, k, n, dtype, dev, min_seconds)} for name, m, k, n in shapes]
    peak = out["matmul_flop_s"] = max(r["flop_s"] for r in out["matmul"])
    out["bandwidth"] = _bandwidth(bandwidth_mib, dev, min_seconds)
    bw = out["bandwidth_gb_s"] = max(out["bandwidth"]["copy_gb_s"], out["bandwidth"]["add_gb_s"])
    out["weight_bytes"] = (fl["body_params"] + fl["head_params"]) * itemsize
    out["kv_bytes_per_token"] = fl["kv_elements_per_token"] * itemsize
    out["flops_per_token"] = fl["linear_flops"] + fl["attention_flops_per_context"] * context
    out["flops_per_prefill_token"] = (fl["body_flops"] + fl["attention_flops_per_context"] * (prompt + 1) / 2
                                      + 2 * fl["head_params"] / prompt)

    infer = _inference_model(model, dtype)
    pure = pure_throughput(infer, dtype, prefill_batch, prompt, context, decode_steps)
    out["prefill"] = {"batch": prefill_batch, "prompt": prompt, "tok_s": pure["prefill_tok_s"],
                      "compute_bound_tok_s": peak / out["flops_per_prefill_token"]}
    decode = []
    for b in batches:
        rate = pure["decode_tok_s"] if b == prefill_batch else _decode_rate(
            infer, dtype, b, context, decode_steps, fl["vocab"])
        step_kv = b * (context + 2 + decode_steps / 2) * out["kv_bytes_per_token"]
        decode.append({"batch": b, "context": context, "tok_s": rate,
                       "compute_bound_tok_s": peak / out["flops_per_token"],
                       "weights_bound_tok_s": bw * 1e9 / out["weight_bytes"] * b,
                       "weights_kv_bound_tok_s": bw * 1e9 / (out["weight_bytes"] + step_kv) * b})
    out["decode"] = decode
    del infer
    out["train"] = None
    if train_tokens > 0:
        length = max(2, min(train_length, train_tokens))
        tr = _train_rate(model, dtype, train_tokens, length, train_response, checkpointing, min_seconds)
        fwd = fl["body_flops"] + fl["attention_flops_per_context"] * (length + 1) / 2
        fwd += 2 * fl["head_params"] * tr["logits_kept"] / length
        flops = 3 * fwd + (fl["body_flops"] if checkpointing else 0)
        out["train"] = {"tokens": tr["rows"] * length, **tr, "flops_per_token": flops,
                        "compute_bound_tok_s": peak / flops}
    out["load"] = {"start": load_start, "end": _load_average(), "cpus": os.cpu_count() or 1}
    return out


def _load_average() -> float | None:
    """The system's 1-minute load average (runnable processes; ``None`` where the OS has none): a load
    above the cores means other processes shared them while the rates were measured."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _nearest(decode: Sequence[dict[str, Any]], batch: int | None) -> dict[str, Any]:
    """The decode row at the measured batch nearest ``batch`` (on a log scale); ``None``: the fastest."""
    if batch is None:
        return max(decode, key=lambda r: r["tok_s"])
    return min(decode, key=lambda r: (abs(math.log(r["batch"] / max(batch, 1))), r["batch"]))


def roofline_share(roof: dict[str, Any], *, prefill_tokens: int, generated_tokens: int, seconds: float,
                   batch: int | None = None) -> dict[str, Any]:
    """How close a generation of ``prefill_tokens`` computed prompt tokens and ``generated_tokens`` new
    tokens in ``seconds`` came to the limits ``roof`` (:func:`measure_roofline`) measured.

    Args:
        roof: the roofline of the same model and compute dtype.
        prefill_tokens: prompt tokens whose keys and values were computed (tokens served from a prefix
            cache are not counted); generated_tokens: tokens decoded.
        seconds: wall seconds the generation took (> 0).
        batch: rows per decode forward the generation ran at; the measured batch nearest it (log scale)
            is used, ``None``: the fastest measured.

    Returns:
        ``{"share_of_pure", "share_of_matmul", "pure_seconds", "flops", "batch"}``: ``pure_seconds`` =
        ``prefill_tokens / pure prefill tok/s + generated_tokens / pure decode tok/s`` (at the chosen
        measured ``batch``), ``share_of_pure = pure_seconds / seconds``; ``flops`` = ``prefill_tokens x
        flops_per_prefill_token + generated_tokens x flops_per_token``, ``share_of_matmul = flops /
        (seconds x matmul_flop_s)``. Both are fractions (1.0: at the limit); they can exceed 1 where
        the engine does less work than the bare forwards (e.g. a cache the counts miss).

    Raises:
        ValueError: ``seconds`` is not positive, or a token count is negative.
    """
    if not seconds > 0 or prefill_tokens < 0 or generated_tokens < 0:
        raise ValueError(f"roofline_share needs seconds > 0 and token counts >= 0, got {seconds}, "
                         f"{prefill_tokens}, {generated_tokens}")
    row = _nearest(roof["decode"], batch)
    pure_s = prefill_tokens / roof["prefill"]["tok_s"] + generated_tokens / row["tok_s"]
    flops = prefill_tokens * roof["flops_per_prefill_token"] + generated_tokens * roof["flops_per_token"]
    return {"share_of_pure": pure_s / seconds, "share_of_matmul": flops / (seconds * roof["matmul_flop_s"]),
            "pure_seconds": pure_s, "flops": flops, "batch": row["batch"]}


def format_roofline(roof: dict[str, Any], model_name: str = "") -> str:
    """The ``bench roofline`` table: the machine, the model's FLOPs, each matmul's rate, bandwidth,
    then prefill, decode per batch and training forward+backward against their bounds (tokens/s and the
    share of the compute bound)."""
    m = roof["model"]
    units = ", ".join(roof["cpu_bf16_units"]) or "none"
    lines = [f"roofline: {model_name or 'model'} in {roof['dtype']} on {roof['device']} ({roof['cpu']}; "
             f"bf16 units: {units}), torch {roof['torch']}, {roof['threads']} threads, {roof['date']}",
             f"model: {m['layers']} layers, hidden {m['hidden']}, vocab {m['vocab']}; "
             f"{m['body_params'] / 1e6:.1f}M linear params + {m['head_params'] / 1e6:.1f}M LM head; "
             f"{roof['flops_per_token'] / 1e9:.3f} GFLOP per decode token at context "
             f"{roof['decode'][0]['context']} (2 x linear params + 4 x layers x heads x head_dim x context), "
             f"{roof['flops_per_prefill_token'] / 1e9:.3f} per prefill token (LM head once per row)",
             f"{'matmul':34s} {'M':>6s} {'K':>6s} {'N':>6s} {'GFLOP/s':>8s}"]
    for r in roof["matmul"]:
        lines.append(f"{r['name']:34s} {r['m']:6d} {r['k']:6d} {r['n']:6d} {r['flop_s'] / 1e9:8.1f}")
    bw = roof["bandwidth"]
    lines.append(f"memory bandwidth: copy {bw['copy_gb_s']:.1f} GB/s, add {bw['add_gb_s']:.1f} GB/s "
                 f"({bw['mib']} MiB float32 tensors, bytes read + written); weights "
                 f"{roof['weight_bytes'] / 2**20:.0f} MiB, key/value cache {roof['kv_bytes_per_token']} bytes/token")
    lines.append(f"{'pure torch':24s} {'tok/s':>8s} {'compute':>8s} {'of it':>6s} {'weights':>8s} {'+KV':>8s}")
    p = roof["prefill"]
    lines.append(f"{'prefill ' + str(p['batch']) + ' x ' + str(p['prompt']):24s} {p['tok_s']:8.0f} "
                 f"{p['compute_bound_tok_s']:8.0f} {p['tok_s'] / p['compute_bound_tok_s']:6.1%}")
    for d in roof["decode"]:
        lines.append(f"{'decode ' + str(d['batch']) + ' @ ' + str(d['context']):24s} {d['tok_s']:8.0f} "
                     f"{d['compute_bound_tok_s']:8.0f} {d['tok_s'] / d['compute_bound_tok_s']:6.1%} "
                     f"{d['weights_bound_tok_s']:8.0f} {d['weights_kv_bound_tok_s']:8.0f}")
    t = roof["train"]
    if t:
        lines.append(f"{'fwd+bwd ' + str(t['rows']) + ' x ' + str(t['length']):24s} {t['tok_s']:8.0f} "
                     f"{t['compute_bound_tok_s']:8.0f} {t['tok_s'] / t['compute_bound_tok_s']:6.1%}   "
                     f"(autocast over float32 weights, {'with' if t['checkpointing'] else 'no'} checkpointing, "
                     f"logits of {t['logits_kept']} positions, {t['flops_per_token'] / 1e9:.3f} GFLOP/token)")
    lines.append("compute = best matmul GFLOP/s / FLOPs per token; weights, +KV = bandwidth / bytes read per "
                 "decode step x batch (weights only, and with the key/value cache)")
    load = roof.get("load") or {}
    if load.get("start") is not None:
        # at the start the load is other processes' (and the model's loading); at the end it includes
        # this measurement's own threads, about one per CPU
        busy = load["start"] > load["cpus"] - 0.5 or (load["end"] or 0) > load["cpus"] + 0.5
        lines.append(f"load average {load['start']:.1f} at the start, {load['end']:.1f} at the end, {load['cpus']} CPUs"
                     + ("; other processes shared the cores: the rates are lower than alone" if busy else ""))
    return "\n".join(lines)


def _batches(text: str) -> list[int]:
    """argparse type of ``--batches``: comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``roofline`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("roofline", help=HELP, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--threads", type=non_negative_int, default=0, help="torch threads (0: the cores available)")
    p.add_argument("--batches", type=_batches, default=list(DEFAULT_BATCHES),
                   help="decode batch sizes, comma-separated (default 8,32,64)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="compute dtype (auto: bf16 where the CPU or GPU has bf16 units)")
    p.add_argument("--train-tokens", type=non_negative_int, default=2304,
                   help="tokens of the timed training micro-batch (0: skip it)")
    p.add_argument("--no-checkpointing", action="store_true", help="training forward without activation checkpointing")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the measurements to FILE as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``crl-bench bench roofline`` with the options of :func:`add_parser`: load the model (float32
    master weights, as the trainer does), print :func:`format_roofline`'s table and write ``--json``;
    returns 0, or 2 when the JSON file cannot be written."""
    import sys

    from crl_bench.llm.hf_engine import load_model_and_tokenizer
    from crl_bench.llm.precision import DTYPES, resolve_dtype
    from crl_bench.trainer.loop import set_threads

    set_threads(args.threads)
    model, _ = load_model_and_tokenizer(args.model)
    dtype = DTYPES[resolve_dtype(args.dtype, next(model.parameters()).device)]
    roof = measure_roofline(model, dtype, batches=args.batches, train_tokens=args.train_tokens,
                            checkpointing=not args.no_checkpointing)
    print(format_roofline(roof, args.model))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps({"model_name": args.model, **roof}, indent=1) + "\n")
        except OSError as e:
            print(f"crl-bench: error: cannot write {args.json}: {e.strerror or e}", file=sys.stderr)
            return 2
    return 0
