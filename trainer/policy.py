"""Policy-gradient updates of an LLM on turn samples (prompt, response, old log-probs, advantage).

One :class:`PolicyUpdater` serves any token-level policy loss: GRPO's PPO-clipped loss for the actor
here, CISPO for the extractor (it takes the loss function as an argument).  Two settings follow the
released code (docs/method.md): ``loss_agg="seq-mean-token-mean"`` weighs each *sequence* (one whole
episode of the actor: all its turns, which share :attr:`TokenSample.sequence`; one extraction of the
extractor) equally, its tokens averaged within it; ``recompute_old_logprobs`` recomputes the old
log-probs with the trainer's weights before the update (needed whenever the sampler is not the trainer,
e.g. vLLM or a bf16 sampler).  With ``compute_dtype`` bf16 the forward/backward runs under
``torch.autocast`` while the weights and the optimiser state stay float32.  Samples are left-padded
into micro-batches so that all responses end at the last position; the model then only has to
produce logits for the last ``max response length + 1`` positions (``logits_to_keep``), which keeps the
``(B, T, vocab)`` tensor small on CPU.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

import torch

from crl_bench.config import LossAgg, SequenceLayout
from crl_bench.llm.precision import autocast
from crl_bench.trainer.losses import ppo_clip_loss, token_logprobs
from crl_bench.trainer.packing import check_samples, pack_batch, packed_chunks, packed_logprobs

if TYPE_CHECKING:
    from crl_bench.rollout import Trajectory


@dataclass
class TokenSample:
    """One training sequence: a context that is never trained, then a trained part.

    Attributes:
        prompt_ids: length P, masked out of the loss (a turn's prompt; an episode's first prompt).
        response_ids: length R >= 1, the tokens after the prompt (a turn's reply; for a whole episode
            every later token: each reply and, between replies, the tokens the environment and the
            template added).
        old_logprobs: length R, behaviour log-probs (any value where ``loss_mask`` is 0).
        advantage: scalar advantage broadcast over the trained tokens.
        sequence: key of the sequence this sample belongs to for ``seq-mean-token-mean`` (e.g. the
            episode of a turn); ``None``: the sample is a sequence of its own.
        loss_mask: length R, 1 on the tokens the actor generated (those receive gradient), 0 on the
            environment's; ``None``: every response token is the actor's.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]
    advantage: float
    sequence: Hashable | None = None
    loss_mask: list[int] | None = None

    @property
    def trained_tokens(self) -> int:
        """How many tokens receive gradient (the actor's tokens of the response)."""
        return sum(self.loss_mask) if self.loss_mask is not None else len(self.response_ids)


SEQUENCE_LAYOUTS: tuple[str, ...] = get_args(SequenceLayout)


def append_only(turns: Sequence[Any]) -> bool:
    """Whether each turn's prompt ids begin with the previous turn's prompt ids and response ids, token
    for token (the ``multiturn`` prompts of :class:`~crl_bench.prompts.PromptBuilder`; never the
    ``window`` layout, whose prompts are rebuilt each turn)."""
    for prev, cur in zip(turns, turns[1:]):
        n, r = len(prev.prompt_ids), len(prev.response_ids)
        if len(cur.prompt_ids) < n + r or cur.prompt_ids[:n] != prev.prompt_ids \
                or cur.prompt_ids[n:n + r] != prev.response_ids:
            return False
    return True


def episode_sequence(trajectory: Trajectory, advantage: float, sequence: Hashable | None = None) -> TokenSample | None:
    """A whole episode as one :class:`TokenSample`: its first turn's prompt, then every later token of
    its last turn's prompt and its last reply, with ``loss_mask`` 1 on each turn's reply and the
    replies' behaviour log-probs aligned with them (released ROLL: one padded sequence per episode,
    the environment's tokens masked, ``traj_env_manager.py``).  Under causal attention each reply
    token sees exactly the context its turn's prompt gave it, so the log-probs, the loss and the
    gradient equal those of the per-turn samples while each token goes through the model once.

    Returns ``None`` when the episode's prompts are not :func:`append_only` or no turn generated
    tokens (the caller trains it per turn or not at all).
    """
    turns = list(trajectory.turns)
    if not turns or not any(t.response_ids for t in turns) or not append_only(turns):
        return None
    first = len(turns[0].prompt_ids)
    ids = list(turns[-1].prompt_ids[first:]) + list(turns[-1].response_ids)
    mask = [0] * len(ids)
    old = [0.0] * len(ids)
    for t in turns:
        start = len(t.prompt_ids) - first
        r = len(t.response_ids)
        mask[start:start + r] = [1] * r
        old[start:start + r] = [float(x) for x in t.logprobs[:r]]
    return TokenSample(list(turns[0].prompt_ids), ids, old, float(advantage), sequence=sequence, loss_mask=mask)


