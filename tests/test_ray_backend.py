"""The Ray backend (crl_bench/ray_backend.py) on a local Ray with 2 CPUs: a complementary smoke run
writes what the local backend writes, and a killed env actor fails only the episodes it hosted.

Ray clusters share the machine badly with each other: this module and the data-parallel tests form
one xdist group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from crl_bench.cli import main
from crl_bench.config import ConfigError, RayConfig, build_config
from crl_bench.llm.base import Generation, SamplingParams
from crl_bench.results.run_folder import read_metrics
from crl_bench.rollout import EpisodeSpec, PromptBuilder, RolloutRunner

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (2 logical CPUs, as on this project's CI machine). Its workers
    import the tests' helpers and extract through tests_helpers.LessonWriterEngine (the smoke run's
    manager actor: an extractor that writes a lesson per extraction, whatever the model)."""
    tests_dir = str(Path(__file__).resolve().parent)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": tests_dir},
                          "worker_process_setup_hook": "tests_helpers.install_lesson_writer"})
    yield
    ray.shutdown()


class FirstActionEngine:
    """Replies with the first allowed action; on its ``kill_at``-th call it kills env actor 0 first
    (mid-rollout: the episodes it hosts have taken steps and are not finished)."""

    def __init__(self, tokenizer, pool, kill_at: int = 2):
        self.tokenizer = tokenizer
        self.pool = pool
        self.calls = 0
        self.kill_at = kill_at

    def generate(self, prompts, params, allowed=None):
        self.calls += 1
        if self.calls == self.kill_at:
            ray.kill(self.pool.hosts[0])
        out = []
        for p, a in zip(prompts, allowed or [None] * len(prompts)):
            text = a[0] if a else "wait</answer>"
            out.append(Generation(list(p), [1], [-0.1], text, "stop"))
        return out

    def sync_weights(self, model):
        pass


@pytest.mark.slow
def test_a_killed_env_actor_fails_only_its_episodes_and_is_replaced(local_ray, tokenizer):
    from crl_bench.ray_backend import RayEnvPool

    pool = RayEnvPool({}, 6, RayConfig(env_actors=4, env_actor_cpus=0.25))
    engine = FirstActionEngine(tokenizer, pool)
    runner = RolloutRunner(engine, PromptBuilder(tokenizer), pool, SamplingParams(max_new_tokens=8))
    specs = [EpisodeSpec("minihack-room", t, group_id=t) for t in range(4)]
    try:
        trajs = runner.collect(specs)
        assert [bool(t.error) for t in trajs] == [True, False, False, False]       # one env per actor
        assert "Actor" in trajs[0].error and len(trajs[0].turns) >= 1       # it died mid-episode
        assert all(t.steps >= 2 and (t.terminated or t.truncated) for t in trajs[1:])
        assert pool.replaced == 1
        pids = ray.get([h.pid.remote() for h in pool.hosts])              # four live actors again
        assert len(set(pids)) == 4
        engine.kill_at = 0                                                 # no more kills
        again = runner.collect(specs)
        assert not any(t.error for t in again)
    finally:
        pool.close()


