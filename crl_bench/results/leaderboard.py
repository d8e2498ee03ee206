"""``crl-bench leaderboard``: one table of comparable results from run and submission summaries.

Input: folders walked recursively for ``summary.json`` files (runs and submissions,
crl_bench/results/summary.py); a finished run folder without one (``config.yaml`` + ``eval.json``) is
summarised on the fly; an unfinished run (no ``eval.json``) or an invalid summary is skipped with a
warning.

Rows: one per (method, model, extractor, mix, eval protocol, eval mode). The eval mode is ``free``
(no experience), ``guided`` (read-only retrieval from the bank) or one of the memory controls
``shuffled`` (another task's retrieval) and ``empty`` (the knowledge block with no entry), so
experience methods get up to four rows.  A run folder's later evaluations on other splits
(``checkpoint-<split>-split.json`` of ``crl-bench eval --run``, with their protocol) are rows of
their own protocol. Runs with different protocols (split, episodes, tasks per env, temperature, top_p, top_k,
max_new_tokens, max_steps, trials) are never pooled: the protocol is part of the key.

Numbers (the header of ``leaderboard.md`` says the same):

* per env: success rate, mean and sample standard deviation (ddof=1) over the row's runs, and n, the
  number of runs that evaluated that env (a run without the env makes n smaller, never a 0), and
  its 95% CI (CSV only, ``ci_low/<env>``, ``ci_high/<env>``);
* overall: per run the unweighted mean of its per-env success rates (only runs that evaluated every
  env of the row), then mean and std over runs, and a 95% CI that says what it resamples
  (``overall_ci_over``): where the runs recorded per-task outcomes, the two-level bootstrap over runs
  (seeds), then tasks within each run (``seeds and tasks``; one run: ``tasks (1 seed)``); else, for
  n >= 3, the percentile bootstrap of the per-run means (``seeds``); 9,999 resamples, seeded
  (:mod:`.stats`);
* mean eval steps and invalid-action rate, train steps, train episodes and train wall seconds:
  per-run values averaged over the row's runs;
* a ``guided`` row's overall lifts ``guided - shuffled`` and ``guided - empty`` with the same CI,
  paired per task within each run (:data:`LIFT_ROW_COLUMNS`); per env in :func:`lift_frame`;
* the headline (:mod:`.headline`): one row per method and model per protocol.

Duplicates: a run id met twice in one row (e.g. a run folder and a submission packed from it, or
overlapping paths) is counted once, with a warning. Two different runs with the same seed are both
counted (n counts runs; e.g. re-runs on nondeterministic kernels), with a warning.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pandas as pd

from crl_bench.results.headline import headline_frame, headline_markdown, model_notes, short_model
from crl_bench.results.panel import content_hash, short_hash
from crl_bench.results.reported import load_reported, reported_markdown
from crl_bench.results.run_folder import is_run_folder
from crl_bench.results.stats import (
    CI_RESAMPLES,
    CI_SEED,
    OVER_RUNS,
    mean_ci,
    mean_or_nan,
    std_or_nan,
    two_level_ci,
)
from crl_bench.results.submission import is_verified
from crl_bench.results.summary import (
    LABEL_MAX_KEYS,
    SummaryError,
    build_summary,
    fill_settings,
    read_summary,
    settings_labels,
    validate_summary,
)
from crl_bench.safe_io import load_json, markdown_cell, printable

#: eval modes of a summary run: with experience, its memory controls, without; ``initial`` is the
#: untrained actor before step 1 (``eval.at_start``).
MODES = ("guided", "shuffled", "empty", "free", "initial")
#: Columns of the memory-lift table (:func:`lift_frame`).
LIFT_COLUMNS = ["method", "model", "extractor", "mix", "protocol", "env", "n_runs", "tasks", "guided",
                "shuffled", "lift", "lift_ci_low", "lift_ci_high", "ci_over", "empty", "lift_empty",
                "lift_empty_ci_low", "lift_empty_ci_high", "run_ids", "settings"]
#: Folders never walked into.
SKIP_DIRS = {"checkpoint", "__pycache__", "node_modules"}
#: Columns before the per-env ones, in order.
BASE_COLUMNS = ["method", "model", "model_short", "extractor", "mix", "eval", "protocol", "n_runs", "seeds",
                "overall_mean", "overall_std", "overall_n", "overall_ci_low", "overall_ci_high", "overall_ci_over"]
#: Columns of a ``guided`` row: its memory lifts over the runs that also have the control, overall
#: (per run the mean over envs of the per-task differences), with their two-level CIs.
LIFT_ROW_COLUMNS = ["lift_shuffled", "lift_shuffled_ci_low", "lift_shuffled_ci_high", "lift_empty",
                    "lift_empty_ci_low", "lift_empty_ci_high", "lift_ci_over", "lift_n"]
TAIL_COLUMNS = ["steps_mean", "invalid_action_rate", "train_steps", "train_episodes", "train_wall_s",
                "per_seed", "run_ids", "verified", "mix_envs", "panel", "settings", "protocol_json"]
EVAL_DOC = "docs/evaluation.md"


def _warn(warnings: list[str] | None, message: str) -> None:
    message = printable(message)            # it may quote a hostile file: no control characters
    if warnings is None:
        print(f"warning: {message}", file=sys.stderr)
    else:
        warnings.append(message)


# ---- collecting --------------------------------------------------------------------------------
def collect(paths: Sequence[str | Path], warnings: list[str] | None = None) -> list[dict[str, Any]]:
    """Every summary under ``paths``, validated.

    Each path is a folder walked recursively (hidden folders, ``checkpoint/`` and ``__pycache__``
    skipped) or a ``summary.json`` file. A folder with ``summary.json`` is read and not walked
    further; a run folder (``config.yaml`` with ``eval.json``/``versions.json``/``metrics.jsonl``)
    without one is summarised on the fly (crl_bench.results.summary.build_summary).

    Args:
        paths: folders or summary files.
        warnings: if given, skip messages are appended to it; otherwise each is printed to stderr.

    Returns:
        The summaries in walk order (sorted folder names). Unfinished runs (no ``eval.json``),
        invalid summaries and missing paths are skipped with a warning naming the folder and the
        problem; nothing here raises for bad input. Every file is read as untrusted input
        (crl_bench.safe_io: no symbolic link out of its folder, size and depth limits, UTF-8, finite
        numbers), so one hostile submission is skipped and the others are still collected.
    """
    out: list[dict[str, Any]] = []
    seen: set[Path] = set()

    def take(folder: Path, has_summary: bool) -> None:
        real = folder.resolve()
        if real in seen:
            return
        seen.add(real)
        # RecursionError: metrics.jsonl lines are parsed by crl_bench.results.run_folder.iter_metrics without a depth
        # limit; TypeError/AttributeError: run files of the wrong shapes; each costs only its own run
        try:
            if has_summary:
                data = read_summary(folder / "summary.json")
                if data["kind"] == "submission":     # re-run and matched here (submission verify)
                    data["_verified"] = is_verified(folder)
            else:
                data = build_summary(folder)
                validate_summary(data, source=f"{folder} (summarised from its run files)")
            data["_settings"] = fill_settings(data, folder)
            out.append(data)
        except (SummaryError, OSError, ValueError, RecursionError, TypeError, AttributeError) as e:
            _warn(warnings, f"skipped {folder}: {e}")
        for extra in sorted(folder.glob("checkpoint-*-split.json")):
            try:
                head = load_json(extra)
                if not isinstance(head, dict) or not isinstance(head.get("protocol"), dict):
                    continue                # written before evaluations recorded their protocol
                data = build_summary(folder, extra.name)
                validate_summary(data, source=f"{extra} (summarised with its run files)")
                data["_settings"] = fill_settings(data, folder)
                out.append(data)
            except (SummaryError, OSError, ValueError, RecursionError, TypeError, AttributeError) as e:
                _warn(warnings, f"skipped {extra}: {e}")

    for p in map(Path, paths):
        if not p.exists():
            _warn(warnings, f"{p}: does not exist")
            continue
        if p.is_file():
            if p.name == "summary.json":
                take(p.parent, True)
            else:
                _warn(warnings, f"{p}: not a folder or a summary.json")
            continue
        for dirpath, dirnames, filenames in os.walk(p):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
            folder = Path(dirpath)
            if "summary.json" in filenames:
                take(folder, True)
                dirnames[:] = []
            elif is_run_folder(folder, set(filenames)):
                take(folder, False)
                dirnames[:] = []
    return out


# ---- the table ---------------------------------------------------------------------------------
def _per_env_text(values: dict[str, Any]) -> str:
    vals = list(values.values())
    if vals and all(v == vals[0] for v in vals):
        return f"{vals[0]}"
    return ",".join(f"{e}={v}" for e, v in values.items())


def protocol_label(protocol: dict[str, Any]) -> str:
    """Compact text of an eval protocol, e.g. ``"eval · 4 ep/env · T=0 · max_steps 6"``.

    Shows the protocol profile where there is one, split (with the envs on another split), episodes
    per env (``all tasks`` for ``"all"``), the tasks actually run when they differ from the episodes
    asked, temperature, ``top_p`` unless 1, ``top_k`` unless 0/absent, ``max_new_tokens`` when
    recorded, the step limit (one number if all envs share it), the eval prompt's layout and history
    where the evaluation sets them, each env's constructor settings when it has any (e.g.
    ``minihack-room: variant=MiniHack-Room-Random-5x5-v0``), the attempts per task when more than one
    (``3 trials``), the independent samples per task when more than one (``8 samples``), ``free
    replies`` and the prefill where the evaluation did not restrict replies or changed the prefill, the
    sampled-worker draws (``20 draws of 128``) and the task panel where recorded (``panel 3f2a...``:
    one env's panel hash, or for several envs the hash of all of them,
    :func:`panels_hash`; shortened to :data:`~crl_bench.results.panel.SHORT` hex digits).
    """
    ep = protocol["episodes"]
    split = str(protocol["split"])
    if protocol.get("splits"):              # envs evaluated on another split (eval.splits)
        split += " (" + ", ".join(f"{e}: {v}" for e, v in sorted(protocol["splits"].items())) + ")"
    parts = ([f"profile {protocol['profile']}"] if protocol.get("profile") else []) + \
        [split, "all tasks" if ep == "all" else f"{ep} ep/env"]
    tpe = protocol.get("tasks_per_env") or {}
    if ep == "all" or any(v != ep for v in tpe.values()):
        parts.append(f"tasks {_per_env_text(tpe)}")
    parts.append(f"T={protocol['temperature']:g}")
    if protocol.get("top_p", 1.0) != 1.0:
        parts.append(f"top_p {protocol['top_p']:g}")
    if protocol.get("top_k"):
        parts.append(f"top_k {protocol['top_k']}")
    if protocol.get("max_new_tokens") is not None:
        parts.append(f"max_new_tokens {protocol['max_new_tokens']}")
    parts.append(f"max_steps {_per_env_text(protocol.get('max_steps') or {})}")
    if protocol.get("prompt"):
        parts.append(f"{protocol['prompt']['layout']} prompt, history {protocol['prompt']['history']}")
    if protocol.get("constrained") is False:
        parts.append("free replies")
    if "prefill" in protocol:
        parts.append(f"prefill {json.dumps(protocol['prefill'])}")
    for env, settings in sorted((protocol.get("env_settings") or {}).items()):
        parts.append(f"{env}: " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())))
    if protocol.get("trials", 1) > 1:
        parts.append(f"{protocol['trials']} trials")
    if protocol.get("samples", 1) > 1:
        parts.append(f"{protocol['samples']} samples")
    if protocol.get("draws"):
        parts.append(f"{protocol['draws']['count']} draws of {protocol['draws']['size']}")
    if protocol.get("panels"):
        parts.append(f"panel {short_hash(panels_hash(protocol['panels']))}")
    return " · ".join(parts)


def panels_hash(panels: dict[str, str]) -> str:
    """One hash for a protocol's task panels: the env's panel hash when there is one env, else the
    sha256 of the canonical JSON ``{env id: panel hash}`` (docs/evaluation.md "Task panels")."""
    if len(panels) == 1:
        return next(iter(panels.values()))
    return content_hash(panels)


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _model_label(model: dict[str, Any]) -> str:
    return model["name"] + (f" ({model['variant']})" if model.get("variant") else "")


def run_identity(summary: dict[str, Any], run: dict[str, Any]) -> tuple[str, str, str]:
    """What makes one run the same run wherever its summary is met (a run folder and a submission packed
    from it): its run id, the git commit it ran at and its training totals. Two runs that only share a
    run id (e.g. ``static-s1`` of two sweeps) are different runs."""
    return str(run["run_id"]), str(summary["versions"].get("git_commit")), _canon(run["train"])


def leaderboard_frame(summaries: Sequence[dict[str, Any]], warnings: list[str] | None = None) -> pd.DataFrame:
    """One row per (method, model, extractor, mix, protocol, training settings, eval mode) over
    validated summaries (settings: each run's ``settings`` hash, "" where unknown; see
    :func:`_label_settings` for how rows that differ only in it are named).

    Columns: ``BASE_COLUMNS``, then per env ``success_mean/<env>``, ``success_std/<env>``,
    ``n/<env>`` (envs in mix order), then ``score_mean/<env>`` for envs whose score is not their
    success rate (WebShop's mean score, mean over runs) and ``type_success/<env>/<type>`` for envs
    with task types (ALFWorld's six; mean over runs), then ``TAIL_COLUMNS``. Success rates are fractions in [0, 1];
    ``train_wall_s`` is seconds; a std of fewer than 2 runs and a CI of fewer than 3 are NaN; an env
    no run of the row evaluated has NaN mean and n 0. Sorted by mix, then overall mean (descending,
    NaN last), then method, model, eval mode, protocol.

    Args:
        summaries: summary dicts (crl_bench.results.summary; e.g. from :func:`collect`).
        warnings: duplicate-run and duplicate-seed messages are appended here (stderr if None).

    Returns:
        A DataFrame; empty (with the base columns) when there is nothing to show.
    """
    groups: dict[tuple, dict[str, Any]] = {}
    for s in summaries:
        proto = s["eval_protocol"]
        for r in s["runs"]:
            for mode in MODES:
                block = r["eval"].get(mode)
                if block is None:
                    continue
                key = (s["method"], _canon(s["model"]), s["mix"]["name"], _canon(s["mix"]["envs"]),
                       _canon(proto), mode, r.get("settings", ""))
                g = groups.setdefault(key, {"summary": s, "mode": mode, "runs": {}, "settings": key[-1], "key": key})
                ident = run_identity(s, r)
                if ident in g["runs"]:
                    _warn(warnings, f"run {r['run_id']} appears twice for {s['method']} / {s['mix']['name']} "
                                    f"/ {mode}; counted once")
                    continue
                g["runs"][ident] = {"run_id": r["run_id"], "seed": r["seed"], "train": r["train"], "eval": block,
                                    "verified": bool(s.get("_verified"))}

    rows: list[dict[str, Any]] = []
    all_envs: list[str] = []
    score_envs: list[str] = []                 # envs whose score is not just success (WebShop)
    type_cols: list[str] = []                  # type_success/<env>/<task type> (ALFWorld's six)
    pass_cols: list[str] = []                  # pass@k/<env>, pass^k/<env> (eval.samples)
    for g in groups.values():
        s, runs = g["summary"], list(g["runs"].items())
        seeds = [v["seed"] for _, v in runs]
        for seed in sorted({x for x in seeds if seeds.count(x) > 1}):
            ids = [v["run_id"] for _, v in runs if v["seed"] == seed]
            _warn(warnings, f"seed {seed} has {len(ids)} runs for {s['method']} / {s['mix']['name']} / "
                            f"{g['mode']} ({', '.join(ids)}); all are counted")
        evaluated = {e for _, v in runs for e in v["eval"]["per_env"]}
        envs = [e for e in s["mix"]["envs"] if e in evaluated] + sorted(evaluated - set(s["mix"]["envs"]))
        row: dict[str, Any] = {
            "method": s["method"], "model": _model_label(s["model"]), "model_short": s["model"]["name"],
            "extractor": s["model"].get("extractor") or "", "mix": s["mix"]["name"], "eval": g["mode"],
            "protocol": protocol_label(s["eval_protocol"]), "n_runs": len(runs),
            "seeds": ",".join(str(x) for x in seeds),
        }
        overall: list[float] = []
        by_seed: list[str] = []
        for _, v in runs:
            per_env = v["eval"]["per_env"]
            if envs and all(e in per_env for e in envs):
                overall.append(float(np.mean([per_env[e]["success_rate"] for e in envs])))
                by_seed.append(f"{v['seed']}={overall[-1]!r}")
        row["per_seed"] = ";".join(by_seed)
        row["overall_mean"], row["overall_std"] = mean_or_nan(overall), std_or_nan(overall)
        row["overall_n"] = len(overall)
        outcomes = _task_outcomes([v["eval"] for _, v in runs], envs)
        if outcomes is not None:
            row["overall_ci_low"], row["overall_ci_high"], row["overall_ci_over"] = two_level_ci(outcomes)
        else:
            row["overall_ci_low"], row["overall_ci_high"] = mean_ci(overall)
            row["overall_ci_over"] = "" if math.isnan(row["overall_ci_low"]) else OVER_RUNS
        for e in envs:
            vals = [float(v["eval"]["per_env"][e]["success_rate"]) for _, v in runs if e in v["eval"]["per_env"]]
            row[f"success_mean/{e}"], row[f"success_std/{e}"] = mean_or_nan(vals), std_or_nan(vals)
            row[f"n/{e}"] = len(vals)
            env_outcomes = _task_outcomes([v["eval"] for _, v in runs if e in v["eval"]["per_env"]], [e])
            row[f"ci_low/{e}"], row[f"ci_high/{e}"] = (two_level_ci(env_outcomes)[:2] if env_outcomes is not None
                                                       else mean_ci(vals))
            if e not in all_envs:
                all_envs.append(e)
            blocks = [v["eval"]["per_env"][e] for _, v in runs if e in v["eval"]["per_env"]]
            scores = [float(b["score_mean"]) for b in blocks if "score_mean" in b]
            if scores and any(abs(float(b["score_mean"]) - float(b["success_rate"])) > 1e-9
                              for b in blocks if "score_mean" in b):
                row[f"score_mean/{e}"] = mean_or_nan(scores)
                if e not in score_envs:
                    score_envs.append(e)
            curves = [b for b in blocks if b.get("pass_at_k")]
            if curves:                  # eval.samples: pass@k and pass^k at k = samples (the protocol's)
                k = str(max(int(x) for x in curves[0]["pass_at_k"]))
                for name, key in (("pass@k", "pass_at_k"), ("pass^k", "pass_hat_k")):
                    col = f"{name}/{e}"
                    row[col] = mean_or_nan([float(b[key][k]) for b in curves if k in (b.get(key) or {})])
                    if col not in pass_cols:
                        pass_cols.append(col)
            types = sorted({t for b in blocks for t in (b.get("per_type") or {})})
            for t in types:
                col = f"type_success/{e}/{t}"
                row[col] = mean_or_nan([float(b["per_type"][t]["success_rate"]) for b in blocks
                                  if t in (b.get("per_type") or {})])
                if col not in type_cols:
                    type_cols.append(col)
        row["steps_mean"] = mean_or_nan([float(v["eval"]["steps_mean"]) for _, v in runs])
        row["invalid_action_rate"] = mean_or_nan([float(v["eval"]["invalid_action_rate"]) for _, v in runs])
        row["train_steps"] = mean_or_nan([float(v["train"]["steps"]) for _, v in runs])
        row["train_episodes"] = mean_or_nan([float(v["train"]["episodes"]) for _, v in runs])
        row["train_wall_s"] = mean_or_nan([float(v["train"]["wall_s"]) for _, v in runs])
        row["run_ids"] = ",".join(v["run_id"] for _, v in runs)
        checked = [v["verified"] for _, v in runs]
        row["verified"] = "yes" if all(checked) else "partly" if any(checked) else ""
        row["mix_envs"] = _canon(s["mix"]["envs"])
        row["panel"] = panels_hash(s["eval_protocol"]["panels"]) if s["eval_protocol"].get("panels") else ""
        row["settings"] = g["settings"]
        row["protocol_json"] = _canon(s["eval_protocol"])
        if g["mode"] == "guided":
            row.update(_row_lifts(g, groups, envs))
        rows.append(row)
    _label_settings(rows, _details(summaries))

    # two different protocols must never look the same: disambiguate equal labels with a short hash
    # (within one mix: tables are per mix, and other mixes' protocols differ in their envs anyway)
    by_label: dict[tuple[str, str], set[str]] = {}
    for row in rows:
        by_label.setdefault((row["mix"], row["protocol"]), set()).add(row["protocol_json"])
    for row in rows:
        if len(by_label[(row["mix"], row["protocol"])]) > 1:
            row["protocol"] += " #" + hashlib.sha1(row["protocol_json"].encode()).hexdigest()[:6]

    env_cols = [f"{k}/{e}" for e in all_envs for k in ("success_mean", "success_std", "n", "ci_low", "ci_high")]
    extra_cols = [f"score_mean/{e}" for e in score_envs] + type_cols + pass_cols
    df = pd.DataFrame(rows, columns=BASE_COLUMNS + LIFT_ROW_COLUMNS + env_cols + extra_cols + TAIL_COLUMNS)
    for e in all_envs:
        df[f"n/{e}"] = df[f"n/{e}"].fillna(0).astype(int)
    if df.empty:
        return df
    df["_neg"] = -df["overall_mean"]
    df = df.sort_values(["mix", "_neg", "method", "model", "eval", "protocol"], na_position="last",
                        kind="mergesort").drop(columns="_neg").reset_index(drop=True)
    return df


def _task_outcomes(blocks: Sequence[dict[str, Any]], envs: Sequence[str]) -> list[list[np.ndarray]] | None:
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


def _row_lifts(g: dict[str, Any], groups: dict[tuple, dict[str, Any]], envs: Sequence[str]) -> dict[str, Any]:
    """The :data:`LIFT_ROW_COLUMNS` of a ``guided`` group ``g``: ``guided - shuffled`` and ``guided -
    empty`` over the runs that have both modes, per run the mean over ``envs`` of the per-task
    differences, with :func:`~crl_bench.results.stats.two_level_ci` (paired per task within a run)."""
    out: dict[str, Any] = {c: math.nan for c in LIFT_ROW_COLUMNS}
    out["lift_ci_over"], out["lift_n"] = "", 0
    for control in ("shuffled", "empty"):
        key = list(g["key"])
        key[5] = control
        other = groups.get(tuple(key))
        if other is None:
            continue
        both = [ident for ident in g["runs"] if ident in other["runs"]]
        a = _task_outcomes([g["runs"][i]["eval"] for i in both], envs)
        b = _task_outcomes([other["runs"][i]["eval"] for i in both], envs)
        if a is None or b is None or any([x.size for x in ra] != [y.size for y in rb] for ra, rb in zip(a, b)):
            continue
        diffs = [[x - y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]
        low, high, over = two_level_ci(diffs)
        out[f"lift_{control}"] = float(np.mean([np.mean([d.mean() for d in run]) for run in diffs]))
        out[f"lift_{control}_ci_low"], out[f"lift_{control}_ci_high"] = low, high
        out["lift_ci_over"], out["lift_n"] = over, max(out["lift_n"], len(diffs))
    return out


def _details(summaries: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{settings hash: training settings}`` over the summaries (``_settings``, set by :func:`collect`)."""
    out: dict[str, dict[str, Any]] = {}
    for s in summaries:
        out.update(s.get("_settings") or {})
    return out


def _label_settings(rows: list[dict[str, Any]], details: dict[str, dict[str, Any]]) -> None:
    """Runs of one method with different training settings are never pooled (their rows differ in
    ``settings``); where rows of one mix, method, model, extractor and protocol have more than one,
    each such row's ``method`` gets `` · `` and the settings that differ between those rows
    (``casebank · experience.rerank=utility``), from ``details`` (``{hash: training settings}``).
    Where a hash's settings are not known (no config beside its summary), more than
    :data:`~crl_bench.results.summary.LABEL_MAX_KEYS` keys differ, or two labels would read the same,
    every such row gets
    `` · settings <hash prefix>`` instead (``unknown`` for runs whose summary has no settings hash)."""
    def key(row: dict[str, Any]) -> tuple:
        return row["mix"], row["method"], row["model"], row["extractor"], row.get("protocol_json", row["protocol"])

    seen: dict[tuple, set[str]] = {}
    for row in rows:
        seen.setdefault(key(row), set()).add(row["settings"])
    named = {k: settings_labels(v, details) for k, v in seen.items() if len(v) > 1}
    for row in rows:
        k = key(row)
        if k not in named:
            continue
        labels = named[k]
        if labels is not None:
            row["method"] += f" · {labels[row['settings']]}"
        else:
            row["method"] += f" · settings {short_hash(row['settings']) if row['settings'] else 'unknown'}"


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
            key = (s["method"], _canon(s["model"]), s["mix"]["name"], _canon(s["mix"]["envs"]),
                   _canon(s["eval_protocol"]), r.get("settings", ""))
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
            row = {"method": s["method"], "model": _model_label(s["model"]),
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
    _label_settings(rows, _details(summaries))
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
                     f"{r['guided']:.3f}", f"{r['shuffled']:.3f}", _fmt_num(r["empty"], ".3f"),
                     f"{r['lift']:+.3f} {ci}", empty, r["ci_over"]]
            lines.append("| " + " | ".join(markdown_cell(c) for c in cells) + " |")
        lines.append("")
    return lines


# ---- writing -----------------------------------------------------------------------------------
def _fmt_stat(mean: float, std: float, n: int) -> str:
    if not n or math.isnan(mean):
        return "-"
    if n < 2 or math.isnan(std):
        return f"{mean:.3f} (n={n})"
    return f"{mean:.3f} ± {std:.3f} (n={n})"


def _fmt_num(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)



def _doc_link(out_dir: Path) -> str:
    root = Path(__file__).resolve().parents[2]
    doc = root / EVAL_DOC
    try:
        out_dir.resolve().relative_to(root)
        return Path(os.path.relpath(doc, out_dir.resolve())).as_posix()
    except ValueError:
        return EVAL_DOC


def _display_rows(part: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells of one mix's rows (the columns of the markdown table)."""
    envs = [c.split("/", 1)[1] for c in part.columns
            if c.startswith("n/") and part[c].fillna(0).astype(int).sum() > 0]
    scored = [c.split("/", 1)[1] for c in part.columns
              if c.startswith("score_mean/") and part[c].notna().any()]
    header = (["method", "model", "extractor", "eval", "protocol"] + envs + [f"mean reward: {e}" for e in scored]
              + ["overall", "95% CI", "CI over", "steps", "invalid", "train steps", "train episodes", "wall (s)",
                 "runs"])
    body = []
    notes = model_notes(part)
    for _, r in part.iterrows():
        ci = ("n/a" if math.isnan(r["overall_ci_low"])
              else f"[{r['overall_ci_low']:.3f}, {r['overall_ci_high']:.3f}]")
        body.append([r["method"], short_model(r["model"], r["model_short"], notes), r["extractor"] or "-",
                     r["eval"], r["protocol"]]
                    + [_fmt_stat(r[f"success_mean/{e}"], r[f"success_std/{e}"], int(r[f"n/{e}"])) for e in envs]
                    + [_fmt_num(r[f"score_mean/{e}"], ".3f") for e in scored]
                    + [_fmt_stat(r["overall_mean"], r["overall_std"], int(r["overall_n"])), ci,
                       r["overall_ci_over"] or "-",
                       _fmt_num(r["steps_mean"], ".1f"), _fmt_num(r["invalid_action_rate"], ".3f"),
                       _fmt_num(r["train_steps"], "g"), _fmt_num(r["train_episodes"], "g"),
                       _fmt_num(r["train_wall_s"], ".0f"),
                       r["run_ids"] + {"yes": " (verified)", "partly": " (partly verified)"}.get(r["verified"], "")])
    return header, body


def display_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard as the markdown shows it (strings: ``mean ± std (n)``, CI, ...), one frame
    with a ``mix`` column first and the env columns of every mix (empty where a mix lacks one);
    for reports (``crl_bench.results.report``)."""
    frames = []
    for mix, part in df.groupby("mix", sort=False):
        header, body = _display_rows(part)
        frames.append(pd.DataFrame([[mix] + b for b in body], columns=["mix"] + header))
    return pd.concat(frames, ignore_index=True).fillna("") if frames else pd.DataFrame(columns=["mix"])


def leaderboard_markdown(df: pd.DataFrame, doc_link: str = EVAL_DOC, lift: pd.DataFrame | None = None,
                         reported: list[dict[str, Any]] | None = None) -> str:
    """The markdown text of :func:`write_leaderboard`: a header on how the numbers are computed, then
    the headline tables (one row per method and model per protocol,
    :func:`~crl_bench.results.headline.headline_markdown`), then the details: one table per mix (its own
    env columns, one row per eval mode), then the memory lift per env (:func:`lift_markdown`) when
    ``lift`` has rows, then the rows reported by papers (:func:`~crl_bench.results.reported.reported_markdown`)."""
    lines = [
        "# crl-bench leaderboard",
        "",
        "Generated by `crl-bench leaderboard` from run and submission summaries (`summary.json`; no "
        f"timestamp, so an unchanged table gives no diff). How results are evaluated and compared: "
        f"[{EVAL_DOC}]({doc_link}).",
        "",
        "* Headline: per protocol, one row per method and model, its overall success in each eval mode "
        "and its memory lifts; short model names, the full description in a footnote and the CSV. "
        "Details: one row per method, model, extractor, mix, evaluation protocol and eval mode (`free`: no "
        "experience; `guided`: read-only retrieval from the experience bank; `shuffled`: another task's "
        "retrieval, `empty`: the knowledge block with no entry (memory controls); `initial`: the untrained "
        "actor on the same tasks before step 1, for runs with `eval.at_start`). Runs with different "
        "protocols are never pooled; `protocol` shows split, episodes per env, temperature, step limit and, "
        "where the runs recorded it, the task panel (`panel` and a hash prefix: the same tasks with the same "
        "content; full hash in the CSV). Runs of one method with different training settings (config.yaml "
        "without run id, folders, seed, evaluation, logging, alarms, backend, checkpoint cadence) are never "
        "pooled either: where that splits a method's rows, its name adds the settings that differ "
        "(`casebank · experience.rerank=utility`; `unset` for a key a config lacks) or, where more than "
        f"{LABEL_MAX_KEYS} differ or a config is missing, `settings` and a hash prefix (full hash in the "
        "CSV's `settings` column).",
        "* Per env: eval success rate, mean ± sample std (ddof=1) over runs (one per seed), n = runs "
        "that evaluated the env.",
        f"* Overall: per run, the unweighted mean of its per-env success rates (runs that evaluated every "
        f"env of the row), then mean ± std over runs. 95% CI ({CI_RESAMPLES} resamples, seed {CI_SEED}), "
        "`CI over` saying what it resamples: `seeds and tasks`, a two-level percentile bootstrap (the runs, "
        "then the tasks within each run, stratified by env) where the runs recorded per-task outcomes; "
        "`tasks (1 seed)` for one run (scipy.stats.bootstrap over its tasks); `seeds`, the percentile "
        "bootstrap of the per-run means, for n ≥ 3 runs without per-task outcomes; else n/a. The CSV has "
        "the same per env (`ci_low/<env>`, `ci_high/<env>`).",
        "* Steps and invalid-action rate: eval means; train steps, train episodes and wall time (s): "
        "per run; all averaged over runs. The CSV beside this file has every number unrounded.",
        "* A run met twice (e.g. a run folder and a submission packed from it) is counted once; "
        "different runs with the same seed are all counted (the build warns). `(verified)` after the run ids: "
        "a submission re-run and matched by `crl-bench submission verify` (results/submissions/README.md).",
        "",
    ]
    if df.empty:
        lines += ["No finished runs or submissions found.", ""] + reported_markdown(reported or [])
        return "\n".join(lines) + "\n"
    lines += headline_markdown(headline_frame(df))
    lines += ["## Details", "", "Every eval mode of every row, per mix: per env, steps, invalid actions, training "
              "totals and the runs.", ""]
    for mix, part in df.groupby("mix", sort=False):
        header, body = _display_rows(part)
        lines += [f"### {markdown_cell(mix)}", "", "| " + " | ".join(markdown_cell(h) for h in header) + " |",
                  "|" + "---|" * len(header)]
        for cells in body:
            lines.append("| " + " | ".join(markdown_cell(c) for c in cells) + " |")
        lines.append("")
        notes = model_notes(part)
        if notes:
            lines += [f"[{n}] {markdown_cell(full)}" for full, n in notes.items()] + [""]
        if (part["eval"] == "initial").any():
            lines += _per_seed_lines(mix, part)
        typed: dict[str, list[str]] = {}
        for c in part.columns:
            if c.startswith("type_success/") and part[c].notna().any():
                _, env, task_type = c.split("/", 2)
                typed.setdefault(env, []).append(task_type)
        for env, types in typed.items():
            head = ["method", "eval", "protocol"] + types
            lines += [f"#### {markdown_cell(mix)}: {markdown_cell(env)} success by task type (mean over runs)", "",
                      "| " + " | ".join(markdown_cell(h) for h in head) + " |", "|" + "---|" * len(head)]
            for _, r in part.iterrows():
                cells = [r["method"], r["eval"], r["protocol"]] + [
                    _fmt_num(r[f"type_success/{env}/{t}"], ".3f") for t in types]
                lines.append("| " + " | ".join(markdown_cell(c) for c in cells) + " |")
            lines.append("")
        sampled = [c.split("/", 1)[1] for c in part.columns if c.startswith("pass@k/") and part[c].notna().any()]
        if sampled:
            head = ["method", "eval", "protocol"] + [f"{e}: pass@1 / pass@k / pass^k" for e in sampled]
            title = f"#### {markdown_cell(mix)}: repeated samples, pass@k and pass^k at k = samples (mean over runs)"
            lines += [title, "",
                      "| " + " | ".join(markdown_cell(h) for h in head) + " |", "|" + "---|" * len(head)]
            for _, r in part[part[[f"pass@k/{e}" for e in sampled]].notna().any(axis=1)].iterrows():
                cells = [r["method"], r["eval"], r["protocol"]] + [
                    " / ".join(_fmt_num(r[c], ".3f") for c in (f"success_mean/{e}", f"pass@k/{e}", f"pass^k/{e}"))
                    for e in sampled]
                lines.append("| " + " | ".join(markdown_cell(c) for c in cells) + " |")
            lines.append("")
    if lift is not None:
        lines += lift_markdown(lift)
    lines += reported_markdown(reported or [])
    return "\n".join(lines)


def _per_seed_lines(mix: str, part: pd.DataFrame) -> list[str]:
    """A table of each row's overall success per seed (rows of one mix that has ``initial`` evals),
    so that the final eval of every seed can be read beside the same seed's step-0 eval."""
    seeds: list[str] = []
    values: list[dict[str, str]] = []
    for _, r in part.iterrows():
        cells: dict[str, str] = {}
        for item in str(r.get("per_seed") or "").split(";"):
            if "=" in item:
                seed, val = item.split("=", 1)
                cells[seed] = f"{float(val):.3f}"
                if seed not in seeds:
                    seeds.append(seed)
        values.append(cells)
    seeds.sort(key=lambda x: (len(x), x))
    head = ["method", "eval", "protocol"] + [f"seed {x}" for x in seeds]
    lines = [f"#### {markdown_cell(mix)}: overall success per seed (`initial` = the same run before training)", "",
             "| " + " | ".join(markdown_cell(h) for h in head) + " |", "|" + "---|" * len(head)]
    for (_, r), cells in zip(part.iterrows(), values):
        lines.append("| " + " | ".join(markdown_cell(c) for c in [r["method"], r["eval"], r["protocol"]]
                                       + [cells.get(x, "-") for x in seeds]) + " |")
    return lines + [""]


def write_leaderboard(df: pd.DataFrame, out_dir: str | Path, lift: pd.DataFrame | None = None,
                      reported: list[dict[str, Any]] | None = None) -> tuple[Path, Path]:
    """Write ``leaderboard.md`` (with ``reported``'s section, :mod:`crl_bench.results.reported`) and
    ``leaderboard.csv`` (measured rows only) into ``out_dir`` (created if needed), and, when ``lift``
    has rows, ``memory_lift.csv`` (:func:`lift_frame`) beside them.

    The CSVs hold every column unrounded (NaN as empty cells) and read back with ``pandas.read_csv``.

    Returns:
        ``(md_path, csv_path)``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md_path, csv_path = out / "leaderboard.md", out / "leaderboard.csv"
    files = [(md_path, leaderboard_markdown(df, _doc_link(out), lift, reported)), (csv_path, df.to_csv(index=False))]
    if lift is not None and not lift.empty:
        files.append((out / "memory_lift.csv", lift.to_csv(index=False)))
    for path, text in files:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return md_path, csv_path


def main_leaderboard(paths: Sequence[str | Path], out_dir: str | Path, stdout: TextIO | None = None,
                     stderr: TextIO | None = None) -> int:
    """``crl-bench leaderboard [DIR ...] [--out DIR]``: collect, build the table, write it, with the
    rows reported by papers in ``<DIR>/reported/`` (or a given folder named ``reported``) in a section
    of their own.

    Prints one ``warning: ...`` line per skipped folder, duplicate or invalid reported file to
    ``stderr`` and the paths written to ``stdout``.

    Returns:
        0 when the table was written, 1 when no summary was found (nothing is written then).
    """
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    warnings: list[str] = []
    summaries = collect(paths, warnings)
    df = leaderboard_frame(summaries, warnings)
    reported = [t for p in map(Path, paths) for t in load_reported(p if p.name == "reported" else p / "reported",
                                                                   warnings)]
    for w in warnings:
        print(f"warning: {w}", file=stderr)
    if not summaries:
        print(f"error: no finished runs or submissions under {', '.join(map(str, paths))}", file=stderr)
        return 1
    md, csv = write_leaderboard(df, out_dir, lift_frame(summaries), reported)
    print(f"wrote {md} and {csv}: {len(df)} rows from {len(summaries)} summaries", file=stdout)
    return 0