def episode_samples(trajectories: Sequence[Trajectory], advantages: Sequence[float],
                    layout: str = "episode", counts: dict[str, int] | None = None) -> list[TokenSample]:
    """The actor's training sequences of a batch of episodes, each carrying its episode's advantage
    and ``sequence`` = the episode's index (``seq-mean-token-mean`` weighs each episode's tokens as
    one sequence either way).

    ``layout="episode"``: one :func:`episode_sequence` per episode whose prompts are append-only,
    else (windowed prompts, a chat template that re-renders the history) one sample per turn that
    generated tokens; ``"turn"``: always one sample per turn.

    Args:
        trajectories: N episodes. advantages: N advantages, one per episode.
        counts: when given, ``episode_sequences`` and ``turn_sample_episodes`` are added to it: how
            many episodes were trained as one sequence, and how many per turn although ``layout`` was
            ``"episode"`` (their prompts were not append-only).

    Raises:
        ValueError: the two lengths differ, or an unknown ``layout``.
    """
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    if layout not in SEQUENCE_LAYOUTS:
        raise ValueError(f"sequence layout must be one of {SEQUENCE_LAYOUTS}, got {layout!r}")
    out: list[TokenSample] = []
    whole = fallback = 0
    for k, (tr, adv) in enumerate(zip(trajectories, advantages)):
        if layout == "episode":
            one = episode_sequence(tr, adv, sequence=k)
            if one is not None:
                out.append(one)
                whole += 1
                continue
            fallback += any(t.response_ids for t in tr.turns)
        out += [TokenSample(t.prompt_ids, t.response_ids, t.logprobs, float(adv), sequence=k)
                for t in tr.turns if t.response_ids]
    if counts is not None:
        counts["episode_sequences"] = counts.get("episode_sequences", 0) + whole
        counts["turn_sample_episodes"] = counts.get("turn_sample_episodes", 0) + fallback
    return out


LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)


