"""Action names, action sets and reply aliases of the MiniHack text envs.

NLE action constants come from ``nle.nethack`` (``nle/nethack/actions.py``: ``CompassDirection``
and ``Command``, NLE 1.3.0); the names and aliases are this project's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nle import nethack

#: NLE action (as ``int``) -> canonical action name (lower case).
ACTION_NAMES: dict[int, str] = {
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
    int(nethack.Command.OPEN): "open",
    int(nethack.Command.KICK): "kick",
    int(nethack.Command.SEARCH): "search",
    int(nethack.Command.ZAP): "zap",
}

#: Screen displacement ``(d_row, d_col)`` of each move (row grows southwards).
MOVE_DELTAS: dict[str, tuple[int, int]] = {
    "north": (-1, 0), "east": (0, 1), "south": (1, 0), "west": (0, -1),
    "northeast": (-1, 1), "southeast": (1, 1), "southwest": (1, -1), "northwest": (-1, -1),
}

#: NLE action set of the move-only envs: the 8 compass directions in NLE's order (N, E, S, W, NE,
#: SE, SW, NW).
MOVE_ACTIONS: tuple[Any, ...] = tuple(nethack.CompassDirection)
#: NLE action set of KeyRoom: the 8 moves, then PICKUP and APPLY.
KEY_ACTIONS: tuple[Any, ...] = MOVE_ACTIONS + (nethack.Command.PICKUP, nethack.Command.APPLY)
#: NLE action set of the corridors, MiniHack's own (``minihack/envs/corridor.py`` NAVIGATE_ACTIONS): the 8
#: moves, then OPEN and KICK (each asks "In what direction?", which the next move answers) and SEARCH.
CORRIDOR_ACTIONS: tuple[Any, ...] = MOVE_ACTIONS + (nethack.Command.OPEN, nethack.Command.KICK,
                                                   nethack.Command.SEARCH)


def action_names(actions: Iterable[Any]) -> tuple[str, ...]:
    """Canonical names of NLE ``actions`` (enum members or ints), in the same order.

    Raises:
        KeyError: an action without a name in :data:`ACTION_NAMES`.
    """
    return tuple(ACTION_NAMES[int(a)] for a in actions)


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


#: Reply text -> move name: abbreviations (``ne``), screen words (``up right``), spelled-apart
#: diagonals (``north-east``), each also after ``move `` / ``go ``.
MOVE_ALIASES: dict[str, str] = _move_aliases()
#: :data:`MOVE_ALIASES` plus the wordings of ``pickup`` and ``apply`` (KeyRoom).
KEY_ALIASES: dict[str, str] = {
    **MOVE_ALIASES,
    "pick up": "pickup", "pick-up": "pickup", "pick up key": "pickup", "pick up the key": "pickup",
    "take": "pickup", "take key": "pickup", "grab": "pickup", ",": "pickup",
    "use": "apply", "use key": "apply", "use the key": "apply", "apply key": "apply",
    "apply the key": "apply", "unlock": "apply", "unlock door": "apply",
    "unlock the door": "apply", "open": "apply", "open door": "apply", "open the door": "apply",
}
