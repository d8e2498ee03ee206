"""Mechanisms of the released Complementary RL code (pUmpKin-Co/ComplementaryRL @ab2574f, docs/method.md)
checked on a scripted extractor: the merge fold and when it runs, votes, fresh rewritten entries,
the warm-up schedule, the extractor's contract in the paper preset, the actor-critic inputs, turn-level
experience, the in-episode search tool, the training-count-aware reweighting, evaluation that writes
counters, raw-logit log-probs."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from tests_helpers import CoinEnv, coin_config

from crl_bench.config import ConfigError, build_config, preset_data
from crl_bench.env_api import register_env
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.extractor import EpisodeRecord, Extraction, extractor_for, full_transcript
from crl_bench.experience.lessons import merge_pass
from crl_bench.experience.manager import NO_KNOWLEDGE
from crl_bench.experience.operations import ParseResult
from crl_bench.experience.types import Operation
from crl_bench.llm.base import Generation
from crl_bench.trainer.evaluation import Evaluator
from crl_bench.trainer.loop import Trainer

ADD = "<op>ADD</op><title>Call heads</title><content>Heads wins the coin toss.</content>"


@pytest.fixture(autouse=True)
def _coin():
    register_env("test-coin", CoinEnv)


class ByPrompt:
    """An engine whose reply depends on the prompt text: ``reply(prompt_text) -> str`` (token ids from
    the real tokenizer; the prefill the builder put in the prompt is stripped from the reply)."""

    def __init__(self, tokenizer, reply, prefill=""):
        self.tokenizer = tokenizer
        self.reply = reply
        self.prefill = prefill
        self.prompts: list[str] = []

    def generate(self, prompts, params, allowed=None):
        out = []
        for p in prompts:
            text = self.tokenizer.decode(list(p))
            self.prompts.append(text)
            reply = self.reply(text)
            reply = reply[len(self.prefill):] if self.prefill and reply.startswith(self.prefill) else reply
            ids = self.tokenizer.encode(reply, add_special_tokens=False)
            out.append(Generation(list(p), ids, [-1.0] * len(ids), reply, "stop"))
        return out

    def sync_weights(self, model):
        pass


def _trainer(tokenizer, model, reply=lambda text: "<ops>\n" + ADD + "\n</ops>", method="complementary", **extra):
    tr = Trainer(coin_config(method, **extra), model=model, tokenizer=tokenizer, embedder=HashEmbedder(64),
                 extractor_model=copy.deepcopy(model))
    ex = tr.experience.extractor
    ex.engine = ByPrompt(tokenizer, reply, ex.prompts.prefill)
    return tr


def _seed(bank, env, n, step=0):
    for i in range(n):
        bank.apply([Operation("ADD", f"lesson {i}", f"Lesson number {i} of {env}: say heads.")], env_id=env, step=step,
                   extraction_id=f"seed-{env}-{i}", extractor_version=0)


def _fold_reply(lessons: int = 1, fail_on: str | None = None):
    """A merge-pass extractor: for a fold prompt, ``lessons`` lessons naming how many items it saw (or a
    garbage reply when the prompt holds ``fail_on``)."""
    def reply(text: str) -> str:
        if "Your lessons:" not in text:
            return "<ops>\n" + ADD + "\n</ops>"
        if fail_on and fail_on in text.split("Lessons:")[-1]:
            return "<ops>\n<op>ADD</op><title></title>"
        seen = len(re.findall(r"^\d+\. ", text.split("Lessons:")[-1], re.M))
        return "<ops>\n" + "\n".join(f"<op>ADD</op><title>merged {k}</title><content>Joined {seen} lessons into "
                                     f"one piece of advice number {k}.</content>" for k in range(lessons)) + "\n</ops>"
    return reply


# ---- 1. the merge pass as released: the fold -------------------------------------------------------

def test_fold_folds_an_env_down_to_one_calls_output_and_credits_the_last_call(tokenizer, tiny_model):
    """Released ``_merge_single_task``: chunks of merge.max, each call's lessons carried into the next
    chunk, every merged original deleted, only the last call's lessons remain; they credit that call."""
    tr = _trainer(tokenizer, tiny_model, reply=_fold_reply(1))
    track, bank = tr.experience, tr.experience.bank
    _seed(bank, "test-coin", 40)
    _seed(bank, "other", 3)
    _seed(bank, "lonely", 1)                       # a task with one entry is not merged
    merge_pass(track.manager, step=7, mode="fold", max_size=5)
    left = bank.entries("test-coin")
    assert len(left) == 1 and left[0].origin == "fold" and left[0].parent_ids == tuple(range(1, 41))
    assert left[0].content == "Joined 6 lessons into one piece of advice number 0."   # 5 originals + 1 carried
    assert len(bank.entries("other")) == 1 and len(bank.entries("lonely")) == 1
    outcomes = track.manager.pop_outcomes()
    calls = [o for o in outcomes if o.extraction.env_id == "test-coin"]
    assert len(calls) == 8 and all(o.extraction.kind == "merge" for o in outcomes)
    assert [o.wrote for o in calls] == [False] * 7 + [True]
    assert all(o.valid for o in calls)
    assert left[0].source_extraction == calls[-1].extraction.id
    # the chunk prompts: the first shows 5 lessons, every later one 5 + the lesson carried over
    prompts = [p for p in track.extractor.engine.prompts if "Your lessons:" in p and "test-coin" in p]
    counts = [len(re.findall(r"^\d+\. ", p.split("Lessons:")[-1], re.M)) for p in prompts]
    assert counts == [5] + [6] * 7
    st = track.manager.stats()
    assert (st["merge_passes"], st["merges"], st["merge_entries_in"], st["merge_entries_out"]) == (1, 9, 43, 2)
    assert bank.stats()["merge_pass"]["entries_written"] == 2 and bank.stats()["merge_pass"]["calls"] == 9
    # the merge call is credited when a guided episode uses the merged entry (the track takes it in)
    for o in outcomes:
        track.manager._finished.append(o)
    track._collect_extractions()
    assert calls[-1].extraction.id in track.waiting_reward
    tr.close()


