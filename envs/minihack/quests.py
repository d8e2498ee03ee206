"""The MiniHack tasks with fighting: the corridor battle and the two quests (subclasses of
:class:`~.env.MiniHackTextEnv`; three of BALROG's eight MiniHack tasks).

Facts used (read in the upstream sources named, minihack 1.0.2 on NLE 1.3.0, and measured on this machine):

* ``minihack/envs/fightcorridor.py``: ``MiniHack-CorridorBattle(-Dark)-v0`` is a ``MiniHackNavigation``
  (actions: the 8 compass moves) played as a lawful human Knight: a 3x3 start room joined by a corridor
  to a 3x20 room holding six giant rats at its east end, the stairs down beyond them (fixed map; the
  seed moves the start and the rats' moves and fights). ``-Dark`` is the same level unlit. Walking
  into a monster attacks it.
* ``minihack/envs/skills_quest.py`` with ``minihack/dat/quest_easy.des`` / ``quest_medium.des``:
  ``MiniHackSkill`` levels (full keyboard in MiniHack; a caveman in Easy, a Knight in Medium) with
  ``autopickup``, so the blessed wand of cold and frost horn lying on the start cell are in the
  inventory at reset. Easy: a column of lava '~' (``L`` in the map) splits the start room, two random
  monsters, the stairs in a small room at the end of a corridor. Medium: a corridor to a big room with
  six giant rats and a lava column in front of the stairs' room. The stairs cannot be reached without
  crossing the lava: a ray of cold freezes the lava it crosses ("The lava cools and solidifies.").
* NetHack 3.6 ``dozap`` (``zap.c``): ``z`` asks "What do you want to zap? [g or ?*]", then the wand's
  letter asks "In what direction?". NLE's ``_perform_known_steps`` (``nle/env/base.py``) answers a
  prompt with ESC unless ``allow_all_yn_questions`` is set or the prompt holds "eat", "attack",
  "direction?" or "pray" (``SKIP_EXCEPTIONS``); these envs do not set it, so only the direction (which
  the next move gives) and "Really attack the ...?" (a peaceful monster, declined by the env) are left
  to answer.
* ``blstats`` index 10 / 11 (``nle/nethack/nethack.py`` ``NLE_BL_HP`` / ``NLE_BL_HPMAX``): hit points.
"""

from __future__ import annotations

import string
from typing import Any, ClassVar

import numpy as np
from nle import nethack

from .actions import MOVE_ACTIONS, MOVE_ALIASES
from .env import MiniHackTextEnv, join_messages

__all__ = ["QUEST_ACTIONS", "MiniHackCorridorBattleEnv", "MiniHackQuestEasyEnv", "MiniHackQuestMediumEnv"]

#: NLE action set of the quests: the 8 moves, then ZAP (the env picks the wand; NetHack then asks for a
#: direction, which the next move gives).
QUEST_ACTIONS: tuple[Any, ...] = MOVE_ACTIONS + (nethack.Command.ZAP,)
_KEY_ACTIONS = {int(a): a for a in nethack.ACTIONS}
#: the keys the quests send themselves: ESC (declining a prompt) and every inventory letter that is not
#: already the key of a move
_QUEST_HIDDEN: tuple[Any, ...] = (nethack.Command.ESC,) + tuple(
    _KEY_ACTIONS[ord(c)] for c in string.ascii_letters if ord(c) not in {int(a) for a in QUEST_ACTIONS})
_ZAP_ALIASES = {"zap wand": "zap", "zap the wand": "zap", "use wand": "zap", "use the wand": "zap",
                "zap wand of cold": "zap", "freeze": "zap"}


class _FightMixin:
    """Shows the hit points under the map (``HP: 14 of 16.``); a fight can be lost."""

    _hp: tuple[int, int] = (0, 0)

    def _capture(self, obs: dict[str, np.ndarray]) -> bool:
        if not super()._capture(obs):  # type: ignore[misc]
            return False
        bl = obs["blstats"]
        self._hp = (int(bl[nethack.NLE_BL_HP]), int(bl[nethack.NLE_BL_HPMAX]))
        return True

    def _status_lines(self) -> list[str]:
        return [*super()._status_lines(), f"HP: {self._hp[0]} of {self._hp[1]}."]  # type: ignore[misc]


class MiniHackCorridorBattleEnv(_FightMixin, MiniHackTextEnv):
    """``minihack-corridor-battle``: past six giant rats to the stairs, in the dark
    (``MiniHack-CorridorBattle-Dark-v0``, one of BALROG's eight MiniHack tasks; ``variant=
    "MiniHack-CorridorBattle-v0"`` is the lit level). 100 actions by default, as BALROG allows.

    Actions are MiniHack's own for the task, the 8 compass moves; moving into a monster attacks it. The
    observation adds the hit points (``HP: 14 of 16.``). The explorer of :mod:`.explore` (which attacks
    whatever stands in its way) measures how often the task is won with these actions.
    """

    env_id: ClassVar[str] = "minihack-corridor-battle"
    default_variant: ClassVar[str] = "MiniHack-CorridorBattle-Dark-v0"
    default_max_steps: ClassVar[int] = 100
    goal_text: ClassVar[str] = "Get past the giant rats to the stairs down '>' at the far east end of the level."
    rules_text: ClassVar[str] = (
        "You are a knight. A corridor leads east from your small room to a long room; giant rats 'r' wait "
        "at its far end, and the stairs down '>' are behind them. Moving into a monster attacks it; if "
        "your hit points (HP) reach 0 you die. Goal: step onto the stairs.")


