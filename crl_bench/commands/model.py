"""``crl-bench model prepare``: prepare the default model (convert the shipped GGUF once;
crl_bench/llm/default_model.py)."""

from __future__ import annotations

import argparse

__all__ = ["HELP", "add_parser", "run"]

HELP = "prepare the default model (convert the shipped GGUF once)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``model`` with its options to the ``crl-bench`` subcommands; returns its parser."""
    m = subparsers.add_parser("model", help=HELP)
    m.add_argument("action", choices=["prepare"])
    m.add_argument("--force", action="store_true")
    return m


def run(args: argparse.Namespace) -> int:
    """Prepare the default model (again with ``--force``) and print where it is; returns 0."""
    from crl_bench.llm.default_model import prepare_default_model

    path = prepare_default_model(force=args.force)
    print(f"default model ready at {path}")
    return 0
