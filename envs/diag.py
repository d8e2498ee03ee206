"""Diagnostic environments of the experience mechanism: ``diag-vault`` and ``diag-corridor``.

These envs are not benchmarks of agent skill: a model's success on them says nothing about how well it
plays games.  They are built to test whether experience (an extracted lesson, retrieved and followed)
does its job, by making experience

* **necessary**: the winning actions of a task cannot be inferred from its observation.  The places
  (*contexts*) are made-up proper names with nothing to do with the actions, and the rest of the
  observation depends only on the task's variant, never on its solution.  An agent without memory of
  earlier episodes succeeds at chance rate;
* **sufficient**: every task of a context has the same solution, and one successful episode of a
  context contains the whole of it.  An agent that keeps the lesson of that episode and follows it
  succeeds on every later task of the context.

Task ids.  ``task = variant * 16 + context``: 16 contexts (:data:`CONTEXT_NAMES`), each with a fixed
secret solution.  The variant picks the surface text (:func:`surface_text`: a sentence on the weather
and one on the people around), so different tasks of one context have different observations, which
all name the context in their first line and in :meth:`~DiagEnv.task_prompt`.

Splits (:data:`DIAG_SPLITS`; no two share a task):

* ``train``: variants ``0..9999`` of the *seen* contexts ``0..7`` (80,000 tasks);
* ``eval``: variants ``10000..10007`` of the seen contexts (64 tasks, 8 per context): new tasks of the
  trained contexts, where experience gathered in training can help;
* ``eval_unseen``: variants ``10000..10007`` of the *unseen* contexts ``8..15`` (64 tasks): contexts
  never met in training, where it cannot.  Success there stays at chance unless the observation leaks
  the solution; the gap between ``eval`` and ``eval_unseen`` is what experience carries.

The envs:

* ``diag-vault`` (:class:`DiagVaultEnv`): one action.  Each context's vault has a secret code, one of
  8 dial positions (:data:`VAULT_ACTIONS`, marked by symbols); the first valid action ends the episode,
  with reward 1 if it is the code.  Each position is the code of exactly one seen and exactly one
  unseen context (:data:`VAULT_CODES`), so a uniformly random policy *and any constant policy*
  succeed on exactly 1/8 of the tasks of each split.  Chance rate: 1/8 = 0.125.
* ``diag-corridor`` (:class:`DiagCorridorEnv`): a series of ``length`` doors (default 3), at each of
  which one of ``choices`` passages (default 3: left, middle, right) is right.  A right passage leads
  to the next door (reward 0) or, at the last door, to success (reward 1); a wrong one ends the
  episode with reward 0.  Balance (:func:`corridor_sequences`): at every door, each passage is the
  right one for ``floor(8 / choices)`` or ``ceil(8 / choices)`` of the seen contexts, and likewise of
  the unseen contexts (3, 3 and 2 for the defaults), so a policy that always takes one passage at a
  given door gets past it for about ``1 / choices`` of the contexts.  Chance rate:
  ``(1 / choices) ** length``, 1/27 (about 0.037) for the defaults.

Chance rates are those of a policy picking uniformly among the valid actions at every step
(:meth:`DiagEnv.chance_success_rate`); invalid replies only use up steps (``max_steps`` is small: 3
for the vault, ``length + 2`` for the corridor).  Failure messages never name the right action.
"""

from __future__ import annotations

import abc
import hashlib
import operator
import re
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any, ClassVar

from crl_bench.env_api import AnswerParser, TextEnv

#: contexts per variant: ``task = variant * N_CONTEXTS + context``
N_CONTEXTS = 16
#: contexts of the train and eval splits
SEEN_CONTEXTS = range(0, 8)
#: contexts of the eval_unseen split only
UNSEEN_CONTEXTS = range(8, 16)
TRAIN_VARIANTS = range(0, 10_000)
EVAL_VARIANTS = range(10_000, 10_008)

