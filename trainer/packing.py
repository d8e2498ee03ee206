"""Padding-free micro-batches of the policy update (``train.packing``).

The padded layout (:func:`crl_bench.trainer.policy.build_batch`) puts each sample in a row of the
longest sample's width, so a micro-batch of lengths 900, 400 and 300 costs 3 x 900 positions.  Here the
samples of a micro-batch are packed, first-fit by decreasing length, into rows no wider than its
longest sample (900 | 400 + 300: 2 x 900), each sample's ``position_ids`` restarting at 0.  The
attention mask is transformers' own: with ``attention_mask=None``, ``position_ids`` given and no cache,
its masking utilities (``masking_utils.find_packed_sequence_indices``, transformers >= 4.54) split each
row where the positions restart and make every token attend causally within its own sample only
(block-diagonal causal), for ``sdpa`` and ``eager`` attention alike.  So each sample's log-probs equal
the padded forward's, to float rounding.

Rows are never wider than the micro-batch's longest sample: one row holding the whole micro-batch
would pay attention over all of its tokens (quadratic in the row's width) and measured about 2x slower
than the padded rows on a 2-core CPU with the default model (docs/performance.md, "Packed
micro-batches").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from crl_bench.llm.precision import autocast
from crl_bench.trainer.losses import token_logprobs

__all__ = ["check_samples", "pack_batch", "pack_rows", "packed_chunks", "packed_logprobs", "packed_tokens"]


def check_samples(samples: Sequence[Any]) -> None:
    """Raise ``ValueError`` for an empty batch of :class:`~crl_bench.trainer.policy.TokenSample`, a sample
    without response tokens, or per-token lists (old log-probs, ``loss_mask``) of another length than its
    response."""
    if not samples:
        raise ValueError("empty batch")
    for s in samples:
        if not s.response_ids or len(s.response_ids) != len(s.old_logprobs):
            raise ValueError("each sample needs a non-empty response with one old log-prob per token")
        if s.loss_mask is not None and len(s.loss_mask) != len(s.response_ids):
            raise ValueError(f"loss_mask has {len(s.loss_mask)} entries for {len(s.response_ids)} response tokens")


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """First-fit-decreasing packing of items of token ``lengths`` into rows of at most ``width`` tokens.

    Returns the rows as lists of item indices (each item in exactly one row, a row's items in the
    order they are laid out).  Raises ``ValueError`` when an item is longer than ``width``."""
    if lengths and max(lengths) > width:
        raise ValueError(f"an item of {max(lengths)} tokens does not fit a row of {width}")
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for r, f in enumerate(fill):
            if f + lengths[i] <= width:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    return rows


def packed_tokens(lengths: Sequence[int]) -> int:
    """Positions the packed rows of items of token ``lengths`` hold (rows x the longest item, trailing
    padding of the rows included; :func:`pack_rows`): what a packed micro-batch's forward computes."""
    if not lengths:
        return 0
    return len(pack_rows(lengths, max(lengths))) * max(lengths)


def packed_chunks(lengths: Sequence[int], size: int, tokens: int = 0) -> list[range]:
    """Split items of token ``lengths`` (in order) into consecutive micro-batches of at most ``size``
    items whose packed rows hold at most ``tokens`` positions (:func:`packed_tokens`: the items' real
    tokens and the rows' trailing padding; 0: no token bound); an item longer than ``tokens`` is a
    micro-batch of its own.  The packed twin of :func:`~crl_bench.trainer.policy.micro_chunks`, which
    bounds items x the longest: both bound the tensor the forward computes, hence the update's memory."""
    out: list[range] = []
    start = 0
    for i in range(len(lengths)):
        if i > start and (i - start >= size or (tokens and packed_tokens(lengths[start:i + 1]) > tokens)):
            out.append(range(start, i))
            start = i
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