@pytest.mark.slow
def test_ray_smoke_run_writes_what_the_local_backend_writes(local_ray, tmp_path, tiny_model_dir, monkeypatch):
    """``crl-bench run --backend ray --method complementary --mix minihack-room --preset smoke``: the
    same run folder files, metric keys and eval blocks as the same run on the local backend. The tiny
    model acts and extracts; its extractor writes a lesson per extraction on both backends
    (tests_helpers.LessonWriterEngine), so the bank fills and guides step 2."""
    from tests_helpers import install_lesson_writer

    install_lesson_writer(monkeypatch)
    args = ["run", "--method", "complementary", "--mix", "minihack-room", "--preset", "smoke",
            "--output-dir", str(tmp_path), "--quiet", "--model", str(tiny_model_dir)]
    assert main(args + ["--run-id", "local"]) == 0
    assert main(args + ["--run-id", "ray", "--backend", "ray"]) == 0
    local, remote = tmp_path / "local", tmp_path / "ray"

    def files(run):
        return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()
                      and not p.name.startswith("experience.sqlite-"))      # WAL side files come and go
    assert files(remote) == files(local)
    cfg = build_config([yaml.safe_load((remote / "config.yaml").read_text())])
    assert cfg.backend == "ray"
    rows_l, rows_r = read_metrics(local), read_metrics(remote)
    assert [r["step"] for r in rows_r] == [r["step"] for r in rows_l] == [1, 2]
    assert [set(r) for r in rows_r] == [set(r) for r in rows_l]
    assert rows_r[-1]["bank_size"] > 0                          # the manager actor distilled into the bank
    assert rows_r[-1]["guided_with_experience"] > 0             # and step 2 retrieved from it
    ev_l, ev_r = (json.loads((d / "eval.json").read_text()) for d in (local, remote))
    assert set(ev_r) == set(ev_l) and ev_r["guided"]["episodes"] == ev_l["guided"]["episodes"] == 4
    # the task panel read from the env actors is the one the local envs give
    assert ev_r["protocol"]["panels"] == ev_l["protocol"]["panels"]
    assert set(ev_l["protocol"]["panels"]) == {"minihack-room"}


@pytest.mark.slow
def test_actors_that_do_not_fit_the_cluster_are_a_clear_error(local_ray):
    """Ray would wait forever for resources it does not have: the run says so instead."""
    from crl_bench.ray_backend import RayBackend

    cfg = build_config([{"backend": "ray", "method": "complementary", "ray": {"engine_cpus": 2}}])
    with pytest.raises(ConfigError, match=r"CPU 3 needed, 2 in the cluster.*ray.num_cpus"):
        RayBackend(cfg)


def test_backend_settings_are_validated():
    with pytest.raises(ConfigError, match="backend"):
        build_config([{"backend": "slurm"}])
    with pytest.raises(ConfigError, match="ray.env_actors"):
        build_config([{"backend": "ray", "ray": {"env_actors": 0}}])
    assert main(["run", "--resume", "/nonexistent", "--backend", "ray"]) == 2


def test_weights_go_to_actors_in_their_compute_dtype(tiny_model):
    """wire_state sends floating parameters in the receivers' compute dtype (half the bytes of float32
    for bf16 engines), leaves them as they are when the receivers differ or compute in float32."""
    import torch

    from crl_bench.llm.weights import trainable_state
    from crl_bench.ray_backend import _common_dtype, wire_state

    names = set(trainable_state(tiny_model))
    bf16 = wire_state(tiny_model, "bfloat16")
    assert set(bf16) == names and all(v.dtype == torch.bfloat16 for v in bf16.values())
    assert sum(v.nbytes for v in bf16.values()) * 2 == sum(v.nbytes for v in wire_state(tiny_model).values())
    assert all(v.dtype == torch.float32 for v in wire_state(tiny_model, "float32").values())
    assert all(v.dtype == torch.float32 for v in wire_state(tiny_model, None).values())
    assert _common_dtype(["bfloat16", "bfloat16"]) == "bfloat16"
    assert _common_dtype(["bfloat16", "float32"]) is None and _common_dtype([]) is None


def test_sending_the_compute_dtype_changes_nothing_the_engine_generates_from(tiny_model, tokenizer):
    """An engine host (float32 copy, bf16 generation copy) loaded from bf16 wire weights holds the same
    bf16 generation weights, bit for bit, as one loaded from the float32 master weights."""
    import copy

    import torch

    from crl_bench.llm.hf_engine import HFEngine
    from crl_bench.llm.weights import load_trainable
    from crl_bench.ray_backend import wire_state

    trainer = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in trainer.parameters():        # "trained": values with bits below bf16's precision
            p.add_(torch.randn_like(p) * 1e-3)
    engines = []
    for dtype in (None, "bfloat16"):
        host = copy.deepcopy(tiny_model)
        engine = HFEngine(host, tokenizer, compute_dtype=torch.bfloat16)
        engine.sync_weights(host)
        load_trainable(host, wire_state(trainer, dtype), "engine weights")
        engine.sync_weights(host)
        engines.append(engine)
    full, wire = ([p for p in e.generator.parameters()] for e in engines)
    assert all(p.dtype == torch.bfloat16 for p in full)
    assert all(torch.equal(a, b) for a, b in zip(full, wire))
    assert not torch.equal(full[0].float(), trainer.get_input_embeddings().weight)   # the cast did round


