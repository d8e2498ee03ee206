"""Policy-gradient updates of an LLM on turn samples (prompt, response, old log-probs, advantage).

One :class:`PolicyUpdater` serves any token-level policy loss: GRPO's PPO-clipped loss for the actor
here, CISPO for the extractor (it takes the loss function as an argument).  Samples are left-padded
into micro-batches so that all responses end at the last position; the model then only has to
produce logits for the last ``max response length + 1`` positions (``logits_to_keep``), which keeps the
``(B, T, vocab)`` tensor small on CPU.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from crl_bench.trainer.losses import ppo_clip_loss, token_logprobs


@dataclass
class TokenSample:
    """One training sequence.

    Attributes:
        prompt_ids: length P, masked out of the loss.
        response_ids: length R >= 1, the generated tokens that receive gradient.
        old_logprobs: length R, behaviour log-probs.
        advantage: scalar advantage broadcast over the response tokens.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]
    advantage: float


def build_batch(samples: Sequence[TokenSample], pad_id: int, device: torch.device | str = "cpu"):
    """Left-pad samples into tensors.

    Returns:
        dict with ``input_ids``/``attention_mask``/``position_ids`` ``(B, L)``, ``targets`` ``(B, R)``
        (the last R tokens), ``mask`` ``(B, R)`` (1 on each row's own response tokens, right-aligned),
        ``old_logprobs`` ``(B, R)``, ``advantages`` ``(B,)`` and ``keep`` = R + 1 (logits to keep),
        where ``R`` is the longest response in the batch.
    """
    if not samples:
        raise ValueError("empty batch")
    for s in samples:
        if not s.response_ids or len(s.response_ids) != len(s.old_logprobs):
            raise ValueError("each sample needs a non-empty response with one old log-prob per token")
    seqs = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
    width = max(len(x) for x in seqs)
    rmax = max(len(s.response_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, rmax), dtype=torch.float32)
    old = torch.zeros((b, rmax), dtype=torch.float32)
    for i, (seq, s) in enumerate(zip(seqs, samples)):
        input_ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        attention[i, width - len(seq):] = 1
        r = len(s.response_ids)
        mask[i, rmax - r:] = 1.0
        old[i, rmax - r:] = torch.tensor(s.old_logprobs, dtype=torch.float32)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids.to(device), "attention_mask": attention.to(device),
        "position_ids": position_ids.to(device), "targets": input_ids[:, width - rmax:].to(device),
        "mask": mask.to(device), "old_logprobs": old.to(device),
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device),
        "keep": rmax + 1,
    }


