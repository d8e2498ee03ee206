"""``crl-bench bench NAME``: speed benchmarks printed as ratios measured side by side in one run.

One module per benchmark, each registering its own subcommand:

* ``env`` (:mod:`.env`): steps/s of each text env against its raw simulator (:mod:`.raw`: the
  :class:`~crl_bench.bench.raw.RawSimulator` adapters); ALFWorld (:mod:`.alfworld`) and WebShop
  (:mod:`.webshop`) have benches of their own, run when named with ``--env``.
* ``rollout`` (:mod:`.rollout`): generated tokens/s of one batched rollout over N envs against the same
  N episodes rolled out one env at a time (with and without the prefix cache), same model, tasks, seeds
  and sampling.
* ``retrieval`` (:mod:`.retrieval`): recall and latency of the experience bank's search, per index
  kind, bank size and data shape.
* ``overhead`` (:mod:`.overhead`): rollout wall time of ``complementary`` against ``grpo``, with and
  without distillation running beside it.
* ``step`` (:mod:`.step`): whole training steps (rollout + update) of a preset and mix, ``before``
  (float32 compute, only the batch-wide prompt head cached: no bf16, no per-group heads, no reuse)
  against ``after`` (the defaults: ``model.dtype: auto``, per-group heads, per-episode reuse for
  multi-turn prompts), interleaved step by step; and the share of pure-torch prefill/decode throughput
  the rollout reaches.
* ``update`` (:mod:`.update`): one actor update with padded against packed micro-batches
  (``train.packing``) on the same batch, per prompt layout (per-turn samples of ``window`` prompts, one
  sequence per episode of ``multiturn`` ones), interleaved.
* ``dp`` (:mod:`.dp`): one policy update of the same batch in this process against N data-parallel
  workers (Ray actors forming one torch.distributed group: trainer/data_parallel.py), interleaved.
* ``backend`` (:mod:`.backend`): whole training steps on the Ray backend against the local backend
  (crl_bench/ray_backend.py), interleaved step by step.
* ``eval`` (:mod:`.eval`): one evaluation (every mode of a method) run per-mode waves against one stream
  with continuous batching (trainer/evaluation.py), interleaved, with each arm's share of the roofline.
* ``roofline`` (:mod:`.roofline`): this machine's limits for a model (matmul FLOP/s in the compute dtype,
  memory bandwidth, pure-torch prefill/decode and forward+backward tokens/s); ``rollout`` and ``step``
  print their arms as a share of it (:func:`~crl_bench.bench.roofline.roofline_share`).
* ``memory`` (:mod:`.memory`): the update's memory laws (chunked against full-vocabulary log-probs,
  autocast's weight-cast cache on against off under checkpointing), measured at two small sizes side by
  side and extrapolated to the paper's model shapes.
* ``update-peak`` (:mod:`.update_peak`): one steady-state actor update of a paper-shaped model with fewer
  layers (random weights), its peak measured against what ``crl-bench plan`` counts, and extrapolated to
  all the model's layers.
* ``weight-sync`` (:mod:`.weight_sync`): one weight sync from data-parallel ranks into a vLLM engine through
  the driver against straight over the weight channel (``devices.weight_sync``), interleaved.
* ``checkpoint-io`` (:mod:`.checkpoint_io`): a checkpoint's bytes per trainable parameter (the law) and this
  disk's save and resume rates, extrapolated to the paper's models and run.

A benchmark module exposes ``HELP`` (a few words for ``crl-bench bench --help``), ``add_parser(subparsers)``
(adds ``NAME`` with its own options to the ``bench`` subcommands and returns that parser) and
``run(args) -> int`` (runs it with the parsed options, prints its table, returns the exit status).
:data:`BENCHMARKS` lists them; the command line asks this package for its parser (:func:`add_parser`)
and hands the parsed arguments back to :func:`main`, so it knows no benchmark by name. Module imports
stay light (torch, FAISS and the envs are imported when a benchmark runs), as the parser is built on
every ``crl-bench`` call.

Standalone: ``python -m crl_bench.bench NAME [options]`` is ``crl-bench bench NAME [options]``.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

__all__ = ["BENCHMARKS", "add_parser", "benchmark", "main"]

#: subcommand name -> module implementing it (in the order ``crl-bench bench --help`` lists them)
BENCHMARKS: dict[str, str] = {
    "env": "crl_bench.bench.env",
    "rollout": "crl_bench.bench.rollout",
    "retrieval": "crl_bench.bench.retrieval",
    "overhead": "crl_bench.bench.overhead",
    "step": "crl_bench.bench.step",
    "update": "crl_bench.bench.update",
    "dp": "crl_bench.bench.dp",
    "backend": "crl_bench.bench.backend",
    "eval": "crl_bench.bench.eval",
    "roofline": "crl_bench.bench.roofline",
    "memory": "crl_bench.bench.memory",
    "update-peak": "crl_bench.bench.update_peak",
    "weight-sync": "crl_bench.bench.weight_sync",
    "checkpoint-io": "crl_bench.bench.checkpoint_io",
}


def benchmark(name: str) -> ModuleType:
    """The module of benchmark ``name`` (imported on first use).

    Raises:
        KeyError: ``name`` is not in :data:`BENCHMARKS`.
    """
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    return importlib.import_module(BENCHMARKS[name])


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench`` command to ``subparsers`` (the ``crl-bench`` subcommands) with one subcommand
    per registered benchmark; the chosen benchmark's name lands in ``args.name``. Returns the ``bench``
    parser (the caller sets what runs it, e.g. ``set_defaults(func=...)`` calling :func:`main`)."""
    mods = {name: benchmark(name) for name in BENCHMARKS}
    b = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(f"{name} ({mod.HELP})"
                                                                        for name, mod in mods.items()))
    names = b.add_subparsers(dest="name", required=True)
    for mod in mods.values():
        mod.add_parser(names)
    return b


def main(args: argparse.Namespace) -> int:
    """Entry of ``crl-bench bench``: run benchmark ``args.name`` with the parsed ``args``; returns its exit
    status.

    Raises:
        KeyError: ``args.name`` is not a registered benchmark.
    """
    return benchmark(args.name).run(args)
