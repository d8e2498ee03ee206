"""Lessons: the memory kind of Complementary RL (arXiv 2603.17621; docs/method.md), the default.

An extractor model reads finished episodes and answers with operations on the bank (ADD / UPDATE /
MERGE / NONE, :mod:`crl_bench.experience.operations`); a guided episode is shown the lessons retrieved
for its retrieval query, numbered, under :data:`~crl_bench.experience.memory.GUIDANCE_HEADER`.  It is
the only kind whose extractor a method may train (CISPO; trainer/experience_track.py credits the
extractions whose lessons guided episodes).

* What a finished step writes (:meth:`LessonsMemory.write`): with trajectory integration one
  :class:`~crl_bench.experience.manager.DistillRequest` per chosen episode (``experience.distill``,
  ``distill_per_group``), shown the entries it retrieved (none after an ``invalid`` judgement, as
  released); with turn integration one per step of each guided episode (released
  ``hook_on_turn_end``).
* Upkeep (:meth:`LessonsMemory.upkeep`): every ``experience.merge.every`` steps the merge pass
  (:func:`merge_pass`): the released fold (``merge_memory``, :class:`FoldRequest`) or groups of
  similar entries (:class:`MergeRequest`), both handled on the manager's worker thread.
* Memory forms (:meth:`LessonsMemory.form_guidance`, the ``raw`` and ``both`` eval controls): the
  lessons a guided episode retrieved shown as the episodes they were distilled from
  (:attr:`~crl_bench.experience.types.ExperienceEntry.source_case`), or each lesson with its episode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, get_args

from annotated_types import Ge, Interval

from crl_bench.experience.cases import CASES_HEADER
from crl_bench.experience.extractor import fold_items
from crl_bench.experience.memory import Memory, bank_scope, guidance_text, register_memory
from crl_bench.experience.records import by_group, entry_key, episode_record, turn_query, turn_record
from crl_bench.experience.requests import DistillRequest, Request
from crl_bench.experience.types import JUDGED_INVALID, ApplyResult, ExperienceEntry, Operation

MergeMode = Literal["fold", "similar"]
"""Values of ``experience.merge.mode``: how the merge pass groups a bank's lessons."""
MERGE_MODES: tuple[str, ...] = get_args(MergeMode)


@dataclass
class MergeConfig:
    """Section ``experience.merge``: the merge pass of a bank of lessons."""

    every: Annotated[int, Ge(0)] = 5
    """A merge pass runs at the start of every 0-based step divisible by N, after the flush (0 = never; released 5),
    except when the extractor was updated in the step before (the released asynchronous update is then still
    pending, and the pipeline skips the flush and the merge)."""
    mode: MergeMode = "fold"
    """``fold`` (released ``merge_memory``: each env's entries, oldest first, go to the extractor in chunks of
    ``max``; each call's lessons are carried into the next chunk, the originals of every chunk that gave lessons
    are deleted and the last call's lessons stay, crediting the last call that gave lessons) or ``similar`` (groups
    of at most ``max`` entries whose index vectors have cosine >= ``threshold``, one MERGE / UPDATE / NONE call per
    group)."""
    max: Annotated[int, Ge(2)] = 5
    """Entries per extractor call of the pass (released 5; at least 2)."""
    threshold: Annotated[float, Interval(ge=-1, le=1)] = 0.8
    """Cosine similarity that groups entries for ``similar``."""


@dataclass
class MergeRequest(Request):
    """Consolidate ``entries`` (all of one env) with one extractor call (``experience.merge.mode: similar``)."""

    order: ClassVar[int] = 30
    needs: ClassVar[str] = "extract_merges"
    key_text: ClassVar[str] = ""               # merged entries are indexed by their own text
    entries: list[ExperienceEntry]
    env_id: str
    step: int

    @classmethod
    def handle(cls, manager: Any, requests: list[MergeRequest]) -> None:
        """One batched ``extract_merges`` call for the groups, then their operations applied."""
        with manager.extractor_lock:
            extractions = manager.extractor.extract_merges([r.entries for r in requests])
        manager.apply_extractions(list(zip(requests, extractions)), merges=True)


