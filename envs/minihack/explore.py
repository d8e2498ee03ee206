"""A scripted explorer for the MiniHack navigation tasks: the check that every task of a split can be
solved with the env's own actions (``python -m crl_bench.envs.minihack.explore``).

It plays through the env's ``step`` like the actor, choosing each move from the symbols the text
rendering is made from (NLE's ``glyphs`` of the dungeon and the agent's position in ``blstats``): the
stairs when they have been seen, else the nearest seen cell it has not stood on whose neighbours are
still unseen (frontier exploration, breadth-first over the cells seen so far). Doorways are entered and
left orthogonally only (NetHack forbids diagonal moves there); a target the agent fails to reach three
times counts as blocked. It attacks nothing on purpose: a monster in the way is walked into (which
attacks it). With ``search`` and ``kick`` among the env's actions (the corridor task) it also searches
for hidden doors and passages when nothing else is reachable, and kicks closed doors that do not open;
with ``zap`` (the quests) it walks next to the lava when nothing else is reachable and zaps the wand of
cold at it.

Facts used: NetHack 3.6 ``include/defsym.h`` (cmap 0 stone, 1-11 walls, 12 doorless doorway, 13/14
open doors, 15/16 closed doors, 17 bars, 18 tree, 19/20 floor, 21/22 corridor, 23-26 stairs and
ladders, 27-31 altar, grave, throne, sink, fountain, 32 water (S_pool), 33 ice, 34 lava), NLE
``blstats`` (index 0 x, 1 y).
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
_PASSABLE_CMAP = frozenset({12, 13, 14, 15, 16, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 33})
_STAIRS_DOWN = 24
_LAVA = 34


def _cell(glyph: int) -> str:
    """``"unseen"``, ``"blocked"``, ``"lava"``, ``"door"``, ``"stairs"`` or ``"open"`` for a dungeon glyph."""
    if glyph == nethack.GLYPH_CMAP_OFF:                       # S_stone: unseen or solid rock
        return "unseen"
    if nethack.glyph_is_cmap(glyph):
        c = nethack.glyph_to_cmap(glyph)
        if c == _STAIRS_DOWN:
            return "stairs"
        if c == _LAVA:
            return "lava"
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
        if k in ("unseen", "blocked", "lava"):
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


def _next_lava(kinds: np.ndarray, pos: tuple[int, int], blocked: set[tuple[int, int]]) -> list[str] | None:
    """``["zap", move]`` when lava is next to the agent (``move`` its direction, east preferred: the rays
    then cross the lava columns of the quests), else ``[move]``, the first move towards the nearest
    reachable cell next to lava; ``None`` when there is none."""
    h, w = kinds.shape

    def lava_dirs(y: int, x: int) -> list[str]:
        return [name for name, (dy, dx) in MOVE_DELTAS.items()
                if 0 <= y + dy < h and 0 <= x + dx < w and kinds[y + dy, x + dx] == "lava"]

    first: dict[tuple[int, int], str] = {pos: ""}
    queue = deque([pos])
    while queue:
        cur = queue.popleft()
        dirs = lava_dirs(*cur)
        if dirs:
            if cur == pos:
                return ["zap", "east" if "east" in dirs else dirs[0]]
            return [first[cur]]
        for name, nxt in _moves(kinds, *cur, blocked):
            if nxt not in first:
                first[nxt] = first[cur] or name
                queue.append(nxt)
    return None


#: glyph -> whether it shows a monster that is not the agent's pet
_HOSTILE = np.array([bool(nethack.glyph_is_monster(g)) and not nethack.glyph_is_pet(g)
                     for g in range(nethack.MAX_GLYPH + 1)])
_ROOM = frozenset({12, 19, 20})                 # doorless doorway, lit and dark floor of a room
_CORRIDOR = frozenset({21, 22})


#: glyph -> its cmap index (map feature), -1 for a glyph that is not one (a monster, an object)
_CMAP_OF = np.array([nethack.glyph_to_cmap(g) if nethack.glyph_is_cmap(g) else -1
                     for g in range(nethack.MAX_GLYPH + 1)], dtype=np.int16)


class _Hold:
    """Fighting from a corridor: on first standing on a corridor cell next to a room cell not stood on,
    stay in the corridor, attacking any monster next to the agent and otherwise stepping between that
    cell and the one the agent came from, until ``turns`` turns in a row pass with no monster next to the
    agent (at most ``4 * turns`` turns); monsters then come one at a time instead of surrounding it."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.anchor: tuple[int, int] | None = None
        self.back: tuple[int, int] | None = None
        self.quiet = self.spent = 0
        self.done = turns <= 0
        self.features: np.ndarray | None = None     # the map feature last seen in each cell (under the agent)

    def act(self, glyphs: np.ndarray, pos: tuple[int, int], last: tuple[int, int] | None,
            visited: set[tuple[int, int]]) -> str | None:
        """The reply while holding (an attack or a step), ``None`` when not holding."""
        if self.done:
            return None
        h, w = glyphs.shape
        cmap = _CMAP_OF[glyphs]
        if self.features is None:
            self.features = np.full(glyphs.shape, -1, dtype=np.int16)
        np.copyto(self.features, cmap, where=cmap >= 0)
        if self.anchor is None:
            if int(self.features[pos]) not in _CORRIDOR or last is None or last == pos:
                return None
            for dy, dx in ((0, 1), (0, -1), (1, 0), (-1, 0)):
                y, x = pos[0] + dy, pos[1] + dx
                if 0 <= y < h and 0 <= x < w and (y, x) not in visited and int(self.features[y, x]) in _ROOM:
                    self.anchor, self.back = pos, last
                    break
            if self.anchor is None:
                return None
        self.spent += 1
        for name, (dy, dx) in MOVE_DELTAS.items():
            y, x = pos[0] + dy, pos[1] + dx
            if 0 <= y < h and 0 <= x < w and _HOSTILE[glyphs[y, x]]:
                self.quiet = 0
                return name
        self.quiet += 1
        if self.quiet >= self.turns or self.spent >= 4 * self.turns:
            self.done = True
            return None
        to = self.back if pos == self.anchor else self.anchor
        for name, (dy, dx) in MOVE_DELTAS.items():
            if (pos[0] + dy, pos[1] + dx) == to:
                return name
        self.done = True                             # pushed off the corridor: go on exploring
        return None


