"""``crl-bench bench env``: step time of each text env against its bare simulator.

For every env id two instances are made and driven side by side through the *same* seeded sequence
of random legal actions and the same sequence of task ids:

* **raw**: the simulator alone, through the env's :class:`~crl_bench.bench.raw.RawSimulator` adapter
  (:mod:`crl_bench.bench.raw`: for MiniHack the wrapped NLE gymnasium env stepped with the action index;
  for Sokoban, which has no external simulator, the game logic ``_reset_task`` / ``_apply``), no reply
  parsing, no text;
* **text**: the full protocol, ``env.step("<answer>ACTION</answer>")`` and ``env.reset(options=...)``.

Both paths start a new episode on the same condition (the game ended, or ``max_steps`` actions were
taken, i.e. the text env's truncation), so for deterministic envs they play exactly the same episodes.
Steps are timed in chunks that alternate between the two paths (and alternate which path goes first),
so machine noise (other processes, frequency changes) hits both alike. Resets are timed separately
and are not part of the step times. The timing loop is the same for both paths; its own overhead
(about 0.1 us a step) is included in both.

The project's target is ``ratio = text step time / raw step time <= 1.3``.

Envs that cannot run here are skipped when every env is benchmarked (no ids given, e.g.
``crl-bench bench env`` without ``--env``): an env whose engine, service or data is missing
(:class:`~crl_bench.env_api.EnvUnavailableError`, e.g. SWE-bench without a Docker daemon or its
container images; :class:`~crl_bench.data.DataMissingError`) and an env with an open action set
(no random legal actions to draw, e.g. SWE-bench's tool calls). They are listed after the table with
the reason; the others are measured. An env named explicitly still raises.

Envs with a bench of their own (:data:`OWN_BENCHES`: ALFWorld's worker processes, WebShop's scripted
episodes) run that bench instead, and only when named with ``--env``.

Usage::

    crl-bench bench env --steps 5000                    # every registered env but alfworld, webshop
    crl-bench bench env --env sokoban --env minihack-room --steps 2000 --json
    crl-bench bench env --env alfworld --workers 4      # ALFWorld's own bench

(``python -m crl_bench.bench env ...`` is the same.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from crl_bench.bench import alfworld, webshop
from crl_bench.bench.options import non_negative_int, positive_int
from crl_bench.bench.raw import RawSimulator, raw_simulator
from crl_bench.data import DataMissingError
from crl_bench.env_api import EnvUnavailableError, TextEnv, list_envs, make_env

__all__ = ["HELP", "OWN_BENCHES", "OpenActionSetError", "add_parser", "bench_env", "format_skipped",
           "format_table", "run"]

HELP = "wrapper vs raw"

#: envs with a bench of their own (worker processes, scripted episodes), run only when named: env id ->
#: function of the parsed ``bench env`` options that runs it and returns its printed lines
OWN_BENCHES: dict[str, Callable[[argparse.Namespace], str]] = {
    "alfworld": alfworld.report,
    "webshop": webshop.report,
}


class OpenActionSetError(ValueError):
    """The env has an open action set (``admissible_actions()`` gives nothing), so the benchmark has
    no legal actions to draw at random."""


#: errors that mean "this env cannot be benchmarked on this machine" (skipped, not fatal, when every
#: env is benchmarked)
UNAVAILABLE = (EnvUnavailableError, DataMissingError, OpenActionSetError)


class _Path:
    """One side of the comparison: an env (driven through ``sim``, its raw simulator, when given), the
    shared action sequence, timers and counters."""

    def __init__(self, env: TextEnv, sim: RawSimulator | None, actions: Sequence[str],
                 tasks: Sequence[int]) -> None:
        self.env = env
        self.sim = sim
        self.raw = sim is not None
        self.max_steps = env.max_steps
        self.tasks = tasks
        if self.raw:
            self.inputs: list[str] = list(actions)
        else:
            self.inputs = [f"<answer>{a}</answer>" for a in actions]
        self.pos = 0              # index of the next action
        self.episode = 0          # episodes started
        self.ep_steps = 0         # steps in the current episode
        self.need_reset = True
        self.ends = 0             # episodes ended by the game (done / terminated), not the step limit
        self.step_time = 0.0
        self.reset_time = 0.0
        self.steps = 0            # timed steps
        self.resets = 0           # timed resets
        self.chunk_times: list[float] = []

    def _reset(self) -> None:
        task = self.tasks[self.episode % len(self.tasks)]
        self.episode += 1
        if self.sim is not None:
            self.sim.reset(task)
        else:
            self.env.reset(options={"task": task})

    def run(self, n: int) -> float:
        """Take ``n`` steps (resetting when an episode ends); return the step time of this chunk."""
        perf = time.perf_counter
        inputs, pos, max_steps = self.inputs, self.pos, self.max_steps
        ep_steps, need_reset = self.ep_steps, self.need_reset
        step_time = reset_time = 0.0
        resets = ends = 0
        # the two arms' loops are written out apart on purpose: a shared loop would add a call per
        # step to both, and that overhead is of the size the benchmark measures
        if self.raw:
            step = self.sim.step
            t0 = perf()
            for _ in range(n):
                if need_reset:
                    t1 = perf()
                    step_time += t1 - t0
                    self._reset()
                    t0 = perf()
                    reset_time += t0 - t1
                    resets += 1
                    ep_steps = 0
                done = step(inputs[pos])
                pos += 1
                ep_steps += 1
                if done:
                    ends += 1
                need_reset = done or ep_steps >= max_steps
            step_time += perf() - t0
        else:
            step = self.env.step
            t0 = perf()
            for _ in range(n):
                if need_reset:
                    t1 = perf()
                    step_time += t1 - t0
                    self._reset()
                    t0 = perf()
                    reset_time += t0 - t1
                    resets += 1
                    ep_steps = 0
                _obs, _r, terminated, truncated, _info = step(inputs[pos])
                pos += 1
                ep_steps += 1
                if terminated:
                    ends += 1
                need_reset = terminated or truncated or ep_steps >= max_steps
            step_time += perf() - t0
        self.pos, self.ep_steps, self.need_reset = pos, ep_steps, need_reset
        self.step_time += step_time
        self.reset_time += reset_time
        self.steps += n
        self.resets += resets
        self.ends += ends
        self.chunk_times.append(step_time)
        return step_time

    def clear_timers(self) -> None:
        self.step_time = self.reset_time = 0.0
        self.steps = self.resets = 0
        self.chunk_times = []


def _bench_one(env_id: str, steps: int, seed: int, chunk: int, warmup: int,
               env_kwargs: dict[str, Any]) -> dict[str, Any]:
    raw_env = make_env(env_id, **env_kwargs)
    text_env = make_env(env_id, **env_kwargs)
    try:
        train = text_env.task_ids("train")
        rng = np.random.default_rng(seed)
        # task ids: a seeded sample of the train split, the same for both paths
        tasks = [int(train[int(i)]) for i in rng.integers(len(train), size=4096)]
        text_env.reset(options={"task": tasks[0]})
        legal = text_env.admissible_actions()
        if not legal:
            raise OpenActionSetError(f"{env_id}: bench_env needs a closed action set "
                                     f"(admissible_actions() returned {legal!r})")
        legal = list(legal)
        actions = [legal[int(i)] for i in rng.integers(len(legal), size=warmup + steps)]
        raw = _Path(raw_env, raw_simulator(raw_env), actions, tasks)
        text = _Path(text_env, None, actions, tasks)
        if warmup:
            raw.run(warmup)
            text.run(warmup)
        raw.clear_timers()
        text.clear_timers()
        done, c = 0, 0
        while done < steps:
            n = min(chunk, steps - done)
            first, second = (raw, text) if c % 2 == 0 else (text, raw)
            first.run(n)
            second.run(n)
            done += n
            c += 1
        chunk_ratios = [t / r for t, r in zip(text.chunk_times, raw.chunk_times) if r > 0]
        raw_step = raw.step_time / raw.steps
        text_step = text.step_time / text.steps
        return {
            "env": env_id,
            "raw_steps": raw.steps,
            "text_steps": text.steps,
            "raw_episodes": raw.episode,
            "text_episodes": text.episode,
            "raw_game_ends": raw.ends,
            "text_game_ends": text.ends,
            "raw_steps_per_s": raw.steps / raw.step_time,
            "text_steps_per_s": text.steps / text.step_time,
            "raw_step_us": 1e6 * raw_step,
            "text_step_us": 1e6 * text_step,
            "ratio": text_step / raw_step,
            "ratio_chunk_median": statistics.median(chunk_ratios) if chunk_ratios else float("nan"),
            "raw_resets": raw.resets,
            "text_resets": text.resets,
            "raw_reset_ms": 1e3 * raw.reset_time / raw.resets if raw.resets else float("nan"),
            "text_reset_ms": 1e3 * text.reset_time / text.resets if text.resets else float("nan"),
        }
    finally:
        raw_env.close()
        text_env.close()


def bench_env(env_ids: list[str] | None, steps: int, seed: int = 0, *, chunk: int = 100,
              warmup: int = 50, env_kwargs: dict[str, dict[str, Any]] | None = None,
              skipped: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """Time raw simulator steps against text-env steps for each env (see the module docstring).

    Args:
        env_ids: env ids to measure; ``None`` for every id of :func:`crl_bench.env_api.list_envs`.
        steps: timed steps per path and env (after ``warmup`` untimed ones).
        seed: seeds the random legal actions and the task ids (shared by both paths).
        chunk: steps per timing chunk; the two paths alternate chunk by chunk.
        warmup: untimed steps taken by each path first.
        env_kwargs: optional settings per env id, passed to :func:`make_env` for both instances.
        skipped: when a list is given, an env that cannot run here (:data:`UNAVAILABLE`: missing
            engine, service, container image or data, or an open action set) is not measured:
            ``(env_id, reason)`` is appended to the list and the other envs are measured. Without
            it, such an env raises.

    Returns:
        one dict per env: ``env``; ``raw_steps`` / ``text_steps`` (timed steps, equal by
        construction); ``raw_episodes`` / ``text_episodes`` (episodes started, warm-up included);
        ``raw_game_ends`` / ``text_game_ends`` (episodes ended by the game rather than by the step
        limit, warm-up included); ``raw_steps_per_s``, ``text_steps_per_s``, ``raw_step_us``,
        ``text_step_us``; ``ratio`` (text step time / raw step time, over all chunks);
        ``ratio_chunk_median`` (median of the per-chunk ratios); ``raw_resets`` / ``text_resets``
        and ``raw_reset_ms`` / ``text_reset_ms`` (mean time of a timed reset).

    Raises:
        ValueError: ``steps`` or ``chunk`` < 1, or (``skipped`` not given) an env with an open action
            set (:class:`OpenActionSetError`).
        EnvUnavailableError, DataMissingError: (``skipped`` not given) an env that cannot run here.
        KeyError: an unknown env id (never skipped).
    """
    if steps < 1 or chunk < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1, chunk >= 1, warmup >= 0; got {steps}, {chunk}, {warmup}")
    ids = list(env_ids) if env_ids is not None else list_envs()
    env_kwargs = env_kwargs or {}
    rows = []
    for env_id in ids:
        try:
            rows.append(_bench_one(env_id, steps, seed, chunk, warmup, env_kwargs.get(env_id, {})))
        except UNAVAILABLE as e:
            if skipped is None:
                raise
            skipped.append((env_id, f"{type(e).__name__}: {e}"))
    return rows


def format_skipped(skipped: Sequence[tuple[str, str]]) -> str:
    """One line per env :func:`bench_env` skipped, with the reason ("" when none was)."""
    return "\n".join(f"skipped {env_id} (cannot run here): {reason}" for env_id, reason in skipped)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of :func:`bench_env` rows (one line per env)."""
    header = ("env", "raw steps/s", "text steps/s", "ratio", "raw us", "text us",
              "raw reset ms", "text reset ms", "steps", "episodes")
    lines = []
    for r in rows:
        lines.append((
            str(r["env"]),
            f"{r['raw_steps_per_s']:,.0f}",
            f"{r['text_steps_per_s']:,.0f}",
            f"{r['ratio']:.2f}x",
            f"{r['raw_step_us']:.1f}",
            f"{r['text_step_us']:.1f}",
            f"{r['raw_reset_ms']:.3f}",
            f"{r['text_reset_ms']:.3f}",
            f"{r['raw_steps']}/{r['text_steps']}",
            f"{r['raw_episodes']}/{r['text_episodes']}",
        ))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(header)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    out = [fmt(header), "  ".join("-" * w for w in widths)]
    out += [fmt(line) for line in lines]
    return "\n".join(out)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``env`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("env", help=HELP, description="Step time of each text env against its bare "
                              "simulator; ALFWorld and WebShop: their own benches (when named).")
    p.add_argument("--env", action="append",
                   help=f"env id, repeatable (default: every registered env but {', '.join(OWN_BENCHES)})")
    p.add_argument("--steps", type=positive_int, default=2000, help="timed steps per path and env")
    p.add_argument("--workers", type=positive_int, default=2, help="alfworld bench: N worker processes (vs 1)")
    p.add_argument("--episodes", type=positive_int, default=None,
                   help="alfworld episodes per arm (8), webshop scripted episodes (200)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seeds the random legal actions and the task ids")
    p.add_argument("--chunk", type=positive_int, default=100, help="steps per alternating timing chunk")
    p.add_argument("--warmup", type=non_negative_int, default=50, help="untimed steps per path first")
    p.add_argument("--json", action="store_true", help="print the text-vs-raw rows as JSON at the end")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``crl-bench bench env`` with the options of :func:`add_parser`: the own benches of the named
    :data:`OWN_BENCHES` envs, then the text-vs-raw table of the others (every registered env but the
    :data:`OWN_BENCHES` when no ``--env`` is given, skipping those that cannot run here). Returns 0.

    Raises:
        the errors of :func:`bench_env` (an env named with ``--env`` that cannot run here, an unknown id).
    """
    from crl_bench import env_api

    ids = args.env or [e for e in env_api.list_envs() if e not in OWN_BENCHES]
    for env_id, own_bench in OWN_BENCHES.items():
        if env_id in ids:
            print(own_bench(args))
            ids = [e for e in ids if e != env_id]
    # every env (no --env): one that cannot run here (no Docker daemon or SWE-bench images, a
    # missing extra or data set, an open action set) is skipped and listed with the reason
    skipped: list[tuple[str, str]] | None = None if args.env else []
    rows: list[dict[str, Any]] = []
    if ids:
        rows = bench_env(ids, args.steps, args.seed, chunk=args.chunk, warmup=args.warmup, skipped=skipped)
        print(format_table(rows))
    if skipped:
        print(format_skipped(skipped))
    if not args.env:
        print(f"(not included by default: {', '.join(OWN_BENCHES)}; use --env ID)")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0
