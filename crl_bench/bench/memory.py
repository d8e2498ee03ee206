"""``crl-bench bench memory``: the update's memory laws, measured at small sizes side by side and
extrapolated to a model's shape (docs/scaling.md "Memory laws").

Each law is a pair of arms run on the same inputs, ``before`` (what a plain implementation does) and
``after`` (what the trainer does), at two sizes; the peak memory each arm allocates beyond what was live
before it gives a slope (bytes per unit of size), and the slope gives the paper-scale figure.

* ``logprob``: the log-probs of kept tokens from bf16 logits (``(1, T, V)``, the real vocabulary) with
  their backward. ``before``: one float32 ``log_softmax`` over the whole vocabulary (kept for the backward,
  and its gradient built dense); ``after``: :func:`crl_bench.trainer.losses.token_logprobs` chunked (the
  softmax rebuilt per chunk in the backward; the trainer takes the plain one below
  ``LOGPROB_PLAIN_BYTES``, where memory does not matter). Unit: bytes per position, printed in multiples of V.
* ``autocast-cache``: a stack of float32 linear layers under bf16 autocast with activation checkpointing,
  forward and backward. ``before``: autocast's weight-cast cache on (torch's default: every bf16 cast of a
  weight stays alive until the autocast region ends, which undoes checkpointing for the weights);
  ``after``: the cache off, as :func:`crl_bench.llm.precision.autocast` is called for a checkpointed
  model. Unit: bytes per linear parameter (the law: 2, one bf16 copy).

* ``decode``: replies sampled through the transformers engine (a randomly initialised 2-layer model with the
  default model's vocabulary, 8 rows). ``before``: transformers' ``generate`` with ``output_logits`` and
  ``output_scores``, which keeps two float32 ``(B, V)`` tensors per step for the whole call; ``after``: the
  engine's decode loop (the default), which reads each step's log-prob and entropies and drops the logits.
  Unit: bytes per generated token of a row, printed in multiples of V (the law: 8 before, about 0 after).

Where it measures: on CUDA, the caching allocator's peak (``torch.cuda.max_memory_allocated``) minus what
was allocated before; on CPU, the arms run in a subprocess and each one's peak is the peak resident size
(reset before it through ``/proc/self/clear_refs``) minus the resident size just before it, with the heap
trimmed and every block over 128 KiB mapped on its own (:data:`MALLOC_ENV`) so that the resident size
follows live memory. Numbers carry the C allocator's slack (a few MiB): the slopes are what to read.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from typing import Any

HELP = "memory laws of the update (log-probs, autocast's cast cache) and decoding, measured small, extrapolated"

#: prompts of the ``decode`` law's batch
DECODE_ROWS = 8
#: the vocabulary the log-prob law runs with by default: Qwen2.5's (152,064), the paper's actor
PAPER_VOCAB = 152_064
#: linear parameters of Qwen2.5-7B (the paper's actor) outside the embedding and the head: 28 layers of
#: q, k, v, o (3584 x 3584, 2 x 3584 x 512, 3584 x 3584) and gate, up, down (3 x 3584 x 18944)
PAPER_LINEAR_PARAMS = 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944)
GIB = 1024 ** 3


def full_vocab_logprobs(logits: Any, targets: Any) -> Any:
    """The plain float32 log-softmax over the whole vocabulary, gathered at ``targets``: the ``before``
    arm of the ``logprob`` law (``(B, T, V)`` logits, ``(B, T)`` targets -> ``(B, T)`` float32)."""
    import torch

    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _logprob_case(size: int, arm: str, vocab: int, device: str) -> Any:
    """Inputs and the measured call of one ``logprob`` arm: ``size`` positions of bf16 logits from a
    ``(vocab, 64)`` head, the log-probs of random targets, backward of their weighted sum."""
    import torch

    from crl_bench.trainer.losses import token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, size, 64, generator=g).to(device).requires_grad_()
    head = (torch.randn(vocab, 64, generator=g) * 0.05).to(device=device, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (1, size), generator=g).to(device)
    weights = torch.randn(1, size, generator=g).to(device)
    fn = full_vocab_logprobs if arm == "before" else functools.partial(token_logprobs, plain_bytes=0)

    def call() -> None:
        logits = hidden.to(torch.bfloat16) @ head.T                     # (1, T, V) bf16, as a model returns
        (fn(logits, targets) * weights).sum().backward()

    return call


def _autocast_case(size: int, arm: str, width: int, device: str) -> Any:
    """Inputs and the measured call of one ``autocast-cache`` arm: ``size`` float32 linear layers of
    ``width x width``, each under non-reentrant activation checkpointing, 8 tokens, bf16 autocast with the
    weight-cast cache on (``before``) or off (``after``), forward and backward, with the gradients already
    allocated (as from an update's second micro-batch on), so that the peak is the forward's."""
    import torch
    import torch.utils.checkpoint

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(size)).to(device)
    x = torch.randn(8, width, device=device, requires_grad=True)

    def call() -> None:
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                            cache_enabled=arm == "before"):
            h = x
            for layer in layers:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            loss = h.float().pow(2).mean()
        loss.backward()

    # the gradients exist before the measured call, as they do from an update's second micro-batch on
    call()
    layers.zero_grad(set_to_none=False)
    return call


#: what each law's slopes must be (``--check``, the tests): per arm, (low, high) in the law's printed unit
#: (multiples of V for ``logprob``, bytes per linear parameter for ``autocast-cache``)
LAW_BOUNDS: dict[str, dict[str, tuple[float, float]]] = {
    "logprob": {"before": (12.0, 16.0), "after": (0.0, 5.0)},
    "autocast-cache": {"before": (1.7, 2.3), "after": (-0.3, 0.3)},
    "decode": {"before": (6.0, 10.0), "after": (-0.5, 0.5)},
}

def _decode_case(size: int, arm: str, vocab: int, device: str) -> Any:
    """Inputs and the measured call of one ``decode`` arm: 8 prompts of 16 tokens, ``size`` new tokens
    sampled at temperature 1 from a randomly initialised 2-layer model with the default model's tokenizer
    and vocabulary, through the transformers engine with ``generate`` (``before``: its ``output_logits`` and
    ``output_scores`` kept for the whole call) or with the engine's decode loop (``after``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from crl_bench.llm.base import SamplingParams
    from crl_bench.llm.default_model import DEFAULT_MODEL
    from crl_bench.llm.hf_engine import HFEngine, load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config).to(device).eval()
    engine = HFEngine(model, tok, batch_size=8, prefix_cache=False, decode_loop=arm == "after")
    prompts = [[int(t) for t in torch.randint(100, len(tok), (16,))] for _ in range(8)]
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=size)

    def call() -> None:
        with torch.no_grad():
            engine.generate(prompts, params)

    return call


