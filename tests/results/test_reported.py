"""Reported rows (results/reported/*.yaml): read against their schema, shown in their own leaderboard
section as 'reported, not reproduced', never pooled with measured rows."""

from __future__ import annotations

import io

import pandas as pd
import yaml
from test_summary import make_run

from crl_bench.results.leaderboard import main_leaderboard
from crl_bench.results.reported import load_reported, reported_markdown

TABLE = {
    "source": {"title": "A paper", "arxiv": "2505.10978v3", "table": "Table 1",
               "checked": "read from the arXiv HTML of v3 on 2026-11-27"},
    "protocol": {"split": "valid_unseen", "eval_episodes": 134, "temperature": None,
                 "max_steps": {"alfworld": 50}, "catalogue": None, "seeds": 3, "notes": "temperature not stated",
                 "sources": {"split": {"kind": "code", "where": "repo abc123 eval.sh:3"},
                             "eval_episodes": {"kind": "code", "where": "repo abc123 eval.sh:4"},
                             "max_steps": {"kind": "paper", "where": "Section 5.1"},
                             "seeds": {"kind": "paper", "where": "Table 1 caption"}}},
    "rows": [
        {"method": "GRPO", "model": "Qwen2.5-1.5B-Instruct", "env": "alfworld", "success_rate": 0.722,
         "per_type": {"Pick": 0.8, "Look": 0.5}, "std": 0.02},
        {"method": "GRPO", "model": "Qwen2.5-1.5B-Instruct", "env": "webshop", "success_rate": 0.5, "score": 75.8},
    ],
}


def test_a_valid_table_is_shown_with_its_protocol_and_source(tmp_path):
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(TABLE, sort_keys=False))
    tables = load_reported(tmp_path)
    assert [t["file"] for t in tables] == ["a.yaml"]
    text = "\n".join(reported_markdown(tables))
    assert "## Reported, not reproduced" in text and "never pooled" in text
    assert "### A paper (arXiv 2505.10978v3), Table 1" in text
    assert "| eval episodes | 134 | released code: repo abc123 eval.sh:4 |" in text
    assert "| temperature | not stated | - |" in text
    assert "| max steps | alfworld 50 | paper text: Section 5.1 |" in text
    assert "| seeds | 3 | paper text: Table 1 caption |" in text and "temperature not stated" in text
    assert "| GRPO | Qwen2.5-1.5B-Instruct | alfworld | 72.2 ± 2.0 | - | 80.0 | 50.0 |  |" in text
    assert "| GRPO | Qwen2.5-1.5B-Instruct | webshop | 50.0 | 75.8 | - | - |  |" in text
    assert reported_markdown([]) == [] and load_reported(tmp_path / "none") == []


def test_bad_files_are_skipped_with_the_key_named(tmp_path):
    bad = {**TABLE, "rows": [{**TABLE["rows"][0], "success_rate": 72.2}]}      # a percentage, not a fraction
    (tmp_path / "percent.yaml").write_text(yaml.safe_dump(bad))
    (tmp_path / "nosource.yaml").write_text(yaml.safe_dump({k: v for k, v in TABLE.items() if k != "source"}))
    (tmp_path / "broken.yaml").write_text("rows: [")
    warnings: list[str] = []
    assert load_reported(tmp_path, warnings) == []
    assert any("percent.yaml: $.rows[0].success_rate" in w for w in warnings)
    assert any("nosource.yaml" in w and "source" in w for w in warnings)
    assert any("broken.yaml" in w for w in warnings) and len(warnings) == 3