@dataclass
class FoldRequest(Request):
    """One merge pass over the whole bank as released (``merge_memory``): every env with two or more
    entries is folded in chunks of ``chunk`` entries (:meth:`handle`)."""

    order: ClassVar[int] = 0
    needs: ClassVar[str] = "extract_fold"
    step: int
    chunk: int = 5

    @classmethod
    def handle(cls, manager: Any, requests: list[FoldRequest]) -> None:
        """Run each pass in turn (:func:`fold`)."""
        for req in requests:
            fold(manager, req)


def fold(manager: Any, req: FoldRequest) -> None:
    """The released merge pass (``merge_memory`` / ``_merge_single_task``), on the worker thread.

    Per env with at least two entries: its entries, oldest first, are cut into chunks of
    ``req.chunk``.  Call k shows chunk k's lessons (with the lessons call k - 1 gave, appended to
    it); when its reply gives lessons (:func:`~crl_bench.experience.extractor.fold_items`), the
    chunk's original entries are marked for deletion and the lessons go on into chunk k + 1 (after
    the last chunk they stay); a reply that fails to parse or says NONE keeps the chunk's items
    as they are.  Calls of the same chunk index of all envs share one batched ``generate``.  The
    env's result is applied in one transaction (:meth:`ExperienceBank.replace`), crediting the
    last call that gave lessons, and skipped when an entry it would delete is gone.
    """
    from crl_bench.experience.manager import ExtractionOutcome  # the manager's, imported on its worker

    chunk = max(2, int(req.chunk))
    bank = manager.bank
    with manager.lock.read():
        per_env = {env: bank.entries(env) for env in sorted({e.env_id for e in bank.entries()})}
    # items: (entry id or None for a lesson a call wrote, title, content)
    plans: dict[str, dict[str, Any]] = {}
    for env, entries in per_env.items():
        if len(entries) < 2:
            continue
        items = [(e.id, e.title, e.content) for e in entries]
        plans[env] = {"chunks": [items[i:i + chunk] for i in range(0, len(items), chunk)], "final": [],
                      "deleted": [], "last": None, "outcomes": []}
    rounds = max((len(pl["chunks"]) for pl in plans.values()), default=0)
    for k in range(rounds):
        active = [env for env, pl in plans.items() if k < len(pl["chunks"])]
        with manager.extractor_lock:
            calls = manager.extractor.extract_fold([[(t, c) for _, t, c in plans[env]["chunks"][k]]
                                                    for env in active], active)
        for env, call in zip(active, calls):
            pl = plans[env]
            items = fold_items(call.parse)
            current = pl["chunks"][k]
            outcome = ExtractionOutcome(call, ApplyResult(), answered=items is not None)
            pl["outcomes"].append(outcome)
            if not items:                       # failed (None) or NONE ([]): keep the chunk's items
                pl["final"].extend(current)
                if items is None:
                    outcome.applied = None
                continue
            pl["last"] = outcome
            pl["deleted"] += [uid for uid, _, _ in current if uid is not None]
            made = [(None, t, c) for t, c in items]
            if k + 1 < len(pl["chunks"]):
                pl["chunks"][k + 1].extend(made)
            else:
                pl["final"].extend(made)
    done: list[ExtractionOutcome] = []
    for env, pl in plans.items():
        new_items = [(t, c) for uid, t, c in pl["final"] if uid is None]
        last = pl["last"]
        if last is not None and (new_items or pl["deleted"]):
            with manager.lock.write():
                ids = bank.replace(env, pl["deleted"], new_items, step=req.step, extraction_id=last.extraction.id,
                                   extractor_version=last.extraction.extractor_version)
            if ids is not None:
                last.applied = ApplyResult(applied=[(Operation("MERGE", t, c, tuple(pl["deleted"])), i)
                                                    for (t, c), i in zip(new_items, ids)])
        done += pl["outcomes"]
    if done:
        with manager.lock.write():
            bank.record_merge_calls(len(done), sum(1 for o in done if o.applied is None))
    with manager.tally() as st:
        st.merge_passes += 1
        st.merges += len(done)
    manager.report(done)


