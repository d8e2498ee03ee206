"""The extractor's second answer format, "json": think, then a JSON list of operations, and its parser.

Modelled on the extractor format of the released Complementary RL code.  A reply is::

    <think>optional reasoning</think>
    <answer>[
      {"function_name": "add", "parameters": {"title": "Short title", "content": "The lesson."}},
      {"function_name": "update", "parameters": {"target_ids": [2], "title": "...", "content": "..."}},
      {"function_name": "update", "parameters": {"target_ids": [1, 3], "title": "...", "content": "..."}},
      {"function_name": "upvote", "parameters": {"target_ids": [1]}},
      {"function_name": "downvote", "parameters": {"target_ids": [4]}}
    ]</answer>

or, when nothing should change, ``<answer>[{"function_name": "return"}]</answer>``.

Lessons are shown to the extractor numbered ``1..n`` (:func:`format_numbered`), not by bank id;
``target_ids`` name those numbers and are mapped to bank ids through ``shown_ids``
(lesson ``k`` is ``shown_ids[k - 1]``).

Mapping to :class:`~crl_bench.experience.types.Operation`:

* ``add`` -> ``Operation("ADD", title, content)``; other parameters (e.g. ``target_ids``) are ignored.
* ``update`` with one distinct target -> ``Operation("UPDATE", title, content, (bank_id,))``; with two
  or more distinct targets -> ``Operation("MERGE", title, content, (bank_id, ...))`` (the released
  ``update`` replaces all its targets by one new lesson).  ``idx`` and ``target_idx`` are accepted as
  aliases of ``target_ids`` (naming the same lessons when more than one is given), and a bare integer
  as a one-element list.  Targets are de-duplicated after mapping, in order.
* ``upvote`` / ``downvote`` -> ``Operation("UPVOTE" | "DOWNVOTE", targets=(bank_id, ...))`` (the
  released voting: the bank adds +1 / -1 to each target's vote count and deletes an entry whose count
  falls below 0).
* A lesson number outside ``1..len(shown_ids)`` is dropped with an error noted, as the released code
  skips such an index when it executes the operation: an ``update`` left with no target is written as
  an ``add`` (released: nothing deleted, the new lesson added), a vote left with none is dropped.
* ``return`` stops reading: later list items are neither read nor checked.  As the first item it
  gives the single operation ``Operation("NONE")``.

Rules (as the released parser, the reply is all or nothing):

* A leading ``<think>...</think>`` block is skipped (an unclosed leading ``<think>`` leaves no
  answer).  The LAST ``<answer>...</answer>`` block of the rest is parsed; text outside it is ignored.
  Tags are matched case-insensitively, whitespace inside the angle brackets is ignored, and a Markdown
  code fence around the JSON (```` ```json ... ``` ````) is removed.
* The answer is read with :func:`json.loads`: a list of operation objects, or one object (taken as
  a one-element list).  An empty list is an error.
* Any invalid operation read (not an object, unknown or non-string ``function_name``, non-object
  ``parameters``, ``title`` / ``content`` missing, not a string, empty, longer than the optional
  ``max_title_chars`` / ``max_content_chars`` (no limit by default: the token budget bounds a lesson,
  as released), containing one of the tags ``<ops> <op> <title> <content> <think> <answer>`` (opening
  or closing) or text that is not valid UTF-8 such as a lone surrogate; a target that is not an
  integer, or an empty target list) rejects the whole reply: ``ops == []``.  Internal whitespace of
  title and content is collapsed to single spaces before the checks.
* More than ``max_ops`` operations (``return`` not counted): the first ``max_ops`` are kept and an
  error is recorded.

:func:`parse_json_operations` never raises on any reply (non-strings, invalid JSON, huge numbers, lone
surrogates, deeply nested JSON included) and returns the :class:`~crl_bench.experience.operations.
ParseResult` of the text format: ``ok`` is true only when the whole reply was valid (no error) and
gave at least one operation; ``blocks`` counts the list items read (``return`` included).
"""

from __future__ import annotations

import json
import re
import reprlib
from collections.abc import Sequence
from typing import Any

from crl_bench.experience.operations import ParseResult
from crl_bench.experience.types import ExperienceEntry, Operation

