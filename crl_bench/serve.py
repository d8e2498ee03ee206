"""Serving a crl-bench env to other trainers over OpenEnv's protocol (``crl-bench serve``).

OpenEnv (the ``openenv-core`` package, meta-pytorch/OpenEnv) defines an env server with a WebSocket
session protocol at ``/ws`` (messages ``reset``, ``step``, ``state``, ``close``; replies ``observation``,
``state`` or ``error``) and stateless HTTP endpoints (``/reset``, ``/step``, ``/state``, ``/schema``,
``/metadata``, ``/health``); TRL, SkyRL and others consume it. This module puts any registered
:class:`~crl_bench.env_api.TextEnv` behind that server, using openenv-core's own server
(:func:`openenv.core.env_server.create_fastapi_app`) and message types, so that what another trainer
sees is exactly what our rollout sees:

- **action** (:class:`ReplyAction`): ``{"reply": "<the model's whole reply>"}``, parsed by the env's own
  parser (``<answer>ACTION</answer>``, :class:`~crl_bench.env_api.AnswerParser`); a malformed reply is
  an invalid action fed back in the observation, as in our rollout, never an error.
- **observation** (:class:`TextObservation`): the observation text, the task's goal, the admissible
  actions (``None`` for an open action set), ``terminated`` / ``truncated`` and the env's ``info``; the
  reset observation also carries the env's rules (``system_prompt``) and how to reply
  (``reply_instruction``), which a trainer puts in its prompt.
- **reset kwargs**: ``task`` (a task id; the same id gives the same task, so a GRPO group shares one),
  ``split`` (default: the served split), ``seed`` (the task id when ``task`` is absent, as
  :meth:`TextEnv.reset`), ``max_steps`` (this episode's action limit, an evaluation protocol's) and
  ``episode_id``; with neither task nor seed, a uniformly drawn task of the split. Any other key is
  refused, naming it.
- **state** (:class:`EpisodeState`): the episode's env, split, task id, the task's content hash (its
  fingerprint, :meth:`TextEnv.task_fingerprint`, hashed as in a task panel) and the panel hash of the
  served split's panel when the task is on it, so a result obtained through the server can be cited
  with the same panel hash as ``crl-bench eval`` (docs/evaluation.md "Task panels").

Every WebSocket session has its own env instance (``SUPPORTS_CONCURRENT_SESSIONS``; at most
``max_sessions`` at once). An env that raises mid-episode (a crashed simulator worker) is closed and
rebuilt at the next reset. Docs: docs/serving.md.
"""

from __future__ import annotations

import functools
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from openenv.core.env_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, ConcurrencyConfig, EnvironmentMetadata, Observation, State
from pydantic import Field

from crl_bench.env_api import TextEnv

__all__ = ["EpisodeState", "ReplyAction", "ServeError", "ServedEnv", "ServedSession", "TextObservation",
           "make_app"]

RESET_KEYS = frozenset({"task", "split", "seed", "max_steps", "episode_id"})
"""The keyword arguments a served env's ``reset`` accepts."""


class ServeError(ValueError):
    """A request the served env refuses (an unknown reset key, a task outside the split, a step
    without an episode); the server answers it with the protocol's error message."""


class ReplyAction(Action):
    """One actor turn: the model's whole reply, parsed by the env like in our rollout."""

    reply: str = Field(..., max_length=1 << 16,
                       description="the model's reply; the env reads the last <answer>ACTION</answer> block")


class TextObservation(Observation):
    """What the env shows after a reset or a step (``done``: terminated or truncated; ``reward``: the
    step's reward, ``None`` at reset)."""

    text: str = Field(default="", description="the observation text, as our rollout shows it")
    task: int | None = Field(default=None, description="the episode's task id")
    split: str | None = Field(default=None, description="the split the task belongs to")
    task_prompt: str = Field(default="", description="one line stating the task's goal")
    system_prompt: str = Field(default="", description="the env's rules and answer format (reset only)")
    reply_instruction: str = Field(default="", description="how to reply, the last line of a prompt (reset only)")
    admissible_actions: list[str] | None = Field(default=None,
                                                 description="the legal actions now; None for an open action set")
    terminated: bool = Field(default=False, description="the episode ended by success or failure")
    truncated: bool = Field(default=False, description="the episode ended at its action limit")
    info: dict[str, Any] = Field(default_factory=dict,
                                 description="the env's info: success, invalid_action, steps, ... (env_api.TextEnv)")