def test_a_stated_value_needs_a_source_of_an_allowed_kind(tmp_path):
    """Every protocol value names where it was read; a summary is not a kind of source."""
    unsourced = {**TABLE, "protocol": {**TABLE["protocol"], "temperature": 0.4}}
    summary = {**TABLE, "protocol": {**TABLE["protocol"], "sources": {
        **TABLE["protocol"]["sources"], "split": {"kind": "summary", "where": "a blog post"}}}}
    (tmp_path / "unsourced.yaml").write_text(yaml.safe_dump(unsourced))
    (tmp_path / "summary.yaml").write_text(yaml.safe_dump(summary))
    warnings: list[str] = []
    assert load_reported(tmp_path, warnings) == []
    assert any("unsourced.yaml: $.protocol.sources: 'temperature' has a value but no source" in w for w in warnings)
    assert any("summary.yaml: $.protocol.sources.split.kind" in w for w in warnings)


def test_rows_with_their_own_temperature_show_it(tmp_path):
    """Leaderboard data whose submissions differ in temperature (BALROG's) show it per row."""
    rows = [{**TABLE["rows"][0], "temperature": 1.0}, {**TABLE["rows"][1], "temperature": None}]
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({**TABLE, "rows": rows}))
    text = "\n".join(reported_markdown(load_reported(tmp_path)))
    assert "| method | model | env | T | success % |" in text
    assert "| GRPO | Qwen2.5-1.5B-Instruct | alfworld | 1 | 72.2 ± 2.0 |" in text
    assert "| GRPO | Qwen2.5-1.5B-Instruct | webshop | not recorded | 50.0 |" in text


def test_the_leaderboard_shows_them_apart_from_measured_rows(tmp_path):
    make_run(tmp_path / "results" / "runs", "grpo-s0", seed=0)
    (tmp_path / "results" / "reported").mkdir(parents=True)
    (tmp_path / "results" / "reported" / "a.yaml").write_text(yaml.safe_dump(TABLE, sort_keys=False))
    out, err = io.StringIO(), io.StringIO()
    assert main_leaderboard([tmp_path / "results"], tmp_path / "lb", out, err) == 0
    md = (tmp_path / "lb" / "leaderboard.md").read_text()
    assert md.index("## sokoban:1,minihack-room:1") < md.index("## Reported, not reproduced")
    csv = pd.read_csv(tmp_path / "lb" / "leaderboard.csv")
    assert set(csv["method"]) == {"grpo"}                       # reported rows are not measured rows


def test_the_committed_reported_files_are_valid():
    """results/reported/ of this checkout: every file passes the schema (a transcription slip such as a
    percentage in a fraction field is caught here), and the GiGPO table's GRPO rows read as printed."""
    from pathlib import Path

    warnings: list[str] = []
    tables = load_reported(Path(__file__).resolve().parents[2] / "results" / "reported", warnings)
    assert warnings == [] and tables
    gigpo = next(t for t in tables if t["source"]["arxiv"].startswith("2505.10978"))
    grpo = {(r["model"], r["env"]): r for r in gigpo["rows"] if r["method"] == "GRPO"}
    assert grpo[("Qwen2.5-1.5B-Instruct", "alfworld")]["success_rate"] == 0.728
    assert grpo[("Qwen2.5-7B-Instruct", "webshop")]["score"] == 79.3
    assert gigpo["protocol"]["temperature"] == 0.4 and gigpo["protocol"]["sources"]["seeds"]["kind"] == "paper"
    balrog = next(t for t in tables if t["source"]["arxiv"].startswith("2411.13543"))
    assert len(balrog["rows"]) == 26 and {r["env"] for r in balrog["rows"]} == {"minihack"}
    for r in balrog["rows"]:
        # 8 tasks x 5 episodes: the overall success is the mean of the per-task successes
        if r.get("per_type"):
            assert len(r["per_type"]) == 8 and abs(sum(r["per_type"].values()) / 8 - r["success_rate"]) < 1e-9, r
    grok3 = next(r for r in balrog["rows"] if r["model"] == "Grok-3-beta")
    assert (grok3["success_rate"], grok3["temperature"], grok3["per_type"]["Corridor-R3"]) == (0.225, 1.0, 0.4)
