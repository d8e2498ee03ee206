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
   episode's retrieval query (``experience.key: query``).  At the start of every ``merge_every``-th
   step the merge pass runs (:meth:`ExperienceTrack.before_rollout`; the released fold by default).
3. Credit: each use of an entry by a guided episode adds a reward to the extraction recorded at
   retrieval time (``binary``: the episode's score, 0 counting -1; ``relative``: +1 / 0 / -1 against
   the free subgroup's mean; the judge's decision overrides, see :mod:`.actor_critic`), and each
   search-tool answer of a guided episode is credited with the episode's score.  An extraction's
   reward is the mean over its uses: one training sample per extraction call.
4. When ``extractor.batch_size`` extractions wait, the extractor takes one CISPO update with the
   batch mean as baseline (each sample's advantage times its repeat weight, ``extractor.repeat_*``),
   unless the method freezes it: the static-extractor baseline, whose buffer is bounded the same way
   and simply never drained by an update.

The memory baselines are configurations of the same track: a bank of cases (``casebank``) is written
with the finished episodes themselves instead of step 2's extractor, and ``expel`` also sends each
step's success/failure pairs and successes to a frozen extractor that edits the env's insight list,
shown above the cases in every guided prompt (:meth:`ExperienceTrack._insight_requests`); for
``reflexion`` the actor reflects on each failed episode and the reflections are kept per task
(:meth:`ExperienceTrack.reflection_guidance`), with no retrieval.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from crl_bench.config import RunConfig
from crl_bench.env_api import feedback_of
from crl_bench.experience.cases import admits_case
from crl_bench.experience.extractor import EpisodeRecord, Extraction
from crl_bench.experience.insights import Insight, format_insights
from crl_bench.experience.json_ops import format_numbered
from crl_bench.experience.manager import DistillRequest, InsightRequest, build_manager
from crl_bench.experience.reflections import REFLECTIONS_HEADER, ReflectionWriter, reflection_block
from crl_bench.experience.types import RetrievalRecord
from crl_bench.llm.base import SamplingParams
from crl_bench.llm.gate import ComputeGate
from crl_bench.llm.memory import trim_heap
from crl_bench.llm.precision import DTYPES, cast_parameters, resolve_dtype
from crl_bench.methods import MethodSpec
from crl_bench.rollout import Guidance, SearchTool, Trajectory, Turn
from crl_bench.trainer.actor_critic import INVALID, ActorCritic
from crl_bench.trainer.advantages import grouped_advantages
from crl_bench.trainer.extractor_training import answer_reward, extraction_sample, use_reward
from crl_bench.trainer.losses import cispo_loss
from crl_bench.trainer.policy import PolicyUpdater
from crl_bench.trainer.updaters import logprob_temperature, make_updater

GUIDANCE_HEADER = ("Knowledge distilled from earlier episodes. Use it where it applies to this task; "
                    "do not follow it blindly.")


#: the header of a case bank's block (``casebank``): its entries are whole earlier episodes
CASES_HEADER = ("Earlier episodes of similar tasks, each with its outcome. Use them where they apply to this "
                "task; do not copy them blindly.")

#: the header of the insight list of a method with insights (``expel``), shown above its cases
INSIGHTS_HEADER = ("Insights learned from earlier episodes of this game, most important first. Use them where they "
                   "apply to this task; do not follow them blindly.")


def empty_guidance_text(header: str = GUIDANCE_HEADER) -> str:
    """The ``empty`` memory control's experience block: the header a guided episode sees, no entry."""
    return f"{header}\n\n(no entries)"


def insight_block(insights: Sequence[Insight]) -> str:
    """The insight part of an ``expel`` guided prompt: :data:`INSIGHTS_HEADER` and the numbered
    insights; ``""`` without insights."""
    return guidance_text(format_insights(insights, empty=""), INSIGHTS_HEADER)


#: the ``empty`` control's block of a bank of lessons
EMPTY_GUIDANCE = empty_guidance_text()


def guidance_text(body: str, header: str = GUIDANCE_HEADER) -> str:
    """The experience block shown to the actor: ``header`` (:data:`GUIDANCE_HEADER` for lessons,
    :data:`CASES_HEADER` for cases) and the numbered entries (``body``); ``""`` without entries."""
    return f"{header}\n\n{body}" if body.strip() else ""


@dataclass
class _Credit:
    """An extraction waiting for its update, with the rewards of its uses so far."""

    extraction: Extraction
    total: float = 0.0
    uses: int = 0

    @property
    def reward(self) -> float:
        return self.total / self.uses if self.uses else 0.0


def _step_text(traj: Trajectory, k: int) -> tuple[str, str, str]:
    """``(observation, action, feedback)`` of turn ``k`` (a search-tool call reads ``(search) question``)."""
    turn = traj.turns[k]
    nxt = traj.turns[k + 1].observation if k + 1 < len(traj.turns) else traj.final_obs
    if turn.tool:
        call = next((c for c in traj.tool_calls if c.turn == k), None)
        return turn.observation, f"(search) {call.query if call else turn.reply}", \
            f"Search results: {call.answer}" if call else ""
    return turn.observation, turn.action or turn.reply, feedback_of(nxt)


def episode_record(traj: Trajectory) -> EpisodeRecord:
    """The text record of a finished episode that the extractor reads (each step's observation,
    action and feedback, and the actor's whole replies for ``extractor.transcript: full``)."""
    steps = [_step_text(traj, k) for k in range(len(traj.turns))]
    return EpisodeRecord(env_id=traj.env_id, task_prompt=traj.task_prompt, steps=steps, success=traj.success,
                         reward=traj.reward, final_obs=traj.final_obs, group_id=traj.group_id,
                         source=(traj.group_id, traj.meta.get("rollout")), replies=[t.reply for t in traj.turns])


def turn_record(traj: Trajectory, k: int) -> EpisodeRecord:
    """The record of turn ``k`` alone that turn-level distillation reads (released turn-based update:
    the step's action and the env's feedback, keyed by the observation it was taken in)."""
    turn: Turn = traj.turns[k]
    obs, action, feedback = _step_text(traj, k)
    nxt = traj.turns[k + 1].observation if k + 1 < len(traj.turns) else traj.final_obs
    return EpisodeRecord(env_id=traj.env_id, task_prompt=traj.task_prompt, steps=[(obs, action, feedback)],
                         success=traj.success and k + 1 == len(traj.turns), reward=turn.reward, final_obs=nxt,
                         group_id=traj.group_id, source=(traj.group_id, traj.meta.get("rollout"), k),
                         replies=[turn.reply], outcome=f"one step of an episode (step reward {turn.reward:.2f})")


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
        self.header = {"cases": CASES_HEADER, "reflections": REFLECTIONS_HEADER}.get(method.entries, GUIDANCE_HEADER)
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
        # reflexion: the actor writes reflections on its failed attempts (in evaluation too)
        self.reflector = ReflectionWriter(actor_engine, tokenizer, exp_cfg.reflection_tokens) \
            if method.entries == "reflections" and actor_engine is not None else None
        self.updater: PolicyUpdater | None = None
        if self.read_only:
            return
        if self.model is None:              # a case bank: no extractor model, nothing to train
            return
        if method.trains_extractor:
            params = [p for p in self.model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=xc.lr, weight_decay=0.0)
            self.updater = make_updater(
                cfg, self.model, opt, pad_id=self.tokenizer.pad_token_id, micro_batch_size=xc.micro_batch_size,
                micro_batch_tokens=cfg.train.micro_batch_tokens,
                max_grad_norm=cfg.train.max_grad_norm,
                temperature=logprob_temperature(cfg, xc.temperature), loss_fn=cispo_loss,
                loss_kwargs={"eps_low": xc.eps_low if xc.eps_low >= 0 else None, "eps_high": xc.eps_high},
                skip_zero_advantage=True, seed=cfg.train.seed, loss_agg=cfg.train.loss_agg,
                recompute_old_logprobs=cfg.train.recompute_old_logprobs, compute_dtype=self.compute_dtype,
                share_prefix=cfg.train.share_prefix)
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
            from crl_bench.llm.hf_engine import load_model_and_tokenizer

            model, tok = load_model_and_tokenizer(xc.model, "float32")      # master weights
        if self.cfg.model.gradient_checkpointing and hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return model, tok

    # ---- rollout side ---------------------------------------------------------------------------
    @property
    def empty_guidance(self) -> str:
        """The ``empty`` memory control's block: this bank's header and no entry (with insights: the
        insight header and no insight, then the case header and no case)."""
        if self.method.insights:
            return f"{empty_guidance_text(INSIGHTS_HEADER)}\n\n{empty_guidance_text(self.header)}"
        return empty_guidance_text(self.header)

    def reflection_guidance(self, env_id: str, task: int, later: Sequence[str] = ()) -> str:
        """``reflexion``: the block an attempt at ``env_id``'s task ``task`` is shown: the task's
        stored reflections followed by ``later`` ones (an evaluation's earlier attempts), the last
        ``experience.reflections_shown`` of them (:func:`reflection_block`; ``""`` without any)."""
        shown = self.cfg.experience.reflections_shown
        texts = [*self.manager.reflections(env_id, task, shown), *later]
        return reflection_block(texts[-shown:])

    def reflect(self, trajs: Sequence[Trajectory]) -> list[str]:
        """``reflexion``: the actor's reflection on each of ``trajs`` (one batched generate call).

        Raises:
            RuntimeError: the track has no reflection writer (another method, or no actor engine).
        """
        if self.reflector is None:
            raise RuntimeError(f"method {self.method.name!r} writes no reflections")
        return self.reflector.reflect([episode_record(t) for t in trajs])

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
        With insights (``expel``) the text starts with the env's insight list (:func:`insight_block`),
        shown whether or not a case was found; the judge sees only the cases.
        ``count_retrievals=False`` leaves the bank's counters untouched.  The actor-critic judge (if
        on) is shown the initial prompt, the guidance and the actor's average score on the env over
        the training episodes so far (released ``actor_critic``); it judges with the training
        sampling, or with the evaluation sampling when ``judge_sampling`` is false (default:
        ``count_retrievals``).
        """
        found = self.manager.retrieve([(env_id, query) for env_id, _, query in requests],
                                      count_retrievals=count_retrievals)
        bodies = [format_numbered(entries, empty="") for entries in found]
        decisions = [""] * len(requests)
        if self.critic is not None:
            asked = [i for i, entries in enumerate(found) if entries]
            items = [(requests[i][1], bodies[i], *self.env_score(requests[i][0])) for i in asked]
            judging = None if (count_retrievals if judge_sampling is None else judge_sampling) else self._eval_judging
            for i, j in zip(asked, self.critic.judge(items, judging)):
                decisions[i], bodies[i] = j.decision, j.guidance
        lists = self.manager.insights([env_id for env_id, _, _ in requests]) if self.method.insights else {}
        out = []
        for (env_id, _, _), entries, body, decision in zip(requests, found, bodies, decisions):
            text = guidance_text(body, self.header)
            if lists.get(env_id):
                text = "\n\n".join(p for p in (insight_block(lists[env_id]), text) if p)
            snap = [replace(e) for e in entries]
            out.append(Guidance(text, [e.id for e in entries], RetrievalRecord(snap, text, decision)))
        return out

    def eval_guide(self, requests: list[tuple[str, str, str]]) -> list[Guidance]:
        """:meth:`guide` for guided evaluation: the evaluation sampling for the judge; the retrievals
        are counted on the entries only with ``eval.writes_counters`` (released evaluation)."""
        return self.guide(requests, count_retrievals=self.cfg.eval.writes_counters, judge_sampling=False)

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
        found = self.manager.retrieve([(env_id, query) for env_id, _, query in requests],
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
            return [(a.text, [e.id for e in a.entries], a.extraction)
                    for a in self.manager.answer(queries, count_retrievals=count_retrievals)]
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
        """The merge pass, where the released pipeline runs it: at the start of 0-based step ``step``
        when ``step`` is a positive multiple of ``experience.merge_every``, after the flush (the
        caller flushes first), except when the extractor was updated in the step before: the released
        asynchronous update is then still pending at this point, and the pipeline skips the flush and
        the merge of that step (``should_flush_pending_updates_before_rollout``).  Returns the
        metrics ``merge_pass`` (1 when it ran) and ``merge_skipped`` (1 when skipped for that reason)
        and, for a pass that ran, ``merge_pass_calls`` (its extractor calls) and ``merge_pass_writes``
        (entries it wrote: MERGE and UPDATE operations applied plus the entries a fold rewrote).

        Raises ``RuntimeError`` on a read-only track."""
        self._check_trainable()
        every = self.cfg.experience.merge_every
        if not every or step <= 0 or step % every or self.method.entries != "lessons":   # cases are not merged
            return {}
        if self.updated_at_step == step:          # updated at the end of the previous (1-based ``step``) step
            return {"merge_pass": 0, "merge_skipped": 1}
        exp_cfg = self.cfg.experience
        self.manager.drain()        # queued distillation first (the pass drains too), so the counts are the pass's
        before = self.manager.stats()
        self.manager.merge_pass(step, exp_cfg.merge, exp_cfg.merge_max, exp_cfg.merge_threshold)
        after = self.manager.stats()
        return {"merge_pass": 1, "merge_skipped": 0, "merge_pass_calls": after["merges"] - before["merges"],
                "merge_pass_writes": _merge_writes(after) - _merge_writes(before)}

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
        credited = self._credit(_by_group(trajs)) if not warmup else 0
        self._prune_waiting_reward()
        return credited

    def queue_distillation(self, trajs: Sequence[Trajectory], step: int) -> int:
        """Queue this step's finished episodes for the extractor (step 2 of the module doc); returns at
        once (the background manager distils).  Which episodes go is set by ``experience.distill`` and
        ``distill_per_group``; with ``experience.integration`` ``turn`` or ``both`` every step of a
        guided-subgroup episode goes as well (released ``hook_on_turn_end``).  Returns the number of
        requests queued.  For ``reflexion`` the actor writes a reflection on every failed episode
        now, stored per task; returns their number.  Raises ``RuntimeError`` on a read-only track."""
        self._check_trainable()
        if self.method.entries == "reflections":          # reflexion: the actor reflects on its failures
            failed = [t for t in trajs if not t.success and t.turns]
            texts = self.reflect(failed)
            self.manager.add_reflections([(t.env_id, int(t.task), x, step) for t, x in zip(failed, texts) if x])
            return len(failed)
        reqs = self._distill_requests(_by_group(trajs), step)
        if reqs:
            self.manager.submit(reqs)
        return len(reqs)

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
        if self.method.entries == "reflections":
            out["guided_with_reflections"] = sum(1 for t in guided if t.guidance)
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
        to the extractor's answers to its search-tool calls."""
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

    def _distill_requests(self, by_group: dict[int, list[Trajectory]], step: int) -> list[DistillRequest]:
        """With trajectory integration, one request per chosen episode with at least one turn, shown
        the entries it retrieved (none after an ``invalid`` judgement, as released); with
        turn integration, one request per step of each guided-subgroup episode, shown the entries
        retrieved before that step and keyed by that step's observation query.  A case bank takes
        every episode of both subgroups whose outcome ``experience.cases`` admits (successes by
        default), whole, keyed as the other methods' entries are."""
        exp_cfg = self.cfg.experience
        reqs = []
        if self.method.entries == "cases":
            for t in (t for members in by_group.values() for t in members):
                if admits_case(bool(t.turns), t.success, exp_cfg.cases):
                    reqs.append(DistillRequest(episode_record(t), [], t.env_id, step,
                                               t.query if exp_cfg.key == "query" else ""))
            if self.method.insights:
                reqs += self._insight_requests(by_group, step)
            return reqs
        for members in by_group.values():
            if exp_cfg.integration in ("trajectory", "both"):
                chosen = [t for t in members if exp_cfg.distill == "all" or t.subgroup == "guided"]
                if exp_cfg.distill_per_group > 0:
                    chosen = chosen[:exp_cfg.distill_per_group]
                for t in chosen:
                    if not t.turns:
                        continue
                    rec = t.retrieval
                    shown = rec.entries if rec is not None and rec.judgement != INVALID else []
                    key = t.query if exp_cfg.key == "query" else ""
                    reqs.append(DistillRequest(episode_record(t), list(shown), t.env_id, step, key))
            if exp_cfg.integration in ("turn", "both"):
                for t in members:
                    if t.subgroup != "guided":
                        continue
                    for k, turn in enumerate(t.turns):
                        rec = turn.retrieval
                        key = _turn_query(t, k) if exp_cfg.key == "query" else ""
                        reqs.append(DistillRequest(turn_record(t, k), list(rec.entries) if rec else [], t.env_id,
                                                   step, key))
        return reqs

    def _insight_requests(self, by_group: dict[int, list[Trajectory]], step: int) -> list[InsightRequest]:
        """The step's insight calls (:mod:`crl_bench.experience.insights`): for each group (one task)
        with a success and a failure, ``experience.insight_pairs`` comparisons, the i-th success
        against the i-th failure (both subgroups); then, per env, the first success of each task in
        chunks of ``experience.insight_successes`` (ExpeL's L), only chunks of two tasks or more."""
        exp_cfg = self.cfg.experience
        reqs: list[InsightRequest] = []
        firsts: dict[str, list[EpisodeRecord]] = {}
        for members in by_group.values():
            wins = [t for t in members if t.success and t.turns]
            losses = [t for t in members if not t.success and t.turns]
            for w, loss in list(zip(wins, losses))[:exp_cfg.insight_pairs]:
                reqs.append(InsightRequest(w.env_id, step, [episode_record(w)], [episode_record(loss)]))
            if wins:
                firsts.setdefault(wins[0].env_id, []).append(episode_record(wins[0]))
        size = exp_cfg.insight_successes
        for env_id, recs in firsts.items() if size else ():
            for i in range(0, len(recs), size):
                if len(recs[i:i + size]) >= 2:
                    reqs.append(InsightRequest(env_id, step, recs[i:i + size]))
        return reqs

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
        operation (``extractions_parse_rate``, only when there were any); with insights the same for
        the insight calls (``insight_calls_step``, ``insight_parse_rate``, from the outcomes the
        manager reports, which this collects).  Called once per step."""
        s = self.manager.stats()
        parsed, failed = s["extractions_parsed"] - self.parse_seen[0], s["extractions_failed"] - self.parse_seen[1]
        self.parse_seen = (s["extractions_parsed"], s["extractions_failed"])
        step_parse = {"extractions_step": parsed + failed,
                      **({"extractions_parse_rate": parsed / (parsed + failed)} if parsed + failed > 0 else {})}
        if self.method.entries == "reflections":
            step_parse["reflections"] = s["reflections"]
        if self.method.insights:
            done = self.manager.pop_insight_outcomes()        # the insight calls since the previous row
            valid = sum(1 for o in done if o.call.parse.valid)
            step_parse.update(insights=s["insights"], insight_calls=s["insight_calls"],
                              insight_kinds=s["insight_kinds"], insight_calls_step=len(done),
                              **({"insight_parse_rate": valid / len(done)} if done else {}))
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
        and the manager's counters and uncollected outcomes.  The extractor's weights and the bank
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
            "manager": self.manager.state_dict(),
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


def _turn_query(traj: Trajectory, k: int) -> str:
    """The retrieval query of turn ``k``'s observation (recorded by turn-level retrieval), else the
    episode's query."""
    return traj.turns[k].query or traj.query


def _by_group(trajs: Sequence[Trajectory]) -> dict[int, list[Trajectory]]:
    """``trajs`` by GRPO group, groups and episodes in rollout order."""
    by_group: dict[int, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_group[t.group_id].append(t)
    return by_group


def _mean(xs: Sequence[float]) -> float:
    return float(statistics.fmean(xs)) if xs else 0.0


def _merge_writes(stats: dict[str, Any]) -> int:
    """Entries merge passes wrote so far, from :meth:`ExperienceManager.stats`: MERGE and UPDATE
    operations applied (``similar`` passes; distillation's too, hence the caller's difference around
    one pass) plus the entries fold passes rewrote (``merge_entries_out``)."""
    kinds = stats.get("op_kinds", {})
    return int(kinds.get("MERGE", 0)) + int(kinds.get("UPDATE", 0)) + int(stats.get("merge_entries_out", 0))


def _rate(trajs: Sequence[Trajectory]) -> float:
    return _mean([1.0 if t.success else 0.0 for t in trajs])
