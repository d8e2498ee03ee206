"""Labels and identities of leaderboard rows: the eval protocol as text, the canonical JSON that keys a
row, a run's identity, a model's label and the names of rows that differ only in training settings.
Shared by the leaderboard (:mod:`crl_bench.results.leaderboard`), its lifts (:mod:`.lifts`) and
``crl-bench compare`` (:mod:`.compare`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from crl_bench.results.panel import content_hash, short_hash
from crl_bench.results.summary import settings_labels

__all__ = ["canon", "label_settings", "model_label", "panels_hash", "protocol_label", "run_identity",
           "settings_details"]


def _per_env_text(values: dict[str, Any]) -> str:
    vals = list(values.values())
    if vals and all(v == vals[0] for v in vals):
        return f"{vals[0]}"
    return ",".join(f"{e}={v}" for e, v in values.items())


def protocol_label(protocol: dict[str, Any]) -> str:
    """Compact text of an eval protocol, e.g. ``"eval · 4 ep/env · T=0 · max_steps 6"``.

    Shows the protocol profile where there is one, split (with the envs on another split), episodes
    per env (``all tasks`` for ``"all"``), the tasks actually run when they differ from the episodes
    asked, temperature, ``top_p`` unless 1, ``top_k`` unless 0/absent, ``max_new_tokens`` when
    recorded, the step limit (one number if all envs share it), the eval prompt's layout and history
    where the evaluation sets them, each env's constructor settings when it has any (e.g.
    ``minihack-room: variant=MiniHack-Room-Random-5x5-v0``), the attempts per task when more than one
    (``3 trials``), the independent samples per task when more than one (``8 samples``), ``free
    replies`` and the prefill where the evaluation did not restrict replies or changed the prefill, the
    sampled-worker draws (``20 draws of 128``) and the task panel where recorded (``panel 3f2a...``:
    one env's panel hash, or for several envs the hash of all of them,
    :func:`panels_hash`; shortened to :data:`~crl_bench.results.panel.SHORT` hex digits).
    """
    ep = protocol["episodes"]
    split = str(protocol["split"])
    if protocol.get("splits"):              # envs evaluated on another split (eval.splits)
        split += " (" + ", ".join(f"{e}: {v}" for e, v in sorted(protocol["splits"].items())) + ")"
    parts = ([f"profile {protocol['profile']}"] if protocol.get("profile") else []) + \
        [split, "all tasks" if ep == "all" else f"{ep} ep/env"]
    tpe = protocol.get("tasks_per_env") or {}
    if ep == "all" or any(v != ep for v in tpe.values()):
        parts.append(f"tasks {_per_env_text(tpe)}")
    parts.append(f"T={protocol['temperature']:g}")
    if protocol.get("top_p", 1.0) != 1.0:
        parts.append(f"top_p {protocol['top_p']:g}")
    if protocol.get("top_k"):
        parts.append(f"top_k {protocol['top_k']}")
    if protocol.get("max_new_tokens") is not None:
        parts.append(f"max_new_tokens {protocol['max_new_tokens']}")
    parts.append(f"max_steps {_per_env_text(protocol.get('max_steps') or {})}")
    if protocol.get("prompt"):
        parts.append(f"{protocol['prompt']['layout']} prompt, history {protocol['prompt']['history']}")
    if protocol.get("constrained") is False:
        parts.append("free replies")
    if "prefill" in protocol:
        parts.append(f"prefill {json.dumps(protocol['prefill'])}")
    for env, settings in sorted((protocol.get("env_settings") or {}).items()):
        parts.append(f"{env}: " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())))
    if protocol.get("trials", 1) > 1:
        parts.append(f"{protocol['trials']} trials")
    if protocol.get("samples", 1) > 1:
        parts.append(f"{protocol['samples']} samples")
    if protocol.get("draws"):
        parts.append(f"{protocol['draws']['count']} draws of {protocol['draws']['size']}")
    if protocol.get("panels"):
        parts.append(f"panel {short_hash(panels_hash(protocol['panels']))}")
    return " · ".join(parts)


def panels_hash(panels: dict[str, str]) -> str:
    """One hash for a protocol's task panels: the env's panel hash when there is one env, else the
    sha256 of the canonical JSON ``{env id: panel hash}`` (docs/evaluation.md "Task panels")."""
    if len(panels) == 1:
        return next(iter(panels.values()))
    return content_hash(panels)


def canon(obj: Any) -> str:
    """``obj`` as canonical JSON (sorted keys, no spaces): equal text for equal values."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def model_label(model: dict[str, Any]) -> str:
    """A summary's model as a label: its name, and its variant in brackets where it has one."""
    return model["name"] + (f" ({model['variant']})" if model.get("variant") else "")


def run_identity(summary: dict[str, Any], run: dict[str, Any]) -> tuple[str, str, str]:
    """What makes one run the same run wherever its summary is met (a run folder and a submission packed
    from it): its run id, the git commit it ran at and its training totals. Two runs that only share a
    run id (e.g. ``static-s1`` of two sweeps) are different runs."""
    return str(run["run_id"]), str(summary["versions"].get("git_commit")), canon(run["train"])


def settings_details(summaries: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{settings hash: training settings}`` over the summaries (``_settings``, set by :func:`collect`)."""
    out: dict[str, dict[str, Any]] = {}
    for s in summaries:
        out.update(s.get("_settings") or {})
    return out


def label_settings(rows: list[dict[str, Any]], details: dict[str, dict[str, Any]]) -> None:
    """Runs of one method with different training settings are never pooled (their rows differ in
    ``settings``); where rows of one mix, method, model, extractor and protocol have more than one,
    each such row's ``method`` gets `` · `` and the settings that differ between those rows
    (``casebank · experience.rerank=utility``), from ``details`` (``{hash: training settings}``).
    Where a hash's settings are not known (no config beside its summary), more than
    :data:`~crl_bench.results.summary.LABEL_MAX_KEYS` keys differ, or two labels would read the same,
    every such row gets
    `` · settings <hash prefix>`` instead (``unknown`` for runs whose summary has no settings hash)."""
    def key(row: dict[str, Any]) -> tuple:
        return row["mix"], row["method"], row["model"], row["extractor"], row.get("protocol_json", row["protocol"])

    seen: dict[tuple, set[str]] = {}
    for row in rows:
        seen.setdefault(key(row), set()).add(row["settings"])
    named = {k: settings_labels(v, details) for k, v in seen.items() if len(v) > 1}
    for row in rows:
        k = key(row)
        if k not in named:
            continue
        labels = named[k]
        if labels is not None:
            row["method"] += f" · {labels[row['settings']]}"
        else:
            row["method"] += f" · settings {short_hash(row['settings']) if row['settings'] else 'unknown'}"
