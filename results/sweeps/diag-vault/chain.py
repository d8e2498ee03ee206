"""Follow experience through the loop in the diag-vault sweep: for each run, what the extractor wrote
(bank entries that state a context's code, per extractor version), what retrieval showed, whether the
actor followed it (lesson_follow), and the final evaluation in every mode on `eval` and `eval_unseen`.
Writes chain.md beside this file, with what each final bank held and how training used it.
Usage: python results/sweeps/diag-vault/chain.py
Banks are not committed: each is read read-only where its run folder still has it, and its readings
are kept in banks.json beside this file, which stands in for a bank no longer on disk."""

from __future__ import annotations

import json
import sqlite3
import statistics
from pathlib import Path

from crl_bench.envs.diag import DiagVaultEnv
from crl_bench.safe_io import printable

HERE = Path(__file__).resolve().parent
READINGS = HERE / "banks.json"          # run -> {"per_version": ..., "use": ...}, from the banks when read
MODES = ("free", "guided", "shuffled", "empty")


def rate(block):
    return "-" if not block else f"{block['success_rate']:.3f}"


def mean(rows, key):
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return "-" if not vals else f"{statistics.fmean(vals):.3f}"


def bank_by_version(path: Path, env: DiagVaultEnv) -> str:
    """Entries and the share stating a context's code, per extractor version (``generation``)."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    rows = con.execute("SELECT generation, title, content FROM entries").fetchall()
    con.close()
    by: dict[int, list[bool]] = {}
    named = 0
    for gen, title, content in rows:
        grade = env.grade_lesson(f"{title}: {content}")
        by.setdefault(int(gen), []).append(grade["correct"])
        named += bool(grade["actions"]) and bool(grade["contexts"])
    per_version = ", ".join(f"v{g}: {sum(v)}/{len(v)}" for g, v in sorted(by.items())) or "(empty)"
    return f"{per_version}; naming a context and a symbol: {named}/{len(rows)}"


def quote(text: str, limit: int = 90) -> str:
    """Text a model wrote, as an inert Markdown code span (which shows HTML and Markdown syntax as
    written): control characters escaped, whitespace folded, backticks (which would end the span)
    replaced, cut to ``limit`` characters."""
    one = " ".join(printable(text).split()).replace("`", "'")
    return "`" + (one if len(one) <= limit else one[: limit - 1] + "\u2026") + "`"


def bank_use(path: Path, env: DiagVaultEnv) -> list[str]:
    """What a final bank held and how training used it: its entries with how often they were retrieved
    for guided training episodes and how those episodes ended, split by whether the entry states its
    context's code; the insight list (``expel``); the reflections (``reflexion``)."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    entries = con.execute("SELECT title, content, times_retrieved, times_success, times_failure FROM entries "
                          "ORDER BY times_retrieved DESC, id").fetchall()
    utilities = [u for (u,) in con.execute("SELECT utility FROM entries")]
    insights = con.execute("SELECT text, importance FROM insights ORDER BY importance DESC, id").fetchall()
    reflections = con.execute("SELECT task, text FROM reflections ORDER BY id").fetchall()
    con.close()
    out = []
    if entries:
        groups: dict[bool, list[tuple]] = {True: [], False: []}
        for title, content, shown, won, lost in entries:
            groups[env.grade_lesson(f"{title}: {content}")["correct"]].append((shown, won, lost))
        parts = []
        for ok, label in ((True, "stating the code"), (False, "not")):
            g = groups[ok]
            shown = sum(x[0] for x in g)
            won, ended = sum(x[1] for x in g), sum(x[1] + x[2] for x in g)
            used = sum(1 for x in g if x[0])
            rate_txt = f"{won / ended:.3f}" if ended else "-"
            parts.append(f"{len(g)} {label} ({used} retrieved, {shown} times in all; success {rate_txt})")
        title, content = entries[0][0], entries[0][1]
        steps = [ln for ln in content.splitlines() if ln.startswith("Step ")]   # a case: its actions
        gist = f"{title} {' '.join(steps)}" if steps else f"{title}: {content}"
        out.append(f"entries: {len(entries)}: " + "; ".join(parts)
                   + f"; utility {min(utilities):.2f}-{max(utilities):.2f}"
                   + f"; most retrieved ({entries[0][2]} times): {quote(gist, 120)}")
    if insights:
        right = sum(env.grade_lesson(t)["correct"] for t, _ in insights)
        top = ", ".join(f"{quote(t, 60)} ({imp})" for t, imp in insights[:3])
        out.append(f"insights: {len(insights)} ({right} state a code); highest importance: {top}")
    if reflections:
        right = sum(env.grade_lesson(t)["correct"] for _, t in reflections)
        named = sum(bool(env.grade_lesson(t)["actions"]) for _, t in reflections)
        tasks = len({task for task, _ in reflections})
        sample = ", ".join(quote(t, 60) for _, t in reflections[:2])
        out.append(f"reflections: {len(reflections)} on {tasks} tasks ({named} name a symbol, {right} a context "
                   f"with its code); first: {sample}")
    return out or ["(empty)"]


