"""ExpeL insights: a list of general rules per env, edited by a frozen extractor model.

The ``expel`` method (crl_bench/methods.py; docs/method.md, "ExpeL insights") follows ExpeL
(Zhao et al., arXiv 2308.10144, section 4.2 and Algorithm 2; released code LeapLabTHU/ExpeL,
``agent/expel.py``):

* The extractor is shown the env's current insights, numbered, and either a successful and a failed
  episode of the same task (a comparison) or successful episodes of different tasks, and answers with
  operations on the list, one per line (at most ``max_ops``, 4 as released):
  ``ADD: <insight>``, ``EDIT <n>: <insight>``, ``UPVOTE <n>``, ``DOWNVOTE <n>`` (the paper's names;
  the released prompt's ``AGREE`` and ``REMOVE`` are read as ``UPVOTE`` and ``DOWNVOTE``). With
  ``experience.insights.match: text`` (default, as released ``update_rules``) a vote quotes its
  insight and names the first insight its text contains, an EDIT containing an insight is an UPVOTE
  of it and an ADD containing one is a repeat (:func:`quoted_insight`); with ``number`` votes and
  edits name insights by number and each insight may be named by one operation of a reply.
* Importance counts (section 4.2): an ADD starts at :data:`INSIGHT_INIT` = 2, an EDIT (which
  replaces the text) and an UPVOTE add 1, a DOWNVOTE takes 1 away, and an insight whose count falls
  to 0 is removed. As released, an ADD that repeats an existing insight is dropped and an EDIT that
  leaves the text as it was counts as an UPVOTE; a reply's operations are applied downvotes first,
  then upvotes, edits and adds (``update_rules``).
* A guided episode is shown all the insights of its env, most important first (section 4.3), and the
  most similar successful case (:mod:`crl_bench.experience.cases`).
* The extractor is not trained (the paper's extractor is a frozen API model).

This project's own choices, where the paper and code leave room or where a training loop differs
from ExpeL's gather-then-extract protocol: insights are extracted during training, from the episodes
of each step (a group is G attempts at one task, so a group with a success and a failure gives the
comparison pair ExpeL gets from Reflexion retries); ``experience.insights.pairs`` pairs per group,
then one call over the first success of up to ``experience.insights.successes`` different tasks (the
paper's L), comparisons before success lists as in Algorithm 2; calls batched together see the same
list. The released code's larger DOWNVOTE on a long list (3 instead of 1) is not followed: the
paper's arithmetic is. When the list holds ``experience.insights.max`` insights or more, the prompt
asks for downvotes and edits before new insights (the released prompt nudges too, towards removals
and only very different new rules; the paper has no cap).

:class:`InsightsMemory` is the memory kind ``insights`` (:mod:`crl_bench.experience.memory`): the
cases of :mod:`crl_bench.experience.cases` plus the insight list, whose calls are
:class:`InsightRequest` on the manager's worker thread.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, get_args

from annotated_types import Ge

from crl_bench.experience.cases import CasesMemory, CaseWriter, case_requests
from crl_bench.experience.json_ops import format_numbered
from crl_bench.experience.memory import Memory, empty_guidance_text, guidance_text, register_memory
from crl_bench.experience.records import by_group, episode_record
from crl_bench.experience.requests import Request
from crl_bench.experience.transcripts import EpisodeRecord, compact_trajectory, outcome_text, strip_observation

INSIGHT_INIT = 2
"""Importance of a new insight (ExpeL section 4.2)."""
INSIGHT_KINDS = ("ADD", "EDIT", "UPVOTE", "DOWNVOTE")
"""Operations on an insight list, in the paper's names."""
APPLY_ORDER = ("DOWNVOTE", "UPVOTE", "EDIT", "ADD")
"""The order a reply's operations are applied in (released ``update_rules``)."""
_ALIASES = {"AGREE": "UPVOTE", "REMOVE": "DOWNVOTE"}
_OP_LINE = re.compile(r"^\s*(?:[-*]\s*|\d+[.)]\s+)?(ADD|EDIT|UPVOTE|DOWNVOTE|AGREE|REMOVE)\b"
                      r"\s*(\d+)?\s*[:.\-]?\s*(.*?)\s*$", re.IGNORECASE)
MIN_INSIGHT_CHARS = 8
"""Shortest text an ADD or EDIT may write (shorter is not a rule)."""


InsightMatch = Literal["text", "number"]
"""Values of ``experience.insights.match``: how an operation names an insight."""
INSIGHT_MATCHES: tuple[str, ...] = get_args(InsightMatch)


