"""Leaderboard submissions: a folder with ``summary.json`` (kind ``submission``) and ``metadata.yaml``.

The format is documented in ``results/submissions/README.md``. :func:`pack_submission` merges the
summaries of one's own runs (one per seed, same method, model, mix and eval protocol) into a
submission folder with a ``metadata.yaml`` template; :func:`check_submission` lists everything
wrong with a submission folder.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from crl_bench.config import ConfigError, check_name
from crl_bench.results.summary import (
    SCHEMA_VERSION,
    SummaryError,
    build_summary,
    schema_problems,
    summary_problems,
    validate_summary,
    write_json_atomic,
)
from crl_bench.safe_io import InputFileError, load_json, load_yaml, nonfinite_paths, printable

#: Fields of summaries that must be identical for runs to be packed into one submission.
COMPARABLE_KEYS = ("method", "model", "mix", "eval_protocol")
#: A metadata value that still starts with this is an unfilled template field.
PLACEHOLDER = "TODO"
#: Largest ``summary.json`` and ``metadata.yaml`` :func:`check_submission` reads (bytes).
SUMMARY_MAX_BYTES = 16 * 1024 * 1024
METADATA_MAX_BYTES = 64 * 1024


# ---- checking ----------------------------------------------------------------------------------
def _placeholders(data: Any, path: str = "$") -> list[str]:
    out = []
    if isinstance(data, dict):
        for k, v in data.items():
            out += _placeholders(v, f"{path}.{k}")
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += _placeholders(v, f"{path}[{i}]")
    elif isinstance(data, str) and data.strip().startswith(PLACEHOLDER):
        out.append(f"{path}: still the template placeholder {data.strip()!r}")
    return out


def _dates_to_text(data: Any) -> Any:
    """YAML reads an unquoted 2025-01-31 as a date; the schema wants the ISO text."""
    if isinstance(data, dict):
        return {k: _dates_to_text(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_dates_to_text(v) for v in data]
    if isinstance(data, (dt.date, dt.datetime)):
        return data.isoformat()
    return data


def _submission_rules(data: dict[str, Any]) -> list[str]:
    """Rules for submissions beyond the summary schema: kind, a free evaluation of every mix env in
    every run, and a protocol that names every env of the mix."""
    problems = []
    if data.get("kind") != "submission":
        problems.append(f"$.kind: is {data.get('kind')!r}; a submission's summary has kind 'submission' "
                        f"(crl-bench submission pack makes one)")
    mix_envs = list(data["mix"]["envs"])
    proto = data["eval_protocol"]
    for key in ("max_steps", "tasks_per_env"):
        missing = [e for e in mix_envs if e not in proto[key]]
        if missing:
            problems.append(f"$.eval_protocol.{key}: no entry for env(s) of the mix: {', '.join(missing)}")
    for e, n in proto["tasks_per_env"].items():
        if n == 0:
            problems.append(f"$.eval_protocol.tasks_per_env.{e}: 0 eval tasks")
    for i, r in enumerate(data["runs"]):
        free = r["eval"]["free"]
        if free is None:
            problems.append(f"$.runs[{i}].eval.free: missing (seed {r['seed']}); every run needs the "
                            f"evaluation without experience")
            continue
        missing = [e for e in mix_envs if e not in free["per_env"]]
        if missing:
            problems.append(f"$.runs[{i}].eval.free.per_env: no result for env(s) of the mix "
                            f"(seed {r['seed']}): {', '.join(missing)}")
    return problems


def check_submission(folder: str | Path) -> list[str]:
    """Everything wrong with a submission folder; an empty list means it is valid.

    Both files are read as untrusted input (crl_bench.safe_io): a symbolic link that leaves the
    folder, a file over the size limit (:data:`SUMMARY_MAX_BYTES`, :data:`METADATA_MAX_BYTES`), text
    that is not UTF-8, nesting deeper than 64 levels, YAML aliases, over-long integers and numbers
    that are not finite (NaN, Infinity) are each one problem, and nothing of a refused file is shown.

    Checks ``summary.json`` (present, JSON, the summary schema and cross-field rules:
    crl_bench.results.summary.summary_problems; kind ``submission``; one run per seed; every evaluated env in
    the mix; ``eval_protocol`` names every env of the mix; every run has a free evaluation of every
    env) and ``metadata.yaml`` (present, YAML, ``submission_metadata.schema.json``; no ``TODO``
    placeholders left from the template).

    Args:
        folder: the submission folder.

    Returns:
        One line per problem, ``"<file>: <json path>: <message>"``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder}: not a folder"]
    problems: list[str] = []
    spath = folder / "summary.json"
    if not spath.is_file() and not spath.is_symlink():
        problems.append(f"{spath}: missing (crl-bench submission pack RUN_DIR ... writes it)")
    else:
        try:
            data = load_json(spath, root=folder, max_bytes=SUMMARY_MAX_BYTES)
        except InputFileError as e:
            problems.append(str(e))
        else:
            found = schema_problems(data, "summary") + [f"{p}: not a finite number" for p in nonfinite_paths(data)]
            if not found:               # the cross-field and submission rules need a well-formed summary
                found = summary_problems(data) + _submission_rules(data)
            elif isinstance(data, dict) and data.get("kind") == "run":
                found.append("$.kind: is 'run'; a submission's summary has kind 'submission'")
            problems += [f"{spath}: {p}" for p in found]
    mpath = folder / "metadata.yaml"
    if not mpath.is_file() and not mpath.is_symlink():
        problems.append(f"{mpath}: missing (see results/submissions/README.md)")
    else:
        try:
            meta = load_yaml(mpath, root=folder, max_bytes=METADATA_MAX_BYTES, max_aliases=0, finite=True)
        except InputFileError as e:
            problems.append(str(e))
        else:
            meta = _dates_to_text(meta)
            found = schema_problems(meta, "submission_metadata")
            if isinstance(meta, dict):
                found += _placeholders(meta)
            problems += [f"{mpath}: {p}" for p in found]
    return problems


