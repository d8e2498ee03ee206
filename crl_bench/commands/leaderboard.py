"""``crl-bench leaderboard``: ``leaderboard.md`` and ``leaderboard.csv`` from run folders and submissions
(crl_bench/results/leaderboard.py)."""

from __future__ import annotations

import argparse

__all__ = ["HELP", "add_parser", "run"]

HELP = "leaderboard.md and leaderboard.csv from run folders and submissions"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``leaderboard`` with its options to the ``crl-bench`` subcommands; returns its parser."""
    lb = subparsers.add_parser("leaderboard", help=HELP)
    lb.add_argument("dirs", nargs="*", help="folders to read (default: results, i.e. runs, sweeps, submissions)")
    lb.add_argument("--out", default="results", help="where leaderboard.md/.csv go (default results)")
    return lb


def run(args: argparse.Namespace) -> int:
    """Write the leaderboard of ``args.dirs`` (default ``results``) into ``args.out``; returns its exit
    status (:func:`~crl_bench.results.leaderboard.main_leaderboard`)."""
    from crl_bench.results.leaderboard import main_leaderboard

    return main_leaderboard(args.dirs or ["results"], args.out)
