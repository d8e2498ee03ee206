"""``crl-bench compare A B``: the difference of two methods (or two eval modes of the same runs) per env
and overall, on one task panel, with the seed-level interval, the probability of improvement and the
values of every seed.

A side is a run folder, a folder of runs (a sweep, or its ``runs/``) holding one method, or, with
``--sweep DIR``, a method name within that sweep: the run ids of a sweep are ``<name>-s<seed>``
(crl_bench/sweep.py), so ``casebank-utility`` names the runs ``casebank-utility-s0``, ... and
``casebank`` the runs ``casebank-s0``, ...; a name no run id has is matched against the summaries'
method field.

The two sides must share an evaluation protocol (split, tasks, task panel hashes, temperature, step
limit, trials, ...: the leaderboard's key). Runs of a side with another protocol are set aside with a
note (e.g. a 3-trial seed beside 1-trial ones); with no protocol in common the comparison is refused
(:class:`CompareError`, one line, exit 2).

Statistics (:mod:`crl_bench.results.stats`): per run and env the success rate over the panel's tasks;
per side the mean over runs; overall the unweighted mean over envs. Where both sides are the same runs
(``compare casebank casebank --mode guided --mode-b shuffled``) the difference is within each run,
paired per task, and its CI the two-level bootstrap of the per-task differences
(:func:`~crl_bench.results.stats.two_level_ci`); otherwise the runs of each side are resampled on their
own and the tasks once for both, paired over the panel (:func:`~crl_bench.results.stats.difference_ci`).
The probability of improvement is rliable's ``P(A > B)`` over pairs of runs, ties one half, per env and
averaged over envs overall (:func:`~crl_bench.results.stats.probability_of_improvement`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from crl_bench.results.labels import canon, protocol_label, run_identity
from crl_bench.results.leaderboard import collect
from crl_bench.results.stats import (
    CI_LEVEL,
    CI_RESAMPLES,
    CI_SEED,
    difference_ci,
    probability_of_improvement,
    two_level_ci,
)
from crl_bench.results.summary import pool_hash

__all__ = ["CompareError", "Side", "compare", "compare_json", "compare_markdown", "load_side"]

_SEED_SUFFIX = re.compile(r"-s\d+$")


class CompareError(ValueError):
    """A comparison that cannot be made (no such runs, several methods in one folder, no common panel)."""


@dataclass
class Side:
    """One side of a comparison: its name, and its runs as ``(summary, run)`` pairs."""

    name: str
    runs: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)


def _group(run: dict[str, Any]) -> str:
    return _SEED_SUFFIX.sub("", str(run["run_id"]))


def load_side(spec: str, sweep: str | Path | None = None) -> Side:
    """The runs ``spec`` names: a path (run folder or folder of runs), or a method name in ``sweep``.

    Raises:
        CompareError: nothing found, or a folder holds runs of several methods.
    """
    warnings: list[str] = []
    path = Path(spec)
    if sweep is not None and not path.exists():
        pairs = [(s, r) for s in collect([sweep], warnings) for r in s["runs"]]
        chosen = [(s, r) for s, r in pairs if _group(r) == spec] or [(s, r) for s, r in pairs if s["method"] == spec]
        groups = sorted({_group(r) for _, r in chosen})
        if not chosen:
            known = ", ".join(sorted({_group(r) for _, r in pairs})) or "none"
            raise CompareError(f"no runs named {spec!r} in {sweep} (its methods: {known})")
        if len(groups) > 1 and len({pool_hash(r) for _, r in chosen}) > 1:
            raise CompareError(f"{spec!r} in {sweep} is runs of different settings ({', '.join(groups)}); "
                               "name one of them")
        return Side(spec, chosen)
    if not path.exists():
        raise CompareError(f"{spec}: no such folder" + ("" if sweep else " (a method name needs --sweep DIR)"))
    pairs = [(s, r) for s in collect([path], warnings) for r in s["runs"]]
    if not pairs:
        raise CompareError(f"{spec}: no finished runs there")
    groups = sorted({_group(r) for _, r in pairs})
    if len(groups) > 1:
        raise CompareError(f"{spec} holds runs of several methods ({', '.join(groups)}); name one with "
                           f"--sweep {spec} and its method name")
    return Side(groups[0], pairs)


def _mode_runs(side: Side, mode: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The side's runs with per-task successes of every env under ``mode``, each run once."""
    out, seen = [], set()
    for s, r in side.runs:
        block = r["eval"].get(mode)
        ident = (run_identity(s, r), canon(s["eval_protocol"]))    # one run may have several protocols
        if block is None or ident in seen:
            continue
        if all(isinstance(v.get("successes"), list) and v["successes"] for v in block["per_env"].values()):
            seen.add(ident)
            out.append((s, r))
    return out


