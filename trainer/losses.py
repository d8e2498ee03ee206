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

from typing import Any

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


LOGPROB_PLAIN_BYTES = 256 * 2**20
"""Below this many bytes of a float32 ``(B, T, V)`` copy, :func:`token_logprobs` takes the plain log-softmax: at
that size its memory does not matter and it is faster (8 rows of 300 positions at V = 49,152, forward and
backward: 0.93 s against 1.09 s chunked, medians of 6, 2-core Intel Xeon with AMX, 2026-11-30); above it, the
chunked one."""
LOGPROB_CHUNK_TOKENS = 512
"""Positions per chunk of :func:`token_logprobs`: its transient float32 memory is about
``3 x 4 x LOGPROB_CHUNK_TOKENS x V`` bytes (0.9 GiB at Qwen2.5's V = 152,064), whatever the sequence length."""


class _ChunkedLogprobs(torch.autograd.Function):
    """Log-probs of ``targets`` under ``logits / temperature``, the vocabulary reduced ``chunk`` positions at a
    time in float32: the forward keeps each position's log-sum-exp (one float per position), and the backward
    rebuilds each chunk's softmax from the logits and that log-sum-exp, so the gradient is
    ``(onehot(target) - softmax) * g / temperature`` without any float32 ``(B, T, V)`` tensor. One exp pass
    each way, as the full log-softmax takes."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int) -> torch.Tensor:
        b, t, _ = logits.shape
        out = torch.empty((b, t), dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for row in range(b):
            for s in range(0, t, chunk):
                x = logits[row, s:s + chunk].float()
                if temperature != 1.0:
                    x = x / temperature
                m = torch.logsumexp(x, dim=-1)
                lse[row, s:s + chunk] = m
                out[row, s:s + chunk] = x.gather(-1, targets[row, s:s + chunk, None]).squeeze(-1) - m
                del x
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        logits, targets, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        b, t, _ = logits.shape
        for row in range(b):
            for s in range(0, t, chunk):
                x = logits[row, s:s + chunk].float()
                if temperature != 1.0:
                    x = x / temperature
                g = grad_out[row, s:s + chunk, None].float()
                gx = torch.exp(x.sub_(lse[row, s:s + chunk, None])).mul_(-g)      # -softmax * g, in place
                gx.scatter_add_(-1, targets[row, s:s + chunk, None], g)
                if temperature != 1.0:
                    gx.div_(temperature)
                grad[row, s:s + chunk] = gx
                del x, gx
        return grad, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_tokens: int = LOGPROB_CHUNK_TOKENS, plain_bytes: int = LOGPROB_PLAIN_BYTES) -> torch.Tensor:
    """Log-prob of ``targets`` under ``logits / temperature``, without a float32 copy of the whole
    vocabulary for every position.

    The log-softmax runs in float32 for stability. Above ``plain_bytes`` it runs on ``chunk_tokens`` positions at
    a time; what the graph
    keeps is the logits themselves (already alive: the model returned them), the targets and one
    log-sum-exp per position, and the backward rebuilds each chunk's softmax from them
    (:class:`_ChunkedLogprobs`), so its transient float32 memory is that of one chunk. A plain
    ``log_softmax(logits.float()).gather(...)`` keeps a float32 ``(B, T, V)`` output for the backward and
    builds another as its gradient: about 14 V bytes per position with bf16 logits (2 GiB per 1,000
    positions at V = 152k), the peak of a long-context update (docs/scaling.md). Same values and
    gradients (to float rounding); the idea of TRL's ``selective_log_softmax`` and of fused
    cross-entropy kernels (verl, Liger).

    Args:
        logits: ``(B, T, V)``, any float dtype.
        targets: ``(B, T)`` token ids.
        temperature: divides the logits (> 0).
        chunk_tokens: positions per chunk (>= 1).
        plain_bytes: below this size of a float32 copy of ``logits`` the plain log-softmax runs instead
            (:data:`LOGPROB_PLAIN_BYTES`; 0: always chunked).
    Returns:
        ``(B, T)`` float32 log-probs.
    Raises:
        ValueError: ``chunk_tokens < 1``, or shapes that do not match.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"logits (B, T, V) and targets (B, T) do not match: {tuple(logits.shape)}, "
                         f"{tuple(targets.shape)}")
    if logits.shape[0] * logits.shape[1] == 0:
        return torch.zeros(logits.shape[:2], dtype=torch.float32, device=logits.device)
    if 4 * logits.numel() < plain_bytes:
        x = logits.float()
        if temperature != 1.0:
            x = x / temperature
        return torch.log_softmax(x, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return _ChunkedLogprobs.apply(logits, targets, float(temperature), int(chunk_tokens))
