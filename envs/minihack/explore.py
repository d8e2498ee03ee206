"""A scripted explorer for the MiniHack navigation tasks: the check that every task of a split can be
solved with the env's own actions (``python -m crl_bench.envs.minihack.explore``).

It plays through the env's ``step`` like the actor, choosing each move from the symbols the text
rendering is made from (NLE's ``glyphs`` of the dungeon and the agent's position in ``blstats``): the
stairs when they have been seen, else the nearest seen cell it has not stood on whose neighbours are
still unseen (frontier exploration, breadth-first over the cells seen so far). Doorways are entered and
left orthogonally only (NetHack forbids diagonal moves there); a target the agent fails to reach three
times counts as blocked. It attacks nothing on purpose: a monster in the way is walked into. With
``search`` and ``kick`` among the env's actions (the corridor task) it also searches for hidden doors
and passages when nothing else is reachable, and kicks closed doors that do not open.

Facts used: NetHack 3.6 ``include/defsym.h`` (cmap 0 stone, 1-11 walls, 12 doorless doorway, 13/14
open doors, 15/16 closed doors, 17 bars, 18 tree, 19/20 floor, 21/22 corridor, 23-26 stairs and
ladders, 32 water (S_pool), 34 lava), NLE ``blstats`` (index 0 x, 1 y).
"""

from __future__ import annotations

import argparse
from collections import deque
from typing import Any

import numpy as np
from nle import nethack

from .actions import MOVE_DELTAS

__all__ = ["explore_episode", "main"]

_DOORS = frozenset(range(12, 17))            # doorless doorway, open and closed doors
_PASSABLE_CMAP = frozenset({12, 13, 14, 15, 16, 19, 20, 21, 22, 23, 24, 25, 26})
_STAIRS_DOWN = 24


def _cell(glyph: int) -> str:
    """``"unseen"``, ``"blocked"``, ``"door"``, ``"stairs"`` or ``"open"`` for a dungeon glyph."""
    if glyph == nethack.GLYPH_CMAP_OFF:                       # S_stone: unseen or solid rock
        return "unseen"
    if nethack.glyph_is_cmap(glyph):
        c = nethack.glyph_to_cmap(glyph)
        if c == _STAIRS_DOWN:
            return "stairs"
        if c in _DOORS:
            return "door"
        return "open" if c in _PASSABLE_CMAP else "blocked"
    if nethack.glyph_is_trap(glyph):
        return "blocked"                                       # traps are walked around
    return "open"                                              # objects, monsters, the agent


#: glyph -> its :func:`_cell` kind, for every glyph (a look-up per cell instead of a call)
_KINDS = np.array([_cell(g) for g in range(nethack.MAX_GLYPH + 1)], dtype=object)


def _moves(kinds: np.ndarray, y: int, x: int, blocked: set[tuple[int, int]]):
    """The moves ``(name, (y2, x2))`` from ``(y, x)`` onto seen passable cells."""
    h, w = kinds.shape
    for name, (dy, dx) in MOVE_DELTAS.items():
        y2, x2 = y + dy, x + dx
        if not (0 <= y2 < h and 0 <= x2 < w) or (y2, x2) in blocked:
            continue
        k = kinds[y2, x2]
        if k in ("unseen", "blocked"):
            continue
        if dy and dx and ("door" in (k, kinds[y, x])):        # no diagonal moves into or out of a doorway
            continue
        yield name, (y2, x2)


def _next_move(kinds: np.ndarray, pos: tuple[int, int], visited: set[tuple[int, int]],
               blocked: set[tuple[int, int]]) -> str | None:
    """The first move of a shortest path to the stairs when a path over seen cells reaches them, else to
    the nearest frontier cell not stood on; ``None`` when neither is reachable."""
    h, w = kinds.shape

    def frontier(y: int, x: int) -> bool:
        return (y, x) not in visited and any(
            0 <= y + dy < h and 0 <= x + dx < w and kinds[y + dy, x + dx] == "unseen"
            for dy, dx in MOVE_DELTAS.values())

    first: dict[tuple[int, int], str] = {pos: ""}
    queue = deque([pos])
    nearest: tuple[int, int] | None = None          # the nearest frontier cell, while no stairs are reached
    while queue:
        cur = queue.popleft()
        if cur != pos:
            if kinds[cur] == "stairs":
                return first[cur]
            if nearest is None and frontier(*cur):
                nearest = cur
        for name, nxt in _moves(kinds, *cur, blocked):
            if nxt not in first:
                first[nxt] = first[cur] or name
                queue.append(nxt)
    return first[nearest] if nearest is not None else None


