"""The statistics of compared results: means and sample standard deviations over runs, the percentile
bootstrap confidence interval of a mean, and the paired comparison of two evaluation modes over the
same tasks.

Used by the leaderboard (:mod:`crl_bench.results.leaderboard`: ``overall`` CIs over runs, the memory
lift ``guided - shuffled`` over tasks) and by the scripts that read committed sweeps
(``results/sweeps/cpu-methods/banks.py``), so every interval printed anywhere is computed one way.

Every interval is deterministic: the resampling generator is ``numpy.random.default_rng(seed)``
(:data:`CI_SEED` unless a caller gives another), created afresh for each interval and used only by
that interval's ``scipy.stats.bootstrap`` call, so the same values always give the same interval,
whatever was computed before.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

__all__ = ["CI_LEVEL", "CI_MIN_VALUES", "CI_RESAMPLES", "CI_SEED", "bootstrap_ci", "mean_ci", "mean_or_nan",
           "std_or_nan", "task_differences"]

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