@pytest.mark.parametrize("fmt", ["line", "json"])
def test_a_fold_keeps_every_lesson_it_returns(tokenizer, tiny_model, fmt):
    """The fold prompt names no limit and the released ``parse_answer_to_list`` keeps every item: a
    merge pass whose calls return 10 lessons leaves a 10-entry bank with those 10 lessons, not the
    distillation's operation cap (``extractor.max_ops`` 3) of them, in both answer formats."""
    def keep_ten(text: str) -> str:
        if "Your lessons:" not in text and "REPLACE ALL" not in text:
            return "<ops>\n" + ADD + "\n</ops>"
        lessons = [(f"kept {k}", f"Lesson {k} kept as it was, since every lesson still holds.") for k in range(10)]
        if fmt == "json":
            ops = [{"function_name": "add", "parameters": {"title": t, "content": c}} for t, c in lessons]
            return "<answer>" + json.dumps(ops) + "</answer>"
        return "<ops>\n" + "\n".join(f"<op>ADD</op><title>{t}</title><content>{c}</content>"
                                       for t, c in lessons) + "\n</ops>"

    tr = _trainer(tokenizer, tiny_model, reply=keep_ten, extractor={"format": fmt, "max_ops": 3})
    bank = tr.experience.bank
    _seed(bank, "test-coin", 10)
    merge_pass(tr.experience.manager, step=5, mode="fold", max_size=5)
    left = bank.entries("test-coin")
    assert sorted(e.title for e in left) == sorted(f"kept {k}" for k in range(10))
    assert all(e.origin == "fold" for e in left)
    tr.close()


def test_fold_keeps_failed_chunks_and_the_lessons_carried_into_them(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model, reply=_fold_reply(2, fail_on="lesson 17:"))
    track, bank = tr.experience, tr.experience.bank
    _seed(bank, "test-coin", 40)
    merge_pass(track.manager, step=3, mode="fold", max_size=5)
    left = bank.entries("test-coin")
    kept = [e for e in left if e.origin == "add"]
    made = [e for e in left if e.origin == "fold"]
    assert [e.title for e in kept] == [f"lesson {i}" for i in range(15, 20)]   # chunk 3 failed: kept
    # the two lessons carried into the failed chunk stay, and the last call's two lessons
    assert len(made) == 4 and len({e.source_extraction for e in made}) == 1
    assert set(made[0].parent_ids) == set(range(1, 41)) - set(range(16, 21))
    calls = [o for o in track.manager.pop_outcomes()]
    assert [o.applied is None for o in calls] == [False, False, False, True, False, False, False, False]
    assert made[0].source_extraction == calls[-1].extraction.id
    tr.close()


