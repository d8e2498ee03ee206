"""Memory forms (``eval.controls``: ``raw``, ``condensed``, ``both``): the guided retrieval shown as the
episodes its entries come from, as what was distilled from them, or both, on the same tasks.

The bank keeps each entry's raw case (``source_case``): checked on the bank (ADD, UPDATE, MERGE, the
merge pass, an older file), on the manager (the case a case bank would store for the episode), and on
the trainer's evaluation of ``diag-vault`` with a scripted extractor (the same entries as guided, each
shown as its episode, and the forms a kind does not have skipped with a reason).
"""

from __future__ import annotations

import json
import sqlite3
import uuid

import numpy as np
import pytest
from test_memory_controls import _collected, _diag_trainer

from crl_bench.experience.bank import ExperienceBank
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.types import Operation

EMB = HashEmbedder(32)


def _bank(tmp_path) -> ExperienceBank:
    return ExperienceBank(tmp_path / "bank.sqlite", EMB)


def _apply(bank, ops, case=""):
    return bank.apply(ops, env_id="e", step=1, extraction_id=uuid.uuid4().hex, extractor_version=0,
                      source_case=case)


# ---- the bank keeps each entry's raw case ---------------------------------------------------------------
def test_entries_keep_the_case_they_were_written_from(tmp_path):
    bank = _bank(tmp_path)
    _apply(bank, [Operation("ADD", "a", "lesson a")], case="task 1: Outcome: success")
    _apply(bank, [Operation("ADD", "b", "lesson b")], case="task 2: Outcome: failure")
    _apply(bank, [Operation("ADD", "c", "lesson c")])                     # no episode: no case
    a, b, c = bank.entries()
    assert (a.source_case, b.source_case, c.source_case) == ("task 1: Outcome: success",
                                                              "task 2: Outcome: failure", "")
    # an UPDATE from an episode keeps that episode's case; without one, its target's
    res = _apply(bank, [Operation("UPDATE", "a2", "lesson a2", (a.id,))], case="task 3: Outcome: success")
    assert bank.get([res.applied[0][1]])[0].source_case == "task 3: Outcome: success"
    res = _apply(bank, [Operation("UPDATE", "b2", "lesson b2", (b.id,))])
    assert bank.get([res.applied[0][1]])[0].source_case == "task 2: Outcome: failure"
    # a MERGE without an episode: its first target that has a case
    c_id, b2_id = c.id, res.applied[0][1]
    res = _apply(bank, [Operation("MERGE", "m", "merged", (c_id, b2_id))])
    merged = res.applied[0][1]
    assert bank.get([merged])[0].source_case == "task 2: Outcome: failure"
    # the merge pass (fold): the case of the first removed entry that has one
    ids = [e.id for e in bank.entries()]
    assert [bank.get([i])[0].source_case for i in ids] == ["task 3: Outcome: success", "task 2: Outcome: failure"]
    new = bank.replace("e", ids, [("f", "folded")], step=2, extraction_id="x", extractor_version=0)
    assert bank.get(new)[0].source_case == "task 3: Outcome: success"
    new = bank.replace("e", new, [("g", "folded again")], step=3, extraction_id="y", extractor_version=0)
    assert bank.get(new)[0].source_case == "task 3: Outcome: success"
    bank.close()


def test_banks_without_the_case_column_read_as_no_case(tmp_path):
    bank = _bank(tmp_path)
    _apply(bank, [Operation("ADD", "old", "an entry of an older bank")], case="x: y")
    path = bank.path
    bank.close()
    with sqlite3.connect(path) as c:
        c.execute("ALTER TABLE entries DROP COLUMN source_case")
    c.close()
    ro = ExperienceBank(path, EMB, read_only=True)
    assert ro.entries()[0].source_case == ""
    ro.close()
    bank = _bank(tmp_path)                                    # migrated when opened for writing
    _apply(bank, [Operation("ADD", "new", "a new entry")], case="task: Outcome: success")
    assert [e.source_case for e in bank.entries()] == ["", "task: Outcome: success"]
    bank.close()


