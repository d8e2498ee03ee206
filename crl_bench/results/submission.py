"""Leaderboard submissions: a folder with ``summary.json`` (kind ``submission``) and ``metadata.yaml``.

The format is documented in ``results/submissions/README.md``. :func:`pack_submission` merges the
summaries of one's own runs (one per seed, same method, model, mix and eval protocol) into a
submission folder with a ``metadata.yaml`` template, each run's ``config.yaml`` (``configs/``) and,
optionally, its trajectories (``trajectories/<run id>.jsonl.gz``); :func:`check_submission` lists
everything wrong with a submission folder, task panels included; :func:`verify_submission` re-runs
the configs and writes ``verification.json``, whose ``verified`` the leaderboard shows.
"""

from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import itertools
import math
import platform
import sys
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from crl_bench.config import ConfigError, RunConfig, check_name
from crl_bench.results.summary import (
    SCHEMA_VERSION,
    SummaryError,
    build_summary,
    schema_problems,
    summary_problems,
    validate_summary,
    write_json_atomic,
)
from crl_bench.safe_io import (
    InputFileError,
    copy_inside,
    load_json,
    load_yaml,
    nonfinite_paths,
    parse_json,
    printable,
    read_text,
)

#: Fields of summaries that must be identical for runs to be packed into one submission.
COMPARABLE_KEYS = ("method", "model", "mix", "eval_protocol")
#: A metadata value that still starts with this is an unfilled template field.
PLACEHOLDER = "TODO"
#: Largest ``summary.json`` and ``metadata.yaml`` :func:`check_submission` reads (bytes).
SUMMARY_MAX_BYTES = 16 * 1024 * 1024
METADATA_MAX_BYTES = 64 * 1024
#: Largest ``trajectories/<run id>.jsonl.gz`` (bytes on disk), its text once decompressed, and one line.
TRAJECTORY_MAX_BYTES = 256 * 1024 * 1024
TRAJECTORY_MAX_TEXT = 1024 * 1024 * 1024
TRAJECTORY_MAX_LINE = 16 * 1024 * 1024
#: The file :func:`verify_submission` writes; only it sets ``verified``.
VERIFICATION_FILE = "verification.json"
#: z of the two-sided 95 % interval :func:`verify_submission` allows a re-run to differ by.
VERIFY_Z = 1.96


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


def summary_sha256(folder: str | Path) -> str:
    """sha256 (hex) of a submission's ``summary.json`` bytes, which ``verification.json`` names."""
    return hashlib.sha256((Path(folder) / "summary.json").read_bytes()).hexdigest()