# ---- packing -----------------------------------------------------------------------------------
def _load_run(run_dir: Path) -> dict[str, Any]:
    spath = run_dir / "summary.json"
    if spath.is_file():
        from crl_bench.results.summary import read_summary

        data = read_summary(spath)
    else:
        data = build_summary(run_dir)
        validate_summary(data, source=f"{run_dir} (summarised from its run files)")
    return data


def _differences(a: Any, b: Any, path: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            out += _differences(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}")
        return out
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def merge_summaries(summaries: Sequence[dict[str, Any]], sources: Sequence[str]) -> dict[str, Any]:
    """Merge validated summaries of the same method, model, mix and eval protocol into one
    ``kind: submission`` summary (runs and seeds concatenated in input order; versions of the first;
    data checksums united).

    Args:
        summaries: summaries (runs or submissions).
        sources: where each came from, for messages (same length).

    Raises:
        SummaryError: no summaries; a field of ``COMPARABLE_KEYS`` differs (the message names each
            differing field, its two values and the two sources); a run id or seed appears twice;
            two summaries give different checksums for one data file.
    """
    if not summaries:
        raise SummaryError("no runs to pack")
    first, src0 = summaries[0], sources[0]
    for s, src in zip(summaries[1:], sources[1:]):
        diffs = [d for key in COMPARABLE_KEYS for d in _differences(first[key], s[key], key)]
        if diffs:
            raise SummaryError(f"cannot pack {src} with {src0}: results are not comparable "
                               f"({'; '.join(diffs)}). Pack runs of one method, model, mix and eval "
                               f"protocol; re-evaluate with the same protocol (crl-bench eval) if needed.")
    runs, seen_ids, seen_seeds = [], {}, {}
    checksums: dict[str, dict[str, str]] = {}
    for s, src in zip(summaries, sources):
        for r in s["runs"]:
            if r["run_id"] in seen_ids:
                raise SummaryError(f"run {r['run_id']!r} is in both {seen_ids[r['run_id']]} and {src}")
            if r["seed"] in seen_seeds:
                raise SummaryError(f"seed {r['seed']} is in both {seen_seeds[r['seed']]} and {src}; a "
                                   f"submission has one run per seed")
            seen_ids[r["run_id"]], seen_seeds[r["seed"]] = src, src
            runs.append(r)
        for env_id, files in s["data_checksums"].items():
            have = checksums.setdefault(env_id, {})
            for name, sha in files.items():
                if have.get(name, sha) != sha:
                    raise SummaryError(f"data file {env_id}/{name} has sha256 {have[name]} in an earlier run "
                                       f"and {sha} in {src}: the runs read different data")
                have[name] = sha
    return {
        "schema_version": SCHEMA_VERSION, "kind": "submission",
        **{k: first[k] for k in COMPARABLE_KEYS},
        "seeds": [r["seed"] for r in runs], "runs": runs,
        "versions": first["versions"], "data_checksums": checksums,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def metadata_template(name: str, git_commit: str | None = None) -> str:
    """Text of a ``metadata.yaml`` to fill in; fields starting with ``TODO`` fail
    :func:`check_submission` until they are replaced."""
    meta = {
        "name": name,
        "authors": [f"{PLACEHOLDER}: Full Name"],
        "contact": f"{PLACEHOLDER}: e-mail or URL",
        "description": f"{PLACEHOLDER}: what was run and how it differs from the reference setup",
        "code": git_commit or f"{PLACEHOLDER}: URL of the code or the crl-bench git commit",
        "date": dt.date.today().isoformat(),
    }
    return ("# Submission metadata (results/submissions/README.md). Replace every TODO; optional keys:\n"
            "# paper, model_url, notes, license.\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True))


def pack_submission(run_dirs: Sequence[str | Path], out_dir: str | Path, name: str,
                    overwrite: bool = False) -> Path:
    """Merge the summaries of run folders into a submission folder.

    Each run folder's ``summary.json`` is read (or, for older runs, built from ``config.yaml`` and
    ``eval.json``); they must share method, model, mix and eval protocol. Writes
    ``<out_dir>/summary.json`` (kind ``submission``) and, if absent, a ``metadata.yaml`` template
    (an existing one is kept).

    Args:
        run_dirs: finished run folders, one per seed.
        out_dir: the submission folder (created).
        name: the submission's name (``metadata.yaml``'s ``name``).
        overwrite: replace an existing ``summary.json`` in ``out_dir``.

    Returns:
        The submission folder.

    Raises:
        SummaryError: an empty name, no run folders, a run that cannot be summarised, runs that are
            not comparable (the message names the differing fields), a duplicate seed or run id, or
            an existing ``summary.json`` without ``overwrite``.
    """
    if not name or not name.strip():
        raise SummaryError("submission name is empty")
    if not run_dirs:
        raise SummaryError("no run folders given")
    out = Path(out_dir)
    if (out / "summary.json").exists() and not overwrite:
        raise SummaryError(f"{out / 'summary.json'} already exists (remove it or pass overwrite)")
    dirs = [Path(d) for d in run_dirs]
    merged = merge_summaries([_load_run(d) for d in dirs], [str(d) for d in dirs])
    validate_summary(merged, source=f"{out / 'summary.json'} (packed)")
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "summary.json", merged)
    meta = out / "metadata.yaml"
    if not meta.exists():
        meta.write_text(metadata_template(name.strip(), merged["versions"].get("git_commit")))
    return out


# ---- command-line helpers ---------------------------------------------------------------------
def main_submission_check(folder: str | Path, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """``crl-bench submission check DIR``: print each problem to stderr (or ``ok`` to stdout).

    Returns:
        0 when valid, 1 otherwise.
    """
    problems = check_submission(folder)
    for p in problems:                      # the messages quote the files' text: escaped for the terminal
        print(printable(p), file=stderr or sys.stderr)
    if problems:
        print(f"{folder}: {len(problems)} problem{'s' if len(problems) > 1 else ''}", file=stderr or sys.stderr)
        return 1
    print(f"{folder}: ok", file=stdout or sys.stdout)
    return 0


def main_submission_pack(run_dirs: Sequence[str | Path], name: str, out_dir: str | Path | None = None,
                         root: str | Path = "results/submissions", stdout: TextIO | None = None,
                         stderr: TextIO | None = None) -> int:
    """``crl-bench submission pack RUN... --name N [--out DIR]``: pack into ``out_dir`` or
    ``<root>/<name>``; ``name`` must pass :func:`crl_bench.config.check_name` (it names the folder
    unless ``--out`` is given, and the submission in any case).

    Returns:
        0 on success (prints the folder and the next steps), 2 on an error (printed to stderr).
    """
    err = stderr or sys.stderr
    try:
        check_name(name, "--name")
    except ConfigError as e:
        print(f"error: {e}", file=err)
        return 2
    target = Path(out_dir) if out_dir is not None else Path(root) / name
    try:
        folder = pack_submission(run_dirs, target, name)
    except SummaryError as e:
        print(f"error: {e}", file=err)
        return 2
    print(f"wrote {folder / 'summary.json'}; fill in {folder / 'metadata.yaml'}, then run "
          f"`crl-bench submission check {folder}`", file=stdout or sys.stdout)
    return 0
