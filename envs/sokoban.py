"""Sokoban as a text environment: a small room, boxes to push onto targets.

Levels are generated procedurally and deterministically from the task id, solvable by construction
with the *reverse-play* method: carve a random room, put every box on a target, then play the game
backwards (the player *pulls* boxes instead of pushing them) and keep a reached state whose boxes are
all off their targets.  Every reverse move has a forward counterpart, so the forward game can always
undo the reverse play and solve the level.  The method is the one of gym-sokoban (Max-Philipp
Schrader, 2018, ``gym_sokoban/envs/room_utils.py``), which took the idea from the Sokoban levels of
"Imagination-Augmented Agents for Deep Reinforcement Learning" (Weber et al., 2017).  The code here is
an independent implementation: the room is carved by a random walk with small brushes, and the reverse
play is a bounded breadth-first search over (player, boxes) states rather than a depth-first search, so
the number of reverse moves recorded for a state is the shortest such play and bounds the length of
the optimal forward solution.

Eval levels never appear in training.  The generator's level space is small (about one train id in ten
draws the walls, targets and boxes of one of the 500 eval levels), so :class:`SokobanEnv` excludes by
level *content*: the identity of a level (:func:`level_identity`) is its grid size, walls, targets and
boxes, *without* the player start.  Two levels that differ only in where the player stands are
treated as the same puzzle: the room, the boxes and the goal are the same, and a start inside the
same region reaches the other start by walking, so keeping such a level in training would leak the
eval puzzle.  The identities of the eval levels are computed once per process and generator setting
(:func:`eval_level_identities`, ~0.15 s for the defaults); a task id outside the eval split whose level
has one of them is regenerated from derived seeds (:func:`generate_level`'s ``attempt``) until it
does not (:func:`train_level`).  Eval levels themselves are unchanged: an eval id gives the plain
:func:`generate_level` level, so eval results stay comparable across versions.  Rotated or mirrored
copies of an eval level are not excluded (the text map an agent sees differs).

Grid coordinates are ``(row, col)`` with ``(0, 0)`` the top-left cell; rows grow downwards.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import lru_cache
from typing import ClassVar, NamedTuple

import numpy as np

from crl_bench.env_api import AnswerParser, TextEnv

Cell = tuple[int, int]

#: Canonical actions and their ``(d_row, d_col)`` displacements.
MOVES: dict[str, Cell] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}

#: Observation symbols.
WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = "#", "_", "O", "X", "*", "P", "+"
_LEGEND: dict[str, str] = {
    WALL: "wall", FLOOR: "floor", TARGET: "target", BOX: "box",
    BOX_ON_TARGET: "box on target", PLAYER: "you", PLAYER_ON_TARGET: "you on target",
}

#: Legend text per set of symbols shown (at most 2**7 distinct sets).
_LEGEND_TEXT: dict[frozenset[str], str] = {}
_VALID_LINE = f"Valid actions: {', '.join(MOVES)}"

# Brushes used by the room-carving random walk: offsets from the walker's cell.
_BRUSHES: tuple[tuple[Cell, ...], ...] = (
    ((0, 0),), ((0, 0),), ((0, 0), (0, 1)), ((0, 0), (1, 0)), ((0, 0), (0, 1), (1, 0), (1, 1)),
)
_MAX_REVERSE_STATES = 50_000


class SokobanState(NamedTuple):
    """A full Sokoban configuration (read-only; everything is a tuple).

    Attributes:
        height: grid rows, border walls included.
        width: grid columns, border walls included.
        walls: sorted ``(row, col)`` cells that are walls (the border included).
        targets: sorted ``(row, col)`` target cells; ``len(targets) == len(boxes)``.
        boxes: sorted ``(row, col)`` cells holding a box.
        player: ``(row, col)`` of the player.
    """

    height: int
    width: int
    walls: tuple[Cell, ...]
    targets: tuple[Cell, ...]
    boxes: tuple[Cell, ...]
    player: Cell


def _carve_room(rng: np.random.Generator, height: int, width: int, num_boxes: int) -> set[Cell] | None:
    """Carve floor cells inside the border by a random walk; ``None`` if too few cells were carved."""
    inner_h, inner_w = height - 2, width - 2
    floor: set[Cell] = set()
    r, c = 1 + int(rng.integers(inner_h)), 1 + int(rng.integers(inner_w))
    dirs = list(MOVES.values())
    d = dirs[int(rng.integers(4))]
    n_steps = int(1.5 * (inner_h + inner_w)) + int(rng.integers(inner_h + inner_w))
    for _ in range(n_steps):
        for dr, dc in _BRUSHES[int(rng.integers(len(_BRUSHES)))]:
            rr, cc = r + dr, c + dc
            if 1 <= rr <= inner_h and 1 <= cc <= inner_w:
                floor.add((rr, cc))
        if rng.random() < 0.35:
            d = dirs[int(rng.integers(4))]
        r = min(max(r + d[0], 1), inner_h)
        c = min(max(c + d[1], 1), inner_w)
    # Room for the boxes, their targets and the player, plus some slack to manoeuvre.
    if len(floor) < 2 * num_boxes + 3:
        return None
    return floor


def _reverse_play(floor: set[Cell], targets: tuple[Cell, ...], player: Cell, search_depth: int,
                  rng: np.random.Generator) -> tuple[tuple[Cell, ...], Cell] | None:
    """Play pulls backwards from the solved state; return the best ``(boxes, player)`` or ``None``.

    Breadth-first over reverse moves (a walk, or a walk that pulls the box behind the player along),
    at most ``search_depth`` moves deep.  A state qualifies when no box is on any target; its score is
    ``pulls * displacement`` (pulls on the recorded play, total Manhattan distance of each box from its
    own starting target), ties broken at random.
    """
    target_set = set(targets)
    start = (player, targets)
    # key (player, sorted boxes) -> (boxes in identity order, pulls)
    seen: dict[tuple[Cell, tuple[Cell, ...]], tuple[tuple[Cell, ...], int]] = {
        (player, tuple(sorted(targets))): (targets, 0)}
    frontier: deque[tuple[Cell, tuple[Cell, ...], int, int]] = deque([(start[0], start[1], 0, 0)])
    best_score, best = 0, []
    while frontier:
        p, boxes, depth, pulls = frontier.popleft()
        if not target_set.intersection(boxes):
            disp = sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in zip(boxes, targets))
            score = pulls * disp
            if score > best_score:
                best_score, best = score, [(boxes, p)]
            elif score == best_score and score > 0:
                best.append((boxes, p))
        if depth >= search_depth or len(seen) >= _MAX_REVERSE_STATES:
            continue
        box_set = set(boxes)
        for dr, dc in MOVES.values():
            nxt = (p[0] + dr, p[1] + dc)
            if nxt not in floor or nxt in box_set:
                continue
            behind = (p[0] - dr, p[1] - dc)
            options = [(boxes, pulls)]
            if behind in box_set:
                options.append((tuple(p if b == behind else b for b in boxes), pulls + 1))
            for nb, npulls in options:
                key = (nxt, tuple(sorted(nb)))
                if key not in seen:
                    seen[key] = (nb, npulls)
                    frontier.append((nxt, nb, depth + 1, npulls))
    if not best:
        return None
    boxes, p = best[int(rng.integers(len(best)))]
    return tuple(sorted(boxes)), p


def generate_level(task: int, dim_room: tuple[int, int] = (6, 6), num_boxes: int = 2,
                   search_depth: int = 20, max_tries: int = 1000, attempt: int = 0) -> SokobanState:
    """Generate the level of task id ``task`` (deterministic: same arguments, same level).

    This is the raw generator: it does not exclude eval levels from train ids (see
    :func:`train_level`, which :class:`SokobanEnv` uses).

    Args:
        task: non-negative task id, used as the seed of ``numpy.random.default_rng``.
        attempt: ``0`` (default) seeds with ``task`` itself; ``k >= 1`` seeds with
            ``numpy.random.SeedSequence(task, spawn_key=(k,))``, a stream independent of every plain
            integer seed (used to redraw a train level that equals an eval level).
        dim_room: ``(height, width)`` of the grid, border walls included (both >= 4).
        num_boxes: number of boxes (= number of targets), >= 1.
        search_depth: bound on the number of reverse moves (walks and pulls) played from the solved
            state, so the optimal forward solution has at most this many moves.  gym-sokoban uses 300
            for its depth-first play; our breadth-first play records shortest plays, and 20 keeps
            every default level solvable well within the default ``max_steps=30`` (with 300, about 1
            level in 2000 needs more than 30 moves).  Lowering it to 20 changes ~4% of the levels.
        max_tries: rooms drawn before giving up.

    Returns:
        a :class:`SokobanState` with every box off the targets, solvable by construction.

    Raises:
        ValueError: bad arguments.
        RuntimeError: no acceptable room in ``max_tries`` draws (not expected for the defaults).
    """
    height, width = int(dim_room[0]), int(dim_room[1])
    if height < 4 or width < 4:
        raise ValueError(f"dim_room must be at least (4, 4), got {dim_room}")
    if num_boxes < 1 or search_depth < 1 or task < 0 or attempt < 0:
        raise ValueError(f"need num_boxes >= 1, search_depth >= 1, task >= 0, attempt >= 0; "
                         f"got {num_boxes}, {search_depth}, {task}, {attempt}")
    seed = int(task) if attempt == 0 else np.random.SeedSequence(int(task), spawn_key=(int(attempt),))
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        floor = _carve_room(rng, height, width, num_boxes)
        if floor is None:
            continue
        cells = sorted(floor)
        picks = rng.choice(len(cells), size=num_boxes + 1, replace=False)
        targets = tuple(cells[int(i)] for i in picks[:num_boxes])
        player = cells[int(picks[-1])]
        found = _reverse_play(floor, targets, player, search_depth, rng)
        if found is None:
            continue
        boxes, player = found
        walls = tuple((r, c) for r in range(height) for c in range(width) if (r, c) not in floor)
        return SokobanState(height, width, walls, tuple(sorted(targets)), boxes, player)
    raise RuntimeError(f"sokoban: no solvable level for task {task} with dim_room={dim_room}, "
                       f"num_boxes={num_boxes} after {max_tries} rooms")


LevelIdentity = tuple[int, int, tuple[Cell, ...], tuple[Cell, ...], tuple[Cell, ...]]

#: the eval task ids of :class:`SokobanEnv` (its ``splits["eval"]``)
EVAL_TASKS = range(1_000_000, 1_000_500)
#: derived seeds tried per train id before giving up (about 1 in 10 draws hits an eval level)
MAX_REDRAWS = 1000


def level_identity(level: SokobanState) -> LevelIdentity:
    """The content identity of a level: ``(height, width, walls, targets, boxes)`` (sorted cells).

    The player start is deliberately left out (module docstring): levels equal up to the player's
    start count as the same puzzle.
    """
    return (level.height, level.width, tuple(sorted(level.walls)), tuple(sorted(level.targets)),
            tuple(sorted(level.boxes)))


@lru_cache(maxsize=16)
def _eval_identities(dim_room: tuple[int, int], num_boxes: int, search_depth: int,
                     eval_tasks: range | tuple[int, ...]) -> frozenset[LevelIdentity]:
    return frozenset(level_identity(generate_level(t, dim_room, num_boxes, search_depth))
                     for t in eval_tasks)


def eval_level_identities(dim_room: tuple[int, int] = (6, 6), num_boxes: int = 2,
                          search_depth: int = 20,
                          eval_tasks: Sequence[int] = EVAL_TASKS) -> frozenset[LevelIdentity]:
    """Identities (:func:`level_identity`) of the levels of ``eval_tasks`` for one generator setting.

    Computed once per process and setting (cached; ~0.3 ms per level), from the raw
    :func:`generate_level`.  ``eval_tasks``: the eval task ids (a ``range`` or any sequence of ints).
    """
    key = eval_tasks if isinstance(eval_tasks, range) else tuple(int(t) for t in eval_tasks)
    return _eval_identities((int(dim_room[0]), int(dim_room[1])), int(num_boxes), int(search_depth),
                            key)


def train_level(task: int, dim_room: tuple[int, int] = (6, 6), num_boxes: int = 2,
                search_depth: int = 20, eval_tasks: Sequence[int] = EVAL_TASKS) -> SokobanState:
    """The level :class:`SokobanEnv` plays for task id ``task``, with eval levels excluded.

    An id in ``eval_tasks`` gets its raw :func:`generate_level` level.  Any other id gets its raw level
    unless that level's :func:`level_identity` is one of :func:`eval_level_identities`; then the level
    is redrawn with ``attempt = 1, 2, ...`` until it is not.  Deterministic: same arguments, same level.

    Raises:
        ValueError: bad arguments (see :func:`generate_level`).
        RuntimeError: every one of :data:`MAX_REDRAWS` redraws hit an eval level (a setting whose
            level space is about as small as the eval split).
    """
    level = generate_level(task, dim_room, num_boxes, search_depth)
    if task in eval_tasks:
        return level
    excluded = eval_level_identities(dim_room, num_boxes, search_depth, eval_tasks)
    attempt = 0
    while level_identity(level) in excluded:
        attempt += 1
        if attempt > MAX_REDRAWS:
            raise RuntimeError(f"sokoban: task {task}: {MAX_REDRAWS} redraws all gave eval levels "
                               f"(dim_room={dim_room}, num_boxes={num_boxes})")
        level = generate_level(task, dim_room, num_boxes, search_depth, attempt=attempt)
    return level


def solve(level: SokobanState, max_states: int = 200_000) -> list[str] | None:
    """A shortest action sequence solving ``level``: breadth-first search over (player, boxes) states.

    Used to check that levels are solvable, and by anything that needs to know whether a state can still
    be solved (a box pushed into a corner that is not a target leaves none).

    Args:
        level: the configuration (e.g. ``env.state()``).
        max_states: give up (return ``None``) after this many distinct states.

    Returns:
        canonical action names (empty when already solved), or ``None`` when no solution exists within
        the bound (a level with a box pushed into a corner that is not a target has none).
    """
    walls, targets = set(level.walls), frozenset(level.targets)
    start = (level.player, frozenset(level.boxes))
    parent: dict = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        player, boxes = state
        if boxes <= targets:
            path = []
            while parent[state] is not None:
                state, action = parent[state]
                path.append(action)
            return path[::-1]
        for action, (dr, dc) in MOVES.items():
            nxt = (player[0] + dr, player[1] + dc)
            if nxt in walls:
                continue
            new_boxes = boxes
            if nxt in boxes:
                behind = (nxt[0] + dr, nxt[1] + dc)
                if behind in walls or behind in boxes:
                    continue
                new_boxes = (boxes - {nxt}) | {behind}
            child = (nxt, new_boxes)
            if child not in parent:
                if len(parent) >= max_states:
                    return None
                parent[child] = (state, action)
                queue.append(child)
    return None


class SokobanEnv(TextEnv):
    """Sokoban on a small procedurally generated grid (default 6x6 with its border walls, 2 boxes).

    Observation: a text map (one row of symbols per grid row), a legend of the symbols present, the
    player position, the number of boxes on targets and the feedback of the last step.  Actions:
    ``up``, ``down``, ``left``, ``right`` (aliases ``u/d/l/r``, ``north/south/west/east``).  Walking
    into a box pushes it if the cell behind it is free; otherwise (wall or second box) nothing moves,
    which is still a valid action.  Reward is 1.0 on the step that puts the last box on a target (the
    episode then terminates) and 0.0 otherwise; ``max_steps`` truncates.

    Task ids outside the eval split never give an eval level: a train level equal in content (walls,
    targets, boxes; the player start is ignored) to an eval level of the same generator setting is
    redrawn from a derived seed (:func:`train_level`; module docstring).  Eval levels are the raw
    :func:`generate_level` levels of their ids.

    Args:
        max_steps: actions per episode before truncation.
        dim_room: ``(height, width)`` including the border walls.
        num_boxes: boxes and targets.
        search_depth: reverse-play move bound of the generator, hence a bound on the optimal solution
            length (see :func:`generate_level`).
        render_mode: only ``"ansi"`` (``render()`` returns the last observation).
    """

    env_id: ClassVar[str] = "sokoban"
    system_prompt: ClassVar[str] = (
        "You are playing Sokoban on a grid. You are the player. Walk up, down, left or right one "
        "cell per move; you cannot enter walls. Walking into a box pushes it one cell the same way, "
        "but only if the cell behind the box is free: boxes cannot be pulled, and a box cannot be "
        "pushed into a wall or another box. A box pushed into a corner is stuck for good. "
        "Goal: push every box onto a target.\n"
        "Reply with exactly one action inside answer tags, for example <answer>left</answer>."
    )
    splits: ClassVar[dict[str, range]] = {"train": range(0, 1_000_000), "eval": EVAL_TASKS}
    action_aliases: ClassVar[dict[str, str]] = {
        "u": "up", "d": "down", "l": "left", "r": "right",
        "north": "up", "south": "down", "west": "left", "east": "right",
        "move up": "up", "move down": "down", "move left": "left", "move right": "right",
    }

    def __init__(self, max_steps: int = 30, dim_room: tuple[int, int] = (6, 6), num_boxes: int = 2,
                 search_depth: int = 20, render_mode: str | None = "ansi") -> None:
        super().__init__(max_steps=max_steps, render_mode=render_mode)
        self.dim_room = (int(dim_room[0]), int(dim_room[1]))
        self.num_boxes = int(num_boxes)
        self.search_depth = int(search_depth)
        self._walls: frozenset[Cell] = frozenset()
        self._targets: frozenset[Cell] = frozenset()
        self._boxes: set[Cell] = set()
        self._player: Cell = (0, 0)
        # the map without boxes and player (one symbol per cell, row-major), built at reset
        self._base_cells: list[str] = [FLOOR] * (self.dim_room[0] * self.dim_room[1])
        # the action set is fixed (admissible_actions() does not depend on the state): one parser
        self._parser = AnswerParser(self.admissible_actions(), self.action_aliases)

    # ---- TextEnv hooks ---------------------------------------------------------------------------
    def _reset_task(self, task: int) -> None:
        level = train_level(task, self.dim_room, self.num_boxes, self.search_depth,
                            self.splits["eval"])
        self._walls = frozenset(level.walls)
        self._targets = frozenset(level.targets)
        self._boxes = set(level.boxes)
        self._player = level.player
        height, width = self.dim_room
        self._base_cells = [WALL if (r, c) in self._walls else TARGET if (r, c) in self._targets
                            else FLOOR for r in range(height) for c in range(width)]

    def _apply(self, action: str) -> tuple[float, bool, bool, str]:
        dr, dc = MOVES[action]
        r, c = self._player
        nxt = (r + dr, c + dc)
        if nxt in self._walls:
            return 0.0, False, False, "You bumped into a wall; nothing moved."
        if nxt in self._boxes:
            behind = (nxt[0] + dr, nxt[1] + dc)
            if behind in self._walls or behind in self._boxes:
                what = "a wall" if behind in self._walls else "another box"
                return 0.0, False, False, f"The box cannot move {action}: {what} is behind it."
            self._boxes.remove(nxt)
            self._boxes.add(behind)
            self._player = nxt
            message = f"You pushed a box {action}" + (" onto a target." if behind in self._targets
                                                      else ".")
        else:
            self._player = nxt
            message = f"You moved {action}."
        if self._boxes <= self._targets:
            return 1.0, True, True, message + " All boxes are on targets. You win!"
        return 0.0, False, False, message

    def _observe(self, message: str = "") -> str:
        height, width = self.dim_room
        # walls, targets and floor come from the map built at reset; boxes, then the player, are
        # drawn over them (a wall always shows as a wall)
        cells = self._base_cells.copy()
        walls, targets = self._walls, self._targets
        for cell in self._boxes:
            r, c = cell
            if 0 <= r < height and 0 <= c < width and cell not in walls:
                cells[r * width + c] = BOX_ON_TARGET if cell in targets else BOX
        r, c = self._player
        if 0 <= r < height and 0 <= c < width and self._player not in walls:
            cells[r * width + c] = PLAYER_ON_TARGET if self._player in targets else PLAYER
        text = "".join(cells)
        rows = [text[k:k + width] for k in range(0, height * width, width)]
        used = frozenset(cells)
        legend = _LEGEND_TEXT.get(used)
        if legend is None:
            legend = _LEGEND_TEXT[used] = ", ".join(f"{s} {_LEGEND[s]}" for s in _LEGEND if s in used)
        on = len(self._boxes & targets)
        lines = ["Map (row 0 is the top):", *rows, f"Legend: {legend}",
                 f"You are at row {self._player[0]}, column {self._player[1]}. "
                 f"Boxes on targets: {on}/{len(self._boxes)}."]
        if message:
            lines.append(f"Last: {message}")
        lines.append(_VALID_LINE)
        return "\n".join(lines)

    def parser(self) -> AnswerParser:
        """The parser of the fixed action set, built once (a subclass whose admissible actions
        depend on the state must override this too)."""
        return self._parser

    def admissible_actions(self) -> list[str]:
        return list(MOVES)

    def task_prompt(self) -> str:
        n = len(self._boxes) or self.num_boxes
        return "Push both boxes onto the targets." if n == 2 else \
            ("Push the box onto the target." if n == 1 else f"Push all {n} boxes onto the targets.")

    # ---- read-only state -------------------------------------------------------------------------
    def state(self) -> SokobanState:
        """The current configuration as a :class:`SokobanState` (a fresh immutable copy).

        Raises ``RuntimeError`` before the first :meth:`reset`.
        """
        if self.task is None:
            raise RuntimeError("sokoban: state() called before reset()")
        return SokobanState(self.dim_room[0], self.dim_room[1], tuple(sorted(self._walls)),
                            tuple(sorted(self._targets)), tuple(sorted(self._boxes)), self._player)
