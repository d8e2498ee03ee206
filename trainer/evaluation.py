"""Evaluation of a trainer's actor: the eval modes (``free``, ``guided`` and the memory controls ``shuffled`` /
``empty`` and the memory forms ``raw`` / ``condensed`` / ``both``), the eval tasks and their panels, the
protocol that makes two evaluations comparable, repeated trials and independent samples, and Reflexion's
evaluation attempts (docs/evaluation.md).

:class:`Evaluator` runs on the parts of a :class:`~crl_bench.trainer.loop.Trainer` (its env pool,
rollout runner, eval sampling and experience track) and adds no state to the actor: the training loop
calls it at the step-0 and interval evaluations and at the end (``trainer/lifecycle.py``), and
``crl-bench eval`` on a finished run's actor and bank.
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, get_args

import numpy as np

from crl_bench.config import DEFAULT_PREFILL, ConfigError, EvalControl, RunConfig
from crl_bench.experience.memory import MEMORY_FORMS
from crl_bench.results.passk import pass_curves
from crl_bench.rollout import EpisodeSpec, Trajectory

#: the memory controls of evaluation (``eval.controls``; docs/evaluation.md "Memory controls")
EVAL_CONTROLS: tuple[str, ...] = get_args(EvalControl)
#: every eval mode, in the order a final evaluation runs the ones it has
EVAL_MODES = ("guided", *EVAL_CONTROLS, "free")


def summarise(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """Success rate, mean reward/steps, invalid-action rate (invalid / actions), errors, episodes
    ended by the actor's context (``context_full``, only when there were any), per env, and the
    actor's entropy.

    Returns a flat dict; per-env success rates appear as ``success_rate/<env_id>``.  ``entropy`` is the
    mean over every generated token of the entropy (nats) of the actor's unconstrained next-token
    distribution at the sampling temperature (as verl's ``actor/entropy``); ``reply_entropy`` the mean
    over turns of the summed entropies of the distributions the reply's tokens were drawn from (the
    allowed-reply mask applied): with a closed action set its mean estimates the entropy of the action
    choice, 0 for a collapsed policy (one action per state) and at most ln(number of actions) (one
    reply's sum can exceed that when replies share leading tokens).  Both are absent when the
    engine does not report entropies (vLLM).
    """
    if not trajs:
        return {"episodes": 0, "success_rate": 0.0, "reward_mean": 0.0, "steps_mean": 0.0,
                "invalid_action_rate": 0.0, "env_errors": 0}
    steps = sum(t.steps for t in trajs)
    out: dict[str, Any] = {
        "episodes": len(trajs),
        "success_rate": float(np.mean([t.success for t in trajs])),
        "reward_mean": float(np.mean([t.reward for t in trajs])),
        "steps_mean": float(np.mean([t.steps for t in trajs])),
        "invalid_action_rate": (sum(t.invalid_actions for t in trajs) / steps) if steps else 0.0,
        "env_errors": sum(1 for t in trajs if t.error),
    }
    full = sum(1 for t in trajs if t.context_full)
    if full:                                # episodes ended by the actor's context (rollout.max_context_tokens)
        out["context_full"] = full
    ents = [e for t in trajs for turn in t.turns for e in turn.entropy]
    if ents:
        out["entropy"] = float(np.mean(ents))
    replies = [sum(turn.sampling_entropy) for t in trajs for turn in t.turns if turn.sampling_entropy]
    if replies:
        out["reply_entropy"] = float(np.mean(replies))
    by_env = episodes_by_env(trajs)
    if len(by_env) > 1:
        for env_id, ts in sorted(by_env.items()):
            out[f"success_rate/{env_id}"] = float(np.mean([t.success for t in ts]))
    return out


def episodes_by_env(trajs: Sequence[Trajectory]) -> dict[str, list[Trajectory]]:
    """The episodes of each env id, in the order given (envs in order of first appearance)."""
    by_env: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_env[t.env_id].append(t)
    return dict(by_env)


class Evaluator:
    """Evaluates the current actor of ``trainer`` (and, with a method's bank, the bank's guidance).

    Args:
        trainer: the trainer whose env pool, rollout runner, eval sampling (``eval.temperature`` with
            the actor's ``top_p`` / ``top_k``), experience track, task splits (``eval_tasks``,
            ``eval_contexts``, ``task_types``, ``max_steps``) and step counter are used. The
            evaluator keeps two caches of its own: each eval task's first retrieval query and each
            env's task panel hash.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._first_queries: dict[tuple[str, int], str] = {}       # (env, task) -> its retrieval query
        self._panels: dict[tuple[str, str, tuple[int, ...]], str] = {}   # (env, split, task ids) -> panel hash

    @property
    def cfg(self) -> RunConfig:
        """The trainer's run configuration."""
        return self.trainer.cfg

    @property
    def guided(self) -> bool:
        """Whether evaluation also runs guided: the method has a bank and ``experience.eval_guided``."""
        return self.trainer.experience is not None and self.cfg.experience.eval_guided

    @property
    def modes(self) -> list[str]:
        """The modes of the final evaluation, in the order they run: ``guided`` and the memory controls
        of ``eval.controls`` for a method with a bank (and ``experience.eval_guided``), then ``free``.
        A memory form the method's memory kind does not show apart from ``guided``
        (:attr:`~crl_bench.experience.memory.Memory.forms`) is left out (:meth:`skipped_controls`)."""
        if not self.guided:
            return ["free"]
        skip = self.skipped_controls()
        return ["guided", *[c for c in EVAL_CONTROLS if c in self.cfg.eval.controls and c not in skip], "free"]

    def skipped_controls(self) -> dict[str, str]:
        """``{control: why}`` for the memory forms of ``eval.controls`` that the method's memory kind
        does not show apart from ``guided`` (a case bank's raw form is its guided mode, and it has no
        condensed form): the final evaluation does not run them."""
        track = self.trainer.experience
        if track is None:
            return {}
        forms = track.memory.forms
        return {c: f"memory {track.memory.name!r} shows forms {', '.join(forms) or 'none'} apart from guided"
                for c in MEMORY_FORMS if c in self.cfg.eval.controls and c not in forms}

    def task_ids(self, episodes: int | str | None = None) -> dict[str, list[int]]:
        """The eval tasks of each env: the first ``episodes`` ids of its eval split (``"all"``: every
        one; default ``eval.episodes``)."""
        n = self.cfg.eval.episodes if episodes is None else episodes
        return {e: [int(t) for t in (self.trainer.eval_tasks[e] if n == "all" else self.trainer.eval_tasks[e][:int(n)])]
                for e in self.trainer.mixture.envs}

    def max_steps(self) -> dict[str, int]:
        """Each env's action limit in evaluation: ``eval.max_steps``'s where it names the env, else
        the training limit."""
        return {e: self.trainer.eval_max_steps.get(e) or n for e, n in self.trainer.max_steps.items()}

    def protocol(self, episodes: int | str | None = None) -> dict[str, Any]:
        """What makes two evaluations comparable (docs/evaluation.md): split, episodes per env (as
        asked and as run), sampling, each env's step limit, for envs that have any, their
        constructor settings (``rollout.env_kwargs``, e.g. a MiniHack variant) as ``env_settings``,
        each env's task panel hash as ``panels`` (:meth:`panels`), ``trials`` when
        ``eval.trials`` is more than 1 and ``samples`` when ``eval.samples`` is. What an evaluation
        protocol sets beyond that appears only when set (docs/evaluation.md, "Protocol profiles"):
        ``profile``, ``splits`` (envs evaluated on another split than ``split``), ``prompt``
        (``{"layout", "history"}`` when ``eval.prompt`` or ``eval.history`` is set) and ``draws``
        (``{"size", "count", "replace": {env: bool}}`` with ``eval.draw_size``), ``constrained``
        (``false`` when replies are free: ``generation.constrained``) and ``prefill`` (when it is not
        :data:`~crl_bench.config.DEFAULT_PREFILL`). Which engine generated is not part of it (engines
        give the same replies); a served model's record names it (``served``)."""
        tasks = self.task_ids(episodes)
        g, ec = self.cfg.generation, self.cfg.eval
        other = ec.other_splits(tasks)
        return {"split": ec.split, **({"splits": other} if other else {}),
                **({"profile": ec.profile} if ec.profile else {}),
                "episodes": ec.episodes if episodes is None else episodes,
                "tasks_per_env": {e: len(ids) for e, ids in tasks.items()},
                "temperature": ec.temperature, "top_p": g.top_p, "top_k": g.top_k,
                "max_new_tokens": g.max_new_tokens, "max_steps": self.max_steps(),
                **({"prompt": {"layout": ec.prompt or self.cfg.rollout.prompt,
                               "history": self.cfg.rollout.history if ec.history is None else ec.history}}
                   if ec.prompt is not None or ec.history is not None else {}),
                **({"env_settings": settings} if (settings := {
                    e: dict(kw) for e, kw in self.cfg.rollout.env_kwargs.items() if e in tasks and kw}) else {}),
                "panels": self.panels(episodes),
                **({"trials": ec.trials} if ec.trials > 1 else {}),
                **({"samples": ec.samples} if ec.samples > 1 else {}),
                **({"draws": {"size": ec.draw_size, "count": ec.draw_count,
                              "replace": {e: bool(ec.draw_replace.get(e, True)) for e in tasks}}}
                   if ec.draw_size else {}),
                **({"constrained": False} if not g.constrained else {}),
                **({"prefill": g.prefill} if g.prefill != DEFAULT_PREFILL else {})}

    def check_draws(self, episodes: int | str | None = None) -> None:
        """Refuse sampled-worker draws (``eval.draw_size``) that cannot be drawn: more tasks per draw
        than an env has eval tasks, without replacement.

        Raises:
            ConfigError: naming the env, its task count and the draw size.
        """
        ec = self.cfg.eval
        if not ec.draw_size:
            return
        for env_id, ids in self.task_ids(episodes).items():
            if not ec.draw_replace.get(env_id, True) and ec.draw_size > len(ids):
                raise ConfigError(f"eval.draw_size={ec.draw_size} is more than the {len(ids)} eval tasks of "
                                 f"{env_id}, drawn without replacement (eval.draw_replace.{env_id}: false)")

    def panels(self, episodes: int | str | None = None) -> dict[str, str]:
        """Each env's task panel hash (:mod:`crl_bench.results.panel`) for the eval tasks of
        :meth:`task_ids`: ``{env id: sha256 hex}``, what ``crl-bench panel export`` writes for the
        same env, split, episodes and settings. Computed once per env and task list (procedural envs
        reset each task once, on an env of the pool)."""
        from crl_bench.results.panel import build_panel

        out: dict[str, str] = {}
        for env_id, ids in self.task_ids(episodes).items():
            split = self.cfg.eval.split_of(env_id)
            key = (env_id, split, tuple(ids))
            if key not in self._panels:
                env = self.trainer.pool.acquire(env_id)
                try:
                    self._panels[key] = build_panel(env, env_id, split, ids)["panel_hash"]
                finally:
                    self.trainer.pool.release(env_id, env)
            out[env_id] = self._panels[key]
        return out

    def shuffled_donors(self, tasks: dict[str, list[int]]) -> dict[str, dict[int, int]]:
        """For the ``shuffled`` memory control: each eval task's donor, another task of the same
        env's ``tasks`` whose retrieval query it is shown the experience of.

        Where the env has contexts (:meth:`TextEnv.context`, the diagnostics) the donor is drawn
        from the tasks of other contexts, else from every other task.  Drawn uniformly with a
        generator seeded by ``train.seed`` and the env id, so a run's control is reproducible.  An env
        with a single task gives no donor (the task is left out of the mapping and then shown what
        its own retrieval returns).
        """
        out: dict[str, dict[int, int]] = {}
        for env_id, ids in tasks.items():
            ctx = self.trainer.eval_contexts.get(env_id, {})
            gen = np.random.default_rng([self.cfg.train.seed, zlib.crc32(env_id.encode())])
            donors: dict[int, int] = {}
            for t in ids:
                pool = [d for d in ids if d != t and (not ctx or ctx.get(d) != ctx.get(t))] or \
                       [d for d in ids if d != t]
                if pool:
                    donors[t] = int(pool[int(gen.integers(len(pool)))])
            out[env_id] = donors
        return out

    def first_query(self, env_id: str, task: int) -> str:
        """The retrieval query of task ``task``'s first observation (a reset of a pool env; cached)."""
        key = (env_id, int(task))
        if key not in self._first_queries:
            env = self.trainer.pool.acquire(env_id)
            try:
                obs, _ = env.reset(options={"task": int(task)})
                self._first_queries[key] = env.retrieval_query(obs)
            finally:
                self.trainer.pool.release(env_id, env)
        return self._first_queries[key]

    def control_guide(self) -> Any:
        """The ``empty`` control's guide: the knowledge block's header with no entry, no retrieval."""
        from crl_bench.rollout import Guidance

        text = self.trainer.experience.empty_guidance
        return lambda requests: [Guidance(text) for _ in requests]

    def evaluate(self, episodes: int | str | None = None, progress: Any = None,
                 guided: bool | None = None, mode: str | None = None) -> dict[str, Any]:
        """Roll out the eval tasks of each env (:meth:`task_ids`) once, with the eval sampling.

        Args:
            episodes: per env, an int or ``"all"`` (default ``eval.episodes``).
            progress: called with 1 per finished episode.
            guided: retrieve from the bank (read-only); default: the method has experience and
                ``experience.eval_guided``. Raises ``ValueError`` if asked without a bank.
            mode: ``free``, ``guided`` or a memory control (docs/evaluation.md "Memory controls"):
                ``shuffled`` (each episode retrieves with the query of another eval task of its env,
                :meth:`shuffled_donors`), ``empty`` (the knowledge block's header and no entry) or a
                memory form of the kind's (``raw``, ``condensed``, ``both``: the guided retrieval shown
                in that form, :meth:`ExperienceTrack.form_guide`); overrides ``guided``.  The controls
                replace the episode-start experience only: turn-level retrieval and the search tool are
                off in them.

        Returns ``summarise`` of the episodes plus ``per_env`` (episodes, success rate, mean steps,
        invalid-action rate, ``score_mean`` = mean episode reward, e.g. WebShop's score, ``successes``:
        0/1 per task in the order of ``tasks``, and for envs with task types ``per_type``: episodes
        and success rate per type, e.g. ALFWorld's six), ``mode``, ``guided`` (experience in the
        prompt: every mode but ``free``), ``episodes_with_experience``, ``split``, ``temperature``,
        ``wall_s`` (seconds of the evaluation that ran the mode: with :meth:`evaluate_modes`' stream,
        of all its modes together) and the task ids used (``tasks``; ``donors`` for ``shuffled``);
        outside ``free``, a memory kind that learns between attempts adds its own
        (:meth:`ExperienceTrack.eval_attempts`; ``reflexion``: ``attempts_with_reflections``
        (attempts shown at least one reflection: its guidance is not a bank entry, so
        ``episodes_with_experience`` stays 0)).  With ``eval.trials`` n > 1 each task is attempted
        until solved, at most n times, and every figure is of each task's best attempt
        (:meth:`trials`); the block adds ``success_by_trial`` (share solved after each attempt) and
        ``attempts`` (episodes run).  With ``eval.samples`` n > 1 each task is run n times
        independently: rates are over all episodes, ``successes`` is each task's share of
        successful samples, and the block and each env add ``pass_at_k`` and ``pass_hat_k``
        (``{"1": ..., ..., "n": ...}``, :func:`crl_bench.results.passk.pass_curves`; the block's
        pooled over all tasks) and ``samples``.

        Raises:
            ValueError: an unknown mode, a mode with experience for a method without a bank, or a
                memory form the method's memory kind does not show.
        """
        if mode is None:
            mode = "guided" if (self.guided if guided is None else guided) else "free"
        return self.evaluate_modes([mode], episodes, progress)[mode]

    def evaluate_modes(self, modes: Sequence[str], episodes: int | str | None = None,
                       progress: Any = None, on_mode: Any = None, journal: Any = None) -> dict[str, dict[str, Any]]:
        """Evaluate each of ``modes`` (blocks as :meth:`evaluate`, keyed by mode) on the same tasks;
        ``on_mode(mode, block)``, if given, is called as soon as a mode's block is known (in a stream
        with one attempt, when the mode's last episode ends: the queue holds the modes in the order
        given, so they end about in that order).

        ``journal`` (an :class:`~crl_bench.trainer.eval_journal.EpisodeJournal`), with ``eval.trials``
        1: every finished episode is recorded there, and the episodes it already holds are not rolled
        out again but counted in their mode's block, which then says how many (``resumed_episodes``).

        With ``eval.stream`` (default) the modes run as one stream (docs/evaluation.md "One stream"):
        every mode's episodes in one queue of the rollout's continuous batching
        (:meth:`RolloutRunner.collect_streams`), each with its own mode's hooks; with ``eval.trials``
        > 1 each attempt is one stream of every mode's unsolved tasks, and a memory kind that learns
        between attempts (``reflexion``) learns per mode between them.  Without it each mode is its
        own pass, in the order given.  Either way the evaluation starts from an empty actor prefix
        store, and the read-only retrievals are a function of the bank and the query
        (:meth:`Retriever.begin_readonly`), so a mode's episodes do not depend on the order of the
        episodes around it.

        Raises:
            ValueError: an unknown mode, a mode given twice, a mode with experience for a method
                without a bank, or a memory form the method's memory kind does not show.
        """
        modes = list(modes)
        for mode in modes:
            if mode not in ("free", "guided", *EVAL_CONTROLS):
                raise ValueError(f"unknown eval mode {mode!r}; known: free, guided, {', '.join(EVAL_CONTROLS)}")
            if mode != "free" and self.trainer.experience is None:
                raise ValueError(f"{mode} evaluation needs an experience bank; method {self.cfg.method!r} has none")
            if mode in MEMORY_FORMS and mode not in self.trainer.experience.memory.forms:
                raise ValueError(f"eval mode {mode!r}: {self.skipped_controls().get(mode) or 'not a form here'}")
        if len(set(modes)) != len(modes):
            raise ValueError(f"eval modes given twice: {modes}")
        if not self.cfg.eval.stream and len(modes) > 1:
            return {mode: self.evaluate_modes([mode], episodes, progress, on_mode)[mode] for mode in modes}
        if any(m != "free" for m in modes):
            self.trainer.experience.flush()         # the bank evaluated is the one training has written
            # read-only retrievals (the released re-rank's random demotion of a recently retrieved top
            # entry) depend neither on the evaluations before, nor on the order of the episodes, nor on
            # the wall time since training, so `crl-bench eval` reproduces eval.json's guided and
            # control blocks
            self.trainer.experience.begin_evaluation(f"{self.cfg.train.seed}")
        # every evaluation starts from an empty prefix store: a cached prefix equals its recomputation
        # only up to rounding, which can flip a greedy choice at a near-tie, so without this an
        # evaluation's episodes would depend on which evaluations ran before it
        self.trainer.clear_actor_prefix_store()
        tasks = self.task_ids(episodes)
        plans = [self._plan(mode, tasks) for mode in modes]
        if self.cfg.eval.trials > 1:
            journal = None                      # a retry depends on the attempts before it: no resume
        kept: list[dict[int, Trajectory]] = [{} for _ in plans]
        order = [list(range(len(p["specs"]))) for p in plans]      # each rolled-out spec's place in its mode
        for j, p in enumerate(plans):
            if journal is not None:
                kept[j] = {i: t for i, t in journal.kept(p["mode"]).items() if i < len(p["specs"])}
                order[j] = [i for i in order[j] if i not in kept[j]]
                p["specs"] = [p["specs"][i] for i in order[j]]
        t0 = time.perf_counter()
        blocks: dict[str, dict[str, Any]] = {}

        def done(j: int, run: tuple[list[Trajectory], list[float], int]) -> None:
            trajs, by_trial, attempts = run
            if kept[j]:                         # the journal's episodes back in their places
                every = {**kept[j], **dict(zip(order[j], trajs))}
                trajs = [every[i] for i in range(len(every))]
                by_trial, attempts = [sum(1 for t in trajs if t.success) / len(trajs)], attempts + len(kept[j])
            # wall_s: from the evaluation's start until the mode's last episode ended
            blocks[plans[j]["mode"]] = block = self._block(plans[j], tasks, trajs, by_trial, attempts,
                                                           time.perf_counter() - t0)
            if kept[j]:
                block["resumed_episodes"] = len(kept[j])
            if on_mode is not None:
                on_mode(plans[j]["mode"], block)

        def episode(j: int, i: int, t: Trajectory) -> None:
            journal.record(plans[j]["mode"], order[j][i], t)

        with self.trainer.peaks.phase("eval"):
            self._attempts(plans, progress, done, episode if journal is not None else None)
        return {p["mode"]: blocks[p["mode"]] for p in plans}

    def _plan(self, mode: str, tasks: dict[str, list[int]]) -> dict[str, Any]:
        """What ``mode`` runs: its specs (``eval.samples`` each), rollout hooks, between-attempt
        ``prepare`` / ``learn`` (or ``None``), the memory kind's attempts object and the donors of
        ``shuffled``."""
        exp = self.cfg.experience
        donors = self.shuffled_donors(tasks) if mode == "shuffled" else {}
        live = mode == "guided"
        form = mode if mode in MEMORY_FORMS else ""
        specs = [EpisodeSpec(env_id, t, group_id=i, subgroup="free" if mode == "free" else "guided",
                             retrieve=mode != "free" and (exp.integration != "turn" or not live),
                             turn_retrieve=live and exp.integration != "trajectory",
                             tool=live and exp.search_tool != "off",
                             query=self.first_query(env_id, donors[env_id][t])
                             if t in donors.get(env_id, {}) and self.trainer.experience.memory.retrieves else "",
                             max_steps=self.trainer.eval_max_steps.get(env_id, 0))
                 for env_id, ids in tasks.items() for i, t in enumerate(ids)]
        # evaluation leaves the bank and its usage counters as they were, unless eval.writes_counters
        # (the released evaluation counts its retrievals)
        hooks = self.trainer.rollout_hooks(training=False, guided=mode != "free", form=form)
        if mode != "guided" and not form:
            hooks = {"guide": self.control_guide()} if mode == "empty" else \
                {k: v for k, v in hooks.items() if k == "guide"}
        prepare = learn = None
        # a memory kind that learns between attempts (reflexion) replaces retrieval in every attempt
        between = self.trainer.experience.eval_attempts(mode, donors) if mode != "free" else None
        if between is not None:
            prepare, learn = between.prepare, between.learn
            specs = [replace(s, retrieve=False, turn_retrieve=False, tool=False) for s in specs]
            hooks = {}
        samples = self.cfg.eval.samples
        specs = [s for s in specs for _ in range(samples)]     # eval.samples: independent episodes per task
        return {"mode": mode, "specs": specs, "hooks": hooks, "prepare": prepare, "learn": learn,
                "between": between, "donors": donors}

    def _block(self, plan: dict[str, Any], tasks: dict[str, list[int]], trajs: list[Trajectory],
               by_trial: list[float], attempts: int, wall: float) -> dict[str, Any]:
        """The eval.json block of one mode (:meth:`evaluate`) from its episodes."""
        mode, between, donors = plan["mode"], plan["between"], plan["donors"]
        samples = self.cfg.eval.samples
        out = summarise(trajs)
        per_env = {}
        all_counts: list[int] = []                  # successful samples per task, every env (eval.samples)
        by_env = episodes_by_env(trajs)
        for env_id in self.trainer.mixture.envs:
            ts = by_env.get(env_id)
            if not ts:
                continue
            env_summary = summarise(ts)
            row = {k: env_summary[k] for k in ("episodes", "success_rate", "steps_mean", "invalid_action_rate")}
            row["score_mean"] = env_summary["reward_mean"]
            won: dict[int, int] = defaultdict(int)          # successful episodes per task
            for t in ts:
                won[int(t.task)] += int(bool(t.success))
            counts = [won.get(t, 0) for t in tasks[env_id]]
            all_counts += counts
            row["successes"] = counts if samples == 1 else [c / samples for c in counts]
            if samples > 1:
                row["pass_at_k"], row["pass_hat_k"] = pass_curves(samples, counts)
            if self.cfg.eval.draw_size:
                row["draws"] = self._draws(env_id, ts, tasks[env_id])
            types = self.trainer.task_types.get(env_id)
            if types:
                by_type: dict[str, list[bool]] = defaultdict(list)
                for t in ts:
                    by_type[types.get(int(t.task), "unknown")].append(bool(t.success))
                row["per_type"] = {k: {"episodes": len(v), "success_rate": float(np.mean(v))}
                                   for k, v in sorted(by_type.items())}
            per_env[env_id] = row
        if other := self.cfg.eval.other_splits(per_env):     # envs evaluated on another split (eval.splits)
            out["splits"] = other
        out.update(split=self.cfg.eval.split, per_env=per_env, wall_s=wall,
                   mode=mode, guided=mode != "free", temperature=self.cfg.eval.temperature, tasks=tasks,
                   # with experience: how many episodes the bank actually had experience for
                   episodes_with_experience=sum(1 for t in trajs if t.experience_ids))
        if between is not None:
            out.update(between.metrics())
        if donors:
            out["donors"] = {e: {str(t): d for t, d in m.items()} for e, m in donors.items()}
        if self.cfg.eval.trials > 1:
            out.update(success_by_trial=by_trial, attempts=attempts)
        if samples > 1:                 # pooled over the tasks of every env
            out["samples"] = samples
            out["pass_at_k"], out["pass_hat_k"] = pass_curves(samples, all_counts)
        return out

    def _draws(self, env_id: str, trajs: Sequence[Trajectory], ids: Sequence[int]) -> dict[str, Any]:
        """``env_id``'s sampled-worker draws (:func:`~crl_bench.results.draws.sampled_worker_draws`)
        from its eval episodes ``trajs`` on tasks ``ids``, drawn with a generator seeded by
        ``train.seed`` and the env id (a run's draws are reproducible)."""
        from crl_bench.results.draws import sampled_worker_draws

        outcomes: dict[int, list[bool]] = defaultdict(list)
        for t in trajs:
            outcomes[int(t.task)].append(bool(t.success))
        ec = self.cfg.eval
        gen = np.random.default_rng([self.cfg.train.seed, zlib.crc32(env_id.encode()), 1])
        return sampled_worker_draws([outcomes.get(int(t), []) for t in ids], ec.draw_size, ec.draw_count,
                                    replace=bool(ec.draw_replace.get(env_id, True)), rng=gen)

    def trials(self, specs: list[EpisodeSpec], progress: Any, hooks: dict[str, Any], prepare: Any = None,
                learn: Any = None) -> tuple[list[Trajectory], list[float], int]:
        """Run ``specs`` for ``eval.trials`` attempts: attempt k + 1 runs the specs whose task no
        earlier attempt solved.  ``prepare(spec)``, if given, gives the spec an attempt runs (called
        before each attempt: what it is shown); ``learn(failed trajectories)`` is called after each
        attempt but the last.  Returns one trajectory per spec, in order (the first successful
        attempt, else the attempt with the highest reward, the earliest on ties), the share of
        specs solved after each attempt and the number of episodes run."""
        plan = {"specs": specs, "hooks": hooks, "prepare": prepare, "learn": learn}
        return self._attempts([plan], progress)[0]

    def _attempts(self, plans: list[dict[str, Any]], progress: Any,
                  done: Any = None, episode: Any = None) -> list[tuple[list[Trajectory], list[float], int]]:
        """:meth:`trials` of several modes' plans together: each attempt runs every plan's unsolved
        specs as one stream (:meth:`_collect`), then each plan's ``learn`` sees its own failures.
        ``done(j, result of plan j)`` is called once per plan as soon as its result is known (with a
        single attempt: when its stream's last episode ends); ``episode(j, i, trajectory)`` as soon as
        an attempt's episode of spec ``i`` of plan ``j`` has ended."""
        trials = self.cfg.eval.trials

        reported: set[int] = set()

        def single(k: int, ran: list[Trajectory]) -> None:
            j = which[k]
            share = sum(1 for t in ran if t.success) / max(len(plans[j]["specs"]), 1)
            reported.add(j)
            done(j, (list(ran), [share], len(ran)))

        stream_done = single if done is not None and trials == 1 else None
        best: list[dict[int, Trajectory]] = [{} for _ in plans]
        by_trial: list[list[float]] = [[] for _ in plans]
        pending = [list(range(len(p["specs"]))) for p in plans]
        attempts = [0] * len(plans)
        for k in range(trials):
            which = [j for j, p in enumerate(plans) if pending[j]]
            streams = []
            for j in which:
                p = plans[j]
                run = [p["prepare"](p["specs"][i]) if p["prepare"] is not None else p["specs"][i] for i in pending[j]]
                streams.append((run, p["hooks"]))
            ended = None if episode is None else \
                (lambda s, i, t, which=which, pending=pending: episode(which[s], pending[which[s]][i], t))
            ran_all = self._collect(streams, progress, stream_done, ended) if streams else []
            for j, ran in zip(which, ran_all):
                attempts[j] += len(ran)
                learn = plans[j]["learn"]
                if learn is not None and k + 1 < trials:
                    learn([t for t in ran if not t.success])
                for i, t in zip(pending[j], ran):
                    prev = best[j].get(i)
                    if prev is None or (not prev.success and (t.success or t.reward > prev.reward)):
                        best[j][i] = t
                pending[j] = [i for i in pending[j] if not best[j][i].success]
            for j, p in enumerate(plans):
                by_trial[j].append(sum(1 for t in best[j].values() if t.success) / max(len(p["specs"]), 1))
        results = [([best[j][i] for i in range(len(p["specs"]))], by_trial[j], attempts[j])
                   for j, p in enumerate(plans)]
        if done is not None:                # every plan not reported by its stream (none with no specs)
            for j, run in enumerate(results):
                if j not in reported:
                    done(j, run)
        return results

    def _collect(self, streams: list[tuple[list[EpisodeSpec], dict[str, Any]]], progress: Any,
                 stream_done: Any = None, episode_done: Any = None) -> list[list[Trajectory]]:
        """Roll out ``streams`` (``(specs, hooks)``) with the eval sampling: one stream by
        :meth:`RolloutRunner.collect`, several (or any with ``episode_done``) as one queue
        (:meth:`RolloutRunner.collect_streams`); continuous batching with ``eval.stream``, else waves
        of ``rollout.max_concurrent``; ``stream_done`` and ``episode_done`` as in
        :meth:`RolloutRunner.collect_streams`."""
        runner, sampling = self.trainer.eval_runner, self.trainer.eval_sampling
        before = getattr(runner, "continuous", True)
        runner.continuous = self.cfg.eval.stream
        try:
            if episode_done is not None:
                return runner.collect_streams(streams, sampling, progress=progress, stream_done=stream_done,
                                              episode_done=episode_done)
            if len(streams) == 1:
                specs, hooks = streams[0]
                out = [runner.collect(specs, sampling, progress=progress, **hooks)]
                if stream_done is not None:
                    stream_done(0, out[0])
                return out
            return runner.collect_streams(streams, sampling, progress=progress, stream_done=stream_done)
        finally:
            runner.continuous = before

    def evaluate_all(self, episodes: int | str | None = None, progress: Any = None,
                     modes: Sequence[str] | None = None, journal: Any = None) -> dict[str, Any]:
        """The final evaluation written to ``eval.json``: ``{"step", "protocol", MODE: ...}`` for each
        of ``modes`` (default :attr:`modes`: ``free`` and, for methods with an experience bank
        and ``experience.eval_guided``, ``guided`` and the memory controls of ``eval.controls``), the
        same tasks in every mode (blocks as :meth:`evaluate`, run as one stream by
        :meth:`evaluate_modes`), the final actor's ``lesson_follow`` (with ``eval.lesson_follow``) and,
        where ``eval.controls`` names memory forms the method's kind does not show, why they did not run
        (``controls_skipped``). ``journal``: as :meth:`evaluate_modes` (episodes kept and not rolled out
        again)."""
        out: dict[str, Any] = {"step": self.trainer.step, "protocol": self.protocol(episodes)}
        skipped = self.skipped_controls() if modes is None and self.guided else {}
        if skipped:
            out["controls_skipped"] = skipped
        out.update(self.evaluate_modes(self.modes if modes is None else modes, episodes, progress, journal=journal))
        follow = self.trainer.lesson_follow()
        if follow:                            # the final actor's lesson following
            out["lesson_follow"] = {k: v for k, v in follow.items() if not k.startswith("time_")}
        return out

    def episode_count(self, episodes: int | str | None = None, modes: Sequence[str] | None = None) -> int:
        """Episodes :meth:`evaluate_all` runs (for progress bars; with ``eval.trials`` the most it
        can run, as solved tasks are not attempted again)."""
        n = len(self.modes if modes is None else modes) * self.cfg.eval.trials * self.cfg.eval.samples
        return n * sum(len(v) for v in self.task_ids(episodes).values())