def panel_problems(data: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The task panels of a summary's protocol checked against this machine: ``(problems, notes)``.

    For each env of ``eval_protocol.panels`` the env is built with the protocol's settings and the
    panel of its evaluated tasks (the first ``tasks_per_env`` ids of the split) is hashed here
    (:mod:`crl_bench.results.panel`); a different hash is a problem. An env that cannot be built here
    (an engine, a data set or a container service missing) is a note: its panel is not checked. A
    summary without panels (written before them) gives a note."""
    from crl_bench.data import DataMissingError
    from crl_bench.env_api import EnvUnavailableError
    from crl_bench.results.panel import build_panel, panel_task_ids, short_hash
    from crl_bench.rollout import EnvPool

    proto = data["eval_protocol"]
    panels = proto.get("panels") or {}
    if not panels:
        return [], ["eval_protocol.panels: none recorded (evaluated before task panels existed); the tasks "
                    "cannot be checked"]
    from crl_bench.results.rerun import check_env_settings

    problems, notes = [], []
    settings = proto.get("env_settings") or {}
    for env_id, want in panels.items():
        checked = check_env_settings(env_id, settings.get(env_id, {}), f"$.eval_protocol.env_settings.{env_id}")
        if checked.unavailable:
            notes.append(f"eval_protocol.panels.{env_id}: not checked, the env cannot be built here "
                         f"({checked.unavailable})")
            continue
        if checked.problems:
            problems += checked.problems
            continue
        if checked.dropped:
            notes.append(f"eval_protocol.env_settings.{env_id}: {', '.join(checked.dropped)} not used (settings "
                         "that name the submitter's files or services; this machine's own apply)")
        try:
            env = EnvPool({env_id: checked.kept}, int(proto["max_steps"].get(env_id, 0))).make(env_id)
        except TypeError as e:
            problems.append(f"$.eval_protocol.env_settings.{env_id}: the env cannot be built with these settings "
                            f"({e})")
            continue
        except (EnvUnavailableError, DataMissingError, KeyError, OSError, ValueError) as e:
            notes.append(f"eval_protocol.panels.{env_id}: not checked, the env cannot be built here ({e})")
            continue
        try:
            split = (proto.get("splits") or {}).get(env_id, proto["split"])
            ids = panel_task_ids(env, split, int(proto["tasks_per_env"].get(env_id, 0)))
            here = build_panel(env, env_id, split, ids)["panel_hash"]
        except KeyError as e:
            problems.append(f"$.eval_protocol.panels.{env_id}: the protocol's tasks are not tasks here ({e})")
            continue
        finally:
            env.close()
        if here != want:
            problems.append(f"$.eval_protocol.panels.{env_id}: panel {short_hash(want)} is not the panel this "
                            f"data and code give for the protocol's tasks ({short_hash(here)}): the runs were "
                            f"evaluated on other tasks or other task content (crl-bench panel export / check)")
    return problems, notes


def _run_files(folder: Path, sub: str, suffix: str, ids: set[str]) -> tuple[list[tuple[Path, str]], list[str]]:
    """The files of ``folder/sub`` named ``<run id><suffix>`` of a run in ``ids``: ``([(file, run id)],
    problems)``. ``sub`` as a symbolic link, or not a folder, is one problem (nothing in it is read);
    so is each entry that is not a regular file of a run (a link, a folder, another name)."""
    d = folder / sub
    if d.is_symlink():
        return [], [f"{d}: a symbolic link; refused (a submission's files must be inside its folder)"]
    if not d.exists():
        return [], []
    if not d.is_dir():
        return [], [f"{d}: not a folder"]
    files, problems = [], []
    for f in sorted(d.iterdir()):
        run_id = f.name[:-len(suffix)] if f.name.endswith(suffix) else None
        if f.is_symlink() or not f.is_file() or run_id not in ids:
            problems.append(f"{f}: not a file of a run of this submission ({sub}/<run id>{suffix})")
        else:
            files.append((f, run_id))
    return files, problems


def _trajectory_file_problem(f: Path) -> str | None:
    """What is wrong with one trajectories file, or None: over :data:`TRAJECTORY_MAX_BYTES` on disk or
    :data:`TRAJECTORY_MAX_TEXT` decompressed, a line over :data:`TRAJECTORY_MAX_LINE`, not gzip, a line
    that is not UTF-8 or not a JSON object (parsed with :func:`crl_bench.safe_io.parse_json`'s limits)."""
    size = f.stat().st_size
    if size > TRAJECTORY_MAX_BYTES:
        return f"{f}: {size} bytes, more than the {TRAJECTORY_MAX_BYTES} accepted"
    total = 0
    try:
        with gzip.open(f, "rb") as fh:
            for i in itertools.count(1):
                line = fh.readline(TRAJECTORY_MAX_LINE + 1)
                if not line:
                    return None
                total += len(line)
                if total > TRAJECTORY_MAX_TEXT:
                    return f"{f}: more than the {TRAJECTORY_MAX_TEXT} bytes accepted once decompressed"
                if len(line) > TRAJECTORY_MAX_LINE:
                    return f"{f}: line {i} is longer than the {TRAJECTORY_MAX_LINE} bytes accepted"
                if not line.strip():
                    continue
                try:
                    item = parse_json(line.decode("utf-8"), f"{f}: line {i}")
                except UnicodeDecodeError as e:
                    return f"{f}: line {i} is not UTF-8 text (byte {e.start})"
                except InputFileError as e:
                    return str(e)
                if not isinstance(item, dict):
                    return f"{f}: line {i} is not a JSON object"
    except (OSError, EOFError, zlib.error) as e:
        return f"{f}: not gzip-compressed JSON lines ({e})"
    return None


def _trajectory_problems(folder: Path, data: dict[str, Any]) -> list[str]:
    """``trajectories/<run id>.jsonl.gz``: each names a run of the summary and holds JSON lines
    (:func:`_trajectory_file_problem`); a linked ``trajectories/`` is refused unread."""
    files, problems = _run_files(folder, "trajectories", ".jsonl.gz", {r["run_id"] for r in data["runs"]})
    return problems + [p for f, _ in files if (p := _trajectory_file_problem(f)) is not None]


def _config_problems(folder: Path, data: dict[str, Any]) -> list[str]:
    """``configs/<run id>.yaml``: each names a run of the summary, reads as untrusted YAML, is a valid
    config (:func:`crl_bench.config.build_config`) and has the training settings the summary records
    for its run (``settings``); a linked ``configs/`` is refused unread."""
    from crl_bench.config import CONFIG_MAX_ALIASES, CONFIG_MAX_BYTES, build_config
    from crl_bench.results.summary import settings_hash

    runs = {r["run_id"]: r for r in data["runs"]}
    files, problems = _run_files(folder, "configs", ".yaml", set(runs))
    for f, run_id in files:
        try:
            cfg = load_yaml(f, root=folder, max_bytes=CONFIG_MAX_BYTES, max_aliases=CONFIG_MAX_ALIASES, finite=True)
        except InputFileError as e:
            problems.append(str(e))
            continue
        if not isinstance(cfg, dict):
            problems.append(f"{f}: not a config (a mapping of sections), got {type(cfg).__name__}")
            continue
        try:
            build_config([cfg])
            mine = settings_hash(cfg)
        except (ConfigError, TypeError, ValueError) as e:
            problems.append(f"{f}: not a valid config ({e})")
            continue
        recorded = runs[run_id].get("settings")
        if isinstance(recorded, str) and mine != recorded:
            problems.append(f"{f}: not the config of run {run_id} (its training settings hash to {mine[:12]}, "
                            f"the summary records {recorded[:12]})")
    return problems


def _verification(folder: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """``verification.json`` of ``folder`` read as untrusted input: ``(its data, [])`` when it is
    :func:`verify_submission`'s for the current ``summary.json``, ``(None, [])`` when there is none,
    else ``(None, [problem])``."""
    vpath = folder / VERIFICATION_FILE
    if not vpath.exists() and not vpath.is_symlink():
        return None, []
    try:
        v = load_json(vpath, root=folder)
        current = summary_sha256(folder)
    except (InputFileError, OSError) as e:
        return None, [str(e)]
    if not (isinstance(v, dict) and isinstance(v.get("verified"), bool) and isinstance(v.get("summary_sha256"), str)):
        return None, [f"{vpath}: not written by crl-bench submission verify (needs 'verified' and 'summary_sha256')"]
    if v["summary_sha256"] != current:
        return None, [f"{vpath}: it verified another summary.json (changed since); run crl-bench submission verify "
                      f"again or remove {VERIFICATION_FILE}"]
    return v, []


def check_submission(folder: str | Path, panels: bool = True, notes: list[str] | None = None) -> list[str]:
    """Everything wrong with a submission folder; an empty list means it is valid.

    Both files are read as untrusted input (crl_bench.safe_io): a symbolic link that leaves the
    folder, a file over the size limit (:data:`SUMMARY_MAX_BYTES`, :data:`METADATA_MAX_BYTES`), text
    that is not UTF-8, nesting deeper than 64 levels, YAML aliases, over-long integers and numbers
    that are not finite (NaN, Infinity) are each one problem, and nothing of a refused file is shown.

    Checks ``summary.json`` (present, JSON, the summary schema and cross-field rules:
    crl_bench.results.summary.summary_problems; kind ``submission``; one run per seed; every evaluated env in
    the mix; ``eval_protocol`` names every env of the mix; every run has a free evaluation of every
    env; with ``panels``, the task panels of the protocol against this machine's data and code,
    :func:`panel_problems`), ``metadata.yaml`` (present, YAML, ``submission_metadata.schema.json``;
    no ``TODO`` placeholders left from the template), the configs if any (``configs/<run id>.yaml``,
    each a valid config with the run's training settings: :func:`_config_problems`), the trajectories
    if any (named by run id, gzip-compressed JSON lines within size caps, each parsed with the bounded
    parser: :func:`_trajectory_file_problem`; a linked ``configs/`` or ``trajectories/`` is refused
    unread) and ``verification.json`` if any (made for this ``summary.json``). Bad
    ``eval_protocol.env_settings`` are problems (:func:`panel_problems`).

    Args:
        folder: the submission folder.
        panels: check the task panels (builds each env of the mix once).
        notes: what could not be checked (e.g. an env that cannot be built here) is appended here.

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
                if panels and not found:
                    found_panels, said = panel_problems(data)
                    found += found_panels
                    if notes is not None:
                        notes += said
            elif isinstance(data, dict) and data.get("kind") == "run":
                found.append("$.kind: is 'run'; a submission's summary has kind 'submission'")
            problems += [f"{spath}: {p}" for p in found]
            if not found:
                problems += (_config_problems(folder, data) + _trajectory_problems(folder, data)
                             + _verification(folder)[1])
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
                    overwrite: bool = False, trajectories: bool = False) -> Path:
    """Merge the summaries of run folders into a submission folder.

    Each run folder's ``summary.json`` is read (or, for older runs, built from ``config.yaml`` and
    ``eval.json``); they must share method, model, mix and eval protocol. Writes
    ``<out_dir>/summary.json`` (kind ``submission``), each run's ``config.yaml`` as
    ``configs/<run id>.yaml`` (what :func:`verify_submission` re-runs), with ``trajectories`` each
    run's ``episodes.jsonl`` gzip-compressed as ``trajectories/<run id>.jsonl.gz``, and, if absent, a
    ``metadata.yaml`` template (an existing one is kept). A stale ``verification.json`` is removed.

    Args:
        run_dirs: finished run folders, one per seed.
        out_dir: the submission folder (created).
        name: the submission's name (``metadata.yaml``'s ``name``).
        overwrite: replace an existing ``summary.json`` in ``out_dir``.
        trajectories: also pack the runs' episodes (a run without ``episodes.jsonl`` is an error).

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
    loaded = [_load_run(d) for d in dirs]
    merged = merge_summaries(loaded, [str(d) for d in dirs])
    validate_summary(merged, source=f"{out / 'summary.json'} (packed)")
    runs_of = [(d, r["run_id"]) for d, s in zip(dirs, loaded) if s["kind"] == "run" for r in s["runs"]]
    if trajectories:
        missing = [str(d) for d, _ in runs_of if not (d / "episodes.jsonl").is_file()
                   and not (d / "episodes.jsonl").is_symlink()]
        if missing:
            raise SummaryError(f"no episodes.jsonl in {', '.join(missing)}: nothing to pack as trajectories")
    from crl_bench.config import CONFIG_MAX_BYTES

    texts = {}                                  # read as untrusted, all before anything is written
    for d, run_id in runs_of:
        if (d / "config.yaml").is_file() or (d / "config.yaml").is_symlink():
            try:
                texts[run_id] = read_text(d / "config.yaml", root=d, max_bytes=CONFIG_MAX_BYTES)
            except InputFileError as e:
                raise SummaryError(f"cannot pack {e}") from None
    made = [p for p in (out, out / "configs", out / "trajectories") if not p.exists()]
    written: list[Path] = []
    out.mkdir(parents=True, exist_ok=True)
    for run_id, text in texts.items():
        (out / "configs").mkdir(exist_ok=True)
        written.append(out / "configs" / f"{run_id}.yaml")
        written[-1].write_text(text, encoding="utf-8")
    for d, run_id in runs_of if trajectories else ():
        (out / "trajectories").mkdir(exist_ok=True)
        written.append(out / "trajectories" / f"{run_id}.jsonl.gz")
        try:
            with gzip.open(written[-1], "wb") as dst:
                copy_inside(d / "episodes.jsonl", dst, root=d, max_bytes=TRAJECTORY_MAX_TEXT)
        except InputFileError as e:             # what this call wrote goes again
            for path in written:
                path.unlink(missing_ok=True)
            for folder_made in sorted(made, key=lambda p: len(p.parts), reverse=True):
                if folder_made.is_dir() and not any(folder_made.iterdir()):
                    folder_made.rmdir()
            raise SummaryError(f"cannot pack {e}") from None
    (out / VERIFICATION_FILE).unlink(missing_ok=True)       # it verified the summary replaced here
    write_json_atomic(out / "summary.json", merged)
    meta = out / "metadata.yaml"
    if not meta.exists():
        meta.write_text(metadata_template(name.strip(), merged["versions"].get("git_commit")))
    return out


# ---- verification ------------------------------------------------------------------------------
def tolerance(p_a: float, p_b: float, n: int) -> float:
    """How far two success rates over the same ``n`` episodes may differ by sampling alone: the 95 %
    half-width of the difference of two binomial proportions, ``1.96 * sqrt(2 p (1 - p) / n)``, with
    ``p`` the pooled rate with one success and one failure added (``(n p_a + n p_b + 1) / (2 n + 2)``)
    so that two rates of 0 (or 1) still allow a one-episode difference. Raises ``ValueError`` for n < 1."""
    if n < 1:
        raise ValueError(f"tolerance needs at least one episode, got n={n}")
    p = (n * p_a + n * p_b + 1) / (2 * n + 2)
    return VERIFY_Z * math.sqrt(2 * p * (1 - p) / n)


def verify_submission(folder: str | Path, rerun: Callable[[RunConfig], Path], work: str | Path,
                      seeds: Sequence[int] | None = None, say: Callable[[str], Any] | None = None,
                      plan_only: bool = False) -> dict[str, Any] | None:
    """Re-run a submission's configs within bounds and compare; writes and returns ``verification.json``.

    Each run chosen (``seeds``, default all) is trained and evaluated again by ``rerun(config) -> run
    folder`` with the config :func:`crl_bench.results.rerun.rerun_config` builds from
    ``configs/<run id>.yaml``: only the fields that define training and the protocol, a local run
    logged into ``work/verify-<run id>``, no sizes beyond what the summary records. Every run's config
    is built and checked, and the plan of each (:func:`crl_bench.results.rerun.plan`) passed to
    ``say``, before the first re-run starts. The submission is verified when every re-run has the
    submission's evaluation protocol (task panels included: the same tasks with the same content) and,
    in every eval mode both have, every env's success rate lies within :func:`tolerance` of the
    submitted one (over the protocol's tasks times ``samples``).

    Args:
        folder: the submission folder.
        rerun: trains and evaluates one config (``output_dir`` and ``run_id`` set), returns its folder.
        work: the folder the re-runs go into.
        seeds: only these seeds.
        say: called with each line of the plan and each note (default: nothing).
        plan_only: stop after the plan (returns None, writes nothing).

    Returns:
        ``{"verified", "summary_sha256", "rule", "crl_bench", "git_commit", "machine", "date",
        "runs": [{"run_id", "seed", "rerun", "protocol_differences", "modes": {mode: {env:
        {"submitted", "rerun", "tolerance", "ok"}}}}]}``, or None with ``plan_only``.

    Raises:
        SummaryError: the submission has problems (:func:`check_submission`, verification aside), a
            seed it does not hold, a run without ``configs/<run id>.yaml``, or a config refused by
            :func:`~crl_bench.results.rerun.rerun_config` (every reason, one per line).
    """
    from crl_bench.config import CONFIG_MAX_ALIASES, CONFIG_MAX_BYTES
    from crl_bench.results.rerun import comparable_settings, plan, plan_line, rerun_config

    folder, work, say = Path(folder), Path(work), say or (lambda _line: None)
    problems = [p for p in check_submission(folder) if VERIFICATION_FILE not in p]
    if problems:
        raise SummaryError(f"{folder} has problems; fix them first (crl-bench submission check): {problems[0]}")
    data = load_json(folder / "summary.json", root=folder, max_bytes=SUMMARY_MAX_BYTES)
    runs = data["runs"] if seeds is None else [r for r in data["runs"] if r["seed"] in set(seeds)]
    unknown = sorted(set(seeds or ()) - {r["seed"] for r in data["runs"]})
    if unknown:
        raise SummaryError(f"{folder}: no run with seed(s) {', '.join(map(str, unknown))}")
    configs = []
    for r in runs:
        try:
            check_name(r["run_id"], "run_id")
        except ConfigError as e:
            raise SummaryError(f"{folder / 'summary.json'}: {e}") from None
        path = folder / "configs" / f"{r['run_id']}.yaml"
        if not path.is_file() and not path.is_symlink():
            raise SummaryError(f"{folder}: no configs/{r['run_id']}.yaml to re-run (pack the runs again with "
                               f"crl-bench submission pack)")
        try:
            submitted = load_yaml(path, root=folder, max_bytes=CONFIG_MAX_BYTES, max_aliases=CONFIG_MAX_ALIASES,
                                  finite=True)
        except InputFileError as e:
            raise SummaryError(str(e)) from None
        cfg, notes = rerun_config(submitted, data, r, work, str(path))
        configs.append((r, cfg))
        for n in notes:
            say(f"note: {n}")
    for r, cfg in configs:
        say(plan_line(plan(cfg, data, r)))
    if plan_only:
        return None
    proto = data["eval_protocol"]
    per_task = int(proto.get("samples", 1))
    out_runs = []
    for r, cfg in configs:
        new = rerun(cfg)
        again = build_summary(new)
        mine_proto = {**again["eval_protocol"]}
        theirs = {**proto}
        for p in (mine_proto, theirs):
            if "env_settings" in p:
                p["env_settings"] = comparable_settings(p["env_settings"])
        diffs = _differences(theirs, mine_proto, "eval_protocol")
        modes: dict[str, dict[str, Any]] = {}
        mine = again["runs"][0]["eval"]
        for mode, block in r["eval"].items():
            if not block or not mine.get(mode):
                continue
            for env_id, row in block["per_env"].items():
                other = mine[mode]["per_env"].get(env_id)
                if other is None:
                    diffs.append(f"eval.{mode}.per_env.{env_id}: not evaluated by the re-run")
                    continue
                n = int(proto["tasks_per_env"][env_id]) * per_task
                a, b = float(row["success_rate"]), float(other["success_rate"])
                tol = tolerance(a, b, n)
                modes.setdefault(mode, {})[env_id] = {"submitted": a, "rerun": b, "tolerance": tol,
                                                      "ok": abs(a - b) <= tol + 1e-12}
        out_runs.append({"run_id": r["run_id"], "seed": r["seed"], "rerun": str(new), "protocol_differences": diffs,
                         "modes": modes})
    ok = bool(out_runs) and all(not x["protocol_differences"] and all(c["ok"] for m in x["modes"].values()
                                                                      for c in m.values()) for x in out_runs)
    from crl_bench import __version__
    from crl_bench.results.run_folder import git_commit

    result = {"verified": ok, "summary_sha256": summary_sha256(folder),
              "rule": f"each env's success within {VERIFY_Z} x the binomial standard error of the difference "
                      "(crl_bench.results.submission.tolerance), same protocol and task panels",
              "crl_bench": __version__, "git_commit": git_commit(),
              "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
              "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "runs": out_runs}
    write_json_atomic(folder / VERIFICATION_FILE, result)
    return result


def is_verified(folder: str | Path) -> bool:
    """The folder's ``verification.json`` says ``verified`` for its current ``summary.json`` (read as
    untrusted input; any problem reads as not verified)."""
    v, _ = _verification(Path(folder))
    return v is not None and v["verified"] is True


# ---- command-line helpers ---------------------------------------------------------------------
def main_submission_check(folder: str | Path, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """``crl-bench submission check DIR``: print each problem to stderr (or ``ok`` to stdout).

    Returns:
        0 when valid, 1 otherwise.
    """
    notes: list[str] = []
    problems = check_submission(folder, notes=notes)
    for n in notes:
        print(f"note: {printable(n)}", file=stdout or sys.stdout)
    for p in problems:                      # the messages quote the files' text: escaped for the terminal
        print(printable(p), file=stderr or sys.stderr)
    if problems:
        print(f"{folder}: {len(problems)} problem{'s' if len(problems) > 1 else ''}", file=stderr or sys.stderr)
        return 1
    print(f"{folder}: ok", file=stdout or sys.stdout)
    return 0


def main_submission_pack(run_dirs: Sequence[str | Path], name: str, out_dir: str | Path | None = None,
                         root: str | Path = "results/submissions", stdout: TextIO | None = None,
                         stderr: TextIO | None = None, trajectories: bool = False) -> int:
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
        folder = pack_submission(run_dirs, target, name, trajectories=trajectories)
    except SummaryError as e:
        print(f"error: {e}", file=err)
        return 2
    print(f"wrote {folder / 'summary.json'}; fill in {folder / 'metadata.yaml'}, then run "
          f"`crl-bench submission check {folder}`", file=stdout or sys.stdout)
    return 0


def main_submission_verify(folder: str | Path, rerun: Callable[[RunConfig], Path], work: str | Path,
                           seeds: Sequence[int] | None = None, stdout: TextIO | None = None,
                           stderr: TextIO | None = None, plan_only: bool = False) -> int:
    """``crl-bench submission verify DIR [--seeds S,...] [--work DIR] [--plan]``: :func:`verify_submission`,
    its plan first (one line per run: episodes to train and evaluate), then one line per run and env.

    Returns:
        0 verified (or, with ``plan_only``, the plan printed), 1 not verified (each difference
        printed), 2 a submission that cannot be verified (each reason printed).
    """
    out = stdout or sys.stdout
    try:
        res = verify_submission(folder, rerun, work, seeds, plan_only=plan_only,
                                say=lambda line: print(printable(line), file=out, flush=True))
    except SummaryError as e:
        for line in str(e).splitlines():
            print(f"error: {printable(line)}", file=stderr or sys.stderr)
        return 2
    if res is None:
        return 0
    for r in res["runs"]:
        for d in r["protocol_differences"]:
            print(f"{r['run_id']}: protocol differs: {printable(d)}", file=out)
        for mode, envs in r["modes"].items():
            for env_id, c in envs.items():
                print(f"{r['run_id']} {mode} {env_id}: submitted {c['submitted']:.3f}, re-run {c['rerun']:.3f} "
                      f"(allowed difference {c['tolerance']:.3f}) {'ok' if c['ok'] else 'DIFFERS'}", file=out)
    print(f"{folder}: {'verified' if res['verified'] else 'NOT verified'}; wrote {Path(folder) / VERIFICATION_FILE}",
          file=out)
    return 0 if res["verified"] else 1
