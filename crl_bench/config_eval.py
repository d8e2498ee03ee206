"""The evaluation's and the learning alarms' sections of the run configuration (``eval``, ``alarms``):
their dataclasses, split from :mod:`crl_bench.config`, which re-exports them and validates them with
the rest (docs/configuration.md, docs/evaluation.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from annotated_types import Ge, Interval

from crl_bench.prompts import PromptLayout

__all__ = ["AlarmConfig", "EvalConfig", "EvalControl"]

EvalControl = Literal["shuffled", "empty", "raw", "condensed", "both"]
"""Values of ``eval.controls``: the memory controls and the memory forms (docs/evaluation.md)."""


@dataclass
class EvalConfig:
    """Evaluation on the eval split."""

    episodes: Annotated[int, Ge(0)] | Literal["all"] = 50
    """Eval episodes per env: the first ``episodes`` task ids of the eval split, or ``"all"`` for every task of it
    (e.g. ALFWorld's 134). docs/evaluation.md. ``crl-bench run`` needs at least 1 (its summary reports the final
    evaluation); 0 is for trainers built without one (the benches)."""
    every: Annotated[int, Ge(0)] = 0
    """Evaluate every N training steps (0 = only at the end); the evaluation after step N runs where the released
    pipeline runs it, at the start of step N + 1 after the flush and the merge pass (released ``eval_steps: 1``:
    every step)."""
    at_start: bool = False
    """Also evaluate the untrained actor before step 1 (experience-free; a ``step: 0`` eval row in metrics.jsonl and
    ``initial`` in eval.json), the baseline a run's final eval is compared with."""
    temperature: Annotated[float, Ge(0)] = 0.0
    """Sampling temperature at eval (0 = greedy)."""
    split: str = "eval"
    """Which split to evaluate (``splits`` names another for single envs)."""
    splits: dict = field(default_factory=dict)
    """Per-env split in place of ``split``, e.g. ``{alfworld: eval_seen}`` (verl-agent's ALFWorld split)."""
    max_steps: dict = field(default_factory=dict)
    """Per-env action limit of eval episodes, e.g. ``{alfworld: 50, webshop: 15}``; an env not named keeps its
    training limit (``rollout.max_steps``, else the env's default). Training is not changed."""
    history: Annotated[int, Ge(0)] | None = None
    """(action, feedback) pairs the eval prompts repeat (``prompt: window``); null = ``rollout.history``."""
    prompt: PromptLayout | None = None
    """Prompt layout of eval episodes; null = ``rollout.prompt``."""
    profile: str = ""
    """The protocol profile (``--profile``, ``crl_bench/profiles/<name>.yaml``) the eval keys above were set from;
    recorded in the protocol. ``""`` = none. docs/evaluation.md, "Protocol profiles"."""
    draw_size: Annotated[int, Ge(0)] = 0
    """Episodes per sampled-worker draw (verl-agent's estimator: ``--draws 128``); 0 = off. Each of ``draw_count``
    draws picks ``draw_size`` eval tasks at random and averages one of each task's ``samples`` episodes (docs/
    evaluation.md, "Sampled-worker draws"); needs ``samples`` above 1."""
    draw_count: Annotated[int, Interval(ge=1, le=100_000)] = 20
    """How many sampled-worker draws to score (with ``draw_size`` above 0)."""
    draw_replace: dict = field(default_factory=dict)
    """Per env: whether a draw picks its tasks with replacement (the default, ``true``: verl-agent's ALFWorld
    workers may repeat a game) or without (``false``: its WebShop batch draws distinct goals)."""
    writes_counters: bool = False
    """Guided evaluation episodes count their retrievals on the entries (retrieval counts and times, which the re-rank
    reads; search-tool calls included), as the released evaluation does; default ``false``: evaluation leaves the
    bank untouched, so reported numbers do not change the run they measure."""
    controls: list[EvalControl] = field(default_factory=lambda: ["shuffled", "empty"])
    """Memory controls evaluated after ``guided`` by methods with a bank (docs/evaluation.md "Memory controls"):
    ``shuffled`` (each episode is shown what retrieval returns for another eval task of its env, of another context
    where the env has contexts) and ``empty`` (the guided prompt with its knowledge block but no entry in it); the
    memory forms ``raw``, ``condensed`` and ``both`` (the guided retrieval shown as the episodes the entries come
    from, as what was distilled from them, or both; docs/evaluation.md "Memory forms"), each run only by a memory
    kind for which it differs from ``guided`` (lessons: raw, both; insights: raw, condensed; cases and reflections:
    none), the others skipped. All are read-only."""
    lesson_follow: Annotated[int, Interval(ge=0, le=8)] = 0
    """Probe states of a diagnostic on which the actor's lesson following is measured after every training step
    (``lesson_follow`` in metrics.jsonl; :mod:`crl_bench.trainer.lesson_follow`): the run's own (``diag-vault`` or
    ``diag-corridor``, the first in its mix), else ``diag-vault``; 0 = off, the default: the probe means something
    only for an actor trained on that diagnostic, and the ``diag`` preset sets 8 (every context)."""
    trials: Annotated[int, Interval(ge=1, le=1000)] = 1
    """Attempts per eval task (Reflexion's protocol, arXiv 2303.11366, section 4): attempt k + 1 runs the tasks no
    earlier attempt solved, and a task counts as solved if any attempt solved it (``success_by_trial`` in each
    mode's block: the share solved after each attempt). ``reflexion``'s attempts are shown the actor's reflections
    on the earlier ones; other methods' attempts see what the mode shows and nothing of the earlier ones, so with
    ``temperature`` 0 they repeat the first. More than 1 is part of the protocol (``trials``). docs/evaluation.md,
    "Repeated trials"."""
    samples: Annotated[int, Interval(ge=1, le=1024)] = 1
    """Independent episodes per eval task, sampled at ``temperature`` (which must then be above 0): each mode's block
    gives pass@k and pass^k for k = 1..samples (unbiased estimators: Chen et al. 2021, arXiv 2107.03374, section
    2.1; tau-bench, arXiv 2406.12045, section 4) and success rates over all samples. More than 1 is part of the
    protocol (``samples``); not combined with ``trials``. docs/evaluation.md, "Repeated samples"."""
    stream: bool = True
    """Run every mode of an evaluation as one stream with continuous batching: all modes' episodes in one queue, at
    most ``rollout.max_concurrent`` live, an ended episode's slot taken by the next one at the next turn (docs/
    evaluation.md "One stream"). ``false``: each mode its own pass, in waves of ``rollout.max_concurrent`` (the
    evaluation before the stream; ``crl-bench bench eval`` compares the two). At temperature 0 with a deterministic
    engine whose replies do not depend on the batch both give the same episodes."""

    def split_of(self, env_id: str) -> str:
        """The eval split of ``env_id``: its entry of ``splits``, else ``split``."""
        return str(self.splits.get(env_id, self.split))

    def other_splits(self, env_ids: Any) -> dict[str, str]:
        """``{env: split}`` for the envs of ``env_ids`` evaluated on another split than ``split``."""
        return {e: self.split_of(e) for e in env_ids if self.split_of(e) != self.split}