LAWS: dict[str, dict[str, Any]] = {
    "logprob": {"case": _logprob_case, "unit": "position", "sizes": (1024, 2048)},
    "autocast-cache": {"case": _autocast_case, "unit": "linear parameter", "sizes": (4, 8)},
    "decode": {"case": _decode_case, "unit": "generated token of a row", "sizes": (128, 256)},
}


#: glibc settings of the CPU subprocess: every block over 128 KiB is its own mapping, returned to the kernel when
#: freed, so the resident size follows live memory (the heap's reuse and dynamic threshold otherwise leave freed
#: blocks resident and make the peak depend on the order of frees)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def measure_here(law: str, size: int, arm: str, param: int, device: str) -> tuple[int, bool]:
    """``(peak bytes, reset)``: the peak one arm allocates beyond what was live before it, in this process
    (CUDA: the allocator's peak; CPU: the peak resident size, reset before the arm where Linux allows, minus
    the resident size before). ``reset`` False: the CPU peak could not be reset, so the figure holds only
    for the first case of a fresh process."""
    import torch

    from crl_bench.llm.memory import hwm_gb, peak_rss_gb, reset_peak_rss, rss_gb, trim_heap

    call = LAWS[law]["case"](size, arm, param, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        call()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base), True
    trim_heap()
    reset = reset_peak_rss()
    base = rss_gb() or 0.0
    call()
    peak = hwm_gb()
    return int(((peak if peak is not None else peak_rss_gb()) - base) * 1e9), reset


