"""Static validation of bank operations: the rejection reasons and the checks that need no database.

:func:`check_operation` looks at one :class:`~crl_bench.experience.types.Operation` alone (kind,
target count and range, text). The checks that need the bank's contents (the targets exist, they
belong to the operation's env) and the runtime failures (embedding, database write) are made by
:meth:`ExperienceBank.apply <crl_bench.experience.bank.ExperienceBank.apply>`, which logs every
refusal with one of :data:`REJECTION_REASONS`. The reason strings are stored in the bank's
``rejections`` table and reported by ``stats()``: they are part of the file format, do not rename.
"""

from __future__ import annotations

from crl_bench.experience.types import OP_KINDS, VOTE_KINDS, Operation

REJECT_UNKNOWN_KIND = "unknown_kind"            # kind not in OP_KINDS
REJECT_EMPTY_TEXT = "empty_text"                # ADD / UPDATE / MERGE with an empty title or content
REJECT_TOO_LONG = "too_long"                    # title or content longer than max_text_chars
REJECT_ADD_TARGETS = "add_with_targets"         # ADD naming target ids
REJECT_UPDATE_TARGETS = "update_target_count"   # UPDATE without exactly one target
REJECT_MERGE_TARGETS = "merge_target_count"     # MERGE with fewer than 2 distinct targets
REJECT_VOTE_TARGETS = "vote_target_count"       # UPVOTE / DOWNVOTE naming no entry
REJECT_UNKNOWN_TARGET = "unknown_target"        # a target id not in the bank (or not an integer)
REJECT_WRONG_ENV = "target_other_env"           # a target belongs to another env id
REJECT_BAD_TEXT = "invalid_text"                # title or content is not encodable text (lone surrogate)
REJECT_EMBED_FAILED = "embedding_failed"        # the embedder raised on the operation's key text
REJECT_WRITE_FAILED = "write_failed"            # the database refused the write (rolled back)
#: every reason an operation can be refused for
REJECTION_REASONS = (REJECT_UNKNOWN_KIND, REJECT_EMPTY_TEXT, REJECT_TOO_LONG, REJECT_ADD_TARGETS,
                     REJECT_UPDATE_TARGETS, REJECT_MERGE_TARGETS, REJECT_VOTE_TARGETS, REJECT_UNKNOWN_TARGET,
                     REJECT_WRONG_ENV, REJECT_BAD_TEXT, REJECT_EMBED_FAILED, REJECT_WRITE_FAILED)
#: largest entry id (SQLite's INTEGER range); entry ids are positive
MAX_ENTRY_ID = 2 ** 63 - 1


def valid_text(text: str) -> bool:
    """Whether ``text`` can be stored and embedded (UTF-8 encodable: no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_operation(op: Operation, max_text_chars: int) -> tuple[str | None, tuple[int, ...]]:
    """Check one operation without the database; never raises on extractor input.

    Checks, in this order (the first that fails is the reason): the kind is one of ``OP_KINDS``
    (``NONE`` passes with no further check); ``targets`` is iterable and every target converts
    with ``int()`` to an id in ``[1, MAX_ENTRY_ID]`` (bools and floats that are not whole numbers,
    ``inf`` and ``nan`` included, do not count as ids); ADD names no target; UPDATE names exactly one; MERGE names
    at least two distinct ones; a vote (UPVOTE / DOWNVOTE) names at least one and needs no text
    (any title or content is ignored); title and content are non-empty after ``strip()``; both are
    UTF-8 encodable; neither is longer than ``max_text_chars`` characters (after ``strip()``) when
    ``max_text_chars`` is positive.

    Args:
        op: the operation (any object with ``kind``, ``title``, ``content``, ``targets``; a missing
            ``kind`` or ``targets`` is tolerated).
        max_text_chars: longest accepted title and longest accepted content, in characters; 0 = no
            limit (the released code bounds a lesson only by the extractor's token budget).

    Returns:
        ``(reason, targets)``: ``reason`` is ``None`` when the operation passes, else one of the
        ``REJECT_*`` strings; ``targets`` are the distinct target ids as ints, in order of first
        appearance (``()`` when they could not be read).
    """
    kind = getattr(op, "kind", None)
    if kind not in OP_KINDS:
        return REJECT_UNKNOWN_KIND, ()
    if kind == "NONE":
        return None, ()
    raw = getattr(op, "targets", ()) or ()
    try:
        raw = tuple(raw)
        if any(isinstance(t, bool) or (isinstance(t, float) and not t.is_integer()) for t in raw):
            raise ValueError
        targets = tuple(dict.fromkeys(int(t) for t in raw))
        if any(not 0 < t <= MAX_ENTRY_ID for t in targets):
            raise ValueError         # ids are positive SQLite integers: 99999999999999999999 is no id
    except (TypeError, ValueError, OverflowError):   # OverflowError: int(float("inf"))
        return REJECT_UNKNOWN_TARGET, ()
    if kind == "ADD" and raw:
        return REJECT_ADD_TARGETS, targets
    if kind == "UPDATE" and len(tuple(raw)) != 1:
        return REJECT_UPDATE_TARGETS, targets
    if kind == "MERGE" and len(targets) < 2:
        return REJECT_MERGE_TARGETS, targets
    if kind in VOTE_KINDS:
        return (None, targets) if targets else (REJECT_VOTE_TARGETS, targets)
    title, content = str(op.title or "").strip(), str(op.content or "").strip()
    if not title or not content:
        return REJECT_EMPTY_TEXT, targets
    if not (valid_text(title) and valid_text(content)):
        return REJECT_BAD_TEXT, targets
    if max_text_chars > 0 and (len(title) > max_text_chars or len(content) > max_text_chars):
        return REJECT_TOO_LONG, targets
    return None, targets
