"""``crl-bench panel export|check``: task panels, the evaluated task ids of an env with a content hash
each (docs/evaluation.md "Task panels"; crl_bench/results/panel.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from crl_bench.commands.bank import shown
from crl_bench.commands.options import add_config_args, episodes, resolve_config
from crl_bench.config import ConfigError

__all__ = ["HELP", "add_parser", "run"]

HELP = "task panels: the evaluated task ids with a content hash each (docs/evaluation.md \"Task panels\")"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``panel`` and its ``export`` and ``check`` subcommands to the ``crl-bench`` subcommands;
    returns the ``panel`` parser."""
    pn = subparsers.add_parser("panel", help=HELP)
    pns = pn.add_subparsers(dest="panel_cmd", required=True)
    pe = pns.add_parser("export", help="write an env's eval panel (task ids, content hashes, panel hash)")
    pe.add_argument("env", help="env id")
    add_config_args(pe, with_method=False)
    pe.add_argument("--split", default="eval", help="split (default eval)")
    pe.add_argument("--episodes", type=episodes, help="tasks per env as in eval.episodes (default: the config's)")
    pe.add_argument("--out", help="panel file (default <env>-<split>.panel.json)")
    pe.add_argument("--quiet", action="store_true", help="no progress bar")
    pc = pns.add_parser("check", help="check that this machine's data and code reproduce a panel "
                                      "(exit 1 naming the tasks that differ)")
    pc.add_argument("panel", help="a panel file from `panel export`")
    pc.add_argument("--quiet", action="store_true", help="no progress bar")
    return pn


def run(args: argparse.Namespace) -> int:
    """``crl-bench panel export ENV`` / ``panel check PANEL``: write an env's eval task panel, or check
    that this machine's data and code reproduce one (:mod:`crl_bench.results.panel`).

    ``export`` exits 0; ``check`` exits 0 when every task reproduces, 1 when any differs (each
    difference printed), 2 for an unreadable panel file or an env that cannot be made.
    """
    from tqdm import tqdm

    from crl_bench.results.panel import PanelError, build_panel, check_panel, panel_task_ids, read_panel
    from crl_bench.rollout import EnvPool

    if args.panel_cmd == "export":
        extra: dict[str, Any] = {"eval.split": args.split}
        if args.episodes is not None:
            extra["eval.episodes"] = args.episodes
        cfg = resolve_config(args, extra)
        split = cfg.eval.split_of(args.env)          # a profile's split for this env (eval.splits), else --split
        settings = dict(cfg.rollout.env_kwargs.get(args.env, {}))
        env = EnvPool({args.env: settings}, cfg.rollout.max_steps).make(args.env)
        try:
            ep = cfg.eval.episodes
            ids = panel_task_ids(env, split, ep)
            with tqdm(total=len(ids), desc=f"panel {args.env} {split}", unit="task", disable=args.quiet) as bar:
                panel = build_panel(env, args.env, split, ids, episodes=ep, env_settings=settings,
                                    progress=bar.update)
        finally:
            env.close()
        out = Path(args.out) if args.out else Path(f"{args.env}-{split}.panel.json")
        out.write_text(json.dumps(panel, indent=1) + "\n")
        print(f"panel {panel['panel_hash']}: {args.env} {split}, {len(ids)} tasks; wrote {out}")
        return 0
    try:
        panel = read_panel(args.panel)
    except PanelError as e:
        raise ConfigError(str(e)) from None
    try:
        env = EnvPool({panel["env"]: panel["env_settings"]}, panel["max_steps"]).make(panel["env"])
    except (TypeError, ValueError) as e:     # env_settings the env's constructor does not take
        raise ConfigError(f"{args.panel}: its env_settings cannot make {panel['env']!r} here "
                          f"({type(e).__name__}: {str(e)[:200]})") from None
    try:
        with tqdm(total=len(panel["tasks"]), desc=f"check {panel['env']}", unit="task", disable=args.quiet) as bar:
            problems = check_panel(panel, env, progress=bar.update)
    finally:
        env.close()
    if problems:
        print(f"panel {panel['panel_hash']} ({panel['env']} {panel['split']}): NOT reproduced here, "
              f"{len(problems)} problem(s):")
        for line in problems:
            print(f"  {shown(line)}")
        return 1
    print(f"panel {panel['panel_hash']} ({panel['env']} {panel['split']}, {len(panel['tasks'])} tasks): reproduced")
    return 0
