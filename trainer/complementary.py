"""The experience track of the training loop: Complementary RL's actor-extractor co-evolution.

Complementary RL (arXiv 2603.17621; DESIGN.md section 1).  Beside the actor's GRPO loop:

1. Each group of G rollouts is split into an experience-free and an experience-guided subgroup; the
   guided episodes retrieve ``k`` entries from the experience bank at episode start (query: task goal +
   first observation) and carry them in their prompt.  Advantages are computed within each subgroup
   (the loop's :meth:`Trainer.advantages` keys on ``(group, subgroup)``).
2. Every finished episode goes to the background experience manager, whose extractor turns it into
   ADD / UPDATE / MERGE / NONE operations on the bank; every ``merge_every`` steps a merge pass offers
   groups of similar entries to the extractor for consolidation.
3. A guided episode's outcome becomes a reward of the extraction that wrote the entry that guided
   it, one (extraction, reward) pair per guided episode: ``relative`` (+1 / 0 / -1 against the mean score of the experience-free subgroup of the same
   group, as in the released code) or ``binary`` (the guided episode succeeded).
4. When ``extractor.batch_size`` pairs have accumulated, the extractor takes one CISPO update
   (unless the method freezes it: the static-extractor baseline).  An extraction keeps earning pairs
   while its entry guides episodes; pairs from extractions sampled before the last update are
   off-policy, which CISPO's clipped importance weights account for.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch

from crl_bench.config import RunConfig
from crl_bench.env_api import feedback_of
from crl_bench.experience.bank import ExperienceBank
from crl_bench.experience.embedding import SentenceEmbedder
from crl_bench.experience.manager import DistillRequest, ExperienceManager, MergeRequest
from crl_bench.experience.operations import STOP, guidance_text
from crl_bench.experience.retrieval import Retriever
from crl_bench.llm.base import SamplingParams
from crl_bench.methods import MethodSpec, register_method
from crl_bench.rollout import Trajectory
from crl_bench.trainer.extractor import EpisodeRecord, Extractor, ExtractorPromptBuilder, binary_reward, \
    normalise_rewards, relative_reward
from crl_bench.trainer.losses import cispo_loss
from crl_bench.trainer.policy import PolicyUpdater, TokenSample

COMPLEMENTARY = MethodSpec(
    name="complementary",
    description="Complementary RL: GRPO actor + CISPO-trained experience extractor co-evolving",
    uses_experience=True,
    trains_extractor=True,
)
register_method(COMPLEMENTARY)

MAX_PENDING_EXTRACTIONS = 4096


def episode_record(traj: Trajectory) -> EpisodeRecord:
    """The text record of a finished episode that the extractor reads."""
    steps = []
    for k, turn in enumerate(traj.turns):
        nxt = traj.turns[k + 1].observation if k + 1 < len(traj.turns) else traj.final_obs
        steps.append((turn.observation, turn.action or turn.reply, feedback_of(nxt)))
    return EpisodeRecord(env_id=traj.env_id, task_line=traj.task_line, steps=steps, success=traj.success,
                         reward=traj.reward, final_obs=traj.final_obs, group_id=traj.group_id,
                         source=(traj.group_id, traj.meta.get("rollout")))


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
    """

    def __init__(self, cfg: RunConfig, method: MethodSpec, actor_model: Any, tokenizer: Any,
                 run_dir: str | Path | None, embedder: Any = None, extractor_model: Any = None) -> None:
        import tempfile

        from crl_bench.llm.hf_engine import HFEngine

        self.cfg = cfg
        self.method = method
        ex, xc = cfg.experience, cfg.extractor
        if run_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="crl-bank-")
            run_dir = self._tmp.name
        self.bank_path = Path(run_dir) / "experience.sqlite"
        self.embedder = embedder or SentenceEmbedder(ex.embedder)
        self.bank = ExperienceBank(self.bank_path, self.embedder, capacity=ex.capacity, eviction=ex.eviction,
                                   index=ex.index, max_text_chars=ex.max_text_chars)
        self.retriever = Retriever(self.bank, k=ex.k, oversample=ex.oversample, freq_penalty=ex.freq_penalty,
                                   recency_window_s=ex.recency_window_s, top1_demote_p=ex.top1_demote_p,
                                   seed=cfg.train.seed)
        self.tokenizer = tokenizer
        self.model = extractor_model if extractor_model is not None else self._load_extractor(actor_model)
        self.engine = HFEngine(self.model, tokenizer, batch_size=cfg.generation.batch_size,
                               prefix_cache=cfg.generation.prefix_cache)
        stop = (STOP, "\n") if xc.one_op_per_reply else (STOP,)
        sampling = SamplingParams(temperature=xc.temperature, top_p=1.0, max_new_tokens=xc.max_new_tokens,
                                  stop=stop)
        self.extractor = Extractor(self.engine, tokenizer, ExtractorPromptBuilder(tokenizer, xc.max_prompt_tokens),
                                   sampling)
        self.manager = ExperienceManager(self.bank, self.retriever, self.extractor,
                                         search_workers=ex.search_workers, query_batch=ex.query_batch,
                                         query_timeout_ms=ex.query_timeout_ms)
        self.updater: PolicyUpdater | None = None
        if method.trains_extractor:
            params = [p for p in self.model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=xc.lr, weight_decay=0.0)
            self.updater = PolicyUpdater(
                self.model, opt, pad_id=tokenizer.pad_token_id, micro_batch_size=xc.micro_batch_size,
                max_grad_norm=cfg.train.max_grad_norm,
                temperature=xc.temperature if xc.temperature > 0 else 1.0, loss_fn=cispo_loss,
                loss_kwargs={"eps_low": xc.eps_low if xc.eps_low >= 0 else None, "eps_high": xc.eps_high},
                skip_zero_advantage=True, seed=cfg.train.seed)
        else:
            for p in self.model.parameters():
                p.requires_grad_(False)
        # extractions whose entries are in the bank (id -> Extraction), most recently credited last
        self.pending: OrderedDict[str, Any] = OrderedDict()
        # (extraction, reward) pairs waiting for the next extractor update
        self.rewarded: list[tuple[Any, float]] = []
        self.generation = 0
        self.updates: list[dict[str, Any]] = []

    def _load_extractor(self, actor_model: Any) -> Any:
        xc = self.cfg.extractor
        if xc.model == "same":
            import copy

            base = actor_model.get_base_model() if hasattr(actor_model, "get_base_model") else actor_model
            model = copy.deepcopy(base)          # separate weights, same starting point
        else:
            from crl_bench.llm.hf_engine import load_model_and_tokenizer

            model, tok = load_model_and_tokenizer(xc.model, self.cfg.model.dtype)
            if tok.get_vocab() != self.tokenizer.get_vocab():
                raise ValueError("extractor.model must share the actor's tokenizer in this build")
        if self.cfg.model.gradient_checkpointing and hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return model

    # ---- rollout side ---------------------------------------------------------------------------
    def free_size(self, group_size: int) -> int:
        """Experience-free episodes per group (the rest are guided)."""
        n = self.cfg.experience.free_size
        return group_size // 2 if n < 0 else n

    def guide(self, requests: list[tuple[str, str, str]]) -> list[tuple[str, list[int]]]:
        """Rollout callback: retrieve for ``(env_id, task line, first observation)`` of each guided episode."""
        queries = [(env_id, f"{task}\n{obs}") for env_id, task, obs in requests]
        found = self.manager.retrieve(queries)
        return [(guidance_text(entries) if entries else "", [e.id for e in entries]) for entries in found]

    # ---- after a step's rollout -----------------------------------------------------------------
    def after_rollout(self, trajs: Sequence[Trajectory], step: int) -> dict[str, Any]:
        """Record outcomes, reward extractions, queue distillation (and a merge pass); returns metrics."""
        xc, ex = self.cfg.extractor, self.cfg.experience
        self._collect_extractions()
        by_group: dict[int, list[Trajectory]] = defaultdict(list)
        for t in trajs:
            by_group[t.group_id].append(t)
        rewards: dict[str, list[float]] = defaultdict(list)
        guided_used = 0
        with self.manager.lock.write():
            for g, members in by_group.items():
                free_scores = [t.reward for t in members if t.subgroup == "free"]
                for t in members:
                    if t.subgroup != "guided" or not t.experience_ids:
                        continue
                    guided_used += 1
                    self.bank.record_outcome(t.experience_ids, t.success)
                    if xc.reward == "relative" and free_scores:
                        r = relative_reward(t.reward, free_scores)
                    else:
                        r = binary_reward(t.success)
                    for entry in self.bank.get(t.experience_ids):
                        if entry.source_extraction:
                            rewards[entry.source_extraction].append(r)
        credited = 0
        for eid, rs in rewards.items():
            extraction = self.pending.get(eid)
            if extraction is None:
                continue
            self.pending.move_to_end(eid)
            for r in rs:                      # one (extraction, reward) pair per guided episode
                self.rewarded.append((extraction, float(r)))
            credited += 1
        # distillation: every finished episode (or the first n of each group), never waited on
        reqs = []
        for g, members in by_group.items():
            chosen = members if ex.distill_per_group <= 0 else members[:ex.distill_per_group]
            for t in chosen:
                if t.turns:
                    used = self.bank.get(t.experience_ids) if t.experience_ids else []
                    reqs.append(DistillRequest(episode_record(t), used, t.env_id, step))
        if ex.merge_every and step % ex.merge_every == 0:
            reqs += self._merge_requests(step)
        if reqs:
            self.manager.submit(reqs)
        guided = [t for t in trajs if t.subgroup == "guided"]
        free = [t for t in trajs if t.subgroup == "free"]
        return {
            "success_rate/guided": _rate(guided), "success_rate/free": _rate(free),
            "reward_mean/guided": _mean([t.reward for t in guided]),
            "reward_mean/free": _mean([t.reward for t in free]),
            "guided_with_experience": guided_used,
            "extractions_credited": credited, "distill_queued": len(reqs),
        }

    def _merge_requests(self, step: int) -> list[MergeRequest]:
        """Groups of similar entries (cosine >= ``merge_threshold``), at most ``merge_max`` each."""
        ex = self.cfg.experience
        out = []
        with self.manager.lock.read():
            for env_id in sorted({e.env_id for e in self.bank.entries()}):
                entries = self.bank.entries(env_id)
                seen: set[int] = set()
                for e in entries:
                    if e.id in seen:
                        continue
                    hits = self.bank.search([e.text()], ex.merge_max, env_id)[0]
                    ids = [i for i, s in hits if s >= ex.merge_threshold and i not in seen]
                    if e.id not in ids:
                        ids = [e.id] + ids
                    ids = ids[:ex.merge_max]
                    if len(ids) >= 2:
                        seen.update(ids)
                        out.append(MergeRequest(self.bank.get(ids), env_id, step))
        return out

    def _collect_extractions(self) -> None:
        invalid_reward = self.cfg.extractor.invalid_reward
        for extraction in self.manager.pop_extractions():
            applied = getattr(extraction, "applied", None)
            wrote = applied is not None and any(op.kind != "NONE" for op, _ in applied.applied)
            said_none = applied is not None and any(op.kind == "NONE" for op, _ in applied.applied)
            if wrote:
                self.pending[extraction.id] = extraction
            elif not said_none and invalid_reward is not None and extraction.response_ids:
                extraction.reward = float(invalid_reward)     # format signal (optional, off by default)
                self.rewarded.append((extraction, float(invalid_reward)))
        while len(self.pending) > MAX_PENDING_EXTRACTIONS:
            self.pending.popitem(last=False)

    # ---- extractor update -----------------------------------------------------------------------
    def maybe_update_extractor(self) -> dict[str, Any] | None:
        """One CISPO update when ``extractor.batch_size`` rewarded extractions are waiting.

        Returns the update's metrics (loss, reward mean, ...), or ``None`` when no update ran.
        """
        xc = self.cfg.extractor
        if self.updater is None or len(self.rewarded) < xc.batch_size:
            return None
        batch, self.rewarded = self.rewarded[:xc.batch_size], self.rewarded[xc.batch_size:]
        raw = [r for _, r in batch]
        advs = normalise_rewards(raw, std=xc.reward_std_normalize)
        samples = [TokenSample(e.prompt_ids, e.response_ids, e.logprobs, a)
                   for (e, _), a in zip(batch, advs) if e.response_ids]
        with self.manager.extractor_lock:
            stats = self.updater.update(samples)
            self.generation += 1
            self.extractor.generation = self.generation
            self.engine.sync_weights(self.model)
        out = {"extractor_update": len(self.updates) + 1, "extractor_generation": self.generation,
               "extractor_reward_mean": _mean(raw), "extractor_batch": len(batch),
               **{f"extractor_{k}": v for k, v in stats.items()}}
        self.updates.append(out)
        return out

    def metrics(self) -> dict[str, Any]:
        """Manager and bank counters for the step's metrics row."""
        s = self.manager.stats()
        return {"bank_size": s["bank_size"], "extractions_parsed": s["extractions_parsed"],
                "extractions_failed": s["extractions_failed"], "ops_applied": s["ops_applied"],
                "ops_rejected": s["ops_rejected"], "op_kinds": s["op_kinds"], "merges": s["merges"],
                "distill_pending": self.manager.pending(), "extractor_errors": s["extractor_errors"],
                "extractions_waiting_reward": len(self.pending), "extractions_rewarded": len(self.rewarded),
                "retrieval_queries": s["queries"], "retrieval_batches": s["query_batches"]}

    def close(self, drain_timeout: float = 0.0) -> None:
        self.manager.close(drain_timeout=drain_timeout)
        self.bank.close()


def _mean(xs: Sequence[float]) -> float:
    return float(statistics.fmean(xs)) if xs else 0.0


def _rate(trajs: Sequence[Trajectory]) -> float:
    return _mean([1.0 if t.success else 0.0 for t in trajs])
