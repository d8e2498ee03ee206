"""Seeds needed: the between-seed SD of the per-run lift and success, pooled over methods, and the
t-test power behind the count; ``crl-bench sweep --plan-seeds``."""

from __future__ import annotations

import math

from test_compare import _run

from crl_bench.cli import main
from crl_bench.results.leaderboard import collect, leaderboard_frame
from crl_bench.results.power import plan_lines, spreads
from crl_bench.results.stats import seeds_needed

FOUR = {0: [0, 0, 0, 0], 1: [1, 0, 0, 0], 2: [1, 1, 0, 0], 3: [1, 1, 1, 0], 4: [1, 1, 1, 1]}


def _sweep(root):
    # casebank: guided 2/4, 3/4, 4/4 solved over shuffled 1/4 -> lifts .25, .5, .75 (same on both envs)
    for s, g in enumerate((2, 3, 4)):
        _run(root, f"casebank-s{s}", "casebank", s, {"sokoban": FOUR[1], "minihack-room": FOUR[1]},
             guided={"sokoban": FOUR[g], "minihack-room": FOUR[g]},
             shuffled={"sokoban": FOUR[1], "minihack-room": FOUR[1]})
    # static: lifts 0 and .25
    for s, g in enumerate((1, 2)):
        _run(root, f"static-s{s}", "static", s, {"sokoban": FOUR[1], "minihack-room": FOUR[1]},
             guided={"sokoban": FOUR[g], "minihack-room": FOUR[g]},
             shuffled={"sokoban": FOUR[1], "minihack-room": FOUR[1]})


def test_spreads_and_the_pooled_sd(tmp_path):
    _sweep(tmp_path)
    summaries = collect([tmp_path])
    df = leaderboard_frame(summaries)
    rows = {r["method"]: r for r in spreads(df, summaries)}
    assert sorted(rows["casebank"]["lift_runs"]) == [0.25, 0.5, 0.75]
    assert sorted(rows["static"]["lift_runs"]) == [0.0, 0.25]
    assert rows["casebank"]["mode"] == "guided"
    # pooled variance: (2 * 0.0625 + 1 * 0.03125) / 3; SD of casebank alone 0.25
    pooled = math.sqrt((2 * 0.0625 + 0.03125) / 3)
    lines = plan_lines(df, summaries, effect=0.25)
    assert lines[0].startswith("seeds needed on sokoban:1,minihack-room:1")
    assert (f"lift guided - shuffled of 0.25: {seeds_needed(pooled, 0.25)} seeds at the pooled SD {pooled:.3f} "
            "(2 methods, 3 df)") in lines[1]
    assert f"{seeds_needed(0.25, 0.25)} seeds at the SD 0.250 of the most variable (casebank, 3 seeds)" in lines[1]
    assert "between two methods' success" in lines[2] and "seeds each" in lines[2]


def test_no_spread_gives_no_estimate_and_one_seed_no_line(tmp_path):
    for s in (0, 1):
        _run(tmp_path / "a", f"static-s{s}", "static", s, {"sokoban": FOUR[1], "minihack-room": FOUR[1]},
             guided={"sokoban": FOUR[2], "minihack-room": FOUR[2]},
             shuffled={"sokoban": FOUR[2], "minihack-room": FOUR[2]})
    summaries = collect([tmp_path / "a"])
    lines = plan_lines(leaderboard_frame(summaries), summaries)
    assert "no estimate" in lines[1] and "no estimate" in lines[2]
    _run(tmp_path / "b", "grpo-s0", "grpo", 0, {"sokoban": FOUR[1], "minihack-room": FOUR[1]})
    one = collect([tmp_path / "b"])
    assert plan_lines(leaderboard_frame(one), one) == []


def test_sweep_plan_seeds_prints_and_runs_nothing(tmp_path, capsys):
    _sweep(tmp_path)
    assert main(["sweep", "--plan-seeds", str(tmp_path), "--effect", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "seeds needed on" in out and "lift guided - shuffled of 0.25" in out


def test_a_sweep_prints_the_seeds_needed_for_its_own_runs_at_its_end(tmp_path, capsys, monkeypatch):
    import crl_bench.sweep as sweep_mod

    _sweep(tmp_path / "runs")
    monkeypatch.setattr(sweep_mod, "run_sweep", lambda *a, **k: (tmp_path, []))
    assert main(["sweep", "--methods", "casebank,static", "--seeds", "0,1,2", "--mix", "sokoban"]) == 0
    out = capsys.readouterr().out
    assert out.index(f"sweep folder: {tmp_path}") < out.index("seeds needed on")
    assert "lift guided - shuffled of 0.05" in out