class EpisodeState(State):
    """The session's episode: what it runs and how to cite it (``episode_id``, ``step_count`` from
    OpenEnv's ``State``)."""

    env: str = ""
    split: str | None = None
    task: int | None = None
    task_hash: str | None = Field(default=None, description="content hash of the task's fingerprint "
                                                            "(crl_bench/results/panel.py task_entry)")
    panel_hash: str | None = Field(default=None, description="hash of the served split's panel, when the "
                                                             "task is on it")
    max_steps: int = 0
    done: bool = True
    success: bool = False
    invalid_actions: int = 0


class ServedEnv:
    """What every session of one server shares: the env id, how to make the env, the served split, its
    task panel and a cache of task hashes.

    Args:
        env_id: a registered env id.
        make: builds a new env instance with the served settings (``EnvPool.make``).
        split: the default split of a reset without ``split``.
        panel: the served split's panel (``build_panel``), or ``None`` (a training split).
    """

    def __init__(self, env_id: str, make: Callable[[], TextEnv], split: str,
                 panel: dict[str, Any] | None = None) -> None:
        self.env_id = env_id
        self.make = make
        self.split = split
        self.panel = panel
        self._panel_tasks = {int(t["task"]): t["hash"] for t in (panel or {}).get("tasks", [])}
        self._hashes: dict[int, str] = dict(self._panel_tasks)
        self._lock = threading.Lock()
        self._fingerprint_env: TextEnv | None = None

    def panel_hash_of(self, split: str, task: int) -> str | None:
        """The served panel's hash when ``task`` of ``split`` is on it, else ``None``."""
        if self.panel is None or split != self.panel["split"] or task not in self._panel_tasks:
            return None
        return self.panel["panel_hash"]

    def task_hash(self, task: int) -> str:
        """The content hash of ``task`` (its panel entry's ``hash``). Tasks off the panel are
        fingerprinted on an env of the server's own (never a session's, whose episode a fingerprint
        reset would end), once each."""
        from crl_bench.results.panel import task_entry

        with self._lock:
            if task not in self._hashes:
                if self._fingerprint_env is None:
                    self._fingerprint_env = self.make()
                self._hashes[task] = task_entry(task, self._fingerprint_env.task_fingerprint(task))["hash"]
            return self._hashes[task]

    def close(self) -> None:
        """Close the server's fingerprinting env."""
        with self._lock:
            if self._fingerprint_env is not None:
                self._fingerprint_env.close()
                self._fingerprint_env = None


