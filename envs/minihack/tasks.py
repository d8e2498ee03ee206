"""The MiniHack tasks: room, the two mazes, corridors, key room and river (subclasses of :class:`MiniHackTextEnv`;
env ids, default MiniHack ids and actions in the package docstring).

Facts used (read in the upstream sources named, and measured on this machine):

* ``minihack/envs/room.py``: ``MiniHack-Room-5x5-v0`` is *not* random (``random=False``: agent in
  the top-left corner, stairs in the bottom-right), so every task id gives the same 5x5 room; the
  ``variant`` setting selects e.g. ``MiniHack-Room-Random-5x5-v0`` or
  ``MiniHack-Room-Ultimate-5x5-v0`` (dark, one monster, one trap) where the seed matters.
* ``minihack/envs/keyroom.py`` (``MiniHackKeyDoor.step``): when APPLY is chosen while a key is in the
  inventory and a closed door is in one of the 8 neighbouring cells, MiniHack itself plays
  ``apply, <key letter>, <door direction>, y`` (unlock) and then walks into the door until it is open;
  the APPLY command it sends afterwards opens the "What do you want to use or apply?" prompt, which
  NLE's ``_perform_known_steps`` answers with ESC ("Never mind."). Without key or door the same ESC
  happens. So one ``apply`` is one agent decision, with no follow-up prompt for the agent; the wrapper
  replaces "Never mind." by a message saying whether the door was opened.
* Doors seen during the episode are remembered, so standing in a doorway is reported (NetHack forbids
  diagonal moves into or out of doorways).
* Known limit: MiniHack's apply macro loops ``while`` the door next to the agent stays closed; with
  the blessed key unlocking and opening succeed within a few game turns (200/200 scripted KeyRoom
  tasks solved here), but a door that could never open would hang that call.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .actions import CORRIDOR_ACTIONS, KEY_ACTIONS, KEY_ALIASES
from .env import MiniHackTextEnv, join_messages
from .prompts import MAZE_SCENE

__all__ = ["MiniHackCorridorEnv", "MiniHackKeyRoomEnv", "MiniHackMaze15Env", "MiniHackMazeEnv", "MiniHackRiverEnv",
           "MiniHackRoomEnv"]


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


class MiniHackRoomEnv(MiniHackTextEnv):
    """``minihack-room``: walk to the stairs in a 5x5 room (``minihack/envs/room.py``).

    The default ``MiniHack-Room-5x5-v0`` has a fixed layout (agent top-left, stairs bottom-right) for
    every task id; pass ``variant="MiniHack-Room-Random-5x5-v0"`` (random positions) or
    ``"MiniHack-Room-Ultimate-5x5-v0"`` (random, dark, a monster and a trap) for seed-dependent rooms.
    """

    env_id: ClassVar[str] = "minihack-room"
    default_variant: ClassVar[str] = "MiniHack-Room-5x5-v0"
    #: the released MiniHackRoomUltimate configuration's ``observation_keys`` plus ``chars``
    raw_keys: ClassVar[tuple[str, ...]] = ("glyphs", "message", "chars_crop", "glyphs_crop",
                                           "screen_descriptions", "chars")
    goal_text: ClassVar[str] = "Walk to the stairs down '>' in the room."
    # rules_text: the base class's (step onto the stairs)


class MiniHackMazeEnv(MiniHackTextEnv):
    """``minihack-maze``: find the stairs in a 9x9 maze under fog of war (``minihack/envs/mazewalk.py``)."""

    env_id: ClassVar[str] = "minihack-maze"
    default_variant: ClassVar[str] = "MiniHack-MazeWalk-9x9-v0"
    goal_text: ClassVar[str] = "Find the stairs down '>' in the maze."
    scene_text: ClassVar[str] = MAZE_SCENE
    rules_text: ClassVar[str] = ("You only see the passages you have already explored. Goal: find the "
                                 "stairs down '>' and step onto them.")


class MiniHackMaze15Env(MiniHackMazeEnv):
    """``minihack-maze-15x15``: the 15x15 maze (``MiniHack-MazeWalk-15x15-v0``, one of BALROG's eight
    MiniHack tasks), 100 actions by default as BALROG allows (``minihack_kwargs.max_episode_steps``).

    Its action set is MiniHack's own for the maze (``MiniHackNavigation``: the 8 compass moves). The
    explorer of :mod:`.explore` solves each of the first 50 eval tasks, 44 of them within 100 actions.
    """

    env_id: ClassVar[str] = "minihack-maze-15x15"
    default_variant: ClassVar[str] = "MiniHack-MazeWalk-15x15-v0"
    default_max_steps: ClassVar[int] = 100


class MiniHackCorridorEnv(MiniHackTextEnv):
    """``minihack-corridor``: three lit rooms joined by random corridors, the stairs down in one of them
    (``MiniHack-Corridor-R3-v0``, ``minihack/dat/corridor3.des``: ``RANDOM_CORRIDORS``), one of BALROG's
    eight MiniHack tasks; 100 actions by default, as BALROG allows.

    Actions are MiniHack's own for the corridors: the 8 moves, ``open`` and ``kick`` (NetHack then asks
    "In what direction?", shown as the step's message; the next move answers it) and ``search``
    (NetHack's random corridors and doors can be hidden until searched for next to them).
    """

    env_id: ClassVar[str] = "minihack-corridor"
    default_variant: ClassVar[str] = "MiniHack-Corridor-R3-v0"
    default_max_steps: ClassVar[int] = 100
    nle_actions: ClassVar[tuple[Any, ...]] = CORRIDOR_ACTIONS
    goal_text: ClassVar[str] = "Find the stairs down '>' in one of the rooms and step onto them."
    rules_text: ClassVar[str] = (
        "Rooms are joined by corridors '#' that you see only next to you. Goal: find the stairs down '>' "
        "and step onto them. Walking into a closed door '+' opens it; open and kick ask for a direction, "
        "which your next move gives; search looks for hidden doors and corridors next to you.")


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
    rules_text: ClassVar[str] = (
        "The stairs down '>' are in a small side room behind a locked door '+'. Goal: walk onto the key "
        "'(' and pick it up, stand next to the door and apply the key to unlock and open it (an open "
        "door is shown as \"'\"), then step onto the stairs. Doors cannot be entered or left diagonally.")

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
            return join_messages(message, "Nothing happens: apply works with the key in your inventory "
                                          "and a closed door next to you.")
        if self._end_status == 0 and self._nle.get_object_direction("closed door") is None:
            return join_messages(message, "You unlock the door with the key and open it.")
        return join_messages(message, "The door is still closed.")

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
    rules_text: ClassVar[str] = (
        "A river of water '}' blocks the way east to the stairs down '>'. Walk into a boulder '`' to push "
        "it one cell (the cell behind it must be free); a boulder pushed into water fills that cell so you "
        "can walk over it. You cannot swim: walking into water makes you fall in. Goal: cross the river "
        "and step onto the stairs.")
