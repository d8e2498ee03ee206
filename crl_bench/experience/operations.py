"""The strict text format the experience extractor answers in, its parser, and entry rendering.

Format (one reply; one operation per line; tags are matched case-insensitively and whitespace inside
the angle brackets is ignored)::

    <ops>
    <op>ADD</op><title>Short title</title><content>One or two sentences of advice.</content>
    <op>UPDATE 12</op><title>Refined title</title><content>Refined advice.</content>
    <op>MERGE 3 7</op><title>Merged title</title><content>Advice that replaces entries 3 and 7.</content>
    <op>UPVOTE 4</op>
    <op>DOWNVOTE 9</op>
    </ops>

or, when the episode teaches nothing new::

    <ops>
    <op>NONE</op>
    </ops>

Rules:

* A reply is a sequence of *blocks*; a block starts at an ``<op>`` tag and runs to the next ``<op>``,
  the closing ``</ops>`` or the end of the reply.  The ``<ops>`` / ``</ops>`` wrapper is optional for
  the parser (the extractor's generation stops at ``</ops>``; :data:`STOP` is that string).
* An operation is the first line of its block: the header, title and content never contain a line
  break.  Anything on the following lines of the block (before the next ``<op>``) is stray text: it is
  reported as an error and the operation is kept.
* The header inside ``<op>...</op>`` is the kind (``ADD``, ``UPDATE``, ``MERGE``, ``UPVOTE``,
  ``DOWNVOTE``, ``NONE``; ``REFINE`` is accepted as a synonym of ``UPDATE``) followed by entry ids:
  integers separated by spaces or commas, each optionally written ``#12`` or ``[12]``.  ADD and NONE
  take no id, UPDATE exactly one, MERGE two or more distinct ids, a vote one or more (released
  ``upvote`` / ``downvote``: +1 / -1 on each entry's vote count; below 0 the bank deletes the entry).
* Votes and NONE take no title or content.
* ADD / UPDATE / MERGE need a non-empty ``<title>...</title>`` and ``<content>...</content>`` (in
  that order or the other).  Their length is not limited here: the extractor's token budget bounds it
  (released: no limit on a lesson).  ``</content>`` may be left out when the content is the last thing on its
  line: a line break or ``</ops>`` closes it (so a reply stopped at the end of a line is complete;
  :class:`~crl_bench.experience.extractor.Extractor` also treats a reply the model ended with EOS as
  ending its line).  A content that is neither closed nor followed by a line break (a reply cut by
  the token cap) is incomplete.
  Internal whitespace of title and content is collapsed to single spaces; they may not contain the
  format's tags.
* NONE must be the only operation; next to other operations it is dropped (with an error).
* A leading ``<think>...</think>`` block (reasoning models) is skipped.

:func:`parse_operations` never raises: each malformed block is skipped and described in
``ParseResult.errors``; ``ParseResult.ok`` is true only when the whole reply followed the format and
gave at least one operation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from crl_bench.experience.types import OP_KINDS, VOTE_KINDS, ExperienceEntry, Operation

OPEN = "<ops>"
CLOSE = "</ops>"
STOP = CLOSE
"""Stop string of the extractor's generation (kept in the reply by the engines)."""

ALIASES = {"REFINE": "UPDATE"}

_OP_OPEN = re.compile(r"<\s*op\s*>", re.IGNORECASE)
_OPS_OPEN = re.compile(r"^\s*<\s*ops\s*>", re.IGNORECASE)
_OPS_CLOSE = re.compile(r"<\s*/\s*ops\s*>", re.IGNORECASE)
_THINK = re.compile(r"^\s*<\s*think\s*>.*?<\s*/\s*think\s*>", re.IGNORECASE | re.DOTALL)
_HEADER = re.compile(r"^<\s*op\s*>(.*?)<\s*/\s*op\s*>", re.IGNORECASE | re.DOTALL)
_FIELD = {name: re.compile(rf"<\s*{name}\s*>(.*?)<\s*/\s*{name}\s*>", re.IGNORECASE | re.DOTALL)
          for name in ("title", "content")}
_CONTENT_OPEN = re.compile(r"<\s*content\s*>", re.IGNORECASE)
_ANY_TAG = re.compile(r"<\s*/?\s*(?:ops|op|title|content)\s*>", re.IGNORECASE)
_ID = re.compile(r"^(?:#|\[)?(\d+)\]?$")
MAX_ENTRY_ID = 2**63 - 1
"""Largest entry id an operation may name (SQLite's largest integer); a longer number in a reply is
refused as the operation's error before it is converted (Python refuses more than 4,300 digits)."""


