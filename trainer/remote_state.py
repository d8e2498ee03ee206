"""The driver's stand-ins for the data-parallel ranks' optimiser and lr scheduler
(:class:`~crl_bench.trainer.data_parallel.DataParallelUpdater`): ``state_dict()`` / ``load_state_dict()`` reach
the ranks' own objects, so checkpoints and resumes treat a data-parallel updater like a one-process one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LambdaFactory", "RemoteOptimizer", "RemoteScheduler"]


class RemoteOptimizer:
    """Driver-side stand-in for the workers' optimiser: ``state_dict()`` / ``load_state_dict()`` reach
    the workers; ``param_groups`` is a snapshot (``lr`` as of the last update).

    ``load_state_dict`` first copies the driver model's trainable parameters to every worker
    (:meth:`DataParallelUpdater.push_weights`): a resume loads the weights into the driver's model and
    then the optimiser state (trainer/checkpoint.py ``load_checkpoint``), so the replicas follow."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [{"lr": self._owner.lr_now}]

    def state_dict(self) -> dict[str, Any]:
        return self._owner.call_rank0("optimizer_state")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._owner.push_weights()
        self._owner.lr_now = self._owner.call_full_state("load_optimizer_state", state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op (the workers zero their gradients)."""


class RemoteScheduler:
    """Driver-side stand-in for the workers' lr scheduler (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner

    def state_dict(self) -> dict[str, Any]:
        return self._owner.call_rank0("scheduler_state")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._owner.lr_now = self._owner.call_rank0("load_scheduler_state", state)


@dataclass
class LambdaFactory:
    """Picklable ``optimizer -> LambdaLR(optimizer, lr_lambdas)`` (the lambdas are shipped by Ray's
    cloudpickle)."""

    lr_lambdas: list[Callable[[int], float]]

    def __call__(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_lambdas)
