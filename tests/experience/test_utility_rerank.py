"""Utility-aware retrieval (``experience.rerank: utility``): RetroAgent's SimUtil-UCB (arXiv
2603.08561, section 3.3) against hand-computed cases, and the entry utility it reads."""

from __future__ import annotations

import math

import pytest
import torch

from crl_bench.config import ConfigError, build_config, preset_data
from crl_bench.experience.bank import ExperienceBank
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.manager import build_manager
from crl_bench.experience.retrieval import Retriever
from crl_bench.experience.types import ExperienceEntry
from crl_bench.experience.types import Operation as Op


def _add(bank, title, content="", env="e", key=None):
    res = bank.apply([Op("ADD", title, content or title)], env_id=env, step=1, extraction_id="x",
                     extractor_version=0, key_text=key)
    return res.applied[0][1]


def test_utility_moves_towards_each_outcome_by_beta(tmp_path):
    bank = ExperienceBank(tmp_path / "b.sqlite", HashEmbedder(32))
    i = _add(bank, "open the door")
    assert bank.get([i])[0].utility == 0.5                           # RetroAgent's initial utility
    bank.record_outcome([i], True, utility_beta=0.05)
    assert bank.get([i])[0].utility == pytest.approx(0.525)        # 0.95 * 0.5 + 0.05 * 1
    bank.record_outcome([i], False, utility_beta=0.05)
    e = bank.get([i])[0]
    assert e.utility == pytest.approx(0.49875)                     # 0.95 * 0.525 + 0.05 * 0
    assert (e.times_success, e.times_failure) == (1, 1)
    bank.record_outcome([i], True)                                  # beta 0: counted, utility kept
    assert bank.get([i])[0].utility == pytest.approx(0.49875)
    with pytest.raises(ValueError, match="utility_beta"):
        bank.record_outcome([i], True, utility_beta=1.5)
    bank.close()


def _entry(i, utility, n):
    return ExperienceEntry(id=i, env_id="e", title=f"t{i}", content="c", utility=utility, times_retrieved=n)


def test_simutil_ucb_score_hand_computed():
    r = Retriever.__new__(Retriever)          # the scoring only: no bank needed
    r.utility_alpha, r.utility_ucb, r.utility_min_sim, r.utility_count_start = 0.7, 1.0, 0.4, 0
    near = _entry(1, utility=0.5, n=10)       # most similar, often used
    fresh = _entry(2, utility=0.5, n=1)       # a little less similar, used once
    far = _entry(3, utility=1.0, n=0)         # below the similarity floor
    cands = [(near, 0.9), (fresh, 0.8), (far, 0.3)]
    # N = 20: S(near) = 0.7*0.9 + 0.3*(0.5 + sqrt(ln 20 / 10)) = 0.63 + 0.3*(0.5 + 0.54733) = 0.94420
    #         S(fresh) = 0.7*0.8 + 0.3*(0.5 + sqrt(ln 20 / 1)) = 0.56 + 0.3*(0.5 + 1.73082) = 1.22925
    assert 0.63 + 0.3 * (0.5 + math.sqrt(math.log(20) / 10)) == pytest.approx(0.94420, abs=1e-5)
    assert [e.id for e in r.utility_rank(cands, 20)] == [2, 1]
    # evaluation leaves the bonus out: S(near) = 0.63 + 0.15 = 0.78 > S(fresh) = 0.56 + 0.15 = 0.71
    assert [e.id for e in r.utility_rank(cands, 20, explore=False)] == [1, 2]
    # utility decides between equally similar entries; an unused bank (N <= 1) gives no bonus
    good, bad = _entry(4, utility=0.9, n=0), _entry(5, utility=0.1, n=0)
    assert [e.id for e in r.utility_rank([(bad, 0.6), (good, 0.6)], 0)] == [4, 5]
    assert r.utility_rank([(far, 0.39)], 5) == []


def test_retriever_utility_mode_prefers_the_useful_entry_and_counts_only_training_calls(tmp_path):
    bank = ExperienceBank(tmp_path / "b.sqlite", HashEmbedder(64))
    query = "Goal: open the red door. Observation: a red door."
    useless = _add(bank, "lesson A", key=query)                     # the most similar
    useful = _add(bank, "lesson B", key=query + " Seen twice.")      # a little less similar
    for _ in range(4):
        bank.record_outcome([useless], False, utility_beta=0.5)
        bank.record_outcome([useful], True, utility_beta=0.5)
    released = Retriever(bank, k=1, top1_demote_p=0.0, seed=0)
    assert [e.id for e in released.retrieve([query], ["e"], count_retrievals=False)[0]] == [useless]
    util = Retriever(bank, k=1, seed=0, rerank="utility")
    assert [e.id for e in util.retrieve([query], ["e"], count_retrievals=False)[0]] == [useful, useless]
    assert bank.total_retrievals() == 0                             # read-only: nothing counted
    assert [e.id for e in util.retrieve([query], ["e"])[0]] == [useful]
    assert bank.total_retrievals() == 1 and bank.get([useful])[0].times_retrieved == 1
    bank.close()


