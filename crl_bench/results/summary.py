"""``summary.json``: one comparable, validated record of a finished run or of a submission.

A run folder (crl_bench/results/run_folder.py) holds everything about a run; ``summary.json`` keeps only what
makes results comparable across runs, machines and submitters (schema_version 1,
``crl_bench/schemas/summary.schema.json``)::

    {"schema_version": 1, "kind": "run" | "submission", "method": ...,
     "model": {"name", "variant", "extractor"}, "mix": {"name", "envs": {env_id: weight}},
     "eval_protocol": {"split", "episodes", "temperature", "top_p", ["top_k", "max_new_tokens"],
                       "max_steps": {env_id: int}, "tasks_per_env": {env_id: int},
                       ["env_settings": {env_id: {setting: value}}], ["splits", "profile", "prompt",
                       "trials", "samples", "draws", "constrained", "prefill"]},
     "seeds": [...], "runs": [{"run_id", "seed", "train": {"steps", "episodes", "wall_s"}, ["alerts": [...],]
                               "eval": {"free": EVALS | null, "guided": EVALS | null,
                                        ["shuffled": EVALS, "empty": EVALS, "raw": EVALS,
                                         "condensed": EVALS, "both": EVALS,]
                                        ["initial": EVALS]}}],
     "versions": {"crl_bench", "python", "git_commit", "packages"},
     "data_checksums": {env_id: {file: sha256}}, "created": ISO-8601}

``EVALS`` is one evaluation mode of ``eval.json`` without its task ids and wall time: episodes,
pooled success rate, mean reward, mean steps, invalid-action rate, env errors and ``per_env``
(episodes, success rate, mean steps, invalid-action rate, ``score_mean``, ``per_type``).
``initial`` (runs with ``eval.at_start``) is the untrained actor's evaluation on the same tasks;
``shuffled`` and ``empty`` are the memory controls of experience methods, ``raw``, ``condensed`` and ``both``
its memory forms (docs/evaluation.md "Memory controls", "Memory forms").
``alerts`` (only when the run raised any) are the learning alarms of its metrics.jsonl rows, in step
order (:mod:`crl_bench.results.alarms`).

A run's summary has one entry in ``runs``; a submission's has one per seed
(crl_bench/results/submission.py). The leaderboard (crl_bench/results/leaderboard.py) reads only summaries.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from crl_bench.config import CONFIG_MAX_ALIASES, RENAMED_KEYS
from crl_bench.methods import get_method, list_methods
from crl_bench.results.panel import content_hash
from crl_bench.results.run_folder import iter_metrics
from crl_bench.safe_io import InputFileError, load_json, load_yaml, nonfinite_paths, printable

SCHEMA_VERSION = 1
#: Keys of one evaluation mode that a summary keeps (``tasks`` and ``wall_s`` are dropped).
EVAL_KEYS = ("episodes", "success_rate", "reward_mean", "steps_mean", "invalid_action_rate", "env_errors")
#: Keys of one evaluation mode a summary keeps when the evaluation has them (``eval.trials`` > 1,
#: ``eval.samples`` > 1).
TRIAL_KEYS = ("success_by_trial", "attempts", "samples", "pass_at_k", "pass_hat_k")
#: Keys of one env's entry in ``per_env`` that a summary keeps (``successes``: per eval task, in the
#: panel's task order, 0/1, or the share of successful samples with ``eval.samples``, which the paired
#: memory lift of the leaderboard resamples).
PER_ENV_KEYS = ("episodes", "success_rate", "steps_mean", "invalid_action_rate", "score_mean", "per_type",
                "successes", "pass_at_k", "pass_hat_k", "draws")
#: Evaluation modes a run's summary carries (``initial`` besides): experience-free, guided, and the
#: memory controls (docs/evaluation.md).
EVAL_MODES = ("free", "guided", "shuffled", "empty", "raw", "condensed", "both")
#: The method name of a run folder written by ``crl-bench eval --save-run``: a model evaluated here and
#: trained elsewhere (or not at all); it has no extractor.
EVAL_ONLY = "eval-only"
#: Protocol keys of a new-format ``eval.json`` that a summary keeps.
PROTOCOL_KEYS = ("split", "splits", "profile", "episodes", "temperature", "top_p", "top_k", "max_new_tokens",
                 "max_steps", "prompt", "tasks_per_env", "env_settings", "panels", "trials", "samples", "draws",
                 "constrained", "prefill")


class SummaryError(ValueError):
    """A run folder cannot be summarised, or a summary does not validate.

    Attributes:
        problems: one line per problem (each names the file and the field or JSON path).
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems) if problems else [message]


