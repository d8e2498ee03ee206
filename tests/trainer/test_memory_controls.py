"""Memory controls of evaluation (``shuffled``, ``empty``) and the leaderboard's paired memory lift.

The summary and leaderboard tests use synthetic run folders (tests/results/test_summary.py ``make_run``) whose
per-task outcomes are set by hand, so the lift and its paired CI are checked against hand
computation; the trainer tests run the tiny random actor on the ``diag-vault`` diagnostic, whose
contexts make "another context's task" checkable.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from test_summary import _eval_block, make_run

from crl_bench.results.leaderboard import collect, leaderboard_frame, leaderboard_markdown, lift_frame
from crl_bench.results.stats import two_level_ci
from crl_bench.results.summary import build_summary, validate_summary

ENV = "sokoban"


def _block(successes: list[int]) -> dict:
    """An eval.json mode block of one env with these per-task outcomes."""
    b = _eval_block({ENV: float(np.mean(successes))}, episodes=len(successes))
    b["per_env"][ENV]["successes"] = list(successes)
    return b


def _run_with_controls(root, run_id, seed, guided, shuffled, empty=None, method="complementary"):
    d = make_run(root, run_id, method=method, mix="sokoban", seed=seed,
                 free={ENV: 0.0}, episodes=len(guided))
    ev = json.loads((d / "eval.json").read_text())
    ev["free"] = _block([0] * len(guided))
    ev["guided"], ev["shuffled"] = _block(guided), _block(shuffled)
    if empty is not None:
        ev["empty"] = _block(empty)
    (d / "eval.json").write_text(json.dumps(ev))
    return d


def test_summary_carries_the_controls_and_per_task_outcomes(tmp_path):
    d = _run_with_controls(tmp_path, "r", 0, [1, 1, 0, 1], [0, 1, 0, 0], empty=[0, 0, 0, 1])
    s = build_summary(d)
    validate_summary(s)
    ev = s["runs"][0]["eval"]
    assert ev["shuffled"]["per_env"][ENV]["successes"] == [0, 1, 0, 0]
    assert ev["empty"]["success_rate"] == pytest.approx(0.25)
    assert ev["guided"]["per_env"][ENV]["successes"] == [1, 1, 0, 1]
    bad = copy.deepcopy(s)
    bad["runs"][0]["eval"]["shuffled"]["per_env"][ENV]["successes"] = [0, 2]
    with pytest.raises(Exception, match="successes"):
        validate_summary(bad)


def test_leaderboard_rows_for_every_mode(tmp_path):
    _run_with_controls(tmp_path, "r", 0, [1, 1, 0, 1], [0, 1, 0, 0], empty=[0, 0, 0, 1])
    df = leaderboard_frame(collect([tmp_path]))
    assert sorted(df["eval"]) == ["empty", "free", "guided", "shuffled"]
    assert df.set_index("eval").loc["shuffled", f"success_mean/{ENV}"] == pytest.approx(0.25)


def test_lift_is_paired_over_tasks_against_hand_computation(tmp_path):
    # two seeds on the same 6 tasks; per-task differences averaged over seeds:
    # seed 0: g-s = [1,0,1,0,0,1], seed 1: g-s = [1,1,0,0,-1,1] -> mean [1,.5,.5,0,-.5,1]
    _run_with_controls(tmp_path, "s0", 0, [1, 1, 1, 0, 0, 1], [0, 1, 0, 0, 0, 0])
    _run_with_controls(tmp_path, "s1", 1, [1, 1, 0, 1, 0, 1], [0, 0, 0, 1, 1, 0])
    lift = lift_frame(collect([tmp_path]))
    assert len(lift) == 1
    r = lift.iloc[0]
    diff = np.array([1, .5, .5, 0, -.5, 1])
    assert (r["env"], r["n_runs"], r["tasks"]) == (ENV, 2, 6)
    assert r["lift"] == pytest.approx(diff.mean())
    assert r["guided"] == pytest.approx(8 / 12) and r["shuffled"] == pytest.approx(3 / 12)
    # the interval resamples the seeds, then the tasks within each seed (paired per task within a run),
    # not the tasks of the per-task differences averaged over seeds (tests/results/test_stats.py: wider
    # than that as the seeds spread)
    per_run = [[np.array([1, 0, 1, 0, 0, 1.0])], [np.array([1, 1, 0, 0, -1, 1.0])]]
    assert (r["lift_ci_low"], r["lift_ci_high"], r["ci_over"]) == two_level_ci(per_run)
    assert r["ci_over"] == "seeds and tasks"
    assert r["lift_ci_low"] < r["lift"] < r["lift_ci_high"]
    md = leaderboard_markdown(leaderboard_frame(collect([tmp_path])), lift=lift)
    assert "Memory lift per env" in md and f"{diff.mean():+.3f} [" in md


def test_lift_ci_excludes_zero_only_when_the_memory_matters(tmp_path):
    _run_with_controls(tmp_path / "a", "helps", 0, [1] * 12, [0] * 12)
    _run_with_controls(tmp_path / "b", "noise", 0, [1, 0] * 6, [0, 1] * 6, method="static")
    lift = lift_frame(collect([tmp_path])).set_index("run_ids")
    assert lift.loc["helps", "lift_ci_low"] == 1.0
    assert lift.loc["noise", "lift"] == 0.0
    assert lift.loc["noise", "lift_ci_low"] < 0 < lift.loc["noise", "lift_ci_high"]


def test_runs_without_shuffled_or_outcomes_give_no_lift(tmp_path):
    make_run(tmp_path, "g", method="complementary", guided={"sokoban": 0.5, "minihack-room": 0.5})
    assert lift_frame(collect([tmp_path])).empty


def test_a_later_eval_on_another_split_is_a_row_of_its_own_protocol(tmp_path):
    d = _run_with_controls(tmp_path, "r", 0, [1, 1, 0, 1], [0, 1, 0, 0])
    ev = json.loads((d / "eval.json").read_text())
    later = {"model": "m", "method": "complementary", "run": str(d),
             "protocol": {**ev["protocol"], "split": "eval_unseen"},
             "guided": _block([0, 0, 0, 1]), "shuffled": _block([0, 0, 0, 1]), "free": _block([0, 0, 0, 0])}
    (d / "checkpoint-eval_unseen-split.json").write_text(json.dumps(later))
    (d / "checkpoint-old-split.json").write_text(json.dumps({"free": _block([0])}))   # no protocol: skipped
    warnings: list[str] = []
    summaries = collect([tmp_path], warnings)
    assert warnings == [] and len(summaries) == 2
    df = leaderboard_frame(summaries)
    assert sorted(set(df["protocol"].str.split(" ").str[0])) == ["eval", "eval_unseen"]
    lift = lift_frame(summaries)
    by_split = dict(zip(lift["protocol"].str.split(" ").str[0], lift["lift"]))
    assert by_split == pytest.approx({"eval": 0.5, "eval_unseen": 0.0})


# ---- the trainer's evaluation modes on the diagnostic ------------------------------------------------
ADD = "<op>ADD</op><title>Vault</title><content>Turn the dial to the key.</content>"


def _diag_trainer(tokenizer, tiny_model, method="complementary", **extra):
    from test_complementary import ScriptedEngine
    from tests_helpers import coin_config

    from crl_bench.experience.embedding import HashEmbedder
    from crl_bench.trainer.loop import Trainer

    layer = {"rollout": {"mix": "diag-vault", "max_steps": 2}, "eval": {"episodes": 16, "lesson_follow": 0},
             "experience": {"warmup_steps": 0, "warmup_train_steps": 0}}
    for section, values in extra.items():
        layer.setdefault(section, {}).update(values)
    cfg = coin_config(method, **layer)
    tr = Trainer(cfg, model=tiny_model, tokenizer=tokenizer, embedder=HashEmbedder(64),
                 extractor_model=copy.deepcopy(tiny_model) if method != "grpo" else None)
    if tr.experience is not None:
        ex = tr.experience.extractor
        ex.engine = ScriptedEngine(tr.experience.engine, ADD, ex.prompts.prefill)
    return tr


def _recording(tr):
    """Wrap the manager's retrieve so the test sees every query it is asked."""
    asked: list[str] = []
    real = tr.experience.manager.retrieve

    def retrieve(requests, count_retrievals=True):
        asked.extend(q for _, q in requests)
        return real(requests, count_retrievals=count_retrievals)

    tr.experience.manager.retrieve = retrieve
    return asked