def test_fold_none_keeps_everything(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model, reply=lambda text: "<ops>\n<op>NONE</op>\n</ops>")
    bank = tr.experience.bank
    _seed(bank, "test-coin", 12)
    before = [(e.id, e.title) for e in bank.entries()]
    merge_pass(tr.experience.manager, step=1, mode="fold", max_size=5)
    assert [(e.id, e.title) for e in bank.entries()] == before
    assert all(o.valid and not o.wrote for o in tr.experience.manager.pop_outcomes())
    tr.close()


def test_merge_runs_at_step_start_after_the_flush_and_is_skipped_after_an_extractor_update(tokenizer, tiny_model):
    """Released: the merge runs at the start of every merging_interval-th step, after the pre-rollout
    flush (so it folds what the previous step distilled), and not at a step that starts with the
    extractor's (asynchronous) update still pending."""
    tr = _trainer(tokenizer, tiny_model, reply=_fold_reply(1),
                  experience={"merge": {"every": 2}, "warmup_train_steps": 9}, extractor={"batch_size": 64})
    rows = [tr.train_step().metrics for _ in range(3)]
    assert [r.get("merge_pass") for r in rows] == [None, None, 1]
    # the pass at the start of 0-based step 2 folded everything steps 0 and 1 distilled (4 ADDs each)
    assert rows[2]["merge_entries_in"] == 8 and rows[2]["merge_passes"] == 1
    assert tr.experience.bank.stats()["lineage"]["by_origin"]["fold"] == 1
    tr.experience.updated_at_step = 4            # as if the extractor was updated at the end of step 4
    assert tr.experience.before_rollout(4) == {"merge_pass": 0, "merge_skipped": 1}
    assert tr.experience.before_rollout(3) == {}
    tr.close()


def test_smoke_preset_runs_a_merge_pass(tokenizer, tiny_model):
    cfg = build_config([preset_data("smoke")])
    assert cfg.experience.merge.every == 1 and cfg.experience.merge.mode == "fold"
    tr = _trainer(tokenizer, tiny_model, reply=_fold_reply(1),
                  experience={"merge": {"every": cfg.experience.merge.every}})
    rows = [tr.train_step().metrics for _ in range(2)]
    assert rows[1]["merge_pass"] == 1 and rows[1]["merge_passes"] == 1
    tr.close()


# ---- 2 and 3. votes, fresh rewritten entries (bank tests: test_bank.py) ------------------------------

def test_votes_flow_from_the_reply_to_the_bank(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model)
    tr.train_step()                                    # warm-up: ADDs
    ids = [e.id for e in tr.experience.bank.entries()]
    tr.experience.extractor.engine.reply = lambda text: "<ops>\n<op>DOWNVOTE " + \
        " ".join(re.findall(r"^\[(\d+)\]", text.split("Current lessons:")[-1], re.M)) + "</op>\n</ops>"
    m = tr.train_step().metrics
    assert m["op_kinds"].get("DOWNVOTE", 0) >= 1 and m["deleted_by_vote"] >= 1
    gone = set(ids) - {e.id for e in tr.experience.bank.entries()}
    assert gone                                      # a new entry's first downvote deletes it (count -1)
    tr.close()


# ---- 4. warm-up as released -----------------------------------------------------------------------

def test_warmup_as_released_retrieves_one_step_before_it_trains(tokenizer, tiny_model):
    """memory_warmup_interval W: steps 0..W-1 retrieve nothing, steps 0..W neither train the actor nor
    credit the extractor (step W is guided); from W + 1 on everything runs."""
    tr = _trainer(tokenizer, tiny_model, experience={"warmup_steps": 2, "warmup_train_steps": -1})
    w = tiny_model.lm_head.weight.detach().clone()
    rows, trajs = [], []
    for _ in range(4):
        res = tr.train_step()
        rows.append(res.metrics)
        trajs.append(res.trajectories)
    guided = [[t for t in ts if t.subgroup == "guided"] for ts in trajs]
    assert [any(t.experience_ids for t in g) for g in guided] == [False, False, True, True]
    assert [r["warmup"] for r in rows] == [True, True, True, False]
    assert [r["optimizer_steps"] > 0 for r in rows] == [False, False, False, True]
    assert [r["extractions_credited"] for r in rows][:3] == [0, 0, 0] and rows[3]["extractions_credited"] > 0
    assert not torch.equal(w, tiny_model.lm_head.weight)
    assert not tr.trains(2) and tr.trains(3) and tr.in_warmup(1) and not tr.in_warmup(2)
    tr.cfg.experience.warmup_steps = 0                # no warm-up at all
    assert tr.trains(0) and not tr.in_warmup(0)
    tr.close()


