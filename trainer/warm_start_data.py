"""The examples of an extractor warm start: episodes of practice contexts, and what a scripted teacher
would have the extractor answer for each.

An extractor too small to write a correct lesson gives co-evolution nothing to reinforce
(docs/diagnostics.md).  A user with a small extractor would first fine-tune it on examples of the job:
a finished episode in, the operations a competent extractor writes out.  This module makes those
examples for the diagnostics; :mod:`crl_bench.trainer.extractor_sft` renders them in the exact prompt
and reply format of the loop's extractor and fine-tunes on them.

* The episodes are played in *practice worlds* (:func:`crl_bench.envs.diag.practice_contexts`):
  the diagnostic's observations, goals and lesson wording, with invented context names and their own
  solutions, so that no example holds an evaluation task's answer.  The held-out check plays the env's
  own contexts (:func:`diag_items` with ``world=None``).
* Each episode is an :class:`~crl_bench.rollout.Trajectory` read by the loop's own
  :func:`~crl_bench.experience.records.episode_record`, so the extractor sees it as it sees a rollout's.
  Some episodes were guided: the extractor is shown the entries that guided them (a correct lesson of
  the episode's context, a wrong one, or another context's), as the loop shows retrieved entries.
* The teacher (:func:`diag_teacher_ops`) writes one operation, the one a competent extractor writes
  (the loop's extractor writes one operation per reply, ``extractor.one_op_per_reply``): after a
  success, the lesson the episode holds (the env's own lesson writer, :meth:`DiagEnv.lesson_for`) as an
  ADD, as an UPDATE of a shown wrong lesson of the context, or an UPVOTE of a shown correct one; after a
  failure that followed a shown lesson of its context, a DOWNVOTE of it; otherwise NONE (a failure of
  the diagnostics only says which action was wrong, which is not a lesson worth keeping).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from crl_bench.envs.diag import DIAG_ENVS, DIAG_SPLITS, N_CONTEXTS, DiagEnv
from crl_bench.experience.records import episode_record
from crl_bench.experience.types import ExperienceEntry, Operation
from crl_bench.trainer.warm_start_items import TeacherItem, play_episode

__all__ = ["diag_items", "diag_teacher_ops", "teacher_items", "TEACHERS", "DIAG_TEACHERS", "VALIDATION_OFFSET"]

#: the diagnostics, whose teacher plays practice worlds and whose lessons ``grade_lesson`` judges
DIAG_TEACHERS: tuple[str, ...] = DIAG_ENVS
#: env ids that have a teacher (``minihack-room``'s: :mod:`crl_bench.trainer.warm_start_minihack`;
#: ``sokoban``'s: :mod:`crl_bench.trainer.warm_start_sokoban`)
TEACHERS: tuple[str, ...] = DIAG_TEACHERS + ("minihack-room", "sokoban")
#: the validation set's practice worlds start this far past the examples' last world
VALIDATION_OFFSET = 10_000


def _wrong_actions(env: DiagEnv, task: int, rng: random.Random) -> list[str]:
    """A sequence as long as the solution of ``task`` that is not the solution."""
    solution = env.solution(task)
    actions = env.admissible_actions()
    while True:
        seq = [rng.choice(actions) for _ in solution]
        if seq != solution:
            return seq


def diag_teacher_ops(env: DiagEnv, task: int, success: bool, played: Sequence[str],
                     shown: Sequence[ExperienceEntry]) -> list[Operation]:
    """The one operation a competent extractor writes for an episode of ``task`` (module docstring).

    Args:
        env: the diagnostic (its practice world or its own contexts).
        task: the episode's task id.
        success: whether it succeeded.
        played: the actions it took, in order.
        shown: the entries shown with it.

    Returns:
        A one-element list: ADD / UPDATE / UPVOTE / DOWNVOTE / NONE.
    """
    context = env.context(task)
    own = [e for e in shown if context in env.grade_lesson(f"{e.title} {e.content}")["contexts"]]
    if success:
        lesson = env.lesson_for(task, env.solution(task))
        right = [e for e in own if env.grade_lesson(f"{e.title} {e.content}", context)["correct"]]
        if right:
            return [Operation("UPVOTE", targets=(right[0].id,))]
        if own:
            return [Operation("UPDATE", context, lesson, (own[0].id,))]
        return [Operation("ADD", context, lesson)]
    for e in own:
        said = env.grade_lesson(f"{e.title} {e.content}", context)
        if not said["correct"] and list(played) == said["actions"][:len(played)]:
            return [Operation("DOWNVOTE", targets=(e.id,))]
    return [Operation("NONE")]


def diag_items(env_id: str, n: int, seed: int, world: int | None = 0, worlds: int = 1,
               env_kwargs: dict | None = None, shown_p: float = 0.5, follow_p: float = 0.7,
               solve_p: float = 0.35) -> list[TeacherItem]:
    """``n`` teacher items of diagnostic ``env_id``.

    Args:
        env_id: ``diag-vault`` or ``diag-corridor``.
        n: items to make.
        seed: seed of the episodes, the entries shown and the policy.
        world: the first practice world (``worlds`` consecutive ones are used, the items spread over
            them), or ``None`` for the env's own contexts: then the tasks are those of the ``eval`` and
            ``eval_unseen`` splits (a held-out check); in a practice world, those of ``train``.
        env_kwargs: extra arguments of the env (e.g. a corridor's ``length``).
        shown_p: chance that an episode was guided by one entry: a correct lesson of its context
            (2 in 5), a wrong one (3 in 10) or another context's lesson (3 in 10).
        follow_p: chance that a guided episode plays the actions its own-context entry names.
        solve_p: chance that an episode plays its solution (otherwise uniform random actions), so that
            successes are common enough to teach from (1 in 8 at chance on the vault).

    Returns:
        ``n`` items, in the order made.

    Raises:
        ValueError: ``env_id`` has no teacher (:data:`TEACHERS`), ``n`` < 0 or ``worlds`` < 1.
    """
    from crl_bench.env_api import make_env

    if env_id not in DIAG_TEACHERS:
        raise ValueError(f"no practice worlds for env {env_id!r}; they exist for {', '.join(DIAG_TEACHERS)}")
    if n < 0 or worlds < 1:
        raise ValueError(f"need n >= 0 and worlds >= 1, got n={n}, worlds={worlds}")
    rng = random.Random(f"warm-start/{env_id}/{seed}/{world}")
    kwargs = dict(env_kwargs or {})
    envs = ([make_env(env_id, **kwargs)] if world is None
            else [make_env(env_id, practice_world=world + w, **kwargs) for w in range(worlds)])
    tasks = (list(DIAG_SPLITS["eval"]) + list(DIAG_SPLITS["eval_unseen"])) if world is None else None
    next_id = 1 + rng.randrange(1000)
    items = []
    for i in range(n):
        env = envs[i % len(envs)]
        task = rng.choice(tasks) if tasks is not None else rng.choice(DIAG_SPLITS["train"])
        context = env.context(task)
        shown: list[ExperienceEntry] = []
        plan: list[str] = []
        if rng.random() < shown_p:
            kind = rng.choices(("right", "wrong", "other"), (4, 3, 3))[0]
            if kind == "other":
                half = range(0, 8) if task % N_CONTEXTS < 8 else range(8, N_CONTEXTS)    # the same split
                other_ctx = rng.choice([c for c in half if c != task % N_CONTEXTS])
                other = task - task % N_CONTEXTS + other_ctx
                text = env.lesson_for(other, env.solution(other) if rng.random() < 0.5
                                      else _wrong_actions(env, other, rng))
                title = env.context(other)
            else:
                actions = env.solution(task) if kind == "right" else _wrong_actions(env, task, rng)
                text, title = env.lesson_for(task, actions), context
                if rng.random() < follow_p:
                    plan = list(actions)
            shown = [ExperienceEntry(next_id, env_id, title, text)]
            next_id += 1 + rng.randrange(50)
        if not plan and rng.random() < solve_p:
            plan = env.solution(task)
        traj = play_episode(env, task, i, lambda k, plan=plan, env=env: plan[k] if k < len(plan)
                            else rng.choice(env.admissible_actions()))
        played = [t.action for t in traj.turns if t.action]
        ops = diag_teacher_ops(env, task, traj.success, played, shown)
        lesson = env.lesson_for(task, env.solution(task)) if traj.success else ""
        items.append(TeacherItem(episode_record(traj), shown, ops, context, lesson,
                                 None if world is None else world + i % len(envs)))
    return items


def teacher_items(env_id: str, n: int, seed: int, part: str, *, worlds: int = 64, env_kwargs: dict | None = None,
                  max_steps: int | None = None) -> list[TeacherItem]:
    """``n`` teacher items of ``env_id`` for one part of a warm start.

    ``part``: ``train`` (the examples), ``validation`` (what picks a checkpoint) or ``heldout`` (reported
    only).  Diagnostics: the examples play practice worlds ``0 .. worlds - 1``, validation 16 practice
    worlds past :data:`VALIDATION_OFFSET` (never in the examples), held-out the env's own contexts.
    ``minihack-room`` and ``sokoban``: every part plays ``train`` tasks (the ``eval`` rooms and levels are
    never played), each part with its own seed.

    Raises:
        ValueError: ``env_id`` has no teacher (:data:`TEACHERS`) or ``part`` is unknown.
    """
    if part not in ("train", "validation", "heldout"):
        raise ValueError(f"part must be train, validation or heldout, got {part!r}")
    if env_id not in TEACHERS:
        raise ValueError(f"no warm-start teacher for env {env_id!r}; teachers exist for {', '.join(TEACHERS)}")
    offset = {"train": 0, "validation": 2, "heldout": 1}[part]
    if env_id == "minihack-room":
        from crl_bench.trainer.warm_start_minihack import room_items

        return room_items(n, seed + offset, env_kwargs, max_steps)
    if env_id == "sokoban":
        from crl_bench.trainer.warm_start_sokoban import sokoban_items

        return sokoban_items(n, seed + offset, env_kwargs, max_steps)
    if part == "train":
        return diag_items(env_id, n, seed, world=0, worlds=worlds, env_kwargs=env_kwargs)
    if part == "validation":
        return diag_items(env_id, n, seed + offset, world=worlds + VALIDATION_OFFSET, worlds=16, env_kwargs=env_kwargs)
    return diag_items(env_id, n, seed + offset, world=None, env_kwargs=env_kwargs)
