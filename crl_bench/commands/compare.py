"""``crl-bench compare A B``: two methods, or two eval modes of the same runs, on one task panel
(crl_bench/results/compare.py)."""

from __future__ import annotations

import argparse

__all__ = ["HELP", "add_parser", "run"]

HELP = "difference of two methods per env and overall, with seed-level CIs and P(A > B)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``compare`` with its options to the ``crl-bench`` subcommands; returns its parser."""
    cp = subparsers.add_parser("compare", help=HELP)
    cp.add_argument("a", help="a run folder, a folder of one method's runs, or a method name in --sweep")
    cp.add_argument("b", help="the same for the other side")
    cp.add_argument("--sweep", help="sweep folder in which A and B are method names (run ids <name>-s<seed>)")
    cp.add_argument("--mode", default="free", help="eval mode of A (free, guided, shuffled, empty, raw, condensed, "
                                                   "both, initial; default free)")
    cp.add_argument("--mode-b", help="eval mode of B (default: --mode); A and B the same runs: a within-run "
                                     "difference, e.g. --mode guided --mode-b shuffled")
    cp.add_argument("--protocol", help="the shared protocol whose label contains this text (e.g. eval_unseen, "
                                       "'3 trials'; default: the one with the most runs)")
    cp.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    return cp


def run(args: argparse.Namespace) -> int:
    """Print the comparison; a comparison that cannot be made is a ``ConfigError`` (one line, exit 2)."""
    from crl_bench.config import ConfigError
    from crl_bench.results.compare import CompareError, compare, compare_json, compare_markdown, load_side

    try:
        res = compare(load_side(args.a, args.sweep), load_side(args.b, args.sweep), args.mode, args.mode_b,
                      args.protocol)
    except CompareError as e:
        raise ConfigError(f"compare: {e}") from None
    print(compare_json(res) if args.json else compare_markdown(res), end="" if not args.json else "\n")
    return 0
