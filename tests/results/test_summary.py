"""summary.json: built from synthetic run folders (new and old eval.json), validated by the schema."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from crl_bench.results.summary import (
    SummaryError,
    build_summary,
    load_schema,
    read_summary,
    summary_problems,
    validate_summary,
    write_summary,
)

SHA = "ab" * 32


def _eval_block(per_env: dict[str, float], steps: float = 3.0, invalid: float = 0.1, episodes: int = 4,
                types: bool = False) -> dict:
    """An EVAL block of eval.json with the given per-env success rates."""
    rows = {}
    for env_id, sr in per_env.items():
        rows[env_id] = {"episodes": episodes, "success_rate": sr, "steps_mean": steps,
                        "invalid_action_rate": invalid, "score_mean": sr}
        if types:
            rows[env_id]["per_type"] = {"pick": {"episodes": episodes, "success_rate": sr}}
    n = episodes * len(per_env)
    pooled = sum(per_env.values()) / len(per_env) if per_env else 0.0
    return {"episodes": n, "success_rate": pooled, "reward_mean": pooled, "steps_mean": steps,
            "invalid_action_rate": invalid, "env_errors": 0, "wall_s": 1.5, "per_env": rows,
            "guided": False, "split": "eval", "temperature": 0.0,
            "tasks": {e: list(range(1000000, 1000000 + episodes)) for e in per_env}}


def make_run(root: Path, run_id: str, *, method: str = "grpo", mix: str = "sokoban:1,minihack-room:1",
             seed: int = 0, free: dict[str, float] | None = None, guided: dict[str, float] | None = None,
             episodes: int | str = 4, temperature: float = 0.0, max_steps: int = 6,
             train_rows: list[tuple[int, float]] = ((8, 2.0), (8, 3.0)), old_format: bool = False,
             finished: bool = True, steps_mean: float = 3.0, invalid: float = 0.1,
             initial: dict[str, float] | None = None, env_kwargs: dict | None = None,
             panels: dict[str, str] | None = None) -> Path:
    """Write a synthetic run folder ``root/run_id`` (config.yaml, versions.json, metrics.jsonl,
    data.json and, when ``finished``, eval.json in the new or old format)."""
    free = {"sokoban": 0.5, "minihack-room": 0.25} if free is None else free
    d = root / run_id
    d.mkdir(parents=True)
    config = {"method": method, "model": {"name": "smollm2-135m-instruct", "dtype": "float32"},
              "generation": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 24},
              "rollout": {"mix": mix, "max_steps": max_steps, **({"env_kwargs": env_kwargs} if env_kwargs else {})},
              "train": {"steps": len(train_rows), "seed": seed, "groups_per_step": 2, "group_size": 4},
              "eval": {"episodes": episodes, "every": 0, "temperature": temperature, "split": "eval"},
              "extractor": {"model": "same"}, "output_dir": str(root), "run_id": run_id}
    (d / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (d / "versions.json").write_text(json.dumps({
        "python": "3.11.9", "platform": "Linux", "packages": {"crl-bench": "0.1.0", "torch": "2.5.0"},
        "git_commit": "0123456789abcdef0123456789abcdef01234567", "started": "2025-01-01T00:00:00+0000"}))
    rows = [{"step": i + 1, "episodes": n, "success_rate": 0.5, "invalid_action_rate": 0.1, "steps_mean": 3.0,
             "time_step_s": w} for i, (n, w) in enumerate(train_rows)]
    rows.insert(1, {"step": 1, "eval": {"success_rate": 0.9}})        # a periodic eval row: not training
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "data.json").write_text(json.dumps({"data_checksums": {"sokoban": {"levels.txt": SHA}}}))
    if not finished:
        return d
    n_tasks = episodes if isinstance(episodes, int) else 10
    if old_format:
        block = _eval_block(guided if guided is not None else free, steps_mean, invalid, n_tasks)
        block["guided"] = guided is not None
        block["temperature"] = temperature
        block["step"] = len(train_rows)
        ev = block
    else:
        envs = list(free)
        ev = {"step": len(train_rows),
              "protocol": {"split": "eval", "episodes": episodes, "temperature": temperature, "top_p": 1.0,
                           "top_k": 0, "max_new_tokens": 24, "max_steps": {e: max_steps for e in envs},
                           "tasks_per_env": {e: n_tasks for e in envs}, **({"panels": panels} if panels else {})},
              "free": _eval_block(free, steps_mean, invalid, n_tasks, types=True)}
        if guided is not None:
            ev["guided"] = _eval_block(guided, steps_mean, invalid, n_tasks)
        if initial is not None:
            ev["initial"] = {"step": 0, "free": _eval_block(initial, steps_mean, invalid, n_tasks)}
    (d / "eval.json").write_text(json.dumps(ev))
    return d


def test_schemas_are_valid_draft_2020_12():
    for name in ("summary", "submission_metadata", "reported"):
        jsonschema.Draft202012Validator.check_schema(load_schema(name))
    with pytest.raises(SummaryError, match="no schema 'nope'.*summary.schema.json"):
        load_schema("nope")


def test_build_summary_new_format(tmp_path):
    d = make_run(tmp_path, "r0", method="complementary", seed=3, free={"sokoban": 0.5, "minihack-room": 0.25},
                 guided={"sokoban": 0.75, "minihack-room": 0.5}, train_rows=[(8, 2.0), (8, 3.0), (16, 1.5)])
    s = build_summary(d)
    validate_summary(s)
    assert s["kind"] == "run" and s["method"] == "complementary" and s["seeds"] == [3]
    assert s["model"] == {"name": "smollm2-135m-instruct", "variant": None, "extractor": "smollm2-135m-instruct"}
    assert s["mix"]["name"] == "sokoban:1,minihack-room:1"
    assert s["mix"]["envs"] == {"sokoban": 0.5, "minihack-room": 0.5}
    run = s["runs"][0]
    assert run["run_id"] == "r0" and run["seed"] == 3
    # train rows summed, the periodic eval row skipped
    assert run["train"] == {"steps": 3, "episodes": 32, "wall_s": pytest.approx(6.5)}
    free, guided = run["eval"]["free"], run["eval"]["guided"]
    assert "tasks" not in free and "wall_s" not in free and "guided" not in free
    assert free["per_env"]["sokoban"]["success_rate"] == 0.5
    assert free["per_env"]["sokoban"]["per_type"] == {"pick": {"episodes": 4, "success_rate": 0.5}}
    assert free["per_env"]["minihack-room"]["score_mean"] == 0.25
    assert guided["per_env"]["sokoban"]["success_rate"] == 0.75
    p = s["eval_protocol"]
    assert p["episodes"] == 4 and p["temperature"] == 0.0 and p["max_steps"] == {"sokoban": 6, "minihack-room": 6}
    assert p["tasks_per_env"] == {"sokoban": 4, "minihack-room": 4}
    assert s["versions"]["crl_bench"] == "0.1.0" and s["versions"]["git_commit"].startswith("0123")
    assert s["data_checksums"] == {"sokoban": {"levels.txt": SHA}}


def test_grpo_has_no_guided_block_nor_extractor_and_shipped_mix_resolves(tmp_path):
    envs = {"minihack-room": 0.1, "webshop": 0.2, "alfworld": 0.3}
    s = build_summary(make_run(tmp_path, "g", mix="3task", free=envs))
    assert s["runs"][0]["eval"]["guided"] is None and s["model"]["extractor"] is None
    assert s["mix"] == {"name": "3task", "envs": {e: pytest.approx(1 / 3) for e in envs}}


def test_write_summary_writes_valid_file(tmp_path):
    d = make_run(tmp_path, "r1")
    path = write_summary(d)
    assert path == d / "summary.json"
    data = read_summary(d)
    assert data["runs"][0]["run_id"] == "r1"
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]


def test_old_format_guided_eval_is_the_guided_block(tmp_path):
    d = make_run(tmp_path, "old", method="complementary", old_format=True, guided={"sokoban": 0.5},
                 free={"sokoban": 0.0}, mix="sokoban", temperature=0.5)
    s = build_summary(d)
    validate_summary(s)
    ev = s["runs"][0]["eval"]
    assert ev["free"] is None and ev["guided"]["success_rate"] == 0.5
    assert ev["guided"]["per_env"]["sokoban"]["success_rate"] == 0.5
    p = s["eval_protocol"]
    assert p["split"] == "eval" and p["episodes"] == 4 and p["temperature"] == 0.5 and p["top_p"] == 1.0
    assert p["max_steps"] == {"sokoban": 6} and p["tasks_per_env"] == {"sokoban": 4}
    assert p["max_new_tokens"] == 24


def test_old_format_unguided_eval_is_the_free_block(tmp_path):
    s = build_summary(make_run(tmp_path, "old", old_format=True))
    validate_summary(s)
    assert s["runs"][0]["eval"]["guided"] is None
    assert s["runs"][0]["eval"]["free"]["per_env"]["minihack-room"]["success_rate"] == 0.25


def test_unfinished_run_and_missing_pieces_name_the_file(tmp_path):
    d = make_run(tmp_path, "u", finished=False)
    with pytest.raises(SummaryError, match=r"eval\.json: missing \(the run is unfinished"):
        build_summary(d)
    d2 = make_run(tmp_path, "nomethod")
    cfg = yaml.safe_load((d2 / "config.yaml").read_text())
    del cfg["method"]
    (d2 / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(SummaryError, match=r"config\.yaml: missing 'method'"):
        build_summary(d2)
    d3 = make_run(tmp_path, "badeval")
    ev = json.loads((d3 / "eval.json").read_text())
    del ev["free"]["steps_mean"]
    (d3 / "eval.json").write_text(json.dumps(ev))
    with pytest.raises(SummaryError, match=r"eval\.json: missing free\.steps_mean"):
        build_summary(d3)
    with pytest.raises(SummaryError, match="not a folder"):
        build_summary(tmp_path / "nowhere")


@pytest.fixture()
def summary(tmp_path):
    return build_summary(make_run(tmp_path, "v", method="static", guided={"sokoban": 0.5, "minihack-room": 0.5}))


def test_validate_rejects_out_of_range_success_rate_with_its_path(summary):
    bad = copy.deepcopy(summary)
    bad["runs"][0]["eval"]["free"]["success_rate"] = 1.5
    with pytest.raises(SummaryError) as e:
        validate_summary(bad, source="x/summary.json")
    assert "x/summary.json: $.runs[0].eval.free.success_rate: 1.5 is greater than the maximum of 1" in str(e.value)
    bad = copy.deepcopy(summary)
    bad["runs"][0]["eval"]["guided"]["per_env"]["sokoban"]["success_rate"] = -0.1
    assert summary_problems(bad) == [
        "$.runs[0].eval.guided.per_env.sokoban.success_rate: -0.1 is less than the minimum of 0"]


def test_validate_rejects_missing_method_unknown_kind_negative_counts(summary):
    bad = copy.deepcopy(summary)
    del bad["method"]
    bad["kind"] = "draft"
    bad["runs"][0]["train"]["episodes"] = -1
    with pytest.raises(SummaryError) as e:
        validate_summary(bad, source="s.json")
    problems = e.value.problems
    assert "s.json: $: 'method' is a required property" in problems
    assert any(p.startswith("s.json: $.kind: 'draft' is not one of") for p in problems)
    assert any(p.startswith("s.json: $.runs[0].train.episodes: -1 is less than the minimum") for p in problems)
    assert len(problems) == 3


def test_validate_rejects_seeds_not_matching_runs_and_foreign_envs(summary):
    bad = copy.deepcopy(summary)
    bad["seeds"] = [1]
    bad["runs"][0]["eval"]["free"]["per_env"]["webshop"] = bad["runs"][0]["eval"]["free"]["per_env"]["sokoban"]
    problems = summary_problems(bad)
    assert "$.seeds: [1] does not match the seeds of $.runs [0]" in problems
    assert any(p.startswith("$.runs[0].eval.free.per_env.webshop: env is not in the mix") for p in problems)
    assert "$.eval_protocol.max_steps: no entry for evaluated env 'webshop'" in problems
    two = copy.deepcopy(summary)
    two["runs"].append(copy.deepcopy(two["runs"][0]))
    two["seeds"].append(0)
    problems = summary_problems(two)
    assert "$.runs: a summary of kind 'run' has exactly one run, got 2" in problems
    assert "$.runs: run_id 'v' appears 2 times" in problems


@pytest.mark.parametrize("run_id", ["a/../../x", "..", "a..b", "/abs", ".hidden", "x\n", "a" * 129, ""])
def test_a_run_id_must_be_a_name(summary, run_id):
    """The run id names files and folders (configs/<run id>.yaml, verify's re-run): check_name's rule."""
    bad = copy.deepcopy(summary)
    bad["runs"][0]["run_id"] = run_id
    assert [p for p in summary_problems(bad) if p.startswith("$.runs[0].run_id: ")]
    bad["runs"][0]["run_id"] = "2026-grpo_x.s0"
    assert summary_problems(bad) == []


def test_validate_requires_one_eval_block(summary):
    bad = copy.deepcopy(summary)
    bad["runs"][0]["eval"] = {"free": None, "guided": None}
    assert summary_problems(bad)
    validate_summary(summary)                   # the original is valid
