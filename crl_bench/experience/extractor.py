"""The experience extractor's inference side: episode record -> prompt -> a sampled reply -> operations.

Complementary RL (arXiv 2603.17621, docs/method.md): a second LLM reads a finished episode (task,
observations, actions, outcome) together with the bank entries that guided it and answers with
ADD / UPDATE / MERGE / NONE operations, in the strict one-line format of
:mod:`crl_bench.experience.operations` (``extractor.format: line``) or the released JSON format of
:mod:`crl_bench.experience.json_ops` (``json``); :func:`extractor_for` builds either.  The background
manager (:mod:`crl_bench.experience.manager`) applies the operations of its samples
(:class:`Extraction`) to the bank.

* The episode it reads is an :class:`~crl_bench.experience.transcripts.EpisodeRecord`, rendered by
  :func:`~crl_bench.experience.transcripts.compact_trajectory` or
  :func:`~crl_bench.experience.transcripts.full_transcript` (``extractor.transcript``;
  :mod:`crl_bench.experience.transcripts`).
* :class:`ExtractorPromptBuilder` builds the chat prompt; :class:`Extractor` samples one reply per
  record in a single batched ``engine.generate`` call; :class:`FoldPromptBuilder` and
  :meth:`Extractor.extract_fold` do the same for the merge pass (the released fold over an env's
  entries), :class:`MergePromptBuilder` and :meth:`Extractor.extract_merges` for the ``similar``
  merge candidates; :func:`fold_items` reads a merge-pass reply.

The extractor's training belongs to the trainer (nothing here imports it): its reward and advantages
are in :mod:`crl_bench.trainer.extractor_training`, its CISPO loss is
:func:`crl_bench.trainer.losses.cispo_loss`, and :mod:`crl_bench.trainer.experience_track` credits an
extraction with the outcomes of the episodes its entries guided.
"""

from __future__ import annotations

import contextlib
import re
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from crl_bench.experience.operations import STOP, ParseResult, format_entries, format_operations, parse_operations
from crl_bench.experience.transcripts import (
    EpisodeRecord,
    Transcript,
    compact_trajectory,
    cut_tokens,
    full_transcript,
    outcome_text,
    strip_observation,
)
from crl_bench.experience.types import ExperienceEntry, Operation
from crl_bench.llm.base import Engine, SamplingParams

# --------------------------------------------------------------------------------------------------
# Prompt

SYSTEM_PROMPT = """\
You keep a notebook of lessons for an agent that plays a game. Read one finished game and the \
agent's current lessons. Then write operations that improve the notebook, so the agent plays \
better next time.

There are six kinds of operation:
ADD: write a new lesson.
UPDATE with one id: rewrite that lesson.
MERGE with two or more ids: join those lessons into one.
UPVOTE with ids: those lessons helped.
DOWNVOTE with ids: those lessons misled the agent; a lesson with more downvotes than upvotes is \
deleted.
NONE: change nothing.
Every ADD, UPDATE or MERGE has a title of a few words and a content of one or two sentences of \
advice. Write each operation on one line.

Answer in exactly this format and nothing else:
<ops>
<op>ADD</op><title>Look before you move</title><content>Read the map first and plan a route \
that goes around walls.</content>
<op>UPDATE 5</op><title>title of lesson 5</title><content>better advice</content>
<op>MERGE 2 5</op><title>joined title</title><content>joined advice</content>
<op>DOWNVOTE 7</op>
</ops>

Rules: at most {max_ops} operations. Only use the ids of the current lessons. A lesson is general \
advice that helps in new games, not a list of moves. End with </ops>."""

USER_TEMPLATE = """\
Game: {env_id}
Task: {task}

What happened:
{trajectory}

Outcome: {outcome}

Current lessons:
{entries}

Write the operations."""


DEMO_RECORD = EpisodeRecord(
    env_id="maze", task_prompt="Reach the exit E.",
    steps=[("#####\n#@..#\n###E#", "left", "You bumped into a wall."),
           ("#####\n#@..#\n###E#", "right", "You moved right."),
           ("#####\n#.@.#\n###E#", "right", "You moved right."),
           ("#####\n#..@#\n###E#", "down", "You reached the exit. You win!")],
    success=True, reward=1.0)
