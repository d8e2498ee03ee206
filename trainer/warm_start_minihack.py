"""Warm-start examples of ``minihack-room``: episodes of training rooms and a scripted teacher's lesson.

The room's lesson is how to reach the stairs: find the ``>`` and step towards it every turn, diagonally
while both the row and the column differ (the shortest walk in NetHack's 8-direction moves, as many moves
as the larger of the two gaps).  The teacher knows where the stairs and the agent were (NLE's ``glyphs``
and ``blstats``, as the explorer of :mod:`crl_bench.envs.minihack.explore` reads them) and what the
episode did, and writes what a competent extractor writes from the transcript:

* a success: that lesson, with the moves the episode needed against the fewest possible (an ADD; an
  UPVOTE when the shown entry already says it; an UPDATE of a shown misleading entry);
* a failure: what went wrong, the moves that took the agent away from the stairs and the direction they
  lay in (an ADD; a DOWNVOTE of a shown misleading entry the episode followed).

Episodes are played on ``train`` tasks only (the ``eval`` rooms are never played), by a policy that steps
towards the stairs with a per-episode probability (0.95, 0.7 or 0.3) and moves at random otherwise, so
that both outcomes are common.  Facts used: NetHack 3.6 ``include/defsym.h`` (cmap 24 is the stairs down),
NLE ``blstats`` (index 0 x, 1 y).
"""

from __future__ import annotations

from typing import Any

from crl_bench.experience.records import episode_record
from crl_bench.experience.types import ExperienceEntry, Operation
from crl_bench.trainer.warm_start_items import TeacherItem, game_setup, guiding_entry, play_episode

__all__ = ["ROOM_LESSON", "MISLEADING", "room_items", "room_teacher_ops", "direction"]

#: the room's general lesson, as the teacher titles and words it
ROOM_LESSON = ("Walk straight to the stairs",
               "Find the stairs down '>' on the map and step towards them every turn: move diagonally while "
               "both the row and the column differ, then straight; any other move wastes one of the few "
               "moves there are.")
#: lessons a bad extractor writes, shown to some episodes as the entries that guided them
MISLEADING: tuple[tuple[str, str], ...] = (
    ("Explore the walls first", "Walk along the walls of the room before heading anywhere, so that nothing "
                                "is missed."),
    ("Stay near the start", "Take small steps around where you begin until the way becomes clear."),
    ("Go north first", "Always start by walking north to the top of the room, then look for the exit."),
)
_NAMES = {(-1, 0): "north", (1, 0): "south", (0, 1): "east", (0, -1): "west", (-1, 1): "northeast",
          (1, 1): "southeast", (1, -1): "southwest", (-1, -1): "northwest"}


def _sign(v: int) -> int:
    return (v > 0) - (v < 0)


def direction(frm: tuple[int, int], to: tuple[int, int]) -> str:
    """The compass move from ``frm`` towards ``to`` (``(row, col)`` cells; rows grow southwards), e.g.
    ``"southeast"``; ``""`` when they are the same cell."""
    d = (_sign(to[0] - frm[0]), _sign(to[1] - frm[1]))
    return _NAMES.get(d, "")


def _positions(env: Any) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """The agent's cell and the stairs' cell (``None`` when not on the map) of a MiniHack text env."""
    from nle import nethack

    keys = env._nle._observation_keys
    obs = env._nle.last_observation
    glyphs, bl = obs[keys.index("glyphs")], obs[keys.index("blstats")]
    agent = (int(bl[1]), int(bl[0]))
    stairs = None
    for y, x in zip(*(glyphs >= 0).nonzero()):
        g = int(glyphs[y, x])
        if nethack.glyph_is_cmap(g) and nethack.glyph_to_cmap(g) == 24:
            stairs = (int(y), int(x))
            break
    return agent, stairs


