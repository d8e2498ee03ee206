"""The background experience manager (the "background track" of Complementary RL, docs/method.md).

Two services run beside the actor's rollout:

* **Retrieval.** Queries from many environments are put on a queue; a batcher thread collects up to
  ``query_batch`` of them or waits at most ``query_timeout_ms`` after the first, and hands the batch to a
  pool of ``search_workers`` threads.  Each search holds the bank's *read* lock, so searches run in
  parallel with each other but never see a half-applied mutation.
* **Distillation.** Finished episodes are put on a distillation queue (:meth:`submit` never blocks); a
  worker thread takes up to ``distill_batch`` requests at a time, asks the extractor for operations in
  one batched generate call, and applies them to the bank under the *write* lock.  Every request type
  brings its own handler (:class:`Request`): the memory kinds' modules (:mod:`crl_bench.experience.memory`)
  declare theirs, such as the merge pass of lessons (:func:`crl_bench.experience.lessons.merge_pass`)
  and ExpeL's insight calls, and the worker runs a batch's handlers in their ``order``.  The actor's
  rollout never waits on it.
  Each processed extraction is reported as an :class:`ExtractionOutcome` (the extraction and what the
  bank made of its operations), collected with :meth:`ExperienceManager.pop_outcomes`.
* **Answers.** The actor's in-episode search tool (:meth:`ExperienceManager.answer`): retrieval with
  the actor's question, then the extractor answers it with what was found (released
  ``search_and_ask``).

The extractor's weights are shared with the trainer: :attr:`extractor_lock` is held while the worker
generates and must be held by whoever updates the extractor.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from crl_bench.experience.bank import ExperienceBank
from crl_bench.experience.cases import case_text
from crl_bench.experience.extractor import Extraction, Extractor, answer_text
from crl_bench.experience.insights import InsightOutcome
from crl_bench.experience.json_ops import format_numbered
from crl_bench.experience.locks import RWLock
from crl_bench.experience.memory import get_memory
from crl_bench.experience.requests import DistillRequest, Request  # noqa: F401 - DistillRequest: the manager's request type, imported from here by callers
from crl_bench.experience.retrieval import Retriever
from crl_bench.experience.types import WRITE_KINDS, ApplyResult, ExperienceEntry

NO_KNOWLEDGE = "No relevant knowledge found."
"""The search tool's answer when retrieval finds nothing (released ``search_and_ask``)."""


@dataclass
class ToolAnswer:
    """The search tool's answer to one query (:meth:`ExperienceManager.answer`).

    Attributes:
        text: what the actor is shown (the extractor's answer, or :data:`NO_KNOWLEDGE`).
        entries: the entries retrieved for the question (snapshots).
        extraction: the extractor's answer call (a training sample once credited), or ``None`` when
            nothing was retrieved or the manager has no extractor (then ``text`` is the retrieved
            knowledge itself, as released without a memory model).
    """

    text: str
    entries: list[ExperienceEntry] = field(default_factory=list)
    extraction: Extraction | None = None


@dataclass
class ExtractionOutcome:
    """What the manager reports for one processed extraction (:meth:`ExperienceManager.pop_outcomes`).

    Attributes:
        extraction: the extractor's sample (of a :class:`DistillRequest`, or of a merge-pass call:
            :mod:`crl_bench.experience.lessons`).
        applied: the bank's :class:`~crl_bench.experience.types.ApplyResult` for its parsed operations
            (applied and rejected ones), or ``None`` when nothing parsed (nothing was sent to the bank).
            For the merge pass, the call credited with the env's new entries has them as applied
            MERGE operations (their targets are the entries the pass replaced).
        answered: the reply was a valid answer although the bank applied nothing of it (a merge-pass
            call that kept its lessons, or whose lessons the next call of the pass took over).
    """

    extraction: Extraction
    applied: ApplyResult | None = None
    answered: bool = False

    @property
    def wrote(self) -> bool:
        """Whether the bank applied an ADD, UPDATE or MERGE of this extraction (it wrote an entry)."""
        return self.applied is not None and any(op.kind in WRITE_KINDS for op, _ in self.applied.applied)

    @property
    def said_none(self) -> bool:
        """Whether the bank applied a NONE of this extraction (a valid "change nothing" answer)."""
        return self.applied is not None and any(op.kind == "NONE" for op, _ in self.applied.applied)

    @property
    def valid(self) -> bool:
        """A usable reply: something of it was applied (NONE and votes included), or ``answered``."""
        return self.answered or (self.applied is not None and bool(self.applied.applied))


