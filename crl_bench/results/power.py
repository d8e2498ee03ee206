"""How many seeds a sweep needs: from the spread between the seeds of finished runs, the seeds with
which a two-sided t-test at 5 % detects a given memory lift, or a given difference between two
methods, with 80 % power (:func:`crl_bench.results.stats.seeds_needed`).

The spread is the sample standard deviation over runs (seeds) of one method on one protocol of

* its overall lift ``guided - shuffled`` (per run: the mean over envs of the difference of the two
  modes' success rates on the same tasks), for a lift; and
* its overall success in its main mode (``guided`` where it has one, else ``free``), for a difference
  between two methods (``n`` seeds each).

Each run's value already carries the noise of its finite task panel, so this between-seed SD is the
whole variance a new seed adds. Methods with 2+ seeds are pooled (pooled variance, weights ``n - 1``);
since a method whose lift is always 0 has no spread, the most variable method is reported too, the
conservative figure. Read by ``crl-bench sweep`` (for its own folder, and ``--plan-seeds DIR`` on its
own) and docs/evaluation.md "How many seeds".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from crl_bench.results.interval_plots import method_scores
from crl_bench.results.stats import seeds_needed

__all__ = ["POWER", "ALPHA", "plan_lines", "spreads"]

POWER = 0.8
ALPHA = 0.05


def spreads(df: pd.DataFrame, summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mix, protocol, method) of a leaderboard frame with 2+ runs: ``lift_runs`` (per-run overall
    ``guided - shuffled``, empty when the method has no such pair of modes) and ``main_runs`` (per-run
    overall success in its main mode), with ``mode`` naming that mode."""
    out = []
    for (mix, proto, method), part in df.groupby(["mix", "protocol", "method"], sort=False):
        modes = {r["eval"]: r for _, r in part.iterrows()}
        main = modes.get("guided", modes.get("free"))
        if main is None or int(main["n_runs"]) < 2:
            continue
        lift: list[float] = []
        g, s = modes.get("guided"), modes.get("shuffled")
        if g is not None and s is not None and g["run_ids"] == s["run_ids"]:
            a, b = method_scores(g, summaries), method_scores(s, summaries)
            if a.shape == b.shape and a.shape[0] >= 2:
                lift = (a.mean(axis=1) - b.mean(axis=1)).tolist()
        main_scores = method_scores(main, summaries)
        out.append({"mix": mix, "protocol": proto, "method": method, "mode": main["eval"],
                    "lift_runs": lift, "main_runs": main_scores.mean(axis=1).tolist() if main_scores.size else []})
    return out


def _pooled(groups: list[list[float]]) -> tuple[float, int]:
    """Pooled SD over groups of 2+ values and its degrees of freedom."""
    groups = [g for g in groups if len(g) >= 2]
    df = sum(len(g) - 1 for g in groups)
    if not df:
        return math.nan, 0
    return math.sqrt(sum((len(g) - 1) * float(np.var(g, ddof=1)) for g in groups) / df), df


def _needed(sd: float, effect: float, two_sample: bool) -> str:
    n = seeds_needed(sd, effect, POWER, ALPHA, two_sample=two_sample)
    return ("more than 1000" if n > 1000 else str(n)) + " seeds" + (" each" if two_sample else "")


def _line(what: str, groups: list[tuple[str, list[float]]], effect: float, two_sample: bool) -> str:
    """One seeds-needed line over ``groups`` (name, per-run values), pooled and most variable."""
    sd, dof = _pooled([v for _, v in groups])
    if sd == 0:
        return (f"  {what}: no estimate: every seed of the {len(groups)} methods gave the same value "
                "(SD 0), no spread to go by")
    worst = max(groups, key=lambda kv: float(np.std(kv[1], ddof=1)))
    wsd = float(np.std(worst[1], ddof=1))
    return (f"  {what}: {_needed(sd, effect, two_sample)} at the pooled SD {sd:.3f} ({len(groups)} methods, "
            f"{dof} df); {_needed(wsd, effect, two_sample)} at the SD {wsd:.3f} of the most variable "
            f"({worst[0]}, {len(worst[1])} seeds)")


def plan_lines(df: pd.DataFrame, summaries: Sequence[dict[str, Any]], effect: float = 0.05) -> list[str]:
    """The lines ``crl-bench sweep`` prints: per protocol with a method of 2+ seeds, the between-seed
    SDs and the seeds needed to detect a lift of ``effect`` and a difference of ``effect`` between two
    methods (80 % power, two-sided t-test at 5 %; :func:`crl_bench.results.stats.seeds_needed`)."""
    lines: list[str] = []
    rows = spreads(df, summaries)
    for (mix, proto), part in pd.DataFrame(rows).groupby(["mix", "protocol"], sort=False) if rows else []:
        lines.append(f"seeds needed on {mix} · {proto} (80% power, two-sided t-test at 5%, from the "
                     "between-seed SD of these runs):")
        lifts = [(r["method"], r["lift_runs"]) for _, r in part.iterrows() if len(r["lift_runs"]) >= 2]
        if lifts:
            lines.append(_line(f"lift guided - shuffled of {effect:g}", lifts, effect, False))
        mains = [(f"{r['method']} ({r['mode']})", r["main_runs"]) for _, r in part.iterrows()
                 if len(r["main_runs"]) >= 2]
        if mains:
            lines.append(_line(f"difference of {effect:g} between two methods' success", mains, effect, True))
    return lines