def compare(a: Side, b: Side, mode: str = "free", mode_b: str | None = None,
            protocol: str | None = None) -> dict[str, Any]:
    """The comparison of ``a`` under ``mode`` with ``b`` under ``mode_b`` (default: ``mode``).

    The protocol compared is the one both sides share whose label contains ``protocol`` (e.g.
    ``eval_unseen``, ``3 trials``), or, without it, the shared one with the most runs (the first met
    on a tie); the other shared protocols are named in ``notes``.

    Returns:
        A JSON-ready dict: ``a``/``b`` (name, mode, run ids, seeds), ``protocol`` (label and JSON),
        ``paired_runs`` (both sides are the same runs), ``ci`` (level, resamples, seed, what it
        resamples), ``envs`` (per env and ``overall``: ``a``, ``b``, ``diff``, ``ci_low``, ``ci_high``,
        ``ci_over``, ``p_improvement``), ``per_seed`` (seed -> ``a``, ``b``, ``diff`` overall) and
        ``notes`` (runs set aside and why).

    Raises:
        CompareError: a side has no runs with per-task outcomes under its mode, or the sides share no
            evaluation protocol.
    """
    mode_b = mode_b or mode
    notes: list[str] = []
    ra, rb = _mode_runs(a, mode), _mode_runs(b, mode_b)
    for side, runs, m in ((a, ra, mode), (b, rb, mode_b)):
        if not runs:
            raise CompareError(f"{side.name}: no run has per-task outcomes in eval mode {m!r}")
    protos_a = {canon(s["eval_protocol"]): s["eval_protocol"] for s, _ in ra}
    protos_b = {canon(s["eval_protocol"]) for s, _ in rb}
    common = [p for p in protos_a if p in protos_b]
    if not common:
        pa = ", ".join(sorted({protocol_label(s["eval_protocol"]) for s, _ in ra}))
        pb = ", ".join(sorted({protocol_label(s["eval_protocol"]) for s, _ in rb}))
        raise CompareError(f"{a.name} and {b.name} were not evaluated on one task panel and protocol "
                           f"({a.name}: {pa}; {b.name}: {pb}); refusing to compare")
    if protocol is not None:
        chosen = [p for p in common if protocol in protocol_label(protos_a[p])]
        if len(chosen) != 1:
            labels = "; ".join(protocol_label(protos_a[p]) for p in common)
            raise CompareError(f"--protocol {protocol!r} matches {len(chosen)} of the protocols {a.name} and "
                               f"{b.name} share ({labels})")
        common = chosen + [p for p in common if p not in chosen]
    proto = max(common, key=lambda p: sum(canon(s["eval_protocol"]) == p for s, _ in ra + rb)) \
        if protocol is None else common[0]
    others = [protocol_label(protos_a[p]) for p in common if p != proto]
    if others:
        notes.append(f"also evaluated on both sides, under other protocols (choose with --protocol): "
                     f"{'; '.join(others)}")
    for side, runs in ((a, ra), (b, rb)):
        kept = {r["run_id"] for s, r in runs if canon(s["eval_protocol"]) == proto}
        other = sorted({r["run_id"] for _, r in runs} - kept)
        if other:
            notes.append(f"{side.name}: set aside {', '.join(other)} (not evaluated under this protocol)")
    ra = [(s, r) for s, r in ra if canon(s["eval_protocol"]) == proto]
    rb = [(s, r) for s, r in rb if canon(s["eval_protocol"]) == proto]
    envs = list(protos_a[proto].get("tasks_per_env") or ra[0][1]["eval"][mode]["per_env"])
    paired = {run_identity(s, r) for s, r in ra} == {run_identity(s, r) for s, r in rb}

    def tasks(runs: list, m: str) -> list[list[np.ndarray]]:
        return [[np.asarray(r["eval"][m]["per_env"][e]["successes"], dtype=float) for e in envs] for _, r in runs]

    ta, tb = tasks(ra, mode), tasks(rb, mode_b)
    if paired:                        # the same runs: order b as a, then a per-task difference per run
        order = {run_identity(s, r): i for i, (s, r) in enumerate(rb)}
        tb = [tb[order[run_identity(s, r)]] for s, r in ra]
        rb = [rb[order[run_identity(s, r)]] for s, r in ra]
    rows: dict[str, dict[str, Any]] = {}
    for i, env in enumerate([*envs, "overall"]):
        pick = list(range(len(envs))) if env == "overall" else [i]
        xa = [[run[j] for j in pick] for run in ta]
        xb = [[run[j] for j in pick] for run in tb]
        va = np.array([np.mean([x.mean() for x in run]) for run in xa])
        vb = np.array([np.mean([x.mean() for x in run]) for run in xb])
        if paired:
            low, high, over = two_level_ci([[p - q for p, q in zip(ra_, rb_)] for ra_, rb_ in zip(xa, xb)])
        else:
            low, high, over = difference_ci(xa, xb)
        if env == "overall":
            poi = float(np.mean([rows[e]["p_improvement"] for e in envs]))
        else:
            poi = probability_of_improvement(va, vb)
        rows[env] = {"a": float(va.mean()), "b": float(vb.mean()), "diff": float(va.mean() - vb.mean()),
                     "ci_low": low, "ci_high": high, "ci_over": over, "p_improvement": poi,
                     "a_per_run": va.tolist(), "b_per_run": vb.tolist()}
    per_seed: dict[str, dict[str, float | None]] = {}
    for (_, r), v in zip(ra, rows["overall"]["a_per_run"]):
        per_seed.setdefault(str(r["seed"]), {"a": None, "b": None, "diff": None})["a"] = v
    for (_, r), v in zip(rb, rows["overall"]["b_per_run"]):
        per_seed.setdefault(str(r["seed"]), {"a": None, "b": None, "diff": None})["b"] = v
    for cell in per_seed.values():
        if cell["a"] is not None and cell["b"] is not None:
            cell["diff"] = cell["a"] - cell["b"]
    return {
        "a": {"name": a.name, "mode": mode, "run_ids": [r["run_id"] for _, r in ra],
              "seeds": [r["seed"] for _, r in ra]},
        "b": {"name": b.name, "mode": mode_b, "run_ids": [r["run_id"] for _, r in rb],
              "seeds": [r["seed"] for _, r in rb]},
        "protocol": {"label": protocol_label(protos_a[proto]), "json": protos_a[proto]},
        "paired_runs": paired,
        "ci": {"level": CI_LEVEL, "resamples": CI_RESAMPLES, "seed": CI_SEED},
        "envs": rows, "per_seed": dict(sorted(per_seed.items(), key=lambda kv: (len(kv[0]), kv[0]))),
        "notes": notes,
    }


