"""``crl-bench bench env --env alfworld``: reset and step latency of the ALFWorld env, and episodes per
minute with N worker processes against 1.

Episodes replay each game's stored walkthrough (the solving command list in ``game.tw-pddl``), so every
episode is a real, successful game of typical length, and the same episodes are run in both arms.
With N workers, N envs go through the split-phase protocol the rollout uses (every env is sent its
reset or command before any is waited on), so the figure is what the rollout loop gets from its
workers, minus the LLM. Each arm starts its workers before the clock starts (as the trainer's pool
keeps them between steps).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from crl_bench.env_api import make_env


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def worker_start_ms(forked: int = 8, fresh: int = 2) -> dict[str, float]:
    """Median milliseconds from asking for an ALFWorld worker to its first answer, both ways side by
    side: ``fresh``, a new interpreter that imports TextWorld and ALFWorld first (what every worker
    cost before workers were forked; measured as a new launcher and its first worker), and
    ``forked``, a worker forked from this process's running launcher
    (:mod:`crl_bench.envs.alfworld.process`). Raises ``EnvWorkerError`` when ALFWorld cannot start."""
    from crl_bench.envs.alfworld import process

    process.Worker(0, 120).close()                          # the running launcher: not timed
    fresh_ms, forked_ms = [], []
    for _ in range(fresh):
        t0 = time.perf_counter()
        launcher = process._Launcher()
        try:
            _pid, sock, log = launcher.spawn(0, 120)
            with sock, log, sock.makefile("rb") as f:
                if not f.readline():
                    raise process.EnvWorkerError(f"a fresh ALFWorld worker died{process._tail(log)}")
                fresh_ms.append(1e3 * (time.perf_counter() - t0))
        finally:
            launcher.close()
    workers = []
    try:
        for _ in range(forked):
            t0 = time.perf_counter()
            workers.append(process.Worker(0, 120))
            forked_ms.append(1e3 * (time.perf_counter() - t0))
    finally:
        for w in workers:
            w.close()
    return {"fresh": statistics.median(fresh_ms), "forked": statistics.median(forked_ms)}


def _run_episodes(envs: list, tasks: list[int], walkthroughs: dict[int, list[str]]) -> tuple[float, int, int]:
    """Run ``tasks`` over ``envs`` in waves of ``len(envs)``; returns (wall seconds, successes, steps)."""
    t0 = time.perf_counter()
    wins = steps = 0
    for start in range(0, len(tasks), len(envs)):
        wave = list(zip(envs, tasks[start:start + len(envs)]))
        for env, task in wave:
            env.reset_async(options={"task": task})
        for env, _ in wave:
            env.reset_wait()
        plans = {id(env): list(walkthroughs[task]) for env, task in wave}
        live = [env for env, _ in wave]
        while live:
            for env in live:
                env.step_async(f"<answer>{plans[id(env)].pop(0)}</answer>")
            nxt = []
            for env in live:
                _, _, term, trunc, info = env.step_wait()
                steps += 1
                if term or trunc or not plans[id(env)]:
                    wins += int(info["success"])
                else:
                    nxt.append(env)
            live = nxt
    return time.perf_counter() - t0, wins, steps


def bench_alfworld(workers: int = 2, episodes: int = 8, resets: int = 6, split: str = "eval",
                   env_kwargs: dict[str, Any] | None = None, fresh_starts: int = 2) -> dict[str, Any]:
    """Measure the ALFWorld env (see the module docstring).

    Args:
        workers: N, worker processes in the parallel arm (compared with 1).
        episodes: walkthrough episodes per arm (the first ``episodes`` tasks of ``split``).
        resets: timed resets for the latency figures (distinct tasks).
        split: task split to draw from.
        env_kwargs: settings for :func:`make_env` (e.g. ``data_dir``).
        fresh_starts: fresh-interpreter worker starts timed by :func:`worker_start_ms` (8 forked ones).

    Returns:
        ``reset_ms`` / ``step_ms`` (p50, p95, mean), ``worker_start_ms`` (:func:`worker_start_ms`),
        ``worker_rss_mb`` (peak resident memory of a
        worker), ``episodes_per_min`` for 1 and N workers, ``speedup`` (N over 1), ``successes`` per
        arm (every replayed walkthrough should win), ``workers``, ``episodes``.

    Raises:
        DataMissingError: no ALFWorld data; ValueError: ``workers`` < 1 or ``episodes`` < 1.
    """
    if workers < 1 or episodes < 1:
        raise ValueError(f"need workers >= 1 and episodes >= 1, got {workers}, {episodes}")
    kw = dict(env_kwargs or {})
    kw.setdefault("max_steps", 200)
    envs = [make_env("alfworld", **kw) for _ in range(workers)]
    try:
        ids = list(envs[0].task_ids(split))
        tasks = ids[:episodes]
        walk = {t: envs[0].walkthrough(t) for t in ids[:max(episodes, resets)]}
        probe = envs[0]
        reset_ms, step_ms = [], []
        probe.reset(options={"task": ids[0]})               # starts the worker; not timed
        for t in ids[:resets]:
            t0 = time.perf_counter()
            probe.reset(options={"task": t})
            reset_ms.append(1e3 * (time.perf_counter() - t0))
            for a in walk[t]:
                t0 = time.perf_counter()
                _, _, term, trunc, _ = probe.step(f"<answer>{a}</answer>")
                step_ms.append(1e3 * (time.perf_counter() - t0))
                if term or trunc:
                    break
        for env in envs[1:]:                                  # start the other workers before timing
            env.reset(options={"task": ids[0]})
        one_s, one_wins, one_steps = _run_episodes(envs[:1], tasks, walk)
        n_s, n_wins, n_steps = _run_episodes(envs, tasks, walk)
        rss = max(env.worker_rss_mb for env in envs)
        start = worker_start_ms(fresh=fresh_starts)
        return {
            "worker_start_ms": start,
            "workers": workers, "episodes": len(tasks), "split": split,
            "reset_ms": {"p50": _pct(reset_ms, 0.5), "p95": _pct(reset_ms, 0.95),
                         "mean": statistics.fmean(reset_ms)},
            "step_ms": {"p50": _pct(step_ms, 0.5), "p95": _pct(step_ms, 0.95),
                        "mean": statistics.fmean(step_ms)},
            "worker_rss_mb": rss,
            "episodes_per_min": {"1": 60.0 * len(tasks) / one_s, str(workers): 60.0 * len(tasks) / n_s},
            "speedup": one_s / n_s,
            "successes": {"1": one_wins, str(workers): n_wins},
            "steps": {"1": one_steps, str(workers): n_steps},
        }
    finally:
        for env in envs:
            env.close()


def format_result(r: dict[str, Any]) -> str:
    """Human-readable lines of :func:`bench_alfworld`'s result."""
    n = str(r["workers"])
    return "\n".join([
        f"alfworld bench: {r['episodes']} walkthrough episodes of the {r['split']} split per arm",
        f"reset latency  p50 {r['reset_ms']['p50']:8.1f} ms   p95 {r['reset_ms']['p95']:8.1f} ms   "
        f"mean {r['reset_ms']['mean']:8.1f} ms",
        f"step latency   p50 {r['step_ms']['p50']:8.1f} ms   p95 {r['step_ms']['p95']:8.1f} ms   "
        f"mean {r['step_ms']['mean']:8.1f} ms",
        f"worker peak resident memory {r['worker_rss_mb']:.0f} MB",
        f"worker start   fresh interpreter {r['worker_start_ms']['fresh']:8.1f} ms   forked from the launcher "
        f"{r['worker_start_ms']['forked']:6.1f} ms (medians)",
        f"episodes/min   1 worker {r['episodes_per_min']['1']:7.1f}   {n} workers "
        f"{r['episodes_per_min'][n]:7.1f}   ratio {r['speedup']:.2f}x",
        f"successes      1 worker {r['successes']['1']}/{r['episodes']}   {n} workers "
        f"{r['successes'][n]}/{r['episodes']}",
    ])


def report(args: argparse.Namespace) -> str:
    """This bench as ``crl-bench bench env --env alfworld`` runs it, with the parsed ``--workers`` (N) and
    ``--episodes`` (per arm, default 8); returns :func:`format_result`'s lines."""
    return format_result(bench_alfworld(workers=args.workers, episodes=args.episodes or 8))