def _closed_door(glyph: int) -> bool:
    return bool(nethack.glyph_is_cmap(glyph)) and nethack.glyph_to_cmap(glyph) in (15, 16)


def explore_episode(env: Any, task: int, max_steps: int | None = None, searches: int = 10,
                    kicks: int = 8, zaps: int = 4, hold: int = 0) -> tuple[bool, int]:
    """Play task ``task`` of the MiniHack text env ``env`` with the explorer.

    Where the env's actions include them, the explorer also searches for hidden passages when no
    stairs and no frontier are reachable (``searches`` times from each cell next to a wall or an
    unseen cell, nearest first) and kicks a closed door it failed to walk through (at most ``kicks``
    times; ``kick`` asks for a direction, the next reply), and zaps the lava next to it when nothing else
    is reachable (at most ``zaps`` times; ``zap`` asks for a direction, the next reply). With ``hold`` > 0
    it fights from the corridor before entering a new room (:class:`_Hold`: until ``hold`` turns in a row
    pass with no monster next to it).

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
    zapped = 0
    holding = _Hold(hold)
    last: tuple[int, int] | None = None
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
        held = None if plan else holding.act(glyphs, pos, last, visited)
        last = pos
        if plan:
            act = plan.pop(0)
        elif held is not None:
            act = held
        else:
            kinds = _KINDS[glyphs]
            act = _next_move(kinds, pos, visited, blocked)
            if act is None and "zap" in actions and zapped < zaps:
                plan = _next_lava(kinds, pos, blocked) or []
                if plan:
                    zapped += plan[0] == "zap"
                    act = plan.pop(0)
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
    """``python -m crl_bench.envs.minihack.explore --env ID [--split S] [--episodes N] [--max-steps N]
    [--hold N]``: play the first N
    tasks of a split with the explorer and print how many it solved; exit 0 when all."""
    from crl_bench.env_api import make_env

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", required=True, help="a MiniHack env id, e.g. minihack-maze-15")
    p.add_argument("--split", default="eval")
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--max-steps", type=int, default=0, help="action limit (default: the env's)")
    p.add_argument("--hold", type=int, default=0,
                   help="fight from the corridor before entering a new room, until this many turns pass "
                        "with no monster next to the agent (0: never)")
    args = p.parse_args(argv)
    env = make_env(args.env)
    try:
        ids = list(env.task_ids(args.split))[:args.episodes]
        results = [explore_episode(env, int(t), args.max_steps or None, hold=args.hold) for t in ids]
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
