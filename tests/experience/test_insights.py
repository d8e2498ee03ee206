"""ExpeL insight lists: the reply format, the importance arithmetic (hand-computed), the bank's
storage, the prompt and the manager's insight calls (crl_bench/experience/insights.py)."""

import sqlite3

import pytest
from tests_helpers import ScriptedReplies

from crl_bench.config import ConfigError, build_config, preset_data
from crl_bench.experience.bank import ExperienceBank
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.extractor import EpisodeRecord
from crl_bench.experience.insights import (
    DEMO_INSIGHTS,
    DEMO_RULE,
    INSIGHT_FULL_NOTE,
    INSIGHT_INIT,
    Insight,
    InsightOp,
    InsightPromptBuilder,
    InsightRequest,
    InsightWriter,
    insight_writer_for,
    parse_insight_ops,
)
from crl_bench.experience.manager import ExperienceManager
from crl_bench.experience.retrieval import Retriever
from crl_bench.llm.base import SamplingParams


def _bank(tmp_path, name="b.sqlite"):
    return ExperienceBank(tmp_path / name, HashEmbedder(32))


# ---- the reply format -------------------------------------------------------------------------------
def test_parse_reads_the_four_operations_and_the_released_names():
    reply = ("ADD: Read the map before moving.\n"
             "EDIT 2: Walls block every move into them.\n"
             "UPVOTE 1\n"
             "REMOVE 3: the old rule\n")
    p = parse_insight_ops(reply, shown=3)
    assert p.ops == [InsightOp("ADD", 0, "Read the map before moving."),
                     InsightOp("EDIT", 2, "Walls block every move into them."),
                     InsightOp("UPVOTE", 1), InsightOp("DOWNVOTE", 3)]
    assert p.errors == [] and p.valid
    # AGREE is the released name of UPVOTE; a number after ADD (released "ADD 4:") is ignored
    p = parse_insight_ops("AGREE 1: some rule\nADD 4: Keep away from the water.", shown=1)
    assert p.ops == [InsightOp("UPVOTE", 1), InsightOp("ADD", 0, "Keep away from the water.")]


def test_parse_refuses_what_is_not_a_valid_operation():
    reply = ("Here are my thoughts\n"            # not an operation
             "UPVOTE 4\n"                        # only 3 shown
             "EDIT: no number given here\n"      # EDIT needs a number
             "ADD: short\n"                      # not a rule
             "UPVOTE 1\n"
             "DOWNVOTE 1\n"                      # insight 1 named twice
             "ADD: Go north when the stairs are north.\n"
             "ADD: Go south when the stairs are south.\n"
             "ADD: Go east when the stairs are east.\n"
             "ADD: Go west when the stairs are west.\n")   # the fifth operation
    p = parse_insight_ops(reply, shown=3, max_ops=4)
    assert [o.kind for o in p.ops] == ["UPVOTE", "ADD", "ADD", "ADD"]
    assert len(p.errors) == 6
    assert any("more than 4" in e for e in p.errors) and any("named twice" in e for e in p.errors)
    assert not parse_insight_ops("nothing useful", shown=0).valid
    # a rule copied from the prompt's worked example or format lines is not a rule the attempts taught
    near = "Find the exit on the map first and move towards the exit."      # the 135M model's copy
    p = parse_insight_ops(f"ADD: {DEMO_RULE}\nADD: A new general rule.\nEDIT 1: {near}", 1)
    assert not p.ops and all("copies the prompt" in e for e in p.errors) and len(p.errors) == 3
    assert parse_insight_ops("ADD: Move towards the stairs on the map.", 0).valid    # shares a few words only