# ---- schemas -------------------------------------------------------------------------------------
@cache
def _schema_text(name: str) -> str:
    fname = name if name.endswith(".json") else f"{name}.schema.json"
    ref = resources.files("crl_bench").joinpath("schemas", fname)
    if not ref.is_file():
        known = sorted(p.name for p in resources.files("crl_bench").joinpath("schemas").iterdir()
                       if p.name.endswith(".json"))
        raise SummaryError(f"no schema {name!r} in crl_bench/schemas (known: {', '.join(known)})")
    return ref.read_text()


def load_schema(name: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) shipped as ``crl_bench/schemas/<name>.schema.json``.

    Args:
        name: ``"summary"``, ``"submission_metadata"`` or ``"reported"`` (a full file name also works).

    Returns:
        A fresh dict (callers may modify it).

    Raises:
        SummaryError: no such schema (the message lists the shipped ones).
    """
    return json.loads(_schema_text(name))


def json_path(parts: Iterable[Any]) -> str:
    """``$.runs[0].eval.free`` from a jsonschema ``absolute_path``."""
    out = "$"
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def schema_problems(data: Any, schema_name: str) -> list[str]:
    """Every violation of schema ``schema_name`` by ``data``, as ``"<json path>: <message>"``,
    sorted by path. Empty when ``data`` validates."""
    schema = load_schema(schema_name)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    errors = sorted(validator.iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{json_path(e.absolute_path)}: {_message(e)}" for e in errors]


def _message(error: jsonschema.ValidationError) -> str:
    """The error's message; for anyOf/oneOf, which alternatives failed and why; for a pattern, the
    schema's ``errorMessage`` where it gives one (a regular expression says little to a reader)."""
    if error.validator == "pattern" and isinstance(error.schema, dict) and "errorMessage" in error.schema:
        return f"{error.instance!r} {error.schema['errorMessage']}"
    if error.validator in ("anyOf", "oneOf") and error.context:
        why = "; ".join(dict.fromkeys(f"{json_path(c.relative_path)[1:].lstrip('.')}"
                                      f"{': ' if c.relative_path else ''}{c.message}" for c in error.context))
        return f"{error.instance!r} matches none of the allowed forms ({why})"
    return error.message


