"""Internalisation: the experience a guided episode was shown, fine-tuned into the actor without it.

The released code's memory-actor pipeline (pUmpKin-Co/ComplementaryRL at ``ab2574f``,
``roll/pipeline/agentic/multi_agentic_sft_pipeline.py``, ``MemoryActorPipeline``; unchanged since its
first release ``0523d21``), with ``extract_successful_memory: true`` and
``use_extracted_for_training: separate``, does after every actor update of a step past warm-up:

1. **Selection** (``~214-291``): per group (``traj_group_id``), the mean episode score of the group's
   experience-free episodes (``evolve_with_memory`` false; 0.0 when the group has none); every guided
   episode whose score is strictly greater is kept. No other filter, nothing carried to the next step.
2. **Stripping** (``env_manager/traj_env_manager.py`` ``~495-561``): the kept episode's prompt as it would
   have been without the experience (the first turn's system prompt rebuilt from the plain template),
   its replies unchanged; the whole episode stays one sample.
3. **Fine-tuning** (``~1622-1656``; ``base_worker.py`` ``~166-210``): cross-entropy on those samples,
   ``sft_epochs`` optimiser steps (one per pass over the whole selection), on the actor itself with the
   GRPO update's optimiser and learning-rate schedule (it steps the schedule), before the extractor's
   update; the next step's rollouts sample from the result.

Here: :func:`select_episodes` is 1; :func:`stripped` is 2 on the prompts the rollout recorded without
experience (:attr:`crl_bench.rollout.Turn.free_prompt_ids`: the same prompt builder with no guidance,
and, unlike the release, without turn-level retrieved text either); :class:`Internaliser` is 3, with the
trainer's optimiser and schedule, ``train.internalise_epochs`` passes.  Two choices differ from the
release, which are its apparent slips rather than its design: the loss covers the actor's reply tokens
only (the release's label mask leaves later observations of a multi-turn episode in the loss, and its
labels are not shifted as its own SFT collator shifts them), and log-probs are of the raw logits
(temperature 1), the plain language-model loss.  The release's ``concat`` mode (the stripped copies
added to the GRPO batch) is not built.  docs/method.md, "Internalisation".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from crl_bench.config_schema import ConfigError
from crl_bench.rollout import Trajectory
from crl_bench.trainer.losses import aggregate
from crl_bench.trainer.policy import PolicyUpdater, episode_samples

__all__ = ["Internaliser", "select_episodes", "sft_loss", "stripped"]


def select_episodes(trajs: Sequence[Trajectory]) -> list[Trajectory]:
    """The guided episodes whose reward is strictly above the mean reward of their group's free episodes
    (0.0 for a group without free ones), in the order given (released ``MemoryActorPipeline``, module
    docstring, step 1)."""
    free: dict[int, list[float]] = defaultdict(list)
    for t in trajs:
        if t.subgroup == "free":
            free[t.group_id].append(float(t.reward))
    mean = {g: sum(v) / len(v) for g, v in free.items()}
    return [t for t in trajs if t.subgroup == "guided" and float(t.reward) > mean.get(t.group_id, 0.0)]


def stripped(traj: Trajectory) -> Trajectory | None:
    """A copy of ``traj`` whose turns' prompts are the ones recorded without experience
    (:attr:`~crl_bench.rollout.Turn.free_prompt_ids`), replies and everything else unchanged; a turn
    without a recorded free prompt keeps its prompt where it carried no experience (an episode shown
    nothing).  ``None`` when a turn that carried experience has no free prompt (not recorded, or the
    chat template re-encoded the whole chat), so the episode cannot be stripped."""
    turns = []
    shown = bool(traj.guidance)
    for turn in traj.turns:
        if turn.free_prompt_ids is not None:
            turns.append(replace(turn, prompt_ids=list(turn.free_prompt_ids)))
        elif shown or turn.experience_ids:
            return None
        else:
            turns.append(turn)
    return replace(traj, turns=turns, guidance="")


def sft_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             normalizer: float | None = None, token_weights: torch.Tensor | None = None,
             **_: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """The language-model loss: minus the log-prob of each masked token, aggregated as
    :func:`~crl_bench.trainer.losses.aggregate` does (``(B, T)`` tensors; ``old_logprobs`` and
    ``advantages`` are not used).  Stats: ``nll`` (mean over masked tokens, nats)."""
    per_token = -logprobs
    loss = aggregate(per_token, mask, normalizer, token_weights)
    m = mask > 0
    nll = float(per_token.detach()[m].mean()) if bool(m.any()) else 0.0
    return loss, {"nll": nll}


class Internaliser:
    """Fine-tunes the actor on its selected guided episodes with their experience stripped, after each
    actor update (module docstring).

    Args:
        cfg: the run's :class:`~crl_bench.config.RunConfig` (``train.internalise_epochs`` passes,
            ``train.sequences`` layout, ``train.micro_batch_size`` / ``micro_batch_tokens``,
            ``max_grad_norm``, ``share_prefix``, ``packing``).
        updater: the actor's GRPO updater: its model, optimiser and schedule are the ones fine-tuned
            and stepped.
        compute_dtype: the update's compute dtype.

    Raises:
        ConfigError: ``train.workers`` above 1 (the fine-tuning runs in the trainer's process).
    """

    def __init__(self, cfg: Any, updater: PolicyUpdater, compute_dtype: torch.dtype | None = None) -> None:
        if cfg.train.workers > 1:
            raise ConfigError("train.workers: internalisation fine-tunes the actor in the trainer's process; "
                              "set train.workers: 1")
        self.layout = cfg.train.sequences
        self.updater = PolicyUpdater(
            updater.model, updater.optimizer, updater.pad_id, micro_batch_size=cfg.train.micro_batch_size,
            micro_batch_tokens=cfg.train.micro_batch_tokens, mini_batches=1, epochs=cfg.train.internalise_epochs,
            max_grad_norm=cfg.train.max_grad_norm, temperature=1.0, loss_fn=sft_loss, skip_zero_advantage=False,
            seed=cfg.train.seed + 1, loss_agg="token-mean", compute_dtype=compute_dtype,
            share_prefix=cfg.train.share_prefix, packing=cfg.train.packing, scheduler=updater.scheduler)

    def update(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        """Select, strip and fine-tune on the step's episodes ``trajs``; returns the metrics, prefixed
        ``internalise_``: ``selected`` (episodes kept), ``stripped`` (of those, the ones whose prompts
        could be stripped and were trained), ``optimizer_steps``, ``loss`` and ``nll`` (per reply token,
        nats, before the step), ``trained_tokens``, ``grad_norm``, ``lr``.  No optimiser step without a
        stripped episode."""
        chosen = select_episodes(trajs)
        copies = [c for c in (stripped(t) for t in chosen) if c is not None and any(x.response_ids for x in c.turns)]
        out = {"selected": float(len(chosen)), "stripped": float(len(copies)), "optimizer_steps": 0.0}
        if copies:
            samples = episode_samples(copies, [1.0] * len(copies), self.layout)
            res = self.updater.update(samples)
            out.update({k: float(res[k]) for k in ("optimizer_steps", "loss", "nll", "trained_tokens", "grad_norm",
                                                   "lr") if k in res})
        return {f"internalise_{k}": v for k, v in out.items()}

    def state_dict(self) -> dict[str, Any]:
        """The fine-tuning's shuffling generator (the optimiser and schedule are the actor's)."""
        return {"rng": self.updater.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (``{}``: leave the generator as built)."""
        if state.get("rng") is not None:
            self.updater.rng.setstate(state["rng"])
