"""What ``crl-bench submission verify`` re-runs: a config built from a submitted one, within bounds.

A submission's ``configs/<run id>.yaml`` is text from someone else. Run as given, it could train for
10^9 steps, write TensorBoard files anywhere, join a Ray cluster, log to Weights & Biases under the
verifier's account or hand arbitrary settings to env constructors. :func:`rerun_config` therefore
builds the re-run's config itself:

* from the submitted config it takes only the fields of :data:`RERUN_FIELDS`, the ones that define
  training and the evaluation protocol (method, model, sampling, rollout, training, evaluation,
  experience and extractor settings); every other field (logging, backend, Ray, folders, checkpoint
  cadence, engines, batch and worker sizes, periodic evaluation) keeps this machine's default;
* it forces a local run into the verifier's work folder: ``backend: local``, ``logging.backends:
  [jsonl]`` with ``wandb_mode: disabled`` and no TensorBoard folder, no checkpoints,
  ``output_dir`` = the work folder, ``run_id`` = ``verify-<run id>`` (the run id must be a name,
  :func:`crl_bench.config.check_name`);
* it refuses sizes beyond what the submission records for that run: more training steps, or more
  training episodes (steps x groups x group size), than its ``train``; evaluation episodes,
  samples, trials or an action limit other than its ``eval_protocol``;
* each env's settings (``rollout.env_kwargs``) must equal the protocol's ``env_settings`` and pass
  :func:`check_env_settings`: named parameters of the env's constructor with plain values;
  settings that name this machine's files or services (:data:`LOCAL_SETTING`, e.g. ``data_dir``) are
  left out, the re-run uses this machine's own (the task panels check the task content).

:func:`plan` gives the re-run's cost, printed before anything starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crl_bench.config import ConfigError, RunConfig, build_config, check_name
from crl_bench.results.summary import SummaryError, settings_hash

#: Fields of a submitted config a re-run takes: section -> its fields; ``"*"`` takes every field of
#: the section but those of :data:`RERUN_EXCLUDED` (experience and extractor settings are all method
#: settings, under names that change with the memory kinds); ``True`` takes a top-level value.
RERUN_FIELDS: dict[str, Any] = {
    "method": True,
    "model": ("name", "dtype", "lora", "lora_r", "lora_alpha", "lora_dropout", "gradient_checkpointing"),
    "generation": ("temperature", "top_p", "top_k", "max_new_tokens", "prefill", "constrained"),
    "rollout": ("mix", "max_steps", "history", "prompt", "env_kwargs", "max_context_tokens"),
    "train": ("steps", "groups_per_step", "group_size", "lr", "weight_decay", "lr_warmup_steps", "max_grad_norm",
              "clip_eps", "kl_coef", "adv_std_normalize", "ppo_epochs", "mini_batches", "loss_agg",
              "recompute_old_logprobs", "logprob_temperature", "share_prefix", "sequences", "seed"),
    "eval": ("episodes", "at_start", "temperature", "split", "writes_counters", "controls", "lesson_follow",
             "trials", "samples"),
    "experience": "*",
    "extractor": "*",
}
#: Fields of the ``"*"`` sections that are this machine's business (threads, caches, engines).
RERUN_EXCLUDED = {"experience": ("search_workers", "query_batch", "query_cache"), "extractor": ("engine",)}
#: What every re-run is given, whatever the submitted config says.
RERUN_FORCED: dict[str, Any] = {
    "backend": "local",
    "logging": {"backends": ["jsonl"], "wandb_mode": "disabled", "tensorboard_dir": "", "transcripts": False},
    "train": {"save_checkpoint": False},
    "eval": {"every": 0},
}
#: Env settings that name this machine's files, folders or services: never taken from a submission.
LOCAL_SETTING = re.compile(r"(_dir|_path|_file|_index|_list)$|^(workdir|network|grade_network|engine|pull)$")
#: Longest text value and longest list accepted in one env setting.
SETTING_MAX_CHARS = 1000
SETTING_MAX_ITEMS = 1000
_PLAIN = (str, int, float, bool, type(None))


@dataclass
class EnvSettingsCheck:
    """What :func:`check_env_settings` made of one env's settings.

    Attributes:
        kept: the settings a run here may use.
        dropped: names of settings left out (this machine's files or services, :data:`LOCAL_SETTING`).
        problems: one line per setting refused.
        unavailable: why the env's settings cannot be checked here (an unknown env, a missing
            engine), else None; nothing is kept then.
    """

    kept: dict[str, Any] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unavailable: str | None = None


def _plain(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= SETTING_MAX_CHARS
    if isinstance(value, list):
        return len(value) <= SETTING_MAX_ITEMS and all(_plain(v) and not isinstance(v, list) for v in value)
    return isinstance(value, _PLAIN)


def check_env_settings(env_id: str, settings: Any, where: str) -> EnvSettingsCheck:
    """Check the constructor settings of ``env_id`` read from someone else's file.

    A setting is kept when its name is a parameter of the env's constructor
    (:func:`crl_bench.env_api.env_settings_accepted`) and its value is plain: text of at most
    :data:`SETTING_MAX_CHARS` characters, a number, a boolean, null, or a list of at most
    :data:`SETTING_MAX_ITEMS` of those. A name matching :data:`LOCAL_SETTING` (``data_dir``,
    ``workdir``, ``network``, ...) is dropped: it points at the writer's machine, and this machine's
    own applies. An env that cannot be loaded here sets ``unavailable`` (its settings cannot be checked).

    Args:
        env_id: the env.
        settings: its settings as read (should be a mapping).
        where: the JSON path or key the settings came from, for messages.

    Returns:
        :class:`EnvSettingsCheck`; nothing is raised.
    """
    from crl_bench.env_api import EnvUnavailableError, env_settings_accepted

    out = EnvSettingsCheck()
    if not isinstance(settings, dict):
        out.problems.append(f"{where}: must be a mapping of setting -> value, got {type(settings).__name__}")
        return out
    try:
        accepted = env_settings_accepted(env_id)
    except (KeyError, EnvUnavailableError) as e:
        out.unavailable = f"{where}: the settings of {env_id!r} cannot be checked here ({e})"
        return out
    for name, value in settings.items():
        if not isinstance(name, str) or accepted is None or name not in accepted:
            known = ", ".join(sorted(accepted)) if accepted else "none that can be checked"
            out.problems.append(f"{where}.{name}: not a setting of {env_id} (it accepts: {known})")
        elif LOCAL_SETTING.search(name):
            out.dropped.append(name)
        elif not _plain(value):
            out.problems.append(f"{where}.{name}: not a plain value (text of at most {SETTING_MAX_CHARS} "
                                f"characters, a number, a boolean, null or a list of at most {SETTING_MAX_ITEMS} "
                                "of those)")
        else:
            out.kept[name] = value
    return out


def comparable_settings(settings: Any) -> Any:
    """``eval_protocol.env_settings`` without the settings :func:`check_env_settings` drops, for
    comparing a re-run's protocol with the submitted one."""
    if not isinstance(settings, dict):
        return settings
    return {e: {k: v for k, v in s.items() if not (isinstance(k, str) and LOCAL_SETTING.search(k))}
            if isinstance(s, dict) else s for e, s in settings.items()}