@dataclass
class AlarmConfig:
    """Learning alarms (:mod:`crl_bench.results.alarms`): warnings that a run is not learning, raised
    as a log line and an ``alerts`` list in the metrics row and in summary.json (docs/learning.md
    "Learning alarms").
    """

    enabled: bool = True
    """Raise alarms at all."""
    no_signal_steps: Annotated[int, Ge(1)] = 2
    """Warn when this many consecutive steps had no group with a learning signal (every group's rewards equal, so
    every advantage is 0)."""
    entropy_drop: Annotated[float, Interval(gt=0, le=1)] = 0.5
    """Warn when ``reply_entropy`` fell below ``(1 - entropy_drop)`` times its value at step 1."""
    parse_rate: Annotated[float, Interval(ge=0, le=1)] = 0.5
    """Warn when the extractor's reply parse rate of a step is below this."""
    merge_passes: Annotated[int, Ge(1)] = 3
    """Warn when this many merge passes running produced no MERGE or UPDATE."""
    guided_free_steps: Annotated[int, Ge(1)] = 5
    """Warn when guided and free training success have been equal within noise for this many steps running (experience
    methods)."""
    noise_z: Annotated[float, Ge(0)] = 1.96
    """"equal within noise": ``|guided - free| <= noise_z`` standard errors of the difference of the two success
    rates."""
