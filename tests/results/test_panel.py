"""Task panels (crl_bench/results/panel.py, `crl-bench panel export|check`): hashes by content, a tampered
file and a data dir that gives other content are both caught, evaluations and leaderboard rows carry them."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from test_summary import make_run

from crl_bench.cli import main
from crl_bench.env_api import make_env
from crl_bench.results.leaderboard import collect, leaderboard_frame, panels_hash, protocol_label
from crl_bench.results.panel import (
    build_panel,
    check_panel,
    content_hash,
    panel_hash,
    read_panel,
    task_entry,
)


def test_hashes_are_by_content_and_order_of_tasks():
    assert content_hash({"a": 1, "b": [1, 2]}) == content_hash({"b": [1, 2], "a": 1})    # canonical JSON
    assert content_hash({"a": 1}) != content_hash({"a": "1"})
    e = task_entry(7, {"goal": "put a mug on the desk", "price": 12.5})
    assert e["task"] == 7 and set(e["fields"]) == {"goal", "price"}
    assert e["hash"] == content_hash({"goal": content_hash("put a mug on the desk"), "price": content_hash(12.5)})
    a, b = task_entry(1, {"x": "a"}), task_entry(2, {"x": "b"})
    assert panel_hash("env", "eval", [a, b]) != panel_hash("env", "eval", [b, a])     # order is part of it
    assert panel_hash("env", "eval", [a, b]) != panel_hash("env", "train", [a, b])
    assert panels_hash({"env": "f" * 64}) == "f" * 64
    assert panels_hash({"a": "1" * 64, "b": "2" * 64}) == content_hash({"b": "2" * 64, "a": "1" * 64})


def test_export_then_check_reproduces_and_edits_are_named(tmp_path, capsys):
    out = tmp_path / "dv.json"
    assert main(["panel", "export", "diag-vault", "--episodes", "6", "--out", str(out), "--quiet"]) == 0
    panel = read_panel(out)
    env = make_env("diag-vault")
    assert [t["task"] for t in panel["tasks"]] == list(env.task_ids("eval"))[:6]
    assert set(panel["tasks"][0]["fields"]) == {"context", "solution", "first_observation"}
    assert panel["panel_hash"] in capsys.readouterr().out
    assert main(["panel", "check", str(out), "--quiet"]) == 0
    assert "reproduced" in capsys.readouterr().out

    edited = json.loads(out.read_text())            # a task hash changed by hand
    edited["tasks"][2]["hash"] = "0" * 64
    (tmp_path / "e1.json").write_text(json.dumps(edited))
    assert main(["panel", "check", str(tmp_path / "e1.json"), "--quiet"]) == 1
    text = capsys.readouterr().out
    task = panel["tasks"][2]["task"]
    assert "NOT reproduced" in text and f"task {task}: its hash does not match its fields" in text
    assert f"task {task}: fields differ" in text and "panel_hash does not match" in text

    dropped = json.loads(out.read_text())           # a task left out, hashes recomputed: the split differs
    dropped["tasks"].pop(0)
    dropped["panel_hash"] = panel_hash(dropped["env"], dropped["split"], dropped["tasks"])
    assert check_panel(dropped, env) == ["the split's tasks differ: an evaluation with episodes 6 runs 6 tasks "
                                         "here, the panel lists 5; first difference at position 0"]
    env.close()

    (tmp_path / "bad.json").write_text(json.dumps({**panel, "tasks": [{"task": "one"}]}))
    assert main(["panel", "check", str(tmp_path / "bad.json")]) == 2
    assert "tasks[0]" in capsys.readouterr().err
    (tmp_path / "nojson.json").write_text("{")
    assert main(["panel", "check", str(tmp_path / "nojson.json")]) == 2


def test_a_changed_alfworld_game_is_found(tmp_path, alfworld_env):
    """The same panel checked against a data dir whose one game file differs: that task, and only it,
    is reported, by field."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = alfworld_env                                # the session's env (conftest)
        ids = list(env.task_ids("eval"))[:3]
        panel = build_panel(env, "alfworld", "eval", ids, episodes=3)
        assert set(panel["tasks"][0]["fields"]) == {"game_file", "game_sha256", "goal"}
        assert check_panel(panel, env) == []
        games, member = Path(env.games_root), env.tasks[ids[1]].member
        # a data dir with the games unpacked: every file a link to the shared copy but one
        root = tmp_path / "data" / "alfworld"
        shutil.copytree(Path(env.data_root) / "alfworld" / "splits", root / "splits")
        shutil.copytree(games / "json_2.1.1", root / "json_2.1.1", copy_function=lambda s, d: Path(d).symlink_to(s))
        changed = root / member
        text = changed.read_text()
        changed.unlink()
        changed.write_text(text.replace("}", "} ", 1))
        other = make_env("alfworld", data_dir=str(tmp_path / "data"))
    try:
        assert Path(other.games_root) == root            # the games here, not the shared archive's
        assert check_panel(panel, other) == [f"task {ids[1]}: fields differ: game_sha256"]
    finally:
        other.close()


