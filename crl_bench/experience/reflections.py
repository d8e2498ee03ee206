"""Reflexion's verbal reflections: after a failed attempt the actor writes what to do differently,
and later attempts at the same task are shown the task's most recent reflections.

The ``reflexion`` method (crl_bench/methods.py; docs/method.md, "Reflexion") follows Reflexion
(Shinn et al., arXiv 2303.11366, section 3; released code noahshinn/reflexion):

* After an episode that failed, a reflection is written from the task, the trajectory and its outcome
  (the paper's self-reflection model; here the actor itself, with its weights of the moment).
* Reflections are kept per task (the env and the task id); an attempt at a task is shown the task's
  most recent ``experience.reflections_shown`` (the paper's Omega: 3 for ALFWorld and HotpotQA,
  section 4), oldest first, under :data:`REFLECTIONS_HEADER`.
* Reflexion's gains come from retrying the same task: in evaluation the reflections of a task's
  earlier attempts are what ``eval.trials`` gives the next attempt (trainer/loop.py); reflections
  written in training reach later training episodes of the same task only.

This project's own choices: the prompt wording, the reply budget (``experience.reflection_tokens``),
greedy decoding of the reflection (the released reflections are written at temperature 0) and a
reflection after every failed episode (the released ALFWorld code reflects on every environment
not yet solved at the end of a trial).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from crl_bench.experience.extractor import EpisodeRecord, compact_trajectory, outcome_text, strip_observation
from crl_bench.experience.insights import copies_example

REFLECTIONS_HEADER = ("Your reflections on your earlier failed attempts at this same task, oldest first. "
                      "Use them to do better this time.")

REFLECTION_SYSTEM_PROMPT = """\
You just failed a task in a text game. Read what you did and how it ended. In one or two short \
sentences, say what went wrong and what you will do differently on your next attempt at the same \
task. Be concrete: name the actions to avoid or to take."""


def reflection_block(texts: Sequence[str]) -> str:
    """The reflections part of a prompt: :data:`REFLECTIONS_HEADER` and ``Attempt i: text`` lines,
    oldest first; ``""`` without reflections."""
    lines = [f"Attempt {n}: {' '.join(t.split())}" for n, t in enumerate(texts, 1) if t.strip()]
    return f"{REFLECTIONS_HEADER}\n\n" + "\n".join(lines) if lines else ""


class ReflectionPromptBuilder:
    """The chat prompt of one reflection: the system instruction, then the task, the compacted
    trajectory and its outcome.

    Args:
        tokenizer: the actor's tokenizer (with a chat template).
        max_prompt_tokens: cap on the prompt; the trajectory gets what the rest leaves.
    """

    def __init__(self, tokenizer: Any, max_prompt_tokens: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_tokens = int(max_prompt_tokens)

    def _ids(self, record: EpisodeRecord, trajectory: str) -> list[int]:
        user = (f"Task: {' '.join(record.task_prompt.split())}\n\nWhat you did:\n{trajectory}\n\n"
                f"Outcome: {outcome_text(record)}\n\nYour reflection:")
        messages = [{"role": "system", "content": REFLECTION_SYSTEM_PROMPT}, {"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def build(self, record: EpisodeRecord) -> list[int]:
        """Prompt token ids for ``record``, at most ``max_prompt_tokens`` (the trajectory is cut)."""
        budget = max(16, self.max_prompt_tokens - len(self._ids(record, "")))
        while True:
            ids = self._ids(record, compact_trajectory(record, self.tokenizer, budget, strip_observation))
            if len(ids) <= self.max_prompt_tokens or budget <= 16:
                return ids
            budget = max(16, budget - max(4, len(ids) - self.max_prompt_tokens))


class ReflectionWriter:
    """Writes reflections on failed episodes with the actor's engine.

    Args:
        engine: the actor's generation engine (``generate(prompts, sampling)``; unconstrained).
        tokenizer: the actor's tokenizer.
        max_tokens: most tokens of one reflection (``experience.reflection_tokens``).
        max_prompt_tokens: cap on a reflection prompt.
    """

    def __init__(self, engine: Any, tokenizer: Any, max_tokens: int = 64, max_prompt_tokens: int = 1024) -> None:
        from crl_bench.llm.base import SamplingParams

        self.engine = engine
        self.prompts = ReflectionPromptBuilder(tokenizer, max_prompt_tokens)
        self.sampling = SamplingParams(temperature=0.0, max_new_tokens=int(max_tokens), stop=("\n\n",))

    def reflect(self, records: Sequence[EpisodeRecord]) -> list[str]:
        """One reflection per record, in order (one batched ``generate`` call); whitespace collapsed,
        ``""`` where the reply was empty or repeats the instruction (:func:`copies_example` of
        :data:`REFLECTION_SYSTEM_PROMPT`: measured with SmolLM2-135M on ``diag-vault``, most of its
        greedy reflections were the instruction itself), which the callers do not store."""
        if not records:
            return []
        replies = self.engine.generate([self.prompts.build(r) for r in records], self.sampling)
        texts = [" ".join(r.text.split()) for r in replies]
        return ["" if copies_example(t, [REFLECTION_SYSTEM_PROMPT]) else t for t in texts]