def room_teacher_ops(success: bool, moves: list[str], start: tuple[int, int], stairs: tuple[int, int] | None,
                     shown: list[ExperienceEntry], followed: bool) -> list[Operation]:
    """The one operation a competent extractor writes for a ``minihack-room`` episode (module docstring).

    Args:
        success: whether the agent reached the stairs.
        moves: the moves it made, in order.
        start, stairs: the agent's first cell and the stairs' cell (``None``: never seen).
        shown: the entries shown with the episode.
        followed: whether the episode followed a shown misleading entry.
    """
    good = [e for e in shown if (e.title, e.content) == ROOM_LESSON]
    bad = [e for e in shown if (e.title, e.content) in MISLEADING]
    fewest = max(abs(stairs[0] - start[0]), abs(stairs[1] - start[1])) if stairs else None
    if success:
        if good:
            return [Operation("UPVOTE", targets=(good[0].id,))]
        extra = (f" This room took {len(moves)} moves where {fewest} were enough." if fewest is not None
                 and len(moves) > fewest else f" This room took the fewest moves, {len(moves)}.")
        op = Operation("UPDATE", ROOM_LESSON[0], ROOM_LESSON[1] + extra, (bad[0].id,)) if bad else \
            Operation("ADD", ROOM_LESSON[0], ROOM_LESSON[1] + extra)
        return [op]
    if bad and followed:
        return [Operation("DOWNVOTE", targets=(bad[0].id,))]
    if good or stairs is None:
        return [Operation("NONE")]
    way = direction(start, stairs)
    astray = [m for m in dict.fromkeys(moves) if m != way]
    went = f"moved {', '.join(astray[:3])}" if astray else "did not keep moving"
    return [Operation("ADD", "Head for the stairs, not away",
                      f"The stairs down '>' lay to the {way} of the start, but the agent {went} and ran out of "
                      f"moves. Step towards the '>' every turn ({way} here) until standing on it.")]


def room_items(n: int, seed: int, env_kwargs: dict | None = None, max_steps: int | None = None,
               shown_p: float = 0.5) -> list[TeacherItem]:
    """``n`` teacher items of ``minihack-room`` on its ``train`` tasks.

    Args:
        n: items to make.
        seed: seed of the tasks, the policy and the entries shown.
        env_kwargs: the env's arguments (the run's ``rollout.env_kwargs``, e.g. the cpu preset's random
            rooms with ``goal_offset``).
        max_steps: the episode limit (the run's ``rollout.max_steps``; ``None``: the env's).
        shown_p: chance that an episode was guided by one entry: the room's lesson (half) or a misleading
            one, which the episode then follows for its first moves.

    Raises:
        ValueError: ``n`` < 0.
    """
    from crl_bench.envs.minihack.actions import MOVE_DELTAS

    env, rng = game_setup("minihack-room", n, seed, env_kwargs, max_steps)
    moves_all = list(MOVE_DELTAS)
    items = []
    try:
        for i in range(n):
            task = env.splits["train"][rng.randrange(len(env.splits["train"]))]
            shown, misleading = guiding_entry(rng, shown_p, "minihack-room", ROOM_LESSON, MISLEADING, 100 + i)
            greedy = rng.choice((0.95, 0.7, 0.3))
            first: dict[str, Any] = {}          # the agent's and the stairs' cells at the start

            def choose(k: int, shown=shown, misleading=misleading, greedy=greedy, first=first) -> str:
                agent, seen = _positions(env)
                if k == 0:
                    first.update(start=agent, stairs=seen)
                if misleading and k < 2:
                    return "north" if shown[0].title == "Go north first" else rng.choice(moves_all)
                if seen is not None and rng.random() < greedy:
                    return direction(agent, seen) or rng.choice(moves_all)
                return rng.choice(moves_all)

            traj = play_episode(env, task, i, choose)
            moves = [t.action for t in traj.turns]
            ops = room_teacher_ops(traj.success, moves, first["start"], first["stairs"], shown, misleading)
            items.append(TeacherItem(episode_record(traj), shown, ops, "room", ROOM_LESSON[1] if traj.success else "",
                                     meta={"task": task, **first}))
    finally:
        env.close()
    return items
