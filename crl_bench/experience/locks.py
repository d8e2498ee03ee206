"""A phase-fair readers-writer lock for the experience bank.

Bank searches (many threads) take :meth:`RWLock.read`; bank mutations (``apply``, eviction) take
:meth:`RWLock.write`. The lock alternates phases so that neither side can starve the other:

- once a writer is waiting, new readers wait (a steady stream of searches cannot starve
  distillation); readers already inside finish first;
- when a writer leaves, every reader that was waiting at that moment is admitted before the next
  writer may enter (a steady stream of writers cannot starve searches).

Not reentrant: a thread holding the read lock must not ask for the write lock (deadlock), and a
thread must not take ``read()`` again while a writer may be queued behind its first ``read()``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RWLock:
    """Phase-fair readers-writer lock with ``read()`` / ``write()`` context managers."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0            # threads inside read()
        self._writer = False         # a thread is inside write()
        self._writers_waiting = 0
        self._readers_waiting = 0
        # Readers admitted ahead of waiting writers by the last release_write. Invariant:
        # 0 <= _admitted <= _readers_waiting, so every admission is taken by a waiting reader.
        self._admitted = 0

    def acquire_read(self) -> None:
        with self._cond:
            self._readers_waiting += 1
            try:
                while self._writer or (self._writers_waiting and not self._admitted):
                    self._cond.wait()
                if self._admitted:
                    self._admitted -= 1
            finally:
                self._readers_waiting -= 1
                self._admitted = min(self._admitted, self._readers_waiting)   # an interrupted wait
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            if self._readers <= 0:
                raise RuntimeError("release_read without acquire_read")
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def acquire_write(self) -> None:
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers or self._admitted:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True

    def release_write(self) -> None:
        with self._cond:
            if not self._writer:
                raise RuntimeError("release_write without acquire_write")
            self._writer = False
            self._admitted = self._readers_waiting     # the read phase: everyone who waited goes next
            self._cond.notify_all()

    @contextmanager
    def read(self) -> Iterator[None]:
        self.acquire_read()
        try:
            yield
        finally:
            self.release_read()

    @contextmanager
    def write(self) -> Iterator[None]:
        self.acquire_write()
        try:
            yield
        finally:
            self.release_write()
