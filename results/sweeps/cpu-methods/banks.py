"""Read the cpu-methods sweep: each finished cell's final evaluation in every mode with the memory lift
and its paired CI, its 3-trial evaluation, `lesson_follow`, wall times, and what its final bank held
and how training used it (cases, insights, reflections). Writes banks.md in the sweep folder.
Usage: python results/sweeps/cpu-methods/banks.py [SWEEP_FOLDER]   (default: this file's folder; e.g.
results/sweeps/cpu-methods-utility, the same cells trained with settings of their own)
Banks are not committed: each is read read-only where its run folder still has it, and its readings
are kept in banks.json in the sweep folder, which stands in for a bank no longer on disk."""

from __future__ import annotations

import json
import sqlite3
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from crl_bench.results.stats import bootstrap_ci
from crl_bench.safe_io import printable

HERE = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parent
READINGS = HERE / "banks.json"          # cell -> list of lines, from the bank when it was read
MODES = ("free", "guided", "shuffled", "empty")
ENV = "minihack-room"


def quote(text: str, limit: int = 90) -> str:
    """Text a model wrote, as an inert Markdown code span: control characters escaped, whitespace
    folded, backticks (which would end the span) replaced, cut to ``limit`` characters."""
    one = " ".join(printable(text).split()).replace("`", "'")
    return "`" + (one if len(one) <= limit else one[: limit - 1] + "\u2026") + "`"


def pct(block) -> str:
    return "-" if not block else f"{100 * block['success_rate']:.1f}"


def trials_cell(tri, ev) -> str:
    """The 3-trial rates per mode; for a trials evaluation over other tasks than ``ev``'s (an
    earlier run.sh evaluated all 500), its task count and its rates on ``ev``'s tasks."""
    if not tri:
        return "-"
    txt = " / ".join(pct(tri.get(m)) for m in MODES)
    mine, theirs = tri["free"]["tasks"][ENV], ev["free"]["tasks"][ENV]
    if mine == theirs:
        return txt
    where = {t: i for i, t in enumerate(mine)}

    def on_theirs(block):
        if not block:
            return "-"
        won = block["per_env"][ENV]["successes"]
        return f"{100 * np.mean([won[where[t]] for t in theirs]):.1f}"

    return f"{txt} ({len(mine)} tasks; on the {len(theirs)} above: {' / '.join(on_theirs(tri.get(m)) for m in MODES)})"


def successes(block) -> np.ndarray | None:
    per = (block or {}).get("per_env", {}).get(ENV) or {}
    return None if per.get("successes") is None else np.asarray(per["successes"], dtype=float)


def lift(a_block, b_block) -> str:
    """``a - b`` in points with the paired 95 % bootstrap CI over tasks (the leaderboard's)."""
    a, b = successes(a_block), successes(b_block)
    if a is None or b is None or len(a) != len(b):
        return "-"
    low, high = bootstrap_ci(a - b)
    return f"{100 * (a - b).mean():+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def gist(title: str, content: str) -> str:
    """A case in a line: its task, the goal's direction where the observation states it, its actions."""
    lines = content.splitlines()
    where = next((ln[ln.index("(direction:"):] for ln in lines if "(direction:" in ln), "")
    acts = [ln.split(":", 1)[1].split("->")[0].strip() for ln in lines if ln.startswith("Step ") and ":" in ln]
    outcome = next((ln for ln in lines if ln.startswith("Outcome:")), "")
    return f"{title} {outcome} {where} moves: {', '.join(acts)}".strip()


