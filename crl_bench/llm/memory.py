"""Process memory: resident size for the metrics, and handing the allocator's free pages back.

Why: PyTorch on CPU allocates its tensors with the C library's ``malloc``. On glibc, blocks up to the
dynamic mmap threshold (which rises to 32 MiB after the first large free) come from the main heap,
which only shrinks from its top; the many KV-cache rows, activations and prefix-store entries of a
training step leave it fragmented, and the freed pages in the middle stay resident, so resident
memory grows step after step (docs/performance.md, "Memory: handing free pages back", has the figures).
``malloc_trim(0)`` (glibc >= 2.8) returns every whole free page of the heap to the kernel
(``MADV_DONTNEED``), so calling it between phases bounds resident memory by what is live.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import re
import resource
import sys
from collections.abc import Iterator


@functools.lru_cache(maxsize=1)
def _libc_trim():
    """glibc's ``malloc_trim``, or ``None`` where there is none (macOS, musl, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the kernel (glibc ``malloc_trim(0)``); a no-op returning
    ``False`` where the C library has no such call. Cheap (milliseconds for a 10 GB heap); call it
    between phases (after a training step, an evaluation, an extractor update)."""
    fn = _libc_trim()
    if fn is None:
        return False
    fn(0)
    return True


def rss_gb() -> float | None:
    """This process's resident memory now, in GB (10^9 bytes); ``None`` where ``/proc`` is missing."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e9


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, in GB (``getrusage``; KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 1e9


def hwm_gb() -> float | None:
    """``VmHWM`` of ``/proc/self/status`` (the kernel's peak resident size since the process started or
    its last reset) in GB; ``None`` where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) * 1024 / 1e9 if m else None


def reset_peak_rss() -> bool:
    """Reset this process's peak resident size to its current one (Linux >= 4.0: ``5`` written to
    ``/proc/self/clear_refs``, proc(5)); ``False`` where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PhasePeaks:
    """Peak resident memory of each phase of a step (rollout, update, ...), in GB, and where the process
    uses CUDA, the GPU allocator's peak of each phase.

    Linux resets a process's resident high-water mark when ``5`` is written to
    ``/proc/self/clear_refs`` (proc(5)); a phase resets it on entry and reads ``VmHWM`` on exit.  The
    reset also lowers ``getrusage``'s ``ru_maxrss``, so the lifetime peak is kept here
    (:attr:`lifetime_gb`, the maximum over every reading).  Where the files are missing (non-Linux)
    phases record nothing and :attr:`lifetime_gb` falls back to :func:`peak_rss_gb`.  Threads share
    the process's memory: a phase's peak includes what background work (distillation) held meanwhile.
    """

    def __init__(self) -> None:
        self.lifetime = 0.0
        self.last: dict[str, float] = {}
        self.last_gpu: dict[str, float] = {}

    @property
    def lifetime_gb(self) -> float:
        """Peak resident memory of the process so far, in GB."""
        now = hwm_gb()
        if now is None:
            return peak_rss_gb()
        self.lifetime = max(self.lifetime, now)
        return self.lifetime

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the peak resident memory of the enclosed code into ``last[name]`` (GB; the maximum
        when the same phase runs several times before :meth:`take`).

        The phase starts by handing the heap's free pages back (:func:`trim_heap`): what the previous
        phase freed (a rollout's KV caches before the update) would otherwise stay resident beside
        the new phase's allocations, which glibc serves from fresh mappings when they are large."""
        trim_heap()
        before = hwm_gb()
        reset = False
        if before is not None:
            self.lifetime = max(self.lifetime, before)
            reset = reset_peak_rss()
        gpu = _cuda_in_use()
        if gpu:
            import torch

            torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            after = hwm_gb()
            if reset and after is not None:
                self.lifetime = max(self.lifetime, after)
                self.last[name] = max(self.last.get(name, 0.0), after)
            if gpu:
                self.last_gpu[name] = max(self.last_gpu.get(name, 0.0), _cuda_peak_gb())

    def take(self) -> dict[str, float]:
        """The phase peaks measured since the last call: ``{"peak_rss_gb/<phase>": GB}`` and, where this
        process has used CUDA, ``{"peak_gpu_gb/<phase>": GB}`` (the caching allocator's peak of tensors
        this process allocated on its current device during the phase, ``torch.cuda.max_memory_allocated``;
        not what vLLM's engine-core processes or other processes hold)."""
        out = {f"peak_rss_gb/{k}": round(v, 3) for k, v in self.last.items()}
        out.update({f"peak_gpu_gb/{k}": round(v, 3) for k, v in self.last_gpu.items()})
        self.last, self.last_gpu = {}, {}
        return out


def _cuda_in_use() -> bool:
    """Whether this process has initialised CUDA (so its allocator has something to report); never
    initialises it."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())


def _cuda_peak_gb() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 1e9
