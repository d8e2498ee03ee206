"""``crl-bench bank show|stats RUN``: inspect the experience bank of a run (opened read-only: nothing
written, no model loaded): its entries with their utility counts, insights and reflections, or its
statistics as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from crl_bench.config import ConfigError

__all__ = ["HELP", "add_parser", "run", "shown"]

HELP = "inspect the experience bank of a run"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bank`` and its ``show`` and ``stats`` subcommands to the ``crl-bench`` subcommands; returns
    the ``bank`` parser."""
    k = subparsers.add_parser("bank", help=HELP)
    ks = k.add_subparsers(dest="bank_cmd", required=True)
    show = ks.add_parser("show", help="list entries with their utility counts")
    show.add_argument("run", help="run folder (or an experience.sqlite file)")
    show.add_argument("--env", help="only this env's entries, insights and reflections (entries: the bank "
                      "partition, e.g. minihack_navigation with experience.scope family)")
    show.add_argument("--limit", type=int, default=50)
    show.add_argument("--sort", choices=["id", "retrieved", "success", "failure", "votes", "utility"],
                      default="retrieved")
    st = ks.add_parser("stats", help="counts per env, retrievals, outcomes, operations applied and rejected, "
                                     "votes, merge passes, lineage")
    st.add_argument("run")
    return k


def _open_bank(run: str):
    """Open the experience bank of a run folder (or a ``.sqlite`` path) for inspection, with
    :meth:`ExperienceBank.open_readonly` (nothing written, no model loaded, a file that is not a
    crl-bench bank refused).

    A bank is the ``.sqlite`` file with its ``-wal``/``-shm`` files: after a crash the entries can sit
    only in the ``-wal``, so a near-empty ``.sqlite`` without its ``-wal`` gets a warning (it was
    probably copied without it).

    Raises:
        ConfigError: no bank there, or the file is not a (readable) crl-bench bank.
    """
    from crl_bench.experience.bank import ExperienceBank, NotABankError

    path = Path(run) / "experience.sqlite" if Path(run).is_dir() else Path(run)
    if not path.is_file():
        raise ConfigError(f"{run!r} has no experience bank (experience.sqlite); was it run with "
                          "a method with an experience bank (complementary, static, casebank, expel, reflexion)?")
    wal = path.with_name(path.name + "-wal")
    hint = (f" Its write-ahead log {wal.name} is missing: a bank that was not closed cleanly keeps its "
            f"entries there; copy {path.name} with its -wal and -shm files." if not wal.exists() else "")
    try:
        bank = ExperienceBank.open_readonly(path)
    except NotABankError as e:
        near_empty = path.stat().st_size <= 8192
        raise ConfigError(f"{e}." + (hint if near_empty else "")) from None
    if len(bank) == 0 and hint:
        print(f"crl-bench: warning: {path} holds no entries.{hint}", file=sys.stderr)
    return bank


def shown(text: Any) -> str:
    """Bank text for the terminal: control characters escaped (an ESC in a lesson cannot drive the
    terminal), tabs kept and each line after the first indented like the first, so a lesson's
    newline cannot start what looks like another entry."""
    from crl_bench.safe_io import printable

    return printable(text).replace("\n", "\n    ")


def run(args: argparse.Namespace) -> int:
    """``crl-bench bank show|stats RUN``: list a bank's entries or print its statistics (JSON).

    Raises:
        ConfigError: no bank, or the file is not a readable crl-bench bank (exit 2, naming it).
    """
    import sqlite3

    bank = _open_bank(args.run)
    try:
        if args.bank_cmd == "stats":
            print(json.dumps(bank.stats(), indent=2))
            return 0
        entries = bank.entries(args.env)
        keys = {"id": lambda e: -e.id, "retrieved": lambda e: e.times_retrieved,
                "success": lambda e: e.times_success, "failure": lambda e: e.times_failure,
                "votes": lambda e: e.votes, "utility": lambda e: e.utility}
        entries.sort(key=keys[args.sort], reverse=True)
        for e in entries[:args.limit]:
            lineage = f"{e.origin}" + (f" of #{', #'.join(map(str, e.parent_ids))}" if e.parent_ids else "")
            print(f"#{e.id} [{shown(e.env_id)}] {shown(e.title)}\n    {shown(e.content)}\n    retrieved "
                  f"{e.times_retrieved}, guided {e.times_success} successes / {e.times_failure} failures, utility "
                  f"{e.utility:.3f}, votes {e.votes:+d}; {shown(lineage)} at step {e.created_step}, extractor version "
                  f"{e.extractor_version}")
        print(f"{len(entries)} entries" + (f" (showing {args.limit})" if len(entries) > args.limit else ""))
        insights = bank.insights(args.env)
        if insights:                    # a method with insight lists (expel): most important first, per env
            print("\ninsights:")
            for i in insights[:args.limit]:
                print(f"#{i.id} [{shown(i.env_id)}] importance {i.importance}, added at step {i.created_step}, "
                      f"changed at step {i.updated_step}\n    {shown(i.text)}")
            print(f"{len(insights)} insights" + (f" (showing {args.limit})" if len(insights) > args.limit else ""))
        reflections = bank.recent_reflections(args.env, args.limit)
        if reflections:                 # reflexion: the newest reflections first, each with its task
            print("\nreflections:")
            for env_id, task, text, step in reflections:
                print(f"[{shown(env_id)}] task {task}, written at step {step}\n    {shown(text)}")
            total = bank.reflection_count(args.env)
            print(f"{total} reflections" + (f" (showing the newest {args.limit})" if total > args.limit else ""))
        return 0
    except (sqlite3.Error, ValueError, TypeError) as e:   # rows a crl-bench bank never holds
        raise ConfigError(f"{bank.path} is not a readable crl-bench experience bank: {e}") from None
    finally:
        bank.close()