def test_the_manager_stores_the_case_a_case_bank_would(tmp_path, tokenizer):
    from test_manager import ADD as LINE_ADD
    from test_manager import CannedExtractor

    from crl_bench.experience.cases import case_text
    from crl_bench.experience.manager import DistillRequest, ExperienceManager
    from crl_bench.experience.retrieval import Retriever
    from crl_bench.experience.transcripts import EpisodeRecord

    record = EpisodeRecord("e", "open the vault", steps=[("a locked vault", "turn dial", "it clicks")],
                           success=True, reward=1.0)
    bank = _bank(tmp_path)
    manager = ExperienceManager(bank, Retriever(bank), CannedExtractor([LINE_ADD]), case_tokenizer=tokenizer,
                                case_tokens=64)
    try:
        manager.submit([DistillRequest(record, [], "e", step=1)])
        assert manager.drain(timeout=60)
    finally:
        manager.close()
    title, content = case_text(record, tokenizer, 64)
    (entry,) = bank.entries()
    assert entry.content == "Call heads." and entry.source_case == f"{title}: {content}"
    assert "turn dial" in entry.source_case and "success" in entry.source_case
    bank.close()


# ---- what each form shows ---------------------------------------------------------------------------------
def test_lesson_forms_show_the_episode_instead_of_or_beside_the_lesson():
    from crl_bench.experience.cases import CASES_HEADER
    from crl_bench.experience.lessons import BOTH_HEADER, form_block
    from crl_bench.experience.types import ExperienceEntry

    with_case = ExperienceEntry(1, "e", "Vault", "Turn the dial.", source_case="open it: Outcome: success\nStep 1")
    without = ExperienceEntry(2, "e", "Door", "Knock first.")
    raw = form_block([without, with_case], "raw")
    assert raw.startswith(CASES_HEADER) and "1. open it: Outcome: success Step 1" in raw
    assert "Turn the dial" not in raw and "Knock" not in raw and "2." not in raw
    both = form_block([with_case, without], "both")
    assert both.startswith(BOTH_HEADER)
    assert both.splitlines()[2:] == ["1. Vault: Turn the dial.", "   Episode: open it: Outcome: success Step 1",
                                     "2. Door: Knock first."]
    assert form_block([without], "raw") == ""
    with pytest.raises(ValueError, match="raw and both"):
        form_block([with_case], "condensed")


def test_insight_forms_split_the_guided_block(tmp_path):
    from crl_bench.config import build_config, preset_data
    from crl_bench.experience.cases import CASES_HEADER
    from crl_bench.experience.insights import INSIGHTS_HEADER, InsightsMemory
    from crl_bench.experience.types import ExperienceEntry

    class Manager:
        def insights(self, env_ids):
            return {"e": [type("I", (), {"text": "Push boxes away from walls.", "importance": 2, "id": 1})()]}

    mem = InsightsMemory(build_config([preset_data("smoke"), {"method": "expel"}]))
    case = ExperienceEntry(1, "e", "a task", "Outcome: success (reward 1.00) after 1 steps")
    guided = mem.guidance(Manager(), ["e"], ["1. a task: Outcome: success (reward 1.00) after 1 steps"])[0]
    raw, = mem.form_guidance(Manager(), "raw", ["e"], [[case]])
    condensed, = mem.form_guidance(Manager(), "condensed", ["e"], [[case]])
    assert INSIGHTS_HEADER in guided and CASES_HEADER in guided
    assert raw.startswith(CASES_HEADER) and INSIGHTS_HEADER not in raw and raw in guided
    assert condensed.startswith(INSIGHTS_HEADER) and CASES_HEADER not in condensed and condensed in guided
    with pytest.raises(ValueError, match="raw and condensed"):
        mem.form_guidance(Manager(), "both", ["e"], [[case]])


# ---- the trainer's evaluation ----------------------------------------------------------------------------
FORMS = {"controls": ["shuffled", "empty", "raw", "condensed", "both"]}


