"""vLLM engine: the weight-sync payload, constrained-reply budgets and settings are checked here without
vLLM (a stand-in ``LLM`` whose ``collective_rpc`` checks what it is sent and hands it, as vLLM's engine
process would decode it, to a worker made the way vLLM makes one): what a real engine cannot be made
to show (msgpack-native chunks, malformed chunks, a worker that loads too few tensors, budgets of
byte-by-byte tokenisations, settings). Real generation, syncs and training steps are in
test_vllm_real.py."""

import copy
import types

import pytest
import torch

from crl_bench.config import ConfigError, GenerationConfig, ModelConfig, build_config
from crl_bench.llm import vllm_engine
from crl_bench.llm.base import SamplingParams
from crl_bench.llm.vllm_engine import (
    FINISH_METHOD,
    SYNC_METHOD,
    WORKER_EXTENSION,
    VLLMEngine,
    WeightSyncExtension,
    constrained_budget,
    pack_weights,
    runs_in_process,
    sampling_kwargs,
    unpack_weights,
    weight_chunks,
)

# ---- what vLLM's out-of-process engine can carry ---------------------------------------------------


def _assert_msgpack_native(obj, path="payload"):
    """``obj`` is made only of what msgpack encodes natively and decodes back as itself without a type
    (vLLM's engine process decodes utility-call arguments untyped: vllm/v1/engine/core.py): None, bool,
    int, float, str, bytes, lists/tuples and str-keyed dicts of those.  A tensor would arrive as a raw
    ``[dtype, shape, buffer index]`` list and a function is refused (vllm/v1/serial_utils.py)."""
    if obj is None or isinstance(obj, (bool, float, str, bytes)):
        return
    if isinstance(obj, int):
        assert -(2**63) <= obj < 2**64, f"{path}: integer {obj} does not fit msgpack"
        return
    if isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            _assert_msgpack_native(x, f"{path}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, str), f"{path}: dict key {k!r} is not a string"
            _assert_msgpack_native(v, f"{path}[{k!r}]")
        return
    raise AssertionError(f"{path}: {type(obj).__module__}.{type(obj).__qualname__} is not msgpack-native "
                         "(vLLM's multiprocessing engine cannot carry it)")


def _untyped_roundtrip(obj):
    """``obj`` as an untyped msgpack decoder returns it: msgspec's round trip where msgspec is installed
    (vLLM's encoder), else the same mapping done by hand (tuples become lists)."""
    try:
        import msgspec
    except ImportError:
        msgspec = None
    if msgspec is not None:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(obj))
    if isinstance(obj, (list, tuple)):
        return [_untyped_roundtrip(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _untyped_roundtrip(v) for k, v in obj.items()}
    return obj


class _FakeVllmModel:
    """vLLM's model as the worker sees it: ``load_weights`` takes (HF name, tensor) pairs and copies them
    into its parameters (here a real HF model's state dict)."""

    def __init__(self, module):
        self.module = module
        self.loaded = []

    def load_weights(self, weights):
        state = self.module.state_dict()
        for name, tensor in weights:
            assert isinstance(tensor, torch.Tensor), f"{name}: got {type(tensor)}, not a tensor"
            with torch.no_grad():
                state[name].copy_(tensor)
            self.loaded.append(name)
        return {name for name, _ in weights}


class _FakeWorkerBase:
    """The attributes of a vLLM GPU worker an extension must not clash with (a subset)."""

    def __init__(self, module):
        self.model_runner = types.SimpleNamespace(model=_FakeVllmModel(module))
        self.device = torch.device("cpu")

    def load_model(self):
        raise NotImplementedError

    def execute_model(self, scheduler_output):
        raise NotImplementedError


def _make_worker(module):
    """A worker built as vLLM builds one with ``worker_extension_cls``: after checking that no attribute
    of the extension exists on the worker class, the extension is appended to its bases
    (vllm/v1/worker/worker_base.py ``WorkerWrapperBase.init_worker``)."""
    import importlib

    mod_name, _, cls_name = WORKER_EXTENSION.rpartition(".")
    ext = getattr(importlib.import_module(mod_name), cls_name)
    assert ext is WeightSyncExtension
    for attr in dir(ext):
        if not attr.startswith("__"):
            assert not hasattr(_FakeWorkerBase, attr), attr
    cls = type("Worker", (_FakeWorkerBase,), {})
    cls.__bases__ = cls.__bases__ + (ext,)
    return cls(module)


class InprocClient:                    # names as in vllm/v1/engine/core_client.py
    def __init__(self, executor):
        self.engine_core = types.SimpleNamespace(model_executor=executor)


class UniProcExecutor:                 # as in vllm/v1/executor/uniproc_executor.py
    pass


class MultiprocExecutor:
    pass


class _FakeLLM:
    """``vllm.LLM`` as :class:`VLLMEngine` uses it.  Out of process (the default), ``collective_rpc``
    requires a method name and msgpack-native arguments and passes the worker what an untyped decoder
    returns; in process, it calls the worker with the arguments as they are (``UniProcExecutor``)."""

    def __init__(self, worker, in_process=False, executor=UniProcExecutor):
        self.worker = worker
        self.events = []
        self.payloads = []
        if in_process:
            self.llm_engine = types.SimpleNamespace(engine_core=InprocClient(executor()))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.events.append("rpc")
        self.payloads.append((method, args))
        if not runs_in_process(self):
            assert isinstance(method, str), f"collective_rpc got {method!r}, not a method name"
            _assert_msgpack_native((method, args, kwargs))
            args, kwargs = _untyped_roundtrip(list(args)), _untyped_roundtrip(kwargs)
        fn = getattr(self.worker, method) if isinstance(method, str) else (lambda *a, **k: method(self.worker, *a, **k))
        return [fn(*args, **kwargs)]

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")
        return True


def _perturbed(model, seed):
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return out


def _assert_same_weights(a, b, dtype=None):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        x = sa[k] if dtype is None else sa[k].to(dtype)
        assert torch.equal(x, sb[k]), k


# ---- import guard -----------------------------------------------------------------------------------


def test_clear_error_without_vllm(tokenizer, monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    with pytest.raises(ImportError, match="CRL_EXTRAS=vllm"):
        VLLMEngine("unused", tokenizer)


# ---- weight sync ------------------------------------------------------------------------------------


def test_the_payload_check_rejects_the_old_weight_sync(tiny_model):
    """A weight sync that sent a function and the state dict's tensors fails the check the weight-sync
    tests apply, as vLLM's multiprocessing engine refuses it."""
    def _load_weights(worker, weights):
        worker.model_runner.model.load_weights(weights=weights)

    old = [(k, v.detach()) for k, v in tiny_model.state_dict().items()]
    with pytest.raises(AssertionError, match="function"):
        _assert_msgpack_native((_load_weights, (old,), {}))
    with pytest.raises(AssertionError, match="Tensor"):
        _assert_msgpack_native(("crl_load_weights", (old,), {}))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sync_weights_sends_msgpack_native_chunks_and_the_worker_ends_with_the_trainers_weights(tiny_model, tokenizer,
                                                                                              dtype):
    tdtype = getattr(torch, dtype)
    trainer = _perturbed(tiny_model, 1)
    served = copy.deepcopy(tiny_model).to(tdtype)          # vLLM's copy: the initial weights, engine dtype
    llm = _FakeLLM(_make_worker(served))
    eng = VLLMEngine("unused", tokenizer, dtype=dtype, sync_chunk_mb=1, llm=llm)
    assert not eng.in_process
    eng.sync_weights(trainer)

    _assert_same_weights(trainer, served, tdtype)
    assert llm.events[-1] == "reset_prefix_cache" and llm.events.count("reset_prefix_cache") == 1
    assert llm.payloads[-1] == (FINISH_METHOD, ())                     # a sync ends with one finish call
    assert len(llm.payloads) > 2                                          # chunked
    sent = []
    for method, args in llm.payloads[:-1]:
        assert method == SYNC_METHOD and isinstance(method, str)
        (chunk,) = args
        assert chunk["format"] == "bytes"
        sizes = [len(data) for _name, _dt, _shape, data in chunk["tensors"]]
        assert sum(sizes) <= 2**20 or len(sizes) == 1                   # bounded, or one large tensor alone
        assert all(dt == dtype for _n, dt, _s, _d in chunk["tensors"])
        sent += [name for name, *_ in chunk["tensors"]]
    assert sent == list(trainer.state_dict())                              # every tensor once, in order


def test_sync_weights_in_process_passes_tensors_without_serialising(tiny_model, tokenizer):
    trainer = _perturbed(tiny_model, 2)
    served = copy.deepcopy(tiny_model).to(torch.bfloat16)
    llm = _FakeLLM(_make_worker(served), in_process=True)
    eng = VLLMEngine("unused", tokenizer, dtype="bfloat16", llm=llm)
    assert eng.in_process
    eng.sync_weights(trainer)
    _assert_same_weights(trainer, served, torch.bfloat16)
    assert llm.payloads[-1] == (FINISH_METHOD, ())
    for method, (chunk,) in llm.payloads[:-1]:
        assert method == SYNC_METHOD and chunk["format"] == "tensors"
        assert all(t.dtype == torch.bfloat16 for _n, t in chunk["weights"])
    assert llm.events[-1] == "reset_prefix_cache"


def test_only_the_in_process_client_with_a_uniproc_executor_counts_as_in_process(tiny_model):
    worker = _make_worker(tiny_model)
    assert runs_in_process(_FakeLLM(worker, in_process=True))
    assert not runs_in_process(_FakeLLM(worker, in_process=True, executor=MultiprocExecutor))
    assert not runs_in_process(_FakeLLM(worker))
    assert not runs_in_process(object())


def test_a_worker_reporting_fewer_tensors_is_an_error(tiny_model, tokenizer):
    llm = _FakeLLM(_make_worker(copy.deepcopy(tiny_model)))
    llm.collective_rpc = lambda method, timeout=None, args=(), kwargs=None: [0]     # for every chunk
    with pytest.raises(RuntimeError, match="loaded"):
        VLLMEngine("unused", tokenizer, dtype="float32", llm=llm).sync_weights(tiny_model)


def test_weight_chunks_are_bounded_and_cover_the_state_once():
    state = {f"w{i}": torch.zeros(n) for i, n in enumerate([10, 30, 5, 100, 1, 1, 60])}
    chunks = list(weight_chunks(state, itemsize=4, max_bytes=160))      # 40 elements a chunk
    assert [[n for n, _ in c] for c in chunks] == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5"], ["w6"]]
    with pytest.raises(ValueError):
        list(weight_chunks(state, itemsize=4, max_bytes=0))
    # an integer buffer counts its own element size (8 bytes), not the engine dtype's
    mixed = {"a": torch.zeros(20), "ids": torch.zeros(10, dtype=torch.int64), "b": torch.zeros(20)}
    assert [[n for n, _ in c] for c in weight_chunks(mixed, itemsize=2, max_bytes=100)] == [["a"], ["ids"], ["b"]]


def test_pack_and_unpack_round_trip_every_dtype_and_shape():
    weights = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)), ("scalar", torch.tensor(2.5)),
               ("empty", torch.zeros(0, 3)), ("strided", torch.randn(4, 6)[:, ::2]),
               ("int_buffer", torch.arange(3)), ("mask", torch.tensor([True, False]))]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        chunk = _untyped_roundtrip(pack_weights(weights, dtype))
        _assert_msgpack_native(chunk)
        back = unpack_weights(chunk)
        assert [n for n, _ in back] == [n for n, _ in weights]
        for (_, t), (_, u) in zip(weights, back):
            want = t.to(dtype) if t.is_floating_point() else t          # integer and bool buffers keep theirs
            assert u.dtype == want.dtype and u.shape == t.shape and torch.equal(u, want)


