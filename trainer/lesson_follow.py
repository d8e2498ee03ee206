"""Does the actor follow a lesson?  ``lesson_follow``: the probability that the actor takes the action a
lesson shown to it names, on fixed probe states of a diagnostic: the run's own (``diag-vault`` or
``diag-corridor``, the first of them in its mix; :func:`probe_env`), ``diag-vault`` for any other mix.

Why: experience can only help an actor that acts on what it is shown.  Measured with the default
135M model, untrained and constrained to an env's action set, a correct lesson in the prompt hardly
moves the probability of the action it names (docs/diagnostics.md), so any benefit of experience at
that scale has to come from training the actor to use it.  This module makes that visible every
step.

Probe states: the first eval task of each of the first ``n`` contexts of the diagnostic
(:mod:`crl_bench.envs.diag`), at its first turn, each shown three ways, with exactly the prompt a guided
episode's first turn gets (the run's :class:`~crl_bench.prompts.PromptBuilder`: placement, layout,
prefill):

* ``right``: a knowledge block with one entry naming the context's solution
  (:meth:`~crl_bench.envs.diag.DiagEnv.lesson_for`: the vault's code, or the corridor's passages in order);
* ``wrong``: the same entry naming a wrong solution (each action replaced by the next one in the action
  list, so on the vault wrong lessons cover every action and on the corridor the first named passage is
  never the right one);
* ``none``: no knowledge block (the experience-free prompt).

The action measured is the first one: the code, or the corridor's first passage.

The probability of an action is the one constrained decoding gives it at temperature 1: the product,
along the action's reply tokens, of the next-token probability renormalised over the tokens that
still spell an allowed reply (:class:`crl_bench.llm.hf_engine.AllowedRepliesProcessor`'s mask).
Reported (fractions in [0, 1], means over probes):

* ``lesson_follow``: P(the solution's first action | ``right`` lesson);
* ``lesson_follow_wrong``: P(the wrong lesson's first action | ``wrong`` lesson);
* ``lesson_follow_none``: P(the solution's first action | no lesson), the baseline both compare with
  (chance is 1/8 on the vault, 1/3 on the default corridor).

An actor that reads lessons has ``lesson_follow`` and ``lesson_follow_wrong`` well above
``lesson_follow_none`` and chance; one that learned the solutions themselves (memorised the training
contexts) has ``lesson_follow_none`` high and ``lesson_follow_wrong`` low.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from crl_bench.env_api import make_env
from crl_bench.envs.diag import DIAG_ENVS
from crl_bench.experience.json_ops import format_numbered
from crl_bench.rollout import PromptBuilder

#: the diagnostic probed when the run's mix holds none
PROBE_ENV = "diag-vault"
CONDITIONS = ("right", "wrong", "none")


def probe_env(envs: Sequence[str]) -> str:
    """The diagnostic a run's ``lesson_follow`` probes: the first of the diagnostics
    (:data:`~crl_bench.envs.diag.DIAG_ENVS`) among ``envs`` (the run's mix, in its order), else
    :data:`PROBE_ENV`."""
    return next((e for e in envs if e in DIAG_ENVS), PROBE_ENV)


@dataclass(frozen=True)
class Probe:
    """One probe state shown three ways.

    Attributes:
        task: the diagnostic's task id.
        context: its context's name.
        right: the solution's first action (the vault's code, the corridor's first passage); ``wrong``: the
            first action the wrong lesson names.
        prompts: condition (``right`` / ``wrong`` / ``none``) -> prompt token ids (prefill included).
        replies: the allowed reply texts, one per action, in ``actions`` order.
        actions: the env's action names.
    """

    task: int
    context: str
    right: str
    wrong: str
    prompts: dict[str, list[int]]
    replies: list[str]
    actions: list[str]


def _knowledge(context: str, lesson: str) -> str:
    """The experience block a guided episode would see with one retrieved entry."""
    from crl_bench.experience.memory import guidance_text

    return guidance_text(format_numbered([SimpleNamespace(title=context, content=lesson)], empty=""))


def build_probes(prompts: PromptBuilder, n: int, env_id: str = PROBE_ENV,
                 env_kwargs: dict[str, Any] | None = None) -> list[Probe]:
    """The first eval task of each of the first ``n`` contexts of diagnostic ``env_id`` (made with
    ``env_kwargs``), at its first turn, as :class:`Probe`.

    Raises:
        ValueError: ``env_id`` is not a diagnostic (:data:`~crl_bench.envs.diag.DIAG_ENVS`), or ``n`` < 1
            or more than the eval split's contexts.
    """
    if env_id not in DIAG_ENVS:
        raise ValueError(f"lesson_follow probes: {env_id!r} is not a diagnostic with lessons "
                         f"({', '.join(DIAG_ENVS)})")
    env = make_env(env_id, **(env_kwargs or {}))
    seen: dict[str, int] = {}
    for t in env.task_ids("eval"):
        seen.setdefault(env.context(int(t)), int(t))
    if not 1 <= n <= len(seen):
        raise ValueError(f"lesson_follow probes: {n} asked, {env_id}'s eval split has {len(seen)} contexts")
    prefix = "" if "<answer>" in prompts.prefill.lower() else "<answer>"
    out = []
    for context, task in list(seen.items())[:n]:
        obs, _ = env.reset(options={"task": task})
        actions = list(env.admissible_actions())
        solution = list(env.solution(task))
        miss = [actions[(actions.index(a) + 1) % len(actions)] for a in solution]
        fmt = env.reply_format
        guidance = {"right": _knowledge(context, env.lesson_for(task, solution)),
                    "wrong": _knowledge(context, env.lesson_for(task, miss)), "none": ""}
        ids = {c: prompts.turn([], env.system_prompt, env.task_prompt(), (), obs, guidance[c], fmt.instruction,
                               prompts.prefill if fmt.prefill is None else fmt.prefill)
               for c in CONDITIONS}
        out.append(Probe(task, context, solution[0], miss[0], ids, [f"{prefix}{a}</answer>" for a in actions],
                         actions))
    env.close()
    return out


def _branches(reply_ids: list[list[int]]) -> dict[tuple[int, ...], set[int]]:
    """Prefix (token tuple) -> the next tokens allowed after it, for prefixes with two or more (the
    only places where constrained decoding chooses)."""
    nxt: dict[tuple[int, ...], set[int]] = {}
    for ids in reply_ids:
        for k in range(len(ids)):
            nxt.setdefault(tuple(ids[:k]), set()).add(ids[k])
    return {p: s for p, s in nxt.items() if len(s) > 1}


@torch.no_grad()
def action_probabilities(model: Any, tokenizer: Any, prompt_ids: list[list[int]],
                         replies: list[list[str]]) -> list[list[float]]:
    """Constrained-decoding probability (temperature 1) of each allowed reply of each prompt.

    Args:
        model: a causal LM (its current weights; run in eval mode, no gradient).
        tokenizer: its tokenizer (replies are encoded as the engine encodes allowed replies).
        prompt_ids: B prompts (token ids).
        replies: per prompt, the allowed reply texts.

    Returns:
        Per prompt, one probability per reply (they sum to 1 when no reply is a prefix of another).
    """
    reply_ids = [[tokenizer.encode(r, add_special_tokens=False) for r in rs] for rs in replies]
    seqs, where = [], []
    for b, ids in enumerate(reply_ids):
        for prefix, allowed in _branches(ids).items():
            seqs.append(list(prompt_ids[b]) + list(prefix))
            where.append((b, prefix, sorted(allowed)))
    logp: dict[tuple[int, tuple[int, ...]], dict[int, float]] = {}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for start in range(0, len(seqs), 8):
            chunk = seqs[start:start + 8]
            width = max(map(len, chunk))
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            ids = torch.tensor([[pad] * (width - len(s)) + s for s in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in chunk], device=device)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1,
                           use_cache=False).logits[:, -1, :].float()
            for row, (b, prefix, allowed) in zip(logits, where[start:start + 8]):
                sub = torch.log_softmax(row[allowed], dim=-1)
                logp[(b, prefix)] = dict(zip(allowed, sub.tolist()))
    finally:
        if was_training:
            model.train()
    out = []
    for b, ids in enumerate(reply_ids):
        probs = []
        for r in ids:
            total = sum(logp[(b, tuple(r[:k]))][r[k]] for k in range(len(r)) if (b, tuple(r[:k])) in logp)
            probs.append(math.exp(total))
        out.append(probs)
    return out


class LessonFollow:
    """The ``lesson_follow`` measurement of a run (``eval.lesson_follow`` probes; module docstring).

    Args:
        prompts: the run's prompt builder (so probes see exactly the guided prompt of a rollout).
        tokenizer: the actor's tokenizer.
        n: probe states (contexts), 1..8.
        env_id: the diagnostic probed (:func:`probe_env` of the run's mix).
        env_kwargs: its constructor arguments (the run's ``rollout.env_kwargs`` for it).

    Raises:
        ValueError: as :func:`build_probes`.
    """

    def __init__(self, prompts: PromptBuilder, tokenizer: Any, n: int, env_id: str = PROBE_ENV,
                 env_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.env_id = env_id
        self.probes = build_probes(prompts, n, env_id, env_kwargs)

    def measure(self, model: Any) -> dict[str, float]:
        """``{"lesson_follow", "lesson_follow_wrong", "lesson_follow_none"}`` of ``model`` now."""
        prompts, replies, named = [], [], []
        for p in self.probes:
            for c in CONDITIONS:
                prompts.append(p.prompts[c])
                replies.append(p.replies)
                named.append(p.actions.index(p.wrong if c == "wrong" else p.right))
        probs = action_probabilities(model, self.tokenizer, prompts, replies)
        by: dict[str, list[float]] = {c: [] for c in CONDITIONS}
        for k, (ps, i) in enumerate(zip(probs, named)):
            by[CONDITIONS[k % len(CONDITIONS)]].append(ps[i])
        mean = {c: sum(v) / len(v) for c, v in by.items()}
        return {"lesson_follow": mean["right"], "lesson_follow_wrong": mean["wrong"],
                "lesson_follow_none": mean["none"]}
