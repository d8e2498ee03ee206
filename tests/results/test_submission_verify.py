"""Submissions with configs and trajectories, checked against this machine's task panels, and verified by
re-running their configs (`crl-bench submission pack --trajectories`, `check`, `verify`)."""

from __future__ import annotations

import gzip
import json
import shutil

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


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tiny_model_dir):
    """One finished run of a tiny local model on test-coin (1 step, all 10 eval tasks), packed with its
    trajectories and a filled-in metadata.yaml; built once, each test gets a copy (``submission``)."""
    register_env("test-coin", CoinEnv)
    root = tmp_path_factory.mktemp("packed")
    assert main(["run", "--method", "grpo", "--mix", "test-coin", "--preset", "smoke", "--model", str(tiny_model_dir),
                 "--steps", "1", "--set", "eval.episodes=all", "--set", "rollout.max_steps=2",
                 "--set", "train.save_checkpoint=false", "--output-dir", str(root / "runs"),
                 "--run-id", "coin-s0", "--quiet"]) == 0
    sub = root / "subs" / "coin"
    assert main(["submission", "pack", str(root / "runs" / "coin-s0"), "--name", "coin", "--out", str(sub),
                 "--trajectories"]) == 0
    meta = {"name": "coin", "authors": ["A. Tester"], "contact": "a@example.org", "description": "a test",
            "code": "0123456789abcdef", "date": "2026-11-27"}
    (sub / "metadata.yaml").write_text(yaml.safe_dump(meta))
    return root


@pytest.fixture
def submission(packed, tmp_path):
    """A copy of :func:`packed` under ``tmp_path``: ``runs/coin-s0`` and the submission ``subs/coin``."""
    shutil.copytree(packed, tmp_path, dirs_exist_ok=True)
    return tmp_path / "subs" / "coin"


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
    assert any("someone-else.jsonl.gz: not a file of a run of this submission" in p for p in problems)
    assert any("coin-s0.jsonl.gz: not gzip-compressed JSON lines" in p for p in problems)


# ---- verify re-runs within bounds ------------------------------------------------------------------
def _edit_config(sub, edit):
    """Apply ``edit`` to the submission's configs/coin-s0.yaml and record the new training settings in
    its summary, as a submitter who packed that config would have."""
    from crl_bench.results.summary import settings_hash

    path = sub / "configs" / "coin-s0.yaml"
    cfg = yaml.safe_load(path.read_text())
    edit(cfg)
    path.write_text(yaml.safe_dump(cfg))
    summary = json.loads((sub / "summary.json").read_text())
    summary["runs"][0]["settings"] = settings_hash(cfg)
    (sub / "summary.json").write_text(json.dumps(summary))


class _Stop(Exception):
    pass


def test_verify_reruns_only_the_allowed_fields_locally_into_work(submission, tmp_path):
    from crl_bench.results.submission import verify_submission

    def hostile(cfg):
        cfg["backend"] = "ray"
        cfg["ray"] = {"address": "10.0.0.1:6379"}
        cfg["logging"] = {"backends": ["jsonl", "tensorboard", "wandb"], "wandb_mode": "online",
                          "tensorboard_dir": str(tmp_path / "outside")}
        cfg["output_dir"] = str(tmp_path / "outside")
        cfg["eval"]["every"] = 1
        cfg["train"].update(save_checkpoint=True, checkpoint_every=1)
        cfg["generation"]["batch_size"] = 4096

    _edit_config(submission, hostile)
    said, seen = [], []

    def rerun(cfg):
        seen.append(cfg)
        raise _Stop

    with pytest.raises(_Stop):
        verify_submission(submission, rerun, tmp_path / "work", say=said.append)
    cfg = seen[0]
    assert (cfg.backend, cfg.ray.address) == ("local", "")
    assert (cfg.logging.backends, cfg.logging.wandb_mode, cfg.logging.tensorboard_dir) == (["jsonl"], "disabled", "")
    assert (cfg.output_dir, cfg.run_id) == (str(tmp_path / "work"), "verify-coin-s0")
    assert (cfg.eval.every, cfg.train.save_checkpoint, cfg.generation.batch_size) == (0, False, 32)
    assert (cfg.train.steps, cfg.rollout.mix, cfg.method) == (1, "test-coin", "grpo")      # what defines the run
    assert len(said) == 1 and said[0].startswith(
        "plan coin-s0: training 1 steps x 2 groups x 4 episodes = 8 episodes, evaluation 10 tasks x 1 x 1 modes = 10 "
        "episodes, at most 2 actions each; the submitted run trained in ")
    assert said[0].endswith(" s on its own machine (no estimate for this one)")
    assert not (tmp_path / "outside").exists()