def _next_search(kinds: np.ndarray, pos: tuple[int, int], searched: dict[tuple[int, int], int],
                 blocked: set[tuple[int, int]], searches: int) -> str | None:
    """``"search"`` when the agent stands on a cell to search from, else the first move towards the
    nearest one: a reachable cell next to a wall or an unseen cell, searched fewer than ``searches``
    times; ``None`` when none is left."""
    h, w = kinds.shape

    def worth(y: int, x: int) -> bool:
        return searched.get((y, x), 0) < searches and any(
            0 <= y + dy < h and 0 <= x + dx < w and kinds[y + dy, x + dx] in ("unseen", "blocked")
            for dy, dx in MOVE_DELTAS.values())

    first: dict[tuple[int, int], str] = {pos: ""}
    queue = deque([pos])
    while queue:
        cur = queue.popleft()
        if worth(*cur):
            return first[cur] or "search"
        for name, nxt in _moves(kinds, *cur, blocked):
            if nxt not in first:
                first[nxt] = first[cur] or name
                queue.append(nxt)
    return None


def _closed_door(glyph: int) -> bool:
    return bool(nethack.glyph_is_cmap(glyph)) and nethack.glyph_to_cmap(glyph) in (15, 16)


def explore_episode(env: Any, task: int, max_steps: int | None = None, searches: int = 10,
                    kicks: int = 8) -> tuple[bool, int]:
    """Play task ``task`` of the MiniHack text env ``env`` with the explorer.

    Where the env's actions include them, the explorer also searches for hidden passages when no
    stairs and no frontier are reachable (``searches`` times from each cell next to a wall or an
    unseen cell, nearest first) and kicks a closed door it failed to walk through (at most ``kicks``
    times; ``kick`` asks for a direction, the next reply).

    Args:
        env: a :class:`~crl_bench.envs.minihack.env.MiniHackTextEnv` with the 8 compass moves.
        task: a task id of its splits.
        max_steps: the episode's action limit (default: the env's).

    Returns:
        ``(success, actions taken)``; nothing left to try ends the episode as a failure.
    """
    opts = {"task": task, **({"max_steps": max_steps} if max_steps else {})}
    env.reset(options=opts)
    actions = set(env.admissible_actions() or ())
    keys = env._nle._observation_keys
    gi, bi = keys.index("glyphs"), keys.index("blstats")
    visited: set[tuple[int, int]] = set()
    blocked: set[tuple[int, int]] = set()
    failed: dict[tuple[int, int], int] = {}
    searched: dict[tuple[int, int], int] = {}
    kicked: dict[tuple[int, int], int] = {}
    plan: list[str] = []                            # replies decided together (kick, then its direction)
    steps, target, move = 0, None, ""
    while True:
        obs = env._nle.last_observation
        glyphs, bl = obs[gi], obs[bi]
        pos = (int(bl[1]), int(bl[0]))
        if target is not None and pos != target:
            # the move did not take the agent there (a wall, a locked door, a monster): a closed door is
            # kicked; any other target missed three times (a monster may die) counts as blocked
            if "kick" in actions and _closed_door(int(glyphs[target])) and kicked.get(target, 0) < kicks:
                kicked[target] = kicked.get(target, 0) + 1
                plan = ["kick", move]
            else:
                failed[target] = failed.get(target, 0) + 1
                if failed[target] >= 3:
                    blocked.add(target)
        visited.add(pos)
        target = None
        if plan:
            act = plan.pop(0)
        else:
            kinds = _KINDS[glyphs]
            act = _next_move(kinds, pos, visited, blocked)
            if act is None and "search" in actions:
                act = _next_search(kinds, pos, searched, blocked, searches)
                if act == "search":
                    searched[pos] = searched.get(pos, 0) + 1
            if act is None:
                return False, steps
            if act in MOVE_DELTAS:
                move = act
                dy, dx = MOVE_DELTAS[act]
                target = (pos[0] + dy, pos[1] + dx)
        _obs, _r, term, trunc, info = env.step(f"<answer>{act}</answer>")
        steps += 1
        if term or trunc:
            return bool(info["success"]), steps


def main(argv: list[str] | None = None) -> int:
    """``python -m crl_bench.envs.minihack.explore --env ID [--split S] [--episodes N]``: play the first N
    tasks of a split with the explorer and print how many it solved; exit 0 when all."""
    from crl_bench.env_api import make_env

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", required=True, help="a MiniHack env id, e.g. minihack-maze-15")
    p.add_argument("--split", default="eval")
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--max-steps", type=int, default=0, help="action limit (default: the env's)")
    args = p.parse_args(argv)
    env = make_env(args.env)
    try:
        ids = list(env.task_ids(args.split))[:args.episodes]
        results = [explore_episode(env, int(t), args.max_steps or None) for t in ids]
    finally:
        env.close()
    solved = sum(ok for ok, _ in results)
    steps = [n for ok, n in results if ok]
    print(f"{args.env} {args.split}: {solved} of {len(ids)} solved"
          + (f", {min(steps)}-{max(steps)} actions (mean {np.mean(steps):.1f})" if steps else ""))
    for t, (ok, n) in zip(ids, results):
        if not ok:
            print(f"  task {t}: not solved in {n} actions")
    return 0 if solved == len(ids) else 1


if __name__ == "__main__":
    raise SystemExit(main())
