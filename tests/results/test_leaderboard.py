"""Leaderboard and submissions from synthetic run folders: numbers checked against hand computation."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pandas as pd
import pytest
import yaml
from test_summary import make_run

from crl_bench.config import RunConfig
from crl_bench.results.leaderboard import (
    collect,
    leaderboard_frame,
    leaderboard_markdown,
    main_leaderboard,
    protocol_label,
    write_leaderboard,
)
from crl_bench.results.panel import content_hash
from crl_bench.results.stats import bootstrap_ci
from crl_bench.results.submission import check_submission, main_submission_check, main_submission_pack, pack_submission
from crl_bench.results.summary import (
    SummaryError,
    build_summary,
    config_settings_hash,
    config_training_settings,
    pooled_settings,
    write_summary,
)

ENVS = ("sokoban", "minihack-room")


def _three_seeds(root, method="grpo", guided=False, **kw):
    """Seeds 0..2; sokoban 0.25/0.5/0.75, minihack-room 0/0.5/1 (free); guided adds 0.25 to each."""
    sok, room = [0.25, 0.5, 0.75], [0.0, 0.5, 1.0]
    dirs = []
    for s in range(3):
        free = {"sokoban": sok[s], "minihack-room": room[s]}
        g = {e: min(1.0, v + 0.25) for e, v in free.items()} if guided else None
        dirs.append(make_run(root, f"{method}-s{s}", method=method, seed=s, free=free, guided=g,
                             train_rows=[(8, 10.0 + s), (8, 20.0)], steps_mean=2.0 + s, invalid=0.1 * s, **kw))
    return dirs


def _pool(config_path):
    """The hash the leaderboard pools a run of this config by."""
    return content_hash(pooled_settings(config_training_settings(config_path)))


#: The default learning rate as a settings label writes it.
LR = json.dumps(RunConfig().train.lr)


def _row(df, **match):
    sel = df
    for k, v in match.items():
        sel = sel[sel[k] == v]
    assert len(sel) == 1, f"{match}: {len(sel)} rows"
    return sel.iloc[0]


def test_means_stds_and_bootstrap_against_hand_computation(tmp_path):
    _three_seeds(tmp_path)
    warnings = []
    df = leaderboard_frame(collect([tmp_path], warnings), warnings)
    assert warnings == [] and len(df) == 1
    r = df.iloc[0]
    assert (r["method"], r["eval"], r["n_runs"], r["seeds"]) == ("grpo", "free", 3, "0,1,2")
    assert r["success_mean/sokoban"] == pytest.approx(0.5)
    assert r["success_std/sokoban"] == pytest.approx(0.25)           # sample std of .25, .5, .75
    assert r["success_mean/minihack-room"] == pytest.approx(0.5)
    assert r["success_std/minihack-room"] == pytest.approx(0.5)
    assert r["n/sokoban"] == 3 and r["n/minihack-room"] == 3
    # per seed: mean over envs = .125, .5, .875 -> mean .5, sample std .375
    assert r["overall_mean"] == pytest.approx(0.5) and r["overall_std"] == pytest.approx(0.375)
    assert r["overall_n"] == 3
    assert r["overall_ci_low"] < 0.5 < r["overall_ci_high"]
    assert 0.125 <= r["overall_ci_low"] and r["overall_ci_high"] <= 0.875
    assert (r["overall_ci_low"], r["overall_ci_high"]) == bootstrap_ci([0.125, 0.5, 0.875])
    assert r["steps_mean"] == pytest.approx(3.0) and r["invalid_action_rate"] == pytest.approx(0.1)
    assert r["train_steps"] == 2 and r["train_episodes"] == 16
    assert r["train_wall_s"] == pytest.approx(31.0)                  # (30 + 31 + 32) / 3
    assert r["run_ids"] == "grpo-s0,grpo-s1,grpo-s2"
    assert r["protocol"] == "eval · 4 ep/env · T=0 · max_new_tokens 24 · max_steps 6"


def test_bootstrap_is_deterministic_and_needs_three():
    a = bootstrap_ci([0.1, 0.4, 0.2, 0.9])
    assert a == bootstrap_ci([0.1, 0.4, 0.2, 0.9])
    assert a[0] < np.mean([0.1, 0.4, 0.2, 0.9]) < a[1]
    assert bootstrap_ci([0.3, 0.3, 0.3]) == (0.3, 0.3)
    with pytest.raises(ValueError, match="at least 3"):
        bootstrap_ci([0.1, 0.2])


def test_complementary_gives_guided_and_free_rows(tmp_path):
    _three_seeds(tmp_path / "c", method="complementary", guided=True)
    _three_seeds(tmp_path / "g", method="grpo")
    df = leaderboard_frame(collect([tmp_path]))
    assert sorted(zip(df["method"], df["eval"])) == [("complementary", "free"), ("complementary", "guided"),
                                                     ("grpo", "free")]
    g = _row(df, method="complementary", eval="guided")
    # guided sokoban .5/.75/1, room .25/.75/1 -> overall per seed .375/.75/1
    assert g["success_mean/sokoban"] == pytest.approx(0.75)
    assert g["success_mean/minihack-room"] == pytest.approx(2 / 3)
    assert g["overall_mean"] == pytest.approx(np.mean([0.375, 0.75, 1.0]))
    assert g["extractor"] == "smollm2-135m-instruct"
    f = _row(df, method="complementary", eval="free")
    assert f["overall_mean"] == pytest.approx(0.5)
    assert _row(df, method="grpo", eval="free")["extractor"] == ""
    # sorted by overall mean within the mix: guided (.708) first
    assert df.iloc[0]["eval"] == "guided"


def test_missing_env_in_one_seed_makes_n_smaller_not_zero(tmp_path):
    make_run(tmp_path, "s0", seed=0, free={"sokoban": 0.2, "minihack-room": 0.4})
    make_run(tmp_path, "s1", seed=1, free={"sokoban": 0.6, "minihack-room": 0.8})
    d = make_run(tmp_path, "s2", seed=2, free={"sokoban": 1.0, "minihack-room": 0.0})
    ev = json.loads((d / "eval.json").read_text())
    del ev["free"]["per_env"]["minihack-room"]              # same protocol, no result for that env
    (d / "eval.json").write_text(json.dumps(ev))
    df = leaderboard_frame(collect([tmp_path]))
    r = df.iloc[0]
    assert r["n/sokoban"] == 3 and r["success_mean/sokoban"] == pytest.approx(0.6)
    assert r["n/minihack-room"] == 2 and r["success_mean/minihack-room"] == pytest.approx(0.6)
    assert r["success_std/minihack-room"] == pytest.approx(math.sqrt(0.08))   # (.2² + .2²) / (2 - 1)
    # the seed without minihack-room is left out of the overall mean (never counted as 0)
    assert r["overall_n"] == 2 and r["overall_mean"] == pytest.approx(0.5)
    assert math.isnan(r["overall_ci_low"])


def test_differing_protocols_are_separate_rows(tmp_path):
    make_run(tmp_path, "e4", seed=0, episodes=4)
    make_run(tmp_path, "e8", seed=1, episodes=8)
    make_run(tmp_path, "t07", seed=2, temperature=0.7)
    make_run(tmp_path, "ms10", seed=3, max_steps=10)
    df = leaderboard_frame(collect([tmp_path]))
    assert len(df) == 4 and set(df["n_runs"]) == {1}
    assert len(set(df["protocol"])) == 4
    assert any("8 ep/env" in p for p in df["protocol"]) and any("T=0.7" in p for p in df["protocol"])
    assert any("max_steps 10" in p for p in df["protocol"])


def test_protocol_label_all_tasks_and_per_env_limits():
    p = {"split": "eval", "episodes": "all", "temperature": 0.0, "top_p": 0.9, "max_steps": {"a": 50, "b": 15},
         "tasks_per_env": {"a": 134, "b": 500}}
    assert protocol_label(p) == "eval · all tasks · tasks a=134,b=500 · T=0 · top_p 0.9 · max_steps a=50,b=15"


def test_markdown_and_csv_written_and_csv_reads_back(tmp_path):
    _three_seeds(tmp_path / "runs", method="static", guided=True)
    make_run(tmp_path / "runs", "other-mix", mix="sokoban", free={"sokoban": 0.3})
    df = leaderboard_frame(collect([tmp_path / "runs"]))
    md, csv = write_leaderboard(df, tmp_path / "out")
    back = pd.read_csv(csv)
    assert list(back.columns) == list(df.columns) and len(back) == 3
    assert list(back["mix"]) == ["sokoban", "sokoban:1,minihack-room:1", "sokoban:1,minihack-room:1"]
    row = back[(back["mix"] == "sokoban:1,minihack-room:1") & (back["eval"] == "free")].iloc[0]
    assert row["success_mean/sokoban"] == pytest.approx(0.5) and row["n/minihack-room"] == 3
    assert math.isnan(back[back["mix"] == "sokoban"].iloc[0]["success_std/sokoban"])
    text = md.read_text()
    assert text.startswith("# crl-bench leaderboard")
    assert "docs/evaluation.md" in text and "bootstrap" in text
    assert "| static | smollm2-135m-instruct | smollm2-135m-instruct | free |" in text
    assert "0.500 ± 0.250 (n=3)" in text and "0.500 ± 0.375 (n=3)" in text
    assert "0.300 (n=1)" in text and "n/a" in text
    assert "## sokoban:1,minihack-room:1" in text and "## sokoban\n" in text


def test_collect_skips_unfinished_reads_summaries_and_walks_sweeps(tmp_path):
    make_run(tmp_path / "runs", "done", seed=0)
    write_summary(make_run(tmp_path / "runs", "with-summary", seed=1))
    make_run(tmp_path / "runs", "unfinished", seed=2, finished=False)
    make_run(tmp_path / "sweeps" / "sw" / "runs", "grpo-s3", seed=3)
    (tmp_path / "sweeps" / "sw" / "sweep.yaml").write_text("mix: x\n")
    bad = make_run(tmp_path / "runs", "broken", seed=4)
    s = json.loads(json.dumps(build_summary(bad)))
    s["runs"][0]["eval"]["free"]["success_rate"] = 1.5
    (bad / "summary.json").write_text(json.dumps(s))
    warnings = []
    got = collect([tmp_path, tmp_path / "nope"], warnings)
    assert sorted(x["runs"][0]["run_id"] for x in got) == ["done", "grpo-s3", "with-summary"]
    assert any("unfinished" in w and "eval.json" in w for w in warnings)
    assert any("broken" in w and "$.runs[0].eval.free.success_rate" in w for w in warnings)
    assert any("nope" in w and "does not exist" in w for w in warnings)
    assert len(warnings) == 3


def test_duplicate_run_counted_once_and_duplicate_seed_warned(tmp_path):
    dirs = _three_seeds(tmp_path / "runs")
    pack_submission(dirs, tmp_path / "subs" / "mine", "mine")      # the same three runs again
    make_run(tmp_path / "runs", "grpo-s0-rerun", seed=0, free={"sokoban": 0.25, "minihack-room": 0.0})
    warnings = []
    df = leaderboard_frame(collect([tmp_path], warnings), warnings)
    assert len(df) == 1 and df.iloc[0]["n_runs"] == 4
    assert sum("appears twice" in w for w in warnings) == 3
    assert any("seed 0 has 2 runs" in w for w in warnings)


def test_two_runs_that_only_share_a_run_id_are_both_counted(tmp_path):
    """static-s1 of two sweeps (other training, same id and seed) are two runs: both pooled, with the
    duplicate-seed warning, not dropped as the same run met twice."""
    make_run(tmp_path / "sweep-a", "static-s1", seed=1, train_rows=[(8, 2.0)])
    make_run(tmp_path / "sweep-b", "static-s1", seed=1, train_rows=[(8, 5.0)],
             free={"sokoban": 0.0, "minihack-room": 0.0})
    warnings = []
    df = leaderboard_frame(collect([tmp_path], warnings), warnings)
    assert len(df) == 1 and df.iloc[0]["n_runs"] == 2 and df.iloc[0]["run_ids"] == "static-s1,static-s1"
    assert not any("appears twice" in w for w in warnings)
    assert any("seed 1 has 2 runs" in w for w in warnings)


def test_main_leaderboard(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    assert main_leaderboard([tmp_path], tmp_path / "lb", out, err) == 1
    assert "no finished runs" in err.getvalue()
    make_run(tmp_path / "r", "a")
    make_run(tmp_path / "r", "b", finished=False)
    out, err = io.StringIO(), io.StringIO()
    assert main_leaderboard([tmp_path / "r"], tmp_path / "lb", out, err) == 0
    assert (tmp_path / "lb" / "leaderboard.md").is_file() and (tmp_path / "lb" / "leaderboard.csv").is_file()
    assert "1 rows from 1 summaries" in out.getvalue() and "warning: skipped" in err.getvalue()


# ---- submissions ------------------------------------------------------------------------------
def _fill_metadata(folder):
    meta = yaml.safe_load((folder / "metadata.yaml").read_text())
    meta.update(authors=["Ada Lovelace"], contact="ada@example.org", description="three seeds of grpo",
                code="https://example.org/code", license="CC-BY-4.0")
    (folder / "metadata.yaml").write_text(yaml.safe_dump(meta))


def test_pack_then_check_valid_submission(tmp_path):
    dirs = _three_seeds(tmp_path / "runs", method="complementary", guided=True)
    write_summary(dirs[0])                    # one run with summary.json, two summarised on the fly
    folder = pack_submission(dirs, tmp_path / "sub", "my-sub")
    s = json.loads((folder / "summary.json").read_text())
    assert s["kind"] == "submission" and s["seeds"] == [0, 1, 2] and len(s["runs"]) == 3
    problems = check_submission(folder)       # the template's TODO fields are problems
    assert problems and all("metadata.yaml" in p and "placeholder" in p for p in problems)
    assert {p.split(": ")[1] for p in problems} == {"$.authors[0]", "$.contact", "$.description"}
    _fill_metadata(folder)
    assert check_submission(folder) == []
    out = io.StringIO()
    assert main_submission_check(folder, out, io.StringIO()) == 0 and "ok" in out.getvalue()
    df = leaderboard_frame(collect([folder]))
    assert len(df) == 2 and set(df["n_runs"]) == {3}
    with pytest.raises(SummaryError, match="already exists"):
        pack_submission(dirs, folder, "my-sub")


def test_check_reports_each_problem_of_an_invalid_submission(tmp_path):
    dirs = _three_seeds(tmp_path / "runs")
    folder = pack_submission(dirs, tmp_path / "sub", "bad")
    s = json.loads((folder / "summary.json").read_text())
    s["seeds"] = [0, 1, 5]
    s["runs"][1]["eval"]["free"]["per_env"]["webshop"] = s["runs"][1]["eval"]["free"]["per_env"]["sokoban"]
    del s["runs"][2]["eval"]["free"]["per_env"]["minihack-room"]
    del s["eval_protocol"]["max_steps"]["minihack-room"]
    (folder / "summary.json").write_text(json.dumps(s))
    (folder / "metadata.yaml").write_text(yaml.safe_dump({
        "name": "bad", "authors": [], "description": "x", "code": "not a url", "date": "31/01/2025",
        "homepage": "https://example.org"}))
    problems = check_submission(folder)
    text = "\n".join(problems)
    for expected in ("$.seeds: [0, 1, 5] does not match the seeds of $.runs [0, 1, 2]",
                     "$.runs[1].eval.free.per_env.webshop: env is not in the mix",
                     "$.eval_protocol.max_steps: no entry for evaluated env 'webshop'",
                     "$.eval_protocol.max_steps: no entry for env(s) of the mix: minihack-room",
                     "$.runs[2].eval.free.per_env: no result for env(s) of the mix (seed 2): minihack-room",
                     "metadata.yaml: $: 'contact' is a required property",
                     "metadata.yaml: $.authors: [] should be non-empty",
                     "metadata.yaml: $.code: 'not a url' matches none of the allowed forms",
                     "metadata.yaml: $.date: '31/01/2025' does not match",
                     "metadata.yaml: $: Additional properties are not allowed ('homepage' was unexpected)"):
        assert expected in text, f"{expected!r} not in:\n{text}"
    assert all(p.startswith(str(folder)) for p in problems)
    err = io.StringIO()
    assert main_submission_check(folder, io.StringIO(), err) == 1 and "problems" in err.getvalue()


def test_check_missing_files_and_a_run_summary(tmp_path):
    assert check_submission(tmp_path / "none") == [f"{tmp_path / 'none'}: not a folder"]
    empty = tmp_path / "empty"
    empty.mkdir()
    problems = check_submission(empty)
    assert len(problems) == 2 and "summary.json: missing" in problems[0] and "metadata.yaml: missing" in problems[1]
    d = make_run(tmp_path / "runs", "r")
    write_summary(d)
    (d / "metadata.yaml").write_text("name: x\nauthors: [A]\ncontact: a@b.c\ndescription: d\n"
                                     "code: 0123abc\ndate: 2025-01-31\n")      # an unquoted YAML date is fine
    assert check_submission(d) == [f"{d / 'summary.json'}: $.kind: is 'run'; a submission's summary has kind "
                                   f"'submission' (crl-bench submission pack makes one)"]


def test_pack_refuses_differing_protocols_and_duplicate_seeds(tmp_path):
    a = make_run(tmp_path, "a", seed=0, episodes=4)
    b = make_run(tmp_path, "b", seed=1, episodes=8)
    with pytest.raises(SummaryError, match=r"not comparable \(eval_protocol\.episodes: 4 vs 8; "
                                           r"eval_protocol\.tasks_per_env\.sokoban: 4 vs 8"):
        pack_submission([a, b], tmp_path / "s", "x")
    c = make_run(tmp_path, "c", seed=0)
    with pytest.raises(SummaryError, match="seed 0 is in both"):
        pack_submission([a, c], tmp_path / "s", "x")
    assert not (tmp_path / "s").exists()
    err = io.StringIO()
    assert main_submission_pack([a], "bad name", stderr=err) == 2 and "--name" in err.getvalue()
    out = io.StringIO()
    assert main_submission_pack([a], "ok", root=tmp_path / "subs", stdout=out) == 0
    assert (tmp_path / "subs" / "ok" / "summary.json").is_file()
    assert "submission check" in out.getvalue()


def test_submission_readme_examples_are_valid(tmp_path):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "results" / "submissions" / "README.md").read_text()
    summary = re.search(r"```json\n(.*?)```", readme, re.S).group(1)
    metadata = re.search(r"```yaml\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "summary.json").write_text(summary)
    (tmp_path / "metadata.yaml").write_text(metadata)
    assert check_submission(tmp_path) == []
    df = leaderboard_frame(collect([tmp_path]))
    g = _row(df, eval="guided")
    assert g["n/minihack-room"] == 1 and _row(df, eval="free")["success_mean/minihack-room"] == pytest.approx(0.4)


def test_score_and_task_type_columns(tmp_path):
    """An env whose score is not its success rate (WebShop) gets a score column; an env with task
    types (ALFWorld) gets a per-type table; both are means over the runs."""
    for seed, score in ((0, 0.8), (1, 0.6)):
        d = make_run(tmp_path, f"r{seed}", seed=seed)
        ev = json.loads((d / "eval.json").read_text())
        ev["free"]["per_env"]["sokoban"]["score_mean"] = score
        (d / "eval.json").write_text(json.dumps(ev))
    df = leaderboard_frame(collect([tmp_path]))
    assert len(df) == 1
    assert df.loc[0, "score_mean/sokoban"] == pytest.approx(0.7)
    assert "score_mean/minihack-room" not in df.columns          # its score equals its success
    assert df.loc[0, "type_success/sokoban/pick"] == pytest.approx(0.5)
    md = leaderboard_markdown(df)
    assert "mean reward: sokoban" in md and "0.700" in md
    assert "sokoban success by task type" in md


def test_display_frame_matches_the_markdown(tmp_path):
    """The report's table is the markdown's: formatted cells, one row per leaderboard row."""
    from crl_bench.results.leaderboard import display_frame

    _three_seeds(tmp_path / "a")
    df = leaderboard_frame(collect([tmp_path]))
    shown = display_frame(df)
    assert len(shown) == len(df) and list(shown.columns[:2]) == ["mix", "method"]
    md = leaderboard_markdown(df)
    for cell in shown.iloc[0].tolist()[1:]:
        assert str(cell).replace("|", "\\|") in md


def test_protocol_labels_of_different_mixes_carry_no_hash(tmp_path):
    """Tables are per mix: the same compact label in two mixes (their protocols differ in their env
    lists) needs no disambiguating hash."""
    make_run(tmp_path, "a", seed=0, mix="sokoban", free={"sokoban": 0.5})
    make_run(tmp_path, "b", seed=0, mix="minihack-room", free={"minihack-room": 0.5})
    df = leaderboard_frame(collect([tmp_path]))
    labels = df["protocol"].tolist()
    assert len(labels) == 2 and labels[0] == labels[1] and " #" not in labels[0]


def test_initial_evals_give_step_zero_rows_and_a_per_seed_table(tmp_path):
    """Runs with eval.at_start: their step-0 evaluation is an ``initial`` row beside the final ``free``
    row, and the markdown lists each seed's overall success for both."""
    base = {"sokoban": 0.25, "minihack-room": 0.0}
    for seed, final in ((0, {"sokoban": 0.5, "minihack-room": 0.5}), (1, {"sokoban": 0.75, "minihack-room": 0.25})):
        d = make_run(tmp_path, f"grpo-s{seed}", seed=seed, free=final, initial=base)
        summary = build_summary(d)
        assert summary["runs"][0]["eval"]["initial"]["per_env"]["sokoban"]["success_rate"] == 0.25
        write_summary(d)
    make_run(tmp_path, "old-s2", seed=2)              # a run without an initial eval: no initial row
    df = leaderboard_frame(collect([tmp_path]))
    init = _row(df, method="grpo", eval="initial")
    assert init["n_runs"] == 2 and init["overall_mean"] == pytest.approx(0.125)
    assert init["per_seed"] == "0=0.125;1=0.125"
    free = _row(df, method="grpo", eval="free")
    assert free["n_runs"] == 3 and free["per_seed"].startswith("0=0.5;1=0.5;2=")
    md = leaderboard_markdown(df)
    table = md[md.index("overall success per seed"):]
    lines = [ln for ln in table.splitlines() if ln.startswith("| grpo")]
    assert lines[0].split("|")[2].strip() == "free" and lines[0].split("|")[4:6] == [" 0.500 ", " 0.500 "]
    init_line = next(ln for ln in lines if "| initial |" in ln)
    assert init_line.split("|")[4:7] == [" 0.125 ", " 0.125 ", " - "]