# ---- 5. the paper preset's extractor contract -----------------------------------------------------

def test_paper_extractor_reads_the_whole_transcript_and_has_no_stop_or_length_limit(tokenizer):
    cfg = build_config([preset_data("paper")])
    xc = cfg.extractor
    assert (xc.format, xc.transcript) == ("json", "full") and cfg.experience.max_text_chars == 0
    ex = extractor_for(xc, None, tokenizer)
    assert ex.sampling.stop == () and ex.sampling.max_new_tokens == 8192
    assert "detailed" in ex.prompts.system_prompt
    reasoning = "<think>The box is left of me, so pushing right moves it away from the corner.</think>"
    record = EpisodeRecord("sokoban", "Push the box.", [("MAP ONE", "right", "moved"), ("MAP TWO", "up", "")],
                           success=True, reward=1.0, final_obs="MAP THREE",
                           replies=[reasoning + "<answer>right</answer>", "<answer>up</answer>"])
    ids, _, traj = ex.prompts.prepare(record, [])
    for part in ("MAP ONE", "MAP TWO", "MAP THREE", reasoning, "<answer>up</answer>"):
        assert part in traj, part
    # over budget, the middle turns go first, then the compact rendering
    long = EpisodeRecord("sokoban", "t", [(f"OBS {i} " + "x " * 40, "a", "") for i in range(30)],
                         replies=[f"reply {i}" for i in range(30)], final_obs="END")
    text = full_transcript(long, tokenizer, 400)
    assert "OBS 0 " in text and "OBS 29 " in text and "turns omitted" in text
    assert len(tokenizer.encode(text, add_special_tokens=False)) <= 400
    # a lesson of any length is accepted
    very = ('<answer>[{"function_name": "add", "parameters": {"title": "T", "content": "' + "word " * 3000
            + '"}}]</answer>')
    assert ex._parse(very, []).ok
    cpu = build_config([preset_data("cpu")]).extractor
    assert (cpu.format, cpu.transcript) == ("line", "compact")


# ---- 6. the actor-critic gate's inputs --------------------------------------------------------------

def test_critic_sees_the_first_task_prompt_and_the_actors_average_score(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model, experience={"actor_critic": True})
    critic = ByPrompt(tokenizer, lambda text: '<answer>{"function_name": "accept", "parameters": {}}</answer>')
    tr.experience.critic.engine = critic
    first = tr.train_step()
    scores = [t.reward for t in first.trajectories]
    tr.train_step()
    prompt = critic.prompts[0]
    assert "A coin." in prompt and "Call the coin." in prompt            # first observation + instruction
    assert f"{sum(scores) / len(scores):.2f} over {len(scores)} episodes" in prompt
    avg, n = tr.experience.env_score("test-coin")
    assert n == 16 and 0.0 <= avg <= 1.0
    tr.close()


def test_an_invalid_judgement_hides_the_entries_from_the_extractor(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model, experience={"actor_critic": True})
    tr.experience.critic.engine = ByPrompt(tokenizer, lambda text: "I am not sure.")
    tr.train_step()
    res = tr.train_step()
    guided = [t for t in res.trajectories if t.subgroup == "guided"]
    assert guided and all(t.retrieval.judgement == "invalid" and t.retrieval.entries for t in guided)
    reqs = tr.experience.memory.requests(res.trajectories, 2)
    assert reqs and all(r.retrieved == [] for r in reqs)
    tr.close()


# ---- 7. turn-level experience and the search tool ---------------------------------------------------

