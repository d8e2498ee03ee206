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
    r.utility_alpha, r.utility_ucb, r.utility_min_sim = 0.7, 1.0, 0.4
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
    assert [e.id for e in util.retrieve([query], ["e"], count_retrievals=False)[0]] == [useful]
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
                                       ("utility.ucb", -1.0)])
def test_bad_utility_settings_name_the_key(key, value):
    section, _, leaf = key.rpartition(".")
    with pytest.raises(ConfigError, match=f"experience.{key}"):
        build_config([preset_data("smoke"), {"experience": {section: {leaf: value}} if section else {key: value}}])