@dataclass
class InsightsConfig:
    """Section ``experience.insights``: ExpeL's insight calls (``expel``)."""

    pairs: Annotated[int, Ge(0)] = 1
    """Comparison calls per group with a success and a failure (each a success against a failure of the group's task),
    per step."""
    successes: Annotated[int, Ge(0)] = 4
    """Most successes of different tasks in one success-list call (ExpeL's L: 4 as for WebShop; 8 for ALFWorld does
    not fit a small model's prompt); one call per step when at least two tasks had a success (0 = no success-list
    calls; else at least 2)."""
    ops: Annotated[int, Ge(1)] = 4
    """Most operations of one insight reply (4, as released)."""
    max: Annotated[int, Ge(0)] = 10
    """From this many insights of an env on, the extractor is asked to prefer downvotes and edits and to add only a
    clearly new rule (the released prompt asks for removals first and a new rule only when it is very different;
    10 as in the released ALFWorld runs; 0 = never)."""
    new_tokens: Annotated[int, Ge(8)] = 160
    """Most tokens of one insight reply (at least 8)."""
    match: InsightMatch = "text"
    """How an operation names an insight: ``text`` (as released ``update_rules``: a vote quotes the insight and names
    the first insight whose text its text contains, whatever its number; an EDIT whose text contains an insight is an
    UPVOTE of it; an ADD containing an insight is a repeat) or ``number`` (votes and edits by number alone, an ADD a
    repeat only when equal to an insight: for extractors that do not quote rules word for word)."""


@dataclass(frozen=True)
class Insight:
    """One insight of an env's list.

    Attributes:
        id: bank-assigned id (never reused).
        env_id: the env whose list it is on.
        text: the rule.
        importance: its count (>= 1 while it is on the list).
        created_step, updated_step: actor steps of its ADD and of its last change.
        source_call: id of the extractor call that wrote its text.
    """

    id: int
    env_id: str
    text: str
    importance: int = INSIGHT_INIT
    created_step: int = 0
    updated_step: int = 0
    source_call: str = ""


@dataclass(frozen=True)
class InsightOp:
    """One operation of an extractor reply.

    Attributes:
        kind: one of :data:`INSIGHT_KINDS`.
        number: the 1-based number of the insight it names in the list the extractor was shown
            (0 for ADD).
        text: the new text (ADD, EDIT); for votes, the insight as quoted (``match: text``), else empty.
        by_text: the operation names its insight by text (``experience.insights.match: text``:
            :meth:`InsightTable.apply_insights`), not by number.
    """

    kind: str
    number: int = 0
    text: str = ""
    by_text: bool = False


@dataclass
class InsightParse:
    """What :func:`parse_insight_ops` read from a reply.

    Attributes:
        ops: the valid operations, in reply order.
        errors: one readable message per line that was not a valid operation.
    """

    ops: list[InsightOp] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        """At least one valid operation."""
        return bool(self.ops)


@dataclass
class InsightResult:
    """What the bank made of a reply's operations (:meth:`ExperienceBank.apply_insights`).

    Attributes:
        applied: ``(operation as applied, insight id)``: an EDIT that changed nothing is listed as
            the UPVOTE it counts as.
        rejected: ``(operation, reason)`` for each operation refused.
        removed: ids of the insights a DOWNVOTE took to 0.
    """

    applied: list[tuple[InsightOp, int]] = field(default_factory=list)
    rejected: list[tuple[InsightOp, str]] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


COPY_OVERLAP = 0.6
"""A rule whose word set overlaps one of the prompt's example rules this much (Jaccard) or more is a
copy of it (:func:`copies_example`)."""


def _words(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z0-9]+", text.lower()))


def copies_example(text: str, examples: Sequence[str]) -> bool:
    """Whether ``text`` is one of ``examples`` with a few words changed: the Jaccard overlap of their
    word sets is at least :data:`COPY_OVERLAP`."""
    words = _words(text)
    for ex in examples:
        other = _words(ex)
        if words and other and len(words & other) / len(words | other) >= COPY_OVERLAP:
            return True
    return False


def normalise(text: str) -> str:
    """``text`` with whitespace collapsed, lower case, without a final full stop: how insights are
    compared for repeats."""
    return " ".join(text.split()).lower().rstrip(".")


def quoted_insight(text: str, insights: Sequence[Any]) -> int | None:
    """Index in ``insights`` (objects with ``text``, in the order shown) of the first insight whose text
    ``text`` contains, both :func:`normalise`-d; ``None`` if none does (released ``update_rules``:
    ``rules[i][0] in operation_rule_text``)."""
    quoted = normalise(text)
    for i, ins in enumerate(insights):
        own = normalise(ins.text)
        if own and own in quoted:
            return i
    return None


def repeats_insight(op: InsightOp, live: Sequence[str], shown: Sequence[Any] = ()) -> bool:
    """Whether the ADD ``op`` repeats an insight: its text equals one of ``live`` (the env's list now)
    when ``normalise``-d, or, :attr:`~InsightOp.by_text`, contains one of ``shown`` or ``live``
    (released ``update_rules``: an ADD containing an existing rule is dropped)."""
    if not op.by_text:
        return normalise(op.text) in {normalise(t) for t in live}
    texts = [*(i.text for i in shown), *live]
    return quoted_insight(op.text, [Insight(0, "", t) for t in texts]) is not None


