"""The HTML pieces of ``crl-bench report`` (crl_bench/results/report.py): the page's style, the runs
table, the learning alarms, the most used entries of each experience bank (read read-only), and PNGs
embedded as data URIs. Every text from a run folder or a bank is escaped (:func:`_e`)."""

from __future__ import annotations

import base64
import html
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from crl_bench.safe_io import printable

#: entries of each bank the report lists
TOP_ENTRIES = 10


# ------------------------------------------------------------------------------------------ banks
def read_bank(path: str | os.PathLike, limit: int = TOP_ENTRIES) -> tuple[list, dict]:
    """The ``limit`` most used entries of a bank and its :meth:`ExperienceBank.stats`.

    Entries are sorted by ``times_retrieved``, then ``times_success`` (both descending), then id.
    The bank is opened with :meth:`ExperienceBank.open_readonly` (nothing is written to it, no model
    is loaded).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: ``limit`` < 0.
        NotABankError: the file is not a readable crl-bench experience bank.
    """
    from crl_bench.experience.bank import ExperienceBank

    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    with ExperienceBank.open_readonly(path) as bank:
        entries = bank.entries()
        stats = bank.stats()
    entries.sort(key=lambda e: (-e.times_retrieved, -e.times_success, e.id))
    return entries[:limit], stats


# ------------------------------------------------------------------------------------------ HTML
_CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px auto;max-width:1150px;
color:#222;background:#fff;padding:0 16px;line-height:1.4}
h1{font-size:1.6em;margin-bottom:4px}h2{font-size:1.25em;margin-top:32px;border-bottom:1px solid #ccc}
h3{font-size:1.05em;margin-top:20px}
table{border-collapse:collapse;font-size:0.85em;margin:8px 0}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f0f0f0}
td.num{text-align:right;font-variant-numeric:tabular-nums}
td.text{white-space:pre-wrap;max-width:560px}
figure{margin:14px 0}figure img{max-width:100%;border:1px solid #ddd}
figcaption{font-size:0.85em;color:#444;margin-top:4px}
.note{color:#555;font-style:italic}.meta{color:#555;font-size:0.85em}
code{font-size:0.95em}
"""


def _e(x: Any) -> str:
    """``x`` as HTML text: control characters escaped (:func:`crl_bench.safe_io.printable`: a NUL or
    an ESC from a bank or a config never reaches the page raw), then HTML-escaped."""
    return html.escape(printable(x), quote=True)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _fmt_rate(ev: dict | None) -> str:
    v = _num((ev or {}).get("success_rate")) if isinstance(ev, dict) else None
    return "" if v is None else f"{v:.3f}"


def _runs_table(runs: Sequence[Any]) -> str:
    head = ("run id", "method", "seed", "mix", "envs", "model", "steps (logged / configured)",
            "final eval free", "final eval guided", "shuffled", "empty", "folder")
    rows = []
    for r in runs:
        fe = r.final_eval or {}
        steps = f"{r.last_step} / {'' if r.steps_configured is None else r.steps_configured}"
        cells = (_e(r.run_id), _e(r.method), _e(r.seed), _e(r.mix), _e(", ".join(r.envs)), _e(r.model),
                 _e(steps), _e(_fmt_rate(fe.get("free"))), _e(_fmt_rate(fe.get("guided"))),
                 _e(_fmt_rate(fe.get("shuffled"))), _e(_fmt_rate(fe.get("empty"))), _e(r.path))
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return ("<table><thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def _alerts_html(runs: Sequence[Any]) -> str:
    """Per run, its learning alarms (step, alarm, message) or "no alarms"."""
    parts = []
    for r in runs:
        head = f"<h3>{_e(r.run_id)} <span class='meta'>({_e(r.method)}, seed {_e(r.seed)})</span></h3>"
        if not r.alerts:
            parts.append(head + "<p class='note'>no alarms</p>")
            continue
        rows = "".join(f"<tr><td class='num'>{_e(a.get('step'))}</td><td>{_e(a.get('alarm'))}</td>"
                       f"<td class='text'>{_e(a.get('message'))}</td></tr>" for a in r.alerts)
        parts.append(head + "<table><thead><tr><th>step</th><th>alarm</th><th>message</th></tr></thead>"
                     f"<tbody>{rows}</tbody></table>")
    return "".join(parts)


def _bank_html(run: Any) -> str:
    head = f"<h3>{_e(run.run_id)} <span class='meta'>({_e(run.method)}, seed {_e(run.seed)})</span></h3>"
    try:
        entries, stats = read_bank(run.bank_path)
    except Exception as e:  # noqa: BLE001 - one unreadable bank must not hide the rest of the report
        warnings.warn(printable(f"report: could not read {run.bank_path}: {e}"), stacklevel=2)
        return head + f"<p class='note'>Could not read {_e(run.bank_path)}: {_e(type(e).__name__)}: {_e(e)}</p>"
    applied = ", ".join(f"{k} {v}" for k, v in (stats.get("applied") or {}).items())
    summary = (f"<p class='meta'>{_e(stats.get('count'))} entries; applied operations: {_e(applied)}; "
               f"rejected: {_e(stats.get('rejections_total'))}; evicted: {_e(stats.get('evicted_total'))}; "
               f"retrievals: {_e(stats.get('retrieved_total'))}.</p>")
    if not entries:
        return head + summary + "<p class='note'>The bank is empty.</p>"
    cols = ("#", "env", "title", "content", "retrieved", "successes", "failures", "created step")
    rows = []
    for e in entries:
        rows.append("<tr>" + "".join((
            f"<td class='num'>{_e(e.id)}</td>", f"<td>{_e(e.env_id)}</td>", f"<td class='text'>{_e(e.title)}</td>",
            f"<td class='text'>{_e(e.content)}</td>", f"<td class='num'>{_e(e.times_retrieved)}</td>",
            f"<td class='num'>{_e(e.times_success)}</td>", f"<td class='num'>{_e(e.times_failure)}</td>",
            f"<td class='num'>{_e(e.created_step)}</td>")) + "</tr>")
    return (head + summary + "<table><thead><tr>" + "".join(f"<th>{_e(c)}</th>" for c in cols)
            + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")