def test_turn_integration_retrieves_before_every_step_and_distils_every_step(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model, experience={"integration": "turn", "turn_show": True},
                  rollout={"max_steps": 2})
    tr.train_step()
    res = tr.train_step()
    guided = [t for t in res.trajectories if t.subgroup == "guided"]
    free = [t for t in res.trajectories if t.subgroup == "free"]
    assert all(turn.experience_ids and turn.query.startswith("Goal:") for t in guided for turn in t.turns)
    assert not any(turn.experience_ids for t in free for turn in t.turns)
    assert not any(t.experience_ids for t in guided)              # no episode-start retrieval with "turn"
    assert "Heads wins" in tokenizer.decode(guided[0].turns[0].prompt_ids)   # turn_show
    assert res.metrics["distill_queued"] == sum(len(t.turns) for t in guided)
    assert res.metrics["extractions_credited"] == 0                # turn retrievals are never credited
    prompt = [p for p in tr.experience.extractor.engine.prompts if "one step of an episode" in p]
    assert prompt
    tr.close()


def test_bank_scope_family_shares_the_released_memory_task(tokenizer, tiny_model):
    """experience.scope: family (paper preset): episodes retrieve from and write to the released
    memory task (``f"{env_class}_{env_type}"``), which MiniHack's navigation envs share; ``env``
    (default) keeps each env's own bank. Lessons and cases follow it; reflections stay per env."""
    from crl_bench.experience.cases import case_requests
    from crl_bench.experience.memory import bank_scope, get_memory
    from crl_bench.rollout import Trajectory, Turn

    assert bank_scope("minihack-maze", "family") == bank_scope("minihack-room", "family") == "minihack_navigation"
    assert bank_scope("sokoban", "family") == "sokoban" and bank_scope("minihack-maze") == "minihack-maze"
    assert preset_data("paper")["experience"]["scope"] == "family"
    assert build_config([preset_data("smoke")]).experience.scope == "env"
    with pytest.raises(ConfigError, match="scope"):
        build_config([preset_data("smoke"), {"experience": {"scope": "class"}}])
    family = build_config([preset_data("smoke"), {"experience": {"scope": "family"}}])
    assert get_memory("reflections")(family).scope("minihack-maze") == "minihack-maze"
    for scope, found in (("family", True), ("env", False)):
        tr = _trainer(tokenizer, tiny_model, experience={"scope": scope})
        _seed(tr.experience.bank, "minihack_navigation", 1)
        (g,) = tr.experience.guide([("minihack-maze", "Find the stairs.", "Observation: a maze")])
        assert bool(g.entry_ids) == found
        room = Trajectory("minihack-room", 0, 0, "guided", turns=[Turn([1], [2], [-1.0], "east", False, 0.0, "o", "r")],
                          query="Observation: a room")
        room.success = True
        (req,) = tr.experience.memory.requests([room], 0)
        (case,) = case_requests([room], 0, "successes", "query", scope)
        assert req.env_id == case.env_id == ("minihack_navigation" if found else "minihack-room")
        tr.close()


class _ToolActor(ByPrompt):
    """An actor that asks the search tool once, then answers heads; keeps the stop strings it saw."""

    def __init__(self, tokenizer, query="Which side wins?"):
        super().__init__(tokenizer, lambda text: "heads</answer>" if "Search results:" in text.split("user")[-1]
                         else f"<knowledge_search>{query}</knowledge_search>")
        self.stops = []

    def generate(self, prompts, params, allowed=None):
        self.stops.append(tuple(params.stop))
        return super().generate(prompts, params, allowed)