def _collected(tr):
    """Wrap the runner's collect so the test sees the trajectories of each call."""
    calls: list = []
    real = tr.runner.collect

    def collect(*a, **kw):
        out = real(*a, **kw)
        calls.append(out)
        return out

    tr.runner.collect = collect
    return calls


def test_default_modes_and_controls_setting(tokenizer, tiny_model):
    tr = _diag_trainer(tokenizer, tiny_model)
    assert tr.evaluator.modes == ["guided", "shuffled", "empty", "free"]
    tr.close()
    tr = _diag_trainer(tokenizer, tiny_model, eval={"episodes": 4, "controls": "empty"})
    assert tr.evaluator.modes == ["guided", "empty", "free"]
    assert tr.evaluator.episode_count() == 12
    tr.close()
    tr = _diag_trainer(tokenizer, tiny_model, method="grpo")
    assert tr.evaluator.modes == ["free"]
    with pytest.raises(ValueError, match="needs an experience bank"):
        tr.evaluator.evaluate(mode="shuffled")
    with pytest.raises(ValueError, match="unknown eval mode"):
        tr.evaluator.evaluate(mode="sideways")
    tr.close()


def test_shuffled_retrieves_with_another_contexts_query(tokenizer, tiny_model):
    tr = _diag_trainer(tokenizer, tiny_model)
    tr.train_step()
    tr.experience.flush()
    assert tr.experience.bank.entries("diag-vault")
    tasks = tr.evaluator.task_ids()
    donors = tr.evaluator.shuffled_donors(tasks)["diag-vault"]
    ctx = tr.eval_contexts["diag-vault"]
    assert set(donors) == set(tasks["diag-vault"]) and len(set(ctx[t] for t in donors)) > 1
    assert all(d != t and ctx[d] != ctx[t] for t, d in donors.items())
    assert tr.evaluator.shuffled_donors(tasks)["diag-vault"] == donors          # reproducible
    asked = _recording(tr)
    calls = _collected(tr)
    ev = tr.evaluator.evaluate(mode="shuffled")
    trajs = calls[-1]
    own = {int(t.task): t.query for t in trajs}
    ids = tasks["diag-vault"]
    assert asked == [tr.evaluator.first_query("diag-vault", donors[t]) for t in ids]
    assert all(q != own[t] and ctx[donors[t]] in q and ctx[t] not in q for t, q in zip(ids, asked))
    assert all(t.query == tr.evaluator.first_query("diag-vault", int(t.task)) for t in trajs)   # own query kept
    assert ev["mode"] == "shuffled" and ev["guided"] is True
    assert ev["donors"]["diag-vault"] == {str(t): d for t, d in donors.items()}
    assert ev["per_env"]["diag-vault"]["successes"] == [
        int(next(x.success for x in trajs if int(x.task) == t)) for t in tasks["diag-vault"]]
    tr.close()


