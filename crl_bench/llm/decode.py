"""The transformers engine's own decode loop: one prefill forward, then one forward per token.

:func:`decode` replaces ``model.generate`` in :class:`~crl_bench.llm.hf_engine.HFEngine` and gives the
same replies at temperature 0 (tests/llm/test_decode.py compares them; in bf16 the attention's
rounding differs from torch's kernel in the last bit, so a near-tie may resolve differently).  What it saves on a CPU
(docs/performance.md, "Decode loop"):

* the key/value cache is one pre-allocated tensor per layer (:class:`BufferCache`), written in place
  at each step, instead of ``DynamicCache``'s concatenation, which copies the whole cache of every
  layer at every step;
* log-prob, entropy and sampling entropy are computed per step from that step's logits, so no
  ``(steps, B, V)`` stacks of logits and processed scores are kept;
* the allowed-reply mask follows each row's node in its token trie instead of walking the trie from the
  root over all generated tokens at every step;
* rows that finished (EOS or a stop string) leave the batch (``drop_finished``), so they stop costing
  forwards;
* the prompt tokens not covered by a reused prefix are computed in groups of rows with similar
  counts (``group_prefill``, :func:`prefill_groups`) instead of one forward padding every row to the
  longest: in a rollout's later turns most rows reuse all but a few tokens while a few start afresh,
  and one padded forward computed 64 rows x the longest new part;
* attention of the few new tokens per row over the cache is two batched products per key/value head
  (:func:`short_query_attention`) instead of torch's CPU ``scaled_dot_product_attention``, which was
  most of a bf16 decode step.

Sampling uses transformers' own warpers (temperature, top-k, top-p, in ``generate``'s order) and
``torch.multinomial`` over the softmax of the processed scores, as ``generate`` does, and each step
draws for the whole batch, rows that left it included (:func:`_sample`), so with the same torch seed,
batch and logits the samples are those of ``generate``: a seeded run samples what it sampled with
``generate``, however early its rows finish.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = ["ATTENTION", "BufferCache", "Decoded", "decode", "decode_attention", "prefill_groups",
           "short_query_attention"]

#: the attention implementation name :func:`decode` runs the model with (registered below)
ATTENTION = "crl_short_query"
#: longest query (new tokens per row) computed by :func:`short_query_attention`'s grouped products
SHORT_QUERY = 16
#: a prefill forward's fixed cost in prefill tokens, for :func:`prefill_groups`: on the 2-core CPUs
#: measured, a forward of the 135M model costs ~70 ms beyond its tokens (decode steps of 8 and 64 rows:
#: 123 and 504 ms), about 64 tokens of a large prefill (~1 ms a token; docs/performance.md, "Roofline")
PREFILL_FORWARD_TOKENS = 64


def short_query_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention for a few new tokens per row over a long cache, as two batched matrix products.

    On the CPU, torch's ``scaled_dot_product_attention`` in bf16 took ~15 ms per layer for one new token
    of 64 rows over a 240-token cache (2-core AMD EPYC, one thread) against ~1.6 ms for the same
    products grouped by key/value head: with SmolLM2's 30 layers that was most of a decode step.
    Queries ``(B, Hq, q, D)`` with ``q <= SHORT_QUERY`` and a mask (or ``q == 1``) are computed here: the
    ``Hq / Hkv`` query heads sharing a key/value head ``(B, Hkv, L, D)`` form one product, scores and
    softmax in float32, the mask (boolean, True = attend, or additive; shape ``(B, 1, q, L)``, as
    transformers' sdpa mask) applied; anything else goes to transformers' ``sdpa_attention_forward``.

    Returns:
        ``(output (B, q, Hq, D), None)``, as transformers' attention functions.
    """
    b, hq, q, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    if (q > SHORT_QUERY or (q > 1 and attention_mask is None) or dropout or hq % hkv
            or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    g = hq // hkv
    scale = scaling if scaling is not None else d ** -0.5
    # both products in float32: a bf16 product rounds its scores to 8 bits of mantissa (~0.1 at the
    # scores' scale, log-probs off by up to ~0.2 nats), and on the CPUs measured the float32 products
    # of these small shapes were also faster than bf16 ones (docs/performance.md, "Decode loop")
    qg = query.reshape(b, hkv, g * q, d).float()
    scores = torch.matmul(qg, key.float().transpose(-1, -2)).mul_(scale).view(b, hkv, g, q, length)
    if attention_mask is not None:
        m = attention_mask[:, :, -q:, -length:].unsqueeze(1)          # (B, 1, 1, q, L)
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
    # a query with every key masked (a left-padding position) gets a zero output instead of NaN, which
    # would reach the other rows' products through its values (0 x NaN)
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0).view(b, hkv, g * q, length)
    out = torch.matmul(probs, value.float()).view(b, hq, q, d)
    return out.transpose(1, 2).to(value.dtype).contiguous(), None