def sequence_logprobs(model: Any, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs ``(B, R)`` of the batch's response tokens under ``model`` (with gradient if enabled)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], logits_to_keep=batch["keep"], use_cache=False)
    logits = out.logits[:, :-1, :]                       # predicts the last R tokens
    return token_logprobs(logits, batch["targets"], temperature)


LossFn = Callable[..., tuple[torch.Tensor, dict]]


class PolicyUpdater:
    """Runs optimiser steps of a token-level policy loss over a list of :class:`TokenSample`.

    Args:
        model: the trainable model (its parameters with ``requires_grad`` are optimised).
        optimizer: an optimiser over those parameters.
        pad_id: tokenizer pad id.
        micro_batch_size: samples per forward/backward.
        mini_batches: optimiser steps per epoch (the samples are split evenly).
        epochs: passes over the samples.
        max_grad_norm: global-norm clip (0 disables).
        temperature: the sampling temperature the old log-probs were computed at.
        loss_fn: ``loss_fn(logprobs, old_logprobs, advantages, mask, normalizer=..., **loss_kwargs)``
            -> ``(loss, stats)``; default :func:`ppo_clip_loss`.
        loss_kwargs: extra keyword arguments of ``loss_fn`` (e.g. ``clip_eps``).
        ref_model: a frozen reference for a KL term (``kl_coef`` in ``loss_kwargs``), or a callable
            context manager factory (e.g. peft's ``disable_adapter``) that makes ``model`` the reference.
        skip_zero_advantage: drop samples with advantage exactly 0 from forward/backward (their
            gradient is exactly 0 when there is no KL term); they still count in the token normaliser.
    """

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, pad_id: int,
                 micro_batch_size: int = 8, mini_batches: int = 1, epochs: int = 1,
                 max_grad_norm: float = 1.0, temperature: float = 1.0, loss_fn: LossFn = ppo_clip_loss,
                 loss_kwargs: dict | None = None, ref_model: Any = None,
                 skip_zero_advantage: bool = True, seed: int = 0) -> None:
        self.model = model
        self.optimizer = optimizer
        self.pad_id = pad_id
        self.micro_batch_size = micro_batch_size
        self.mini_batches = mini_batches
        self.epochs = epochs
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.loss_fn = loss_fn
        self.loss_kwargs = dict(loss_kwargs or {})
        self.ref_model = ref_model
        self.skip_zero_advantage = skip_zero_advantage and not self.loss_kwargs.get("kl_coef")
        self.rng = random.Random(seed)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _ref_logprobs(self, batch: dict) -> torch.Tensor | None:
        if self.ref_model is None or not self.loss_kwargs.get("kl_coef"):
            return None
        with torch.no_grad():
            if callable(self.ref_model) and not isinstance(self.ref_model, torch.nn.Module):
                with self.ref_model():
                    return sequence_logprobs(self.model, batch, self.temperature)
            return sequence_logprobs(self.ref_model, batch, self.temperature)

    def update(self, samples: Sequence[TokenSample]) -> dict[str, float]:
        """Optimise on ``samples``; returns mean loss statistics over micro-batches.

        Returns a dict with ``loss``, ``grad_norm`` (pre-clip, last optimiser step), ``clip_frac``,
        ``ratio_mean``, ``approx_kl``, ``kl``, ``optimizer_steps``, ``trained_tokens`` and
        ``trained_samples``.  With no sample carrying a learning signal it returns zeros and makes no
        optimiser step.
        """
        totals: dict[str, float] = {}
        count = 0
        grad_norm = 0.0
        steps = 0
        trained_tokens = 0
        trained_samples = 0
        self.model.train()
        samples = list(samples)
        for _ in range(self.epochs):
            order = samples[:]
            self.rng.shuffle(order)
            size = math.ceil(len(order) / self.mini_batches) if order else 0
            for m in range(self.mini_batches):
                chunk = order[m * size:(m + 1) * size]
                if not chunk:
                    continue
                normalizer = float(sum(len(s.response_ids) for s in chunk))
                work = [s for s in chunk if not (self.skip_zero_advantage and s.advantage == 0.0)]
                if not work:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                for start in range(0, len(work), self.micro_batch_size):
                    micro = work[start:start + self.micro_batch_size]
                    batch = build_batch(micro, self.pad_id, self.device)
                    ref = self._ref_logprobs(batch)
                    lp = sequence_logprobs(self.model, batch, self.temperature)
                    kwargs = dict(self.loss_kwargs)
                    if ref is not None:
                        kwargs["ref_logprobs"] = ref
                    elif "kl_coef" in kwargs:
                        kwargs.pop("kl_coef")
                    loss, stats = self.loss_fn(lp, batch["old_logprobs"], batch["advantages"],
                                               batch["mask"], normalizer=normalizer, **kwargs)
                    loss.backward()
                    totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
                    for k, v in stats.items():
                        totals[k] = totals.get(k, 0.0) + v
                    count += 1
                    trained_tokens += int(batch["mask"].sum())
                    trained_samples += len(micro)
                params = [p for p in self.model.parameters() if p.requires_grad]
                if self.max_grad_norm > 0:
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
                else:
                    grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in params
                                                              if p.grad is not None])))
                self.optimizer.step()
                steps += 1
        out = {k: v / max(count, 1) for k, v in totals.items()}
        # "loss" above is a mean of micro-batch partial sums; report the step loss (their sum per step)
        if count:
            out["loss"] = totals["loss"] / max(steps, 1)
        out.update(grad_norm=grad_norm, optimizer_steps=float(steps), trained_tokens=float(trained_tokens),
                   trained_samples=float(trained_samples))
        for k in ("loss", "clip_frac", "ratio_mean", "approx_kl", "kl"):
            out.setdefault(k, 0.0)
        return out
