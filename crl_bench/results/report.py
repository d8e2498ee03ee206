"""HTML report over run folders: learning curves, experience-method diagnostics, the banks' top entries.

``make_report(paths, out_dir)`` finds every run folder under ``paths`` (a run folder, a sweep folder
or any folder above them), reads each run's ``config.yaml``, ``metrics.jsonl``, ``eval.json`` and,
for the experience methods, ``experience.sqlite``, and writes into ``out_dir``:

=========================  ==========================================================================
``success_per_env.png``    train success rate per env vs step (one panel per env, one line per
                           method; final eval success drawn as markers at the last step)
``guided_vs_free.png``     guided vs free train success vs step (experience methods)
``extractor_reward.png``   mean extractor reward vs step (steps where the extractor trained)
``bank.png``               bank size vs step and the cumulative applied operation counts per kind
``invalid_actions.png``    invalid-action rate vs step per method
``entropy.png``            the entropy of the actor's reply choice (``reply_entropy``) vs step per
                           method: a policy collapsing to one reply per state falls towards 0
``lesson_follow.png``      ``lesson_follow`` (right, wrong and no lesson) vs step per method
``report.html``            one self-contained page: the runs, their learning alarms (the ``alerts``
                           of metrics.jsonl), the plots (embedded as base64 data URIs), the
                           leaderboard table if given, each bank's 10 most used entries
=========================  ==========================================================================

Runs are grouped by method; the seeds of a method are pooled: the line is the mean over seeds at
each step, the shaded band spans the minimum to the maximum over seeds (drawn where at least two
seeds logged that step). A plot whose data no run has (e.g. the bank plots for GRPO-only runs) is
not written and the page says so.

Each bank is opened with :meth:`~crl_bench.experience.bank.ExperienceBank.open_readonly`: read-only
(its bytes, journal mode and files are left as they were; a SQLite file that is not a crl-bench bank
is reported on the page, never turned into one) with a hash embedder of the stored dimension, so the
report never loads a sentence-transformers model. Text from the banks, configs and summaries reaches
the page with its control characters escaped (:func:`crl_bench.safe_io.printable`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from crl_bench.config import CONFIG_MAX_ALIASES
from crl_bench.results.alarms import run_alerts
from crl_bench.results.interval_plots import draw_one
from crl_bench.results.panel import content_hash, short_hash
from crl_bench.results.report_html import _CSS, TOP_ENTRIES, _alerts_html, _bank_html, _data_uri, _e, _runs_table
from crl_bench.results.report_html import read_bank as read_bank
from crl_bench.results.run_folder import is_run_folder, iter_metrics
from crl_bench.results.summary import pooled_settings, settings_labels, training_settings
from crl_bench.safe_io import load_json, load_yaml, printable

PLOT_FILES = {
    "success": "success_per_env.png",
    "guided_free": "guided_vs_free.png",
    "extractor": "extractor_reward.png",
    "bank": "bank.png",
    "invalid": "invalid_actions.png",
    "entropy": "entropy.png",
    "lesson_follow": "lesson_follow.png",
}
"""File name of each plot ``make_report`` writes (key: plot)."""

REPORT_FILE = "report.html"
OP_KIND_ORDER = ("ADD", "UPDATE", "MERGE", "UPVOTE", "DOWNVOTE", "NONE")
_SPECIAL_SUCCESS = ("guided", "free")
_METHOD_COLOURS = {"grpo": "#1f77b4", "static": "#ff7f0e", "complementary": "#2ca02c", "casebank": "#9467bd",
                    "expel": "#393b79", "reflexion": "#637939"}
_OTHER_COLOURS = ("#d62728", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
_BAND_NOTE = ("Line: mean over the seeds of a method; shaded band: minimum to maximum over seeds "
              "(where at least two seeds logged that step); n = number of seeds.")


# ------------------------------------------------------------------------------------------ runs
@dataclass
class RunData:
    """What the report reads from one run folder.

    Attributes:
        path: the run folder.
        run_id: ``config.yaml``'s ``run_id`` (the folder name if absent).
        method: ``grpo`` | ``static`` | ``complementary`` | ``casebank`` (or any other method name in the config).
        seed: ``train.seed`` (None if absent).
        mix: ``rollout.mix`` as written in the config ('' if absent).
        model: ``model.name`` ('' if absent).
        steps_configured: ``train.steps`` (None if absent).
        envs: env ids of the run, in mixture order.
        train: training rows of ``metrics.jsonl`` (rows without an ``eval`` key), one per step,
            sorted by step (a later row for the same step replaces an earlier one).
        evals: periodic evaluation rows ``{"step": int, "free": EVAL, "guided": EVAL | None}``.
        final_eval: ``eval.json`` normalised to ``{"step", "protocol", "free", "guided"}`` (old-format
            files, one flat EVAL, become ``free``), or None when the run has no ``eval.json``.
        bank_path: ``experience.sqlite`` if the run has one, else None.
        alerts: the learning alarms the run raised (its training rows' ``alerts``, in step order;
            :mod:`crl_bench.results.alarms`).
        settings: the run's training settings as the leaderboard pools them, keys its config lacks read
            as today's defaults (:func:`crl_bench.results.summary.pooled_settings`).
        group: the curve the run belongs to: its method, or, where the report holds runs of that
            method with other training settings, the method and the settings that differ
            (``casebank · experience.rerank=utility``; set by :func:`label_groups`).
    """

    path: Path
    run_id: str
    method: str
    seed: int | None
    mix: str
    model: str
    steps_configured: int | None
    envs: list[str]
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    final_eval: dict[str, Any] | None = None
    bank_path: Path | None = None
    alerts: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    group: str = ""

    @property
    def last_step(self) -> int:
        """Largest training step logged (0 when none)."""
        return int(self.train[-1]["step"]) if self.train else 0


def find_runs(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Run folders (:func:`~crl_bench.results.run_folder.is_run_folder`) at or under ``paths``.

    Args:
        paths: one path or several; each is a run folder, a sweep folder (``sweep.yaml`` +
            ``runs/``) or any folder, searched recursively (a run folder is not searched further).

    Returns:
        The run folders, each once, in the order of ``paths`` and then sorted by path.

    Raises:
        FileNotFoundError: a path does not exist.
        NotADirectoryError: a path is a file.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    seen: set[Path] = set()
    for raw in paths:
        root = Path(raw)
        if not root.exists():
            raise FileNotFoundError(f"report: {str(root)!r} does not exist")
        if not root.is_dir():
            raise NotADirectoryError(f"report: {str(root)!r} is not a folder (give a run or sweep folder)")
        found: list[Path] = []
        if is_run_folder(root):
            found.append(root)
        else:
            for dirpath, dirnames, _ in os.walk(root):
                here = Path(dirpath)
                if here != root and is_run_folder(here):
                    found.append(here)
                    dirnames.clear()
                    continue
                dirnames.sort()
            found.sort()
        for p in found:
            key = p.resolve()
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


def _normalise_eval(ev: Any, where: str) -> dict[str, Any]:
    """``{"free": EVAL, "guided": EVAL | None, ["shuffled": EVAL, "empty": EVAL], ...}`` from the new
    format or an old flat EVAL, told apart as :func:`crl_bench.results.summary.build_summary` does: a
    file with ``free`` or ``protocol`` is the new format; an old flat EVAL is the ``guided`` block when
    its ``guided`` flag is true, else the ``free`` one."""
    if not isinstance(ev, dict):
        raise ValueError(f"{where}: an evaluation must be a JSON object, got {type(ev).__name__}")
    if "free" in ev or "protocol" in ev:
        free, guided = ev.get("free"), ev.get("guided")
    elif ev.get("guided") is True:
        free, guided = None, ev
    else:
        free, guided = ev, None
    controls = {m: ev.get(m) for m in ("shuffled", "empty") if ev.get(m) is not None}
    for name, part in (("free", free), ("guided", guided), *controls.items()):
        if part is not None and not isinstance(part, dict):
            raise ValueError(f"{where}: '{name}' must be a JSON object, got {type(part).__name__}")
    return {"step": ev.get("step"), "protocol": ev.get("protocol") or {}, "free": free, "guided": guided,
            **controls}


def _read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for n, row in iter_metrics(path):             # keys renamed since the run was written: current names
        where = f"{path}:{n}"
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)) or step != int(step):
            raise ValueError(f"{where}: missing or non-integer 'step' ({step!r})")
        step = int(step)
        if "eval" in row:
            ev = _normalise_eval(row["eval"], where)
            ev["step"] = step
            evals[step] = ev
        else:
            train[step] = row
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def _mixture_envs(mix: str) -> list[str]:
    if not mix:
        return []
    try:
        from crl_bench.mixtures import resolve_mixture

        return list(resolve_mixture(mix).envs)
    except Exception:  # noqa: BLE001 - e.g. a mixture file that has moved; fall back to the metrics
        return []


def _run_envs(mix: str, train: list[dict], final_eval: dict | None) -> list[str]:
    logged: list[str] = []
    for row in train:
        for k in row:
            if k.startswith("success_rate/"):
                env = k[len("success_rate/"):]
                if env and env not in _SPECIAL_SUCCESS and "/" not in env and env not in logged:
                    logged.append(env)
    envs = _mixture_envs(mix)
    if envs:
        return envs + [e for e in sorted(logged) if e not in envs]
    if logged:
        return sorted(logged)
    per_env = ((final_eval or {}).get("free") or {}).get("per_env") or {}
    if isinstance(per_env, dict) and per_env:
        return sorted(per_env)
    return [mix or "all"]


def load_run(path: str | os.PathLike) -> RunData:
    """Read one run folder.

    Raises:
        FileNotFoundError: no ``config.yaml`` or no ``metrics.jsonl`` in ``path``.
        ValueError: ``config.yaml`` is not a mapping or names no ``method``; a ``metrics.jsonl`` line
            is not a JSON object with an integer ``step``; ``eval.json`` is not valid JSON / an object;
            ``config.yaml`` or ``eval.json`` is refused as untrusted input
            (:class:`crl_bench.safe_io.InputFileError`: a symbolic link out of the folder, too large,
            not UTF-8, too deep, not finite numbers).
    """
    p = Path(path)
    if not (p / "config.yaml").is_file():
        raise FileNotFoundError(f"{p} is not a run folder: it has no config.yaml")
    if not (p / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{p} has no metrics.jsonl (the run stopped before its first step, or the "
                                "file was removed): nothing to plot")
    cfg = load_yaml(p / "config.yaml", max_aliases=CONFIG_MAX_ALIASES)     # InputFileError is a ValueError
    if not isinstance(cfg, dict):
        raise ValueError(f"{p / 'config.yaml'}: must be a mapping, got {type(cfg).__name__}")
    method = cfg.get("method")
    if not isinstance(method, str) or not method:
        raise ValueError(f"{p / 'config.yaml'}: no 'method' (grpo, static, complementary, casebank, ...)")
    rollout, train_cfg, model = (cfg.get(k) if isinstance(cfg.get(k), dict) else {}
                                 for k in ("rollout", "train", "model"))
    train, evals = _read_metrics(p / "metrics.jsonl")
    final_eval = None
    if (p / "eval.json").is_file():
        raw = load_json(p / "eval.json")
        final_eval = _normalise_eval(raw, str(p / "eval.json"))
    mix = str(rollout.get("mix") or "")
    seed = train_cfg.get("seed")
    steps = train_cfg.get("steps")
    bank = p / "experience.sqlite"
    return RunData(
        path=p, run_id=str(cfg.get("run_id") or p.name), method=method,
        seed=int(seed) if isinstance(seed, (int, float)) and not isinstance(seed, bool) else None,
        mix=mix, model=str(model.get("name") or ""),
        steps_configured=int(steps) if isinstance(steps, (int, float)) and not isinstance(steps, bool) else None,
        envs=_run_envs(mix, train, final_eval), train=train, evals=evals, final_eval=final_eval,
        bank_path=bank if bank.is_file() else None, alerts=run_alerts(train),
        settings=pooled_settings(training_settings(cfg)), group=method)


def label_groups(runs: Sequence[RunData]) -> None:
    """Keep runs of one method with different training settings on separate curves, as the
    leaderboard keeps them in separate rows: where a method's runs have more than one settings
    hash, each run's ``group`` becomes the method and the settings that differ
    (:func:`crl_bench.results.summary.settings_labels`), or ``settings`` and a hash prefix where
    those cannot name them."""
    by_method: dict[str, dict[str, dict[str, Any]]] = {}
    hashes: dict[int, str] = {}
    for r in runs:
        try:
            h = content_hash(r.settings)
        except (TypeError, ValueError):         # a config value JSON cannot hold: its own curve
            h = f"unhashable {r.run_id}"
        hashes[id(r)] = h
        by_method.setdefault(r.method, {})[h] = r.settings
    for r in runs:
        details = by_method[r.method]
        if len(details) < 2:
            r.group = r.method
            continue
        labels = settings_labels(set(details), details)
        h = hashes[id(r)]
        name = labels[h] if labels else "settings unknown" if h.startswith("unhashable") else \
            f"settings {short_hash(h)}"
        r.group = f"{r.method} · {name}"


# ------------------------------------------------------------------------------------------ series
def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _series(run: RunData, get: Callable[[dict], Any]) -> dict[int, float]:
    """``{step: value}`` over the run's training rows where ``get(row)`` is a finite number."""
    out = {}
    for row in run.train:
        v = _num(get(row))
        if v is not None:
            out[int(row["step"])] = v
    return out