def test_unpack_rejects_malformed_chunks():
    chunk = pack_weights([("w", torch.zeros(4))], torch.float32)
    bad = copy.deepcopy(chunk)
    bad["tensors"][0][3] = bad["tensors"][0][3][:-1]
    with pytest.raises(ValueError, match="bytes"):
        unpack_weights(bad)
    bad = copy.deepcopy(chunk)
    bad["tensors"][0][1] = "no_such_dtype"
    with pytest.raises(ValueError, match="dtype"):
        unpack_weights(bad)
    with pytest.raises(ValueError, match="format"):
        unpack_weights({"format": "pickle"})


# ---- constrained-reply budget ------------------------------------------------------------------------


def test_constrained_budget_fits_a_byte_by_byte_tokenisation(tokenizer):
    """vLLM's choice grammar accepts any tokenisation of an allowed reply; the most tokens one can take
    is one per byte (byte-level BPE has a token per byte), which the budget fits with its EOS, where a budget of the
    canonical tokenisation's length would not."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_token = bytes_to_unicode()
    for reply in ["<answer>north</answer>", "café</answer>", "go → east</answer>"]:
        canonical = tokenizer.encode(reply, add_special_tokens=False)
        per_byte = tokenizer.convert_tokens_to_ids([byte_token[b] for b in reply.encode("utf-8")])
        assert tokenizer.unk_token_id not in per_byte and tokenizer.decode(per_byte) == reply
        budget = sampling_kwargs(SamplingParams(max_new_tokens=4), [reply, "up</answer>"])["max_tokens"]
        assert budget == len(per_byte) + 1
        assert len(canonical) + 1 < len(per_byte) + 1 <= budget


def test_budget_never_below_the_cap_and_free_prompts_keep_it():
    assert constrained_budget(["up"], 24) == 24
    assert constrained_budget(["up", "down</answer>"], 4) == len("down</answer>") + 1
    kw = sampling_kwargs(SamplingParams(max_new_tokens=7, top_k=0, temperature=0.0), None)
    assert kw["max_tokens"] == 7 and kw["top_k"] == -1 and kw["temperature"] == 0.0 and kw["logprobs"] == 0
    assert kw["include_stop_str_in_output"] and kw["stop"] == ["</answer>"]


# ---- generation (vLLM's outputs stood in for) --------------------------------------------------------


def _completion(ids, lps, text, finish_reason="stop", stop_reason="</answer>"):
    logprobs = [{t: types.SimpleNamespace(logprob=lp)} for t, lp in zip(ids, lps)]
    return types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, logprobs=logprobs, text=text,
                                                                finish_reason=finish_reason,
                                                                stop_reason=stop_reason)])


def test_generate_marks_masked_logprobs_and_maps_finish_reasons(tokenizer, monkeypatch):
    calls = []

    class _GenLLM:
        def generate(self, reqs, sampling_params, use_tqdm):
            calls.append((reqs, sampling_params))
            return [_completion([5, 6], [-0.5, -0.1], "up</answer>"),
                    _completion([7], [-2.0], "x", finish_reason="length", stop_reason=None),
                    _completion([8], [-0.3], "y", stop_reason=None)]

    eng = VLLMEngine("unused", tokenizer, dtype="float32", llm=_GenLLM())
    monkeypatch.setattr(eng, "_params", lambda params, choice: {"choice": choice, **sampling_kwargs(params, choice)})
    gens = eng.generate([[1], [2], [3], [4]], SamplingParams(max_new_tokens=3),
                        [["up</answer>", "down</answer>"], None, [], None])
    (reqs, sps), = calls
    assert reqs == [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2]}, {"prompt_token_ids": [4]}]
    assert sps[0]["max_tokens"] == len("down</answer>") + 1 and sps[1]["max_tokens"] == 3
    assert [g.finish_reason for g in gens] == ["stop", "length", "eos", "eos"]
    assert [g.extra["logprobs_kind"] for g in gens] == ["masked", "raw", "masked", "raw"]
    assert gens[0].logprobs == [-0.5, -0.1] and gens[0].response_ids == [5, 6]
    assert gens[2].response_ids == [] and gens[2].prompt_ids == [3]
    with pytest.raises(ValueError, match="entries"):
        eng.generate([[1]], SamplingParams(), [None, None])


# ---- settings ---------------------------------------------------------------------------------------


def test_vllm_settings_are_validated_naming_the_key():
    cfg = build_config([])
    assert cfg.generation.vllm_gpu_memory_utilization == 0.5 and cfg.generation.vllm_seed is None
    gen = build_config([{"generation": {"vllm_gpu_memory_utilization": 0.9, "vllm_seed": 3}}]).generation
    assert gen.vllm_gpu_memory_utilization == 0.9 and gen.vllm_seed == 3
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="generation.vllm_gpu_memory_utilization"):
            build_config([{"generation": {"vllm_gpu_memory_utilization": bad}}])
    with pytest.raises(ConfigError, match="generation.vllm_seed"):
        build_config([{"generation": {"vllm_seed": "seven"}}])
    with pytest.raises(ConfigError, match="train.recompute_old_logprobs"):
        build_config([{"generation": {"engine": "vllm"}, "train": {"recompute_old_logprobs": False}}])
    with pytest.raises(ConfigError, match="model.lora"):
        build_config([{"generation": {"engine": "vllm"}, "model": {"lora": True}}])


def test_engine_arguments_are_checked(tokenizer):
    llm = object()
    for bad in (0, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            VLLMEngine("unused", tokenizer, gpu_memory_utilization=bad, llm=llm)
    with pytest.raises(ValueError, match="dtype"):
        VLLMEngine("unused", tokenizer, dtype="auto", llm=llm)
    with pytest.raises(ValueError, match="sync_chunk_mb"):
        VLLMEngine("unused", tokenizer, sync_chunk_mb=0, llm=llm)


@pytest.mark.parametrize("vllm_seed, expected_seed", [(None, 5), (11, 11)])
def test_from_model_takes_the_settings_and_loads_the_trainers_weights(tiny_model, tokenizer, default_model_dir,
                                                                     monkeypatch, vllm_seed, expected_seed):
    served = copy.deepcopy(tiny_model)
    trainer = _perturbed(tiny_model, 3)
    built = {}

    def fake_build(model_path, dtype, gpu_memory_utilization, seed, in_process, enforce_eager, kv_cache_bytes,
                   limits=None):
        built.update(model_path=model_path, dtype=dtype, util=gpu_memory_utilization, seed=seed, in_process=in_process,
                     eager=enforce_eager, kv=kv_cache_bytes)
        assert limits == {}                     # vLLM's own defaults unless set
        return _FakeLLM(_make_worker(served))

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_engine, "vllm_on_cpu", lambda: True)
    monkeypatch.setattr(vllm_engine, "_build_llm", fake_build)
    gen = GenerationConfig(vllm_gpu_memory_utilization=0.7, vllm_seed=vllm_seed)
    eng = VLLMEngine.from_model(trainer, tokenizer, ModelConfig(dtype="float32"), gen, seed=5)
    # on vLLM's CPU backend: eager, and the KV cache sized explicitly (not from the memory share)
    assert built == dict(model_path=str(default_model_dir), dtype="float32", util=0.7, seed=expected_seed,
                         in_process=True, eager=True, kv=int(vllm_engine.CPU_KV_CACHE_GB * 2**30))
    gen = GenerationConfig(vllm_enforce_eager=False, vllm_kv_cache_gb=0.5)
    VLLMEngine.from_model(trainer, tokenizer, ModelConfig(dtype="float32"), gen, seed=5)
    assert built["eager"] is False and built["kv"] == 2**29
    _assert_same_weights(trainer, served)              # synced at construction
    assert eng.llm.events[-1] == "reset_prefix_cache"
    with pytest.raises(ValueError, match="lora"):
        VLLMEngine.from_model(trainer, tokenizer, ModelConfig(dtype="float32", lora=True), gen)


class _SleepyLLM(_FakeLLM):
    """A stand-in that also records vLLM's sleep mode calls and refuses to generate while asleep."""

    def __init__(self, worker):
        super().__init__(worker)
        self.asleep = False

    def sleep(self, level=1):
        assert level == 1 and not self.asleep
        self.events.append("sleep")
        self.asleep = True

    def wake_up(self, tags=None):
        self.events.append("wake_up")
        self.asleep = False

    def generate(self, reqs, sampling_params, use_tqdm):
        assert not self.asleep, "generate on a sleeping engine"
        self.events.append("generate")
        return [_completion([5], [-0.5], "up</answer>") for _ in reqs]


