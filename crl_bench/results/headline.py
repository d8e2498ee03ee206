"""The headline tables of ``leaderboard.md``: per evaluation protocol, one row per method and model with
its overall success in each eval mode, the memory lifts with their seed-level CIs and the number of
seeds, built from the rows of :func:`crl_bench.results.leaderboard.leaderboard_frame` (one per eval
mode); the details (per env, steps, invalid rate, wall time) stay in that frame and its section.

Model labels are short (the model's name); where a name stands for a more specific model (a variant:
quantisation, de-quantisation), the cell adds ``[n]`` and a footnote under the table gives the full
description, which the CSV keeps in ``model`` (``model_short`` beside it).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from crl_bench.safe_io import markdown_cell

__all__ = ["HEADLINE_COLUMNS", "headline_frame", "headline_markdown", "model_notes"]

MODES = ("free", "guided", "shuffled", "empty")
#: The memory forms (docs/evaluation.md "Memory forms"), shown in a table of their own where a run has one.
FORMS = ("raw", "condensed", "both")
#: The lift columns a headline row takes from its ``guided`` leaderboard row.
LIFTS = [f"lift_{c}{part}" for c in ("shuffled", "empty", *FORMS) for part in ("", "_ci_low", "_ci_high")]
#: Columns of :func:`headline_frame`.
HEADLINE_COLUMNS = ["mix", "protocol", "method", "model", "model_short", "extractor", *MODES, *FORMS, *LIFTS,
                    "lift_ci_over", "seeds", "n_seeds"]


def headline_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (mix, protocol, method, model, extractor) of a leaderboard frame.

    ``free``/``guided``/``shuffled``/``empty`` and the memory forms ``raw``/``condensed``/``both``: that
    mode's ``overall_mean`` (mean over runs of each run's unweighted mean over envs; NaN where the method has
    no such mode); the lifts ``guided - <mode>`` and their CIs: the ``guided`` row's (two-level bootstrap over
    seeds, then tasks within a run; ``lift_ci_over`` says which); ``seeds``: the seeds of any of the method's
    rows, ``n_seeds`` their number. Sorted by mix, protocol (leaderboard order), then the better of free and
    guided (descending), then method.
    """
    rows: list[dict[str, Any]] = []
    if df.empty:
        return pd.DataFrame(columns=HEADLINE_COLUMNS)
    keys = ["mix", "protocol", "method", "model", "extractor"]
    for key, part in df.groupby(keys, sort=False):
        row = dict(zip(keys, key))
        row["model_short"] = part["model_short"].iloc[0]
        by_mode = {r["eval"]: r for _, r in part.iterrows()}
        for mode in (*MODES, *FORMS):
            row[mode] = by_mode[mode]["overall_mean"] if mode in by_mode else math.nan
        g = by_mode.get("guided")
        for col in [*LIFTS, "lift_ci_over"]:
            row[col] = g[col] if g is not None and col in g else (math.nan if col != "lift_ci_over" else "")
        seeds = sorted({x for v in part["seeds"] for x in str(v).split(",") if x}, key=lambda x: (len(x), x))
        row["seeds"], row["n_seeds"] = ",".join(seeds), len(seeds)
        rows.append(row)
    out = pd.DataFrame(rows, columns=HEADLINE_COLUMNS)
    order = {k: i for i, k in enumerate(dict.fromkeys(zip(df["mix"], df["protocol"])))}
    out["_p"] = [order[(m, p)] for m, p in zip(out["mix"], out["protocol"])]
    out["_best"] = -out[["free", "guided"]].max(axis=1, skipna=True)
    out = out.sort_values(["_p", "_best", "method"], na_position="last", kind="mergesort")
    return out.drop(columns=["_p", "_best"]).reset_index(drop=True)


def model_notes(frame: pd.DataFrame) -> dict[str, int]:
    """``{full model label: footnote number}`` for the labels that say more than the short name."""
    notes: dict[str, int] = {}
    for full, short in zip(frame["model"], frame["model_short"]):
        if full != short and full not in notes:
            notes[full] = len(notes) + 1
    return notes


def short_model(full: str, short: str, notes: dict[str, int]) -> str:
    """The cell of a model: its short name, with ``[n]`` where a footnote gives the full description."""
    return f"{short} [{notes[full]}]" if full in notes else short


