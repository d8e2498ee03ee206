"""``crl-bench bench update-peak`` (crl_bench/bench/update_peak.py): a steady-state update of a paper-shaped model
measured against what the plan counts for it. On CPU at a small width with a vocabulary large enough for the
chunked log-probs: the law holds (the plan neither understates the peak nor overstates it twice over), and a
plan without the log-prob term would be caught understating it."""

from __future__ import annotations

import pytest

from crl_bench.bench.update_peak import PLAN_BOUNDS, bench_update_peak, counted, format_update_peak, shape_config
from crl_bench.trainer.losses import LOGPROB_PLAIN_BYTES

#: a Qwen2.5-7B-shaped model made narrow: 40,000 tokens of vocabulary x 2,048 positions of float32 logits is
#: above the size where the trainer switches to the chunked log-probs
SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=40_000)
TOKENS = 2048


def test_the_shapes_are_the_paper_models_and_a_bad_request_is_refused():
    from crl_bench.trainer.memory_plan import ModelShape

    assert round(ModelShape.from_config(shape_config("qwen2.5-7b")).params / 1e9, 3) == 7.616
    assert round(ModelShape.from_config(shape_config("qwen3-4b")).params / 1e9, 3) == 4.022
    assert shape_config("qwen3-4b", 2).num_hidden_layers == 2
    with pytest.raises(KeyError, match="unknown shape"):
        shape_config("llama")
    with pytest.raises(ValueError, match="two distinct layer counts"):
        bench_update_peak("qwen2.5-7b", (2, 2), device="cpu")


def test_a_steady_update_measured_on_cpu_lies_within_the_plans_count():
    assert 4 * SMALL["vocab_size"] * TOKENS > LOGPROB_PLAIN_BYTES
    res = bench_update_peak("qwen2.5-7b", (1, 2), TOKENS, "cpu", **SMALL)
    assert not res["violations"], format_update_peak(res)
    assert all(PLAN_BOUNDS[0] <= r <= PLAN_BOUNDS[1] for r in res["ratio"])
    # the log-prob part is most of it at this width: a plan that left it out would understate the peak past
    # the bound
    plan = counted(shape_config("qwen2.5-7b", 1, **SMALL), TOKENS)
    assert res["measured"][0] / (plan["states"] + plan["activations"]) > PLAN_BOUNDS[1]
    text = format_update_peak(res)
    assert "law holds" in text and "all 28 layers" in text
