"""``crl-bench envs list|play``: every registered env id with its splits, actions and chance rate (or
why it is unavailable here, with its docs page), or play an env yourself in the terminal."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from crl_bench.config import ConfigError

__all__ = ["ENV_DOC_PAGES", "HELP", "add_parser", "env_doc", "play", "run"]

HELP = "list or play environments"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``envs`` and its ``list`` and ``play`` subcommands to the ``crl-bench`` subcommands; returns
    the ``envs`` parser."""
    v = subparsers.add_parser("envs", help=HELP)
    vs = v.add_subparsers(dest="envs_cmd", required=True)
    vs.add_parser("list")
    pl = vs.add_parser("play")
    pl.add_argument("env")
    pl.add_argument("--task", type=int, default=0)
    pl.add_argument("--max-steps", type=int, default=50)
    return v


ENV_DOC_PAGES = {"minihack-": "minihack", "diag-": "diag", "swebench-": "swebench"}
"""Env id prefixes whose envs share one docs/envs page (the others have a page of their own name)."""


def env_doc(env_id: str) -> str:
    """The docs page of ``env_id`` (``docs/envs/<family>.md``) as a path relative to the checkout."""
    family = next((page for prefix, page in ENV_DOC_PAGES.items() if env_id.startswith(prefix)), env_id)
    return f"docs/envs/{family}.md"


def _short(text: str, limit: int = 140) -> str:
    """``text`` on one line, at most ``limit`` characters (cut at a word, with an ellipsis)."""
    one = " ".join(text.split())
    if len(one) <= limit:
        return one
    return one[:limit].rsplit(" ", 1)[0] + " ..."


def run(args: argparse.Namespace) -> int:
    """List the envs (``envs list``) or play one (``envs play``: :func:`play`); returns 0."""
    from crl_bench.env_api import list_envs, make_env

    if args.envs_cmd == "list":
        import warnings

        for env_id in list_envs():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("ignore")
                warnings.simplefilter("always", UserWarning)     # an env's setup notes, said once each
                try:
                    env = make_env(env_id)
                    splits = ", ".join(f"{k}: {len(v)}" for k, v in env.splits.items())
                    actions = env.admissible_actions()
                    # None: an open action set (WebShop's search[...] / click[...]), whose syntax
                    # the env's page gives
                    shown = (f"free text, as {env_doc(env_id)} says" if actions is None
                             else ", ".join(actions) if actions else "the admissible commands of each state")
                    # the env is built anyway for its splits and actions, so its chance rate (which
                    # depends on its settings) costs nothing more; shown only where the env knows it
                    chance = env.chance_success_rate()
                    known = "" if chance is None else f"; chance success: {chance:.4g}"
                    print(f"{env_id:18s} tasks ({splits}); actions: {shown}{known}")
                    env.close()
                except Exception as e:  # noqa: BLE001 - list what we can, say why one is unavailable
                    print(f"{env_id:18s} unavailable here ({type(e).__name__}: {_short(str(e))}); "
                          f"see {env_doc(env_id)}")
                    caught = []             # the reason above is what matters; its setup notes are not
            for w in caught:
                print(f"{'':18s} note: {_short(str(w.message))}")
        return 0
    return play(args.env, args.task, args.max_steps)


def play(env_id: str, task: int, max_steps: int, stdin: Any = None, stdout: Any = None) -> int:
    """Let a human play ``env_id`` in the terminal (bare action names are accepted)."""
    from crl_bench.env_api import make_env

    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    if stdin is None or getattr(stdin, "closed", False):
        raise ConfigError("envs play reads your actions from standard input, which is closed")
    env = make_env(env_id, max_steps=max_steps)
    try:
        obs, info = env.reset(options={"task": task})
    except BaseException:
        env.close()
        raise
    print(f"{env_id}, task {task}. {env.task_prompt()}  (type an action, or 'quit')\n", file=stdout)
    total = 0.0
    while True:
        print(obs, file=stdout)
        print("> ", end="", file=stdout, flush=True)
        try:
            line = stdin.readline()
        except (OSError, ValueError):       # stdin closed or unreadable mid-game: end like EOF
            line = ""
        if not line or line.strip().lower() in ("quit", "exit", "q"):
            print("\nbye", file=stdout)
            break
        reply = line if "<answer>" in line.lower() else f"<answer>{line.strip()}</answer>"
        obs, r, term, trunc, info = env.step(reply)
        total += r
        if term or trunc:
            print(obs, file=stdout)
            outcome = "success" if info["success"] else ("truncated" if trunc else "failed")
            print(f"\nEpisode over: {outcome}, reward {total:g}, {info['steps']} steps, "
                  f"{info['invalid_actions']} invalid.", file=stdout)
            break
    env.close()
    return 0
