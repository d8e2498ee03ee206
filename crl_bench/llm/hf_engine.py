"""Batched generation with transformers (the default engine; CPU or GPU).

The engine samples from the trainer's model (or a low-precision copy of its weights, refreshed after
each update).  Prompts are left-padded into micro-batches sorted by length, with cached key/value
prefixes reused (:class:`PrefixStore`); each reply's token ids and per-token log-probs come back
without padding.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StoppingCriteriaList, StopStringCriteria

from crl_bench.llm.base import Generation, SamplingParams
from crl_bench.llm.decode import decode
from crl_bench.llm.gate import ComputeGate, YieldToForeground
from crl_bench.llm.precision import DTYPES as _DTYPES
from crl_bench.llm.precision import cast_parameters


def adapter_base_model(adapter_dir: str | Path) -> str:
    """The base model of a peft adapter folder, as something ``from_pretrained`` loads.

    Reads ``base_model_name_or_path`` from ``adapter_dir/adapter_config.json``.  The default model is
    recognised by its alias or by its converted-checkpoint path (``.../models/smollm2-135m-instruct``,
    even when that path belongs to another machine or another ``CRL_BENCH_CACHE``) and resolved to
    this machine's converted checkpoint (converted first if needed); any other value is returned as is.

    Raises:
        FileNotFoundError: ``adapter_config.json`` is missing.
        ValueError: the adapter config names no base model.
        ModelNotAvailable: the default model is needed and its package is missing.
    """
    from crl_bench.llm.default_model import ALIASES, DEFAULT_MODEL, default_model_dir, resolve_model

    cfg_path = Path(adapter_dir) / "adapter_config.json"
    base = json.loads(cfg_path.read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{cfg_path}: base_model_name_or_path is empty; cannot tell which model the "
                         "adapter belongs to")
    base_path = Path(base)
    if (base in ALIASES or base_path == default_model_dir()
            or (base_path.name == DEFAULT_MODEL and base_path.parent.name == "models"
                and not (base_path / "config.json").is_file())):
        return resolve_model(DEFAULT_MODEL)
    return resolve_model(base)


def _first_line(e: BaseException) -> str:
    """``Type: first line of the message`` of a loader's exception, at most 300 characters."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


