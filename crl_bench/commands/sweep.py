"""``crl-bench sweep``: a grid of methods x seeds into one resumable sweep folder (crl_bench/sweep.py)."""

from __future__ import annotations

import argparse

from crl_bench.commands.options import add_backend_args, add_config_args, resolve_config
from crl_bench.config import ConfigError, RunConfig, check_name

__all__ = ["HELP", "add_parser", "run"]

HELP = "run a grid of methods x seeds into one sweep folder (resumable)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``sweep`` with its options to the ``crl-bench`` subcommands; returns its parser."""
    sw = subparsers.add_parser("sweep", help=HELP)
    add_config_args(sw, with_method=False)
    add_backend_args(sw)
    sw.add_argument("--methods", default="grpo,static,complementary", help="comma-separated methods")
    sw.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    sw.add_argument("--steps", type=int, help="training steps of every run")
    sw.add_argument("--output-dir", default="results/sweeps", help="folder of sweeps (default results/sweeps)")
    sw.add_argument("--name", help="sweep folder name (default: <mix>-<preset>[-hash of the other settings])")
    sw.add_argument("--verbose", action="store_true", help="print every run's step lines too")
    sw.add_argument("--effect", type=float, default=0.05,
                    help="the lift and the difference between methods the seeds-needed lines are for (0.05)")
    sw.add_argument("--plan-seeds", nargs="+", metavar="DIR",
                    help="only print the seeds needed, from the spread of the finished runs under DIR, and exit")
    return sw


def run(args: argparse.Namespace) -> int:
    """Run the sweep ``args`` describe (the cells not yet finished); returns 0, or 1 when a run failed.

    Raises:
        ConfigError: no ``--mix``, ``--seed`` instead of ``--seeds``, a bad ``--name`` or setting.
    """
    from crl_bench.sweep import SweepSpec, describe, parse_list, run_sweep, seeds_needed_lines

    if args.plan_seeds:
        for line in seeds_needed_lines(args.plan_seeds, args.effect):
            print(line)
        return 0
    if not args.mix:
        raise ConfigError("sweep: --mix is required")
    if args.seed is not None:
        raise ConfigError("sweep: use --seeds (a list), not --seed")
    if args.name is not None:
        check_name(args.name, "--name")
    spec = SweepSpec(methods=parse_list(args.methods, str, "methods"), seeds=parse_list(args.seeds, int, "seeds"),
                     mix=args.mix, preset=args.preset, config=args.config, model=args.model, steps=args.steps,
                     sets=list(args.set), profile=args.profile, draws=args.draws)

    def resolve(method: str, seed: int) -> RunConfig:
        ns = argparse.Namespace(**{**vars(args), "method": method, "seed": seed})
        return resolve_config(ns, {"train.steps": args.steps} if args.steps is not None else None)

    for line in describe(spec):
        print(line, flush=True)
    path, failures = run_sweep(spec, args.output_dir, resolve, name=args.name, quiet=not args.verbose,
                               print_fn=lambda line: print(line, flush=True))
    print(f"sweep folder: {path}" + (f"; {len(failures)} run(s) failed (rerun the same command to retry them)"
                                     if failures else ""))
    for line in seeds_needed_lines([path], args.effect):
        print(line)
    return 1 if failures else 0