TARGET_KEYS = ("target_ids", "idx", "target_idx")
"""Accepted names of the targets of an ``update`` or a vote, in order of preference (the released
prompts write ``target_idx`` for updates and ``idx`` for votes)."""

JSON_SYSTEM_PROMPT = """\
You maintain the lessons of an agent that acts in a text environment. You are shown one finished \
episode (every message of it, the agent's own reasoning included), whether it succeeded, and the \
lessons that guided it, numbered 1, 2, 3, ... Improve the lessons so that the agent succeeds more \
often in new episodes of this kind of task.

A good lesson is detailed and can be acted on directly: say when it applies (what the agent will \
observe), what to do step by step, how to decide between options, and what to avoid and why. Keep \
it general: no coordinates or details that only held in this one episode. Prefer improving an \
existing lesson over adding a near-duplicate.

Think first inside <think></think>. Then answer inside <answer></answer> with a JSON list of at \
most {max_ops} operations, each an object:
- {{"function_name": "add", "parameters": {{"title": ..., "content": ...}}}} writes a new lesson.
- {{"function_name": "update", "parameters": {{"target_ids": [...], "title": ..., "content": ...}}}} \
rewrites lessons: target_ids lists lesson numbers as shown. One number rewrites that lesson; two or \
more replace all of them by this one lesson.
- {{"function_name": "upvote", "parameters": {{"target_ids": [...]}}}} marks shown lessons that \
helped.
- {{"function_name": "downvote", "parameters": {{"target_ids": [...]}}}} marks shown lessons that \
misled the agent; a lesson with more downvotes than upvotes is deleted.
- {{"function_name": "return"}} ends the list. Answer [{{"function_name": "return"}}] when nothing \
should change.

Example:
<answer>[{{"function_name": "add", "parameters": {{"title": "Scan before moving", "content": "At the \
start, and whenever the target is not in view, read the whole map and locate the goal symbol. If a \
wall lies on the direct line, step around it on the side with open floor instead of pushing into \
it; if no route is visible, explore the nearest unexplored edge first."}}}}, {{"function_name": \
"downvote", "parameters": {{"target_ids": [2]}}}}]</answer>"""
"""System prompt of the json format (the ``paper`` preset's extractor contract: detailed lessons of
any length, votes, the whole transcript); a ``str.format`` template with ``{max_ops}`` (as
:class:`~crl_bench.experience.extractor.ExtractorPromptBuilder` uses it; literal braces are doubled)."""

JSON_FOLD_SYSTEM_PROMPT = """\
You maintain the lessons of an agent that acts in a text environment. Below are some of its \
lessons, numbered 1, 2, 3, ... Consolidate them into fewer, stronger lessons: join lessons that \
share one idea, rewrite lessons that are too specific to one episode so that they hold in general, \
and leave out lessons that are wrong or that contradict better ones. Keep every useful condition \
and step; a lesson may be long.

The lessons you write REPLACE ALL the lessons shown. Think first inside <think></think>. Then \
answer inside <answer></answer> with a JSON list of the lessons that should remain, each written \
as {"function_name": "add", "parameters": {"title": ..., "content": ...}}; or answer \
[{"function_name": "return"}] to keep the lessons exactly as they are.

Example:
<answer>[{"function_name": "add", "parameters": {"title": "Avoid walls", "content": "Before each \
move check the square you are moving into; walking into a wall wastes a turn, so step around it on \
the side with open floor."}}]</answer>"""
"""System prompt of the json format's merge pass (the fold: the reply replaces every lesson shown);
used as is (no format fields, not a format template, as
:class:`~crl_bench.experience.extractor.FoldPromptBuilder` uses it)."""