def test_empty_shows_the_header_and_no_entry_without_retrieving(tokenizer, tiny_model):
    from crl_bench.experience.memory import EMPTY_GUIDANCE, GUIDANCE_HEADER

    tr = _diag_trainer(tokenizer, tiny_model)
    tr.train_step()
    asked = _recording(tr)
    calls = _collected(tr)
    ev = tr.evaluator.evaluate(mode="empty")
    assert asked == [] and ev["episodes_with_experience"] == 0 and ev["mode"] == "empty"
    assert all(t.guidance == EMPTY_GUIDANCE and GUIDANCE_HEADER in t.guidance for t in calls[-1])
    guided = tr.evaluator.evaluate(mode="guided")
    assert len(asked) == 16 and guided["episodes_with_experience"] > 0
    tr.close()


def test_every_evaluation_starts_from_an_empty_prefix_store(tokenizer, tiny_model):
    """A mode's episodes must not depend on the evaluations before it: cached prefixes equal their
    recomputation only up to rounding, which flips greedy choices at near-ties. So each evaluation
    starts with the actor engine's prefix store empty, though the one before filled it."""
    tr = _diag_trainer(tokenizer, tiny_model, eval={"episodes": 8})
    if not hasattr(tr.engine, "store"):
        tr.close()
        pytest.skip("the actor engine has no prefix store")
    tr.train_step()
    sizes: list[int] = []
    real = tr.runner.collect

    def collect(*a, **kw):
        sizes.append(len(tr.engine.store))
        return real(*a, **kw)

    tr.runner.collect = collect
    for mode in ("guided", "free", "empty"):
        tr.evaluator.evaluate(mode=mode)
        assert len(tr.engine.store) > 0           # the evaluation cached prefixes ...
    assert sizes == [0, 0, 0]                     # ... and the next one started without them
    tr.close()


