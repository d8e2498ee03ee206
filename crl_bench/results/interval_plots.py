"""The interval charts of ``crl-bench report``: per evaluation protocol, a point-and-interval chart of
every method's overall success in each eval mode with its seed-level CI, and, where 3 or more seeds
of at least two methods share the protocol, rliable-style IQM and probability-of-improvement charts
(Agarwal et al., "Deep RL at the Edge of the Statistical Precipice", NeurIPS 2021, arXiv:2108.13264),
drawn with matplotlib from :mod:`crl_bench.results.stats`.

Input: a leaderboard frame (:func:`crl_bench.results.leaderboard.leaderboard_frame`) and the summaries
it was built from; output: PNG files and, for each, the caption the report shows.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from crl_bench.results.stats import CI_LEVEL, OVER_SEEDS, iqm, iqm_ci, probability_of_improvement_ci
from crl_bench.results.summary import pool_hash
from crl_bench.safe_io import printable

__all__ = ["MIN_SEEDS", "draw_interval_charts", "method_scores"]

#: the fewest runs of a method for the IQM and probability-of-improvement charts
MIN_SEEDS = 3
MODE_STYLE = {"free": ("tab:blue", "o"), "guided": ("tab:green", "^"), "shuffled": ("tab:orange", "s"),
              "empty": ("tab:grey", "D"), "initial": ("black", "x")}


def _slug(i: int, mix: str) -> str:
    return f"{i:02d}-" + re.sub(r"[^A-Za-z0-9]+", "-", mix).strip("-")[:40]


def method_scores(row: pd.Series, summaries: Sequence[dict[str, Any]]) -> np.ndarray:
    """The per-run, per-env success rates of one leaderboard row: shape ``(runs, envs)``, the envs of
    the row's protocol sorted by name, runs that lack an env left out."""
    ids = set(str(row["run_ids"]).split(","))
    proto = row["protocol_json"]
    envs = list(json.loads(proto).get("tasks_per_env") or {})
    out = []
    for s in summaries:
        if json.dumps(s["eval_protocol"], sort_keys=True, separators=(",", ":")) != proto:
            continue
        for r in s["runs"]:
            if r["run_id"] not in ids or pool_hash(r) != row["settings"]:
                continue
            per_env = (r["eval"].get(row["eval"]) or {}).get("per_env") or {}
            if envs and all(e in per_env for e in envs):
                out.append([float(per_env[e]["success_rate"]) for e in envs])
    # one run may be met twice (a run folder and its submission): keep distinct rows per run id
    return np.array(out[: len(ids)]) if out else np.zeros((0, max(len(envs), 1)))


def draw_one(job: Callable[[Path], Any], target: Path) -> str | None:
    """Draw one figure: ``job(target)`` with mathtext off, so that a ``$`` in a method, env or run
    name (text from configs and summaries) is drawn as itself and never parsed as a formula
    (matplotlib's ``text.parse_math``). A figure that fails is reported, not raised, so the others are
    still drawn: its half-written file is removed and the failure returned as the reason it is missing.

    Returns:
        ``job``'s own value (None when drawn, else why not), or ``"drawing failed (<error>)"``.
    """
    import matplotlib

    try:
        with matplotlib.rc_context({"text.parse_math": False}):
            return job(target)
    except Exception as e:  # noqa: BLE001 - any error of one figure; the report goes on without it
        target.unlink(missing_ok=True)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return printable(f"drawing failed ({type(e).__name__}{': ' + first[:300] if first else ''})")


def _figure(w: float, h: float) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100, layout="constrained")
    return fig, fig.subplots()


