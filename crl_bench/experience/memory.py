"""Memory kinds: what an experience bank holds, as one module per kind, and their registry.

A method with experience (:class:`crl_bench.methods.MethodSpec`, ``uses_experience``) names its memory
kind (``MethodSpec.memory``); the training loop's experience track (trainer/experience_track.py), the
background manager (:func:`crl_bench.experience.manager.build_manager`) and the evaluation reach the
kind only through the :class:`Memory` interface below, so a new kind is one module with one
``@register_memory`` class. What is common to every kind stays outside it: the bank (entries,
retrieval, the write lock, capacity and eviction), the guided/free subgroups, the actor-critic judge,
the search tool and the extractor's CISPO training.

The built-in kinds (docs/method.md):

* ``lessons`` (:mod:`crl_bench.experience.lessons`): an extractor model distils lessons from finished
  episodes, and a merge pass folds them periodically (Complementary RL, arXiv 2603.17621, and its
  released code); the only kind whose extractor can be trained.
* ``cases`` (:mod:`crl_bench.experience.cases`): the finished episodes themselves, compacted
  (ExpeL's trajectory retrieval, arXiv 2308.10144, section 4.1).
* ``insights`` (:mod:`crl_bench.experience.insights`): cases plus a list of insights per env edited by
  a frozen extractor (ExpeL, arXiv 2308.10144, section 4.2).
* ``reflections`` (:mod:`crl_bench.experience.reflections`): the actor's reflections on its failed
  attempts, per task, without retrieval (Reflexion, arXiv 2303.11366).

The registry follows Gymnasium's: a kind is registered by its class (``@register_memory(name)``), or,
for the built-in kinds, by a ``"module:Class"`` entry point imported on first use, so that reading a
method's properties does not load every kind.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, get_args

GUIDANCE_HEADER = ("Knowledge distilled from earlier episodes. Use it where it applies to this task; "
                   "do not follow it blindly.")
"""The header of a bank of lessons' experience block."""


def guidance_text(body: str, header: str = GUIDANCE_HEADER) -> str:
    """The experience block shown to the actor: ``header`` and the numbered entries (``body``); ``""``
    without entries."""
    return f"{header}\n\n{body}" if body.strip() else ""


def empty_guidance_text(header: str = GUIDANCE_HEADER) -> str:
    """The ``empty`` memory control's experience block: the header a guided episode sees, no entry."""
    return f"{header}\n\n(no entries)"


EMPTY_GUIDANCE = empty_guidance_text()
"""The ``empty`` control's block of a bank of lessons."""

MemoryForm = Literal["raw", "condensed", "both"]
"""The memory forms a control can show a retrieval in (docs/evaluation.md "Memory forms"): ``raw`` (the
episodes the retrieved entries come from, compacted as cases), ``condensed`` (what was distilled from
them: lessons, insights) and ``both``. Each kind says which of them differ from its ``guided`` mode
(:attr:`Memory.forms`)."""
MEMORY_FORMS: tuple[str, ...] = get_args(MemoryForm)

BankScope = Literal["env", "family"]
"""Values of ``experience.scope`` (:func:`bank_scope`)."""
BANK_SCOPES: tuple[str, ...] = get_args(BankScope)

RELEASED_FAMILIES: dict[str, str] = {
    "minihack-room": "minihack_navigation",
    "minihack-maze": "minihack_navigation",
    "minihack-keyroom": "minihack_navigation",
    "minihack-river": "minihack_navigation",
    "minihack-maze-15x15": "minihack_navigation",
    "minihack-corridor": "minihack_navigation",
    "minihack-corridor-battle": "minihack_navigation",
    "minihack-quest-easy": "minihack_skill",
    "minihack-quest-medium": "minihack_skill",
}
"""Envs whose released bank is shared with other envs here: env id -> the released memory task name.

The released env manager names its memory ``f"{env_class}_{config.env_type}"`` (``env_class``: the
env config's ``env_type``, ``memory_integration_mixin.py`` ``initialize_memory_integration`` ~38-40;
``multi_agentic_config.py`` ``make_env_configs`` ~313, ~346), and every search, write and merge is
of that task's entries (``multi_task_tabuler`` memory in the example config; ``hook_on_episode_start``
~98-100, ``hook_on_episode_end`` ~318, ``merge_memory`` per task). Its MiniHack envs are ``minihack``
with ``env_type: navigation`` (MazeWalk, HideNSeek, Memento, Room Ultimate) or ``skill`` (LavaCross,
Skill) in ``multitask_env_tool.yaml``; crl-bench's MiniHack envs but the quests are navigation tasks
(MiniHack's ``MiniHackNavigation`` subclasses), so they share ``minihack_navigation``; the quests are
``MiniHackSkill`` levels and share ``minihack_skill``. Any other env is its own
family (one env per released env class)."""


