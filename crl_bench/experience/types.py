"""Experience entries and bank operations."""

from __future__ import annotations

from dataclasses import dataclass, field

OP_KINDS = ("ADD", "UPDATE", "MERGE", "UPVOTE", "DOWNVOTE", "NONE")
"""Every operation kind an extractor reply can carry (docs/method.md, "Extractor output format")."""
WRITE_KINDS = ("ADD", "UPDATE", "MERGE")
"""Kinds that write an entry (the extraction becomes the entry's source and can be credited)."""
VOTE_KINDS = ("UPVOTE", "DOWNVOTE")
"""Kinds that change the vote count of entries the extractor was shown (released ``upvote`` /
``downvote``: a downvote that takes the count below 0 deletes the entry)."""
ORIGINS = ("add", "update", "merge", "fold", "import")
"""How an entry came to be (column ``origin``): an ADD, an UPDATE of one entry, a MERGE of several
entries named by one extraction, a merge pass (the fold over an env's entries), or
:meth:`~crl_bench.experience.bank.ExperienceBank.add_vectors` (benchmarks, imports)."""


@dataclass(frozen=True)
class Operation:
    """One bank operation proposed by the extractor.

    Attributes:
        kind: ``ADD`` (new entry), ``UPDATE`` (rewrite one entry), ``MERGE`` (replace several entries
            by one), ``UPVOTE`` / ``DOWNVOTE`` (change the vote count of the named entries) or ``NONE``
            (change nothing).
        title: short title of the new/rewritten/merged entry (empty for votes and NONE).
        content: the lesson text (empty for votes and NONE).
        targets: entry ids the operation acts on: none for ADD/NONE, exactly one for UPDATE, two or
            more for MERGE, one or more for a vote.
    """

    kind: str
    title: str = ""
    content: str = ""
    targets: tuple[int, ...] = ()


@dataclass
class ExperienceEntry:
    """A stored lesson.

    Attributes:
        id: bank-assigned integer id (never reused). An UPDATE, a MERGE and a merge pass write new
            entries with new ids (the released code deletes the old uid and adds a new one), so an
            id names one text for its whole life.
        env_id: environment (task family) the lesson comes from.
        title, content: the lesson.
        created_step, updated_step: actor training steps at creation / last change.
        source_extraction: id of the extraction that wrote it (for extractor rewards).
        extractor_version: extractor version (number of extractor updates) that wrote it
            (stored in the bank's column ``generation``).
        times_retrieved: how often it was given to the actor.
        times_success, times_failure: outcomes of the episodes it guided.
        last_retrieved: unix time (s) of the last retrieval, 0 if never.
        votes: the extractor's vote count (released ``votes_count``: +1 per UPVOTE, -1 per DOWNVOTE;
            below 0 the entry is deleted); 0 for a new entry.
        parent_ids: ids of the entries this one replaced (UPDATE: one, MERGE and merge pass: several;
            empty for an ADD): lineage for provenance, they are no longer in the bank.
        origin: one of :data:`ORIGINS`.
        utility: moving average of the success of the guided training episodes it was shown to
            (starts at 0.5; :meth:`~crl_bench.experience.bank.ExperienceBank.record_outcome`); read by
            the ``utility`` re-rank.
        source_case: the raw case of the entry: the episode it was written from, compacted as a case
            bank stores it (``"task: Outcome: ... Start: ... Step 1: ..."``,
            :func:`crl_bench.experience.cases.case_text` at ``experience.cases.tokens``); for an entry
            written without an episode (a merge call, a merge pass) its first parent's; ``""`` when
            none is known (imports, banks older than the column). Shown by the ``raw`` and ``both``
            memory controls (docs/evaluation.md "Memory forms"), never in training.
    """

    id: int
    env_id: str
    title: str
    content: str
    created_step: int = 0
    updated_step: int = 0
    source_extraction: str = ""
    extractor_version: int = 0
    times_retrieved: int = 0
    times_success: int = 0
    times_failure: int = 0
    last_retrieved: float = 0.0
    votes: int = 0
    parent_ids: tuple[int, ...] = ()
    origin: str = "add"
    utility: float = 0.5
    source_case: str = ""

    def text(self) -> str:
        """The text that is embedded and shown to the actor: ``"title: content"``."""
        return f"{self.title}: {self.content}"


@dataclass
class ApplyResult:
    """Outcome of applying a list of operations.

    Attributes:
        applied: ``(operation, resulting entry id or None)`` for each applied operation (``None`` for
            NONE and for votes).
        rejected: ``(operation, reason)`` for each operation that was refused (nothing of it applied).
        evicted: ids removed by the capacity cap.
        deleted_by_vote: ids removed because a DOWNVOTE took their count below 0.
    """

    applied: list[tuple[Operation, int | None]] = field(default_factory=list)
    rejected: list[tuple[Operation, str]] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    deleted_by_vote: list[int] = field(default_factory=list)


JUDGED_INVALID = "invalid"
"""The actor-critic judgement of a reply that was no decision (trainer/actor_critic.py): the extractor
is then not shown the entries when it distils the episode."""


@dataclass
class RetrievalRecord:
    """What one guided episode was given, recorded at retrieval time (credit comes from here, never
    from the bank later, where an UPDATE or MERGE may have rewritten or removed the entry).

    Attributes:
        entries: snapshots of the retrieved entries as they were (id, ``source_extraction``: the
            extraction to credit, title and content).
        guidance: the exact text put into the actor's prompt from these entries ("" when nothing
            was shown): :attr:`crl_bench.rollout.Guidance.text` of the episode.
        judgement: the actor-critic decision (``accept`` / ``refine`` / ``reject`` / ``invalid``), or
            "" when the judge is off.  After an ``invalid`` judgement the extractor is not shown the
            entries when it distils the episode (released: the episode's retrieved uids are cleared).
    """

    entries: list[ExperienceEntry] = field(default_factory=list)
    guidance: str = ""
    judgement: str = ""