def test_engine_limits_and_sleep_mode_reach_vllm_and_the_extractors_own_settings_win(tiny_model, tokenizer,
                                                                                  monkeypatch):
    built = []

    def fake_build(model_path, dtype, gpu_memory_utilization, seed, in_process, enforce_eager, kv_cache_bytes,
                   limits=None):
        built.append(dict(util=gpu_memory_utilization, **(limits or {})))
        return _SleepyLLM(_make_worker(copy.deepcopy(tiny_model)))

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_engine, "_build_llm", fake_build)
    monkeypatch.setattr(vllm_engine, "vllm_on_cpu", lambda: False)         # a GPU build
    gen = GenerationConfig(vllm_max_model_len=32_768, vllm_max_num_seqs=64, vllm_sleep=True)
    VLLMEngine.from_model(tiny_model, tokenizer, ModelConfig(dtype="float32"), gen)
    assert built[-1] == dict(util=0.5, max_model_len=32_768, max_num_seqs=64, enable_sleep_mode=True)
    # the extractor's engine: its own share and length win over generation's, no sleep mode
    VLLMEngine.from_model(tiny_model, tokenizer, ModelConfig(dtype="float32"), gen, gpu_memory_utilization=0.2,
                          max_model_len=65_536, sleep_mode=False)
    assert built[-1] == dict(util=0.2, max_model_len=65_536, max_num_seqs=64)
    monkeypatch.setattr(vllm_engine, "vllm_on_cpu", lambda: True)          # vLLM's CPU backend: no sleep mode
    with pytest.raises(ValueError, match="sleep mode"):
        VLLMEngine.from_model(tiny_model, tokenizer, ModelConfig(dtype="float32"), gen)
    for bad in ({"max_model_len": 0}, {"max_num_seqs": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            VLLMEngine("unused", tokenizer, llm=_FakeLLM(None), **bad)


def test_a_sleeping_engine_wakes_before_it_generates_or_loads_weights(tiny_model, tokenizer, monkeypatch):
    llm = _SleepyLLM(_make_worker(copy.deepcopy(tiny_model)))
    eng = VLLMEngine("unused", tokenizer, dtype="float32", llm=llm, sleep_mode=True)
    monkeypatch.setattr(eng, "_params", lambda params, choice: sampling_kwargs(params, choice))
    eng.sleep()
    eng.sleep()                                            # already asleep: one call to vLLM
    eng.generate([[1]], SamplingParams(max_new_tokens=2))
    eng.sleep()
    eng.sync_weights(tiny_model)
    assert [e for e in llm.events if e != "rpc"] == ["sleep", "wake_up", "generate", "sleep", "wake_up",
                                                     "reset_prefix_cache"]
    plain = _SleepyLLM(_make_worker(copy.deepcopy(tiny_model)))
    eng = VLLMEngine("unused", tokenizer, dtype="float32", llm=plain)       # no sleep mode: sleep is a no-op
    eng.sleep()
    assert "sleep" not in plain.events


def test_engine_lengths_are_checked_against_the_rollout_and_the_extractor():
    cfg = build_config([{"generation": {"engine": "vllm", "vllm_max_model_len": 4096}}])
    assert cfg.generation.vllm_max_model_len == 4096 and cfg.extractor.vllm_max_model_len is None
    with pytest.raises(ConfigError, match="rollout.max_context_tokens"):
        build_config([{"generation": {"engine": "vllm", "vllm_max_model_len": 4096},
                       "rollout": {"max_context_tokens": 8192}}])
    with pytest.raises(ConfigError, match="extractor.vllm_max_model_len"):
        build_config([{"extractor": {"engine": "vllm", "vllm_max_model_len": 1000, "max_prompt_tokens": 1536}}])
    with pytest.raises(ConfigError, match="generation.vllm_max_model_len"):
        build_config([{"generation": {"vllm_max_model_len": 0}}])


def test_the_rollout_caps_episodes_at_the_vllm_engines_length(tiny_model):
    from crl_bench.trainer.loop import context_window, engine_context

    cfg = build_config([{"generation": {"engine": "vllm", "vllm_max_model_len": 300}}])
    assert engine_context(cfg, tiny_model) == 300
    assert engine_context(build_config([]), tiny_model) == context_window(tiny_model)


def test_an_engine_given_gpus_starts_out_of_process_on_exactly_those_tensor_parallel(tiny_model, tokenizer,
                                                                                  monkeypatch):
    import os

    seen = []

    def fake_build(model_path, dtype, gpu_memory_utilization, seed, in_process, enforce_eager, kv_cache_bytes,
                   limits=None):
        seen.append(dict(in_process=in_process, visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                         mp=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"), **(limits or {})))
        return _FakeLLM(_make_worker(copy.deepcopy(tiny_model)))

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_engine, "vllm_on_cpu", lambda: False)
    monkeypatch.setattr(vllm_engine, "_build_llm", fake_build)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")      # a user's in-process setting does not pin it
    VLLMEngine.from_model(tiny_model, tokenizer, ModelConfig(dtype="float32"), GenerationConfig(), gpus=[2, 3])
    assert seen[-1] == dict(in_process=False, visible="2,3", mp="1", tensor_parallel_size=2)
    # the variables are the engine process's only: this process's are as they were
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # indices are this process's: under CUDA_VISIBLE_DEVICES=4,5,6 its GPU 1 is the machine's 5
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    VLLMEngine.from_model(tiny_model, tokenizer, ModelConfig(dtype="float32"), GenerationConfig(), gpus=[1])
    assert seen[-1] == dict(in_process=False, visible="5", mp="1") and os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6"
    with pytest.raises(ValueError, match="GPU 3 is not visible"):
        VLLMEngine.from_model(tiny_model, tokenizer, ModelConfig(dtype="float32"), GenerationConfig(), gpus=[3])
    with pytest.raises(ValueError, match="distinct GPU indices"):
        VLLMEngine("unused", tokenizer, gpus=[1, 1])
    # without gpus: where in_process puts it, nothing set
    VLLMEngine.from_model(tiny_model, tokenizer, ModelConfig(dtype="float32"), GenerationConfig())
    assert seen[-1] == dict(in_process=True, visible="4,5,6", mp="0")
