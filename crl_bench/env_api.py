"""Environment protocol, action parsing and the environment registry.

Every crl-bench environment is a :class:`gymnasium.Env` whose observations and actions are text
(README "Adding an environment"):

* ``reset(seed=None, options={"task": int}) -> (obs: str, info: dict)``
* ``step(action: str) -> (obs: str, reward: float, terminated: bool, truncated: bool, info: dict)``

``info`` always carries ``success: bool``, ``invalid_action: bool`` and ``steps: int``; envs with a
closed action set also carry ``admissible_actions: list[str]``.  ``step`` takes the actor's raw reply
(e.g. ``"<think>...</think><answer>up</answer>"``; a bare action without the tags is accepted only by a
parser with ``allow_bare``, which no env here uses: ``crl-bench envs play`` wraps what a human types);
a reply that does not parse to a legal action is an *invalid action*: the episode goes on, the step
counts towards the step limit and the observation tells the agent what was wrong.  It never raises.
``crl_bench.env_check.check_env`` checks an env against this contract (Gymnasium's ``check_env`` for
TextEnvs; a module of its own, since this one imports nothing of the project).

Environments are found by id through the ``crl_bench.envs`` entry-point group (ours are declared in
pyproject.toml the same way a user's package declares its own) and registered with gymnasium under the
``crl_bench/`` namespace, so ``gymnasium.make("crl_bench/sokoban")`` works as well as
:func:`make_env`.  An env whose optional engine is not installed (a ``pip install 'crl-bench[EXTRA]'``
extra, see :data:`ENV_EXTRAS`) makes :func:`make_env` raise :class:`EnvUnavailableError` naming the
missing module and the command that installs it.
"""

from __future__ import annotations

import abc
import importlib.util
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

ENTRY_POINT_GROUP = "crl_bench.envs"
GYM_NAMESPACE = "crl_bench"

_ANSWER_RE = re.compile(r"<\s*answer\s*>(.*?)<\s*/\s*answer\s*>", re.IGNORECASE | re.DOTALL)
_OPEN_ANSWER_RE = re.compile(r"<\s*answer\s*>(.*)$", re.IGNORECASE | re.DOTALL)


class EnvUnavailableError(RuntimeError):
    """The environment cannot run on this machine: its optional engine (a Python package of an extra),
    a service it needs (e.g. a Docker daemon) or an artefact it cannot obtain (e.g. a container image)
    is missing.  Raised when the env is loaded or created, with a message that says what is missing and
    how to provide it; ``crl-bench`` reports it and exits 2."""


#: env id -> the ``crl-bench`` extra (pyproject.toml ``[project.optional-dependencies]``) that installs
#: its engine; used for the message of a missing engine (:func:`missing_engine_error`)
ENV_EXTRAS: dict[str, str] = {"alfworld": "alfworld", "webshop": "webshop", "swebench-verified": "swe"}


def missing_engine_error(env_id: str, module: str | None, detail: str = "") -> EnvUnavailableError:
    """The :class:`EnvUnavailableError` for env ``env_id`` whose Python module ``module`` is missing.

    For an env of :data:`ENV_EXTRAS` the message names the extra and both install commands, e.g.
    ``env 'webshop' needs the [webshop] extra (missing module 'thefuzz'): CRL_EXTRAS=webshop bash
    install.sh, or pip install 'crl-bench[webshop]'``; for another env (a third-party plugin) it names
    the missing module only.  ``module`` ``None`` (unknown): ``detail`` (the import error's text) is
    shown instead.
    """
    what = f"missing module {module!r}" if module else f"import failed: {detail or 'unknown module'}"
    extra = ENV_EXTRAS.get(env_id)
    if extra is None:
        return EnvUnavailableError(f"env {env_id!r} cannot be loaded ({what}); install the package "
                                   f"that provides it")
    return EnvUnavailableError(f"env {env_id!r} needs the [{extra}] extra ({what}): "
                               f"CRL_EXTRAS={extra} bash install.sh, or pip install 'crl-bench[{extra}]'")


