"""crl_bench.results.stats: the intervals are deterministic, paired over tasks, and NaN below three values;
the two-level bootstrap against an exact enumeration, and it widens with the seed spread."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from crl_bench.results.stats import (
    CI_MIN_VALUES,
    CI_RESAMPLES,
    OVER_SEEDS,
    OVER_TASKS,
    bootstrap_ci,
    difference_ci,
    iqm,
    iqm_ci,
    mean_ci,
    mean_or_nan,
    probability_of_improvement,
    probability_of_improvement_ci,
    run_means,
    seeds_needed,
    std_or_nan,
    task_differences,
    two_level_ci,
    two_level_distribution,
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


# ---- the two-level bootstrap ------------------------------------------------------------------------
def _exact_two_level(runs: list[np.ndarray]) -> np.ndarray:
    """Every outcome of the two-level bootstrap, equally likely: each slot picks a run, then its tasks."""
    slot_values = [np.mean(run[list(idx)]) for run in runs
                   for idx in itertools.product(range(run.size), repeat=run.size)]
    return np.array([np.mean(c) for c in itertools.product(slot_values, repeat=len(runs))])


def test_two_level_bootstrap_matches_the_hand_computed_case():
    # 2 seeds x 3 tasks: run 1 solved 1 of 3 tasks, run 2 all 3. A slot picks a run (1/2 each), then
    # 3 of its tasks: Var(slot) = E[Var | run] + Var(E | run) = (2/27 + 0)/2 + ((1/3 - 2/3)^2 + (1 - 2/3)^2)/2
    # = 4/27, and the statistic (mean of 2 slots) has variance 2/27 and mean 2/3.
    runs = [np.array([0.0, 0.0, 1.0]), np.array([1.0, 1.0, 1.0])]
    dist = two_level_distribution([[r] for r in runs])
    assert dist.shape == (CI_RESAMPLES,)
    assert dist.mean() == pytest.approx(2 / 3, abs=0.01)
    assert dist.std() == pytest.approx(math.sqrt(2 / 27), rel=0.03)
    exact = _exact_two_level(runs)                   # 2 x 27 slot outcomes, squared: 2916
    assert exact.var() == pytest.approx(2 / 27)
    for x in (1 / 3, 1 / 2, 2 / 3, 5 / 6):           # the bootstrap's CDF against the enumeration
        assert np.mean(dist <= x + 1e-9) == pytest.approx(np.mean(exact <= x + 1e-9), abs=0.015)
    low, high, over = two_level_ci([[r] for r in runs])
    assert over == OVER_SEEDS
    assert (low, high) == pytest.approx(tuple(np.quantile(exact, [0.025, 0.975])), abs=1 / 6 + 1e-9)
    assert two_level_ci([[r] for r in runs]) == (low, high, over)     # seeded: deterministic


def test_one_seed_gives_the_task_level_interval_labelled_so():
    run = np.array([0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    low, high, over = two_level_ci([[run]])
    assert over == OVER_TASKS
    assert (low, high) == bootstrap_ci(run)                       # scipy's bootstrap over the tasks
    two_envs = two_level_ci([[run, 1 - run[:5]]])
    assert two_envs[2] == OVER_TASKS and two_envs[0] < (run.mean() + (1 - run[:5]).mean()) / 2 < two_envs[1]
    assert two_level_ci([[np.ones(4)], [np.ones(4)]]) == (1.0, 1.0, OVER_SEEDS)


def test_seed_level_interval_widens_with_seed_spread_while_the_pooled_task_interval_does_not():
    gen = np.random.default_rng(1)
    noise = gen.choice([-1.0, 0.0, 0.0, 1.0], size=60)            # per-task guided - shuffled, shared
    widths, pooled = [], []
    for spread in (0.0, 0.1, 0.3):
        runs = [noise + off for off in (-spread, 0.0, spread)]
        low, high, over = two_level_ci([[r] for r in runs])
        assert over == OVER_SEEDS
        widths.append(high - low)
        p_low, p_high = mean_ci(task_differences([(r, np.zeros_like(r)) for r in runs]))
        pooled.append(p_high - p_low)
    assert widths[0] < widths[1] < widths[2]
    assert widths[2] > 2 * widths[0]
    assert pooled[0] == pooled[1] == pooled[2]                    # pooled tasks cannot see the seeds


def test_two_level_strata_are_envs_and_runs_must_share_them():
    runs = [[np.array([1.0, 1.0]), np.array([0.0, 0.0, 0.0, 0.0])], [np.array([1.0, 0.0]), np.array([0.0] * 4)]]
    assert run_means(runs).tolist() == [0.5, 0.25]
    with pytest.raises(ValueError):
        two_level_ci([[np.ones(2)], [np.ones(2), np.ones(2)]])


def test_difference_of_two_methods_is_paired_over_the_panel():
    gen = np.random.default_rng(2)
    hard = gen.integers(0, 2, size=40).astype(float)       # task difficulty shared by both methods
    a, b = [[hard], [hard]], [[hard], [hard]]
    assert difference_ci(a, b) == (0.0, 0.0, OVER_SEEDS)   # paired: identical outcomes, no width
    low, high, over = difference_ci([[np.ones(40)]], [[hard]])
    assert over == OVER_TASKS
    assert (low, high) == bootstrap_ci(1 - hard)
    with pytest.raises(ValueError):
        difference_ci([[np.ones(40)]], [[np.ones(39)]])


def test_probability_of_improvement_counts_ties_half():
    assert probability_of_improvement([1.0, 2.0], [2.0, 0.0]) == pytest.approx((0.5 + 1 + 0 + 1) / 4)
    assert probability_of_improvement([0.3], [0.3]) == 0.5
    assert math.isnan(probability_of_improvement([], [0.1]))


def test_iqm_and_its_stratified_interval():
    assert iqm([1.0, 2.0, 3.0, 4.0, 100.0, 0.0, 2.5, 3.5]) == pytest.approx(np.mean([2.0, 2.5, 3.0, 3.5]))
    scores = np.array([[0.1, 0.2], [0.3, 0.4], [0.5, 0.9], [0.2, 0.2]])
    low, high = iqm_ci(scores)
    assert low <= iqm(scores) <= high
    assert iqm_ci(scores) == (low, high)


def test_seeds_needed_from_the_t_test_power():
    # the textbook value: one-sample two-sided t-test, effect = 1 sd, 80 % power, alpha 0.05 -> n = 10
    assert seeds_needed(1.0, 1.0) == 10
    # two samples, effect = 1 sd: 17 per group (the standard table value)
    assert seeds_needed(1.0, 1.0, two_sample=True) == 17
    assert seeds_needed(0.0, 0.05) == 2
    assert seeds_needed(1.0, 1e-4, max_seeds=50) == 51
    assert seeds_needed(math.nan, 0.05, max_seeds=50) == 51


def test_probability_of_improvement_interval():
    x = np.array([[0.5, 0.2], [0.7, 0.4], [0.6, 0.3]])
    y = np.array([[0.1, 0.2], [0.2, 0.1], [0.3, 0.3]])
    point, low, high = probability_of_improvement_ci(x, y)
    # env 0: every x beats every y -> 1; env 1: pairs (0.2: =, >, <), (0.4: >, >, >), (0.3: >, >, =) -> 7/9
    assert point == pytest.approx((1 + 7 / 9) / 2)
    assert low <= point <= high <= 1.0
    assert probability_of_improvement_ci(x, y) == (point, low, high)