def test_a_modes_retrievals_depend_neither_on_earlier_modes_nor_on_the_clock(tokenizer, tiny_model, monkeypatch):
    """The released re-rank demotes a recently retrieved top entry at random. A read-only evaluation
    draws each query's demotion from a generator seeded by the run's seed, the env and the query, and
    judges "recent" by the bank's last training retrieval, so re-running a mode (after other modes, or
    an hour later, as `crl-bench eval` does) shows every episode the same entries."""
    import crl_bench.experience.retrieval as retrieval

    tr = _diag_trainer(tokenizer, tiny_model, experience={"top1_demote_p": 0.5, "oversample": 4})
    tr.train_step()
    tr.train_step()
    shown = _collected(tr)

    def entries_shown() -> list:
        return [(t.task, tuple(t.experience_ids)) for t in shown[-1]]

    tr.evaluator.evaluate(mode="guided")
    first = entries_shown()
    assert sum(1 for _, ids in first if ids) > 0
    tr.evaluator.evaluate(mode="shuffled")
    tr.evaluator.evaluate(mode="guided")
    assert entries_shown() == first
    later = retrieval.time.time() + 3600.0
    monkeypatch.setattr(retrieval.time, "time", lambda: later)
    tr.evaluator.evaluate(mode="guided")
    assert entries_shown() == first
    tr.close()


def test_evaluate_all_runs_every_mode_on_the_same_tasks(tokenizer, tiny_model):
    tr = _diag_trainer(tokenizer, tiny_model, eval={"episodes": 4, "lesson_follow": 2})
    tr.train_step()
    ev = tr.evaluator.evaluate_all()
    assert [m for m in ("guided", "shuffled", "empty", "free") if m in ev] == ["guided", "shuffled", "empty", "free"]
    assert len({json.dumps(ev[m]["tasks"]) for m in ("guided", "shuffled", "empty", "free")}) == 1
    assert set(ev["lesson_follow"]) == {"lesson_follow", "lesson_follow_wrong", "lesson_follow_none"}
    tr.close()


# ---- lesson_follow ------------------------------------------------------------------------------------
def test_lesson_follow_probes_show_the_guided_prompt(tokenizer):
    from crl_bench.config import RunConfig
    from crl_bench.envs.diag import DiagVaultEnv
    from crl_bench.experience.memory import GUIDANCE_HEADER
    from crl_bench.rollout import PromptBuilder
    from crl_bench.trainer.lesson_follow import build_probes

    cfg = RunConfig()
    probes = build_probes(PromptBuilder(tokenizer, cfg.generation.prefill, cfg.rollout.history), 8)
    env = DiagVaultEnv()
    assert len({p.context for p in probes}) == 8
    for p in probes:
        assert p.right == env.solution(p.task)[0] and p.wrong != p.right
        right, wrong, none = (tokenizer.decode(p.prompts[c]) for c in ("right", "wrong", "none"))
        assert GUIDANCE_HEADER in right and GUIDANCE_HEADER not in none
        assert env.lesson_for(p.task, [p.right]) in right and env.lesson_for(p.task, [p.wrong]) in wrong
        assert p.context in none
    assert len({p.wrong for p in probes}) == 8               # wrong lessons name every action once
    with pytest.raises(ValueError, match="contexts"):
        build_probes(PromptBuilder(tokenizer, cfg.generation.prefill, cfg.rollout.history), 9)