def require_modules(env_id: str, *modules: str) -> None:
    """Raise :func:`missing_engine_error` for the first of ``modules`` (top-level import names) that
    cannot be imported; imports nothing (``importlib.util.find_spec``).  For envs whose engine is
    imported later than construction (e.g. in a worker process), so that a missing one fails early.

    Raises:
        EnvUnavailableError: a module is not installed.
    """
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise missing_engine_error(env_id, name)


def _missing_module(err: BaseException) -> str | None:
    """The name of the module whose import failed: the ``name`` of ``err`` or of an ImportError it
    was raised from (a wrapper such as ``raise ImportError("needs bm25s") from e``); else ``None``."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ImportError) and e.name:
            return e.name.split(".")[0] if isinstance(e, ModuleNotFoundError) else e.name
        e = e.__cause__ or e.__context__
    return None


def data_file_map(root: str | os.PathLike, paths: Sequence[str | os.PathLike]) -> dict[str, Path]:
    """``{name: absolute path}`` of the existing files among ``paths``, for :meth:`TextEnv.data_files`.

    ``name`` is the path relative to the data root ``root`` (POSIX separators, e.g.
    ``"webshop/items_shuffle_1000.json"``), or the absolute path itself for a file outside it.  Paths
    that are not regular files are left out.
    """
    base = Path(root).absolute()
    out: dict[str, Path] = {}
    for p in paths:
        path = Path(p).absolute()
        if not path.is_file():
            continue
        try:
            name = path.relative_to(base).as_posix()
        except ValueError:
            name = path.as_posix()
        out[name] = path
    return out


@dataclass(frozen=True)
class ParsedAction:
    """Result of parsing one actor reply.

    Attributes:
        action: the canonical action name (a member of the env's action set), or ``None`` if invalid.
        raw: the text found inside ``<answer>...</answer>`` (or the whole reply when no tag), stripped.
        error: a short message for the agent when ``action`` is ``None``; empty otherwise.
    """

    action: str | None
    raw: str
    error: str = ""

    @property
    def valid(self) -> bool:
        return self.action is not None


def normalise_action_text(text: str) -> str:
    """Lower-case, strip, and collapse internal whitespace: ``"  Move   UP "`` -> ``"move up"``."""
    return " ".join(text.strip().lower().split())


class AnswerParser:
    """Parses an actor reply of the form ``[<think>...</think>] <answer>ACTION</answer>``.

    The last complete ``<answer>`` block wins; tag names are matched case-insensitively and with
    whitespace tolerated inside the brackets.  A reply with an opening tag but no closing tag (generation
    cut at ``max_new_tokens``) uses the text after the tag.  A reply without any tag is parsed as a bare
    action only when ``allow_bare`` is set (useful for a human playing in the terminal).

    Args:
        actions: the closed action set (canonical names), or ``None`` for an open set (any non-empty text
            is valid and returned stripped).
        aliases: extra spellings mapped to canonical names, e.g. ``{"north": "up"}``; matched after
            :func:`normalise_action_text`.
        allow_bare: accept a reply without ``<answer>`` tags as the action text.
    """

    def __init__(
        self,
        actions: Sequence[str] | None,
        aliases: dict[str, str] | None = None,
        allow_bare: bool = False,
    ) -> None:
        self.actions = list(actions) if actions is not None else None
        self.allow_bare = allow_bare
        self._lookup: dict[str, str] = {}
        if self.actions is not None:
            for a in self.actions:
                self._lookup[normalise_action_text(a)] = a
            for alias, canonical in (aliases or {}).items():
                if canonical not in self.actions:
                    raise ValueError(f"alias {alias!r} maps to unknown action {canonical!r}")
                self._lookup[normalise_action_text(alias)] = canonical

    def extract(self, reply: str) -> str | None:
        """Return the answer text of ``reply`` (stripped), or ``None`` if it has no answer."""
        found = _ANSWER_RE.findall(reply)
        if found:
            return found[-1].strip()
        m = _OPEN_ANSWER_RE.search(reply)
        if m:
            return m.group(1).strip()
        if self.allow_bare:
            return reply.strip()
        return None

    def parse(self, reply: str) -> ParsedAction:
        """Parse ``reply`` into a :class:`ParsedAction`; never raises."""
        text = self.extract(reply if isinstance(reply, str) else str(reply))
        if text is None:
            return ParsedAction(None, reply.strip()[:200] if isinstance(reply, str) else "",
                                "No <answer>...</answer> found. Reply with <answer>ACTION</answer>.")
        if not text:
            return ParsedAction(None, text, "Empty answer. Reply with <answer>ACTION</answer>.")
        if self.actions is None:
            return ParsedAction(text, text)
        canonical = self._lookup.get(normalise_action_text(text))
        if canonical is None:
            shown = text if len(text) <= 60 else text[:57] + "..."
            return ParsedAction(None, text, f"'{shown}' is not a valid action. "
                                            f"Valid actions: {', '.join(self.actions)}.")
        return ParsedAction(canonical, text)


def feedback_of(obs: str) -> str:
    """The env's feedback in an observation: the text of its ``Last: ...`` line (the convention of
    :meth:`TextEnv._observe` implementations here), else a first line starting with ``Message:`` or
    ``Invalid action``; ``""`` if there is none."""
    lines = [ln.strip() for ln in (obs or "").splitlines() if ln.strip()]
    for ln in lines:
        if ln.lower().startswith("last:"):
            return ln[5:].strip()
    if lines and lines[0].lower().startswith(("message:", "invalid action")):
        return lines[0]
    return ""


DEFAULT_REPLY_INSTRUCTION = "Reply with your next action as <answer>ACTION</answer>."


@dataclass(frozen=True)
class ReplyFormat:
    """How the actor replies in one env; the rollout reads it every turn (:mod:`crl_bench.rollout`).

    Attributes:
        instruction: the last line of every user prompt: how to reply.
        prefill: text opening the actor's turn (``None``: the run's ``generation.prefill``).
        min_new_tokens: reply tokens this env needs at least; a turn with such an env raises the run's
            ``max_new_tokens`` to it.
        stop: extra stop strings of this env's replies (added to the run's ``generation`` stop strings).

    The default is the ``<answer>ACTION</answer>`` format of every env but SWE-bench's tool calls.
    """

    instruction: str = DEFAULT_REPLY_INSTRUCTION
    prefill: str | None = None
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()


class TextEnv(gym.Env, metaclass=abc.ABCMeta):
    """Base class of the text-symbolic environments.

    Subclasses set :attr:`env_id`, :attr:`system_prompt`, :attr:`splits` and implement
    :meth:`_reset_task`, :meth:`_apply` and :meth:`_observe`, plus :meth:`admissible_actions` (the
    currently legal action names; ``None`` for an open action set).  The base class parses replies,
    counts steps and invalid actions, enforces ``max_steps`` (as truncation) and fills ``info``.

    Attributes:
        env_id: registry id, e.g. ``"sokoban"``.
        system_prompt: the rules and answer format shown to the actor once per prompt.
        splits: ``{"train": range(...), "eval": range(...)}`` of task ids (seeds for procedural envs);
            ranges must not overlap.
        max_steps: actions (valid or invalid) allowed per episode before truncation.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"]}
    env_id: ClassVar[str] = "text-env"
    system_prompt: ClassVar[str] = ""
    splits: ClassVar[dict[str, Sequence[int]]] = {"train": range(0, 1_000_000),
                                                   "eval": range(1_000_000, 1_000_200)}
    action_aliases: ClassVar[dict[str, str]] = {}
    #: resets are slow enough (seconds) that the trainer should start them ahead of time
    prefetch_resets: ClassVar[bool] = False
    #: how the actor replies in this env (instruction, prefill, token budget, stop strings)
    reply_format: ClassVar[ReplyFormat] = ReplyFormat()
    #: the env keys an episode's entries by :meth:`entry_key` instead of the retrieval query
    has_entry_key: bool = False

    def __init__(self, max_steps: int = 30, render_mode: str | None = "ansi") -> None:
        super().__init__()
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.max_steps = int(max_steps)
        self.episode_max_steps = self.max_steps      # this episode's limit: max_steps unless reset said otherwise
        self.render_mode = render_mode
        self.observation_space = spaces.Text(max_length=1 << 16)
        self.action_space = spaces.Text(max_length=1 << 12)
        self.task: int | None = None
        self._steps = 0
        self._invalid = 0
        self._done = True
        self._last_obs = ""
        self._success = False
        self._pending: tuple[str, Any] | None = None

    # ---- for subclasses -------------------------------------------------------------------------
    @abc.abstractmethod
    def _reset_task(self, task: int) -> None:
        """Start the episode of task ``task`` (deterministic given ``task``)."""

    @abc.abstractmethod
    def _apply(self, action: str) -> tuple[float, bool, bool, str]:
        """Apply a legal canonical action. Returns ``(reward, terminated, success, message)``."""

    @abc.abstractmethod
    def _observe(self, message: str = "") -> str:
        """Render the current state as text, with ``message`` (feedback of the last step) included."""

    def admissible_actions(self) -> list[str] | None:
        """Currently legal canonical action names, or ``None`` for an open action set."""
        return None

    def task_prompt(self) -> str:
        """One line stating the goal of the current task (used for retrieval and in prompts)."""
        return ""

    def retrieval_query(self, first_observation: str) -> str:
        """The text a guided episode retrieves experience with, from the task and its first observation;
        entries distilled from the episode are keyed by it too (``experience.key: query``).

        Default, as the released code's default query (``traj_env_manager.py``
        ``build_memory_query``): ``"Goal: <task>\nObservation: <first observation>"``; envs whose
        released query differs override it (MiniHack: the observation only; WebShop: the goal only).
        """
        return f"Goal: {self.task_prompt()}\nObservation: {first_observation.strip()}"

    def entry_key(self, first_turn_acted: bool) -> str | None:
        """Called when an episode ends: the text the entries distilled from it are keyed by
        (``experience.key: query``), or ``None`` (default) for the episode's retrieval query.  An env
        that returns text sets :attr:`has_entry_key` (MiniHack's released raw key).

        Args:
            first_turn_acted: the episode's first reply went to the env (it was not a search-tool
                call).
        """
        return None

    def task_type(self, task: int) -> str | None:
        """The benchmark's category of task id ``task`` (e.g. ALFWorld's ``"pick_and_place_simple"``),
        or ``None`` when the benchmark has none (the default).

        Cheap: no reset and no simulator call, so it works in the main process for any task id of
        :meth:`task_ids`, before or during episodes.  Envs with categories raise ``KeyError`` for an
        unknown task id.
        """
        return None

    def context(self, task: int) -> str | None:
        """The context of task id ``task``: the name of the group of tasks that share one solution,
        named in the observation (the diagnostics of :mod:`crl_bench.envs.diag`).  The ``shuffled``
        memory control draws its donor task from another context.  ``None`` (the default): the env
        has no contexts.  Cheap, like :meth:`task_type`; envs with contexts raise ``KeyError`` for an
        unknown task id."""
        return None

    def chance_success_rate(self) -> float | None:
        """Success rate, in ``[0, 1]``, of a policy that picks uniformly among the admissible actions
        at every step, for this instance's settings; ``None`` (the default) where it is not known."""
        return None

    def data_files(self) -> dict[str, Path]:
        """The data files this env instance reads: ``{name relative to the data root: absolute
        path}`` (see :func:`data_file_map`), default ``{}`` (procedural envs read none).

        Only real files are listed (a folder of thousands of games is represented by the archive it
        was unpacked from, or left out); the run summary records their sha256.  Cheap: lists paths,
        reads nothing.
        """
        return {}

    def task_fingerprint(self, task: int) -> dict[str, Any]:
        """What defines task id ``task`` on this machine, for task panels (``crl-bench panel``,
        :mod:`crl_bench.results.panel`): ``{field: JSON value}``, hashed field by field, so that two data
        dirs, package versions or machines that give a task different content are told apart.

        Default: ``{"first_observation": ...}``, the observation ``reset`` returns for the task (it
        holds the task's goal and its initial state; a procedural env's content is a function of the
        task id and the generator, which this catches when either changes). Envs whose task comes from
        a data file name the file's content instead, without a reset (ALFWorld: the game file and
        goal; WebShop: the goal and the target's price; SWE-bench: the instance). Resets the env.

        Raises:
            KeyError: ``task`` is not a task id of this env.
        """
        obs, _info = self.reset(options={"task": self.check_task(task)})
        return {"first_observation": obs}

    def task_weights(self, split: str) -> Sequence[float] | None:
        """Relative sampling weights of ``task_ids(split)`` (same order), or ``None`` for uniform
        (the default). The trainer's task sampler draws training tasks with these weights."""
        return None

    def check_task(self, task: Any) -> int:
        """``task`` as an int if it is a task id of one of this env's splits, the same rule for every
        env (procedural envs' splits are ranges of seeds, so any id in them is a task).

        Raises:
            KeyError: not an integer (a bool or a fractional number is none either), or in no split;
                the message names the splits' ranges.
        """
        if isinstance(task, bool) or not isinstance(task, (int, np.integer, float, str)):
            raise KeyError(f"{self.env_id}: task id must be an integer, got {task!r}")
        try:
            as_int = int(task)
            if isinstance(task, float) and task != as_int:
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise KeyError(f"{self.env_id}: task id must be an integer, got {task!r}") from None
        if any(as_int in ids for ids in self.splits.values()):
            return as_int

        def describe(ids: Sequence[int]) -> str:
            if isinstance(ids, range) and ids.step == 1:
                return f"{ids.start}..{ids.stop - 1}" if len(ids) else "none"
            return f"{len(ids)} ids" + (f", {min(ids)}..{max(ids)}" if len(ids) else "")
        known = "; ".join(f"{name}: {describe(ids)}" for name, ids in self.splits.items())
        raise KeyError(f"{self.env_id}: {as_int} is not a task id of this env ({known})")

    # ---- protocol -------------------------------------------------------------------------------
    def task_ids(self, split: str) -> Sequence[int]:
        """Task ids of ``split`` (``"train"`` or ``"eval"``). Raises ``KeyError`` for another split."""
        if split not in self.splits:
            raise KeyError(f"{self.env_id}: unknown split {split!r}; known: {sorted(self.splits)}")
        return self.splits[split]

    def parser(self) -> AnswerParser:
        """The action parser for the current state's action set."""
        return AnswerParser(self.admissible_actions(), self.action_aliases)

    def parse_action(self, reply: str) -> ParsedAction:
        """Parse an actor reply against the current admissible actions (see :class:`AnswerParser`)."""
        return self.parser().parse(reply)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode.

        ``options["task"]`` picks the task id; else ``seed`` is used as the task id; else the next
        integer from gymnasium's ``np_random`` over the train split. ``options["max_steps"]`` sets this
        episode's action limit (``episode_max_steps``; an evaluation protocol's, e.g. 100 for BALROG's
        MiniHack); without it the episode has the constructor's ``max_steps``.
        Returns ``(observation text, info)``.

        Raises:
            KeyError: not a task id of this env. ValueError: a ``max_steps`` option below 1 or above
                what the env can run (:meth:`check_episode_limit`).
        """
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def step(self, action: str):
        """Apply one actor reply; see the module docstring. Raises ``RuntimeError`` after the end."""
        self.step_async(action)
        return self.step_wait()

    # ---- split-phase protocol: many envs whose simulators run in worker processes progress at once --
    def reset_async(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """First half of :meth:`reset`: pick the task and hand it to the simulator
        (:meth:`_submit_reset`); :meth:`reset_wait` returns the result. The rollout calls this on every
        env before waiting on any, so process-backed envs reset in parallel."""
        super().reset(seed=seed)
        task = (options or {}).get("task")
        if task is None:
            if seed is not None:
                task = seed
            else:
                train = self.task_ids("train")
                task = int(train[int(self.np_random.integers(len(train)))])
        self.task = self.check_task(task)
        limit = (options or {}).get("max_steps")
        self.episode_max_steps = self.max_steps if limit is None else self.check_episode_limit(limit)
        self._steps = 0
        self._invalid = 0
        self._done = False
        self._success = False
        self._pending = ("reset", self.task)
        self._submit_reset(self.task)

    def reset_wait(self) -> tuple[str, dict[str, Any]]:
        """Second half of :meth:`reset`: ``(observation text, info)``."""
        if self._pending is None or self._pending[0] != "reset":
            raise RuntimeError(f"{self.env_id}: reset_wait() without reset_async()")
        self._pending = None
        self._reset_task(self.task)
        self._last_obs = self._observe("")
        return self._last_obs, self._info(invalid=False)

    def step_async(self, action: str) -> None:
        """First half of :meth:`step`: parse the reply and hand a legal action to the simulator
        (:meth:`_submit_apply`). Raises ``RuntimeError`` after the end."""
        if self._done:
            raise RuntimeError(f"{self.env_id}: step() called on a finished episode; call reset()")
        parsed = self.parse_action(action)
        self._pending = ("step", parsed)
        if parsed.valid:
            self._submit_apply(parsed.action)

    def step_wait(self):
        """Second half of :meth:`step`: ``(obs, reward, terminated, truncated, info)``."""
        if self._pending is None or self._pending[0] != "step":
            raise RuntimeError(f"{self.env_id}: step_wait() without step_async()")
        parsed: ParsedAction = self._pending[1]
        self._pending = None
        self._steps += 1
        reward, terminated, message = 0.0, False, ""
        if parsed.valid:
            reward, terminated, self._success, message = self._apply(parsed.action)
        else:
            self._invalid += 1
            message = f"Invalid action: {parsed.error}"
        truncated = (not terminated) and self._steps >= self.episode_max_steps
        if truncated:
            reward += self.truncation_reward()
        self._done = terminated or truncated
        self._last_obs = self._observe(message)
        return self._last_obs, float(reward), bool(terminated), bool(truncated), \
            self._info(invalid=not parsed.valid, action=parsed.action)

    def check_episode_limit(self, limit: Any) -> int:
        """``limit`` as an episode's action limit (a reset's ``max_steps`` option). Envs whose simulator
        has a limit of its own narrow the range (MiniHack: NLE's ``inner_max_steps``).

        Raises:
            ValueError: not an integer of at least 1.
        """
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or int(limit) < 1:
            raise ValueError(f"{self.env_id}: an episode's max_steps must be an integer >= 1, got {limit!r}")
        return int(limit)

    def _submit_reset(self, task: int) -> None:
        """Start resetting to ``task`` without waiting (process-backed envs send the request here and
        receive it in :meth:`_reset_task`). Default: nothing; :meth:`_reset_task` does the work."""

    def _submit_apply(self, action: str) -> None:
        """Start applying a legal ``action`` without waiting (see :meth:`_submit_reset`)."""

    def truncation_reward(self) -> float:
        """Reward added on the step where the step limit ends an unfinished episode (default 0)."""
        return 0.0

    def render(self) -> str:
        """The last observation text (``render_mode="ansi"``)."""
        return self._last_obs

    def _info(self, invalid: bool, action: str | None = None) -> dict[str, Any]:
        info: dict[str, Any] = {
            "task": self.task,
            "success": bool(self._success),
            "invalid_action": bool(invalid),
            "invalid_actions": self._invalid,
            "steps": self._steps,
            "action": action,
        }
        adm = self.admissible_actions()
        if adm is not None:
            info["admissible_actions"] = list(adm)
        extra = self.extra_info()
        if extra:                      # every step: dict key views, no sets built for envs without extras
            clash = extra.keys() & info.keys()
            if clash:
                raise KeyError(f"{type(self).__name__}.extra_info() may not override the common info keys "
                               f"{sorted(clash)}")
            info.update(extra)
        return info

    def extra_info(self) -> dict[str, Any]:
        """Env-specific keys added to the ``info`` dict of every ``reset`` and ``step`` (hook; default
        none), after the common keys (``task``, ``success``, ``invalid_action``, ``invalid_actions``,
        ``steps``, ``action`` and, for closed action sets, ``admissible_actions``), which it may not
        replace (``KeyError``). Values should be JSON-serialisable: the rollout keeps them in trajectories."""
        return {}


# ---- registry ------------------------------------------------------------------------------------

_extra: dict[str, Callable[..., TextEnv] | str] = {}


def register_env(env_id: str, entry_point: Callable[..., TextEnv] | str) -> None:
    """Register an env at run time (tests, notebooks). Packages should use the entry-point group.

    Args:
        env_id: id used by ``--mix`` and :func:`make_env`.
        entry_point: a callable returning a :class:`TextEnv`, or ``"module:attr"``.
    """
    _extra[env_id] = entry_point
    _gym_register(env_id, entry_point)


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def list_envs() -> list[str]:
    """Ids of every environment known through the entry-point group or :func:`register_env`."""
    return sorted(set(_entry_points()) | set(_extra))


def _resolve(env_id: str) -> Callable[..., TextEnv]:
    if env_id in _extra:
        ep = _extra[env_id]
        if isinstance(ep, str):
            mod, _, attr = ep.partition(":")
            module = __import__(mod, fromlist=[attr])
            return getattr(module, attr)
        return ep
    eps = _entry_points()
    if env_id not in eps:
        raise KeyError(f"unknown environment {env_id!r}; known: {', '.join(list_envs()) or '(none)'}")
    return eps[env_id].load()


def env_settings_accepted(env_id: str) -> frozenset[str] | None:
    """The keyword settings :func:`make_env` accepts for ``env_id``: the named parameters of its
    entry point (for a class, of its ``__init__`` and, while one passes ``**kwargs`` on, of the
    ``__init__`` of each base class in method resolution order). ``None`` when the entry point takes
    any keyword (a function with ``**kwargs``), so the settings cannot be checked.

    Raises:
        KeyError: unknown id.
        EnvUnavailableError: the entry point's module cannot be imported (an optional engine).
    """
    import inspect

    try:
        factory = _resolve(env_id)
    except ImportError as e:
        raise missing_engine_error(env_id, _missing_module(e), str(e)) from e
    targets = ([vars(c)["__init__"] for c in factory.__mro__ if "__init__" in vars(c) and c is not object]
               if isinstance(factory, type) else [factory])
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names: set[str] = set()
    for fn in targets:
        params = list(inspect.signature(fn).parameters.values())
        names |= {p.name for p in params if p.kind in kinds and p.name != "self"}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return frozenset(names)
    return frozenset(names) if isinstance(factory, type) else None


def _gym_register(env_id: str, entry_point: Callable[..., TextEnv] | str) -> None:
    full = f"{GYM_NAMESPACE}/{env_id}"
    if full not in gym.registry:
        gym.register(id=full, entry_point=entry_point, disable_env_checker=True,
                     order_enforce=False)


def register_gymnasium() -> None:
    """Register every known env with gymnasium as ``crl_bench/<id>``."""
    for env_id, ep in _entry_points().items():
        _gym_register(env_id, ep.value)


def make_env(env_id: str, **kwargs: Any) -> TextEnv:
    """Instantiate environment ``env_id`` with keyword settings (e.g. ``max_steps=20``).

    Raises:
        KeyError: unknown id.
        TypeError: unknown setting, or the entry point did not return a :class:`TextEnv`.
        EnvUnavailableError: loading or constructing the env failed with an ``ImportError`` (its
            optional engine is not installed); the message names the env, the missing module, and for
            our envs the extra and the command that installs it (:func:`missing_engine_error`).  Other
            errors pass through unchanged.
    """
    try:
        factory = _resolve(env_id)
        env = factory(**kwargs)
    except ImportError as e:
        raise missing_engine_error(env_id, _missing_module(e), str(e)) from e
    if not isinstance(env, TextEnv):
        raise TypeError(f"{env_id}: entry point returned {type(env).__name__}, not a TextEnv")
    return env