DEMO_ENTRIES = [ExperienceEntry(4, "maze", "Walls block you", "Walking into a wall wastes a turn.")]
DEMO_OPS = [Operation("ADD", "Head for the exit", "Find the exit on the map and take the shortest path to it.")]
"""The worked example shown as an earlier user/assistant exchange (``demo=True``)."""




class ExtractorPromptBuilder:
    """Builds the extractor's chat prompt (system + user message, generation prompt, prefill).

    The user message holds the game, the task, the compacted trajectory, the outcome and the retrieved
    entries with their ids (``[12] title: content``).  The trajectory gets whatever the rest leaves of
    ``max_prompt_tokens``; entries are dropped from the end when fewer than ``min_trajectory_tokens``
    would be left.

    Args:
        tokenizer: tokenizer with a chat template.
        max_prompt_tokens: hard cap on the prompt length (prefill included).
        prefill: text put after the generation prompt; the model continues it and the reply is parsed
            as ``prefill + generated``.  Default ``"<ops>\\n<op>"`` (the model's first token is the
            operation kind).
        max_ops: the operation cap told to the model (use the same value for parsing).
        system_prompt, user_template: override the wording (``{max_ops}``; ``{env_id}``, ``{task}``,
            ``{trajectory}``, ``{outcome}``, ``{entries}``).
        min_trajectory_tokens: see above.
        decode_fn: observation hook passed to :func:`compact_trajectory` (default
            :func:`strip_observation`; ``None`` shows observations as they are).
        demo: show a worked example (:data:`DEMO_RECORD` -> :data:`DEMO_OPS`) as an earlier
            user/assistant exchange (the same for every prompt, so the engine's prefix cache
            reuses it).  Measured with SmolLM2-135M at temperature 1 (24 replies each): 9/24 replies
            with a valid operation with the example, 0/24 without.
        entry_format: renders the entries for the prompt (default ``[id] title: content`` lines).
        transcript: ``compact`` (:func:`compact_trajectory`: one line per action, the last
            observations; small models and short budgets) or ``full`` (:func:`full_transcript`: every
            observation and the actor's whole replies, as released).
    """

    def __init__(self, tokenizer: Any, max_prompt_tokens: int = 1536, prefill: str = "<ops>\n<op>",
                 max_ops: int = 4, system_prompt: str = SYSTEM_PROMPT, user_template: str = USER_TEMPLATE,
                 min_trajectory_tokens: int = 128,
                 decode_fn: Callable[[str], str] | None = strip_observation, demo: bool = True,
                 entry_format: Callable[[Sequence[ExperienceEntry]], str] = format_entries,
                 transcript: str = "compact") -> None:
        if transcript not in get_args(Transcript):
            raise ValueError(f"transcript must be compact or full, got {transcript!r}")
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.prefill = prefill
        self.max_ops = max_ops
        self.system_prompt = system_prompt
        self.user_template = user_template
        self.min_trajectory_tokens = min_trajectory_tokens
        self.decode_fn = decode_fn
        self.demo = demo
        self.entry_format = entry_format
        self.transcript = transcript

    def render(self, record: EpisodeRecord, max_tokens: int) -> str:
        """The episode as the prompt shows it, within ``max_tokens`` (``transcript`` decides how)."""
        if self.transcript == "full":
            return full_transcript(record, self.tokenizer, max_tokens)
        return compact_trajectory(record, self.tokenizer, max_tokens, self.decode_fn)

    def user_text(self, record: EpisodeRecord, entries: Sequence[ExperienceEntry], trajectory: str) -> str:
        """The user message."""
        return self.user_template.format(env_id=record.env_id, task=" ".join(record.task_prompt.split()),
                                         trajectory=trajectory, outcome=outcome_text(record),
                                         entries=self.entry_format(entries))

    def messages(self, record: EpisodeRecord, entries: Sequence[ExperienceEntry],
                 trajectory: str) -> list[dict[str, str]]:
        """Chat messages: system, optional worked example (user + assistant), user."""
        msgs = [{"role": "system", "content": self.system_prompt.format(max_ops=self.max_ops)}]
        if self.demo:
            demo_traj = compact_trajectory(DEMO_RECORD, self.tokenizer, 10_000, self.decode_fn)
            msgs.append({"role": "user", "content": self.user_text(DEMO_RECORD, DEMO_ENTRIES, demo_traj)})
            msgs.append({"role": "assistant", "content": format_operations(DEMO_OPS)})
        msgs.append({"role": "user", "content": self.user_text(record, entries, trajectory)})
        return msgs

    def _text(self, record: EpisodeRecord, entries: Sequence[ExperienceEntry], trajectory: str) -> str:
        messages = self.messages(record, entries, trajectory)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text + self.prefill

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prepare(self, record: EpisodeRecord, retrieved: Sequence[ExperienceEntry]
                ) -> tuple[list[int], list[ExperienceEntry], str]:
        """``(prompt ids, entries actually shown, compacted trajectory text)``."""
        shown = list(retrieved)
        while True:
            overhead = len(self._ids(self._text(record, shown, "")))
            budget = self.max_prompt_tokens - overhead
            if budget >= self.min_trajectory_tokens or not shown:
                break
            shown.pop()
        budget = max(budget, 0)
        while True:
            traj = self.render(record, budget)
            ids = self._ids(self._text(record, shown, traj))
            if len(ids) <= self.max_prompt_tokens or budget <= 0:
                return ids, shown, traj
            budget -= max(len(ids) - self.max_prompt_tokens, 4)

    def build(self, record: EpisodeRecord, retrieved: Sequence[ExperienceEntry]) -> list[int]:
        """Prompt token ids (chat template, generation prompt, prefill)."""
        return self.prepare(record, retrieved)[0]