def test_lesson_follow_probes_the_runs_own_diagnostic(tokenizer, tiny_model):
    """A run on diag-corridor probes corridor states, its lesson naming the passages in order and the
    measured action the first passage; a mix without a diagnostic probes diag-vault."""
    from crl_bench.config import RunConfig
    from crl_bench.envs.diag import DiagCorridorEnv
    from crl_bench.rollout import PromptBuilder
    from crl_bench.trainer.lesson_follow import build_probes, probe_env

    assert probe_env(["diag-corridor"]) == "diag-corridor"
    assert probe_env(["minihack-room", "diag-corridor", "diag-vault"]) == "diag-corridor"
    assert probe_env(["minihack-room"]) == "diag-vault"
    cfg = RunConfig()
    builder = PromptBuilder(tokenizer, cfg.generation.prefill, cfg.rollout.history)
    probes = build_probes(builder, 8, "diag-corridor")
    env = DiagCorridorEnv()
    assert len({p.context for p in probes}) == 8
    for p in probes:
        solution = list(env.solution(p.task))
        assert p.actions == ["left", "middle", "right"] and p.right == solution[0] and p.wrong != p.right
        right, wrong, none = (tokenizer.decode(p.prompts[c]) for c in ("right", "wrong", "none"))
        assert env.lesson_for(p.task, solution) in right
        miss = [p.actions[(p.actions.index(a) + 1) % 3] for a in solution]     # every passage wrong
        assert env.lesson_for(p.task, miss) in wrong and p.wrong == miss[0]
        assert "door 1 of 3" in none and p.context in none
    with pytest.raises(ValueError, match="not a diagnostic"):
        build_probes(builder, 2, "minihack-room")

    tr = _diag_trainer(tokenizer, tiny_model, method="grpo", rollout={"mix": "diag-corridor", "max_steps": 3},
                       eval={"episodes": 2, "lesson_follow": 2})
    try:
        follow = tr.lesson_follow()
        assert tr._lesson_probe.env_id == "diag-corridor"
        assert [p.actions for p in tr._lesson_probe.probes] == [["left", "middle", "right"]] * 2
        assert 0.0 <= follow["lesson_follow_none"] <= 1.0
    finally:
        tr.close()


def test_action_probabilities_are_the_constrained_samplers(tokenizer, tiny_model):
    """The probabilities match the constrained sampler's empirical choice frequencies (a tiny random
    model; replies that share first tokens exercise the renormalisation at deeper branches)."""
    from crl_bench.llm.base import SamplingParams
    from crl_bench.llm.hf_engine import HFEngine
    from crl_bench.trainer.lesson_follow import action_probabilities

    replies = ["north</answer>", "northeast</answer>", "northwest</answer>", "south</answer>"]
    prompt = tokenizer.encode("Pick a direction. <answer>", add_special_tokens=False)
    [probs] = action_probabilities(tiny_model, tokenizer, [prompt], [replies])
    assert sum(probs) == pytest.approx(1.0, abs=1e-5)
    engine = HFEngine(tiny_model, tokenizer, batch_size=64)
    import torch

    torch.manual_seed(0)
    n = 400
    gens = engine.generate([prompt] * n, SamplingParams(temperature=1.0, max_new_tokens=8), [replies] * n)
    freq = [sum(g.text.strip() == r for g in gens) / n for r in replies]
    for p, f in zip(probs, freq):
        assert abs(p - f) < 4 * (p * (1 - p) / n) ** 0.5 + 0.01