def _side_text(side: dict[str, Any]) -> str:
    return f"{side['name']} ({side['mode']})"


def compare_markdown(res: dict[str, Any]) -> str:
    """The Markdown ``crl-bench compare`` prints: a table per env and overall, then one row per seed."""
    a, b = _side_text(res["a"]), _side_text(res["b"])
    how = ("within each run, paired per task; two-level bootstrap: runs, then tasks within each run"
           if res["paired_runs"] else
           "two-level bootstrap: each side's runs resampled on their own, tasks once for both (paired over the panel)")
    lines = [f"# {a} vs {b}", "",
             f"Protocol: {res['protocol']['label']}. Runs: {res['a']['name']} {', '.join(res['a']['run_ids'])}; "
             f"{res['b']['name']} {', '.join(res['b']['run_ids'])}.", "",
             f"{res['ci']['level']:.0%} CI: {how} ({res['ci']['resamples']} resamples, seed {res['ci']['seed']}); "
             "the last column says what it resamples (one seed on each side: tasks only). "
             "P(A > B): over every pair of a run of A and a run of B, ties one half (rliable); overall: "
             "mean over envs.", "",
             f"| env | A: {a} | B: {b} | A - B | {res['ci']['level']:.0%} CI | CI over | P(A > B) |",
             "|---|---:|---:|---:|---|---|---:|"]
    for env, r in res["envs"].items():
        name = f"**{env}**" if env == "overall" else env
        lines.append(f"| {name} | {r['a']:.3f} | {r['b']:.3f} | {r['diff']:+.3f} | "
                     f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] | {r['ci_over']} | {r['p_improvement']:.2f} |")
    lines += ["", "| seed | A | B | A - B |", "|---|---:|---:|---:|"]
    for seed, c in res["per_seed"].items():
        cells = ["-" if c[k] is None else f"{c[k]:.3f}" if k != "diff" else f"{c[k]:+.3f}" for k in ("a", "b", "diff")]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    for note in res["notes"]:
        lines += ["", f"Note: {note}."]
    return "\n".join(lines) + "\n"


def compare_json(res: dict[str, Any]) -> str:
    """``res`` as indented JSON (``--json``)."""
    return json.dumps(res, indent=2, sort_keys=False)
