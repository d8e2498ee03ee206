"""Submissions with configs and trajectories, checked against this machine's task panels, and verified by
re-running their configs (`crl-bench submission pack --trajectories`, `check`, `verify`)."""

from __future__ import annotations

import gzip
import json

import pytest
import yaml
from tests_helpers import CoinEnv

from crl_bench.cli import main
from crl_bench.env_api import register_env
from crl_bench.results.leaderboard import collect, leaderboard_frame
from crl_bench.results.submission import VERIFICATION_FILE, check_submission, is_verified, tolerance


@pytest.fixture(autouse=True)
def _coin():
    register_env("test-coin", CoinEnv)


@pytest.fixture
def submission(tmp_path, tiny_model, tokenizer):
    """One finished run of a tiny local model on test-coin (1 step, all 10 eval tasks), packed with its
    trajectories and a filled-in metadata.yaml."""
    model_dir = tmp_path / "model"
    tiny_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    assert main(["run", "--method", "grpo", "--mix", "test-coin", "--preset", "smoke", "--model", str(model_dir),
                 "--steps", "1", "--set", "eval.episodes=all", "--set", "rollout.max_steps=2",
                 "--set", "train.save_checkpoint=false", "--output-dir", str(tmp_path / "runs"),
                 "--run-id", "coin-s0", "--quiet"]) == 0
    sub = tmp_path / "subs" / "coin"
    assert main(["submission", "pack", str(tmp_path / "runs" / "coin-s0"), "--name", "coin", "--out", str(sub),
                 "--trajectories"]) == 0
    meta = {"name": "coin", "authors": ["A. Tester"], "contact": "a@example.org", "description": "a test",
            "code": "0123456789abcdef", "date": "2026-11-27"}
    (sub / "metadata.yaml").write_text(yaml.safe_dump(meta))
    return sub


def test_tolerance_by_hand():
    # n = 10, rates 0.3 and 0.5: pooled p = (3 + 5 + 1) / 22; 1.96 * sqrt(2 p (1 - p) / 10)
    p = 9 / 22
    assert tolerance(0.3, 0.5, 10) == pytest.approx(1.96 * (2 * p * (1 - p) / 10) ** 0.5)
    assert tolerance(0.0, 0.0, 100) > 0.0                    # two zeros still allow one episode's difference
    with pytest.raises(ValueError):
        tolerance(0.5, 0.5, 0)


def test_pack_check_verify_and_a_tampered_submission(submission, tmp_path, capsys):
    run = tmp_path / "runs" / "coin-s0"
    assert (submission / "configs" / "coin-s0.yaml").read_text() == (run / "config.yaml").read_text()
    with gzip.open(submission / "trajectories" / "coin-s0.jsonl.gz", "rt") as fh:
        assert fh.read() == (run / "episodes.jsonl").read_text()
    notes: list[str] = []
    assert check_submission(submission, notes=notes) == [] and notes == []     # the panel is checked here

    work = tmp_path / "work"
    assert main(["submission", "verify", str(submission), "--work", str(work), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "coin-s0 free test-coin: submitted" in out and "verified; wrote" in out
    v = json.loads((submission / VERIFICATION_FILE).read_text())
    assert v["verified"] is True and v["runs"][0]["rerun"] == str(work / "verify-coin-s0")
    assert v["runs"][0]["protocol_differences"] == []
    assert is_verified(submission) and check_submission(submission) == []
    df = leaderboard_frame(collect([tmp_path / "subs"]))
    assert list(df["verified"]) == ["yes"]

    # the summary changed after verification: the flag no longer holds, and check says so
    summary = json.loads((submission / "summary.json").read_text())
    free = summary["runs"][0]["eval"]["free"]
    flipped = 1.0 if free["success_rate"] < 0.5 else 0.0
    free["success_rate"] = free["per_env"]["test-coin"]["success_rate"] = flipped
    (submission / "summary.json").write_text(json.dumps(summary))
    assert not is_verified(submission)
    assert any(VERIFICATION_FILE in p and "another summary.json" in p for p in check_submission(submission))
    assert list(leaderboard_frame(collect([tmp_path / "subs"]))["verified"]) == [""]
    # verified again: the re-run does not reproduce the edited number
    assert main(["submission", "verify", str(submission), "--work", str(tmp_path / "work2"), "--quiet"]) == 1
    assert "DIFFERS" in capsys.readouterr().out
    assert json.loads((submission / VERIFICATION_FILE).read_text())["verified"] is False


def test_a_submission_on_another_panel_is_refused(submission, tmp_path, capsys):
    summary = json.loads((submission / "summary.json").read_text())
    summary["eval_protocol"]["panels"]["test-coin"] = "0" * 64
    (submission / "summary.json").write_text(json.dumps(summary))
    problems = check_submission(submission)
    assert len(problems) == 1 and "$.eval_protocol.panels.test-coin: panel 000000000000 is not the panel" in problems[0]
    assert main(["submission", "check", str(submission)]) == 1
    assert main(["submission", "verify", str(submission), "--work", str(tmp_path / "w")]) == 2
    assert "fix them first" in capsys.readouterr().err


def test_trajectories_must_name_a_run_and_be_gzip_json_lines(submission):
    (submission / "trajectories" / "someone-else.jsonl.gz").write_bytes(gzip.compress(b"{}\n"))
    (submission / "trajectories" / "coin-s0.jsonl.gz").write_bytes(b"not gzip")
    problems = check_submission(submission)
    assert any("someone-else.jsonl.gz: not the trajectories of a run" in p for p in problems)
    assert any("coin-s0.jsonl.gz: not gzip-compressed JSON lines" in p for p in problems)
