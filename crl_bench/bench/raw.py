"""Raw simulator access for the env benchmark: each env's game without its text wrapper.

:mod:`crl_bench.bench.env` times an env's text protocol (``reset`` / ``step`` with a reply) against the
bare game it wraps, reached through a :class:`RawSimulator` adapter. :func:`raw_simulator` picks the
adapter by the env's class: the registered class nearest in its method resolution order wins.

* any :class:`~crl_bench.env_api.TextEnv` (the fallback; e.g. Sokoban, which has no external simulator):
  :class:`GameLogicSimulator`, the env's own game hooks ``_reset_task`` / ``_apply``;
* MiniHack (``MiniHackTextEnv`` and its task subclasses): :class:`NLESimulator`, the wrapped NLE
  gymnasium env reset with the task's seeds and stepped with the action index, no rendering;
* ALFWorld (``AlfWorldEnv``): :class:`AlfWorldSimulator`, the reset or command sent to the env's worker
  process and its answer read back (``_submit_reset`` / ``_submit_apply``, then ``_reset_task`` /
  ``_apply``).

The adapters use the envs' private internals on purpose (the point is to skip the public wrapper): an env
that renames or changes them must update its adapter here (``tests/bench/test_bench_envs.py`` plays the raw
path against the text path). Driving the raw simulator leaves the env's protocol state (step counters,
last observation) stale: call ``env.reset`` before using ``env.step`` again. An env whose game runs in an
external simulator registers its adapter with :func:`register_raw_simulator`; classes are named by
``"module:QualName"`` so that no env module (NLE, TextWorld) is imported to build the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from crl_bench.env_api import TextEnv

__all__ = ["AlfWorldSimulator", "GameLogicSimulator", "NLESimulator", "RawSimulator", "raw_simulator",
           "register_raw_simulator"]


@runtime_checkable
class RawSimulator(Protocol):
    """The bare game of one env instance, driven by task ids and legal canonical action names."""

    def reset(self, task: int) -> None:
        """Start task ``task`` (same seeding as the env's ``reset``); no observation text, no ``info``."""

    def step(self, action: str) -> bool:
        """Apply the legal canonical ``action``; return whether the game ended (no reply parsing, no
        text rendering, no step limit)."""


#: builds the adapter for one env instance
RawSimulatorFactory = Callable[[Any], RawSimulator]

_REGISTRY: dict[str, RawSimulatorFactory] = {}


def _class_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def register_raw_simulator(env_class: type | str, factory: RawSimulatorFactory) -> None:
    """Use ``factory(env)`` as the raw simulator of every instance of ``env_class`` and its subclasses
    (unless a subclass has its own).

    Args:
        env_class: the env class, or its ``"module:QualName"`` (the module where the class is defined,
            e.g. ``"crl_bench.envs.minihack.env:MiniHackTextEnv"``), which keeps the env module unimported.
        factory: called with the env instance; returns a :class:`RawSimulator`. It may keep references
            to the env's internals for the env's lifetime.
    """
    _REGISTRY[env_class if isinstance(env_class, str) else _class_key(env_class)] = factory


def raw_simulator(env: TextEnv) -> RawSimulator:
    """The raw simulator adapter of ``env`` (see the module docstring).

    Raises:
        TypeError: no adapter is registered for ``env``'s class or its bases (not a
            :class:`~crl_bench.env_api.TextEnv`).
    """
    for cls in type(env).__mro__:
        factory = _REGISTRY.get(_class_key(cls))
        if factory is not None:
            return factory(env)
    raise TypeError(f"no raw simulator for {type(env).__qualname__} (not a TextEnv)")


class GameLogicSimulator:
    """The game logic of an env that implements it itself: ``reset`` is the env's ``_reset_task(task)``,
    ``step`` its ``_apply(action)`` (its ``terminated``)."""

    def __init__(self, env: TextEnv) -> None:
        self._reset_task = env._reset_task
        self._apply = env._apply

    def reset(self, task: int) -> None:
        """Start task ``task`` through the env's ``_reset_task``."""
        self._reset_task(task)

    def step(self, action: str) -> bool:
        """Apply ``action`` through the env's ``_apply``; returns its ``terminated``."""
        return bool(self._apply(action)[1])


class NLESimulator:
    """The NLE gymnasium env a MiniHack env wraps (its ``_env``, made once per env), seeded per task as
    the env's ``reset`` does (:func:`~crl_bench.envs.minihack.env.task_seeds`) and stepped with the action
    index (the env's ``_action_index``); nothing is rendered."""

    def __init__(self, env: Any) -> None:
        from crl_bench.envs.minihack.env import task_seeds

        self._text_env = env
        self._task_seeds = task_seeds
        self._nle = env._nle
        self._gym_step = env._env.step
        self._gym_reset = env._env.reset
        self._action_index = env._action_index

    def reset(self, task: int) -> None:
        """Seed NLE for task ``task`` and reset it.

        Raises:
            RuntimeError: the env was closed.
        """
        if self._text_env._closed:
            raise RuntimeError(f"{self._text_env.env_id}: reset() after close()")
        core, disp = self._task_seeds(task)
        self._nle.seed(core, disp, False)
        self._gym_reset()

    def step(self, action: str) -> bool:
        """Step NLE with the index of ``action``; returns ``terminated or truncated``.

        Raises:
            KeyError: ``action`` is not one of the env's action names.
        """
        _obs, _r, term, trunc, _info = self._gym_step(self._action_index[action])
        return bool(term or trunc)


class AlfWorldSimulator:
    """The TextWorld game in an ALFWorld env's worker process: the request is sent
    (``_submit_reset`` / ``_submit_apply``) and its answer read back (``_reset_task`` / ``_apply``, which
    only parse the worker's reply), as one blocking call."""

    def __init__(self, env: Any) -> None:
        self._submit_reset = env._submit_reset
        self._reset_task = env._reset_task
        self._submit_apply = env._submit_apply
        self._apply = env._apply

    def reset(self, task: int) -> None:
        """Load task ``task``'s game in the worker (starting the worker if needed).

        Raises:
            EnvWorkerError: the worker failed or timed out.
        """
        self._submit_reset(task)
        self._reset_task(task)

    def step(self, action: str) -> bool:
        """Send the command ``action``; returns whether the game was won.

        Raises:
            EnvWorkerError: the worker failed or timed out.
        """
        self._submit_apply(action)
        return bool(self._apply(action)[1])


register_raw_simulator(TextEnv, GameLogicSimulator)
register_raw_simulator("crl_bench.envs.minihack.env:MiniHackTextEnv", NLESimulator)
register_raw_simulator("crl_bench.envs.alfworld.env:AlfWorldEnv", AlfWorldSimulator)
