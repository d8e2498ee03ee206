"""Where each role of a run lives on a CUDA machine (``devices``): the section's dataclass and its rules,
split from :mod:`crl_bench.config`, which re-exports it and validates it with the rest
(docs/configuration.md, docs/scaling.md "Placing the roles on GPUs").

A GPU is named by its index as the trainer's process sees it (``cuda:N`` there: the N-th entry of
``CUDA_VISIBLE_DEVICES`` when that is set, else the N-th GPU of the machine). The roles:

* **the driver** (the trainer's process): the actor's float32 master weights, the extractor's where the
  method loads one, the transformers engines and in-process vLLM engine, and one-process updates; on its
  GPU 0 (``cuda``) or, with ``driver: cpu``, in host memory (every GPU computation then happens in the
  engines and the data-parallel ranks below);
* **the engines**: the actor's and the extractor's vLLM engine, each on a list of GPUs (tensor-parallel
  over them, vLLM's ``tensor_parallel_size``); an empty list keeps today's places (the actor's engine in
  the driver's process on its device, the extractor's in its own process on GPU 0);
* **the update ranks**: the actor's and the extractor's data-parallel ranks (``train.workers`` each), one
  GPU per rank in rank order; an empty list lets Ray pick (Ray does not count the driver's use of GPU 0).

The released run maps its roles the same way (ROLL's ``device_mapping``: actor training and inference on
GPUs 0-7, the extractor's vLLM on 8-15, tensor parallel 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from crl_bench.config_schema import ConfigError

__all__ = ["DevicesConfig", "DriverDevice", "WeightSync", "distinct_gpus", "driver_device", "placed",
           "validate_devices"]

DriverDevice = Literal["cuda", "cpu"]
"""Values of ``devices.driver``: where the trainer's process keeps its models."""

WeightSync = Literal["host", "direct"]
"""Values of ``devices.weight_sync``: how trained weights reach the vLLM engines."""


@dataclass
class DevicesConfig:
    """Which GPUs each role uses on a CUDA machine (module docstring); ignored by a run without CUDA.
    ``crl-bench plan`` prints the memory of a layout per GPU and phase, and ``crl-bench run`` refuses one
    that does not fit before it loads anything."""

    driver: DriverDevice = "cuda"
    """Where the trainer's process keeps the actor's (and extractor's) float32 master weights: ``cuda`` (its GPU 0)
    or ``cpu`` (host memory; needs vLLM engines on their own GPUs and ``train.workers`` > 1, so that no model
    computes in the driver)."""
    actor_engine: list[int] = field(default_factory=list)
    """GPUs of the actor's vLLM engine, tensor-parallel over them; ``[]`` (default): in the driver's process, on
    its device. Given, the engine runs in its own process on exactly these GPUs."""
    extractor_engine: list[int] = field(default_factory=list)
    """GPUs of the extractor's vLLM engine (its own process), tensor-parallel over them; ``[]`` (default): GPU 0."""
    actor_train: list[int] = field(default_factory=list)
    """GPUs of the actor's data-parallel ranks, one per rank (``train.workers`` of them); ``[]`` (default): Ray
    picks."""
    extractor_train: list[int] = field(default_factory=list)
    """GPUs of the extractor's data-parallel ranks, one per rank (``train.workers`` of them); ``[]`` (default): Ray
    picks."""
    weight_sync: WeightSync = "host"
    """How trained weights reach the vLLM engines after an update: ``host`` (the ranks' weights into the driver's
    model, then from there into the engine) or ``direct`` (rank 0 broadcasts each tensor to the engine's workers
    over a process group of their own, NCCL on GPUs and gloo on the CPU; the driver's model is refreshed only for
    checkpoints and the final weights: crl_bench/llm/weight_channel.py). ``direct`` needs data-parallel updates
    (``train.workers`` > 1), vLLM engines for every model that trains, no LoRA, and each updater's rank 0 on a GPU
    its engine does not use (NCCL connects no two processes on one GPU)."""


def distinct_gpus(gpus: Any) -> bool:
    """Whether ``gpus`` is a list of GPU indices each >= 0 and named once (what every GPU list here must be)."""
    gpus = list(gpus)
    return all(isinstance(g, int) and g >= 0 for g in gpus) and len(set(gpus)) == len(gpus)


