"""Reusable env instances per env id for the rollout (:class:`EnvPool`), with prefetched resets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from crl_bench.env_api import TextEnv, make_env


class EnvPool:
    """Reusable env instances per env id (creation of NLE envs and ALFWorld workers is not free).

    Envs whose class sets ``prefetch_resets`` can be reset ahead of time with :meth:`prefetch`; a
    later :meth:`acquire_for` of the same (env id, task) gets the env with its reset under way.

    Args:
        env_kwargs: ``{env_id: {setting: value}}`` passed to :func:`make_env`.
        max_steps: per-episode action limit (0 = the env's default).
    """

    def __init__(self, env_kwargs: dict | None = None, max_steps: int = 0) -> None:
        self.env_kwargs = env_kwargs or {}
        self.max_steps = max_steps
        self._free: dict[str, list[TextEnv]] = {}
        self._ready: dict[tuple[str, int, int], list[TextEnv]] = {}     # (env, task, episode limit) -> envs
        self._prefetchable: dict[str, bool] = {}
        self.prefetch_hits = 0

    def acquire(self, env_id: str) -> TextEnv:
        """A free env of ``env_id`` (one released earlier, else a new one from :meth:`make`)."""
        free = self._free.setdefault(env_id, [])
        if free:
            return free.pop()
        env = self.make(env_id)
        self._prefetchable[env_id] = bool(getattr(env, "prefetch_resets", False))
        return env

    def make(self, env_id: str) -> TextEnv:
        """A new env of ``env_id`` with the pool's settings (``env_kwargs``, ``max_steps``); a remote
        pool (crl_bench/ray_backend.py) makes it in another process instead."""
        kwargs = dict(self.env_kwargs.get(env_id, {}))
        if self.max_steps:
            kwargs.setdefault("max_steps", self.max_steps)
        return make_env(env_id, **kwargs)

    def acquire_for(self, env_id: str, task: int, max_steps: int = 0) -> tuple[TextEnv, bool]:
        """An env for ``task``: ``(env, True)`` when a prefetched env has its reset to ``task`` (with the
        episode limit ``max_steps``, 0 = the env's) under way (finish it with ``reset_wait``), else
        ``(env, False)``."""
        ready = self._ready.get((env_id, int(task), int(max_steps)))
        if ready:
            self.prefetch_hits += 1
            return ready.pop(), True
        return self.acquire(env_id), False

    def prefetch(self, specs: Sequence[Any]) -> int:
        """Start the resets of ``specs`` (the rollout's ``EpisodeSpec``s: ``env_id``, ``task``, ``max_steps``,
        ``reset_options()``) whose env sets ``prefetch_resets``; returns how many started.

        An env that fails to start its reset is dropped (the later episode resets normally)."""
        n = 0
        for s in specs:
            if self._prefetchable.get(s.env_id) is False:
                continue
            env = self.acquire(s.env_id)
            if not getattr(env, "prefetch_resets", False):
                self.release(s.env_id, env)
                continue
            try:
                env.reset_async(options=s.reset_options())
            except Exception:  # noqa: BLE001 - a broken env is replaced; the episode resets later
                self.discard(env)
                continue
            self._ready.setdefault((s.env_id, int(s.task), int(s.max_steps)), []).append(env)
            n += 1
        return n

    def release(self, env_id: str, env: TextEnv) -> None:
        self._free.setdefault(env_id, []).append(env)

    def idle_envs(self) -> list[TextEnv]:
        """Envs the pool holds now (free or with a prefetched reset), e.g. to read worker statistics."""
        return [e for envs in list(self._free.values()) + list(self._ready.values()) for e in envs]

    def discard(self, env: TextEnv) -> None:
        """Drop a broken env (it is closed; a fresh one is created on the next acquire)."""
        try:
            env.close()
        except Exception:  # noqa: BLE001 - a broken env may fail to close; it is dropped either way
            pass

    def close(self) -> None:
        for envs in list(self._free.values()) + list(self._ready.values()):
            for env in envs:
                try:
                    env.close()
                except Exception:  # noqa: BLE001 - closing is best effort at shutdown
                    pass
        self._free.clear()
        self._ready.clear()
