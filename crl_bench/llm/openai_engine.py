"""Generation through an OpenAI-compatible server (``generation.engine: openai``): evaluation of a served
model, e.g. a vLLM or SGLang server of an open model, or a hosted API.

Two APIs (``generation.openai_api``):

- ``completions`` (default): ``POST /v1/completions`` with the prompt as **token ids**, built here with
  the served model's own tokenizer and chat template (``model.name``), the prefill included: the
  server sees exactly the prompt our in-process engines see, so at temperature 0 a vLLM server gives
  the in-process vLLM engine's replies. Servers of open models (vLLM, SGLang) accept token-id prompts.
- ``chat``: ``POST /v1/chat/completions`` with the episode's messages (the rollout's chat), for servers
  that only speak chat (hosted models). Such servers cannot continue a prefilled assistant message,
  so ``generation.prefill`` must be empty and the model writes the whole ``<answer>...</answer>``; the
  local tokenizer only counts tokens.

Replies are free (no constrained decoding: a served model's protocol is its own replies), so
``generation.constrained`` must be false. The API key is read from the environment variable
``generation.openai_api_key_env`` (default ``OPENAI_API_KEY``; a local server takes any key) and never
written to a run's files. Requests run ``generation.openai_concurrency`` at a time; the ``openai``
client retries connection errors, 408/409/429 and 5xx replies ``generation.openai_retries`` times
with exponential backoff. :attr:`OpenAIEngine.stats` counts requests, tokens (the server's ``usage``)
and latency for the evaluation record. There are no weights: training through this engine is refused.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from crl_bench.llm.base import Generation, SamplingParams

__all__ = ["OPENAI_APIS", "OpenAIEngine", "ServedStats"]

OPENAI_APIS = ("completions", "chat")
"""The OpenAI-compatible APIs the engine speaks (``generation.openai_api``)."""


@dataclass
class ServedStats:
    """What the server was asked and answered, accumulated over the engine's life (thread-safe via the
    engine's lock). ``latency_s`` holds one wall time per request (retries included)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """``{"requests", "prompt_tokens", "completion_tokens", "latency_s_mean", "latency_s_p50",
        "latency_s_p95", "latency_s_max"}`` (latencies ``None`` before any request)."""
        lat = sorted(self.latency_s)

        def q(p: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))], 4) if lat else None

        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "latency_s_mean": round(sum(lat) / len(lat), 4) if lat else None,
                "latency_s_p50": q(0.5), "latency_s_p95": q(0.95), "latency_s_max": q(1.0)}


class OpenAIEngine:
    """The :class:`~crl_bench.llm.base.Engine` of an OpenAI-compatible server (see the module docstring).

    Args:
        tokenizer: the local tokenizer (the served model's for ``completions``); it decodes nothing
            the server sent, it encodes the replies for the trajectory's ``response_ids``.
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the model name the server knows.
        api: ``completions`` or ``chat``.
        api_key_env: environment variable holding the API key (``"EMPTY"`` when unset).
        concurrency: requests in flight at once (>= 1).
        retries: retries of a failed request (the ``openai`` client's backoff).
        timeout_s: one request's timeout.
        client: an ``openai.OpenAI`` client to use instead (tests).

    Raises:
        ValueError: an unknown ``api``, an empty ``base_url`` or ``model``, ``concurrency`` below 1.
    """

    #: the rollout passes each prompt's chat (message list) to :meth:`generate` as ``chats``
    wants_chats = True

    def __init__(self, tokenizer: Any, base_url: str, model: str, api: str = "completions",
                 api_key_env: str = "OPENAI_API_KEY", concurrency: int = 8, retries: int = 5,
                 timeout_s: float = 120.0, client: Any = None) -> None:
        if api not in OPENAI_APIS:
            raise ValueError(f"openai api must be one of {OPENAI_APIS}, got {api!r}")
        if not base_url or not model:
            raise ValueError("the openai engine needs generation.openai_base_url and generation.openai_model")
        if concurrency < 1:
            raise ValueError(f"openai concurrency must be >= 1, got {concurrency}")
        if client is None:
            from openai import OpenAI

            client = OpenAI(base_url=base_url, api_key=os.environ.get(api_key_env) or "EMPTY",
                            max_retries=retries, timeout=timeout_s)
        self.tokenizer = tokenizer
        self.client = client
        self.model = model
        self.api = api
        self.concurrency = int(concurrency)
        self.stats = ServedStats()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="openai")

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 allowed: Sequence[Sequence[str] | None] | None = None,
                 chats: Sequence[Sequence[dict[str, str]]] | None = None) -> list[Generation]:
        """One reply per prompt, in order (``concurrency`` requests at a time).

        ``logprobs`` are NaN (the server's are not asked for: nothing trains on a served model's
        replies); ``response_ids`` are the local tokenizer's encoding of the reply. A reply stopped by a
        stop string keeps it (as the in-process engines do), from the server's ``stop_reason`` (vLLM)
        or, with a single stop string, that string.

        Raises:
            ValueError: a prompt with an allowed-reply list (constrained decoding is not available), or
                the ``chat`` API without ``chats``.
            openai.APIError: a request that failed after its retries (the evaluation stops; a
                resumable evaluation keeps its finished episodes).
        """
        if allowed is not None and any(a is not None for a in allowed):
            raise ValueError("the openai engine does not constrain replies: set generation.constrained=false")
        if self.api == "chat" and (chats is None or len(chats) != len(prompts)):
            raise ValueError("the chat API needs each prompt's messages (chats)")
        jobs = [self._pool.submit(self._one, list(p), params, None if chats is None else chats[i])
                for i, p in enumerate(prompts)]
        return [j.result() for j in jobs]

    def _one(self, prompt_ids: list[int], params: SamplingParams, chat: Sequence[dict[str, str]] | None) -> Generation:
        kwargs: dict[str, Any] = {"model": self.model, "max_tokens": params.max_new_tokens,
                                  "temperature": max(params.temperature, 0.0), "top_p": params.top_p}
        if params.stop:
            kwargs["stop"] = list(params.stop)
        if params.top_k > 0:            # not an OpenAI parameter: sent only when asked for (vLLM, SGLang take it)
            kwargs["extra_body"] = {"top_k": params.top_k}
        t0 = time.perf_counter()
        if self.api == "completions":
            out = self.client.completions.create(prompt=prompt_ids, **kwargs)
            choice = out.choices[0]
            text = choice.text or ""
        else:
            out = self.client.chat.completions.create(messages=[dict(m) for m in chat or ()], **kwargs)
            choice = out.choices[0]
            text = choice.message.content or ""
        latency = time.perf_counter() - t0
        matched = getattr(choice, "stop_reason", None)
        if choice.finish_reason == "stop":
            says = "stop_reason" in (getattr(choice, "model_extra", None) or {})
            if not isinstance(matched, str) and len(params.stop) == 1 and not says:
                matched = params.stop[0]          # a server that does not say which stop string matched
            reason = "stop" if isinstance(matched, str) else "eos"
            if isinstance(matched, str) and not text.endswith(matched):
                text += matched
        else:
            reason = "length"
        ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        usage = getattr(out, "usage", None)
        with self._lock:
            self.stats.requests += 1
            self.stats.prompt_tokens += int(getattr(usage, "prompt_tokens", 0) or 0)
            self.stats.completion_tokens += int(getattr(usage, "completion_tokens", 0) or 0)
            self.stats.latency_s.append(latency)
        return Generation(prompt_ids, ids, [float("nan")] * len(ids), text, reason,
                          {"served_latency_s": latency})

    def sync_weights(self, model: object) -> None:
        """Refused: a served model has no weights here to follow.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("generation.engine=openai evaluates a served model; it cannot follow trained weights")

    def close(self) -> None:
        """Stop the request threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
