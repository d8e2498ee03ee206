"""The ``crl-bench`` command line: :func:`main`, the top-level parser and the mapping of errors to exit
statuses. Each command is a module of :mod:`crl_bench.commands` (its options and what it runs); the
option groups several commands share are in :mod:`crl_bench.commands.options`.

Commands::

    crl-bench run   --method grpo --mix minihack-room [--preset smoke] [--config FILE] [--steps N]
                    [--model NAME] [--seed S] [--set section.key=value ...]
    crl-bench sweep --methods grpo,static,complementary --seeds 0,1,2 --mix M [--preset P] [--set ...]
    crl-bench leaderboard [DIR ...] [--out DIR]
    crl-bench report RUN_OR_SWEEP ... [--out DIR]
    crl-bench submission check DIR | crl-bench submission pack RUN ... --name NAME
    crl-bench eval  --mix sokoban [--run RUN_DIR | --model NAME] [--split eval] [--episodes N|all] [--modes M,...]
    crl-bench envs list | crl-bench envs play ENV [--task N]
    crl-bench serve ENV [--split S] [--host 127.0.0.1] [--port N] [--max-sessions N]
    crl-bench bench env | rollout | retrieval | overhead | step [--mix M --preset P --train-steps N]
                                            [--engines transformers,vllm]
    crl-bench bank show RUN | crl-bench bank stats RUN
    crl-bench model prepare
    crl-bench extractor sft --mix diag-vault --preset diag --out DIR [--steps N] [--lora-rank R]
    crl-bench data list | crl-bench data download alfworld|webshop|swebench ... [--data-dir DIR] [--source S]
    crl-bench swe filter --model M --k 16 --low 0 --high 0.8 [--tasks FILE] [--out FILE]
    crl-bench swe base-image
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from crl_bench import commands
from crl_bench.config import ConfigError
from crl_bench.data import ChecksumError, DataInvalidError, DataMissingError
from crl_bench.env_api import EnvUnavailableError
from crl_bench.llm import lean_imports
from crl_bench.llm.default_model import ModelNotAvailable
from crl_bench.results.run_folder import RunFolderError, is_storage_error

#: the errors a user can fix (a misspelt setting, a missing engine, data set or model, a refused resume,
#: a run folder in use): :func:`main` prints each as one line and exits with status 2
USER_ERRORS = (ConfigError, KeyError, FileExistsError, DataMissingError, DataInvalidError, ChecksumError,
               EnvUnavailableError, ModelNotAvailable, RunFolderError)


def build_parser() -> argparse.ArgumentParser:
    """The ``crl-bench`` parser: ``--version`` and one subcommand per command of
    :data:`crl_bench.commands.COMMANDS` (the parsed arguments carry the command's ``run`` as ``func``)."""
    from crl_bench import __version__

    p = argparse.ArgumentParser(
        prog="crl-bench",
        description="crl-bench: text environments for LLM agents (MiniHack, Sokoban, ALFWorld, WebShop, "
                    "SWE-Bench-Verified, diagnostic tasks), one batched rollout loop, and a trainer for "
                    "GRPO and Complementary RL (an actor and an experience extractor that co-evolve "
                    "through an experience bank).",
        epilog="Start with: crl-bench run --method complementary --mix 6task --preset smoke. "
               "Each command has --help; the documentation is README.md and docs/.")
    p.add_argument("--version", action="version", version=f"crl-bench {__version__}")
    commands.add_parsers(p.add_subparsers(dest="cmd", required=True))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``crl-bench`` command of ``argv`` (default: ``sys.argv[1:]``); returns its exit status.

    A usage error exits 2 through argparse. An error the user can fix (:data:`USER_ERRORS`) prints one
    line ``crl-bench: error: ...`` and returns 2; a full or read-only disk prints one line and returns
    1; any other exception propagates with its traceback.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    lean_imports.install()          # this process is crl-bench's: transformers without scikit-learn
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        from crl_bench.safe_io import printable

        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"crl-bench: error: {printable(msg)}", file=sys.stderr)     # it may quote a file's text
        return 2
    except OSError as e:
        if not is_storage_error(e):
            raise
        # the disk filled up or cannot be written: one message, no chained tracebacks
        print(f"crl-bench: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