def test_env_settings_are_part_of_the_protocol(tmp_path):
    """Two runs that differ only in an env's constructor settings (a MiniHack variant) are never
    pooled, and the label says how they differ; settings come from config.yaml for runs whose
    eval.json predates env_settings."""
    make_run(tmp_path, "fixed-s0", seed=0)
    room = {"minihack-room": {"variant": "MiniHack-Room-Random-5x5-v0", "goal_offset": True}}
    d = make_run(tmp_path, "random-s0", seed=0, env_kwargs={**room, "webshop": {"x": 1}})
    proto = build_summary(d)["eval_protocol"]
    assert proto["env_settings"] == room             # only envs the run evaluated
    df = leaderboard_frame(collect([tmp_path]))
    rows = df[(df["method"] == "grpo") & (df["eval"] == "free")]
    assert len(rows) == 2 and sorted(rows["n_runs"]) == [1, 1]
    labels = sorted(rows["protocol"])
    assert labels[1].endswith("minihack-room: goal_offset=True, variant=MiniHack-Room-Random-5x5-v0")
    assert "variant" not in labels[0]


def _edit_config(run_dir, edit):
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    edit(cfg)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def test_runs_with_different_training_settings_are_never_pooled(tmp_path):
    """Two sweeps of one method on one protocol, the second with another learning rate: two rows,
    each method labelled with the setting that differs. Seeds, run ids, output folders, logging, a served
    model's connection and null-valued keys are not training settings and split nothing."""
    a, b = _three_seeds(tmp_path / "a"), _three_seeds(tmp_path / "b")
    for d in b:
        _edit_config(d, lambda c: c["train"].update(lr=3e-5))
    _edit_config(a[0], lambda c: (c.update(logging={"backends": ["jsonl"]}),
                                  c["generation"].update(vllm_seed=None)))
    # a served model's connection (generation.openai_*) is no training setting: a config written before
    # those keys existed pools with one that has them
    _edit_config(a[1], lambda c: c["generation"].update(openai_base_url="http://127.0.0.1:8000/v1", openai_model="m",
                                                          openai_concurrency=3))
    _edit_config(a[2], lambda c: [c["generation"].pop(k, None) for k in list(c["generation"])
                                  if k.startswith("openai_")])
    ha, hb = (config_settings_hash(x[0] / "config.yaml") for x in (a, b))
    assert ha == config_settings_hash(a[1] / "config.yaml") != hb
    pa, pb = _pool(a[0] / "config.yaml"), _pool(b[0] / "config.yaml")
    df = leaderboard_frame(collect([tmp_path]))
    assert len(df) == 2 and list(df["n_runs"]) == [3, 3] and set(df["settings"]) == {pa, pb}
    # the test configs have no train.lr: it reads as its default
    assert dict(zip(df["settings"], df["method"])) == {pa: f"grpo · train.lr={LR}", pb: "grpo · train.lr=3e-05"}
    assert set(df["run_ids"]) == {"grpo-s0,grpo-s1,grpo-s2"}
    alone = leaderboard_frame(collect([tmp_path / "a"]))
    assert len(alone) == 1 and alone.iloc[0]["method"] == "grpo"     # labelled only where it tells rows apart


