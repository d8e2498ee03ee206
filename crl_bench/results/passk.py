"""pass@k and pass^k from repeated samples of one task (``eval.samples``; docs/evaluation.md "Repeated
samples").

With ``n`` independent episodes of a task of which ``c`` succeeded:

* pass@k, the chance that at least one of k episodes drawn without replacement from the n succeeds:
  ``1 - C(n - c, k) / C(n, k)``, the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374,
  section 2.1, equation 1);
* pass^k, the chance that all k drawn succeed: ``C(c, k) / C(n, k)``, the estimator of tau-bench
  (Yao et al. 2024, arXiv 2406.12045, section 4).

Both are averaged over tasks. pass@1 = pass^1 = c / n.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one task with ``c`` successes in ``n`` samples. Raises ``ValueError`` unless
    ``0 <= c <= n`` and ``1 <= k <= n``."""
    _check(n, c, k)
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k of one task with ``c`` successes in ``n`` samples (same errors as :func:`pass_at_k`)."""
    _check(n, c, k)
    return comb(c, k) / comb(n, k)


def _check(n: int, c: int, k: int) -> None:
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")


def pass_curves(n: int, successes: Sequence[int]) -> tuple[dict[str, float], dict[str, float]]:
    """pass@k and pass^k for k = 1..n, each the mean over tasks, from each task's success count in
    ``successes`` (one count per task, ``n`` samples each). Keys are ``str(k)`` (JSON object keys).
    Raises ``ValueError`` for no task or a count outside ``0..n``."""
    if not successes:
        raise ValueError("pass@k needs at least one task")
    at = {str(k): sum(pass_at_k(n, c, k) for c in successes) / len(successes) for k in range(1, n + 1)}
    hat = {str(k): sum(pass_hat_k(n, c, k) for c in successes) / len(successes) for k in range(1, n + 1)}
    return at, hat
