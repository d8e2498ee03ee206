"""Data-parallel policy updates: ``train.workers=N`` Ray actors forming one ``torch.distributed`` group.

:class:`DataParallelUpdater` is a drop-in for :class:`~crl_bench.trainer.policy.PolicyUpdater` (same
constructor arguments, same ``update(samples) -> stats`` contract and keys) that runs the update on
``workers`` :class:`TrainWorker` Ray actors.  Each actor holds a replica of the model (shipped once from
the driver through the Ray object store) wrapped in PyTorch's own data parallelism: ``sharding="ddp"``
(:class:`torch.nn.parallel.DistributedDataParallel`, a full replica per worker) or ``sharding="fsdp"``
(FSDP2 :func:`torch.distributed.fsdp.fully_shard` on every transformer block and the root; parameters,
gradients and optimiser state sharded).  The actors form one process group (``gloo`` on CPU, ``nccl``
with CUDA; rank 0's address is ``ray.util.get_node_ip_address()`` and a free port it picks).

**Same math as one process.** The driver plans the update exactly as ``PolicyUpdater.update`` does (its
shuffling generator, sequences kept together, one optimiser step per mini-batch, the token weights of
:func:`~crl_bench.trainer.policy.token_weights` over the whole mini-batch chunk, micro-batches of
``micro_batch_size`` (and ``micro_batch_tokens``) after the prompt sort of the shared-prefix path).
Micro-batch ``p`` of a step goes to rank ``p % workers``; each rank back-propagates its micro-batches'
partial sums (token weights already global) and the gradients are **summed** over ranks: DDP's default
hook averages, so a communication hook (:func:`allreduce_sum_hook`) all-reduces with ``ReduceOp.SUM`` and
no division; FSDP2 is told ``set_gradient_divide_factor(1.0)`` with
``set_force_sum_reduction_for_comms(True)`` (gloo has no ``PREMUL_SUM``) on every sharded module.  Then
the global-norm clip over the full gradient (``clip_grad_norm_``, which FSDP2's DTensors reduce across
shards) and one optimiser step on every rank.  Every micro-batch's loss statistics come back to the
driver, which adds them up in the single-process order, so ``loss``, ``clip_frac``, ``trained_tokens``,
``grad_norm`` ... equal the single-process values (to float rounding of the gradient sum order).

**Collectives in step.** DDP: every rank accumulates its micro-batches under ``no_sync`` and syncs on
its last one, so each rank joins exactly one all-reduce per step; a rank with no micro-batch in a step
back-propagates one zero-weight dummy sample (a 1-token response whose loss weight is 0, so its gradient
is exactly 0).  FSDP2 all-gathers parameters in every forward, so ranks run in rounds: in round ``r``
rank ``k`` runs micro-batch ``r * workers + k`` or the dummy, and every round reduce-scatters (sharded
gradients accumulate); for the same reason the shared-prefix forward (two forwards per micro-batch)
is off with FSDP (same gradient, float rounding aside; ``shared_prefix_tokens`` is then 0).  The
recomputation of the old log-probs (``recompute_old_logprobs`` with several optimiser steps) is split
the same way and its results all-gathered.

**Weights back.** After an update with optimiser steps, rank 0 returns the trainable parameters (FSDP:
the full state dict from ``torch.distributed.checkpoint.state_dict.get_model_state_dict``), which are
copied into the driver's model in place, so ``engine.sync_weights(model)`` and checkpoints of the
driver's model work unchanged.  With ``weights_to_driver`` false (set by
:meth:`~crl_bench.llm.vllm_engine.VLLMEngine.weights_from` under ``devices.weight_sync: direct``) the weights stay
on the ranks, which send them to the engine themselves (crl_bench/llm/weight_channel.py), and
:meth:`DataParallelUpdater.refresh_model` fetches them when the driver's copy is read.
:attr:`DataParallelUpdater.optimizer` and ``.scheduler`` are stand-ins
whose ``state_dict()`` / ``load_state_dict()`` reach the workers' optimiser (rank 0's for DDP; the full,
unsharded state for FSDP, re-keyed to ``torch.optim``'s integer parameter ids so a checkpoint is the
same as the one-process updater's) and lr scheduler.

**Ray.** If Ray is not initialised, :class:`DataParallelUpdater` starts a local one
(``ray.init(num_cpus=max(cpu count, workers * threads), include_dashboard=False,
log_to_driver=False)``) and leaves it running (other updaters may share it; ``ray.shutdown()`` is the
caller's); an already initialised Ray (e.g. a cluster the caller connected to) is used as is.
:meth:`DataParallelUpdater.close` destroys the process group and kills the actors.

Sources: PyTorch docs "DistributedDataParallel" (``no_sync``, ``register_comm_hook``), "DDP
Communication Hooks", "torch.distributed.fsdp.fully_shard" (FSDP2: ``set_gradient_divide_factor``,
``set_force_sum_reduction_for_comms``), "torch.distributed.checkpoint.state_dict"; Ray docs "Actors".
"""