def test_settings_labels_fall_back_to_the_hash(tmp_path):
    """Rows split by settings are named by the keys that differ, up to three; by the hash prefix
    where more differ or a run's config is gone (its summary keeps the hash). A setting's text is
    config input: control characters are escaped, a long value is cut to 40 characters, an absent
    key reads `unset`, and the markdown table escapes `|`."""
    _three_seeds(tmp_path / "a")
    b = _three_seeds(tmp_path / "b")
    for d in b:
        _edit_config(d, lambda c: c.update(note="x|y\n\x1b[31m" + "z" * 60))
    cut = "note=x|y\\x0a\\x1b[31m" + "z" * 22 + "..."
    df = leaderboard_frame(collect([tmp_path]))
    assert set(df["method"]) == {"grpo · note=unset", f"grpo · {cut}"}
    assert f"grpo · {cut.replace('|', chr(92) + '|')}" in leaderboard_markdown(df)
    for d in b:                                    # two keys differ: both named, in key order
        _edit_config(d, lambda c: c["train"].update(lr=3e-5))
    assert set(leaderboard_frame(collect([tmp_path]))["method"]) == \
        {f"grpo · note=unset, train.lr={LR}", f"grpo · {cut}, train.lr=3e-05"}
    for d in b:                                    # four keys differ: the hash prefix
        _edit_config(d, lambda c: (c["train"].update(extra=7), c.update(other=1)))
    hb = _pool(b[0] / "config.yaml")
    df = leaderboard_frame(collect([tmp_path]))
    assert set(df["method"]) == {f"grpo · settings {h[:12]}" for h in df["settings"]} and hb in set(df["settings"])
    for d in b:                                    # one key, but b's configs are gone
        _edit_config(d, lambda c: (c["train"].pop("extra"), c.pop("other"), c.pop("note")))
        write_summary(d)
        (d / "config.yaml").unlink()
    df = leaderboard_frame(collect([tmp_path]))
    assert len(df) == 2 and set(df["method"]) == {f"grpo · settings {h[:12]}" for h in df["settings"]}


