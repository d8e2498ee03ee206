"""Task panels: the tasks an evaluation runs, named by content, so a result can be cited and checked.

A panel is the ordered list of task ids an evaluation of one env runs on one split (the first
``eval.episodes`` ids of the split, or all of them: ``Evaluator.task_ids``) together with a content
hash per task, taken from :meth:`crl_bench.env_api.TextEnv.task_fingerprint` (ALFWorld: the game file
and goal; WebShop: the goal and the target's price; Sokoban, MiniHack and the diagnostics: the rendered
first observation, MiniHack with its NetHack seeds; SWE-bench: the instance). The **panel hash** covers
the env id, the split and the ordered ``(task id, task hash)`` pairs, so two evaluations with the same
panel hash ran the same tasks with the same content, whatever machine, data copy or package version
they ran on; a different hash says which was not the same, and :func:`check_panel` says which tasks.

Hashes are sha256 over canonical JSON (sorted keys, no spaces, UTF-8): a field's hash over its value,
a task's hash over ``{field: field hash}``, the panel's over ``{"env", "split", "tasks": [[id, task
hash], ...]}``. Environment settings (``rollout.env_kwargs``) are stored in the panel file so that
``crl-bench panel check`` can rebuild the env, but are not hashed: what they change, the content shows.

Why this exists: reproductions of agent-RL papers on ALFWorld and WebShop failed because the task
panel depended on the machine (task order from file discovery, goals and prices from worker seeds);
docs/evaluation.md "Task panels".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PANEL_FORMAT = 1
"""Version of the panel file layout (:func:`build_panel`)."""

SHORT = 12
"""Hex digits of a panel hash shown in tables and labels (:func:`short_hash`)."""


class PanelError(ValueError):
    """A panel file that cannot be read or is not a crl-bench panel (the message names the file and the key)."""


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def content_hash(value: Any) -> str:
    """sha256 (hex) of ``value`` as canonical JSON. Raises ``TypeError`` for a value JSON cannot hold."""
    return hashlib.sha256(_canonical(value)).hexdigest()


def short_hash(h: str) -> str:
    """The first :data:`SHORT` hex digits of a hash, as tables show it."""
    return h[:SHORT]


def task_entry(task: int, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """``{"task", "hash", "fields": {name: hash}}`` of one task from its fingerprint
    (:meth:`~crl_bench.env_api.TextEnv.task_fingerprint`)."""
    fields = {name: content_hash(v) for name, v in sorted(fingerprint.items())}
    return {"task": int(task), "hash": content_hash(fields), "fields": fields}


def panel_hash(env_id: str, split: str, tasks: Sequence[dict[str, Any]]) -> str:
    """The hash of a panel from its env id, split and task entries (in evaluation order)."""
    return content_hash({"env": env_id, "split": split, "tasks": [[int(t["task"]), t["hash"]] for t in tasks]})


def panel_task_ids(env: Any, split: str, episodes: int | str) -> list[int]:
    """The task ids an evaluation with ``eval.episodes`` = ``episodes`` runs on ``env``'s ``split``: the
    first ``episodes`` of the split, or all of them for ``"all"`` (as ``Evaluator.task_ids``).
    Raises ``KeyError`` for an unknown split."""
    ids = [int(t) for t in env.task_ids(split)]
    return ids if episodes == "all" else ids[:int(episodes)]


def build_panel(env: Any, env_id: str, split: str, task_ids: Sequence[int], *, episodes: int | str = "all",
                env_settings: dict[str, Any] | None = None,
                progress: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """The panel of ``task_ids`` (in evaluation order) of ``env`` (an env of ``env_id``).

    Args:
        env: a :class:`~crl_bench.env_api.TextEnv` (or a Ray backend's remote env) with the run's
            settings; procedural envs are reset once per task.
        env_id, split: what the ids belong to.
        task_ids: the evaluated ids, in order.
        episodes: ``eval.episodes`` as asked (an int or ``"all"``), recorded for ``panel check``.
        env_settings: the env's ``rollout.env_kwargs``, recorded so that the env can be rebuilt.
        progress: called with 1 after each task.

    Returns:
        ``{"format", "env", "split", "episodes", "env_settings", "max_steps", "tasks": [task_entry...],
        "panel_hash"}`` (``max_steps``: the env's step limit, with which ``panel check`` rebuilds it,
        as an observation may state it).

    Raises:
        KeyError: an id that is not a task of the env.
    """
    tasks = []
    for t in task_ids:
        tasks.append(task_entry(int(t), env.task_fingerprint(int(t))))
        if progress is not None:
            progress(1)
    return {"format": PANEL_FORMAT, "env": env_id, "split": split, "episodes": episodes,
            "env_settings": dict(env_settings or {}), "max_steps": int(getattr(env, "max_steps", 0) or 0),
            "tasks": tasks,
            "panel_hash": panel_hash(env_id, split, tasks)}


def read_panel(path: str | Path) -> dict[str, Any]:
    """A panel file written by ``crl-bench panel export``, checked for shape.

    Raises:
        PanelError: unreadable, not JSON, over the limits of :func:`crl_bench.safe_io.load_json`
            (size, nesting, integer digits, NaN), or a key missing or of the wrong type (named).
    """
    from crl_bench.safe_io import InputFileError, load_json

    path = Path(path)
    try:        # bounded: size, nesting, integer digits, no NaN (a panel may come from anyone)
        data = load_json(path, root="/")
    except InputFileError as e:
        raise PanelError(f"{path}: not a readable panel file ({e.problem})") from None
    if not isinstance(data, dict):
        raise PanelError(f"{path}: expected a JSON object")
    if data.get("format") != PANEL_FORMAT:
        raise PanelError(f"{path}: 'format' is {data.get('format')!r}; this crl-bench reads panel format "
                         f"{PANEL_FORMAT}")
    for key, kind in (("env", str), ("split", str), ("panel_hash", str), ("tasks", list),
                      ("env_settings", dict)):
        if not isinstance(data.get(key), kind):
            raise PanelError(f"{path}: missing or malformed {key!r} (expected {kind.__name__})")
    ep = data.get("episodes")
    if isinstance(ep, bool) or not (ep == "all" or isinstance(ep, int) and ep >= 0):
        raise PanelError(f"{path}: missing or malformed 'episodes' (a number or 'all')")
    if isinstance(data.get("max_steps"), bool) or not isinstance(data.get("max_steps"), int) or data["max_steps"] < 0:
        raise PanelError(f"{path}: missing or malformed 'max_steps' (a non-negative integer)")
    for i, t in enumerate(data["tasks"]):
        if not (isinstance(t, dict) and isinstance(t.get("task"), int) and not isinstance(t["task"], bool)
                and isinstance(t.get("hash"), str) and isinstance(t.get("fields"), dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in t["fields"].items())):
            raise PanelError(f"{path}: tasks[{i}] is not {{'task': int, 'hash': str, 'fields': {{name: hash}}}}")
    return data


def check_panel(panel: dict[str, Any], env: Any, progress: Callable[[int], Any] | None = None) -> list[str]:
    """What differs between ``panel`` (from :func:`read_panel`) and the same tasks of ``env`` here.

    Checks the file first (its panel hash against its own tasks, each task hash against its fields:
    an edited file), then that an evaluation here would choose the same task ids in the same order
    (the first ``episodes`` ids of the split), then each task's fingerprint on this machine field by
    field.

    Returns:
        One line per problem (``[]``: the data and code here reproduce the panel), e.g.
        ``"task 3: fields differ: goal, target_price"``.
    """
    problems: list[str] = []
    for t in panel["tasks"]:
        if content_hash(t["fields"]) != t["hash"]:
            problems.append(f"task {t['task']}: its hash does not match its fields (the file was edited)")
    if panel_hash(panel["env"], panel["split"], panel["tasks"]) != panel["panel_hash"]:
        problems.append("panel_hash does not match the listed tasks (the file was edited)")
    ids = [int(t["task"]) for t in panel["tasks"]]
    try:
        chosen = panel_task_ids(env, panel["split"], panel["episodes"])
    except KeyError as e:
        return [*problems, f"split {panel['split']!r}: not a split here ({e.args[0] if e.args else e})"]
    if chosen != ids:
        first = next((i for i, (a, b) in enumerate(zip(chosen, ids)) if a != b), min(len(chosen), len(ids)))
        problems.append(f"the split's tasks differ: an evaluation with episodes {panel['episodes']!r} runs "
                        f"{len(chosen)} tasks here, the panel lists {len(ids)}; first difference at position {first}")
    for t in panel["tasks"]:
        try:
            here = task_entry(t["task"], env.task_fingerprint(t["task"]))
        except KeyError as e:
            problems.append(f"task {t['task']}: not a task here ({e.args[0] if e.args else e})")
            continue
        finally:
            if progress is not None:
                progress(1)
        if here["hash"] != t["hash"]:
            names = sorted(set(here["fields"]) | set(t["fields"]))
            diff = [n for n in names if here["fields"].get(n) != t["fields"].get(n)]
            problems.append(f"task {t['task']}: fields differ: {', '.join(diff)}")
    return problems