# ---- the importance arithmetic ------------------------------------------------------------------------
def test_importance_counts_by_hand(tmp_path):
    bank = _bank(tmp_path)
    r = bank.apply_insights([InsightOp("ADD", 0, "Rule A: read the map."), InsightOp("ADD", 0, "Rule B: go north.")],
                            [], env_id="e", step=1, call_id="c1")
    assert len(r.applied) == 2 and not r.rejected
    a, b = sorted(bank.insights("e"), key=lambda i: i.id)
    assert (a.importance, b.importance) == (INSIGHT_INIT, INSIGHT_INIT) == (2, 2)
    shown = bank.insights("e")                               # ties: oldest first -> [A, B]
    assert [i.id for i in shown] == [a.id, b.id]
    # UPVOTE 1 (A: 2 + 1 = 3), DOWNVOTE 2 (B: 2 - 1 = 1)
    bank.apply_insights([InsightOp("UPVOTE", 1), InsightOp("DOWNVOTE", 2)], shown, env_id="e", step=2, call_id="c2")
    got = {i.id: i.importance for i in bank.insights("e")}
    assert got == {a.id: 3, b.id: 1}
    shown = bank.insights("e")                               # most important first -> [A, B]
    # DOWNVOTE 2 removes B (1 - 1 = 0); EDIT 1 rewrites A and adds 1 (4); an ADD repeating A's new
    # text (case, spaces and the full stop aside) is dropped
    r = bank.apply_insights([InsightOp("ADD", 0, "rule  a: read the MAP first"),
                             InsightOp("EDIT", 1, "Rule A: read the map first."), InsightOp("DOWNVOTE", 2)],
                            shown, env_id="e", step=3, call_id="c3")
    assert r.removed == [b.id]
    assert [(op.kind, reason) for op, reason in r.rejected] == [("ADD", "duplicate")]
    (a2,) = bank.insights("e")
    assert (a2.id, a2.text, a2.importance, a2.updated_step, a2.source_call) == \
        (a.id, "Rule A: read the map first.", 4, 3, "c3")
    # an EDIT that changes nothing counts as an UPVOTE (5); a number naming a removed insight is gone
    r = bank.apply_insights([InsightOp("EDIT", 1, "rule a: read the map first"), InsightOp("UPVOTE", 2)],
                            shown, env_id="e", step=4, call_id="c4")
    assert [op.kind for op, _ in r.applied] == ["UPVOTE"]
    assert [(op.number, reason) for op, reason in r.rejected] == [(2, "gone")]
    assert bank.insights("e")[0].importance == 5 and bank.insights("e")[0].text == "Rule A: read the map first."
    st = bank.stats()["insights"]
    assert st == {"count": 1, "per_env": {"e": 1}, "importance_sum": 5,
                  "applied": {"ADD": 2, "EDIT": 1, "UPVOTE": 2, "DOWNVOTE": 2}, "removed": 1}
    assert [x["reason"] for x in bank.rejections()] == ["duplicate", "gone"]
    bank.close()


def test_operations_name_insights_by_text_as_released(tmp_path):
    # released update_rules (LeapLabTHU/ExpeL agent/expel.py), run on this reply and list, ends with
    # [("Read the map first.", 4), ("Keep away from water.", 2), ("Go north.", 1)]: a vote names the
    # first rule its text contains (its number is not read), an EDIT containing a rule is an AGREE of
    # it, an ADD containing a rule is dropped, a vote quoting no rule is dropped
    reply = ("REMOVE 1: Go north.\n"
             "AGREE 2: Read the map first.\n"
             "EDIT 2: Always Read the map first. Then act.\n"
             "ADD: Go north. Also keep away from water.\n"
             "AGREE 1: Something that is not on the list.\n"
             "ADD: Keep away from water.\n")
    p = parse_insight_ops(reply, shown=2, max_ops=6, match="text")
    assert not p.errors and all(op.by_text for op in p.ops)
    assert p.ops[0] == InsightOp("DOWNVOTE", 1, "Go north.", by_text=True)
    assert parse_insight_ops("UPVOTE 1", shown=2, match="text").errors      # a vote must quote its insight
    bank = _bank(tmp_path)
    bank.apply_insights([InsightOp("ADD", 0, "Read the map first."), InsightOp("ADD", 0, "Go north.")], [],
                        env_id="e", step=1, call_id="c1")
    shown = bank.insights("e")
    r = bank.apply_insights(p.ops, shown, env_id="e", step=2, call_id="c2")
    assert [(i.text, i.importance) for i in bank.insights("e")] == \
        [("Read the map first.", 4), ("Keep away from water.", 2), ("Go north.", 1)]
    assert sorted((op.kind, reason) for op, reason in r.rejected) == [("ADD", "duplicate"), ("UPVOTE", "unknown_text")]
    # by number (experience.insights.match: number) the same reply reads differently
    by_number = parse_insight_ops(reply, shown=2, max_ops=6)
    assert [op.number for op in by_number.ops if op.kind != "ADD"] == [1, 2] and len(by_number.errors) == 2
    bank.close()


