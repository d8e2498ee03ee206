"""Warm-start examples of ``sokoban``: episodes of training levels and a teacher that reads them with a solver.

The teacher knows each state's shortest solution (:func:`crl_bench.envs.sokoban.solve`, breadth-first
search) and so can say what a competent extractor would read from the transcript:

* a success: plan the pushes before moving, with the moves the episode needed against the shortest
  solution's (an ADD; an UPVOTE when the shown entry already says it; an UPDATE of a shown misleading
  entry);
* a failure where a push made the level unsolvable (the first push after which the solver finds no
  solution): which push it was and where the box ended, a corner that is not a target or a wall it can
  no longer leave (an ADD); a DOWNVOTE of a shown misleading entry the episode followed;
* any other failure: the moves ran out, with how many bumped into a wall or a blocked box and how many
  the shortest solution needed (an ADD).

Episodes are played on ``train`` levels only (which never equal an ``eval`` level in content, see
:mod:`crl_bench.envs.sokoban`), by a policy that follows the solver's next move with a per-episode
probability (0.95, 0.7 or 0.4) and moves at random otherwise, so that both outcomes are common.
"""

from __future__ import annotations

import random

from crl_bench.experience.records import episode_record
from crl_bench.experience.types import ExperienceEntry, Operation
from crl_bench.rollout import Trajectory, Turn
from crl_bench.trainer.warm_start_data import TeacherItem

__all__ = ["PLAN_LESSON", "MISLEADING", "sokoban_items", "sokoban_teacher_ops"]

#: the general lesson of a solved level, as the teacher titles and words it
PLAN_LESSON = ("Plan the pushes first",
               "Before moving, work out which target each box goes to and from which side it must be pushed; "
               "push a box only when the cell behind it is free and the push brings it nearer its target.")
#: lessons a bad extractor writes, shown to some episodes as the entries that guided them
MISLEADING: tuple[tuple[str, str], ...] = (
    ("Push boxes to the walls", "Push every box against the nearest wall first, where it is out of the way."),
    ("Keep pushing", "When a box is next to you, push it; moving boxes is always progress."),
)
_STEP = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def _corner(cell: tuple[int, int], walls: frozenset) -> bool:
    r, c = cell
    vertical = (r - 1, c) in walls or (r + 1, c) in walls
    horizontal = (r, c - 1) in walls or (r, c + 1) in walls
    return vertical and horizontal


def sokoban_teacher_ops(success: bool, moves: list[str], shortest: int | None, dead: dict | None,
                        bumps: int, shown: list[ExperienceEntry], followed: bool) -> list[Operation]:
    """The one operation a competent extractor writes for a Sokoban episode (module docstring).

    Args:
        success: whether every box reached a target.
        moves: the moves made, in order.
        shortest: the length of the shortest solution from the start (``None``: not found in the bound).
        dead: the push that made the level unsolvable (``{"step", "move", "cell", "corner"}``; ``None``
            when the level stayed solvable).
        bumps: moves that moved nothing (a wall or a blocked box).
        shown: the entries shown with the episode.
        followed: whether the episode followed a shown misleading entry.
    """
    good = [e for e in shown if (e.title, e.content) == PLAN_LESSON]
    bad = [e for e in shown if (e.title, e.content) in MISLEADING]
    if success:
        if good:
            return [Operation("UPVOTE", targets=(good[0].id,))]
        extra = (f" This level took {len(moves)} moves; the shortest solution has {shortest}."
                 if shortest is not None else "")
        if bad:
            return [Operation("UPDATE", PLAN_LESSON[0], PLAN_LESSON[1] + extra, (bad[0].id,))]
        return [Operation("ADD", PLAN_LESSON[0], PLAN_LESSON[1] + extra)]
    if bad and followed:
        return [Operation("DOWNVOTE", targets=(bad[0].id,))]
    if dead is not None:
        r, c = dead["cell"]
        where = (f"into the corner at row {r}, column {c}, which is not a target" if dead["corner"]
                 else f"to row {r}, column {c}, from where it can no longer reach a target")
        return [Operation("ADD", "Never push a box into a dead cell",
                          f"Move {dead['step'] + 1} pushed a box {dead['move']} {where}; after that the level "
                          f"could not be solved. Before each push, check that the box can still be pushed on "
                          f"to a target: a box in a corner that is not a target is stuck for good.")]
    if good:
        return [Operation("NONE")]
    need = f"; the shortest solution needed {shortest}" if shortest is not None else ""
    return [Operation("ADD", "Do not waste moves",
                      f"The moves ran out after {len(moves)}: {bumps} of them moved nothing (into a wall or a "
                      f"box that could not move){need}. Plan the route to each box before walking.")]