def pack_batch(samples: Sequence[Any], pad_id: int, device: torch.device | str = "cpu",
               weights: Sequence[float] | None = None) -> dict[str, Any]:
    """Pack samples into rows (:func:`pack_rows`, width = the longest sample), right-padding the rows.

    The loss-side tensors have the padded layout's shapes and alignment, one row per sample with its
    response right-aligned in ``R`` columns (``R`` = the longest response), so the loss functions and
    :func:`~crl_bench.trainer.policy.response_logprobs` take them unchanged.

    Args:
        samples: B samples, each with a non-empty prompt (its last token predicts the first response
            token) and response. weights: optional per-token loss weight of each sample.

    Returns:
        dict with ``packed`` True; the model's inputs ``input_ids`` / ``position_ids`` ``(N, L)`` (N rows,
        L <= the longest sample; positions restart at 0 at each sample and at a row's trailing padding)
        and ``keep`` (1-D: the K row positions whose logits predict some trained token, in any row);
        ``row_targets`` ``(N, K)`` (the token each kept position predicts) and ``index`` ``(B, R)``
        (flat index into the ``(N, K)`` log-probs of each sample's response token; 0 off the mask);
        ``targets``, ``mask``, ``old_logprobs`` ``(B, R)``, ``advantages`` ``(B,)``, with ``weights``
        ``token_weights`` ``(B, R)``; ``cols`` None, ``width`` R; ``real_tokens`` (sum of the samples'
        lengths) and ``forward_tokens`` (N x L, padding included).

    Raises:
        ValueError: an empty batch, an empty prompt or response, or per-token lists of another length.
    """
    check_samples(samples)
    if any(not s.prompt_ids for s in samples):
        raise ValueError("packing needs a non-empty prompt for each sample (its last token predicts the first "
                         "response token)")
    seqs = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
    lengths = [len(x) for x in seqs]
    rows = pack_rows(lengths, max(lengths))
    width = max(sum(lengths[i] for i in row) for row in rows)
    n_rows, b = len(rows), len(samples)
    rmax = max(len(s.response_ids) for s in samples)
    input_ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((n_rows, width), dtype=torch.long)
    mask = torch.zeros((b, rmax), dtype=torch.float32)
    old = torch.zeros((b, rmax), dtype=torch.float32)
    targets = torch.full((b, rmax), pad_id, dtype=torch.long)
    # (row, predicting position) of each trained response token, per sample
    where: list[list[tuple[int, int, int]]] = [[] for _ in samples]
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            s, n = samples[i], lengths[i]
            input_ids[r, offset:offset + n] = torch.tensor(seqs[i], dtype=torch.long)
            position_ids[r, offset:offset + n] = torch.arange(n)
            resp = len(s.response_ids)
            lm = s.loss_mask if s.loss_mask is not None else [1] * resp
            col0 = rmax - resp
            mask[i, col0:] = torch.tensor(lm, dtype=torch.float32)
            old[i, col0:] = torch.tensor(s.old_logprobs, dtype=torch.float32)
            targets[i, col0:] = torch.tensor(s.response_ids, dtype=torch.long)
            first = offset + len(s.prompt_ids) - 1
            where[i] = [(r, first + j, col0 + j) for j in range(resp) if lm[j]]
            offset += n
        position_ids[r, offset:] = torch.arange(width - offset)
    keep = sorted({pos for w in where for _, pos, _ in w})
    if not keep:                                  # nothing trained: keep one position so shapes stay valid
        keep = [0]
    at = {pos: k for k, pos in enumerate(keep)}
    keep_t = torch.tensor(keep, dtype=torch.long)
    row_targets = input_ids[:, (keep_t + 1).clamp(max=width - 1)]
    index = torch.zeros((b, rmax), dtype=torch.long)
    for i, w in enumerate(where):
        for r, pos, col in w:
            index[i, col] = r * len(keep) + at[pos]
    extra: dict[str, Any] = {}
    if weights is not None:
        extra["token_weights"] = (mask * torch.tensor(list(weights), dtype=torch.float32)[:, None]).to(device)
    return {**extra, "packed": True,
            "input_ids": input_ids.to(device), "position_ids": position_ids.to(device), "keep": keep_t.to(device),
            "row_targets": row_targets.to(device), "index": index.to(device), "targets": targets.to(device),
            "mask": mask.to(device), "old_logprobs": old.to(device),
            "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device),
            "cols": None, "width": rmax, "real_tokens": sum(lengths), "forward_tokens": n_rows * width}


def packed_logprobs(model: Any, batch: dict[str, Any], temperature: float = 1.0,
                    compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Log-probs ``(B, R)`` (float32) of a :func:`pack_batch` batch's response tokens under ``model``
    (with gradient if enabled; 0 off ``batch["mask"]``, where no logit was kept).  The forward runs under
    autocast to ``compute_dtype`` with ``attention_mask=None`` and the restarting ``position_ids``,
    from which transformers builds the block-diagonal causal mask (module docstring); the
    log-softmax runs in float32 outside autocast."""
    with autocast(batch["input_ids"].device, compute_dtype or torch.float32, cache=False):
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
                    logits_to_keep=batch["keep"], use_cache=False)
    rows = token_logprobs(out.logits, batch["row_targets"], temperature)
    lp = rows.reshape(-1)[batch["index"]]
    return torch.where(batch["mask"] > 0, lp, torch.zeros_like(lp))
