"""Options shared by the model-driven benchmarks (``rollout``, ``overhead``, ``step``)."""

from __future__ import annotations

import argparse

#: the model the model-driven benchmarks load unless ``--model`` names another
DEFAULT_MODEL = "smollm2-135m-instruct"
#: the env they run when no ``--env`` is given
DEFAULT_ENV = "minihack-room"


def add_model_and_env(p: argparse.ArgumentParser, env_help: str) -> None:
    """Add ``--model NAME`` (default :data:`DEFAULT_MODEL`) and ``--env ID`` (repeatable; the first one
    counts, see :func:`first_env`) to ``p``."""
    p.add_argument("--env", action="append", help=env_help)
    p.add_argument("--model", default=DEFAULT_MODEL)


def first_env(args: argparse.Namespace) -> str:
    """The first ``--env`` of ``args``, or :data:`DEFAULT_ENV` when none was given."""
    return (args.env or [DEFAULT_ENV])[0]