def test_search_tool_is_answered_by_the_extractor_and_credited_for_guided_episodes(tokenizer, tiny_model, tmp_path):
    def extractor(text: str) -> str:
        if "Question:" in text:
            return "<answer>Call heads.</answer>"
        return "<ops>\n" + ADD + "\n</ops>"
    tr = _trainer(tokenizer, tiny_model, reply=extractor, experience={"search_tool": "all", "max_tool_uses": 1},
                  generation={"constrained": False}, rollout={"max_steps": 3}, extractor={"batch_size": 64})
    tr.train_step()                                      # the bank gets its first entries
    actor = tr.runner.engine = _ToolActor(tokenizer)
    res = tr.train_step()
    assert "</knowledge_search>" in actor.stops[0] and "</knowledge_search>" not in actor.stops[1]
    for t in res.trajectories:                           # both subgroups have the tool (released)
        assert len(t.tool_calls) == 1 and t.turns[0].tool and t.turns[0].action is None
        call = t.tool_calls[0]
        assert call.query == "Which side wins?" and call.answer == "Call heads." and call.entry_ids
        assert isinstance(call.record, Extraction) and call.record.kind == "answer"
        assert t.success and t.steps == 2 and len(t.turns) == 2
        assert "Search results: Call heads." in tokenizer.decode(t.turns[1].prompt_ids)
    assert "knowledge_search" in tokenizer.decode(res.trajectories[0].turns[0].prompt_ids)   # the instruction
    answers = {t.tool_calls[0].record.id for t in res.trajectories if t.subgroup == "guided"}
    free_answers = {t.tool_calls[0].record.id for t in res.trajectories if t.subgroup == "free"}
    buffered = set(tr.experience.buffer)
    assert answers <= buffered and not (free_answers & buffered)      # guided answers only, episode score
    assert all(tr.experience.buffer[a].total == 1.0 and tr.experience.buffer[a].uses == 1 for a in answers)
    assert res.metrics["tool_calls/guided"] == 4 and res.metrics["tool_calls/free"] == 4
    import json

    from crl_bench.results.run_folder import RunWriter
    writer = RunWriter(tmp_path, run_id="w")
    writer.log_episodes(2, res.trajectories, transcripts=True)
    row = json.loads((writer.dir / "episodes.jsonl").read_text().splitlines()[0])
    assert row["tool_calls"] == [{"turn": 0, "query": "Which side wins?", "answer": "Call heads.",
                                  "entry_ids": res.trajectories[0].tool_calls[0].entry_ids}]
    assert row["actions"] == [None, "heads"] and row["transcript"]["turns"][0]["tool"]
    tr.close()


def test_turn_integration_is_one_advantage_group_and_credits_nothing(tokenizer, tiny_model):
    """Released ``turn_based``: no episode searches at episode start, so every episode is keyed
    ``wo_memory`` (a group's G episodes are one advantage group) and none carries triggered
    interactions, so the extractor's search-tool answers are not credited either."""
    from crl_bench.rollout import Trajectory

    def extractor(text: str) -> str:
        return "<answer>Call heads.</answer>" if "Question:" in text else "<ops>\n" + ADD + "\n</ops>"
    tr = _trainer(tokenizer, tiny_model, reply=extractor, rollout={"max_steps": 3}, extractor={"batch_size": 64},
                  experience={"integration": "turn", "search_tool": "all", "max_tool_uses": 1},
                  generation={"constrained": False})
    tr.train_step()                                      # turn-level entries for the tool to find
    tr.runner.engine = _ToolActor(tokenizer)
    trajs = tr.runner.collect(tr.episode_specs(), tr.sampling, **tr.rollout_hooks(training=True))
    guided = [t for t in trajs if t.subgroup == "guided"]
    assert guided and all(isinstance(t.tool_calls[0].record, Extraction) for t in guided)
    assert tr.experience.credit(trajs) == 0 and not tr.experience.buffer
    trajs = [Trajectory("test-coin", 0, 0, sub, reward=r) for sub, r in
             (("free", 1.0), ("free", 1.0), ("guided", 0.0), ("guided", 0.0))]
    assert tr.advantages(trajs) == pytest.approx([0.5, 0.5, -0.5, -0.5])      # one group of 4
    tr.cfg.experience.integration = "trajectory"
    assert tr.advantages(trajs) == pytest.approx([0.0] * 4)                   # subgroups apart
    tr.close()


def test_search_tool_limits(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model, experience={"search_tool": "guided", "max_tool_uses": 2},
                  generation={"constrained": False}, rollout={"max_steps": 3})
    tr.runner.engine = ByPrompt(tokenizer, lambda text: "<knowledge_search>anything?</knowledge_search>")
    res = tr.train_step()                                # empty bank: "No relevant knowledge found."
    for t in res.trajectories:
        if t.subgroup == "free":
            assert not t.tool_calls and all(not turn.tool for turn in t.turns)
        else:                                            # 2 calls, then the reply goes to the env (invalid)
            assert [c.answer for c in t.tool_calls] == [NO_KNOWLEDGE] * 2 and t.turns[2].invalid
            assert t.truncated and len(t.turns) == 3 and t.steps == 3
    with pytest.raises(ConfigError, match="constrained"):
        build_config([preset_data("smoke"), {"experience": {"search_tool": "all"}}])
    tr.close()