def test_webshop_panel_holds_goal_and_price_and_catches_other_prices():
    env = make_env("webshop")
    fp = env.task_fingerprint(0)
    goal = env.world.goals[0]
    assert fp["instruction"] == goal.instruction_text and fp["target_price"] == env.world.catalogue.prices[goal.asin]
    assert fp["price_upper"] == goal.price_upper and fp["asin"] == goal.asin
    panel = build_panel(env, "webshop", "eval", list(env.task_ids("eval"))[:20], episodes=20)
    assert check_panel(panel, env) == []
    env.close()
    reseeded = make_env("webshop", seed=1)               # prices drawn with another seed
    try:
        problems = check_panel(panel, reseeded)
    finally:
        reseeded.close()
    assert problems and all("price" in p for p in problems)


def test_leaderboard_rows_carry_the_panel_and_never_pool_two(tmp_path):
    p1, p2 = {"sokoban": "1" * 64, "minihack-room": "2" * 64}, {"sokoban": "1" * 64, "minihack-room": "3" * 64}
    make_run(tmp_path, "a0", seed=0, panels=p1)
    make_run(tmp_path, "a1", seed=1, panels=p1)
    make_run(tmp_path, "b0", seed=2, panels=p2)
    df = leaderboard_frame(collect([tmp_path]))
    rows = df[df["eval"] == "free"]
    assert sorted(rows["n_runs"]) == [1, 2]
    assert set(rows["panel"]) == {panels_hash(p1), panels_hash(p2)}
    assert any(label.endswith(f"panel {panels_hash(p1)[:12]}") for label in rows["protocol"])
    proto = {"split": "eval", "episodes": 4, "temperature": 0.0, "max_steps": {"a": 5}, "tasks_per_env": {"a": 4}}
    assert "panel" not in protocol_label(proto)       # runs written before panels


@pytest.mark.parametrize("episodes", ["all", 3])
def test_eval_protocol_names_the_panel_export_writes(tokenizer, tiny_model, tmp_path, episodes):
    """The trainer's eval protocol carries each env's panel hash, the one `panel export` writes for the
    same tasks."""
    from tests_helpers import CoinEnv

    from crl_bench.config import build_config, preset_data
    from crl_bench.env_api import register_env
    from crl_bench.trainer.loop import Trainer

    register_env("test-coin", CoinEnv)
    cfg = build_config([preset_data("smoke"), {"rollout": {"mix": "test-coin", "max_steps": 2},
                                               "eval": {"episodes": episodes}}])
    tr = Trainer(cfg, model=tiny_model, tokenizer=tokenizer)
    try:
        proto = tr.evaluator.protocol()
        env = make_env("test-coin")
        ids = tr.evaluator.task_ids()["test-coin"]
        assert proto["panels"] == {"test-coin": build_panel(env, "test-coin", "eval", ids)["panel_hash"]}
        assert tr.evaluator.panels() is not proto["panels"] and tr.evaluator.panels() == proto["panels"]
    finally:
        tr.close()


def test_swebench_panel_entry_names_the_instance_without_a_container():
    """SWE-bench's fingerprint reads the instance only (the env needs a container engine to be built, so
    the method is called on a stand-in holding the real first instance of the data)."""
    import hashlib

    from crl_bench.envs.swebench.env import EVAL_OFFSET, SWEBenchEnv
    from crl_bench.envs.swebench.instances import load_instances

    inst = load_instances(None, None)[0]

    class StandIn:
        def check_task(self, task):
            return int(task)

        def instance_of(self, task):
            assert task == EVAL_OFFSET
            return inst

    fp = SWEBenchEnv.task_fingerprint(StandIn(), EVAL_OFFSET)
    assert fp["instance_id"] == inst.instance_id and fp["base_commit"] == inst.base_commit
    assert fp["problem_statement_sha256"] == hashlib.sha256(inst.problem_statement.encode()).hexdigest()
    assert fp["fail_to_pass"] == list(inst.fail_to_pass) and fp["test_patch_sha256"] != content_hash("")
    changed = task_entry(EVAL_OFFSET, {**fp, "base_commit": "0" * 40})
    assert changed["hash"] != task_entry(EVAL_OFFSET, fp)["hash"]


def test_panel_export_takes_a_profile_s_split_and_episodes(tmp_path, capsys):
    """``panel export --profile verl-agent`` writes the panel that profile evaluates: ALFWorld's seen
    split, every task (the hash docs/envs/alfworld.md gives), not ``--split``'s default."""
    out = tmp_path / "seen.json"
    assert main(["panel", "export", "alfworld", "--profile", "verl-agent", "--out", str(out), "--quiet"]) == 0
    panel = read_panel(out)
    assert panel["split"] == "eval_seen" and len(panel["tasks"]) == 140
    assert panel["panel_hash"] == "18f9b1cc690df32ad2ee573254a69280f64b8afa04d9976c43db30123ee0f1e1"
    assert "alfworld eval_seen, 140 tasks" in capsys.readouterr().out
