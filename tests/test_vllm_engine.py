"""vLLM engine: import guard everywhere; real generation where vLLM and a GPU exist."""

import pytest

from crl_bench.llm.base import SamplingParams
from crl_bench.llm.vllm_engine import VLLMEngine, vllm_available


def test_clear_error_without_vllm(tokenizer):
    if vllm_available():
        pytest.skip("vLLM is installed here")
    with pytest.raises(ImportError, match=r"\[vllm\]"):
        VLLMEngine("unused", tokenizer)


def test_vllm_generates_valid_constrained_replies(tokenizer, default_model_dir):
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("vLLM engine is tested on GPU machines")
    eng = VLLMEngine(str(default_model_dir), tokenizer, dtype="float32", gpu_memory_utilization=0.3)
    ids = tokenizer.encode("<|im_start|>user\nPick a direction.<|im_end|>\n<|im_start|>assistant\n<answer>")
    allowed = ["up</answer>", "down</answer>"]
    gens = eng.generate([ids] * 4, SamplingParams(max_new_tokens=8), [allowed] * 4)
    for g in gens:
        assert g.text in allowed
        assert len(g.logprobs) == len(g.response_ids) and all(lp <= 0 for lp in g.logprobs)
