"""The ``crl-bench`` commands, one module per command.

A command module exposes ``HELP`` (the line ``crl-bench --help`` shows for it), ``add_parser(subparsers)``
(adds the command, with its options and subcommands, to the ``crl-bench`` subcommands and returns its
parser) and ``run(args) -> int`` (runs it with the parsed options and returns the exit status).
:data:`COMMANDS` lists them; :func:`add_parsers` adds each to the parser that
:func:`crl_bench.cli.build_parser` makes, and sets ``args.func`` to the chosen command's ``run``.
What several commands share (the option groups of a run's config and backend, ``--episodes``,
:func:`~crl_bench.commands.options.resolve_config`) is in :mod:`.options`; ``crl_bench/cli.py`` keeps
``main`` and the mapping of errors to exit statuses.

The parser is built on every ``crl-bench`` call, so a command module imports at its top only what
building its parser needs (argparse, the config, the method names, the data set names); torch, the
trainer, the envs and the bank are imported inside ``run``. ``crl-bench bench`` is served by
:mod:`crl_bench.bench` (:mod:`.bench` hands the command over).
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

__all__ = ["COMMANDS", "add_parsers", "command"]

#: command name -> module implementing it (in the order ``crl-bench --help`` lists them)
COMMANDS: dict[str, str] = {
    "run": "crl_bench.commands.run",
    "plan": "crl_bench.commands.plan",
    "sweep": "crl_bench.commands.sweep",
    "leaderboard": "crl_bench.commands.leaderboard",
    "compare": "crl_bench.commands.compare",
    "report": "crl_bench.commands.report",
    "submission": "crl_bench.commands.submission",
    "eval": "crl_bench.commands.eval",
    "envs": "crl_bench.commands.envs",
    "serve": "crl_bench.commands.serve",
    "bench": "crl_bench.commands.bench",
    "data": "crl_bench.commands.data",
    "swe": "crl_bench.commands.swe",
    "bank": "crl_bench.commands.bank",
    "extractor": "crl_bench.commands.extractor",
    "panel": "crl_bench.commands.panel",
    "model": "crl_bench.commands.model",
}


def command(name: str) -> ModuleType:
    """The module of command ``name`` (imported on first use).

    Raises:
        KeyError: ``name`` is not in :data:`COMMANDS`.
    """
    if name not in COMMANDS:
        raise KeyError(f"unknown command {name!r}; known: {', '.join(COMMANDS)}")
    return importlib.import_module(COMMANDS[name])


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add every command of :data:`COMMANDS`, in order, to ``subparsers`` (the ``crl-bench``
    subcommands); the parsed arguments of one carry its ``run`` as ``args.func``."""
    for name in COMMANDS:
        mod = command(name)
        mod.add_parser(subparsers).set_defaults(func=mod.run)
