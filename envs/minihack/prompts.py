"""System prompts of the MiniHack text envs: one shared intro, per-task rules, variant notes and the
action list.

A system prompt is::

    <intro> <task rules><variant notes> <map conventions> <action list>
    Reply with exactly one action inside answer tags, ...

where only the task rules (and, for the maze, the scene of the intro) differ between the tasks.
"""

from __future__ import annotations

from collections.abc import Sequence

from .actions import MOVE_DELTAS

#: Scene of the intro for a level seen as a whole map (every task but the maze).
MAP_SCENE = " shown as a map seen from above:"
#: Scene of the intro for the maze.
MAZE_SCENE = ": a maze of narrow passages seen from above;"


def intro(scene: str = MAP_SCENE) -> str:
    """The sentences every MiniHack system prompt opens with.

    ``scene`` follows "(MiniHack)" and ends with the punctuation before "row 0 is the top", e.g.
    :data:`MAP_SCENE` (``"... (MiniHack) shown as a map seen from above: row 0 is the top, north is
    up. You are '@'."``) or :data:`MAZE_SCENE`.
    """
    return f"You play a small NetHack level (MiniHack){scene} row 0 is the top, north is up. You are '@'."


def variant_notes(variant: str) -> str:
    """Hazard sentences for a MiniHack id, read from its name (``Dark``, ``Monster``, ``Trap``,
    ``Ultimate`` = all three, ``Lava``); ``""`` when none apply, else the sentences with a leading
    blank."""
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


def build_prompt(rules: str, variant: str, actions: Sequence[str], scene: str = MAP_SCENE) -> str:
    """The full system prompt: :func:`intro` (with ``scene``), the task's ``rules``, the notes of
    ``variant`` (:func:`variant_notes`), the map conventions, the action names ``actions`` (moves
    first, then the others, each group in the given order) and the answer format."""
    moves = [a for a in actions if a in MOVE_DELTAS]
    others = [a for a in actions if a not in MOVE_DELTAS]
    text = (f"{intro(scene)} {rules}{variant_notes(variant)} Blank cells are unseen or solid rock; walls "
            f"block you. Each turn pick one action. Moves (diagonals allowed): {', '.join(moves)}.")
    if others:
        text += f" Other actions: {', '.join(others)}."
    return text + "\nReply with exactly one action inside answer tags, for example " \
                  "<answer>east</answer>."
