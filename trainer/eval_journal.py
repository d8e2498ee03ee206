"""The episode journal of a resumable evaluation: each finished evaluation episode as one JSON line, so that
an interrupted ``crl-bench eval`` run again with the same arguments rolls out only the episodes it had
not finished (docs/evaluation.md "Resuming an evaluation").

A line is ``{"key": K, "mode": M, "index": I, "episode": {...}}``: ``K`` identifies the evaluation (the
settings, model and bank: :func:`crl_bench.trainer.lifecycle.partial_eval_key`, hashed), ``M`` the eval
mode, ``I`` the episode's place among the mode's specs (task order, then ``eval.samples``), and the
episode what an evaluation block is computed from (:meth:`Evaluator._block`): env, task, outcome,
steps, invalid actions, error, the experience that guided it and each turn's action, reply and
entropies. Prompt and reply token ids are not kept (no block reads them).

A journal written for another key (other settings, another model or bank, or a version of crl-bench whose
settings differ) is not used: it is moved aside to ``<path>.stale-<its key's first 8 hex digits>`` with a
warning, never deleted, and this evaluation starts a new one; a torn last line (the process killed
mid-write) is ignored. Whether an episode's outcome depends on the episodes run beside it is the
engine's: greedy episodes of an engine whose replies do not depend on the batch come out the same
resumed or not; sampled episodes are independent draws either way, but a resumed evaluation's draws
are not the ones an uninterrupted one would have made, which the block records (``resumed_episodes``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from crl_bench.rollout import Trajectory, Turn

__all__ = ["EpisodeJournal", "episode_record", "episode_from_record"]


def episode_record(t: Trajectory) -> dict[str, Any]:
    """What the journal keeps of trajectory ``t`` (JSON-ready)."""
    return {"env_id": t.env_id, "task": int(t.task), "group_id": t.group_id, "subgroup": t.subgroup,
            "meta": t.meta, "reward": float(t.reward), "success": bool(t.success), "steps": int(t.steps),
            "invalid_actions": int(t.invalid_actions), "terminated": bool(t.terminated),
            "truncated": bool(t.truncated), "context_full": bool(t.context_full), "error": t.error,
            "experience_ids": [int(x) for x in t.experience_ids],
            "turns": [{"action": u.action, "invalid": bool(u.invalid), "reward": float(u.reward), "reply": u.reply,
                       "entropy": [float(x) for x in u.entropy],
                       "sampling_entropy": [float(x) for x in u.sampling_entropy], "tool": bool(u.tool)}
                      for u in t.turns]}


def episode_from_record(d: dict[str, Any]) -> Trajectory:
    """The trajectory of a journal record (:func:`episode_record`), its turns without token ids."""
    turns = [Turn([], [], [], u["action"], u["invalid"], u["reward"], reply=u["reply"], entropy=list(u["entropy"]),
                  sampling_entropy=list(u["sampling_entropy"]), tool=u["tool"]) for u in d["turns"]]
    return Trajectory(d["env_id"], int(d["task"]), int(d["group_id"]), d["subgroup"], turns=turns,
                      reward=float(d["reward"]), success=bool(d["success"]), steps=int(d["steps"]),
                      invalid_actions=int(d["invalid_actions"]), terminated=bool(d["terminated"]),
                      truncated=bool(d["truncated"]), context_full=bool(d["context_full"]), error=d["error"],
                      meta=dict(d["meta"]), experience_ids=list(d["experience_ids"]))


class EpisodeJournal:
    """Finished evaluation episodes of one evaluation, kept in ``path`` (JSON lines).

    Args:
        path: the journal file (created on the first episode).
        key: what identifies the evaluation (any JSON value; hashed).
    """

    def __init__(self, path: str | Path, key: Any) -> None:
        self.path = Path(path)
        self.key = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
        self._kept: dict[str, dict[int, Trajectory]] = {}
        self._file = None
        if not self.path.is_file():
            return
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:                  # a torn line (the process killed mid-write)
                continue
            if not isinstance(rec, dict):
                continue
            if rec.get("key") != self.key:      # another evaluation's journal: keep it aside, start afresh
                self._kept.clear()
                self._set_aside(str(rec.get("key", "")))
                return
            try:
                self._kept.setdefault(str(rec["mode"]), {})[int(rec["index"])] = episode_from_record(rec["episode"])
            except (KeyError, TypeError, ValueError):
                continue

    def _set_aside(self, other: str) -> None:
        """Move the journal of another evaluation (key ``other``) to ``<path>.stale-<key[:8]>``, so that its
        episodes stay readable (and resumable by the settings that wrote them)."""
        import warnings

        tag = "".join(c for c in other[:8] if c.isalnum()) or "unknown"
        aside = self.path.with_name(f"{self.path.name}.stale-{tag}")
        n = 1
        while aside.exists():
            aside = self.path.with_name(f"{self.path.name}.stale-{tag}-{n}")
            n += 1
        self.path.rename(aside)
        warnings.warn(f"{self.path} holds episodes of another evaluation (other settings, model, bank or "
                      f"crl-bench version); kept as {aside}, this evaluation starts a new journal", stacklevel=3)

    def kept(self, mode: str) -> dict[int, Trajectory]:
        """The finished episodes of ``mode`` this journal holds: ``{index: trajectory}``."""
        return dict(self._kept.get(mode, {}))

    def count(self, modes: Any) -> int:
        """How many finished episodes of ``modes`` (an iterable of mode names) this journal holds."""
        return sum(len(self._kept.get(m, {})) for m in modes)

    def record(self, mode: str, index: int, t: Trajectory) -> None:
        """Append episode ``index`` of ``mode`` (flushed at once, so a kill loses at most this line)."""
        if self._file is None:
            torn = self.path.is_file() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n")
            self._file = self.path.open("a")
            if torn:                            # end the torn line, so the next record starts its own
                self._file.write("\n")
        self._file.write(json.dumps({"key": self.key, "mode": mode, "index": int(index),
                                     "episode": episode_record(t)}) + "\n")
        self._file.flush()

    def close(self, remove: bool = False) -> None:
        """Close the file; ``remove``: delete it (the evaluation's result is written)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if remove:
            self.path.unlink(missing_ok=True)