def test_sync_bench_alternates_the_two_wire_dtypes_and_restores_the_run_one(tiny_model):
    import torch

    from crl_bench.bench.backend import bench_sync
    from crl_bench.ray_backend import wire_state

    class Recording:
        def __init__(self):
            self.wire_dtype = "bfloat16"
            self.sent = []

        def sync_weights(self, model):
            self.sent.append(next(iter(wire_state(model, self.wire_dtype).values())).dtype)

    eng = Recording()
    res = bench_sync(eng, tiny_model, repeats=2)
    assert eng.sent == [torch.bfloat16, torch.float32] * 2 + [torch.bfloat16]   # the last: back to the run's
    assert eng.wire_dtype == "bfloat16" and res["wire_dtype"] == "bfloat16"
    assert res["mb"]["float32"] == pytest.approx(2 * res["mb"]["compute_dtype"])
    assert res["compute_dtype_s"] > 0 and res["float32_s"] > 0


def _manager_host(tmp_path, method, monkeypatch=None):
    """The body of a ``method`` run's manager actor, built in this process on the smoke preset; with
    ``monkeypatch``, loading model weights raises (the methods that must not load any)."""
    import torch

    from crl_bench.config import preset_data
    from crl_bench.ray_backend import ManagerHost

    if monkeypatch is not None:
        import crl_bench.llm.hf_engine as hf

        def no_model(*a, **k):
            raise AssertionError(f"a {method} manager loads no model")

        monkeypatch.setattr(hf, "load_model_and_tokenizer", no_model)
    cfg = build_config([preset_data("smoke"), {"method": method, "rollout": {"mix": "minihack-room"}}])
    threads = torch.get_num_threads()
    try:
        return ManagerHost(cfg.to_dict(), str(tmp_path / "experience.sqlite"), None, False, 1.0)
    finally:
        torch.set_num_threads(threads)       # the actor body sets its own thread count



def test_case_bank_manager_actor_loads_no_model(tmp_path, monkeypatch):
    """The manager actor of a ``casebank`` run writes cases with the actor's tokenizer and loads no
    model weights (the body of the actor, built in this process)."""
    from crl_bench.experience.cases import CaseWriter

    host = _manager_host(tmp_path, "casebank", monkeypatch)
    try:
        assert host.model is None and isinstance(host.manager.extractor, CaseWriter)
        assert host.manager.extractor.tokenizer.chat_template
    finally:
        host.close()


def test_expel_manager_actor_loads_the_frozen_extractor(tmp_path):
    """The manager actor of an ``expel`` run loads the extractor model (frozen, in the compute
    dtype) and keeps the insight lists, which the driver's handle reads through ``insights``."""
    from crl_bench.experience.insights import InsightOp, InsightWriter

    host = _manager_host(tmp_path, "expel")
    try:
        assert isinstance(host.manager.extractor, InsightWriter) and host.model is not None
        assert not any(p.requires_grad for p in host.model.parameters())
        host.manager.bank.apply_insights([InsightOp("ADD", 0, "Walk to the stairs.")], [], env_id="minihack-room",
                                         step=1, call_id="c")
        got = host.run("insights", ["minihack-room"])
        assert [i.text for i in got["minihack-room"]] == ["Walk to the stairs."]
    finally:
        host.close()