def parse_insight_ops(reply: str, shown: int, max_ops: int = 4,
                      copies: Sequence[str] | None = None, match: str = "number") -> InsightParse:
    """Read a reply's operation lines.

    Args:
        reply: the extractor's text.
        shown: how many insights the extractor was shown (numbers 1..shown may be named).
        max_ops: most operations kept (later ones are errors).
        copies: rules a reply can only have copied from the prompt's format lines and worked
            example (a rule that :func:`copies_example` of one is refused); default
            :data:`INSIGHT_PROMPT_COPIES`.
        match: ``number`` or ``text`` (``experience.insights.match``): with ``text`` the operations
            name insights by text (:attr:`InsightOp.by_text`), a vote needs the quoted insight and no
            number is checked here (the bank resolves them, :meth:`InsightTable.apply_insights`).

    Returns:
        The valid operations and an error for each non-blank line that is not one: an unknown line,
        an ADD or EDIT without a rule of at least :data:`MIN_INSIGHT_CHARS` characters or with a
        rule copied from the prompt, one past ``max_ops``, and by ``number``: an EDIT or a vote
        without a shown number or a second operation on the same number; by ``text``: a vote
        without the insight's text.

    Raises:
        ValueError: an unknown ``match``.
    """
    if match not in INSIGHT_MATCHES:
        raise ValueError(f"match must be one of {INSIGHT_MATCHES}, got {match!r}")
    by_text = match == "text"
    copies = INSIGHT_PROMPT_COPIES if copies is None else copies
    out = InsightParse()
    named: set[int] = set()
    for line in reply.splitlines():
        if not line.strip():
            continue
        m = _OP_LINE.match(line)
        if m is None:
            out.errors.append(f"not an operation: {line.strip()[:80]!r}")
            continue
        kind = _ALIASES.get(m.group(1).upper(), m.group(1).upper())
        number = int(m.group(2)) if m.group(2) else 0
        text = " ".join(m.group(3).split())
        if kind == "ADD":
            number = 0
        elif by_text:
            if kind in ("UPVOTE", "DOWNVOTE") and not text:
                out.errors.append(f"{kind} without the insight's text: {line.strip()[:80]!r}")
                continue
        elif not 1 <= number <= shown:
            out.errors.append(f"{kind} needs the number of a shown insight (1..{shown}), got {m.group(2) or 'none'}")
            continue
        if kind in ("ADD", "EDIT") and len(text) < MIN_INSIGHT_CHARS:
            out.errors.append(f"{kind} without a rule: {line.strip()[:80]!r}")
            continue
        if kind in ("ADD", "EDIT") and copies_example(text, copies):
            out.errors.append(f"{kind} copies the prompt's example: {text[:80]!r}")
            continue
        if number and number in named and not by_text:
            out.errors.append(f"insight {number} named twice")
            continue
        if len(out.ops) >= max_ops:
            out.errors.append(f"more than {max_ops} operations")
            break
        named.add(number)
        out.ops.append(InsightOp(kind, number, text if kind in ("ADD", "EDIT") or by_text else "", by_text))
    return out


def format_insights(insights: Sequence[Insight], empty: str = "(none yet)") -> str:
    """``1. text`` lines, in the order given (the numbering a reply refers to)."""
    return "\n".join(f"{n}. {' '.join(i.text.split())}" for n, i in enumerate(insights, 1)) or empty


# --------------------------------------------------------------------------------------------------
# Prompt

INSIGHT_SYSTEM_PROMPT = """\
You keep a short list of insights for an agent that plays a text game: general rules that help it \
solve new tasks of the game. You are shown the current list and some finished attempts. Improve the \
list with at most {max_ops} operations, one per line, in exactly this form:
ADD: a new general rule
EDIT 2: a better version of insight 2
{votes}
Name each insight at most once. Write only operation lines."""

VOTE_LINES = {"number": "UPVOTE 1 (insight 1 is confirmed by the attempts)\n"
                        "DOWNVOTE 3 (insight 3 is wrong or useless)",
              "text": "UPVOTE 1: insight 1 copied word for word (it is confirmed by the attempts)\n"
                      "DOWNVOTE 3: insight 3 copied word for word (it is wrong or useless)"}
"""The vote lines of :data:`INSIGHT_SYSTEM_PROMPT` by ``experience.insights.match``: a vote names its
insight by number, or quotes it (as the released format ``AGREE <n>: <existing rule>``)."""

INSIGHT_FULL_NOTE = ("The list is long: prefer DOWNVOTE and EDIT, and ADD only a rule that is clearly new "
                     "and important.")

DEMO_SUCCESS = EpisodeRecord(env_id="maze", task_prompt="Reach the exit E.",
                             steps=[("#####\n#@..#\n###E#", "right", "You moved right."),
                                    ("#####\n#.@.#\n###E#", "right", "You moved right."),
                                    ("#####\n#..@#\n###E#", "down", "You reached the exit. You win!")],
                             success=True, reward=1.0)