def test_expel_runs_name_insights_by_text_by_default(tokenizer):
    cfg = build_config([preset_data("smoke"), {"method": "expel", "rollout": {"mix": "sokoban"}}])
    assert cfg.experience.insights.match == "text"
    writer = insight_writer_for(cfg, object(), tokenizer)
    assert writer.prompts.match == "text"
    text = tokenizer.decode(writer.prompts.build("room", [], [_rec(1, ["north"], True)], [_rec(1, ["west"], False)]))
    assert "UPVOTE 1: insight 1 copied word for word" in text and f"UPVOTE 1: {DEMO_INSIGHTS[0].text}" in text
    number = build_config([preset_data("smoke"), {"method": "expel", "rollout": {"mix": "sokoban"},
                                                  "experience": {"insights": {"match": "number"}}}])
    assert insight_writer_for(number, object(), tokenizer).prompts.match == "number"
    with pytest.raises(ConfigError, match="experience.insights.match"):
        build_config([preset_data("smoke"), {"experience": {"insights": {"match": "words"}}}])


def test_lists_are_per_env_and_persist(tmp_path):
    bank = _bank(tmp_path)
    bank.apply_insights([InsightOp("ADD", 0, "Rule of env one.")], [], env_id="one", step=1, call_id="x")
    bank.apply_insights([InsightOp("ADD", 0, "Rule of env two.")], [], env_id="two", step=1, call_id="y")
    two = bank.insights("two")
    # a number refers to the list the call was shown: env one's insight cannot be voted through env two
    r = bank.apply_insights([InsightOp("UPVOTE", 1)], bank.insights("one"), env_id="two", step=2, call_id="z")
    assert r.rejected and bank.insights("one")[0].importance == 2
    bank.close()
    ro = ExperienceBank.open_readonly(tmp_path / "b.sqlite")
    assert [i.text for i in ro.insights("one")] == ["Rule of env one."] and ro.insights("two") == two
    with pytest.raises(PermissionError):
        ro.apply_insights([InsightOp("ADD", 0, "Another rule here.")], [], env_id="one", step=3, call_id="w")
    ro.close()


def test_a_bank_written_before_insights_has_none(tmp_path):
    bank = _bank(tmp_path)
    bank.close()
    c = sqlite3.connect(tmp_path / "b.sqlite")
    c.execute("DROP TABLE insights")
    c.commit()
    c.close()
    ro = ExperienceBank.open_readonly(tmp_path / "b.sqlite")
    assert ro.insights() == [] and ro.stats()["insights"]["count"] == 0
    ro.close()


# ---- the prompt ---------------------------------------------------------------------------------------
def _rec(task, actions, success):
    steps = [(f"You are in a room. Task {task}.", a, "fine") for a in actions]
    return EpisodeRecord(env_id="room", task_prompt=f"Task {task}", steps=steps, success=success,
                         reward=1.0 if success else 0.0)


