"""``crl-bench compare``: differences, intervals and P(A > B) from synthetic run folders with per-task
outcomes, checked by hand; the within-run difference; the refusal across task panels."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_summary import make_run

from crl_bench.cli import main
from crl_bench.results.compare import compare, load_side
from crl_bench.results.stats import OVER_SEEDS, OVER_TASKS, difference_ci, two_level_ci

ENVS = ("sokoban", "minihack-room")
PANELS = {"sokoban": "a" * 64, "minihack-room": "b" * 64}


def _run(root, run_id, method, seed, free, guided=None, panels=PANELS, shuffled=None):
    """A run folder whose eval blocks carry per-task ``successes`` (``free``/``guided``/``shuffled``:
    env -> 4 outcomes; ``shuffled`` a copy of the guided block with its own outcomes)."""
    rate = {e: float(np.mean(v)) for e, v in free.items()}
    d = make_run(root, run_id, method=method, seed=seed, free=rate,
                 guided=None if guided is None else {e: float(np.mean(v)) for e, v in guided.items()}, panels=panels)
    ev = json.loads((d / "eval.json").read_text())
    if shuffled is not None:
        ev["shuffled"] = json.loads(json.dumps(ev["guided"]))
        for env, succ in shuffled.items():
            ev["shuffled"]["per_env"][env]["success_rate"] = float(np.mean(succ))
    for mode, outcomes in (("free", free), ("guided", guided), ("shuffled", shuffled)):
        for env, succ in (outcomes or {}).items():
            ev[mode]["per_env"][env]["successes"] = list(succ)
    (d / "eval.json").write_text(json.dumps(ev))
    return d


A = {0: {"sokoban": [1, 1, 0, 0], "minihack-room": [1, 0, 0, 0]},
     1: {"sokoban": [1, 1, 1, 0], "minihack-room": [1, 1, 0, 0]}}
B = {0: {"sokoban": [1, 0, 0, 0], "minihack-room": [0, 0, 0, 0]},
     1: {"sokoban": [1, 1, 0, 0], "minihack-room": [1, 1, 0, 0]}}


@pytest.fixture()
def sweep(tmp_path):
    runs = tmp_path / "sweep" / "runs"
    for s in (0, 1):
        _run(runs, f"casebank-s{s}", "casebank", s, A[s], guided=B[s])
        _run(runs, f"grpo-s{s}", "grpo", s, B[s])
    return tmp_path / "sweep"


def test_difference_of_two_methods_by_hand(sweep):
    res = compare(load_side("casebank", sweep), load_side("grpo", sweep))
    assert not res["paired_runs"]
    sok = res["envs"]["sokoban"]
    assert (sok["a"], sok["b"], sok["diff"]) == pytest.approx((0.625, 0.375, 0.25))
    # per run sokoban: A 0.5, 0.75; B 0.25, 0.5 -> pairs (0.5>0.25, 0.5=0.5, 0.75>0.25, 0.75>0.5) = 3.5 / 4
    assert sok["p_improvement"] == pytest.approx(3.5 / 4)
    room = res["envs"]["minihack-room"]          # A 0.25, 0.5; B 0, 0.5: (1, 0, 1, 0.5) / 4
    assert room["p_improvement"] == pytest.approx(2.5 / 4)
    over = res["envs"]["overall"]
    assert over["diff"] == pytest.approx((0.25 + 0.125) / 2)
    assert over["p_improvement"] == pytest.approx((3.5 / 4 + 2.5 / 4) / 2)
    assert over["ci_over"] == OVER_SEEDS
    a_tasks = [[np.array(A[s][e], float) for e in ENVS] for s in (0, 1)]
    b_tasks = [[np.array(B[s][e], float) for e in ENVS] for s in (0, 1)]
    assert (over["ci_low"], over["ci_high"], over["ci_over"]) == difference_ci(a_tasks, b_tasks)
    assert res["per_seed"]["0"] == pytest.approx({"a": 0.375, "b": 0.125, "diff": 0.25})


def test_within_run_difference_pairs_each_run(sweep):
    res = compare(load_side("casebank", sweep), load_side("casebank", sweep), "free", "guided")
    assert res["paired_runs"]
    diffs = [[np.array(A[s][e], float) - np.array(B[s][e], float) for e in ENVS] for s in (0, 1)]
    over = res["envs"]["overall"]
    assert (over["ci_low"], over["ci_high"], over["ci_over"]) == two_level_ci(diffs)
    assert res["per_seed"]["1"]["diff"] == pytest.approx((0.75 - 0.5 + 0.5 - 0.5) / 2)


def test_one_seed_is_labelled_tasks_only(sweep, capsys):
    rc = main(["compare", str(sweep / "runs" / "casebank-s0"), str(sweep / "runs" / "grpo-s0")])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"| {OVER_TASKS} |" in out and OVER_SEEDS not in out.split("| env |")[1]
    assert "| 0 | 0.375 | 0.125 | +0.250 |" in out


def test_cli_markdown_and_json(sweep, capsys):
    assert main(["compare", "casebank", "grpo", "--sweep", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# casebank (free) vs grpo (free)")
    assert "| **overall** | 0.500 | 0.312 | +0.188 |" in out
    assert main(["compare", "casebank", "grpo", "--sweep", str(sweep), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["envs"]["overall"]["diff"] == pytest.approx(0.1875)
    assert res["a"]["run_ids"] == ["casebank-s0", "casebank-s1"]


def test_refuses_across_task_panels_with_one_line(sweep, tmp_path, capsys):
    other = tmp_path / "other"
    _run(other, "grpo-s0", "grpo", 0, B[0], panels={"sokoban": "c" * 64, "minihack-room": "b" * 64})
    rc = main(["compare", str(sweep / "runs" / "casebank-s0"), str(other / "grpo-s0")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("crl-bench: error: compare: ") and "not evaluated on one task panel" in err[0]


def test_refuses_a_folder_of_several_methods_and_unknown_names(sweep, capsys):
    assert main(["compare", str(sweep), str(sweep / "runs" / "grpo-s0")]) == 2
    assert "several methods (casebank, grpo)" in capsys.readouterr().err
    assert main(["compare", "nope", "grpo", "--sweep", str(sweep)]) == 2
    assert "no runs named 'nope'" in capsys.readouterr().err
    assert main(["compare", "grpo", "casebank", "--sweep", str(sweep), "--mode", "guided"]) == 2
    assert "no run has per-task outcomes in eval mode 'guided'" in capsys.readouterr().err


def test_protocol_option_must_match_one_shared_protocol(sweep, capsys):
    assert main(["compare", "casebank", "grpo", "--sweep", str(sweep), "--protocol", "4 ep/env"]) == 0
    assert "Note: also evaluated" not in capsys.readouterr().out
    assert main(["compare", "casebank", "grpo", "--sweep", str(sweep), "--protocol", "eval_unseen"]) == 2
    assert "--protocol 'eval_unseen' matches 0 of the protocols" in capsys.readouterr().err