DEMO_FAILURE = EpisodeRecord(env_id="maze", task_prompt="Reach the exit E.",
                             steps=[("#####\n#@..#\n###E#", "left", "You bumped into a wall."),
                                    ("#####\n#@..#\n###E#", "left", "You bumped into a wall."),
                                    ("#####\n#@..#\n###E#", "up", "You bumped into a wall. Time is up.")],
                             success=False, reward=0.0)
DEMO_INSIGHTS = [Insight(1, "maze", "Walls block you; a move into a wall wastes a turn.")]
DEMO_RULE = "Find the exit on the map first and move towards it."
DEMO_REPLY = f"UPVOTE 1\nADD: {DEMO_RULE}"
"""The worked example shown as an earlier user/assistant exchange (``demo=True``; ``match: number``)."""
DEMO_REPLY_TEXT = f"UPVOTE 1: {DEMO_INSIGHTS[0].text}\nADD: {DEMO_RULE}"
"""The worked example's reply with ``match: text``: the vote quotes the insight."""

INSIGHT_PROMPT_COPIES = ("a new general rule", "a better version of insight 2", DEMO_RULE, DEMO_INSIGHTS[0].text)
"""Rules a reply can only have copied from the prompt (its format lines and worked example), word
for word or nearly (:func:`copies_example`); :func:`parse_insight_ops` refuses them, as the merge
pass drops lessons that repeat its template. Measured with SmolLM2-135M on ``diag-vault`` (smoke
preset, 4 x 8 episodes, 3 steps): without this, the one insight written in each of two runs was the
example's rule, exact or with its last word changed."""


def _attempt(record: EpisodeRecord, body: str) -> str:
    return f"Task: {' '.join(record.task_prompt.split())}\n{body}\nOutcome: {outcome_text(record)}"