def summary_problems(data: Any) -> list[str]:
    """Schema violations of a summary, then (only if the schema passes) the checks that span fields.

    Every number must be finite (a NaN passes a schema's minimum and maximum). Semantic checks:
    ``seeds`` equals the runs' seeds in order; a ``run`` summary has exactly one
    run; run ids are unique; a ``submission`` has one run per seed; every env evaluated in any run
    is in ``mix.envs``; ``eval_protocol.max_steps``, ``tasks_per_env`` and (when present)
    ``panels`` name every evaluated env.

    Returns:
        ``["<json path>: <message>", ...]``; empty when the summary is valid.
    """
    problems = schema_problems(data, "summary") + [f"{p}: not a finite number" for p in nonfinite_paths(data)]
    if problems:
        return problems
    runs = data["runs"]
    run_seeds = [r["seed"] for r in runs]
    if data["seeds"] != run_seeds:
        problems.append(f"$.seeds: {data['seeds']} does not match the seeds of $.runs {run_seeds}")
    if data["kind"] == "run" and len(runs) != 1:
        problems.append(f"$.runs: a summary of kind 'run' has exactly one run, got {len(runs)}")
    ids = [r["run_id"] for r in runs]
    for rid in sorted({i for i in ids if ids.count(i) > 1}):
        problems.append(f"$.runs: run_id {rid!r} appears {ids.count(rid)} times")
    if data["kind"] == "submission":
        for s in sorted({s for s in run_seeds if run_seeds.count(s) > 1}):
            problems.append(f"$.seeds: seed {s} appears {run_seeds.count(s)} times (one run per seed)")
    mix_envs = set(data["mix"]["envs"])
    proto = data["eval_protocol"]
    evaluated: set[str] = set()
    for i, r in enumerate(runs):
        for mode in EVAL_MODES:
            block = r["eval"].get(mode)
            if block is None:
                continue
            for env_id in block["per_env"]:
                evaluated.add(env_id)
                if env_id not in mix_envs:
                    problems.append(f"$.runs[{i}].eval.{mode}.per_env.{env_id}: env is not in the mix "
                                    f"{data['mix']['name']!r} ({', '.join(sorted(mix_envs))})")
    for key in ("max_steps", "tasks_per_env") + (("panels",) if "panels" in proto else ()):
        for env_id in sorted(evaluated - set(proto[key])):
            problems.append(f"$.eval_protocol.{key}: no entry for evaluated env {env_id!r}")
    return problems


def validate_summary(data: Any, source: str = "summary.json") -> None:
    """Check a summary against the schema and the cross-field rules (:func:`summary_problems`).

    Args:
        data: the parsed summary.
        source: where it came from, used in the message (a file path).

    Raises:
        SummaryError: listing every problem as ``<source>: <json path>: <message>``; its
            ``problems`` attribute holds them one per item.
    """
    problems = summary_problems(data)
    if problems:
        lines = [f"{source}: {p}" for p in problems]
        raise SummaryError(f"{source} is not a valid summary ({len(lines)} problem"
                           f"{'s' if len(lines) > 1 else ''}):\n  " + "\n  ".join(lines), lines)


# ---- reading a run folder ---------------------------------------------------------------------
def _read_json(path: Path, what: str) -> Any:
    """``path`` parsed as untrusted JSON (crl_bench.safe_io.load_json: inside its folder, size, depth
    and finite numbers). Raises :class:`SummaryError` naming the file."""
    if not path.is_file():
        raise SummaryError(f"{path}: missing ({what})")
    try:
        return load_json(path)
    except InputFileError as e:
        raise SummaryError(str(e)) from None


def _get(d: Any, dotted: str, file: Path, default: Any = ..., types: tuple = ()) -> Any:
    cur = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            if default is not ...:
                return default
            raise SummaryError(f"{file}: missing {dotted!r}")
        cur = cur[part]
    bad_bool = isinstance(cur, bool) and bool not in types
    if types and (not isinstance(cur, types) or bad_bool):
        names = "/".join(t.__name__ for t in types)
        raise SummaryError(f"{file}: {dotted!r} must be {names}, got {cur!r}")
    return cur


#: The ``generation`` keys of a model behind an OpenAI-compatible server (where it is and how to reach
#: it): a served model is only evaluated, never trained, and the served model's name is the row's model.
OPENAI_KEYS = ("openai_base_url", "openai_model", "openai_api", "openai_api_key_env", "openai_concurrency",
               "openai_retries", "openai_timeout_s")
#: Config keys that do not change what a run learns: names and folders, the evaluation (its protocol
#: is keyed on its own), logging, the learning alarms, the execution backend, when checkpoints are
#: written, and the served model's connection (:data:`OPENAI_KEYS`). Everything else in config.yaml is a
#: training setting.
NOT_TRAINING = {"run_id": None, "output_dir": None, "eval": None, "logging": None, "alarms": None,
                "backend": None, "ray": None,
                "train": ("seed", "save_checkpoint", "checkpoint_every", "keep_checkpoints"),
                "generation": OPENAI_KEYS}