def test_summaries_without_settings_take_them_from_the_config(tmp_path):
    """A summary.json written before runs carried a settings hash (a run's, a submission's) gets
    the hash of the config beside it, so an old and a new sweep of other settings are not pooled."""
    old = make_run(tmp_path / "runs", "grpo-s0")
    write_summary(old)
    data = json.loads((old / "summary.json").read_text())
    assert data["runs"][0]["settings"] == config_settings_hash(old / "config.yaml")
    del data["runs"][0]["settings"]
    (old / "summary.json").write_text(json.dumps(data))
    sub = pack_submission(_three_seeds(tmp_path / "sweep"), tmp_path / "subs" / "mine", "mine")
    packed = json.loads((sub / "summary.json").read_text())
    for r in packed["runs"]:
        del r["settings"]
    (sub / "summary.json").write_text(json.dumps(packed))
    found = {s["kind"]: s for s in collect([tmp_path / "runs", tmp_path / "subs"])}
    assert found["run"]["runs"][0]["settings"] == config_settings_hash(old / "config.yaml")
    assert [r["settings"] for r in found["submission"]["runs"]] == \
        [config_settings_hash(sub / "configs" / f"grpo-s{s}.yaml") for s in range(3)]


def test_a_setting_added_later_reads_as_its_default(tmp_path):
    """Runs of one config written by two versions of the code, the later one with settings the earlier
    lacked at their defaults, pool as seeds (their recorded settings hashes differ); a run with one of
    those settings off its default does not, and its label names it against the default."""
    runs = _three_seeds(tmp_path)
    defaults = RunConfig()
    epochs = defaults.train.internalise_epochs
    newer = {"vllm_sleep": defaults.generation.vllm_sleep}
    _edit_config(runs[0], lambda c: (c["generation"].update(newer), c["train"].update(internalise_epochs=epochs),
                                     c.update(devices=defaults.to_dict()["devices"])))
    _edit_config(runs[2], lambda c: c["train"].update(internalise_epochs=epochs + 1))
    for d in runs:
        write_summary(d)
    assert config_settings_hash(runs[0] / "config.yaml") != config_settings_hash(runs[1] / "config.yaml")
    df = leaderboard_frame(collect([tmp_path]))
    assert dict(zip(df["method"], df["run_ids"])) == {f"grpo · train.internalise_epochs={epochs}": "grpo-s0,grpo-s1",
                                                      f"grpo · train.internalise_epochs={epochs + 1}": "grpo-s2"}
    assert set(df["settings"]) == {_pool(runs[0] / "config.yaml"), _pool(runs[2] / "config.yaml")}
    assert _pool(runs[0] / "config.yaml") == _pool(runs[1] / "config.yaml")