def _allowed(submitted: dict[str, Any]) -> dict[str, Any]:
    """The fields of :data:`RERUN_FIELDS` present in ``submitted``."""
    layer: dict[str, Any] = {}
    for key, fields in RERUN_FIELDS.items():
        if key not in submitted:
            continue
        value = submitted[key]
        if fields is True or not isinstance(value, dict):
            layer[key] = value                  # a non-mapping section: build_config says what is wrong
        elif fields == "*":
            layer[key] = {k: v for k, v in value.items() if k not in RERUN_EXCLUDED.get(key, ())}
        else:
            layer[key] = {k: v for k, v in value.items() if k in fields}
    return layer


def rerun_config(submitted: Any, summary: dict[str, Any], run: dict[str, Any], work: str | Path,
                 source: str) -> tuple[RunConfig, list[str]]:
    """The config a verification re-runs for ``run`` of ``summary``, within bounds (module docstring).

    Args:
        submitted: the submitted config (``configs/<run id>.yaml`` as parsed).
        summary: the submission's validated ``summary.json``.
        run: the entry of ``summary["runs"]`` re-run.
        work: the folder the re-run is written into (``<work>/verify-<run id>``).
        source: the config file, for messages.

    Returns:
        ``(config, notes)``: notes name what was left out of the submitted env settings.

    Raises:
        SummaryError: every reason the run is not re-run, one per line: a run id that is not a name,
            a config that is not a mapping or not a valid config, its training settings not those the
            summary records (``settings``), sizes beyond the submission's, env settings refused.
    """
    try:
        check_name(run["run_id"], "run_id")
    except ConfigError as e:
        raise SummaryError(f"{source}: {e}") from None
    if not isinstance(submitted, dict):
        raise SummaryError(f"{source}: not a mapping of config sections")
    problems, notes = [], []
    recorded = run.get("settings")
    try:
        mine = settings_hash(submitted)
    except (TypeError, ValueError):
        mine = None
    if isinstance(recorded, str) and mine != recorded:
        problems.append(f"{source}: not the config of run {run['run_id']} (its training settings hash to "
                        f"{str(mine)[:12]}, the summary records {recorded[:12]})")
    proto = summary["eval_protocol"]
    layer = _allowed(submitted)
    rollout = layer.get("rollout") if isinstance(layer.get("rollout"), dict) else {}
    kwargs = rollout.get("env_kwargs") or {}
    if not isinstance(kwargs, dict):
        problems.append(f"{source}: rollout.env_kwargs: must be a mapping of env id -> settings")
        kwargs = {}
    want = comparable_settings(proto.get("env_settings") or {})
    kept: dict[str, Any] = {}
    for env_id, settings in kwargs.items():
        if env_id not in summary["mix"]["envs"]:
            problems.append(f"{source}: rollout.env_kwargs.{env_id}: not an env of the submission's mix")
            continue
        checked = check_env_settings(env_id, settings, f"{source}: rollout.env_kwargs.{env_id}")
        problems += checked.problems + ([checked.unavailable] if checked.unavailable else [])
        if checked.dropped:
            notes.append(f"{run['run_id']}: rollout.env_kwargs.{env_id}: {', '.join(checked.dropped)} left out "
                         "(this machine's files and services are its own)")
        if checked.kept:
            kept[env_id] = checked.kept
    if {e: s for e, s in want.items() if s} != kept and not problems:
        problems.append(f"{source}: rollout.env_kwargs differ from the summary's eval_protocol.env_settings")
    if rollout:
        rollout["env_kwargs"] = kept
    rid = f"verify-{run['run_id']}"
    forced = {**RERUN_FORCED, "output_dir": str(work), "run_id": rid}
    try:
        layer_cfg = build_config([layer, forced])
    except ConfigError as e:
        problems.append(f"{source}: {e}")
        raise SummaryError("\n".join(problems)) from None
    problems += _size_problems(layer_cfg, summary, run, source)
    if problems:
        raise SummaryError("\n".join(problems))
    return layer_cfg, notes


