"""Compute dtype detection, float32 master weights with bf16 autocast, the bf16 generation copy, and
the compute gate between the actor and background distillation."""

import copy
import threading
import time

import pytest
import torch

from crl_bench.config import build_config
from crl_bench.llm.gate import ComputeGate, YieldToForeground
from crl_bench.llm.hf_engine import HFEngine
from crl_bench.llm.precision import cast_parameters, cpu_bf16_units, resolve_dtype
from crl_bench.trainer.policy import PolicyUpdater, TokenSample


def test_auto_uses_bf16_only_with_native_units():
    env = {}                                   # no oneDNN ISA cap, whatever this shell has
    assert resolve_dtype("auto", "cpu", frozenset({"avx512f", "amx_bf16"}), env) == "bfloat16"
    assert resolve_dtype("auto", "cpu", frozenset({"avx512f", "avx512_bf16"}), env) == "bfloat16"
    # AVX-512 VNNI without bf16 units: oneDNN emulates bf16 there, slower than float32
    assert resolve_dtype("auto", "cpu", frozenset({"avx512f", "avx512_vnni"}), env) == "float32"
    assert resolve_dtype("auto", "cpu", frozenset(), env) == "float32"
    assert resolve_dtype("float32", "cpu", frozenset({"amx_bf16"}), env) == "float32"
    assert resolve_dtype("bfloat16", "cpu", frozenset(), env) == "bfloat16"
    assert cpu_bf16_units(frozenset({"amx_bf16", "avx512_bf16", "sse"}), env) == ["amx_bf16", "avx512_bf16"]
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_dtype("bf16", "cpu")


def test_auto_is_float32_when_onednn_is_capped_below_its_bf16_kernels():
    """An AVX2-only CPU emulated on a bf16 one (ONEDNN_MAX_CPU_ISA=AVX2) must compute in float32, as the
    real CPU would; a cap that keeps the bf16 kernels changes nothing."""
    units = frozenset({"avx512f", "avx512_bf16"})
    for cap in ("AVX2", "avx2", "AVX512_CORE", "AVX512_CORE_VNNI"):
        assert resolve_dtype("auto", "cpu", units, {"ONEDNN_MAX_CPU_ISA": cap}) == "float32", cap
        assert cpu_bf16_units(units, {"ONEDNN_MAX_CPU_ISA": cap}) == []
    assert resolve_dtype("auto", "cpu", units, {"DNNL_MAX_CPU_ISA": "AVX2"}) == "float32"
    for cap in ("AVX512_CORE_BF16", "AVX512_CORE_AMX", "ALL", ""):
        assert resolve_dtype("auto", "cpu", units, {"ONEDNN_MAX_CPU_ISA": cap}) == "bfloat16", cap
    # an explicit dtype is never overridden
    assert resolve_dtype("bfloat16", "cpu", units, {"ONEDNN_MAX_CPU_ISA": "AVX2"}) == "bfloat16"


def test_default_config_is_auto_and_bad_dtype_names_the_key():
    from crl_bench.config import ConfigError

    assert build_config([]).model.dtype == "auto"
    with pytest.raises(ConfigError, match="model.dtype"):
        build_config([{"model": {"dtype": "int8"}}])


def test_cast_parameters_keeps_buffers(tiny_model):
    buffers = {n: b.dtype for n, b in tiny_model.named_buffers()}
    cast_parameters(tiny_model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in tiny_model.parameters())
    assert {n: b.dtype for n, b in tiny_model.named_buffers()} == buffers


def test_bf16_generation_copy_follows_the_float32_weights(tokenizer, tiny_model):
    from crl_bench.llm.base import SamplingParams

    eng = HFEngine(tiny_model, tokenizer, compute_dtype=torch.bfloat16)
    assert eng.generator is not tiny_model
    assert all(p.dtype == torch.bfloat16 for p in eng.generator.parameters())
    assert all(p.dtype == torch.float32 for p in tiny_model.parameters())     # master weights untouched
    ids = tokenizer.encode("hello there, what next?")
    out = eng.generate([ids], SamplingParams(temperature=0, max_new_tokens=4))[0]
    assert out.response_ids and len(out.logprobs) == len(out.response_ids)
    with torch.no_grad():
        tiny_model.lm_head.weight.add_(0.5)
    eng.sync_weights(tiny_model)
    assert torch.equal(eng.generator.lm_head.weight, tiny_model.lm_head.weight.to(torch.bfloat16))
    # float32 compute, or a model already in the compute dtype: no copy
    assert HFEngine(tiny_model, tokenizer, compute_dtype=torch.float32).generator is tiny_model


