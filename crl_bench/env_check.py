"""``check_env``: does an environment keep the :class:`~crl_bench.env_api.TextEnv` contract?

The idea is Gymnasium's environment checker (``gymnasium.utils.env_checker.check_env``: call
``reset`` and ``step`` with a variety of inputs and check what comes back, determinism under a seed
and ``close`` twice), applied to what crl-bench's rollout, trainer and task panels rely on from an
env (:mod:`crl_bench.env_api`, :mod:`crl_bench.rollout`, :mod:`crl_bench.results.panel`):

* the shapes of ``reset`` / ``step`` and the common ``info`` keys with their types, at every step;
* determinism by task id: two resets of a task give the same observation, the same replies give the
  same trajectory, ``reset(seed=t)`` is task ``t``, and the split-phase calls the rollout makes
  (``reset_async``/``reset_wait``, ``step_async``/``step_wait``) give what ``reset``/``step`` give;
* splits: ``train`` and ``eval`` exist, no task id is in two splits, the ids are integers and the
  same on every call (and on a second instance), unknown ids and splits are ``KeyError``;
* invalid actions (garbage, no ``<answer>`` tags, an empty answer, an action outside a closed set)
  are fed back: the ``invalid_action`` flag set, the observation says the action was invalid, no
  reward, the episode goes on, nothing raised;
* the step limit: ``max_steps`` actions, valid or not, end the episode as truncated (not
  terminated, no success) with the env's failure reward (:meth:`TextEnv.truncation_reward`), and
  a step after the end raises ``RuntimeError``;
* ``task_fingerprint``: a dict of JSON values, the same on every call whatever the env's state;
* closed action sets: every admissible action, sent as ``<answer>ACTION</answer>`` (what constrained
  decoding produces), is a valid action; ``info["admissible_actions"]`` is the current set;
* the cheap hooks (``task_prompt``, ``retrieval_query``, ``task_type``, ``context``,
  ``task_weights``, ``chance_success_rate``, ``data_files``, ``reply_format``) return what their
  docstrings say;
* ``close()`` may be called twice.

Run it on your env with ``python -m crl_bench.env_check ENV_ID`` (CONTRIBUTING.md, "Adding an
environment") or call :func:`check_env` in a test; ``tests/test_check_env.py`` runs it on every
registered env.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crl_bench.env_api import EnvUnavailableError, ReplyFormat, TextEnv, list_envs, make_env

#: the ``info`` keys of every ``reset`` and ``step`` (:meth:`TextEnv._info`) and their types; the
#: rollout reads ``action``, ``invalid_action``, ``invalid_actions``, ``steps`` and ``success``
COMMON_INFO_KEYS: dict[str, tuple[type, ...]] = {
    "task": (int, np.integer), "success": (bool,), "invalid_action": (bool,),
    "invalid_actions": (int, np.integer), "steps": (int, np.integer), "action": (str, type(None)),
}

#: replies that are no legal action in any env: no answer tags, empty, empty tags, an unclosed empty
#: tag, control characters and a long run of text (the rollout sends what the actor wrote)
GARBAGE_REPLIES: tuple[str, ...] = (
    "I am not sure what to do here, no tags at all.",
    "",
    "<answer></answer>",
    "<think>thinking</think><answer>   ",
    "\x00\x1b[31m\ufffd <answer\n",
    "zq" * 2048,
)

#: a tagged answer that names no action of a closed action set
UNKNOWN_ACTION = "<answer>crl-bench-check: no such action</answer>"

#: the reply of :func:`default_policy` where the action set is open (the env may take it or not)
OPEN_SET_REPLY = "<answer>look</answer>"

#: ``policy(env, observation, step index) -> reply``: the replies of the checked trajectories
Policy = Callable[[TextEnv, str, int], str]


def default_policy(env: TextEnv, obs: str, step: int) -> str:
    """A fixed, state-dependent reply: with a closed action set, ``<answer>A</answer>`` for the
    admissible action at index ``(3 * step + 1) % n`` (it varies the actions without randomness);
    with an open set, :data:`OPEN_SET_REPLY`."""
    actions = env.admissible_actions()
    if not actions:
        return OPEN_SET_REPLY
    return f"<answer>{actions[(3 * step + 1) % len(actions)]}</answer>"


@dataclass(frozen=True)
class EnvCheckFailure:
    """One violated property: ``prop`` (e.g. ``"determinism"``, ``"step limit"``), the task id
    (``None`` for a property of the env as a whole) and what was found."""

    env_id: str
    prop: str
    task: int | None
    detail: str

    def __str__(self) -> str:
        where = f"task {self.task}: " if self.task is not None else ""
        return f"{self.env_id}: {where}{self.prop}: {self.detail}"


class EnvCheckError(AssertionError):
    """:func:`check_env` found contract violations; ``failures`` lists every one
    (:class:`EnvCheckFailure`), the message one per line."""

    def __init__(self, failures: Sequence[EnvCheckFailure]) -> None:
        self.failures = list(failures)
        head = f"{len(self.failures)} contract violation(s) of env {self.failures[0].env_id!r}:"
        super().__init__("\n".join([head] + [f"  - {f}" for f in self.failures]))

    @property
    def properties(self) -> set[str]:
        """The names of the violated properties."""
        return {f.prop for f in self.failures}


class _Failed(Exception):
    """A check stops at its first broken expectation (the rest would only repeat it); ``prop``, when
    given, files it under another property than the check's (one episode checks several)."""

    def __init__(self, detail: str, prop: str | None = None) -> None:
        super().__init__(detail)
        self.prop = prop