def _num(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _lift(mean: float, low: float, high: float) -> str:
    if isinstance(mean, float) and math.isnan(mean):
        return "-"
    if isinstance(low, float) and math.isnan(low):
        return f"{mean:+.3f} (n/a)"
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"



def headline_markdown(head: pd.DataFrame, level: float = 0.95) -> list[str]:
    """The headline section of ``leaderboard.md`` (lines): one table per (mix, protocol), then the
    footnotes of its model labels."""
    if head.empty:
        return []
    pct = f"{level:.0%}"
    lines = ["## Headline: one row per method and model", "",
             f"Overall success (per run the unweighted mean over envs, then the mean over runs) in each eval "
             f"mode; the memory lifts with their {pct} CI: a two-level bootstrap over seeds, then tasks within "
             "each seed, paired per task within a run (`CI over` says what it resampled: one seed gives the "
             "task-level interval only). Per env, steps, invalid actions and wall time: [Details](#details).", ""]
    head_cols = ["method", "model", "free", "guided", "shuffled", "empty", f"guided − shuffled [{pct} CI]",
                 f"guided − empty [{pct} CI]", "CI over", "seeds"]
    for (mix, proto), part in head.groupby(["mix", "protocol"], sort=False):
        notes = model_notes(part)
        lines += [f"### {markdown_cell(mix)} · {markdown_cell(proto)}", "", "| " + " | ".join(head_cols) + " |",
                  "|---|---|" + "---:|" * 4 + "---|---|---|---:|"]
        for _, r in part.iterrows():
            method = r["method"] + (f" (extractor {r['extractor']})" if r["extractor"] and
                                    r["extractor"] != r["model_short"] else "")
            cells = [method, short_model(r["model"], r["model_short"], notes)] + [_num(r[m]) for m in MODES] + [
                _lift(r["lift_shuffled"], r["lift_shuffled_ci_low"], r["lift_shuffled_ci_high"]),
                _lift(r["lift_empty"], r["lift_empty_ci_low"], r["lift_empty_ci_high"]),
                r["lift_ci_over"] or "-", f"{r['n_seeds']} ({r['seeds']})"]
            lines.append("| " + " | ".join(markdown_cell(c) for c in cells) + " |")
        lines.append("")
        lines += [f"[{n}] {markdown_cell(full)}" + ("  " if i < len(notes) - 1 else "")
                  for i, (full, n) in enumerate(notes.items())]
        if notes:
            lines.append("")
        lines += _forms_markdown(part, notes, pct)
    return lines


def _forms_markdown(part: pd.DataFrame, notes: dict[str, int], pct: str) -> list[str]:
    """The memory-forms table of one (mix, protocol) (lines; none where no row ran a form): the guided
    retrieval shown as it is (``guided``), as its raw episodes, as what was distilled alone, or both,
    and ``guided`` minus each, with their CIs."""
    rows = part[part[list(FORMS)].notna().any(axis=1)]
    if rows.empty:
        return []
    head = ["method", "model", "guided", *FORMS, *[f"guided − {f} [{pct} CI]" for f in FORMS], "CI over", "seeds"]
    lines = ["Memory forms: the same retrieval on the same tasks, shown as the method shows it (`guided`), as the "
             "episodes its entries come from (`raw`), as what was distilled from them alone (`condensed`), or as "
             "both (docs/evaluation.md \"Memory forms\"); `-`: the form is the guided mode itself or does not "
             "exist for the method's memory.", "", "| " + " | ".join(head) + " |",
             "|---|---|" + "---:|" * 4 + "---|" * 3 + "---|---:|"]
    for _, r in rows.iterrows():
        cells = [r["method"], short_model(r["model"], r["model_short"], notes), _num(r["guided"]),
                 *[_num(r[f]) for f in FORMS],
                 *[_lift(r[f"lift_{f}"], r[f"lift_{f}_ci_low"], r[f"lift_{f}_ci_high"]) for f in FORMS],
                 r["lift_ci_over"] or "-", f"{r['n_seeds']} ({r['seeds']})"]
        lines.append("| " + " | ".join(markdown_cell(c) for c in cells) + " |")
    return lines + [""]
