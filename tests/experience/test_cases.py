"""The case bank's writer (crl_bench/experience/cases.py): a finished episode becomes one entry, its
title the task and its content the outcome and the compacted trajectory, written and retrieved through
the experience manager as every bank entry is."""

import pytest
import torch

from crl_bench.config import build_config, preset_data
from crl_bench.experience.cases import CaseWriter, case_text
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.extractor import EpisodeRecord
from crl_bench.experience.lessons import merge_pass
from crl_bench.experience.manager import DistillRequest, build_manager


def _record(task="Push the box onto the target.", success=True, reward=1.0, steps=None, env_id="sokoban"):
    steps = steps if steps is not None else [
        ("You see a box.\nValid actions: up, down, left, right", "up", "You moved up."),
        ("Box near.", "left", ""),
    ]
    return EpisodeRecord(env_id=env_id, task_prompt=task, steps=steps, success=success, reward=reward,
                         final_obs="Box on target.", group_id=3, source=(3, 1))


def test_case_text_is_the_task_the_outcome_and_the_steps(tokenizer):
    title, content = case_text(_record(), tokenizer, 256)
    assert title == "Push the box onto the target."
    # the observations lose the "Valid actions:" line every observation repeats
    assert content == ("Outcome: success (reward 1.00) after 2 steps\n"
                       "Start:\nYou see a box.\n"
                       "Step 1: up -> You moved up.\n"
                       "Before step 2:\nBox near.\n"
                       "Step 2: left\n"
                       "After the last step:\nBox on target.")


def test_case_trajectory_keeps_to_its_token_budget(tokenizer):
    steps = [(f"Room {i}: a long corridor with doors to the north and the south.", "north", f"You walk ({i}).")
             for i in range(40)]
    _, content = case_text(_record(steps=steps), tokenizer, 64)
    outcome, body = content.split("\n", 1)
    assert outcome == "Outcome: success (reward 1.00) after 40 steps"
    assert len(tokenizer.encode(body, add_special_tokens=False)) <= 64
    assert "Step 40: north" in body                    # the last action is kept


def test_writer_stores_successes_by_default_and_failures_on_request(tokenizer):
    ok, failed = _record(), _record(success=False, reward=0.0)
    only = CaseWriter(tokenizer, 128).extract([ok, failed])
    assert [x.parse.ops[0].kind for x in only] == ["ADD", "NONE"]
    assert all(x.kind == "case" and not x.response_ids and x.group_id == 3 for x in only)
    both = CaseWriter(tokenizer, 128, outcomes="all").extract([ok, failed])
    assert [x.parse.ops[0].kind for x in both] == ["ADD", "ADD"]
    assert both[1].parse.ops[0].content.startswith("Outcome: failure (reward 0.00) after 2 steps")
    assert CaseWriter(tokenizer, 128, outcomes="all").extract([_record(steps=[])])[0].parse.ops[0].kind == "NONE"


@pytest.mark.parametrize("kwargs", [{"outcomes": "failures"}, {"max_tokens": 0}])
def test_writer_refuses_bad_settings(tokenizer, kwargs):
    with pytest.raises(ValueError):
        CaseWriter(tokenizer, **{"max_tokens": 64, **kwargs})


def _manager(tmp_path, tokenizer, **experience):
    cfg = build_config([preset_data("smoke"), {"method": "casebank", "rollout": {"mix": "sokoban"},
                                                "experience": experience}])
    return build_manager(cfg, tmp_path / "experience.sqlite", None, tokenizer, compute_dtype=torch.float32,
                         embedder=HashEmbedder(64))


RED = "Goal: open the red door with the red key."
LAMP = "Goal: light the blue lamp in the cellar."


def _request(task, action, step=1):
    rec = _record(task=task, steps=[("A room.", action, "Done.")], env_id="minihack-room")
    return DistillRequest(rec, [], "minihack-room", step, key_text=task)


def test_manager_writes_cases_and_retrieves_the_most_similar(tmp_path, tokenizer):
    m = _manager(tmp_path, tokenizer)
    assert isinstance(m.extractor, CaseWriter)
    m.submit([_request(RED, "open red door"), _request(LAMP, "light lamp")])
    assert m.drain(timeout=30)
    assert len(m.bank.entries()) == 2
    (found,) = m.retrieve([("minihack-room", RED + " Then leave.")], count_retrievals=False)
    assert [e.title for e in found] == [RED]
    assert "Step 1: open red door -> Done." in found[0].content
    # the search tool's answer is the retrieved case itself: there is no model to answer with
    (answer,) = m.answer([("minihack-room", "How do I light the blue lamp?")], count_retrievals=False)
    assert answer.extraction is None and "light lamp" in answer.text and LAMP in answer.text
    with pytest.raises(RuntimeError, match="no extractor model"):
        merge_pass(m, step=2)
    m.close()


def test_case_bank_capacity_evicts_the_oldest_case(tmp_path, tokenizer):
    m = _manager(tmp_path, tokenizer, capacity=1, eviction="fifo")
    m.submit([_request(RED, "open red door")])
    assert m.drain(timeout=30)
    m.submit([_request(LAMP, "light lamp", step=2)])
    assert m.drain(timeout=30)
    assert [e.title for e in m.bank.entries()] == [LAMP]
    m.close()


def test_an_episode_is_not_shown_its_own_tasks_case(tmp_path, tokenizer):
    # ExpeL's retrieval (agent/expel.py topk_docs) skips the current task and tasks already chosen
    m = _manager(tmp_path, tokenizer, k=2)
    assert m.retriever.skip_same_key
    m.submit([_request(RED, "open red door"), _request(RED, "open red door again", step=2),
              _request(RED + " And the blue one.", "open both"), _request(LAMP, "light lamp")])
    assert m.drain(timeout=30)
    for count in (True, False):                  # training and evaluation alike
        (found,) = m.retrieve([("minihack-room", RED)], count_retrievals=count)
        assert sorted(e.title for e in found) == sorted([RED + " And the blue one.", LAMP])
    # one case per task: the two cases of RED are one candidate
    (found,) = m.retrieve([("minihack-room", RED + " Quickly.")], count_retrievals=False)
    assert [e.title for e in found].count(RED) == 1 and len(found) == 2
    m.close()
    every = _manager(tmp_path / "all", tokenizer, k=2, cases={"skip_own": False})
    assert not every.retriever.skip_same_key
    every.submit([_request(RED, "open red door"), _request(LAMP, "light lamp")])
    assert every.drain(timeout=30)
    assert [e.title for e in every.retrieve([("minihack-room", RED)], count_retrievals=False)[0]][0] == RED
    every.close()


def test_the_own_tasks_many_cases_do_not_crowd_out_the_others(tmp_path):
    # 20 cases of RED fill the 16 nearest; the search is widened, so LAMP's case is still found
    from crl_bench.experience.bank import ExperienceBank
    from crl_bench.experience.retrieval import Retriever
    from crl_bench.experience.types import Operation

    bank = ExperienceBank(tmp_path / "b.sqlite", HashEmbedder(64))
    for n in range(20):
        bank.apply([Operation("ADD", RED, f"case {n}")], env_id="room", step=1, extraction_id=f"x{n}",
                   extractor_version=0, key_text=RED)
    bank.apply([Operation("ADD", LAMP, "lamp case")], env_id="room", step=1, extraction_id="y",
               extractor_version=0, key_text=LAMP)
    r = Retriever(bank, k=1, oversample=16, seed=0, skip_same_key=True)
    assert [e.title for e in r.retrieve([RED], ["room"], count_retrievals=False)[0]] == [LAMP]
    bank.close()
