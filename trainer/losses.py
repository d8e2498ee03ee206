"""Policy-gradient losses on token log-probs (actor tokens only).

All functions take per-token tensors of shape ``(B, T)`` aligned with a 0/1 ``mask`` of the same shape
that marks the tokens the policy generated; every other position contributes nothing, value or gradient.
Normalisation is token-level: the sum over masked tokens divided by ``normalizer`` (default: the number
of masked tokens here; pass the token count of the whole optimiser step when accumulating gradients
over micro-batches, so that micro-batch sizes do not change the weighting).
"""

from __future__ import annotations

import torch


def _normalizer(mask: torch.Tensor, normalizer: float | None) -> torch.Tensor | float:
    if normalizer is not None:
        return float(normalizer)
    return mask.sum().clamp(min=1.0)


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_eps: float = 0.2, normalizer: float | None = None,
                  ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0):
    """PPO clipped surrogate as used by GRPO (Schulman et al. 2017, eq. 7; DeepSeekMath eq. 3).

    ``loss_t = max(-A r_t, -A clip(r_t, 1-eps, 1+eps))`` with ``r_t = exp(logp_t - old_logp_t)``,
    plus ``kl_coef * k3`` where ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's unbiased,
    non-negative KL estimator, DeepSeekMath eq. 4) when ``ref_logprobs`` is given.

    Args:
        logprobs: current policy log-probs, ``(B, T)``, with gradient.
        old_logprobs: behaviour log-probs, ``(B, T)`` (no gradient needed).
        advantages: ``(B, T)`` or ``(B,)`` (broadcast over tokens).
        mask: ``(B, T)`` 1 on actor tokens.
        clip_eps: the clip range epsilon.
        normalizer: token count to divide by (see module docstring).
        ref_logprobs: reference-model log-probs ``(B, T)`` for the KL penalty, or ``None``.
        kl_coef: weight of the KL penalty.

    Returns:
        ``(loss, stats)``: scalar loss; stats holds ``clip_frac`` (fraction of masked tokens where the
        clipped branch was taken), ``ratio_mean``, ``approx_kl`` (mean of ``old - new``) and ``kl``.
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)
    kl = torch.zeros((), dtype=logprobs.dtype)
    if ref_logprobs is not None and kl_coef > 0:
        d = ref_logprobs.detach() - logprobs
        k3 = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * k3
        kl = (k3 * mask).sum() / mask.sum().clamp(min=1.0)
    norm = _normalizer(mask, normalizer)
    loss = (per_token * mask).sum() / norm
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        stats = {
            "clip_frac": float(((clipped > unclipped).to(mask.dtype) * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "approx_kl": float(((old_logprobs - logprobs) * mask).sum() / n),
            "kl": float(kl),
        }
    return loss, stats


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of ``targets`` under ``logits / temperature``.

    Args:
        logits: ``(B, T, V)``.
        targets: ``(B, T)`` token ids.
    Returns:
        ``(B, T)`` float32 log-probs (computed in float32 for stability).
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
