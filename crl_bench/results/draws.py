"""Sampled-worker draws: the estimator of a validation that runs a fixed number of worker episodes on
tasks drawn at random, as verl-agent's (docs/evaluation.md, "Sampled-worker draws").

verl-agent validates ALFWorld with 128 env workers, each seeded on its own and playing its next game of
the 140 valid_seen games, so a validation's 128 games are a draw with replacement (some games twice, some
never); its WebShop validation draws 128 distinct goals of 0..499 (``langfengQ/verl-agent`` f974dc5,
``agent_system/environments/env_manager.py:562``, ``env_package/alfworld/envs.py:50-51,101``,
``env_package/webshop/envs.py:151-152,182``). One draw's success rate is one reported number; the spread
of many draws is what a single reported number can move by with the same actor (aiming-lab/SkillRL#68
reports 0.84, 0.77 and 0.52 for one checkpoint under different batch sizes).

Each draw here is assembled from an evaluation that ran every task ``samples`` times: a task drawn ``m``
times contributes ``m`` of its episodes, distinct ones while it has enough (so every draw is distributed
as one validation of that many independent worker episodes); a task drawn more often than it has episodes
reuses them, and the count of reused episodes is reported.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["sampled_worker_draws"]


def sampled_worker_draws(outcomes: Sequence[Sequence[bool]], size: int, count: int, replace: bool = True,
                         rng: np.random.Generator | None = None) -> dict[str, Any]:
    """Score ``count`` draws of ``size`` worker episodes each.

    Args:
        outcomes: per eval task, the success (bool) of each of its sampled episodes; a task with none
            counts as failed wherever it is drawn.
        size: episodes per draw (verl-agent: 128).
        count: draws.
        replace: draw tasks with replacement (ALFWorld's workers) or without (WebShop's goals).
        rng: the generator of the draws (default: a fresh unseeded one).

    Returns:
        ``{"size", "count", "replace", "scores": [success rate of each draw], "mean", "sd" (sample
        standard deviation of the scores, ddof 1; 0 for one draw), "min", "max", "p05", "p95"
        (the 5th and 95th percentiles of the scores), "reused_episodes"}`` (episodes a draw used
        twice because its task was drawn more often than it has episodes, summed over the draws).

    Raises:
        ValueError: no tasks, ``size`` or ``count`` below 1, or, without replacement, ``size`` above the
            number of tasks.
    """
    n = len(outcomes)
    if n == 0 or size < 1 or count < 1:
        raise ValueError(f"draws need tasks and size, count >= 1 (tasks {n}, size {size}, count {count})")
    if not replace and size > n:
        raise ValueError(f"a draw of {size} tasks without replacement from {n} tasks")
    gen = rng if rng is not None else np.random.default_rng()
    scores, reused = [], 0
    for _ in range(count):
        won = 0
        for task, m in sorted(Counter(gen.choice(n, size=size, replace=replace).tolist()).items()):
            eps = outcomes[task]
            if not eps:
                continue
            distinct = min(m, len(eps))
            picked = list(gen.choice(len(eps), size=distinct, replace=False))
            if m > distinct:                  # more picks than episodes: the extra ones reuse episodes
                picked += list(gen.choice(len(eps), size=m - distinct, replace=True))
                reused += m - distinct
            won += sum(bool(eps[i]) for i in picked)
        scores.append(won / size)
    arr = np.asarray(scores)
    return {"size": int(size), "count": int(count), "replace": bool(replace), "scores": scores,
            "mean": float(arr.mean()), "sd": float(arr.std(ddof=1)) if count > 1 else 0.0,
            "min": float(arr.min()), "max": float(arr.max()),
            "p05": float(np.percentile(arr, 5)), "p95": float(np.percentile(arr, 95)),
            "reused_episodes": int(reused)}