from __future__ import annotations

import inspect
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, get_args

import torch

from crl_bench.config import Sharding
from crl_bench.trainer.policy import (
    PolicyUpdater,
    TokenSample,
    UpdateStats,
    recomputed,
    response_logprobs,
)
from crl_bench.trainer.rank_placement import rank_placement, release, reserve, scheduling, wait_for_resources
from crl_bench.trainer.remote_state import LambdaFactory, RemoteOptimizer, RemoteScheduler

__all__ = ["SHARDINGS", "DataParallelUpdater", "MicroBatch", "TrainWorker", "allreduce_sum_hook"]

SHARDINGS: tuple[str, ...] = get_args(Sharding)
"""The values of ``train.sharding``."""


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward of the update plan.

    Attributes:
        index: position of this micro-batch in the whole update, in the order the one-process
            ``PolicyUpdater.update`` runs them (the order statistics are summed in).
        items: ``(sample index, per-token loss weight)`` pairs (weights from :func:`token_weights` over
            the mini-batch chunk).
        shared: prompt tokens all its samples share, computed once (:func:`shared_prefix_logprobs`);
            0: the plain forward.
    """

    index: int
    items: tuple[tuple[int, float], ...]
    shared: int = 0


def allreduce_sum_hook(process_group, bucket):
    """DDP communication hook that all-reduces a gradient bucket with ``ReduceOp.SUM`` and does not
    divide by the world size (DDP's built-in behaviour, ``allreduce_hook``, averages).

    Args:
        process_group: the group to reduce over (``None``: the default group).
        bucket: ``torch.distributed.GradBucket``; its flat ``buffer()`` is reduced in place.

    Returns:
        ``torch.futures.Future[torch.Tensor]`` holding the summed flat bucket (1-D, the bucket's dtype).

    No annotations: ``DistributedDataParallel.register_comm_hook`` checks them against the real types
    and this module's postponed (string) annotations would fail that check.
    """
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    fut = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor inside dicts/lists/tuples moved to the CPU (detached)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _full(t: Any) -> torch.Tensor:
    """A plain tensor of ``t`` (DTensors are gathered: ``full_tensor()``)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _optimizer_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The constructor keyword arguments of ``optimizer``'s class found in its ``defaults`` (e.g.
    AdamW's ``defaults`` holds ``decoupled_weight_decay``, which its constructor does not take)."""
    sig = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in sig}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class TrainWorker:
    """One rank of the data-parallel group (run as a Ray actor; public for tests and debugging).

    Args:
        rank: this worker's rank in ``[0, world_size)``.
        world_size: number of workers.
        threads: torch CPU threads of this worker.
        gpu: with NCCL, the CUDA device index of this rank (trainer/rank_placement.py); ``None``: device 0 of
            what Ray made visible to it.
    """

    def __init__(self, rank: int, world_size: int, threads: int, gpu: int | None = None) -> None:
        from crl_bench.llm import lean_imports

        lean_imports.install()      # before setup's model unpickles transformers (a rank is crl-bench's process)
        self.rank, self.world = int(rank), int(world_size)
        self.gpu = gpu
        torch.set_num_threads(max(1, int(threads)))
        self.updater: PolicyUpdater | None = None

    def address(self) -> tuple[str, int]:
        """``(node IP, free TCP port)`` for rank 0's rendezvous (``ray.util.get_node_ip_address``)."""
        import ray.util

        return ray.util.get_node_ip_address(), _free_port()

    # ---- setup ------------------------------------------------------------------------------------
    def setup(self, address: str, port: int, spec: dict[str, Any], model: Any,
              model_state: dict[str, torch.Tensor] | None, ref: Any,
              optimizer_state: dict[str, Any] | None, scheduler_state: dict[str, Any] | None) -> float:
        """Join the process group, build the replica, wrap it, build optimiser and scheduler.

        Args:
            spec: ``backend``, ``sharding``, ``timeout_s``, ``optimizer_cls``/``optimizer_kwargs``/
                ``param_groups`` (hyper-parameters of the driver's groups), ``scheduler_factory``
                (``optimizer -> scheduler`` or ``None``), ``ref_method`` (name of the model's method
                that makes it the KL reference, or ``None``), ``updater`` (PolicyUpdater keyword
                arguments), ``model_factory`` (or ``None``: ``model`` is the replica).
            model: the driver's model (unpickled: this worker's own copy), or ``None`` with a factory.
            model_state: the driver's ``state_dict()`` when a factory builds the replica.
            ref: the KL reference model (a module), or ``None``.
            optimizer_state, scheduler_state: the driver's ``state_dict()``s to start from (or ``None``).

        Returns:
            the learning rate of the first parameter group after the scheduler is built.
        """
        import torch.distributed as dist

        self.spec = spec
        self.sharding = spec["sharding"]
        cuda = spec["backend"] == "nccl"
        self.device = torch.device("cuda", self.gpu or 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        dist.init_process_group(spec["backend"], init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=spec["timeout_s"]))
        if spec["model_factory"] is not None:
            model = spec["model_factory"]()
            model.load_state_dict(model_state)
        model = model.to(self.device)
        self.inner = model
        self.trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        if self.sharding == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            # gradient_as_bucket_view: the gradients live in DDP's buckets (no second copy of them)
            wrapped = DDP(model, device_ids=[self.device.index] if cuda else None, broadcast_buffers=False,
                          gradient_as_bucket_view=True)
            wrapped.register_comm_hook(None, allreduce_sum_hook)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import FSDPModule, fully_shard

            mesh = init_device_mesh(self.device.type, (self.world,))
            blocks = set(getattr(model, "_no_split_modules", None) or ())
            for sub in list(model.modules())[1:]:
                if type(sub).__name__ in blocks:
                    fully_shard(sub, mesh=mesh)
            fully_shard(model, mesh=mesh)
            for sub in model.modules():
                if isinstance(sub, FSDPModule):
                    sub.set_gradient_divide_factor(1.0)
                    sub.set_force_sum_reduction_for_comms(True)
            wrapped = model
        self.model = wrapped
        params = [p for p in model.parameters() if p.requires_grad]
        opt = spec["optimizer_cls"](params, **spec["optimizer_kwargs"])
        for group, hyper in zip(opt.param_groups, spec["param_groups"]):
            group.update(hyper)
        if optimizer_state is not None and optimizer_state.get("state"):
            self._load_optimizer(opt, optimizer_state)
        sched = spec["scheduler_factory"](opt) if spec["scheduler_factory"] is not None else None
        if sched is not None and scheduler_state is not None:
            sched.load_state_dict(scheduler_state)
        if ref is not None:
            ref = ref.to(self.device).eval()
            for p in ref.parameters():
                p.requires_grad_(False)
        elif spec["ref_method"] is not None:
            ref = getattr(model, spec["ref_method"])        # e.g. peft's disable_adapter on this replica
        self.updater = PolicyUpdater(wrapped, opt, scheduler=sched, ref_model=ref, **spec["updater"])
        return float(opt.param_groups[0]["lr"])

    # ---- one update -------------------------------------------------------------------------------
    def _dummy(self) -> MicroBatch:
        return MicroBatch(-1, ((-1, 0.0),), 0)

    def _samples_of(self, samples: Sequence[TokenSample], mb: MicroBatch) -> tuple[list[TokenSample], list[float]]:
        pad = self.updater.pad_id
        ss = [samples[i] if i >= 0 else TokenSample([pad], [pad], [0.0], 0.0) for i, _ in mb.items]
        return ss, [w for _, w in mb.items]

    def _micro(self, samples: Sequence[TokenSample], mb: MicroBatch, fold: bool) -> dict[str, Any]:
        """Forward and backward of one micro-batch (the body of ``PolicyUpdater.update``'s loop);
        returns its loss, statistics, token counts and (``fold``) log-prob differences."""
        ss, ws = self._samples_of(samples, mb)
        out = self.updater.micro_backward(ss, ws, mb.shared, fold)
        return {"index": mb.index, **out}

    def _mine(self, micros: Sequence[Any]) -> list[tuple[Any, bool]]:
        """This rank's share of ``micros`` (position ``p`` goes to rank ``p % world``) as ``(item,
        is_real)``; FSDP: one item per round (a ``None`` item where this rank has none)."""
        own = list(micros[self.rank::self.world])
        if self.sharding == "fsdp":
            rounds = math.ceil(len(micros) / self.world)
            return [(own[r], True) if r < len(own) else (None, False) for r in range(rounds)]
        return [(m, True) for m in own]

    def _recompute(self, samples: list[TokenSample]) -> tuple[list[TokenSample], dict[str, float]]:
        """``PolicyUpdater._recompute`` split over the ranks: chunk ``c`` of the trained samples on rank
        ``c % world``; the recomputed log-probs are all-gathered so every rank continues with the same
        samples.  Returns the samples and the drift statistics (every rank computes the same)."""
        import torch.distributed as dist

        up = self.updater
        idx = [i for i, s in enumerate(samples) if up._trains(s)]
        chunks = up.chunks(samples, idx)
        # DDP: the plain module (no collective in a no-grad forward); FSDP: the sharded one, in rounds
        model = self.inner if self.sharding == "ddp" else self.model
        mine: dict[int, list[list[float]]] = {}
        self.model.eval()
        with torch.no_grad():
            for part, real in self._mine(list(enumerate(chunks))):
                if not real:
                    build = up.batch([TokenSample([up.pad_id], [up.pad_id], [0.0], 0.0)])
                    up._logprobs(model, build)
                    continue
                c, ids = part
                batch = up.batch([samples[i] for i in ids])
                lp = up._logprobs(model, batch).float().cpu()
                mine[c] = [response_logprobs(lp, batch, row, len(samples[i].response_ids)).tolist()
                           for row, i in enumerate(ids)]
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine)
        got = {c: v for part in gathered for c, v in part.items()}
        out = list(samples)
        diffs = []
        for c, ids in enumerate(chunks):
            for i, new in zip(ids, got[c]):
                out[i], d = recomputed(samples[i], torch.tensor(new, dtype=torch.float32))
                diffs.append(d)
        return out, (PolicyUpdater._drift(torch.cat(diffs)) if diffs else {})

    def update(self, samples: list[TokenSample], plan: list[list[MicroBatch]], recompute: bool, fold: bool,
               return_weights: bool) -> dict[str, Any]:
        """Run the planned optimiser steps on this rank's micro-batches.

        Returns a dict: ``micro`` (this rank's real micro-batches' results, see :meth:`_micro`),
        ``steps`` (per optimiser step ``{"grad_norm", "lr"}``, identical on every rank), ``lr`` (the
        learning rate after the update), ``drift`` (recomputation statistics or ``{}``), ``timing``
        (``compute_s``: recomputation, forwards, backwards, gradient sums and optimiser steps;
        ``weights_s``: gathering the weights to return; seconds) and, on rank 0 with
        ``return_weights``, ``weights`` (``{name: CPU tensor}`` of the trainable parameters).
        """
        t0 = time.perf_counter()
        up = self.updater
        drift: dict[str, float] = {}
        if recompute:
            samples, drift = self._recompute(samples)
        self.model.train()
        micro_out: list[dict[str, Any]] = []
        steps: list[dict[str, float]] = []
        for step in plan:
            up.optimizer.zero_grad(set_to_none=True)
            mine = self._mine(step)
            if not mine:                        # DDP, fewer micro-batches than ranks: still join the sum
                mine = [(None, False)]
            for k, (mb, real) in enumerate(mine):
                sync = self.sharding == "fsdp" or k == len(mine) - 1
                ctx = self.model.no_sync() if not sync else nullcontext()
                with ctx:
                    res = self._micro(samples, mb if real else self._dummy(), fold and real)
                if real:
                    micro_out.append(res)
            params = [p for p in self.model.parameters() if p.requires_grad]
            if up.max_grad_norm > 0:
                grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(params, up.max_grad_norm)))
            elif self.sharding == "fsdp":
                grad_norm = float(_full(torch.nn.utils.get_total_norm(
                    [p.grad for p in params if p.grad is not None])))
            else:
                grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
            lr = float(up.optimizer.param_groups[0]["lr"])
            up.optimizer.step()
            if up.scheduler is not None:
                up.scheduler.step()
            steps.append({"grad_norm": grad_norm, "lr": lr})
        up.optimizer.zero_grad(set_to_none=True)       # gradients freed between updates
        t1 = time.perf_counter()
        out: dict[str, Any] = {"micro": micro_out, "steps": steps, "drift": drift,
                               "lr": float(up.optimizer.param_groups[0]["lr"])}
        if return_weights:
            w = self.weights()
            if self.rank == 0:
                out["weights"] = w
        out["timing"] = {"compute_s": t1 - t0, "weights_s": time.perf_counter() - t1}
        return out

    # ---- state ------------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor] | None:
        """``{name: CPU tensor}`` of the trainable parameters on rank 0 (names as the driver's
        ``named_parameters``), ``None`` on the other ranks.  FSDP: a collective, every rank calls it."""
        if self.sharding == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return {n: full[n] for n in self.trainable} if self.rank == 0 else None
        if self.rank != 0:
            return None
        return {n: p.detach().cpu() for n, p in self.inner.named_parameters() if p.requires_grad}

    def load_weights(self, state: dict[str, torch.Tensor] | None) -> None:
        """Copy ``{name: tensor}`` (the driver's trainable parameters) into this replica (every rank
        calls it). FSDP: rank 0 gets the full state and broadcasts it tensor by tensor, each rank keeping
        its shard (``broadcast_from_rank0``); the other ranks pass ``None``, so no rank but the first holds
        the full state in host memory."""
        if self.sharding == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, state if self.rank == 0 and state is not None else {},
                                 options=StateDictOptions(full_state_dict=True, strict=False,
                                                          broadcast_from_rank0=True))
            return
        params = dict(self.inner.named_parameters())
        with torch.no_grad():
            for n, t in state.items():
                params[n].copy_(t)

    def _load_optimizer(self, opt: torch.optim.Optimizer, state: dict[str, Any] | None) -> None:
        """Load a full optimiser state (integer-id form). DDP: every rank its replica's copy. FSDP: rank 0
        broadcasts it and each rank keeps its shard (``broadcast_from_rank0``); the others pass ``None``."""
        if self.sharding == "ddp":
            opt.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        keyed: dict[str, Any] = {}
        if self.rank == 0:
            names = self.trainable
            keyed = {"state": {names[int(k)]: v for k, v in state["state"].items()},
                     "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                      for g in state["param_groups"]]}
        set_optimizer_state_dict(self.model, opt, optim_state_dict=keyed,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def optimizer_state(self) -> dict[str, Any] | None:
        """The optimiser's ``state_dict()`` in ``torch.optim``'s integer-id form (tensors on the CPU)
        on rank 0, ``None`` elsewhere.  FSDP: the full unsharded state (a collective)."""
        opt = self.updater.optimizer
        if self.sharding == "ddp":
            return _to_cpu(opt.state_dict()) if self.rank == 0 else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(self.model, opt, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
        if self.rank != 0:
            return None
        ids = {n: i for i, n in enumerate(self.trainable)}
        return {"state": {ids[n]: _to_cpu(v) for n, v in full["state"].items()},
                "param_groups": [{**g, "params": [ids[n] for n in g["params"]]} for g in full["param_groups"]]}

    def load_optimizer_state(self, state: dict[str, Any] | None) -> float:
        """Load :meth:`optimizer_state` output on this rank (every rank must call it; with FSDP only rank 0
        needs it, the others may pass ``None``); returns the lr."""
        self._load_optimizer(self.updater.optimizer, state)
        return float(self.updater.optimizer.param_groups[0]["lr"])

    def scheduler_state(self) -> dict[str, Any] | None:
        """The lr scheduler's ``state_dict()`` (``None`` without one)."""
        s = self.updater.scheduler
        return s.state_dict() if s is not None else None

    def load_scheduler_state(self, state: dict[str, Any]) -> float:
        """Load a scheduler ``state_dict()``; returns the lr."""
        self.updater.scheduler.load_state_dict(state)
        return float(self.updater.optimizer.param_groups[0]["lr"])

    # ---- weights straight to an engine (crl_bench/llm/weight_channel.py) --------------------------
    def weight_specs(self) -> list[list[Any]]:
        """``[name, shape]`` of each trainable parameter (full shapes), in the order :meth:`send_weights` sends;
        a tied weight under each of its names, as ``state_dict`` has it (vLLM's CPU reload restores a layer whose
        name it does not get from the checkpoint, e.g. a tied ``lm_head``)."""
        return [[n, list(p.shape)] for n, p in self._sent()]

    def _sent(self) -> list[tuple[str, Any]]:
        return [(n, p) for n, p in self.inner.named_parameters(remove_duplicate=False) if p.requires_grad]

    def open_weight_channel(self, host: str, port: int, world_size: int, backend: str) -> None:
        """Rank 0: host the weight channel at ``host:port`` and wait for the engine's workers to join."""
        from crl_bench.llm.weight_channel import open_channel

        if self.rank == 0:
            self.channel = open_channel(host, port, 0, world_size, backend, self.spec["timeout_s"])

    def send_weights(self, dtype_name: str) -> int:
        """Send the trainable parameters over the weight channel in ``dtype_name`` (every rank calls it: FSDP
        gathers each tensor); returns the bytes rank 0 sent."""
        from crl_bench.llm.weight_channel import send_parameters

        return send_parameters(getattr(self, "channel", None), self._sent(), getattr(torch, dtype_name), self.device)

    def close_weight_channel(self) -> None:
        """Leave the weight channel."""
        self.channel = None

    def where(self) -> str:
        """This rank's device and the GPUs its process sees (``CUDA_VISIBLE_DEVICES``; ``all`` when unset)."""
        return f"{self.device} (visible {os.environ.get('CUDA_VISIBLE_DEVICES', 'all')})"

    def close(self) -> None:
        """Leave the process group."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class DataParallelUpdater(PolicyUpdater):
    """:class:`PolicyUpdater` whose updates run data-parallel on ``workers`` Ray actors (module docstring).

    Takes :class:`PolicyUpdater`'s arguments (``model`` is the driver's model: shipped to the workers
    once and overwritten with the trained weights after every update that stepped; ``optimizer``: its
    class, constructor defaults, parameter-group hyper-parameters and state are rebuilt on every worker
    over the replica's trainable parameters; ``ref_model``: a module is shipped as a frozen replica,
    a bound method of ``model`` such as peft's ``disable_adapter`` is rebound on each replica; every
    other keyword, ``updater_kwargs``, goes unchanged to the driver's and each worker's
    :class:`PolicyUpdater`), plus:

    Args:
        workers: number of ranks (>= 1; 1 runs one worker actor, useful to measure the overhead).
        sharding: ``ddp`` (full replica per worker) or ``fsdp`` (FSDP2, sharded).
        threads: torch threads per worker (= the actor's ``num_cpus``); default: this process's torch
            threads divided by ``workers`` (at least 1).
        scheduler_factory: ``optimizer -> lr scheduler`` built on every worker (e.g.
            ``functools.partial(linear_warmup, steps=N)``); by default derived from ``scheduler``, which
            must then be a ``LambdaLR`` (its ``lr_lambdas`` are shipped, its state loaded).
        model_factory: ``() -> model`` building the replica's architecture on the worker (the driver's
            ``state_dict()`` is then shipped instead of the pickled model); default ``None``.
        num_cpus: Ray CPUs each worker actor reserves (default ``threads``); a fraction lets the
            workers share CPUs with other actors (e.g. the extractor's workers beside the actor's).
        timeout_s: process-group timeout (seconds): a collective that waits longer raises; also the
            longest the driver waits for the workers without progress (``TimeoutError``).
        gpus: with CUDA, each rank's GPU (one per rank, as this process numbers them), reserved in a Ray
            placement group (trainer/rank_placement.py); ``None``: Ray picks one whole GPU per rank.
        gpu_fraction: the share of its GPU each rank declares to Ray with ``gpus`` (0.5 where two updaters'
            ranks share the GPUs).

    Attributes ``optimizer`` and ``scheduler`` are stand-ins (``state_dict`` / ``load_state_dict`` on
    the workers' objects, trainer/remote_state.py); ``lr_now`` is the learning rate after the last update;
    ``rng`` is the driver's shuffling generator as in :class:`PolicyUpdater`; ``last_timing`` (seconds)
    splits the last :meth:`update` into ``call_s`` (the Ray call: shipping the samples, the workers' work,
    returning the weights), ``compute_s`` (the slowest worker's forwards, backwards, gradient sums and
    optimiser steps), ``weights_s`` (gathering the weights on rank 0) and ``load_s`` (copying them into
    the driver's model).

    Raises:
        ValueError: ``workers < 1``, unknown ``sharding`` or ``loss_agg``.
        TypeError: a ``scheduler`` that is not a ``LambdaLR`` without ``scheduler_factory``.
        ValueError: ``fsdp`` with a callable (non-module) KL reference (LoRA's ``disable_adapter``).
        RuntimeError: not enough free Ray resources (CPUs, GPUs) for the worker actors.
        ray.exceptions.RayError: a worker failed while setting up (the actors are then killed).
    """

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, pad_id: int, *, ref_model: Any = None,
                 scheduler: Any = None, workers: int = 2, sharding: str = "ddp", threads: int | None = None,
                 scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None = None,
                 model_factory: Callable[[], Any] | None = None, num_cpus: float | None = None,
                 timeout_s: float = 1800.0, gpus: Sequence[int] | None = None, gpu_fraction: float = 1.0,
                 **updater_kwargs: Any) -> None:
        import ray

        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
        # the driver's updater: the same settings, for the shuffling generator and the batch checks;
        # the reference and the scheduler live on the workers
        super().__init__(model, optimizer, pad_id, **updater_kwargs, ref_model=None, scheduler=None)
        self.workers = int(workers)
        self.sharding = sharding
        if scheduler is not None and scheduler_factory is None:
            if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                raise TypeError("pass scheduler_factory for a scheduler other than LambdaLR "
                                f"(got {type(scheduler).__name__})")
            lambdas = list(scheduler.lr_lambdas)
            scheduler_factory = LambdaFactory(lambdas)
        ref_module, ref_method = None, None
        if ref_model is not None:
            if isinstance(ref_model, torch.nn.Module):
                ref_module = ref_model
            elif callable(ref_model) and getattr(ref_model, "__self__", None) is model:
                if sharding == "fsdp":
                    raise ValueError("sharding='fsdp' takes the reference as a module, not a method of the "
                                     "model (LoRA's disable_adapter): use sharding='ddp'")
                ref_method = ref_model.__name__
            else:
                raise TypeError("ref_model must be a module or a bound method of model")
        cuda = torch.cuda.is_available()
        self.backend = "nccl" if cuda else "gloo"
        self.threads = max(1, int(threads) if threads else torch.get_num_threads() // self.workers)
        if not ray.is_initialized():
            ray.init(num_cpus=max(os.cpu_count() or 1, self.workers * self.threads),
                     include_dashboard=False, log_to_driver=False)
        self.timeout_s = float(timeout_s)
        cpus = float(num_cpus) if num_cpus is not None else float(self.threads)
        placement = rank_placement(self.workers, cpus, cuda, gpus, gpu_fraction)
        self._group = None
        if placement.bundles:
            self._group = reserve(placement, min(self.timeout_s, 60.0))
        else:
            need = {"CPU": cpus * self.workers, "GPU": float(self.workers) if cuda else 0.0}
            wait_for_resources(need, min(self.timeout_s, 60.0))
        actor = ray.remote(TrainWorker)
        self._actors = [actor.options(**placement.options, **scheduling(self._group, r))
                        .remote(r, self.workers, self.threads, placement.gpus[r]) for r in range(self.workers)]
        try:
            address, port = ray.get(self._actors[0].address.remote(), timeout=self.timeout_s)
            spec = {"backend": self.backend, "sharding": sharding, "timeout_s": self.timeout_s,
                    "optimizer_cls": type(optimizer), "optimizer_kwargs": _optimizer_kwargs(optimizer),
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
                    "scheduler_factory": scheduler_factory, "ref_method": ref_method,
                    "model_factory": model_factory,
                    "updater": {"pad_id": pad_id, **updater_kwargs}}
            if model_factory is not None:
                model_ref, state_ref = None, ray.put(_to_cpu(model.state_dict()))
            else:
                model_ref, state_ref = ray.put(model), None
            ref_ref = ray.put(ref_module) if ref_module is not None else None
            opt_state = ray.put(_to_cpu(optimizer.state_dict()))     # stored once, one reference per rank
            sched_state = scheduler.state_dict() if scheduler is not None else None
            lrs = self.gather([a.setup.remote(address, port, spec, model_ref, state_ref, ref_ref, opt_state,
                                               sched_state) for a in self._actors])
        except BaseException:
            self.close()
            raise
        self.lr_now = lrs[0]
        self.weights_to_driver = True
        self.model_stale = False
        self.last_timing: dict[str, float] = {}
        self.optimizer = RemoteOptimizer(self)
        self.scheduler = RemoteScheduler(self) if scheduler_factory is not None else None

    # ---- driver side --------------------------------------------------------------------------------
    def gather(self, refs: list[Any]) -> list[Any]:
        """``ray.get(refs)``, but raising as soon as any worker fails (the others may be blocked in a
        collective waiting for it); ``TimeoutError`` after ``timeout_s`` without progress."""
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=self.timeout_s)
            if not done:
                raise TimeoutError(f"data-parallel workers made no progress in {self.timeout_s:.0f} s")
            ray.get(done)                   # raises the worker's error
        return ray.get(refs)

    def start(self, method: str, *args: Any) -> list[Any]:
        """Start ``method(*args)`` on every worker (each argument stored once) without waiting; the Ray
        references in rank order, for :meth:`gather`."""
        import ray

        refs = [ray.put(a) for a in args]
        return [getattr(a, method).remote(*refs) for a in self._actors]

    def refresh_model(self) -> None:
        """Bring the driver's model up to the ranks' weights where updates left it behind (weights synced
        straight from the ranks to the engine, ``weights_to_driver`` false); a no-op otherwise."""
        from crl_bench.llm.weights import load_trainable

        if self.model_stale:
            load_trainable(self.model, self.call_rank0("weights"), "data-parallel ranks")
            self.model_stale = False

    def call_rank0(self, method: str, *args: Any) -> Any:
        """Call ``method`` on every worker (collectives need all ranks) and return rank 0's result. Each
        argument goes into Ray's object store once and every worker gets that one reference: passed by
        value, Ray would store a copy per call (a resumed 7B AdamW state is 61 GB, once per rank)."""
        return self.gather(self.start(method, *args))[0]

    def call_full_state(self, method: str, state: Any) -> Any:
        """:meth:`call_rank0` with a full state that FSDP ranks take from rank 0 by broadcast: with FSDP only
        rank 0 gets ``state`` (the others ``None``, so they never deserialise it); with DDP every rank gets
        the one stored copy."""
        import ray

        ref = ray.put(state)
        return self.gather([getattr(a, method).remote(ref if i == 0 or self.sharding != "fsdp" else None)
                             for i, a in enumerate(self._actors)])[0]

    def sharing(self) -> bool:
        """:meth:`PolicyUpdater.sharing`, and never with FSDP (its two forwards per micro-batch would
        break the ranks' lockstep collectives)."""
        return self.sharding != "fsdp" and super().sharing()

    def plan(self, samples: Sequence[TokenSample]) -> list[list[MicroBatch]]:  # type: ignore[override]
        """:meth:`PolicyUpdater.plan` (the same draws: advances :attr:`rng` by one shuffle per epoch),
        its micro-batches numbered in order as :class:`MicroBatch`."""
        steps: list[list[MicroBatch]] = []
        index = 0
        for micros in super().plan(samples):
            steps.append([MicroBatch(index + k, items, shared) for k, (items, shared) in enumerate(micros)])
            index += len(micros)
        return steps

    def update(self, samples: Sequence[TokenSample]) -> dict[str, float]:
        """Optimise on ``samples`` on the workers; same return value as :meth:`PolicyUpdater.update`
        (statistics summed over all ranks' micro-batches in the one-process order; ``grad_norm`` of the
        full summed gradient).  The driver's model holds the updated weights when it returns.

        Raises:
            ray.exceptions.RayError: a worker failed (the group is then unusable: :meth:`close` it).
            TimeoutError: no worker finished within ``timeout_s``.
        """
        import ray

        from crl_bench.llm.weights import load_trainable

        samples = list(samples)
        fold = self.recompute_old_logprobs and self.epochs == 1 and self.mini_batches == 1
        recompute = self.recompute_old_logprobs and not fold and any(self._trains(s) for s in samples)
        plan = self.plan(samples)
        results: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        if plan:
            sref = ray.put(samples)
            results = self.gather([a.update.remote(sref, plan, recompute, fold, self.weights_to_driver)
                                    for a in self._actors])
        t1 = time.perf_counter()
        acc = UpdateStats()
        grad_norm, lr, steps = 0.0, self.lr_now, 0
        drift: dict[str, float] = {}
        if results:
            for m in sorted((m for r in results for m in r["micro"]), key=lambda m: m["index"]):
                acc.add(m)
            head = results[0]
            steps = len(head["steps"])
            if steps:
                grad_norm, lr = head["steps"][-1]["grad_norm"], head["steps"][-1]["lr"]
            drift = head["drift"]
            self.lr_now = head["lr"]
            if "weights" in head and steps:
                load_trainable(self.model, head["weights"], "data-parallel update")
            elif steps:
                self.model_stale = True         # the ranks moved on; refresh_model() fetches their weights
            self.last_timing = {"call_s": t1 - t0, "load_s": time.perf_counter() - t1,
                                "compute_s": max(r["timing"]["compute_s"] for r in results),
                                "weights_s": head["timing"]["weights_s"]}
        return acc.result(steps, grad_norm, lr, drift)

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer", "scheduler", "rng"}``: the workers' optimiser state (integer-id form),
        scheduler state (or ``None``) and the driver's shuffling generator state."""
        return {"optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; load the weights into the driver's model first (the
        optimiser's ``load_state_dict`` copies them to the workers)."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.rng.setstate(state["rng"])

    def push_weights(self) -> None:
        """Copy the driver model's trainable parameters to every worker (after changing the driver's
        model outside :meth:`update`, e.g. loading a checkpoint into it)."""
        self.model_stale = False
        self.call_full_state("load_weights", {n: p.detach().cpu() for n, p in self.model.named_parameters()
                                               if p.requires_grad})

    def rank_devices(self) -> list[str]:
        """Each rank's device and visible GPUs (:meth:`TrainWorker.where`), in rank order."""
        import ray

        return ray.get([a.where.remote() for a in self._actors], timeout=self.timeout_s)

    def close(self) -> None:
        """Leave the process group and kill the worker actors (idempotent; Ray itself stays up)."""
        import ray

        actors, self._actors = getattr(self, "_actors", []), []
        if not actors:
            return
        try:
            ray.get([a.close.remote() for a in actors], timeout=30)
        except Exception:       # noqa: BLE001 - a dead or hung worker is killed anyway
            pass
        for a in actors:
            ray.kill(a)
        group, self._group = getattr(self, "_group", None), None
        release(group)

    def __enter__(self) -> DataParallelUpdater:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
