"""The update's memory laws (crl_bench/bench/memory.py) and the two changes they check: chunked log-probs
(trainer/losses.py ``token_logprobs``) and autocast without the weight-cast cache for the update's forward
(crl_bench/llm/precision.py ``autocast``, trainer/policy.py ``sequence_logprobs``)."""

from __future__ import annotations

import pytest
import torch

from crl_bench.bench import memory
from crl_bench.bench.memory import full_vocab_logprobs
from crl_bench.trainer.losses import token_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_logprobs_equal_the_full_log_softmax_in_value_and_gradient(dtype, chunk):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, 301, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, 301, (3, 50), generator=g)
    w = torch.randn(3, 50, generator=g)
    for temperature in (1.0, 0.7):
        ref = torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
        (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
        got = token_logprobs(logits, targets, temperature, chunk_tokens=chunk, plain_bytes=0)
        (g_got,) = torch.autograd.grad((got * w).sum(), logits)
        assert got.dtype == torch.float32 and got.shape == (3, 50)
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=0)
        tol = 1e-6 if dtype == torch.float32 else 1e-4
        torch.testing.assert_close(g_got.float(), g_ref.float(), atol=tol, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(logits, targets, chunk_tokens=chunk, plain_bytes=0),
                                   full_vocab_logprobs(logits, targets), atol=2e-6, rtol=0)
        # a small batch takes the plain log-softmax: the same values
        torch.testing.assert_close(token_logprobs(logits, targets), full_vocab_logprobs(logits, targets),
                                   atol=2e-6, rtol=0)


def test_chunked_logprobs_refuse_bad_input_and_take_empty_batches():
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), chunk_tokens=0)
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))
    assert token_logprobs(torch.zeros(2, 0, 3), torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0)


LAW_SIZES = {"logprob": (16_384, (2048, 4096)),      # sizes where the per-token part dominates the chunk's
             "autocast-cache": (1024, (4, 8))}


@pytest.fixture(scope="module")
def laws():
    """Both laws' arms, and the decode loop's arm of the decode law, measured in one subprocess."""
    cases = [c for law, (param, sizes) in LAW_SIZES.items() for c in memory.law_cases(law, param, sizes)]
    cases += [{"law": "decode", "size": n, "arm": "after", "param": 0} for n in (16, 80)]
    got = memory.measure(cases)
    out, i = {}, 0
    for law, (param, sizes) in LAW_SIZES.items():
        out[law] = memory.law_result(law, param, sizes, got[i:i + 4])
        i += 4
    out["decode-after"] = got[i:i + 2]
    return out


def test_logprob_law_chunked_keeps_a_fraction_of_the_full_vocabulary_copies(laws):
    # the full float32 log-softmax peaks at ~14 V bytes per position with bf16 logits (docs/scaling.md);
    # the chunked one at the logits and their gradient (~4 V) plus one chunk's constant
    r = laws["logprob"]
    assert memory.law_violations(r) == [], r
    assert memory.law_violations({**r, "slope": {"before": 3 * 16_384, "after": 3 * 16_384}}) == [
        "logprob before: 3.00 outside [12.0, 16.0]"]


def test_autocast_cache_law_the_cache_keeps_two_bytes_per_parameter_and_off_keeps_none(laws):
    assert memory.law_violations(laws["autocast-cache"]) == [], laws["autocast-cache"]


def test_decode_law_the_engines_decode_loop_keeps_no_logits_per_generated_token(laws):
    # transformers' generate with output_logits/scores keeps ~8 V bytes per generated token of a row for the
    # whole call (crl-bench bench memory --law decode measures both arms: 7.89 V against 0.03 V); the engine's
    # decode loop reads each step's statistics and drops the logits
    after = laws["decode-after"]
    per_v = (after[1] - after[0]) / (64 * memory.DECODE_ROWS) / 49_152
    assert per_v < 2, per_v            # retained logits would be 4-8 V; at these sizes the noise is about +-0.6 V


def test_the_update_forward_runs_without_the_cast_cache(monkeypatch):
    # sequence_logprobs must ask autocast for no cache: with it, a checkpointed model keeps a bf16 copy
    # of every weight alive at the forward's peak
    from crl_bench.trainer import policy

    seen = []

    def spy(device, dtype, cache=True):
        seen.append(cache)
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16, cache_enabled=cache)

    monkeypatch.setattr(policy, "autocast", spy)
    lin = torch.nn.Linear(4, 11)

    class Tiny(torch.nn.Module):
        def forward(self, input_ids, attention_mask, position_ids, logits_to_keep, use_cache):
            return type("Out", (), {"logits": lin(torch.nn.functional.one_hot(input_ids, 4).float())})()

    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
             "position_ids": torch.arange(3)[None], "keep": 3, "targets": torch.tensor([[2, 3]])}
    lp = policy.sequence_logprobs(Tiny(), batch, compute_dtype=torch.bfloat16)
    assert lp.shape == (1, 2) and seen == [False]


def test_bench_memory_prints_both_laws_with_their_extrapolation(capsys, monkeypatch):
    monkeypatch.setattr(memory, "measure", lambda cases, device="cpu": [1000, 3000] * 2)
    import argparse

    args = argparse.Namespace(law=["logprob", "autocast-cache"], device="cpu", vocab=100, width=10, json=None,
                              check=False)
    assert memory.run(args) == 0
    assert memory.run(argparse.Namespace(**{**vars(args), "check": True})) == 1     # 20 V, 2000 B: both broken
    out = capsys.readouterr().out
    assert "logprob (V = 100)" in out and "autocast-cache" in out and "GiB at Qwen2.5-7B" in out
    decode = memory.law_result("decode", 1000, (10, 20), [0, 8 * 1000 * 80, 0, 0])
    assert decode["slope"]["before"] == 8000 and "8.00 V" in memory.format_laws([decode], "cpu")