# ---- 8. training-count-aware reweighting ------------------------------------------------------------

def _ext(eid):
    return Extraction(eid, "test-coin", [1, 2], [3, 4], [-1.0, -1.0], "", ParseResult())


def test_repeat_weights_as_released(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model, extractor={"batch_size": 2})
    track = tr.experience
    assert track.repeat_weight("x", 5) == 1.0                  # never trained
    from crl_bench.trainer.experience_track import _Credit
    for eid, total in (("a", 1.0), ("b", -1.0)):
        track._buffer(_Credit(_ext(eid), total, 1))
    up = track.maybe_update_extractor(step=3)
    assert up["extractor_repeat_weight_mean"] == 1.0 and track.trained == {}    # released: never recorded
    on = _trainer(tokenizer, tiny_model, extractor={"batch_size": 2, "repeat_record": True,
                                                    "repeat_cooldown_steps": 2})
    t2 = on.experience
    for eid, total in (("a", 1.0), ("b", -1.0)):
        t2._buffer(_Credit(_ext(eid), total, 1))
    t2.maybe_update_extractor(step=3)
    assert t2.trained == {"a": (1, 3), "b": (1, 3)}
    assert t2.repeat_weight("a", 4) == 0.0                     # within the cooldown
    assert t2.repeat_weight("a", 5) == pytest.approx(2 ** -0.5)
    tr.close()
    on.close()


# ---- 9. evaluation as released -----------------------------------------------------------------------

def test_eval_writes_counters_only_when_asked(tokenizer, tiny_model):
    for writes in (False, True):
        tr = _trainer(tokenizer, tiny_model, eval={"writes_counters": writes})
        tr.train_step()
        tr.train_step()
        before = sum(e.times_retrieved for e in tr.experience.bank.entries())
        tr.evaluator.evaluate(guided=True)
        after = sum(e.times_retrieved for e in tr.experience.bank.entries())
        assert (after > before) == writes
        tr.close()


def test_periodic_eval_sees_the_bank_after_the_next_steps_merge(tokenizer, tiny_model, tmp_path):
    from crl_bench.trainer.lifecycle import run_training

    cfg = coin_config("complementary", train={"steps": 3, "save_checkpoint": False, "checkpoint_every": 0},
                      eval={"every": 2, "episodes": 2}, experience={"merge": {"every": 2}},
                      output_dir=str(tmp_path), run_id="r")
    seen = {}
    orig = Evaluator.evaluate

    def evaluate(self, *a, **k):
        seen.setdefault(self.trainer.step, self.trainer.experience.manager.stats()["merge_passes"])
        return orig(self, *a, **k)

    import crl_bench.trainer.lifecycle as lifecycle
    real_trainer = lifecycle.Trainer

    class Patched(real_trainer):
        def __init__(self, cfg, writer=None, **kw):
            super().__init__(cfg, writer, model=tiny_model, tokenizer=tokenizer, embedder=HashEmbedder(64),
                             extractor_model=copy.deepcopy(tiny_model))
            ex = self.experience.extractor
            ex.engine = ByPrompt(tokenizer, _fold_reply(1), ex.prompts.prefill)
    lifecycle.Trainer = Patched
    Evaluator.evaluate = evaluate
    try:
        run_training(cfg, quiet=True)
    finally:
        lifecycle.Trainer = real_trainer
        Evaluator.evaluate = orig
    assert seen[2] == 1            # the eval after step 2 ran after step 3's merge pass (released order)
    import json
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    step3 = [r for r in rows if r.get("step") == 3 and "merge_pass" in r]
    assert step3 and step3[0]["merge_pass"] == 1 and step3[0]["merge_passes"] == 1   # not run twice


# ---- 10. raw-logit log-probs ----------------------------------------------------------------------------

