"""The Ray backend: ``crl-bench run --backend ray`` (config ``backend: ray``, section ``ray``).

The driver process (``crl-bench run``) runs the same training loop as the local backend
(:class:`~crl_bench.trainer.loop.Trainer`: env -> rollout -> trajectory -> advantage -> loss) and
keeps what is trained: the actor's weights and AdamW state and, for ``complementary``, the
extractor's trainable copy and its CISPO optimiser. Three parts move into Ray actors, each behind
the interface the loop already uses, so the loop does not know where they run:

==================  =====================================================  ==========================
part                Ray actor (resources)                                  seen by the loop as
==================  =====================================================  ==========================
environments        ``ray.env_actors`` :class:`EnvHost` actors             :class:`RayEnvPool` of
                    (``env_actor_cpus`` CPUs each)                         :class:`RemoteEnv` (an
                                                                           ``EnvPool`` of ``TextEnv``)
rollout engine(s)   ``ray.engines`` :class:`EngineHost` actors (one GPU    :class:`RemoteEngine` (an
                    each, ``engine_gpus``, when the cluster has GPUs;      ``Engine``)
                    else ``engine_cpus`` CPUs)
experience manager  one :class:`ManagerHost` actor (``manager_cpus``),     :class:`RemoteManager` (an
                    on the driver's node: bank (SQLite in the run folder   ``ExperienceManager``)
                    + FAISS), embedder, retrieval, distillation
==================  =====================================================  ==========================

After each actor update the driver sends the trainable parameters (all weights, or the LoRA
adapters) to every engine through Ray's object store (``ray.put`` once, in the engines' compute dtype,
which is lossless as they generate in it; each engine copies them into its model: the transformers
engine's weight-update path); after each CISPO update it sends the
extractor's to the manager actor. Env episodes stay independent: an env actor that dies (killed,
out of memory) fails the episodes it hosted as env errors, as a crashed env does locally, and is
replaced by a new actor on the next episode.

Ray is started by :func:`init_ray`: it joins ``ray.address`` (or ``RAY_ADDRESS``) when given,
otherwise starts a local Ray with ``ray.num_cpus`` logical CPUs (default: the machine's). Every
node of a cluster needs the same crl-bench installation (``install.sh``); the driver forwards its
data, cache and offline settings (:data:`FORWARDED_ENV`) to the workers. The run folder, metrics,
checkpoints and results are those of the local backend. Not restored by ``--resume`` on this
backend: the engine actors' sampling generators (a resumed Ray run continues from the checkpoint's
weights, optimisers, sampler, buffers and bank, but its samples are not bit-identical to an
uninterrupted run's).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from crl_bench.config import RayConfig, RunConfig, build_config
from crl_bench.llm.base import Generation, SamplingParams
from crl_bench.rollout import EnvPool

#: environment variables the driver hands to every Ray worker (data and model locations, offline mode)
FORWARDED_ENV = ("CRL_BENCH_DATA", "CRL_BENCH_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                 "TOKENIZERS_PARALLELISM")


def ray_available() -> bool:
    """Whether the ``ray`` package (extra ``[ray]``) can be imported here."""
    try:
        import ray  # noqa: F401 - only checks that Ray is installed
    except ImportError:
        return False
    return True


def init_ray(rc: RayConfig) -> dict[str, Any]:
    """Connect to Ray once per process: ``rc.address`` (else ``RAY_ADDRESS``) joins a running cluster,
    otherwise a local Ray starts with ``rc.num_cpus`` logical CPUs (0: the machine's cores). A Ray
    already initialised in this process (tests, notebooks) is used as it is.

    Returns ``ray.cluster_resources()`` (e.g. ``{"CPU": 2.0, ...}``).

    Raises:
        ImportError: Ray is not installed (names the extra).
        ConfigError: the address does not answer, or refuses this process's authentication.
    """
    if not ray_available():
        raise ImportError("backend=ray needs Ray: pip install 'crl-bench[ray]' (or CRL_EXTRAS=ray bash install.sh)")
    import ray

    if not ray.is_initialized():
        env_vars = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "runtime_env": {"env_vars": env_vars} if env_vars else None}
        address = rc.address or os.environ.get("RAY_ADDRESS") or None
        if address:
            try:
                ray.init(address=address, **kwargs)
            except ConnectionError as e:
                from crl_bench.config import ConfigError

                raise ConfigError(f"cannot join the Ray cluster at {address!r} (ray.address / --ray-address / "
                                  f"RAY_ADDRESS): {e}. Is it running (`ray status`), and do this process and the "
                                  "cluster agree on RAY_AUTH_MODE and its token (~/.ray/auth_token)?") from None
        else:
            ray.init(num_cpus=rc.num_cpus or os.cpu_count() or 1, **kwargs)
    return dict(ray.cluster_resources())


def _driver_node_affinity() -> Any:
    """A scheduling strategy that pins an actor to the driver's node (where the run folder is)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


@functools.cache
def _remote(cls: type) -> Any:
    """``ray.remote(cls)``, made once per class and process."""
    import ray

    return ray.remote(cls)


def _threads(cpus: float) -> int:
    """torch threads of an actor that declared ``cpus`` CPUs (at least 1)."""
    import torch

    n = max(1, int(cpus))
    torch.set_num_threads(n)
    return n


def wire_state(model: Any, dtype: str | None = None) -> dict[str, Any]:
    """``model``'s trainable parameters (:func:`~crl_bench.llm.weights.trainable_state` names) as
    CPU tensors to send to actors, floating-point ones cast to ``dtype`` where that is narrower.

    The actors that receive them (:class:`EngineHost`, :class:`ManagerHost`) generate from a copy cast to
    their compute dtype, so sending that dtype changes nothing they compute (float32 -> bf16 -> float32
    -> bf16 gives the bf16 of the first cast) and halves the bytes through the object store.

    Args:
        model: the trainer's model (float32 master weights, or LoRA adapters).
        dtype: the receivers' compute dtype name (``float32`` | ``bfloat16`` | ``float16``), or ``None``
            to send the parameters' own dtype.

    Returns:
        name -> tensor; integer tensors and tensors already as narrow as ``dtype`` are sent as they are.
    """
    import torch

    from crl_bench.llm.precision import DTYPES
    from crl_bench.llm.weights import trainable_state

    to = DTYPES[dtype] if dtype is not None else None
    out = {}
    for k, v in trainable_state(model).items():
        v = v.detach().cpu()
        if to is not None and v.is_floating_point() and torch.finfo(to).bits < torch.finfo(v.dtype).bits:
            v = v.to(to)
        out[k] = v
    return out


def short_resources(need: dict[str, float], have: dict[str, float]) -> dict[str, tuple[float, float]]:
    """The resources of ``need`` (e.g. ``{"CPU": 2.0, "GPU": 0.0}``) that ``have`` (Ray's
    ``cluster_resources()`` or ``available_resources()``) cannot cover, as ``{name: (needed, have)}``."""
    return {k: (v, have.get(k, 0.0)) for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}


def _common_dtype(names: Sequence[str]) -> str | None:
    """The one compute dtype all receivers share, or ``None`` (send as is) when they differ."""
    return names[0] if names and len(set(names)) == 1 else None


# ---- environments ---------------------------------------------------------------------------------
class EnvHost:
    """Ray actor body: environment instances of one run in one worker process, by slot number.

    Each slot holds one :class:`~crl_bench.env_api.TextEnv` made with the run's settings (an
    :class:`~crl_bench.rollout.EnvPool` inside the actor). Calls return what the driver's
    :class:`RemoteEnv` needs for the next prompt, so a turn costs one round trip per env.

    Args:
        env_kwargs: ``rollout.env_kwargs``.
        max_steps: ``rollout.max_steps``.
        cpus: CPUs the actor declared (torch threads).
    """

    def __init__(self, env_kwargs: dict, max_steps: int, cpus: float = 1.0) -> None:
        _threads(cpus)
        self.pool = EnvPool(env_kwargs, max_steps)
        self.envs: dict[int, Any] = {}

    def open(self, slot: int, env_id: str) -> dict[str, Any]:
        """Make an env of ``env_id`` in ``slot``; returns its fixed attributes (system prompt, reply
        format, step limit). Raises what :func:`~crl_bench.env_api.make_env` raises."""
        env = self.pool.make(env_id)
        self.envs[slot] = env
        return {"system_prompt": env.system_prompt, "reply_format": env.reply_format,
                "max_steps": int(env.max_steps), "prefetch_resets": True,
                "has_entry_key": bool(getattr(env, "has_entry_key", False))}

    def reset(self, slot: int, task: int, max_steps: int | None = None) -> tuple[str, dict, dict]:
        """Reset ``slot`` to ``task`` (with the episode's action limit ``max_steps``, default the env's):
        ``(observation, info, view)``; ``view`` holds the task line, the retrieval query of the first
        observation and the admissible actions."""
        env = self.envs[slot]
        obs, info = env.reset(options={"task": int(task), **({} if max_steps is None else {"max_steps": max_steps})})
        return obs, info, {"task_prompt": env.task_prompt(), "retrieval_query": env.retrieval_query(obs),
                           "admissible_actions": env.admissible_actions()}

    def step(self, slot: int, reply: str) -> tuple[str, float, bool, bool, dict, dict]:
        """Step ``slot`` with the actor's reply: gymnasium's five values plus ``view`` (the admissible
        actions of the new state)."""
        env = self.envs[slot]
        obs, r, term, trunc, info = env.step(reply)
        return obs, r, term, trunc, info, {"admissible_actions": None if term or trunc else env.admissible_actions()}

    def call(self, slot: int, name: str, *args: Any) -> Any:
        """Any other ``TextEnv`` method of ``slot`` (task ids, weights, types, data files)."""
        return getattr(self.envs[slot], name)(*args)

    def close(self, slot: int) -> None:
        """Close and forget ``slot`` (best effort)."""
        env = self.envs.pop(slot, None)
        if env is not None:
            self.pool.discard(env)

    def pid(self) -> int:
        """The actor's process id (liveness probe; tests kill it)."""
        return os.getpid()


class RemoteEnv:
    """The driver's handle of one env living in an :class:`EnvHost` actor: the methods the rollout
    loop and the trainer call on a :class:`~crl_bench.env_api.TextEnv` (``reset_async``/``reset_wait``,
    ``step_async``/``step_wait``, ``task_prompt``, ``retrieval_query``, ``admissible_actions``, task
    splits), each a Ray call or a value the last call brought back.

    Errors of the env or of its actor (``ray.exceptions.RayActorError`` when the actor died) are raised
    by ``reset_wait`` / ``step_wait``, where the rollout loop fails the episode."""

    def __init__(self, host: Any, host_index: int, slot: int, env_id: str, desc: dict[str, Any]) -> None:
        self.host, self.host_index, self.slot, self.env_id = host, host_index, slot, env_id
        self.system_prompt = desc["system_prompt"]
        self.reply_format = desc["reply_format"]
        self.max_steps = desc["max_steps"]
        self.episode_max_steps = self.max_steps
        self.prefetch_resets = desc["prefetch_resets"]     # every remote reset overlaps the driver's work
        self.has_entry_key = desc.get("has_entry_key", False)
        self._pending: Any = None
        self._view: dict[str, Any] = {}
        self._reset_obs: str | None = None

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref)

    def reset_async(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        opts = options or {}
        self.episode_max_steps = int(opts.get("max_steps") or self.max_steps)   # as TextEnv.episode_max_steps
        self._pending = self.host.reset.remote(self.slot, int(opts["task"]), opts.get("max_steps"))

    def reset_wait(self) -> tuple[str, dict[str, Any]]:
        ref, self._pending = self._pending, None
        obs, info, self._view = self._get(ref)
        self._reset_obs = obs
        return obs, info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def step_async(self, action: str) -> None:
        self._pending = self.host.step.remote(self.slot, action)

    def step_wait(self) -> tuple[str, float, bool, bool, dict[str, Any]]:
        ref, self._pending = self._pending, None
        obs, r, term, trunc, info, view = self._get(ref)
        self._view.update(view)
        return obs, r, term, trunc, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.step_async(action)
        return self.step_wait()

    def task_prompt(self) -> str:
        return self._view["task_prompt"]

    def retrieval_query(self, observation: str) -> str:
        """The env's query for ``observation``: the one the reset brought back for the reset
        observation, else asked of the env in its actor (turn-level retrieval queries the current
        state, which only the env holds)."""
        if observation == self._reset_obs:
            return self._view["retrieval_query"]
        return self._get(self.host.call.remote(self.slot, "retrieval_query", observation))

    def admissible_actions(self) -> list[str] | None:
        return self._view.get("admissible_actions")

    def entry_key(self, first_turn_acted: bool) -> str | None:
        return self._get(self.host.call.remote(self.slot, "entry_key", first_turn_acted)) \
            if self.has_entry_key else None

    def task_ids(self, split: str) -> Sequence[int]:
        return self._get(self.host.call.remote(self.slot, "task_ids", split))

    def task_weights(self, split: str) -> Sequence[float] | None:
        return self._get(self.host.call.remote(self.slot, "task_weights", split))

    def task_type(self, task: int) -> str | None:
        return self._get(self.host.call.remote(self.slot, "task_type", task))

    def context(self, task: int) -> str | None:
        return self._get(self.host.call.remote(self.slot, "context", task))

    def data_files(self) -> dict[str, Path]:
        return self._get(self.host.call.remote(self.slot, "data_files"))

    def task_fingerprint(self, task: int) -> dict[str, Any]:
        return self._get(self.host.call.remote(self.slot, "task_fingerprint", task))

    def close(self) -> None:
        with contextlib.suppress(Exception):       # the actor may be gone: nothing left to close
            self.host.close.remote(self.slot)


class RayEnvPool(EnvPool):
    """An :class:`~crl_bench.rollout.EnvPool` whose envs live in ``ray.env_actors`` :class:`EnvHost`
    actors (new envs go to the actor hosting the fewest). A dead actor is detected when an episode
    on it fails (:meth:`discard`): it is replaced by a new actor, and the idle envs it hosted are
    dropped, so only the episodes it was running are lost.

    Args:
        env_kwargs, max_steps: as :class:`~crl_bench.rollout.EnvPool`.
        rc: the ``ray`` section (actor count and CPUs).
    """

    def __init__(self, env_kwargs: dict | None, max_steps: int, rc: RayConfig) -> None:
        super().__init__(env_kwargs, max_steps)
        self.rc = rc
        self.hosts: list[Any] = [self._new_host() for _ in range(rc.env_actors)]
        self.load = [0] * rc.env_actors
        self._slot = 0
        self.replaced = 0

    def _new_host(self) -> Any:

        actor = _remote(EnvHost).options(num_cpus=self.rc.env_actor_cpus, max_restarts=0)
        return actor.remote(self.env_kwargs, self.max_steps, self.rc.env_actor_cpus)

    def make(self, env_id: str) -> RemoteEnv:
        """A new env of ``env_id`` in the least loaded env actor."""
        import ray

        index = min(range(len(self.hosts)), key=lambda i: self.load[i])
        self._slot += 1
        host = self.hosts[index]
        desc = ray.get(host.open.remote(self._slot, env_id))
        self.load[index] += 1
        return RemoteEnv(host, index, self._slot, env_id, desc)

    def _alive(self, index: int) -> bool:
        import ray

        try:
            ray.get(self.hosts[index].pid.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False
        return True

    def discard(self, env: Any) -> None:
        """Drop a failed env; if its actor died, replace the actor and forget the idle envs it hosted."""
        if not isinstance(env, RemoteEnv):
            return super().discard(env)
        index = env.host_index
        if self.hosts[index] is not env.host:             # its actor was replaced already
            return None
        if self._alive(index):
            env.close()
            self.load[index] -= 1
            return None
        self.hosts[index] = self._new_host()
        self.load[index] = 0
        self.replaced += 1
        for table in (self._free, self._ready):
            for key, envs in table.items():
                table[key] = [e for e in envs if not (isinstance(e, RemoteEnv) and e.host_index == index)]
        return None

    def close(self) -> None:
        import ray

        super().close()
        for host in self.hosts:
            with contextlib.suppress(Exception):
                ray.kill(host)
        self.hosts = []


# ---- rollout engines -------------------------------------------------------------------------------
class EngineHost:
    """Ray actor body: one rollout engine (:class:`~crl_bench.llm.hf_engine.HFEngine`) with its own copy
    of the actor model, in the compute dtype, on the actor's GPU if it has one.

    Args:
        cfg: the run configuration as a dict (``RunConfig.to_dict``).
        cpus: CPUs the actor declared (torch threads when on the CPU).
    """

    def __init__(self, cfg: dict[str, Any], cpus: float = 1.0) -> None:
        from crl_bench.llm import lean_imports

        lean_imports.install()      # this Ray worker process is crl-bench's (crl_bench/llm/lean_imports.py)
        import torch

        from crl_bench.llm.hf_engine import HFEngine, load_model_and_tokenizer
        from crl_bench.llm.precision import DTYPES, resolve_dtype

        c = build_config([cfg])
        _threads(c.model.threads if c.model.threads > 0 else cpus)
        torch.manual_seed(c.train.seed)
        model, tokenizer = load_model_and_tokenizer(c.model.name, "float32")
        if c.model.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=c.model.lora_r, lora_alpha=c.model.lora_alpha,
                                                     lora_dropout=0.0, target_modules="all-linear",
                                                     task_type="CAUSAL_LM"))
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.dtype = resolve_dtype(c.model.dtype, next(model.parameters()).device)
        dtype = DTYPES[self.dtype]
        self.model = model
        g = c.generation
        self.engine = HFEngine(model, tokenizer, batch_size=g.batch_size, prefix_cache=g.prefix_cache,
                               compute_dtype=dtype, keep_sequences=c.rollout.prompt == "multiturn",
                               cache_mb=g.cache_mb)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 allowed: list[list[str] | None] | None) -> list[Generation]:
        """:meth:`HFEngine.generate <crl_bench.llm.hf_engine.HFEngine.generate>` of this actor."""
        return self.engine.generate(prompts, params, allowed)

    def load_weights(self, state: dict[str, Any]) -> int:
        """Copy the trainer's trainable parameters (:func:`~crl_bench.llm.weights.trainable_state`
        names) into the model and refresh the engine; returns how many tensors were loaded.
        Raises ``WeightsMismatchError`` when the names or shapes do not fit."""
        from crl_bench.llm.weights import load_trainable

        for p in self.model.parameters():       # load_trainable checks the trainable names
            p.requires_grad_(False)
        names = set(state)
        for n, p in self.model.named_parameters():
            p.requires_grad_(n in names)
        load_trainable(self.model, state, "engine weights")
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.engine.sync_weights(self.model)
        return len(state)

    def compute_dtype(self) -> str:
        """The dtype this engine generates in (what :func:`wire_state` may send it)."""
        return self.dtype

    def counters(self) -> dict[str, int]:
        return dict(self.engine.counters)

    def clear_prefix_cache(self) -> None:
        self.engine.clear_prefix_cache()


