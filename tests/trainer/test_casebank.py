"""The ``casebank`` method in the training loop: no extractor model, successful episodes of both
subgroups stored as cases, guided episodes shown the most similar case under the case header."""

import pytest
from tests_helpers import CoinEnv, coin_config

from crl_bench.config import ConfigError
from crl_bench.env_api import register_env
from crl_bench.experience.cases import CASES_HEADER, CaseWriter
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.memory import GUIDANCE_HEADER
from crl_bench.trainer.loop import Trainer


@pytest.fixture(autouse=True)
def _coin():
    register_env("test-coin", CoinEnv)


def test_casebank_stores_successes_and_guides_with_them(tokenizer, tiny_model):
    # every coin task has one retrieval query, so each case is of the guided episode's own task:
    # shown only with experience.cases.skip_own off
    tr = Trainer(coin_config("casebank", experience={"cases": {"skip_own": False}}), model=tiny_model,
                 tokenizer=tokenizer, embedder=HashEmbedder(64))
    track = tr.experience
    assert track.model is None and track.updater is None and isinstance(track.extractor, CaseWriter)
    res1 = tr.train_step()                                       # the warm-up step fills the bank
    wins = [t for t in res1.trajectories if t.success]
    assert wins and {t.subgroup for t in res1.trajectories} == {"free", "guided"}
    # every success becomes a case, whichever subgroup it was in; no failure does
    assert res1.metrics["distill_queued"] == len(wins) == res1.metrics["bank_size"]
    cases = track.bank.entries()
    assert all(c.content.startswith("Outcome: success (reward 1.00) after 1 steps") and "Step 1: heads" in c.content
               for c in cases)
    res2 = tr.train_step()
    guided = [t for t in res2.trajectories if t.subgroup == "guided"]
    assert guided and all(t.experience_ids and t.guidance.startswith(CASES_HEADER) for t in guided)
    assert all(GUIDANCE_HEADER not in t.guidance and "Step 1: heads" in t.guidance for t in guided)
    assert "merge_pass" not in res2.metrics
    assert track.empty_guidance == f"{CASES_HEADER}\n\n(no entries)"
    tr.close()


def test_casebank_never_shows_an_episode_its_own_tasks_case(tokenizer, tiny_model):
    # ExpeL's retrieval skips the current task (agent/expel.py topk_docs): a coin task's cases are all
    # keyed by the one query every coin task has, so a guided episode is shown none of them
    tr = Trainer(coin_config("casebank"), model=tiny_model, tokenizer=tokenizer, embedder=HashEmbedder(64))
    assert tr.train_step().metrics["bank_size"] > 0
    guided = [t for t in tr.train_step().trajectories if t.subgroup == "guided"]
    assert guided and not any(t.experience_ids or t.guidance for t in guided)
    tr.close()


def test_casebank_failures_on_request(tokenizer, tiny_model):
    tr = Trainer(coin_config("casebank", experience={"cases": {"outcomes": "all"}}), model=tiny_model,
                 tokenizer=tokenizer,
                 embedder=HashEmbedder(64))
    res = tr.train_step()
    assert res.metrics["bank_size"] == len(res.trajectories) == 8
    assert {c.content.split(" (")[0] for c in tr.experience.bank.entries()} == \
        {"Outcome: success", "Outcome: failure"}
    tr.close()


@pytest.mark.parametrize("integration", ["turn", "both"])
def test_casebank_refuses_turn_integration(integration):
    with pytest.raises(ConfigError, match="experience.integration"):
        coin_config("casebank", experience={"integration": integration})


def test_casebank_summary_names_no_extractor(tmp_path):
    from test_summary import make_run

    from crl_bench.results.summary import build_summary

    run = make_run(tmp_path, "cases", method="casebank")
    assert build_summary(run)["model"]["extractor"] is None
    static = make_run(tmp_path, "static", method="static")
    assert build_summary(static)["model"]["extractor"] == "smollm2-135m-instruct"
