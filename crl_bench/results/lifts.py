"""Memory lifts: how much a method's own retrieved experience beats its controls, paired per task.

* :func:`row_lifts`: a leaderboard ``guided`` row's overall lifts ``guided - <control>`` for each memory
  control (``shuffled``, ``empty``) and memory form (``raw``, ``condensed``, ``both``) its runs have;
* :func:`lift_frame` / :func:`lift_markdown`: ``guided - shuffled`` and ``guided - empty`` per env.

Every interval is the two-level bootstrap over runs (seeds), then tasks within each run, a task's two
outcomes of one run resampled together (:func:`~crl_bench.results.stats.two_level_ci`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from crl_bench.results.labels import canon, label_settings, model_label, protocol_label, run_identity, settings_details
from crl_bench.results.stats import CI_RESAMPLES, CI_SEED, two_level_ci
from crl_bench.results.summary import pool_hash
from crl_bench.safe_io import markdown_cell

__all__ = ["LIFT_COLUMNS", "LIFT_CONTROLS", "LIFT_ROW_COLUMNS", "lift_frame", "lift_markdown", "row_lifts",
           "task_outcomes"]

#: Columns of the memory-lift table (:func:`lift_frame`).
LIFT_COLUMNS = ["method", "model", "extractor", "mix", "protocol", "env", "n_runs", "tasks", "guided",
                "shuffled", "lift", "lift_ci_low", "lift_ci_high", "ci_over", "empty", "lift_empty",
                "lift_empty_ci_low", "lift_empty_ci_high", "run_ids", "settings"]
#: The modes a ``guided`` row's overall lift is measured against: the memory controls, then the memory forms
#: (docs/evaluation.md "Memory controls", "Memory forms").
LIFT_CONTROLS = ("shuffled", "empty", "raw", "condensed", "both")
#: Columns of a ``guided`` row: its lifts ``guided - <control>`` over the runs that also have the control,
#: overall (per run the mean over envs of the per-task differences), with their two-level CIs.
LIFT_ROW_COLUMNS = [f"lift_{c}{part}" for c in LIFT_CONTROLS for part in ("", "_ci_low", "_ci_high")] + \
    ["lift_ci_over", "lift_n"]


def task_outcomes(blocks: Sequence[dict[str, Any]], envs: Sequence[str]) -> list[list[np.ndarray]] | None:
    """Per eval block (one run), per env of ``envs``, its per-task successes (shape ``(T_e,)``); None
    when a block lacks them or the runs' task counts differ (then no two-level CI can be drawn)."""
    out = []
    for block in blocks:
        per_env = block["per_env"]
        if not envs or any(not isinstance((per_env.get(e) or {}).get("successes"), list)
                           or not per_env[e]["successes"] for e in envs):
            return None
        out.append([np.asarray(per_env[e]["successes"], dtype=float) for e in envs])
    if not out or any([x.size for x in run] != [x.size for x in out[0]] for run in out):
        return None
    return out