def flat_experience(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the keys of ``experience``'s sections under their flat names
    (:data:`~crl_bench.config.RENAMED_KEYS`: ``experience.cases.tokens`` as ``experience.case_tokens``),
    a section's other keys as ``section.key``: one form for configs written in either layout, so that
    equal settings give equal training settings and hashes. A new dict; ``config`` is left as it is."""
    exp = config.get("experience")
    sections = {new.split(".")[1] for new in RENAMED_KEYS.values()}
    if not isinstance(exp, dict) or not any(isinstance(exp.get(name), dict) for name in sections):
        return config
    flat = {new.split(".", 1)[1]: old.split(".", 1)[1] for old, new in RENAMED_KEYS.items()}
    out: dict[str, Any] = {}
    for key, value in exp.items():
        if key in sections and isinstance(value, dict):
            for leaf, v in value.items():
                out[flat.get(f"{key}.{leaf}", f"{key}.{leaf}")] = v
        else:
            out[key] = value
    return {**config, "experience": out}


def training_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A run's training settings: its config (``config.yaml``, a mapping) without the keys of
    :data:`NOT_TRAINING` and without keys set to null (a setting added later with a null default
    reads as absent in the configs written before it), ``experience``'s sections under their flat
    names (:func:`flat_experience`). Two runs whose training settings are equal differ only in seed
    (and in what the config does not record, such as the code's version)."""
    def drop_null(value: Any) -> Any:
        return {k: drop_null(v) for k, v in value.items() if v is not None} if isinstance(value, dict) else value

    out: dict[str, Any] = {}
    for key, value in flat_experience(config).items():
        drop = NOT_TRAINING.get(key, ())
        if drop is None or value is None:
            continue
        out[key] = drop_null({k: v for k, v in value.items() if k not in drop} if isinstance(value, dict) else value)
    return out


def settings_hash(config: dict[str, Any]) -> str:
    """sha256 (hex) of :func:`training_settings` as canonical JSON (the panels' ``content_hash``):
    the leaderboard pools only runs with the same hash (docs/leaderboard.md). Raises ``TypeError``
    for a config JSON cannot hold."""
    return content_hash(training_settings(config))


def config_training_settings(path: str | Path, root: str | Path | None = None) -> dict[str, Any] | None:
    """:func:`training_settings` of a config file (a run's ``config.yaml``, a submission's
    ``configs/<run id>.yaml``); ``None`` when it is missing, unreadable, not a mapping, or (a real
    path) outside ``root`` (default: its folder; :func:`crl_bench.safe_io.read_text`)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        config = load_yaml(path, root=root, max_aliases=CONFIG_MAX_ALIASES)
    except (InputFileError, TypeError, ValueError):
        return None
    return training_settings(config) if isinstance(config, dict) else None


def config_settings_hash(path: str | Path) -> str | None:
    """:func:`settings_hash` of a config file (a run's ``config.yaml``, a submission's
    ``configs/<run id>.yaml``); ``None`` when it is missing, unreadable or not a mapping."""
    settings = config_training_settings(path)
    try:
        return content_hash(settings) if settings is not None else None
    except (TypeError, ValueError):
        return None


def run_config_path(summary: dict[str, Any], folder: str | Path, run_id: str) -> Path:
    """Where the config of run ``run_id`` of ``summary`` lies in ``folder``: ``config.yaml`` for a
    run's summary, ``configs/<run id>.yaml`` for a submission's."""
    folder = Path(folder)
    return folder / "config.yaml" if summary["kind"] == "run" else folder / "configs" / f"{run_id}.yaml"


@cache
def _default_training_settings() -> str:
    """Canonical JSON of :func:`training_settings` of a default :class:`~crl_bench.config.RunConfig`."""
    from crl_bench.config import RunConfig

    return json.dumps(training_settings(RunConfig().to_dict()), sort_keys=True)


def pooled_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Training settings (:func:`training_settings`) as the leaderboard pools them: each key a section of
    ``settings`` lacks that today's default config has reads as its default (a setting added after the
    config was written behaved as its default then), so a run configured before a setting existed pools
    with one that has it at its default. Sections merge one level deep (``train.lr``); a value that is
    itself a mapping (``rollout.env_kwargs``) is kept whole. A new dict; ``settings`` is left as it is."""
    out = json.loads(_default_training_settings())
    for key, value in settings.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def fill_settings(summary: dict[str, Any], folder: str | Path) -> dict[str, dict[str, Any]]:
    """Read each run's config in ``folder`` (``config.yaml`` for a run, ``configs/<run id>.yaml`` for
    a submission) once: a run without a ``settings`` hash (a summary written before it existed) gets
    its config's hash; runs without a config stay without. A run whose config has the hash it
    carries also gets ``_pool``, the hash of its :func:`pooled_settings`: what the leaderboard groups
    runs by (:func:`pool_hash`), so runs of one config written by different versions of the code pool.

    Returns:
        ``{pool hash: pooled settings}`` for the runs whose config has the hash the run carries (a
        config edited since is left out): the leaderboard names rows that differ only in settings
        by the keys that differ (docs/leaderboard.md)."""
    out: dict[str, dict[str, Any]] = {}
    pools: dict[str, str] = {}                       # settings hash -> pool hash, read once
    for r in summary["runs"]:
        if r.get("settings") in pools:
            r["_pool"] = pools[r["settings"]]
            continue
        settings = config_training_settings(run_config_path(summary, folder, r["run_id"]), root=folder)
        if settings is None:
            continue
        try:
            h = content_hash(settings)
            pooled = pooled_settings(settings)
            pool = content_hash(pooled)
        except (TypeError, ValueError):
            continue
        r.setdefault("settings", h)
        if r["settings"] == h:
            r["_pool"] = pools[h] = pool
            out[pool] = pooled
    return out


def pool_hash(run: dict[str, Any]) -> str:
    """The hash a run of a summary read by the leaderboard pools by: its ``_pool``
    (:func:`fill_settings`) where its config was read, else the ``settings`` hash its summary records
    (``""`` where none)."""
    return str(run.get("_pool") or run.get("settings") or "")


#: At most this many differing settings name a row; rows that differ in more get the hash prefix.
LABEL_MAX_KEYS = 3
#: Longest value shown in a settings label (longer ones are cut and end with "...").
LABEL_MAX_VALUE = 40


def _flat(settings: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys to canonical JSON values (``{"train": {"lr": 1e-5}}`` -> ``{"train.lr": "1e-05"}``)."""
    out: dict[str, str] = {}
    for k, v in settings.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v, sort_keys=True, separators=(",", ":"))
    return out


def _setting_text(key: str, value: str | None) -> str:
    """``key=value`` for a label: strings without their quotes, ``unset`` for an absent key, values
    longer than :data:`LABEL_MAX_VALUE` cut; printable characters only (config text is user input)."""
    if value is None:
        text = "unset"
    else:
        parsed = json.loads(value)
        text = parsed if isinstance(parsed, str) else value
    text = printable(text, keep="")
    if len(text) > LABEL_MAX_VALUE:
        text = text[:LABEL_MAX_VALUE - 3] + "..."
    return f"{printable(key, keep='')}={text}"


def settings_labels(hashes: set[str], details: dict[str, dict[str, Any]]) -> dict[str, str] | None:
    """``{hash: "key=value, ..."}`` naming each settings hash by the keys whose values differ
    between them (``details``: ``{hash: training settings}``); ``None`` when a hash has no known
    settings, more than :data:`LABEL_MAX_KEYS` keys differ, or two labels would read the same. The
    leaderboard names its rows and the report its curves this way (docs/leaderboard.md)."""
    if not hashes <= details.keys():
        return None
    flat = {h: _flat(details[h]) for h in hashes}
    keys = sorted({k for f in flat.values() for k in f})
    differ = [k for k in keys if len({f.get(k) for f in flat.values()}) > 1]
    if not differ or len(differ) > LABEL_MAX_KEYS:
        return None
    labels = {h: ", ".join(_setting_text(k, flat[h].get(k)) for k in differ) for h in hashes}
    return labels if len(set(labels.values())) == len(labels) else None


def _train_totals(run_dir: Path, config: dict) -> dict[str, Any]:
    """Train steps, episodes and wall seconds summed over the train rows of metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        if _get(config, "train.steps", run_dir / "config.yaml", default=None) == 0:
            return {"steps": 0, "episodes": 0, "wall_s": 0.0}
        raise SummaryError(f"{path}: missing (the per-step training metrics)")
    steps: set[int] = set()
    episodes, wall = 0, 0.0
    try:
        rows = list(iter_metrics(path))
    except ValueError as e:
        raise SummaryError(str(e)) from None
    for n, row in rows:
        if "eval" in row:                    # periodic evaluation rows are not training
            continue
        if "step" not in row:
            raise SummaryError(f"{path}:{n}: missing 'step'")
        steps.add(int(row["step"]))
        episodes += int(row.get("episodes", 0))
        wall += float(row.get("time_step_s", 0.0))
    return {"steps": len(steps), "episodes": episodes, "wall_s": wall}


def _alerts(run_dir: Path) -> list[dict[str, Any]]:
    """Every learning alarm of the run (its metrics.jsonl rows' ``alerts``, in step order); ``[]``
    without metrics.jsonl."""
    from crl_bench.results.alarms import run_alerts

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    try:
        return run_alerts(row for _, row in iter_metrics(path))
    except ValueError as e:
        raise SummaryError(str(e)) from None


def _evals(block: dict, file: Path, where: str) -> dict[str, Any]:
    """One evaluation mode of eval.json reduced to the summary's EVALS block."""
    if not isinstance(block, dict):
        raise SummaryError(f"{file}: {where!r} must be an object")
    out: dict[str, Any] = {}
    for key in EVAL_KEYS:
        if key not in block:
            raise SummaryError(f"{file}: missing {where + '.' if where else ''}{key}")
        out[key] = block[key]
    out.update({k: block[k] for k in TRIAL_KEYS if k in block})
    per_env = block.get("per_env")
    if not isinstance(per_env, dict):
        raise SummaryError(f"{file}: missing {where + '.' if where else ''}per_env")
    out["per_env"] = {env_id: {k: v for k, v in row.items() if k in PER_ENV_KEYS}
                      for env_id, row in per_env.items() if isinstance(row, dict)}
    return out


def _mix(spec: str, seen_envs: Iterable[str]) -> dict[str, Any]:
    """Name and normalised env weights of ``rollout.mix``; if the mixture no longer resolves (a file
    that is gone), the envs seen in eval.json with equal weights."""
    from crl_bench.config import ConfigError
    from crl_bench.mixtures import resolve_mixture

    try:
        m = resolve_mixture(spec)
        return {"name": m.name, "envs": dict(zip(m.envs, m.weights))}
    except (ConfigError, OSError, yaml.YAMLError, AttributeError):
        envs = list(dict.fromkeys(seen_envs))
        if not envs:
            raise SummaryError(f"rollout.mix {spec!r} does not resolve and eval.json names no env") from None
        name = Path(spec).stem if spec.endswith((".yaml", ".yml")) else spec
        return {"name": name, "envs": {e: 1.0 / len(envs) for e in envs}}


def _tasks_per_env(ev: dict, evals: list[dict]) -> dict[str, int]:
    tasks = ev.get("tasks")
    if isinstance(tasks, dict) and tasks:
        return {e: len(ids) for e, ids in tasks.items()}
    out: dict[str, int] = {}
    for block in evals:
        for e, row in block["per_env"].items():
            out.setdefault(e, int(row.get("episodes", 0)))
    return out


def build_summary(run_dir: str | Path, eval_file: str = "eval.json") -> dict[str, Any]:
    """Summarise a finished run folder (new or old eval.json format) into a ``kind: run`` summary.

    Reads ``config.yaml``, ``versions.json``, ``metrics.jsonl`` (train steps = distinct train step
    rows, episodes = sum of ``episodes``, wall = sum of ``time_step_s``; ``eval`` rows skipped),
    ``eval.json`` and, if present, ``data.json``. Old eval.json files (top-level ``success_rate``,
    ``per_env``, ``guided: bool``, ``split``, ``temperature``) become the ``guided`` block when
    ``guided`` is true (``free`` is then null), else the ``free`` block; their protocol comes from the
    config (episodes, top_p, top_k, max_new_tokens, ``rollout.max_steps`` for every env) and the
    task ids they list.

    Args:
        run_dir: the run folder.
        eval_file: the evaluation to summarise, relative to ``run_dir``: the final ``eval.json``, or
            a later ``crl-bench eval --run`` result on another split (``checkpoint-<split>-split.json``,
            which carries its own protocol).

    Returns:
        The summary dict (not yet validated; :func:`write_summary` validates).

    Raises:
        SummaryError: naming the file and what is missing, e.g. no ``eval.json`` (an unfinished
            run), no ``config.yaml``, a key the summary needs.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SummaryError(f"{run_dir}: not a folder")
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise SummaryError(f"{cfg_path}: missing (not a run folder)")
    try:
        config = load_yaml(cfg_path, max_aliases=CONFIG_MAX_ALIASES)
    except InputFileError as e:
        raise SummaryError(str(e)) from None
    if not isinstance(config, dict):
        raise SummaryError(f"{cfg_path}: expected a mapping")
    eval_path = run_dir / eval_file
    if not eval_path.is_file():
        raise SummaryError(f"{eval_path}: missing (the run is unfinished: no final evaluation)")
    ev = _read_json(eval_path, "final evaluation")
    if not isinstance(ev, dict):
        raise SummaryError(f"{eval_path}: expected a JSON object")
    versions = _read_json(run_dir / "versions.json", "Python, package versions, git commit")
    if not isinstance(versions, dict):
        raise SummaryError(f"{run_dir / 'versions.json'}: expected a JSON object")

    method = _get(config, "method", cfg_path, types=(str,))
    model_name = _get(config, "model.name", cfg_path, types=(str,))
    mix_spec = _get(config, "rollout.mix", cfg_path, types=(str,))
    seed = _get(config, "train.seed", cfg_path, types=(int,))
    run_id = _get(config, "run_id", cfg_path, default="") or run_dir.name

    controls: dict[str, Any] = {}
    if "free" in ev or "protocol" in ev:                      # new format
        free = _evals(ev["free"], eval_path, "free") if ev.get("free") is not None else None
        guided = _evals(ev["guided"], eval_path, "guided") if ev.get("guided") is not None else None
        controls = {m: _evals(ev[m], eval_path, m) for m in EVAL_MODES[2:] if ev.get(m) is not None}
        if free is None and guided is None:
            raise SummaryError(f"{eval_path}: missing 'free' (no evaluation block)")
        proto_in = ev.get("protocol")
        if not isinstance(proto_in, dict):
            raise SummaryError(f"{eval_path}: missing 'protocol'")
        protocol = {k: proto_in[k] for k in PROTOCOL_KEYS if k in proto_in}
        for k in ("split", "episodes", "temperature", "top_p", "max_steps"):
            if k not in protocol:
                raise SummaryError(f"{eval_path}: missing 'protocol.{k}'")
        if "tasks_per_env" not in protocol:
            protocol["tasks_per_env"] = _tasks_per_env(ev.get("free") or ev.get("guided"),
                                                       [b for b in (free, guided) if b])
    elif "success_rate" in ev:                                 # old format: one flat block
        block = _evals(ev, eval_path, "")
        is_guided = bool(ev.get("guided", False))
        free, guided = (None, block) if is_guided else (block, None)
        envs = list(block["per_env"])
        max_steps = _get(config, "rollout.max_steps", cfg_path, types=(int,))
        gen = config.get("generation") if isinstance(config.get("generation"), dict) else {}
        protocol = {
            "split": ev.get("split", _get(config, "eval.split", cfg_path, default="eval")),
            "episodes": _get(config, "eval.episodes", cfg_path, types=(int, str)),
            "temperature": ev.get("temperature", _get(config, "eval.temperature", cfg_path, default=0.0)),
            "top_p": gen.get("top_p", 1.0),
        }
        if "top_k" in gen:
            protocol["top_k"] = gen["top_k"]
        if "max_new_tokens" in gen:
            protocol["max_new_tokens"] = gen["max_new_tokens"]
        protocol["max_steps"] = {e: max_steps for e in envs}
        protocol["tasks_per_env"] = _tasks_per_env(ev, [block])
    else:
        raise SummaryError(f"{eval_path}: missing 'free' (new format) or 'success_rate' (old format)")

    initial = None
    init_in = ev.get("initial")
    if isinstance(init_in, dict) and isinstance(init_in.get("free"), dict):
        initial = _evals(init_in["free"], eval_path, "initial.free")
    seen = [e for b in (free, guided) if b for e in b["per_env"]]
    if "env_settings" not in protocol:         # runs written before the protocol recorded them
        kwargs = config.get("rollout", {}).get("env_kwargs") if isinstance(config.get("rollout"), dict) else None
        settings = {e: dict(kwargs[e]) for e in seen
                    if isinstance(kwargs, dict) and isinstance(kwargs.get(e), dict) and kwargs[e]}
        if settings:
            protocol["env_settings"] = settings
    mix = _mix(mix_spec, seen)
    if method in ("grpo", EVAL_ONLY) or method in list_methods() and not get_method(method).uses_extractor:
        extractor = None                        # no extractor model (grpo, a case bank, a model only evaluated)
    else:
        extractor = _get(config, "extractor.model", cfg_path, default=None)
        if extractor == "same":
            extractor = model_name
    vmodel = versions.get("model") if isinstance(versions.get("model"), dict) else {}
    packages = versions.get("packages") if isinstance(versions.get("packages"), dict) else {}
    data_checksums: dict[str, Any] = {}
    data_path = run_dir / "data.json"
    if data_path.is_file():
        data = _read_json(data_path, "data checksums")
        data_checksums = data.get("data_checksums", {}) if isinstance(data, dict) else {}
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "run",
        "method": method,
        "model": {"name": model_name, "variant": vmodel.get("variant"), "extractor": extractor},
        "mix": mix,
        "eval_protocol": protocol,
        "seeds": [seed],
        "runs": [{"run_id": str(run_id), "seed": seed, "train": _train_totals(run_dir, config),
                  "settings": settings_hash(config),
                  **({"alerts": alerts} if (alerts := _alerts(run_dir)) else {}),
                  "eval": {"free": free, "guided": guided, **controls,
                           **({"initial": initial} if initial else {})}}],
        "versions": {"crl_bench": str(packages.get("crl-bench", "unknown")),
                     "python": str(_get(versions, "python", run_dir / "versions.json")),
                     "git_commit": versions.get("git_commit"),
                     "packages": {str(k): str(v) for k, v in packages.items()}},
        "data_checksums": data_checksums,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def new_file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file here: ``0o666`` less the process umask
    (read from ``/proc/self/status`` where it is there, so no other thread sees a changed umask)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON to ``path`` through a temporary file in the same folder, so a
    reader never sees half a file; the file gets the mode a plain new file would have
    (:func:`new_file_mode`; the temporary file is private). Returns the path."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            os.fchmod(f.fileno(), new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_summary(run_dir: str | Path) -> Path:
    """Build (:func:`build_summary`), validate (:func:`validate_summary`) and atomically write
    ``<run_dir>/summary.json``.

    Returns:
        The path written.

    Raises:
        SummaryError: the folder cannot be summarised or the result does not validate.
    """
    run_dir = Path(run_dir)
    data = build_summary(run_dir)
    validate_summary(data, source=str(run_dir / "summary.json"))
    return write_json_atomic(run_dir / "summary.json", data)


def read_summary(path: str | Path) -> dict[str, Any]:
    """Read and validate a ``summary.json`` (a file, or a folder holding one).

    Raises:
        SummaryError: missing, not JSON, or not valid (every problem listed with its JSON path).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    data = _read_json(path, "summary")
    validate_summary(data, source=str(path))
    return data
