"""``crl-bench plan``: the GPU memory a run would take, per GPU and phase, computed from the models'
configurations before anything loads, and whether it fits (trainer/memory_plan.py, docs/scaling.md)."""

from __future__ import annotations

import argparse

from crl_bench.commands.options import add_config_args, resolve_config

__all__ = ["HELP", "add_parser", "run"]

HELP = "the GPU memory a run would take per GPU and phase, before anything loads"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``plan`` with the run's config options and the machine's GPUs to the ``crl-bench`` subcommands."""
    p = subparsers.add_parser("plan", help=HELP, description=__doc__)
    add_config_args(p)
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the machine planned for (default 8)")
    p.add_argument("--gpu-memory-gib", type=float, default=79.6,
                   help="usable memory of one GPU in GiB (default 79.6: an 80 GB card)")
    return p


def run(args: argparse.Namespace) -> int:
    """Print the plan of the run ``args`` describe on ``--gpus`` cards of ``--gpu-memory-gib``; returns 0
    when it fits, 3 when it does not.

    Raises:
        ConfigError: a bad setting, or ``--gpus`` / ``--gpu-memory-gib`` not positive.
        ModelNotAvailable: a model's configuration cannot be found on this machine.
    """
    from crl_bench.config import ConfigError
    from crl_bench.trainer.memory_plan import format_plan, plan_memory, shapes_for

    if args.gpus < 1 or not args.gpu_memory_gib > 0:
        raise ConfigError(f"--gpus and --gpu-memory-gib must be positive, got {args.gpus} and {args.gpu_memory_gib}")
    cfg = resolve_config(args)
    actor, extractor = shapes_for(cfg)
    print(f"{cfg.method} on {args.gpus} x {args.gpu_memory_gib:g} GiB: actor {actor.name} "
          f"({actor.params / 1e9:.2f} B parameters)"
          + (f", extractor {extractor.name} ({extractor.params / 1e9:.2f} B)" if extractor is not None else ""))
    plan = plan_memory(cfg, args.gpus, args.gpu_memory_gib, actor, extractor)
    print(format_plan(plan))
    return 0 if plan.fits else 3
