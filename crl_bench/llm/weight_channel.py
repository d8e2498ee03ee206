"""Weights from the data-parallel ranks straight into a vLLM engine (``devices.weight_sync: direct``).

The host path (``devices.weight_sync: host``) moves the trained weights GPU -> host -> Ray -> the driver's
model -> the engine after every update: at 7B that is 30.5 GB of float32 through host memory per step
(docs/scaling.md). The direct path moves each trainable tensor once, in the engine's dtype, from the ranks
to the engine's workers over a process group of its own, the **weight channel**:

* its ranks are the data-parallel rank 0 (the sender, channel rank 0) and the engine's workers (channel
  ranks ``1 .. tensor_parallel_size``); NCCL between GPUs, gloo where the ranks run on the CPU;
* it is built from torch's backend classes directly (``ProcessGroupNCCL`` / ``ProcessGroupGloo`` on a
  ``TCPStore`` that the sender hosts), outside the default process group each side already has (the ranks'
  training group, vLLM's own);
* a sync is one broadcast per trainable tensor, in ``named_parameters`` order: with FSDP2 every rank
  gathers the tensor's shards (``DTensor.full_tensor``, a collective of the training group) and rank 0
  casts it to the engine's dtype and broadcasts it; each worker receives it into a fresh tensor on its own
  device and hands it to ``model.load_weights`` (which takes its tensor-parallel slice), or keeps it for
  one in-place reload where vLLM's CPU backend repacked the layers
  (:class:`crl_bench.llm.vllm_engine.WeightSyncExtension`);
* the driver starts the ranks' sends as Ray calls, then makes the engine's workers receive
  (``collective_rpc``), then waits for the sends: nothing goes through the driver's memory, and the
  driver's own model is refreshed only when something reads it (a checkpoint, the final weights, the
  lesson-follow probe: :meth:`~crl_bench.trainer.policy.PolicyUpdater.refresh_model`).

The pattern is the one of vLLM's RLHF example (examples/offline_inference/rlhf.py: a separate NCCL group
between the trainer and the engine's workers, a broadcast per tensor, ``load_weights``) and of verl's and
ROLL's broadcast weight updates for engines on other GPUs than the trainer's; the group here is torch's
rather than vLLM's ``PyNcclCommunicator``, so that the same code runs over gloo on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["CHANNEL_PREFIX", "Channel", "ChannelReceiver", "DirectWeightSync", "open_channel",
           "receive_parameters", "send_parameters"]

#: key prefix of the channel's rendezvous in its TCP store
CHANNEL_PREFIX = "crl-weight-channel"


def open_channel(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """Join the weight channel: a ``torch.distributed`` backend of ``world_size`` ranks on a TCP store.

    Rank 0 (the sending data-parallel rank) hosts the store at ``host:port``; the others connect to it.
    Blocks until every rank has joined (gloo; NCCL connects at its first broadcast).

    Args:
        host, port: the store's address (rank 0's node and a free port of it).
        rank: this process's rank in the channel (0: the sender).
        world_size: 1 + the engine's number of workers.
        backend: ``"nccl"`` (tensors on this process's current CUDA device) or ``"gloo"`` (CPU tensors).
        timeout_s: how long a rendezvous or a broadcast may wait (seconds) before it raises.

    Returns:
        a :class:`Channel` (the backend and its store).

    Raises:
        ValueError: an unknown backend, or a rank outside ``[0, world_size)``.
        RuntimeError / DistStoreError: the other ranks did not join within ``timeout_s``.
    """
    import torch.distributed as dist

    if backend not in ("nccl", "gloo"):
        raise ValueError(f"weight channel backend must be nccl or gloo, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"channel rank {rank} outside [0, {world_size})")
    timeout = timedelta(seconds=float(timeout_s))
    store = dist.TCPStore(host, int(port), int(world_size), is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    prefixed = dist.PrefixStore(CHANNEL_PREFIX, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return Channel(group, store)


@dataclass
class Channel:
    """One process's end of the weight channel: torch's backend object and the TCP store it was built on
    (rank 0's store is the rendezvous server, so it lives as long as the channel)."""

    group: Any
    store: Any

    def broadcast(self, tensor: Any) -> None:
        """Broadcast ``tensor`` in place from channel rank 0 (the sender) and wait for it."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()


def send_parameters(group: Any | None, params: Iterable[tuple[str, Any]], dtype: Any, device: Any) -> int:
    """Send ``params`` over the channel, one broadcast each (every data-parallel rank calls this).

    Args:
        group: the channel on the sending rank (:func:`open_channel` with rank 0); ``None`` on the other
            data-parallel ranks, which only take part in the gathers.
        params: ``(name, parameter)`` in the order the receiver expects; FSDP2's ``DTensor`` parameters are
            gathered (``full_tensor``, a collective every rank must make in the same order).
        dtype: the engine's ``torch.dtype`` (floating-point tensors are cast to it).
        device: where the sent tensor lives (the rank's CUDA device for NCCL, the CPU for gloo).

    Returns:
        the bytes sent (0 on a rank without the channel).
    """
    import torch

    params = list(params)
    sharded = any(hasattr(p, "full_tensor") for _, p in params)
    if group is None and not sharded:
        return 0                            # a DDP replica: rank 0 sends its own full copy
    sent = 0
    with torch.no_grad():
        for _name, p in params:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if group is None:
                continue                    # this rank's part of the gather is done
            t = full.to(device=device, dtype=dtype if full.is_floating_point() else full.dtype).contiguous()
            group.broadcast(t)
            sent += t.numel() * t.element_size()
            del full, t
    return sent


def receive_parameters(group: Any, specs: Sequence[Sequence[Any]], dtype: Any, device: Any
                       ) -> Iterator[tuple[str, Any]]:
    """Receive the tensors :func:`send_parameters` sends, one per ``specs`` entry, in order.

    Args:
        group: this worker's channel (rank >= 1).
        specs: ``[name, shape]`` per tensor (:meth:`~crl_bench.trainer.data_parallel.TrainWorker.weight_specs`).
        dtype: the engine's ``torch.dtype``.
        device: where to receive (the worker's CUDA device for NCCL, the CPU for gloo).

    Yields:
        ``(name, tensor)`` as each tensor arrives (a fresh tensor per entry).
    """
    import torch

    for name, shape in specs:
        t = torch.empty([int(s) for s in shape], dtype=dtype, device=device)
        group.broadcast(t)
        yield str(name), t


class ChannelReceiver:
    """The engine-worker side of the channel, mixed into
    :class:`~crl_bench.llm.vllm_engine.WeightSyncExtension` (every attribute starts with ``crl_``, as vLLM
    requires of a worker extension). ``self`` is a vLLM worker; its rank among the engine's workers is
    ``self.rank`` (0 where the worker has none)."""

    def crl_open_channel(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> int:
        """Join the channel as rank ``1 + self.rank``; returns that rank."""
        import torch

        rank = 1 + int(getattr(self, "rank", 0) or 0)
        if backend == "nccl":
            self.crl_channel_device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.crl_channel_device = torch.device("cpu")
        self.crl_channel = open_channel(host, port, rank, world_size, backend, timeout_s)
        return rank

    def crl_receive_weights(self, specs: Sequence[Sequence[Any]], dtype_name: str) -> int:
        """Receive one sync's tensors and load them (``load`` mode, one at a time) or keep them for
        :meth:`crl_finish_sync` (``reload`` mode); returns how many arrived.

        Raises:
            RuntimeError: the channel was not opened (:meth:`crl_open_channel`).
        """
        import torch

        group = getattr(self, "crl_channel", None)
        if group is None:
            raise RuntimeError("the weight channel is not open on this worker")
        dtype = getattr(torch, dtype_name)
        count = 0
        reload = self.crl_sync_mode() == "reload"
        for name, t in receive_parameters(group, specs, dtype, self.crl_channel_device):
            if reload:
                if not hasattr(self, "crl_pending"):
                    self.crl_pending = []
                self.crl_pending.append((name, t))
            else:
                self.model_runner.model.load_weights(weights=[(name, t)])
            count += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return count

    def crl_close_channel(self) -> None:
        """Leave the channel (drop the group and its store)."""
        self.crl_channel = None


class DirectWeightSync:
    """Syncs a :class:`~crl_bench.llm.vllm_engine.VLLMEngine` from a
    :class:`~crl_bench.trainer.data_parallel.DataParallelUpdater`'s ranks over a weight channel (module
    docstring). The channel opens at the first :meth:`sync` and lives until :meth:`close`.

    Args:
        updater: the data-parallel updater whose ranks hold the weights the engine serves.
        engine: the engine (``llm.collective_rpc`` by method name, ``dtype``, ``tensor_parallel_size``).
        timeout_s: rendezvous and broadcast timeout (seconds); default the updater's.
    """

    def __init__(self, updater: Any, engine: Any, timeout_s: float | None = None) -> None:
        self.updater, self.engine = updater, engine
        self.timeout_s = float(timeout_s if timeout_s is not None else updater.timeout_s)
        self.specs: list[list[Any]] | None = None

    def _open(self) -> None:
        host, port = self.updater.gather(self.updater.start("address"))[0]
        backend = self.updater.backend      # the ranks' own: nccl on GPUs, gloo on the CPU
        world = 1 + int(getattr(self.engine, "tensor_parallel_size", 1))
        # rank 0 hosts the store and waits in the rendezvous while the engine's workers join it
        refs = self.updater.start("open_weight_channel", host, port, world, backend)
        self.engine.llm.collective_rpc("crl_open_channel", args=(host, port, world, backend, self.timeout_s))
        self.updater.gather(refs)
        self.specs = self.updater.gather(self.updater.start("weight_specs"))[0]

    def sync(self) -> int:
        """Copy the ranks' current trainable weights into every engine worker; returns the bytes sent.

        Raises:
            RuntimeError: a worker received another number of tensors than the ranks hold.
            ray.exceptions.RayError / TimeoutError: a rank failed or the broadcast timed out.
        """
        if self.specs is None:
            self._open()
        dtype_name = self.engine.dtype
        refs = self.updater.start("send_weights", dtype_name)
        received = self.engine.llm.collective_rpc("crl_receive_weights", args=(self.specs, dtype_name))
        sent = self.updater.gather(refs)[0]
        if any(n != len(self.specs) for n in received):
            raise RuntimeError(f"vLLM workers received {received} tensors of {len(self.specs)} sent")
        return int(sent)

    def close(self) -> None:
        """Leave the channel on both sides (best effort: either side may already be gone)."""
        if self.specs is None:
            return
        self.specs = None
        for close in (lambda: self.engine.llm.collective_rpc("crl_close_channel"),
                      lambda: self.updater.gather(self.updater.start("close_weight_channel"))):
            try:
                close()
            except Exception:  # noqa: BLE001 - closing is best effort; the processes end anyway
                pass