def _short(value: Any, n: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _canonical(value: Any) -> str:
    """Canonical JSON (the form :mod:`crl_bench.results.panel` hashes); raises ``TypeError`` or
    ``ValueError`` for a value JSON cannot hold."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _ids_equal(a: Sequence[int], b: Sequence[int]) -> bool:
    if isinstance(a, range) and isinstance(b, range):
        return a == b
    return len(a) == len(b) and list(a) == list(b)


def _membership(ids: Sequence[int]) -> Any:
    """An object answering ``t in ids`` fast: ranges and other O(1) containers as they are."""
    return ids if isinstance(ids, (range, set, frozenset)) or not isinstance(ids, (list, tuple)) else set(ids)


def _overlap(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """Up to five task ids in both ``a`` and ``b`` (ranges of step 1 compared by their bounds)."""
    if isinstance(a, range) and isinstance(b, range) and a.step == b.step == 1:
        lo, hi = max(a.start, b.start), min(a.stop, b.stop)
        return list(range(lo, min(hi, lo + 5)))
    small, big = (a, b) if len(a) <= len(b) else (b, a)
    inside = _membership(big)
    found = []
    for t in small:
        if t in inside:
            found.append(int(t))
            if len(found) == 5:
                break
    return found


class _Checker:
    """State of one :func:`check_env` run: the env, the failures and notes found so far."""

    def __init__(self, env: TextEnv, policy: Policy, steps: int) -> None:
        self.env = env
        self.env_id = str(getattr(env, "env_id", type(env).__name__))
        self.policy = policy
        self.steps = steps
        self.failures: list[EnvCheckFailure] = []
        self.notes: list[str] = []

    # ---- bookkeeping ------------------------------------------------------------------------------
    def fail(self, prop: str, detail: str, task: int | None = None) -> None:
        failure = EnvCheckFailure(self.env_id, prop, task, detail)
        if failure not in self.failures:         # two episodes of a task may break the same way
            self.failures.append(failure)

    def note(self, text: str) -> None:
        line = f"{self.env_id}: {text}"
        if line not in self.notes:
            self.notes.append(line)

    def run(self, prop: str, fn: Callable[..., Any], *args: Any, task: int | None = None) -> Any:
        """Run one check; a broken expectation (:class:`_Failed`) or an exception of the env is a
        failure of ``prop``. An :class:`EnvUnavailableError` (a missing engine, container image or
        daemon) is no contract violation and propagates."""
        try:
            return fn(*args)
        except _Failed as e:
            self.fail(e.prop or prop, str(e), task)
        except EnvUnavailableError:
            raise
        except Exception as e:  # noqa: BLE001 - any exception of the env is reported as a failure of prop
            self.fail(prop, f"raised {type(e).__name__}: {e}", task)
        return None

    @staticmethod
    def expect(ok: bool, detail: str, prop: str | None = None) -> None:
        if not ok:
            raise _Failed(detail, prop)

    # ---- the env as a whole -------------------------------------------------------------------------
    def attributes(self) -> None:
        env, expect = self.env, self.expect
        expect(isinstance(env.env_id, str) and bool(env.env_id), f"env_id must be a non-empty str, got "
                                                                f"{_short(env.env_id)}")
        expect(_is_int(env.max_steps) and env.max_steps >= 1,
               f"max_steps (the rollout's step limit) must be an int >= 1, got {_short(env.max_steps)}")
        expect(isinstance(env.system_prompt, str), f"system_prompt must be a str, got {_short(env.system_prompt)}")
        if not env.system_prompt.strip():
            self.note("system_prompt is empty: the actor is shown no rules or answer format")
        expect(isinstance(env.prefetch_resets, bool), "prefetch_resets must be a bool")
        fmt = env.reply_format
        expect(isinstance(fmt, ReplyFormat), f"reply_format must be a ReplyFormat, got {_short(fmt)}")
        expect(isinstance(fmt.instruction, str) and bool(fmt.instruction.strip()),
               "reply_format.instruction (the last line of every prompt) must be a non-empty str")
        expect(fmt.prefill is None or isinstance(fmt.prefill, str), "reply_format.prefill must be None or a str")
        expect(_is_int(fmt.min_new_tokens) and fmt.min_new_tokens >= 0,
               "reply_format.min_new_tokens must be an int >= 0")
        expect(isinstance(fmt.stop, tuple) and all(isinstance(s, str) and s for s in fmt.stop),
               f"reply_format.stop must be a tuple of non-empty str, got {_short(fmt.stop)}")

    def splits(self) -> dict[str, Sequence[int]]:
        env, expect = self.env, self.expect
        names = list(env.splits)
        expect({"train", "eval"} <= set(names), f"splits must include 'train' and 'eval', got {names}")
        ids = {name: env.task_ids(name) for name in names}
        for name, seq in ids.items():
            expect(isinstance(seq, Sequence), f"task_ids({name!r}) must be a sequence, got {type(seq).__name__}")
            expect(len(seq) > 0, f"split {name!r} has no task ids")
            sample = list(seq) if isinstance(seq, (list, tuple)) else [seq[0], seq[len(seq) // 2], seq[-1]]
            bad = [t for t in sample if not _is_int(t)]
            expect(not bad, f"task ids must be integers; split {name!r} holds {_short(bad[:3])}")
            if not isinstance(seq, range) and len(set(sample if isinstance(seq, (list, tuple)) else seq)) < len(seq):
                self.note(f"split {name!r} lists a task id more than once (sampled more often)")
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                both = _overlap(ids[a], ids[b])
                expect(not both, f"splits {a!r} and {b!r} share task ids, e.g. {both}")
        try:
            env.task_ids("crl-bench-check-no-such-split")
        except KeyError:
            pass
        else:
            raise _Failed("task_ids() of an unknown split must raise KeyError")
        return ids

    def task_ids_stable(self, ids: dict[str, Sequence[int]], other: TextEnv | None) -> None:
        for name, seq in ids.items():
            self.expect(_ids_equal(seq, self.env.task_ids(name)),
                        f"task_ids({name!r}) differs between two calls on one instance")
            if other is not None:
                self.expect(_ids_equal(seq, other.task_ids(name)),
                            f"task_ids({name!r}) differs between two instances made alike")
            weights = self.env.task_weights(name)
            if weights is not None:
                w = list(weights)
                self.expect(len(w) == len(seq), f"task_weights({name!r}) has {len(w)} weights for "
                                                 f"{len(seq)} task ids")
                self.expect(all(_is_number(x) and math.isfinite(x) and x >= 0 for x in w) and sum(w) > 0,
                            f"task_weights({name!r}) must be finite, >= 0 and not all 0")

    def unknown_task(self, ids: dict[str, Sequence[int]]) -> None:
        env = self.env
        inside = [_membership(seq) for seq in ids.values()]
        bad = -1
        if any(bad in s for s in inside):
            bad = max(max(seq) for seq in ids.values()) + 1
        for what, call in (("check_task", lambda: env.check_task(bad)),
                           ("task_fingerprint", lambda: env.task_fingerprint(bad)),
                           ("reset(options={'task': id})", lambda: env.reset(options={"task": bad}))):
            try:
                call()
            except KeyError:
                continue
            raise _Failed(f"{what} of {bad}, a task id of no split, must raise KeyError")
        first = ids["train"][0]
        if env.task_type(first) is not None:
            try:
                env.task_type(bad)
            except KeyError:
                pass
            else:
                raise _Failed(f"task_type({bad}) of an unknown id must raise KeyError (the env has task types)")

    def hooks(self) -> None:
        env, expect = self.env, self.expect
        rate = env.chance_success_rate()
        expect(rate is None or (_is_number(rate) and 0.0 <= rate <= 1.0),
               f"chance_success_rate() must be None or in [0, 1], got {_short(rate)}")
        files = env.data_files()
        expect(isinstance(files, dict), f"data_files() must be a dict, got {type(files).__name__}")
        for name, path in files.items():
            expect(isinstance(name, str) and isinstance(path, Path) and path.is_absolute() and path.is_file(),
                   f"data_files() must map names to absolute paths of existing files; {name!r}: {_short(path)}")

    # ---- per task ----------------------------------------------------------------------------------
    def info(self, info: Any, task: int, steps: int, invalid_total: int, where: str) -> None:
        """The common info keys of one reset or step (failures filed under ``"info"``)."""
        def expect(ok: bool, detail: str) -> None:
            self.expect(ok, detail, "info")

        expect(isinstance(info, dict), f"{where}: info must be a dict, got {type(info).__name__}")
        missing = [k for k in COMMON_INFO_KEYS if k not in info]
        expect(not missing, f"{where}: info lacks the key(s) {missing}")
        for key, types in COMMON_INFO_KEYS.items():
            value = info[key]
            ok = isinstance(value, types) and (key in ("success", "invalid_action") or not isinstance(value, bool))
            expect(ok, f"{where}: info[{key!r}] must be {' or '.join(t.__name__ for t in types)}, "
                       f"got {_short(value)}")
        expect(int(info["task"]) == task, f"{where}: info['task'] is {info['task']}, the episode's task is {task}")
        expect(int(info["steps"]) == steps, f"{where}: info['steps'] is {info['steps']}, expected {steps} "
                                            f"(every action, valid or not, counts)")
        expect(int(info["invalid_actions"]) == invalid_total,
               f"{where}: info['invalid_actions'] is {info['invalid_actions']}, expected {invalid_total}")
        expect((info["action"] is None) == info["invalid_action"] or steps == 0,
               f"{where}: info['action'] must be None exactly when the action was invalid, got "
               f"action={_short(info['action'])}, invalid_action={info['invalid_action']}")
        current = self.env.admissible_actions()
        if current is None:
            expect("admissible_actions" not in info,
                   f"{where}: info['admissible_actions'] present while admissible_actions() is None")
        else:
            expect(isinstance(current, list) and all(isinstance(a, str) and a for a in current),
                   f"{where}: admissible_actions() must be a list of non-empty str, got {_short(current)}")
            expect(info.get("admissible_actions") == current,
                   f"{where}: info['admissible_actions'] must be the current admissible_actions()")
        extra = {k: v for k, v in info.items() if k not in COMMON_INFO_KEYS and k != "admissible_actions"}
        try:
            _canonical(extra)
        except (TypeError, ValueError) as e:
            self.note(f"extra_info is not JSON-serialisable ({e}); the rollout keeps it in trajectories")

    def reset_result(self, out: Any, task: int, where: str) -> str:
        self.expect(isinstance(out, tuple) and len(out) == 2,
                    f"{where} must return (observation, info), got {_short(out)}")
        obs, info = out
        self.expect(isinstance(obs, str) and bool(obs.strip()), f"{where}: the observation must be a "
                                                                f"non-empty str, got {_short(obs)}")
        self.info(info, task, 0, 0, where)
        self.expect(info["success"] is False and info["invalid_action"] is False and info["action"] is None,
                    f"{where}: a new episode has success False, invalid_action False and action None, got "
                    f"{_short({k: info[k] for k in ('success', 'invalid_action', 'action')})}")
        self.expect(self.env.task == task, f"{where}: env.task is {self.env.task!r}, expected {task}")
        return obs

    def step_result(self, out: Any, task: int, steps: int, invalid_total: int, where: str) -> tuple:
        self.expect(isinstance(out, tuple) and len(out) == 5,
                    f"{where} must return (observation, reward, terminated, truncated, info), got {_short(out)}")
        obs, reward, terminated, truncated, info = out
        self.expect(isinstance(obs, str), f"{where}: the observation must be a str, got {_short(obs)}")
        self.expect(_is_number(reward) and math.isfinite(float(reward)),
                    f"{where}: the reward must be a finite number, got {_short(reward)}")
        self.expect(isinstance(terminated, (bool, np.bool_)) and isinstance(truncated, (bool, np.bool_)),
                    f"{where}: terminated and truncated must be bool, got {_short(terminated)}, {_short(truncated)}")
        self.info(info, task, steps, invalid_total, where)
        if self.env.render_mode == "ansi":
            self.expect(self.env.render() == obs, f"{where}: render() must return the last observation")
        return obs, float(reward), bool(terminated), bool(truncated), info

    def seeded_resets(self, task: int, first: str, train: Sequence[int]) -> None:
        """``reset(seed=t)`` is task ``t``; a reset without a task draws one of the train split."""
        env = self.env
        out = env.reset(seed=task)
        got = out[1].get("task") if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict) else None
        self.expect(got == task, f"reset(seed=t) must start task t (a seed is the task id), it started task {got!r}")
        obs = self.reset_result(out, task, "reset(seed=t)")
        self.expect(obs == first, "reset(seed=t) must start task t: its observation differs from "
                                  "reset(options={'task': t})'s")
        _obs, info = env.reset()
        self.expect(isinstance(info, dict) and info.get("task") in _membership(train),
                    f"reset() without a task must draw a task of the train split, got task "
                    f"{_short(info.get('task') if isinstance(info, dict) else info)}")

    def admissible(self, task: int) -> None:
        """Every admissible action of the current state, as constrained decoding writes it, is valid
        (a failure is recorded and the episode goes on)."""
        env = self.env
        actions = env.admissible_actions()
        if actions is None:
            self.note("open action set at a first state (admissible_actions() is None): the policy's "
                      "replies there are free text")
            return
        problem = ""
        if not actions:
            problem = "admissible_actions() is empty at the first state: no legal action"
        elif len(set(actions)) != len(actions):
            problem = f"admissible_actions() lists an action twice: {_short(actions)}"
        for a in actions if not problem else ():
            parsed = env.parse_action(f"<answer>{a}</answer>")
            if parsed.action != a:
                problem = (f"the admissible action {a!r}, replied as <answer>{a}</answer>, parses to "
                           f"{_short(parsed.action)} ({parsed.error})")
                break
        if problem:
            self.fail("admissible actions", problem, task)

    def trajectory(self, task: int) -> tuple[str, list[tuple]]:
        """One episode of the policy's replies through ``reset``/``step``: the first observation and
        ``[(reply, obs, reward, terminated, truncated, common info)]``. Checks the first state's
        admissible actions and the per-task hooks on the way."""
        env = self.env
        obs = self.reset_result(env.reset(options={"task": task}), task, "reset")
        self.admissible(task)
        prompt, query = env.task_prompt(), env.retrieval_query(obs)
        self.expect(isinstance(prompt, str) and isinstance(query, str),
                    f"task_prompt() and retrieval_query() must return str, got {_short(prompt)}, "
                    f"{_short(query)}", "hooks")
        for name in ("task_type", "context"):
            value = getattr(env, name)(task)
            self.expect(value is None or isinstance(value, str),
                        f"{name}({task}) must be None or a str, got {_short(value)}", "hooks")
        first, record, invalid = obs, [], 0
        for k in range(min(self.steps, env.max_steps)):
            reply = self.policy(env, obs, k)
            allowed = env.admissible_actions()
            out = env.step(reply)
            invalid += _flagged(out)
            obs, reward, term, trunc, info = self.step_result(out, task, k + 1, invalid, f"step {k + 1}")
            chosen = _answer_of(reply)
            if allowed is not None and chosen in allowed:
                self.expect(not info["invalid_action"] and info["action"] == chosen,
                            f"step {k + 1}: the admissible action {chosen!r} was not taken "
                            f"(invalid_action={info['invalid_action']}, action={_short(info['action'])})",
                            "admissible actions")
            record.append((reply, obs, reward, term, trunc, _common(info)))
            if term or trunc:
                break
        if all(r[5]["invalid_action"] for r in record):
            self.note("the policy's replies were all invalid: determinism was checked on invalid "
                      "actions only (pass policy= to check_env)")
        return first, record

    def replay(self, task: int, first: str, record: list[tuple]) -> None:
        """The same task, replayed with the same replies through the split-phase calls the rollout
        makes, gives the same observations, rewards, ends and info."""
        env = self.env
        env.reset_async(options={"task": task})
        obs = self.reset_result(env.reset_wait(), task, "reset_async/reset_wait")
        self.expect(obs == first, f"two resets of the task give different first observations:\n    "
                                  f"{_short(first, 200)}\n    {_short(obs, 200)}")
        invalid = 0
        for k, (reply, *want) in enumerate(record):
            env.step_async(reply)
            out = env.step_wait()
            invalid += _flagged(out)
            obs, reward, term, trunc, info = self.step_result(out, task, k + 1, invalid,
                                                              f"step_async/step_wait {k + 1}")
            got = [obs, reward, term, trunc, _common(info)]
            for name, w, g in zip(("observation", "reward", "terminated", "truncated", "info"), want, got):
                self.expect(w == g, f"the same replies give a different trajectory: step {k + 1} "
                                    f"({_short(reply, 60)}): {name} {_short(w, 200)} then {_short(g, 200)}")

    def invalid_and_limit(self, task: int) -> None:
        """Garbage replies until the step limit: each is an invalid action fed back (property
        ``"invalid action"``), the episode goes on until ``max_steps`` actions, then ends truncated
        with the failure reward (``"step limit"``)."""
        env, expect = self.env, self.expect
        self.reset_result(env.reset(options={"task": task}), task, "reset")
        limit = env.max_steps
        for k in range(1, limit + 1):
            closed = env.admissible_actions() is not None
            replies = GARBAGE_REPLIES + ((UNKNOWN_ACTION,) if closed else ())
            reply = replies[(k - 1) % len(replies)]
            where = f"invalid reply {_short(reply, 40)} (step {k} of {limit})"
            try:
                out = env.step(reply)
            except EnvUnavailableError:
                raise
            except Exception as e:
                raise _Failed(f"{where} raised {type(e).__name__}: {e} (an invalid action is fed back "
                              f"to the agent, never an exception)") from e
            obs, reward, term, trunc, info = self.step_result(out, task, k, k, where)
            expect(info["invalid_action"] is True and info["action"] is None,
                   f"{where}: must be an invalid action (info['invalid_action'] True, action None), got "
                   f"invalid_action={info['invalid_action']}, action={_short(info['action'])}")
            expect(not term, f"{where}: an invalid action must not end the episode (terminated)")
            expect("invalid" in obs.lower(), f"{where}: the observation must tell the agent its action "
                                             f"was invalid, got {_short(obs, 200)}")
            if k < limit:
                expect(not trunc, f"{where}: truncated before the step limit ({limit} actions)", "step limit")
                expect(reward == 0.0, f"{where}: an invalid action earned reward {reward}")
                continue
            expect(trunc, f"{limit} actions (max_steps) must end the episode as truncated, got "
                          f"terminated={term}, truncated={trunc}", "step limit")
            expect(info["success"] is False, "an episode of invalid actions ended with success", "step limit")
            expected = float(env.truncation_reward())
            expect(reward == expected, f"the truncating step's reward is {reward}; the env's failure reward "
                                       f"(truncation_reward()) is {expected}", "step limit")
        try:
            env.step("<answer>anything</answer>")
        except RuntimeError:
            return
        raise _Failed("step() after the episode ended must raise RuntimeError", "step limit")

    def fingerprint(self, task: int, other: TextEnv | None) -> str:
        """The task's fingerprint as canonical JSON: a non-empty dict of JSON values, the same on two
        calls and on a second instance."""
        env, expect = self.env, self.expect
        fp = env.task_fingerprint(task)
        expect(isinstance(fp, dict) and bool(fp) and all(isinstance(k, str) for k in fp),
               f"task_fingerprint must be a non-empty dict with str keys, got {_short(fp)}")
        try:
            text = _canonical(fp)
        except (TypeError, ValueError) as e:
            raise _Failed(f"task_fingerprint is not JSON-serialisable ({e}): {_short(fp)}") from None
        expect(_canonical(env.task_fingerprint(task)) == text, "task_fingerprint differs between two calls")
        if other is not None:
            expect(_canonical(other.task_fingerprint(task)) == text,
                   "task_fingerprint differs between two instances made alike")
        return text

    def fingerprint_again(self, task: int, before: str) -> None:
        """After episodes of the checked tasks were played, the fingerprint is what it was."""
        self.expect(_canonical(self.env.task_fingerprint(task)) == before,
                    "task_fingerprint depends on the env's state: it differs after episodes were played")

    def close(self, other: TextEnv | None, close_env: bool) -> None:
        """``close()`` twice: on the second instance (never reset) and on the checked env."""
        for which, env in (("a never-reset instance", other), ("the checked env", self.env if close_env else None)):
            if env is None:
                continue
            for n in ("first", "second"):
                try:
                    env.close()
                except Exception as e:
                    raise _Failed(f"the {n} close() of {which} raised {type(e).__name__}: {e} (close must "
                                  f"be idempotent)") from e


def _flagged(out: Any) -> bool:
    """Whether a step's result says its action was invalid (``False`` for a malformed result, which
    :meth:`_Checker.step_result` reports)."""
    return isinstance(out, tuple) and len(out) == 5 and isinstance(out[4], dict) and \
        bool(out[4].get("invalid_action"))


def _answer_of(reply: str) -> str | None:
    """The text of a ``<answer>A</answer>`` reply the policy wrote, else ``None``."""
    head, tail = "<answer>", "</answer>"
    if reply.startswith(head) and reply.endswith(tail):
        return reply[len(head):-len(tail)]
    return None


def _common(info: dict[str, Any]) -> dict[str, Any]:
    """The info keys a replay must reproduce: the common ones and the admissible actions; an env's
    extra keys may hold measurements (a worker's memory, seconds) and are not compared."""
    return {k: info[k] for k in (*COMMON_INFO_KEYS, "admissible_actions") if k in info}


def check_env(env: TextEnv, *, tasks: Sequence[int] | None = None, steps: int = 3,
              policy: Policy | None = None, make: Callable[[], TextEnv] | None = None,
              close: bool = True) -> list[str]:
    """Check that ``env`` keeps the :class:`~crl_bench.env_api.TextEnv` contract (module docstring).

    The idea is Gymnasium's ``gymnasium.utils.env_checker.check_env`` (reset and step with varied
    inputs, determinism under a seed, ``close`` twice), checked against what crl-bench relies on:
    the common ``info`` keys and their types at every step, determinism by task id (reset and a
    replay of the same replies, through ``reset``/``step`` and the split-phase calls the rollout
    makes), disjoint splits and stable task ids, invalid actions fed back, truncation at
    ``max_steps`` with :meth:`~crl_bench.env_api.TextEnv.truncation_reward`, a JSON, state-independent
    ``task_fingerprint``, every admissible action valid as ``<answer>A</answer>``, the hooks' return
    types and an idempotent ``close``.

    Required and optional: an open action set (``admissible_actions()`` ``None``), an empty system
    prompt, a task id listed twice in a split, two checked tasks with the same fingerprint (e.g.
    SWE-bench's default eval list, the training list) and ``extra_info`` values JSON cannot hold are
    allowed and returned as notes; everything else is a failure.

    Cost: per task, three resets (five for the first; a default ``task_fingerprint`` resets too),
    ``steps`` actions twice and ``max_steps`` invalid replies (which do not reach the simulator), so
    slow envs (ALFWorld, WebShop, SWE-bench in containers) are checked on a few tasks.

    Args:
        env: the env, newly made or between episodes; it is reset many times.
        tasks: the task ids to play (default: the first id of every split).
        steps: actions of the policy per checked trajectory (at most ``max_steps``).
        policy: ``policy(env, observation, step index) -> reply`` for the checked trajectories
            (default :func:`default_policy`: an admissible action, or :data:`OPEN_SET_REPLY` where
            the action set is open: pass one that writes valid actions for an open-set env, e.g. a
            SWE-bench tool call).
        make: makes a second instance alike (e.g. ``lambda: make_env("alfworld")``), to check that
            task ids and fingerprints agree between instances and that a never-reset instance
            closes; it is closed at the end. ``None``: those checks are skipped (noted).
        close: close ``env`` at the end, twice (``close`` must be idempotent); ``False`` leaves it
            open (a shared env; then pass ``make`` so that closing is checked on another instance).

    Returns:
        Notes: what was allowed but worth knowing, and what was not checked.

    Raises:
        TypeError: ``env`` is not a :class:`~crl_bench.env_api.TextEnv`.
        EnvCheckError: one or more properties fail; ``failures`` names the env, the task and the
            property of each (:class:`EnvCheckFailure`).
        EnvUnavailableError: the env cannot run here (a missing engine, image or daemon).
    """
    if not isinstance(env, TextEnv):
        raise TypeError(f"check_env checks a crl_bench.env_api.TextEnv, got {type(env).__name__}")
    c = _Checker(env, policy or default_policy, max(1, int(steps)))
    other = None
    try:
        c.run("attributes", c.attributes)
        c.run("hooks", c.hooks)
        ids = c.run("splits", c.splits)
        if make is not None:
            other = c.run("make", make)
        else:
            c.note("no make= given: task ids and fingerprints were not compared with a second instance")
        if ids is not None:
            _check_tasks(c, ids, tasks, other)
    finally:
        c.run("close", c.close, other, close)
    if c.failures:
        raise EnvCheckError(c.failures)
    return c.notes


def _check_tasks(c: _Checker, ids: dict[str, Sequence[int]], tasks: Sequence[int] | None,
                 other: TextEnv | None) -> None:
    """The checks of :func:`check_env` that play tasks, once the splits are known."""
    env = c.env
    c.run("task ids", c.task_ids_stable, ids, other)
    c.run("unknown task id", c.unknown_task, ids)
    chosen = [int(t) for t in tasks] if tasks is not None else [int(seq[0]) for seq in ids.values()]
    chosen = [t for t in chosen if c.run("task ids", env.check_task, t, task=t) is not None]
    prints = {t: c.run("fingerprint", c.fingerprint, t, other, task=t) for t in chosen}
    for i, t in enumerate(chosen):
        traj = c.run("step", c.trajectory, t, task=t)
        if traj is not None:
            c.run("determinism", c.replay, t, *traj, task=t)
            if i == 0:
                c.run("reset", c.seeded_resets, t, traj[0], ids["train"], task=t)
        c.run("invalid action", c.invalid_and_limit, t, task=t)
    seen: dict[str, int] = {}
    for t, text in prints.items():
        if text is None:
            continue
        c.run("fingerprint", c.fingerprint_again, t, text, task=t)
        if text in seen:
            c.note(f"tasks {seen[text]} and {t} have the same fingerprint (the same content)")
        seen.setdefault(text, t)


def _setting(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"a setting is KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m crl_bench.env_check ENV_ID [--task T ...] [--steps N] [--set KEY=VALUE ...]``: run
    :func:`check_env` on a registered env. Exit 0: it passes (notes printed); 1: violations (one per
    line); 2: the env cannot run here, or its id or a setting is unknown."""
    p = argparse.ArgumentParser(prog="python -m crl_bench.env_check",
                                description="Check that an environment keeps the TextEnv contract.")
    p.add_argument("env_id", help=f"a registered env: {', '.join(list_envs())}")
    p.add_argument("--task", type=int, action="append", dest="tasks", help="a task id to play (repeatable; "
                   "default: the first of every split)")
    p.add_argument("--steps", type=int, default=3, help="policy actions per checked trajectory (default 3)")
    p.add_argument("--set", type=_setting, action="append", default=[], dest="settings", metavar="KEY=VALUE",
                   help="an env setting passed to make_env (VALUE read as JSON, else as text)")
    args = p.parse_args(argv)
    kwargs = dict(args.settings)
    try:
        env = make_env(args.env_id, **kwargs)
        notes = check_env(env, tasks=args.tasks, steps=args.steps,
                          make=lambda: make_env(args.env_id, **kwargs))
    except (EnvUnavailableError, KeyError, TypeError) as e:    # cannot run here, unknown id or setting
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EnvCheckError as e:
        print(e, file=sys.stderr)
        return 1
    for n in notes:
        print(f"note: {n}")
    print(f"{args.env_id}: the env keeps the TextEnv contract")
    return 0


if __name__ == "__main__":
    sys.exit(main())