def _env_getter(run: RunData, env: str) -> Callable[[dict], Any]:
    if len(run.envs) == 1:
        return lambda row: row.get("success_rate") if env == run.envs[0] else None
    return lambda row: row.get(f"success_rate/{env}")


def _op_kind_getter(kind: str) -> Callable[[dict], Any]:
    def get(row: dict) -> Any:
        kinds = row.get("op_kinds")
        return kinds.get(kind, 0) if isinstance(kinds, dict) else None
    return get


@dataclass
class _Agg:
    steps: np.ndarray   # (S,) int
    mean: np.ndarray    # (S,)
    lo: np.ndarray      # (S,) min over seeds
    hi: np.ndarray      # (S,) max over seeds
    n: np.ndarray       # (S,) seeds with a value at that step


def _aggregate(per_run: Sequence[dict[int, float]]) -> _Agg | None:
    """Mean / min / max over runs at every step any run logged; None when no run has a value."""
    steps = sorted(set().union(*per_run)) if per_run else []
    if not steps:
        return None
    vals = [[d[s] for d in per_run if s in d] for s in steps]
    return _Agg(np.asarray(steps), np.asarray([np.mean(v) for v in vals]), np.asarray([min(v) for v in vals]),
                np.asarray([max(v) for v in vals]), np.asarray([len(v) for v in vals]))


