"""Where a data-parallel updater's ranks run: on the GPUs ``devices.actor_train`` / ``devices.extractor_train``
list (one per rank, in rank order), reserved in a Ray placement group, or where Ray puts them.

With a list, each rank's Ray actor sits in its own bundle of one placement group (``STRICT_PACK``: one
node, the driver's, which is where the indices mean anything) that declares the rank's CPUs and its share
of a GPU, so Ray gives those GPUs to no other actor beyond their shares; Ray is told not to set the
rank's ``CUDA_VISIBLE_DEVICES`` (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``) and the rank puts itself
on its listed GPU (``cuda:N``, N as the driver numbers its GPUs, which the rank inherits). verl and ROLL
place their colocated workers the same way (their ``RAY_EXPERIMENTAL_NOSET_*`` settings and placement
groups of one GPU per bundle). Without a list, each rank asks Ray for one whole GPU and Ray picks it
(Ray does not count what the driver or an engine holds on a GPU: ``crl-bench plan`` shows where that
lands).

Without a list, :func:`wait_for_resources` waits for the CPUs and GPUs the ranks ask for (or says at once
that the cluster has too few).

Sources: Ray docs "Placement Groups" (``placement_group``, ``PlacementGroupSchedulingStrategy``) and
"Accelerator support" (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from crl_bench.config_devices import distinct_gpus

__all__ = ["NOSET_VISIBLE_DEVICES", "RankPlacement", "rank_placement", "release", "reserve", "scheduling",
           "wait_for_resources"]

#: the Ray setting that leaves an actor's ``CUDA_VISIBLE_DEVICES`` as its node's
#: (ray/_private/accelerators/nvidia_gpu.py)
NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
#: seconds to wait for Ray to reserve a placement group before giving up
RESERVE_TIMEOUT_S = 60.0


@dataclass
class RankPlacement:
    """The Ray options and devices of an updater's ranks.

    Attributes:
        options: keyword arguments of ``ray.remote(TrainWorker).options(...)`` for every rank (CPUs, GPUs, and
            with listed GPUs the runtime environment that keeps Ray off ``CUDA_VISIBLE_DEVICES``).
        gpus: each rank's GPU index as the driver numbers them, or ``None`` per rank where Ray picks (rank order).
        bundles: the placement group's bundles (one per rank), or ``[]`` without listed GPUs.
    """

    options: dict[str, Any]
    gpus: list[int | None]
    bundles: list[dict[str, float]] = field(default_factory=list)


def rank_placement(workers: int, cpus: float, cuda: bool, gpus: Sequence[int] | None = None,
                   gpu_fraction: float = 1.0) -> RankPlacement:
    """The placement of ``workers`` ranks of ``cpus`` Ray CPUs each: on ``gpus`` (one per rank; each rank
    declaring ``gpu_fraction`` of its GPU, e.g. 0.5 where the actor's and the extractor's ranks share GPUs),
    or, with ``gpus`` ``None`` or without CUDA, one whole GPU each that Ray picks (none without CUDA).

    Raises:
        ValueError: ``gpus`` not of length ``workers``, repeated or negative, or ``gpu_fraction`` outside (0, 1].
    """
    if not 0 < gpu_fraction <= 1:
        raise ValueError(f"gpu_fraction must be in (0, 1], got {gpu_fraction!r}")
    if not cuda or not gpus:
        return RankPlacement({"num_cpus": cpus, "num_gpus": 1 if cuda else 0}, [None] * workers)
    gpus = [int(g) for g in gpus]
    if len(gpus) != workers or not distinct_gpus(gpus):
        raise ValueError(f"one distinct GPU per rank: {workers} ranks and GPUs {gpus}")
    return RankPlacement({"num_cpus": cpus, "num_gpus": gpu_fraction,
                          "runtime_env": {"env_vars": {NOSET_VISIBLE_DEVICES: "1"}}},
                         list(gpus), [{"CPU": cpus, "GPU": gpu_fraction} for _ in gpus])


def reserve(placement: RankPlacement, timeout_s: float = RESERVE_TIMEOUT_S) -> Any:
    """Reserve ``placement``'s bundles as one Ray placement group (``STRICT_PACK``); ``None`` without bundles.

    Raises:
        RuntimeError: Ray cannot reserve them within ``timeout_s`` (the cluster lacks the CPUs or GPU shares,
            or other actors hold them); the group is removed.
    """
    if not placement.bundles:
        return None
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(placement.bundles, strategy="STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except Exception as e:      # noqa: BLE001 - GetTimeoutError and Ray's scheduling errors alike
        remove_placement_group(group)
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise RuntimeError(f"Ray could not reserve the data-parallel ranks' resources {placement.bundles[0]} x "
                           f"{len(placement.bundles)} on one node within {timeout_s:g} s (free: {free}; other "
                           f"actors may hold them): {type(e).__name__}") from None
    return group


def scheduling(group: Any, rank: int) -> dict[str, Any]:
    """The ``.options(...)`` that put rank ``rank`` into its bundle of ``group`` (``{}`` without a group)."""
    if group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)}


def release(group: Any) -> None:
    """Remove a placement group :func:`reserve` made (``None``: nothing)."""
    if group is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)


def wait_for_resources(need: dict[str, float], wait_s: float) -> None:
    """Return once the Ray cluster has ``need`` (e.g. ``{"CPU": 2.0, "GPU": 0.0}``) free.

    Ray releases a killed actor's CPUs a moment after ``ray.kill`` returns, so an updater built right
    after another one closed may briefly see them held: free resources are polled for up to ``wait_s``
    seconds. A cluster whose *total* is below ``need`` could never place the workers (Ray would wait
    forever), so that is an error at once.

    Raises:
        RuntimeError: the cluster's total is short of ``need``, or ``need`` is not free after ``wait_s``
            (other actors hold it); the message names each resource, needed and free.
    """
    import ray

    from crl_bench.ray_backend import short_resources

    def fail(missing: dict[str, tuple[float, float]], what: str, hint: str) -> RuntimeError:
        return RuntimeError("not enough free Ray resources for the data-parallel workers: "
                            + ", ".join(f"{k} needs {v:g}, {f:g} {what}" for k, (v, f) in missing.items())
                            + f" ({hint})")

    missing = short_resources(need, ray.cluster_resources())
    if missing:
        raise fail(missing, "in the cluster",
                   "start Ray with more num_cpus, or pass num_cpus= a fraction per worker")
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        missing = short_resources(need, ray.available_resources())
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise fail(missing, f"free after waiting {wait_s:g} s",
                       "other actors hold them; close them, or pass num_cpus= a fraction per worker")
        time.sleep(0.2)
