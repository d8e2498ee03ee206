"""The experience track of the training loop: Complementary RL's actor-extractor co-evolution.

Complementary RL (arXiv 2603.17621; every mechanism, its released-code source and its setting are in
docs/method.md).  Beside the actor's GRPO loop:

1. Each group of G rollouts is split into an experience-free and an experience-guided subgroup.
   After the first ``experience.warmup_steps`` steps (which only fill the bank), guided episodes
   retrieve ``k`` entries at episode start with the env's retrieval query; with
   ``experience.actor_critic`` the actor first judges them (accept / refine / reject), shown its first
   task prompt and its average score on the env.  What was retrieved (entry ids, the extraction that
   wrote each entry, the exact text shown) is recorded at retrieval time in a :class:`RetrievalRecord`
   and carried by the trajectory.  With ``experience.integration: turn`` (or ``both``) guided episodes
   also retrieve before every step; with ``experience.search_tool`` episodes may ask the bank a
   question mid-episode, answered by the extractor.
2. Finished episodes of the guided subgroup (``experience.distill: guided``; ``all`` for every
   episode) go to the background experience manager, whose extractor turns each into operations on
   the bank (with turn integration, every step of a guided episode too); entries are keyed by the
   episode's retrieval query (``experience.key: query``).  At the start of every ``experience.merge.every``-th
   step the merge pass runs (:meth:`ExperienceTrack.before_rollout`; the released fold by default).
3. Credit: each use of an entry by a guided episode adds a reward to the extraction recorded at
   retrieval time (``binary``: the episode's score, 0 counting -1; ``relative``: +1 / 0 / -1 against
   the free subgroup's mean; the judge's decision overrides, see :mod:`.actor_critic`), and each
   search-tool answer of a guided episode is credited with the episode's score (with
   ``experience.integration: turn`` nothing is credited, as released).  An extraction's
   reward is the mean over its uses: one training sample per extraction call.
4. When ``extractor.batch_size`` extractions wait, the extractor takes one CISPO update with the
   batch mean as baseline (each sample's advantage times its repeat weight, ``extractor.repeat_*``),
   unless the method freezes it: the static-extractor baseline, whose buffer is bounded the same way
   and simply never drained by an update.

What the bank holds is the method's memory kind (``MethodSpec.memory``,
:mod:`crl_bench.experience.memory`), which the track reaches only through the kind's interface
(:attr:`ExperienceTrack.memory`): the header and the block a guided episode is shown, what a finished
step writes (step 2: lessons distilled by the extractor; the episodes themselves for a bank of cases,
``casebank``; cases and ExpeL's insight calls for ``expel``; the actor's reflections, kept per task and
shown instead of retrieved entries, for ``reflexion``), the periodic upkeep (the merge pass of
lessons), its metrics and its state.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from crl_bench.config import RunConfig
from crl_bench.experience.extractor import Extraction
from crl_bench.experience.json_ops import format_numbered
from crl_bench.experience.manager import build_manager
from crl_bench.experience.memory import Attempts, Memory, get_memory, guidance_text
from crl_bench.experience.records import by_group
from crl_bench.experience.types import RetrievalRecord
from crl_bench.llm.base import SamplingParams
from crl_bench.llm.gate import ComputeGate
from crl_bench.llm.memory import trim_heap
from crl_bench.llm.precision import DTYPES, cast_parameters, resolve_dtype
from crl_bench.methods import MethodSpec
from crl_bench.rollout import EpisodeSpec, Guidance, SearchTool, Trajectory
from crl_bench.trainer.actor_critic import ActorCritic
from crl_bench.trainer.advantages import grouped_advantages
from crl_bench.trainer.extractor_training import answer_reward, extraction_sample, use_reward
from crl_bench.trainer.losses import cispo_loss
from crl_bench.trainer.policy import PolicyUpdater
from crl_bench.trainer.updaters import logprob_temperature, make_updater


@dataclass
class _Credit:
    """An extraction waiting for its update, with the rewards of its uses so far."""

    extraction: Extraction
    total: float = 0.0
    uses: int = 0

    @property
    def reward(self) -> float:
        return self.total / self.uses if self.uses else 0.0


class ExperienceTrack:
    """Bank, retrieval, extractor and its training for one run.

    Args:
        cfg: the run configuration (sections ``experience`` and ``extractor``).
        method: the method spec (``trains_extractor`` decides whether the extractor learns).
        actor_model, tokenizer: the actor (its weights are copied for the extractor when
            ``extractor.model`` is ``same``).
        run_dir: folder for ``experience.sqlite``; a temporary folder when ``None``.
        embedder: an embedder to use instead of ``experience.embedder`` (tests).
        extractor_model: an extractor model to use instead of loading one (tests).
        extractor_tokenizer: its tokenizer (default: the actor's).
        actor_engine, actor_sampling, eval_sampling: the actor's engine and its training and
            evaluation sampling, for the actor-critic judge.
        gate: the trainer's :class:`~crl_bench.llm.gate.ComputeGate`; the extractor then generates as
            background work, in the gaps of the actor's generation and updates.
        read_only_bank: evaluate with this existing bank (a finished run's ``experience.sqlite``),
            opened read-only: retrieval only, no extractor is loaded, and distillation, credit and
            counters are unavailable (``after_rollout`` raises ``RuntimeError``).
        backend: the run's Ray backend (crl_bench/ray_backend.py) or ``None``: with Ray the bank,
            retriever and extractor inference live in a manager actor, reached through the same
            manager interface; the track keeps only the extractor's trainable copy and its optimiser.
    """

    def __init__(self, cfg: RunConfig, method: MethodSpec, actor_model: Any, tokenizer: Any,
                 run_dir: str | Path | None, embedder: Any = None, extractor_model: Any = None,
                 extractor_tokenizer: Any = None, actor_engine: Any = None,
                 actor_sampling: SamplingParams | None = None, eval_sampling: SamplingParams | None = None,
                 gate: ComputeGate | None = None, read_only_bank: str | Path | None = None,
                 backend: Any = None) -> None:
        import tempfile

        self.cfg = cfg
        self.method = method
        # the memory kind: what the bank holds, what a step writes and what a guided episode is shown
        self.memory: Memory = get_memory(method.memory)(cfg, actor_engine, tokenizer)
        self.header = self.memory.header
        exp_cfg, xc = cfg.experience, cfg.extractor
        self.read_only = read_only_bank is not None
        if self.read_only:
            self.bank_path = Path(read_only_bank)
        else:
            if run_dir is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="crl-bank-")
                run_dir = self._tmp.name
            self.bank_path = Path(run_dir) / "experience.sqlite"
        self.compute_dtype = DTYPES[resolve_dtype(cfg.model.dtype, next(actor_model.parameters()).device)]
        # extractions that wrote entries (id -> Extraction), kept while an entry they wrote is in the bank
        # or an episode may still credit them (pruned after each step's credit; metric
        # extractions_waiting_reward)
        self.waiting_reward: OrderedDict[str, Extraction] = OrderedDict()
        # extractions credited by guided episodes, waiting for an update (at most batch_size, oldest first)
        self.buffer: OrderedDict[str, _Credit] = OrderedDict()
        self.dropped = 0
        self.extractor_version = 0          # extractor updates so far, stamped on new extractions
        self.updates: list[dict[str, Any]] = []
        # the actor's score per env over every training episode so far: env -> [score sum, episodes]
        # (released record_actor_performance; the actor-critic judge is shown the average)
        self.env_scores: dict[str, list[float]] = {}
        # extraction id -> (times trained, last step trained), kept with extractor.repeat_record
        self.trained: dict[str, tuple[int, int]] = {}
        self.updated_at_step = -1            # 1-based step of the last extractor update (-1: none)
        # the manager's (extractions_parsed, extractions_failed) at the previous metrics row: the step's
        # own parse rate is the difference (metrics extractions_step, extractions_parse_rate)
        self.parse_seen = (0, 0)
        self.model = self.engine = self.extractor = None
        self.tokenizer = tokenizer
        remote = backend is not None and backend.remote
        if not self.read_only and method.uses_extractor and (not remote or method.trains_extractor):
            # the extractor's weights: shared with the manager's engine here; with a remote manager only
            # the trainer's copy (the manager actor generates from its own, synced after each update)
            if extractor_model is not None:
                self.model, self.tokenizer = extractor_model, extractor_tokenizer or tokenizer
            else:
                self.model, self.tokenizer = self._load_extractor(actor_model, tokenizer)
                if not method.trains_extractor:         # inference only: no float32 master weights needed
                    cast_parameters(self.model, self.compute_dtype)
        if remote:
            if self.read_only:
                raise ValueError("a read-only bank is evaluated with the local backend")
            self.manager = backend.experience_manager(self.bank_path, initial_extractor=self.model)
            self.bank = self.retriever = self.embedder = None
        else:
            self.manager = build_manager(cfg, self.bank_path, self.model, self.tokenizer,
                                         compute_dtype=self.compute_dtype, embedder=embedder, gate=gate,
                                         read_only=self.read_only)
            # the parts, for inspection (tests, benchmarks): the track itself goes through the manager
            self.bank, self.retriever = self.manager.bank, self.manager.retriever
            self.extractor = self.manager.extractor
            self.embedder = self.bank.embedder
            self.engine = getattr(self.extractor, "engine", None)          # none for a case bank
        self.critic: ActorCritic | None = None
        if exp_cfg.actor_critic:
            if actor_engine is None:
                raise ValueError("experience.actor_critic needs the actor's engine")
            self.critic = ActorCritic(actor_engine, tokenizer, actor_sampling or SamplingParams(),
                                      max_new_tokens=max(256, cfg.generation.max_new_tokens))
            self._eval_judging = self.critic.judge_sampling(eval_sampling or actor_sampling or SamplingParams())
        self.updater: PolicyUpdater | None = None
        if self.read_only:
            return
        if self.model is None:              # a case bank: no extractor model, nothing to train
            return
        if method.trains_extractor:
            params = [p for p in self.model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=xc.lr, weight_decay=0.0)
            self.updater = make_updater(
                cfg, self.model, opt, role="extractor", pad_id=self.tokenizer.pad_token_id,
                micro_batch_size=xc.micro_batch_size,
                micro_batch_tokens=cfg.train.micro_batch_tokens,
                max_grad_norm=cfg.train.max_grad_norm,
                temperature=logprob_temperature(cfg, xc.temperature), loss_fn=cispo_loss,
                loss_kwargs={"eps_low": xc.eps_low if xc.eps_low >= 0 else None, "eps_high": xc.eps_high},
                skip_zero_advantage=True, seed=cfg.train.seed, loss_agg=cfg.train.loss_agg,
                recompute_old_logprobs=cfg.train.recompute_old_logprobs, compute_dtype=self.compute_dtype,
                share_prefix=cfg.train.share_prefix, packing=cfg.train.packing)
        else:
            for p in self.model.parameters():
                p.requires_grad_(False)

    def _load_extractor(self, actor_model: Any, actor_tokenizer: Any) -> tuple[Any, Any]:
        """``(model, tokenizer)`` of the extractor: a copy of the actor (``same``) or its own model."""
        xc = self.cfg.extractor
        if xc.model == "same":
            import copy

            base = actor_model.get_base_model() if hasattr(actor_model, "get_base_model") else actor_model
            model, tok = copy.deepcopy(base), actor_tokenizer       # separate weights, same starting point
        else:
            from crl_bench.config_devices import driver_device
            from crl_bench.llm.hf_engine import load_model_and_tokenizer

            model, tok = load_model_and_tokenizer(xc.model, "float32", device=driver_device(self.cfg))  # master weights
        if self.cfg.model.gradient_checkpointing and hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return model, tok

    # ---- rollout side ---------------------------------------------------------------------------
    @property
    def empty_guidance(self) -> str:
        """The ``empty`` memory control's block: the memory kind's header and no entry
        (:meth:`~crl_bench.experience.memory.Memory.empty_guidance`)."""
        return self.memory.empty_guidance()

    def task_guidance(self, env_id: str, task: int, later: Sequence[str] = ()) -> str:
        """For a memory kind that does not retrieve (``reflexion``): the block an attempt at
        ``env_id``'s task ``task`` is shown, with ``later`` texts of an evaluation's earlier attempts
        (:meth:`~crl_bench.experience.memory.Memory.task_guidance`)."""
        return self.memory.task_guidance(self.manager, env_id, task, later)

    def place_guidance(self, specs: list[EpisodeSpec]) -> list[EpisodeSpec]:
        """The step's episode specs as the memory kind guides them: unchanged for a kind that
        retrieves; for one that does not (``reflexion``), each spec that would retrieve (a guided
        episode after the warm-up) is shown its task's :meth:`task_guidance` instead, read when the
        step runs (after the previous step wrote, also when the specs were drawn ahead)."""
        if self.memory.retrieves:
            return specs
        return [replace(s, retrieve=False, guidance=self.task_guidance(s.env_id, s.task)) if s.retrieve else s
                for s in specs]

    def eval_attempts(self, mode: str, donors: dict[str, dict[int, int]]) -> Attempts | None:
        """The memory kind's evaluation attempts for ``mode`` (``reflexion``'s reflections between
        attempts), or ``None`` when attempts are guided by retrieval
        (:meth:`~crl_bench.experience.memory.Memory.eval_attempts`)."""
        return self.memory.eval_attempts(self.manager, mode, donors)

    def free_size(self, group_size: int) -> int:
        """Experience-free episodes per group (the rest are guided)."""
        n = self.cfg.experience.free_size
        return group_size // 2 if n < 0 else n

    def guide(self, requests: list[tuple[str, str, str]], count_retrievals: bool = True,
              judge_sampling: bool | None = None) -> list[Guidance]:
        """Rollout callback: retrieve for ``(env_id, first task prompt, retrieval query)`` of each guided
        episode.

        Returns one :class:`~crl_bench.rollout.Guidance` per request, whose ``record`` is a
        :class:`RetrievalRecord` (snapshots of the entries, the text shown, the judge's decision).
        The text is the memory kind's block (:meth:`~crl_bench.experience.memory.Memory.guidance`:
        with insights, ``expel``, the env's insight list above the cases); the judge sees only the
        retrieved entries.
        ``count_retrievals=False`` leaves the bank's counters untouched.  The actor-critic judge (if
        on) is shown the initial prompt, the guidance and the actor's average score on the env over
        the training episodes so far (released ``actor_critic``); it judges with the training
        sampling, or with the evaluation sampling when ``judge_sampling`` is false (default:
        ``count_retrievals``).  Each env retrieves from its bank partition
        (:meth:`~crl_bench.experience.memory.Memory.scope`, ``experience.scope``).
        """
        found = self.manager.retrieve([(self.memory.scope(env_id), query) for env_id, _, query in requests],
                                      count_retrievals=count_retrievals)
        bodies = [format_numbered(entries, empty="") for entries in found]
        decisions = [""] * len(requests)
        if self.critic is not None:
            asked = [i for i, entries in enumerate(found) if entries]
            items = [(requests[i][1], bodies[i], *self.env_score(requests[i][0])) for i in asked]
            judging = None if (count_retrievals if judge_sampling is None else judge_sampling) else self._eval_judging
            for i, j in zip(asked, self.critic.judge(items, judging)):
                decisions[i], bodies[i] = j.decision, j.guidance
        texts = self.memory.guidance(self.manager, [env_id for env_id, _, _ in requests], bodies)
        out = []
        for entries, text, decision in zip(found, texts, decisions):
            snap = [replace(e) for e in entries]
            out.append(Guidance(text, [e.id for e in entries], RetrievalRecord(snap, text, decision)))
        return out

    def eval_guide(self, requests: list[tuple[str, str, str]]) -> list[Guidance]:
        """:meth:`guide` for guided evaluation: the evaluation sampling for the judge; the retrievals
        are counted on the entries only with ``eval.writes_counters`` (released evaluation)."""
        return self.guide(requests, count_retrievals=self.cfg.eval.writes_counters, judge_sampling=False)

    def form_guide(self, requests: list[tuple[str, str, str]], form: str) -> list[Guidance]:
        """Rollout callback of a memory form's control (``eval.controls``: ``raw``, ``condensed``,
        ``both``; docs/evaluation.md "Memory forms"): the retrieval of :meth:`eval_guide` for each
        request, never counted on the entries, shown as the memory kind's ``form``
        (:meth:`~crl_bench.experience.memory.Memory.form_guidance`) and recorded as retrieved.  The
        actor-critic judge does not run: the entries are shown as retrieved.

        Raises:
            ValueError: the memory kind has no such form.
        """
        self.memory.check_form(form)
        found = self.manager.retrieve([(self.memory.scope(env_id), query) for env_id, _, query in requests],
                                      count_retrievals=False)
        texts = self.memory.form_guidance(self.manager, form, [env_id for env_id, _, _ in requests], found)
        return [Guidance(text, [e.id for e in entries], RetrievalRecord([replace(e) for e in entries], text))
                for entries, text in zip(found, texts)]

    def env_score(self, env_id: str) -> tuple[float, int]:
        """``(average score, episodes)`` of the actor on ``env_id`` over the training episodes so far
        (``(0.0, 0)`` before the first)."""
        total, n = self.env_scores.get(env_id, (0.0, 0))
        return (total / n if n else 0.0), int(n)

    def turn_guide(self, requests: list[tuple[str, str, str]], count_retrievals: bool = True) -> list[Guidance]:
        """Rollout callback of turn-level retrieval (``experience.integration: turn | both``): the
        ``k`` entries for the current observation's query, recorded on the turn; shown in the turn's
        prompt only with ``experience.turn_show``.  No judgement, and never credited (released: the
        turn-level search discards the extractions that wrote the entries)."""
        found = self.manager.retrieve([(self.memory.scope(env_id), query) for env_id, _, query in requests],
                                      count_retrievals=count_retrievals)
        out = []
        for entries in found:
            text = guidance_text(format_numbered(entries, empty=""), self.header) if self.cfg.experience.turn_show \
                else ""
            out.append(Guidance(text, [e.id for e in entries], RetrievalRecord([replace(e) for e in entries], text)))
        return out

    def search_tool(self, count_retrievals: bool = True) -> SearchTool:
        """The in-episode search tool over this track's manager (``experience.search_tool``): each
        question is answered by :meth:`ExperienceManager.answer` (retrieval, then the extractor);
        ``count_retrievals=False`` leaves the bank's counters untouched."""
        def answer(queries: list[tuple[str, str]]) -> list[tuple[str, list[int], Extraction | None]]:
            scoped = [(self.memory.scope(env_id), q) for env_id, q in queries]
            return [(a.text, [e.id for e in a.entries], a.extraction)
                    for a in self.manager.answer(scoped, count_retrievals=count_retrievals)]
        return SearchTool(answer, self.cfg.experience.max_tool_uses)

    def flush(self) -> None:
        """Wait until every queued distillation and merge has been applied to the bank."""
        self.manager.drain()

    def begin_evaluation(self, key: str) -> None:
        """Before a read-only evaluation mode: the retriever's read-only draws are reseeded from
        ``key`` and its clock fixed at the bank's last training retrieval
        (:meth:`ExperienceManager.begin_evaluation`)."""
        self.manager.begin_evaluation(key)

    # ---- before a step's rollout ----------------------------------------------------------------
    def before_rollout(self, step: int) -> dict[str, Any]:
        """The memory kind's upkeep at the start of 0-based step ``step``, after the flush (the caller
        flushes first): for lessons the merge pass every ``experience.merge.every`` steps, skipped
        when the extractor was updated in the step before
        (:meth:`crl_bench.experience.lessons.LessonsMemory.upkeep`, which names its metrics).

        Raises ``RuntimeError`` on a read-only track."""
        self._check_trainable()
        return self.memory.upkeep(self.manager, step, self.updated_at_step)

    # ---- after a step's rollout -----------------------------------------------------------------
    def after_rollout(self, trajs: Sequence[Trajectory], step: int, warmup: bool = False) -> dict[str, Any]:
        """Everything the track does with a finished rollout, in this order: the actor's score per env
        (every episode, as the released pipeline records it), :meth:`credit` (the extractions whose
        entries, or answers, guided this step), :meth:`queue_distillation` (this step's episodes) and
        :meth:`episode_metrics`, which it returns.  ``warmup``: a step that neither trains the actor
        nor credits the extractor (retrieval may have happened: the released step ``warmup_steps``).

        Raises ``RuntimeError`` on a read-only (evaluation) track."""
        self._check_trainable()
        for t in trajs:
            acc = self.env_scores.setdefault(t.env_id, [0.0, 0])
            acc[0] += float(t.reward)
            acc[1] += 1
        credited = self.credit(trajs, warmup)
        queued = self.queue_distillation(trajs, step)
        return self.episode_metrics(trajs, credited, queued, warmup)

    def credit(self, trajs: Sequence[Trajectory], warmup: bool = False) -> int:
        """Reward extractions by the outcomes of the episodes they guided (step 3 of the module doc).

        In order: take in the extractions the manager finished since the last step (those that wrote
        an entry can be credited from now on; with ``extractor.invalid_reward`` one of which the bank
        applied no operation is queued for the next update with that reward); unless ``warmup``, add each
        guided episode's use reward (:func:`use_reward`) to the extractions recorded at its retrieval
        and count its outcome on the entries it was shown; then forget extractions none of whose
        entries is still in the bank.  Returns the number of (episode, extraction) credits given.
        Raises ``RuntimeError`` on a read-only track."""
        self._check_trainable()
        self._collect_extractions()
        credited = self._credit(by_group(trajs)) if not warmup else 0
        self._prune_waiting_reward()
        return credited

    def queue_distillation(self, trajs: Sequence[Trajectory], step: int) -> int:
        """Queue what this step's finished episodes write (step 2 of the module doc); returns at once
        (the background manager distils).  What goes is the memory kind's
        (:meth:`~crl_bench.experience.memory.Memory.write`): for lessons the episodes chosen by
        ``experience.distill`` and ``distill_per_group``, and with ``experience.integration`` ``turn``
        or ``both`` every step of a guided-subgroup episode as well (released ``hook_on_turn_end``);
        for ``reflexion`` the actor writes a reflection on every failed episode now, stored per task.
        Returns the number of requests queued (of reflections, the failed episodes).  Raises
        ``RuntimeError`` on a read-only track."""
        self._check_trainable()
        return self.memory.write(self.manager, trajs, step)

    def episode_metrics(self, trajs: Sequence[Trajectory], credited: int, distill_queued: int,
                        warmup: bool = False) -> dict[str, Any]:
        """The step's experience metrics: success rate and mean reward of the guided and free
        subgroups, guided episodes that were shown experience, ``credited`` (from :meth:`credit`),
        ``distill_queued`` (from :meth:`queue_distillation`), ``warmup`` and, with the actor-critic
        judge, how often it accepted / refined / rejected the experience or answered invalidly."""
        guided = [t for t in trajs if t.subgroup == "guided"]
        free = [t for t in trajs if t.subgroup == "free"]
        judged = [t.retrieval.judgement for t in guided if t.retrieval is not None and t.retrieval.judgement]
        out = {
            "success_rate/guided": _rate(guided), "success_rate/free": _rate(free),
            "episodes/guided": len(guided), "episodes/free": len(free),
            "reward_mean/guided": _mean([t.reward for t in guided]),
            "reward_mean/free": _mean([t.reward for t in free]),
            "guided_with_experience": sum(1 for t in guided if t.experience_ids),
            "extractions_credited": credited, "distill_queued": distill_queued, "warmup": warmup,
        }
        out.update(self.memory.episode_metrics(guided))
        if any(t.tool_calls for t in trajs):
            out["tool_calls/guided"] = sum(len(t.tool_calls) for t in guided)
            out["tool_calls/free"] = sum(len(t.tool_calls) for t in free)
        for d in ("accept", "refine", "reject", "invalid"):
            if judged:
                out[f"critic_{d}"] = judged.count(d)
        return out

    def _check_trainable(self) -> None:
        if self.read_only:
            raise RuntimeError("this experience track evaluates a finished run's bank read-only; it cannot train")

    def _credit(self, by_group: dict[int, list[Trajectory]]) -> int:
        """Add each guided episode's use reward to the extractions recorded at its retrieval, and its
        score (0 counting -1, no judge adjustment: released, only the episode-start retrieval is judged)
        to the extractor's answers to its search-tool calls.  With ``experience.integration: turn``
        nothing is credited, as released: ``add_memory_metadata_to_rollout``
        (``memory_integration_mixin.py`` ~345-409) attaches triggered interactions, search-tool
        answers included, only to episodes that searched at episode start, which ``turn_based`` never
        does."""
        if self.cfg.experience.integration == "turn":
            return 0
        kind = self.cfg.extractor.reward
        credited = 0
        episode_outcomes: list[tuple[list[int], bool]] = []     # (entry ids shown, success) per episode
        for members in by_group.values():
            free_scores = [t.reward for t in members if t.subgroup == "free"]
            for t in members:
                if t.subgroup == "guided":
                    for call in t.tool_calls:
                        if call.record is not None and call.record.response_ids:
                            self._add_use(call.record, answer_reward(t))
                            credited += 1
                rec = t.retrieval
                if t.subgroup != "guided" or rec is None or not rec.entries:
                    continue
                if rec.guidance:                       # outcome counters: only experience the actor saw
                    episode_outcomes.append(([e.id for e in rec.entries], t.success))
                r = use_reward(t, free_scores, kind)
                for eid in dict.fromkeys(e.source_extraction for e in rec.entries if e.source_extraction):
                    extraction = self.waiting_reward.get(eid)
                    if extraction is None:          # written before this run, or long forgotten
                        continue
                    self.waiting_reward.move_to_end(eid)
                    self._add_use(extraction, r)
                    credited += 1
        self.manager.record_outcomes(episode_outcomes)
        return credited

    def _collect_extractions(self) -> None:
        """Take in the manager's finished extractions: one that wrote an entry can be credited from now
        on; one whose reply was not usable (nothing parsed, or every operation rejected) gets
        ``extractor.invalid_reward`` when that is set and the extractor trains."""
        invalid_reward = self.cfg.extractor.invalid_reward
        for outcome in self.manager.pop_outcomes():
            extraction = outcome.extraction
            if outcome.wrote:
                self.waiting_reward[extraction.id] = extraction
            elif not outcome.valid and invalid_reward is not None and extraction.response_ids \
                    and self.updater is not None:
                self._buffer(_Credit(extraction, float(invalid_reward), 1))   # format signal (off by default)

    def _add_use(self, extraction: Extraction, reward: float) -> None:
        """Add one use with ``reward`` to ``extraction``'s waiting credit (queued if new)."""
        credit = self.buffer.get(extraction.id) or self._buffer(_Credit(extraction))
        credit.total += reward
        credit.uses += 1

    def _buffer(self, credit: _Credit) -> _Credit:
        """Queue ``credit`` for the next extractor update; beyond ``extractor.batch_size`` waiting calls
        the oldest is dropped (released: a buffer of that many calls)."""
        self.buffer[credit.extraction.id] = credit
        while len(self.buffer) > self.cfg.extractor.batch_size:
            self.buffer.popitem(last=False)
            self.dropped += 1
        return credit

    def _prune_waiting_reward(self) -> None:
        """Forget extractions none of whose entries is in the bank any more (rewritten, merged away or
        evicted): no later retrieval can credit them.  Called after the step's credit, so an episode
        that retrieved an entry before it was rewritten still credits its writer."""
        live = self.manager.source_extractions()
        for eid in [eid for eid in self.waiting_reward if eid not in live]:
            del self.waiting_reward[eid]

    # ---- extractor update -----------------------------------------------------------------------
    def repeat_weight(self, extraction_id: str, step: int) -> float:
        """The released training-count-aware weight of one extractor sample at 1-based ``step``
        (``_build_memory_batch_from_buffer_entries``): 0 when the extraction was trained fewer than
        ``extractor.repeat_cooldown_steps`` steps ago, else ``(1 + times trained) **
        -extractor.repeat_weight_power`` (1 for one never trained)."""
        xc = self.cfg.extractor
        count, last = self.trained.get(extraction_id, (0, -1))
        if xc.repeat_cooldown_steps > 0 and last >= 0 and step - last < xc.repeat_cooldown_steps:
            return 0.0
        return float((1 + count) ** -xc.repeat_weight_power) if xc.repeat_weight_power > 0 else 1.0

    def maybe_update_extractor(self, step: int = 0) -> dict[str, Any] | None:
        """One CISPO update when ``extractor.batch_size`` credited extractions are waiting, at 1-based
        ``step``.

        Each extraction is one training sample whose reward is the mean over its uses; the advantage
        is that reward minus the batch mean (divided by the std with ``reward_std_normalize``), times
        the sample's :meth:`repeat_weight` (as released, the advantage is scaled; a weight of 0 leaves
        the sample in the batch with no gradient).  Queued distillation is applied first, with the
        weights before the update (released: the fence before the asynchronous extractor update).
        With ``extractor.repeat_record`` each trained
        extraction's count and step are recorded (released only by the knowledge-model pipeline, so
        the released Complementary RL weights are all 1).  Returns the update's metrics (loss, reward
        mean, ...), or ``None`` when no update ran.
        """
        xc = self.cfg.extractor
        if self.updater is None or len(self.buffer) < xc.batch_size:
            return None
        # released fence (fence_memory_updates_before_async_train): what is queued is distilled with the
        # weights that were current when it was queued, before the update starts
        self.manager.drain()
        # the update's weight sync drops the extractor engine's cached prefixes anyway: dropped first,
        # they stay out of the update's resident peak; then the distillation's freed caches are handed
        # back before the update allocates
        self.manager.clear_caches()
        trim_heap()
        batch = [self.buffer.popitem(last=False)[1] for _ in range(xc.batch_size)]
        raw = [c.reward for c in batch]
        # REINFORCE-style batch baseline as released: the whole batch is one group
        advs = grouped_advantages(raw, [0] * len(raw), std_normalize=xc.reward_std_normalize)
        weights = [self.repeat_weight(c.extraction.id, step) for c in batch]
        samples = []
        for c, a, w in zip(batch, advs, weights):
            c.extraction.reward = c.reward
            if c.extraction.response_ids:
                samples.append(extraction_sample(c.extraction, a * w))
        with self.manager.updating_extractor():
            stats = self.updater.update(samples)
            self.extractor_version += 1
            self.manager.extractor_updated(self.model, self.extractor_version)
        self.updated_at_step = int(step)
        if xc.repeat_record:
            for c, w in zip(batch, weights):
                if w > 0:
                    count, _ = self.trained.get(c.extraction.id, (0, -1))
                    self.trained[c.extraction.id] = (count + 1, int(step))
        kinds = [c.extraction.kind for c in batch]
        out = {"extractor_update": len(self.updates) + 1, "extractor_version": self.extractor_version,
               "extractor_reward_mean": _mean(raw), "extractor_batch": len(batch),
               "extractor_uses_mean": _mean([c.uses for c in batch]),
               "extractor_repeat_weight_mean": _mean(weights),
               "extractor_batch_kinds": {k: kinds.count(k) for k in sorted(set(kinds))},
               **{f"extractor_{k}": v for k, v in stats.items()}}
        self.updates.append(out)
        return out

    def metrics(self) -> dict[str, Any]:
        """Manager and bank counters for the step's metrics row, and the extractor replies finished since
        the previous row (``extractions_step``) with the share of them that parsed into at least one
        operation (``extractions_parse_rate``, only when there were any), then the memory kind's own
        (:meth:`~crl_bench.experience.memory.Memory.metrics`: with insights the same for the insight
        calls, ``insight_calls_step`` and ``insight_parse_rate``; with reflections their count).
        Called once per step."""
        s = self.manager.stats()
        parsed, failed = s["extractions_parsed"] - self.parse_seen[0], s["extractions_failed"] - self.parse_seen[1]
        self.parse_seen = (s["extractions_parsed"], s["extractions_failed"])
        step_parse = {"extractions_step": parsed + failed,
                      **({"extractions_parse_rate": parsed / (parsed + failed)} if parsed + failed > 0 else {})}
        step_parse.update(self.memory.metrics(self.manager, s))
        return {"bank_size": s["bank_size"], "extractions_parsed": s["extractions_parsed"],
                "extractions_failed": s["extractions_failed"], "ops_applied": s["ops_applied"],
                "ops_rejected": s["ops_rejected"], "op_kinds": s["op_kinds"], "merges": s["merges"],
                "merge_passes": s["merge_passes"], "merge_calls_failed": s["merge_calls_failed"],
                "merge_entries_in": s["merge_entries_in"], "merge_entries_out": s["merge_entries_out"],
                "deleted_by_vote": s["deleted_by_vote"], "tool_answers": s["answers"],
                "distill_backlog": self.manager.backlog(), "extractor_errors": s["extractor_errors"],
                "extractions_waiting_reward": len(self.waiting_reward), "extractor_buffer": len(self.buffer),
                "extractor_buffer_dropped": self.dropped,
                "retrieval_queries": s["queries"], "retrieval_batches": s["query_batches"],
                "retrieval_query_cache_hit_rate": s["query_cache_hit_rate"], **step_parse}

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The track's state at a step boundary, for a checkpoint (trainer/checkpoint.py): the
        extractions waiting for reward (they wrote entries still in the bank) and those credited and
        waiting for the next CISPO update, in order, the dropped-buffer count, the extractor version
        and update log, the CISPO optimiser and its shuffling generator, the retriever's generators
        and the manager's counters and uncollected outcomes, and the memory kind's own state
        (``memory``; ``{}`` for the built-in kinds).  The extractor's weights and the bank
        file are saved beside it by the caller (:meth:`save_bank`, the extractor model).

        Drains the manager first, so no distillation is half done.  Raises ``RuntimeError`` on a
        read-only track.
        """
        self._check_trainable()
        self.flush()
        return {
            "waiting_reward": list(self.waiting_reward.items()),
            "buffer": [(k, c.extraction, c.total, c.uses) for k, c in self.buffer.items()],
            "dropped": self.dropped, "extractor_version": self.extractor_version, "updates": list(self.updates),
            "env_scores": {k: list(v) for k, v in self.env_scores.items()}, "trained": dict(self.trained),
            "updated_at_step": self.updated_at_step, "parse_seen": list(self.parse_seen),
            "optimizer": self.updater.optimizer.state_dict() if self.updater is not None else None,
            "updater_rng": self.updater.rng.getstate() if self.updater is not None else None,
            "manager": self.manager.state_dict(), "memory": self.memory.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (on a track built for the same run, its bank opened from the
        checkpoint's copy and its extractor weights already loaded).

        Raises:
            ValueError: the checkpoint has CISPO optimiser state and this track trains no extractor,
                or the other way round (another method's checkpoint).
        """
        self._check_trainable()
        if (state["optimizer"] is None) != (self.updater is None):
            raise ValueError("checkpoint and run disagree on whether the extractor trains (another method's run?)")
        self.waiting_reward = OrderedDict(state["waiting_reward"])
        self.buffer = OrderedDict((k, _Credit(x, total, uses)) for k, x, total, uses in state["buffer"])
        self.dropped = int(state["dropped"])
        self.extractor_version = int(state["extractor_version"])
        self.updates = list(state["updates"])
        self.env_scores = {k: list(v) for k, v in state.get("env_scores", {}).items()}
        self.trained = dict(state.get("trained", {}))
        self.updated_at_step = int(state.get("updated_at_step", -1))
        if self.updater is not None:
            self.updater.optimizer.load_state_dict(state["optimizer"])
            self.updater.rng.setstate(state["updater_rng"])
            with self.manager.updating_extractor():       # generation follows the loaded weights
                self.manager.extractor_updated(self.model, self.extractor_version)
        self.manager.load_state_dict(state["manager"])
        self.memory.load_state_dict(state.get("memory", {}))
        s = self.manager.stats()            # a checkpoint without parse_seen: count from the restored counters
        self.parse_seen = tuple(state.get("parse_seen", (s["extractions_parsed"], s["extractions_failed"])))

    def save_bank(self, dest: str | Path) -> None:
        """Copy the bank's SQLite file to ``dest`` (:meth:`ExperienceManager.backup`: the manager
        drained, its write lock held)."""
        self.manager.backup(dest)

    def close(self, drain_timeout: float = 0.0) -> None:
        """Stop the manager (after up to ``drain_timeout`` s of queued distillation), close the bank and
        the extractor's data-parallel workers, if any."""
        self.manager.close(drain_timeout=drain_timeout)
        if self.bank is not None:
            self.bank.close()
        close_updater = getattr(self.updater, "close", None)
        if close_updater is not None:
            close_updater()


def _mean(xs: Sequence[float]) -> float:
    return float(statistics.fmean(xs)) if xs else 0.0


def _rate(trajs: Sequence[Trajectory]) -> float:
    return _mean([1.0 if t.success else 0.0 for t in trajs])
