"""The interval charts of ``crl-bench report``: one point-and-interval chart per protocol; IQM and
probability-of-improvement charts only where two methods have 3+ seeds."""

from __future__ import annotations

import numpy as np
from test_compare import _run

from crl_bench.results.interval_plots import draw_interval_charts, method_scores
from crl_bench.results.leaderboard import collect, leaderboard_frame

OUT = [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]]


def _png(path):
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_three_seeds_of_two_methods_get_iqm_and_poi_charts(tmp_path):
    for s in range(3):
        _run(tmp_path / "runs", f"casebank-s{s}", "casebank", s, {"sokoban": OUT[s], "minihack-room": OUT[2 - s]},
             guided={"sokoban": OUT[2], "minihack-room": OUT[s]})
        _run(tmp_path / "runs", f"grpo-s{s}", "grpo", s, {"sokoban": OUT[s], "minihack-room": OUT[s]})
    summaries = collect([tmp_path / "runs"])
    df = leaderboard_frame(summaries)
    guided = df[(df["method"] == "casebank") & (df["eval"] == "guided")].iloc[0]
    scores = method_scores(guided, summaries)
    assert scores.shape == (3, 2) and np.allclose(scores[:, 1], 0.75)       # envs by name: sokoban second
    drawn = draw_interval_charts(df, summaries, tmp_path / "out")
    names = [n for n, _ in drawn]
    assert [n.split("-")[0] for n in names] == ["intervals", "iqm", "poi"]
    assert all(_png(tmp_path / "out" / n) for n in names)
    assert "CI over seeds and tasks" in drawn[0][1] and "IQM" in drawn[1][1]


def test_one_seed_gets_only_the_interval_chart(tmp_path, capsys):
    from crl_bench.cli import main

    _run(tmp_path / "runs", "grpo-s0", "grpo", 0, {"sokoban": OUT[0], "minihack-room": OUT[1]})
    summaries = collect([tmp_path / "runs"])
    drawn = draw_interval_charts(leaderboard_frame(summaries), summaries, tmp_path / "out")
    assert [n.split("-")[0] for n, _ in drawn] == ["intervals"]
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 0
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "<h2>Intervals</h2>" in html and "intervals-00-" in html


def test_a_formula_in_a_method_name_is_text_and_a_failing_chart_is_reported(tmp_path, monkeypatch):
    import crl_bench.results.interval_plots as ip

    _run(tmp_path / "runs", "m-s0", "grpo$\\badcmd$", 0, {"sokoban": OUT[0]})
    summaries = collect([tmp_path / "runs"])
    df = leaderboard_frame(summaries)
    drawn = draw_interval_charts(df, summaries, tmp_path / "out")
    assert len(drawn) == 1 and _png(tmp_path / "out" / drawn[0][0])

    def boom(part, title, path):
        raise RuntimeError("boom")

    monkeypatch.setattr(ip, "_point_interval", boom)
    failures: list[str] = []
    assert draw_interval_charts(df, summaries, tmp_path / "out2", failures=failures) == []
    assert failures == [f"{drawn[0][0]} not drawn: drawing failed (RuntimeError: boom)"]
