"""``crl-bench leaderboard``: one table of comparable results from run and submission summaries.

Input: folders walked recursively for ``summary.json`` files (runs and submissions,
crl_bench/results/summary.py); a finished run folder without one (``config.yaml`` + ``eval.json``) is
summarised on the fly; an unfinished run (no ``eval.json``) or an invalid summary is skipped with a
warning.

Rows: one per (method, model, extractor, mix, eval protocol, eval mode). The eval mode is ``free`` (no
experience), ``guided`` (read-only retrieval from the bank) or one of the memory controls ``shuffled``
(another task's retrieval) and ``empty`` (the knowledge block with no entry), or one of the memory forms
``raw``, ``condensed``, ``both`` (the guided retrieval shown as its episodes, as what was distilled from them,
or both), so experience methods get a row per mode they ran. A run folder's later evaluations on other splits
(``checkpoint-<split>-split.json`` of ``crl-bench eval --run``, with their protocol) are rows of their own
protocol. Runs with different protocols (split, episodes, tasks per env, temperature, top_p, top_k,
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
* a ``guided`` row's overall lifts ``guided - <control>`` for each control and form its runs have, with
  the same CI, paired per task within each run (:mod:`.lifts`, :data:`LIFT_ROW_COLUMNS`); per env
  ``guided - shuffled`` and ``guided - empty`` in :func:`lift_frame`;
* the headline (:mod:`.headline`): one row per method and model per protocol.

Duplicates: a run id met twice in one row (e.g. a run folder and a submission packed from it, or
overlapping paths) is counted once, with a warning. Two different runs with the same seed are both
counted (n counts runs; e.g. re-runs on nondeterministic kernels), with a warning.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pandas as pd

from crl_bench.results.headline import headline_frame, headline_markdown, model_notes, short_model
from crl_bench.results.labels import (
    canon,
    label_settings,
    model_label,
    panels_hash,
    protocol_label,
    run_identity,
    settings_details,
)
from crl_bench.results.lifts import LIFT_ROW_COLUMNS, lift_frame, lift_markdown, row_lifts, task_outcomes
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
    pool_hash,
    read_summary,
    validate_summary,
)
from crl_bench.safe_io import load_json, markdown_cell, printable

#: eval modes of a summary run: with experience, its memory controls and forms, without; ``initial`` is
#: the untrained actor before step 1 (``eval.at_start``).
MODES = ("guided", "shuffled", "empty", "raw", "condensed", "both", "free", "initial")
#: Folders never walked into.
SKIP_DIRS = {"checkpoint", "__pycache__", "node_modules"}
#: Columns before the per-env ones, in order.
BASE_COLUMNS = ["method", "model", "model_short", "extractor", "mix", "eval", "protocol", "n_runs", "seeds",
                "overall_mean", "overall_std", "overall_n", "overall_ci_low", "overall_ci_high", "overall_ci_over"]
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
                key = (s["method"], canon(s["model"]), s["mix"]["name"], canon(s["mix"]["envs"]),
                       canon(proto), mode, pool_hash(r))
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
            "method": s["method"], "model": model_label(s["model"]), "model_short": s["model"]["name"],
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
        outcomes = task_outcomes([v["eval"] for _, v in runs], envs)
        if outcomes is not None:
            row["overall_ci_low"], row["overall_ci_high"], row["overall_ci_over"] = two_level_ci(outcomes)
        else:
            row["overall_ci_low"], row["overall_ci_high"] = mean_ci(overall)
            row["overall_ci_over"] = "" if math.isnan(row["overall_ci_low"]) else OVER_RUNS
        for e in envs:
            vals = [float(v["eval"]["per_env"][e]["success_rate"]) for _, v in runs if e in v["eval"]["per_env"]]
            row[f"success_mean/{e}"], row[f"success_std/{e}"] = mean_or_nan(vals), std_or_nan(vals)
            row[f"n/{e}"] = len(vals)
            env_outcomes = task_outcomes([v["eval"] for _, v in runs if e in v["eval"]["per_env"]], [e])
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
        row["mix_envs"] = canon(s["mix"]["envs"])
        row["panel"] = panels_hash(s["eval_protocol"]["panels"]) if s["eval_protocol"].get("panels") else ""
        row["settings"] = g["settings"]
        row["protocol_json"] = canon(s["eval_protocol"])
        if g["mode"] == "guided":
            row.update(row_lifts(g, groups, envs))
        rows.append(row)
    label_settings(rows, settings_details(summaries))

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
        "pooled either (a setting a config lacks, written before the setting existed, reads as today's "
        "default): where that splits a method's rows, its name adds the settings that differ "
        "(`casebank · experience.rerank=utility`; `unset` for a key the code does not know) or, where more "
        f"than {LABEL_MAX_KEYS} differ or a config is missing, `settings` and a hash prefix (full hash in the "
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
