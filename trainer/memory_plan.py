"""GPU memory of a run as its ``devices`` section places the roles, computed from the models' configurations
before anything loads (``crl-bench plan``; checked by ``crl-bench run`` on a CUDA machine before the models load).

What is modelled (docs/scaling.md "GPU memory at the paper's scale" and "Placing the roles on GPUs"):

* **The driver** (the trainer's process), on its GPU 0 unless ``devices.driver: cpu`` keeps it in host memory:
  the actor's float32 master weights, the extractor's where the method loads one, the transformers engines'
  copies of the weights in the compute dtype and their rollout key/value caches.
* **The engines**: a vLLM engine takes ``vllm_gpu_memory_utilization`` of each GPU it runs on
  (``devices.actor_engine`` / ``devices.extractor_engine``, tensor-parallel over them; by default the actor's
  on the driver's GPU, the extractor's on GPU 0), except, with sleep mode (``generation.vllm_sleep``), during
  the actor's update; **vLLM's start-up checks**: an engine is refused when less than its share of the card is
  free when it starts, and when its share, less its slice of the weights and :data:`VLLM_OVERHEAD_GIB`, cannot
  hold its slice of the KV cache of one sequence of its ``max_model_len`` (the model's own context when unset).
  The engines start in this order, after the driver's weights and before the ranks.
* **Updates** with ``train.workers: 1`` run on the driver's device: float32 gradients and AdamW's two
  moments (AdamW's state stays from one step to the next), the checkpointed activations of one micro-batch
  (one bf16 hidden state per layer and token) and the log-prob peak (``crl-bench bench memory``: about
  4 V bytes per kept token, plus one 512-token chunk's float32 transients). With ``train.workers: N > 1``
  each updater's N ranks sit on the GPUs ``devices.actor_train`` / ``devices.extractor_train`` list, or, where
  none is listed, on the lowest GPUs Ray has not given to a rank (Ray does not count the driver's or the
  engines' use of a GPU): a ``ddp`` rank holds the whole 16 bytes per parameter, an ``fsdp`` rank its 1/N
  share plus the root (embeddings and head) whole and, while it sets up, a full float32 replica. Both
  updaters' states stay between their updates, so ranks sharing a GPU hold both in every phase. The
  extractor's micro-batches are bounded by ``train.micro_batch_tokens`` as the actor's are.

Model sizes are counted exactly by instantiating the architecture on the meta device (no weights); a LoRA
checkpoint counts as its base model, and with ``model.lora`` the actor's gradients and AdamW state (the
adapters') are left out.
Figures are GiB; a card's usable memory is ``gpu_memory_gib`` (79.6 for an 80 GB card). What is not
modelled: fragmentation, CUDA contexts (~0.5 GiB a process), NCCL buffers, FSDP's gathered layer in flight,
and the embedder (``experience.embedder_device``; a sentence embedder of a few hundred MiB).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GIB", "ModelShape", "MemoryPlan", "plan_memory", "format_plan", "check_before_loading",
           "micro_batch_peak"]

GIB = 1024 ** 3
#: vLLM's own use of its share beside weights and KV cache (activations of its profiling run, CUDA graphs,
#: sampler buffers), an estimate
VLLM_OVERHEAD_GIB = 3.0
#: bytes per kept token of the update's log-probs, in multiples of V (measured: ``crl-bench bench memory``, law
#: ``logprob``, 3.98 V on CPU), rounded up
LOGPROB_BYTES_PER_TOKEN_PER_V = 4.0


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: counts from its configuration, no weights.

    Attributes:
        name: the model's name as configured.
        params: all parameters (tied embeddings counted once).
        root_params: parameters outside the decoder layers (embeddings, head, final norm): what FSDP2
            keeps unsharded at the root.
        vocab, hidden, layers: from the configuration.
        kv_bytes_per_token: bf16 keys and values of one token over all layers (bytes).
        max_positions: ``max_position_embeddings`` (the model's own context).
    """

    name: str
    params: int
    root_params: int
    vocab: int
    hidden: int
    layers: int
    kv_bytes_per_token: int
    max_positions: int

    @classmethod
    def from_config(cls, config: Any, name: str = "") -> ModelShape:
        """Count a transformers configuration's model on the meta device (nothing allocated)."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        inner = getattr(model, "model", model)
        layer_params = sum(p.numel() for p in inner.layers.parameters())
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        return cls(name=name or getattr(config, "_name_or_path", ""), params=params,
                   root_params=params - layer_params, vocab=int(text.vocab_size), hidden=int(text.hidden_size),
                   layers=int(text.num_hidden_layers), kv_bytes_per_token=2 * int(text.num_hidden_layers) * kv_heads
                   * head_dim * 2, max_positions=int(getattr(text, "max_position_embeddings", 0) or 0))

    @classmethod
    def of(cls, name: str) -> ModelShape:
        """The shape of model ``name`` (a folder, a hub name cached here, or the default model's name).

        Raises:
            ModelNotAvailable: the name cannot be resolved (:func:`crl_bench.llm.default_model.resolve_model`).
        """
        from pathlib import Path

        from transformers import AutoConfig

        from crl_bench.llm.default_model import resolve_model

        path = resolve_model(name)
        if (Path(path) / "adapter_config.json").is_file():     # a LoRA checkpoint: its base model's shape
            from crl_bench.llm.hf_engine import adapter_base_model

            path = resolve_model(adapter_base_model(path))
        return cls.from_config(AutoConfig.from_pretrained(path), name=name)


@dataclass
class MemoryPlan:
    """Per GPU and phase, what it holds: ``gpus[i][phase] = [(label, GiB), ...]``; ``problems``: why the
    layout does not fit (empty when it does), each naming the GPU, the phase and what to change."""

    gpu_gib: float
    gpus: dict[int, dict[str, list[tuple[str, float]]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Whether the layout fits (no problem found)."""
        return not self.problems

    def add(self, gpu: int, phase: str, label: str, gib: float) -> None:
        """Record that ``gpu`` holds ``gib`` GiB of ``label`` during ``phase``."""
        self.gpus.setdefault(gpu, {}).setdefault(phase, []).append((label, gib))

    def total(self, gpu: int, phase: str) -> float:
        """GiB ``gpu`` holds during ``phase`` (0 when nothing is recorded)."""
        return sum(g for _, g in self.gpus.get(gpu, {}).get(phase, []))


def _gib(n: float) -> float:
    return n / GIB


def _engine(plan: MemoryPlan, phases: list[str], who: str, shape: ModelShape, gpus: list[int], util: float,
            max_len: int | None, asleep: tuple[str, ...], card: float) -> None:
    """A vLLM engine on ``gpus`` (tensor-parallel over them), from load on except in the ``asleep`` phases
    (sleep mode), checked the way vLLM checks at start-up on each of its GPUs: its share of the card free, and
    room in its share, less its slice of the weights and :data:`VLLM_OVERHEAD_GIB`, for its slice of one
    sequence's KV cache."""
    n = len(gpus)
    need = util * card
    key = "generation" if who == "actor" else "extractor"
    length = max_len or shape.max_positions
    kv_room = need - _gib(2 * shape.params) / n - VLLM_OVERHEAD_GIB
    kv_need = _gib(shape.kv_bytes_per_token * length) / n
    tp = f", tensor parallel {n}" if n > 1 else ""
    for gpu in gpus:
        free = card - plan.total(gpu, "load")
        if free < need:
            have = f"{free:.1f} GiB is" if free > 0 else f"none is ({card - free:.1f} GiB of {card:.1f} in use)"
            plan.problems.append(f"GPU {gpu}, load: the {who}'s vLLM engine wants {need:.1f} GiB ({util:g} of the "
                                 f"card) free and {have}: vLLM refuses to start (lower {key}.vllm_gpu_memory_"
                                 f"utilization, or give it GPUs of its own: devices.{who}_engine)")
        if kv_room < kv_need:
            plan.problems.append(f"GPU {gpu}, load: the {who}'s vLLM engine has {max(kv_room, 0):.1f} GiB for KV "
                                 f"cache and its part of one sequence of {length:,} tokens needs {kv_need:.1f} GiB: "
                                 f"vLLM refuses to start (set {key}.vllm_max_model_len lower, or raise its memory "
                                 "share)")
        for ph in phases:
            if ph not in asleep:
                plan.add(gpu, ph, f"{who} vLLM engine ({util:g} of the card{tp})", need)


def micro_batch_peak(shape: ModelShape, micro_tokens: int) -> tuple[float, float]:
    """(checkpointed activations, log-prob peak) of one micro-batch of ``micro_tokens`` tokens, GiB."""
    from crl_bench.trainer.losses import LOGPROB_CHUNK_TOKENS

    act = _gib(shape.layers * shape.hidden * 2 * micro_tokens)
    logprob = _gib(LOGPROB_BYTES_PER_TOKEN_PER_V * shape.vocab * micro_tokens
                   + 3 * 4 * LOGPROB_CHUNK_TOKENS * shape.vocab)        # one chunk's float32 transients
    return act, logprob


def _check_indices(plan: MemoryPlan, cfg: Any, gpus: int, extractor: bool) -> None:
    """A problem for every GPU index ``cfg.devices`` gives a role of this run (the extractor's where the method
    loads one, the ranks' where ``train.workers`` > 1) that the machine of ``gpus`` GPUs does not have."""
    devices = cfg.devices
    keys = ["actor_engine"] + (["extractor_engine"] if extractor else [])
    if cfg.train.workers > 1:
        keys += ["actor_train"] + (["extractor_train"] if extractor and cfg.method_spec.trains_extractor else [])
    for key in keys:
        bad = [g for g in getattr(devices, key) if g >= gpus]
        if bad:
            plan.problems.append(f"devices.{key} names GPU {bad[0]} and the machine has {gpus} (0 to {gpus - 1})")


def plan_memory(cfg: Any, gpus: int, gpu_gib: float, actor: ModelShape,
                extractor: ModelShape | None = None) -> MemoryPlan:
    """The memory of ``cfg``'s run on ``gpus`` cards of ``gpu_gib`` GiB as ``cfg.devices`` places its roles
    (module docstring). ``extractor``: the extractor model's shape where the method loads one (``None``: none).

    Raises:
        ValueError: ``gpus < 1`` or ``gpu_gib <= 0``.
    """
    if gpus < 1 or gpu_gib <= 0:
        raise ValueError(f"a plan needs at least one GPU and positive memory, got {gpus} x {gpu_gib} GiB")
    plan = MemoryPlan(gpu_gib)
    g, x, t, d = cfg.generation, cfg.extractor, cfg.train, cfg.devices
    _check_indices(plan, cfg, gpus, extractor is not None)
    if plan.problems:
        return plan
    bf16 = cfg.model.dtype != "float32"         # auto is bf16 on a GPU with bf16 (every card of this scale)
    trains_x = extractor is not None and cfg.method_spec.trains_extractor
    direct = d.weight_sync == "direct" and t.workers > 1   # each update ends with a sync over the weight channel
    phases = ["load", "rollout", "actor update"] + (["actor sync"] if direct else [])
    if trains_x:
        phases += ["extractor update"] + (["extractor sync"] if direct else [])
    steady = phases[1:]                 # what stays from one step to the next (optimizer states)
    driver = 0 if d.driver == "cuda" else None          # the driver's GPU; None: host memory
    # the driver: the models' float32 master weights, from load on
    if driver is not None:
        for ph in phases:
            plan.add(driver, ph, "actor float32 weights", _gib(4 * actor.params))
            if extractor is not None:
                plan.add(driver, ph, "extractor float32 weights", _gib(4 * extractor.params))
    # the engines, in the order they start: the actor's, then the extractor's
    engines = [("actor", actor, g.engine, d.actor_engine or [driver or 0], g.vllm_gpu_memory_utilization,
                g.vllm_max_model_len, ("actor update",) if g.vllm_sleep else ())]
    if extractor is not None:
        engines.append(("extractor", extractor, x.engine, d.extractor_engine or [0],
                        x.vllm_gpu_memory_utilization or g.vllm_gpu_memory_utilization, x.vllm_max_model_len, ()))
    for who, shape, kind, on, util, max_len, asleep in engines:
        if kind == "vllm":
            _engine(plan, phases, who, shape, on, util, max_len, asleep, gpu_gib)
        elif bf16 and driver is not None:
            for ph in phases:
                plan.add(driver, ph, f"{who} engine weights (bf16 copy)", _gib(2 * shape.params))
    # the rollout: a transformers engine's key/value cache of a full batch at the longest context (vLLM's is
    # inside its share) and its prefix store; the extractor distils beside it
    context = cfg.rollout.max_context_tokens or actor.max_positions
    if g.engine != "vllm" and driver is not None:
        plan.add(driver, "rollout", f"actor decode KV ({g.batch_size} rows x {context:,} tokens, bf16)",
                 _gib(actor.kv_bytes_per_token * g.batch_size * context))
        plan.add(driver, "rollout", "actor prefix store (generation.cache_mb)", g.cache_mb / 1024)
    if extractor is not None and x.engine != "vllm" and driver is not None:
        plan.add(driver, "rollout", f"extractor decode KV ({g.batch_size} rows x "
                 f"{x.max_prompt_tokens + x.max_new_tokens:,} tokens, bf16)",
                 _gib(extractor.kv_bytes_per_token * g.batch_size * (x.max_prompt_tokens + x.max_new_tokens)))
    # the updates
    micro = t.micro_batch_tokens or t.micro_batch_size * (cfg.rollout.max_context_tokens or actor.max_positions)
    x_seq = x.max_prompt_tokens + x.max_new_tokens       # the extractor's updater takes the same token bound
    x_micro = x.micro_batch_size * x_seq if not t.micro_batch_tokens else \
        min(x.micro_batch_size * x_seq, max(t.micro_batch_tokens, x_seq))
    updates = [("actor update", "actor", actor, micro, d.actor_train)]
    if trains_x:
        updates.append(("extractor update", "extractor", extractor, x_micro, d.extractor_train))
    if t.workers <= 1:
        for phase, who, shape, tokens, _ in updates:
            act, lp = micro_batch_peak(shape, tokens)
            if not (who == "actor" and cfg.model.lora):   # LoRA: the adapters' states, a few MiB, not counted
                plan.add(driver or 0, phase, f"{who} gradients (float32)", _gib(4 * shape.params))
                for ph in steady:                         # AdamW's moments stay from the first update on
                    plan.add(driver or 0, ph, f"{who} AdamW moments", _gib(8 * shape.params))
            plan.add(driver or 0, phase, f"{who} activations ({tokens:,} tokens, checkpointed)", act)
            plan.add(driver or 0, phase, f"{who} log-probs ({tokens:,} tokens)", lp)
    else:
        _rank_updates(plan, cfg, updates, gpus, phases, steady)
    if direct:
        for _, who, shape, _, _ in updates:
            on = (d.actor_engine or [driver or 0]) if who == "actor" else (d.extractor_engine or [0])
            for gpu in on:      # every tensor-parallel worker receives each whole tensor, then keeps its slice
                plan.add(gpu, f"{who} sync", f"{who} weight arriving (largest tensor, bf16)", _largest(shape, 2))
    for gpu, by_phase in sorted(plan.gpus.items()):
        for phase in by_phase:
            total = plan.total(gpu, phase)
            if total > gpu_gib:
                top = max(by_phase[phase], key=lambda item: item[1])
                plan.problems.append(f"GPU {gpu}, {phase}: {total:.1f} GiB > {gpu_gib:.1f} GiB (largest: {top[0]}, "
                                     f"{top[1]:.1f} GiB)")
    return plan


def _rank_updates(plan: MemoryPlan, cfg: Any, updates: list[tuple[str, str, ModelShape, int, list[int]]],
                  gpus: int, phases: list[str], steady: list[str]) -> None:
    """The data-parallel ranks of each updater (``train.workers`` each) on the GPUs ``devices`` lists, or, where
    it lists none, on the lowest GPUs Ray has not given to a rank yet (Ray does not count the driver's or the
    engines' use of a GPU)."""
    t = cfg.train
    n = t.workers
    taken = {gpu for *_, listed in updates for gpu in listed}
    for phase, who, shape, tokens, listed in updates:
        on = list(listed)
        if not on:
            free = [gpu for gpu in range(gpus) if gpu not in taken]
            if len(free) < n:
                plan.problems.append(f"the {who}'s updater asks Ray for {n} GPUs and {len(free)} are left of {gpus} "
                                     f"(each updater takes train.workers={n}): it cannot start (lower train.workers, "
                                     f"or place the ranks: devices.{who}_train)")
                continue
            on = free[:n]
            taken.update(on)
        act, lp = micro_batch_peak(shape, tokens)
        for gpu in on:
            if t.sharding == "fsdp":
                plan.add(gpu, "load", f"{who} rank setup (full float32 replica before sharding)",
                         _gib(4 * shape.params))
                states = _gib(16 * (shape.params - shape.root_params) / n + 16 * shape.root_params)
                label = f"{who} rank states (16 B/param, 1/{n} sharded, root whole)"
            else:
                states = _gib(16 * shape.params)
                label = f"{who} rank states (16 B/param, ddp replica)"
            for ph in steady:
                plan.add(gpu, ph, label, states)
            plan.add(gpu, phase, f"{who} rank activations ({tokens:,} tokens)", act)
            plan.add(gpu, phase, f"{who} rank log-probs ({tokens:,} tokens)", lp)
            if f"{who} sync" in phases:     # each rank gathers a whole tensor at a time; rank 0 also casts it
                plan.add(gpu, f"{who} sync", f"{who} tensor gathered for the engine (largest, float32 + bf16)",
                         _largest(shape, 6))


def _largest(shape: ModelShape, bytes_per_param: int) -> float:
    """GiB of the model's largest tensor (the embedding or output head, vocabulary x hidden) at ``bytes_per_param``."""
    return _gib(bytes_per_param * shape.vocab * shape.hidden)


def format_plan(plan: MemoryPlan) -> str:
    """The plan as text: per GPU and phase (consecutive GPUs holding the same shown once), each item and the total
    against the card, then the verdict."""
    lines = []
    groups: list[list[int]] = []          # consecutive GPUs that hold the same, shown once
    for gpu in sorted(plan.gpus):
        if groups and groups[-1][-1] == gpu - 1 and plan.gpus[groups[-1][0]] == plan.gpus[gpu]:
            groups[-1].append(gpu)
        else:
            groups.append([gpu])
    for group in groups:
        name = f"GPU {group[0]}" if len(group) == 1 else f"GPUs {group[0]}-{group[-1]} (each)"
        for phase, items in plan.gpus[group[0]].items():
            total = plan.total(group[0], phase)
            mark = "" if total <= plan.gpu_gib else "  OVER"
            lines.append(f"{name}, {phase}: {total:.1f} / {plan.gpu_gib:.1f} GiB{mark}")
            lines += [f"    {gib:7.1f}  {label}" for label, gib in items]
    if plan.fits:
        lines.append("fits")
    else:
        lines.append("does not fit:")
        lines += [f"  - {p}" for p in plan.problems]
    return "\n".join(lines)


def shapes_for(cfg: Any) -> tuple[ModelShape, ModelShape | None]:
    """The actor's and (where the method loads one) the extractor's shape, from their configurations."""
    from crl_bench.experience.memory import get_memory

    actor = ModelShape.of(cfg.model.name)
    spec = cfg.method_spec
    loads = spec.uses_experience and get_memory(spec.memory).uses_extractor
    if not loads:
        return actor, None
    if cfg.extractor.model == "same":
        return actor, dataclasses.replace(actor, name=f"{actor.name} (copy)")
    return actor, ModelShape.of(cfg.extractor.model)


def check_before_loading(cfg: Any) -> MemoryPlan | None:
    """On a machine with CUDA, the plan of ``cfg``'s run on this machine's GPUs (count and the smallest
    card's memory); ``None`` without CUDA (CPU runs are not planned).

    Raises:
        ConfigError: the run does not fit, with the plan's problems.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    from crl_bench.config import ConfigError

    n = torch.cuda.device_count()
    gib = min(torch.cuda.get_device_properties(i).total_memory for i in range(n)) / GIB
    plan = plan_memory(cfg, n, gib, *shapes_for(cfg))
    if not plan.fits:
        raise ConfigError("this run does not fit this machine's GPUs (crl-bench plan prints the whole budget):\n"
                          + "\n".join(f"  - {p}" for p in plan.problems))
    return plan
