"""Batched generation with transformers (the default engine; CPU or GPU).

The engine shares the policy's weights with the trainer, so there is nothing to synchronise after an
update.  Prompts are left-padded into micro-batches sorted by length; each reply's token ids and
per-token log-probs come back without padding.
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StopStringCriteria, StoppingCriteriaList

from crl_bench.llm.base import Generation, SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def load_model_and_tokenizer(name: str, dtype: str = "float32", device: str | None = None):
    """Load a causal LM and its tokenizer; the default alias is converted from its GGUF once.

    A folder holding a peft adapter (``adapter_config.json``, as ``Trainer.save_checkpoint`` writes
    for a LoRA run) is loaded as: its base model (:func:`adapter_base_model`), the adapter on top
    (``peft.PeftModel.from_pretrained``), merged into the weights (``merge_and_unload``), so a plain
    ``PreTrainedModel`` comes back; the tokenizer is the folder's own.

    Args:
        name: ``--model`` value (see :func:`crl_bench.llm.default_model.resolve_model`), or an adapter
            folder.
        dtype: ``float32`` | ``bfloat16`` | ``float16``.
        device: torch device; default CUDA when available, else CPU.

    Returns:
        ``(model, tokenizer)``; the tokenizer has a pad token and pads on the left.

    Raises:
        ModelNotAvailable: the default model's package is missing.
        ValueError: unknown dtype, the tokenizer has no chat template, or an adapter config names no
            base model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from crl_bench.llm.default_model import resolve_model

    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    path = resolve_model(name)
    adapter = Path(path).is_dir() and (Path(path) / "adapter_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(path)
    if not tok.chat_template:
        raise ValueError(f"tokenizer of {name!r} has no chat template; crl-bench builds chat prompts")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if adapter:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(adapter_base_model(path), dtype=_DTYPES[dtype])
        model = PeftModel.from_pretrained(base, path).merge_and_unload()
        model.requires_grad_(True)   # peft froze the base for inference; return it as from_pretrained would
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def _common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest common token prefix, leaving every prompt at least one own token."""
    first = prompts[0]
    n = min(len(p) for p in prompts) - 1
    for i in range(max(n, 0)):
        t = first[i]
        if any(p[i] != t for p in prompts):
            return i
    return max(n, 0)


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

    def walk(self, ids: Sequence[int]) -> "_Trie | None":
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


class HFEngine:
    """Generation engine over a transformers causal LM (weights shared with the trainer).

    Prefix caching: the prompts of one batch usually share a long head (chat template, system prompt,
    task line).  With ``prefix_cache`` on, the key/value cache of that common head is computed once
    (batch 1), kept across calls until the weights change, and expanded over the batch; each row is
    laid out as ``head + padding + own tail`` with the padding masked, so positions and outputs are
    those of the plain left-padded batch.  On CPU, where prompt processing dominates, this removes
    most of the repeated work.

    Args:
        model: the policy (a ``PreTrainedModel`` or a peft wrapper of one).
        tokenizer: its tokenizer (left padding, pad token set).
        batch_size: prompts per ``generate`` call.
        prefix_cache: reuse the key/value cache of the batch's common prompt head.
        min_prefix: shortest common head (tokens) worth caching.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 32, prefix_cache: bool = True,
                 min_prefix: int = 32) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.prefix_cache = prefix_cache
        self.min_prefix = min_prefix
        self._stop_criteria: dict[tuple[str, ...], StopStringCriteria] = {}
        # bounded: envs such as ALFWorld have a different admissible set at almost every step
        self._trie_cache: OrderedDict[tuple[str, ...], _Trie] = OrderedDict()
        self.trie_cache_size = 512
        self._kv: OrderedDict[tuple[int, ...], Any] = OrderedDict()

    def sync_weights(self, model: Any) -> None:
        """Weights are shared with the trainer; cached prefixes are stale after an update."""
        self.model = model
        self._kv.clear()

    def _prefix_kv(self, head: list[int]) -> Any:
        key = tuple(head)
        if key in self._kv:
            self._kv.move_to_end(key)
            return self._kv[key]
        ids = torch.tensor([head], dtype=torch.long, device=self.device)
        kv = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True).past_key_values
        self._kv[key] = kv
        while len(self._kv) > 8:
            self._kv.popitem(last=False)
        return kv

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

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 allowed: Sequence[Sequence[str] | None] | None = None) -> list[Generation]:
        """Generate one reply per prompt (see :class:`crl_bench.llm.base.Engine`)."""
        if allowed is not None and len(allowed) != len(prompts):
            raise ValueError(f"allowed has {len(allowed)} entries for {len(prompts)} prompts")
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Generation | None] = [None] * len(prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(order), self.batch_size):
                idx = order[start:start + self.batch_size]
                batch = [list(prompts[i]) for i in idx]
                batch_allowed = [allowed[i] if allowed is not None else None for i in idx]
                for i, gen in zip(idx, self._generate_batch(batch, params, batch_allowed)):
                    results[i] = gen
        finally:
            if was_training:
                self.model.train()
        return results  # type: ignore[return-value]

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        allowed: list[Sequence[str] | None]) -> list[Generation]:
        tok = self.tokenizer
        pad = tok.pad_token_id
        eos = tok.eos_token_id
        head = _common_prefix(prompts) if self.prefix_cache else 0
        head = head if head >= self.min_prefix else 0
        tails = [p[head:] for p in prompts]
        width = head + max(len(t) for t in tails)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        att = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, (p, t) in enumerate(zip(prompts, tails)):
            ids[i, :head] = torch.tensor(p[:head], dtype=torch.long)
            att[i, :head] = 1
            ids[i, width - len(t):] = torch.tensor(t, dtype=torch.long)
            att[i, width - len(t):] = 1
        ids, att = ids.to(self.device), att.to(self.device)
        extra: dict[str, Any] = {}
        if head:
            kv = copy.deepcopy(self._prefix_kv(prompts[0][:head]))
            if len(prompts) > 1:
                kv.batch_repeat_interleave(len(prompts))
            extra["past_key_values"] = kv

        processors = LogitsProcessorList()
        tries = [self._trie(a) if a is not None else None for a in allowed]
        if any(t is not None for t in tries):
            processors.append(AllowedRepliesProcessor(tries, width, eos))
        stopping = StoppingCriteriaList()
        if params.stop:
            key = tuple(params.stop)
            if key not in self._stop_criteria:
                self._stop_criteria[key] = StopStringCriteria(tok, list(key))
            stopping.append(self._stop_criteria[key])
        greedy = params.temperature <= 0
        # a constrained reply always fits: the budget grows to the longest allowed reply (+ EOS)
        budget = max([params.max_new_tokens] + [t.depth + 1 for t in tries if t is not None])
        kwargs: dict[str, Any] = dict(do_sample=not greedy, max_new_tokens=budget)
        if not greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=max(0, params.top_k))
        out = self.model.generate(
            input_ids=ids, attention_mask=att, logits_processor=processors,
            stopping_criteria=stopping, return_dict_in_generate=True, output_logits=True,
            pad_token_id=pad, eos_token_id=eos, **kwargs, **extra)
        seqs = out.sequences[:, width:].tolist()
        temp = params.temperature if params.temperature > 0 else 1.0
        raw = torch.stack(out.logits, dim=1).float() / temp            # (B, T, V) unprocessed logits
        gen_ids = out.sequences[:, width:]
        lps = torch.log_softmax(raw, dim=-1).gather(-1, gen_ids.unsqueeze(-1)).squeeze(-1).tolist()

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
            results.append(Generation(list(prompts[i]), resp, lps[i][:len(resp)], text, reason))
        return results