def _group(runs: Sequence[RunData]) -> dict[str, list[RunData]]:
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        groups.setdefault(r.group or r.method, []).append(r)
    return groups


def _colours(methods: Iterable[str]) -> dict[str, str]:
    out, k = {}, 0
    for m in methods:
        if m in _METHOD_COLOURS:
            out[m] = _METHOD_COLOURS[m]
        else:
            out[m] = _OTHER_COLOURS[k % len(_OTHER_COLOURS)]
            k += 1
    return out


def _draw(ax, agg: _Agg, colour: str, label: str, linestyle: str = "-", marker: str | None = None) -> None:
    if marker is None and len(agg.steps) < 3:
        marker = "."                     # a lone step (an env a mixture sampled once) is still seen
    ax.plot(agg.steps, agg.mean, color=colour, linestyle=linestyle, marker=marker, markersize=4, label=label)
    multi = agg.n >= 2
    if multi.any():
        ax.fill_between(agg.steps, np.where(multi, agg.lo, agg.mean), np.where(multi, agg.hi, agg.mean),
                        color=colour, alpha=0.18, linewidth=0, where=multi, interpolate=False)


def _eval_success(ev: dict | None, run: RunData, env: str) -> float | None:
    """Success rate of ``env`` in one EVAL dict (the overall rate for a single-env run)."""
    if not isinstance(ev, dict):
        return None
    per_env = ev.get("per_env")
    if isinstance(per_env, dict) and isinstance(per_env.get(env), dict):
        return _num(per_env[env].get("success_rate"))
    if len(run.envs) == 1:
        return _num(ev.get("success_rate"))
    return None


