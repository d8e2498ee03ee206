"""`crl-bench eval --model FOLDER --save-run DIR`: a model this project did not train, scored on a panel,
becomes a leaderboard row of its own (method eval-only)."""

from __future__ import annotations

import json

import pytest
import yaml
from tests_helpers import CoinEnv

from crl_bench.cli import main
from crl_bench.env_api import register_env
from crl_bench.results.leaderboard import collect, leaderboard_frame
from crl_bench.results.summary import build_summary, validate_summary


@pytest.fixture(autouse=True)
def _coin():
    register_env("test-coin", CoinEnv)


def test_a_local_model_folder_becomes_a_leaderboard_row(tmp_path, tiny_model, tokenizer, capsys):
    model_dir = tmp_path / "released-checkpoint"
    tiny_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    run = tmp_path / "runs" / "released-coin"
    args = ["eval", "--model", str(model_dir), "--mix", "test-coin", "--preset", "smoke", "--episodes", "4",
            "--set", "rollout.max_steps=2", "--quiet"]
    assert main(args + ["--save-run", str(run)]) == 0
    assert "evaluation-only run folder" in capsys.readouterr().out
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "data.json", "eval.json", "versions.json"]
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["method"] == "eval-only" and config["train"]["steps"] == 0 and config["run_id"] == "released-coin"
    ev = json.loads((run / "eval.json").read_text())
    assert ev["step"] == 0 and ev["free"]["episodes"] == 4 and ev["protocol"]["panels"].keys() == {"test-coin"}
    s = build_summary(run)
    validate_summary(s)
    assert s["method"] == "eval-only" and s["model"]["name"] == str(model_dir) and s["model"]["extractor"] is None
    df = leaderboard_frame(collect([tmp_path / "runs"]))
    assert len(df) == 1
    row = df.iloc[0]
    assert (row["method"], row["eval"], row["train_steps"], row["run_ids"]) == ("eval-only", "free", 0, "released-coin")
    assert row["success_mean/test-coin"] == pytest.approx(ev["free"]["success_rate"])
    assert row["panel"] == ev["protocol"]["panels"]["test-coin"]

    assert main(args + ["--save-run", str(run)]) == 2                       # never over an existing folder
    assert "exists" in capsys.readouterr().err
    assert main(["eval", "--run", str(run), "--save-run", str(tmp_path / "other")]) == 2
    assert "--save-run" in capsys.readouterr().err