def load_tokenizer(name: str) -> Any:
    """The tokenizer :func:`load_model_and_tokenizer` returns for ``name``, without the model's weights
    (a case bank measures its cases with the actor's tokenizer and loads no model).

    Raises:
        ModelNotAvailable: as :func:`load_model_and_tokenizer`.
        ValueError: the tokenizer has no chat template.
    """
    from transformers import AutoTokenizer

    from crl_bench.llm.default_model import ModelNotAvailable, resolve_model

    path = resolve_model(name)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - no such hub id, offline, no tokenizer, a malformed config or file
        raise ModelNotAvailable(f"cannot load model {name!r}: {_first_line(e)}") from None
    if not tok.chat_template:
        raise ValueError(f"tokenizer of {name!r} has no chat template; crl-bench builds chat prompts")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_architecture(name: str) -> Any:
    """Model ``name``'s architecture without its weights (parameters on torch's ``meta`` device: no memory,
    no file read but the config), for an actor whose replies come from elsewhere (an OpenAI-compatible
    server, ``generation.engine: openai``): what reads the model's config (its context window) works,
    nothing can run it.

    Raises:
        ModelNotAvailable: as :func:`load_model_and_tokenizer`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from crl_bench.llm.default_model import ModelNotAvailable, resolve_model

    path = resolve_model(name)
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as e:
        raise ModelNotAvailable(f"cannot read the config of model {name!r}: {e}") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def load_model_and_tokenizer(name: str, dtype: str = "float32", device: str | None = None):
    """Load a causal LM and its tokenizer; the default alias is converted from its GGUF once.

    A folder holding a peft adapter (``adapter_config.json``, as ``Trainer.save_checkpoint`` writes
    for a LoRA run) is loaded as: its base model (:func:`adapter_base_model`), the adapter on top
    (``peft.PeftModel.from_pretrained``), merged into the weights (``merge_and_unload``), so a plain
    ``PreTrainedModel`` comes back; the tokenizer is the folder's own.

    Args:
        name: ``--model`` value (see :func:`crl_bench.llm.default_model.resolve_model`), or an adapter
            folder.
        dtype: dtype of the loaded weights: ``float32`` | ``bfloat16`` | ``float16`` | ``auto``
            (:func:`crl_bench.llm.precision.resolve_dtype`).  The trainer loads trainable models in
            ``float32`` (master weights) whatever its compute dtype.
        device: torch device; default CUDA when available, else CPU.

    Returns:
        ``(model, tokenizer)``; the tokenizer has a pad token and pads on the left.

    Raises:
        ModelNotAvailable: the default model's package is missing, a model folder does not exist, or
            transformers cannot find the model (a hub id not cached on an offline machine).
        ValueError: unknown dtype, the tokenizer has no chat template, or an adapter config names no
            base model.
    """
    from transformers import AutoModelForCausalLM

    from crl_bench.llm.default_model import ModelNotAvailable, resolve_model
    from crl_bench.llm.precision import resolve_dtype

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(dtype, device)
    path = resolve_model(name)
    adapter = Path(path).is_dir() and (Path(path) / "adapter_config.json").is_file()
    tok = load_tokenizer(name)
    if adapter:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(adapter_base_model(path), dtype=_DTYPES[dtype])
        model = PeftModel.from_pretrained(base, path).merge_and_unload()
        model.requires_grad_(True)   # peft froze the base for inference; return it as from_pretrained would
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - a malformed config.json or weights file: one line, not a traceback
            raise ModelNotAvailable(f"cannot load model {name!r}: {_first_line(e)}") from None
    model.to(device)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def _contiguous_head_input(model: Any) -> None:
    """Make the input of ``model``'s output projection (the LM head) contiguous, once per model.

    ``generate`` calls the model with ``logits_to_keep=1``, so the head sees the strided view
    ``hidden[:, -1:, :]`` of shape ``(B, 1, H)``.  On the CPU, torch's ``matmul`` folds such a 3-D
    input into one ``(B, H) @ (H, V)`` product only when the weight requires grad; for a frozen
    weight (the bf16 generation copy, a static extractor) it broadcasts the weight to ``(B, H, V)``
    for a batched product instead: 7.2 GB for 128 prompts with SmolLM2's 49,152 x 576 head in
    bf16, the peak that had a 200-task evaluation killed for memory.  A contiguous ``(B, 1, H)``
    input always folds, and gives the same logits.  Models without output embeddings are left as
    they are.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or getattr(head, "_crl_contiguous_input", False):
        return

    def contiguous(_module: Any, args: tuple) -> tuple | None:
        if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
            return (args[0].contiguous(), *args[1:])
        return None

    head.register_forward_pre_hook(contiguous)
    head._crl_contiguous_input = True


class _Trie:
    """Token-id prefix tree of the allowed replies of one prompt."""

    __slots__ = ("children", "terminal", "depth")

    def __init__(self) -> None:
        self.children: dict[int, _Trie] = {}
        self.terminal = False
        self.depth = 0          # tokens of the longest reply added (kept on the root)

    def add(self, ids: Sequence[int]) -> None:
        self.depth = max(self.depth, len(ids))
        node = self
        for t in ids:
            node = node.children.setdefault(int(t), _Trie())
        node.terminal = True

    def walk(self, ids: Sequence[int]) -> _Trie | None:
        node: _Trie | None = self
        for t in ids:
            node = node.children.get(int(t)) if node is not None else None
            if node is None:
                return None
        return node