def test_comparison_prompt_shows_the_list_and_both_attempts(tokenizer):
    b = InsightPromptBuilder(tokenizer, max_prompt_tokens=1024, full_at=2)
    ins = [Insight(7, "room", "Walk towards the stairs.", 3)]
    text = tokenizer.decode(b.build("room", ins, [_rec(1, ["north"], True)], [_rec(1, ["west", "west"], False)]))
    user = text.rsplit("Game: room", 1)[1]                  # after the worked example
    assert "1. Walk towards the stairs." in user
    assert "A successful attempt:" in user and "A failed attempt at the same task:" in user
    assert user.index("Step 1: north") < user.index("Step 1: west") and "Outcome: failure" in user
    assert INSIGHT_FULL_NOTE not in user
    full = tokenizer.decode(b.build("room", ins * 2, [_rec(1, ["north"], True)], [_rec(1, ["west"], False)]))
    assert INSIGHT_FULL_NOTE in full.rsplit("Game: room", 1)[1]
    # successes of different tasks, and a budget that long trajectories must fit
    long = [_rec(t, ["north"] * 60, True) for t in range(4)]
    ids = b.build("room", [], long)
    assert len(ids) <= 1024
    assert tokenizer.decode(ids).count("Successful attempt ") == 4
    with pytest.raises(ValueError):
        b.build("room", [], [])


# ---- the writer and the manager -----------------------------------------------------------------------
def _scripted(tokenizer, compare, successes):
    """Replies by what the prompt asks: a comparison gets ``compare``, a success list ``successes``."""
    return ScriptedReplies(tokenizer, lambda text: compare if "A failed attempt" in text.rsplit("Game: ", 1)[1]
                           else successes)


def test_manager_applies_comparisons_before_success_lists(tmp_path, tokenizer):
    bank = _bank(tmp_path)
    engine = _scripted(tokenizer, "ADD: Walk towards the stairs.", "UPVOTE 1")
    writer = InsightWriter(engine, tokenizer, InsightPromptBuilder(tokenizer, 1024), SamplingParams(temperature=0.0))
    m = ExperienceManager(bank, Retriever(bank), writer)
    succ = InsightRequest("room", 1, [_rec(1, ["north"], True), _rec(2, ["east"], True)])
    comp = InsightRequest("room", 1, [_rec(1, ["north"], True)], [_rec(1, ["west"], False)])
    m._process([succ, comp])            # one batch of the worker, the success list queued first
    (ins,) = m.insights(["room"])["room"]
    # the comparison's ADD (2) was on the list the success list was shown, which upvoted it (3)
    assert (ins.text, ins.importance) == ("Walk towards the stairs.", 3)
    outcomes = m.pop_insight_outcomes()
    assert [o.call.kind for o in outcomes] == ["compare", "successes"]
    assert [o.call.shown for o in outcomes][0] == [] and outcomes[1].call.shown[0].id == ins.id
    s = m.stats()
    assert (s["insight_calls"], s["insight_calls_failed"], s["insights"]) == (2, 0, 1)
    assert s["insight_kinds"] == {"ADD": 1, "UPVOTE": 1}
    # the worker path: submit, drain
    m.submit([InsightRequest("room", 2, [_rec(3, ["north"], True)], [_rec(3, ["south"], False)])])
    assert m.drain(30)
    assert m.stats()["insight_calls"] == 3
    assert m.stats()["insight_kinds"]["ADD"] == 1          # the same ADD again is a duplicate, rejected
    state = m.state_dict()
    m.close()
    bank.close()
    plain = ExperienceManager(_bank(tmp_path, "c.sqlite"), Retriever(_bank(tmp_path, "d.sqlite")))
    plain.load_state_dict(state)
    assert plain.stats()["insight_kinds"] == {"ADD": 1, "UPVOTE": 1}
    plain.close()


def test_only_an_insight_writer_takes_insight_requests(tmp_path, tokenizer):
    from crl_bench.experience.cases import CaseWriter

    bank = _bank(tmp_path)
    m = ExperienceManager(bank, Retriever(bank), CaseWriter(tokenizer))
    with pytest.raises(RuntimeError, match="insight"):
        m.submit([InsightRequest("room", 1, [_rec(1, ["north"], True)])])
    m.close()
    bank.close()