def row_lifts(g: dict[str, Any], groups: dict[tuple, dict[str, Any]], envs: Sequence[str]) -> dict[str, Any]:
    """The :data:`LIFT_ROW_COLUMNS` of a ``guided`` group ``g`` (a leaderboard group: ``key`` with the
    mode at index 5, ``runs`` by run identity): ``guided - <control>`` for each of :data:`LIFT_CONTROLS`
    over the runs that have both modes, per run the mean over ``envs`` of the per-task differences, with
    :func:`~crl_bench.results.stats.two_level_ci` (paired per task within a run); NaN where no run has
    the control."""
    out: dict[str, Any] = {c: math.nan for c in LIFT_ROW_COLUMNS}
    out["lift_ci_over"], out["lift_n"] = "", 0
    for control in LIFT_CONTROLS:
        key = list(g["key"])
        key[5] = control
        other = groups.get(tuple(key))
        if other is None:
            continue
        both = [ident for ident in g["runs"] if ident in other["runs"]]
        a = task_outcomes([g["runs"][i]["eval"] for i in both], envs)
        b = task_outcomes([other["runs"][i]["eval"] for i in both], envs)
        if a is None or b is None or any([x.size for x in ra] != [y.size for y in rb] for ra, rb in zip(a, b)):
            continue
        diffs = [[x - y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]
        low, high, over = two_level_ci(diffs)
        out[f"lift_{control}"] = float(np.mean([np.mean([d.mean() for d in run]) for run in diffs]))
        out[f"lift_{control}_ci_low"], out[f"lift_{control}_ci_high"] = low, high
        out["lift_ci_over"], out["lift_n"] = over, max(out["lift_n"], len(diffs))
    return out


def lift_frame(summaries: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """The memory lift ``guided - shuffled`` per env of every row whose runs evaluated both modes.

    Rows: one per (method, model, extractor, mix, protocol, env), over the runs whose ``guided`` and
    ``shuffled`` blocks both carry per-task ``successes`` of that env of the same length (the same
    panel).  ``guided``/``shuffled``: mean success over runs and tasks; ``lift``: their difference;
    ``lift_ci_low``/``lift_ci_high``: 95% CI of the two-level bootstrap over runs (seeds), then tasks
    within each run, of each run's per-task differences (paired: a task's guided and shuffled outcomes
    of one run are resampled together; :func:`~crl_bench.results.stats.two_level_ci`, deterministic);
    ``ci_over`` says what it resamples (one run: the tasks only; NaN for fewer than 3 tasks).
    ``empty``/``lift_empty``/``lift_empty_ci_*``: the same for ``guided - empty`` where every run of
    the row has the ``empty`` control, else NaN. Runs met twice in one row are counted once.

    Returns:
        A DataFrame with :data:`LIFT_COLUMNS` (empty when no run has both modes).
    """
    groups: dict[tuple, dict[str, Any]] = {}
    for s in summaries:
        for r in s["runs"]:
            g_block, s_block = r["eval"].get("guided"), r["eval"].get("shuffled")
            if not g_block or not s_block:
                continue
            key = (s["method"], canon(s["model"]), s["mix"]["name"], canon(s["mix"]["envs"]),
                   canon(s["eval_protocol"]), pool_hash(r))
            grp = groups.setdefault(key, {"summary": s, "runs": {}, "settings": key[-1]})
            grp["runs"].setdefault(run_identity(s, r), (r["run_id"], g_block, s_block, r["eval"].get("empty")))
    rows = []
    for grp in groups.values():
        s = grp["summary"]
        envs = list(dict.fromkeys(e for _, g, _, _ in grp["runs"].values() for e in g["per_env"]))
        for env in envs:
            pairs, empties, ids = [], [], []
            for rid, g, sh, em in grp["runs"].values():
                a = (g["per_env"].get(env) or {}).get("successes")
                b = (sh["per_env"].get(env) or {}).get("successes")
                if a is not None and b is not None and len(a) == len(b) and len(a) > 0:
                    pairs.append((np.asarray(a, dtype=float), np.asarray(b, dtype=float)))
                    ids.append(rid)
                    c = ((em or {}).get("per_env", {}).get(env) or {}).get("successes")
                    if c is not None and len(c) == len(a):
                        empties.append((pairs[-1][0], np.asarray(c, dtype=float)))
            if not pairs or len({len(a) for a, _ in pairs}) != 1:
                continue
            low, high, over = two_level_ci([[a - b] for a, b in pairs])    # runs, then tasks within a run
            row = {"method": s["method"], "model": model_label(s["model"]),
                   "extractor": s["model"].get("extractor") or "", "mix": s["mix"]["name"],
                   "protocol": protocol_label(s["eval_protocol"]), "env": env, "n_runs": len(pairs),
                   "tasks": int(pairs[0][0].size), "guided": float(np.mean([a for a, _ in pairs])),
                   "shuffled": float(np.mean([b for _, b in pairs])),
                   "lift": float(np.mean([a - b for a, b in pairs])), "lift_ci_low": low, "lift_ci_high": high,
                   "ci_over": over, "empty": math.nan, "lift_empty": math.nan, "lift_empty_ci_low": math.nan,
                   "lift_empty_ci_high": math.nan, "run_ids": ",".join(ids), "settings": grp["settings"]}
            if len(empties) == len(pairs):          # every run of the row has the empty control too
                row["empty"] = float(np.mean([c for _, c in empties]))
                row["lift_empty"] = float(np.mean([a - c for a, c in empties]))
                row["lift_empty_ci_low"], row["lift_empty_ci_high"], _ = two_level_ci([[a - c] for a, c in empties])
            rows.append(row)
    label_settings(rows, settings_details(summaries))
    df = pd.DataFrame(rows, columns=LIFT_COLUMNS)
    return df.sort_values(["mix", "env", "method", "model", "protocol"], kind="mergesort").reset_index(drop=True) \
        if not df.empty else df


def lift_markdown(lift: pd.DataFrame) -> list[str]:
    """The per-env memory-lift section of ``leaderboard.md`` (lines; none when ``lift`` is empty)."""
    if lift.empty:
        return []
    head = ["method", "model", "protocol", "env", "runs", "tasks", "guided", "shuffled", "empty",
            "guided − shuffled [95% CI]", "guided − empty [95% CI]", "CI over"]
    lines = ["## Memory lift per env", "",
             "Success with the task's own retrieved experience minus success with another task's (another "
             "context's in the diagnostics), and minus the empty knowledge block, on the same eval tasks. "
             f"95% CI: two-level percentile bootstrap ({CI_RESAMPLES} resamples, seed {CI_SEED}): the runs "
             "(seeds), then the tasks within each run, a task's two outcomes in one run resampled together; "
             "one run: over its tasks only (`CI over`). A lift whose CI excludes 0 says the content of the "
             "memory mattered, not just extra text in the prompt.", ""]
    for mix, part in lift.groupby("mix", sort=False):
        lines += [f"### {markdown_cell(mix)}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for _, r in part.iterrows():
            ci = "n/a" if math.isnan(r["lift_ci_low"]) else f"[{r['lift_ci_low']:+.3f}, {r['lift_ci_high']:+.3f}]"
            empty = ("-" if math.isnan(r["lift_empty"]) else f"{r['lift_empty']:+.3f}" + (
                " n/a" if math.isnan(r["lift_empty_ci_low"])
                else f" [{r['lift_empty_ci_low']:+.3f}, {r['lift_empty_ci_high']:+.3f}]"))
            cells = [r["method"], r["model"], r["protocol"], r["env"], str(r["n_runs"]), str(r["tasks"]),
                     f"{r['guided']:.3f}", f"{r['shuffled']:.3f}",
                     "-" if math.isnan(r["empty"]) else f"{r['empty']:.3f}",
                     f"{r['lift']:+.3f} {ci}", empty, r["ci_over"]]
            lines.append("| " + " | ".join(markdown_cell(c) for c in cells) + " |")
        lines.append("")
    return lines