class MiniHackQuestEnv(_FightMixin, MiniHackTextEnv):
    """Base of the quests: lava between the agent and the stairs, a wand of cold in the inventory,
    monsters on the way (``minihack/envs/skills_quest.py``).

    Actions: the 8 moves and ``zap``: with the wand in the inventory, the env chooses it at NetHack's
    "What do you want to zap?" and NetHack asks "In what direction?", shown as the step's message; the
    next move gives the direction (the cold ray freezes the lava it crosses). Without a wand NetHack's
    own answer is shown. A "Really attack the ...?" question (moving into a peaceful monster) is
    declined by the env and said so. The observation adds the hit points and whether the wand is
    carried (``Wand: carried.`` / ``Wand: not carried.``).
    """

    env_id: ClassVar[str] = "minihack-quest"
    nle_actions: ClassVar[tuple[Any, ...]] = QUEST_ACTIONS
    hidden_actions: ClassVar[tuple[Any, ...]] = _QUEST_HIDDEN
    action_aliases: ClassVar[dict[str, str]] = {**MOVE_ALIASES, **_ZAP_ALIASES}
    default_max_steps: ClassVar[int] = 100
    extra_obs_keys: ClassVar[tuple[str, ...]] = ("inv_strs", "inv_letters")
    goal_text: ClassVar[str] = ("Cross the lava with your wand of cold, fight past the monsters and reach the "
                                "stairs down '>'.")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._wand: str | None = None
        self._declined = ""
        super().__init__(*args, **kwargs)

    def _reset_task(self, task: int) -> None:
        self._wand = None
        super()._reset_task(task)

    def _capture(self, obs: dict[str, np.ndarray]) -> bool:
        if not super()._capture(obs):
            return False
        self._wand = None
        for letter, line in zip(obs["inv_letters"].tolist(), obs["inv_strs"]):
            if not letter:
                break
            if b"wand" in line.tobytes():
                self._wand = chr(letter)
                break
        return True

    def _send(self, action: str) -> tuple[Any, ...]:
        # zap: press z, then answer NetHack's "What do you want to zap?" with the wand's letter; the step
        # that sends the letter is the env's step (its observation is the one shown), and it ends at
        # "In what direction?", which NLE leaves for the next move to answer
        if action == "zap" and self._wand is not None and not self._awaiting_direction():
            self._nle.nethack.step(ord("z"))
            result = self._send_key(self._wand)
        else:
            result = super()._send(action)
        message = bytes(self._nle.last_observation[self._nle._message_index])
        if b"Really attack" in message:
            self._declined = message.split(b"\0", 1)[0].decode("latin-1").strip()
            result = self._send_key(nethack.Command.ESC)
        return result

    def _awaiting_direction(self) -> bool:
        message = bytes(self._nle.last_observation[self._nle._message_index]).split(b"\0", 1)[0]
        return message.rstrip().endswith(b"direction?")

    def _before_step(self, action: str) -> Any:
        self._declined = ""
        return None

    def _after_step(self, action: str, pre: Any, message: str) -> str:
        if self._declined:
            return join_messages(message, f"{self._declined} You did not attack: it is peaceful.")
        return message

    def _status_lines(self) -> list[str]:
        wand = "Wand: carried." if self._wand is not None else "Wand: not carried."
        return [*super()._status_lines(), wand]


_QUEST_RULES = ("Lava '~' kills you if you step into it. You carry a wand of cold: choose zap, then a move "
                "gives the direction; the ray of cold freezes the lava it crosses into ground you can walk "
                "on. Moving into a monster attacks it; if your hit points (HP) reach 0 you die. ")


class MiniHackQuestEasyEnv(MiniHackQuestEnv):
    """``minihack-quest-easy``: a lava column across the start room, two random monsters, the stairs at
    the end of a corridor (``MiniHack-Quest-Easy-v0``, ``quest_easy.des``; a caveman). 100 actions by
    default, as BALROG allows."""

    env_id: ClassVar[str] = "minihack-quest-easy"
    default_variant: ClassVar[str] = "MiniHack-Quest-Easy-v0"
    rules_text: ClassVar[str] = (_QUEST_RULES + "A column of lava blocks your room; beyond it a corridor "
                                 "leads east to a small room with the stairs down '>'. Goal: step onto the stairs.")


class MiniHackQuestMediumEnv(MiniHackQuestEnv):
    """``minihack-quest-medium``: a corridor to a big room with six giant rats, then a lava column in
    front of the stairs' room (``MiniHack-Quest-Medium-v0``, ``quest_medium.des``; a Knight). 100
    actions by default, as BALROG allows."""

    env_id: ClassVar[str] = "minihack-quest-medium"
    default_variant: ClassVar[str] = "MiniHack-Quest-Medium-v0"
    rules_text: ClassVar[str] = (_QUEST_RULES + "A corridor leads east from your room to a big room with "
                                 "giant rats 'r'; at its east end a column of lava is in front of the "
                                 "stairs down '>'. Goal: step onto the stairs.")