class ServedSession(Environment[ReplyAction, TextObservation, EpisodeState]):
    """One OpenEnv session: its own env instance (made at its first reset, so the stateless HTTP
    endpoints that make a session per request stay cheap), one episode at a time.

    ``reset``, ``step`` and ``state`` follow OpenEnv's ``Environment``; errors the client can fix raise
    :class:`ServeError`, which the server turns into the protocol's error reply.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, served: ServedEnv) -> None:
        super().__init__()
        self.served = served
        self._env: TextEnv | None = None
        self._state = EpisodeState(env=served.env_id)
        self._split: str | None = None
        self._rng = None

    def _task_for(self, split: str, task: Any, seed: Any) -> int:
        env = self._env
        assert env is not None
        if split not in env.splits:
            raise ServeError(f"{self.served.env_id}: unknown split {split!r}; known: {', '.join(env.splits)}")
        ids: Sequence[int] = env.task_ids(split)
        if task is None and seed is not None:
            task = seed
        if task is None:
            import numpy as np

            if self._rng is None:
                self._rng = np.random.default_rng()
            return int(ids[int(self._rng.integers(len(ids)))])
        try:
            tid = env.check_task(task)
        except KeyError as e:
            raise ServeError(str(e.args[0])) from None
        if tid not in ids:
            raise ServeError(f"{self.served.env_id}: task {tid} is not in split {split!r}")
        return tid

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> TextObservation:
        """Start an episode (see the module docstring for the keys).

        Raises:
            ServeError: an unknown key, an unknown split, a task id outside the split, a bad ``max_steps``.
        """
        unknown = sorted(set(kwargs) - RESET_KEYS)
        if unknown:
            raise ServeError(f"unknown reset key(s) {', '.join(map(repr, unknown))}; "
                             f"a reset takes {', '.join(sorted(RESET_KEYS))}")
        if self._env is None:
            self._env = self.served.make()
        split = kwargs.get("split") or self.served.split
        task = self._task_for(split, kwargs.get("task"), seed)
        options: dict[str, Any] = {"task": task}
        if kwargs.get("max_steps") is not None:
            options["max_steps"] = kwargs["max_steps"]
        try:
            obs, info = self._env.reset(options=options)
        except ValueError as e:                  # a max_steps the env refuses
            raise ServeError(str(e)) from None
        except Exception:
            self._discard_env()
            raise
        self._split = split
        self._state = EpisodeState(env=self.served.env_id, episode_id=episode_id or uuid.uuid4().hex,
                                   split=split, task=task, max_steps=self._env.episode_max_steps, done=False,
                                   panel_hash=self.served.panel_hash_of(split, task))
        return self._observation(obs, info, reward=None, terminated=False, truncated=False, first=True)

    def step(self, action: ReplyAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        """Apply one reply to the session's episode.

        Raises:
            ServeError: no episode (reset first) or the episode is over.
        """
        if self._env is None or self._state.task is None:
            raise ServeError("no episode in this session: send a reset first")
        if self._state.done:
            raise ServeError("the episode is over: send a reset to start the next")
        try:
            obs, reward, terminated, truncated, info = self._env.step(action.reply)
        except Exception:
            self._discard_env()
            raise
        self._state.step_count = int(info.get("steps", self._state.step_count + 1))
        self._state.done = bool(terminated or truncated)
        self._state.success = bool(info.get("success", False))
        self._state.invalid_actions = int(info.get("invalid_actions", 0))
        return self._observation(obs, info, reward=float(reward), terminated=terminated, truncated=truncated,
                                 first=False)

    @property
    def state(self) -> EpisodeState:
        """The session's episode, with the task's content hash (computed on first request per task)."""
        if self._state.task is not None and self._state.task_hash is None:
            self._state.task_hash = self.served.task_hash(self._state.task)
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        """The env id, its splits and the served panel."""
        from crl_bench.commands.envs import env_doc

        panel = self.served.panel
        shown = f"; panel {panel['panel_hash']} ({panel['split']}, {len(panel['tasks'])} tasks)" if panel else ""
        return EnvironmentMetadata(name=self.served.env_id, version=_version(),
                                   description=f"crl-bench env {self.served.env_id}, served split "
                                               f"{self.served.split}{shown}; see {env_doc(self.served.env_id)}")

    def close(self) -> None:
        """Close the session's env."""
        self._discard_env()

    def _discard_env(self) -> None:
        env, self._env = self._env, None
        self._state = EpisodeState(env=self.served.env_id)
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - a crashed env may fail to close; the session goes on
                pass

    def _observation(self, obs: str, info: dict[str, Any], *, reward: float | None, terminated: bool,
                     truncated: bool, first: bool) -> TextObservation:
        env = self._env
        assert env is not None
        adm = env.admissible_actions()
        return TextObservation(
            text=obs, task=self._state.task, split=self._split, task_prompt=env.task_prompt(),
            system_prompt=env.system_prompt if first else "",
            reply_instruction=env.reply_format.instruction if first else "",
            admissible_actions=list(adm) if adm is not None else None,
            terminated=bool(terminated), truncated=bool(truncated), info=_jsonable(info),
            done=bool(terminated or truncated), reward=reward)


def _version() -> str:
    from crl_bench import __version__

    return __version__


def _jsonable(value: Any) -> Any:
    """``value`` with numpy scalars and tuples turned into JSON types (an env's info may hold them)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


def make_app(served: ServedEnv, max_sessions: int = 8, session_timeout: float | None = None):
    """The FastAPI app of OpenEnv's server in front of ``served``: ``/ws`` sessions (at most
    ``max_sessions`` at once, each with its own env; idle ones closed after ``session_timeout`` s
    when given) and the stateless HTTP endpoints. A :class:`ServeError` on an HTTP endpoint is
    answered with status 400 and its message.

    Raises:
        ValueError: ``max_sessions`` below 1 or ``session_timeout`` not positive.
    """
    from fastapi import Request
    from fastapi.responses import JSONResponse

    if max_sessions < 1:
        raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
    if session_timeout is not None and session_timeout <= 0:
        raise ValueError(f"session_timeout must be > 0 seconds, got {session_timeout}")
    app = create_fastapi_app(functools.partial(ServedSession, served), ReplyAction, TextObservation,
                             concurrency_config=ConcurrencyConfig(max_concurrent_envs=max_sessions,
                                                                  session_timeout=session_timeout))

    async def refused(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": str(exc)})

    app.add_exception_handler(ServeError, refused)
    app.router.on_shutdown.append(served.close)
    return app