ALL_ATTENTION_FUNCTIONS.register(ATTENTION, short_query_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


@contextlib.contextmanager
def decode_attention(model: Any) -> Iterator[None]:
    """Within the block, ``model`` computes attention with :func:`short_query_attention` (its
    ``config._attn_implementation`` set to :data:`ATTENTION`, the previous value restored at exit);
    a model whose attention is not ``sdpa`` is left as it is."""
    config = getattr(model, "config", None)
    switch = config is not None and getattr(config, "_attn_implementation", None) == "sdpa"
    if switch:
        config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        if switch:
            config._attn_implementation = "sdpa"


class _BufferLayer(DynamicLayer):
    """One layer's keys and values in a pre-allocated ``(B, H, capacity, D)`` buffer; ``keys``/``values``
    are views of the filled part ``[:, :, :n]``, as ``DynamicLayer`` would hold them."""

    def __init__(self, capacity: int, prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        self.n = 0
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        if prefix is not None:
            self._allocate(prefix[0])
            n = prefix[0].shape[-2]
            self.kbuf[:, :, :n] = prefix[0]
            self.vbuf[:, :, :n] = prefix[1]
            self._set(n)

    def _allocate(self, like: torch.Tensor) -> None:
        b, h, _, d = like.shape
        self.kbuf = like.new_zeros((b, h, self.capacity, d))
        self.vbuf = like.new_zeros((b, h, self.capacity, d))
        self.dtype, self.device = like.dtype, like.device
        self.is_initialized = True

    def _set(self, n: int) -> None:
        self.n = n
        self.keys = self.kbuf[:, :, :n]
        self.values = self.vbuf[:, :, :n]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self._allocate(key_states)
        n, q = self.n, key_states.shape[-2]
        if n + q > self.capacity:
            raise RuntimeError(f"key/value buffer full: {n} + {q} tokens > capacity {self.capacity}")
        self.kbuf[:, :, n:n + q] = key_states
        self.vbuf[:, :, n:n + q] = value_states
        self._set(n + q)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (a 1-D index tensor), in that order."""
        if self.kbuf is not None:
            self.kbuf = self.kbuf.index_select(0, rows)
            self.vbuf = self.vbuf.index_select(0, rows)
            self._set(self.n)


class BufferCache(DynamicCache):
    """A key/value cache of pre-allocated per-layer buffers: ``capacity`` positions per row, filled in
    place (no per-step concatenation).  ``prefix``: per layer keys and values ``(B, H, P, D)`` already
    computed (a reused prompt prefix), or ``None`` for an empty cache of ``num_layers`` layers.

    Raises:
        RuntimeError: a forward writes past ``capacity``.
    """

    def __init__(self, capacity: int, num_layers: int,
                 prefix: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        if prefix is not None:
            layers = [_BufferLayer(capacity, (k, v)) for k, v in prefix]
        else:
            layers = [_BufferLayer(capacity) for _ in range(num_layers)]
        super(DynamicCache, self).__init__(layers=layers)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (1-D index tensor) in every layer."""
        for layer in self.layers:
            layer.keep(rows)


@dataclass
class Decoded:
    """What :func:`decode` returns for a batch of ``B`` rows.

    Attributes:
        tokens: per row, the generated token ids up to and including the one that finished it (EOS or
            the end of a stop string), or ``budget`` tokens.
        logprobs, entropy, sampling_entropy: per row and generated token (same lengths as ``tokens``):
            the token's log-prob under the unprocessed logits at temperature (temperature 1 when
            greedy), that distribution's entropy (nats), and the entropy of the distribution it was
            drawn from (allowed-reply mask, temperature, top-k/top-p applied).
        kv: with ``keep_kv``, per row ``(layers, fed)``: per layer keys and values ``(H, L, D)`` of the
            row's cache columns (``L = width + fed``) and ``fed``, the generated tokens fed to the model
            (all but the last generated token, or fewer when the row left the batch earlier).
        steps: forwards after the prefill.
        prefill_positions: token positions the prefill forwards computed, padding included.
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    entropy: list[list[float]]
    sampling_entropy: list[list[float]]
    kv: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], int]] | None
    steps: int
    prefill_positions: int = 0


def _warpers(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """The sampling warpers ``generate(do_sample=True, temperature=, top_k=, top_p=)`` applies, in its
    order (transformers ``GenerationMixin._get_logits_processor``)."""
    out = LogitsProcessorList()
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return out


def decode(model: Any, ids: torch.Tensor, att: torch.Tensor, prefix: list[tuple[torch.Tensor, torch.Tensor]] | None,
           width_p: int, *, budget: int, eos: int, pad: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
           tries: Sequence[Any | None] | None = None,
           stop: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
           yield_point: Callable[[], None] | None = None, drop_finished: bool = True,
           keep_kv: bool = False, group_prefill: bool = True) -> Decoded:
    """Generate up to ``budget`` tokens per row of a laid-out batch.

    Args:
        model: a transformers causal LM (eval mode).
        ids, att: ``(B, W)`` token ids and attention mask; the first ``width_p`` columns are covered by
            ``prefix`` (left padding + cached prefix, see ``HFEngine._layout``), the rest is prefilled.
        prefix: per layer keys and values ``(B, H, width_p, D)``, or ``None`` (``width_p == 0``).
        budget: the most tokens generated per row.
        eos, pad: end-of-sequence id (finishes a row) and the id a finished row is fed while kept.
        temperature: ``<= 0`` greedy (argmax of the masked logits), else sampling with ``top_k``
            (0: off) and ``top_p`` as transformers' warpers.
        tries: per row the root of its allowed-reply token trie (``HFEngine``'s ``_Trie``), or ``None``
            (free row); a row at a trie leaf, or off the trie, may only produce ``eos``.
        stop: a stopping criterion called as ``stop(ids_so_far, scores)`` with ``ids_so_far`` the
            ``(b, W + t)`` ids of the rows in the batch; returns ``(b,)`` bool (a
            ``transformers.StopStringCriteria``).
        yield_point: called after every generated token (a background engine's
            ``ComputeGate.yield_point``).
        drop_finished: rows that finished leave the batch (their cache rows are dropped) instead of
            being fed ``pad`` to the end.
        keep_kv: return each row's cache (:attr:`Decoded.kv`).
        group_prefill: compute the columns after ``width_p`` in groups of rows (:func:`prefill_groups`
            over each row's count of unpadded tokens there), each group's forward only over the columns
            its rows use, into the one cache, so every row still ends at column ``W`` and the decode
            steps, their sampling draws included, are those of one padded forward; ``False``: one
            forward over all rows and columns.

    Returns:
        :class:`Decoded`.
    """
    with torch.no_grad(), decode_attention(model):
        return _decode(model, ids, att, prefix, width_p, budget=budget, eos=eos, pad=pad, temperature=temperature,
                       top_k=top_k, top_p=top_p, tries=tries, stop=stop, yield_point=yield_point,
                       drop_finished=drop_finished, keep_kv=keep_kv, group_prefill=group_prefill)


def prefill_groups(lengths: Sequence[int], overhead: int = PREFILL_FORWARD_TOKENS) -> list[list[int]]:
    """Split rows into prefill forwards that compute the fewest tokens.

    A forward over rows ``G`` computes ``len(G) x max(lengths[G])`` tokens (each row left-padded to the
    group's longest) plus a fixed ``overhead`` (tokens).  Groups are runs of the rows sorted by length
    (some optimal split always is: swapping a shorter row of a wider group with a longer row of a narrower
    one never raises the cost), found by dynamic programming over the sorted lengths, ``O(B^2)``.

    Args:
        lengths: per row, the tokens it needs computed (``>= 1``).
        overhead: a forward's fixed cost in tokens.

    Returns:
        the groups, each a list of row indices, the group of the longest rows first.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0] + [None] * n                             # best[j]: least cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(j):
            c = best[i] + (j - i) * longest + overhead
            if best[j] is None or c < best[j]:
                best[j], cut[j] = c, i
    groups = []
    j = n
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups


def _prefill(model: Any, ids: torch.Tensor, att: torch.Tensor, pos: torch.Tensor, width_p: int, cache: BufferCache,
             group: bool) -> tuple[torch.Tensor, int]:
    """Fill ``cache`` (holding columns ``[0, width_p)``) with the batch's columns ``[width_p, W)``; returns the last
    column's logits ``(B, V)`` in float32 and the positions computed (padding included).  With ``group``, rows go
    in :func:`prefill_groups` forwards, each over the columns ``[W - L, W)`` its rows need (``L`` the group's
    longest count of unpadded tokens), its cache built from the batch cache's first ``W - L`` columns of its rows
    (prefix and masked padding) and copied back."""
    bsz, width = ids.shape
    counts = att[:, width_p:].sum(-1).tolist()          # each row's unpadded tokens after width_p
    uneven = group and min(counts) != max(counts)
    groups = prefill_groups(counts) if uneven else [list(range(bsz))]
    if len(groups) == 1:
        out = model(input_ids=ids[:, width_p:], attention_mask=att, position_ids=pos[:, width_p:],
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float(), bsz * (width - width_p)
    dev = ids.device
    logits = None
    positions = 0
    for rows in groups:
        idx = torch.tensor(rows, device=dev)
        start = width - max(counts[i] for i in rows)
        head = None
        if start:
            head = [(layer.kbuf[:, :, :start].index_select(0, idx), layer.vbuf[:, :, :start].index_select(0, idx))
                    for layer in cache.layers]
        sub = BufferCache(width, len(cache.layers), head)
        positions += len(rows) * (width - start)
        out = model(input_ids=ids[idx, start:], attention_mask=att[idx], position_ids=pos[idx, start:],
                    past_key_values=sub, use_cache=True, logits_to_keep=1)
        last = out.logits[:, -1].float()
        out = None
        if logits is None:
            logits = last.new_empty((bsz, last.shape[-1]))
        logits[idx] = last
        for big, small in zip(cache.layers, sub.layers):
            if big.kbuf is None:                        # no reused prefix: the first group sizes the buffers
                big._allocate(small.kbuf[:1].expand(bsz, -1, -1, -1))
            big.kbuf[idx, :, start:width] = small.kbuf[:, :, start:width]
            big.vbuf[idx, :, start:width] = small.vbuf[:, :, start:width]
    for layer in cache.layers:
        layer._set(width)
    return logits, positions


def _decode(model: Any, ids: torch.Tensor, att: torch.Tensor, prefix: Any, width_p: int, *, budget: int, eos: int,
            pad: int, temperature: float, top_k: int, top_p: float, tries: Any, stop: Any, yield_point: Any,
            drop_finished: bool, keep_kv: bool, group_prefill: bool) -> Decoded:
    bsz, width = ids.shape
    dev = ids.device
    greedy = temperature <= 0
    temp = temperature if temperature > 0 else 1.0
    warp = _warpers(temperature, top_k, top_p) if not greedy else LogitsProcessorList()
    tries = list(tries) if tries is not None else [None] * bsz
    nodes = list(tries)                                 # each row's current trie node (None: free row)
    constrained = [i for i, t in enumerate(tries) if t is not None]
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    cache = BufferCache(width + budget, cfg.num_hidden_layers, prefix if width_p else None)
    seq = torch.full((bsz, width + budget), pad, dtype=torch.long, device=dev)
    seq[:, :width] = ids
    mask = torch.zeros((bsz, width + budget), dtype=att.dtype, device=dev)
    mask[:, :width] = att
    pos = (att.long().cumsum(-1) - 1).masked_fill(att == 0, 0)
    logits, positions = _prefill(model, ids, att, pos, width_p, cache, group_prefill)    # (B, V) unprocessed
    last_pos = pos[:, -1:]
    live = list(range(bsz))
    toks: list[list[int]] = [[] for _ in range(bsz)]
    stats: list[list[list[float]]] = [[[] for _ in range(bsz)] for _ in range(3)]
    finished = [False] * bsz
    kv: list[Any] = [None] * bsz
    steps = 0
    for t in range(budget):
        scores = logits
        if constrained:
            allowed = torch.zeros(scores.shape, dtype=torch.bool, device=dev)
            any_row = False
            for b, g in enumerate(live):
                if tries[g] is None:
                    continue
                node = nodes[g]
                allowed[b, list(node.children) if node is not None and node.children else [eos]] = True
                any_row = True
            if any_row:
                sel = torch.tensor([b for b, g in enumerate(live) if tries[g] is not None], device=dev)
                scores = scores.clone()
                scores[sel] = scores[sel].masked_fill(~allowed[sel], float("-inf"))
        scores = warp(seq[:, :width + t], scores) if len(warp) else scores
        if greedy:
            nxt = torch.argmax(scores, dim=-1)
        else:
            nxt = _sample(torch.softmax(scores, dim=-1), live, bsz, pad)
        done = [finished[g] for g in live]
        if any(done):                                   # kept finished rows are fed pad, as generate does
            nxt = nxt.masked_fill(torch.tensor(done, device=dev), pad)
        logp = torch.log_softmax(logits / temp, dim=-1)
        lp = logp.gather(-1, nxt[:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        slogp = torch.log_softmax(scores, dim=-1)
        sent = -(slogp.exp() * slogp).nan_to_num(0.0).sum(-1)
        seq[:, width + t] = nxt
        mask[:, width + t] = 1
        stopped = (nxt == eos)
        if stop is not None:
            stopped = stopped | stop(seq[:, :width + t + 1], scores).to(dev)
        nxt_l, lp_l, ent_l, sent_l, stop_l = (x.tolist() for x in (nxt, lp, ent, sent, stopped))
        for b, g in enumerate(live):
            if finished[g]:
                continue
            toks[g].append(nxt_l[b])
            stats[0][g].append(lp_l[b])
            stats[1][g].append(ent_l[b])
            stats[2][g].append(sent_l[b])
            if tries[g] is not None and nodes[g] is not None:
                nodes[g] = nodes[g].children.get(nxt_l[b])
            if stop_l[b]:
                finished[g] = True
        if yield_point is not None:
            yield_point()
        if all(finished[g] for g in live) or t + 1 == budget:
            break
        if drop_finished and any(finished[g] for g in live):
            keep = [b for b, g in enumerate(live) if not finished[g]]
            if keep_kv:
                for b, g in enumerate(live):
                    if finished[g]:
                        kv[g] = (_row_kv(cache, b), t)
            idx = torch.tensor(keep, device=dev)
            cache.keep(idx)
            seq, mask, last_pos = seq[idx], mask[idx], last_pos[idx]
            nxt = nxt[idx]
            live = [live[b] for b in keep]
        last_pos = last_pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask[:, :width + t + 1], position_ids=last_pos,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float()              # (b, V) unprocessed
        out = None
        steps += 1
    if keep_kv:
        fed = cache.get_seq_length() - width
        for b, g in enumerate(live):
            kv[g] = (_row_kv(cache, b), fed)
    return Decoded(toks, stats[0], stats[1], stats[2], kv if keep_kv else None, steps, positions)


def _sample(probs: torch.Tensor, live: list[int], bsz: int, pad: int) -> torch.Tensor:
    """One token per live row from ``probs`` ``(len(live), V)``, drawn as ``generate`` draws it for
    that row of the full ``bsz``-row batch.

    ``torch.multinomial`` of one sample takes ``argmax(p / q)`` with ``q`` exponential draws of the
    whole ``(B, V)`` tensor (aten/src/ATen/native/Distributions.cpp, ``multinomial``), so the random
    stream a step consumes depends on the batch's shape, not on its values.  Rows that left the batch
    get a stand-in distribution (all mass on ``pad``) in a full-size draw: each live row then gets the
    random numbers, and so the token, that ``generate`` (which keeps finished rows) gives it from the
    same seed, and the steps after consume the stream as ``generate`` does.  Without this, the first
    row to finish would change every later sample of a seeded run."""
    if len(live) == bsz:
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    full = probs.new_zeros((bsz, probs.shape[-1]))
    full[:, pad] = 1.0
    rows = torch.tensor(live, device=probs.device)
    full[rows] = probs
    return torch.multinomial(full, num_samples=1).squeeze(1).index_select(0, rows)


def _row_kv(cache: BufferCache, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row ``b``'s filled cache, per layer keys and values ``(H, L, D)`` (views)."""
    return [(layer.keys[b], layer.values[b]) for layer in cache.layers]
