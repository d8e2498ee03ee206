"""``crl-bench submission check|pack|verify``: validate, pack or re-run a leaderboard submission
(``results/submissions/<name>``; crl_bench/results/submission.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["HELP", "add_parser", "run"]

HELP = "check or pack a leaderboard submission (results/submissions/<name>)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``submission`` and its ``check``, ``pack`` and ``verify`` subcommands to the ``crl-bench``
    subcommands; returns the ``submission`` parser."""
    sm = subparsers.add_parser("submission", help=HELP)
    sms = sm.add_subparsers(dest="submission_cmd", required=True)
    sc = sms.add_parser("check", help="validate summary.json and metadata.yaml of a submission folder")
    sc.add_argument("dir")
    sp = sms.add_parser("pack", help="merge the summaries of your runs (one per seed) into a submission")
    sp.add_argument("runs", nargs="+", help="run folders of one method, model, mix and eval protocol")
    sp.add_argument("--name", required=True, help="submission name (folder name)")
    sp.add_argument("--out", help="submission folder (default results/submissions/<name>)")
    sp.add_argument("--trajectories", action="store_true",
                    help="also pack each run's episodes.jsonl as trajectories/<run id>.jsonl.gz")
    sv = sms.add_parser("verify", help="re-run the submission's configs here, within bounds, and set 'verified' "
                                       "in verification.json when the results match within sampling noise")
    sv.add_argument("dir")
    sv.add_argument("--seeds", help="only these seeds, comma-separated (default: every run)")
    sv.add_argument("--work", help="folder for the re-runs (default: a new temporary folder)")
    sv.add_argument("--plan", action="store_true", help="print what would be re-run and its cost, run nothing")
    sv.add_argument("--quiet", action="store_true")
    return sm


def run(args: argparse.Namespace) -> int:
    """Run ``submission check``, ``pack`` or ``verify`` (``args.submission_cmd``); returns its exit status."""
    from crl_bench.results.submission import main_submission_check, main_submission_pack, main_submission_verify

    if args.submission_cmd == "check":
        return main_submission_check(args.dir)
    if args.submission_cmd == "verify":
        import tempfile

        from crl_bench.config import ConfigError, RunConfig

        try:
            seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
        except ValueError:
            raise ConfigError(f"--seeds: expected comma-separated integers, got {args.seeds!r}") from None
        if args.work or not args.plan:
            work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="crl-bench-verify-"))
            print(f"re-runs go to {work}")
        else:                                   # a plan creates nothing
            work = Path(tempfile.gettempdir()) / "crl-bench-verify-PLAN"

        def rerun(cfg: RunConfig) -> Path:
            """Train and evaluate ``cfg`` (its ``output_dir`` and ``run_id`` set by verify) as ``crl-bench run``."""
            from crl_bench.trainer.lifecycle import run_training

            return Path(run_training(cfg, quiet=args.quiet))

        return main_submission_verify(args.dir, rerun, work, seeds, plan_only=args.plan)
    return main_submission_pack(args.runs, args.name, args.out, trajectories=args.trajectories)
