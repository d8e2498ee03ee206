"""The co-evolution loop with a tiny random actor/extractor, the hash embedder and a toy env.

A tiny random extractor almost never writes a parseable operation, so these tests drive the extractor
through a scripted engine where they need bank writes; the real-model path is in test_integration.py.
"""

import pytest
import torch

from crl_bench.config import build_config, preset_data
from crl_bench.env_api import register_env
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.types import Operation
from crl_bench.llm.base import Generation
from crl_bench.trainer.loop import Trainer
from tests_helpers import CoinEnv  # noqa: F401  (registered below)


class ScriptedEngine:
    """Replies with a fixed ADD operation for every extraction prompt (log-probs from the real model)."""

    def __init__(self, real, text, prefill=""):
        self.real = real
        self.tokenizer = real.tokenizer
        self.text = text
        self.prefill = prefill

    def generate(self, prompts, params, allowed=None):
        out = []
        text = "<ops>\n" + self.text + "\n</ops>"
        text = text[len(self.prefill):] if text.startswith(self.prefill) else text
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        for p in prompts:
            out.append(Generation(list(p), ids, [-1.0] * len(ids), text, "stop"))
        return out

    def sync_weights(self, model):
        self.real.sync_weights(model)


@pytest.fixture(autouse=True)
def _coin():
    register_env("test-coin", CoinEnv)


def _cfg(method, **extra):
    layers = [preset_data("smoke"), {
        "method": method,
        "rollout": {"mix": "test-coin", "max_steps": 2},
        "train": {"groups_per_step": 2, "group_size": 4, "lr": 1e-3},
        "model": {"gradient_checkpointing": False},
        "eval": {"episodes": 2},
        "experience": {"wait_distill": True, "merge_every": 0},
        "extractor": {"batch_size": 2, "max_new_tokens": 24, "lr": 1e-3},
    }, extra]
    return build_config(layers)


def _trainer(method, tokenizer, tiny_model, scripted=None, **extra):
    import copy

    tr = Trainer(_cfg(method, **extra), model=tiny_model, tokenizer=tokenizer, embedder=HashEmbedder(64),
                 extractor_model=copy.deepcopy(tiny_model))
    if scripted:
        ex = tr.experience.extractor
        ex.engine = ScriptedEngine(tr.experience.engine, scripted, ex.prompts.prefill)
    return tr


ADD = "<op>ADD</op><title>Call heads</title><content>Heads wins the coin toss.</content>"


def test_subgroups_and_guided_episodes(tokenizer, tiny_model):
    tr = _trainer("complementary", tokenizer, tiny_model, scripted=ADD)
    specs = tr.episode_specs()
    assert [s.subgroup for s in specs] == ["free", "free", "guided", "guided"] * 2
    m1 = tr.train_step().metrics
    assert m1["bank_size"] >= 1 and m1["extractions_parsed"] == 8       # every episode distilled
    res = tr.train_step()
    m2 = res.metrics
    guided = [t for t in res.trajectories if t.subgroup == "guided"]
    assert all(t.experience_ids and "Heads wins" in t.guidance for t in guided)
    assert all(not t.experience_ids and not t.guidance for t in res.trajectories if t.subgroup == "free")
    # the guided prompt really carries the entry
    assert "Heads wins" in tokenizer.decode(guided[0].turns[0].prompt_ids)
    for key in ("success_rate/guided", "success_rate/free", "extractions_credited", "bank_size"):
        assert key in m2
    assert m2["extractions_credited"] >= 1
    # advantages are centred within each (group, subgroup)
    advs = tr.advantages(res.trajectories)
    for key in {(t.group_id, t.subgroup) for t in res.trajectories}:
        s = sum(a for a, t in zip(advs, res.trajectories) if (t.group_id, t.subgroup) == key)
        assert s == pytest.approx(0.0, abs=1e-6)
    tr.close()


