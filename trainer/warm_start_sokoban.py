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

from crl_bench.experience.records import episode_record
from crl_bench.experience.types import ExperienceEntry, Operation
from crl_bench.trainer.warm_start_items import TeacherItem, game_setup, guiding_entry, play_episode

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
    from crl_bench.envs.sokoban import MOVES, solve

    env, rng = game_setup("sokoban", n, seed, env_kwargs, max_steps)
    moves_all = list(MOVES)
    items = []
    for i in range(n):
        task = env.splits["train"][rng.randrange(len(env.splits["train"]))]
        shown, misleading = guiding_entry(rng, shown_p, "sokoban", PLAN_LESSON, MISLEADING, 200 + i)
        greedy = rng.choice((0.95, 0.7, 0.4))
        env.reset(options={"task": task})
        plan = solve(env.state())
        st = {"plan": plan, "dead": None, "bumps": 0, "before": None}
        shortest = None if plan is None else len(plan)

        def choose(k: int, st=st, misleading=misleading, greedy=greedy) -> str:
            st["before"] = env.state()
            if st["plan"] and rng.random() < greedy and not (misleading and k < 3):
                return st["plan"][0]
            return rng.choice(moves_all)

        def after(k: int, move: str, terminated: bool, st=st) -> None:
            state = env.state()
            st["bumps"] += state == st["before"]
            pushed = state.boxes != st["before"].boxes
            if st["plan"] and move == st["plan"][0]:
                st["plan"] = st["plan"][1:]             # the solver's move: the rest of its solution holds
            elif st["dead"] is None and not terminated:
                st["plan"] = solve(state)               # only a push can make a level unsolvable
            if pushed and st["plan"] is None and st["dead"] is None and not terminated:
                cell = (state.player[0] + _STEP[move][0], state.player[1] + _STEP[move][1])
                st["dead"] = {"step": k, "move": move, "cell": cell,
                              "corner": _corner(cell, frozenset(state.walls)) and cell not in state.targets}

        traj = play_episode(env, task, i, choose, after)
        moves = [t.action for t in traj.turns]
        dead, bumps = st["dead"], st["bumps"]
        ops = sokoban_teacher_ops(traj.success, moves, shortest, dead, bumps, shown, misleading)
        items.append(TeacherItem(episode_record(traj), shown, ops, "sokoban", PLAN_LESSON[1] if traj.success else "",
                                 meta={"task": task, "shortest": shortest, "dead": dead}))
    return items