def sokoban_items(n: int, seed: int, env_kwargs: dict | None = None, max_steps: int | None = None,
                  shown_p: float = 0.5) -> list[TeacherItem]:
    """``n`` teacher items of ``sokoban`` on its ``train`` levels.

    Args:
        n: items to make.
        seed: seed of the levels, the policy and the entries shown.
        env_kwargs: the env's arguments (the run's ``rollout.env_kwargs``).
        max_steps: the episode limit (the run's ``rollout.max_steps``; ``None``: the env's).
        shown_p: chance that an episode was guided by one entry: the plan lesson (half) or a misleading
            one, which the episode then follows (it pushes the first box it can for its first moves).

    Raises:
        ValueError: ``n`` < 0.
    """
    from crl_bench.env_api import make_env
    from crl_bench.envs.sokoban import MOVES, solve

    if n < 0:
        raise ValueError(f"need n >= 0, got {n}")
    rng = random.Random(f"warm-start/sokoban/{seed}")
    kwargs = dict(env_kwargs or {})
    if max_steps:
        kwargs["max_steps"] = max_steps
    env = make_env("sokoban", **kwargs)
    moves_all = list(MOVES)
    items = []
    for i in range(n):
        task = env.splits["train"][rng.randrange(len(env.splits["train"]))]
        shown: list[ExperienceEntry] = []
        misleading = False
        if rng.random() < shown_p:
            misleading = rng.random() < 0.5
            title, content = rng.choice(MISLEADING) if misleading else PLAN_LESSON
            shown = [ExperienceEntry(200 + i, "sokoban", title, content)]
        greedy = rng.choice((0.95, 0.7, 0.4))
        obs, _ = env.reset(options={"task": task})
        start = env.state()
        plan = solve(start)
        shortest = None if plan is None else len(plan)
        traj = Trajectory(env_id=env.env_id, task=task, group_id=i, subgroup="free", task_prompt=env.task_prompt())
        moves: list[str] = []
        dead = None
        bumps = 0
        done = False
        while not done:
            before = env.state()
            if plan and rng.random() < greedy and not (misleading and len(moves) < 3):
                move = plan[0]
            else:
                move = rng.choice(moves_all)
            nxt, reward, terminated, truncated, info = env.step(f"<answer>{move}</answer>")
            after = env.state()
            traj.turns.append(Turn([], [], [], move, False, float(reward), observation=obs,
                                   reply=f"<answer>{move}</answer>"))
            traj.reward += float(reward)
            traj.steps += 1
            bumps += after == before
            pushed = after.boxes != before.boxes
            if plan and move == plan[0]:
                plan = plan[1:]                 # the solver's move: the rest of its solution still holds
            elif dead is None and not terminated:
                plan = solve(after)             # only a push can make a level unsolvable
            if pushed and plan is None and dead is None and not terminated:
                cell = (after.player[0] + _STEP[move][0], after.player[1] + _STEP[move][1])
                dead = {"step": len(moves), "move": move, "cell": cell,
                        "corner": _corner(cell, frozenset(after.walls)) and cell not in after.targets}
            moves.append(move)
            obs, done = nxt, terminated or truncated
            traj.success = bool(info.get("success", False))
        traj.final_obs = obs
        ops = sokoban_teacher_ops(traj.success, moves, shortest, dead, bumps, shown, misleading)
        items.append(TeacherItem(episode_record(traj), shown, ops, "sokoban", PLAN_LESSON[1] if traj.success else "",
                                 meta={"task": task, "shortest": shortest, "dead": dead}))
    return items