def validate_devices(cfg: Any) -> None:
    """The ``devices`` rules the types do not state, against the rest of the run's configuration ``cfg``.

    Raises:
        ConfigError: a negative or repeated GPU in a list, a rank list whose length is not ``train.workers``
            (or given with ``train.workers`` 1), an engine list for an engine that is not vLLM (or under the
            Ray backend), ``driver: cpu`` where a model would compute in the driver, or ``weight_sync: direct``
            without data-parallel updates into vLLM engines; each names its keys.
    """
    d = cfg.devices
    for key in ("actor_engine", "extractor_engine", "actor_train", "extractor_train"):
        gpus = getattr(d, key)
        if not distinct_gpus(gpus):
            raise ConfigError(f"invalid value for devices.{key}: {gpus!r} (GPU indices >= 0, each at most once)")
    for key in ("actor_train", "extractor_train"):
        gpus = getattr(d, key)
        if gpus and len(gpus) != cfg.train.workers:
            raise ConfigError(f"devices.{key} names {len(gpus)} GPU(s) and train.workers is {cfg.train.workers}: "
                              "one GPU per data-parallel rank")
    if d.actor_engine and (cfg.generation.engine != "vllm" or cfg.backend != "local"):
        raise ConfigError("devices.actor_engine places the actor's vLLM engine: it needs generation.engine=vllm "
                          "and backend=local")
    if d.extractor_engine and cfg.extractor.engine != "vllm":
        raise ConfigError("devices.extractor_engine places the extractor's vLLM engine: it needs "
                          "extractor.engine=vllm")
    if d.weight_sync == "direct":
        _check_direct(cfg)
    if d.driver == "cpu":
        if cfg.train.workers <= 1:
            raise ConfigError("devices.driver=cpu keeps the driver's models in host memory: the updates must run on "
                              "data-parallel ranks (train.workers > 1)")
        if not d.actor_engine:
            raise ConfigError("devices.driver=cpu keeps the driver's models in host memory: the actor's engine "
                              "needs its own GPUs (generation.engine=vllm and devices.actor_engine)")
        from crl_bench.experience.memory import get_memory
        from crl_bench.methods import list_methods

        spec = cfg.method_spec if cfg.method in list_methods() else None    # a plugin's method may load later
        if spec is not None and spec.uses_experience and get_memory(spec.memory).uses_extractor \
                and cfg.extractor.engine != "vllm":
            raise ConfigError("devices.driver=cpu keeps the extractor in host memory, where the transformers "
                              "engine would generate on the CPU: set extractor.engine=vllm")


def _check_direct(cfg: Any) -> None:
    """``devices.weight_sync: direct``'s rules: the weights leave data-parallel ranks for vLLM engines."""
    why = None
    if cfg.train.workers <= 1:
        why = "the weights leave data-parallel ranks: set train.workers > 1"
    elif cfg.generation.engine != "vllm" or cfg.backend != "local":
        why = "a vLLM engine receives them: set generation.engine=vllm and backend=local"
    elif cfg.model.lora:
        why = "vLLM serves merged weights, not adapters: set model.lora=false"
    elif cfg.method in _methods():
        spec = cfg.method_spec
        if spec.internalises:
            why = (f"method {cfg.method!r} fine-tunes the driver's copy of the actor besides its ranks: "
                   "use devices.weight_sync=host")
        elif spec.trains_extractor and cfg.extractor.engine != "vllm":
            why = "the trained extractor's engine receives its weights the same way: set extractor.engine=vllm"
    d = cfg.devices
    for role in ("actor", "extractor"):
        train, engine = getattr(d, f"{role}_train"), getattr(d, f"{role}_engine")
        if why is None and train and train[0] in engine:
            why = (f"rank 0 of devices.{role}_train sends over NCCL, which cannot connect two processes on one GPU, "
                   f"and GPU {train[0]} is also in devices.{role}_engine: put rank 0 on another GPU or use "
                   "devices.weight_sync=host")
    if why is not None:
        raise ConfigError(f"devices.weight_sync=direct: {why}")


def _methods() -> list[str]:
    from crl_bench.methods import list_methods

    return list_methods()


def placed(gpus: list[int]) -> list[int] | None:
    """``gpus`` where this process has CUDA and the list is not empty, else ``None`` (the role's default place):
    a layout of GPUs means nothing to a run on the CPU."""
    if not gpus:
        return None
    import torch

    return list(gpus) if torch.cuda.is_available() else None


def driver_device(cfg: Any) -> str | None:
    """The device the trainer's process loads its models on: ``"cpu"`` with ``devices.driver: cpu``, else ``None``
    (CUDA where available, else the CPU: :func:`crl_bench.llm.hf_engine.load_model_and_tokenizer`)."""
    return "cpu" if cfg.devices.driver == "cpu" else None