def test_reward_goes_to_the_extraction_that_wrote_the_entry(tokenizer, tiny_model):
    tr = _trainer("complementary", tokenizer, tiny_model, scripted=ADD)
    tr.train_step()
    entries = tr.experience.bank.entries("test-coin")
    writers = {e.source_extraction for e in entries}
    res = tr.train_step()
    assert tr.experience.rewarded or tr.experience.updates
    # every rewarded extraction wrote an entry that guided a step-2 episode
    used = {eid for t in res.trajectories for eid in t.experience_ids}
    used_writers = {e.source_extraction for e in tr.experience.bank.get(sorted(used))}
    guided = [t for t in res.trajectories if t.subgroup == "guided" and t.experience_ids]
    assert len(tr.experience.rewarded) + sum(u["extractor_batch"] for u in tr.experience.updates) \
        == sum(len(t.experience_ids) for t in guided)       # one pair per guided episode and entry
    for ex, r in tr.experience.rewarded:
        assert ex.id in used_writers and ex.id in writers
        assert r in (-1.0, 0.0, 1.0)
    tr.close()


def test_extractor_updates_when_buffer_full_and_static_never(tokenizer, tiny_model):
    comp = _trainer("complementary", tokenizer, tiny_model, scripted=ADD)
    before = comp.experience.model.lm_head.weight.detach().clone()
    rows = [comp.train_step().metrics for _ in range(3)]
    updates = [r for r in rows if "extractor_update" in r]
    assert updates, rows
    u = updates[0]
    for key in ("extractor_loss", "extractor_reward_mean", "extractor_generation", "extractor_batch"):
        assert key in u
    assert comp.experience.generation == len(comp.experience.updates) >= 1
    if any(r["extractor_optimizer_steps"] for r in updates):
        assert not torch.equal(before, comp.experience.model.lm_head.weight)
    comp.close()

    static = _trainer("static", tokenizer, tiny_model, scripted=ADD)
    w = static.experience.model.lm_head.weight.detach().clone()
    rows = [static.train_step().metrics for _ in range(3)]
    assert not any("extractor_update" in r for r in rows)
    assert rows[-1]["bank_size"] >= 1                     # the frozen extractor still writes the bank
    assert torch.equal(w, static.experience.model.lm_head.weight)
    static.close()


def test_merge_pass_consolidates_similar_entries(tokenizer, tiny_model):
    merge = "<op>MERGE {a} {b}</op><title>Heads</title><content>Always call heads.</content>"
    tr = _trainer("complementary", tokenizer, tiny_model, scripted=ADD,
                  experience={"merge_every": 1, "merge_threshold": 0.5})
    bank = tr.experience.bank
    for _ in range(2):
        bank.apply([Operation("ADD", "Call heads", "Heads wins the coin toss.")], env_id="test-coin", step=0,
                   extraction_id="seed", generation=0)
    ids = [e.id for e in bank.entries("test-coin")]
    tr.experience.extractor.engine.text = merge.format(a=ids[0], b=ids[1])
    reqs = tr.experience._merge_requests(step=1)
    assert reqs and {e.id for e in reqs[0].entries} >= set(ids[:2])
    tr.experience.manager.submit(reqs)
    tr.experience.manager.drain(30)
    left = {e.id for e in bank.entries("test-coin")}
    assert not (set(ids[:2]) & left) and len(left) == 1
    assert tr.experience.manager.stats()["merges"] == 1
    tr.close()


def test_garbage_extractor_output_is_recorded_not_fatal(tokenizer, tiny_model):
    tr = _trainer("complementary", tokenizer, tiny_model, scripted="<op>ADD</op><title></title>")
    m = tr.train_step().metrics
    assert m["bank_size"] == 0 and m["extractions_failed"] + m["ops_rejected"] >= 1
    assert m["extractor_errors"] == 0
    tr.close()


def test_eval_is_guided_for_experience_methods(tokenizer, tiny_model):
    tr = _trainer("complementary", tokenizer, tiny_model, scripted=ADD)
    tr.train_step()
    ev = tr.evaluate()
    assert ev["guided"] is True and ev["episodes"] == 2
    tr.close()
