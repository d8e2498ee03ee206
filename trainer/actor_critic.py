"""The actor-critic judge: before a guided episode, the actor judges the experience retrieved for it.

Complementary RL's released pipeline (``memory_integration_mixin.py``, ``enable_actor_critic``, on by
default; see docs/method.md) asks the *actor* whether the retrieved knowledge fits the task before the
episode starts.  Its inputs, as released: the episode's first task prompt (the env's instruction and
first observation), the knowledge, and the actor's average score on this env over its training
episodes so far (with their number).  It answers one of three decisions, which decide what the
episode's prompt shows and what the extraction that wrote the knowledge is rewarded:

=========  =======================================  ================================================
decision   shown to the actor                       extractor reward (``critic_reward``)
=========  =======================================  ================================================
accept     the retrieved text as it is              the episode's score + 1
refine     the actor's rewritten text               0.5
reject     nothing (the entries are still credited) -1
invalid    nothing                                  the episode's plain score (as without the judge)
=========  =======================================  ================================================

``critic_reward`` is in :mod:`crl_bench.trainer.extractor_training`, with the rest of the extractor's
reward. After an invalid judgement the extractor is not shown the entries when it distils the episode
(released: the retrieved uids are cleared; trainer/experience_track.py).

The judgement is sampled with the actor's own weights and sampling settings and is not trained.
The prompts below are this project's own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from crl_bench.experience.types import JUDGED_INVALID as INVALID
from crl_bench.llm.base import Engine, SamplingParams

DECISIONS = ("accept", "refine", "reject")

CRITIC_SYSTEM_PROMPT = """\
You are about to start a task as an agent. Before you start, you are shown advice that an assistant \
wrote from earlier attempts at similar tasks, and how well you have done on this kind of task so \
far. Decide whether the advice helps with THIS task:
- accept: it fits; it will be shown to you as it is.
- refine: it is partly useful; rewrite it so that it fits this task better.
- reject: it does not fit or would mislead; you will start without it.

Think briefly if you need to, then answer with one JSON object inside <answer></answer>, e.g.
<answer>{"function_name": "accept", "parameters": {}}</answer>
<answer>{"function_name": "refine", "parameters": {"knowledge": "the rewritten advice"}}</answer>
<answer>{"function_name": "reject", "parameters": {}}</answer>"""

CRITIC_USER_TEMPLATE = """\
The task, as you will be given it:
{task}

The advice:
{knowledge}

Your average score on this kind of task so far: {score} over {episodes} episodes.

Your decision:"""

_ANSWER = re.compile(r"<\s*answer\s*>(.*?)<\s*/\s*answer\s*>", re.IGNORECASE | re.DOTALL)


@dataclass
class Judgement:
    """The actor's decision on one retrieval.

    Attributes:
        decision: ``accept`` / ``refine`` / ``reject``, or ``invalid`` when the reply did not parse.
        guidance: the text to show the actor ("" for reject and invalid; the rewrite for refine).
        reply: the raw reply (for inspection).
    """

    decision: str
    guidance: str
    reply: str = ""


def parse_judgement(reply: str, original: str) -> Judgement:
    """Read the decision from the last ``<answer>{json}</answer>`` of ``reply``; never raises.

    ``{"function_name": "accept"|"refine"|"reject", "parameters": {"knowledge": str}}``; refine needs
    a non-empty ``knowledge``.  Anything else (no answer tag, bad JSON, unknown name, non-object
    parameters, empty refinement) is ``invalid``.
    """
    try:
        found = _ANSWER.findall(reply or "")
        if not found:
            return Judgement(INVALID, "", reply)
        obj = json.loads(found[-1].strip())
        if not isinstance(obj, dict):
            return Judgement(INVALID, "", reply)
        name = str(obj.get("function_name", "")).strip().lower()
        params = obj.get("parameters", {})
        if params is None:
            params = {}
        if not isinstance(params, dict) or name not in DECISIONS:
            return Judgement(INVALID, "", reply)
        if name == "accept":
            return Judgement("accept", original, reply)
        if name == "reject":
            return Judgement("reject", "", reply)
        text = params.get("knowledge")
        if not isinstance(text, str) or not text.strip():
            return Judgement(INVALID, "", reply)
        return Judgement("refine", " ".join(text.split()), reply)
    except (ValueError, RecursionError, TypeError):
        return Judgement(INVALID, "", reply)


class ActorCritic:
    """Asks the actor to judge retrieved knowledge (one batched ``generate`` call per retrieval batch).

    Args:
        engine: the actor's generation engine.
        tokenizer: the actor's tokenizer (with a chat template).
        sampling: the actor's sampling settings (a judgement has no stop string: :meth:`judge_sampling`).
        max_new_tokens: reply budget of a judgement.
    """

    def __init__(self, engine: Engine, tokenizer: Any, sampling: SamplingParams, max_new_tokens: int = 256) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.sampling = self.judge_sampling(sampling)

    def judge_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """The actor's ``sampling`` (temperature, top-p, top-k) with the judgement's budget and no stop
        string: as released (``actor_critic`` generates with the actor's generating args, whose only
        stop string is the search tool's tag, and ``_parse_actor_critic_response`` reads the last
        ``<answer>``), a judgement runs to its end or its budget and its last answer counts."""
        return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                              max_new_tokens=self.max_new_tokens, stop=())

    def prompt(self, task: str, knowledge: str, avg_score: float, episodes: int) -> list[int]:
        """Prompt ids for one judgement: ``task`` is the episode's first task prompt, ``avg_score`` the
        actor's mean episode score on the env over ``episodes`` training episodes so far."""
        user = CRITIC_USER_TEMPLATE.format(task=task.strip() or "(not stated)", knowledge=knowledge.strip(),
                                           score=f"{avg_score:.2f}", episodes=int(episodes))
        messages = [{"role": "system", "content": CRITIC_SYSTEM_PROMPT}, {"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def judge(self, items: Sequence[tuple[str, str, int, int]],
              sampling: SamplingParams | None = None) -> list[Judgement]:
        """One :class:`Judgement` per ``(task prompt, knowledge, average score, episodes)``, in order; ``sampling``
        (e.g. the evaluation's, from :meth:`judge_sampling`) replaces the training sampling."""
        if not items:
            return []
        gens = self.engine.generate([self.prompt(*it) for it in items], sampling or self.sampling)
        return [parse_judgement(g.text, it[1]) for g, it in zip(gens, items)]
