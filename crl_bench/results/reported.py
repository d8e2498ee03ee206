"""Reported rows: numbers transcribed from papers or from a benchmark's own leaderboard data
(``results/reported/<name>.yaml``), shown by the leaderboard in a section of their own, marked
"reported, not reproduced", never pooled with rows this suite measured (docs/leaderboard.md
"Reported rows").

One file per paper table or leaderboard: ``source`` (title, arXiv id with version, table, what was
read), ``protocol`` (split, eval episodes, temperature, step limits, WebShop catalogue, seeds,
history, what the spread is; null where no source says) with ``sources`` naming, for every stated
value, its kind (``paper``: the paper's text; ``code``: the authors' released code at a commit, file
and line; ``leaderboard-data``: the benchmark's own results data) and where it was read, and ``rows``
(method, model, env, success rate as a fraction and/or a score on the source's scale, per task type
or per task). Schema: ``crl_bench/schemas/reported.schema.json``.
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
        problems = schema_problems(data, "reported") or unsourced_fields(data)
        if problems:
            _warn(warnings, f"skipped {path}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                                                                 else ""))
            continue
        out.append({"file": path.name, **data})
    return out


#: Protocol fields that carry a value (``notes`` and ``sources`` describe them).
PROTOCOL_FIELDS = ("split", "eval_episodes", "temperature", "max_steps", "catalogue", "seeds", "history", "spread")

#: How each source kind is printed.
KIND_LABEL = {"paper": "paper text", "code": "released code", "leaderboard-data": "leaderboard data"}


def unsourced_fields(data: dict[str, Any]) -> list[str]:
    """Problems of a schema-valid reported file that the schema cannot express: every protocol field
    with a value (not null) must name its source in ``protocol.sources``. Returns ``"<json path>:
    <message>"`` strings, empty when every stated value has a source."""
    proto = data["protocol"]
    sources = proto.get("sources") or {}
    return [f"$.protocol.sources: {field!r} has a value but no source (kind and where it was read)"
            for field in PROTOCOL_FIELDS if proto.get(field) is not None and field not in sources]


def _warn(warnings: list[str] | None, message: str) -> None:
    if warnings is not None:
        warnings.append(printable(message))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def reported_markdown(tables: list[dict[str, Any]]) -> list[str]:
    """The leaderboard's "Reported, not reproduced" section (lines; none without tables): per file its
    source and protocol (:func:`protocol_table`), then one line per row with the row's temperature
    (where any row records one), success (%) with its spread, score and per-type success (%)."""
    if not tables:
        return []
    lines = ["## Reported, not reproduced", "",
             "Numbers transcribed from papers or from a benchmark's own leaderboard data (`results/reported/`), "
             "each checked against that source (see `checked`); every protocol value names where it was read "
             "(the paper's text, the authors' released code, or the leaderboard's data). They were measured by "
             "their authors under that protocol, not by this suite, and are never pooled with the rows above: "
             "compare a measured row with them only where the protocols agree.", ""]
    for t in tables:
        src, proto = t["source"], t["protocol"]
        lines += [f"### {printable(src['title'])} (arXiv {printable(src['arxiv'])}), {printable(src['table'])}", "",
                  f"Checked: {printable(src['checked'])} (`results/reported/{printable(t['file'])}`)", ""]
        if src.get("data"):
            lines += [f"Data: {printable(src['data'])}", ""]
        per_row_t = any("temperature" in r for r in t["rows"])
        lines += protocol_table(proto, temperature_per_row=per_row_t)
        types = list(dict.fromkeys(k for r in t["rows"] for k in (r.get("per_type") or {})))
        scores = any(r.get("score") is not None for r in t["rows"])
        head = (["method", "model", "env"] + (["T"] if per_row_t else []) + ["success %"]
                + (["score"] if scores else []) + [f"{x} %" for x in types] + ["notes"])
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in t["rows"]:
            std = f" ± {100 * r['std']:.1f}" if r.get("std") is not None else ""
            cells = [r["method"], r["model"], r["env"]]
            if per_row_t:
                cells.append("not recorded" if r.get("temperature") is None else f"{r['temperature']:g}")
            cells.append(_pct(r.get("success_rate")) + std)
            if scores:
                cells.append("-" if r.get("score") is None else f"{r['score']:g}")
            cells += [_pct((r.get("per_type") or {}).get(x)) for x in types] + [r.get("notes", "")]
            lines.append("| " + " | ".join(markdown_cell(c) for c in cells) + " |")
        lines.append("")
    return lines


def _value(field: str, value: Any) -> str:
    if value is None:
        return "not stated"
    if field == "max_steps":
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return f"{value:g}" if isinstance(value, float) else str(value)


def protocol_table(proto: dict[str, Any], temperature_per_row: bool = False) -> list[str]:
    """A reported file's protocol as markdown lines: one row per field (value, or "not stated") with
    the kind of source it was read from and where, then the file's protocol notes. With
    ``temperature_per_row`` (rows carry their own) a null temperature reads "per row"."""
    sources = proto.get("sources") or {}
    lines = ["| protocol | value | source |", "|---|---|---|"]
    for field in PROTOCOL_FIELDS:
        if field not in proto and field not in sources:
            continue
        s = sources.get(field)
        value = _value(field, proto.get(field))
        if field == "temperature" and proto.get(field) is None and temperature_per_row:
            value = "per row (column T)"
        where = f"{KIND_LABEL[s['kind']]}: {s['where']}" if s else "-"
        lines.append("| " + " | ".join(markdown_cell(c) for c in (field.replace("_", " "), value, where))
                     + " |")
    lines.append("")
    if proto.get("notes"):
        lines += [printable(proto["notes"]), ""]
    return lines
