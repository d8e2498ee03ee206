"""MiniHack navigation tasks as text environments.

Four tasks wrap real MiniHack environments (minihack 1.0.2 on NLE 1.3.0, the NetHack Learning
Environment); the game runs in NetHack itself and this module only names the actions, renders the
symbolic observation as text and maps the game's end status to the reward:

=================  ================================  =========================================
env id             default MiniHack id (``variant``)  actions
=================  ================================  =========================================
minihack-room      ``MiniHack-Room-5x5-v0``          8 compass moves
minihack-maze      ``MiniHack-MazeWalk-9x9-v0``      8 compass moves
minihack-keyroom   ``MiniHack-KeyRoom-S5-v0``        8 compass moves, ``pickup``, ``apply``
minihack-river     ``MiniHack-River-v0``             8 compass moves (walk into a boulder to push)
=================  ================================  =========================================

Facts used (read in the upstream sources named, and measured on this machine):

* ``minihack/envs/room.py``: ``MiniHack-Room-5x5-v0`` is *not* random (``random=False``: agent in
  the top-left corner, stairs in the bottom-right), so every task id gives the same 5x5 room; the
  ``variant`` setting selects e.g. ``MiniHack-Room-Random-5x5-v0`` or
  ``MiniHack-Room-Ultimate-5x5-v0`` (dark, one monster, one trap) where the seed matters.
* ``nle/env/base.py`` / ``nle/env/tasks.py`` (``NetHackStaircase.StepStatus``): ``end_status`` is
  ``-1`` ABORTED (NLE's own step limit, returned with ``terminated=True``), ``0`` RUNNING, ``1``
  DEATH (any game over), ``2`` TASK_SUCCESSFUL (standing on the stairs down).
* ``nle/env/base.py`` ``seed()``: ``reset(seed=...)`` does not seed NetHack;
  ``env.unwrapped.seed(core, disp, reseed=False)`` sets the RNGs used by the *next* reset. We call it
  before every reset with seeds derived from the task id, so a task id always gives the same level.
* NLE returns views into buffers it reuses, and after the last step of a game ``chars``/``glyphs``/
  ``blstats`` are blank (zeros). The wrapper renders each frame to text right after the step and keeps
  the last non-blank frame, so the final observation still shows the map.
* ``gymnasium.make(id, max_episode_steps=N)`` only adds a ``TimeLimit`` wrapper; the NLE step limit
  is a constructor argument that ``make`` cannot forward. We pass it through a copy of the env spec
  (``inner_max_steps``, larger than ``max_steps`` by default) and add no ``TimeLimit``, so this
  class's ``max_steps`` (truncation) governs.
* ``minihack/envs/keyroom.py`` (``MiniHackKeyDoor.step``): when APPLY is chosen while a key is in the
  inventory and a closed door is in one of the 8 neighbouring cells, MiniHack itself plays
  ``apply, <key letter>, <door direction>, y`` (unlock) and then walks into the door until it is open;
  the APPLY command it sends afterwards opens the "What do you want to use or apply?" prompt, which
  NLE's ``_perform_known_steps`` answers with ESC ("Never mind."). Without key or door the same ESC
  happens. So one ``apply`` is one agent decision, with no follow-up prompt for the agent; the wrapper
  replaces "Never mind." by a message saying whether the door was opened.
* ``minihack/base.py`` / ``nle``: open doors are drawn like walls in ``chars`` (``|``/``-``); we
  use ``glyphs`` (cmap 13/14 = open door) and draw them as ``'``; lava (cmap 34) is drawn ``}``
  like water and is redrawn ``~``. Other symbols are named in the legend from
  ``screen_descriptions`` (cached per glyph; two things drawn alike are listed as "a or b"). Doors
  seen during the episode are remembered, so standing in a doorway is reported (NetHack forbids
  diagonal moves into or out of doorways).
* Known limit: MiniHack's apply macro loops ``while`` the door next to the agent stays closed; with
  the blessed key unlocking and opening succeed within a few game turns (200/200 scripted KeyRoom
  tasks solved here), but a door that could never open would hang that call.

Observation text (``view="full"``: the seen part of the map trimmed to its bounding box;
``view="crop"``: the 9x9 cells around the agent, like MiniHack's ``chars_crop``, unseen/outside
cells blank)::

    Map (row 0 is the top):
    @....
    .....
    .....
    .....
    ....>
    Legend: @ you, > stairs down (goal), . floor
    You are at row 0, column 0. Stairs down at row 4, column 4.
    Valid actions: north, east, south, west, northeast, southeast, southwest, northwest

plus ``Key: carried/not carried.`` (KeyRoom) and ``Last: <message>`` lines when they apply.
Row/column are relative to the map shown in that observation.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from crl_bench.env_api import AnswerParser, TextEnv

with warnings.catch_warnings():  # minihack imports pkg_resources (deprecated)
    warnings.simplefilter("ignore")
    import gymnasium as gym
    import minihack  # noqa: F401 - imported to register the MiniHack-* ids with gymnasium)
    from nle import nethack

# ---- actions ------------------------------------------------------------------------------------

#: NLE action -> canonical name (lower case).
_ACTION_NAMES: dict[int, str] = {
    int(nethack.CompassDirection.N): "north",
    int(nethack.CompassDirection.E): "east",
    int(nethack.CompassDirection.S): "south",
    int(nethack.CompassDirection.W): "west",
    int(nethack.CompassDirection.NE): "northeast",
    int(nethack.CompassDirection.SE): "southeast",
    int(nethack.CompassDirection.SW): "southwest",
    int(nethack.CompassDirection.NW): "northwest",
    int(nethack.Command.PICKUP): "pickup",
    int(nethack.Command.APPLY): "apply",
}

#: Screen displacement ``(d_row, d_col)`` of each move (row grows southwards).
MOVE_DELTAS: dict[str, tuple[int, int]] = {
    "north": (-1, 0), "east": (0, 1), "south": (1, 0), "west": (0, -1),
    "northeast": (-1, 1), "southeast": (1, 1), "southwest": (1, -1), "northwest": (-1, -1),
}

MOVE_ACTIONS: tuple[Any, ...] = tuple(nethack.CompassDirection)
KEY_ACTIONS: tuple[Any, ...] = MOVE_ACTIONS + (nethack.Command.PICKUP, nethack.Command.APPLY)


def _move_aliases() -> dict[str, str]:
    short = {"north": "n", "east": "e", "south": "s", "west": "w",
             "northeast": "ne", "southeast": "se", "southwest": "sw", "northwest": "nw"}
    screen = {"north": ["up"], "south": ["down"], "east": ["right"], "west": ["left"],
              "northeast": ["up right", "up-right", "upright"],
              "southeast": ["down right", "down-right", "downright"],
              "southwest": ["down left", "down-left", "downleft"],
              "northwest": ["up left", "up-left", "upleft"]}
    out: dict[str, str] = {}
    for name in MOVE_DELTAS:
        words = [short[name], *screen[name]]
        if len(name) > 5:  # diagonal: "north east", "north-east"
            words += [f"{name[:5]} {name[5:]}", f"{name[:5]}-{name[5:]}"]
        for w in [name, *words]:
            for prefix in ("", "move ", "go "):
                if prefix + w != name:
                    out[prefix + w] = name
    return out


MOVE_ALIASES: dict[str, str] = _move_aliases()
KEY_ALIASES: dict[str, str] = {
    **MOVE_ALIASES,
    "pick up": "pickup", "pick-up": "pickup", "pick up key": "pickup", "pick up the key": "pickup",
    "take": "pickup", "take key": "pickup", "grab": "pickup", ",": "pickup",
    "use": "apply", "use key": "apply", "use the key": "apply", "apply key": "apply",
    "apply the key": "apply", "unlock": "apply", "unlock door": "apply",
    "unlock the door": "apply", "open": "apply", "open door": "apply", "open the door": "apply",
}

# ---- rendering ----------------------------------------------------------------------------------

_CMAP = nethack.GLYPH_CMAP_OFF
#: cmap indices (NetHack 3.6 ``defsym.h`` order, checked against ``screen_descriptions``).
_CMAP_OPEN_DOORS = (13, 14)        # S_vodoor, S_hodoor: drawn '-'/'|' in chars
_CLOSED_DOOR_GLYPHS = [_CMAP + 15, _CMAP + 16]  # S_vcdoor, S_hcdoor: drawn '+'
_LAVA_GLYPH, _LAVA = _CMAP + 34, "~"  # S_lava: drawn '}' like water in chars; redrawn '~'
_OPEN_DOOR = "'"
_BLANK_GLYPH = _CMAP  # S_stone: what glyphs hold for unseen cells (and everywhere after game over)

#: Screen description -> short legend text.
_RENAME: dict[str, str] = {
    "floor of a room": "floor", "dark part of a room": "floor", "doorway": "floor",
    "broken door": "floor", "staircase down": "stairs down (goal)",
    "staircase up": "stairs up", "open door": "open door", "closed door": "closed door",
    "wall": "wall", "corridor": "corridor", "water": "water", "molten lava": "lava",
}
_LEGEND_FIRST = ("@", ">")
_CROP = 9
_WELCOME = "Hello Agent, welcome to NetHack!"

# Lookup tables of the renderer (built once; every step does a few table look-ups, no per-cell
# Python work).
_SCREEN_H, _SCREEN_W = (int(n) for n in nethack.DUNGEON_SHAPE)
#: chars byte -> drawn byte: NUL (never drawn) becomes a blank.
_CHAR_FIX = np.arange(256, dtype=np.uint8)
_CHAR_FIX[0] = 32
#: glyph -> byte drawn instead of its char (0: keep the char): open doors and lava.
_GLYPH_SYM = np.zeros(nethack.MAX_GLYPH + 1, dtype=np.uint8)
_GLYPH_SYM[[_CMAP + c for c in _CMAP_OPEN_DOORS]] = ord(_OPEN_DOOR)
_GLYPH_SYM[_LAVA_GLYPH] = ord(_LAVA)
#: glyph -> 1 for doors (open or closed), remembered for the "in a doorway" remark.
_GLYPH_DOOR = np.zeros(nethack.MAX_GLYPH + 1, dtype=np.uint8)
_GLYPH_DOOR[[_CMAP + c for c in _CMAP_OPEN_DOORS] + _CLOSED_DOOR_GLYPHS] = 1
#: drawn byte -> 0x00 for a blank (or NUL) cell, 0xFF for a drawn one.
_DRAWN_MASK = bytes(0 if b in (0, 32) else 0xFF for b in range(256))
#: id byte of a glyph not seen yet (see MiniHackTextEnv._assign_glyph_ids); ids are 1..254, 0 is
#: "not drawn".
_NEW_ID = b"\xff"
_MAX_GLYPH_IDS = 254
#: legend text of a ``meanings`` dict (as ``tuple(meanings.items())``); few distinct ones occur.
_LEGEND_CACHE: dict[tuple[tuple[str, str], ...], str] = {}


def _clean_description(desc: str) -> str:
    """``"a key named The Master Key of Thievery"`` -> ``"key"``; known terrain renamed."""
    desc = desc.strip()
    if desc in _RENAME:
        return _RENAME[desc]
    for article in ("a ", "an ", "the "):
        if desc.startswith(article):
            desc = desc[len(article):]
            break
    for cut in (" named ", " called "):
        if cut in desc:
            desc = desc.split(cut, 1)[0]
    desc = _RENAME.get(desc, desc)
    return desc[:30] or "?"


def _decode(arr: np.ndarray) -> str:
    """Bytes of a NUL-padded uint8 array -> str (NULs stripped, whitespace collapsed)."""
    raw = arr.tobytes()
    if not raw or not raw[0]:  # (most messages are empty)
        return ""
    raw = raw.split(b"\0", 1)[0]
    return " ".join(raw.decode("latin-1").split())


def _bounding_box(raw: bytes, chars: np.ndarray) -> tuple[int, int, int, int]:
    """``(y0, y1, x0, x1)``: the smallest box holding every cell of ``chars`` that is not NUL or blank.

    The same box as ``np.nonzero((chars != 32) & (chars != 0))`` gives, found with byte-string
    stripping (much cheaper than numpy on a 21x79 screen): the first and last drawn byte in row-major
    order give the rows, then in column-major order within those rows the columns. ``raw`` is
    ``chars.tobytes()``; ``chars`` must have a drawn cell.
    """
    w = chars.shape[1]
    # bytes.strip() without an argument is fast but strips all ASCII whitespace (\t\n\v\f\r too);
    # only blanks (and NULs, replaced by blanks) count as empty cells here
    exact = b"\t" in raw or b"\n" in raw or b"\x0b" in raw or b"\x0c" in raw or b"\r" in raw
    flat = raw.replace(b"\0", b" ")
    if exact:
        left, right = len(flat) - len(flat.lstrip(b" ")), len(flat.rstrip(b" "))
    else:
        left, right = len(flat) - len(flat.lstrip()), len(flat.rstrip())
    y0, y1 = left // w, (right - 1) // w + 1
    band = chars[y0:y1].T.tobytes().replace(b"\0", b" ")  # column-major, rows y0..y1-1 only
    if exact:
        left, right = len(band) - len(band.lstrip(b" ")), len(band.rstrip(b" "))
    else:
        left, right = len(band) - len(band.lstrip()), len(band.rstrip())
    bh = y1 - y0
    return y0, y1, left // bh, (right - 1) // bh + 1


def _task_seeds(task: int) -> tuple[int, int]:
    """Deterministic ``(core, disp)`` NetHack seeds for ``task`` (splitmix64, 63-bit)."""
    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
    t = int(task) & 0xFFFFFFFFFFFFFFFF
    return mix(2 * t), mix(2 * t + 1)


class MiniHackTextEnv(TextEnv):
    """A MiniHack task with text observations and named actions (base of the four envs).

    Args:
        variant: the MiniHack gymnasium id to wrap (must be registered by ``import minihack``);
            defaults to the subclass's :attr:`default_variant`.
        view: ``"full"`` (seen map trimmed to its bounding box) or ``"crop"`` (9x9 around the agent);
            defaults to :attr:`default_view`.
        goal_offset: when the stairs are in view, also state where they are relative to the agent in
            compass terms (``The stairs down are 3 south and 2 east of you (direction:
            southeast).``), the kind of relative
            description BALROG's language observation of NetHack gives; off by default.  The ``cpu``
            preset turns it on (docs/learning.md).
        max_steps: actions per episode before truncation (see :class:`TextEnv`); default 30.
        inner_max_steps: NLE's own step limit (reaching it ends the game as ABORTED, which this env
            reports as terminated with reward 0); default ``max(1000, 10 * max_steps)`` so that
            ``max_steps`` governs.
        render_mode: ``"ansi"`` (the observation text).

    Raises:
        ValueError: unknown ``variant`` or ``view``, or an NLE action without a name here.

    Reward 1.0 and ``success=True`` when NLE reports TASK_SUCCESSFUL (on the stairs down); 0.0
    otherwise. Death (end status 1) and NLE's step limit (-1) terminate with reward 0 and say so in the
    message. An instance can be reset any number of times; :meth:`close` frees the NetHack instance.
    """

    env_id: ClassVar[str] = "minihack"
    default_variant: ClassVar[str] = "MiniHack-Room-5x5-v0"
    default_view: ClassVar[str] = "full"
    nle_actions: ClassVar[tuple[Any, ...]] = MOVE_ACTIONS
    action_aliases: ClassVar[dict[str, str]] = MOVE_ALIASES
    splits: ClassVar[dict[str, Sequence[int]]] = {"train": range(0, 1_000_000),
                                                   "eval": range(1_000_000, 1_000_500)}
    goal_text: ClassVar[str] = "Reach the stairs down '>'."
    extra_obs_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, variant: str | None = None, view: str | None = None, max_steps: int = 30,
                 inner_max_steps: int | None = None, render_mode: str | None = "ansi",
                 goal_offset: bool = False) -> None:
        super().__init__(max_steps=max_steps, render_mode=render_mode)
        self.variant = variant or self.default_variant
        self.view = view or self.default_view
        self.goal_offset = bool(goal_offset)
        if self.view not in ("full", "crop"):
            raise ValueError(f"{self.env_id}: view must be 'full' or 'crop', got {self.view!r}")
        if self.variant not in gym.registry:
            raise ValueError(f"{self.env_id}: unknown MiniHack id {self.variant!r}")
        self.inner_max_steps = int(inner_max_steps or max(1000, 10 * self.max_steps))
        spec = gym.spec(self.variant)
        # The NLE step limit must reach the constructor: gym.make's own max_episode_steps only
        # wraps a TimeLimit (-1: none).
        spec = dataclasses.replace(spec, kwargs={**spec.kwargs,
                                                 "max_episode_steps": self.inner_max_steps})
        keys = ("chars", "glyphs", "blstats", "message", "screen_descriptions",
                *self.extra_obs_keys)
        self._env = gym.make(spec, max_episode_steps=-1, disable_env_checker=True,
                             observation_keys=keys, actions=self.nle_actions)
        self._nle = self._env.unwrapped
        names = []
        for a in self._nle.actions:
            if int(a) not in _ACTION_NAMES:
                raise ValueError(f"{self.env_id}: NLE action {a!r} of {self.variant} has no name")
            names.append(_ACTION_NAMES[int(a)])
        self._action_names: list[str] = names
        self._action_index = {n: i for i, n in enumerate(names)}
        self._valid_line = f"Valid actions: {', '.join(names)}"
        self._parser = AnswerParser(names, {k: v for k, v in self.action_aliases.items()
                                            if v in self._action_index})
        self.system_prompt = self.build_system_prompt(self.variant, names)
        self._desc_cache: dict[int, str] = {}
        self._doors: set[tuple[int, int]] = set()  # (x, y) of doors seen this episode
        self._frame = ""            # rendered map + legend + position of the last non-blank frame
        self._frame_lines: list[str] = []
        self._agent_xy: tuple[int, int] | None = None
        self._end_status = 0
        self._reset_message = ""
        self._closed = False
        self._pad: tuple[np.ndarray, np.ndarray] | None = None
        # per episode: glyph -> id byte (see _capture), (glyph, id) sorted by glyph, ids of the
        # glyphs redrawn (open doors, lava) and of the doors
        self._glyph_id = np.full(nethack.MAX_GLYPH + 1, _NEW_ID[0], dtype=np.uint8)
        self._glyph_ids: list[tuple[int, bytes]] = []
        self._redraw_ids: list[bytes] = []
        self._door_ids: list[bytes] = []

    # ---- prompts --------------------------------------------------------------------------------
    @classmethod
    def build_system_prompt(cls, variant: str, actions: Sequence[str]) -> str:
        """The system prompt for ``variant`` with action names ``actions`` (subclasses add rules)."""
        return _prompt(cls._rules(variant), actions)

    @classmethod
    def _rules(cls, variant: str) -> str:
        return ("You play a small NetHack level (MiniHack) shown as a map seen from above: row 0 is "
                "the top, north is up. You are '@'. Goal: step onto the stairs down '>'."
                + _variant_notes(variant))

    def task_prompt(self) -> str:
        """One line with the goal, e.g. ``"Reach the stairs down '>'."``."""
        return self.goal_text

    def retrieval_query(self, first_observation: str) -> str:
        """``"Observation: <first observation>"``: the released MiniHack query (the goal is the same
        for every task of an env, so only the map tells tasks apart)."""
        return f"Observation: {first_observation.strip()}"

    def admissible_actions(self) -> list[str]:
        """The env's action names (fixed per env; the order of the NLE action set)."""
        return list(self._action_names)

    def parser(self) -> AnswerParser:
        """Cached :class:`AnswerParser` over :meth:`admissible_actions` and the aliases."""
        return self._parser

    # ---- TextEnv hooks --------------------------------------------------------------------------
    def _reset_task(self, task: int) -> None:
        if self._closed:
            raise RuntimeError(f"{self.env_id}: reset() after close()")
        core, disp = _task_seeds(task)
        self._nle.seed(core, disp, False)
        obs, _info = self._env.reset()
        self._end_status = 0
        self._desc_cache.clear()
        self._clear_glyph_ids()
        self._doors.clear()
        self._frame = ""
        self._capture(obs)
        msg = _decode(obs["message"])
        self._reset_message = "" if msg.startswith(_WELCOME) else msg

    def _apply(self, action: str) -> tuple[float, bool, bool, str]:
        idx = self._action_index[action]
        pre = self._before_step(action)
        obs, _r, term, trunc, info = self._env.step(idx)
        self._end_status = int(info.get("end_status", 0))
        self._capture(obs)
        message = self._after_step(action, pre, _decode(obs["message"]))
        if self._end_status == 2:
            return 1.0, True, True, "You reached the stairs down '>'. Success!"
        if self._end_status == 1:
            return 0.0, True, False, _join(message, "You died. Game over.")
        if self._end_status == -1:
            return 0.0, True, False, _join(message, "The game's own step limit was reached. "
                                                    "Game over.")
        if term or trunc:  # not expected: NLE reports every end through end_status
            return 0.0, True, False, _join(message, "Game over.")
        return 0.0, False, False, message

    def _observe(self, message: str = "") -> str:
        if self._steps == 0 and not message:
            message = self._reset_message
        lines = [self._frame]
        lines += self._status_lines()
        if message:
            lines.append(f"Last: {message}")
        lines.append(self._valid_line)
        return "\n".join(lines)

    # ---- raw simulator access (see TextEnv.raw_reset / raw_step) ------------------------------------
    def raw_reset(self, task: int) -> None:
        """Reset the wrapped NLE env to task ``task`` (same seeding as :meth:`reset`), nothing else."""
        if self._closed:
            raise RuntimeError(f"{self.env_id}: reset() after close()")
        core, disp = _task_seeds(task)
        self._nle.seed(core, disp, False)
        self._env.reset()

    def raw_step(self, action: str) -> bool:
        """Step the wrapped NLE env with the index of ``action``; no rendering. Returns done."""
        _obs, _r, term, trunc, _info = self._env.step(self._action_index[action])
        return bool(term or trunc)

    def _info(self, invalid: bool, action: str | None = None) -> dict[str, Any]:
        info = super()._info(invalid, action)
        info["end_status"] = self._end_status
        info["agent_xy"] = self._agent_xy
        return info

    # ---- per-env hooks --------------------------------------------------------------------------
    def _before_step(self, action: str) -> Any:
        return None

    def _after_step(self, action: str, pre: Any, message: str) -> str:
        return message

    def _status_lines(self) -> list[str]:
        return []

    # ---- rendering ------------------------------------------------------------------------------
    def _capture(self, obs: dict[str, np.ndarray]) -> bool:
        """Render the live NLE buffers into :attr:`_frame` (kept as is when the frame is blank).

        Returns ``False`` (and changes nothing) when the frame is blank. Reads the buffers in place
        without copying them: only the map region shown is looked at, and a screen description
        (``screen_descriptions`` is 21x79x80 bytes) is read for one cell of a glyph, the first time
        the glyph is named in the episode's legend.
        """
        chars = obs["chars"]
        raw = chars.tobytes()
        if not raw.strip(b"\0"):  # the game is over: NLE blanked the buffers, keep the previous frame
            return False
        glyphs = obs["glyphs"]
        blstats = obs["blstats"]
        x, y = blstats.item(0), blstats.item(1)
        self._agent_xy = (x, y)
        if self.view == "crop":
            r = _CROP // 2
            y0, x0 = y - r, x - r
            y1, x1 = y + r + 1, x + r + 1
            if y0 < 0 or x0 < 0 or y1 > _SCREEN_H or x1 > _SCREEN_W:
                # part of the crop is off the screen: pad with blanks (unseen stone)
                pc, pg = self._padded_buffers()
                pc[r:r + _SCREEN_H, r:r + _SCREEN_W] = chars
                pg[r:r + _SCREEN_H, r:r + _SCREEN_W] = glyphs
                cg, gg = pc[y0 + r:y1 + r, x0 + r:x1 + r], pg[y0 + r:y1 + r, x0 + r:x1 + r]
            else:
                cg, gg = chars[y0:y1, x0:x1], glyphs[y0:y1, x0:x1]
        else:
            y0, y1, x0, x1 = _bounding_box(raw, chars)
            cg, gg = chars[y0:y1, x0:x1], glyphs[y0:y1, x0:x1]
        gh, gw = y1 - y0, x1 - x0
        # one id byte per cell for its glyph (ids are given per episode), so that the cells of a
        # glyph are found with bytes.find
        id_bytes: bytes | None = self._glyph_id.take(gg).tobytes()
        if _NEW_ID in id_bytes:  # glyphs new in this episode
            if self._assign_glyph_ids(gg):
                id_bytes = self._glyph_id.take(gg).tobytes()
            else:
                id_bytes = None  # more distinct glyphs in view than id bytes: see _meanings_sorted
        # doors in view (drawn or not) are remembered; open doors and lava are redrawn
        if id_bytes is None:
            redraw = True
            for i in _GLYPH_DOOR.take(gg).ravel().nonzero()[0].tolist():
                self._doors.add((i % gw + x0, i // gw + y0))
        else:
            redraw = False
            for b in self._redraw_ids:
                if b in id_bytes:
                    redraw = True
                    break
            for b in self._door_ids:
                i = id_bytes.find(b)
                while i >= 0:
                    self._doors.add((i % gw + x0, i // gw + y0))
                    i = id_bytes.find(b, i + 1)
        if redraw or b"\0" in raw:
            grid = _CHAR_FIX.take(cg)  # a fresh (gh, gw) array: NUL drawn as blank
            if redraw:
                sym = _GLYPH_SYM.take(gg)
                np.copyto(grid, sym, where=sym != 0)
        else:
            grid = cg  # nothing to redraw: read the buffer in place
        drawn = grid.tobytes()
        text = drawn.decode("latin-1")
        ar, ac = y - y0, x - x0
        agent_i = ar * gw + ac if 0 <= ar < gh and 0 <= ac < gw else -1
        # legend: one meaning per symbol, from the first drawn cell (row-major) of each glyph,
        # glyphs in increasing order; '@' at the agent is "you" (its glyph is named from another
        # cell, if any)
        if id_bytes is None:
            meanings = self._meanings_sorted(obs, grid, gg, text, agent_i, y0, x0)
        else:
            # undrawn cells match no glyph: AND the ids with 0x00 (blank) / 0xFF (drawn) bytes, as
            # big integers (cheaper than numpy on a few dozen bytes)
            n = len(id_bytes)
            id_bytes = (int.from_bytes(id_bytes, "big")
                        & int.from_bytes(drawn.translate(_DRAWN_MASK), "big")).to_bytes(n, "big")
            meanings: dict[str, str] = {}
            cache = self._desc_cache
            for g, b in self._glyph_ids:
                i = id_bytes.find(b)
                if i < 0:
                    continue
                sym = text[i]
                if i == agent_i and sym == "@":
                    i = id_bytes.find(b, i + 1)  # the glyph's second cell
                    if i < 0:
                        continue
                _add_meaning(meanings, sym, g, cache, obs, i // gw + y0, i % gw + x0)
        if agent_i >= 0 and text[agent_i] == "@":
            meanings["@"] = "you" + (f" or {meanings['@']}" if "@" in meanings else "")
        rows = [text[k:k + gw].rstrip() for k in range(0, gh * gw, gw)]
        self._frame_lines = rows
        key = tuple(meanings.items())
        legend = _LEGEND_CACHE.get(key)
        if legend is None:
            if len(_LEGEND_CACHE) >= 4096:
                _LEGEND_CACHE.clear()
            legend = _LEGEND_CACHE[key] = _legend(meanings)
        pos = f"You are at row {ar}, column {ac}" + \
            (" (in a doorway: no diagonal moves)." if (x, y) in self._doors else ".")
        k = text.find(">")
        if k >= 0:
            pos += f" Stairs down at row {k // gw}, column {k % gw}."
            if self.goal_offset:
                pos += " " + _offset_sentence(k // gw - ar, k % gw - ac)
        self._frame = "\n".join(["Map (row 0 is the top):", *rows, f"Legend: {legend}", pos])
        return True

    def _assign_glyph_ids(self, gg: np.ndarray) -> bool:
        """Give the glyphs of ``gg`` without one an id byte; ``False`` if more than fit in view."""
        new = sorted(set(gg[self._glyph_id.take(gg) == _NEW_ID[0]].tolist()))
        if len(self._glyph_ids) + len(new) > _MAX_GLYPH_IDS:  # start over with the glyphs in view
            self._clear_glyph_ids()
            new = sorted(set(gg.ravel().tolist()))
            if len(new) > _MAX_GLYPH_IDS:
                return False
        for g in new:
            b = bytes([len(self._glyph_ids) + 1])
            self._glyph_id[g] = b[0]
            self._glyph_ids.append((g, b))
            if _GLYPH_SYM[g]:
                self._redraw_ids.append(b)
            if _GLYPH_DOOR[g]:
                self._door_ids.append(b)
        self._glyph_ids.sort()
        return True

    def _clear_glyph_ids(self) -> None:
        self._glyph_id.fill(_NEW_ID[0])
        self._glyph_ids.clear()
        self._redraw_ids.clear()
        self._door_ids.clear()

    def _meanings_sorted(self, obs: dict[str, np.ndarray], grid: np.ndarray, gg: np.ndarray,
                         text: str, agent_i: int, y0: int, x0: int) -> dict[str, str]:
        """The legend meanings when the view holds more distinct glyphs than there are id bytes.

        Same result as the id-based loop of :meth:`_capture`: the drawn cells are stably sorted by
        glyph, which gives each glyph's first (and second) drawn cell in row-major order.
        """
        gw = grid.shape[1]
        seen = (grid.ravel() != 32).nonzero()[0]
        meanings: dict[str, str] = {}
        if not len(seen):
            return meanings
        gl = gg.ravel().take(seen)
        order = gl.argsort(kind="stable")
        sg = gl.take(order)
        new = np.empty(len(sg), dtype=bool)
        new[0] = True
        np.not_equal(sg[1:], sg[:-1], out=new[1:])
        starts = new.nonzero()[0].tolist()
        starts.append(len(sg))
        cache = self._desc_cache
        for j in range(len(starts) - 1):
            g = int(sg[starts[j]])
            i = int(seen[order[starts[j]]])
            sym = text[i]
            if i == agent_i and sym == "@":
                if starts[j + 1] - starts[j] == 1:
                    continue
                i = int(seen[order[starts[j] + 1]])  # the glyph's second cell
            _add_meaning(meanings, sym, g, cache, obs, i // gw + y0, i % gw + x0)
        return meanings

    def _padded_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """Screen-sized chars/glyphs buffers with a blank border of half a crop (crop view)."""
        if self._pad is None:
            r = _CROP // 2
            self._pad = (np.full((_SCREEN_H + 2 * r, _SCREEN_W + 2 * r), 32, dtype=np.uint8),
                         np.full((_SCREEN_H + 2 * r, _SCREEN_W + 2 * r), _BLANK_GLYPH,
                                 dtype=np.int16))
        return self._pad

    # ---- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the wrapped NLE env (idempotent); the instance cannot be reset afterwards."""
        if not self._closed:
            self._closed = True
            self._env.close()
        super().close()

    # ---- read-only helpers (tests, scripted agents) ---------------------------------------------
    @property
    def map_rows(self) -> list[str]:
        """The rows of the map in the last observation (same text, no legend)."""
        return list(self._frame_lines)


def sym_at(grid: np.ndarray, r: int, c: int) -> str:
    """Symbol at ``grid[r, c]`` or ``""`` outside the grid."""
    if 0 <= r < grid.shape[0] and 0 <= c < grid.shape[1]:
        return chr(grid[r, c])
    return ""


def _add_meaning(meanings: dict[str, str], sym: str, glyph: int, cache: dict[int, str],
                 obs: dict[str, np.ndarray], row: int, col: int) -> None:
    """Record what ``sym`` means (NLE's screen description of ``glyph`` at ``(row, col)``, cached per
    glyph); two things drawn with the same symbol are listed as "a or b"."""
    meaning = cache.get(glyph)
    if meaning is None:
        meaning = cache[glyph] = _clean_description(_decode(obs["screen_descriptions"][row, col]))
    if sym not in meanings:
        meanings[sym] = meaning
    elif meaning not in meanings[sym].split(" or "):
        meanings[sym] += " or " + meaning


def _legend(meanings: dict[str, str]) -> str:
    """``{'@': 'you', '|': 'wall', '-': 'wall'}`` -> ``"@ you, | - wall"`` (``@``, ``>`` first)."""
    order = [s for s in _LEGEND_FIRST if s in meanings] + \
            sorted((s for s in meanings if s not in _LEGEND_FIRST), key=lambda s: (meanings[s], s))
    groups: dict[str, list[str]] = {}
    for s in order:
        groups.setdefault(meanings[s], []).append(s)
    return ", ".join(f"{' '.join(syms)} {meaning}" for meaning, syms in groups.items())


def _names_key(inv_strs: np.ndarray) -> bool:
    """Whether a line of ``inv_strs`` (NUL-padded inventory lines, one per row) contains "key"."""
    raw = inv_strs.tobytes()
    width = inv_strs.shape[-1]
    p = raw.find(b"key")
    while p >= 0:
        start = p - p % width
        end = raw.find(b"\0", start, start + width)  # the line's text ends at its first NUL
        if p + 3 <= (end if end >= 0 else start + width):
            return True
        p = raw.find(b"key", p + 1)
    return False


def _offset_sentence(dr: int, dc: int) -> str:
    """``The stairs down are 3 south and 2 east of you (direction: southeast).`` for a goal ``dr``
    rows below and ``dc`` columns right of the agent (negative: north / west); ``... are here.`` for
    (0, 0).  The direction is the compass move that shortens the way whenever no wall is between."""
    parts = []
    if dr:
        parts.append(f"{abs(dr)} {'south' if dr > 0 else 'north'}")
    if dc:
        parts.append(f"{abs(dc)} {'east' if dc > 0 else 'west'}")
    if not parts:
        return "The stairs down are here."
    way = ("north" if dr < 0 else "south" if dr > 0 else "") + ("west" if dc < 0 else "east" if dc > 0 else "")
    return f"The stairs down are {' and '.join(parts)} of you (direction: {way})."


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _variant_notes(variant: str) -> str:
    notes = []
    if "Dark" in variant or "Ultimate" in variant:
        notes.append("The level is dark: you only see cells next to you.")
    if "Monster" in variant or "Ultimate" in variant:
        notes.append("A monster may attack you; moving into it attacks it.")
    if "Trap" in variant or "Ultimate" in variant:
        notes.append("Traps '^' may hurt you.")
    if "Lava" in variant:
        notes.append("Lava '~' kills you if you step into it.")
    return (" " + " ".join(notes)) if notes else ""


def _prompt(rules: str, actions: Sequence[str]) -> str:
    moves = [a for a in actions if a in MOVE_DELTAS]
    others = [a for a in actions if a not in MOVE_DELTAS]
    text = (rules + " Blank cells are unseen or solid rock; walls block you. "
            f"Each turn pick one action. Moves (diagonals allowed): {', '.join(moves)}.")
    if others:
        text += f" Other actions: {', '.join(others)}."
    return text + "\nReply with exactly one action inside answer tags, for example " \
                  "<answer>east</answer>."


# ---- the four tasks -------------------------------------------------------------------------------

class MiniHackRoomEnv(MiniHackTextEnv):
    """``minihack-room``: walk to the stairs in a 5x5 room (``minihack/envs/room.py``).

    The default ``MiniHack-Room-5x5-v0`` has a fixed layout (agent top-left, stairs bottom-right) for
    every task id; pass ``variant="MiniHack-Room-Random-5x5-v0"`` (random positions) or
    ``"MiniHack-Room-Ultimate-5x5-v0"`` (random, dark, a monster and a trap) for seed-dependent rooms.
    """

    env_id: ClassVar[str] = "minihack-room"
    default_variant: ClassVar[str] = "MiniHack-Room-5x5-v0"
    goal_text: ClassVar[str] = "Walk to the stairs down '>' in the room."


class MiniHackMazeEnv(MiniHackTextEnv):
    """``minihack-maze``: find the stairs in a 9x9 maze under fog of war (``minihack/envs/mazewalk.py``)."""

    env_id: ClassVar[str] = "minihack-maze"
    default_variant: ClassVar[str] = "MiniHack-MazeWalk-9x9-v0"
    goal_text: ClassVar[str] = "Find the stairs down '>' in the maze."

    @classmethod
    def _rules(cls, variant: str) -> str:
        return ("You play a small NetHack level (MiniHack): a maze of narrow passages seen from above; "
                "row 0 is the top, north is up. You are '@'. You only see the passages you have "
                "already explored. Goal: find the stairs down '>' and step onto them."
                + _variant_notes(variant))


class MiniHackKeyRoomEnv(MiniHackTextEnv):
    """``minihack-keyroom``: key, locked door, stairs (``minihack/envs/keyroom.py``,
    ``minihack/dat/key_and_door_tmp.des``).

    A 5x5 room holds a 2x2 side room whose door is locked; the stairs are inside it. Actions: the 8
    moves, ``pickup`` (pick up the object you stand on; autopickup is off) and ``apply``: with the key
    in the inventory and a closed door in one of the 8 cells around you, MiniHack's own macro unlocks
    and opens the door in that one step; otherwise nothing happens. The observation adds a line
    ``Key: carried.`` / ``Key: not carried.``.
    """

    env_id: ClassVar[str] = "minihack-keyroom"
    default_variant: ClassVar[str] = "MiniHack-KeyRoom-S5-v0"
    nle_actions: ClassVar[tuple[Any, ...]] = KEY_ACTIONS
    action_aliases: ClassVar[dict[str, str]] = KEY_ALIASES
    extra_obs_keys: ClassVar[tuple[str, ...]] = ("inv_strs",)
    goal_text: ClassVar[str] = "Pick up the key, open the locked door with it and reach the stairs down '>'."

    @classmethod
    def _rules(cls, variant: str) -> str:
        return ("You play a small NetHack level (MiniHack) shown as a map seen from above: row 0 is the "
                "top, north is up. You are '@'. The stairs down '>' are in a small side room behind a "
                "locked door '+'. Goal: walk onto the key '(' and pick it up, stand next to the door "
                "and apply the key to unlock and open it (an open door is shown as \"'\"), then step "
                "onto the stairs. Doors cannot be entered or left diagonally."
                + _variant_notes(variant))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._key_held = False
        super().__init__(*args, **kwargs)
        self._inv_index = self._nle._observation_keys.index("inv_strs")  # in last_observation

    def _reset_task(self, task: int) -> None:
        self._key_held = False
        super()._reset_task(task)

    def _capture(self, obs: dict[str, np.ndarray]) -> bool:
        if not super()._capture(obs):
            return False
        inv = obs.get("inv_strs")
        if inv is not None:
            self._key_held = _names_key(inv)
        return True

    def _before_step(self, action: str) -> Any:
        if action != "apply":
            return None
        # MiniHack's key_in_inventory() and get_object_direction() cost ~20 us each: when no
        # inventory line mentions "key" there is no key (and no need to look for the door)
        inv = self._nle.last_observation[self._inv_index]
        if b"key" not in inv.tobytes():
            return False
        key = self._nle.key_in_inventory("key")
        door = self._nle.get_object_direction("closed door")
        return key is not None and door is not None

    def _after_step(self, action: str, pre: Any, message: str) -> str:
        if action != "apply":
            return message
        if message == "Never mind.":
            message = ""
        if not pre:
            return _join(message, "Nothing happens: apply works with the key in your inventory "
                                  "and a closed door next to you.")
        if self._end_status == 0 and self._nle.get_object_direction("closed door") is None:
            return _join(message, "You unlock the door with the key and open it.")
        return _join(message, "The door is still closed.")

    def _status_lines(self) -> list[str]:
        return ["Key: carried." if self._key_held else "Key: not carried."]


class MiniHackRiverEnv(MiniHackTextEnv):
    """``minihack-river``: cross a river by pushing boulders into it (``minihack/envs/river.py``).

    The stairs are east of a 3-cell-wide river of water '}'. Walking into a boulder '`' pushes it one
    cell if the cell behind is free; a boulder pushed into water fills it and makes a crossing. Walking
    into water makes you fall in (you usually crawl back out).
    """

    env_id: ClassVar[str] = "minihack-river"
    default_variant: ClassVar[str] = "MiniHack-River-v0"
    goal_text: ClassVar[str] = "Push boulders into the river to cross it and reach the stairs down '>'."

    @classmethod
    def _rules(cls, variant: str) -> str:
        return ("You play a small NetHack level (MiniHack) shown as a map seen from above: row 0 is the "
                "top, north is up. You are '@'. A river of water '}' blocks the way east to the stairs "
                "down '>'. Walk into a boulder '`' to push it one cell (the cell behind it must be "
                "free); a boulder pushed into water fills that cell so you can walk over it. You "
                "cannot swim: walking into water makes you fall in. Goal: cross the river and step "
                "onto the stairs." + _variant_notes(variant))


# Class-level prompts (default variant); instances rebuild theirs for their own variant.
for _cls in (MiniHackTextEnv, MiniHackRoomEnv, MiniHackMazeEnv, MiniHackKeyRoomEnv, MiniHackRiverEnv):
    _cls.system_prompt = _cls.build_system_prompt(
        _cls.default_variant, [_ACTION_NAMES[int(a)] for a in _cls.nle_actions])
del _cls