class InsightPromptBuilder:
    """Builds the extractor's chat prompt for one insight call.

    Args:
        tokenizer: the extractor's tokenizer (with a chat template).
        max_prompt_tokens: cap on the prompt; the attempts share what the rest leaves (each at least
            ``min_attempt_tokens``).
        max_ops: the operation cap told to the model (the parser's too).
        full_at: from this many insights on, the prompt adds :data:`INSIGHT_FULL_NOTE`
            (``experience.insights.max``; 0 = never).
        demo: show :data:`DEMO_SUCCESS` / :data:`DEMO_FAILURE` -> :data:`DEMO_REPLY` first
            (:data:`DEMO_REPLY_TEXT` with ``match: text``).
        min_attempt_tokens: the least budget of one attempt.
        match: how the replies name insights (:data:`INSIGHT_MATCHES`; ``experience.insights.match``):
            the prompt's vote lines (:data:`VOTE_LINES`) and the parser's (:func:`parse_insight_ops`).

    Raises:
        ValueError: an unknown ``match``.
    """

    def __init__(self, tokenizer: Any, max_prompt_tokens: int = 1536, max_ops: int = 4, full_at: int = 10,
                 demo: bool = True, min_attempt_tokens: int = 48, match: str = "number") -> None:
        if match not in INSIGHT_MATCHES:
            raise ValueError(f"experience.insights.match must be one of {', '.join(INSIGHT_MATCHES)}, got {match!r}")
        self.match = match
        self.tokenizer = tokenizer
        self.max_prompt_tokens = int(max_prompt_tokens)
        self.max_ops = int(max_ops)
        self.full_at = int(full_at)
        self.demo = demo
        self.min_attempt_tokens = int(min_attempt_tokens)

    def user_text(self, env_id: str, insights: Sequence[Insight], successes: Sequence[str],
                  failures: Sequence[str]) -> str:
        """The user message: the game, the numbered insights, the attempts (already rendered)."""
        parts = [f"Game: {env_id}", "Current insights:\n" + format_insights(insights)]
        if failures:
            parts += [f"A successful attempt:\n{s}" for s in successes[:1]]
            parts += [f"A failed attempt at the same task:\n{f}" for f in failures[:1]]
        else:
            parts += [f"Successful attempt {n} (a different task each):\n{s}" for n, s in enumerate(successes, 1)]
        if self.full_at and len(insights) >= self.full_at:
            parts.append(INSIGHT_FULL_NOTE)
        parts.append("Your operations:")
        return "\n\n".join(parts)

    def _messages(self, env_id: str, insights: Sequence[Insight], successes: Sequence[str],
                  failures: Sequence[str]) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": INSIGHT_SYSTEM_PROMPT.format(max_ops=self.max_ops,
                                                                           votes=VOTE_LINES[self.match])}]
        if self.demo:
            big = 10_000
            demo = self.user_text("maze", DEMO_INSIGHTS,
                                  [_attempt(DEMO_SUCCESS, compact_trajectory(DEMO_SUCCESS, self.tokenizer, big,
                                                                             strip_observation))],
                                  [_attempt(DEMO_FAILURE, compact_trajectory(DEMO_FAILURE, self.tokenizer, big,
                                                                             strip_observation))])
            reply = DEMO_REPLY_TEXT if self.match == "text" else DEMO_REPLY
            msgs += [{"role": "user", "content": demo}, {"role": "assistant", "content": reply}]
        msgs.append({"role": "user", "content": self.user_text(env_id, insights, successes, failures)})
        return msgs

    def _ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def build(self, env_id: str, insights: Sequence[Insight], successes: Sequence[EpisodeRecord],
              failures: Sequence[EpisodeRecord] = ()) -> list[int]:
        """Prompt token ids of one call: a comparison (``failures`` given: the first success against
        the first failure) or a list of successes of different tasks.

        Raises:
            ValueError: no success given.
        """
        if not successes:
            raise ValueError("an insight call needs at least one successful episode")
        records = [*successes[:1], *failures[:1]] if failures else list(successes)
        n_succ = 1 if failures else len(records)
        overhead = len(self._ids(self._messages(env_id, insights, [""] * n_succ, [""] if failures else [])))
        budget = max(self.min_attempt_tokens, (self.max_prompt_tokens - overhead) // len(records))
        while True:
            rendered = [_attempt(r, compact_trajectory(r, self.tokenizer, budget, strip_observation)) for r in records]
            succ, fail = (rendered[:1], rendered[1:]) if failures else (rendered, [])
            ids = self._ids(self._messages(env_id, insights, succ, fail))
            if len(ids) <= self.max_prompt_tokens or budget <= self.min_attempt_tokens:
                return ids
            budget = max(self.min_attempt_tokens, budget - max(4, (len(ids) - self.max_prompt_tokens) // len(records)))


@dataclass
class InsightCall:
    """One extractor call on an insight list (never trained).

    Attributes:
        id: uuid4 hex (stored as the ``source_call`` of the insights it writes).
        env_id: the env whose list it edits.
        kind: ``compare`` (a success and a failure of one task) or ``successes`` (successes of
            different tasks).
        shown: the insights the extractor was shown, in the numbering of the prompt.
        text: the reply.
        parse: its operations.
        prompt_tokens, response_tokens: lengths.
        finish_reason: the engine's.
    """

    id: str
    env_id: str
    kind: str
    shown: list[Insight]
    text: str
    parse: InsightParse
    prompt_tokens: int = 0
    response_tokens: int = 0
    finish_reason: str = ""


class InsightWriter(CaseWriter):
    """The distiller of an ``expel`` run: cases as a :class:`CaseWriter` writes them, and insight
    calls of the frozen extractor model.

    Args:
        engine: generation engine over the extractor model (``generate(prompts, sampling)``).
        tokenizer: the extractor's tokenizer (also measures the cases; with ``extractor.model:
            same`` it is the actor's).
        prompts: the :class:`InsightPromptBuilder`.
        sampling: the extractor's sampling for insight replies.
        case_tokens, cases: as :class:`CaseWriter` (``experience.cases.tokens``, ``.outcomes``).

    Raises:
        ValueError: as :class:`CaseWriter`.
    """

    def __init__(self, engine: Any, tokenizer: Any, prompts: InsightPromptBuilder, sampling: Any,
                 case_tokens: int = 256, cases: str = "successes") -> None:
        super().__init__(tokenizer, case_tokens, cases)
        self.engine = engine
        self.prompts = prompts
        self.sampling = sampling
        self.extractor_version = 0

    def insight_calls(self, requests: Sequence[tuple[str, Sequence[EpisodeRecord], Sequence[EpisodeRecord],
                                                     Sequence[Insight]]]) -> list[InsightCall]:
        """One :class:`InsightCall` per ``(env_id, successes, failures, current insights)``, in one
        batched ``generate`` call; a request with failures is a comparison."""
        if not requests:
            return []
        prompts = [self.prompts.build(env, ins, succ, fail) for env, succ, fail, ins in requests]
        replies = self.engine.generate(prompts, self.sampling)
        out = []
        for (env, _succ, fail, ins), reply in zip(requests, replies):
            parse = parse_insight_ops(reply.text, len(ins), self.prompts.max_ops, match=self.prompts.match)
            out.append(InsightCall(uuid.uuid4().hex, env, "compare" if fail else "successes", list(ins), reply.text,
                                   parse, len(reply.prompt_ids), len(reply.response_ids), reply.finish_reason))
        return out


def insight_writer_for(cfg: Any, engine: Any, tokenizer: Any) -> InsightWriter:
    """The :class:`InsightWriter` a :class:`~crl_bench.config.RunConfig` describes: prompts capped at
    ``extractor.max_prompt_tokens``, ``experience.insights.ops`` operations, the long-list note from
    ``experience.insights.max`` on, insights named as ``experience.insights.match`` says, replies of
    at most ``experience.insights.new_tokens`` tokens decoded greedily (ExpeL extracts at
    temperature 0, paper appendix D.5) and ended by a blank line; cases by ``experience.cases``."""
    from crl_bench.llm.base import SamplingParams

    ins, cases = cfg.experience.insights, cfg.experience.cases
    prompts = InsightPromptBuilder(tokenizer, cfg.extractor.max_prompt_tokens, ins.ops, ins.max, match=ins.match)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=ins.new_tokens, stop=("\n\n",))
    return InsightWriter(engine, tokenizer, prompts, sampling, cases.tokens, cases.outcomes)


# --------------------------------------------------------------------------------------------------
# The memory kind

INSIGHTS_HEADER = ("Insights learned from earlier episodes of this game, most important first. Use them where they "
                   "apply to this task; do not follow them blindly.")
"""The header of the insight list (``expel``), shown above the cases."""


def insight_block(insights: Sequence[Insight]) -> str:
    """The insight part of an ``expel`` guided prompt: :data:`INSIGHTS_HEADER` and the numbered
    insights; ``""`` without insights."""
    return guidance_text(format_insights(insights, empty=""), INSIGHTS_HEADER)


@dataclass
class InsightOutcome:
    """An insight call and what the bank made of its operations (the manager's ``pop_insight_outcomes``)."""

    call: InsightCall
    applied: InsightResult


@dataclass
class InsightRequest(Request):
    """One insight call: a comparison of ``successes[0]`` with ``failures[0]`` (one task), or, without
    failures, a list of successes of different tasks.  The call is shown ``env_id``'s insight list as
    it is when the worker takes the request; comparisons of a batch are applied before its success
    lists (Algorithm 2)."""

    order: ClassVar[int] = 10
    needs: ClassVar[str] = "insight_calls"
    env_id: str
    step: int
    successes: list[EpisodeRecord]
    failures: list[EpisodeRecord] = field(default_factory=list)

    @classmethod
    def handle(cls, manager: Any, requests: list[InsightRequest]) -> None:
        """The comparisons, then the success lists (:func:`insight_pass`)."""
        for phase in ([r for r in requests if r.failures], [r for r in requests if not r.failures]):
            insight_pass(manager, phase)


def insight_pass(manager: Any, reqs: list[InsightRequest]) -> None:
    """One batched extractor call for ``reqs`` on the manager's worker thread, each shown its env's
    insight list as it is now; the replies are applied one after the other (a number names the insight
    the call was shown, so an insight another reply of the batch removed is ``gone``) and reported as
    :class:`InsightOutcome`."""
    if not reqs:
        return
    bank = manager.bank
    with manager.lock.read():
        lists = {env: bank.insights(env) for env in {r.env_id for r in reqs}}
    with manager.extractor_lock:
        calls = manager.extractor.insight_calls([(r.env_id, r.successes, r.failures, lists[r.env_id]) for r in reqs])
    for req, call in zip(reqs, calls):
        with manager.lock.write():
            result = bank.apply_insights(call.parse.ops, call.shown, env_id=req.env_id, step=req.step, call_id=call.id)
        with manager.tally() as st:
            st.insight_calls += 1
            st.insight_calls_failed += 0 if call.parse.valid else 1
            for op, _ in result.applied:
                st.insight_kinds[op.kind] = st.insight_kinds.get(op.kind, 0) + 1
        manager.report(insight_outcomes=[InsightOutcome(call, result)])


def insight_requests(trajs: Sequence[Any], step: int, pairs: int, successes: int) -> list[InsightRequest]:
    """The insight calls of a finished step: for each group (one task) with a success and a failure,
    ``pairs`` comparisons (``experience.insights.pairs``), the i-th success against the i-th failure
    (both subgroups); then, per env, the first success of each task in chunks of ``successes``
    (``experience.insights.successes``, ExpeL's L), only chunks of two tasks or more."""
    reqs: list[InsightRequest] = []
    firsts: dict[str, list[EpisodeRecord]] = {}
    for members in by_group(trajs).values():
        wins = [t for t in members if t.success and t.turns]
        losses = [t for t in members if not t.success and t.turns]
        for w, loss in list(zip(wins, losses))[:pairs]:
            reqs.append(InsightRequest(w.env_id, step, [episode_record(w)], [episode_record(loss)]))
        if wins:
            firsts.setdefault(wins[0].env_id, []).append(episode_record(wins[0]))
    for env_id, recs in firsts.items() if successes else ():
        for i in range(0, len(recs), successes):
            if len(recs[i:i + successes]) >= 2:
                reqs.append(InsightRequest(env_id, step, recs[i:i + successes]))
    return reqs


@register_memory("insights")
class InsightsMemory(CasesMemory):
    """ExpeL: cases, and a list of insights per env edited by a frozen extractor model; a guided
    episode is shown its env's insights (:func:`insight_block`, whether or not a case was found) above
    the most similar case. The memory of ``expel``."""

    uses_extractor: ClassVar[bool] = True
    forms: ClassVar[tuple[str, ...]] = ("raw", "condensed")     # both: the guided mode itself

    def writer(self, engine: Any, tokenizer: Any) -> Any:
        """The :class:`InsightWriter` over ``engine`` (:func:`insight_writer_for`); ``None`` without one."""
        return None if engine is None else insight_writer_for(self.cfg, engine, tokenizer)

    def empty_guidance(self) -> str:
        """The insight header and no insight, then the case header and no case."""
        return f"{empty_guidance_text(INSIGHTS_HEADER)}\n\n{empty_guidance_text(self.header)}"

    def guidance(self, manager: Any, env_ids: Sequence[str], bodies: Sequence[str]) -> list[str]:
        """Each episode's env's insight list (:func:`insight_block`) above its cases' block."""
        lists = manager.insights(list(env_ids))
        out = []
        for env_id, text in zip(env_ids, super().guidance(manager, env_ids, bodies)):
            if lists.get(env_id):
                text = "\n\n".join(p for p in (insight_block(lists[env_id]), text) if p)
            out.append(text)
        return out

    def form_guidance(self, manager: Any, form: str, env_ids: Sequence[str],
                      found: Sequence[Sequence[Any]]) -> list[str]:
        """``raw``: the retrieved cases alone (the guided block without the insight list); ``condensed``:
        the env's insight list alone (``""`` where it has none), whatever was retrieved."""
        self.check_form(form)
        if form == "raw":
            return Memory.guidance(self, manager, env_ids, [format_numbered(f, empty="") for f in found])
        lists = manager.insights(list(env_ids))
        return [insight_block(lists[e]) if lists.get(e) else "" for e in env_ids]

    def write(self, manager: Any, trajs: Sequence[Any], step: int) -> int:
        """Queue the step's cases (:func:`~crl_bench.experience.cases.case_requests`), then its insight
        calls (:func:`insight_requests`); returns their number."""
        exp_cfg = self.cfg.experience
        ins = exp_cfg.insights
        reqs: list[Request] = [*case_requests(trajs, step, exp_cfg.cases.outcomes, exp_cfg.key, exp_cfg.scope),
                               *insight_requests(trajs, step, ins.pairs, ins.successes)]
        if reqs:
            manager.submit(reqs)
        return len(reqs)

    def metrics(self, manager: Any, stats: dict[str, Any]) -> dict[str, Any]:
        """The insights held and the insight calls so far (``insights``, ``insight_calls``,
        ``insight_kinds``), and those since the previous row (``insight_calls_step``) with the share
        that parsed into at least one operation (``insight_parse_rate``, only when there were any),
        from the outcomes the manager reports, which this collects."""
        done = manager.pop_insight_outcomes()        # the insight calls since the previous row
        valid = sum(1 for o in done if o.call.parse.valid)
        return {"insights": stats["insights"], "insight_calls": stats["insight_calls"],
                "insight_kinds": stats["insight_kinds"], "insight_calls_step": len(done),
                **({"insight_parse_rate": valid / len(done)} if done else {})}


class InsightTable:
    """The insight lists in the experience bank's table ``insights`` (a mixin of
    :class:`~crl_bench.experience.bank.ExperienceBank`, using its ``_conn``, ``_write``, ``_bump``,
    ``_check_writable`` and ``_has_table``): read, edit with ExpeL's importance arithmetic, and the
    statistics. The bank file holds the table whatever the method, so every bank opens the same way."""

    def insights(self, env_id: str | None = None) -> list[Insight]:
        """The insight list of ``env_id`` (or of every env), most important first, then oldest first
        (the order a guided episode and the extractor see; :mod:`crl_bench.experience.insights`).
        A bank written before insights existed has none."""
        c = self._conn()
        if not self._has_table("insights"):
            return []
        sql = "SELECT id, env_id, text, importance, created_step, updated_step, source_call FROM insights"
        args: tuple = ()
        if env_id is not None:
            sql, args = sql + " WHERE env_id = ?", (env_id,)
        rows = c.execute(sql + " ORDER BY importance DESC, id", args)
        return [Insight(int(r[0]), r[1], r[2], int(r[3]), int(r[4]), int(r[5]), r[6]) for r in rows]

    def apply_insights(self, ops: Sequence[InsightOp], shown: Sequence[Insight], *, env_id: str, step: int,
                       call_id: str) -> InsightResult:
        """Apply one reply's operations to ``env_id``'s insight list, in one transaction, with ExpeL's
        importance arithmetic (arXiv 2308.10144, section 4.2; released ``update_rules``):

        * operations go in :data:`~crl_bench.experience.insights.APPLY_ORDER` (downvotes, upvotes,
          edits, adds), each naming an insight of ``shown`` (the list the extractor was shown): by
          its number, or, for an operation :attr:`~InsightOp.by_text` (``experience.insights.match:
          text``, released), a vote by the first insight of ``shown`` its text contains
          (:func:`quoted_insight`; none: ``unknown_text``), an EDIT whose text contains one as an
          UPVOTE of that one, else by its number;
        * ADD writes a new insight of importance 2, unless its text repeats one on the list
          (``duplicate``: equal to one, or, by text, containing one of ``shown`` or of the live list);
        * EDIT replaces the text and adds 1; an EDIT to the same text counts as an UPVOTE;
        * UPVOTE adds 1; DOWNVOTE takes 1 away and removes an insight that reaches 0;
        * an operation on an insight no longer on the list (another call removed it) is rejected
          (``gone``), as is a number outside ``shown`` (``unknown_number``).

        Rejections are logged in the bank's rejection log and returned, never raised. Counters
        ``insight_<KIND>`` and ``insights_removed`` keep the totals.

        Raises:
            PermissionError: a read-only bank.
        """
        self._check_writable()
        res = InsightResult()
        order = {k: n for n, k in enumerate(APPLY_ORDER)}
        with self._write() as c:
            for op in sorted(ops, key=lambda o: order.get(o.kind, len(order))):
                if op.kind == "ADD":
                    live = [r[0] for r in c.execute("SELECT text FROM insights WHERE env_id = ?", (env_id,))]
                    if repeats_insight(op, live, shown):
                        self._reject_insight(c, res, op, "duplicate", env_id, step, call_id)
                        continue
                    cur = c.execute("INSERT INTO insights(env_id, text, importance, created_step, updated_step, "
                                    "source_call) VALUES (?, ?, ?, ?, ?, ?)",
                                    (env_id, op.text, INSIGHT_INIT, int(step), int(step), call_id))
                    res.applied.append((op, int(cur.lastrowid)))
                    self._bump(c, "insight_ADD")
                    continue
                kind, index = op.kind, op.number - 1
                if op.by_text:
                    quoted = quoted_insight(op.text, shown)
                    if op.kind != "EDIT" or quoted is not None:
                        kind, index = ("UPVOTE" if op.kind == "EDIT" else op.kind), quoted
                    if index is None:
                        self._reject_insight(c, res, op, "unknown_text", env_id, step, call_id)
                        continue
                if not 0 <= index < len(shown):
                    self._reject_insight(c, res, op, "unknown_number", env_id, step, call_id)
                    continue
                target = shown[index]
                row = c.execute("SELECT text, importance FROM insights WHERE id = ? AND env_id = ?",
                                (target.id, env_id)).fetchone()
                if row is None:
                    self._reject_insight(c, res, op, "gone", env_id, step, call_id)
                    continue
                if kind == "EDIT" and normalise(op.text) == normalise(row[0]):
                    kind = "UPVOTE"
                importance = int(row[1]) + (-1 if kind == "DOWNVOTE" else 1)
                if importance <= 0:
                    c.execute("DELETE FROM insights WHERE id = ?", (target.id,))
                    res.removed.append(target.id)
                    self._bump(c, "insights_removed")
                elif kind == "EDIT":
                    c.execute("UPDATE insights SET text = ?, importance = ?, updated_step = ?, source_call = ? "
                              "WHERE id = ?", (op.text, importance, int(step), call_id, target.id))
                else:
                    c.execute("UPDATE insights SET importance = ?, updated_step = ? WHERE id = ?",
                              (importance, int(step), target.id))
                as_applied = op if kind == op.kind else InsightOp(kind, index + 1, by_text=op.by_text)
                res.applied.append((as_applied, target.id))
                self._bump(c, f"insight_{kind}")
        return res

    def _reject_insight(self, c: sqlite3.Connection, res: InsightResult, op: InsightOp, reason: str, env_id: str,
                        step: int, call_id: str) -> None:
        res.rejected.append((op, reason))
        c.execute("INSERT INTO rejections(time, step, extraction_id, env_id, operation, reason) "
                  "VALUES (?, ?, ?, ?, ?, ?)",
                  (time.time(), int(step), str(call_id), str(env_id),
                   json.dumps({"kind": op.kind, "number": op.number, "text": op.text, "list": "insights"}), reason))


    def _insight_stats(self, counters: dict[str, int]) -> dict:
        """The insight lists' part of :meth:`stats`: insights per env, their importance sum, and the
        operations applied per kind and the insights removed over the bank's life."""
        per_env: dict[str, int] = {}
        importance = 0
        for i in self.insights():
            per_env[i.env_id] = per_env.get(i.env_id, 0) + 1
            importance += i.importance
        return {"count": sum(per_env.values()), "per_env": dict(sorted(per_env.items())), "importance_sum": importance,
                "applied": {k: int(counters.get(f"insight_{k}", 0)) for k in ("ADD", "EDIT", "UPVOTE", "DOWNVOTE")},
                "removed": int(counters.get("insights_removed", 0))}

