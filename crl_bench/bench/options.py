"""Options shared by the benchmarks: the model and env of the model-driven ones (``rollout``, ``overhead``,
``step``) and the argparse types of their counts."""

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


def positive_int(text: str) -> int:
    """argparse type of a count that must be at least 1 (a size, a number of steps or repeats): a
    bad value is a usage error (exit 2) instead of a failure deep inside the benchmark."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type of a seed, a thread count (0: the library's default) or a warm-up length."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def gpu_list(text: str) -> list[int]:
    """``--gpus 2,3`` as ``[2, 3]``; an argparse type (raises ``ArgumentTypeError`` on anything else)."""
    try:
        gpus = [int(g) for g in text.split(",") if g.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"GPU indices, comma-separated, got {text!r}") from None
    from crl_bench.config_devices import distinct_gpus

    if not gpus or not distinct_gpus(gpus):
        raise argparse.ArgumentTypeError(f"distinct GPU indices >= 0, got {text!r}")
    return gpus