def test_manager_moves_utility_by_the_configured_beta(tmp_path, tokenizer):
    cfg = build_config([preset_data("smoke"), {"method": "casebank", "rollout": {"mix": "sokoban"},
                                                "experience": {"rerank": "utility", "utility": {"beta": 0.5}}}])
    m = build_manager(cfg, tmp_path / "b.sqlite", None, tokenizer, compute_dtype=torch.float32,
                      embedder=HashEmbedder(32))
    assert m.retriever.rerank_mode == "utility" and m.retriever.utility_alpha == 0.7
    i = _add(m.bank, "push the box", env="sokoban")
    m.record_outcomes([([i], True)])
    assert m.bank.get([i])[0].utility == pytest.approx(0.75)
    m.close()


@pytest.mark.parametrize("key,value", [("rerank", "ucb"), ("utility.alpha", 1.5), ("utility.beta", -0.1),
                                       ("utility.ucb", -1.0), ("utility.candidates", "some"),
                                       ("utility.count_start", -1), ("utility.eval_k", -2)])
def test_bad_utility_settings_name_the_key(key, value):
    section, _, leaf = key.rpartition(".")
    with pytest.raises(ConfigError, match=f"experience.{key}"):
        build_config([preset_data("smoke"), {"experience": {section: {leaf: value}} if section else {key: value}}])


def _bank_at(tmp_path, sims):
    """A bank of one env whose entry j has cosine ``sims[j]`` with the query ``"the query"``, and that
    query; the entries' vectors are built around the query's embedding."""
    import numpy as np

    emb = HashEmbedder(64)
    bank = ExperienceBank(tmp_path / "b.sqlite", emb)
    q = emb.encode(["the query"])[0]
    other = np.roll(q, 7) - q * float(np.dot(np.roll(q, 7), q))
    other /= np.linalg.norm(other)
    vecs = np.stack([c * q + math.sqrt(1 - c * c) * other for c in sims]).astype(np.float32)
    return bank, bank.add_vectors("e", vecs), "the query"


def test_utility_rerank_scores_every_entry_over_the_floor(tmp_path):
    # released ReflectionMemory.retrieve scores every entry with similarity >= 0.4, not the nearest 16
    sims = [0.60 - 0.005 * j for j in range(19)] + [0.50]
    bank, ids, query = _bank_at(tmp_path, sims)
    bank.record_outcome(ids[:-1], False, utility_beta=1.0)        # utility 0: the 19 nearest never helped
    bank.record_outcome(ids[-1:], True, utility_beta=1.0)         # utility 1: the 20th always did
    every = Retriever(bank, k=1, seed=0, rerank="utility")
    assert [e.id for e in every.retrieve([query], ["e"])[0]] == [ids[-1]]
    nearest = Retriever(bank, k=1, seed=0, rerank="utility", utility_candidates="nearest")
    assert [e.id for e in nearest.retrieve([query], ["e"])[0]] == [ids[0]]
    bank.close()


def test_utility_use_counts_start_at_one(tmp_path):
    # A is nearer and was retrieved once, B never. Counts from 1 (released): N = 1 + 2 = 3,
    # S(A) = 0.7*0.9 + 0.3*(0.5 + sqrt(ln 3 / 2)) = 1.00235 < S(B) = 0.7*0.8 + 0.3*(0.5 + sqrt(ln 3)) = 1.02444.
    # Counts from 0: N = 1, no bonus, S(A) = 0.78 > S(B) = 0.71.
    assert 0.63 + 0.3 * (0.5 + math.sqrt(math.log(3) / 2)) == pytest.approx(1.00235, abs=1e-5)
    assert 0.56 + 0.3 * (0.5 + math.sqrt(math.log(3))) == pytest.approx(1.02444, abs=1e-5)
    bank, (a, b), query = _bank_at(tmp_path, [0.9, 0.8])
    bank.record_retrieval([a], 1.0)
    released = Retriever(bank, k=1, seed=0, rerank="utility", count_retrievals=False)
    assert [e.id for e in released.retrieve([query], ["e"], count_retrievals=True)[0]] == [b]
    from_zero = Retriever(bank, k=1, seed=0, rerank="utility", utility_count_start=0, count_retrievals=False)
    assert [e.id for e in from_zero.retrieve([query], ["e"], count_retrievals=True)[0]] == [a]
    bank.close()


def test_utility_rerank_shows_three_entries_in_evaluation_and_one_in_training(tmp_path):
    # released env managers: k = top_k (3) if is_eval else 1
    bank, ids, query = _bank_at(tmp_path, [0.9, 0.8, 0.7, 0.6, 0.5])
    r = Retriever(bank, k=1, seed=0, rerank="utility")
    assert [e.id for e in r.retrieve([query], ["e"], count_retrievals=False)[0]] == ids[:3]
    assert len(r.retrieve([query], ["e"])[0]) == 1
    plain = Retriever(bank, k=1, seed=0, rerank="utility", utility_eval_k=0)    # 0: experience.k
    assert len(plain.retrieve([query], ["e"], count_retrievals=False)[0]) == 1
    released = Retriever(bank, k=1, seed=0, top1_demote_p=0.0)                 # other re-ranks: k
    assert len(released.retrieve([query], ["e"], count_retrievals=False)[0]) == 1
    bank.close()
