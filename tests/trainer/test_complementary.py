"""The co-evolution loop with a tiny random actor/extractor, the hash embedder and a toy env.

A tiny random extractor almost never writes a parseable operation, so these tests drive the extractor
through a scripted engine where they need bank writes; the real-model path is in test_integration.py.
"""

import dataclasses

import pytest
import torch
from tests_helpers import CoinEnv, coin_config

from crl_bench.env_api import register_env
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.types import Operation
from crl_bench.llm.base import Generation
from crl_bench.trainer.loop import Trainer


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
    return coin_config(method, **extra)


def _trainer(method, tokenizer, tiny_model, scripted=None, **extra):
    import copy

    tr = Trainer(_cfg(method, **extra), model=tiny_model, tokenizer=tokenizer, embedder=HashEmbedder(64),
                 extractor_model=copy.deepcopy(tiny_model))
    if scripted:
        extractor = tr.experience.extractor
        extractor.engine = ScriptedEngine(tr.experience.engine, scripted, extractor.prompts.prefill)
    return tr


ADD = "<op>ADD</op><title>Call heads</title><content>Heads wins the coin toss.</content>"


def test_warmup_then_subgroups_and_guided_episodes(tokenizer, tiny_model):
    tr = _trainer("complementary", tokenizer, tiny_model, scripted=ADD)
    specs = tr.episode_specs()
    assert [s.subgroup for s in specs] == ["free", "free", "guided", "guided"] * 2
    assert not any(s.retrieve for s in specs)                      # step 1 is the warm-up (smoke: 1)
    w = tiny_model.lm_head.weight.detach().clone()
    res1 = tr.train_step()
    m1 = res1.metrics
    assert m1["warmup"] is True and not any(t.experience_ids for t in res1.trajectories)
    assert torch.equal(w, tiny_model.lm_head.weight)               # warm-up: the actor is not updated
    assert m1["optimizer_steps"] == 0
    # only the guided subgroup is distilled (released), 2 groups x 2 guided
    assert m1["bank_size"] >= 1 and m1["extractions_parsed"] == 4 and m1["distill_queued"] == 4
    res = tr.train_step()
    m2 = res.metrics
    assert m2["warmup"] is False
    guided = [t for t in res.trajectories if t.subgroup == "guided"]
    assert all(t.experience_ids and "Heads wins" in t.guidance for t in guided)
    assert all(not t.experience_ids and not t.guidance for t in res.trajectories if t.subgroup == "free")
    # the guided prompt carries the entry once, in the system message (released placement)
    text = tokenizer.decode(guided[0].turns[0].prompt_ids)
    assert text.count("Heads wins") == 1
    assert text.index("Heads wins") < text.index("<|im_start|>user")
    for key in ("success_rate/guided", "success_rate/free", "extractions_credited", "bank_size"):
        assert key in m2
    assert m2["extractions_credited"] >= 1
    # advantages are centred within each (group, subgroup)
    advs = tr.advantages(res.trajectories)
    for key in {(t.group_id, t.subgroup) for t in res.trajectories}:
        s = sum(a for a, t in zip(advs, res.trajectories) if (t.group_id, t.subgroup) == key)
        assert s == pytest.approx(0.0, abs=1e-6)
    tr.close()


def test_distill_all_option(tokenizer, tiny_model):
    tr = _trainer("complementary", tokenizer, tiny_model, scripted=ADD, experience={"distill": "all"})
    assert tr.train_step().metrics["extractions_parsed"] == 8
    tr.close()


def test_entries_are_keyed_by_the_episode_query(tokenizer, tiny_model):
    tr = _trainer("complementary", tokenizer, tiny_model, scripted=ADD)
    res = tr.train_step()
    bank = tr.experience.bank
    queries = {t.query for t in res.trajectories}
    assert all(q.startswith("Goal: ") and "Observation: A coin." in q for q in queries)
    keys = bank.key_texts([e.id for e in bank.entries()])
    assert keys and set(keys.values()) <= queries
    emb = tr.experience.embedder
    for e in bank.entries():
        vec = bank.vectors([e.id])[0]
        assert vec == pytest.approx(emb.encode([keys[e.id]])[0], abs=1e-5)
        assert vec != pytest.approx(emb.encode([e.text()])[0], abs=1e-3)
    tr.close()
    lesson = _trainer("complementary", tokenizer, tiny_model, scripted=ADD, experience={"key": "lesson"})
    lesson.train_step()
    bank = lesson.experience.bank
    e = bank.entries()[0]
    assert bank.vectors([e.id])[0] == pytest.approx(lesson.experience.embedder.encode([e.text()])[0], abs=1e-5)
    lesson.close()