# --------------------------------------------------------------------------------------------------
# Sampling

DEFAULT_SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=96, stop=(STOP, "\n"))
"""Extractor defaults for small models: temperature 1, one operation per reply (generation stops at
the end of the first operation's line, which also closes its content), at most 96 new tokens."""


@dataclass
class Extraction:
    """One extractor sample (a training sample for CISPO once it has a reward).

    Attributes:
        id: uuid4 hex; written to ``ExperienceEntry.source_extraction`` by the bank.
        env_id: environment of the episode.
        prompt_ids: prompt token ids (prefill included).
        response_ids: generated token ids (the only tokens trained).
        logprobs: behaviour log-prob of each response token (same length as ``response_ids``).
        text: the reply as parsed: ``prefill + generated text``.
        parse: the parsed operations and errors.
        extractor_version: extractor version (number of extractor updates) that sampled it.
        group_id: GRPO group of the source episode.
        source_episode: the record's ``source`` key.
        reward: set once known (``None`` before).
        shown_ids: ids of the entries the extractor was shown (UPDATE / MERGE may only name these).
        finish_reason: the engine's finish reason (``stop`` / ``eos`` / ``length``).
        kind: ``distill`` (an episode or a turn), ``merge`` (a call of the merge pass), ``answer``
            (an answer to the actor's search-tool query) or ``case`` (an episode a
            :class:`~crl_bench.experience.cases.CaseWriter` stored: no tokens, never trained).

    What the bank made of the operations is not stored here: the experience manager reports it
    beside the extraction (:class:`crl_bench.experience.manager.ExtractionOutcome`).
    """

    id: str
    env_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    parse: ParseResult
    extractor_version: int = 0
    group_id: int = 0
    source_episode: Any = None
    reward: float | None = None
    shown_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    kind: str = "distill"