def test_raw_and_both_show_the_guided_retrieval_as_its_episodes(tokenizer, tiny_model):
    from crl_bench.experience.cases import CASES_HEADER
    from crl_bench.experience.lessons import BOTH_HEADER

    tr = _diag_trainer(tokenizer, tiny_model, eval={"episodes": 8, **FORMS})
    assert tr.evaluator.modes == ["guided", "shuffled", "empty", "raw", "both", "free"]
    assert tr.evaluator.skipped_controls() == {
        "condensed": "memory 'lessons' shows forms raw, both apart from guided"}
    tr.train_step()
    tr.experience.flush()
    entries = tr.experience.bank.entries("diag-vault")
    assert entries and all(e.source_case for e in entries)
    # each entry's case is an episode of the vault, as a case bank would have written it
    assert all(": Outcome: " in e.source_case and "Step 1: " in e.source_case for e in entries)
    calls = _collected(tr)
    shown = {}
    for mode in ("guided", "raw", "both"):
        ev = tr.evaluator.evaluate(mode=mode)
        assert ev["mode"] == mode and ev["guided"] is True
        shown[mode] = {int(t.task): (tuple(t.experience_ids), t.guidance) for t in calls[-1]}
    assert any(ids for ids, _ in shown["guided"].values())
    by_id = {e.id: e for e in entries}
    for task, (ids, text) in shown["guided"].items():
        raw_ids, raw_text = shown["raw"][task]
        both_ids, both_text = shown["both"][task]
        assert raw_ids == ids == both_ids                       # the same retrieval in every form
        if not ids:
            assert raw_text == both_text == ""
            continue
        assert "Turn the dial to the key." in text and "Turn the dial to the key." not in raw_text
        assert raw_text.startswith(CASES_HEADER) and both_text.startswith(BOTH_HEADER)
        for i in ids:
            case = " ".join(by_id[i].source_case.split())
            assert case in raw_text and case in both_text and case not in text
    with pytest.raises(ValueError, match="no 'condensed' form|shows forms"):
        tr.evaluator.evaluate(mode="condensed")
    tr.close()


def test_evaluate_all_records_the_forms_it_skipped(tokenizer, tiny_model):
    tr = _diag_trainer(tokenizer, tiny_model, eval={"episodes": 2, **FORMS})
    tr.train_step()
    ev = tr.evaluator.evaluate_all()
    assert [m for m in ("guided", "shuffled", "empty", "raw", "condensed", "both", "free") if m in ev] == \
        ["guided", "shuffled", "empty", "raw", "both", "free"]
    assert list(ev["controls_skipped"]) == ["condensed"]
    assert len({json.dumps(ev[m]["tasks"]) for m in ("guided", "raw", "both", "free")}) == 1
    tr.close()


def test_a_case_bank_has_no_form_apart_from_guided(tokenizer, tiny_model):
    from tests_helpers import coin_config

    from crl_bench.trainer.loop import Trainer

    cfg = coin_config("casebank", rollout={"mix": "diag-vault", "max_steps": 2},
                      eval={"episodes": 2, "lesson_follow": 0, **FORMS})
    tr = Trainer(cfg, model=tiny_model, tokenizer=tokenizer, embedder=HashEmbedder(64))
    assert tr.evaluator.modes == ["guided", "shuffled", "empty", "free"]
    assert set(tr.evaluator.skipped_controls()) == {"raw", "condensed", "both"}
    with pytest.raises(ValueError, match="shows forms none"):
        tr.evaluator.evaluate(mode="raw")
    tr.close()


# ---- the leaderboard --------------------------------------------------------------------------------------
def test_the_leaderboard_pairs_each_form_with_guided(tmp_path):
    from test_memory_controls import ENV, _block, _run_with_controls

    from crl_bench.results.headline import headline_frame, headline_markdown
    from crl_bench.results.leaderboard import collect, leaderboard_frame

    for seed, (guided, raw) in enumerate([([1, 1, 0, 1], [0, 1, 0, 0]), ([1, 0, 1, 1], [1, 0, 0, 0])]):
        d = _run_with_controls(tmp_path, f"s{seed}", seed, guided, [0, 0, 0, 0])
        ev = json.loads((d / "eval.json").read_text())
        ev["raw"], ev["both"] = _block(raw), _block(guided)
        (d / "eval.json").write_text(json.dumps(ev))
    df = leaderboard_frame(collect([tmp_path]))
    assert sorted(df["eval"]) == ["both", "free", "guided", "raw", "shuffled"]
    g = df.set_index("eval").loc["guided"]
    assert g["lift_raw"] == pytest.approx(((1 + 0 + 0 + 1) / 4 + (0 + 0 + 1 + 1) / 4) / 2)
    assert g["lift_both"] == pytest.approx(0.0) and np.isnan(g["lift_condensed"])
    assert g["lift_raw_ci_low"] <= g["lift_raw"] <= g["lift_raw_ci_high"]
    head = headline_frame(df)
    assert head.iloc[0]["raw"] == pytest.approx(df.set_index("eval").loc["raw", "overall_mean"])
    text = "\n".join(headline_markdown(head))
    assert "Memory forms" in text and "guided − raw [95% CI]" in text and f"| {ENV}" not in text
    row = next(line for line in text.splitlines() if line.startswith("| complementary") and "+0.500" in line)
    assert "| - |" in row                                    # no condensed form