class RemoteEngine:
    """The driver's :class:`~crl_bench.llm.base.Engine` over ``ray.engines`` :class:`EngineHost`
    actors: a batch of prompts is split into contiguous parts, one per engine, generated in parallel
    and returned in order; :meth:`sync_weights` sends the trainer's trainable parameters to every
    engine once per update, in the engines' compute dtype (:func:`wire_state`)."""

    def __init__(self, hosts: list[Any], tokenizer: Any) -> None:
        import ray

        self.hosts = hosts
        self.tokenizer = tokenizer
        self.wire_dtype = _common_dtype(ray.get([h.compute_dtype.remote() for h in hosts]))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 allowed: Sequence[Sequence[str] | None] | None = None) -> list[Generation]:
        import ray

        prompts = [list(p) for p in prompts]
        allowed = list(allowed) if allowed is not None else [None] * len(prompts)
        n = max(1, min(len(self.hosts), len(prompts)))
        size = -(-len(prompts) // n) if prompts else 0
        refs = [h.generate.remote(prompts[i * size:(i + 1) * size], params, allowed[i * size:(i + 1) * size])
                for i, h in enumerate(self.hosts[:n]) if prompts[i * size:(i + 1) * size]]
        return [g for part in ray.get(refs) for g in part]

    def sync_weights(self, model: Any) -> None:
        """Send ``model``'s trainable parameters (CPU copies in the engines' compute dtype, once through
        the object store) to every engine and wait until all have loaded them."""
        import ray

        ref = ray.put(wire_state(model, self.wire_dtype))
        ray.get([h.load_weights.remote(ref) for h in self.hosts])

    @property
    def counters(self) -> dict[str, int]:
        """The engines' prompt-token counters, summed (as ``HFEngine.counters``)."""
        import ray

        out: dict[str, int] = {}
        for c in ray.get([h.counters.remote() for h in self.hosts]):
            for k, v in c.items():
                out[k] = out.get(k, 0) + v
        return out

    def clear_prefix_cache(self) -> None:
        import ray

        ray.get([h.clear_prefix_cache.remote() for h in self.hosts])


# ---- experience manager ----------------------------------------------------------------------------
class ManagerHost:
    """Ray actor body: the run's :class:`~crl_bench.experience.manager.ExperienceManager` (built by
    :func:`~crl_bench.experience.manager.build_manager`: bank file in the run folder, embedder,
    retriever and the extractor generating with its own copy of the extractor's weights; for a case
    bank, the case writer with the actor's tokenizer and no model).

    Args:
        cfg: the run configuration as a dict.
        bank_path: the bank's SQLite file (on this node: the actor is pinned to the driver's).
        initial_extractor: trainable parameters to start the extractor from (the trainer's copy), or
            ``None`` to load ``extractor.model`` as the trainer does (``same``: the actor's model).
        trains: whether the extractor is trained (float32 master weights; otherwise the compute dtype).
        cpus: CPUs the actor declared.
    """

    def __init__(self, cfg: dict[str, Any], bank_path: str, initial_extractor: dict[str, Any] | None,
                 trains: bool, cpus: float = 1.0) -> None:
        from crl_bench.llm import lean_imports

        lean_imports.install()      # this Ray worker process is crl-bench's (crl_bench/llm/lean_imports.py)
        import torch

        from crl_bench.experience.manager import build_manager
        from crl_bench.llm.hf_engine import load_model_and_tokenizer, load_tokenizer
        from crl_bench.llm.precision import DTYPES, cast_parameters, resolve_dtype

        c = build_config([cfg])
        _threads(cpus)
        torch.manual_seed(c.train.seed)
        self.model = None
        if not c.method_spec.uses_extractor:     # a case bank: the actor's tokenizer, no model
            self.dtype = resolve_dtype(c.model.dtype)
            self.manager = build_manager(c, bank_path, None, load_tokenizer(c.model.name),
                                         compute_dtype=DTYPES[self.dtype])
            return
        name = c.model.name if c.extractor.model == "same" else c.extractor.model
        model, tokenizer = load_model_and_tokenizer(name, "float32")
        self.dtype = resolve_dtype(c.model.dtype, next(model.parameters()).device)
        dtype = DTYPES[self.dtype]
        for p in model.parameters():
            p.requires_grad_(False)
        if not trains:
            cast_parameters(model, dtype)
        self.model = model
        if initial_extractor is not None:
            self._load(initial_extractor)
        self.manager = build_manager(c, bank_path, model, tokenizer, compute_dtype=dtype)

    def _load(self, state: dict[str, Any]) -> None:
        from crl_bench.llm.weights import load_trainable

        names = set(state)
        for n, p in self.model.named_parameters():
            p.requires_grad_(n in names)
        load_trainable(self.model, state, "extractor weights")
        for p in self.model.parameters():
            p.requires_grad_(False)

    def compute_dtype(self) -> str:
        """The dtype the extractor generates in (what :func:`wire_state` may send it)."""
        return self.dtype

    def extractor_updated(self, state: dict[str, Any], version: int) -> None:
        """Load the trainer's extractor parameters (distillation waits meanwhile) and stamp ``version``."""
        with self.manager.updating_extractor():
            self._load(state)
            self.manager.extractor_updated(self.model, version)

    def run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Any other :class:`~crl_bench.experience.manager.ExperienceManager` method, by name."""
        return getattr(self.manager, name)(*args, **kwargs)

    def close(self, drain_timeout: float | None = 0.0) -> None:
        """Stop the manager's threads and close the bank (its SQLite file stays in the run folder)."""
        self.manager.close(drain_timeout=drain_timeout)
        self.manager.bank.close()


class RemoteManager:
    """The driver's handle of the :class:`ManagerHost` actor, with the
    :class:`~crl_bench.experience.manager.ExperienceManager` methods the experience track calls."""

    def __init__(self, host: Any) -> None:
        import ray

        self.host = host
        self.wire_dtype = ray.get(host.compute_dtype.remote())

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        return ray.get(self.host.run.remote(name, *args, **kwargs))

    def retrieve(self, queries: list[tuple[str, str]], timeout: float | None = 60.0,
                 count_retrievals: bool = True) -> list:
        return self._run("retrieve", queries, timeout=timeout, count_retrievals=count_retrievals)

    def begin_evaluation(self, key: str) -> None:
        self._run("begin_evaluation", key)

    def submit(self, requests: list) -> None:
        self._run("submit", requests)

    def backlog(self) -> int:
        return self._run("backlog")

    def drain(self, timeout: float | None = None) -> bool:
        return self._run("drain", timeout)

    def pop_outcomes(self) -> list:
        return self._run("pop_outcomes")

    def stats(self) -> dict[str, Any]:
        return self._run("stats")

    def record_outcomes(self, outcomes: Sequence[tuple[Sequence[int], bool]]) -> None:
        self._run("record_outcomes", [(list(ids), bool(s)) for ids, s in outcomes])

    def source_extractions(self) -> set[str]:
        return self._run("source_extractions")

    def insights(self, env_ids: Sequence[str]) -> dict[str, list]:
        return self._run("insights", list(env_ids))

    def pop_insight_outcomes(self) -> list:
        return self._run("pop_insight_outcomes")

    def reflections(self, env_id: str, task: int, limit: int) -> list[str]:
        return self._run("reflections", env_id, int(task), int(limit))

    def add_reflections(self, rows: Sequence[tuple[str, int, str, int]]) -> None:
        self._run("add_reflections", [tuple(r) for r in rows])

    def similar_groups(self, threshold: float, max_size: int) -> list:
        return self._run("similar_groups", threshold, max_size)

    @property
    def has_model(self) -> bool:
        """The manager's ``has_model`` (an extractor model writes the bank: the merge pass can run)."""
        return self._run("__getattribute__", "has_model")

    def answer(self, queries: Sequence[tuple[str, str]], count_retrievals: bool = True,
               timeout: float | None = 60.0) -> list:
        return self._run("answer", [tuple(q) for q in queries], count_retrievals=count_retrievals, timeout=timeout)

    def backup(self, dest: Any) -> None:
        self._run("backup", str(Path(dest).resolve()))

    def updating_extractor(self) -> Any:
        """Nothing to hold here: the actor generates from its own copy, replaced atomically."""
        return contextlib.nullcontext()

    def extractor_updated(self, model: Any, version: int) -> None:
        """Send the trainer's extractor parameters to the actor (once through the object store, in the
        actor's compute dtype: :func:`wire_state`)."""
        import ray

        ref = ray.put(wire_state(model, self.wire_dtype))
        ray.get(self.host.extractor_updated.remote(ref, version))

    def clear_caches(self) -> None:
        self._run("clear_caches")

    def state_dict(self) -> dict[str, Any]:
        return self._run("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._run("load_state_dict", state)

    def close(self, drain_timeout: float | None = 0.0) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.get(self.host.close.remote(drain_timeout))
        with contextlib.suppress(Exception):
            ray.kill(self.host)


# ---- the backend ----------------------------------------------------------------------------------
class RayBackend:
    """Builds a run's Ray actors (:func:`init_ray` first) and hands the trainer their driver-side
    handles; :meth:`close` kills them.

    Args:
        cfg: the run configuration (``backend: ray``; section ``ray``).

    Raises:
        ImportError: Ray is not installed.
    """

    remote = True

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.resources = init_ray(cfg.ray)
        self.gpus = self.resources.get("GPU", 0) > 0
        self._actors: list[Any] = []
        self._closers: list[Any] = []
        short = short_resources(self.needed_resources(), self.resources)
        if short:     # Ray would wait for the missing resources forever
            from crl_bench.config import ConfigError

            raise ConfigError("the Ray cluster cannot hold this run's actors: " + ", ".join(
                f"{k} {v:g} needed, {have:g} in the cluster" for k, (v, have) in short.items())
                + " (lower ray.engine_cpus / ray.manager_cpus / ray.env_actor_cpus, or start a local Ray "
                  "with more logical CPUs: --set ray.num_cpus=N)")

    def needed_resources(self) -> dict[str, float]:
        """CPUs and GPUs the run's actors declare (:class:`~crl_bench.config.RayConfig`): env actors,
        engines (a GPU each on a GPU cluster) and, for methods with a bank, the manager."""

        rc = self.cfg.ray
        cpu = rc.env_actors * rc.env_actor_cpus
        gpu = 0.0
        if self.gpus:
            cpu += rc.engines * 1.0
            gpu += rc.engines * rc.engine_gpus
        else:
            cpu += rc.engines * rc.engine_cpus
        if self.cfg.method_spec.uses_experience:
            cpu += rc.manager_cpus
            if self.gpus:
                gpu += rc.manager_gpus
        return {"CPU": cpu, **({"GPU": gpu} if gpu else {})}

    def env_pool(self) -> RayEnvPool:
        """The run's env pool, its envs in ``ray.env_actors`` actors."""
        pool = RayEnvPool(self.cfg.rollout.env_kwargs, self.cfg.rollout.max_steps, self.cfg.ray)
        self._closers.append(pool.close)
        return pool

    def engine(self, model: Any, tokenizer: Any) -> RemoteEngine:
        """``ray.engines`` engine actors (a GPU each when the cluster has GPUs), synced to ``model``."""

        rc = self.cfg.ray
        opts = {"num_gpus": rc.engine_gpus, "num_cpus": 1} if self.gpus else {"num_cpus": rc.engine_cpus}
        hosts = [_remote(EngineHost).options(**opts).remote(self.cfg.to_dict(), rc.engine_cpus)
                 for _ in range(rc.engines)]
        self._actors += hosts
        engine = RemoteEngine(hosts, tokenizer)
        engine.sync_weights(model)          # LoRA adapters start random: the trainer's copy decides
        return engine

    def experience_manager(self, bank_path: str | Path, initial_extractor: Any = None) -> RemoteManager:
        """The manager actor on the driver's node (bank at ``bank_path``; ``ray.manager_gpus`` GPUs on a GPU
        cluster, where its extractor then runs), its extractor starting from ``initial_extractor``'s trainable
        parameters when given (the trainer's copy)."""

        from crl_bench.llm.weights import trainable_state

        state = None
        if initial_extractor is not None:
            state = {k: v.detach().cpu() for k, v in trainable_state(initial_extractor).items()}
        gpus = {"num_gpus": self.cfg.ray.manager_gpus} if self.gpus and self.cfg.ray.manager_gpus else {}
        host = _remote(ManagerHost).options(num_cpus=self.cfg.ray.manager_cpus, max_concurrency=8, **gpus,
                                               scheduling_strategy=_driver_node_affinity()).remote(
            self.cfg.to_dict(), str(Path(bank_path).resolve()), state,
            self.cfg.method_spec.trains_extractor, self.cfg.ray.manager_cpus)
        self._actors.append(host)
        return RemoteManager(host)

    def close(self) -> None:
        """Kill the run's actors (env pool, engines, manager); Ray itself keeps running."""
        import ray

        for close in self._closers:
            with contextlib.suppress(Exception):
                close()
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._actors, self._closers = [], []