def main() -> None:
    env = DiagVaultEnv()
    lines = ["# diag-vault sweep: experience followed through the loop", "",
             "Generated by `chain.py` from the run folders. `eval` / `eval_unseen`: final greedy success "
             "on the 64 tasks of each split per mode (free / guided / shuffled / empty); `eval, 3 trials`: "
             "the same on `eval` with `eval.trials: 3` (the runs that had it). Chain, means over "
             "the training steps that had them: `bank ok` = share of bank entries stating a context's code "
             "(final bank, per extractor version: correct/entries), `own ctx` = guided episodes shown a "
             "text naming their own context, `shown ok` = shown their context's code; `lesson_follow` "
             "(right / wrong / none) of the final actor.", "",
             "| run | eval f / g / s / e | eval_unseen f / g / s / e | eval, 3 trials f / g / s / e | "
             "lesson_follow r / w / n | own ctx | shown ok | bank ok (final) | bank per version | wall (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    readings = json.loads(READINGS.read_text()) if READINGS.is_file() else {}
    for run in sorted((HERE / "runs").iterdir()):
        bank = run / "experience.sqlite"
        if (run / "eval.json").is_file() and bank.is_file():
            readings[run.name] = {"per_version": bank_by_version(bank, env), "use": "; ".join(bank_use(bank, env))}
    READINGS.write_text(json.dumps(readings, indent=1, sort_keys=True) + "\n")
    walls = {}
    wall_file = HERE / "wall.tsv"
    if wall_file.is_file():
        for ln in wall_file.read_text().splitlines():
            parts = ln.split("\t")
            walls[parts[0]] = " + ".join(x for x in parts[1:3] + parts[5:6] if x != "-")
    for run in sorted((HERE / "runs").iterdir()):
        ev_path, un_path = run / "eval.json", run / "checkpoint-eval_unseen-split.json"
        if not ev_path.is_file():
            continue
        ev = json.loads(ev_path.read_text())
        un = json.loads(un_path.read_text()) if un_path.is_file() else {}
        tri_path = run / "checkpoint-eval-trials3-split.json"
        tri = json.loads(tri_path.read_text()) if tri_path.is_file() else {}
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        train = [r for r in rows if "eval" not in r]
        lf = ev.get("lesson_follow") or {}
        lf_txt = " / ".join(f"{lf[k]:.3f}" for k in ("lesson_follow", "lesson_follow_wrong", "lesson_follow_none")
                            if k in lf) or "-"
        last_ok = next((r["bank_correct_lessons"] for r in reversed(train) if "bank_correct_lessons" in r), None)
        lines.append(
            f"| {run.name} | {' / '.join(rate(ev.get(m)) for m in MODES)} | "
            f"{' / '.join(rate(un.get(m)) for m in MODES)} | "
            f"{' / '.join(rate(tri.get(m)) for m in MODES) if tri else '-'} | {lf_txt} | "
            f"{mean(train, 'retrieval_own_context')} | "
            f"{mean(train, 'shown_correct')} | {'-' if last_ok is None else f'{last_ok:.3f}'} | "
            f"{readings.get(run.name, {}).get('per_version', '(no bank)')} | {walls.get(run.name, '-')} |")
    lines += ["", "## Final banks", "",
              "Counts over training: `retrieved` = guided training episodes the entry was retrieved for "
              "(`casebank` and `expel` show it as it is; `static` and `complementary` give it to the "
              "extractor, which answers from it), `success` = the share of those episodes that succeeded. "
              "Quoted text is what the model wrote (for a case: the episode), shortened and escaped.", ""]
    for run in sorted((HERE / "runs").iterdir()):
        use = readings.get(run.name, {}).get("use")
        if (run / "eval.json").is_file() and use:
            lines.append(f"* **{run.name}**: {use}")
    (HERE / "chain.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