JSON_MERGE_SYSTEM_PROMPT = """\
You look after a small set of general lessons for an agent that acts in a text environment. The \
lessons below, numbered 1, 2, 3, ..., say nearly the same thing. You may first think inside \
<think></think>. Then answer inside <answer></answer> with a JSON list holding exactly one \
operation:
- {"function_name": "update", "parameters": {"target_ids": [1, 3], "title": ..., "content": ...}} \
joins the named lessons (two or more numbers) into one lesson that keeps what is useful in each; \
with a single number it only rewrites that lesson.
- {"function_name": "return"} keeps the lessons as they are.
Use only the numbers shown. Keep the title to a few words and the content to one or two sentences.

Example:
<answer>[{"function_name": "update", "parameters": {"target_ids": [1, 2], "title": "Avoid walls", \
"content": "Check the map before each move; walking into a wall wastes a turn."}}]</answer>"""
"""System prompt of the json format's ``similar`` merge candidates; used as is (no format fields, not a format
template, as :class:`~crl_bench.experience.extractor.MergePromptBuilder` uses it)."""

_THINK = re.compile(r"^\s*<\s*think\s*>.*?<\s*/\s*think\s*>", re.IGNORECASE | re.DOTALL)
_THINK_OPEN = re.compile(r"^\s*<\s*think\s*>", re.IGNORECASE)
_ANSWER_OPEN = re.compile(r"<\s*answer\s*>", re.IGNORECASE)
_ANSWER_CLOSE = re.compile(r"<\s*/\s*answer\s*>", re.IGNORECASE)
_FENCE_LANG = re.compile(r"[A-Za-z0-9_-]*")
_FORBIDDEN_TAG = re.compile(r"<\s*/?\s*(?:ops|op|title|content|think|answer)\s*>", re.IGNORECASE)

_short = reprlib.Repr()
_short.maxlevel = 2
_short.maxstring = 40
_short.maxother = 40
_short.maxlong = 40
_short.maxlist = _short.maxdict = 4


def _show(value: Any) -> str:
    """A short repr for error messages (bounded depth and length; never raises)."""
    try:
        return _short.repr(value)
    except Exception:  # noqa: BLE001 - any repr failure (e.g. an int too long to print): a type name
        return f"<{type(value).__name__}>"


def _clean(text: str) -> str:
    return " ".join(text.split())


def format_numbered(entries: Sequence[ExperienceEntry], empty: str = "(none)") -> str:
    """Entries as shown to the extractor in the json format: ``"1. title: content"`` per line.

    Numbers are 1-based positions in ``entries`` (the ``target_ids`` of the answer); pass
    ``[e.id for e in entries]`` as ``shown_ids`` to :func:`parse_json_operations`.  Internal whitespace
    is collapsed.  Returns ``empty`` when there are no entries.
    """
    if not entries:
        return empty
    return "\n".join(f"{n}. {_clean(e.title)}: {_clean(e.content)}" for n, e in enumerate(entries, start=1))


def format_json_operations(ops: Sequence[Operation], shown_ids: Sequence[int]) -> str:
    """Inverse of :func:`parse_json_operations`: ``<answer>[...]</answer>`` holding ``ops`` as the
    released function calls (no think block), targets written as the 1-based numbers of ``shown_ids``
    (the lessons as :func:`format_numbered` shows them).  An empty list, or ``[Operation("NONE")]``, is
    written as ``[{"function_name": "return"}]``.  What a scripted teacher writes for the extractor's
    warm start (:mod:`crl_bench.trainer.extractor_sft`).

    Raises:
        ValueError: a kind this format cannot write (an ``UPDATE`` / ``MERGE`` / vote naming an id that
            is not in ``shown_ids``, or an unknown kind).
    """
    position = {bank_id: n for n, bank_id in enumerate(shown_ids, start=1)}

    def numbers(op: Operation) -> list[int]:
        missing = [t for t in op.targets if t not in position]
        if missing or not op.targets:
            raise ValueError(f"{op.kind} names ids {list(op.targets)}, not all among the shown {list(shown_ids)}")
        return [position[t] for t in op.targets]

    items: list[dict[str, Any]] = []
    for op in ops:
        kind = op.kind.upper()
        if kind == "NONE":
            continue
        if kind == "ADD":
            items.append({"function_name": "add", "parameters": {"title": op.title, "content": op.content}})
        elif kind in ("UPDATE", "MERGE"):
            items.append({"function_name": "update", "parameters": {"target_ids": numbers(op), "title": op.title,
                                                                   "content": op.content}})
        elif kind in ("UPVOTE", "DOWNVOTE"):
            items.append({"function_name": kind.lower(), "parameters": {"target_ids": numbers(op)}})
        else:
            raise ValueError(f"unknown operation kind {op.kind!r}")
    return "<answer>" + json.dumps(items or [{"function_name": "return"}], ensure_ascii=False) + "</answer>"


