"""Cases: finished episodes written to the experience bank as they happened, without an extractor model.

The ``casebank`` method (crl_bench/methods.py; docs/method.md, "Case bank") keeps no lessons: each
finished episode whose outcome ``experience.cases.outcomes`` admits becomes one bank entry, its title the task
as told to the actor and its content the compacted trajectory (:func:`compact_trajectory`: the first
observation, one line per action with the env's feedback, the last observations) and the outcome.
A guided episode is shown the entries retrieved for its retrieval query, as every method with a bank
is: for a case bank, the most similar earlier episodes. This is the trajectory retrieval of ExpeL
(Zhao et al., arXiv 2308.10144, section 4.1: successful trajectories of similar tasks as in-context
examples) and the case memory of Memento (arXiv 2508.16153); the compaction, the budget and the
entry's layout are this project's own choices.

:class:`CaseWriter` stands where the extractor stands in the experience manager's distillation
worker (:meth:`extract` has the extractor's signature), so queueing, the bank's write lock,
capacity, eviction and the per-entry use counts are those of the other methods. Its "extractions"
carry no tokens and are never trained. :class:`CasesMemory` is the memory kind ``cases``
(:mod:`crl_bench.experience.memory`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, get_args

from annotated_types import Ge

from crl_bench.experience.extractor import Extraction
from crl_bench.experience.memory import Memory, bank_scope, register_memory
from crl_bench.experience.operations import ParseResult
from crl_bench.experience.records import by_group, entry_key, episode_record
from crl_bench.experience.requests import DistillRequest
from crl_bench.experience.transcripts import EpisodeRecord, compact_trajectory, outcome_text, strip_observation
from crl_bench.experience.types import ExperienceEntry, Operation

CASES_HEADER = ("Earlier episodes of similar tasks, each with its outcome. Use them where they apply to this "
                "task; do not copy them blindly.")
"""The header of a case bank's block (``casebank``): its entries are whole earlier episodes."""

CaseOutcomes = Literal["successes", "all"]
"""Values of ``experience.cases.outcomes``: which finished episodes become cases."""
CASE_OUTCOMES: tuple[str, ...] = get_args(CaseOutcomes)


@dataclass
class CasesConfig:
    """Section ``experience.cases``: the cases of a bank of cases (``casebank``, ``expel``)."""

    outcomes: CaseOutcomes = "successes"
    """Which finished episodes, of both subgroups, become cases: ``successes`` (default, as ExpeL retrieves successful
    trajectories) or ``all`` (failures too, their outcome stated). ``experience.distill`` and ``distill_per_group``
    choose what goes to an extractor and do not apply."""
    tokens: Annotated[int, Ge(16)] = 256
    """Token budget of one case's compacted trajectory (actor's tokenizer; the outcome line comes on top; at least
    16)."""
    skip_own: bool = True
    """An episode is not shown cases of its own task (cases keyed by its retrieval query), nor two cases of one
    task, in training and in evaluation (ExpeL's retrieval, ``topk_docs``: the current task and tasks already
    chosen are skipped); ``false`` retrieves every case."""


def admits_case(has_steps: bool, success: bool, outcomes: str) -> bool:
    """Whether a finished episode becomes a case under ``experience.cases.outcomes`` = ``outcomes``: one with
    at least one action that succeeded, or any with ``all``."""
    return bool(has_steps) and (outcomes == "all" or bool(success))


def case_text(record: EpisodeRecord, tokenizer: Any, max_tokens: int) -> tuple[str, str]:
    """``(title, content)`` of the case written for ``record``.

    Args:
        record: the finished episode (:func:`crl_bench.trainer.experience_track.episode_record`).
        tokenizer: measures the budget (the actor's: the case is shown to the actor).
        max_tokens: token budget of the trajectory part of the content (the outcome line comes on
            top, about 15 tokens).

    Returns:
        The title (the task as told to the actor, or the env id when the env states no task) and
        the content: ``"Outcome: success (reward 1.00) after 3 steps"``, then the compacted
        trajectory (``Start:`` observation, ``Step i: action -> feedback`` lines; observations
        without the ``Valid actions:`` / ``Last:`` lines every observation repeats).

    Raises:
        ValueError: ``max_tokens`` is below 1.
    """
    if max_tokens < 1:
        raise ValueError(f"a case needs a positive token budget, got {max_tokens}")
    title = " ".join((record.task_prompt or "").split()) or f"a {record.env_id} task"
    body = compact_trajectory(record, tokenizer, max_tokens, decode_fn=strip_observation)
    return title, f"Outcome: {outcome_text(record)}\n{body}"


