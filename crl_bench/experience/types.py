"""Experience entries and bank operations."""

from __future__ import annotations

from dataclasses import dataclass, field

OP_KINDS = ("ADD", "UPDATE", "MERGE", "NONE")


@dataclass(frozen=True)
class Operation:
    """One bank operation proposed by the extractor.

    Attributes:
        kind: ``ADD`` (new entry), ``UPDATE`` (refine one entry), ``MERGE`` (replace several entries by
            one) or ``NONE`` (change nothing).
        title: short title of the new/refined/merged entry (empty for NONE).
        content: the lesson text (empty for NONE).
        targets: entry ids the operation acts on: none for ADD/NONE, exactly one for UPDATE, two or
            more for MERGE.
    """

    kind: str
    title: str = ""
    content: str = ""
    targets: tuple[int, ...] = ()


@dataclass
class ExperienceEntry:
    """A stored lesson.

    Attributes:
        id: bank-assigned integer id (never reused).
        env_id: environment (task family) the lesson comes from.
        title, content: the lesson.
        created_step, updated_step: actor training steps at creation / last change.
        source_extraction: id of the extraction that last wrote it (for extractor rewards).
        extractor_version: extractor version (number of extractor updates) that last wrote it
            (stored in the bank's column ``generation``).
        times_retrieved: how often it was given to the actor.
        times_success, times_failure: outcomes of the episodes it guided.
        last_retrieved: unix time (s) of the last retrieval, 0 if never.
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

    def text(self) -> str:
        """The text that is embedded and shown to the actor: ``"title: content"``."""
        return f"{self.title}: {self.content}"


@dataclass
class ApplyResult:
    """Outcome of applying a list of operations.

    Attributes:
        applied: ``(operation, resulting entry id or None for NONE)`` for each applied operation.
        rejected: ``(operation, reason)`` for each operation that was refused (nothing of it applied).
        evicted: ids removed by the capacity cap.
    """

    applied: list[tuple[Operation, int | None]] = field(default_factory=list)
    rejected: list[tuple[Operation, str]] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