@dataclass
class ManagerStats:
    """Counters of the manager (read with :meth:`ExperienceManager.stats`)."""

    queries: int = 0
    query_batches: int = 0
    search_s: float = 0.0
    distilled: int = 0
    merges: int = 0
    merge_passes: int = 0
    answers: int = 0
    extractions_parsed: int = 0
    extractions_failed: int = 0
    ops_applied: int = 0
    ops_rejected: int = 0
    extractor_errors: int = 0
    distill_s: float = 0.0
    last_error: str = ""
    op_kinds: dict = field(default_factory=dict)
    insight_calls: int = 0
    insight_calls_failed: int = 0
    insight_kinds: dict = field(default_factory=dict)


class _Query:
    __slots__ = ("env_id", "text", "count_retrievals", "future")

    def __init__(self, env_id: str, text: str, count_retrievals: bool = True) -> None:
        self.env_id = env_id
        self.text = text
        self.count_retrievals = count_retrievals
        self.future: Future = Future()


class ExperienceManager:
    """Serves retrieval and distillation asynchronously around one :class:`ExperienceBank`.

    Args:
        bank: the experience bank.
        retriever: a retriever over ``bank``.
        extractor: the writer of the memory kind (:meth:`crl_bench.experience.memory.Memory.writer`):
            the extractor that samples operations for the queued episodes and merge groups, a
            :class:`~crl_bench.experience.cases.CaseWriter` (a case bank: episodes stored as they
            happened, no merge pass), an :class:`~crl_bench.experience.insights.InsightWriter` (a case
            bank with insight lists, which also takes its insight requests), or ``None`` (retrieval
            only: :meth:`submit` raises).
        search_workers: parallel search threads.
        query_batch: most queries per search batch.
        query_timeout_ms: longest wait for a batch to fill after its first query.
        distill_batch: most episodes per extractor call.
        utility_beta: step of an entry's utility towards the outcome of each guided episode it was
            shown to (:meth:`record_outcomes`; ``experience.utility.beta``).
        case_tokenizer: measures the raw case stored on each entry written from an episode
            (:meth:`source_case`); ``None``: no case is stored.
        case_tokens: token budget of that case's trajectory (``experience.cases.tokens``).
    """

    def __init__(self, bank: ExperienceBank, retriever: Retriever, extractor: Extractor | Any = None, *,
                 search_workers: int = 2, query_batch: int = 32, query_timeout_ms: float = 5.0,
                 distill_batch: int = 8, utility_beta: float = 0.05, case_tokenizer: Any = None,
                 case_tokens: int = 256) -> None:
        self.bank = bank
        self.case_tokenizer = case_tokenizer
        self.case_tokens = int(case_tokens)
        self.utility_beta = float(utility_beta)
        self.retriever = retriever
        self.extractor = extractor
        self.lock = RWLock()
        self.extractor_lock = threading.Lock()
        self.query_batch = query_batch
        self.query_timeout = query_timeout_ms / 1000.0
        self.distill_batch = distill_batch
        self._stats = ManagerStats()
        self._mu = threading.Lock()
        self._finished: list[ExtractionOutcome] = []
        self._insight_outcomes: list[InsightOutcome] = []
        self._queries: queue.Queue[_Query | None] = queue.Queue()
        self._distill: queue.Queue[Request | None] = queue.Queue()
        self._pool = ThreadPoolExecutor(max_workers=search_workers, thread_name_prefix="crl-search")
        self._closed = False
        self._batcher = threading.Thread(target=self._batch_loop, name="crl-query-batcher", daemon=True)
        self._batcher.start()
        self._worker: threading.Thread | None = None
        if extractor is not None:
            self._worker = threading.Thread(target=self._distill_loop, name="crl-distiller", daemon=True)
            self._worker.start()

    @property
    def has_model(self) -> bool:
        """Whether an extractor model writes this bank (not a case bank's writer, whose ``answers``
        is false, and not read-only): only then can it merge entries and answer search-tool questions."""
        return self.extractor is not None and getattr(self.extractor, "answers", True)

    # ---- retrieval ------------------------------------------------------------------------------
    def retrieve_async(self, env_id: str, text: str, count_retrievals: bool = True) -> Future:
        """Queue one query; the future resolves to ``list[ExperienceEntry]`` (best first).

        ``count_retrievals=False`` (evaluation) leaves the bank's retrieval counters untouched."""
        if self._closed:
            raise RuntimeError("experience manager is closed")
        q = _Query(env_id, text, count_retrievals)
        self._queries.put(q)
        return q.future

    def retrieve(self, queries: list[tuple[str, str]], timeout: float | None = 60.0,
                 count_retrievals: bool = True) -> list[list[ExperienceEntry]]:
        """Queue ``(env_id, query text)`` pairs together and wait for all answers (in order)."""
        futures = [self.retrieve_async(env_id, text, count_retrievals) for env_id, text in queries]
        return [f.result(timeout=timeout) for f in futures]

    def begin_evaluation(self, key: str) -> None:
        """Before a read-only evaluation (one mode): reseed the retriever's read-only draws from
        ``key`` and fix its read-only clock at the bank's last training retrieval
        (:meth:`Retriever.begin_readonly`), so the evaluation's retrievals do not depend on the
        evaluations before it or on when it runs. Call it with no read-only query in flight."""
        self.retriever.begin_readonly(key, self.bank.last_retrieval_time())

    def _batch_loop(self) -> None:
        while True:
            first = self._queries.get()
            if first is None:
                return
            batch = [first]
            deadline = time.perf_counter() + self.query_timeout
            stop = False
            while len(batch) < self.query_batch:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                try:
                    nxt = self._queries.get(timeout=remaining)
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self._pool.submit(self._serve, batch)
            if stop:
                return

    def _serve(self, batch: list[_Query]) -> None:
        t0 = time.perf_counter()
        for count_retrievals in (True, False):        # counting and read-only queries are searched apart
            part = [q for q in batch if q.count_retrievals == count_retrievals]
            if not part:
                continue
            try:
                with self.lock.read():
                    results = self.retriever.retrieve([q.text for q in part], [q.env_id for q in part],
                                                      count_retrievals=count_retrievals)
            except Exception as e:  # noqa: BLE001 - the callers get the error through their futures
                for q in part:
                    q.future.set_exception(e)
                continue
            for q, r in zip(part, results):
                q.future.set_result(r)
        with self._mu:
            self._stats.queries += len(batch)
            self._stats.query_batches += 1
            self._stats.search_s += time.perf_counter() - t0

    # ---- distillation ---------------------------------------------------------------------------
    def submit(self, requests: Sequence[Request]) -> None:
        """Queue requests (finished episodes, merge or insight requests) for the worker; returns at once.

        Raises:
            RuntimeError: no extractor, or a request whose ``needs`` the writer does not have (an
                insight request for a manager without an
                :class:`~crl_bench.experience.insights.InsightWriter`).
        """
        if self.extractor is None:
            raise RuntimeError("this experience manager has no extractor")
        for r in requests:
            if not hasattr(self.extractor, r.needs):
                raise RuntimeError(f"this experience manager's writer takes no {type(r).__name__} "
                                   f"(it has no {r.needs})")
        for r in requests:
            self._distill.put(r)

    def backlog(self) -> int:
        """Distillation and merge requests queued or being processed (not yet applied to the bank)."""
        return self._distill.unfinished_tasks

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued request is processed; returns False on timeout."""
        if self.extractor is None:
            return True
        end = None if timeout is None else time.monotonic() + timeout
        while self._distill.unfinished_tasks:
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    def pop_outcomes(self) -> list[ExtractionOutcome]:
        """The extractions processed since the last call with what the bank made of each (oldest
        first); the manager forgets them."""
        with self._mu:
            out, self._finished = self._finished, []
        return out

    def _distill_loop(self) -> None:
        while True:
            item = self._distill.get()
            if item is None:
                self._distill.task_done()
                return
            batch = [item]
            while len(batch) < self.distill_batch:
                try:
                    nxt = self._distill.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:  # put the sentinel back for the next loop turn
                    self._distill.task_done()
                    self._distill.put(None)
                    break
                batch.append(nxt)
            try:
                self._process(batch)
            except Exception as e:  # noqa: BLE001 - a failed extraction never stops the worker
                with self._mu:
                    self._stats.extractor_errors += 1
                    self._stats.last_error = f"{type(e).__name__}: {e}"
            finally:
                for _ in batch:
                    self._distill.task_done()

    def _process(self, batch: list[Request]) -> None:
        """Hand the batch's requests to their types' handlers, types in their ``order``."""
        t0 = time.perf_counter()
        by_type: dict[type[Request], list[Request]] = {}
        for r in batch:
            by_type.setdefault(type(r), []).append(r)
        for kind in sorted(by_type, key=lambda k: k.order):
            kind.handle(self, by_type[kind])
        with self._mu:
            self._stats.distill_s += time.perf_counter() - t0

    def source_case(self, record: Any) -> str:
        """The raw case stored on the entries written from the episode ``record`` (an
        :class:`~crl_bench.experience.transcripts.EpisodeRecord`; ``None`` for a request without one):
        ``"title: content"`` of :func:`~crl_bench.experience.cases.case_text`, the text a case bank
        would store for it; ``""`` without a record or :attr:`case_tokenizer`."""
        if record is None or self.case_tokenizer is None or not getattr(record, "steps", None):
            return ""
        title, content = case_text(record, self.case_tokenizer, self.case_tokens)
        return f"{title}: {content}"

    def apply_extractions(self, done: Sequence[tuple[Any, Extraction]], merges: bool = False) -> None:
        """Apply each ``(request, extraction)``'s parsed operations to the bank (under the write lock,
        indexed by the request's ``key_text``, each entry written keeping the raw case of the request's
        episode, :meth:`source_case`), count it (``merges``: as a merge call, else as a distilled
        episode) and report its :class:`ExtractionOutcome` (:meth:`pop_outcomes`).  Called by request
        handlers on the worker thread."""
        for req, extraction in done:
            ops = list(extraction.parse.ops)
            result = None
            if ops:
                case = self.source_case(getattr(req, "record", None)) \
                    if any(op.kind in WRITE_KINDS for op in ops) else ""
                with self.lock.write():
                    result = self.bank.apply(ops, env_id=req.env_id, step=req.step, extraction_id=extraction.id,
                                             extractor_version=extraction.extractor_version, key_text=req.key_text,
                                             source_case=case)
            with self._mu:
                st = self._stats
                if merges:
                    st.merges += 1
                else:
                    st.distilled += 1
                if ops:
                    st.extractions_parsed += 1
                else:
                    st.extractions_failed += 1
                if result is not None:
                    st.ops_applied += len(result.applied)
                    st.ops_rejected += len(result.rejected)
                    for op, _ in result.applied:
                        st.op_kinds[op.kind] = st.op_kinds.get(op.kind, 0) + 1
                self._finished.append(ExtractionOutcome(extraction, result))

    @contextlib.contextmanager
    def tally(self) -> Iterator[ManagerStats]:
        """The manager's counters, held under its lock while the block runs (for request handlers)."""
        with self._mu:
            yield self._stats

    def report(self, outcomes: Sequence[ExtractionOutcome] = (),
               insight_outcomes: Sequence[InsightOutcome] = ()) -> None:
        """Report processed extractions (:meth:`pop_outcomes`) and insight calls
        (:meth:`pop_insight_outcomes`); called by request handlers on the worker thread."""
        with self._mu:
            self._finished += list(outcomes)
            self._insight_outcomes += list(insight_outcomes)

    def insights(self, env_ids: Sequence[str]) -> dict[str, list[Any]]:
        """The insight list of each env in ``env_ids`` (most important first,
        :class:`~crl_bench.experience.insights.Insight`); empty lists for a bank without insights."""
        with self.lock.read():
            return {env: self.bank.insights(env) for env in dict.fromkeys(env_ids)}

    def reflections(self, env_id: str, task: int, limit: int) -> list[str]:
        """The most recent ``limit`` reflections on a task, oldest first (``reflexion``)."""
        with self.lock.read():
            return self.bank.reflections(env_id, task, limit)

    def add_reflections(self, rows: Sequence[tuple[str, int, str, int]]) -> None:
        """Store ``(env_id, task, text, step)`` reflections (under the write lock)."""
        with self.lock.write():
            self.bank.add_reflections(rows)

    def pop_insight_outcomes(self) -> list[InsightOutcome]:
        """The insight calls processed since the last call, with what the bank made of each (oldest
        first); the manager forgets them."""
        with self._mu:
            out, self._insight_outcomes = self._insight_outcomes, []
        return out

    def answer(self, queries: Sequence[tuple[str, str]], count_retrievals: bool = True,
               timeout: float | None = 60.0) -> list[ToolAnswer]:
        """Answer the actor's search-tool questions ``(env_id, question)`` (released ``search_and_ask``):
        retrieve for each question from its env (``count_retrievals``: count the retrievals, as training does),
        then the extractor answers each question that found entries, shown the entries, in one
        batched call.  A question that finds nothing is answered :data:`NO_KNOWLEDGE`; without an
        extractor model (a read-only bank, a case bank) the retrieved knowledge itself is the answer."""
        found = self.retrieve(list(queries), timeout=timeout, count_retrievals=count_retrievals)
        out = [ToolAnswer(NO_KNOWLEDGE, list(entries)) for entries in found]
        asked = [i for i, entries in enumerate(found) if entries]
        if not asked:
            return out
        knowledge = [format_numbered(found[i], empty="") for i in asked]
        if not self.has_model:
            for i, text in zip(asked, knowledge):
                out[i].text = text
            return out
        with self.extractor_lock:
            calls = self.extractor.answer([queries[i][1] for i in asked], knowledge, [queries[i][0] for i in asked])
        for i, call in zip(asked, calls):
            out[i].text = answer_text(call.text) or NO_KNOWLEDGE
            out[i].extraction = call
        with self._mu:
            self._stats.answers += len(calls)
        return out

    # ---- the bank as the experience track sees it -------------------------------------------------
    # The track (trainer/experience_track.py) reads and writes the bank only through these methods, so
    # the manager may live in another process (crl_bench/ray_backend.py: RemoteManager).
    def record_outcomes(self, outcomes: Sequence[tuple[Sequence[int], bool]]) -> None:
        """Count each ``(entry ids shown, success)`` episode outcome on its entries and move their
        utility towards it by :attr:`utility_beta` (under the write lock)."""
        if not outcomes:
            return
        with self.lock.write():
            for ids, success in outcomes:
                self.bank.record_outcome(ids, success, self.utility_beta)

    def source_extractions(self) -> set[str]:
        """Ids of the extractions that wrote an entry still in the bank."""
        with self.lock.read():
            return self.bank.source_extractions()

    def similar_groups(self, threshold: float, max_size: int) -> list[tuple[str, list[ExperienceEntry]]]:
        """Groups of entries of one env whose index vectors are similar: for each entry not yet
        grouped, itself and its nearest entries with cosine >= ``threshold``, at most ``max_size``;
        only groups of two or more.  Returns ``[(env_id, entries)]``, envs sorted, entries by id order
        of discovery (the merge pass of the experience track)."""
        out = []
        with self.lock.read():
            for env_id in sorted({e.env_id for e in self.bank.entries()}):
                entries = self.bank.entries(env_id)
                vecs = self.bank.vectors([e.id for e in entries])
                hits_all = self.bank.search_vectors(vecs, max_size, env_id) if len(entries) else []
                seen: set[int] = set()
                for e, hits in zip(entries, hits_all):
                    if e.id in seen:
                        continue
                    ids = [i for i, s in hits if s >= threshold and i not in seen]
                    if e.id not in ids:
                        ids = [e.id] + ids
                    ids = ids[:max_size]
                    if len(ids) >= 2:
                        seen.update(ids)
                        out.append((env_id, self.bank.get(ids)))
        return out

    def backup(self, dest: Any) -> None:
        """Copy the bank to the SQLite file ``dest`` once queued distillation is applied
        (:meth:`~crl_bench.experience.bank.ExperienceBank.backup`, under the write lock)."""
        self.drain()
        with self.lock.write():
            self.bank.backup(dest)

    def updating_extractor(self) -> Any:
        """Context manager to hold while the extractor's weights change: distillation, which generates
        with those weights, waits (the extractor lock)."""
        return self.extractor_lock

    def extractor_updated(self, model: Any, version: int) -> None:
        """The extractor's weights changed (a CISPO update, or loaded from a checkpoint): the extractor
        generates from ``model``'s weights from now on and stamps ``version`` on its extractions.  Here
        the model is the one the extractor's engine shares; call it inside :meth:`updating_extractor`."""
        if self.extractor is None:
            raise RuntimeError("this experience manager has no extractor")
        self.extractor.extractor_version = int(version)
        self.extractor.engine.sync_weights(model)

    def clear_caches(self) -> None:
        """Drop the extractor engine's cached prompt prefixes (a checkpoint does: trainer/checkpoint.py)."""
        clear = getattr(getattr(self.extractor, "engine", None), "clear_prefix_cache", None)
        if clear is not None:
            with self.extractor_lock:
                clear()

    # ---- bookkeeping ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the manager: its counters, the processed extractions not yet
        collected by :meth:`pop_outcomes` (``ExtractionOutcome`` objects, picklable) and the
        retriever's generators.

        Raises:
            RuntimeError: requests are still queued or in process (call :meth:`drain` first: a
                checkpoint holds no half-distilled episode).
        """
        if self.backlog():
            raise RuntimeError(f"{self.backlog()} distillation request(s) still queued; drain before saving")
        with self._mu:
            stats = ManagerStats(**{**self._stats.__dict__, "op_kinds": dict(self._stats.op_kinds),
                                    "insight_kinds": dict(self._stats.insight_kinds)})
            return {"stats": stats, "finished": list(self._finished), "retriever": self.retriever.state_dict(),
                    "insight_outcomes": list(self._insight_outcomes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (counters, uncollected outcomes, retriever)."""
        with self._mu:
            st = state["stats"]
            self._stats = ManagerStats(**{**ManagerStats().__dict__, **st.__dict__, "op_kinds": dict(st.op_kinds),
                                          "insight_kinds": dict(getattr(st, "insight_kinds", {}))})
            self._finished = list(state["finished"])
            self._insight_outcomes = list(state.get("insight_outcomes", []))
        self.retriever.load_state_dict(state["retriever"])

    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters plus the bank size, the query-embedding cache's hit rate
        (``query_cache_hit_rate``) and, from the bank's own totals, the merge pass's failed calls and
        entries removed and written (``merge_calls_failed``, ``merge_entries_in``,
        ``merge_entries_out``) and the entries deleted by votes (``deleted_by_vote``)."""
        with self._mu:
            s = dict(self._stats.__dict__)
            s["op_kinds"] = dict(self._stats.op_kinds)
            s["insight_kinds"] = dict(self._stats.insight_kinds)
        with self.lock.read():
            s["bank_size"] = len(self.bank)
            s["insights"] = len(self.bank.insights())
            s["reflections"] = self.bank.reflection_count()
            c = self.bank.counters()
        s.update(merge_calls_failed=c.get("merge_pass_calls_failed", 0),
                 merge_entries_in=c.get("merge_pass_removed", 0), merge_entries_out=c.get("merge_pass_written", 0),
                 deleted_by_vote=c.get("deleted_by_vote", 0))
        s["query_cache_hit_rate"] = self.retriever.cache_info()["hit_rate"]
        return s

    def close(self, drain_timeout: float | None = 0.0) -> None:
        """Stop the threads (after waiting up to ``drain_timeout`` s for queued distillation) and shut
        the extractor's engine down where it runs a process of its own (``extractor.engine: vllm``)."""
        if self._closed:
            return
        if drain_timeout:
            self.drain(drain_timeout)
        self._closed = True
        self._queries.put(None)
        self._batcher.join(timeout=10)
        self._pool.shutdown(wait=True)
        if self._worker is not None:
            # drop what is still queued: the run is over
            try:
                while True:
                    self._distill.get_nowait()
                    self._distill.task_done()
            except queue.Empty:
                pass
            self._distill.put(None)
            self._worker.join(timeout=60)
        close_engine = getattr(getattr(self.extractor, "engine", None), "close", None)
        if close_engine is not None:           # vLLM's engine core process (extractor.engine: vllm)
            close_engine()


