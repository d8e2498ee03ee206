"""Reflexion's verbal reflections: after a failed attempt the actor writes what to do differently,
and later attempts at the same task are shown the task's most recent reflections.

The ``reflexion`` method (crl_bench/methods.py; docs/method.md, "Reflexion") follows Reflexion
(Shinn et al., arXiv 2303.11366, section 3; released code noahshinn/reflexion):

* After an episode that failed, a reflection is written from the task, the trajectory and its outcome
  (the paper's self-reflection model; here the actor itself, with its weights of the moment).
* Reflections are kept per task (the env and the task id); an attempt at a task is shown the task's
  most recent ``experience.reflections.shown`` (the paper's Omega: 3 for ALFWorld and HotpotQA,
  section 4), oldest first, under :data:`REFLECTIONS_HEADER`.
* The reflector is shown the task's earlier reflections too (its last ``experience.reflections.shown``,
  oldest first, after the attempt), so that a new reflection builds on the plans that already failed
  (released ``alfworld_runs/generate_reflections.py``: the last 3 of the task's memory, "Plans from
  past attempts").
* Reflexion's gains come from retrying the same task: in evaluation the reflections of a task's
  earlier attempts are what ``eval.trials`` gives the next attempt
  (:meth:`ReflectionsMemory.eval_attempts`); reflections written in training reach later training
  episodes of the same task only.

This project's own choices: the prompt wording, the reply budget (``experience.reflections.tokens``),
greedy decoding of the reflection (the released reflections are written at temperature 0) and a
reflection after every failed episode (the released ALFWorld code reflects on every environment
not yet solved at the end of a trial).

:class:`ReflectionsMemory` is the memory kind ``reflections`` (:mod:`crl_bench.experience.memory`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

from annotated_types import Ge

from crl_bench.experience.insights import copies_example
from crl_bench.experience.memory import Attempts, Memory, register_memory
from crl_bench.experience.records import episode_record
from crl_bench.experience.transcripts import EpisodeRecord, compact_trajectory, outcome_text, strip_observation


@dataclasses.dataclass
class ReflectionsConfig:
    """Section ``experience.reflections``: Reflexion's reflections (``reflexion``)."""

    shown: Annotated[int, Ge(1)] = 3
    """The most recent reflections on a task shown to an attempt at it (Reflexion's Omega: 3 as in its ALFWorld code;
    its HotpotQA code shows every reflection; at least 1)."""
    tokens: Annotated[int, Ge(8)] = 64
    """Most tokens of one reflection (at least 8)."""


REFLECTIONS_HEADER = ("Your reflections on your earlier failed attempts at this same task, oldest first. "
                      "Use them to do better this time.")

REFLECTION_SYSTEM_PROMPT = """\
You just failed a task in a text game. Read what you did and how it ended. In one or two short \
sentences, say what went wrong and what you will do differently on your next attempt at the same \
task. Be concrete: name the actions to avoid or to take."""

EARLIER_HEADER = "What you planned after your earlier failed attempts at this task, oldest first (these plans " \
                 "did not work either):"
"""The header of the earlier reflections in a reflection prompt (:class:`ReflectionPromptBuilder`)."""


def reflection_block(texts: Sequence[str]) -> str:
    """The reflections part of a prompt: :data:`REFLECTIONS_HEADER` and ``Attempt i: text`` lines,
    oldest first; ``""`` without reflections."""
    lines = [f"Attempt {n}: {' '.join(t.split())}" for n, t in enumerate(texts, 1) if t.strip()]
    return f"{REFLECTIONS_HEADER}\n\n" + "\n".join(lines) if lines else ""


