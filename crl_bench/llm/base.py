"""The engine interface shared by the transformers and vLLM back ends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one generate call.

    Attributes:
        temperature: softmax temperature; ``0`` means greedy decoding.
        top_p: nucleus mass in (0, 1].
        top_k: sample among the ``top_k`` most likely tokens only (``0`` = no limit).
        max_new_tokens: cap on generated tokens per prompt.
        stop: strings that end a reply (the stop string is kept in the reply).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 24
    stop: tuple[str, ...] = ("</answer>",)
    top_k: int = 0


@dataclass
class Generation:
    """One reply.

    Attributes:
        prompt_ids: prompt token ids (length P, no padding).
        response_ids: generated token ids (length R), ending at the stop string, EOS or the cap.
        logprobs: log-probability of each generated token under the model's *unconstrained*
            distribution at the sampling temperature (``temperature==0`` -> temperature 1); length R.
        text: decoded reply.
        finish_reason: ``"stop"`` (stop string), ``"eos"`` or ``"length"``.
        extra: engine-specific per-reply data; the transformers engine puts two lists of length R
            there: ``"entropy"``, the entropy in nats of the same unconstrained distribution as
            ``logprobs`` at each generated position, and ``"sampling_entropy"``, that of the
            distribution the token was drawn from (allowed-reply mask, temperature, top-k/top-p
            applied; for a closed action set their sum over the reply is an unbiased estimate of the
            entropy of the action choice, which is at most ln(number of actions)).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str = "stop"
    extra: dict = field(default_factory=dict)


class Engine(Protocol):
    """A batched text generator over token ids.

    ``generate(prompts, params, allowed)`` returns one :class:`Generation` per prompt, in order.
    ``allowed[i]`` (optional) lists the complete replies prompt ``i`` may produce (closed-set
    constrained decoding); ``None`` leaves prompt ``i`` free. A constrained prompt's token budget is
    raised to fit its longest allowed reply, so a constrained reply is always complete.
    """

    tokenizer: object

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 allowed: Sequence[Sequence[str] | None] | None = None) -> list[Generation]: ...

    def sync_weights(self, model: object) -> None:
        """Make the engine sample from ``model``'s current weights (no-op when it shares them)."""
        ...