class Extractor:
    """Samples extractions for a batch of episode records.

    Args:
        engine: generation engine over the extractor model.
        tokenizer: its tokenizer.
        prompt_builder: :class:`ExtractorPromptBuilder`.
        sampling: sampling settings; stop at ``"</ops>"``, and also at ``"\n"`` for one operation per
            reply (:data:`DEFAULT_SAMPLING`; without the ``"\n"`` stop a reply may hold up to the builder's
            ``max_ops``).
        extractor_version: extractor version stamped on the extractions (bump after each update).
        restrict_ids: UPDATE / MERGE may only name the entries shown in the prompt.
        merge_prompts: prompt builder of ``similar`` merge candidates (default:
            :class:`MergePromptBuilder` with the same prefill as ``prompt_builder``).
        fold_prompts: prompt builder of the merge pass's fold (default: :class:`FoldPromptBuilder`
            with the same prefill).
        answer_prompts: prompt builder of search-tool answers (default: :class:`AnswerPromptBuilder`).
        parse_fn: ``parse_fn(reply, shown_ids, max_ops) -> ParseResult`` reading a reply whose
            extractor was shown ``shown_ids``, keeping at most ``max_ops`` operations; default: the
            one-line format (:func:`parse_operations`).
    """

    def __init__(self, engine: Engine, tokenizer: Any, prompt_builder: ExtractorPromptBuilder,
                 sampling: SamplingParams = DEFAULT_SAMPLING, extractor_version: int = 0,
                 restrict_ids: bool = True, merge_prompts: MergePromptBuilder | None = None,
                 parse_fn: Callable[[str, list[int], int], ParseResult] | None = None,
                 fold_prompts: FoldPromptBuilder | None = None,
                 answer_prompts: AnswerPromptBuilder | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompts = prompt_builder
        self.sampling = sampling
        self.extractor_version = extractor_version
        self.restrict_ids = restrict_ids
        self.merge_prompts = merge_prompts or MergePromptBuilder(tokenizer, prompt_builder.prefill)
        self.fold_prompts = fold_prompts or FoldPromptBuilder(tokenizer, prompt_builder.prefill)
        self.answer_prompts = answer_prompts or AnswerPromptBuilder(tokenizer,
                                                                    max_prompt_tokens=prompt_builder.max_prompt_tokens)
        self.parse_fn = parse_fn

    def _background_step(self) -> contextlib.AbstractContextManager[Any]:
        """A step of background work of the engine's compute gate when the engine generates in the
        background (:class:`~crl_bench.llm.gate.ComputeGate`), else nothing.  Never held across a
        ``generate`` call, which opens its own steps."""
        gate = getattr(self.engine, "gate", None)
        if gate is None or not getattr(self.engine, "background", False):
            return contextlib.nullcontext()
        return gate.background()

    def _parse(self, text: str, shown_ids: list[int], max_ops: int | None = None) -> ParseResult:
        """Read a reply, keeping at most ``max_ops`` operations (default: the distillation prompt's
        ``max_ops``)."""
        limit = self.prompts.max_ops if max_ops is None else max_ops
        if self.parse_fn is not None:
            return self.parse_fn(text, shown_ids, limit)
        return parse_operations(text, limit, shown_ids if self.restrict_ids else None)

    def extract(self, records: Sequence[EpisodeRecord],
                retrieved: Sequence[Sequence[ExperienceEntry]] | None = None) -> list[Extraction]:
        """One :class:`Extraction` per record, in order (one batched ``generate`` call).

        ``retrieved[i]`` are the entries that guided episode ``i`` (empty for experience-free ones).
        """
        if retrieved is None:
            retrieved = [[] for _ in records]
        if len(retrieved) != len(records):
            raise ValueError(f"{len(retrieved)} retrieved lists for {len(records)} records")
        if not records:
            return []
        with self._background_step():         # templating and tokenising trajectories is CPU work too
            prepared = [self.prompts.prepare(r, e) for r, e in zip(records, retrieved)]
        replies = self.engine.generate([p[0] for p in prepared], self.sampling)
        out = []
        for rec, (_ids, shown, _), reply in zip(records, prepared, replies):
            text = self.prompts.prefill + reply.text
            shown_ids = [e.id for e in shown]
            # a reply the model ended itself (EOS) ends its last line, which closes an open <content>
            parse = self._parse(text + ("\n" if reply.finish_reason == "eos" else ""), shown_ids)
            out.append(Extraction(uuid.uuid4().hex, rec.env_id, list(reply.prompt_ids), list(reply.response_ids),
                                  list(reply.logprobs), text, parse, self.extractor_version, rec.group_id,
                                  rec.source, None, shown_ids, reply.finish_reason))
        return out


    def _sample(self, prompts: list[list[int]], env_ids: Sequence[str], prefill: str, kind: str,
                shown: Sequence[Sequence[int]], parse: Callable[[str, list[int]], ParseResult]) -> list[Extraction]:
        replies = self.engine.generate(prompts, self.sampling)
        out = []
        for env_id, ids, reply in zip(env_ids, shown, replies):
            text = prefill + reply.text
            res = parse(text + ("\n" if reply.finish_reason == "eos" else ""), list(ids))
            out.append(Extraction(uuid.uuid4().hex, env_id, list(reply.prompt_ids), list(reply.response_ids),
                                  list(reply.logprobs), text, res, self.extractor_version, 0, kind, None,
                                  list(ids), reply.finish_reason, kind))
        return out

    def extract_merges(self, groups: Sequence[Sequence[ExperienceEntry]]) -> list[Extraction]:
        """One consolidation :class:`Extraction` per group of similar entries (``experience.merge.mode:
        similar``).

        The extractor sees the entries with their ids and may MERGE some of them into one, UPDATE one,
        or answer NONE; only the shown ids may be named.  One batched ``generate`` call.
        """
        if not groups:
            return []
        return self._sample([self.merge_prompts.build(g) for g in groups], [g[0].env_id if g else "" for g in groups],
                            self.merge_prompts.prefill, "merge", [[e.id for e in g] for g in groups], self._parse)

    def extract_fold(self, chunks: Sequence[Sequence[tuple[str, str]]], env_ids: Sequence[str]) -> list[Extraction]:
        """One call of the merge pass per chunk of ``(title, content)`` lessons of env ``env_ids[i]``
        (one batched ``generate`` call); read each reply with :func:`fold_items`."""
        if len(chunks) != len(env_ids):
            raise ValueError(f"{len(env_ids)} env ids for {len(chunks)} chunks")
        if not chunks:
            return []
        return self._sample([self.fold_prompts.build(c, e) for c, e in zip(chunks, env_ids)], env_ids,
                            self.fold_prompts.prefill, "merge", [[] for _ in chunks], self._parse_fold)

    def _parse_fold(self, text: str, _shown: list[int]) -> ParseResult:
        # a fold reply lists lessons (ADD operations) or says NONE / return; no lesson number is named.
        # Its prompt names no limit and the released parse_answer_to_list keeps every item, so every
        # lesson is kept: the chunk's originals are deleted once the reply is applied
        return self._parse(text, [], max_ops=sys.maxsize)

    def answer(self, queries: Sequence[str], knowledge: Sequence[str], env_ids: Sequence[str]) -> list[Extraction]:
        """The extractor's answers to the actor's search-tool queries, each given the retrieved
        ``knowledge`` text (released ``search_and_ask``); one batched ``generate`` call.  The answer
        text is :func:`answer_text` of ``Extraction.text``."""
        if not queries:
            return []
        prompts = [self.answer_prompts.build(q, k, e) for q, k, e in zip(queries, knowledge, env_ids)]
        return self._sample(prompts, env_ids, "", "answer", [[] for _ in queries],
                            lambda text, _ids: ParseResult(ok=bool(answer_text(text))))


FOLD_MIN_CHARS = 31
"""A lesson of a merge-pass reply shorter than this many characters (``"title: content"``) is left
out, as the released ``parse_answer_to_list`` drops items of 30 characters or fewer."""


def fold_items(parse: ParseResult) -> list[tuple[str, str]] | None:
    """What one call of the merge pass returned, from its parsed reply: ``[]`` for "keep the lessons
    as they are" (a NONE operation; released ``return``), the ``(title, content)`` of each ADD
    operation whose text is at least :data:`FOLD_MIN_CHARS` long and is not a copy of the prompt's
    example (:data:`FOLD_PROMPT_COPIES`), or ``None`` when the reply gave no such lesson (released: a
    parse failure; the chunk's lessons are kept).  Operations of other kinds are ignored."""
    if any(op.kind == "NONE" for op in parse.ops):
        return []
    items = [(op.title, op.content) for op in parse.ops if op.kind == "ADD"
             and len(f"{op.title}: {op.content}") >= FOLD_MIN_CHARS
             and (op.title.lower(), op.content.lower()) not in FOLD_PROMPT_COPIES]
    return items or None


_ANSWER_BLOCK = re.compile(r"<\s*answer\s*>(.*?)<\s*/\s*answer\s*>", re.IGNORECASE | re.DOTALL)


def answer_text(reply: str) -> str:
    """The answer of a search-tool reply: the inside of its last ``<answer>...</answer>`` block, else
    the whole reply (released ``tool_use_parsing_pattern``), whitespace collapsed."""
    found = _ANSWER_BLOCK.findall(reply or "")
    return " ".join((found[-1] if found else (reply or "")).split())


MERGE_SYSTEM_PROMPT = """You keep a small notebook of lessons for an agent that plays a text game. Several lessons below say nearly the same thing. Tidy them up with exactly one operation on one line:
- <op>MERGE 3 7</op><title>...</title><content>...</content> replaces lessons 3 and 7 by one lesson that keeps what is useful in both;
- <op>UPDATE 3</op><title>...</title><content>...</content> rewrites lesson 3 only;
- <op>NONE</op> when they should stay as they are.
Use only the lesson numbers shown. Keep titles short and the content to one or two sentences.
"""  # noqa: E501 - prompt text: its line breaks are what the model reads


class MergePromptBuilder:
    """The chat prompt of ``experience.merge.mode: similar``: the similar entries with their ids, then the prefill.

    Args:
        tokenizer: tokenizer with a chat template.
        prefill: same convention as :class:`ExtractorPromptBuilder` (default ``"<ops>\\n<op>"``).
        system_prompt: override the wording.
        entry_format: renders the entries (default ``[id] title: content`` lines).
    """

    def __init__(self, tokenizer: Any, prefill: str = "<ops>\n<op>",
                 system_prompt: str = MERGE_SYSTEM_PROMPT,
                 entry_format: Callable[[Sequence[ExperienceEntry]], str] = format_entries) -> None:
        self.tokenizer = tokenizer
        self.prefill = prefill
        self.system_prompt = system_prompt
        self.entry_format = entry_format

    def build(self, entries: Sequence[ExperienceEntry]) -> list[int]:
        """Prompt token ids for consolidating ``entries``."""
        env = entries[0].env_id if entries else ""
        user = f"Game: {env}\nLessons:\n{self.entry_format(entries)}\n\nYour operation:"
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text + self.prefill, add_special_tokens=False)