def test_credit_is_recorded_at_retrieval_time(tokenizer, tiny_model):
    """An UPDATE and a MERGE applied between retrieval and credit do not move the extractor's reward."""
    tr = _trainer("complementary", tokenizer, tiny_model, scripted=ADD, experience={"k": 3},
                  extractor={"batch_size": 16})
    tr.train_step()
    bank, track = tr.experience.bank, tr.experience
    writers = {e.source_extraction for e in bank.entries()}
    collect = tr.runner.collect

    def collect_then_rewrite(*args, **kwargs):
        trajs = collect(*args, **kwargs)
        used = sorted({i for t in trajs for i in t.experience_ids})
        assert len(used) >= 3
        with track.manager.lock.write():
            r1 = bank.apply([Operation("UPDATE", "Rewritten", "Something else.", (used[0],))], env_id="test-coin",
                            step=9, extraction_id="rewriter", extractor_version=0)
            r2 = bank.apply([Operation("MERGE", "Merged", "Merged text.", tuple(used[1:]))], env_id="test-coin",
                            step=9, extraction_id="merger", extractor_version=0)
        assert not r1.rejected and not r2.rejected and r2.applied      # both really happened
        return trajs

    tr.runner.collect = collect_then_rewrite
    res = tr.train_step()
    guided = [t for t in res.trajectories if t.subgroup == "guided"]
    expected: dict[str, list[float]] = {}
    for t in guided:
        rec = t.retrieval
        assert rec.entries and "Heads wins" in rec.guidance and rec.guidance in t.guidance
        r = 1.0 if t.success else -1.0
        for eid in dict.fromkeys(e.source_extraction for e in rec.entries):
            expected.setdefault(eid, []).append(r)
    assert set(expected) <= writers and "rewriter" not in track.buffer and "merger" not in track.buffer
    got = {eid: (c.total, c.uses) for eid, c in track.buffer.items()}
    # uses still waiting plus uses already trained (smoke batch size 2) = one per guided episode and writer
    assert sum(c.uses for c in track.buffer.values()) + sum(u["extractor_batch"] * u["extractor_uses_mean"]
                                                            for u in track.updates) == \
        pytest.approx(sum(len(v) for v in expected.values()))
    for eid, (total, uses) in got.items():
        assert uses == len(expected[eid]) and total == pytest.approx(sum(expected[eid]))
    tr.close()


def test_extractor_updates_when_buffer_full_and_static_never(tokenizer, tiny_model):
    comp = _trainer("complementary", tokenizer, tiny_model, scripted=ADD)
    before = comp.experience.model.lm_head.weight.detach().clone()
    rows = [comp.train_step().metrics for _ in range(3)]
    updates = [r for r in rows if "extractor_update" in r]
    assert updates, rows
    u = updates[0]
    for key in ("extractor_loss", "extractor_reward_mean", "extractor_version", "extractor_batch"):
        assert key in u
    assert comp.experience.extractor_version == len(comp.experience.updates) >= 1
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


def test_release_training_state_frees_both_optimisers_before_the_final_eval(tokenizer, tiny_model):
    comp = _trainer("complementary", tokenizer, tiny_model, scripted=ADD)
    while not (comp.optimizer.state and comp.experience.updater.optimizer.state):
        assert comp.step < 6, "neither update ran in 6 steps"
        comp.train_step()
    sizes = [sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                 if torch.is_tensor(v) and v.dim() > 0)
             for opt in (comp.optimizer, comp.experience.updater.optimizer)]
    weights = {k: v.detach().clone() for k, v in comp.model.state_dict().items()}
    freed = comp.release_training_state()
    assert freed == pytest.approx(sum(sizes) / 1e9) and freed > 0
    assert not comp.optimizer.state and not comp.experience.updater.optimizer.state
    assert all(p.grad is None for p in comp.model.parameters())
    assert all(torch.equal(v, comp.model.state_dict()[k]) for k, v in weights.items())
    assert comp.evaluator.evaluate(2, mode="guided")["episodes"] == 2      # evaluation still runs
    with pytest.raises(RuntimeError, match="release_training_state"):
        comp.train_step()
    comp.close()


class CachingScriptedEngine(ScriptedEngine):
    """:class:`ScriptedEngine` whose real engine also prefills each prompt (so its prefix store fills
    as a real extractor's does)."""

    def generate(self, prompts, params, allowed=None):
        self.real.generate(prompts, dataclasses.replace(params, max_new_tokens=1))
        return super().generate(prompts, params, allowed)

    def clear_prefix_cache(self):
        self.real.clear_prefix_cache()