class CaseWriter:
    """Turns finished episodes into ADD operations of cases; the distiller of a ``casebank`` run.

    Args:
        tokenizer: the actor's tokenizer (measures :func:`case_text`'s budget).
        max_tokens: token budget of one case's trajectory (``experience.cases.tokens``).
        outcomes: ``successes`` (default: only episodes that succeeded become cases, as ExpeL
            retrieves successful trajectories) or ``all`` (failures too; their outcome line says so).

    Raises:
        ValueError: ``outcomes`` is not one of :data:`CASE_OUTCOMES`, or ``max_tokens`` < 1.
    """

    answers: ClassVar[bool] = False        # no model: it merges nothing and answers no search-tool question

    def __init__(self, tokenizer: Any, max_tokens: int = 256, outcomes: str = "successes") -> None:
        if outcomes not in CASE_OUTCOMES:
            raise ValueError(f"experience.cases.outcomes must be one of {', '.join(CASE_OUTCOMES)}, "
                             f"got {outcomes!r}")
        if max_tokens < 1:
            raise ValueError(f"experience.cases.tokens must be positive, got {max_tokens}")
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens)
        self.outcomes = outcomes

    def admits(self, record: EpisodeRecord) -> bool:
        """Whether ``record`` becomes a case (``outcomes``; an episode without any action never does)."""
        return admits_case(bool(record.steps), record.success, self.outcomes)

    def extract(self, records: Sequence[EpisodeRecord],
                retrieved: Sequence[Sequence[ExperienceEntry]] | None = None) -> list[Extraction]:
        """One :class:`Extraction` per record: an ADD of its case when :meth:`admits` it, else a
        NONE (the episode is not stored). ``retrieved`` (what guided the episode) is not used: a case
        is the episode itself. The extractions have no tokens (``kind: case``)."""
        out = []
        for rec in records:
            if self.admits(rec):
                title, content = case_text(rec, self.tokenizer, self.max_tokens)
                op, text = Operation("ADD", title, content), content
            else:
                op, text = Operation("NONE"), ""
            out.append(Extraction(id=uuid.uuid4().hex, env_id=rec.env_id, prompt_ids=[], response_ids=[],
                                  logprobs=[], text=text, parse=ParseResult(ops=[op], ok=True, blocks=1),
                                  group_id=rec.group_id, source_episode=rec.source, kind="case"))
        return out


def case_requests(trajs: Sequence[Any], step: int, outcomes: str, key: str,
                  scope: str = "env") -> list[DistillRequest]:
    """The requests of a finished step for a case bank: every episode of both subgroups whose outcome
    ``outcomes`` admits (:func:`admits_case`; ``experience.cases.outcomes``), whole, keyed by its retrieval
    query when ``key`` (``experience.key``) is ``query``, as the other kinds' entries are, written to the
    env's bank partition (:func:`~crl_bench.experience.memory.bank_scope` of ``scope``)."""
    return [DistillRequest(episode_record(t), [], bank_scope(t.env_id, scope), step,
                           entry_key(t) if key == "query" else "")
            for members in by_group(trajs).values() for t in members
            if admits_case(bool(t.turns), t.success, outcomes)]


@register_memory("cases")
class CasesMemory(Memory):
    """Finished episodes as cases (:class:`CaseWriter`), retrieved by similarity and shown under
    :data:`CASES_HEADER`; no extractor model, no merge pass. The memory of ``casebank``."""

    header: ClassVar[str] = CASES_HEADER
    whole_episodes: ClassVar[bool] = True

    def scope(self, env_id: str) -> str:
        """The bank partition of ``env_id`` under ``experience.scope`` (:func:`bank_scope`), as for a
        bank of lessons."""
        return bank_scope(env_id, self.cfg.experience.scope)

    def skips_own_task(self) -> bool:
        """``experience.cases.skip_own``: retrieval leaves out the episode's own task's cases."""
        return bool(self.cfg.experience.cases.skip_own)

    def writer(self, engine: Any, tokenizer: Any) -> Any:
        """A :class:`CaseWriter` measuring with ``tokenizer`` (``experience.cases``); ``engine`` is not
        used."""
        cases = self.cfg.experience.cases
        return CaseWriter(tokenizer, cases.tokens, cases.outcomes)

    def write(self, manager: Any, trajs: Sequence[Any], step: int) -> int:
        """Queue the step's cases (:func:`case_requests`); returns their number."""
        exp_cfg = self.cfg.experience
        reqs = case_requests(trajs, step, exp_cfg.cases.outcomes, exp_cfg.key, exp_cfg.scope)
        if reqs:
            manager.submit(reqs)
        return len(reqs)