FOLD_SYSTEM_PROMPT = """\
You keep the notebook of lessons of an agent that plays a text game. Below are some of its lessons, \
numbered. Rewrite them as fewer, better lessons: join lessons that say the same thing, make lessons \
that only fit one game general, and leave out wrong ones. The lessons you write replace ALL the \
lessons shown.

Answer in exactly this format and nothing else, one lesson per line, each with a title of a few \
words and a content of one or two sentences of advice:
<ops>
<op>ADD</op><title>Title of the first lesson</title><content>Its advice.</content>
</ops>
or answer <op>NONE</op> to keep the lessons exactly as they are."""

FOLD_DEMO_ITEMS = [("Walls block you", "Walking into a wall wastes a turn."),
                   ("Avoid walls", "Do not move into a wall; it costs a turn."),
                   ("Head for the exit", "Find the exit on the map and take the shortest path to it.")]
FOLD_DEMO_REPLY = [Operation("ADD", "Go around walls to the exit",
                             "Find the exit on the map and take the shortest path to it; every move into a wall "
                             "wastes a turn.")]
"""The worked example of the merge-pass prompt, shown as an earlier user/assistant exchange
(:class:`FoldPromptBuilder` with ``demo=True``)."""

FOLD_PROMPT_COPIES = {("title of the first lesson", "its advice."),
                     *((op.title.lower(), op.content.lower()) for op in FOLD_DEMO_REPLY)}
