"""The ``expel`` method in the training loop: a frozen extractor edits the env's insight list from
the step's success/failure pairs, successes become cases, and guided episodes are shown the insights
above the most similar case."""

import copy

import pytest
from tests_helpers import CoinEnv, ScriptedReplies, coin_config, replay_from_checkpoint

from crl_bench.config import ConfigError
from crl_bench.env_api import register_env
from crl_bench.experience.cases import CASES_HEADER
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.insights import INSIGHTS_HEADER, InsightWriter
from crl_bench.experience.memory import GUIDANCE_HEADER
from crl_bench.methods import get_method
from crl_bench.trainer.loop import Trainer

RULE = "Call heads: tails always loses."


def rule_reply(prompt):
    """Adds :data:`RULE` when the list is empty, upvotes insight 1 after that."""
    return f"UPVOTE 1: {RULE}" if "1. Call heads" in prompt.rsplit("Game: ", 1)[1] else f"ADD: {RULE}"


@pytest.fixture(autouse=True)
def _coin():
    register_env("test-coin", CoinEnv)


def _trainer(tokenizer, tiny_model, **extra):
    tr = Trainer(coin_config("expel", **extra), model=tiny_model, tokenizer=tokenizer, embedder=HashEmbedder(64),
                 extractor_model=copy.deepcopy(tiny_model))
    engine = ScriptedReplies(tokenizer, rule_reply)
    tr.experience.extractor.engine = engine
    return tr, engine


def test_expel_method_spec():
    m = get_method("expel")
    assert m.uses_experience and m.uses_extractor and not m.trains_extractor
    assert m.memory == "insights"


def test_expel_writes_insights_and_guides_with_them(tokenizer, tiny_model):
    # every coin task has one retrieval query: its cases are shown only with skip_own off
    tr, engine = _trainer(tokenizer, tiny_model, experience={"cases": {"skip_own": False}})
    track = tr.experience
    assert isinstance(track.extractor, InsightWriter) and track.updater is None
    assert not any(p.requires_grad for p in track.model.parameters())         # frozen
    res1 = tr.train_step()                                                     # warm-up: fills bank and list
    by_group = {}
    for t in res1.trajectories:
        by_group.setdefault(t.group_id, []).append(t)
    mixed = sum(1 for g in by_group.values() if any(t.success for t in g) and not all(t.success for t in g))
    winners = sum(1 for g in by_group.values() if any(t.success for t in g))
    wins = [t for t in res1.trajectories if t.success]
    assert mixed >= 1, "the coin policy gives mixed groups"
    m1 = res1.metrics
    # one comparison per mixed group, one success list when two tasks had a success; cases: every win
    assert m1["insight_calls_step"] == mixed + (1 if winners >= 2 else 0)
    assert m1["bank_size"] == len(wins) and m1["insights"] == 1
    assert m1["insight_kinds"]["ADD"] == 1 and m1["insight_parse_rate"] == 1.0
    (ins,) = track.bank.insights("test-coin")
    assert ins.text == RULE and ins.importance == 2 + m1["insight_kinds"].get("UPVOTE", 0)
    compare = [p for p in engine.prompts if "A failed attempt" in p.rsplit("Game: ", 1)[1]]
    assert compare and "Step 1: heads" in compare[0].rsplit("Game: ", 1)[1]
    res2 = tr.train_step()
    guided = [t for t in res2.trajectories if t.subgroup == "guided"]
    assert guided and all(t.guidance.startswith(INSIGHTS_HEADER) and f"1. {RULE}" in t.guidance for t in guided)
    assert all(GUIDANCE_HEADER not in t.guidance for t in guided)
    # the case follows the insights, under its own header, where one was retrieved
    with_case = [t for t in guided if t.experience_ids]
    assert with_case and all(t.guidance.index(INSIGHTS_HEADER) < t.guidance.index(CASES_HEADER) for t in with_case)
    assert "merge_pass" not in res2.metrics
    assert track.empty_guidance == f"{INSIGHTS_HEADER}\n\n(no entries)\n\n{CASES_HEADER}\n\n(no entries)"
    tr.close()


def test_expel_without_success_lists(tokenizer, tiny_model):
    tr, engine = _trainer(tokenizer, tiny_model, experience={"insights": {"successes": 0, "pairs": 0}})
    res = tr.train_step()
    assert res.metrics["insight_calls_step"] == 0 and not engine.prompts and res.metrics["insights"] == 0
    tr.close()


@pytest.mark.parametrize("key, value", [("successes", 1), ("ops", 0), ("pairs", -1)])
def test_expel_settings_are_checked(key, value):
    with pytest.raises(ConfigError, match=f"experience.insights.{key}"):
        coin_config("expel", experience={"insights": {key: value}})


def test_expel_refuses_turn_integration():
    with pytest.raises(ConfigError, match="experience.integration"):
        coin_config("expel", experience={"integration": "turn"})


def test_expel_summary_names_the_extractor(tmp_path):
    from test_summary import make_run

    from crl_bench.results.summary import build_summary

    run = make_run(tmp_path, "expel", method="expel")
    assert build_summary(run)["model"]["extractor"] == "smollm2-135m-instruct"


def test_a_resumed_expel_run_takes_the_same_next_steps(tmp_path, tokenizer, tiny_model):
    """Two steps, a checkpoint, two more; a trainer restored from the checkpoint takes the same two
    steps, and its bank ends with the same cases and the same insight list (counts included)."""
    from test_resume import _bank_rows, _computed

    from crl_bench.experience.bank import ExperienceBank
    from crl_bench.results.run_folder import RunWriter

    def make(run_dir):
        cfg = coin_config("expel", train={"steps": 4, "lr_warmup_steps": 2, "seed": 1}, model={"dtype": "float32"},
                          experience={"recency_window_s": 0})
        writer = RunWriter(run_dir.parent, run_dir.name) if not run_dir.exists() else RunWriter.reopen(run_dir)
        tr = Trainer(cfg, writer=writer, model=copy.deepcopy(tiny_model), tokenizer=tokenizer,
                     embedder=HashEmbedder(64), extractor_model=copy.deepcopy(tiny_model))
        tr.experience.extractor.engine = ScriptedReplies(tokenizer, rule_reply)
        return tr

    a, b = replay_from_checkpoint(make, tmp_path, _computed)
    b_dir = b.writer.dir
    assert _bank_rows(a.writer.dir / "experience.sqlite") == _bank_rows(b_dir / "experience.sqlite")
    lists = []
    for d in (a.writer.dir, b_dir):
        with ExperienceBank.open_readonly(d / "experience.sqlite") as bank:
            lists.append([(i.id, i.text, i.importance, i.updated_step) for i in bank.insights()])
    assert lists[0] == lists[1] and lists[0] and lists[0][0][2] > 2      # upvoted after it was added