def test_updates_start_without_the_old_weights_cached_prefixes(tokenizer, tiny_model):
    """Each engine's prompt prefixes belong to the weights about to change: they are dropped before
    the update (out of its resident peak), not only at the weight sync after it."""
    comp = _trainer("complementary", tokenizer, tiny_model)
    extractor = comp.experience.manager.extractor
    real = comp.experience.engine
    extractor.engine = CachingScriptedEngine(real, ADD, extractor.prompts.prefill)
    seen = {"actor": [], "extractor": []}
    filled = []

    def spy(name, update, engine):
        def wrapped(samples):
            seen[name].append(len(engine.store))
            return update(samples)
        return wrapped

    comp.updater.update = spy("actor", comp.updater.update, comp.engine)
    comp.experience.updater.update = spy("extractor", comp.experience.updater.update, real)
    rollout = comp.runner.collect

    def collect(*a, **k):
        out = rollout(*a, **k)
        filled.append((len(comp.engine.store), len(real.store)))
        return out

    comp.runner.collect = collect
    while not (seen["actor"] and seen["extractor"]):
        assert comp.step < 6, "neither update ran in 6 steps"
        comp.train_step()
    assert max(a for a, _ in filled) > 0 and max(x for _, x in filled) > 0     # the stores did fill
    assert seen == {"actor": [0] * len(seen["actor"]), "extractor": [0] * len(seen["extractor"])}
    comp.close()


def test_similar_merge_consolidates_similar_entries(tokenizer, tiny_model):
    merge = "<op>MERGE {a} {b}</op><title>Heads</title><content>Always call heads.</content>"
    tr = _trainer("complementary", tokenizer, tiny_model, scripted=ADD,
                  experience={"merge": {"every": 1, "mode": "similar", "threshold": 0.5}})
    bank = tr.experience.bank
    for _ in range(2):
        bank.apply([Operation("ADD", "Call heads", "Heads wins the coin toss.")], env_id="test-coin", step=0,
                   extraction_id="seed", extractor_version=0)
    ids = [e.id for e in bank.entries("test-coin")]
    groups = tr.experience.manager.similar_groups(0.5, 5)
    assert groups and {e.id for e in groups[0][1]} >= set(ids[:2])
    tr.experience.extractor.engine.text = merge.format(a=ids[0], b=ids[1])
    assert tr.experience.before_rollout(1) == {"merge_pass": 1, "merge_skipped": 0, "merge_pass_calls": 1,
                                               "merge_pass_writes": 1}
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


def _bank_state(bank):
    return [(e.id, e.title, e.content, e.times_retrieved, e.times_success, e.times_failure, e.last_retrieved)
            for e in bank.entries()]


def test_guided_eval_leaves_the_bank_and_its_counters_untouched(tokenizer, tiny_model):
    tr = _trainer("complementary", tokenizer, tiny_model, scripted=ADD)
    tr.train_step()
    tr.train_step()
    bank = tr.experience.bank
    before = _bank_state(bank)
    assert any(row[3] for row in before)                 # training retrievals were counted
    rng_state = tr.experience.retriever._rng.getstate()
    queries = tr.experience.manager.stats()["queries"]
    ev = tr.evaluator.evaluate()
    assert ev["guided"] is True and ev["episodes"] == 2
    assert tr.experience.manager.stats()["queries"] == queries + 2      # eval did retrieve
    assert _bank_state(bank) == before
    assert tr.experience.retriever._rng.getstate() == rng_state
    # the final evaluation runs the same tasks guided and free, both read-only
    both = tr.evaluator.evaluate_all()
    assert both["guided"]["guided"] is True and both["free"]["guided"] is False
    assert both["guided"]["tasks"] == both["free"]["tasks"]
    assert tr.evaluator.modes == ["guided", "shuffled", "empty", "free"]       # the memory controls by default
    assert tr.evaluator.episode_count() == 8
    assert _bank_state(bank) == before
    tr.close()


def test_read_only_bank_evaluates_a_finished_runs_bank(tmp_path, tokenizer, tiny_model):
    """`crl-bench eval --run`'s trainer: the finished run's bank, opened read-only, guides the eval (an
    eval that built a fresh empty bank and still reported "guided" would fail this); no extractor is
    loaded, the bank file does not change and training is refused."""
    from crl_bench.results.run_folder import RunWriter

    cfg = _cfg("complementary")
    writer = RunWriter(tmp_path, run_id="run")
    import copy
    tr = Trainer(cfg, writer=writer, model=tiny_model, tokenizer=tokenizer, embedder=HashEmbedder(64),
                 extractor_model=copy.deepcopy(tiny_model))
    tr.experience.extractor.engine = ScriptedEngine(tr.experience.engine, ADD, tr.experience.extractor.prompts.prefill)
    tr.train_step()
    tr.train_step()
    before = _bank_state(tr.experience.bank)
    tr.close()
    bank_file = writer.dir / "experience.sqlite"
    raw = bank_file.read_bytes()
    ev_tr = Trainer(cfg, model=tiny_model, tokenizer=tokenizer, embedder=HashEmbedder(64),
                    read_only_bank=bank_file)
    try:
        assert ev_tr.experience.extractor is None and ev_tr.experience.model is None
        ev = ev_tr.evaluator.evaluate(guided=True)
        assert ev["guided"] is True and ev["episodes_with_experience"] == ev["episodes"] == 2
        with pytest.raises(RuntimeError, match="read-only"):
            ev_tr.train_step()
        assert _bank_state(ev_tr.experience.bank) == before
    finally:
        ev_tr.close()
    assert bank_file.read_bytes() == raw