def merge_pass(manager: Any, step: int, mode: str = "fold", max_size: int = 5, threshold: float = 0.8) -> None:
    """Run one merge pass now on ``manager`` (local, or the Ray handle) and wait until it is applied
    (queued distillation is applied first).

    ``mode``: ``fold`` (the released pass, :class:`FoldRequest` with chunks of ``max_size``) or
    ``similar`` (one :class:`MergeRequest` per group from
    :meth:`~crl_bench.experience.manager.ExperienceManager.similar_groups`).  Its extractions are
    reported through the manager's ``pop_outcomes``.

    Raises:
        RuntimeError: the manager has no extractor model (none, or a case bank's writer).
        ValueError: unknown ``mode``.
    """
    if not manager.has_model:
        raise RuntimeError("this experience manager has no extractor model to merge entries with")
    if mode == "fold":
        reqs: list[Request] = [FoldRequest(step, max_size)]
    elif mode == "similar":
        reqs = [MergeRequest(entries, env_id, step) for env_id, entries in manager.similar_groups(threshold, max_size)]
    else:
        raise ValueError(f"merge mode must be fold or similar, got {mode!r}")
    manager.drain()
    if reqs:
        manager.submit(reqs)
        manager.drain()


def merge_writes(stats: dict[str, Any]) -> int:
    """Entries merge passes wrote so far, from the manager's ``stats()``: MERGE and UPDATE operations
    applied (``similar`` passes; distillation's too, hence the caller's difference around one pass)
    plus the entries fold passes rewrote (``merge_entries_out``)."""
    kinds = stats.get("op_kinds", {})
    return int(kinds.get("MERGE", 0)) + int(kinds.get("UPDATE", 0)) + int(stats.get("merge_entries_out", 0))


BOTH_HEADER = ("Knowledge distilled from earlier episodes, each lesson followed by the episode it was distilled "
               "from. Use it where it applies to this task; do not follow it blindly.")
"""The header of the ``both`` memory form of a bank of lessons (:func:`form_block`)."""


def form_block(entries: Sequence[ExperienceEntry], form: str) -> str:
    """The block the memory control ``form`` shows for the retrieved lessons ``entries``:

    * ``raw``: the episodes the lessons were distilled from, numbered in retrieval order, under the
      case bank's header (:data:`~crl_bench.experience.cases.CASES_HEADER`): what ``casebank`` would
      show had it stored these episodes. A lesson without a recorded case is left out.
    * ``both``: each lesson (``"n. title: content"``, as guided) with its episode on the next line
      (``"   Episode: ..."``; none for a lesson without a case), under :data:`BOTH_HEADER`.

    Whitespace inside a text is collapsed, as in the guided block. ``""`` when nothing is shown.

    Raises:
        ValueError: ``form`` is neither ``raw`` nor ``both``.
    """
    def clean(text: str) -> str:
        return " ".join(str(text).split())

    if form == "raw":
        cases = [clean(e.source_case) for e in entries if e.source_case.strip()]
        return guidance_text("\n".join(f"{n}. {c}" for n, c in enumerate(cases, start=1)), CASES_HEADER)
    if form == "both":
        lines = []
        for n, e in enumerate(entries, start=1):
            lines.append(f"{n}. {clean(e.title)}: {clean(e.content)}")
            if e.source_case.strip():
                lines.append(f"   Episode: {clean(e.source_case)}")
        return guidance_text("\n".join(lines), BOTH_HEADER)
    raise ValueError(f"a bank of lessons shows forms raw and both, not {form!r}")