def test_reflexion_manager_actor_keeps_reflections_per_task(tmp_path, monkeypatch):
    """The manager actor of a ``reflexion`` run loads no model and stores and serves the reflections
    the driver's actor writes (the calls the driver's handle makes)."""
    host = _manager_host(tmp_path, "reflexion", monkeypatch)
    try:
        assert host.model is None and host.manager.extractor is None
        host.run("add_reflections", [("minihack-room", 3, "Go north first.", 1), ("minihack-room", 4, "x y", 1)])
        assert host.run("reflections", "minihack-room", 3, 3) == ["Go north first."]
        assert host.run("stats")["reflections"] == 2
    finally:
        host.close()


def _remote_sokoban(max_steps: int):
    """A :class:`RemoteEnv` of sokoban whose actor is an :class:`EnvHost` run in place (its methods as a
    Ray handle sees them, ``.remote`` calling them directly), and that host."""
    from crl_bench.ray_backend import EnvHost, RemoteEnv

    class Call:
        def __init__(self, fn):
            self.remote = fn

    class Host:
        def __init__(self, host):
            for name in ("reset", "step", "call"):
                setattr(self, name, Call(getattr(host, name)))

    inner = EnvHost({}, max_steps)
    env = RemoteEnv(Host(inner), 0, 0, "sokoban", inner.open(0, "sokoban"))
    env._get = lambda value: value
    return env, inner


def test_remote_env_asks_its_actor_for_the_query_of_a_later_observation():
    """Turn-level retrieval queries the current state: after the reset observation, the remote env asks
    the env in its actor, as a local env answers (without this every turn got the reset query)."""
    from crl_bench.env_api import make_env

    env, _ = _remote_sokoban(0)
    local = make_env("sokoban")
    obs, _ = env.reset(options={"task": 3})
    lobs, _ = local.reset(options={"task": 3})
    assert env.retrieval_query(obs) == local.retrieval_query(lobs)
    action = local.admissible_actions()[0]
    obs2, *_ = env.step(action)
    lobs2, *_ = local.step(action)
    assert obs2 == lobs2 and obs2 != obs
    assert env.retrieval_query(obs2) == local.retrieval_query(lobs2) != local.retrieval_query(lobs)


def test_remote_env_passes_an_episode_limit_to_its_actor():
    """An evaluation's action limit (``eval.max_steps``) reaches the env in the actor as the reset option,
    and the next reset without it has the env's own limit again."""
    env, inner = _remote_sokoban(2)
    env.reset(options={"task": 3, "max_steps": 5})
    assert inner.envs[0].episode_max_steps == 5 and env.episode_max_steps == 5
    env.reset(options={"task": 3})
    assert inner.envs[0].episode_max_steps == 2 and env.episode_max_steps == 2


def test_the_manager_actor_asks_for_its_gpus_on_a_gpu_cluster(monkeypatch, tmp_path):
    # without ray.manager_gpus Ray hides every GPU from the manager, so the extractor and the embedder run
    # on its CPUs; with it, the actor declares them and the cluster's resources count them
    from crl_bench import ray_backend
    from crl_bench.ray_backend import RayBackend

    seen = []

    class Host:
        def options(self, **opts):
            seen.append(opts)
            return self

        def remote(self, *args):
            return "host"

    monkeypatch.setattr(ray_backend, "_remote", lambda cls: Host())
    monkeypatch.setattr(ray_backend, "_driver_node_affinity", lambda: "driver")
    monkeypatch.setattr(ray_backend, "RemoteManager", lambda host: host)
    for gpus, manager_gpus, expected in ((True, 1.0, 1.0), (True, 0.0, None), (False, 1.0, None)):
        backend = object.__new__(RayBackend)
        backend.cfg = build_config([{"backend": "ray", "method": "complementary",
                                     "ray": {"manager_gpus": manager_gpus}}])
        backend.gpus, backend._actors = gpus, []
        backend.experience_manager(tmp_path / "bank.sqlite")
        assert seen[-1].get("num_gpus") == expected and seen[-1]["num_cpus"] == 0.5
        need = backend.needed_resources()
        assert need.get("GPU", 0) == (1.0 if gpus else 0) + (expected or 0)     # one engine GPU, and its own
