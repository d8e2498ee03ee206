"""End to end: the smoke preset of each method and env, and a real update.

Runs whose assertions hold for any model (the run folder, metrics, constrained decoding, eval blocks,
env plumbing, sweeps) use the tiny random model of the default architecture (conftest
``tiny_model_dir``); the real default model (SmolLM2-135M on CPU) plays one complementary run end to
end, whose extractor writes a bank the actor is then guided by, and the real update's log-probs.
Bounded: the smoke preset is 2 steps of 2 groups x 4 rollouts of at most 6 actions, and a 4-episode eval.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from crl_bench.cli import main
from crl_bench.results.run_folder import read_metrics
from crl_bench.results.summary import validate_summary


def _check_run_folder(run: Path, steps: int) -> None:
    for name in ("config.yaml", "versions.json", "seeds.json", "data.json", "metrics.jsonl", "eval.json",
                 "episodes.jsonl", "summary.json"):
        assert (run / name).is_file(), name
    assert (run / "checkpoint" / "config.json").is_file()
    assert any((run / "checkpoint").glob("*.safetensors"))
    rows = [r for r in read_metrics(run) if "eval" not in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for key in ("success_rate", "reward_mean", "steps_mean", "invalid_action_rate", "loss",
                    "tokens_per_s", "time_rollout_s", "time_update_s", "time_step_s"):
            assert key in r, key
        assert r["episodes"] == 8
        assert r["invalid_action_rate"] == 0.0        # constrained decoding (default)
        assert r["tokens_per_s"] > 0
        assert r["reply_entropy"] >= 0.0 and r["entropy"] > 0
    ev = json.loads((run / "eval.json").read_text())
    free = ev["free"]
    assert free["episodes"] == 4 * len(free["per_env"]) and 0.0 <= free["success_rate"] <= 1.0
    assert free["steps_mean"] > 0 and ev["protocol"]["episodes"] == 4
    versions = json.loads((run / "versions.json").read_text())
    assert "torch" in versions["packages"] and "crl-bench" in versions["packages"]
    assert "pyyaml" in versions["packages"]                  # every installed distribution
    summary = json.loads((run / "summary.json").read_text())
    validate_summary(summary)
    assert summary["runs"][0]["eval"]["free"]["per_env"].keys() == free["per_env"].keys()


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["minihack-room", "sokoban"])
def test_smoke_run(tmp_path, mix, capsys, tiny_model_dir):
    rc = main(["run", "--method", "grpo", "--mix", mix, "--preset", "smoke", "--output-dir", str(tmp_path),
               "--model", str(tiny_model_dir),
               "--run-id", "smoke", "--set", "eval.at_start=true", "--set", "logging.transcripts=true"])
    assert rc == 0
    run = tmp_path / "smoke"
    _check_run_folder(run, steps=2)
    # a closed set of 8 (MiniHack) or 4 (Sokoban) replies: one reply's summed token entropies are at
    # most ln(first-token choices) + ln(continuations) <= ln 4 + ln 3 (north/south each continue three
    # ways), and their mean estimates the action choice's entropy (<= ln 8)
    assert all(0.0 < r["reply_entropy"] <= math.log(12) + 1e-6 for r in read_metrics(run) if "eval" not in r)
    # eval.at_start: the untrained actor on the same eval tasks, a step-0 row, eval.json and the summary
    first = read_metrics(run)[0]
    assert first["step"] == 0 and first["eval"]["free"]["episodes"] == 4
    ev = json.loads((run / "eval.json").read_text())
    assert ev["initial"]["step"] == 0 and ev["initial"]["free"]["tasks"] == ev["free"]["tasks"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["runs"][0]["eval"]["initial"]["episodes"] == 4
    # episodes.jsonl: each episode's action sequence and, with logging.transcripts, its transcript
    episodes = [json.loads(x) for x in (run / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 16
    for e in episodes:
        assert len(e["actions"]) == e["steps"] and all(isinstance(a, str) for a in e["actions"])
        turns = e["transcript"]["turns"]
        assert [t["action"] for t in turns] == e["actions"] and turns[0]["observation"]
        assert all("</answer>" in t["reply"] for t in turns) and e["transcript"]["task"]
    out = capsys.readouterr().out
    assert "step 2:" in out and "eval (eval, free)" in out
    # the checkpoint evaluates through `crl-bench eval --run`
    rc = main(["eval", "--run", str(tmp_path / "smoke"), "--episodes", "2", "--quiet"])
    assert rc == 0
    ev = json.loads((tmp_path / "smoke" / "checkpoint-eval-split.json").read_text())
    assert ev["free"]["episodes"] == 2 and ev["model"].endswith("checkpoint") and "guided" not in ev


@pytest.mark.slow
@pytest.mark.parametrize("method", ["complementary", "static"])
def test_experience_smoke_run(tmp_path, method, capsys, monkeypatch, tiny_model_dir):
    """The smoke preset of the experience methods with the real embedder and the tiny model, whose
    extractor writes a lesson per extraction (tests_helpers.LessonWriterEngine), so the bank fills in
    step 1 and guides step 2 and `eval --run`: complementary updates its extractor on the credited
    extractions, static keeps it frozen. (Whether the real extractor writes replies that parse is
    tests/llm/test_vllm_real.py's and the learning tests' question, not this one's.)"""
    from tests_helpers import install_lesson_writer

    install_lesson_writer(monkeypatch)
    extra = ["--model", str(tiny_model_dir)]
    rc = main(["run", "--method", method, "--mix", "minihack-room", "--preset", "smoke",
               "--output-dir", str(tmp_path), "--run-id", "smoke", *extra])
    assert rc == 0
    run = tmp_path / "smoke"
    _check_run_folder(run, steps=2)
    assert (run / "experience.sqlite").is_file()
    rows = read_metrics(run)
    for r in rows:
        for key in ("success_rate/guided", "success_rate/free", "bank_size", "extractions_parsed",
                    "extractions_failed", "ops_rejected", "guided_with_experience"):
            assert key in r, key
    # step 1 is the warm-up: nothing retrieved, no actor update; its guided subgroup (2 groups x 2) was
    # distilled before step 2 (smoke waits for distillation)
    assert rows[0]["warmup"] is True and rows[0]["optimizer_steps"] == 0
    assert rows[0]["guided_with_experience"] == 0
    assert rows[0]["extractions_parsed"] == 4 and rows[0]["extractions_failed"] == 0
    assert rows[0]["bank_size"] > 0
    assert rows[1]["warmup"] is False
    assert rows[1]["guided_with_experience"] > 0           # step 2's guided episodes used the bank
    episodes = [json.loads(x) for x in (run / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 16 and {e["subgroup"] for e in episodes} == {"free", "guided"}
    assert all(not e["experience_ids"] for e in episodes if e["subgroup"] == "free")
    updates = [r for r in rows if "extractor_update" in r]
    if method == "static":
        assert not updates                                  # its extractor stays frozen
    else:
        assert rows[1]["extractions_credited"] > 0          # guided episodes credit their lessons' writers
    for u in updates:
        assert "extractor_loss" in u and "extractor_reward_mean" in u
    ev = json.loads((run / "eval.json").read_text())
    # experience methods: the same eval tasks with the bank (guided, read-only) and without (free)
    assert ev["guided"]["guided"] is True and ev["free"]["guided"] is False
    assert ev["guided"]["tasks"] == ev["free"]["tasks"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["runs"][0]["eval"]["guided"] is not None and summary["method"] == method
    capsys.readouterr()
    assert main(["bank", "stats", str(run)]) == 0
    stats_before = capsys.readouterr().out
    assert '"count"' in stats_before
    # `eval --run` evaluates the checkpoint guided by the run's own bank (read-only) and free; before,
    # it evaluated "guided" with a fresh empty bank
    entries_before = (run / "experience.sqlite").read_bytes()
    assert main(["eval", "--run", str(run), "--episodes", "3", "--quiet"]) == 0
    ev = json.loads((run / "checkpoint-eval-split.json").read_text())
    assert ev["guided"]["guided"] is True and ev["free"]["guided"] is False and ev["method"] == method
    assert ev["guided"]["episodes"] == ev["free"]["episodes"] == 3
    assert json.loads(stats_before)["count"] > 0
    assert ev["guided"]["episodes_with_experience"] == 3     # the run's bank guided every episode
    assert (run / "experience.sqlite").read_bytes() == entries_before
    capsys.readouterr()
    assert main(["bank", "stats", str(run)]) == 0
    assert capsys.readouterr().out == stats_before           # counters untouched


@pytest.mark.slow
def test_real_model_update_changes_policy():
    """On real rollouts of the real model, an update with non-zero advantages moves the log-probs."""
    from crl_bench.config import build_config, preset_data
    from crl_bench.trainer.loop import Trainer
    from crl_bench.trainer.policy import TokenSample, build_batch, sequence_logprobs

    cfg = build_config([preset_data("smoke"), {"rollout": {"mix": "sokoban", "max_steps": 2},
                                               "train": {"lr": 1e-4}, "model": {"dtype": "float32"}}])
    tr = Trainer(cfg)
    trajs = tr.runner.collect(tr.episode_specs()[:4])
    samples = [TokenSample(t.prompt_ids, t.response_ids, t.logprobs, 1.0 if i % 2 == 0 else -1.0)
               for i, traj in enumerate(trajs) for t in traj.turns]
    batch = build_batch(samples, tr.tokenizer.pad_token_id)
    # the behaviour log-probs recorded at generation equal a fresh forward pass (same policy)
    with torch.no_grad():
        lp = sequence_logprobs(tr.model, batch)
    assert torch.allclose(lp * batch["mask"], batch["old_logprobs"], atol=2e-3)
    # a bf16 sampler (the weights' bf16 copy) and the bf16-autocast trainer differ from float32, and
    # from each other, only slightly (that difference is why the trainer recomputes old log-probs)
    from crl_bench.llm.hf_engine import HFEngine

    n = batch["mask"].sum()
    with torch.no_grad():
        sampler = sequence_logprobs(HFEngine(tr.model, tr.tokenizer, compute_dtype=torch.bfloat16).generator, batch)
        trainer = sequence_logprobs(tr.model, batch, compute_dtype=torch.bfloat16)
    for other in (sampler, trainer):
        assert float(((other - lp).abs() * batch["mask"]).sum() / n) < 0.1
    stats = tr.updater.update(samples)
    assert stats["optimizer_steps"] == 1 and stats["grad_norm"] > 0
    with torch.no_grad():
        lp2 = sequence_logprobs(tr.model, batch)
    pos = torch.tensor([s.advantage > 0 for s in samples])
    delta = ((lp2 - lp) * batch["mask"]).sum(-1)
    assert delta[pos].mean() > delta[~pos].mean()
    tr.close()


@pytest.mark.slow
def test_alfworld_smoke_run_and_eval(tmp_path, capsys, tiny_model_dir):
    """`crl-bench run --mix alfworld --preset smoke` and `crl-bench eval --mix alfworld --split eval`
    with real ALFWorld games (data from the data dir, ../shared/data in CI) and the tiny model."""
    rc = main(["run", "--method", "grpo", "--mix", "alfworld", "--preset", "smoke",
               "--output-dir", str(tmp_path), "--run-id", "smoke", "--model", str(tiny_model_dir)])
    assert rc == 0
    run = tmp_path / "smoke"
    _check_run_folder(run, steps=2)
    rows = read_metrics(run)
    assert rows[0]["env_errors"] == 0 and rows[1]["env_errors"] == 0
    assert rows[1]["prefetched_resets"] == 8          # step 2's resets were started during step 1
    assert rows[0]["env_workers"] >= 8 and 0 < rows[0]["env_worker_rss_mb_max"] < 1024
    episodes = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    # every unwon episode ends at the step limit with the failure reward
    assert all(e["reward"] == (1.0 if e["success"] else -1.0) for e in episodes)
    ev = json.loads((run / "eval.json").read_text())["free"]
    assert all(t >= 10000 for t in ev["tasks"]["alfworld"])      # eval = the 134 valid_unseen tasks
    # ALFWorld's per-task-type breakdown; the data files' checksums are recorded
    per_type = ev["per_env"]["alfworld"]["per_type"]
    assert sum(v["episodes"] for v in per_type.values()) == 4
    assert set(per_type) <= {"pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
                             "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep",
                             "pick_two_obj_and_place"}
    data = json.loads((run / "data.json").read_text())["data_checksums"]["alfworld"]
    assert any(name.endswith("eval_134.jsonl") for name in data)
    capsys.readouterr()
    rc = main(["eval", "--mix", "alfworld", "--split", "eval", "--episodes", "2", "--preset", "smoke",
               "--quiet", "--out", str(tmp_path / "ev.json"), "--model", str(tiny_model_dir)])
    assert rc == 0
    ev = json.loads((tmp_path / "ev.json").read_text())["free"]     # no bank without --run: free only
    assert ev["episodes"] == 2 and ev["split"] == "eval" and ev["tasks"]["alfworld"] == [10000, 10001]
    assert ev["env_errors"] == 0 and ev["steps_mean"] > 0


@pytest.mark.slow
def test_webshop_smoke_run_and_eval(tmp_path, capsys, tiny_model_dir):
    """`crl-bench run --mix webshop --preset smoke` and `crl-bench eval --mix webshop` with the real
    catalogue, BM25 search and the spaCy-based reward, and the tiny model."""
    rc = main(["run", "--method", "grpo", "--mix", "webshop", "--preset", "smoke",
               "--output-dir", str(tmp_path), "--run-id", "smoke", "--model", str(tiny_model_dir)])
    assert rc == 0
    run = tmp_path / "smoke"
    for name in ("config.yaml", "metrics.jsonl", "eval.json", "episodes.jsonl"):
        assert (run / name).is_file(), name
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["episodes"] == 8 and r["env_errors"] == 0 and r["tokens_per_s"] > 0 for r in rows)
    ev = json.loads((run / "eval.json").read_text())["free"]
    assert all(0 <= t < 500 for t in ev["tasks"]["webshop"])          # eval = the held-out goals
    assert 0.0 <= ev["per_env"]["webshop"]["score_mean"] <= 1.0      # WebShop's score beside success
    capsys.readouterr()
    rc = main(["eval", "--mix", "webshop", "--episodes", "2", "--preset", "smoke", "--quiet",
               "--out", str(tmp_path / "ev.json"), "--model", str(tiny_model_dir)])
    assert rc == 0
    ev = json.loads((tmp_path / "ev.json").read_text())["free"]
    assert ev["episodes"] == 2 and ev["tasks"]["webshop"] == [0, 1] and ev["env_errors"] == 0


def test_missing_engine_is_a_clear_error_and_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    """An env whose engine is not installed: exit 2, the extra and its install command named, no
    traceback, and no run folder left behind (the run failed before its first step)."""
    import sys

    for name in [m for m in sys.modules if m == "crl_bench.envs.webshop" or m.startswith("crl_bench.envs.webshop.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "thefuzz", None)          # import thefuzz -> ModuleNotFoundError
    rc = main(["run", "--method", "grpo", "--mix", "webshop", "--preset", "smoke", "--output-dir",
               str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "[webshop]" in err and "CRL_EXTRAS=webshop bash install.sh" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.slow
def test_sweep_runs_real_cells_in_subprocesses_and_resumes(tmp_path, capsys, tiny_model_dir):
    """`crl-bench sweep` of real cells (the tiny model): one cell per subprocess, summary.json in each
    run, the leaderboard reads them, and a rerun skips the finished cells."""
    args = ["sweep", "--methods", "grpo", "--seeds", "0,1", "--mix", "sokoban", "--preset", "smoke",
            "--model", str(tiny_model_dir),
            "--set", "train.steps=1", "--set", "eval.episodes=1", "--output-dir", str(tmp_path), "--name", "s"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "[1/2] grpo seed 0: done" in out and "[2/2] grpo seed 1: done" in out
    runs = tmp_path / "s" / "runs"
    for cell in ("grpo-s0", "grpo-s1"):
        validate_summary(json.loads((runs / cell / "summary.json").read_text()))
        assert (tmp_path / "s" / "logs" / f"{cell}.log").is_file()
    assert main(args) == 0
    assert capsys.readouterr().out.count("finished earlier, skipped") == 2
    assert main(["leaderboard", str(tmp_path), "--out", str(tmp_path)]) == 0
    assert "grpo-s0,grpo-s1" in (tmp_path / "leaderboard.md").read_text()