#: the context names, by context index: invented proper names and a building, 16 different buildings
#: (so that the names differ in a real word too); none holds or suggests an action name
CONTEXT_NAMES: tuple[str, ...] = (
    "Corvane Archive", "Haldel Observatory", "Mirrow Library", "Tessaly Chapel",
    "Brannock Keep", "Oskari Hall", "Tamsworth Abbey", "Velloc Tower",
    "Quillon Museum", "Arbeth Treasury", "Hadley Manor", "Lorimar Depot",
    "Kandry Exchange", "Ketterby Conservatory", "Pallister Gallery", "Nymark Citadel",
)

#: the dial positions of ``diag-vault``, in the order the observation lists them
VAULT_ACTIONS: tuple[str, ...] = ("anchor", "bell", "crown", "feather", "key", "lamp", "moon", "star")

#: the secret code of each context of ``diag-vault`` (by context index).  The first eight (seen
#: contexts) and the last eight (unseen contexts) are each a permutation of :data:`VAULT_ACTIONS`, and
#: no context has the code of the context eight places before or after it.
VAULT_CODES: tuple[str, ...] = (
    "key", "anchor", "moon", "crown", "star", "lamp", "bell", "feather",
    "crown", "lamp", "anchor", "star", "feather", "bell", "key", "moon",
)

#: the passages of ``diag-corridor``; an env with ``choices=c`` uses the first ``c``
CORRIDOR_ACTIONS: tuple[str, ...] = ("left", "middle", "right", "upper", "lower", "narrow")

# surface text: no sentence may contain an action name of either env (tests check this)
_WEATHER: tuple[str, ...] = (
    "Rain drums on the roof.",
    "It is a still, dry day.",
    "Wind rattles the shutters.",
    "Snow has settled on the steps outside.",
    "Fog hangs over the courtyard.",
    "The air is warm and heavy.",
    "Thunder rumbles far away.",
)
_PEOPLE: tuple[str, ...] = (
    "A guard dozes on a stool by the entrance.",
    "A clerk is counting coins at a desk.",
    "Nobody else is about.",
    "A caretaker sweeps the floor and pays you no attention.",
    "Two visitors whisper near the stairs.",
    "A cat watches you from a windowsill.",
)


def surface_text(variant: int) -> str:
    """The two sentences of surface text of ``variant`` (a non-negative int): a weather sentence and a
    people sentence.  Any 42 consecutive variants have different texts; the text carries no
    information on any solution (it does not depend on the context)."""
    w = len(_WEATHER)
    return f"{_WEATHER[variant % w]} {_PEOPLE[(variant // w) % len(_PEOPLE)]}"


class ContextTasks(Sequence[int]):
    """The task ids ``variant * 16 + context`` of every variant in ``variants`` and context in
    ``contexts``, variant-major: index ``i`` is
    ``variants[i // len(contexts)] * 16 + contexts[i % len(contexts)]``.

    Length, indexing and membership are O(1), so a split of 80,000 tasks costs no memory; a slice
    gives a list of ints.

    Args:
        variants: a range of non-negative variants.
        contexts: a range of context indices within ``0..15``.

    Raises:
        ValueError: a variant is negative or a context is outside ``0..15``.
    """

    __slots__ = ("variants", "contexts")

    def __init__(self, variants: range, contexts: range) -> None:
        if len(variants) and min(variants) < 0:
            raise ValueError(f"variants must be non-negative, got {variants}")
        if len(contexts) and (min(contexts) < 0 or max(contexts) >= N_CONTEXTS):
            raise ValueError(f"contexts must lie in 0..{N_CONTEXTS - 1}, got {contexts}")
        self.variants = variants
        self.contexts = contexts

    def __len__(self) -> int:
        return len(self.variants) * len(self.contexts)

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = operator.index(index)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"task index {index} out of range for {n} tasks")
        v, c = divmod(i, len(self.contexts))
        return self.variants[v] * N_CONTEXTS + self.contexts[c]

    def __contains__(self, task: object) -> bool:
        if isinstance(task, bool):
            return False
        try:
            t = operator.index(task)
        except TypeError:
            return False
        variant, context = divmod(t, N_CONTEXTS)
        return variant in self.variants and context in self.contexts

    def __iter__(self) -> Iterator[int]:
        for v in self.variants:
            for c in self.contexts:
                yield v * N_CONTEXTS + c

    def __repr__(self) -> str:
        return f"ContextTasks(variants={self.variants}, contexts={self.contexts})"


