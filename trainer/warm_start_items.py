"""What every warm-start teacher shares (:mod:`crl_bench.trainer.warm_start_data`): the item a teacher
makes, an episode played into a :class:`~crl_bench.rollout.Trajectory`, the entry shown with a game's
episode, and a game teacher's env and generator."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from crl_bench.experience.transcripts import EpisodeRecord
from crl_bench.experience.types import ExperienceEntry, Operation
from crl_bench.rollout import Trajectory, Turn

__all__ = ["TeacherItem", "game_setup", "guiding_entry", "play_episode"]


@dataclass
class TeacherItem:
    """One warm-start example before rendering: an episode, the entries shown with it, the teacher's answer.

    Attributes:
        record: the episode as the extractor reads it.
        shown: the entries the extractor is shown (those that guided the episode; ids are bank ids).
        ops: the teacher's operations (one).
        context: the name of the episode's context.
        lesson: the lesson the episode holds when it succeeded (the env's wording), else ``""``.
        world: the practice world (``None``: the env's own contexts).
    """

    record: EpisodeRecord
    shown: list[ExperienceEntry]
    ops: list[Operation]
    context: str
    lesson: str = ""
    world: int | None = None
    meta: dict = field(default_factory=dict)


def play_episode(env: Any, task: int, group_id: int, choose: Callable[[int], str],
                 after: Callable[[int, str, bool], None] | None = None) -> Trajectory:
    """Play ``task`` of ``env`` (reset to it), taking ``choose(k)`` as the ``k``-th action (0-based; called
    just before the step, so it may read the env's state); ``after(k, action, terminated)`` is called just
    after each step.  Returns the :class:`~crl_bench.rollout.Trajectory` with the text fields the
    extractor reads (no tokens: nothing here is trained on the actor)."""
    obs, _ = env.reset(options={"task": task})
    traj = Trajectory(env_id=env.env_id, task=task, group_id=group_id, subgroup="free",
                      task_prompt=env.task_prompt())
    k = 0
    done = False
    while not done:
        action = choose(k)
        nxt, reward, terminated, truncated, info = env.step(f"<answer>{action}</answer>")
        traj.turns.append(Turn([], [], [], action, False, float(reward), observation=obs,
                               reply=f"<answer>{action}</answer>"))
        traj.reward += float(reward)
        traj.steps += 1
        if after is not None:
            after(k, action, terminated)
        obs, k = nxt, k + 1
        done = terminated or truncated
        traj.success = bool(info.get("success", False))
        traj.terminated, traj.truncated = terminated, truncated
    traj.final_obs = obs
    return traj


def game_setup(env_id: str, n: int, seed: int, env_kwargs: dict | None, max_steps: int | None
               ) -> tuple[Any, random.Random]:
    """The env (the run's ``env_kwargs``, the episode limit ``max_steps`` when given) and the seeded
    generator of a game teacher's ``n`` items.  Raises ``ValueError`` for ``n`` < 0."""
    from crl_bench.env_api import make_env

    if n < 0:
        raise ValueError(f"need n >= 0, got {n}")
    kwargs = dict(env_kwargs or {})
    if max_steps:
        kwargs["max_steps"] = max_steps
    return make_env(env_id, **kwargs), random.Random(f"warm-start/{env_id}/{seed}")


def guiding_entry(rng: random.Random, shown_p: float, env_id: str, lesson: tuple[str, str],
                  misleading: Sequence[tuple[str, str]], entry_id: int) -> tuple[list[ExperienceEntry], bool]:
    """The entry shown with a game's episode: none (chance ``1 - shown_p``), else ``lesson`` or one of
    ``misleading`` (even odds), as ``(entries, whether the entry is misleading)``."""
    if rng.random() >= shown_p:
        return [], False
    bad = rng.random() < 0.5
    title, content = rng.choice(list(misleading)) if bad else lesson
    return [ExperienceEntry(entry_id, env_id, title, content)], bad