@dataclass
class ParseResult:
    """Outcome of :func:`parse_operations`.

    Attributes:
        ops: the valid operations, in reply order (at most ``max_ops``).
        errors: one readable message per problem found (empty when the reply was well-formed).
        ok: the whole reply followed the format (no error) and gave at least one operation.
        blocks: number of ``<op>`` blocks seen (valid or not).
    """

    ops: list[Operation] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ok: bool = False
    blocks: int = 0

    @property
    def valid(self) -> bool:
        """At least one valid operation (the reply is usable even if parts were malformed)."""
        return bool(self.ops)


def _clean(text: str) -> str:
    return " ".join(text.split())


def _parse_ids(words: Sequence[str]) -> tuple[list[int], str]:
    ids: list[int] = []
    for w in words:
        m = _ID.match(w)
        if not m:
            return [], f"entry id {w[:40]!r} is not an integer"
        digits = m.group(1).lstrip("0") or "0"
        if len(digits) > len(str(MAX_ENTRY_ID)) or int(digits) > MAX_ENTRY_ID:
            return [], f"entry id {digits[:20]}... ({len(digits)} digits) is beyond the largest entry id"
        ids.append(int(digits))
    return ids, ""


def _parse_block(block: str, n: int, known_ids: set[int] | None, max_title: int | None,
                 max_content: int | None) -> tuple[Operation | None, list[str]]:
    """Parse one block starting at ``<op>``; returns ``(operation or None, errors)``."""
    where = f"op {n}"
    line, nl, after = block.partition("\n")
    head = _HEADER.match(line)
    if head is None:
        return None, [f"{where}: <op> is not closed by </op> on its line"]
    words = [w for w in re.split(r"[\s,]+", head.group(1).strip()) if w]
    if not words:
        return None, [f"{where}: empty <op></op> header"]
    kind = ALIASES.get(words[0].upper(), words[0].upper())
    if kind not in OP_KINDS:
        return None, [f"{where}: unknown operation kind {words[0]!r}"]
    ids, err = _parse_ids(words[1:])
    if err:
        return None, [f"{where}: {err}"]
    rest = line[head.end():]
    fields: dict[str, str] = {}
    open_field = ""
    leftover = rest
    for name, rx in _FIELD.items():
        found = list(rx.finditer(rest))
        if len(found) > 1:
            return None, [f"{where}: more than one <{name}>"]
        if found:
            fields[name] = _clean(found[0].group(1))
            leftover = leftover.replace(found[0].group(0), " ", 1)
    if "content" not in fields:
        m = _CONTENT_OPEN.search(leftover)
        if m and not _ANY_TAG.search(leftover[m.end():]):
            if nl:                                   # the line break closes the content
                fields["content"] = _clean(leftover[m.end():])
                leftover = leftover[:m.start()]
            else:
                open_field = "content"
    stray = _clean(leftover)
    if kind == "NONE":
        if ids:
            return None, [f"{where}: NONE takes no entry id"]
        if fields or stray or open_field:
            return None, [f"{where}: NONE takes no title or content"]
        return Operation("NONE"), _stray(where, after)
    if kind in VOTE_KINDS:
        ids = list(dict.fromkeys(ids))
        if not ids:
            return None, [f"{where}: {kind} needs at least one entry id"]
        if known_ids is not None:
            unknown = [i for i in ids if i not in known_ids]
            if unknown:
                return None, [f"{where}: unknown entry id(s) {unknown}"]
        if fields or stray or open_field:
            return None, [f"{where}: {kind} takes no title or content"]
        return Operation(kind, targets=tuple(ids)), _stray(where, after)
    if kind == "ADD" and ids:
        return None, [f"{where}: ADD takes no entry id"]
    if kind == "UPDATE" and len(ids) != 1:
        return None, [f"{where}: UPDATE needs exactly one entry id, got {len(ids)}"]
    if kind == "MERGE":
        ids = list(dict.fromkeys(ids))
        if len(ids) < 2:
            return None, [f"{where}: MERGE needs at least two distinct entry ids"]
    if known_ids is not None:
        unknown = [i for i in ids if i not in known_ids]
        if unknown:
            return None, [f"{where}: unknown entry id(s) {unknown}"]
    for name in ("title", "content"):
        if name not in fields:
            opened = name == open_field or re.search(rf"<\s*{name}\s*>", rest, re.IGNORECASE)
            what = "is not closed" if opened else "is missing"
            return None, [f"{where}: <{name}> {what}"]
        if not fields[name]:
            return None, [f"{where}: empty <{name}>"]
    if max_title is not None and len(fields["title"]) > max_title:
        return None, [f"{where}: title longer than {max_title} characters"]
    if max_content is not None and len(fields["content"]) > max_content:
        return None, [f"{where}: content longer than {max_content} characters"]
    errors = [f"{where}: stray text {stray[:40]!r}"] if stray else []
    return Operation(kind, fields["title"], fields["content"], tuple(ids)), errors + _stray(where, after)


