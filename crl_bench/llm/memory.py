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

import ctypes
import ctypes.util
import functools
import os
import resource
import sys


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