# ------------------------------------------------------------------------------------------ plots
def _new_figure(nrows: int, ncols: int, w: float = 4.6, h: float = 3.3):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w * ncols, h * nrows + 0.6), dpi=100, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _save(fig, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.ticker import MaxNLocator

    FigureCanvasAgg(fig)
    for ax in fig.axes:                  # training steps are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    # "tight" keeps a legend wider than a one-panel figure inside the image
    fig.savefig(path, format="png", facecolor="white", bbox_inches="tight", pad_inches=0.1)


def _legend(fig, axes, extra: Sequence = ()) -> None:
    """One legend under the panels: the labelled lines of ``axes`` (each label once), then ``extra``."""
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    for h in extra:
        handles.append(h)
        labels.append(h.get_label())
    if handles:
        ncol = max(1, min(len(labels), 2 * len(fig.axes)))
        fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=8,
                   frameon=False)


def _plot_success(runs: Sequence[RunData], path: Path) -> str | None:
    """Plot 1. Returns None when written, else the reason it was skipped."""
    from matplotlib.lines import Line2D

    groups = _group(runs)
    colours = _colours(groups)
    envs: list[str] = []
    for r in runs:
        envs += [e for e in r.envs if e not in envs]
    curves: dict[str, list[tuple[str, _Agg]]] = {}
    for env in envs:
        for m, rs in groups.items():
            agg = _aggregate([_series(r, _env_getter(r, env)) for r in rs if env in r.envs])
            if agg is not None:
                curves.setdefault(env, []).append((m, agg))
    if not curves:
        return "no run logged a per-env training success rate"
    envs = [e for e in envs if e in curves]
    ncols = min(3, len(envs))
    nrows = math.ceil(len(envs) / ncols)
    fig, axes = _new_figure(nrows, ncols)
    any_eval = {"free": False, "guided": False}
    # the step-0 evaluation (eval.at_start) is part of the x range
    first = min([int(r.train[0]["step"]) for r in runs if r.train]
                + [int(ev["step"]) for r in runs for ev in r.evals], default=0)
    last = max(r.last_step for r in runs)
    span = max(1, last - first)
    for ax, env in zip(axes, envs):
        for j, (m, agg) in enumerate(curves[env]):
            rs = [r for r in groups[m] if env in r.envs]
            _draw(ax, agg, colours[m], f"{m} (n={len(rs)})")
            periodic = _aggregate([{int(ev["step"]): v for ev in r.evals
                                    if (v := _eval_success(ev.get("free"), r, env)) is not None} for r in rs])
            if periodic is not None:
                ax.plot(periodic.steps, periodic.mean, color=colours[m], linestyle=":", marker="x",
                        markersize=5, label=f"{m} periodic eval, free")
            # eval markers of several methods at the same step are dodged sideways a little
            x = max(r.last_step for r in rs) + (j - (len(curves[env]) - 1) / 2) * 0.015 * span
            for part, marker, face in (("free", "o", colours[m]), ("guided", "^", "white")):
                vals = [v for r in rs if r.final_eval is not None
                        and (v := _eval_success(r.final_eval.get(part), r, env)) is not None]
                if vals:
                    any_eval[part] = True
                    mean = float(np.mean(vals))
                    ax.errorbar([x], [mean], yerr=[[mean - min(vals)], [max(vals) - mean]], fmt=marker,
                                color=colours[m], markerfacecolor=face, markersize=7, capsize=3, zorder=5)
        ax.set_title(env, fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel("success rate")
        ax.set_ylim(-0.03, 1.03)
        # one step range for every panel: a mixture's small steps may sample no task of an env
        ax.set_xlim(first - 0.05 * span - 0.2, last + 0.05 * span + 0.2)
        if not any(len(agg.steps) for _, agg in curves[env]):
            ax.text(0.5, 0.55, "no training episode of this env\n(the mixture did not sample it)",
                    transform=ax.transAxes, ha="center", va="center", fontsize=8, color="0.4")
        ax.grid(alpha=0.3)
    for ax in axes[len(envs):]:
        ax.set_visible(False)
    extra = []
    if any_eval["free"]:
        extra.append(Line2D([], [], color="black", marker="o", linestyle="", label="final eval, free"))
    if any_eval["guided"]:
        extra.append(Line2D([], [], color="black", marker="^", markerfacecolor="white", linestyle="",
                            label="final eval, guided"))
    _legend(fig, axes[:len(envs)], extra)
    fig.suptitle("Training success rate per environment", fontsize=11)
    _save(fig, path)
    return None


def _plot_guided_free(runs: Sequence[RunData], path: Path) -> str | None:
    """Plot 2: one panel per method that logged guided/free success."""
    panels = []
    for m, rs in _group(runs).items():
        g = _aggregate([_series(r, lambda row: row.get("success_rate/guided")) for r in rs])
        f = _aggregate([_series(r, lambda row: row.get("success_rate/free")) for r in rs])
        if g is not None or f is not None:
            n = sum(1 for r in rs if any("success_rate/guided" in row or "success_rate/free" in row
                                         for row in r.train))
            panels.append((m, n, g, f))
    if not panels:
        return "no run logged guided / free success (only the methods with an experience bank do)"
    fig, axes = _new_figure(1, len(panels))
    for ax, (m, n, g, f) in zip(axes, panels):
        if g is not None:
            _draw(ax, g, "#2ca02c", "guided (with experience)")
        if f is not None:
            _draw(ax, f, "#7f7f7f", "free (no experience)", linestyle="--")
        ax.set_title(f"{m} (n={n})", fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel("train success rate")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    fig.suptitle("Guided vs free subgroup success", fontsize=11)
    _save(fig, path)
    return None


def _plot_per_method(runs: Sequence[RunData], path: Path, key: str, ylabel: str, title: str,
                     marker: str | None, missing: str) -> str | None:
    """One axes, one line (mean + band) per method, of the numeric metric ``key``."""
    groups = _group(runs)
    colours = _colours(groups)
    curves = []
    for m, rs in groups.items():
        per_run = [_series(r, lambda row: row.get(key)) for r in rs]
        agg = _aggregate(per_run)
        if agg is not None:
            curves.append((m, sum(1 for d in per_run if d), agg))
    if not curves:
        return missing
    fig, axes = _new_figure(1, 1, w=7.0, h=3.6)
    ax = axes[0]
    for m, n, agg in curves:
        _draw(ax, agg, colours[m], f"{m} (n={n})", marker=marker)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    _legend(fig, axes)
    fig.suptitle(title, fontsize=11)
    _save(fig, path)
    return None


def _plot_lesson_follow(runs: Sequence[RunData], path: Path) -> str | None:
    """Per method: ``lesson_follow`` (solid), ``lesson_follow_wrong`` (dotted) and
    ``lesson_follow_none`` (dashed) vs step, and chance (1/8)."""
    groups = _group(runs)
    colours = _colours(groups)
    curves = []
    for m, rs in groups.items():
        for key, style in (("lesson_follow", "-"), ("lesson_follow_wrong", ":"), ("lesson_follow_none", "--")):
            per_run = [_series(r, lambda row, k=key: row.get(k)) for r in rs]
            agg = _aggregate(per_run)
            if agg is not None:
                curves.append((m, key, style, sum(1 for d in per_run if d), agg))
    if not curves:
        return "no run logged lesson_follow (eval.lesson_follow: 0)"
    fig, axes = _new_figure(1, 1, w=7.0, h=3.6)
    ax = axes[0]
    for m, key, style, n, agg in curves:
        label = {"lesson_follow": "right lesson", "lesson_follow_wrong": "wrong lesson",
                 "lesson_follow_none": "no lesson"}[key]
        _draw(ax, agg, colours[m], f"{m}: {label} (n={n})", linestyle=style)
    ax.axhline(1 / 8, color="grey", linewidth=0.8, linestyle="-.", label="chance (1/8)")
    ax.set_xlabel("training step")
    ax.set_ylabel("P(named action)")
    ax.grid(alpha=0.3)
    _legend(fig, axes)
    fig.suptitle("Does the actor follow a lesson? (diag-vault probes)", fontsize=11)
    _save(fig, path)
    return None


def _plot_bank(runs: Sequence[RunData], path: Path) -> str | None:
    """Plot 4: bank size per method; cumulative applied operations per kind (colour) and method (style).

    An operation kind no run of a method applied (zero at every step) gets no line: a flat line at 0
    says nothing and, over many methods, its legend entries crowd out the plot. One legend under both
    panels, as in the other figures."""
    groups = _group(runs)
    colours = _colours(groups)
    sizes, ops = [], []
    for m, rs in groups.items():
        per_run = [_series(r, lambda row: row.get("bank_size")) for r in rs]
        agg = _aggregate(per_run)
        if agg is not None:
            sizes.append((m, sum(1 for d in per_run if d), agg))
        for kind in OP_KIND_ORDER:
            k_agg = _aggregate([_series(r, _op_kind_getter(kind)) for r in rs])
            if k_agg is not None and k_agg.hi.max() > 0:
                ops.append((m, kind, k_agg))
    if not sizes and not ops:
        return "no run logged bank_size or op_kinds (only the methods with an experience bank do)"
    fig, axes = _new_figure(1, 2)
    ax = axes[0]
    for m, n, agg in sizes:
        _draw(ax, agg, colours[m], f"{m} (n={n})")
    ax.set_title("bank size (entries)", fontsize=10)
    ax.set_xlabel("training step")
    ax.set_ylabel("entries")
    ax.grid(alpha=0.3)
    ax = axes[1]
    kind_colours = {"ADD": "#2ca02c", "UPDATE": "#1f77b4", "MERGE": "#9467bd", "UPVOTE": "#ff7f0e",
                    "DOWNVOTE": "#d62728", "NONE": "#7f7f7f"}
    styles = ("-", "--", ":", "-.")
    methods = list(dict.fromkeys(m for m, _, _ in ops))
    for m, kind, agg in ops:
        style = styles[methods.index(m) % len(styles)]
        label = kind if len(methods) == 1 else f"{kind} ({m})"
        _draw(ax, agg, kind_colours[kind], label, linestyle=style)
    ax.set_title("applied operations, cumulative" + (f" ({methods[0]})" if len(methods) == 1 else ""),
                 fontsize=10)
    ax.set_xlabel("training step")
    ax.set_ylabel("operations")
    ax.grid(alpha=0.3)
    _legend(fig, axes)
    fig.suptitle("Experience bank", fontsize=11)
    _save(fig, path)
    return None


_CAPTIONS = {
    "success": ("Training success rate per environment (episodes of the step's rollout; for the experience "
                "methods both subgroups) vs training step, one panel per environment, one line per method. "
                "Markers at each method's last step: final evaluation success (eval.json) — filled circle: "
                "without experience (free); open triangle: with retrieved experience (guided, experience "
                "methods only); error bars span min–max over seeds. Dotted lines with crosses, where present: "
                "the periodic evaluations (eval.every, and the step-0 evaluation of eval.at_start) without "
                "experience, mean over seeds. "),
    "guided_free": ("Training success of the experience-guided and the experience-free subgroups of each "
                    "group vs training step, one panel per experience method. "),
    "extractor": ("Mean extractor reward (extractor_reward_mean) on the steps where the extractor was "
                  "updated, per method. "),
    "bank": ("Left: experience bank size (entries) vs step. Right: cumulative count of applied operations "
             "by kind (ADD / UPDATE / MERGE / UPVOTE / DOWNVOTE / NONE; colour: kind, line style: method). "),
    "invalid": "Invalid-action rate (invalid actions / actions) of the training rollouts vs step, per method. ",
    "entropy": ("Entropy of the actor's sampled reply choice (reply_entropy, nats: per turn the summed "
                "entropies of the distributions its tokens were drawn from, constrained decoding's mask "
                "applied; with a closed action set its mean estimates the action choice's entropy, at most "
                "ln(number of actions)) vs step, per method. A "
                "policy collapsing to one action per state falls towards 0. "),
    "lesson_follow": ("Lesson following (docs/diagnostics.md): the probability that the actor takes the symbol "
                      "a shown lesson names on fixed diag-vault probe states, measured before each step's "
                      "rollout; solid: the lesson names the right symbol, dotted: a wrong one, dashed: the "
                      "right symbol with no lesson shown. Above the dashed line and chance: the actor acts on "
                      "what it is shown. "),
}


def make_report(paths: str | os.PathLike | Iterable[str | os.PathLike], out_dir: str | os.PathLike,
                table: Any | None = None, title: str | None = None,
                figures: Sequence[tuple[str, str]] = ()) -> Path:
    """Write the plots (PNG) and a self-contained ``report.html`` for the runs under ``paths``.

    Each plot is drawn on its own with mathtext off (:func:`crl_bench.results.interval_plots.draw_one`):
    names are drawn as written, and a plot that fails is named in the page with its error while the
    others are drawn.

    Args:
        paths: run folders, sweep folders or folders above them (see :func:`find_runs`).
        out_dir: output folder (created if missing); existing files of the same names are replaced.
        table: optional leaderboard (``pandas.DataFrame``), embedded with ``DataFrame.to_html``
            (escaped).
        title: page title (default ``"crl-bench report"``).
        figures: ``(PNG file name in out_dir, caption)`` pairs shown under "Intervals" (the charts of
            :func:`crl_bench.results.interval_plots.draw_interval_charts`).

    Returns:
        The path of ``report.html`` in ``out_dir``.

    Raises:
        FileNotFoundError / NotADirectoryError: a path is missing or a file (see :func:`find_runs`).
        ValueError: no run folder under ``paths``, or a run folder's files are malformed
            (see :func:`load_run`).
        TypeError: ``table`` is not a ``pandas.DataFrame``.
    """
    import matplotlib

    matplotlib.use("Agg")
    if table is not None:
        import pandas as pd

        if not isinstance(table, pd.DataFrame):
            raise TypeError(f"table must be a pandas.DataFrame, got {type(table).__name__}")
    run_dirs = find_runs(paths)
    if not run_dirs:
        shown = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
        raise ValueError(f"report: no run folder (config.yaml with metrics.jsonl, eval.json or versions.json) "
                         f"under {', '.join(shown)}")
    runs = [load_run(p) for p in run_dirs]
    label_groups(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = title or "crl-bench report"

    plots: dict[str, str | None] = {}
    jobs = {
        "success": lambda p: _plot_success(runs, p),
        "guided_free": lambda p: _plot_guided_free(runs, p),
        "extractor": lambda p: _plot_per_method(
            runs, p, "extractor_reward_mean", "mean extractor reward", "Extractor reward", "o",
            "no run logged extractor_reward_mean (the extractor trains only in complementary runs, once "
            "extractor.batch_size credited extractions are waiting)"),
        "bank": lambda p: _plot_bank(runs, p),
        "invalid": lambda p: _plot_per_method(
            runs, p, "invalid_action_rate", "invalid-action rate", "Invalid-action rate", None,
            "no run logged invalid_action_rate"),
        "entropy": lambda p: _plot_per_method(
            runs, p, "reply_entropy", "entropy of the reply choice (nats)",
            "Actor entropy (reply choice, sampled)", None,
            "no run logged reply_entropy (the transformers engine reports it; vLLM does not)"),
        "lesson_follow": lambda p: _plot_lesson_follow(runs, p),
    }
    for key, job in jobs.items():
        target = out / PLOT_FILES[key]
        if target.exists():
            target.unlink()
        plots[key] = draw_one(job, target)

    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>",
             f"<style>{_CSS}</style></head><body>", f"<h1>{_e(title)}</h1>",
             f"<p class='meta'>Generated {_e(time.strftime('%Y-%m-%d %H:%M:%S'))} from {len(runs)} run(s), "
             f"methods: {_e(', '.join(_group(runs)))}.</p>",
             "<h2>Runs</h2>", _runs_table(runs),
             "<h2>Learning alarms</h2>", "<p class='meta'>Warnings the trainer raised that a run stopped "
             "learning (docs/learning.md \"Learning alarms\").</p>", _alerts_html(runs)]
    if table is not None:
        shown = table.rename(columns=printable).apply(lambda col: col.map(
            lambda v: printable(v) if isinstance(v, str) else v))
        parts += ["<h2>Leaderboard</h2>", shown.to_html(escape=True, border=0, na_rep="", index=False)]
    if figures:
        parts.append("<h2>Intervals</h2>")
        parts += [f"<figure><img alt='{_e(name)}' src='{_data_uri(out / name)}'><figcaption><b>{_e(name)}</b>: "
                  f"{_e(caption)}</figcaption></figure>" for name, caption in figures]
    parts.append("<h2>Plots</h2>")
    for key in PLOT_FILES:
        reason = plots[key]
        if reason is None:
            parts.append(f"<figure><img alt='{_e(PLOT_FILES[key])}' src='{_data_uri(out / PLOT_FILES[key])}'>"
                         f"<figcaption><b>{_e(PLOT_FILES[key])}</b>: {_e(_CAPTIONS[key] + _BAND_NOTE)}"
                         "</figcaption></figure>")
        else:
            parts.append(f"<p class='note'>{_e(PLOT_FILES[key])} not drawn: {_e(reason)}.</p>")
    parts.append("<h2>Experience banks: most used entries</h2>")
    banked = [r for r in runs if r.bank_path is not None]
    if banked:
        parts.append(f"<p class='meta'>The {TOP_ENTRIES} entries of each bank retrieved most often "
                     "(ties: most successes of the episodes they guided).</p>")
        parts += [_bank_html(r) for r in banked]
    else:
        parts.append("<p class='note'>No run has an experience bank (experience.sqlite; only static and "
                     "complementary runs write one).</p>")
    parts.append("</body></html>")
    report = out / REPORT_FILE
    tmp = out / f".{REPORT_FILE}.tmp"
    tmp.write_text("\n".join(parts), encoding="utf-8")
    tmp.replace(report)
    return report