def test_verify_refuses_sizes_beyond_the_submission_before_running(submission, tmp_path, capsys):
    def bigger(cfg):
        cfg["train"].update(steps=10**6, group_size=64)
        cfg["eval"]["episodes"] = 5
        cfg["rollout"]["max_steps"] = 500

    _edit_config(submission, bigger)
    assert main(["submission", "verify", str(submission), "--work", str(tmp_path / "work")]) == 2
    err = capsys.readouterr().err
    assert "train.steps 1000000 is more than the 1 steps the submission records" in err
    assert ("1000000 steps x 2 groups x 64 episodes = 128000000 training episodes, more than the 8 the "
            "submission records") in err
    assert "eval.episodes 5 is not the protocol's 'all'" in err
    assert "rollout.max_steps 500 is more than the protocol's 2 actions per episode" in err
    assert not (tmp_path / "work" / "verify-coin-s0").exists()


def test_verify_refuses_a_config_that_is_not_the_runs(submission, tmp_path, capsys):
    path = submission / "configs" / "coin-s0.yaml"
    path.write_text(path.read_text().replace("steps: 1\n", "steps: 0\n", 1))      # summary's settings unchanged
    assert main(["submission", "verify", str(submission), "--work", str(tmp_path / "work")]) == 2
    assert "not the config of run coin-s0 (its training settings hash to" in capsys.readouterr().err


def test_verify_checks_env_settings(submission, tmp_path, capsys):
    def settings(cfg):
        cfg["rollout"]["env_kwargs"] = {"test-coin": {"bogus": 1}, "sokoban": {"num_boxes": 2}}

    _edit_config(submission, settings)
    assert main(["submission", "verify", str(submission), "--work", str(tmp_path / "work")]) == 2
    err = capsys.readouterr().err
    assert "rollout.env_kwargs.test-coin.bogus: not a setting of test-coin (it accepts: max_steps, render_mode)" in err
    assert "rollout.env_kwargs.sokoban: not an env of the submission's mix" in err


def test_env_settings_keep_constructor_parameters_with_plain_values_and_drop_local_ones():
    from crl_bench.results.rerun import check_env_settings

    c = check_env_settings("alfworld", {"data_dir": "/home/x", "success_reward": 2.0, "bogus": 1,
                                        "timeout_s": {"a": 1}}, "s")
    assert c.kept == {"success_reward": 2.0} and c.dropped == ["data_dir"]
    assert [p.split(":")[0] for p in c.problems] == ["s.bogus", "s.timeout_s"]
    assert check_env_settings("no-such-env", {}, "s").unavailable.startswith("s: the settings of 'no-such-env' cannot")
    assert check_env_settings("alfworld", [1], "s").problems == ["s: must be a mapping of setting -> value, got list"]