def test_frozen_generation_copy_gets_a_contiguous_head_input(tokenizer, tiny_model):
    """generate asks for the last position's logits only, so the LM head would see the strided view
    hidden[:, -1:, :]; with a frozen weight torch's CPU matmul then broadcasts the head per prompt
    ((B, H, V): 7.2 GB for 128 prompts with the default model in bf16). The engine's copy must hand
    the head a contiguous input, and the replies must not change."""
    from crl_bench.llm.base import SamplingParams

    eng = HFEngine(tiny_model, tokenizer, compute_dtype=torch.bfloat16)
    head = eng.generator.get_output_embeddings()
    assert not head.weight.requires_grad
    seen = []
    head.register_forward_pre_hook(lambda _m, args: seen.append((tuple(args[0].shape), args[0].is_contiguous())))
    prompts = [tokenizer.encode(t) for t in ("go north now please", "which way to the stairs?", "x")]
    params = SamplingParams(temperature=0, max_new_tokens=3)
    out = eng.generate(prompts, params)
    assert seen and seen[0][0][:2] == (3, 1)            # logits of the last position only
    assert all(contiguous for _, contiguous in seen), seen
    # the same greedy replies and log-probs as the copy without the hook
    plain = cast_parameters(copy.deepcopy(tiny_model), torch.bfloat16).eval()
    for p in plain.parameters():
        p.requires_grad_(True)         # a weight that requires grad folds (B,1,H) @ head with or without it
    ref = HFEngine(plain, tokenizer).generate(prompts, params)
    assert [g.response_ids for g in out] == [g.response_ids for g in ref]
    for g, r in zip(out, ref):
        assert g.logprobs == pytest.approx(r.logprobs, abs=1e-3)


def test_autocast_update_keeps_float32_master_weights_and_state(tokenizer, tiny_model):
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-2)
    upd = PolicyUpdater(tiny_model, opt, pad_id=tokenizer.pad_token_id, compute_dtype=torch.bfloat16,
                        recompute_old_logprobs=True)
    before = tiny_model.lm_head.weight.detach().clone()
    samples = [TokenSample([1, 2, 3, 4], [5, 6], [-3.0, -3.0], 1.0, sequence=0),
               TokenSample([1, 2, 7], [8], [-3.0], -1.0, sequence=1)]
    out = upd.update(samples)
    assert out["optimizer_steps"] == 1 and torch.isfinite(torch.tensor(out["loss"]))
    assert "behaviour_logprob_abs_diff" in out
    assert all(p.dtype == torch.float32 for p in tiny_model.parameters())
    state = opt.state[tiny_model.lm_head.weight]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    assert not torch.equal(before, tiny_model.lm_head.weight)


def test_autocast_logprobs_are_close_to_float32(tokenizer, tiny_model):
    from crl_bench.trainer.policy import build_batch, sequence_logprobs

    batch = build_batch([TokenSample([1, 2, 3, 4, 9, 10], [5, 6, 11], [0.0] * 3, 1.0)], tokenizer.pad_token_id)
    with torch.no_grad():
        lp32 = sequence_logprobs(tiny_model, batch)
        lp16 = sequence_logprobs(tiny_model, batch, compute_dtype=torch.bfloat16)
    assert lp16.dtype == torch.float32
    assert torch.allclose(lp32, lp16, atol=0.05)


def test_background_waits_for_the_foreground_and_yields_at_decode_steps():
    gate = ComputeGate()
    events: list[str] = []
    in_background = threading.Event()
    release = threading.Event()

    def background():
        with gate.background():
            events.append("bg-start")
            in_background.set()
            release.wait(10)
            YieldToForeground(gate)(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 5))
            events.append("bg-after-yield")

    t = threading.Thread(target=background)
    t.start()
    assert in_background.wait(10)
    entered = threading.Event()

    def foreground():
        with gate.foreground():
            events.append("fg")
            entered.set()

    f = threading.Thread(target=foreground)
    f.start()
    # the foreground is waiting for the background's step; let the step end at its yield point
    release.set()
    assert entered.wait(10)
    f.join(10)
    t.join(10)
    assert events == ["bg-start", "fg", "bg-after-yield"]

    # a background section does not start while a foreground section is open
    events.clear()
    started = threading.Event()
    with gate.foreground():
        t = threading.Thread(target=lambda: (gate.background().__enter__(), started.set()))
        t.start()
        assert not started.wait(0.2)
        events.append("fg-done")
    assert started.wait(10)
    t.join(10)
    gate._release_background()


def test_background_starts_only_after_the_foreground_has_left_a_long_enough_gap():
    """``min_gap_s``: no background step in the short gaps between foreground sections; before any
    foreground section there is no gap to wait for, and the foreground never waits for the rule."""
    gate = ComputeGate(min_gap_s=0.3)
    with gate.background():                    # nothing ran in the foreground yet: starts at once
        pass
    with gate.foreground():
        pass
    left = time.perf_counter()
    started = []
    t = threading.Thread(target=lambda: (gate._acquire_background(), started.append(time.perf_counter())))
    t.start()
    t.join(10)
    assert started and started[0] - left >= 0.3
    gate._release_background()

    # a foreground section that opens during the gap restarts it: the background waits again
    gate = ComputeGate(min_gap_s=3600)
    with gate.foreground():
        pass
    began = threading.Event()
    t = threading.Thread(target=lambda: (gate._acquire_background(), began.set()), daemon=True)
    t.start()
    assert not began.wait(0.2)
    with gate.foreground():                    # not held back by the waiting background
        pass
    assert not began.wait(0.2)
    gate.min_gap_s = 0.0
    with gate.foreground():                    # its exit wakes the waiting background
        pass
    assert began.wait(10)
    gate._release_background()
    with pytest.raises(ValueError, match="min_gap_s"):
        ComputeGate(min_gap_s=-1)
