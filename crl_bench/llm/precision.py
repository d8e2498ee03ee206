"""Numeric precision: which dtype to compute in, detected on the machine that runs, never assumed.

``model.dtype`` names the *compute* dtype of generation and of the trainer's forward/backward.  The
trainable weights and the optimiser state always stay in float32 ("master weights"); with a bf16
compute dtype the trainer runs forward/backward under ``torch.autocast`` and the generation engine
keeps a bf16 copy of the weights, refreshed after every update.

``auto`` (the default) resolves to ``bfloat16`` where bf16 matrix arithmetic is native, else to
``float32``:

* CUDA: ``torch.cuda.is_bf16_supported()``.
* x86 CPU: the kernel's CPU flags list ``amx_bf16`` (Intel AMX) or ``avx512_bf16`` (AVX512-BF16,
  Intel Cooper Lake and later, AMD Zen 4 and later).  oneDNN also "supports" bf16 on plain AVX-512
  CPUs by emulation (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is true there), but emulated
  bf16 is *slower* than float32, so only the native units count.
  A cap on oneDNN's instruction set below its bf16 kernels (``ONEDNN_MAX_CPU_ISA``, or the older
  ``DNNL_MAX_CPU_ISA``, set to e.g. ``AVX2`` or ``AVX512_CORE``) hides the units from the matrix
  kernels, so it counts as having none: that is how an AVX2-only CPU is emulated on a bf16 one
  (docs/performance.md, "The main job's cost on a CPU without bf16 units").
* Anything else (other CPUs, macOS, Windows without the flags file): ``float32``.

The speeds of float32, native and emulated bf16: docs/performance.md ("Precision").
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: values ``model.dtype`` accepts
DTYPE_CHOICES = ("auto",) + tuple(DTYPES)
#: CPU flags (``/proc/cpuinfo``) that mean native bf16 matrix arithmetic
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
#: oneDNN's ``*_MAX_CPU_ISA`` values (oneDNN docs, "CPU Dispatcher Control") whose kernels have no native
#: bf16 dot products; a cap at one of these leaves bf16 matrix arithmetic emulated
ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                            "AVX512_CORE_VNNI")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags the Linux kernel reports (first processor of ``/proc/cpuinfo``); empty
    where the file is missing or unreadable (non-Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def onednn_isa_cap(environ: dict[str, str] | None = None) -> str | None:
    """The instruction-set cap oneDNN was given (``ONEDNN_MAX_CPU_ISA``, else ``DNNL_MAX_CPU_ISA``),
    upper-cased, when it is one under which oneDNN has no native bf16 kernels
    (:data:`ONEDNN_ISAS_WITHOUT_BF16`); ``None`` when unset or higher.  ``environ`` defaults to
    ``os.environ``."""
    env = os.environ if environ is None else environ
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return cap if cap in ONEDNN_ISAS_WITHOUT_BF16 else None


def cpu_bf16_units(flags: frozenset[str] | None = None, environ: dict[str, str] | None = None) -> list[str]:
    """The native bf16 units this CPU has and oneDNN may use, by flag name (``[]`` when none, or when
    :func:`onednn_isa_cap` caps oneDNN below them); ``flags`` default to :func:`cpu_flags`,
    ``environ`` to ``os.environ``."""
    if onednn_isa_cap(environ) is not None:
        return []
    flags = cpu_flags() if flags is None else flags
    return [f for f in BF16_CPU_FLAGS if f in flags]


def resolve_dtype(dtype: str, device: str | torch.device | None = None,
                  flags: frozenset[str] | None = None, environ: dict[str, str] | None = None) -> str:
    """The concrete compute dtype name for a ``model.dtype`` value.

    Args:
        dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16``.
        device: where the model runs (default: CUDA when available, else CPU).
        flags: CPU flags to decide from (tests); default :func:`cpu_flags`.
        environ: environment to read oneDNN's ISA cap from (tests); default ``os.environ``.

    Returns:
        ``float32``, ``bfloat16`` or ``float16`` (``auto``: see the module docstring).

    Raises:
        ValueError: ``dtype`` is not one of :data:`DTYPE_CHOICES`.
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"model.dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if dev.type == "cpu" and cpu_bf16_units(flags, environ):
        return "bfloat16"
    return "float32"


def autocast(device: torch.device | str, dtype: torch.dtype,
             cache: bool = True) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` to ``dtype`` on ``device``'s type, or a no-op context for float32.

    ``cache``: torch's weight-cast cache, which keeps the ``dtype`` cast of every float32 parameter alive
    until the region ends. Off for a forward that is computed once under activation checkpointing (the
    update's): there the cache keeps a bf16 copy of every linear weight alive at the forward's peak,
    2 bytes per parameter (13 GiB at 7B) that checkpointing would otherwise free layer by layer
    (``crl-bench bench memory``, law ``autocast-cache``); a forward without checkpointing saves each cast
    for its backward either way, so turning it off costs nothing there. On where two forwards share the
    weights' casts (the shared-prefix forward)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype, cache_enabled=cache)


def describe(dtype: str) -> dict[str, Any]:
    """What was detected and chosen, for ``versions.json`` and the run's first log line:
    ``{"requested", "compute", "master", "cpu_bf16_units"}``."""
    return {"requested": dtype, "compute": resolve_dtype(dtype), "master": "float32",
            "cpu_bf16_units": cpu_bf16_units()}


def cast_parameters(model: Any, dtype: torch.dtype) -> Any:
    """Cast ``model``'s floating-point parameters to ``dtype`` in place, leaving buffers (e.g. RoPE
    inverse frequencies, which lose precision in bf16) as they are; returns ``model``."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model
