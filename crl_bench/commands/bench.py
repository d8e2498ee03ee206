"""``crl-bench bench NAME``: the speed benchmarks of :mod:`crl_bench.bench`, which builds the subcommand
(one per benchmark, each with its own options, and the help line that lists them) and runs it; this
module only hands the command over."""

from __future__ import annotations

import argparse

from crl_bench import bench

__all__ = ["HELP", "add_parser", "run"]

#: what the command is; the line ``crl-bench --help`` shows is built by :func:`crl_bench.bench.add_parser`
#: from each benchmark's own ``HELP``
HELP = "speed benchmarks (crl_bench/bench/)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` with one subcommand per benchmark (:func:`crl_bench.bench.add_parser`) to the
    ``crl-bench`` subcommands; returns the ``bench`` parser."""
    return bench.add_parser(subparsers)


def run(args: argparse.Namespace) -> int:
    """Run benchmark ``args.name`` (:func:`crl_bench.bench.main`); returns its exit status."""
    return bench.main(args)
