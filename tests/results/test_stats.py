"""crl_bench.results.stats: the intervals are deterministic, paired over tasks, and NaN below three values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crl_bench.results.stats import (
    CI_MIN_VALUES,
    bootstrap_ci,
    mean_ci,
    mean_or_nan,
    std_or_nan,
    task_differences,
)


def test_means_and_stds_of_few_values_are_nan():
    assert math.isnan(mean_or_nan([])) and mean_or_nan([0.25, 0.75]) == 0.5
    assert math.isnan(std_or_nan([0.5])) and std_or_nan([0.25, 0.5, 0.75]) == pytest.approx(0.25)


def test_mean_ci_is_the_bootstrap_from_three_values():
    assert CI_MIN_VALUES == 3
    assert all(math.isnan(x) for x in mean_ci([0.1, 0.9]))
    assert mean_ci([0.1, 0.4, 0.9]) == bootstrap_ci([0.1, 0.4, 0.9])
    assert mean_ci(np.asarray([0.1, 0.4, 0.9])) == bootstrap_ci([0.1, 0.4, 0.9])


def test_an_interval_does_not_depend_on_what_was_drawn_before():
    first = bootstrap_ci([0.1, 0.4, 0.2, 0.9])
    np.random.seed(123)
    np.random.default_rng(5).random(1000)
    bootstrap_ci([0.3, 0.2, 0.8])
    assert bootstrap_ci([0.1, 0.4, 0.2, 0.9]) == first


def test_task_differences_average_each_task_over_runs():
    pairs = [(np.array([1.0, 0.0, 1.0, 1.0]), np.array([0.0, 0.0, 1.0, 0.0])),
             (np.array([1.0, 1.0, 0.0, 1.0]), np.array([1.0, 0.0, 0.0, 0.0]))]
    diff = task_differences(pairs)
    assert diff.shape == (4,) and diff.tolist() == [0.5, 0.5, 0.0, 1.0]
    # one run: exactly its own per-task differences
    a, b = pairs[0]
    assert task_differences([(a, b)]).tolist() == (a - b).tolist()