# ---- the loop with perfect lessons: the actor learns to follow them -----------------------------------
@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.xdist_group("learning-lessons")
def test_with_perfect_lessons_the_actor_learns_to_follow_them():
    """complementary on diag-vault with the real default actor and an oracle extractor that writes the
    winning symbol after every success (tests_helpers.OracleExtractorEngine), so the extractor's
    ability is out of the question: a bounded number of steps make the actor follow shown lessons
    (``lesson_follow`` above its start and above chance, for wrong lessons too: it reads the lesson,
    it did not memorise the codes), guided evaluation beats chance and the shuffled control.

    Sizes chosen from measured runs (docs/diagnostics.md "The loop with perfect lessons"). The rise is
    not monotone, and where a dip falls depends on the CPU's rounding, which changes every sampled
    episode: on a 2-core AMD EPYC with AVX512-BF16, 8 steps gave 0.109 -> 0.221 and 13 gave 0.263; on
    a 2-core Intel Xeon with AMX, the same 8 steps gave 0.109 -> 0.159 (a dip from 0.223 at step 7;
    guided 0.125 = shuffled), and 14 steps 0.270 (wrong lessons 0.252, none 0.138), guided 0.250
    against shuffled 0.109 on the 64 eval tasks. It also depends on the random stream: this is seed 0's
    (seeds 1 and 2 learned slower, docs/diagnostics.md), so the engine must keep sampling what it sampled
    from a seed (tests/llm/test_decode.py). So the test runs at most 14 steps, and stops at the
    first step after which every assertion below holds: the probe is read after each step, the guided
    and shuffled evaluations (greedy, read-only on the bank) once the probe's part holds."""
    from tests_helpers import OracleExtractorEngine

    from crl_bench.config import build_config, preset_data
    from crl_bench.trainer.loop import Trainer

    max_steps = 14
    cfg = build_config([preset_data("diag"), {
        "method": "complementary",
        "train": {"steps": max_steps, "lr_warmup_steps": 0, "save_checkpoint": False},
        "experience": {"wait_distill": True, "merge": {"every": 0}, "distill_per_group": 0},
        "extractor": {"batch_size": 64},            # no extractor update: its replies are scripted
    }])

    def follows(final: dict[str, float], start: float) -> bool:
        return (final["lesson_follow"] > start + 0.05 and final["lesson_follow"] > 0.125 + 0.04
                and final["lesson_follow_wrong"] > 0.125 + 0.03)          # follows what it is shown

    def beats_chance_and_shuffled(guided: float, shuffled: float) -> bool:
        return guided > 0.125 + 0.07 and guided > shuffled + 0.08

    tr = Trainer(cfg)
    rows: list[dict] = []
    guided = shuffled = None
    try:
        ex = tr.experience.extractor
        ex.engine = OracleExtractorEngine(tr.experience.engine, ex.prompts.prefill)
        for _ in range(max_steps):
            rows.append(tr.train_step().metrics)
            final = tr.lesson_follow()
            if follows(final, rows[0]["lesson_follow"]):
                guided = tr.evaluator.evaluate(mode="guided")["success_rate"]
                shuffled = tr.evaluator.evaluate(mode="shuffled")["success_rate"]
                if beats_chance_and_shuffled(guided, shuffled):
                    break
        if guided is None:
            guided = tr.evaluator.evaluate(mode="guided")["success_rate"]
            shuffled = tr.evaluator.evaluate(mode="shuffled")["success_rate"]
    finally:
        tr.close()
    assert ex.engine.written > 0 and rows[-1]["bank_correct_lessons"] == 1.0
    start = rows[0]["lesson_follow"]
    print(f"{len(rows)} steps: lesson_follow {start:.3f} -> {final['lesson_follow']:.3f} (wrong "
          f"{final['lesson_follow_wrong']:.3f}, none {final['lesson_follow_none']:.3f}); eval guided {guided:.3f} "
          f"shuffled {shuffled:.3f}")
    assert final["lesson_follow"] > start + 0.05 and final["lesson_follow"] > 0.125 + 0.04
    assert final["lesson_follow_wrong"] > 0.125 + 0.03            # follows what it is shown
    assert guided > 0.125 + 0.07 and guided > shuffled + 0.08


def test_report_shows_the_controls_of_the_final_eval(tmp_path):
    from crl_bench.results.report import make_report

    d = _run_with_controls(tmp_path / "runs", "r", 0, [1, 1, 0, 1], [0, 1, 0, 0], empty=[0, 0, 0, 1])
    with open(d / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "success_rate": 0.5, "lesson_follow": 0.2, "lesson_follow_wrong": 0.15,
                            "lesson_follow_none": 0.12}) + "\n")
    page = make_report(tmp_path / "runs", tmp_path / "out").read_text()
    row = page[page.index("<td>r</td>"):]
    row = row[:row.index("</tr>")]
    assert "<td>0.750</td><td>0.250</td><td>0.250</td>" in row          # guided, shuffled, empty
    assert (tmp_path / "out" / "lesson_follow.png").is_file()