class AllowedRepliesProcessor(LogitsProcessor):
    """Masks logits so that row ``i`` can only spell one of its allowed replies.

    Rows with ``tries[i] is None`` are left untouched.  When a row has completed an allowed reply
    (or left the tree, which cannot happen while this processor runs), only ``eos_id`` stays allowed.
    """

    def __init__(self, tries: list[_Trie | None], prompt_len: int, eos_id: int) -> None:
        self.tries = tries
        self.prompt_len = prompt_len
        self.eos_id = eos_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = [i for i, t in enumerate(self.tries) if t is not None]
        if not rows:
            return scores
        generated = input_ids[:, self.prompt_len:].tolist()
        allowed = torch.zeros_like(scores, dtype=torch.bool)
        for i in rows:
            node = self.tries[i].walk(generated[i])
            allowed[i, list(node.children) if node is not None and node.children else [self.eos_id]] = True
        out = scores.clone()
        out[rows] = out[rows].masked_fill(~allowed[rows], float("-inf"))
        return out


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class _Prefix:
    """One cached prefix: its token ids ``(L,)`` and, per layer, keys and values ``(H, L, D)``."""

    __slots__ = ("tokens", "layers", "nbytes")

    def __init__(self, tokens: np.ndarray, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.tokens = tokens
        self.layers = layers
        self.nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)


class PrefixStore:
    """Key/value caches of token prefixes, least recently used first out, bounded in bytes.

    A prompt reuses the stored prefix that shares the most leading tokens with it; the reused part
    is that common prefix (keys and values at a position depend only on the tokens up to it, so any
    common prefix is exact).  Storing a prefix that extends a stored one replaces it; storing one
    that a stored prefix already extends is a no-op.

    Args:
        max_bytes: memory bound of the stored tensors (bytes); the least recently used prefixes are
            dropped beyond it.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[int, _Prefix] = OrderedDict()
        self._next = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0

    def match(self, ids: np.ndarray, limit: int) -> tuple[_Prefix | None, int]:
        """The stored prefix sharing the most leading tokens with ``ids`` and that count (at most
        ``limit``); ``(None, 0)`` when nothing matches."""
        best, best_n, best_key = None, 0, None
        for key, item in self._items.items():
            if item.tokens[0] != ids[0]:
                continue
            n = min(_lcp(item.tokens, ids), limit)
            if n > best_n:
                best, best_n, best_key = item, n, key
        if best_key is not None:
            self._items.move_to_end(best_key)
        return best, best_n

    def put(self, tokens: np.ndarray, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store ``layers`` (per layer keys and values ``(H, L, D)``) as the cache of ``tokens`` ``(L,)``."""
        if len(tokens) == 0:
            return
        for key, item in list(self._items.items()):
            n = _lcp(item.tokens, tokens)
            if n == len(tokens):                       # already covered by a stored prefix
                self._items.move_to_end(key)
                return
            if n == len(item.tokens):                  # the new prefix extends this one
                self.nbytes -= item.nbytes
                del self._items[key]
        item = _Prefix(tokens, layers)
        if item.nbytes > self.max_bytes:
            return
        self._items[self._next] = item
        self._next += 1
        self.nbytes += item.nbytes
        while self.nbytes > self.max_bytes and self._items:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes


class HFEngine:
    """Generation engine over a transformers causal LM.

    Weights: the engine samples from the trainer's own model; with a ``compute_dtype`` other than
    the model's (float32 master weights, bf16 generation) it keeps a copy of the weights in that
    dtype, refreshed by :meth:`sync_weights` after every update.

    Prefix caching (``prefix_cache``): prompt processing (prefill) dominates generation on a CPU, and
    the prompts of a batch repeat each other: the rollouts of one group start from the same prompt,
    every prompt of an env starts with the same chat template and system prompt, and a
    ``multiturn`` episode's prompt extends its previous turn's prompt and reply.  The engine keeps a
    :class:`PrefixStore` of key/value caches and, for each batch:

    1. finds, for each prompt, the longest stored prefix it starts with;
    2. computes once (batched) each longer head that at least two prompts of the batch share (a
       group's common prompt, an env's system prompt with the retrieved experience) and stores it;
    3. generates with each row laid out as ``left padding + its cached prefix + padding + its own
       new tokens`` (the padding masked; positions follow the attention mask, so they are those of
       the plain left-padded batch), so the prefill covers only the new tokens;
    4. with ``keep_sequences`` (on for ``multiturn`` prompts), stores each row's prompt and reply, so
       the episode's next turn reuses them (per-episode key/value reuse).

    Outputs equal those of the uncached path up to floating-point rounding (tests compare them).
    All cached prefixes are dropped when the weights change.

    Args:
        model: the policy (a ``PreTrainedModel`` or a peft wrapper of one).
        tokenizer: its tokenizer (left padding, pad token set).
        batch_size: prompts per ``generate`` call.
        prefix_cache: reuse cached prompt prefixes (see above).
        min_prefix: shortest prefix (tokens) worth caching or reusing.
        compute_dtype: dtype to generate in (``None``: the model's own).
        keep_sequences: store each row's prompt + reply after generation (multi-turn reuse).
        cache_mb: memory bound of the prefix store (MiB).
        group_heads: compute the heads shared by any two prompts (step 2); ``False`` computes only
            the head common to the whole batch (this engine's behaviour before per-group heads; kept
            for ``crl-bench bench step``'s before/after comparison).
        gate: a :class:`~crl_bench.llm.gate.ComputeGate` shared with other engines of the process.
        background: with ``gate``, generate as background work (in the gaps of the foreground,
            yielding at every decode step and, with ``prefix_cache``, between prompt chunks of
            ``prefill_chunk`` tokens); otherwise generation is foreground work.
        prefill_chunk: tokens per chunk (over the whole batch) of a background engine's prompt
            processing.
        decode_loop: generate with the engine's own decode loop (:func:`crl_bench.llm.decode.decode`:
            pre-allocated key/value buffers, per-step statistics, finished rows dropped); ``False``
            uses transformers' ``model.generate`` (the engine before that loop; same replies at
            temperature 0, kept for ``crl-bench bench rollout --decode`` and the tests).
        drop_finished: with ``decode_loop``, rows that finished leave the batch at once.
        group_prefill: with ``decode_loop``, compute each batch's uncached prompt tokens in groups of rows
            with similar counts instead of padding every row to the longest (``decode``'s ``group_prefill``;
            same replies, fewer tokens computed when a few rows have long new parts).
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 32, prefix_cache: bool = True,
                 min_prefix: int = 32, compute_dtype: torch.dtype | str | None = None,
                 keep_sequences: bool = False, cache_mb: int = 1024, group_heads: bool = True,
                 gate: ComputeGate | None = None, background: bool = False, prefill_chunk: int = 128,
                 decode_loop: bool = True, drop_finished: bool = True, group_prefill: bool = True) -> None:
        self.tokenizer = tokenizer
        self.decode_loop = decode_loop
        self.drop_finished = drop_finished
        self.group_prefill = group_prefill
        self.prefill_chunk = prefill_chunk
        self.gate = gate
        self.background = background
        self.group_heads = group_heads
        self.batch_size = batch_size
        self.prefix_cache = prefix_cache
        self.min_prefix = min_prefix
        self.keep_sequences = keep_sequences
        self.compute_dtype = _DTYPES[compute_dtype] if isinstance(compute_dtype, str) else compute_dtype
        self.store = PrefixStore(int(cache_mb) * 2**20)
        self._stop_criteria: dict[tuple[str, ...], StopStringCriteria] = {}
        # bounded: envs such as ALFWorld have a different admissible set at almost every step
        self._trie_cache: OrderedDict[tuple[str, ...], _Trie] = OrderedDict()
        self.trie_cache_size = 512
        #: prompt tokens seen, served from the prefix store, and computed (prefill), since creation;
        #: ``prefill_positions``: the positions the generation prefills computed, padding included
        self.counters = {"prompt_tokens": 0, "cached_tokens": 0, "prefill_tokens": 0, "head_tokens": 0,
                         "prefill_positions": 0}
        self.model = model
        self._shadow: Any = None
        self.sync_weights(model)

    # ---- weights -----------------------------------------------------------------------------------
    def sync_weights(self, model: Any) -> None:
        """Sample from ``model``'s current weights: refresh the low-precision copy (if any) and drop
        every cached prefix (they belong to the old weights)."""
        self.model = model
        self.store.clear()
        dtype = self.compute_dtype
        params = list(model.parameters())
        if dtype is None or all(p.dtype == dtype for p in params if p.is_floating_point()):
            self._shadow = None
            _contiguous_head_input(model)
            return
        with torch.no_grad():
            if self._shadow is None:
                self._shadow = cast_parameters(copy.deepcopy(model), dtype)   # buffers stay float32
                self._shadow.eval()
                for p in self._shadow.parameters():
                    p.requires_grad_(False)
                _contiguous_head_input(self._shadow)
            else:
                for dst, src in zip(self._shadow.parameters(), params):
                    dst.copy_(src)

    def clear_prefix_cache(self) -> None:
        """Drop every cached prompt prefix (outputs are unchanged; the next prompts are computed in full)."""
        self.store.clear()

    @property
    def generator(self) -> Any:
        """The model generation runs on (the low-precision copy, or the trainer's model)."""
        return self._shadow if self._shadow is not None else self.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def caching(self) -> bool:
        """Whether prefixes are cached (``prefix_cache`` on and a non-zero ``cache_mb``)."""
        return self.prefix_cache and self.store.max_bytes > 0

    def _trie(self, replies: Sequence[str]) -> _Trie:
        key = tuple(replies)
        trie = self._trie_cache.get(key)
        if trie is None:
            trie = _Trie()
            for r in replies:
                trie.add(self.tokenizer.encode(r, add_special_tokens=False))
            self._trie_cache[key] = trie
            if len(self._trie_cache) > self.trie_cache_size:
                self._trie_cache.popitem(last=False)
        else:
            self._trie_cache.move_to_end(key)
        return trie

    # ---- generation --------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 allowed: Sequence[Sequence[str] | None] | None = None) -> list[Generation]:
        """Generate one reply per prompt (see :class:`crl_bench.llm.base.Engine`)."""
        if allowed is not None and len(allowed) != len(prompts):
            raise ValueError(f"allowed has {len(allowed)} entries for {len(prompts)} prompts")
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Generation | None] = [None] * len(prompts)
        model = self.generator
        was_training = model.training
        model.eval()
        try:
            for start in range(0, len(order), self.batch_size):
                idx = order[start:start + self.batch_size]
                batch = [list(prompts[i]) for i in idx]
                batch_allowed = [allowed[i] if allowed is not None else None for i in idx]
                with self._section():
                    gens = self._generate_batch(model, batch, params, batch_allowed)
                for i, gen in zip(idx, gens):
                    results[i] = gen
        finally:
            if was_training:
                model.train()
        return results  # type: ignore[return-value]

    def _section(self):
        """The gate section one batch runs in (none without a gate)."""
        if self.gate is None:
            return contextlib.nullcontext()
        return self.gate.background() if self.background else self.gate.foreground()

    def _plan(self, model: Any, arrays: list[np.ndarray]) -> list[tuple[_Prefix | None, int]]:
        """For each prompt, the stored prefix it reuses and how many tokens of it (steps 1-2 of the
        class docstring); every prompt keeps at least one token to compute."""
        if not self.caching:
            return [(None, 0)] * len(arrays)
        matches = [self.store.match(a, len(a) - 1) for a in arrays]
        # heads shared by >= 2 prompts: the longest common prefix with a lexicographic neighbour
        order = sorted(range(len(arrays)), key=lambda i: arrays[i].tolist())
        share = [0] * len(arrays)
        for a, b in zip(order, order[1:]):
            n = _lcp(arrays[a], arrays[b])
            share[a], share[b] = max(share[a], n), max(share[b], n)
        if not self.group_heads:                     # only the head common to the whole batch
            common = min((_lcp(arrays[a], arrays[b]) for a, b in zip(order, order[1:])), default=0)
            share = [common] * len(arrays)
        heads: dict[bytes, np.ndarray] = {}
        for i, a in enumerate(arrays):
            s = min(share[i], len(a) - 1)
            if s >= self.min_prefix and s >= matches[i][1] + self.min_prefix:
                heads.setdefault(a[:s].tobytes(), a[:s])
        if heads:
            self._compute_heads(model, list(heads.values()))
            matches = [self.store.match(a, len(a) - 1) for a in arrays]
        return [(p, n) if n >= self.min_prefix else (None, 0) for p, n in matches]

    def _layout(self, arrays: list[np.ndarray], reuse: list[tuple[_Prefix | None, int]]):
        """Padded batch: ``ids``/``att`` ``(B, W)``, the cache of the first ``P`` columns (per layer
        keys and values ``(B, H, P, D)``, or ``None``), ``P`` and ``W``.  Row ``i`` holds its reused
        prefix right-aligned in ``[0, P)`` and its remaining tokens right-aligned in ``[P, W)``."""
        pad = self.tokenizer.pad_token_id
        width_p = max(n for _, n in reuse)
        tails = [a[n:] for a, (_, n) in zip(arrays, reuse)]
        width = width_p + max(len(t) for t in tails)
        ids = torch.full((len(arrays), width), pad, dtype=torch.long)
        att = torch.zeros((len(arrays), width), dtype=torch.long)
        for i, (a, (_, n), t) in enumerate(zip(arrays, reuse, tails)):
            if n:
                ids[i, width_p - n:width_p] = torch.from_numpy(a[:n])
                att[i, width_p - n:width_p] = 1
            ids[i, width - len(t):] = torch.from_numpy(t)
            att[i, width - len(t):] = 1
        cache = None
        if width_p:
            ref = next(p for p, n in reuse if n)
            layers = []
            for layer, (k0, v0) in enumerate(ref.layers):
                k = k0.new_zeros((len(arrays), k0.shape[0], width_p, k0.shape[2]))
                v = v0.new_zeros((len(arrays), v0.shape[0], width_p, v0.shape[2]))
                for i, (p, n) in enumerate(reuse):
                    if n:
                        k[i, :, width_p - n:] = p.layers[layer][0][:, :n]
                        v[i, :, width_p - n:] = p.layers[layer][1][:, :n]
                layers.append((k, v))
            cache = layers
        dev = self.device
        return ids.to(dev), att.to(dev), cache, width_p, width

    def _store_rows(self, rows: Any, arrays: list[np.ndarray], reuse: list[tuple[_Prefix | None, int]],
                    width_p: int, width: int, extra: list[np.ndarray] | None = None) -> None:
        """Store each row's reused prefix + new tokens (+ ``extra[i]``, tokens generated after
        column ``width``) from the columns laid out by :meth:`_layout`: ``rows`` is a batch cache
        (``.layers[l].keys`` ``(B, H, L, D)``) or, per row, its layers' keys and values ``(H, L, D)``."""
        if hasattr(rows, "layers"):
            rows = [[(lay.keys[i], lay.values[i]) for lay in rows.layers] for i in range(len(arrays))]
        for i, (a, (_, n)) in enumerate(zip(arrays, reuse)):
            u = len(a) - n
            more = extra[i] if extra is not None else np.empty(0, dtype=np.int64)
            dev = rows[i][0][0].device
            pos = torch.cat([torch.arange(width_p - n, width_p), torch.arange(width - u, width + len(more))]).to(dev)
            layers = [(k.index_select(1, pos), v.index_select(1, pos)) for k, v in rows[i]]
            self.store.put(np.concatenate([a, more]), layers)

    def _compute_heads(self, model: Any, heads: list[np.ndarray]) -> None:
        """Compute and store the key/value caches of ``heads`` (one batched forward)."""
        reuse = [self.store.match(h, len(h) - 1) for h in heads]
        reuse = [(p, n) if n >= self.min_prefix else (None, 0) for p, n in reuse]
        ids, att, cache, width_p, width = self._layout(heads, reuse)
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids[:, width_p:], attention_mask=att, position_ids=pos[:, width_p:],
                    past_key_values=DynamicCache(ddp_cache_data=cache) if cache is not None else DynamicCache(),
                    use_cache=True, logits_to_keep=1)
        self.counters["head_tokens"] += sum(len(h) - n for h, (_, n) in zip(heads, reuse))
        self._store_rows(out.past_key_values, heads, reuse, width_p, width)

    def _prefill_in_chunks(self, model: Any, arrays: list[np.ndarray]) -> None:
        """Background work: compute the prompts' caches ``prefill_chunk`` tokens (over the batch) at a
        time into the store, yielding to the foreground between chunks, so that one long prompt never holds the
        CPU for long; generation then reuses them (all but each prompt's last token)."""
        longest = max(len(a) for a in arrays) - 1
        step = max(8, self.prefill_chunk // len(arrays))         # prefill_chunk tokens over the batch
        end = step
        while True:
            heads: dict[bytes, np.ndarray] = {}
            for a in arrays:
                n = min(end, len(a) - 1)
                if n >= self.min_prefix:
                    heads.setdefault(a[:n].tobytes(), a[:n])
            todo = [h for h in heads.values() if self.store.match(h, len(h))[1] < len(h)]
            if todo:
                self._compute_heads(model, todo)
            if end >= longest:
                return
            self.gate.yield_point()
            end += step

    def _generate_batch(self, model: Any, prompts: list[list[int]], params: SamplingParams,
                        allowed: list[Sequence[str] | None]) -> list[Generation]:
        tok = self.tokenizer
        eos = tok.eos_token_id
        arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
        if self.gate is not None and self.background and self.caching:
            self._prefill_in_chunks(model, arrays)
        reuse = self._plan(model, arrays)
        ids, att, prefix, width_p, width = self._layout(arrays, reuse)
        c = self.counters
        c["prompt_tokens"] += sum(len(a) for a in arrays)
        c["cached_tokens"] += sum(n for _, n in reuse)
        c["prefill_tokens"] += sum(len(a) - n for a, (_, n) in zip(arrays, reuse))
        tries = [self._trie(a) if a is not None else None for a in allowed]
        stop = None
        if params.stop:
            key = tuple(params.stop)
            if key not in self._stop_criteria:
                self._stop_criteria[key] = StopStringCriteria(tok, list(key))
            stop = self._stop_criteria[key]
        # a constrained reply always fits: the budget grows to the longest allowed reply (+ EOS)
        budget = max([params.max_new_tokens] + [t.depth + 1 for t in tries if t is not None])
        keep = self.caching and self.keep_sequences
        background = self.gate is not None and self.background
        if self.decode_loop:
            dec = decode(model, ids, att, prefix, width_p, budget=budget, eos=eos, pad=tok.pad_token_id,
                         temperature=params.temperature, top_k=max(0, params.top_k), top_p=params.top_p,
                         tries=tries, stop=stop, yield_point=self.gate.yield_point if background else None,
                         drop_finished=self.drop_finished, keep_kv=keep, group_prefill=self.group_prefill)
            seqs, lps, ents, sents = dec.tokens, dec.logprobs, dec.entropy, dec.sampling_entropy
            c["prefill_positions"] += dec.prefill_positions
            rows_kv = [layers for layers, _ in dec.kv] if keep else None
            fed = [n for _, n in dec.kv] if keep else None
        else:
            seqs, lps, ents, sents, rows_kv, n_fed = self._generate_hf(
                model, ids, att, prefix, width, params, tries, stop, budget, background)
            fed = [n_fed] * len(arrays)
            c["prefill_positions"] += ids.shape[0] * (width - width_p)

        results = []
        for i, seq in enumerate(seqs):
            resp: list[int] = []
            reason = "length"
            text = ""
            for t in seq:
                resp.append(t)
                if t == eos:
                    reason = "eos"
                    break
                text = tok.decode(resp, skip_special_tokens=True)
                if any(s in text for s in params.stop):
                    reason = "stop"
                    break
            text = tok.decode(resp, skip_special_tokens=True)
            results.append(Generation(list(prompts[i]), resp, lps[i][:len(resp)], text, reason,
                                      extra={"entropy": ents[i][:len(resp)],
                                             "sampling_entropy": sents[i][:len(resp)]}))
        if keep and rows_kv is not None:
            # a row's cache holds every fed token: the prompt and the generated tokens but the last
            self._store_rows(rows_kv, arrays, reuse, width_p, width,
                             [np.asarray(g.response_ids[:max(0, min(len(g.response_ids), n))], dtype=np.int64)
                              for g, n in zip(results, fed)])
        return results

    def _generate_hf(self, model: Any, ids: torch.Tensor, att: torch.Tensor, prefix: Any, width: int,
                     params: SamplingParams, tries: list[_Trie | None], stop: Any, budget: int,
                     background: bool) -> tuple:
        """The batch through transformers' ``model.generate`` (``decode_loop=False``): per row the
        generated ids (finished rows padded to the longest), log-probs, entropies and sampling entropies
        (as :class:`~crl_bench.llm.decode.Decoded`), the final batch cache and the generated tokens it
        holds (all but the last step's)."""
        tok = self.tokenizer
        pad, eos = tok.pad_token_id, tok.eos_token_id
        extra: dict[str, Any] = {}
        if prefix is not None:
            extra["past_key_values"] = DynamicCache(ddp_cache_data=prefix)
        processors = LogitsProcessorList()
        if any(t is not None for t in tries):
            processors.append(AllowedRepliesProcessor(tries, width, eos))
        stopping = StoppingCriteriaList()
        if stop is not None:
            stopping.append(stop)
        if background:
            stopping.append(YieldToForeground(self.gate))
        greedy = params.temperature <= 0
        kwargs: dict[str, Any] = dict(do_sample=not greedy, max_new_tokens=budget)
        if not greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=max(0, params.top_k))
        out = model.generate(
            input_ids=ids, attention_mask=att, logits_processor=processors,
            stopping_criteria=stopping, return_dict_in_generate=True, output_logits=True, output_scores=True,
            pad_token_id=pad, eos_token_id=eos, **kwargs, **extra)
        seqs = out.sequences[:, width:].tolist()
        temp = params.temperature if params.temperature > 0 else 1.0
        gen_ids = out.sequences[:, width:]
        # per generated position t: the token's log-prob under the unprocessed logits at temperature,
        # the entropy (nats) of that unconstrained distribution, and the entropy of the distribution
        # the token was drawn from (allowed-reply mask, temperature, top-k/top-p applied). One (B, V)
        # step at a time, each step's logits released once read: (B, T, V) float32 stacks of all steps at
        # once would hold several GB for a 128-reply batch.
        logits, scores = list(out.logits), list(out.scores)
        out.logits = out.scores = None
        n_steps = len(logits)
        lp_t = torch.empty(gen_ids.shape[0], n_steps)
        ent_t = torch.empty_like(lp_t)
        sent_t = torch.empty_like(lp_t)
        for t in range(n_steps):
            logp = torch.log_softmax(logits[t].float() / temp, dim=-1)              # (B, V)
            logits[t] = None
            lp_t[:, t] = logp.gather(-1, gen_ids[:, t:t + 1]).squeeze(-1)
            ent_t[:, t] = -(logp.exp() * logp).sum(-1)
            slogp = torch.log_softmax(scores[t].float(), dim=-1)
            scores[t] = None
            sent_t[:, t] = -(slogp.exp() * slogp).nan_to_num(0.0).sum(-1)
        cache = out.past_key_values
        fed = cache.get_seq_length() - width if cache is not None else 0
        return seqs, lp_t.tolist(), ent_t.tolist(), sent_t.tolist(), cache, fed