def _size_problems(cfg: RunConfig, summary: dict[str, Any], run: dict[str, Any], source: str) -> list[str]:
    """Sizes of ``cfg`` beyond what ``summary`` records for ``run`` (module docstring)."""
    proto, train = summary["eval_protocol"], run["train"]
    out = []
    if cfg.train.steps > train["steps"]:
        out.append(f"{source}: train.steps {cfg.train.steps} is more than the {train['steps']} steps the "
                   f"submission records for run {run['run_id']}")
    episodes = cfg.train.steps * cfg.train.groups_per_step * cfg.train.group_size
    if episodes > train["episodes"]:
        out.append(f"{source}: {cfg.train.steps} steps x {cfg.train.groups_per_step} groups x "
                   f"{cfg.train.group_size} episodes = {episodes} training episodes, more than the "
                   f"{train['episodes']} the submission records for run {run['run_id']}")
    for key, mine, theirs in (("eval.episodes", cfg.eval.episodes, proto["episodes"]),
                              ("eval.samples", cfg.eval.samples, proto.get("samples", 1)),
                              ("eval.trials", cfg.eval.trials, proto.get("trials", 1))):
        if mine != theirs:
            out.append(f"{source}: {key} {mine!r} is not the protocol's {theirs!r} (eval_protocol)")
    if cfg.rollout.mix.strip().endswith((".yaml", ".yml")):
        out.append(f"{source}: rollout.mix {cfg.rollout.mix!r} names a mixture file, which a re-run does not read "
                   "from the submitter's paths (write the mix as env:weight,... or a shipped mixture's name)")
    longest = max(proto["max_steps"].values(), default=0)
    if cfg.rollout.max_steps > longest:
        out.append(f"{source}: rollout.max_steps {cfg.rollout.max_steps} is more than the protocol's "
                   f"{longest} actions per episode")
    return out


def plan(cfg: RunConfig, summary: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The cost of re-running ``run`` with ``cfg``: training and evaluation episodes, the most actions
    each, and the submitted run's own training time (the only estimate there is: it was measured on
    the submitter's machine).

    Returns:
        ``{"run_id", "steps", "groups", "group_size", "train_episodes", "eval_tasks", "eval_samples",
        "eval_modes", "eval_episodes", "max_actions", "submitted_train_s"}``; ``eval_modes`` counts
        the evaluation blocks the submitted run reports (free, guided, controls, initial).
    """
    proto = summary["eval_protocol"]
    tasks = sum(int(n) for n in proto["tasks_per_env"].values())
    repeats = int(proto.get("samples", 1)) * int(proto.get("trials", 1))
    modes = sum(1 for v in run["eval"].values() if isinstance(v, dict))
    return {"run_id": run["run_id"], "steps": cfg.train.steps, "groups": cfg.train.groups_per_step,
            "group_size": cfg.train.group_size,
            "train_episodes": cfg.train.steps * cfg.train.groups_per_step * cfg.train.group_size,
            "eval_tasks": tasks, "eval_samples": repeats, "eval_modes": modes,
            "eval_episodes": tasks * repeats * modes, "max_actions": cfg.rollout.max_steps,
            "submitted_train_s": float(run["train"]["wall_s"])}


def plan_line(p: dict[str, Any]) -> str:
    """One line for :func:`plan`'s result."""
    hours = p["submitted_train_s"] / 3600
    took = f"{hours:.1f} h" if hours >= 1 else f"{p['submitted_train_s']:.0f} s"
    return (f"plan {p['run_id']}: training {p['steps']} steps x {p['groups']} groups x {p['group_size']} episodes "
            f"= {p['train_episodes']} episodes, evaluation {p['eval_tasks']} tasks x {p['eval_samples']} "
            f"x {p['eval_modes']} modes = {p['eval_episodes']} episodes, at most {p['max_actions']} actions "
            f"each; the submitted run trained in {took} on its own machine (no estimate for this one)")