"""Lessons a merge-pass reply can only have copied from the prompt (its format line and its worked
example); :func:`fold_items` leaves them out, as the released parser drops lessons that only
repeat its template."""


def _numbered_items(items: Sequence[tuple[str, str]]) -> str:
    return "\n".join(f"{n}. {' '.join(t.split())}: {' '.join(c.split())}" for n, (t, c) in enumerate(items, 1)) \
        or "(none)"


class FoldPromptBuilder:
    """The merge pass's chat prompt: a chunk of lessons, numbered, then the prefill.

    Args:
        tokenizer: tokenizer with a chat template.
        prefill: same convention as :class:`ExtractorPromptBuilder` (default ``"<ops>\\n<op>"``).
        system_prompt: the wording (:data:`FOLD_SYSTEM_PROMPT`; the json format's is
            :data:`~crl_bench.experience.json_ops.JSON_FOLD_SYSTEM_PROMPT`).
        demo: show the worked example (:data:`FOLD_DEMO_ITEMS` -> :data:`FOLD_DEMO_REPLY`) as an
            earlier exchange (the ``line`` format; measured with SmolLM2-135M at temperature 0.7 on a
            run's bank: without it 35 of 36 replies copied the numbered list and gave no lesson).
    """

    def __init__(self, tokenizer: Any, prefill: str = "<ops>\n<op>", system_prompt: str = FOLD_SYSTEM_PROMPT,
                 demo: bool = True) -> None:
        self.tokenizer = tokenizer
        self.prefill = prefill
        self.system_prompt = system_prompt
        self.demo = demo

    @staticmethod
    def user_text(items: Sequence[tuple[str, str]], env_id: str) -> str:
        return f"Game: {env_id}\nLessons:\n{_numbered_items(items)}\n\nYour lessons:"

    def build(self, items: Sequence[tuple[str, str]], env_id: str) -> list[int]:
        """Prompt token ids for folding ``items`` (``(title, content)`` lessons of ``env_id``)."""
        messages = [{"role": "system", "content": self.system_prompt}]
        if self.demo:
            messages += [{"role": "user", "content": self.user_text(FOLD_DEMO_ITEMS, "maze")},
                         {"role": "assistant", "content": format_operations(FOLD_DEMO_REPLY)}]
        messages.append({"role": "user", "content": self.user_text(items, env_id)})
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text + self.prefill, add_special_tokens=False)


