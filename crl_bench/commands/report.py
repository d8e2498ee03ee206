"""``crl-bench report``: PNG curves and one self-contained ``report.html`` of runs or sweeps
(crl_bench/results/report.py), with their leaderboard table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from crl_bench.config import ConfigError

__all__ = ["HELP", "add_parser", "run"]

HELP = "PNG curves and one self-contained report.html of runs or sweeps"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``report`` with its options to the ``crl-bench`` subcommands; returns its parser."""
    rp = subparsers.add_parser("report", help=HELP)
    rp.add_argument("paths", nargs="+", help="run folders, sweep folders, or folders holding them")
    rp.add_argument("--out", help="output folder (default: <the one path>/report, else results/report)")
    rp.add_argument("--title", help="page title")
    return rp


def run(args: argparse.Namespace) -> int:
    """Write the report of ``args.paths`` (leaderboard warnings go to stderr); returns 0.

    Raises:
        ConfigError: a path that is not a folder, no run folder under the paths, or a damaged one.
    """
    from crl_bench.results.interval_plots import draw_interval_charts
    from crl_bench.results.leaderboard import collect, display_frame, leaderboard_frame
    from crl_bench.results.report import make_report
    from crl_bench.safe_io import printable

    for p in args.paths:
        if not Path(p).is_dir():
            raise ConfigError(f"report: {p!r} is not a run or sweep folder")
    out = Path(args.out) if args.out else (Path(args.paths[0]) / "report" if len(args.paths) == 1
                                           else Path("results") / "report")
    warnings: list[str] = []
    summaries = collect(args.paths, warnings=warnings)
    frame = leaderboard_frame(summaries, warnings=warnings) if summaries else None
    table = display_frame(frame) if frame is not None else None
    for w in warnings:
        print(f"crl-bench report: warning: {w}", file=sys.stderr)
    failed: list[str] = []
    try:
        figures = (draw_interval_charts(frame, summaries, out, failures=failed)
                   if frame is not None and not frame.empty else [])
        path = make_report(args.paths, out, table=table, title=args.title, figures=figures)
    except (ValueError, FileNotFoundError) as e:         # no run folder under the paths, or a damaged one
        raise ConfigError(f"report: {e}") from None
    for f in failed:                        # one chart that failed; the report holds the others
        print(f"crl-bench report: warning: {printable(f)}", file=sys.stderr)
    print(f"report: {path}")
    return 0
