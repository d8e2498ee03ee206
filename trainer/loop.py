"""The training loop: rollout -> trajectories -> group advantages -> actor update; evaluation of the
actor is :class:`~crl_bench.trainer.evaluation.Evaluator` (``Trainer.evaluator``).

One loop serves every method (``crl_bench.methods``): a method only switches parts on or off.  For
``grpo`` each step samples ``groups_per_step`` train tasks from the mixture, rolls each out
``group_size`` times, computes outcome advantages within each group and makes one PPO-clipped update
of the actor on the tokens it generated (docs/method.md).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crl_bench.config import RunConfig
from crl_bench.config_devices import driver_device, placed
from crl_bench.llm.base import SamplingParams
from crl_bench.llm.gate import ComputeGate
from crl_bench.llm.memory import PhasePeaks, rss_gb, trim_heap
from crl_bench.llm.precision import DTYPES, resolve_dtype
from crl_bench.methods import MethodSpec
from crl_bench.mixtures import TaskSampler, resolve_mixture
from crl_bench.profiles import check_profile_mix
from crl_bench.results.alarms import LearningAlarms
from crl_bench.results.run_folder import RunWriter
from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner, Trajectory
from crl_bench.trainer.advantages import grouped_advantages
from crl_bench.trainer.evaluation import Evaluator, summarise
from crl_bench.trainer.policy import episode_samples, linear_warmup
from crl_bench.trainer.updaters import logprob_temperature, make_updater


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_threads(threads: int) -> int:
    """Set torch intra-op threads (``0`` = cores available to this process); returns the number."""
    if threads <= 0:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, threads))
    return torch.get_num_threads()



def context_window(model: Any) -> int:
    """The actor's context window in tokens: ``max_position_embeddings`` of its config (of the base
    model under a LoRA wrapper); 0 when the config does not say (no limit is then applied)."""
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "max_position_embeddings", 0) or 0)


def engine_context(cfg: Any, model: Any) -> int:
    """The actor's context as its engine takes it: ``generation.vllm_max_model_len`` where the vLLM engine has
    one (vLLM refuses a longer prompt for the whole batch), else :func:`context_window`."""
    g = cfg.generation
    if g.engine == "vllm" and g.vllm_max_model_len:
        return int(g.vllm_max_model_len)
    return context_window(model)


@dataclass
class StepResult:
    """Metrics of one training step and the trajectories it used."""

    metrics: dict[str, Any]
    trajectories: list[Trajectory]


class Trainer:
    """Owns the actor, its engine, the env pool and the optimiser for one run.

    Args:
        cfg: the resolved run configuration.
        writer: run folder writer, or ``None`` to keep nothing on disk (tests, benchmarks).
        model, tokenizer: an already loaded actor (tests pass a tiny model); loaded from
            ``cfg.model`` when omitted.
        embedder, extractor_model, extractor_tokenizer: replacements for the experience track's
            embedder, extractor model and its tokenizer (tests); built from ``cfg`` when omitted.
        read_only_bank: for methods with experience, evaluate with this existing bank (a finished
            run's ``experience.sqlite``) opened read-only instead of a fresh one; the trainer can then
            evaluate but not train (``crl-bench eval --run``).

    Raises:
        KeyError: unknown method or env id.
        ValueError: the method needs parts this build does not have.
    """

    def __init__(self, cfg: RunConfig, writer: RunWriter | None = None, model: Any = None,
                 tokenizer: Any = None, embedder: Any = None, extractor_model: Any = None,
                 extractor_tokenizer: Any = None, read_only_bank: str | Path | None = None) -> None:
        self.cfg = cfg
        self.method: MethodSpec = cfg.method_spec
        self.writer = writer
        self.threads = set_threads(cfg.model.threads)
        seed_everything(cfg.train.seed)
        self.mixture = resolve_mixture(cfg.rollout.mix)
        check_profile_mix(cfg.eval.profile, self.mixture.envs)
        # backend ray: envs, engines and the experience manager live in Ray actors behind the same
        # interfaces (crl_bench/ray_backend.py); the loop below is the same
        self.backend = None
        if cfg.backend == "ray":
            from crl_bench.ray_backend import RayBackend

            self.backend = RayBackend(cfg)
            self.pool = self.backend.env_pool()
        else:
            self.pool = EnvPool(cfg.rollout.env_kwargs, cfg.rollout.max_steps)
        # one probe env per id: validates the ids early and gives the task splits
        self.train_tasks, self.eval_tasks, weights = {}, {}, {}
        self.max_steps: dict[str, int] = {}
        self.eval_max_steps: dict[str, int] = {}                # eval episodes' limit where eval.max_steps sets one
        self.task_types: dict[str, dict[int, str]] = {}       # eval task id -> benchmark task type
        self.eval_contexts: dict[str, dict[int, str | None]] = {}   # eval task id -> context (diagnostics)
        self.data_files: dict[str, dict[str, str]] = {}
        for env_id in self.mixture.envs:
            env = self.pool.acquire(env_id)
            self.train_tasks[env_id] = env.task_ids("train")
            self.eval_tasks[env_id] = env.task_ids(cfg.eval.split_of(env_id))
            weights[env_id] = env.task_weights("train")
            self.max_steps[env_id] = int(env.max_steps)
            self.eval_max_steps[env_id] = int(cfg.eval.max_steps.get(env_id, 0))
            contexts = {int(t): env.context(int(t)) for t in self.eval_tasks[env_id]}
            if any(v is not None for v in contexts.values()):
                self.eval_contexts[env_id] = contexts
            types = {int(t): env.task_type(int(t)) for t in self.eval_tasks[env_id]}
            if any(v is not None for v in types.values()):
                self.task_types[env_id] = {t: v for t, v in types.items() if v is not None}
            self.data_files[env_id] = {name: str(path) for name, path in env.data_files().items()}
            self.pool.release(env_id, env)
        self.sampler = TaskSampler(self.mixture, self.train_tasks, seed=cfg.train.seed, task_weights=weights)

        if model is None and cfg.generation.engine == "openai":
            from crl_bench.llm.hf_engine import load_architecture, load_tokenizer
            # a served model generates: the actor here is its tokenizer and, for its config, its
            # architecture on the meta device (no weights; nothing trains: OpenAIEngine.sync_weights)
            model, tokenizer = load_architecture(cfg.model.name), load_tokenizer(cfg.model.name)
        elif model is None:
            from crl_bench.llm.hf_engine import load_model_and_tokenizer
            # trainable weights stay float32 (master weights); compute_dtype is what runs
            model, tokenizer = load_model_and_tokenizer(cfg.model.name, "float32", device=driver_device(cfg))
        self.tokenizer = tokenizer
        # the actor's generation and updates come first; distillation runs in their gaps
        self.gate = ComputeGate(min_gap_s=cfg.experience.distill_min_gap_s)
        self.peaks = PhasePeaks()        # peak resident memory per phase of a step (metrics row)
        self.compute_dtype = DTYPES[resolve_dtype(cfg.model.dtype, next(model.parameters()).device)]
        self.model = self._prepare_model(model)
        self.engine = self._make_engine()
        self.prompts = PromptBuilder(tokenizer, cfg.generation.prefill, cfg.rollout.history,
                                     layout=cfg.rollout.prompt, placement=cfg.experience.placement)
        g = cfg.generation
        self.sampling = SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                       max_new_tokens=g.max_new_tokens)
        self.eval_sampling = SamplingParams(temperature=cfg.eval.temperature, top_p=g.top_p, top_k=g.top_k,
                                            max_new_tokens=g.max_new_tokens)
        self.runner = RolloutRunner(self.engine, self.prompts, self.pool, self.sampling, g.constrained,
                                    max_concurrent=cfg.rollout.max_concurrent,
                                    max_context_tokens=cfg.rollout.max_context_tokens or engine_context(cfg, model))
        # evaluation's own prompts where its protocol gives another layout or history (eval.prompt, eval.history)
        ec = cfg.eval
        self._eval_runner: RolloutRunner | None = None
        if ec.prompt is not None or ec.history is not None:
            prompts = PromptBuilder(tokenizer, cfg.generation.prefill,
                                    cfg.rollout.history if ec.history is None else ec.history,
                                    layout=ec.prompt or cfg.rollout.prompt, placement=cfg.experience.placement)
            self._eval_runner = RolloutRunner(self.engine, prompts, self.pool, self.eval_sampling,
                                             g.constrained, max_concurrent=cfg.rollout.max_concurrent,
                                             max_context_tokens=self.runner.max_context_tokens)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        self.updater = make_updater(
            cfg, self.model, self.optimizer, pad_id=tokenizer.pad_token_id,
            micro_batch_size=cfg.train.micro_batch_size, mini_batches=cfg.train.mini_batches,
            micro_batch_tokens=cfg.train.micro_batch_tokens,
            epochs=cfg.train.ppo_epochs, max_grad_norm=cfg.train.max_grad_norm,
            temperature=logprob_temperature(cfg, g.temperature),
            loss_kwargs={"clip_eps": cfg.train.clip_eps, "kl_coef": cfg.train.kl_coef},
            ref_model=self._reference(), seed=cfg.train.seed, loss_agg=cfg.train.loss_agg,
            recompute_old_logprobs=cfg.train.recompute_old_logprobs, compute_dtype=self.compute_dtype,
            share_prefix=cfg.train.share_prefix, packing=cfg.train.packing,
            scheduler=linear_warmup(self.optimizer, cfg.train.lr_warmup_steps) if cfg.train.lr_warmup_steps else None)
        self.optimizer = self.updater.optimizer     # with workers: its state lives (and is saved) there
        self.internaliser: Any = None
        if self.method.internalises:
            from crl_bench.trainer.internalise import Internaliser

            self.internaliser = Internaliser(cfg, self.updater, self.compute_dtype)
            self.runner.free_prompts = True     # the rollout records each guided prompt without its experience
        self.step = 0
        self.training_state_released = False                # release_training_state: no more steps
        self._next_specs: list[EpisodeSpec] | None = None
        self._prepared: dict[str, Any] | None = None      # the next step's pre-rollout work, when done early
        self.alarms = LearningAlarms(cfg.alarms)           # warnings that the run stopped learning
        self._lesson_probe: Any = None                      # built on first use (eval.lesson_follow)
        self._context_envs: dict[str, Any] = {}             # env id -> an env that grades experience text
        self.experience = None
        if self.method.uses_experience:
            from crl_bench.trainer.experience_track import ExperienceTrack
            self.experience = ExperienceTrack(cfg, self.method, self.model, tokenizer,
                                              writer.dir if writer is not None else None,
                                              embedder=embedder, extractor_model=extractor_model,
                                              extractor_tokenizer=extractor_tokenizer,
                                              actor_engine=self.engine, actor_sampling=self.sampling,
                                              eval_sampling=self.eval_sampling, gate=self.gate,
                                              read_only_bank=read_only_bank, backend=self.backend)
        if cfg.devices.weight_sync == "direct":     # the ranks' weights straight into the vLLM engines
            self.engine.weights_from(self.updater)
            track = self.experience
            if track is not None and track.updater is not None:
                track.engine.weights_from(track.updater)
        self.evaluator = Evaluator(self)           # the eval modes, tasks, panels and protocol of this run
        self.evaluator.check_draws()

    @property
    def eval_runner(self) -> Any:
        """The rollout runner of evaluation: the training runner, or one with the eval prompts where
        ``eval.prompt`` / ``eval.history`` give another layout or history (same engine and envs)."""
        return self._eval_runner if self._eval_runner is not None else self.runner

    # ---- setup ------------------------------------------------------------------------------------
    def _prepare_model(self, model: Any) -> Any:
        mc = self.cfg.model
        if mc.lora:
            from peft import LoraConfig, get_peft_model
            lcfg = LoraConfig(r=mc.lora_r, lora_alpha=mc.lora_alpha, lora_dropout=mc.lora_dropout,
                              target_modules="all-linear", task_type="CAUSAL_LM")
            model = get_peft_model(model, lcfg)
        if mc.gradient_checkpointing:
            # transformers >= 5.2x renamed gradient_checkpointing_enable (still accepted, deprecated)
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if mc.lora and hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
        return model

    def _reference(self) -> Any:
        if self.cfg.train.kl_coef <= 0:
            return None
        if self.cfg.model.lora:
            return self.model.disable_adapter           # the base weights are the reference
        import copy
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _make_engine(self):
        g = self.cfg.generation
        if self.backend is not None:
            if g.engine != "transformers":
                raise ValueError("backend=ray runs the transformers engine in its engine actors; "
                                 "generation.engine=vllm runs with backend=local")
            return self.backend.engine(self.model, self.tokenizer)
        if g.engine == "openai":
            from crl_bench.llm.openai_engine import OpenAIEngine
            return OpenAIEngine(self.tokenizer, g.openai_base_url, g.openai_model, api=g.openai_api,
                                api_key_env=g.openai_api_key_env, concurrency=g.openai_concurrency,
                                retries=g.openai_retries, timeout_s=g.openai_timeout_s)
        if g.engine == "vllm":
            from crl_bench.llm.vllm_engine import VLLMEngine
            return VLLMEngine.from_model(self.model, self.tokenizer, self.cfg.model, gen_cfg=g,
                                         seed=self.cfg.train.seed, gpus=placed(self.cfg.devices.actor_engine))
        from crl_bench.llm.hf_engine import HFEngine
        return HFEngine(self.model, self.tokenizer, batch_size=g.batch_size, prefix_cache=g.prefix_cache,
                        compute_dtype=self.compute_dtype, keep_sequences=self.cfg.rollout.prompt == "multiturn",
                        cache_mb=g.cache_mb, gate=self.gate)

    # ---- one step ---------------------------------------------------------------------------------
    def in_warmup(self, step: int | None = None) -> bool:
        """Whether 0-based step ``step`` (default: the next one) is an experience warm-up step: no
        retrieval, the bank fills (``experience.warmup_steps``, released 5)."""
        step = self.step if step is None else step
        return self.experience is not None and step < self.cfg.experience.warmup_steps

    def trains(self, step: int | None = None) -> bool:
        """Whether 0-based step ``step`` (default: the next one) updates the actor and credits the
        extractor: with experience, from step ``experience.warmup_train_steps`` on (-1: released,
        ``warmup_steps + 1``, so step ``warmup_steps`` retrieves but neither trains nor credits)."""
        step = self.step if step is None else step
        if self.experience is None:
            return True
        exp = self.cfg.experience
        n = exp.warmup_train_steps if exp.warmup_train_steps >= 0 else \
            (exp.warmup_steps + 1 if exp.warmup_steps > 0 else 0)
        return step >= n

    def episode_specs(self, step: int | None = None) -> list[EpisodeSpec]:
        """The episodes of 0-based step ``step`` (default: the next one): ``groups_per_step`` sampled
        tasks x ``group_size`` rollouts each.

        With an experience track, the first ``free_size`` rollouts of a group are experience-free and
        the rest are experience-guided (they retrieve from the bank at episode start, except in
        warm-up steps; with ``experience.integration`` ``turn`` or ``both`` also before every step,
        warm-up included, as released). ``experience.search_tool`` decides which episodes may call
        the search tool (``all``: both subgroups, as released; ``guided``).
        """
        size = self.cfg.train.group_size
        n_free = self.experience.free_size(size) if self.experience is not None else size
        retrieve = not self.in_warmup(step)
        exp = self.cfg.experience
        turns = self.experience is not None and exp.integration in ("turn", "both")
        tool = self.experience is not None and exp.search_tool
        specs = []
        for g, (env_id, task) in enumerate(self.sampler.sample(self.cfg.train.groups_per_step)):
            for k in range(size):
                guided = k >= n_free
                specs.append(EpisodeSpec(env_id, task, group_id=g, subgroup="guided" if guided else "free",
                                         retrieve=guided and retrieve and exp.integration != "turn",
                                         meta={"rollout": k}, turn_retrieve=guided and turns,
                                         tool=tool == "all" or (tool == "guided" and guided)))
        return specs

    def prepare_step(self) -> dict[str, Any]:
        """What happens before the next step's rollout, once: the flush of queued distillation
        (``experience.flush_before_rollout``) and the merge pass (:meth:`ExperienceTrack.before_rollout`).
        The periodic evaluation calls it before it evaluates, so that it sees the bank the next step
        will use, as the released evaluation does.  Returns the metrics it adds to the step's row."""
        if self._prepared is not None:
            return self._prepared
        t0 = time.perf_counter()
        m: dict[str, Any] = {}
        if self.experience is not None:
            if self.cfg.experience.flush_before_rollout:
                self.experience.flush()
            m["time_flush_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            m.update(self.experience.before_rollout(self.step))
            if "merge_pass" in m:
                m["time_merge_s"] = time.perf_counter() - t1
        self._prepared = m
        return m

    def advantages(self, trajs: Sequence[Trajectory]) -> list[float]:
        """Outcome advantages within each (group, subgroup); with ``experience.integration: turn``
        within each group, as released: ``turn_based`` never searches at episode start, so
        ``run_rollout_loop`` (``traj_env_manager.py`` ~216-224) keys every episode ``wo_memory`` and a
        group's G episodes are one advantage group."""
        whole = self.experience is not None and self.cfg.experience.integration == "turn"
        keys = [t.group_id if whole else (t.group_id, t.subgroup) for t in trajs]
        return grouped_advantages([t.reward for t in trajs], keys, self.cfg.train.adv_std_normalize)

    def train_step(self, progress: Any = None) -> StepResult:
        """Collect one batch of groups, update the actor once; returns the step's metrics.

        With an experience track: pending distillation is flushed into the bank first
        (``experience.flush_before_rollout``), and in warm-up steps the actor is not updated.
        Raises ``RuntimeError`` on a trainer built with ``read_only_bank`` (evaluation only).
        """
        if self.experience is not None and self.experience.read_only:
            raise RuntimeError("this trainer evaluates a finished run's bank read-only; it cannot train")
        if self.training_state_released:
            raise RuntimeError("this trainer's optimiser state was released after its last step "
                               "(release_training_state); resume the run from its checkpoint to train on")
        follow = self.lesson_follow()         # the actor that plays this step, before its update
        t0 = time.perf_counter()
        warmup = not self.trains()
        pre = self.prepare_step()
        self._prepared = None
        t_flush = time.perf_counter() - t0
        specs = self._next_specs if self._next_specs is not None else self.episode_specs()
        # the next step's tasks are drawn now (same draws, same order) so that envs with slow resets
        # (ALFWorld) can reset them while this step generates
        self._next_specs = None
        if self.cfg.rollout.prefetch and self.step + 1 < self.cfg.train.steps:
            self._next_specs = self.episode_specs(self.step + 1)
        if self.experience is not None:          # a memory kind without retrieval shows its per-task guidance
            specs = self.experience.place_guidance(specs)
        hooks = self.rollout_hooks(training=True)
        cache0 = dict(getattr(self.engine, "counters", {}))
        with self.peaks.phase("rollout"):
            trajs = self.runner.collect(specs, self.sampling, progress=progress, prefetch=self._next_specs,
                                        **hooks)
        rs = self.runner.last_stats
        cache = {k: v - cache0.get(k, 0) for k, v in getattr(self.engine, "counters", {}).items()}
        t_roll = time.perf_counter() - t0 - t_flush
        advs = self.advantages(trajs)
        layout_counts: dict[str, int] = {}
        samples = episode_samples(trajs, advs, self.cfg.train.sequences, layout_counts)
        t1 = time.perf_counter()
        if warmup:
            upd = {"loss": 0.0, "optimizer_steps": 0.0}          # warm-up: the actor is not trained
        else:
            if samples:
                # the update's weight sync drops the cached prefixes of the old weights anyway; dropping
                # them first keeps them out of the update's resident peak (outputs are unchanged)
                self.clear_actor_prefix_store()
                if hasattr(self.engine, "sleep"):   # vLLM with sleep mode: its GPU memory to the update
                    self.engine.sleep()
            with self.gate.foreground(), self.peaks.phase("update"):
                upd = self.updater.update(samples) if samples else {}
                if self.internaliser is not None:      # released: right after the actor's GRPO update
                    upd = {**upd, **self.internaliser.update(trajs)}
        if upd.get("optimizer_steps") or upd.get("internalise_optimizer_steps"):
            self.engine.sync_weights(self.model)
        t_upd = time.perf_counter() - t1
        self.step += 1
        m = {"step": self.step, **summarise(trajs), **follow}
        if self.experience is not None:
            t2 = time.perf_counter()
            m.update(pre)
            with self.peaks.phase("experience"):
                m.update(self.experience.after_rollout(trajs, self.step, warmup=warmup))
                if self.cfg.experience.wait_distill:
                    self.experience.manager.drain()
                m.update(self.experience.maybe_update_extractor(self.step) or {})
            m.update(self.experience.metrics())
            m["time_experience_s"] = time.perf_counter() - t2
            m["time_retrieve_s"] = rs.retrieve_s
        m.update({
            "adv_abs_mean": float(np.mean(np.abs(advs))) if advs else 0.0,
            "groups_with_signal": sum(1 for g in {t.group_id for t in trajs}
                                      if len({t.reward for t in trajs if t.group_id == g}) > 1),
            **{k: v for k, v in upd.items()},
            **layout_counts,
            "generated_tokens": rs.generated_tokens,
            "tokens_per_s": rs.generated_tokens / rs.generate_s if rs.generate_s > 0 else 0.0,
            "time_rollout_s": t_roll, "time_generate_s": rs.generate_s, "time_env_s": rs.env_s,
            "time_update_s": t_upd, "time_step_s": time.perf_counter() - t0,
            "prefetched_resets": self.pool.prefetch_hits,
        })
        if cache.get("prompt_tokens"):     # transformers engine: prompt tokens it did not have to compute
            prefill = cache["prefill_tokens"] + cache.get("head_tokens", 0)
            m.update(prompt_tokens=cache["prompt_tokens"], prefill_tokens=prefill,
                     prefix_cache_saved=1.0 - prefill / cache["prompt_tokens"])
        rss = [e.worker_rss_mb for e in self.pool.idle_envs() if hasattr(e, "worker_rss_mb")]
        if rss:                       # envs in worker processes (ALFWorld): peak resident memory
            m.update(env_workers=len(rss), env_worker_rss_mb_max=max(rss))
        m.update(self._memory())
        m.update(self.context_metrics(trajs))
        alerts = self.alarms.update(m)      # the complete row; ``alerts`` only on steps that raised one
        if alerts:
            m["alerts"] = alerts
        return StepResult(m, trajs)

    def context_metrics(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        """Experience followed through the loop on envs whose tasks have contexts and whose env can
        grade experience text (the diagnostics: :meth:`~crl_bench.envs.diag.DiagEnv.grade_lesson`):

        * ``retrieval_own_context``: of the step's guided episodes that were shown experience, the
          share whose shown text names their own task's context (retrieval found the right lesson);
        * ``retrieval_other_context``: the share naming another context and not their own;
        * ``shown_correct``: the share whose shown text states their own context's solution;
        * ``bank_correct_lessons``: of the bank's entries of those envs, the share that state some
          context's solution (what the extractor wrote and the merge pass kept).

        ``{}`` for runs without such envs or without a bank.
        """
        if self.experience is None:
            return {}
        graders = {}
        for env_id in self.eval_contexts:
            env = self._context_envs.get(env_id)
            if env is None:
                env = self._context_envs[env_id] = self.pool.make(env_id)
            if callable(getattr(env, "grade_lesson", None)):
                graders[env_id] = env
        if not graders:
            return {}
        own = other = correct = shown = 0
        for t in trajs:
            env = graders.get(t.env_id)
            if env is None or not t.experience_ids or not t.guidance:
                continue
            shown += 1
            grade = env.grade_lesson(t.guidance)
            name = env.context(int(t.task))
            own += name in grade["contexts"]
            other += bool(grade["contexts"]) and name not in grade["contexts"]
            correct += env.grade_lesson(t.guidance, context=name)["correct"]
        out = {}
        if shown:
            out.update(retrieval_own_context=own / shown, retrieval_other_context=other / shown,
                       shown_correct=correct / shown)
        bank = getattr(self.experience, "bank", None)
        entries = [e for env_id in graders for e in bank.entries(env_id)] if bank is not None else []
        if entries:
            out["bank_correct_lessons"] = sum(
                graders[e.env_id].grade_lesson(f"{e.title}: {e.content}")["correct"] for e in entries) / len(entries)
        return out

    def lesson_follow(self) -> dict[str, float]:
        """The actor's ``lesson_follow`` on ``eval.lesson_follow`` probe states of the run's diagnostic
        (``diag-vault`` where the mix holds none; :mod:`crl_bench.trainer.lesson_follow`), with
        ``time_lesson_follow_s``; ``{}`` when off."""
        if not self.cfg.eval.lesson_follow:
            return {}
        from crl_bench.trainer.lesson_follow import LessonFollow, probe_env

        t0 = time.perf_counter()
        if self._lesson_probe is None:
            env_id = probe_env(self.mixture.envs)
            self._lesson_probe = LessonFollow(self.prompts, self.tokenizer, self.cfg.eval.lesson_follow, env_id,
                                              self.cfg.rollout.env_kwargs.get(env_id))
        self.refresh_models()
        with self.gate.foreground():
            out = self._lesson_probe.measure(self.model)
        return {**out, "time_lesson_follow_s": time.perf_counter() - t0}

    def _memory(self) -> dict[str, float]:
        """Free heap pages handed back (:func:`~crl_bench.llm.memory.trim_heap`), then this process's
        resident memory now and at its peak so far (GB): ``rss_gb``, ``peak_rss_gb``, and the peak of
        each phase since the last row (``peak_rss_gb/rollout``, ``/update``, ``/experience``,
        ``/eval``: :class:`~crl_bench.llm.memory.PhasePeaks`), and on a GPU the allocator's peak of each
        phase (``peak_gpu_gb/<phase>``)."""
        trim_heap()
        now = rss_gb()
        return {"peak_rss_gb": round(self.peaks.lifetime_gb, 3), **self.peaks.take(),
                **({"rss_gb": round(now, 3)} if now is not None else {})}

    def rollout_hooks(self, training: bool, guided: bool = True, form: str = "") -> dict[str, Any]:
        """The experience track's callbacks for :meth:`RolloutRunner.collect` (none without a track):
        the episode-start guide, the turn-level guide and the search tool. ``training``: training
        (counters written, the judge samples as in training) or evaluation (``eval.writes_counters``
        decides, the judge samples as in evaluation); ``guided``: evaluation with the bank (a free
        evaluation gets none of them); ``form``: a memory form's control (``raw``, ``condensed``,
        ``both``): only the episode-start guide, showing the guided retrieval in that form
        (:meth:`ExperienceTrack.form_guide`).  Retrieval (query embedding, search, the judge) is the actor's
        work: the guides run as foreground sections of the compute gate, so that no distillation step
        starts while the actor waits for its experience.  The search tool does not (the extractor's
        answer is itself background work the actor waits for)."""
        track = self.experience
        if track is None or not guided:
            return {}
        exp = self.cfg.experience
        writes = training or self.cfg.eval.writes_counters
        gate = self.gate

        def foreground(fn: Any) -> Any:
            def call(requests: Any) -> Any:
                with gate.foreground():
                    return fn(requests)
            return call

        if form:
            return {"guide": foreground(lambda requests: track.form_guide(requests, form))}
        hooks: dict[str, Any] = {"guide": foreground(track.guide if training else track.eval_guide)}
        if exp.integration in ("turn", "both"):
            hooks["turn_guide"] = foreground(lambda requests: track.turn_guide(requests, count_retrievals=writes))
        if exp.search_tool != "off":
            hooks["tool"] = track.search_tool(count_retrievals=writes)
        return hooks

    def save_checkpoint(self, path: str) -> None:
        """The final weights: ``save_pretrained`` of the actor (adapters only with LoRA) and its
        tokenizer into ``path``, and for a method that trains its extractor, the extractor's into
        ``path/extractor`` (loadable with ``--extractor-model``)."""
        self.refresh_models()
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        track = self.experience
        if track is not None and track.updater is not None:
            track.flush()
            with track.manager.updating_extractor():
                track.model.save_pretrained(str(Path(path) / "extractor"))
            track.tokenizer.save_pretrained(str(Path(path) / "extractor"))

    def refresh_models(self) -> None:
        """Bring the driver's actor (and trained extractor) up to their updaters' latest weights before
        something reads them here (:meth:`~crl_bench.trainer.policy.PolicyUpdater.refresh_model`)."""
        self.updater.refresh_model()
        track = self.experience
        if track is not None and track.updater is not None:
            track.updater.refresh_model()

    # ---- resumable state (trainer/checkpoint.py) --------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything of the actor's side a resume needs besides its weights: the step counter, AdamW
        and lr-scheduler state, the update's shuffling generator, the task sampler's generator, the
        next step's episodes if already drawn (``rollout.prefetch``), the global generators and the
        learning alarms' streaks (:class:`~crl_bench.results.alarms.LearningAlarms`)."""
        from crl_bench.trainer.checkpoint import rng_states

        sched = self.updater.scheduler
        return {"step": self.step, "optimizer": self.optimizer.state_dict(),
                "scheduler": sched.state_dict() if sched is not None else None,
                "updater_rng": self.updater.rng.getstate(), "sampler_rng": self.sampler.rng.bit_generator.state,
                "next_specs": self._next_specs, "rng": rng_states(), "prepared": self._prepared,
                "alarms": self.alarms.state_dict(),
                **({"internaliser": self.internaliser.state_dict()} if self.internaliser is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a trainer built for the same run (weights loaded first);
        the engine then samples from the loaded weights."""
        from crl_bench.trainer.checkpoint import CheckpointError, set_rng_states

        sched = self.updater.scheduler
        if (state["scheduler"] is None) != (sched is None):
            raise CheckpointError("checkpoint and run disagree on train.lr_warmup_steps")
        self.step = int(state["step"])
        self.optimizer.load_state_dict(state["optimizer"])
        if sched is not None:
            sched.load_state_dict(state["scheduler"])
        self.updater.rng.setstate(state["updater_rng"])
        self.sampler.rng.bit_generator.state = state["sampler_rng"]
        self._next_specs = state["next_specs"]
        self._prepared = state.get("prepared")
        self.alarms.load_state_dict(state.get("alarms", {}))     # a checkpoint without alarm streaks: start them fresh
        if self.internaliser is not None:
            self.internaliser.load_state_dict(state.get("internaliser", {}))
        self.engine.sync_weights(self.model)
        set_rng_states(state["rng"])

    def release_training_state(self) -> float:
        """Free what only further training needs, once the last step is done: the optimiser state
        (AdamW's two float32 moments per trainable weight) and gradients of the actor and, for a
        method that trains its extractor, of the extractor; then hand the heap's free pages back.
        The final evaluation runs after it with the resident size of an untrained run's (for the
        default 135M models ~1.1 GB per trainable model less; docs/performance.md, "Memory per
        phase").  The resumable checkpoint written at the last step keeps the state on disk.

        Returns the GB freed (the tensors' sizes).  Afterwards :meth:`train_step` raises
        ``RuntimeError``.  With ``train.workers`` > 1 the state lives in the data-parallel workers'
        processes and is left there (it does not count in this process's resident size).
        """
        freed = 0
        optimizers = [self.optimizer]
        if self.experience is not None and self.experience.updater is not None:
            optimizers.append(self.experience.updater.optimizer)
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                continue
            for state in opt.state.values():
                freed += sum(v.numel() * v.element_size() for v in state.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0)
            opt.state.clear()
            opt.zero_grad(set_to_none=True)
        self.training_state_released = True
        trim_heap()
        return freed / 1e9

    def clear_actor_prefix_store(self) -> None:
        """Drop the actor engine's cached prompt prefixes (outputs are unchanged; the next prompts are
        computed in full)."""
        clear = getattr(self.engine, "clear_prefix_cache", None)
        if clear is not None:
            clear()

    def clear_prefix_stores(self) -> None:
        """Drop the cached prompt prefixes of the actor's and the extractor's engines (a checkpoint
        does, so a resumed run and the uninterrupted one continue from the same engine state)."""
        self.clear_actor_prefix_store()
        if self.experience is not None:
            self.experience.manager.clear_caches()

    def close(self) -> None:
        """Stop the experience manager, close the envs, shut the actor's engine down (vLLM) and, with
        Ray, kill the run's actors (the data-parallel workers of ``train.workers`` > 1 too)."""
        if self.experience is not None:
            self.experience.close()
        close_updater = getattr(self.updater, "close", None)
        if close_updater is not None:
            close_updater()
        self.pool.close()
        close_engine = getattr(self.engine, "close", None)      # vLLM's engine core (and its process)
        if close_engine is not None:
            close_engine()
        if self.backend is not None:
            self.backend.close()