def test_raw_logprobs_setting(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model, generation={"temperature": 1.5})
    assert tr.updater.temperature == 1.5 and tr.experience.updater.temperature == 0.7
    tr.close()
    raw = _trainer(tokenizer, tiny_model, generation={"temperature": 1.5}, train={"logprob_temperature": "raw"})
    assert raw.updater.temperature == 1.0 and raw.experience.updater.temperature == 1.0
    raw.close()
    with pytest.raises(ConfigError, match="recompute_old_logprobs"):
        build_config([{"train": {"logprob_temperature": "raw", "recompute_old_logprobs": False}}])
    assert build_config([preset_data("paper")]).train.logprob_temperature == "raw"


def test_rerank_ties_keep_the_similarity_order():
    """Released ``_diversify_uids_by_usage`` sorts by (score, -rank) descending: equal scores keep the
    candidates' similarity order."""
    import time as _time

    from crl_bench.experience.retrieval import Retriever
    from crl_bench.experience.types import ExperienceEntry

    now = _time.time()
    recent = ExperienceEntry(1, "e", "a", "x", last_retrieved=now - 10)      # -0 - 1 = -1
    fresh = ExperienceEntry(2, "e", "b", "y")                                # -1
    third = ExperienceEntry(3, "e", "c", "z")                                # -2
    r = Retriever.__new__(Retriever)
    r.rank_score, r.freq_penalty, r.recency_window_s, r.top1_demote_p = "position", 0.4, 300.0, 0.0
    assert [e.id for e in r.rerank([(recent, 0.9), (fresh, 0.8), (third, 0.7)], now)] == [1, 2, 3]
    assert [e.id for e in r.rerank([(fresh, 0.9), (recent, 0.8), (third, 0.7)], now)] == [2, 1, 3]


def test_fold_items_drop_short_lessons_and_copies_of_the_prompt():
    """Released ``parse_answer_to_list``: items of 30 characters or fewer and placeholders are dropped;
    nothing left is a failed call (the chunk is kept); NONE keeps it on purpose."""
    from crl_bench.experience.extractor import FOLD_DEMO_REPLY, fold_items
    from crl_bench.experience.operations import parse_operations

    def items(text):
        return fold_items(parse_operations("<ops>\n<op>" + text))

    good = "ADD</op><title>Go around walls</title><content>Step around a wall instead of into it.</content>"
    assert items(good) == [("Go around walls", "Step around a wall instead of into it.")]
    assert items("ADD</op><title>Exit</title><content>Go to it.</content>") is None          # 19 characters
    demo = FOLD_DEMO_REPLY[0]
    assert items(f"ADD</op><title>{demo.title}</title><content>{demo.content}</content>") is None
    assert items("ADD</op><title>Title of the first lesson</title><content>Its advice.</content>") is None
    assert items("NONE</op>") == []
    assert items("UPDATE 3</op><title>Go around walls</title><content>Step around a wall instead.</content>") is None


def test_the_actor_engine_sleeps_through_the_update_and_wakes_for_the_sync(tokenizer, tiny_model):
    # vLLM's sleep mode (generation.vllm_sleep): the engine gives its GPU memory to the update, as verl's and
    # ROLL's colocated engines do; the engine is asleep while the updater runs and loads the new weights after
    import random

    from tests_helpers import coin_config

    from crl_bench.llm.base import Generation
    from crl_bench.trainer.loop import Trainer

    tr = Trainer(coin_config("grpo"), model=tiny_model, tokenizer=tokenizer)
    events: list[str] = []

    class Sleepy:
        asleep = False
        rng = random.Random(0)

        def generate(self, prompts, params, allowed=None):
            assert not self.asleep
            events.append("generate")
            out = []
            for p in prompts:                    # heads or tails at random: groups with a learning signal
                text = self.rng.choice(["heads</answer>", "tails</answer>"])
                ids = tokenizer.encode(text, add_special_tokens=False)
                out.append(Generation(list(p), ids, [-0.5] * len(ids), text, "stop"))
            return out

        def sleep(self):
            self.asleep = True
            events.append("sleep")

        def sync_weights(self, model):
            self.asleep = False
            events.append("sync")

    tr.engine = tr.runner.engine = Sleepy()
    real_update = tr.updater.update

    def update(samples):
        events.append("update asleep" if tr.engine.asleep else "update awake")
        return real_update(samples)

    tr.updater.update = update
    m = tr.train_step().metrics
    assert m["optimizer_steps"] >= 1
    assert events[-3:] == ["sleep", "update asleep", "sync"] and set(events[:-3]) == {"generate"}
