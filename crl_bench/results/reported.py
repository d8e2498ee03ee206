"""Reported rows: numbers transcribed from papers (``results/reported/<name>.yaml``), shown by the
leaderboard in a section of their own, marked "reported, not reproduced", never pooled with rows this
suite measured (docs/leaderboard.md "Reported rows").

One file per paper table: ``source`` (title, arXiv id with version, table, what text was read),
``protocol`` (split, eval episodes, temperature, step limits, WebShop catalogue, seeds, as the paper
states them; null where it does not) and ``rows`` (method, model, env, success rate as a fraction
and/or a score on the paper's scale, per task type). Schema: ``crl_bench/schemas/reported.schema.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crl_bench.results.summary import schema_problems
from crl_bench.safe_io import InputFileError, load_yaml, markdown_cell, printable

#: Largest reported-rows file read (bytes).
REPORTED_MAX_BYTES = 256 * 1024


def load_reported(folder: str | Path, warnings: list[str] | None = None) -> list[dict[str, Any]]:
    """Every valid ``*.yaml`` of ``folder`` (sorted by name) as ``{"file", "source", "protocol",
    "rows"}``; a file that is not YAML, too large or fails the schema is skipped with a warning naming
    it and the JSON path (appended to ``warnings``). A missing folder gives ``[]``."""
    folder = Path(folder)
    out: list[dict[str, Any]] = []
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.yaml")):
        try:
            data = load_yaml(path, root=folder, max_bytes=REPORTED_MAX_BYTES, max_aliases=0, finite=True)
        except InputFileError as e:
            _warn(warnings, f"skipped {e}")
            continue
        problems = schema_problems(data, "reported")
        if problems:
            _warn(warnings, f"skipped {path}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                                                                 else ""))
            continue
        out.append({"file": path.name, **data})
    return out


def _warn(warnings: list[str] | None, message: str) -> None:
    if warnings is not None:
        warnings.append(printable(message))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def reported_markdown(tables: list[dict[str, Any]]) -> list[str]:
    """The leaderboard's "Reported, not reproduced" section (lines; none without tables): per file its
    source and protocol, then one line per row with success (%), score and per-type success (%)."""
    if not tables:
        return []
    lines = ["## Reported, not reproduced", "",
             "Numbers transcribed from papers (`results/reported/`), each checked against the paper's own text "
             "(see `checked`). They were measured by their authors under the protocol stated beside them, not "
             "by this suite, and are never pooled with the rows above: compare a measured row with them only "
             "where the protocols agree.", ""]
    for t in tables:
        src, proto = t["source"], t["protocol"]
        steps = ", ".join(f"{k} {v}" for k, v in (proto.get("max_steps") or {}).items()) or "not stated"
        lines += [f"### {printable(src['title'])} (arXiv {printable(src['arxiv'])}), {printable(src['table'])}", "",
                  f"Protocol: split {printable(proto['split'])}; eval episodes "
                  f"{printable(str(proto['eval_episodes'])) if proto['eval_episodes'] is not None else 'not stated'}; "
                  f"temperature {proto['temperature'] if proto['temperature'] is not None else 'not stated'}; "
                  f"step limit {printable(steps)}; "
                  + (f"catalogue {printable(proto['catalogue'])}; " if proto.get("catalogue") else "")
                  + f"seeds {proto['seeds'] if proto['seeds'] is not None else 'not stated'}."
                  + (f" {printable(proto['notes'])}" if proto.get("notes") else ""),
                  f"Checked: {printable(src['checked'])} (`results/reported/{printable(t['file'])}`)", ""]
        types = list(dict.fromkeys(k for r in t["rows"] for k in (r.get("per_type") or {})))
        head = ["method", "model", "env", "success %", "score"] + [f"{x} %" for x in types] + ["notes"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in t["rows"]:
            std = f" ± {100 * r['std']:.1f}" if r.get("std") is not None else ""
            cells = [r["method"], r["model"], r["env"], _pct(r.get("success_rate")) + std,
                     "-" if r.get("score") is None else f"{r['score']:g}"]
            cells += [_pct((r.get("per_type") or {}).get(x)) for x in types] + [r.get("notes", "")]
            lines.append("| " + " | ".join(markdown_cell(c) for c in cells) + " |")
        lines.append("")
    return lines