def token_weights(samples: Sequence[TokenSample], loss_agg: str) -> list[float]:
    """Per-token loss weight of each sample for one optimiser step over ``samples`` (weights sum to 1
    over all their tokens).

    ``token-mean``: ``1 / (tokens of all samples)``.  ``seq-mean-token-mean``: ``1 / (S * T_s)`` where
    ``S`` is the number of distinct sequences and ``T_s`` the trained tokens of the sample's sequence
    (ROLL's ``agg_loss`` mode of that name, with one sequence per episode as in the released
    ``traj_env_manager.py``).  Raises ``ValueError`` for another ``loss_agg``.
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    if loss_agg == "token-mean":
        total = sum(s.trained_tokens for s in samples)
        return [1.0 / total if total else 0.0 for _ in samples]
    keys = [s.sequence if s.sequence is not None else ("sample", i) for i, s in enumerate(samples)]
    tokens: dict[Hashable, int] = {}
    for k, s in zip(keys, samples):
        tokens[k] = tokens.get(k, 0) + s.trained_tokens
    n = len(tokens)
    return [1.0 / (n * tokens[k]) if tokens[k] else 0.0 for k in keys]


def build_batch(samples: Sequence[TokenSample], pad_id: int, device: torch.device | str = "cpu",
                weights: Sequence[float] | None = None):
    """Left-pad samples into tensors.

    Args:
        weights: optional per-token loss weight of each sample (see :func:`token_weights`).

    Returns:
        dict with ``input_ids``/``attention_mask``/``position_ids`` ``(B, L)``, ``targets`` ``(B, R)``
        (the last R tokens), ``mask`` ``(B, R)`` (1 on each row's trained tokens: its response, right-
        aligned, times its ``loss_mask``),
        ``old_logprobs`` ``(B, R)``, ``advantages`` ``(B,)``, ``keep`` = R + 1 (logits to keep) and,
        with ``weights``, ``token_weights`` ``(B, R)`` (``mask`` times the sample's weight), where ``R``
        is the longest response in the batch.  When a sample has a ``loss_mask`` (a whole episode),
        only the K columns of the response region where some row has a trained token are kept:
        ``targets``, ``mask``, ``old_logprobs`` and ``token_weights`` are ``(B, K)``, ``keep`` is the
        1-D tensor of the K positions whose logits predict them and ``cols`` their columns in ``R``
        (else ``None``); ``width`` is ``R``; ``real_tokens`` (the samples' tokens) and ``forward_tokens``
        (``B x L``, padding included).  The padded twin of :func:`~crl_bench.trainer.packing.pack_batch`.
    """
    check_samples(samples)
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
        mask[i, rmax - r:] = 1.0 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        old[i, rmax - r:] = torch.tensor(s.old_logprobs, dtype=torch.float32)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    extra = {}
    if weights is not None:
        extra["token_weights"] = mask * torch.tensor(list(weights), dtype=torch.float32)[:, None]
    targets = input_ids[:, width - rmax:]
    keep: int | torch.Tensor = rmax + 1
    cols = None
    if any(s.loss_mask is not None for s in samples):
        # whole-episode rows: most of the response region is the environment's text, so logits are
        # kept only where some row has a trained token (the position before it predicts it)
        cols = mask.sum(0).nonzero().squeeze(-1)
        keep = cols + (width - rmax - 1)
        targets, mask, old = targets[:, cols], mask[:, cols], old[:, cols]
        if "token_weights" in extra:
            extra["token_weights"] = extra["token_weights"][:, cols]
    extra = {k: v.to(device) for k, v in extra.items()}
    return {**extra,
        "input_ids": input_ids.to(device), "attention_mask": attention.to(device),
        "position_ids": position_ids.to(device), "targets": targets.to(device),
        "mask": mask.to(device), "old_logprobs": old.to(device),
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device),
        "keep": keep.to(device) if isinstance(keep, torch.Tensor) else keep, "cols": cols, "width": rmax,
        "real_tokens": int(attention.sum()), "forward_tokens": b * width,
    }


def response_logprobs(logprobs: torch.Tensor, batch: dict, row: int, length: int) -> torch.Tensor:
    """The log-probs of row ``row``'s last ``length`` response tokens from ``logprobs`` (as
    :func:`sequence_logprobs` returns them for ``batch``), with 0 where no logit was kept (the
    environment's tokens of a whole-episode row)."""
    cols = batch.get("cols")
    if cols is None:
        return logprobs[row, logprobs.shape[1] - length:]
    full = torch.zeros(batch["width"], dtype=logprobs.dtype)
    full[cols.cpu()] = logprobs[row].cpu()
    return full[batch["width"] - length:]


def sequence_logprobs(model: Any, batch: dict, temperature: float = 1.0,
                      compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Log-probs ``(B, R)`` (float32) of the batch's response tokens under ``model`` (with gradient if
    enabled); the forward runs under autocast to ``compute_dtype`` (``None``: the weights' dtype) without
    the weight-cast cache (:func:`crl_bench.llm.precision.autocast`), the log-softmax in float32 outside it,
    chunked (:func:`crl_bench.trainer.losses.token_logprobs`)."""
    with autocast(batch["input_ids"].device, compute_dtype or torch.float32, cache=False):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], logits_to_keep=batch["keep"], use_cache=False)
    # an int ``keep`` holds one logit more than R (the last position predicts nothing); a tensor
    # ``keep`` holds exactly the predicting positions
    logits = out.logits if batch.get("cols") is not None else out.logits[:, :-1, :]
    return token_logprobs(logits, batch["targets"], temperature)


def common_prefix_length(samples: Sequence[TokenSample]) -> int:
    """Length of the longest prompt prefix all ``samples`` share (at most each prompt's length)."""
    if not samples:
        return 0
    first = samples[0].prompt_ids
    n = min(len(s.prompt_ids) for s in samples)
    for s in samples[1:]:
        ids = s.prompt_ids
        k = 0
        while k < n and ids[k] == first[k]:
            k += 1
        n = k
        if n == 0:
            break
    return n


def shared_prefix_logprobs(model: Any, samples: Sequence[TokenSample], shared: int, pad_id: int,
                           temperature: float = 1.0, compute_dtype: torch.dtype | None = None,
                           device: torch.device | str = "cpu",
                           weights: Sequence[float] | None = None) -> tuple[torch.Tensor, dict]:
    """:func:`sequence_logprobs` of ``samples`` whose prompts share their first ``shared`` tokens,
    computing that prefix once: one forward of the prefix (batch 1) gives its keys and values, which
    are broadcast to the batch as the cache of a second forward over each sample's remaining tokens
    (left-padded after the prefix, positions continuing from it).  Gradients flow through the
    broadcast into the single prefix computation, so the result and its gradient equal the full
    forward's (to float rounding) at a fraction of the cost when prefixes are long (a group's
    system prompt and task).  Needs a model whose forward takes ``past_key_values`` (transformers
    decoder LMs) and no gradient checkpointing (it disables the cache in training).

    Returns ``(logprobs (B, R) float32, batch)`` with ``batch`` as :func:`build_batch` of the
    samples' remaining tokens (``mask``, ``old_logprobs``, ``advantages``, ...).
    """
    from transformers import DynamicCache

    if not 0 < shared < min(len(s.prompt_ids) for s in samples):
        raise ValueError(f"shared prefix {shared} must be in [1, shortest prompt - 1] (the last prompt "
                         "token predicts the first response token)")
    prefix = torch.tensor([samples[0].prompt_ids[:shared]], dtype=torch.long, device=device)
    rest = [dataclasses.replace(s, prompt_ids=list(s.prompt_ids[shared:])) for s in samples]
    batch = build_batch(rest, pad_id, device, weights)
    b = batch["input_ids"].shape[0]
    dtype = compute_dtype or torch.float32
    with autocast(prefix.device, dtype):
        head = model(input_ids=prefix, use_cache=True, logits_to_keep=1)
        layers = [(lay.keys.expand(b, -1, -1, -1), lay.values.expand(b, -1, -1, -1))
                  for lay in head.past_key_values.layers]
        cache = DynamicCache(ddp_cache_data=layers)
        ones = torch.ones((b, shared), dtype=batch["attention_mask"].dtype, device=prefix.device)
        out = model(input_ids=batch["input_ids"],
                    attention_mask=torch.cat([ones, batch["attention_mask"]], dim=1),
                    position_ids=batch["position_ids"] + shared, past_key_values=cache,
                    logits_to_keep=batch["keep"], use_cache=True)
    logits = out.logits if batch.get("cols") is not None else out.logits[:, :-1, :]
    return token_logprobs(logits, batch["targets"], temperature), batch


def recomputed(sample: TokenSample, logprobs: torch.Tensor) -> tuple[TokenSample, torch.Tensor]:
    """``sample`` with its old log-probs replaced by ``logprobs`` (length R, float32: the trainer's
    recomputation), and the differences recomputed minus behaviour on its trained tokens (1-D)."""
    new = logprobs.float()
    d = new - torch.tensor(sample.old_logprobs, dtype=torch.float32)
    if sample.loss_mask is not None:
        d = d[torch.tensor(sample.loss_mask, dtype=torch.bool)]
    return dataclasses.replace(sample, old_logprobs=new.tolist()), d


def micro_chunks(lengths: Sequence[int], size: int, tokens: int = 0) -> list[range]:
    """Split items of token ``lengths`` (in order) into consecutive micro-batches of at most ``size``
    items whose padded size (items x the longest, in tokens) is at most ``tokens`` (0: no token
    bound); an item longer than ``tokens`` is a micro-batch of its own.  The forward/backward's
    activations grow with that padded size, so the bound caps the update's memory whatever the
    prompt or episode lengths, while gradient accumulation keeps the step's gradient the same."""
    out: list[range] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        grown = max(longest, n)
        if i > start and (i - start >= size or (tokens and (i - start + 1) * grown > tokens)):
            out.append(range(start, i))
            start, grown = i, n
        longest = grown
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


LossFn = Callable[..., tuple[torch.Tensor, dict]]


def linear_warmup(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Learning rate ``lr * k / steps`` at the k-th optimiser step (k = 1..steps), then ``lr``.

    Adam's first steps are sign steps (``m / sqrt(v) = g / |g|``): every weight moves by the full
    learning rate whatever its gradient's signal-to-noise ratio, which on sparse-reward RL batches
    shifts a small actor's action distribution state-independently (docs/learning.md).  A warm-up
    (verl's ``lr_warmup_steps``, TRL's ``warmup_steps``) keeps those steps small until Adam's moment
    estimates average several batches.  Raises ``ValueError`` for ``steps < 1``.
    """
    if steps < 1:
        raise ValueError(f"warm-up steps must be >= 1, got {steps}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / steps))


def _checkpointing(model: Any) -> bool:
    """Whether ``model`` recomputes activations in backward (transformers renamed the flag in v5)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or name in getattr(model, "__dict__", {}):
            return bool(getattr(model, name))
    return False


class UpdateStats:
    """Sums of the per-micro-batch outputs of :meth:`PolicyUpdater.micro_backward` over one update,
    and the update's metrics row from them (:meth:`result`). The one-process and the data-parallel
    updaters (trainer/data_parallel.py) both report through it, so their rows have the same keys
    and the same arithmetic."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.count = 0
        self.tokens = 0
        self.samples = 0
        self.shared_tokens = 0
        self.input_tokens = 0
        self.forward_tokens = 0
        self.diffs: list[torch.Tensor] = []

    def add(self, out: dict[str, Any]) -> None:
        """Add one micro-batch's ``micro_backward`` output (``loss``, ``stats``, ``tokens``,
        ``samples``, ``shared_tokens``, ``input_tokens``, ``forward_tokens``, ``diffs``: a 1-D tensor of
        log-prob differences or ``None``)."""
        self.totals["loss"] = self.totals.get("loss", 0.0) + out["loss"]
        for k, v in out["stats"].items():
            self.totals[k] = self.totals.get(k, 0.0) + v
        if out["diffs"] is not None:
            self.diffs.append(out["diffs"])
        self.count += 1
        self.tokens += out["tokens"]
        self.samples += out["samples"]
        self.shared_tokens += out["shared_tokens"]
        self.input_tokens += out.get("input_tokens", 0)
        self.forward_tokens += out.get("forward_tokens", 0)

    def result(self, steps: int, grad_norm: float, lr: float, drift: dict[str, float]) -> dict[str, float]:
        """The update's row (keys as :meth:`PolicyUpdater.update` documents): statistics averaged
        over micro-batches, ``loss`` per optimiser step, and ``drift`` replaced by the statistics of
        the collected ``diffs`` when there are any."""
        if self.diffs:
            drift = PolicyUpdater._drift(torch.cat(self.diffs))
        out = {k: v / max(self.count, 1) for k, v in self.totals.items()}
        # "loss" above is a mean of micro-batch partial sums; report the step loss (their sum per step)
        if self.count:
            out["loss"] = self.totals["loss"] / max(steps, 1)
        out.update(grad_norm=grad_norm, lr=lr, optimizer_steps=float(steps), trained_tokens=float(self.tokens),
                   trained_samples=float(self.samples), shared_prefix_tokens=float(self.shared_tokens),
                   update_input_tokens=float(self.input_tokens), update_forward_tokens=float(self.forward_tokens),
                   update_tokens_per_trained=self.input_tokens / self.tokens if self.tokens else 0.0, **drift)
        for k in ("loss", "clip_frac", "ratio_mean", "approx_kl", "kl"):
            out.setdefault(k, 0.0)
        return out


class PolicyUpdater:
    """Runs optimiser steps of a token-level policy loss over a list of :class:`TokenSample`.

    Args:
        model: the trainable model (its parameters with ``requires_grad`` are optimised).
        optimizer: an optimiser over those parameters.
        pad_id: tokenizer pad id.
        micro_batch_size: samples per forward/backward.
        micro_batch_tokens: at most this many tokens per forward/backward (0: no bound): samples x the
            longest (:func:`micro_chunks`), or with ``packing`` the positions of the packed rows
            (:func:`~crl_bench.trainer.packing.packed_chunks`).
        mini_batches: optimiser steps per epoch (the sequences are split evenly; the turns of one
            sequence stay in one mini-batch).
        epochs: passes over the samples.
        max_grad_norm: global-norm clip (0 disables).
        temperature: the sampling temperature the old log-probs were computed at.
        loss_fn: ``loss_fn(logprobs, old_logprobs, advantages, mask, normalizer=..., token_weights=...,
            **loss_kwargs)`` -> ``(loss, stats)``; default :func:`ppo_clip_loss`.
        loss_kwargs: extra keyword arguments of ``loss_fn`` (e.g. ``clip_eps``).
        ref_model: a frozen reference for a KL term (``kl_coef`` in ``loss_kwargs``), or a callable
            context manager factory (e.g. peft's ``disable_adapter``) that makes ``model`` the reference.
        skip_zero_advantage: drop samples with advantage exactly 0 from forward/backward (their
            gradient is exactly 0 when there is no KL term); they still count in the aggregation.
        loss_agg: ``seq-mean-token-mean`` or ``token-mean`` (:func:`token_weights`).
        recompute_old_logprobs: before the first optimiser step, recompute the old log-probs of the
            trained samples with the current weights (no gradient) instead of the sampler's; the mean
            absolute difference and the spread of ``exp(recomputed - behaviour)`` are reported.  With
            one epoch of one mini-batch (one optimiser step) they are taken, detached, from the
            training forward itself (the same weights and inputs), saving a forward pass.
        compute_dtype: dtype of the forward/backward (``torch.autocast``; ``None`` or float32: none);
            the model's own weights, gradients and optimiser state are untouched by it.
        share_prefix: compute the prompt prefix that all samples of a micro-batch share once
            (:func:`shared_prefix_logprobs`; samples are ordered by prompt so that a group's turns
            meet), when it is at least ``min_shared_prefix`` tokens, the model has no gradient
            checkpointing and no KL reference is needed; otherwise the plain forward.
        scheduler: a ``torch.optim.lr_scheduler`` stepped after every optimiser step (e.g. the
            learning-rate warm-up of :func:`linear_warmup`); the learning rate used is reported as ``lr``.
        packing: pack each micro-batch's samples into rows no wider than its longest sample, each
            attending only to itself (:mod:`crl_bench.trainer.packing`; same log-probs and gradient as
            the padded rows); a shared-prefix micro-batch keeps its own padded layout.
    """

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, pad_id: int,
                 micro_batch_size: int = 8, mini_batches: int = 1, epochs: int = 1, micro_batch_tokens: int = 0,
                 max_grad_norm: float = 1.0, temperature: float = 1.0, loss_fn: LossFn = ppo_clip_loss,
                 loss_kwargs: dict | None = None, ref_model: Any = None,
                 skip_zero_advantage: bool = True, seed: int = 0, loss_agg: str = "token-mean",
                 recompute_old_logprobs: bool = False, compute_dtype: torch.dtype | None = None,
                 share_prefix: bool = True, min_shared_prefix: int = 32,
                 scheduler: Any = None, packing: bool = False) -> None:
        if loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
        self.model = model
        self.optimizer = optimizer
        self.pad_id = pad_id
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = max(0, int(micro_batch_tokens))
        self.mini_batches = mini_batches
        self.epochs = epochs
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.loss_fn = loss_fn
        self.loss_kwargs = dict(loss_kwargs or {})
        self.ref_model = ref_model
        self.skip_zero_advantage = skip_zero_advantage and not self.loss_kwargs.get("kl_coef")
        self.loss_agg = loss_agg
        self.recompute_old_logprobs = recompute_old_logprobs
        self.compute_dtype = compute_dtype or torch.float32
        self.share_prefix = share_prefix
        self.scheduler = scheduler
        self.min_shared_prefix = max(1, int(min_shared_prefix))
        self.packing = bool(packing)
        self.rng = random.Random(seed)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def batch(self, samples: Sequence[TokenSample], weights: Sequence[float] | None = None) -> dict:
        """The model inputs and loss tensors of one micro-batch: :func:`~crl_bench.trainer.packing.pack_batch`
        with ``packing``, else :func:`build_batch` (on this updater's device)."""
        if self.packing:
            return pack_batch(samples, self.pad_id, self.device, weights)
        return build_batch(samples, self.pad_id, self.device, weights)

    def _logprobs(self, model: Any, batch: dict) -> torch.Tensor:
        """:func:`sequence_logprobs` (or, for a packed batch, :func:`~crl_bench.trainer.packing.packed_logprobs`)
        in the compute dtype (float32 result)."""
        if batch.get("packed"):
            return packed_logprobs(model, batch, self.temperature, self.compute_dtype)
        return sequence_logprobs(model, batch, self.temperature, self.compute_dtype)

    def _ref_logprobs(self, batch: dict) -> torch.Tensor | None:
        if self.ref_model is None or not self.loss_kwargs.get("kl_coef"):
            return None
        with torch.no_grad():
            if callable(self.ref_model) and not isinstance(self.ref_model, torch.nn.Module):
                with self.ref_model():
                    return self._logprobs(self.model, batch)
            return self._logprobs(self.ref_model, batch)

    def _trains(self, s: TokenSample) -> bool:
        return not (self.skip_zero_advantage and s.advantage == 0.0)

    def _recompute(self, samples: list[TokenSample]) -> tuple[list[TokenSample], dict[str, float]]:
        """``samples`` with the old log-probs of the trained ones recomputed, and the drift statistics."""
        out = list(samples)
        idx = [i for i, s in enumerate(samples) if self._trains(s)]
        diffs: list[torch.Tensor] = []
        with torch.no_grad():
            for part in self.chunks(samples, idx):
                batch = self.batch([samples[i] for i in part])
                lp = self._logprobs(self.model, batch).float().cpu()
                for row, i in enumerate(part):
                    out[i], d = recomputed(samples[i], response_logprobs(lp, batch, row, len(samples[i].response_ids)))
                    diffs.append(d)
        if not diffs:
            return out, {}
        return out, self._drift(torch.cat(diffs))

    @staticmethod
    def length(s: TokenSample) -> int:
        """Tokens of a sample's sequence (prompt and response)."""
        return len(s.prompt_ids) + len(s.response_ids)

    def split(self, lengths: Sequence[int]) -> list[range]:
        """Items of token ``lengths`` split into micro-batches: :func:`micro_chunks` (padded rows), or
        :func:`~crl_bench.trainer.packing.packed_chunks` with ``packing`` (the token bound counts the packed
        rows: real tokens and their few trailing pads)."""
        chunk = packed_chunks if self.packing else micro_chunks
        return chunk(lengths, self.micro_batch_size, self.micro_batch_tokens)

    def chunks(self, samples: Sequence[TokenSample], idx: Sequence[int]) -> list[list[int]]:
        """``idx`` (indices into ``samples``) split into micro-batches (:meth:`split`)."""
        return [list(idx[r.start:r.stop]) for r in self.split([self.length(samples[i]) for i in idx])]

    @staticmethod
    def _drift(d: torch.Tensor) -> dict[str, float]:
        """Sampler-vs-trainer statistics of per-token log-prob differences ``d`` (recomputed minus
        behaviour)."""
        ratio = torch.exp(d)
        return {"behaviour_logprob_abs_diff": float(d.abs().mean()),
                "behaviour_ratio_std": float(ratio.std(unbiased=False)),
                "behaviour_ratio_min": float(ratio.min()), "behaviour_ratio_max": float(ratio.max())}

    def refresh_model(self) -> None:
        """Make :attr:`model` hold the latest trained weights: a no-op here (this updater trains it in place);
        :class:`~crl_bench.trainer.data_parallel.DataParallelUpdater` fetches its ranks' weights where they went
        straight to the engine (``devices.weight_sync: direct``)."""

    def sharing(self) -> bool:
        """Whether micro-batches compute the prompt prefix they share once (``share_prefix``; not with
        a KL term or activation checkpointing)."""
        return self.share_prefix and not self.loss_kwargs.get("kl_coef") and not _checkpointing(self.model)

    def plan(self, samples: Sequence[TokenSample]) -> list[list[tuple[tuple[tuple[int, float], ...], int]]]:
        """The optimiser steps of one update over ``samples``: for each step its micro-batches, each
        ``(((sample index, token weight), ...), shared prefix length)`` (0: no shared-prefix forward).

        Sequences (an episode's turns) are the unit of shuffling (this updater's generator, one shuffle
        per epoch: the generator advances) and of mini-batching; token weights
        (:func:`token_weights`) are computed over the whole mini-batch; samples without a learning signal
        are left out; with :meth:`sharing` the step's samples are sorted by prompt (the order of
        micro-batches within one optimiser step is free) and a micro-batch whose samples share at least
        ``min_shared_prefix`` prompt tokens (each keeps one: its logits predict the first response
        token) computes them once.  :class:`~crl_bench.trainer.data_parallel.DataParallelUpdater`
        deals the same plan out to its workers.
        """
        units: dict[Hashable, list[int]] = {}
        for i, s in enumerate(samples):
            units.setdefault(s.sequence if s.sequence is not None else ("sample", i), []).append(i)
        unit_list = list(units.values())
        sharing = self.sharing()
        steps = []
        for _ in range(self.epochs):
            order = unit_list[:]
            self.rng.shuffle(order)
            size = math.ceil(len(order) / self.mini_batches) if order else 0
            for m in range(self.mini_batches):
                chunk = [i for u in order[m * size:(m + 1) * size] for i in u]
                if not chunk:
                    continue
                weights = token_weights([samples[i] for i in chunk], self.loss_agg)
                work = [(i, w) for i, w in zip(chunk, weights) if self._trains(samples[i])]
                if not work:
                    continue
                if sharing:
                    work.sort(key=lambda iw: samples[iw[0]].prompt_ids)
                micros = []
                for rng in self.split([self.length(samples[i]) for i, _ in work]):
                    micro = tuple(work[rng.start:rng.stop])
                    ss = [samples[i] for i, _ in micro]
                    shared = min(common_prefix_length(ss), min(len(s.prompt_ids) for s in ss) - 1) if sharing else 0
                    micros.append((micro, shared if shared >= self.min_shared_prefix else 0))
                steps.append(micros)
        return steps

    def micro_backward(self, samples: Sequence[TokenSample], weights: Sequence[float], shared: int,
                       fold: bool) -> dict[str, Any]:
        """Forward and backward of one micro-batch (gradients accumulate in the parameters).

        Args:
            samples: its samples; ``weights``: their token weights (from :meth:`plan`).
            shared: prompt tokens all samples share and compute once (0: the plain forward, padded or
                packed, and the KL reference when there is one).
            fold: the batch's old log-probs are the training forward's (one optimiser step per update
                with ``recompute_old_logprobs``): use them and return their differences.

        Returns:
            ``loss`` (this micro-batch's partial sum of the step loss), ``stats`` (the loss function's),
            ``tokens`` and ``samples`` trained, ``shared_tokens`` (prompt tokens not recomputed),
            ``input_tokens`` (tokens put through the forward, padding excluded, a shared prefix once),
            ``forward_tokens`` (the same with padding included) and ``diffs`` (recomputed minus behaviour
            log-probs of its response tokens, or ``None``).
        """
        samples = list(samples)
        if shared:
            lp, batch = shared_prefix_logprobs(self.model, samples, shared, self.pad_id, self.temperature,
                                               self.compute_dtype, self.device, list(weights))
            ref = None
        else:
            batch = self.batch(samples, list(weights))
            ref = self._ref_logprobs(batch)
            lp = self._logprobs(self.model, batch)
        old_lp = batch["old_logprobs"]
        diffs = None
        if fold:
            mask = batch["mask"].bool()
            diffs = (lp.detach() - old_lp)[mask].float().cpu()
            old_lp = lp.detach()
        kwargs = dict(self.loss_kwargs)
        if ref is not None:
            kwargs["ref_logprobs"] = ref
        elif "kl_coef" in kwargs:
            kwargs.pop("kl_coef")
        loss, stats = self.loss_fn(lp, old_lp, batch["advantages"], batch["mask"],
                                   token_weights=batch["token_weights"], **kwargs)
        loss.backward()
        return {"loss": float(loss.detach()), "stats": stats, "tokens": int(batch["mask"].sum()),
                "samples": len(samples), "shared_tokens": shared * (len(samples) - 1) if shared else 0,
                "input_tokens": batch["real_tokens"] + shared, "forward_tokens": batch["forward_tokens"] + shared,
                "diffs": diffs}

    def update(self, samples: Sequence[TokenSample]) -> dict[str, float]:
        """Optimise on ``samples``; returns mean loss statistics over micro-batches.

        Returns a dict with ``loss``, ``grad_norm`` (pre-clip, last optimiser step), ``clip_frac``,
        ``ratio_mean``, ``approx_kl``, ``kl``, ``optimizer_steps``, ``trained_tokens``,
        ``trained_samples``, ``shared_prefix_tokens`` (prompt tokens not recomputed thanks to
        ``share_prefix``), ``update_input_tokens`` (tokens put through the training forwards, padding
        excluded), ``update_forward_tokens`` (the same, padding included: what the forwards cost) and
        ``update_tokens_per_trained`` (their ratio to ``trained_tokens``: about 1 + the
        environment's share when each episode is one sequence, far more when every turn repeats the
        episode's history) and, with ``recompute_old_logprobs``, ``behaviour_logprob_abs_diff`` and
        ``behaviour_ratio_std`` / ``_min`` / ``_max``.  With no sample carrying a learning signal it
        returns zeros and makes no optimiser step.
        """
        acc = UpdateStats()
        grad_norm = 0.0
        lr = float(self.optimizer.param_groups[0]["lr"])
        steps = 0
        samples = list(samples)
        drift: dict[str, float] = {}
        # with one optimiser step over the batch the recomputed old log-probs are exactly the ones the
        # training forward computes before that step, so they are taken from it (detached) instead of
        # a separate no-gradient pass over the same samples
        fold = self.recompute_old_logprobs and self.epochs == 1 and self.mini_batches == 1
        if self.recompute_old_logprobs and not fold and any(self._trains(s) for s in samples):
            self.model.eval()
            samples, drift = self._recompute(samples)
        self.model.train()
        for micros in self.plan(samples):
            self.optimizer.zero_grad(set_to_none=True)
            for micro, shared in micros:
                acc.add(self.micro_backward([samples[i] for i, _ in micro], [w for _, w in micro], shared, fold))
            params = [p for p in self.model.parameters() if p.requires_grad]
            if self.max_grad_norm > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
            else:
                grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in params
                                                          if p.grad is not None])))
            lr = float(self.optimizer.param_groups[0]["lr"])
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            steps += 1
        # the gradients are not needed until the next update's first backward: free them (one float32
        # copy of the trainable weights, ~0.54 GB for the default model) instead of keeping them resident
        self.optimizer.zero_grad(set_to_none=True)
        return acc.result(steps, grad_norm, lr, drift)