def read_bank(path: Path) -> list[str]:
    """What a final bank held and how training used it."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    entries = con.execute("SELECT title, content, times_retrieved, times_success, times_failure, utility "
                          "FROM entries ORDER BY times_retrieved DESC, id").fetchall()
    insights = con.execute("SELECT text, importance FROM insights ORDER BY importance DESC, id").fetchall()
    reflections = con.execute("SELECT task, text FROM reflections ORDER BY id").fetchall()
    con.close()
    out = []
    if entries:
        used = [e for e in entries if e[2]]
        won, ended = sum(e[3] for e in entries), sum(e[3] + e[4] for e in entries)
        utils = [e[5] for e in entries]
        top = "; ".join(f"{quote(gist(e[0], e[1]), 160)} ({e[2]} retrievals, {e[3]} of {e[3] + e[4]} "
                        f"episodes succeeded)" for e in used[:3])
        out.append(f"{len(entries)} cases; {len(used)} retrieved, {sum(e[2] for e in entries)} retrievals in all; "
                   f"of the guided training episodes they were shown to after the warm-up (the last warm-up step "
                   f"shows cases but counts no outcome, as released) {won} of {ended} succeeded"
                   f"{f' ({won / ended:.3f})' if ended else ''}; utility {min(utils):.3f}-{max(utils):.3f}. "
                   f"Most retrieved: {top}")
    if insights:
        top = ", ".join(f"{quote(t, 80)} ({imp})" for t, imp in insights[:5])
        out.append(f"{len(insights)} insights; by importance: {top}")
    if reflections:
        tasks = len({task for task, _ in reflections})
        openings = Counter(" ".join(printable(t).split()[:5]) for _, t in reflections).most_common(4)
        common = ", ".join(f"{quote(o, 60)} x{n}" for o, n in openings)
        out.append(f"{len(reflections)} reflections on {tasks} tasks; most common openings: {common}; "
                   f"first: {quote(reflections[0][1], 120)}")
    return out or ["(empty)"]


def main() -> None:
    readings = json.loads(READINGS.read_text()) if READINGS.is_file() else {}
    runs = sorted(p for p in (HERE / "runs").iterdir() if (p / "eval.json").is_file())
    for run in runs:
        if (run / "experience.sqlite").is_file():
            readings[run.name] = read_bank(run / "experience.sqlite")
    READINGS.write_text(json.dumps(readings, indent=1, sort_keys=True) + "\n")
    walls = {}
    if (HERE / "wall.tsv").is_file():
        for ln in (HERE / "wall.tsv").read_text().splitlines():
            walls[ln.split("\t")[0]] = ln.split("\t")[1]
    lines = [f"# {HERE.name}: cells, memory lift and final banks", "",
             "Generated by `banks.py` from the run folders. Success in % on the 200 greedy `eval` tasks: "
             "`step 0` = the untrained actor, then the final evaluation per mode; lift = guided - shuffled "
             "and guided - free in points, paired 95 % bootstrap CI over tasks; `3 trials` = the same with "
             "`eval.trials: 3` (`-`: mode not run); `lesson_follow` of the final actor with the right "
             "lesson / a wrong one / none (chance 0.125); wall: training steps, the final evaluation per "
             "mode, the 3-trial evaluation (s).", "",
             "| cell | step 0 | free | guided | shuffled | empty | guided - shuffled | guided - free | "
             "3 trials f / g / s / e | lesson_follow | wall (s) | peak GB |",
             "|---|---:|---:|---:|---:|---:|---|---|---|---|---|---:|"]
    for run in runs:
        ev = json.loads((run / "eval.json").read_text())
        tri_path = run / "checkpoint-eval-trials3-split.json"
        tri = json.loads(tri_path.read_text()) if tri_path.is_file() else {}
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        train = [r for r in rows if "eval" not in r]
        lf = ev.get("lesson_follow") or {}
        lf_txt = " / ".join(f"{lf[k]:.3f}" for k in ("lesson_follow", "lesson_follow_wrong", "lesson_follow_none")
                            if k in lf) or "-"
        init = (ev.get("initial") or {}).get("free")
        wall = f"{sum(r.get('time_step_s', 0) for r in train):.0f}; " + \
            " / ".join(f"{ev[m]['wall_s']:.0f}" for m in MODES if ev.get(m) and "wall_s" in ev[m]) + \
            (f"; {walls[run.name]}" if run.name in walls else "")
        peak = max((r.get("peak_rss_gb", 0) for r in train), default=0)
        lines.append(f"| {run.name} | {pct(init)} | {' | '.join(pct(ev.get(m)) for m in MODES)} | "
                     f"{lift(ev.get('guided'), ev.get('shuffled'))} | {lift(ev.get('guided'), ev.get('free'))} | "
                     f"{trials_cell(tri, ev)} | {lf_txt} | {wall} | "
                     f"{peak:.1f} |")
    lines += ["", "## Final banks", "",
              "Counts over training: retrievals for guided training episodes (each shows the case), "
              "and how the episodes they were shown to after the warm-up ended. Quoted text is what a "
              "model wrote (for a case: the episode's "
              "task, outcome, the goal's direction and its moves), shortened and escaped.", ""]
    for run in runs:
        for i, line in enumerate(readings.get(run.name, ["(no bank read)"])):
            lines.append(f"* **{run.name}**: {line}" if i == 0 else f"  {line}")
    (HERE / "banks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