def bank_scope(env_id: str, scope: str = "env") -> str:
    """The bank partition an episode of ``env_id`` retrieves from and writes to: ``env_id`` itself
    with ``scope="env"`` (crl-bench's default), the released memory task name with ``"family"``
    (:data:`RELEASED_FAMILIES`; ``env_id`` for an env not listed there).

    Raises:
        ValueError: ``scope`` is not one of :data:`BANK_SCOPES`.
    """
    if scope == "env":
        return env_id
    if scope == "family":
        return RELEASED_FAMILIES.get(env_id, env_id)
    raise ValueError(f"experience.scope must be one of {', '.join(BANK_SCOPES)}, got {scope!r}")


class Attempts:
    """What a kind that learns between evaluation attempts (``eval.trials``) gives the evaluation:
    ``prepare(spec) -> spec`` before each attempt (what it is shown), ``learn(failed trajectories)``
    after each attempt but the last, and :meth:`metrics` for the mode's block. See
    :meth:`Memory.eval_attempts`.

    Args:
        prepare: called with each episode spec an attempt runs; returns the spec to run.
        learn: called with the failed trajectories of an attempt.
        metrics: called once after the last attempt; its keys are added to the mode's block.
    """

    def __init__(self, prepare: Callable[[Any], Any], learn: Callable[[list[Any]], None],
                 metrics: Callable[[], dict[str, Any]]) -> None:
        self.prepare = prepare
        self.learn = learn
        self.metrics = metrics


class Memory:
    """The interface of a memory kind (base class: every method has the behaviour of a bank whose
    entries are retrieved and shown numbered under :attr:`header`).

    A kind is built once per process side that needs it: by the experience track with the run's
    configuration and the actor's engine and tokenizer (:meth:`__init__`), and by
    :func:`~crl_bench.experience.manager.build_manager` with the configuration alone, for
    :meth:`writer`.  The ``manager`` the hooks receive is an
    :class:`~crl_bench.experience.manager.ExperienceManager` or its Ray handle
    (``crl_bench.ray_backend.RemoteManager``): the hooks use only the methods both have.

    Class attributes (what :class:`~crl_bench.methods.MethodSpec` and the config checks read):
        name: the registry name (``MethodSpec.memory``).
        header: the header of the block a guided episode is shown.
        uses_extractor: an extractor model is loaded (it writes the bank, or edits lists).
        trainable: the extractor's calls are training samples (a method may train it: CISPO).
        retrieves: guided episodes retrieve from the bank at episode start; ``False``: each guided
            episode is shown :meth:`task_guidance` instead (no retrieval, no search tool).
        whole_episodes: what is written is about a whole finished episode, so experience is
            retrieved and written per episode only (``experience.integration: trajectory``).
        forms: the memory forms (:data:`MEMORY_FORMS`) whose controls show the guided retrieval
            otherwise than ``guided`` does (:meth:`form_guidance`); a form not listed either is the
            guided mode itself or does not exist for the kind (cases have no condensed form).

    Args:
        cfg: the :class:`~crl_bench.config.RunConfig`.
        actor_engine: the actor's generation engine (``None`` on the manager's side, and in tests).
        tokenizer: the actor's tokenizer.
    """

    name: ClassVar[str] = ""
    header: ClassVar[str] = GUIDANCE_HEADER
    uses_extractor: ClassVar[bool] = False
    trainable: ClassVar[bool] = False
    retrieves: ClassVar[bool] = True
    whole_episodes: ClassVar[bool] = False
    forms: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: Any, actor_engine: Any = None, tokenizer: Any = None) -> None:
        self.cfg = cfg
        self.actor_engine = actor_engine
        self.tokenizer = tokenizer

    # ---- the manager's side ---------------------------------------------------------------------
    def writer(self, engine: Any, tokenizer: Any) -> Any:
        """The distiller of the manager's worker thread (its requests' handlers call it), or ``None``
        when the kind writes through no worker.

        Args:
            engine: the extractor's generation engine, or ``None`` when the kind loads no extractor
                model (or none was given: a read-only bank).
            tokenizer: the extractor's tokenizer (the actor's when the kind loads no model).
        """
        return None

    # ---- where an env's entries live ------------------------------------------------------------
    def scope(self, env_id: str) -> str:
        """The bank partition (the ``env_id`` of its entries) that episodes of ``env_id`` retrieve from
        and write to: ``env_id`` (default); a kind that follows ``experience.scope`` maps it with
        :func:`bank_scope`."""
        return env_id

    def skips_own_task(self) -> bool:
        """Whether retrieval leaves out the entries of the episode's own task (keyed by its query) and
        returns one entry per task (:class:`~crl_bench.experience.retrieval.Retriever`
        ``skip_same_key``); ``False``: every entry may be retrieved."""
        return False

    # ---- what a guided episode is shown ---------------------------------------------------------
    def empty_guidance(self) -> str:
        """The ``empty`` memory control's block: the kind's header and no entry."""
        return empty_guidance_text(self.header)

    def guidance(self, manager: Any, env_ids: Sequence[str], bodies: Sequence[str]) -> list[str]:
        """The block each guided episode is shown, from the numbered entries retrieved for it
        (``bodies``, after the actor-critic judge; ``""`` where nothing was found), one per episode
        of ``env_ids``: :func:`guidance_text` under :attr:`header` (``""`` without entries)."""
        return [guidance_text(body, self.header) for body in bodies]

    def check_form(self, form: str) -> None:
        """Raises ``ValueError`` when ``form`` is not one of this kind's :attr:`forms`."""
        if form not in self.forms:
            raise ValueError(f"memory {self.name!r} shows forms {' and '.join(self.forms) or 'none'} apart "
                             f"from guided, not {form!r}")

    def form_guidance(self, manager: Any, form: str, env_ids: Sequence[str],
                      found: Sequence[Sequence[Any]]) -> list[str]:
        """The block of memory control ``form`` (one of :attr:`forms`) for each episode of ``env_ids``,
        from the entries its guided retrieval returned (``found``: per episode, the
        :class:`~crl_bench.experience.types.ExperienceEntry` list in retrieval order).  A kind that
        declares :attr:`forms` overrides this.

        Raises:
            ValueError: ``form`` is not one of this kind's :attr:`forms` (:meth:`check_form`).
        """
        self.check_form(form)
        raise TypeError(f"memory {self.name!r} declares forms {self.forms} but does not override form_guidance")

    def task_guidance(self, manager: Any, env_id: str, task: int, later: Sequence[str] = ()) -> str:
        """For a kind that does not retrieve (:attr:`retrieves` false): the block an attempt at
        ``env_id``'s task ``task`` is shown, with ``later`` texts of this evaluation's earlier
        attempts.

        Raises:
            NotImplementedError: the kind retrieves (its episodes are guided by :meth:`guidance`).
        """
        raise NotImplementedError(f"memory {self.name!r} retrieves; it has no per-task guidance")

    # ---- what a finished step writes ------------------------------------------------------------
    def write(self, manager: Any, trajs: Sequence[Any], step: int) -> int:
        """Queue what the finished episodes ``trajs`` of 0-based step ``step`` write (requests on the
        manager's worker, or rows written at once); returns how many (the ``distill_queued`` metric)."""
        return 0

    def upkeep(self, manager: Any, step: int, updated_at_step: int) -> dict[str, Any]:
        """Periodic upkeep at the start of 0-based step ``step``, after the flush (the merge pass of
        lessons); ``updated_at_step`` is the 1-based step of the extractor's last update (-1: none).
        Returns the step's upkeep metrics (``{}`` when nothing ran)."""
        return {}

    # ---- metrics and state ----------------------------------------------------------------------
    def episode_metrics(self, guided: Sequence[Any]) -> dict[str, Any]:
        """Kind-specific metrics of the step's guided episodes (added to the experience metrics)."""
        return {}

    def metrics(self, manager: Any, stats: dict[str, Any]) -> dict[str, Any]:
        """Kind-specific metrics of the step's row, from the manager's counters ``stats``
        (:meth:`~crl_bench.experience.manager.ExperienceManager.stats`); called once per step."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the kind on the track's side (``{}``: nothing; what the kind
        writes is in the bank, which the checkpoint copies)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a checkpoint without the kind's state passes ``{}``)."""

    # ---- evaluation -----------------------------------------------------------------------------
    def eval_attempts(self, manager: Any, mode: str, donors: dict[str, dict[int, int]]) -> Attempts | None:
        """For a kind that learns between evaluation attempts: the :class:`Attempts` of one eval mode
        (``guided``, ``shuffled`` with its donor task per task, or ``empty``), which then replace
        retrieval, turn retrieval and the search tool; ``None`` (default): attempts are guided by
        retrieval as in training."""
        return None