def embedder_device(setting: str) -> str:
    """The torch device of ``experience.embedder_device``: ``auto`` is ``cuda`` where a GPU is visible, else ``cpu``.

    Raises:
        ValueError: a CUDA device is asked for and none is visible (the setting named).
    """
    import torch

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"experience.embedder_device={setting} but no CUDA device is visible to this process "
                         "(use cpu or auto)")
    return setting


def build_manager(cfg: Any, bank_path: Any, extractor_model: Any, tokenizer: Any, *, compute_dtype: Any,
                  embedder: Any = None, gate: Any = None, read_only: bool = False) -> ExperienceManager:
    """The experience manager a run's configuration describes, with its parts: the bank at
    ``bank_path`` (``experience.*`` settings; read-only with ``read_only``), its embedder, the
    retriever (seeded with ``train.seed``) and, unless ``read_only`` or ``extractor_model`` is
    ``None``, the extractor generating with ``extractor_model`` through its own
    :class:`~crl_bench.llm.hf_engine.HFEngine` in ``compute_dtype`` (bf16 where the CPU has the units;
    background work of ``gate``), or with ``extractor.engine: vllm`` its own
    :class:`~crl_bench.llm.vllm_engine.VLLMEngine`, out of process.  The parts are reachable as
    ``manager.bank``, ``.retriever`` and ``.extractor``.  The writer is the method's memory kind's
    (:meth:`crl_bench.experience.memory.Memory.writer`): for cases (``casebank``) a
    :class:`~crl_bench.experience.cases.CaseWriter` measuring with ``tokenizer``, with no engine made
    (a kind that loads no extractor model); with insights (``expel``) an
    :class:`~crl_bench.experience.insights.InsightWriter` generating with ``extractor_model``.  Used
    by the experience track in the trainer's process and by the Ray backend's manager actor
    (crl_bench/ray_backend.py) alike.

    Args:
        cfg: the :class:`~crl_bench.config.RunConfig`.
        bank_path: the SQLite file of the bank.
        extractor_model, tokenizer: the extractor's model (shared with its trainer, if it trains) and
            its tokenizer.
        compute_dtype: torch dtype generation runs in.
        embedder: an embedder instead of ``experience.embedder`` (tests).
        gate: a :class:`~crl_bench.llm.gate.ComputeGate`; the extractor then generates in the gaps of
            the actor's work.

    Raises:
        ValueError: invalid bank or extractor settings (from the parts).
    """
    from crl_bench.experience.embedding import SentenceEmbedder
    from crl_bench.llm.hf_engine import HFEngine

    exp_cfg = cfg.experience
    embedder = embedder or SentenceEmbedder(exp_cfg.embedder, device=embedder_device(exp_cfg.embedder_device))
    bank = ExperienceBank(bank_path, embedder, capacity=exp_cfg.capacity, eviction=exp_cfg.eviction,
                          index=exp_cfg.index, max_text_chars=exp_cfg.max_text_chars, read_only=read_only)
    memory = get_memory(cfg.method_spec.memory)(cfg)
    retriever = Retriever(bank, k=exp_cfg.k, oversample=exp_cfg.oversample, freq_penalty=exp_cfg.freq_penalty,
                          recency_window_s=exp_cfg.recency_window_s, top1_demote_p=exp_cfg.top1_demote_p,
                          seed=cfg.train.seed, query_cache=exp_cfg.query_cache, rerank=exp_cfg.rerank,
                          utility_alpha=exp_cfg.utility.alpha, utility_ucb=exp_cfg.utility.ucb,
                          utility_min_sim=exp_cfg.utility.min_sim, utility_candidates=exp_cfg.utility.candidates,
                          utility_count_start=exp_cfg.utility.count_start, utility_eval_k=exp_cfg.utility.eval_k,
                          skip_same_key=memory.skips_own_task())
    engine: Any = None
    if not read_only and memory.uses_extractor and extractor_model is not None:
        g = cfg.generation
        if cfg.extractor.engine == "vllm":
            import dataclasses

            from crl_bench.config_devices import placed
            from crl_bench.llm.vllm_engine import VLLMEngine

            # out of process: a second vLLM engine beside the actor's, with its own engine core
            name = cfg.model.name if cfg.extractor.model == "same" else cfg.extractor.model
            x = cfg.extractor
            engine = VLLMEngine.from_model(extractor_model, tokenizer, dataclasses.replace(cfg.model, name=name,
                                                                                            lora=False),
                                           gen_cfg=g, seed=cfg.train.seed, in_process=False,
                                           gpu_memory_utilization=x.vllm_gpu_memory_utilization,
                                           max_model_len=x.vllm_max_model_len, max_num_seqs=x.vllm_max_num_seqs,
                                           sleep_mode=False, gpus=placed(cfg.devices.extractor_engine))
        else:
            engine = HFEngine(extractor_model, tokenizer, batch_size=g.batch_size, prefix_cache=g.prefix_cache,
                              compute_dtype=compute_dtype, cache_mb=g.cache_mb, gate=gate,
                              background=gate is not None)
    extractor = None if read_only else memory.writer(engine, tokenizer)
    return ExperienceManager(bank, retriever, extractor, search_workers=exp_cfg.search_workers,
                             query_batch=exp_cfg.query_batch, query_timeout_ms=exp_cfg.query_timeout_ms,
                             utility_beta=exp_cfg.utility.beta, case_tokenizer=tokenizer,
                             case_tokens=exp_cfg.cases.tokens)
