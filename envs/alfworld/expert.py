"""ALFWorld games played by their expert plans: the check that a split's games are solvable as
crl-bench serves them, and the builder of the ``eval_seen`` task list.

Every ALFWorld ``game.tw-pddl`` stores ``walkthrough``, a command list that solves it (ALFWorld's
handcoded expert, ``alfworld/agents/expert``, wrote them when the games were generated).

* :func:`replay_split` plays every task of a split through :class:`~crl_bench.envs.alfworld.env.AlfWorldEnv`
  (its text layer included: each command sent as ``<answer> COMMAND </answer>`` in upper case,
  which the env must match back to the admissible command) and counts the games won with reward
  exactly ``success_reward``. ``python -m crl_bench.envs.alfworld.expert --split eval_seen`` runs it and
  exits 1 unless every game is won.
* :func:`build_seen_list` writes ``eval_seen_140.jsonl``: every game folder of ``valid_seen`` (the
  split verl-agent evaluates as ``eval_in_distribution``), sorted by ``<task-folder>/<trial>`` (so the
  order never depends on the file system), each with the goal its game states at reset ("Your task
  is to: ...") and refused unless its walkthrough wins it. Maintainers run it once, with
  ``--build-seen-list OUT --games-root DIR`` (``DIR`` holding ``json_2.1.1/valid_seen``), and put the
  file's sha256 and its games' in ``crl_bench/data_manifests/alfworld.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .data import ALFWORLD_GAME_FOLDERS, ALFWORLD_ROOT


def replay_split(split: str, data_dir: str | None = None, tasks: Sequence[int] | None = None,
                 progress: bool = False) -> dict[str, Any]:
    """Play the walkthrough of every task of ``split`` (or of ``tasks``) through the env.

    Returns ``{"split", "tasks", "won", "lost": [{"task", "description", "why"}], "steps"}``: a game
    counts as won when no command was refused as invalid, the episode ended on the last command and
    its reward was exactly the env's ``success_reward`` with nothing before it.

    Raises:
        KeyError: unknown split.
        DataMissingError, EnvUnavailableError: as :class:`AlfWorldEnv` raises them.
    """
    from .env import AlfWorldEnv

    env = AlfWorldEnv(data_dir=data_dir, max_steps=1_000)
    try:
        ids = list(tasks) if tasks is not None else list(env.task_ids(split))
        lost: list[dict[str, Any]] = []
        steps = 0
        for k, task in enumerate(ids):
            why, n = _replay(env, task)
            steps += n
            if why:
                lost.append({"task": task, "description": env.tasks[task].description, "why": why})
            if progress:
                print(f"[{k + 1}/{len(ids)}] task {task}: {'lost: ' + why if why else 'won'}", flush=True)
        return {"split": split, "tasks": len(ids), "won": len(ids) - len(lost), "lost": lost, "steps": steps}
    finally:
        env.close()


def _replay(env: Any, task: int) -> tuple[str, int]:
    """Why the walkthrough of ``task`` did not win it through ``env`` (``""`` when it did), and the
    walkthrough's number of commands."""
    env.reset(options={"task": task})
    plan = env.walkthrough(task)
    return _verdict(env, plan), len(plan)


def _verdict(env: Any, plan: list[str]) -> str:
    """Play ``plan`` in ``env`` (just reset); why it did not win (``""`` when it did)."""
    if not plan:
        return "the game has no walkthrough"
    total = 0.0
    for k, cmd in enumerate(plan):
        _obs, r, term, trunc, info = env.step(f"<answer>  {cmd.upper()} </answer>")
        total += r
        if info["invalid_action"]:
            return f"command {k} {cmd!r} was refused as invalid"
        if (term or trunc) and k < len(plan) - 1:
            return f"the episode ended at command {k} of {len(plan)}"
    if not (term and info["success"]):
        return "the last command did not win the game"
    if total != env.success_reward:
        return f"reward {total}, not {env.success_reward}"
    return ""


def build_seen_list(games_root: Path, out: Path, memory_mb: int = 1024, timeout_s: float = 120.0) -> int:
    """Write the ``eval_seen`` task list of every game under ``<games_root>/json_2.1.1/valid_seen``
    (module docstring); returns the number of tasks.

    Each line: ``{"id": i, "goal": str, "difficulty": "", "additional_info": {"description":
    "<task-folder>/<trial>"}}``, the format of the paper's lists.

    Raises:
        FileNotFoundError: no ``valid_seen`` game under ``games_root``.
        RuntimeError: a game states no goal at reset, or its walkthrough does not win it.
    """
    from .env import _TASK_RE, RECYCLE_FRACTION
    from .process import EnvWorkerError, Worker

    folder = Path(games_root) / ALFWORLD_ROOT / ALFWORLD_GAME_FOLDERS["eval_seen"]
    games = sorted(folder.glob("*/*/game.tw-pddl"))
    if not games:
        raise FileNotFoundError(f"no valid_seen game under {folder}")
    rows = []
    worker = Worker(memory_mb, timeout_s)
    try:
        for i, game in enumerate(games):
            desc = game.parent.relative_to(folder).as_posix()
            if worker.vm_mb > RECYCLE_FRACTION * memory_mb:     # as the env does between episodes
                worker.close()
                worker = Worker(memory_mb, timeout_s)
            worker.send("reset", str(game))
            status, payload = worker.recv(timeout_s)
            if status != "ok":
                raise EnvWorkerError(f"{desc}: {payload}")
            m = _TASK_RE.search(payload["obs"])
            if not m:
                raise RuntimeError(f"{desc}: the game states no goal at reset")
            for cmd in json.loads(game.read_text(encoding="utf-8"))["walkthrough"]:
                worker.send("step", cmd)
                status, payload = worker.recv(timeout_s)
                if status != "ok":
                    raise EnvWorkerError(f"{desc}: {payload}")
            worker.vm_mb = float(payload.get("vm_mb", 0.0))
            if not payload["won"]:
                raise RuntimeError(f"{desc}: its walkthrough does not win it")
            rows.append({"id": i, "goal": m.group(1).strip(), "difficulty": "",
                         "additional_info": {"description": desc}})
    finally:
        worker.close()
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return len(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m crl_bench.envs.alfworld.expert",
                                description="Replay every game's walkthrough of an ALFWorld split through the env "
                                            "(exit 1 unless all are won), or build the eval_seen task list.")
    p.add_argument("--split", default="eval_seen", help="train, eval or eval_seen (default eval_seen)")
    p.add_argument("--data-dir", default=None, help="data dir (default: CRL_BENCH_DATA or the cache)")
    p.add_argument("--build-seen-list", type=Path, metavar="OUT", help="maintainers: write the eval_seen list")
    p.add_argument("--games-root", type=Path, help="with --build-seen-list: folder holding json_2.1.1/valid_seen")
    args = p.parse_args(argv)
    if args.build_seen_list is not None:
        if args.games_root is None:
            p.error("--build-seen-list needs --games-root")
        n = build_seen_list(args.games_root, args.build_seen_list)
        print(f"wrote {args.build_seen_list}: {n} tasks, every walkthrough won")
        return 0
    res = replay_split(args.split, args.data_dir, progress=True)
    print(f"alfworld {res['split']}: {res['won']} of {res['tasks']} games won by their walkthroughs "
          f"({res['steps']} commands)")
    for x in res["lost"]:
        print(f"  lost: task {x['task']} ({x['description']}): {x['why']}")
    return 0 if not res["lost"] else 1


if __name__ == "__main__":
    sys.exit(main())