def _answer_body(text: str) -> tuple[str | None, str]:
    """The inside of the last ``<answer>...</answer>`` after a leading think block; ``(None, error)``
    when there is none."""
    think = _THINK.match(text)
    if think:
        text = text[think.end():]
    elif _THINK_OPEN.match(text):
        return None, "<think> is not closed (no answer after it)"
    closes = list(_ANSWER_CLOSE.finditer(text))
    if not closes:
        if _ANSWER_OPEN.search(text):
            return None, "<answer> is not closed by </answer>"
        return None, "no <answer>...</answer> block"
    close = closes[-1]
    opens = list(_ANSWER_OPEN.finditer(text, 0, close.start()))
    if not opens:
        return None, "</answer> without <answer>"
    body = text[opens[-1].end():close.start()].strip()
    if len(body) >= 6 and body.startswith("```") and body.endswith("```"):    # a Markdown code fence
        inner = body[3:-3]
        body = inner[_FENCE_LANG.match(inner).end():]                         # its language tag
    return body, ""


def _text_field(params: dict, name: str, max_chars: int | None) -> tuple[str, str]:
    """``(cleaned value, "")`` or ``("", error)`` for the ``title`` / ``content`` parameter."""
    if name not in params:
        return "", f"{name} is missing"
    value = params[name]
    if not isinstance(value, str):
        return "", f"{name} is not a string: {_show(value)}"
    value = _clean(value)
    if not value:
        return "", f"empty {name}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "", f"{name} is not valid UTF-8 text (lone surrogate)"
    if max_chars is not None and len(value) > max_chars:
        return "", f"{name} longer than {max_chars} characters"
    if _FORBIDDEN_TAG.search(value):
        return "", f"{name} contains a format tag: {_show(value)}"
    return value, ""