#: the splits of both diagnostics (module docstring)
DIAG_SPLITS: dict[str, ContextTasks] = {
    "train": ContextTasks(TRAIN_VARIANTS, SEEN_CONTEXTS),
    "eval": ContextTasks(EVAL_VARIANTS, SEEN_CONTEXTS),
    "eval_unseen": ContextTasks(EVAL_VARIANTS, UNSEEN_CONTEXTS),
}

# salts tried per group of contexts by corridor_sequences before it settles for the best table seen
_MAX_SALTS = 1000


def _rank_key(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


@lru_cache(maxsize=32)
def corridor_sequences(length: int, choices: int) -> tuple[tuple[str, ...], ...]:
    """The secret passage sequence of each of the 16 contexts of ``diag-corridor``.

    Built one group of contexts at a time (seen ``0..7``, then unseen ``8..15``).  For each door ``k``
    the group's 8 contexts are put in an order fixed by salted SHA-256 hashes (the same on every
    machine and version), and the context of rank ``r`` gets passage ``CORRIDOR_ACTIONS[r % choices]``;
    so at every door each passage is right for ``floor(8 / choices)`` or ``ceil(8 / choices)`` contexts
    of each group.  A group takes the first salt ``0, 1, ...`` that makes its sequences differ from each
    other and from the earlier group's, none of them taking one passage at every door (so a policy
    that always takes the same passage never succeeds).  That holds for the defaults and for any
    setting where one of 1000 salts gives it; otherwise the group takes the first of those salts with
    the most distinct sequences, then the most sequences that are not constant.

    Args:
        length: doors per corridor (>= 1).
        choices: passages per door, ``1..len(CORRIDOR_ACTIONS)``.

    Returns:
        16 tuples of ``length`` passage names, by context index.

    Raises:
        ValueError: ``length`` or ``choices`` out of range.
    """
    if length < 1 or not 1 <= choices <= len(CORRIDOR_ACTIONS):
        raise ValueError(f"need length >= 1 and 1 <= choices <= {len(CORRIDOR_ACTIONS)}, "
                         f"got length={length}, choices={choices}")
    table: list[tuple[str, ...]] = []
    for group, contexts in (("seen", SEEN_CONTEXTS), ("unseen", UNSEEN_CONTEXTS)):
        best: list[tuple[str, ...]] = []
        best_score = (-1, -1)
        for salt in range(_MAX_SALTS):
            seqs = [[""] * length for _ in contexts]
            for k in range(length):
                order = sorted(range(len(contexts)),
                               key=lambda j, k=k: _rank_key(f"diag-corridor/{group}/{salt}/{k}/{j}"))
                for rank, j in enumerate(order):
                    seqs[j][k] = CORRIDOR_ACTIONS[rank % choices]
            frozen = [tuple(seq) for seq in seqs]
            score = (len(set(table + frozen)), sum(len(set(seq)) > 1 for seq in frozen))
            if score > best_score:
                best, best_score = frozen, score
            if score == (len(table) + len(contexts), len(contexts)):
                break
        table += best
    return tuple(table)


# the pieces of practice-world context names: invented first words, and buildings (none holds or
# suggests an action name of either diagnostic; tests check this, and that no practice name is a real one)
_PRACTICE_STARTS: tuple[str, ...] = (
    "Ab", "Bel", "Cor", "Dra", "El", "Fen", "Gal", "Hes", "Ist", "Jor", "Kel", "Lum", "Mar", "Nor", "Ost",
    "Pel", "Quen", "Ros", "Sel", "Tor", "Ul", "Var", "Wen", "Yor", "Zan",
)
_PRACTICE_ENDS: tuple[str, ...] = (
    "aby", "adin", "arth", "ebury", "ellin", "enna", "ethe", "icot", "indle", "iston", "odar", "olin",
    "orin", "umber", "usk", "wyn",
)
_PRACTICE_BUILDINGS: tuple[str, ...] = (
    "Archive", "Observatory", "Library", "Chapel", "Keep", "Hall", "Abbey", "Tower", "Museum", "Treasury",
    "Manor", "Depot", "Exchange", "Conservatory", "Gallery", "Citadel", "Mill", "Granary", "Bastion",
    "Rotunda", "Armoury", "Lodge", "Priory", "Arsenal",
)
#: the first words of the real context names, which no practice name may use
_REAL_FIRST_WORDS = frozenset(name.split()[0] for name in CONTEXT_NAMES)


@lru_cache(maxsize=256)
def practice_contexts(world: int, length: int = 3, choices: int = 3
                   ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """The invented contexts of practice world ``world``: 16 context names that are not the env's,
    with their own vault codes and corridor sequences, drawn from a generator seeded by ``world``.

    Practice worlds are what an extractor warm start (``crl-bench extractor sft``) learns from: the
    same observations, goals and lessons as the diagnostics, but no real context name and no real
    solution, so that the examples never hold an evaluation task's answer.  In each world the vault
    codes of contexts ``0..7`` and of ``8..15`` are each a permutation of :data:`VAULT_ACTIONS` (chance
    1/8 stays exact); the corridor passages are uniform draws.

    Args:
        world: a non-negative int.
        length, choices: the corridor's doors and passages (as :class:`DiagCorridorEnv`).

    Returns:
        ``(names, vault codes, corridor sequences)``, 16 of each by context index.

    Raises:
        ValueError: ``world`` is negative, or ``length`` / ``choices`` are out of range.
    """
    import random

    if world < 0:
        raise ValueError(f"practice world must be non-negative, got {world}")
    if length < 1 or not 1 <= choices <= len(CORRIDOR_ACTIONS):
        raise ValueError(f"need length >= 1 and 1 <= choices <= {len(CORRIDOR_ACTIONS)}, "
                         f"got length={length}, choices={choices}")
    rng = random.Random(f"diag-practice/{world}")
    names: list[str] = []
    while len(names) < N_CONTEXTS:
        first = rng.choice(_PRACTICE_STARTS) + rng.choice(_PRACTICE_ENDS)
        name = f"{first} {rng.choice(_PRACTICE_BUILDINGS)}"
        if (first in _REAL_FIRST_WORDS or any(n.split()[0] == first for n in names)
                or any(a in name.lower() for a in VAULT_ACTIONS + CORRIDOR_ACTIONS)):
            continue
        names.append(name)
    codes = rng.sample(VAULT_ACTIONS, len(VAULT_ACTIONS)) + rng.sample(VAULT_ACTIONS, len(VAULT_ACTIONS))
    rng2 = random.Random(f"diag-practice/{world}/corridor/{length}/{choices}")
    sequences = tuple(tuple(rng2.choice(CORRIDOR_ACTIONS[:choices]) for _ in range(length))
                      for _ in range(N_CONTEXTS))
    return tuple(names), tuple(codes), sequences


def practice_world_names(world: int) -> tuple[str, ...]:
    """The 16 context names of practice world ``world`` (:func:`practice_contexts`)."""
    return practice_contexts(world)[0]


class DiagEnv(TextEnv):
    """Base class of the diagnostics: 16 named contexts, each with one fixed winning action sequence,
    task ids ``variant * 16 + context`` and the splits of :data:`DIAG_SPLITS` (module docstring).

    Subclasses give the action set to ``__init__`` and implement :meth:`_solution_of`, :meth:`_goal`,
    :meth:`_status`, :meth:`_lesson_clause`, :meth:`_apply` and :meth:`chance_success_rate`.  Every
    method that takes a task id raises ``KeyError`` for an id of no split (:meth:`check_task`).

    Args:
        actions: the closed action set (canonical names, in the order the observation lists them).
        max_steps: actions (valid or invalid) per episode before truncation.
        render_mode: only ``"ansi"``.
        practice_world: ``None`` (the env's own contexts, :data:`CONTEXT_NAMES`) or the index of a
            practice world (:func:`practice_contexts`): invented context names with their own solutions,
            for teaching an extractor without showing it an evaluation task's answer.

    Raises:
        ValueError: ``practice_world`` is negative.
    """

    splits: ClassVar[dict[str, Sequence[int]]] = DIAG_SPLITS

    def __init__(self, actions: Sequence[str], max_steps: int, render_mode: str | None = "ansi",
                 practice_world: int | None = None) -> None:
        super().__init__(max_steps=max_steps, render_mode=render_mode)
        self.practice_world = None if practice_world is None else int(practice_world)
        self._names: tuple[str, ...] = (CONTEXT_NAMES if self.practice_world is None
                                        else practice_world_names(self.practice_world))
        self._actions: tuple[str, ...] = tuple(actions)
        # the action set is fixed: one parser for every state
        self._parser = AnswerParser(self._actions, self.action_aliases)
        self._valid_line = f"Valid actions: {', '.join(self._actions)}"
        self._context = 0
        self._variant = 0

    # ---- per-env pieces ---------------------------------------------------------------------------
    @abc.abstractmethod
    def _solution_of(self, context: int) -> tuple[str, ...]:
        """The winning action sequence of context index ``context``."""

    @abc.abstractmethod
    def _goal(self, name: str) -> str:
        """The goal sentence naming context ``name`` (first observation line and task prompt)."""

    @abc.abstractmethod
    def _status(self) -> str:
        """The line of the observation that describes the current state."""

    @abc.abstractmethod
    def _lesson_clause(self, actions: Sequence[str]) -> str:
        """The instruction of a lesson, e.g. ``"turn the dial to the key"``."""

    # ---- task facts (no reset needed) -------------------------------------------------------------
    def context_index(self, task: int) -> int:
        """The context index (``0..15``) of task id ``task``: ``task % 16``."""
        return self.check_task(task) % N_CONTEXTS

    def context(self, task: int) -> str:
        """The name of the context of task id ``task``, e.g. ``"Corvane Archive"`` (the observation
        says ``"the Corvane Archive"``)."""
        return self._names[self.context_index(task)]

    def task_fingerprint(self, task: int) -> dict[str, Any]:
        """The task's context, its solution and its first observation (:meth:`TextEnv.task_fingerprint`).
        Resets the env."""
        return {"context": self.context(task), "solution": self.solution(task), **super().task_fingerprint(task)}

    def task_type(self, task: int) -> str:
        """The context name (:meth:`context`), so that evaluation's per-type breakdown is per context."""
        return self.context(task)

    def solution(self, task: int) -> list[str]:
        """The winning action sequence of task id ``task`` (canonical action names, one per step);
        the same for every task of a context."""
        return list(self._solution_of(self.context_index(task)))

    def lesson_for(self, task: int, actions: Sequence[str]) -> str:
        """A one-sentence lesson that tells the agent to play ``actions`` in the context of task id
        ``task``, worded as an experience extractor might write it, e.g. ``"In the Corvane Archive,
        turn the dial to the key."``.  ``actions`` need not be the solution (a wrong lesson is a lesson too).

        Raises:
            KeyError: unknown task id.
            ValueError: ``actions`` is empty or holds a name outside this env's action set.
        """
        name = self.context(task)
        actions = list(actions)
        unknown = [a for a in actions if a not in self._actions]
        if not actions or unknown:
            raise ValueError(f"{self.env_id}: a lesson needs one or more of {list(self._actions)}, "
                             f"got {actions}")
        return f"In the {name}, {self._lesson_clause(actions)}."

    def grade_lesson(self, text: str, context: str | None = None) -> dict[str, Any]:
        """What a piece of experience text (a lesson, or a whole knowledge block) says about this
        diagnostic: ``{"contexts": [names it mentions], "actions": [action names it mentions, in
        order, as whole words], "correct": bool}``, where ``correct`` means it names a context (the
        context named ``context`` when given) and that context's whole solution, in order (the
        solution is a subsequence of the actions named).  Case-insensitive.  The trainer uses it to
        follow experience through the loop on the diagnostics (metrics ``retrieval_own_context``,
        ``shown_correct``, ``bank_correct_lessons``)."""
        lower = text.lower()
        contexts = [i for i, name in enumerate(self._names) if name.lower() in lower
                    and (context is None or name == context)]
        named = re.findall(r"\b(" + "|".join(map(re.escape, self._actions)) + r")\b", lower)

        def holds(solution: tuple[str, ...]) -> bool:
            it = iter(named)
            return all(a in it for a in solution)

        mentioned = [name for name in self._names if name.lower() in lower]
        return {"contexts": mentioned, "actions": named,
                "correct": any(holds(self._solution_of(i)) for i in contexts)}

    @abc.abstractmethod
    def chance_success_rate(self) -> float:
        """Success rate of a policy choosing uniformly among the valid actions at every step (exact)."""

    # ---- TextEnv hooks ----------------------------------------------------------------------------
    def admissible_actions(self) -> list[str]:
        return list(self._actions)

    def parser(self) -> AnswerParser:
        """The parser of the fixed action set, built once."""
        return self._parser

    def task_prompt(self) -> str:
        """The goal sentence of the current task, naming its context (``""`` before the first reset)."""
        return "" if self.task is None else self._goal(self._names[self._context])

    def _reset_task(self, task: int) -> None:
        self._variant, self._context = divmod(task, N_CONTEXTS)

    def _observe(self, message: str = "") -> str:
        lines = [self._goal(self._names[self._context]), surface_text(self._variant), self._status()]
        if message:
            lines.append(f"Last: {message}")
        lines.append(self._valid_line)
        return "\n".join(lines)


class DiagVaultEnv(DiagEnv):
    """``diag-vault``: open a vault with one turn of its dial.

    Observation: the goal naming the context ("Open the vault of the Corvane Archive."), two sentences
    of surface text, the dial's number of positions, the feedback of the last step (``Last: ...``) and
    ``Valid actions: anchor, bell, crown, feather, key, lamp, moon, star``.  The first valid action
    ends the episode: the context's code (:data:`VAULT_CODES`) gives reward 1.0 and success; any other
    position gives reward 0 and a message that does not name the code.  Chance rate 1/8.

    Args:
        max_steps: actions per episode before truncation (default 3: room for two invalid replies).
        render_mode: only ``"ansi"``.
        practice_world: see :class:`DiagEnv` (codes from :func:`practice_contexts`).
    """

    env_id: ClassVar[str] = "diag-vault"
    system_prompt: ClassVar[str] = (
        "You are opening vaults. Each vault has a dial with 8 positions marked by symbols, and exactly "
        "one position opens it. The right position of a vault never changes, but nothing you see tells "
        "you which it is. You get one try: a wrong position jams the lock.\n"
        "Reply with exactly one position inside answer tags: <answer>POSITION</answer>."
    )

    def __init__(self, max_steps: int = 3, render_mode: str | None = "ansi", practice_world: int | None = None) -> None:
        super().__init__(VAULT_ACTIONS, max_steps=max_steps, render_mode=render_mode, practice_world=practice_world)
        self._codes = VAULT_CODES if self.practice_world is None else practice_contexts(self.practice_world)[1]

    def _solution_of(self, context: int) -> tuple[str, ...]:
        return (self._codes[context],)

    def _goal(self, name: str) -> str:
        return f"Open the vault of the {name}."

    def _status(self) -> str:
        return f"The vault's dial has {len(self._actions)} positions; one of them opens it."

    def _lesson_clause(self, actions: Sequence[str]) -> str:
        return "turn the dial to the " + ", then the ".join(actions)

    def _apply(self, action: str) -> tuple[float, bool, bool, str]:
        if action == self._codes[self._context]:
            return 1.0, True, True, f"You turn the dial to the {action}. The vault opens."
        return 0.0, True, False, f"You turn the dial to the {action}. The lock jams and the vault stays shut."

    def chance_success_rate(self) -> float:
        """1/8: one try, one right position among 8."""
        return 1.0 / len(self._actions)


class DiagCorridorEnv(DiagEnv):
    """``diag-corridor``: pass a series of doors, choosing one passage at each.

    Observation: the goal naming the context ("Find the way through the doors of the Corvane
    Archive."), two sentences of surface text, the door the agent is at (``You are at door k of
    length.``) and how many passages it has, the feedback of the last step and ``Valid actions: left,
    middle, right`` (for the defaults).  A right passage opens onto the next door (reward 0) or, at the
    last door, ends the episode with reward 1.0 and success; a wrong one ends it with reward 0 and a
    message that does not name the right passage.  Sequences: :func:`corridor_sequences`.  Chance rate
    ``(1 / choices) ** length``.

    Args:
        length: doors per corridor, >= 2 (default 3).
        choices: passages per door, ``2..6`` (default 3); the first ``choices`` of
            :data:`CORRIDOR_ACTIONS`.
        max_steps: actions per episode before truncation; default ``length + 2``.
        render_mode: only ``"ansi"``.
        practice_world: see :class:`DiagEnv` (sequences from :func:`practice_contexts`).

    Raises:
        ValueError: ``length`` < 2, ``choices`` outside ``2..6``, or ``max_steps`` < ``length`` (no
            episode could succeed).
    """

    env_id: ClassVar[str] = "diag-corridor"
    system_prompt: ClassVar[str] = (
        "You are finding your way through the corridors of old buildings. In each building you pass a "
        "series of doors, and at every door exactly one of the passages is right. A right passage "
        "leads to the next door; a wrong one ends your attempt. The right passages of a building "
        "never change, but nothing you see tells you which they are.\n"
        "Reply with exactly one passage inside answer tags: <answer>PASSAGE</answer>."
    )

    def __init__(self, length: int = 3, choices: int = 3, max_steps: int | None = None,
                 render_mode: str | None = "ansi", practice_world: int | None = None) -> None:
        length, choices = int(length), int(choices)
        if length < 2 or not 2 <= choices <= len(CORRIDOR_ACTIONS):
            raise ValueError(f"diag-corridor: need length >= 2 and 2 <= choices <= {len(CORRIDOR_ACTIONS)}, "
                             f"got length={length}, choices={choices}")
        max_steps = length + 2 if max_steps is None else int(max_steps)
        if max_steps < length:
            raise ValueError(f"diag-corridor: max_steps={max_steps} is below length={length}: "
                             f"no episode could succeed")
        super().__init__(CORRIDOR_ACTIONS[:choices], max_steps=max_steps, render_mode=render_mode,
                         practice_world=practice_world)
        self.length = length
        self.choices = choices
        self._sequences = (corridor_sequences(length, choices) if self.practice_world is None
                           else practice_contexts(self.practice_world, length, choices)[2])
        self._door = 0          # doors passed in this episode
        self._failed = False

    def _solution_of(self, context: int) -> tuple[str, ...]:
        return self._sequences[context]

    def _goal(self, name: str) -> str:
        return f"Find the way through the doors of the {name}."

    def _status(self) -> str:
        if self._door >= self.length:
            return f"You are through all {self.length} doors."
        if self._failed:
            return f"You are stuck at door {self._door + 1} of {self.length}."
        return f"You are at door {self._door + 1} of {self.length}. It has {self.choices} passages."

    def _lesson_clause(self, actions: Sequence[str]) -> str:
        return "take " + ", then ".join(actions)

    def _reset_task(self, task: int) -> None:
        super()._reset_task(task)
        self._door = 0
        self._failed = False

    def _apply(self, action: str) -> tuple[float, bool, bool, str]:
        door = self._door + 1
        if action != self._sequences[self._context][self._door]:
            self._failed = True
            return 0.0, True, False, f"You take the {action} passage at door {door}. It is a dead end."
        self._door += 1
        if self._door == self.length:
            return 1.0, True, True, f"You take the {action} passage at door {door} and reach the end."
        return 0.0, False, False, (f"You take the {action} passage. It opens onto door {door + 1} "
                                   f"of {self.length}.")

    def chance_success_rate(self) -> float:
        """``(1 / choices) ** length``: every door must be passed, each with chance ``1 / choices``."""
        return 1.0 / self.choices ** self.length


#: the diagnostics' env ids: the envs with a known solution per context, a lesson writer
#: (:meth:`DiagEnv.lesson_for`) and a judge of lessons (:meth:`DiagEnv.grade_lesson`)
DIAG_ENVS: tuple[str, ...] = (DiagVaultEnv.env_id, DiagCorridorEnv.env_id)
