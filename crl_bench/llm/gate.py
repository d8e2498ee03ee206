"""Who computes when: the actor's work first, background distillation in its gaps.

On a CPU, two threads of one process that run torch operations at the same time each start their own
team of intra-op threads; with as many threads per team as cores, the cores are oversubscribed and
both slow down many times over (threads spin at barriers while their partners are descheduled;
docs/performance.md, "The compute gate", has the rollout times with and without it).  A
:class:`ComputeGate` serialises the two without giving up the overlap that matters: foreground work
(the actor's generation and updates) holds the gate; background work (the extractor's generation)
waits for it before starting and between decode steps (:class:`YieldToForeground`), so it uses the
gaps of the rollout (env steps, retrieval, prompt building) and the time between steps.

A background step cannot be interrupted: foreground work that arrives while one runs waits for its
end.  Most gaps of a rollout are a few milliseconds (MiniHack, 8 episodes x 4 actions: median 7-8 ms,
90 % under ~33 ms) against a few hundred for one background step on a CPU without bf16 units, so a
step started in such a gap is a wait for the actor.  With ``min_gap_s`` a background step starts
only once no foreground section has been open for that long: short gaps are left to the actor, long
ones (env resets, the time between steps, a trainer waiting for distillation) still serve the
background (docs/performance.md, "The compute gate").
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch
from transformers import StoppingCriteria


class ComputeGate:
    """A priority gate between foreground and background compute in one process.

    Foreground sections (:meth:`foreground`) may nest and run concurrently with each other; a
    background section (:meth:`background`) runs only while no foreground section is open, and a
    foreground section waits for a running background *step* to end (background code calls
    :meth:`yield_point` between steps; the longest wait is one step, e.g. one decode forward).

    Args:
        min_gap_s: seconds without an open foreground section before a background step may start
            (0: at once).  Raises ``ValueError`` when negative.
    """

    def __init__(self, min_gap_s: float = 0.0) -> None:
        if min_gap_s < 0:
            raise ValueError(f"min_gap_s must be >= 0, got {min_gap_s}")
        self.min_gap_s = float(min_gap_s)
        self._cv = threading.Condition()
        self._foreground = 0
        self._background = 0
        self._foreground_left = float("-inf")   # perf_counter() when the last foreground section closed
        self.background_wait_s = 0.0       # seconds background work spent waiting for the foreground
        self.foreground_wait_s = 0.0       # seconds foreground work spent waiting for a background step

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """Open a foreground section (blocks while a background step is running)."""
        t0 = time.perf_counter()
        with self._cv:
            self._foreground += 1
            self._cv.wait_for(lambda: self._background == 0)
            self.foreground_wait_s += time.perf_counter() - t0
        try:
            yield
        finally:
            with self._cv:
                self._foreground -= 1
                if self._foreground == 0:
                    self._foreground_left = time.perf_counter()
                self._cv.notify_all()

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        """Open a background step: waits until no foreground section is open."""
        self._acquire_background()
        try:
            yield
        finally:
            self._release_background()

    def yield_point(self) -> None:
        """Inside a background section: let waiting foreground work run, then continue."""
        with self._cv:
            if not self._foreground:
                return
        self._release_background()
        self._acquire_background()

    def _acquire_background(self) -> None:
        t0 = time.perf_counter()
        with self._cv:
            while True:
                if self._foreground == 0:
                    idle = time.perf_counter() - self._foreground_left
                    if idle >= self.min_gap_s:
                        break
                    self._cv.wait(timeout=self.min_gap_s - idle)
                else:
                    self._cv.wait()
            self._background += 1
            self.background_wait_s += time.perf_counter() - t0

    def _release_background(self) -> None:
        with self._cv:
            self._background -= 1
            self._cv.notify_all()


class YieldToForeground(StoppingCriteria):
    """A transformers stopping criterion that never stops generation but, at every decode step,
    yields the CPU to waiting foreground work (:meth:`ComputeGate.yield_point`)."""

    def __init__(self, gate: ComputeGate) -> None:
        self.gate = gate

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.gate.yield_point()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