def _numbers(value: Any, key: str) -> tuple[list[int], str]:
    """Lesson numbers of a target parameter: an int or a non-empty list of ints (bools refused)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value], ""
    if not isinstance(value, list):
        return [], f"{key} is not an integer or a list of integers: {_show(value)}"
    if not value:
        return [], f"{key} is empty"
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool):
            return [], f"{key} holds a non-integer target {_show(v)}"
    return list(value), ""


def _targets(params: dict, shown_ids: Sequence[int], kind: str) -> tuple[tuple[int, ...], str, str]:
    """Bank ids named by an ``update`` or a vote (distinct, in order; lesson numbers outside the
    shown range dropped) as ``(ids, error, note)``: ``error`` (the reply is invalid) when the
    parameter is missing or malformed, ``note`` when numbers were out of range."""
    present = [k for k in TARGET_KEYS if k in params]
    if not present:
        return (), f"{kind} needs target_ids", ""
    chosen: list[int] | None = None
    for key in present:
        nums, err = _numbers(params[key], key)
        if err:
            return (), err, ""
        if chosen is not None and nums != chosen:
            return (), f"{' and '.join(present)} name different lessons", ""
        chosen = nums
    assert chosen is not None
    bad = [n for n in chosen if not 1 <= n <= len(shown_ids)]
    note = ""
    if bad:
        shown = f"1..{len(shown_ids)}" if shown_ids else "none"
        note = f"lesson number {_show(bad[0])} out of range (shown: {shown}): dropped"
    ids = tuple(dict.fromkeys(shown_ids[n - 1] for n in chosen if 1 <= n <= len(shown_ids)))
    return ids, "", note


def _parse_item(item: Any, n: int, shown_ids: Sequence[int], max_title: int | None,
                max_content: int | None) -> tuple[Operation | None, str, str, bool]:
    """One list item: ``(operation or None, error, note, stop)``; ``stop`` is true for ``return``; an
    ``error`` makes the reply invalid, a ``note`` (out-of-range lesson numbers) does not."""
    where = f"op {n}"
    if not isinstance(item, dict):
        return None, f"{where}: not an object: {_show(item)}", "", False
    name = item.get("function_name")
    if not isinstance(name, str):
        what = "missing" if name is None else f"not a string: {_show(name)}"
        return None, f"{where}: function_name {what}", "", False
    kind = name.strip().lower()
    if kind == "return":
        return None, "", "", True
    if kind not in ("add", "update", "upvote", "downvote"):
        return None, f"{where}: unknown function_name {_show(name)}", "", False
    params = item.get("parameters")
    if not isinstance(params, dict):
        what = "missing" if params is None else f"not an object: {_show(params)}"
        return None, f"{where}: parameters {what}", "", False
    targets: tuple[int, ...] = ()
    note = ""
    if kind != "add":
        targets, err, note = _targets(params, shown_ids, kind)
        if err:
            return None, f"{where}: {err}", "", False
        note = f"{where}: {note}" if note else ""
    if kind in ("upvote", "downvote"):
        return (Operation(kind.upper(), targets=targets) if targets else None), "", note, False
    title, err = _text_field(params, "title", max_title)
    if err:
        return None, f"{where}: {err}", "", False
    content, err = _text_field(params, "content", max_content)
    if err:
        return None, f"{where}: {err}", "", False
    if kind == "add" or not targets:
        return Operation("ADD", title, content), "", note, False
    return Operation("UPDATE" if len(targets) == 1 else "MERGE", title, content, targets), "", note, False


def parse_json_operations(text: str, shown_ids: Sequence[int], max_ops: int = 3, *,
                          max_title_chars: int | None = None,
                          max_content_chars: int | None = None) -> ParseResult:
    """Parse an extractor reply in the json format (see the module docstring); never raises on ``text``.

    Args:
        text: the full reply, including any pre-filled opening (e.g. ``"<think>" + generated``).
        shown_ids: bank ids of the lessons shown to the extractor, in the order shown: lesson number
            ``k`` of the answer is ``shown_ids[k - 1]`` (``[]`` when none was shown: every lesson
            number is then out of range).
        max_ops: operations kept; past this count the rest are dropped with an error (the reply
            stays usable: ``ParseResult.valid``, not ``ok``).
        max_title_chars, max_content_chars: longer titles / contents make the reply invalid (``None``,
            the default: no limit).

    Returns:
        :class:`~crl_bench.experience.operations.ParseResult`: ``ops`` empty whenever any operation
        read was invalid; ``errors`` one message per problem; ``ok`` only for a wholly valid reply
        with at least one operation; ``blocks`` the number of list items read.

    Raises:
        TypeError / ValueError: only when ``shown_ids`` is not a sequence of integers (a caller bug).
    """
    ids = [int(i) for i in shown_ids]
    res = ParseResult()
    if not isinstance(text, str):
        res.errors.append(f"reply is not a string: {type(text).__name__}")
        return res
    if not text.strip():
        res.errors.append("empty reply")
        return res
    body, err = _answer_body(text)
    if body is None:
        res.errors.append(err)
        return res
    try:
        data = json.loads(body)
    except RecursionError:
        res.errors.append("answer is not valid JSON: nested too deeply")
        return res
    except ValueError as exc:                  # json.JSONDecodeError, integer too long to convert
        res.errors.append(f"answer is not valid JSON: {_show(str(exc))}")
        return res
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        res.errors.append(f"answer is not a JSON list of operations: {_show(data)}")
        return res
    if not data:
        res.errors.append("empty operation list")
        return res
    ops: list[Operation] = []
    errors: list[str] = []
    notes: list[str] = []
    stopped = False
    for n, item in enumerate(data, start=1):
        res.blocks = n
        op, err, note, stopped = _parse_item(item, n, ids, max_title_chars, max_content_chars)
        if stopped:
            break
        if err:
            errors.append(err)
            continue
        if note:
            notes.append(note)
        if op is not None:
            ops.append(op)
    if errors:
        res.errors = errors + ["invalid operation: the whole reply is rejected"]
        return res
    res.errors = notes
    if not ops and stopped:
        ops = [Operation("NONE")]
    if len(ops) > max_ops:
        res.errors.append(f"{len(ops)} operations, at most {max_ops} allowed: the rest dropped")
        ops = ops[:max(max_ops, 0)]
    res.ops = ops
    res.ok = bool(ops) and not res.errors
    return res