def test_verify_plan_prints_the_cost_and_runs_nothing(submission, tmp_path, capsys):
    assert main(["submission", "verify", str(submission), "--work", str(tmp_path / "work"), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "plan coin-s0: training 1 steps x 2 groups x 4 episodes = 8 episodes, evaluation 10 tasks" in out
    assert not (submission / VERIFICATION_FILE).exists() and not (tmp_path / "work" / "verify-coin-s0").exists()


def test_a_run_id_that_is_not_a_name_is_refused_before_any_folder(submission, tmp_path, capsys):
    from crl_bench.results.rerun import rerun_config
    from crl_bench.results.summary import SummaryError

    summary = json.loads((submission / "summary.json").read_text())
    summary["runs"][0]["run_id"] = "a/../../x"
    (submission / "summary.json").write_text(json.dumps(summary))
    assert any("$.runs[0].run_id: 'a/../../x' is not a name: a letter" in p for p in check_submission(submission))
    assert main(["submission", "verify", str(submission), "--work", str(tmp_path / "w" / "work")]) == 2
    assert "run_id: 'a/../../x' is not a name" in capsys.readouterr().err
    assert not (tmp_path / "w").exists() or list((tmp_path / "w").rglob("*")) == [tmp_path / "w" / "work"]
    with pytest.raises(SummaryError, match="run_id 'a/../../x': a name must start with a letter"):
        rerun_config({}, summary, summary["runs"][0], tmp_path / "work", "c.yaml")


# ---- submissions hardened ----------------------------------------------------------------------------
@pytest.mark.parametrize("line,why", [(b"[" * 100_000, "nested deeper than the 64 levels"),
                                      (b"1" * 5000, "an integer of 5000 digits"),
                                      (b'{"a": NaN}', "NaN is not a finite number"),
                                      (b"\xff{}", "line 2 is not UTF-8 text")])
def test_trajectory_lines_are_parsed_with_the_bounded_parser(submission, line, why):
    path = submission / "trajectories" / "coin-s0.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"ok": 1}\n' + line + b"\n"))
    problems = check_submission(submission)
    assert len(problems) == 1 and problems[0].startswith(f"{path}: line 2") and why in problems[0], problems


def test_trajectory_size_caps(submission, monkeypatch):
    import crl_bench.results.submission as sm

    path = submission / "trajectories" / "coin-s0.jsonl.gz"
    monkeypatch.setattr(sm, "TRAJECTORY_MAX_LINE", 8)
    assert check_submission(submission) == [f"{path}: line 1 is longer than the 8 bytes accepted"]
    monkeypatch.setattr(sm, "TRAJECTORY_MAX_BYTES", 10)
    assert check_submission(submission)[0].startswith(f"{path}: {path.stat().st_size} bytes, more than the 10")


def test_linked_trajectories_and_configs_folders_are_refused_unread(submission, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "coin-s0.jsonl.gz").write_bytes(gzip.compress(b"{}\n"))
    for sub in ("trajectories", "configs"):
        shutil.rmtree(submission / sub)
        (submission / sub).symlink_to(outside)
    problems = check_submission(submission)
    assert problems == [f"{submission / 'configs'}: a symbolic link; refused (a submission's files must be inside "
                        "its folder)",
                        f"{submission / 'trajectories'}: a symbolic link; refused (a submission's files must be "
                        "inside its folder)"]


def test_check_parses_every_config_as_a_config(submission):
    configs = submission / "configs"
    good = (configs / "coin-s0.yaml").read_text()
    (configs / "someone-else.yaml").write_text(good)
    (configs / "coin-s0.yaml").write_text(good.replace("steps: 1\n", "steps: -5\n", 1))
    problems = check_submission(submission)
    assert any(p.startswith(f"{configs / 'someone-else.yaml'}: not a file of a run") for p in problems)
    bad = f"{configs / 'coin-s0.yaml'}: not a valid config (invalid value for train.steps: -5"
    assert any(p.startswith(bad) for p in problems)
    (configs / "coin-s0.yaml").write_text(good.replace("steps: 1\n", "steps: 3\n", 1))
    assert any("not the config of run coin-s0" in p for p in check_submission(submission))
    (configs / "coin-s0.yaml").write_text("a: &x [1]\nb: [" + ", ".join(["*x"] * 1001) + "]\n")
    assert any("coin-s0.yaml: not valid YAML (more than 1000 aliases" in p for p in check_submission(submission))


def test_bad_env_settings_are_a_problem_not_a_crash(submission, capsys):
    summary = json.loads((submission / "summary.json").read_text())
    summary["eval_protocol"]["env_settings"] = {"test-coin": {"bogus": 1, "max_steps": {"deep": [1]}}}
    (submission / "summary.json").write_text(json.dumps(summary))
    problems = check_submission(submission)
    assert [p.split(": ")[1] for p in problems] == ["$.eval_protocol.env_settings.test-coin.bogus",
                                                    "$.eval_protocol.env_settings.test-coin.max_steps"]
    assert main(["submission", "check", str(submission)]) == 1
    assert "not a setting of test-coin" in capsys.readouterr().err


def test_pack_refuses_a_config_linked_out_of_the_run(submission, tmp_path, capsys):
    run = tmp_path / "runs" / "coin-s0"
    (tmp_path / "secret").write_text("root:x:0:0\n")
    (run / "config.yaml").unlink()
    (run / "config.yaml").symlink_to(tmp_path / "secret")
    assert main(["submission", "pack", str(run), "--name", "x", "--out", str(tmp_path / "x")]) == 2
    assert "config.yaml: is a symbolic link to a file outside" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()                     # refused before anything is written
    (run / "config.yaml").unlink()
    (run / "episodes.jsonl").rename(tmp_path / "episodes")
    (run / "config.yaml").write_text((submission / "configs" / "coin-s0.yaml").read_text())
    (run / "episodes.jsonl").symlink_to(tmp_path / "episodes")
    assert main(["submission", "pack", str(run), "--name", "x", "--out", str(tmp_path / "y"), "--trajectories"]) == 2
    assert "episodes.jsonl: is a symbolic link to a file outside" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_the_leaderboard_reads_no_config_through_a_linked_configs_folder(submission, tmp_path):
    from crl_bench.results.summary import fill_settings

    summary = json.loads((submission / "summary.json").read_text())
    del summary["runs"][0]["settings"]
    assert list(fill_settings(json.loads(json.dumps(summary)), submission))         # read from configs/
    shutil.move(submission / "configs", tmp_path / "elsewhere")
    (submission / "configs").symlink_to(tmp_path / "elsewhere")
    assert fill_settings(summary, submission) == {}