def _child_run(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "crl_bench.bench.memory", "--cases", json.dumps(cases)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **MALLOC_ENV})
    if proc.returncode != 0:
        raise RuntimeError(f"memory cases {cases} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(cases: list[dict[str, Any]], device: str = "cpu") -> list[int]:
    """Peak bytes of each case (``{"law", "size", "arm", "param"}``), in order (:func:`measure_here`). On CPU
    the cases run in one subprocess with :data:`MALLOC_ENV` (one subprocess each where the peak cannot be
    reset).

    Raises:
        KeyError: an unknown law; RuntimeError: a subprocess failed (its stderr in the message).
    """
    for c in cases:
        if c["law"] not in LAWS:
            raise KeyError(f"unknown law {c['law']!r}; known: {', '.join(LAWS)}")
    if device.startswith("cuda"):
        return [measure_here(c["law"], c["size"], c["arm"], c["param"], device)[0] for c in cases]
    cases = [{**c, "device": device} for c in cases]
    out = _child_run(cases)
    if not all(r["reset"] for r in out):
        out = [_child_run([c])[0] for c in cases]
    return [int(r["peak_bytes"]) for r in out]


def law_cases(law: str, param: int, sizes: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """The cases of ``law``'s two arms at two sizes, in the order :func:`law_result` reads their peaks."""
    lo, hi = sizes or LAWS[law]["sizes"]
    return [{"law": law, "size": n, "arm": arm, "param": param} for arm in ("before", "after") for n in (lo, hi)]


def law_result(law: str, param: int, sizes: tuple[int, int] | None, got: list[int]) -> dict[str, Any]:
    """``{"law", "unit", "param", "sizes", "peaks": {arm: [bytes, bytes]}, "slope": {arm: bytes per unit}}``
    from the peaks of :func:`law_cases` (the slope is the peaks' difference over the sizes')."""
    lo, hi = sizes or LAWS[law]["sizes"]
    peaks = {arm: got[2 * i: 2 * i + 2] for i, arm in enumerate(("before", "after"))}
    units = (hi - lo) * {"logprob": 1, "autocast-cache": param * param, "decode": DECODE_ROWS}[law]
    slope = {arm: (p[1] - p[0]) / units for arm, p in peaks.items()}
    return {"law": law, "unit": LAWS[law]["unit"], "param": param, "sizes": [lo, hi], "peaks": peaks,
            "slope": slope}


def law_slopes(law: str, param: int, device: str = "cpu",
               sizes: tuple[int, int] | None = None) -> dict[str, Any]:
    """Both arms of ``law`` at two sizes, measured (:func:`law_cases`, :func:`measure`, :func:`law_result`)."""
    return law_result(law, param, sizes, measure(law_cases(law, param, sizes), device))


def law_violations(result: dict[str, Any]) -> list[str]:
    """The arms of a :func:`law_slopes` result outside :data:`LAW_BOUNDS` (empty when the law holds)."""
    law = result["law"]
    scale = result["param"] if law in ("logprob", "decode") else 1
    out = []
    for arm, (lo, hi) in LAW_BOUNDS[law].items():
        got = result["slope"][arm] / scale
        if not lo <= got <= hi:
            out.append(f"{law} {arm}: {got:.2f} outside [{lo}, {hi}]")
    return out


def format_laws(results: list[dict[str, Any]], device: str) -> str:
    """The laws as a table, each slope with its paper-scale extrapolation."""
    lines = [f"memory laws on {device} (peak beyond what was live; slopes between two sizes)", ""]
    for r in results:
        if r["law"] == "logprob":
            v = r["param"]
            lines.append(f"logprob (V = {v:,}): bytes per kept position, in multiples of V")
            for arm in ("before", "after"):
                s = r["slope"][arm]
                lines.append(f"  {arm:<7} {s / v:6.2f} V  -> {s * 1000 / GIB * PAPER_VOCAB / v:6.2f} GiB per "
                             f"1,000 positions at V = {PAPER_VOCAB:,}; {s * 32_768 / GIB * PAPER_VOCAB / v:6.1f} "
                             "GiB for a 32k-position micro-batch")
        elif r["law"] == "decode":
            v = r["param"]
            lines.append(f"decode (V = {v:,}): bytes per generated token of a row, in multiples of V")
            for arm in ("before", "after"):
                s = r["slope"][arm] / v
                gib = s * PAPER_VOCAB * 32 * 4096 / GIB
                lines.append(f"  {arm:<7} {s:6.2f} V  -> {gib:6.1f} GiB for 32 replies of 4,096 tokens at V = "
                             f"{PAPER_VOCAB:,}")
        else:
            lines.append("autocast-cache: bytes per linear parameter under checkpointing")
            for arm in ("before", "after"):
                s = r["slope"][arm]
                lines.append(f"  {arm:<7} {s:6.2f} B  -> {s * PAPER_LINEAR_PARAMS / GIB:6.1f} GiB at Qwen2.5-7B's "
                             f"{PAPER_LINEAR_PARAMS / 1e9:.2f} B linear parameters")
        lines.append("")
    return "\n".join(lines).rstrip()


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``memory`` with its options (``--law``, ``--device``, ``--vocab``, ``--width``, ``--json``,
    ``--check``) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("memory", help=HELP, description=__doc__.split("\n\n")[0])
    p.add_argument("--law", action="append", choices=list(LAWS), help="a law to measure (repeatable; default all)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--vocab", type=int, default=PAPER_VOCAB, help="the logprob law's vocabulary")
    p.add_argument("--width", type=int, default=2048, help="the autocast-cache law's layer width")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the measurements to FILE as JSON")
    p.add_argument("--check", action="store_true", help="exit 1 when a slope is outside its law's bounds")
    return p


def run(args: argparse.Namespace) -> int:
    """Measure the laws ``args`` name (all by default), print them with their extrapolation, write
    ``--json``; returns 0, or 1 with ``--check`` when a slope is outside its law's bounds."""
    results = [law_slopes(law, _param(law, args), args.device) for law in (args.law or list(LAWS))]
    print(format_laws(results, args.device))
    if args.json:
        from pathlib import Path

        Path(args.json).write_text(json.dumps(results, indent=2))
    bad = [v for r in results for v in law_violations(r)]
    if getattr(args, "check", False) and bad:
        print("laws broken: " + "; ".join(bad))
        return 1
    return 0


def _param(law: str, args: argparse.Namespace) -> int:
    """A law's size parameter: the vocabulary (``logprob``; ``decode`` takes the default model's), the
    layer width (``autocast-cache``)."""
    if law == "decode":
        from crl_bench.llm.default_model import DEFAULT_MODEL
        from crl_bench.llm.hf_engine import load_tokenizer

        return len(load_tokenizer(DEFAULT_MODEL))
    return args.vocab if law == "logprob" else args.width


def _child(cases: str) -> None:
    out = []
    for c in json.loads(cases):
        peak, reset = measure_here(c["law"], int(c["size"]), c["arm"], int(c["param"]), c["device"])
        out.append({"peak_bytes": peak, "reset": reset})
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--cases":
        _child(sys.argv[2])
    else:
        parser = argparse.ArgumentParser(prog="python -m crl_bench.bench.memory")
        sub = parser.add_subparsers(dest="name", required=True)
        add_parser(sub)
        raise SystemExit(run(parser.parse_args(["memory", *sys.argv[1:]])))
