"""Requests on the experience manager's worker thread (crl_bench/experience/manager.py).

Each request type brings its own handler (:meth:`Request.handle`), so the worker dispatches on the
type and the memory kinds (:mod:`crl_bench.experience.memory`) add request types of their own: the
merge pass of lessons (:mod:`crl_bench.experience.lessons`), ExpeL's insight calls
(:mod:`crl_bench.experience.insights`).  :class:`DistillRequest`, a finished episode for the writer,
is shared by lessons and cases.  A handler reaches the manager only through its public attributes
(``bank``, ``lock``, ``extractor``, ``extractor_lock``, ``apply_extractions``, ``tally``, ``report``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from crl_bench.experience.transcripts import EpisodeRecord
from crl_bench.experience.types import ExperienceEntry


class Request:
    """A request on the manager's worker thread; each request type brings its handler.

    Class attributes:
        order: the worker handles a batch's requests by type, types in increasing ``order``: fold
            passes (0), ExpeL's insight calls (10), distillation (20), merges of similar entries (30).
        needs: the method the manager's writer must have to take this request
            (:meth:`~crl_bench.experience.manager.ExperienceManager.submit` checks it).
    """

    order: ClassVar[int] = 0
    needs: ClassVar[str] = "extract"

    @classmethod
    def handle(cls, manager: Any, requests: list[Any]) -> None:
        """Process ``requests`` (all of this type, in queue order) on the worker thread."""
        raise NotImplementedError(f"{cls.__name__} has no handler")


@dataclass
class DistillRequest(Request):
    """One finished episode for the writer (the extractor of lessons, or a case writer).

    Attributes:
        record: the episode as text.
        retrieved: the entries that guided the episode (shown to the extractor; empty if free).
        env_id: environment of the episode (entries are written for it).
        step: actor step the episode belongs to.
        key_text: what the entries written from this episode are indexed by ("" = their own text);
            the released keying passes the episode's retrieval query.
    """

    order: ClassVar[int] = 20
    record: EpisodeRecord
    retrieved: list[ExperienceEntry]
    env_id: str
    step: int
    key_text: str = ""

    @classmethod
    def handle(cls, manager: Any, requests: list[DistillRequest]) -> None:
        """One batched ``extract`` call of the writer for the episodes, then their operations applied.

        Each episode is shown its retrieved entries as the bank holds them when the batch starts, in
        retrieval order: one rewritten or deleted since (an earlier distillation's UPDATE, a merge pass)
        is left out and the rest are numbered from 1, as released (``build_memory_model_messages``
        reads each retrieved uid from the live memory, skips the missing and numbers the others)."""
        with manager.lock.read():
            live = [manager.bank.get([e.id for e in r.retrieved]) if r.retrieved else [] for r in requests]
        with manager.extractor_lock:
            extractions = manager.extractor.extract([r.record for r in requests], live)
        manager.apply_extractions(list(zip(requests, extractions)))