def _save(fig: Any, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", facecolor="white", bbox_inches="tight", pad_inches=0.1)


def _point_interval(part: pd.DataFrame, title: str, path: Path) -> None:
    methods = list(dict.fromkeys(part["method"]))
    fig, ax = _figure(7.0, 1.2 + 0.6 * len(methods))
    modes = [m for m in MODE_STYLE if m in set(part["eval"])]
    for j, mode in enumerate(modes):
        colour, marker = MODE_STYLE[mode]
        sel = part[part["eval"] == mode]
        for _, r in sel.iterrows():
            y = methods.index(r["method"]) + (j - (len(modes) - 1) / 2) * 0.15
            seeded = r["overall_ci_over"] == OVER_SEEDS
            if not np.isnan(r["overall_ci_low"]):
                ax.plot([r["overall_ci_low"], r["overall_ci_high"]], [y, y], color=colour, lw=2 if seeded else 1,
                        ls="-" if seeded else ":")
            ax.plot([r["overall_mean"]], [y], marker=marker, color=colour, ms=6,
                    mfc=colour if seeded else "white", ls="none", label=mode)
    handles, labels = ax.get_legend_handles_labels()
    keep = dict(zip(labels, handles))
    ax.legend(keep.values(), keep.keys(), fontsize=7, loc="best")
    ax.set_yticks(range(len(methods)))
    ax.set_yticklabels([f"{m} (n={int(part[part['method'] == m]['n_runs'].max())})" for m in methods], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("overall success (mean over runs)")
    ax.set_title(title, fontsize=7)
    _save(fig, path)


def _rliable(rows: list[tuple[str, np.ndarray]], title: str, iqm_path: Path, poi_path: Path) -> None:
    fig, ax = _figure(6.0, 1.2 + 0.4 * len(rows))
    for i, (_, scores) in enumerate(rows):
        low, high = iqm_ci(scores)
        ax.plot([low, high], [i, i], color="tab:blue", lw=6, alpha=0.4)
        ax.plot([iqm(scores)], [i], marker="|", color="black", ms=12)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{n} (n={s.shape[0]})" for n, s in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("IQM of per-run, per-env success")
    ax.set_title(title, fontsize=7)
    _save(fig, iqm_path)

    pairs = list(itertools.combinations(range(len(rows)), 2))     # P(B > A) = 1 - P(A > B)
    fig, ax = _figure(6.0, 1.2 + 0.3 * len(pairs))
    for i, (a, b) in enumerate(pairs):
        point, low, high = probability_of_improvement_ci(rows[a][1], rows[b][1])
        ax.plot([low, high], [i, i], color="tab:purple", lw=6, alpha=0.4)
        ax.plot([point], [i], marker="|", color="black", ms=12)
    ax.axvline(0.5, color="grey", ls="--", lw=1)
    ax.set_yticks(range(len(pairs)))
    ax.set_yticklabels([f"P({rows[a][0]} > {rows[b][0]})" for a, b in pairs], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("probability of improvement")
    ax.set_title(title, fontsize=7)
    _save(fig, poi_path)


def draw_interval_charts(df: pd.DataFrame, summaries: Sequence[dict[str, Any]],
                         out_dir: str | Path, failures: list[str] | None = None) -> list[tuple[str, str]]:
    """Draw the charts of every protocol of ``df`` into ``out_dir`` (created if needed).

    Files: ``intervals-<nn>-<mix>.png`` per (mix, protocol); where at least two methods have
    :data:`MIN_SEEDS`+ runs in their main mode (``guided`` where the method has it, else ``free``),
    also ``iqm-<nn>-<mix>.png`` (IQM of the per-run, per-env success with rliable's stratified
    bootstrap CI) and ``poi-<nn>-<mix>.png`` (probability of improvement of each pair of methods, once
    since P(B > A) = 1 - P(A > B), with its stratified bootstrap CI). All intervals: 95 %, seeded
    (:mod:`crl_bench.results.stats`).

    Each chart is drawn on its own with mathtext off (:func:`draw_one`): a
    ``$`` in a method or mix name is drawn as itself, and a chart that fails is left out (its line,
    ``"<file> not drawn: <why>"``, appended to ``failures``) while the others are still drawn.

    Returns:
        ``[(file name, caption), ...]`` of the charts drawn, in drawing order.
    """
    import matplotlib


    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawn: list[tuple[str, str]] = []
    pct = f"{CI_LEVEL:.0%}"
    for i, ((mix, proto), part) in enumerate(df.groupby(["mix", "protocol"], sort=False)):
        name = f"intervals-{_slug(i, mix)}.png"
        title = f"{mix} · {proto}"
        failed = draw_one(lambda p, part=part, title=title: _point_interval(part, title, p), out / name)
        if failed is not None and failures is not None:
            failures.append(f"{name} not drawn: {failed}")
        if failed is None:
            drawn.append((name, f"{title}: overall success of each method (rows; n = runs) in each eval mode "
                                f"(colour and marker), with its {pct} CI. Filled marker, solid bar: CI over "
                                "seeds and tasks (two-level bootstrap); open marker, dotted bar: one seed, CI "
                                "over its tasks only; no bar: no CI (fewer than 3 runs without per-task "
                                "outcomes). "))
        rows = []
        for method, m_part in part.groupby("method", sort=False):
            modes = dict(zip(m_part["eval"], (r for _, r in m_part.iterrows())))
            row = modes.get("guided", modes.get("free"))
            if row is None:
                continue
            scores = method_scores(row, summaries)
            if scores.shape[0] >= MIN_SEEDS:
                rows.append((f"{method} ({row['eval']})", scores))
        if len(rows) >= 2:
            iqm_name, poi_name = f"iqm-{_slug(i, mix)}.png", f"poi-{_slug(i, mix)}.png"
            failed = draw_one(lambda p, rows=rows, title=title, poi=out / poi_name: _rliable(rows, title, p, poi),
                              out / iqm_name)
            if failed is not None:
                (out / poi_name).unlink(missing_ok=True)
                if failures is not None:
                    failures.append(f"{iqm_name} and {poi_name} not drawn: {failed}")
                continue
            drawn.append((iqm_name, f"{title}: interquartile mean (IQM, the mean of the middle 50 %) of the "
                                    f"per-run, per-env success of each method with {MIN_SEEDS}+ runs, in its "
                                    f"main mode (guided where it has it), with rliable's stratified bootstrap "
                                    f"{pct} CI (runs resampled within each env; Agarwal et al. 2021). "))
            drawn.append((poi_name, f"{title}: probability of improvement P(X > Y), over every pair of a run of "
                                    "X and a run of Y (ties one half), averaged over envs, with its stratified "
                                    f"bootstrap {pct} CI; 0.5 (dashed): neither is better. "))
    return drawn
