"""vLLM generation engine (optional extra ``[vllm]``; GPU machines).

Same interface as :class:`crl_bench.llm.hf_engine.HFEngine`: prompts are token ids, replies come back
with token ids and the log-prob of each sampled token.  Closed-set constrained decoding uses vLLM's
structured outputs (``choice``).  After every actor update the trainer calls :meth:`sync_weights`,
which loads the trainer's current weights into the vLLM workers (``collective_rpc`` +
``model.load_weights``, the mechanism vLLM documents for RLHF weight updates).

vLLM's sampled-token log-probs are those of the raw model output (``logprobs_mode="raw_logprobs"``):
for ``temperature == 1`` (the default for rollouts) they equal the trainer's log-probs.  LoRA training
with this engine is not supported (the adapters would have to be merged before every sync): use full
fine-tuning or the transformers engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from crl_bench.llm.base import Generation, SamplingParams


def vllm_available() -> bool:
    """Whether the ``vllm`` package can be imported here."""
    try:
        import vllm  # noqa: F401 - only checks that vLLM is installed
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def _load_weights(worker: Any, weights: list[tuple[str, Any]]) -> bool:
    """Runs inside each vLLM worker: load HF-named tensors into its model."""
    worker.model_runner.model.load_weights(weights=weights)
    return True


class VLLMEngine:
    """Generation through a ``vllm.LLM`` instance.

    Args:
        model_path: folder or hub name vLLM loads (the same weights as the trainer's initial model).
        tokenizer: the trainer's tokenizer (prompts are already token ids).
        dtype: ``float32`` | ``bfloat16`` | ``float16``.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (the trainer needs the rest).
        seed: vLLM's sampling seed.

    Raises:
        ImportError: vLLM is not installed (install the ``[vllm]`` extra).
    """

    def __init__(self, model_path: str, tokenizer: Any, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.5, seed: int = 0) -> None:
        if not vllm_available():
            raise ImportError("generation.engine=vllm needs vLLM: pip install 'crl-bench[vllm]' on a GPU machine")
        from vllm import LLM

        self.tokenizer = tokenizer
        self.llm = LLM(model=model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                       enable_prefix_caching=True, seed=seed, logprobs_mode="raw_logprobs")

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, model_cfg: Any) -> VLLMEngine:
        """Build the engine for the trainer's model (``model_cfg`` is a :class:`ModelConfig`)."""
        from crl_bench.llm.default_model import resolve_model

        if getattr(model_cfg, "lora", False):
            raise ValueError("generation.engine=vllm does not support model.lora=true; "
                             "use full fine-tuning or generation.engine=transformers")
        from crl_bench.llm.precision import resolve_dtype

        return cls(resolve_model(model_cfg.name), tokenizer, dtype=resolve_dtype(model_cfg.dtype, "cuda"))

    def sync_weights(self, model: Any) -> None:
        """Copy the trainer's current weights into vLLM (HF parameter names)."""
        weights = [(k, v.detach()) for k, v in model.state_dict().items()]
        self.llm.collective_rpc(_load_weights, args=(weights,))
        self.llm.reset_prefix_cache()

    def _params(self, params: SamplingParams, choice: Sequence[str] | None):
        from vllm import SamplingParams as VSP

        budget = params.max_new_tokens
        if choice is not None:      # a constrained reply always fits (as in HFEngine)
            budget = max([budget] + [len(self.tokenizer.encode(c, add_special_tokens=False)) + 1
                                     for c in choice])
        kwargs: dict[str, Any] = dict(
            temperature=max(params.temperature, 0.0), top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, max_tokens=budget,
            stop=list(params.stop), include_stop_str_in_output=True, logprobs=0)
        if choice is not None:
            try:
                from vllm.sampling_params import StructuredOutputsParams
                kwargs["structured_outputs"] = StructuredOutputsParams(choice=list(choice))
            except ImportError:  # vLLM < 0.11 names it guided decoding
                from vllm.sampling_params import GuidedDecodingParams
                kwargs["guided_decoding"] = GuidedDecodingParams(choice=list(choice))
        return VSP(**kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 allowed: Sequence[Sequence[str] | None] | None = None) -> list[Generation]:
        """Generate one reply per prompt (see :class:`crl_bench.llm.base.Engine`)."""
        allowed = list(allowed) if allowed is not None else [None] * len(prompts)
        reqs = [{"prompt_token_ids": list(p)} for p in prompts]
        sps = [self._params(params, a) for a in allowed]
        outs = self.llm.generate(reqs, sampling_params=sps, use_tqdm=False)
        results = []
        for p, out in zip(prompts, outs):
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [float(next(iter(d.values())).logprob) if d else 0.0 for d in (c.logprobs or [])]
            if len(lps) != len(ids):  # one entry per generated token is expected
                lps = (lps + [0.0] * len(ids))[:len(ids)]
            for step, d in enumerate(c.logprobs or []):
                if d and ids[step] in d:
                    lps[step] = float(d[ids[step]].logprob)
            reason = "stop" if c.finish_reason == "stop" and c.stop_reason is not None else \
                ("eos" if c.finish_reason == "stop" else "length")
            results.append(Generation(list(p), ids, lps, c.text, reason))
        return results
