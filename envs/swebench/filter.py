"""``crl-bench swe filter``: keep the SWE-bench instances a base model solves sometimes, not always.

Complementary RL (arXiv 2603.17621, SWE-Bench setting) trains on the SWE-Bench-Verified
instances whose pass rate under the base model lies strictly between "never" and "almost always": the
model is run ``k`` times (16) per instance and an instance is kept when its pass rate (resolved runs /
k) lies in ``(low, high]`` (0 and 0.8), which kept 124 of the 500.

The run is resumable: every finished episode is appended at once to ``<out>.samples.jsonl`` (instance
id, resolved, steps; episodes that failed for an infrastructure reason are recorded with their error and
played again, up to ``retries`` rounds in the same run), and a rerun of the same command only plays the
samples still missing.  At the end ``<out>`` holds the per-instance pass rates and the ``kept`` ids;
the env's ``task_list`` setting reads that file directly.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crl_bench.rollout import EpisodeSpec, Trajectory


class FilterStateError(ValueError):
    """The samples file was written by a different filter configuration (model or k)."""


def read_samples(path: Path) -> tuple[dict[str, Any] | None, dict[str, list[bool]], int]:
    """``(header, {instance_id: [resolved, ...]}, errors)`` of a samples file (missing: empty).

    Lines that are not valid JSON (a run killed mid-write) are ignored."""
    header, results, errors = None, defaultdict(list), 0
    if not path.is_file():
        return None, {}, 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "header" in rec:
            header = rec["header"]
        elif rec.get("error"):
            errors += 1
        elif "instance_id" in rec:
            results[rec["instance_id"]].append(bool(rec["resolved"]))
    return header, dict(results), errors


def run_filter(collect: Callable[[list[EpisodeSpec]], list[Trajectory]], env: Any, env_id: str, k: int,
               low: float, high: float, out: Path, model: str, per_call: int = 16,
               progress: bool = True, retries: int = 3) -> dict[str, Any]:
    """Play ``k`` episodes of every training instance of ``env`` and write the kept ids.

    Args:
        collect: rolls out a list of specs (``RolloutRunner.collect`` with the base model's sampling).
        env: a SWE-bench env (its ``train_instances`` are filtered; task id ``i`` is instance ``i``).
        env_id: its id in the registry. k: samples per instance (>= 1).
        low, high: keep pass rates in ``(low, high]`` (``0 <= low < high <= 1``).
        out: the result file; the samples go to ``<out>.samples.jsonl``. model: recorded and checked on
            resume. per_call: episodes handed to ``collect`` at once.
        retries: rounds in which the episodes that failed for an infrastructure reason (a container
            that did not start under load, a dead worker: ``Trajectory.error``) are played again, so
            a pass rate is over ``k`` samples; an instance still short after them is ``incomplete``.

    Returns the result written to ``out``: ``kept``, ``pass_rates``, ``samples``, ``incomplete`` (ids
    with fewer than ``k`` valid samples, never kept), ``env_errors`` (episodes lost to an
    infrastructure error, retried or not), ``retried`` and the settings.

    Raises:
        ValueError: bad ``k``/``low``/``high``. FilterStateError: the samples file belongs to another
        model or ``k``.
    """
    if k < 1 or not 0 <= low < high <= 1:
        raise ValueError(f"swe filter: need k >= 1 and 0 <= low < high <= 1, got k={k}, low={low}, high={high}")
    from tqdm import tqdm

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    state = out.with_name(out.name + ".samples.jsonl")
    header = {"model": model, "k": k, "env_id": env_id}
    old_header, results, errors = read_samples(state)
    if old_header is not None and (old_header.get("model"), old_header.get("k")) != (model, k):
        raise FilterStateError(f"{state} was written for model {old_header.get('model')!r} with k="
                               f"{old_header.get('k')}; use another --out or remove it")
    ids = [inst.instance_id for inst in env.train_instances]

    def missing() -> list[tuple[int, str]]:
        return [(task, iid) for task, iid in enumerate(ids) for _ in range(max(0, k - len(results.get(iid, []))))]

    todo = missing()
    total = len(ids) * k
    retried = 0
    t0 = time.perf_counter()
    with open(state, "a", encoding="utf-8") as f, \
            tqdm(total=total, initial=total - len(todo), desc="swe filter", unit="ep", disable=not progress) as bar:
        if state.stat().st_size and not state.read_bytes().endswith(b"\n"):
            f.write("\n")                        # the killed run's last line was cut: start a fresh one
        if old_header is None:
            f.write(json.dumps({"header": header}) + "\n")
            f.flush()
        for attempt in range(1 + max(0, retries)):
            if attempt:
                todo = missing()                 # what infrastructure errors cost in the last round
                if not todo:
                    break
                retried += len(todo)
            for start in range(0, len(todo), max(1, per_call)):
                chunk = todo[start:start + per_call]
                specs = [EpisodeSpec(env_id, task, group_id=task) for task, _ in chunk]
                trajs = collect(specs)
                for (_task, iid), tr in zip(chunk, trajs):
                    rec = {"instance_id": iid, "resolved": bool(tr.success), "steps": tr.steps}
                    if tr.error:
                        rec["error"] = str(tr.error)[:500]
                        errors += 1
                    else:
                        results.setdefault(iid, []).append(bool(tr.success))
                        bar.update(1)
                    f.write(json.dumps(rec) + "\n")
                f.flush()
    pass_rates = {iid: sum(results[iid][:k]) / k for iid in ids if len(results.get(iid, [])) >= k}
    kept = [iid for iid in ids if iid in pass_rates and low < pass_rates[iid] <= high]
    result = {"model": model, "k": k, "low": low, "high": high, "env_id": env_id, "instances": len(ids),
              "kept": kept, "pass_rates": pass_rates,
              "samples": {iid: len(results.get(iid, [])) for iid in ids},
              "incomplete": [iid for iid in ids if iid not in pass_rates], "env_errors": errors, "retried": retried,
              "wall_s": round(time.perf_counter() - t0, 1)}
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result
