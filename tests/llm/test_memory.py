"""Process memory helpers: resident size in the metrics, free heap pages handed back to the kernel."""

import ctypes
import ctypes.util
import sys

import pytest

from crl_bench.llm.memory import peak_rss_gb, rss_gb, trim_heap


def test_rss_and_peak_are_reported():
    now, peak = rss_gb(), peak_rss_gb()
    assert peak > 0
    if sys.platform.startswith("linux"):
        assert 0 < now <= peak * 1.01


def _fragment_heap():
    """The pattern that grew a training process to 22 GB: many heap blocks freed except a few that pin
    the heap; their ~280 MB of pages stay resident until malloc_trim hands them back.  Returns the
    blocks still live (free them with ``_free``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 96 * 1024, 3000                     # below the 128 KiB mmap threshold: heap blocks
    blocks = [libc.malloc(size) for _ in range(n)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, size)                 # make the pages resident
    keep = blocks[::50]                            # every 50th block stays live and pins the heap
    for b in blocks:
        if b not in keep:
            libc.free(b)
    return keep


def _free(blocks):
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.free.argtypes = [ctypes.c_void_p]
    for b in blocks:
        libc.free(b)


needs_trim = pytest.mark.skipif(not sys.platform.startswith("linux") or not trim_heap(),
                                reason="needs glibc malloc_trim")


@needs_trim
def test_trim_returns_a_fragmented_heaps_free_pages():
    keep = _fragment_heap()
    before = rss_gb()
    assert trim_heap()
    after = rss_gb()
    _free(keep)
    assert before - after > 0.15, (before, after)  # ~280 MB of free pages were resident


@needs_trim
def test_a_phase_starts_from_what_is_live():
    """What the previous phase freed is handed back when the next phase starts, so it neither stays
    resident beside the new phase's allocations nor counts in its peak."""
    from crl_bench.llm.memory import PhasePeaks

    peaks = PhasePeaks()
    keep = _fragment_heap()
    before = rss_gb()
    with peaks.phase("next"):
        inside = rss_gb()
    _free(keep)
    assert before - inside > 0.15, (before, inside)


def test_phase_peaks_measure_each_phase_and_keep_the_lifetime_peak():
    import numpy as np

    from crl_bench.llm.memory import PhasePeaks, hwm_gb

    if hwm_gb() is None:
        pytest.skip("no /proc/self/status VmHWM on this system")
    peaks = PhasePeaks()
    with peaks.phase("big"):
        a = np.ones(400_000_000 // 8)           # 0.4 GB touched
        del a
    with peaks.phase("small"):
        b = np.ones(1000)
        del b
    got = peaks.take()
    assert got["peak_rss_gb/big"] - got["peak_rss_gb/small"] > 0.3     # the small phase does not see the big one
    assert peaks.take() == {}
    assert peaks.lifetime_gb >= got["peak_rss_gb/big"] - 0.001         # (take() rounds to MB)


def test_phase_peaks_report_the_gpu_allocators_peak_per_phase_where_cuda_is_in_use(monkeypatch):
    # a CUDA stand-in: the allocator's peak is reset on entering a phase and read on leaving it
    import torch

    from crl_bench.llm import memory

    state = {"peak": 0, "resets": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda *a: state.update(peak=0, resets=state["resets"] + 1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: state["peak"])
    peaks = memory.PhasePeaks()
    with peaks.phase("rollout"):
        state["peak"] = 3e9
    with peaks.phase("update"):
        state["peak"] = 5e9
    with peaks.phase("update"):                 # the same phase twice before take(): the larger peak
        state["peak"] = 4e9
    got = peaks.take()
    assert got["peak_gpu_gb/rollout"] == 3.0 and got["peak_gpu_gb/update"] == 5.0 and state["resets"] == 3
    assert not any(k.startswith("peak_gpu_gb") for k in peaks.take())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)      # CUDA never used: nothing reported
    with peaks.phase("rollout"):
        pass
    assert not any(k.startswith("peak_gpu_gb") for k in peaks.take())