_MEMORIES: dict[str, type[Memory] | str] = {
    "lessons": "crl_bench.experience.lessons:LessonsMemory",
    "cases": "crl_bench.experience.cases:CasesMemory",
    "insights": "crl_bench.experience.insights:InsightsMemory",
    "reflections": "crl_bench.experience.reflections:ReflectionsMemory",
}


def register_memory(name: str) -> Callable[[type[Memory]], type[Memory]]:
    """Class decorator: register a :class:`Memory` subclass as memory kind ``name`` (and set its
    :attr:`Memory.name`).

    Raises:
        ValueError: ``name`` is taken by another class.
        TypeError: the class is not a :class:`Memory`.
    """
    def register(cls: type[Memory]) -> type[Memory]:
        if not (isinstance(cls, type) and issubclass(cls, Memory)):
            raise TypeError(f"memory {name!r} must be a Memory subclass, got {cls!r}")
        known = _MEMORIES.get(name)
        path = f"{cls.__module__}:{cls.__qualname__}"
        if known is not None and known is not cls and known != path:
            raise ValueError(f"memory kind {name!r} is already registered as {known}")
        cls.name = name
        _MEMORIES[name] = cls
        return cls
    return register


def get_memory(name: str) -> type[Memory]:
    """The class of memory kind ``name`` (a built-in kind's module is imported on first use).

    Raises:
        KeyError: an unknown kind, naming the known ones.
    """
    if name not in _MEMORIES:
        raise KeyError(f"unknown memory kind {name!r}; known: {', '.join(list_memories())}")
    entry = _MEMORIES[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        _MEMORIES[name] = entry
    return entry


def list_memories() -> list[str]:
    """Names of every registered memory kind, sorted."""
    return sorted(_MEMORIES)