def test_headline_has_one_row_per_method_with_the_seed_level_lift(tmp_path):
    from test_compare import _run

    from crl_bench.results.headline import headline_frame
    from crl_bench.results.stats import two_level_ci

    g = {0: {"sokoban": [1, 1, 1, 0], "minihack-room": [1, 1, 0, 0]},
         1: {"sokoban": [1, 0, 0, 0], "minihack-room": [1, 0, 0, 0]}}
    sh = {0: {"sokoban": [0, 1, 0, 0], "minihack-room": [0, 1, 0, 0]},
          1: {"sokoban": [1, 0, 0, 0], "minihack-room": [0, 0, 0, 0]}}
    for s in (0, 1):
        _run(tmp_path, f"casebank-s{s}", "casebank", s, sh[s], guided=g[s], shuffled=sh[s])
    _run(tmp_path, "grpo-s0", "grpo", 0, g[0])
    df = leaderboard_frame(collect([tmp_path]))
    head = headline_frame(df)
    # 3 modes + 1 rows in the details, one per method here, the better of free and guided first
    assert list(head["method"]) == ["grpo", "casebank"] and len(df) == 4
    cb = head.iloc[1]
    assert cb["free"] == pytest.approx(3 / 16) and cb["guided"] == pytest.approx(7 / 16)
    assert cb["shuffled"] == pytest.approx(3 / 16) and math.isnan(cb["empty"])
    diffs = [[np.array(g[s][e], float) - np.array(sh[s][e], float) for e in ENVS] for s in (0, 1)]
    assert cb["lift_shuffled"] == pytest.approx(0.25)
    assert (cb["lift_shuffled_ci_low"], cb["lift_shuffled_ci_high"], cb["lift_ci_over"]) == two_level_ci(diffs)
    assert (cb["n_seeds"], cb["seeds"]) == (2, "0,1")
    assert head.iloc[0]["lift_ci_over"] == "" and head.iloc[0]["n_seeds"] == 1
    guided = _row(df, method="casebank", eval="guided")
    assert guided["overall_ci_over"] == "seeds and tasks"
    assert _row(df, method="grpo")["overall_ci_over"] == "tasks (1 seed)"
    assert guided["ci_low/sokoban"] <= guided["success_mean/sokoban"] <= guided["ci_high/sokoban"]
    md = leaderboard_markdown(df)
    assert md.index("## Headline") < md.index("## Details")
    assert "| casebank | smollm2-135m-instruct | 0.188 | 0.438 | 0.188 | - | +0.250 [" in md
    assert "| seeds and tasks | 2 (0,1) |" in md
