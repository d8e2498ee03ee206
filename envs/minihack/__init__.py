"""MiniHack navigation tasks as text environments (installed as ``crl_bench.envs.minihack``).

Nine tasks wrap real MiniHack environments (minihack 1.0.2 on NLE 1.3.0, the NetHack Learning
Environment); the game runs in NetHack itself and this package only names the actions, renders the
symbolic observation as text and maps the game's end status to the reward:

===================  ================================  ==============================================
env id               default MiniHack id (``variant``)  actions
===================  ================================  ==============================================
minihack-room        ``MiniHack-Room-5x5-v0``          8 compass moves
minihack-maze        ``MiniHack-MazeWalk-9x9-v0``      8 compass moves
minihack-maze-15x15  ``MiniHack-MazeWalk-15x15-v0``    8 compass moves (100 actions by default)
minihack-corridor    ``MiniHack-Corridor-R3-v0``       8 moves, ``open``, ``kick``, ``search`` (100)
minihack-keyroom     ``MiniHack-KeyRoom-S5-v0``        8 compass moves, ``pickup``, ``apply``
minihack-river       ``MiniHack-River-v0``             8 compass moves (walk into a boulder to push)
minihack-corridor-   ``MiniHack-CorridorBattle-Dark-   8 compass moves (moving into a monster attacks
battle               v0``                              it; 100 actions)
minihack-quest-easy  ``MiniHack-Quest-Easy-v0``        8 moves, ``zap`` (the wand of cold; 100)
minihack-quest-      ``MiniHack-Quest-Medium-v0``      8 moves, ``zap`` (the wand of cold; 100)
medium
===================  ================================  ==============================================

Modules (each docstring lists the upstream facts it relies on):

* :mod:`.actions`: action names, the NLE action sets, reply aliases;
* :mod:`.prompts`: the system prompts (one shared intro, per-task rules, variant notes);
* :mod:`.render`: NLE observation -> map, legend and position text (:class:`~.render.MapRenderer`);
* :mod:`.env`: :class:`MiniHackTextEnv`, the NLE adapter (seeding, stepping, end status -> reward);
* :mod:`.tasks`: the navigation task classes;
* :mod:`.quests`: the tasks with fights (corridor battle, quests);
* :mod:`.explore`: a scripted explorer, the check that navigation tasks are solvable.

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

from .actions import CORRIDOR_ACTIONS, KEY_ACTIONS, KEY_ALIASES, MOVE_ACTIONS, MOVE_ALIASES, MOVE_DELTAS
from .env import MiniHackTextEnv
from .quests import QUEST_ACTIONS, MiniHackCorridorBattleEnv, MiniHackQuestEasyEnv, MiniHackQuestMediumEnv
from .render import offset_sentence as _offset_sentence  # noqa: F401 - the module's former private name (tests)
from .tasks import (
    MiniHackCorridorEnv,
    MiniHackKeyRoomEnv,
    MiniHackMaze15Env,
    MiniHackMazeEnv,
    MiniHackRiverEnv,
    MiniHackRoomEnv,
)

__all__ = [
    "CORRIDOR_ACTIONS",
    "KEY_ACTIONS",
    "KEY_ALIASES",
    "MOVE_ACTIONS",
    "MOVE_ALIASES",
    "MOVE_DELTAS",
    "QUEST_ACTIONS",
    "MiniHackCorridorBattleEnv",
    "MiniHackCorridorEnv",
    "MiniHackKeyRoomEnv",
    "MiniHackMaze15Env",
    "MiniHackMazeEnv",
    "MiniHackQuestEasyEnv",
    "MiniHackQuestMediumEnv",
    "MiniHackRiverEnv",
    "MiniHackRoomEnv",
    "MiniHackTextEnv",
]