@register_memory("lessons")
class LessonsMemory(Memory):
    """Lessons distilled by an extractor model (:mod:`crl_bench.experience.extractor`), merged
    periodically; the memory of ``static`` and ``complementary``."""

    uses_extractor: ClassVar[bool] = True
    trainable: ClassVar[bool] = True
    forms: ClassVar[tuple[str, ...]] = ("raw", "both")     # condensed: the guided mode itself

    def scope(self, env_id: str) -> str:
        """The bank partition of ``env_id`` under ``experience.scope`` (:func:`bank_scope`: the env id,
        or with ``family`` the released memory task, which MiniHack's navigation envs share)."""
        return bank_scope(env_id, self.cfg.experience.scope)

    def writer(self, engine: Any, tokenizer: Any) -> Any:
        """The :class:`~crl_bench.experience.extractor.Extractor` over ``engine`` (``extractor.*``
        settings); ``None`` without an engine."""
        from crl_bench.experience.extractor import extractor_for

        return None if engine is None else extractor_for(self.cfg.extractor, engine, tokenizer)

    def form_guidance(self, manager: Any, form: str, env_ids: Sequence[str],
                      found: Sequence[Sequence[ExperienceEntry]]) -> list[str]:
        """Each episode's block of memory form ``form`` (``raw`` or ``both``, :func:`form_block`)."""
        self.check_form(form)
        return [form_block(entries, form) for entries in found]

    def write(self, manager: Any, trajs: Sequence[Any], step: int) -> int:
        """Queue the step's distillation requests (:meth:`requests`); returns their number."""
        reqs = self.requests(trajs, step)
        if reqs:
            manager.submit(reqs)
        return len(reqs)

    def requests(self, trajs: Sequence[Any], step: int) -> list[DistillRequest]:
        """With trajectory integration, one request per chosen episode with at least one turn, shown
        the entries it retrieved (none after an ``invalid`` judgement, as released); with turn
        integration, one request per step of each guided-subgroup episode, shown the entries
        retrieved before that step and keyed by that step's observation query.  Each request writes
        to the env's bank partition (:meth:`scope`)."""
        exp_cfg = self.cfg.experience
        reqs = []
        for members in by_group(trajs).values():
            if exp_cfg.integration in ("trajectory", "both"):
                chosen = [t for t in members if exp_cfg.distill == "all" or t.subgroup == "guided"]
                if exp_cfg.distill_per_group > 0:
                    chosen = chosen[:exp_cfg.distill_per_group]
                for t in chosen:
                    if not t.turns:
                        continue
                    rec = t.retrieval
                    shown = rec.entries if rec is not None and rec.judgement != JUDGED_INVALID else []
                    key = entry_key(t) if exp_cfg.key == "query" else ""
                    reqs.append(DistillRequest(episode_record(t), list(shown), self.scope(t.env_id), step, key))
            if exp_cfg.integration in ("turn", "both"):
                for t in members:
                    if t.subgroup != "guided":
                        continue
                    for k, turn in enumerate(t.turns):
                        rec = turn.retrieval
                        key = turn_query(t, k) if exp_cfg.key == "query" else ""
                        reqs.append(DistillRequest(turn_record(t, k), list(rec.entries) if rec else [],
                                                   self.scope(t.env_id), step, key))
        return reqs

    def upkeep(self, manager: Any, step: int, updated_at_step: int) -> dict[str, Any]:
        """The merge pass, where the released pipeline runs it: at the start of 0-based step ``step``
        when ``step`` is a positive multiple of ``experience.merge.every``, except when the extractor
        was updated in the step before (``updated_at_step == step``): the released asynchronous update
        is then still pending at this point, and the pipeline skips the flush and the merge of that
        step (``should_flush_pending_updates_before_rollout``).  Returns the metrics ``merge_pass``
        (1 when it ran) and ``merge_skipped`` (1 when skipped for that reason) and, for a pass that
        ran, ``merge_pass_calls`` (its extractor calls) and ``merge_pass_writes`` (entries it wrote:
        MERGE and UPDATE operations applied plus the entries a fold rewrote)."""
        merge = self.cfg.experience.merge
        every = merge.every
        if not every or step <= 0 or step % every:
            return {}
        if updated_at_step == step:          # updated at the end of the previous (1-based ``step``) step
            return {"merge_pass": 0, "merge_skipped": 1}
        manager.drain()        # queued distillation first (the pass drains too), so the counts are the pass's
        before = manager.stats()
        merge_pass(manager, step, merge.mode, merge.max, merge.threshold)
        after = manager.stats()
        return {"merge_pass": 1, "merge_skipped": 0, "merge_pass_calls": after["merges"] - before["merges"],
                "merge_pass_writes": merge_writes(after) - merge_writes(before)}
