"""Training methods as configurations of the one training loop, all declared here.

A method says which parts of the loop are active; it never brings a loop of its own.  The three
methods of the paper (arXiv 2603.17621, docs/method.md) are:

* ``grpo``: plain GRPO, no experience (the paper's outcome-only baseline; GRPO as in DeepSeekMath,
  Shao et al. 2024, section 4.1);
* ``static``: the full pipeline with the extractor frozen (the paper's static-extractor baseline): the
  bank is still written by the untrained extractor and still guides the actor;
* ``complementary``: actor and extractor co-evolve (GRPO on the actor, CISPO on the extractor).

Beside them, memory baselines of the same loop:

* ``casebank``: no extractor model; finished episodes are written to the bank as compacted
  trajectories with their outcome (cases), and a guided episode is shown the most similar ones
  (ExpeL's trajectory retrieval, arXiv 2308.10144, section 4; case-based memory as in Memento,
  arXiv 2508.16153). docs/method.md, "Case bank".
* ``expel``: ExpeL's insights (arXiv 2308.10144, section 4.2): a frozen extractor compares successful
  and failed episodes of a task and edits a list of insights per env with ADD / EDIT / UPVOTE /
  DOWNVOTE; a guided episode is shown its env's insights and the most similar successful case.
  docs/method.md, "ExpeL insights".
* ``reflexion``: Reflexion's verbal reflections (arXiv 2303.11366): after a failed episode the actor
  writes what to do differently; later attempts at the same task are shown the task's most recent
  reflections (in evaluation, the attempts of ``eval.trials``). docs/method.md, "Reflexion".

And one variant of the paper's method from its released code:

* ``internalise``: ``complementary``, and after each actor update the guided episodes that beat their
  group's free mean are fine-tuned into the actor with their experience stripped from the prompts (the
  released ``MemoryActorPipeline``; trainer/internalise.py). docs/method.md, "Internalisation".

``crl-bench run --method NAME`` looks the name up here; :func:`register_method` adds a method from
outside the package (a plugin), which must also be a configuration of the same loop.  What a method's
bank holds is its memory kind (:attr:`MethodSpec.memory`), one module per kind registered in
:mod:`crl_bench.experience.memory`: a method that stores something new brings one such module.
"""

from __future__ import annotations

from dataclasses import dataclass

from crl_bench.experience.memory import get_memory


@dataclass(frozen=True)
class MethodSpec:
    """What one method turns on.

    Attributes:
        name: the ``--method`` value.
        description: one line for ``crl-bench run --help`` and the leaderboard.
        uses_experience: retrieve from an experience bank and split groups into guided/free subgroups.
        trains_extractor: update the experience extractor (CISPO).
        memory: the memory kind, what the bank holds (a name of
            :func:`crl_bench.experience.memory.list_memories`): ``lessons`` (an extractor model
            distils them from finished episodes), ``cases`` (the episodes themselves, compacted; no
            extractor model is loaded, there is no merge pass, and the search tool answers with the
            cases found), ``insights`` (cases, and a list of insights per env that a frozen extractor
            model edits and every guided episode of the env is shown: ExpeL) or ``reflections`` (the
            actor's own reflections on its failed attempts, kept per task and shown to later attempts
            at that task, without retrieval: Reflexion).
        internalises: after each actor update, fine-tune the actor on the step's guided episodes that beat
            their group's free mean, their experience stripped (:mod:`crl_bench.trainer.internalise`).

    Raises:
        ValueError: an unknown memory kind, ``trains_extractor`` for a method without experience or
            whose memory kind has no trainable extractor (only ``lessons`` has), or ``internalises`` for
            a method whose episodes are never guided (without experience).
        TypeError: an argument this spec does not have (the bank's kind is ``memory``: a bank of
            cases is ``memory="cases"``, cases with insights ``memory="insights"``).
    """

    name: str
    description: str
    uses_experience: bool = False
    trains_extractor: bool = False
    memory: str = "lessons"
    internalises: bool = False

    def __post_init__(self) -> None:
        try:
            kind = get_memory(self.memory)
        except KeyError as e:
            raise ValueError(f"method {self.name!r}: {e.args[0]}") from None
        if self.trains_extractor and (not self.uses_experience or not kind.trainable):
            raise ValueError(f"method {self.name!r}: only a method whose bank holds lessons has an extractor "
                             "to train")
        if self.internalises and not self.uses_experience:
            raise ValueError(f"method {self.name!r}: internalisation needs guided episodes (uses_experience)")

    @property
    def uses_extractor(self) -> bool:
        """Whether the method loads an extractor model (its memory kind's ``uses_extractor``: a bank of
        lessons, or a list of insights)."""
        return self.uses_experience and get_memory(self.memory).uses_extractor


GRPO = MethodSpec(
    name="grpo",
    description="GRPO on outcome rewards; groups of G rollouts per task, no experience",
)
STATIC = MethodSpec(
    name="static",
    description="GRPO actor guided by an experience bank written by a frozen extractor",
    uses_experience=True,
)
COMPLEMENTARY = MethodSpec(
    name="complementary",
    description="Complementary RL: GRPO actor + CISPO-trained experience extractor co-evolving",
    uses_experience=True,
    trains_extractor=True,
)

CASEBANK = MethodSpec(
    name="casebank",
    description="GRPO actor guided by the most similar earlier episodes, stored as cases (no extractor model)",
    uses_experience=True,
    memory="cases",
)

EXPEL = MethodSpec(
    name="expel",
    description="GRPO actor guided by ExpeL insights of a frozen extractor and the most similar successful case",
    uses_experience=True,
    memory="insights",
)

REFLEXION = MethodSpec(
    name="reflexion",
    description="GRPO actor shown its own reflections on its earlier failed attempts at the same task",
    uses_experience=True,
    memory="reflections",
)

INTERNALISE = MethodSpec(
    name="internalise",
    description="Complementary RL, and guided episodes that beat their group's free mean fine-tuned into the actor "
                "with the experience stripped (released MemoryActorPipeline)",
    uses_experience=True,
    trains_extractor=True,
    internalises=True,
)

_METHODS: dict[str, MethodSpec] = {m.name: m for m in (GRPO, STATIC, COMPLEMENTARY, CASEBANK, EXPEL, REFLEXION,
                                                        INTERNALISE)}


def register_method(spec: MethodSpec) -> None:
    """Make ``spec`` available to ``--method``.  Raises ``ValueError`` if the name is taken by a
    different spec."""
    if spec.name in _METHODS and _METHODS[spec.name] != spec:
        raise ValueError(f"method {spec.name!r} is already declared as {_METHODS[spec.name]}")
    _METHODS[spec.name] = spec


def get_method(name: str) -> MethodSpec:
    """The spec of ``name``. Raises ``KeyError`` naming the known methods."""
    if name not in _METHODS:
        raise KeyError(f"unknown method {name!r}; known: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def list_methods() -> list[str]:
    """Names of every declared method, sorted."""
    return sorted(_METHODS)