def _stray(where: str, text: str) -> list[str]:
    text = _clean(text)
    return [f"{where}: stray text after the operation's line {text[:40]!r}"] if text else []


def parse_operations(text: str, max_ops: int = 4, known_ids: Iterable[int] | None = None, *,
                     max_title_chars: int | None = None,
                     max_content_chars: int | None = None) -> ParseResult:
    """Parse an extractor reply (see the module docstring for the format); never raises.

    Args:
        text: the full reply, including any pre-filled opening (e.g. ``"<ops>\\n<op>" + generated``).
        max_ops: operations kept; valid operations past this count are dropped with an error.
        known_ids: when given, UPDATE / MERGE may only name these ids (the entries the extractor was
            shown); an operation naming another id is skipped with an error.
        max_title_chars, max_content_chars: longer titles / contents make the operation invalid
            (``None``, the default: no limit).

    Returns:
        :class:`ParseResult`.
    """
    res = ParseResult()
    if not isinstance(text, str) or not text.strip():
        res.errors.append("empty reply")
        return res
    known = set(int(i) for i in known_ids) if known_ids is not None else None
    body = _THINK.sub("", text, count=1)
    m = _OPS_OPEN.match(body)
    if m:
        body = body[m.end():]
    close = _OPS_CLOSE.search(body)
    if close:
        body = body[:close.start()] + "\n"      # </ops> ends the last line
    starts = [m.start() for m in _OP_OPEN.finditer(body)]
    if not starts:
        res.errors.append("no <op> block")
        return res
    if body[:starts[0]].strip():
        res.errors.append(f"text before the first <op>: {_clean(body[:starts[0]])[:40]!r}")
    res.blocks = len(starts)
    ops: list[Operation] = []
    for n, (a, b) in enumerate(zip(starts, starts[1:] + [len(body)]), start=1):
        op, errs = _parse_block(body[a:b], n, known, max_title_chars, max_content_chars)
        res.errors.extend(errs)
        if op is not None:
            ops.append(op)
    if any(o.kind == "NONE" for o in ops) and any(o.kind != "NONE" for o in ops):
        res.errors.append("NONE next to other operations: NONE dropped")
        ops = [o for o in ops if o.kind != "NONE"]
    elif sum(o.kind == "NONE" for o in ops) > 1:
        res.errors.append("NONE given more than once")
        ops = ops[:1]
    if len(ops) > max_ops:
        res.errors.append(f"{len(ops)} operations, at most {max_ops} allowed: the rest dropped")
        ops = ops[:max_ops]
    res.ops = ops
    res.ok = bool(ops) and not res.errors
    return res


def _check_field(value: str, what: str) -> None:
    if _ANY_TAG.search(value):
        raise ValueError(f"{what} may not contain the format's tags: {value!r}")


def format_operation(op: Operation) -> str:
    """One operation as a block of the format (no wrapper)."""
    kind = op.kind.upper()
    if kind not in OP_KINDS:
        raise ValueError(f"unknown operation kind {op.kind!r}")
    header = " ".join([kind] + [str(int(i)) for i in op.targets])
    if kind == "NONE":
        return "<op>NONE</op>"
    if kind in VOTE_KINDS:
        return f"<op>{header}</op>"
    _check_field(op.title, "title")
    _check_field(op.content, "content")
    return f"<op>{header}</op><title>{op.title}</title><content>{op.content}</content>"


def format_operations(ops: Sequence[Operation], wrap: bool = True) -> str:
    """Inverse of :func:`parse_operations`: one block per line, inside ``<ops>...</ops>``.

    An empty list is written as a single NONE.  Raises ``ValueError`` on an unknown kind or a title /
    content containing the format's tags.
    """
    lines = [format_operation(op) for op in ops] or ["<op>NONE</op>"]
    if not wrap:
        return "\n".join(lines)
    return "\n".join([OPEN, *lines, CLOSE])


def format_entries(entries: Sequence[ExperienceEntry], empty: str = "(none)") -> str:
    """Entries with their ids, one per line, as shown to the extractor: ``[12] title: content``."""
    if not entries:
        return empty
    return "\n".join(f"[{e.id}] {_clean(e.title)}: {_clean(e.content)}" for e in entries)