class ReflectionPromptBuilder:
    """The chat prompt of one reflection: the system instruction, then the task, the compacted
    trajectory, its outcome and the task's earlier reflections (under :data:`EARLIER_HEADER`, as
    ``Attempt i:`` lines; none on a first failure). Released Reflexion shows its reflector the last 3
    reflections of the task the same way (``generate_reflections.py``, ``_generate_reflection_query``);
    the wording is this project's own.

    Args:
        tokenizer: the actor's tokenizer (with a chat template).
        max_prompt_tokens: cap on the prompt; the trajectory gets what the rest leaves.
    """

    def __init__(self, tokenizer: Any, max_prompt_tokens: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_tokens = int(max_prompt_tokens)

    def _ids(self, record: EpisodeRecord, trajectory: str, earlier: Sequence[str] = ()) -> list[int]:
        lines = [f"Attempt {n}: {' '.join(t.split())}" for n, t in enumerate(earlier, 1) if t.strip()]
        before = f"{EARLIER_HEADER}\n" + "\n".join(lines) + "\n\n" if lines else ""
        user = (f"Task: {' '.join(record.task_prompt.split())}\n\nWhat you did:\n{trajectory}\n\n"
                f"Outcome: {outcome_text(record)}\n\n{before}Your reflection:")
        messages = [{"role": "system", "content": REFLECTION_SYSTEM_PROMPT}, {"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def build(self, record: EpisodeRecord, earlier: Sequence[str] = ()) -> list[int]:
        """Prompt token ids for ``record`` after the task's ``earlier`` reflections (oldest first), at
        most ``max_prompt_tokens`` (the trajectory is cut; the earlier reflections are bounded by
        ``experience.reflections.shown`` x ``tokens``)."""
        budget = max(16, self.max_prompt_tokens - len(self._ids(record, "", earlier)))
        while True:
            ids = self._ids(record, compact_trajectory(record, self.tokenizer, budget, strip_observation), earlier)
            if len(ids) <= self.max_prompt_tokens or budget <= 16:
                return ids
            budget = max(16, budget - max(4, len(ids) - self.max_prompt_tokens))


class ReflectionWriter:
    """Writes reflections on failed episodes with the actor's engine.

    Args:
        engine: the actor's generation engine (``generate(prompts, sampling)``; unconstrained).
        tokenizer: the actor's tokenizer.
        max_tokens: most tokens of one reflection (``experience.reflections.tokens``).
        max_prompt_tokens: cap on a reflection prompt.
    """

    def __init__(self, engine: Any, tokenizer: Any, max_tokens: int = 64, max_prompt_tokens: int = 1024) -> None:
        from crl_bench.llm.base import SamplingParams

        self.engine = engine
        self.prompts = ReflectionPromptBuilder(tokenizer, max_prompt_tokens)
        self.sampling = SamplingParams(temperature=0.0, max_new_tokens=int(max_tokens), stop=("\n\n",))

    def reflect(self, records: Sequence[EpisodeRecord], earlier: Sequence[Sequence[str]] | None = None) -> list[str]:
        """One reflection per record, in order (one batched ``generate`` call), each prompt showing that
        record's task's ``earlier`` reflections (one list per record, oldest first; default none);
        whitespace collapsed,
        ``""`` where the reply was empty or repeats the instruction (:func:`copies_example` of
        :data:`REFLECTION_SYSTEM_PROMPT`: measured with SmolLM2-135M on ``diag-vault``, most of its
        greedy reflections were the instruction itself), which the callers do not store."""
        if not records:
            return []
        earlier = earlier if earlier is not None else [()] * len(records)
        if len(earlier) != len(records):
            raise ValueError(f"{len(records)} records but {len(earlier)} lists of earlier reflections")
        replies = self.engine.generate([self.prompts.build(r, e) for r, e in zip(records, earlier)], self.sampling)
        texts = [" ".join(r.text.split()) for r in replies]
        return ["" if copies_example(t, [REFLECTION_SYSTEM_PROMPT]) else t for t in texts]


@register_memory("reflections")
class ReflectionsMemory(Memory):
    """Reflexion: the actor's reflections on its failed episodes (:class:`ReflectionWriter`, with the
    actor's engine), kept per task in the bank and shown to later attempts at the task instead of
    retrieved entries. The memory of ``reflexion``; no extractor model.

    Attributes:
        reflector: the :class:`ReflectionWriter` (``None`` without the actor's engine).
    """

    header: ClassVar[str] = REFLECTIONS_HEADER
    retrieves: ClassVar[bool] = False
    whole_episodes: ClassVar[bool] = True

    def __init__(self, cfg: Any, actor_engine: Any = None, tokenizer: Any = None) -> None:
        super().__init__(cfg, actor_engine, tokenizer)
        self.reflector = ReflectionWriter(actor_engine, tokenizer, cfg.experience.reflections.tokens) \
            if actor_engine is not None else None

    def reflect(self, trajs: Sequence[Any], earlier: Sequence[Sequence[str]] | None = None) -> list[str]:
        """The actor's reflection on each of ``trajs`` (one batched generate call; ``""`` where the
        reply was no reflection), each shown its task's ``earlier`` reflections (one list per
        trajectory, oldest first; default none).

        Raises:
            RuntimeError: no reflection writer (built without the actor's engine).
        """
        if self.reflector is None:
            raise RuntimeError("this reflections memory has no actor engine to reflect with")
        return self.reflector.reflect([episode_record(t) for t in trajs], earlier)

    def task_guidance(self, manager: Any, env_id: str, task: int, later: Sequence[str] = ()) -> str:
        """The block an attempt at ``env_id``'s task ``task`` is shown: the task's stored reflections
        followed by ``later`` ones (an evaluation's earlier attempts), the last
        ``experience.reflections.shown`` of them (:func:`reflection_block`; ``""`` without any)."""
        shown = self.cfg.experience.reflections.shown
        texts = [*manager.reflections(env_id, task, shown), *later]
        return reflection_block(texts[-shown:])

    def write(self, manager: Any, trajs: Sequence[Any], step: int) -> int:
        """The actor reflects on every failed episode (with at least one turn) now, shown the task's
        last ``experience.reflections.shown`` stored reflections; the non-empty reflections are
        stored per task. Returns the number of failed episodes."""
        failed = [t for t in trajs if not t.success and t.turns]
        shown = self.cfg.experience.reflections.shown
        stored = {key: manager.reflections(*key, shown) for key in {(t.env_id, int(t.task)) for t in failed}}
        texts = self.reflect(failed, [stored[(t.env_id, int(t.task))] for t in failed])
        manager.add_reflections([(t.env_id, int(t.task), x, step) for t, x in zip(failed, texts) if x])
        return len(failed)

    def episode_metrics(self, guided: Sequence[Any]) -> dict[str, Any]:
        """``guided_with_reflections``: guided episodes shown at least one reflection."""
        return {"guided_with_reflections": sum(1 for t in guided if t.guidance)}

    def metrics(self, manager: Any, stats: dict[str, Any]) -> dict[str, Any]:
        """``reflections``: the reflections stored."""
        return {"reflections": stats["reflections"]}

    def eval_attempts(self, manager: Any, mode: str, donors: dict[str, dict[int, int]]) -> Attempts:
        """Reflexion's evaluation attempts (``eval.trials``): ``learn`` has the actor reflect on an
        attempt's failed episodes (shown the task's earlier reflections: stored, then this
        evaluation's), kept for this evaluation only (the bank is not written);
        ``prepare`` shows each attempt its task's reflections (stored in training, then those of this
        evaluation's earlier attempts): ``guided`` its own task's, ``shuffled`` those of its donor
        task (another context's, where the env has contexts), ``empty`` the header with no
        reflection.  ``metrics`` gives ``attempts_with_reflections``: the attempts whose block held
        at least one reflection (its guidance is not a bank entry, so ``episodes_with_experience``
        stays 0)."""
        memory: dict[tuple[str, int], list[str]] = defaultdict(list)
        shown = [0]

        def prepare(spec: Any) -> Any:
            if mode == "empty":
                return dataclasses.replace(spec, guidance=self.empty_guidance())
            task = donors.get(spec.env_id, {}).get(spec.task, spec.task) if mode == "shuffled" else spec.task
            block = self.task_guidance(manager, spec.env_id, task, memory[(spec.env_id, task)])
            shown[0] += bool(block)
            return dataclasses.replace(spec, guidance=block)

        def earlier(t: Any) -> list[str]:
            # the reflections the attempt's own task has (stored, then this evaluation's), last ``shown``
            shown_n = self.cfg.experience.reflections.shown
            return [*manager.reflections(t.env_id, int(t.task), shown_n), *memory[(t.env_id, int(t.task))]][-shown_n:]

        def learn(failed: list[Any]) -> None:
            if mode == "empty" or not failed:
                return
            for t, text in zip(failed, self.reflect(failed, [earlier(t) for t in failed])):
                if text:
                    memory[(t.env_id, int(t.task))].append(text)

        return Attempts(prepare, learn, lambda: {"attempts_with_reflections": shown[0]})


class ReflectionTable:
    """Reflexion's reflections in the experience bank's table ``reflections`` (a mixin of
    :class:`~crl_bench.experience.bank.ExperienceBank`, using its ``_conn``, ``_write``,
    ``_check_writable`` and ``_has_table``)."""

    def add_reflections(self, rows: Sequence[tuple[str, int, str, int]]) -> None:
        """Store ``(env_id, task, text, step)`` reflections (:mod:`crl_bench.experience.reflections`),
        in order, in one transaction. Raises ``PermissionError`` on a read-only bank."""
        self._check_writable()
        if not rows:
            return
        with self._write() as c:
            c.executemany("INSERT INTO reflections(env_id, task, text, step) VALUES (?, ?, ?, ?)",
                          [(str(e), int(t), str(x), int(s)) for e, t, x, s in rows])

    def reflections(self, env_id: str, task: int, limit: int = 3) -> list[str]:
        """The most recent ``limit`` reflections on ``env_id``'s task ``task``, oldest first (none in a
        bank written before reflections existed)."""
        if limit <= 0 or not self._has_table("reflections"):
            return []
        rows = self._conn().execute("SELECT text FROM reflections WHERE env_id = ? AND task = ? ORDER BY id DESC "
                                    "LIMIT ?", (env_id, int(task), int(limit))).fetchall()
        return [r[0] for r in reversed(rows)]

    def recent_reflections(self, env_id: str | None = None, limit: int = 20) -> list[tuple[str, int, str, int]]:
        """The ``limit`` most recent reflections as ``(env_id, task, text, step)``, newest first, of one env
        or (``env_id`` None) of all; ``[]`` in a bank written before reflections existed."""
        if limit <= 0 or not self._has_table("reflections"):
            return []
        where, args = ("WHERE env_id = ? ", (env_id,)) if env_id is not None else ("", ())
        rows = self._conn().execute(f"SELECT env_id, task, text, step FROM reflections {where}ORDER BY id DESC "
                                    "LIMIT ?", (*args, int(limit))).fetchall()
        return [(str(e), int(t), str(x), int(s)) for e, t, x, s in rows]

    def reflection_count(self, env_id: str | None = None) -> int:
        """Reflections stored, over all tasks (of ``env_id`` if given)."""
        if not self._has_table("reflections"):
            return 0
        if env_id is None:
            return int(self._conn().execute("SELECT COUNT(*) FROM reflections").fetchone()[0])
        return int(self._conn().execute("SELECT COUNT(*) FROM reflections WHERE env_id = ?", (env_id,)).fetchone()[0])

