"""The statistics of compared results: means and sample standard deviations over runs, the percentile
bootstrap confidence interval of a mean, the paired comparison of two evaluation modes over the
same tasks, and the seed-level intervals: a two-level bootstrap over runs (seeds) and then tasks
within each run, for one method's success or a within-run difference of two modes
(:func:`two_level_ci`) and for the difference of two methods on one task panel
(:func:`difference_ci`); with the probability of improvement, the interquartile mean and the seeds a
sweep needs (:func:`seeds_needed`).

The two-level bootstrap is used because the runs of a sweep differ by far more than their tasks'
sampling noise: a CI that resamples the tasks of runs pooled over seeds is too narrow. IQM, its
stratified bootstrap and the probability of improvement follow rliable (Agarwal et al., "Deep RL at
the Edge of the Statistical Precipice", NeurIPS 2021, arXiv:2108.13264), written here with numpy and
scipy: the ``rliable`` package resamples runs only (one level) and would add arch, statsmodels and
seaborn to the dependencies.

Used by the leaderboard (:mod:`crl_bench.results.leaderboard`), ``crl-bench compare``
(:mod:`crl_bench.results.compare`), ``crl-bench sweep`` and the scripts that read committed sweeps
(``results/sweeps/cpu-methods/banks.py``), so every interval printed anywhere is computed one way.
Every interval says what it resamples: :data:`OVER_SEEDS`, :data:`OVER_TASKS` (one run) or
:data:`OVER_RUNS` (one value per run, no per-task outcomes).

Every interval is deterministic: the resampling generator is ``numpy.random.default_rng(seed)``
(:data:`CI_SEED` unless a caller gives another), created afresh for each interval and used only by
that interval, so the same values always give the same interval, whatever was computed before.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

__all__ = ["CI_LEVEL", "CI_MIN_VALUES", "CI_RESAMPLES", "CI_SEED", "OVER_RUNS", "OVER_SEEDS", "OVER_TASKS",
           "bootstrap_ci", "difference_ci", "difference_distribution", "iqm", "iqm_ci", "mean_ci", "mean_or_nan",
           "probability_of_improvement", "probability_of_improvement_ci", "run_means", "seeds_needed", "std_or_nan",
           "task_differences", "two_level_ci", "two_level_distribution"]

#: confidence level of every interval
CI_LEVEL = 0.95
#: bootstrap resamples per interval
CI_RESAMPLES = 9999
#: seed of the resampling generator of every interval
CI_SEED = 0
#: the fewest values an interval is computed from (:func:`mean_ci` gives NaN below it)
CI_MIN_VALUES = 3


def mean_or_nan(values: Sequence[float]) -> float:
    """The mean of ``values`` (``numpy.mean``), NaN when there is none."""
    return float(np.mean(values)) if values else math.nan


def std_or_nan(values: Sequence[float]) -> float:
    """The sample standard deviation (ddof=1) of ``values``, NaN for fewer than 2."""
    return float(np.std(values, ddof=1)) if len(values) >= 2 else math.nan


def bootstrap_ci(values: Sequence[float], level: float = CI_LEVEL, seed: int = CI_SEED) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of ``values``.

    ``values`` (shape ``(n,)``) are resampled with replacement, ``n`` at a time, :data:`CI_RESAMPLES`
    times (``scipy.stats.bootstrap``, ``method="percentile"``); the interval is the ``(1 - level) / 2``
    and ``(1 + level) / 2`` quantiles of the resampled means. What one value is decides what is
    resampled: one success rate per run (seeds), or one difference per task (:func:`task_differences`).

    Args:
        values: the numbers whose mean is estimated, at least :data:`CI_MIN_VALUES`.
        level: confidence level (0.95).
        seed: seed of the resampling generator, ``numpy.random.default_rng(seed)``, made for this call
            only (same input -> same interval).

    Returns:
        ``(low, high)``; ``(v, v)`` when all values are equal.

    Raises:
        ValueError: fewer than :data:`CI_MIN_VALUES` values.
    """
    x = np.asarray(values, dtype=float)
    if x.size < CI_MIN_VALUES:
        raise ValueError(f"bootstrap_ci needs at least {CI_MIN_VALUES} values, got {x.size}")
    if np.all(x == x[0]):
        return float(x[0]), float(x[0])
    gen = np.random.default_rng(seed)
    # scipy >= 1.15 names the generator ``rng``; older versions ``random_state``
    kw = {"rng": gen} if "rng" in inspect.signature(stats.bootstrap).parameters else {"random_state": gen}
    res = stats.bootstrap((x,), np.mean, confidence_level=level, n_resamples=CI_RESAMPLES,
                          method="percentile", **kw)
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def mean_ci(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """:func:`bootstrap_ci` of ``values`` with the default level and seed, or ``(nan, nan)`` for fewer
    than :data:`CI_MIN_VALUES` values (too few to resample)."""
    return bootstrap_ci(values) if len(values) >= CI_MIN_VALUES else (math.nan, math.nan)


def task_differences(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Per task, the difference ``a - b`` of two evaluation modes averaged over runs.

    Args:
        pairs: one ``(a, b)`` per run, each an array of shape ``(T,)`` holding that run's outcome
            (success 0/1, or a score) on task ``t`` under mode ``a`` and under mode ``b``; every run
            evaluated the same ``T`` tasks in the same order (one task panel).

    Returns:
        An array of shape ``(T,)``. Its :func:`mean_ci` is the paired bootstrap over tasks: a task's
        outcomes under both modes (and over all runs) are resampled together, as one value, so what
        a task's difficulty adds to both modes cancels.
    """
    return np.mean([a - b for a, b in pairs], axis=0)


# ---- seed-level intervals: the two-level bootstrap -----------------------------------------------
#: what an interval resamples, as every table and command labels it
OVER_SEEDS = "seeds and tasks"
OVER_TASKS = "tasks (1 seed)"
OVER_RUNS = "seeds"

#: One run's outcomes: per env (stratum), an array of shape ``(T_e,)`` of per-task values (success
#: 0/1, a score, or a paired difference of two modes of that run on the same tasks).
RunTasks = Sequence[np.ndarray]


def _as_runs(runs: Sequence[RunTasks]) -> list[list[np.ndarray]]:
    out = [[np.asarray(x, dtype=float) for x in run] for run in runs]
    if not out or any(not run for run in out):
        raise ValueError("need at least one run with at least one env")
    if any(len(run) != len(out[0]) for run in out) or any(x.size == 0 for run in out for x in run):
        raise ValueError("every run needs the same envs, each with at least one task")
    return out


def run_means(runs: Sequence[RunTasks]) -> np.ndarray:
    """Per run, the unweighted mean over its envs of the mean over that env's tasks; shape ``(R,)``."""
    return np.array([np.mean([x.mean() for x in run]) for run in _as_runs(runs)])


def two_level_distribution(runs: Sequence[RunTasks], n_resamples: int = CI_RESAMPLES,
                           seed: int = CI_SEED) -> np.ndarray:
    """Bootstrap distribution of the mean over runs of :func:`run_means`, resampling at two levels.

    Each resample draws ``R`` runs with replacement (the seeds), then, independently for each drawn
    run (a run drawn twice gets two independent draws), that run's tasks with replacement within each
    env (stratified by env: ``T_e`` of ``T_e``); its value is the mean over envs of the mean over the
    drawn tasks, and the statistic the mean over the ``R`` drawn runs. With one run it is the
    task-level bootstrap of that run. This is the hierarchical bootstrap for nested data (runs, then
    tasks within a run); paired differences of two modes of one run (``guided - shuffled``) are
    passed as the per-task differences, so a task's two outcomes are resampled together.

    Args:
        runs: ``R`` runs, each a sequence of ``E`` arrays (one per env, the same envs in every run) of
            shape ``(T_e,)``.
        n_resamples: ``B``, the number of resamples.
        seed: seed of ``numpy.random.default_rng``, made for this call only (same input -> same output).

    Returns:
        An array of shape ``(B,)``.
    """
    data = _as_runs(runs)
    n_runs = len(data)
    gen = np.random.default_rng(seed)
    picks = gen.integers(0, n_runs, size=(n_resamples, n_runs)) if n_runs > 1 else np.zeros((n_resamples, 1), int)
    total = np.zeros(n_resamples)
    for slot in range(n_runs):
        slot_value = np.zeros(n_resamples)
        for r, run in enumerate(data):
            rows = np.flatnonzero(picks[:, slot] == r)
            if rows.size == 0:
                continue
            env_means = [x[gen.integers(0, x.size, size=(rows.size, x.size))].mean(axis=1) for x in run]
            slot_value[rows] = np.mean(env_means, axis=0)
        total += slot_value
    return total / n_runs


def _percentile(dist: np.ndarray, level: float) -> tuple[float, float]:
    low, high = np.quantile(dist, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def _task_level_ci(run: list[np.ndarray], level: float, seed: int) -> tuple[float, float]:
    """The percentile bootstrap of one run's mean over envs of its per-task means, tasks resampled
    within each env (``scipy.stats.bootstrap``, independent samples: one per env); one env: exactly
    :func:`bootstrap_ci` of its tasks. NaN for fewer than :data:`CI_MIN_VALUES` tasks in all."""
    if sum(x.size for x in run) < CI_MIN_VALUES:
        return math.nan, math.nan
    if len(run) == 1:
        return bootstrap_ci(run[0], level, seed)
    gen = np.random.default_rng(seed)
    kw = {"rng": gen} if "rng" in inspect.signature(stats.bootstrap).parameters else {"random_state": gen}

    def mean_of_envs(*samples: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.mean([x.mean(axis=axis) for x in samples], axis=0)

    res = stats.bootstrap(tuple(run), mean_of_envs, confidence_level=level, n_resamples=CI_RESAMPLES,
                          method="percentile", vectorized=True, **kw)
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def two_level_ci(runs: Sequence[RunTasks], level: float = CI_LEVEL, seed: int = CI_SEED) -> tuple[float, float, str]:
    """Percentile interval of :func:`two_level_distribution` and what it resamples.

    With one run it is the task-level interval of that run (:func:`_task_level_ci`, scipy's bootstrap:
    for one env exactly :func:`bootstrap_ci` of its per-task values; NaN under :data:`CI_MIN_VALUES`
    tasks).

    Returns:
        ``(low, high, over)``: ``over`` is :data:`OVER_SEEDS` for 2+ runs, :data:`OVER_TASKS` for one;
        ``(v, v, over)`` when every value is equal.
    """
    data = _as_runs(runs)
    over = OVER_SEEDS if len(data) > 1 else OVER_TASKS
    flat = np.concatenate([x for run in data for x in run])
    if np.all(flat == flat[0]):
        return float(flat[0]), float(flat[0]), over
    if len(data) == 1:
        return (*_task_level_ci(data[0], level, seed), over)
    return (*_percentile(two_level_distribution(data, seed=seed), level), over)


def difference_distribution(a: Sequence[RunTasks], b: Sequence[RunTasks], n_resamples: int = CI_RESAMPLES,
                            seed: int = CI_SEED) -> np.ndarray:
    """Bootstrap distribution of ``mean(run_means(a)) - mean(run_means(b))`` for two methods evaluated
    on one task panel (the same tasks in the same order, per env, in every run of both).

    Each resample draws the runs of ``a`` and of ``b`` with replacement, each method on its own (their
    seeds are not paired), and one set of task indices per env that every drawn run of both methods
    uses: the comparison is paired over the shared panel, so what a task's difficulty adds to both
    sides cancels. With one run on each side this is the paired bootstrap over tasks of ``a - b``.

    Args:
        a, b: runs as in :func:`two_level_distribution`; every env's array has the same length ``T_e``
            in both.
        n_resamples: ``B``.
        seed: seed of ``numpy.random.default_rng`` for this call only.

    Returns:
        An array of shape ``(B,)``.

    Raises:
        ValueError: the two sides' envs or task counts differ.
    """
    da, db = _as_runs(a), _as_runs(b)
    sizes = [x.size for x in da[0]]
    if any([x.size for x in run] != sizes for run in da + db):
        raise ValueError("the two sides were not evaluated on one task panel (tasks per env differ)")
    gen = np.random.default_rng(seed)
    tasks = [gen.integers(0, t, size=(n_resamples, t)) for t in sizes]

    def side(data: list[list[np.ndarray]]) -> np.ndarray:
        # per run, per resample: the run's value on that resample's tasks, shape (R, B)
        values = np.array([np.mean([x[idx].mean(axis=1) for x, idx in zip(run, tasks)], axis=0) for run in data])
        picks = gen.integers(0, len(data), size=(n_resamples, len(data)))
        return values[picks, np.arange(n_resamples)[:, None]].mean(axis=1)

    return side(da) - side(db)


def difference_ci(a: Sequence[RunTasks], b: Sequence[RunTasks], level: float = CI_LEVEL,
                  seed: int = CI_SEED) -> tuple[float, float, str]:
    """Percentile interval of :func:`difference_distribution` and what it resamples (:data:`OVER_SEEDS`
    when either side has 2+ runs, else :data:`OVER_TASKS`: then the paired task-level interval of the
    per-task differences, :func:`two_level_ci` of one run)."""
    da, db = _as_runs(a), _as_runs(b)
    if len(da) == len(db) == 1:
        if [x.size for x in da[0]] != [x.size for x in db[0]]:
            raise ValueError("the two sides were not evaluated on one task panel (tasks per env differ)")
        return two_level_ci([[x - y for x, y in zip(da[0], db[0])]], level, seed)
    over = OVER_SEEDS
    dist = difference_distribution(da, db, seed=seed)
    if np.all(dist == dist[0]):
        return float(dist[0]), float(dist[0]), over
    return (*_percentile(dist, level), over)


def probability_of_improvement(x: Sequence[float], y: Sequence[float]) -> float:
    """``P(X > Y)``: over every pair of a run ``x_i`` of one method and a run ``y_j`` of the other,
    the fraction where ``x_i > y_j``, ties counting one half (the Mann-Whitney U statistic over
    ``len(x) * len(y)``). The probability of improvement of rliable (Agarwal et al., "Deep RL at the
    Edge of the Statistical Precipice", NeurIPS 2021, arXiv:2108.13264) for one task; over several
    envs, average this per env.

    Args:
        x, y: per-run scores of shape ``(N,)`` and ``(K,)``.
    """
    a, b = np.asarray(x, dtype=float)[:, None], np.asarray(y, dtype=float)[None, :]
    if a.size == 0 or b.size == 0:
        return math.nan
    return float(np.mean((a > b) + 0.5 * (a == b)))


def iqm(values: Sequence[float] | np.ndarray) -> float:
    """Interquartile mean: the mean of the middle 50 % of ``values`` (``scipy.stats.trim_mean`` cutting
    25 % at each end), rliable's robust aggregate (arXiv:2108.13264, section 4)."""
    x = np.asarray(values, dtype=float).ravel()
    return float(stats.trim_mean(x, 0.25)) if x.size else math.nan


def iqm_ci(scores: np.ndarray, level: float = CI_LEVEL, seed: int = CI_SEED,
           n_resamples: int = CI_RESAMPLES) -> tuple[float, float]:
    """Stratified bootstrap CI of :func:`iqm` as in rliable: ``scores`` has shape ``(R, E)`` (runs x
    envs); each resample draws ``R`` runs with replacement separately for each env (column).
    Seeded (``numpy.random.default_rng(seed)``, this call only)."""
    s = np.asarray(scores, dtype=float)
    gen = np.random.default_rng(seed)
    picks = gen.integers(0, s.shape[0], size=(n_resamples, s.shape[0], s.shape[1]))
    resampled = s[picks, np.arange(s.shape[1])[None, None, :]].reshape(n_resamples, -1)
    return _percentile(np.asarray(stats.trim_mean(resampled, 0.25, axis=1)), level)


def seeds_needed(sd: float, effect: float, power: float = 0.8, alpha: float = 0.05, two_sample: bool = False,
                 max_seeds: int = 1000) -> int:
    """The fewest seeds with which a two-sided t-test at ``alpha`` detects ``effect`` with ``power``.

    The per-run values (one run's lift, or one run's success) are taken as normal with the between-seed
    standard deviation ``sd`` (estimated from committed runs; it includes each run's task-sampling
    noise, since each run was evaluated on a finite panel). Power is exact for that model: the
    noncentral t distribution (``scipy.stats.nct``) with ``df = n - 1`` and noncentrality
    ``effect * sqrt(n) / sd`` (one sample: a within-run difference such as the lift), or
    ``df = 2n - 2`` and ``effect / (sd * sqrt(2 / n))`` (two methods, ``n`` seeds each).

    Returns:
        ``n`` (seeds per method), at least 2: 2 when ``sd`` is 0 (every run agrees), ``max_seeds + 1``
        when even ``max_seeds`` is not enough or ``sd`` is not a finite non-negative number.
    """
    if not math.isfinite(sd) or sd < 0:
        return max_seeds + 1
    if sd == 0:
        return 2
    for n in range(2, max_seeds + 1):
        df = 2 * n - 2 if two_sample else n - 1
        nc = effect / (sd * math.sqrt(2 / n)) if two_sample else effect * math.sqrt(n) / sd
        crit = stats.t.ppf(1 - alpha / 2, df)
        if stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc) >= power:
            return n
    return max_seeds + 1


def probability_of_improvement_ci(x: np.ndarray, y: np.ndarray, level: float = CI_LEVEL, seed: int = CI_SEED,
                                  n_resamples: int = CI_RESAMPLES) -> tuple[float, float, float]:
    """:func:`probability_of_improvement` averaged over envs, with rliable's stratified bootstrap CI.

    Args:
        x, y: per-run, per-env scores of shapes ``(N, E)`` and ``(K, E)`` (the same envs).
        level, seed, n_resamples: as :func:`iqm_ci`; each resample draws ``N`` runs of ``x`` and ``K``
            of ``y`` with replacement, separately for each env.

    Returns:
        ``(point, low, high)``.
    """
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    point = float(np.mean([probability_of_improvement(a[:, e], b[:, e]) for e in range(a.shape[1])]))
    gen = np.random.default_rng(seed)
    pa = a[gen.integers(0, a.shape[0], size=(n_resamples, a.shape[0], a.shape[1])), np.arange(a.shape[1])]
    pb = b[gen.integers(0, b.shape[0], size=(n_resamples, b.shape[0], b.shape[1])), np.arange(b.shape[1])]
    # (B, N, 1, E) against (B, 1, K, E): the U statistic per resample and env, then the mean over envs
    wins = (pa[:, :, None, :] > pb[:, None, :, :]) + 0.5 * (pa[:, :, None, :] == pb[:, None, :, :])
    return (point, *_percentile(wins.mean(axis=(1, 2)).mean(axis=1), level))
