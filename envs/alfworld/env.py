"""ALFWorld (text): household tasks in TextWorld, the paper's 1,466 train / 134 eval task lists and the
140 games of valid_seen.

Each env instance owns one worker process that runs the real ALFWorld TextWorld game (``alfworld``
0.4.x: ``textworld.gym.register_game`` with ALFWorld's ``AlfredDemangler``/``AlfredInfos`` wrappers,
as ``alfworld/agents/environment/alfred_tw_env.py`` sets them up, without domain randomisation),
forked from a launcher process that imported TextWorld once (:mod:`.process`).
A reset costs about a second or more (the game's PDDL is translated by the planner) and a step tens of
milliseconds, so the simulator lives outside the trainer's process: the rollout sends every env its
action before waiting on any (the split-phase protocol of :class:`~crl_bench.env_api.TextEnv`), and
``prefetch_resets`` lets the trainer start the next step's resets while the actor is generating.

A worker that dies or stops answering (``timeout_s``) fails the current episode with
:class:`EnvWorkerError`; the next reset starts a fresh worker (``restarts`` counts them). Each worker's
address space is capped at ``memory_mb`` (``RLIMIT_AS``) and its peak resident memory is reported in
``info["worker_rss_mb"]``. TextWorld keeps what it loads for every game a process has played (about
4-7 MB of address space per game, measured), so a worker that plays a hundred or more games would
hit the cap in the middle of an episode; instead, a reset whose worker has used
:data:`RECYCLE_FRACTION` of ``memory_mb`` first replaces it with a fresh one between episodes
(``recycles`` counts them; no episode is lost).

Observation: the room description of the first observation (kept, since it lists every receptacle),
then ``Last: <the game's feedback>``, then the admissible commands. The task line is the game's
"Your task is to: ...". Actions are free text matched against the admissible commands (case and
whitespace tolerant); anything else is an invalid action fed back. Reward: ``success_reward`` (+1)
when the game is won, ``failure_reward`` (-1) on the step where the step limit ends an unfinished
episode, 0 otherwise; the paper's scheme (ComplementaryRL ``roll/pipeline/agentic/env/alfworld``).

Task ids: train ``0..1465`` = line numbers of ``train_1466.jsonl`` (the one trial missing from the
release is skipped with a warning); eval ``10000..10133`` = ``10000 +`` line number of
``eval_134.jsonl`` (all under ``valid_unseen``); eval_seen ``20000..20139`` = ``20000 +`` line number of
``eval_seen_140.jsonl`` (every game of ``valid_seen``, the split verl-agent evaluates).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from crl_bench.data import DataMissingError, sha256_file
from crl_bench.data import data_dir as resolve_data_dir
from crl_bench.env_api import TextEnv, data_file_map, require_modules

from .data import (
    ALFWORLD_ARCHIVE,
    ALFWORLD_PACKAGED_SPLITS,
    ALFWORLD_SPLIT_FILES,
    AlfWorldTask,
    alfworld_dir,
    alfworld_games_root,
    alfworld_tasks,
    game_hashes,
    split_file,
)
from .process import EnvWorkerError, Worker

EVAL_OFFSET = 10_000
#: First task id of the ``eval_seen`` split (ALFWorld's valid_seen): ``20000 +`` its list's line.
EVAL_SEEN_OFFSET = 20_000
#: Offset of each split's task ids.
SPLIT_OFFSETS = {"train": 0, "eval": EVAL_OFFSET, "eval_seen": EVAL_SEEN_OFFSET}
#: Share of ``memory_mb`` of address space past which a worker is replaced before the next reset.
RECYCLE_FRACTION = 0.75

SYSTEM_PROMPT = (
    "You are a household agent in a text world. Each turn you see the room, the result of your last "
    "command and the commands you can use now. Reach the task's goal by choosing one command per turn: "
    "go to places, open and close receptacles, take and put objects, heat, cool or clean them with the "
    "right appliance, and use lamps. Reply with exactly one of the listed commands as "
    "<answer>COMMAND</answer>."
)


# ---- the env -------------------------------------------------------------------------------------

@lru_cache(maxsize=8)
def _task_table(root: str) -> tuple[dict[int, AlfWorldTask], dict[str, list[int]], str]:
    """``({task id: task}, {split: ids}, games root)`` for the data dir ``root``; cached per process."""
    games = alfworld_games_root(root)
    expected = game_hashes(alfworld_dir(root))
    table: dict[int, AlfWorldTask] = {}
    ids: dict[str, list[int]] = {}
    for split, offset in SPLIT_OFFSETS.items():
        ids[split] = []
        missing = []
        for t in alfworld_tasks(split, root):
            if (games / t.member).is_file():
                table[offset + t.index] = t
                ids[split].append(offset + t.index)
            elif t.member in expected:          # a game of the release that is not there: refused
                raise DataMissingError(f"alfworld: the game of {split} line {t.index} ({t.description}) is "
                                       f"missing from {games}; run `crl-bench data download alfworld`")
            else:                               # the trial the release lacks (null in the manifest)
                missing.append(t)
        if missing:
            warnings.warn(f"alfworld: {len(missing)} {split} task(s) have no game in the data and are "
                          f"skipped: " + ", ".join(f"line {t.index} ({t.description})" for t in missing),
                          stacklevel=3)
    return table, ids, str(games)


_BANNER_RE = re.compile(r"^-= Welcome to TextWorld, ALFRED! =-\s*", re.MULTILINE)
_TASK_RE = re.compile(r"Your task is to:\s*(.+)", re.IGNORECASE)


class AlfWorldEnv(TextEnv):
    """ALFWorld text env in a worker process; see the module docstring.

    Args:
        max_steps: actions per episode before truncation (default 50).
        data_dir: data root (default ``$CRL_BENCH_DATA`` or the cache); games under ``alfworld/``.
        success_reward: reward when the game is won.
        failure_reward: reward on the step where the step limit ends an unwon episode.
        memory_mb: address-space cap of the worker process (0 = none).
        timeout_s: how long to wait for a reset or step before the worker is declared hung.

    Raises:
        DataMissingError: the task lists or games are not in the data dir (names the command to run).
        EnvUnavailableError: ``textworld`` or ``alfworld`` (the ``[alfworld]`` extra) is not installed;
            checked here, although only the worker process imports them.
    """

    env_id: ClassVar[str] = "alfworld"
    system_prompt: ClassVar[str] = SYSTEM_PROMPT
    prefetch_resets: ClassVar[bool] = True

    def __init__(self, max_steps: int = 50, data_dir: str | None = None, success_reward: float = 1.0,
                 failure_reward: float = -1.0, memory_mb: int = 1024, timeout_s: float = 120.0,
                 render_mode: str | None = "ansi") -> None:
        super().__init__(max_steps=max_steps, render_mode=render_mode)
        require_modules(self.env_id, "textworld", "alfworld")
        self.data_root = str(resolve_data_dir(data_dir))
        self.tasks, ids, self.games_root = _task_table(self.data_root)
        self.splits = {split: ids[split] for split in SPLIT_OFFSETS}
        self.success_reward = float(success_reward)
        self.failure_reward = float(failure_reward)
        self.memory_mb = int(memory_mb)
        self.timeout_s = float(timeout_s)
        self.restarts = 0
        self.recycles = 0
        self._worker: Worker | None = None
        self._room = ""
        self._goal = ""
        self._admissible: list[str] = []
        self._rss_mb = 0.0

    # ---- worker management ------------------------------------------------------------------------
    def _ensure_worker(self) -> Worker:
        if self._worker is not None and not self._worker.alive():
            self._drop_worker()
        if self._worker is None:
            self._worker = Worker(self.memory_mb, self.timeout_s)
            self._rss_mb = self._worker.rss_mb
        return self._worker

    def _drop_worker(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker = None
            self.restarts += 1

    def _call_result(self) -> dict[str, Any]:
        if self._worker is None:
            raise EnvWorkerError("no ALFWorld worker (the previous request failed)")
        try:
            status, payload = self._worker.recv(self.timeout_s)
        except EnvWorkerError:
            self._drop_worker()
            raise
        if status != "ok":
            raise EnvWorkerError(f"ALFWorld game error: {payload}")
        self._rss_mb = max(self._rss_mb, float(payload.get("rss_mb", 0.0)))
        self._worker.vm_mb = float(payload.get("vm_mb", 0.0))
        return payload

    @property
    def worker_pid(self) -> int | None:
        """Process id of the current worker (``None`` before the first reset)."""
        return self._worker.pid if self._worker is not None else None

    @property
    def worker_rss_mb(self) -> float:
        """Peak resident memory (MB) of this env's workers so far, as the worker reports it."""
        return self._rss_mb

    def gamefile(self, task: int) -> str:
        """Path of the ``game.tw-pddl`` of ``task``. Raises ``KeyError`` for an unknown id."""
        if task not in self.tasks:
            raise KeyError(f"alfworld: unknown task id {task}; train ids are 0..1465, eval ids "
                           f"{EVAL_OFFSET}..{EVAL_OFFSET + 133}, eval_seen ids "
                           f"{EVAL_SEEN_OFFSET}..{EVAL_SEEN_OFFSET + 139}")
        return os.path.join(self.games_root, self.tasks[task].member)

    def task_fingerprint(self, task: int) -> dict[str, Any]:
        """The task's game: its file relative to the games folder, the file's sha256 and the goal of
        the split list (:meth:`TextEnv.task_fingerprint`); reads the game file, starts no worker.
        Raises ``KeyError`` for an unknown id."""
        path = self.gamefile(self.check_task(task))
        return {"game_file": self.tasks[task].member, "game_sha256": sha256_file(path), "goal": self.tasks[task].goal}

    def task_type(self, task: int) -> str:
        """ALFWorld's task type of ``task``: one of ``pick_and_place_simple``,
        ``look_at_obj_in_light``, ``pick_clean_then_place_in_recep``, ``pick_heat_then_place_in_recep``,
        ``pick_cool_then_place_in_recep``, ``pick_two_obj_and_place`` (the first field of the task's
        folder name, :attr:`crl_bench.envs.alfworld.data.AlfWorldTask.task_type`).  Read from the task table of this
        process; the worker is not involved.  Raises ``KeyError`` for an unknown id."""
        if task not in self.tasks:
            raise KeyError(f"alfworld: unknown task id {task}")
        return self.tasks[task].task_type

    def data_files(self) -> dict[str, Path]:
        """The downloaded split files (not the ``eval_seen`` list, which is part of the package), plus
        the game archive ``alfworld/json_2.1.1.tar.xz`` when the games were unpacked from it
        (:func:`crl_bench.envs.alfworld.data.alfworld_games_root`); games already unpacked in the data
        dir (thousands of files) are not listed.  See :meth:`TextEnv.data_files`."""
        folder = alfworld_dir(self.data_root)
        paths = [split_file(s, folder) for s in ALFWORLD_SPLIT_FILES if s not in ALFWORLD_PACKAGED_SPLITS]
        if Path(self.games_root).absolute() != folder.absolute():
            paths.append(folder / ALFWORLD_ARCHIVE)
        return data_file_map(self.data_root, paths)

    # ---- TextEnv hooks ----------------------------------------------------------------------------
    def _submit_reset(self, task: int) -> None:
        path = self.gamefile(task)
        w = self._worker
        if w is not None and self.memory_mb > 0 and w.vm_mb > RECYCLE_FRACTION * self.memory_mb:
            w.close()                           # between episodes: a fresh worker before the cap is hit
            self._worker = None
            self.recycles += 1
        worker = self._ensure_worker()
        try:
            worker.send("reset", path)
        except EnvWorkerError:
            self._drop_worker()
            raise

    def _reset_task(self, task: int) -> None:
        out = self._call_result()
        text = _BANNER_RE.sub("", out["obs"]).strip()
        m = _TASK_RE.search(text)
        self._goal = m.group(1).strip() if m else self.tasks[task].goal
        self._room = _TASK_RE.sub("", text).strip()
        self._admissible = out["admissible"]

    def _submit_apply(self, action: str) -> None:
        if self._worker is None:
            raise EnvWorkerError("no ALFWorld worker (the episode's worker was lost)")
        try:
            self._worker.send("step", action)
        except EnvWorkerError:
            self._drop_worker()
            raise

    def _apply(self, action: str) -> tuple[float, bool, bool, str]:
        out = self._call_result()
        self._admissible = out["admissible"]
        won = bool(out["won"])
        return (self.success_reward if won else 0.0), won, won, out["obs"].strip()

    def _observe(self, message: str = "") -> str:
        parts = [self._room]
        if message:
            parts.append(f"Last: {' '.join(message.split())}")
        parts.append("Admissible commands: " + ", ".join(self._admissible))
        return "\n".join(parts)

    def admissible_actions(self) -> list[str] | None:
        return list(self._admissible)

    def task_prompt(self) -> str:
        return self._goal

    def truncation_reward(self) -> float:
        return self.failure_reward

    def extra_info(self) -> dict[str, Any]:
        """``worker_rss_mb`` (the worker process's peak resident memory), ``worker_restarts`` (workers
        replaced after a failure) and ``worker_recycles`` (replaced between episodes near the memory cap)."""
        return {"worker_rss_mb": round(self._rss_mb, 1), "worker_restarts": self.restarts,
                "worker_recycles": self.recycles}

    def walkthrough(self, task: int) -> list[str]:
        """The game's stored solving command list (``walkthrough`` of its ``game.tw-pddl``)."""
        import json
        with open(self.gamefile(task), encoding="utf-8") as f:
            return list(json.load(f)["walkthrough"])

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        super().close()

    def __del__(self) -> None:  # a worker must not outlive its env
        try:
            if self._worker is not None:
                self._worker.kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def check_data(data_dir_: str | None = None) -> dict[str, Sequence[int]]:
    """Resolve every task list against the games (unpacking them if needed); returns the split ids.

    Raises:
        DataMissingError: the data is not there.
    """
    _, ids, _ = _task_table(str(resolve_data_dir(data_dir_)))
    return ids


__all__ = ["AlfWorldEnv", "EnvWorkerError", "DataMissingError", "EVAL_OFFSET", "EVAL_SEEN_OFFSET", "check_data"]
