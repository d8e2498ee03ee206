"""The policy updaters' factory: which updater a run trains with, and at which temperature it
computes log-probs.

Both the actor and the extractor are updated by a :class:`~crl_bench.trainer.policy.PolicyUpdater`
(one process) or, with ``train.workers`` > 1, by its data-parallel twin
:class:`~crl_bench.trainer.data_parallel.DataParallelUpdater`; the trainer and the experience track
make theirs here so both follow the same settings.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from crl_bench.config import RunConfig
from crl_bench.trainer.policy import PolicyUpdater


def logprob_temperature(cfg: RunConfig, sampling_temperature: float) -> float:
    """The temperature the trainer divides logits by for log-probs (``train.logprob_temperature``):
    the sampling temperature (1 for greedy sampling), or 1 for ``raw`` (released ROLL)."""
    if cfg.train.logprob_temperature == "raw" or sampling_temperature <= 0:
        return 1.0
    return float(sampling_temperature)


def make_updater(cfg: RunConfig, model: Any, optimizer: torch.optim.Optimizer, role: str = "actor",
                 **kwargs: Any) -> PolicyUpdater:
    """The policy updater of a run: :class:`~crl_bench.trainer.policy.PolicyUpdater` in this process,
    or with ``train.workers`` > 1 a :class:`~crl_bench.trainer.data_parallel.DataParallelUpdater`
    (``train.workers`` Ray actors forming one torch.distributed group, ``train.sharding`` ddp or fsdp,
    the process's torch threads split among them). Both take the same ``kwargs`` (PolicyUpdater's)
    and give the same update; the actor's and the extractor's updater are both made here. ``role``
    (``actor`` or ``extractor``) picks the ranks' GPUs, ``devices.<role>_train``, on a CUDA machine: each rank
    asks Ray for its share of its GPU (half where both updaters list that GPU)."""
    if cfg.train.workers <= 1:
        return PolicyUpdater(model, optimizer, **kwargs)
    import dataclasses

    import ray

    from crl_bench.ray_backend import init_ray
    from crl_bench.trainer.data_parallel import DataParallelUpdater

    threads = max(1, torch.get_num_threads() // cfg.train.workers)
    if not ray.is_initialized():
        # room for the actor's and (complementary) the extractor's workers: Ray's CPUs are logical
        updaters = 2 if cfg.method_spec.trains_extractor else 1
        need = cfg.train.workers * threads * updaters
        init_ray(dataclasses.replace(cfg.ray, num_cpus=cfg.ray.num_cpus or max(os.cpu_count() or 1, need)))
    from crl_bench.config_devices import placed

    d = cfg.devices
    gpus = placed(getattr(d, f"{role}_train"))
    both = set(d.actor_train) & set(d.extractor_train) and cfg.method_spec.trains_extractor
    return DataParallelUpdater(model, optimizer, **kwargs, workers=cfg.train.workers, sharding=cfg.train.sharding,
                               threads=threads, gpus=gpus, gpu_fraction=0.5 if both else 1.0)


