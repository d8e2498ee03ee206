"""``crl-bench run``: train (and finally evaluate) one method on one mix into a run folder, or continue
a stopped run with ``--resume RUN_DIR`` (crl_bench/trainer/lifecycle.py, docs/resume.md)."""

from __future__ import annotations

import argparse
from typing import Any

from crl_bench.commands.options import add_backend_args, add_config_args, resolve_config
from crl_bench.config import ConfigError, check_name

__all__ = ["HELP", "add_parser", "run"]

HELP = "train (and finally evaluate) one method on one mix"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``run`` with its options to the ``crl-bench`` subcommands; returns its parser."""
    r = subparsers.add_parser("run", help=HELP)
    add_config_args(r)
    r.set_defaults(method=None, preset=None)        # defaults applied in run(), so --resume can refuse them
    add_backend_args(r)
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped or killed run from its newest "
                                                        "usable checkpoint (its own config.yaml; no other "
                                                        "flags but the two below)")
    r.add_argument("--start-over", action="store_true",
                   help="with --resume: when the run's checkpoint folders are all unusable, train it again "
                        "from step 0 (they are kept aside) instead of refusing")
    r.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: continue although config.yaml differs from the checkpoint's")
    r.add_argument("--steps", type=int, help="training steps")
    r.add_argument("--output-dir", help="runs folder (default results/runs)")
    r.add_argument("--run-id", help="run folder name (default: time-method-mix-seed)")
    r.add_argument("--quiet", action="store_true")
    return r


def run(args: argparse.Namespace) -> int:
    """Train the run ``args`` describe (or resume ``args.resume``), print its folder; returns 0.

    Raises:
        ConfigError: ``--resume`` with flags that would change the run, ``--start-over`` or
            ``--allow-config-change`` without ``--resume``, a bad ``--run-id``, a bad setting, or a
            checkpoint that cannot be resumed.
    """
    from crl_bench.trainer.lifecycle import resume_training, run_training

    if args.resume:
        given = [flag for flag, value in (("--mix", args.mix), ("--config", args.config), ("--model", args.model),
                                          ("--extractor-model", args.extractor_model), ("--seed", args.seed),
                                          ("--set", args.set), ("--steps", args.steps),
                                          ("--output-dir", args.output_dir), ("--run-id", args.run_id),
                                          ("--method", args.method), ("--preset", args.preset),
                                          ("--backend", args.backend), ("--ray-address", args.ray_address)) if value]
        if given:
            raise ConfigError(f"--resume continues the run with its own config.yaml; drop {', '.join(given)}")
        from crl_bench.trainer.checkpoint import CheckpointError

        try:
            path = resume_training(args.resume, quiet=args.quiet, start_over=args.start_over,
                                   allow_config_change=args.allow_config_change)
        except CheckpointError as e:
            raise ConfigError(f"--resume {args.resume!r}: {e}") from None
        print(f"run folder: {path}")
        return 0
    for flag, value in (("--start-over", args.start_over), ("--allow-config-change", args.allow_config_change)):
        if value:
            raise ConfigError(f"{flag} only applies with --resume RUN_DIR")
    if args.run_id:
        check_name(args.run_id, "--run-id")
    args.method = args.method or "grpo"
    args.preset = args.preset or "default"
    extra: dict[str, Any] = {}
    if args.steps is not None:
        extra["train.steps"] = args.steps
    cfg = resolve_config(args, extra)
    if args.output_dir:
        cfg.output_dir = args.output_dir
    if args.run_id:
        cfg.run_id = args.run_id
    path = run_training(cfg, quiet=args.quiet)
    print(f"run folder: {path}")
    return 0
