"""Run folders: ``results/runs/<run-id>/`` with the resolved config, versions, seeds, metrics, eval.

Layout of a run folder::

    config.yaml      resolved RunConfig (re-runnable with --config)
    versions.json    Python, platform, package versions, git commit of the checkout (if any)
    seeds.json       every seed the run used
    metrics.jsonl    one JSON object per training step
    episodes.jsonl   one JSON object per training episode: step, env, task, group, subgroup, outcome,
                     and the ids of the experience entries that guided it
    eval.json        final evaluation (success rate, mean steps, per env)
    checkpoint/      final weights (save_pretrained) and tokenizer
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

TRACKED_PACKAGES = ("crl-bench", "torch", "transformers", "peft", "gymnasium", "nle", "minihack", "numpy",
                    "gguf", "vllm", "ray", "sentence-transformers", "faiss-cpu")


def package_versions() -> dict[str, str]:
    """Installed versions of the packages a result depends on (absent ones are omitted)."""
    out = {}
    for name in TRACKED_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return res.stdout.strip() or None if res.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def make_run_id(method: str, mix: str, seed: int) -> str:
    """``YYYYmmdd-HHMMSS-<method>-<mix>-s<seed>`` with the mix made file-name safe."""
    safe_mix = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(mix).stem if mix.endswith((".yaml", ".yml")) else mix)
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{method}-{safe_mix}-s{seed}"


class RunWriter:
    """Creates and fills one run folder.

    Args:
        root: the runs folder (``results/runs`` by default).
        run_id: folder name; must not exist yet (raises ``FileExistsError``).
    """

    def __init__(self, root: str | Path, run_id: str) -> None:
        self.dir = Path(root) / run_id
        self.dir.mkdir(parents=True, exist_ok=False)
        self.metrics_path = self.dir / "metrics.jsonl"

    def write_config(self, config: dict[str, Any]) -> None:
        (self.dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    def write_versions(self) -> None:
        info = {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "packages": package_versions(),
            "git_commit": _git_commit(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        self.write_json("versions.json", info)

    def write_json(self, name: str, data: Any) -> None:
        tmp = self.dir / f".{name}.tmp"
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False))
        tmp.replace(self.dir / name)

    def log_episodes(self, step: int, trajectories: Any) -> None:
        """Append one line per episode of ``step`` (which entries guided which episode, outcomes)."""
        with (self.dir / "episodes.jsonl").open("a") as f:
            for t in trajectories:
                f.write(json.dumps({
                    "step": step, "env": t.env_id, "task": t.task, "group": t.group_id,
                    "subgroup": t.subgroup, "rollout": t.meta.get("rollout"), "success": t.success,
                    "reward": t.reward, "steps": t.steps, "invalid_actions": t.invalid_actions,
                    "experience_ids": list(t.experience_ids), "error": t.error}) + "\n")

    def log_metrics(self, row: dict[str, Any]) -> None:
        """Append one JSON line (flushed at once, so a crashed run keeps its history)."""
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Rows of ``metrics.jsonl`` of a run folder."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