ANSWER_SYSTEM_PROMPT = """\
An agent in the middle of a task is stuck and asks a question. You are given its question and \
knowledge retrieved from its notebook of lessons, which may be wrong or only partly relevant. \
Answer with concrete advice that helps the agent take its next steps; do not discuss the retrieved \
knowledge itself. You may think first inside <think></think>; put the advice inside \
<answer></answer>."""


class AnswerPromptBuilder:
    """The chat prompt of an answer to the actor's search-tool query (question, retrieved knowledge).

    Args:
        tokenizer: tokenizer with a chat template.
        system_prompt: the wording (default :data:`ANSWER_SYSTEM_PROMPT`, this project's own).
        max_prompt_tokens: the question and the knowledge are each cut to fit this budget.
    """

    def __init__(self, tokenizer: Any, system_prompt: str = ANSWER_SYSTEM_PROMPT,
                 max_prompt_tokens: int = 1536) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.max_prompt_tokens = max_prompt_tokens

    def build(self, query: str, knowledge: str, env_id: str) -> list[int]:
        """Prompt token ids for one answer."""
        room = max(self.max_prompt_tokens // 3, 16)
        user = (f"Game: {env_id}\nQuestion: {cut_tokens(self.tokenizer, query.strip(), room)}\n\n"
                f"Retrieved knowledge:\n{cut_tokens(self.tokenizer, knowledge.strip(), room)}\n\nYour advice:")
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------------------------------
# From the run configuration

def extractor_for(xc: Any, engine: Engine, tokenizer: Any) -> Extractor:
    """The :class:`Extractor` an :class:`~crl_bench.config.ExtractorConfig` describes: its answer format
    (``line`` / ``json``), transcript (``compact`` / ``full``), prompt budget, operation cap and
    sampling, over ``engine`` and the extractor's own ``tokenizer``.

    The ``json`` format generates without a stop string and reads the last ``<answer>`` block (the
    released extractor: a thinking model may write the tags inside its reasoning); ``line`` stops at
    ``</ops>`` (and at the end of the first line with ``one_op_per_reply``).

    Raises ``ValueError`` for an unknown ``xc.format`` or ``xc.transcript``.
    """
    if xc.format == "json":
        from crl_bench.experience import json_ops

        builder = ExtractorPromptBuilder(tokenizer, xc.max_prompt_tokens, prefill="", max_ops=xc.max_ops,
                                         system_prompt=json_ops.JSON_SYSTEM_PROMPT, demo=False,
                                         entry_format=json_ops.format_numbered, transcript=xc.transcript)
        merge = MergePromptBuilder(tokenizer, prefill="", system_prompt=json_ops.JSON_MERGE_SYSTEM_PROMPT,
                                   entry_format=json_ops.format_numbered)
        fold = FoldPromptBuilder(tokenizer, prefill="", system_prompt=json_ops.JSON_FOLD_SYSTEM_PROMPT, demo=False)
        sampling = SamplingParams(temperature=xc.temperature, top_p=xc.top_p, top_k=xc.top_k,
                                  max_new_tokens=xc.max_new_tokens, stop=())
        return Extractor(engine, tokenizer, builder, sampling, merge_prompts=merge, fold_prompts=fold,
                         parse_fn=json_ops.parse_json_operations)
    if xc.format != "line":
        raise ValueError(f"extractor.format must be line or json, got {xc.format!r}")
    stop = (STOP, "\n") if xc.one_op_per_reply else (STOP,)
    sampling = SamplingParams(temperature=xc.temperature, top_p=xc.top_p, top_k=xc.top_k,
                              max_new_tokens=xc.max_new_tokens, stop=stop)
    return Extractor(engine, tokenizer, ExtractorPromptBuilder(tokenizer, xc.max_prompt_tokens, max_ops=xc.max_ops,
                                                               transcript=xc.transcript), sampling)
