"""Policy-gradient losses on token log-probs (actor tokens only).

All functions take per-token tensors of shape ``(B, T)`` aligned with a 0/1 ``mask`` of the same shape
that marks the tokens the policy generated; every other position contributes nothing, value or gradient.
Aggregation: by default the sum over masked tokens divided by ``normalizer`` (default: the number of
masked tokens here; pass the token count of the whole optimiser step when accumulating gradients over
micro-batches, so that micro-batch sizes do not change the weighting): ``token-mean``.  Any other
aggregation is given as ``token_weights`` ``(B, T)``, the weight of each token in the step's loss
(zero off the mask); :class:`crl_bench.trainer.policy.PolicyUpdater` builds them for
``seq-mean-token-mean`` (each sequence's token mean, averaged over sequences; the released code's
default, see docs/method.md).
"""

from __future__ import annotations

import torch


def _normalizer(mask: torch.Tensor, normalizer: float | None) -> torch.Tensor | float:
    if normalizer is not None:
        return float(normalizer)
    return mask.sum().clamp(min=1.0)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None,
              token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar loss from per-token losses ``(B, T)``: ``sum(per_token * token_weights)`` when weights are
    given, else the masked sum divided by ``normalizer`` (token-mean). Off-mask positions never count,
    whatever value they hold."""
    if token_weights is not None:
        w = token_weights.to(per_token.dtype)
        return torch.where(mask > 0, per_token * w, torch.zeros_like(per_token)).sum()
    return torch.where(mask > 0, per_token * mask, torch.zeros_like(per_token)).sum() / _normalizer(mask, normalizer)


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_eps: float = 0.2, normalizer: float | None = None,
                  ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
                  token_weights: torch.Tensor | None = None):
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
        token_weights: ``(B, T)`` per-token weights replacing ``normalizer`` (see module docstring).

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
    loss = aggregate(per_token, mask, normalizer, token_weights)
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        stats = {
            "clip_frac": float(((clipped > unclipped).to(mask.dtype) * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "approx_kl": float(((old_logprobs - logprobs) * mask).sum() / n),
            "kl": float(kl),
        }
    return loss, stats


def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, eps_low: float | None = 0.1, eps_high: float | None = 0.1,
               normalizer: float | None = None, token_weights: torch.Tensor | None = None):
    """CISPO: clipped importance-sampling-weight policy optimisation (MiniMax-M1, arXiv 2506.13585, eq. 4).

    ``loss = -(1/n) * sum_t sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * log pi(o_t)`` over the masked
    tokens, with ``r_t = exp(logp_t - old_logp_t)``, ``sg`` the stop-gradient and ``n`` the token
    normaliser (token-level normalisation as in the paper; see the module docstring).  No KL term.

    Unlike PPO's clipped surrogate, clipping only bounds the *weight*: every token keeps the gradient
    ``d loss / d logp_t = -clip(r_t) * A / n`` of its log-prob, including tokens whose ratio left the
    trust region (PPO gives those exactly zero gradient).

    Clip bounds: ``eps_low = eps_high = 0.1`` are the Complementary RL release's extractor defaults
    (docs/method.md).  ``eps_low=None`` removes the lower bound: the MiniMax-M1 paper tunes only
    the upper bound (its lower bound is set large enough never to act), and TRL's ``cispo`` loss
    caps only the top (``epsilon_high=5.0`` there).  ``eps_high=None`` removes the upper bound (plain
    importance-weighted REINFORCE; not recommended).

    Args:
        logprobs: current policy log-probs, ``(B, T)``, with gradient.
        old_logprobs: behaviour log-probs, ``(B, T)``.
        advantages: ``(B, T)`` or ``(B,)`` (broadcast over tokens).
        mask: ``(B, T)`` 1 on generated tokens.
        eps_low, eps_high: the clip range of the weight, or ``None`` for no bound on that side.
        normalizer: token count to divide by (default: masked tokens here).
        token_weights: ``(B, T)`` per-token weights replacing ``normalizer`` (see module docstring).

    Returns:
        ``(loss, stats)``: scalar loss; stats holds ``clip_frac`` (fraction of masked tokens whose
        ratio was clipped, either side), ``clip_frac_low``, ``clip_frac_high``, ``ratio_mean``,
        ``weight_mean`` (mean clipped weight) and ``approx_kl`` (mean of ``old - new``).
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    with torch.no_grad():
        ratio = torch.exp(logprobs.detach() - old_logprobs.detach())
        lo = 1.0 - eps_low if eps_low is not None else None
        hi = 1.0 + eps_high if eps_high is not None else None
        weight = torch.clamp(ratio, min=lo, max=hi) if (lo is not None or hi is not None) else ratio
    weight = torch.where(mask > 0, weight, torch.zeros_like(weight))   # padding cannot leak inf/nan
    per_token = -weight * advantages.detach() * logprobs
    loss = aggregate(per_token, mask, normalizer, token_weights)
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        low = (ratio < lo).to(mask.dtype) if lo is not None else torch.zeros_like(mask)
        high = (ratio > hi).to(mask.dtype) if hi is not None else torch.zeros_like(mask)
        stats = {
            "clip_frac": float(((low + high) * mask).sum() / n),
            "clip_frac_low": float((low * mask).sum() / n),
            "clip_frac_high": float((high * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "weight_mean": float((weight * mask).sum() / n),
            "approx_kl": float(((old_logprobs - logprobs) * mask).sum() / n),
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
