"""``crl-bench bench backend``: whole training steps on the Ray backend against the local backend
(same preset, mix, method and seed; one process drives both), interleaved step by step: the
overhead of the Ray actors (envs, engines and the experience manager out of process, weights sent
through Ray's object store after each update). Then the actor's weight sync to the engine actors,
in the engines' compute dtype (what runs send) against float32, interleaved."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from crl_bench.bench.options import non_negative_int, positive_int

__all__ = ["HELP", "add_parser", "bench_backend", "run"]

HELP = "training step time, Ray backend vs local"

#: the per-step phases reported beside the whole step (metrics.jsonl keys)
PHASES = ("time_rollout_s", "time_generate_s", "time_env_s", "time_update_s", "time_experience_s")


def bench_sync(engine: Any, model: Any, repeats: int = 3) -> dict[str, Any]:
    """Seconds per :meth:`~crl_bench.ray_backend.RemoteEngine.sync_weights` of ``model`` to the Ray
    engines, sending the engines' compute dtype (``engine.wire_dtype``, what runs do) and float32,
    alternating ``repeats`` times each.

    Returns:
        ``{"wire_dtype": name or None, "compute_dtype_s": mean s, "float32_s": mean s,
        "ratio": compute / float32, "mb": {"compute_dtype": MiB sent, "float32": MiB sent}}``.
    """
    from crl_bench.ray_backend import wire_state

    wire = engine.wire_dtype
    times: dict[str, list[float]] = {"compute_dtype": [], "float32": []}
    try:
        for _ in range(repeats):
            for name, dtype in (("compute_dtype", wire), ("float32", None)):
                engine.wire_dtype = dtype
                t0 = time.perf_counter()
                engine.sync_weights(model)
                times[name].append(time.perf_counter() - t0)
    finally:
        engine.wire_dtype = wire
        engine.sync_weights(model)
    mb = {name: sum(v.nbytes for v in wire_state(model, dtype).values()) / 2**20
          for name, dtype in (("compute_dtype", wire), ("float32", None))}
    c, f = statistics.fmean(times["compute_dtype"]), statistics.fmean(times["float32"])
    return {"wire_dtype": wire, "compute_dtype_s": c, "float32_s": f, "ratio": c / f, "mb": mb}


def bench_backend(method: str = "complementary", mix: str = "minihack-room", preset: str = "smoke",
                  steps: int = 3, num_cpus: int = 2, seed: int = 0, sets: list[str] | None = None) -> dict[str, Any]:
    """Time ``steps`` training steps of a ``local`` and a ``ray`` trainer built from the same settings,
    alternating local, ray, local, ray, ... so that both see the same machine load.

    The Ray trainer starts a local Ray with ``num_cpus`` logical CPUs (``ray.num_cpus``) unless one is
    running. Returns ``{"local": {...}, "ray": {...}, "ratio": ray / local, "sync": ...}`` with the
    mean seconds of a step and of each phase (:data:`PHASES`) per backend, the mean actor optimiser
    steps per step (0 when no group had a learning signal: then no weights were sent to the engines)
    and the Ray engines' weight sync (:func:`bench_sync`).

    Raises:
        ImportError: Ray is not installed.
    """
    from crl_bench.config import build_config, parse_override, preset_data
    from crl_bench.trainer.loop import Trainer

    layers = [preset_data(preset), {"method": method, "rollout": {"mix": mix},
                                    "train": {"seed": seed, "steps": steps}}]
    layers += [parse_override(s) for s in sets or []]
    trainers = {"local": Trainer(build_config(layers)),
                "ray": Trainer(build_config(layers + [{"backend": "ray", "ray": {"num_cpus": num_cpus}}]))}
    rows: dict[str, list[dict[str, float]]] = {"local": [], "ray": []}
    try:
        for _ in range(steps):
            for name, tr in trainers.items():
                t0 = time.perf_counter()
                m = tr.train_step().metrics
                rows[name].append({"step_s": time.perf_counter() - t0, **{k: float(m.get(k, 0.0)) for k in PHASES},
                                   "optimizer_steps": float(m.get("optimizer_steps", 0.0))})
        sync = bench_sync(trainers["ray"].engine, trainers["ray"].model)
    finally:
        for tr in trainers.values():
            tr.close()
    out: dict[str, Any] = {name: {k: statistics.fmean(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    out["ratio"] = {k: (out["ray"][k] / out["local"][k] if out["local"][k] else float("nan")) for k in out["local"]}
    out["sync"] = sync
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``backend`` and its options to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("backend", help=HELP, description=__doc__)
    p.add_argument("--method", default="complementary")
    p.add_argument("--mix", default="minihack-room")
    p.add_argument("--preset", default="smoke")
    p.add_argument("--steps", type=positive_int, default=3, help="steps per backend (interleaved)")
    p.add_argument("--num-cpus", type=positive_int, default=2, help="logical CPUs of the local Ray")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    return p


def run(args: argparse.Namespace) -> int:
    """Run :func:`bench_backend` with the parsed options and print the table; returns 0."""
    res = bench_backend(args.method, args.mix, args.preset, args.steps, args.num_cpus, args.seed, args.set)
    keys = list(res["local"])
    print(f"{args.method} on {args.mix}, preset {args.preset}, {args.steps} steps per backend, interleaved "
          f"(local Ray: {args.num_cpus} CPUs)")
    print(f"{'mean seconds':<18}" + "".join(f"{k:>18}" for k in keys))
    for name in ("local", "ray"):
        print(f"{name:<18}" + "".join(f"{res[name][k]:>18.2f}" for k in keys))
    print(f"{'ray / local':<18}" + "".join(f"{res['ratio'][k]:>18.2f}" for k in keys))
    s = res["sync"]
    print(f"actor weight sync to the engine actors: {s['wire_dtype'] or 'own dtype'} "
          f"{s['mb']['compute_dtype']:.0f} MiB {s['compute_dtype_s']:.2f} s, float32 {s['mb']['float32']:.0f} MiB "
          f"{s['float32_s']:.2f} s, ratio {s['ratio']:.2f}")
    return 0
