"""Protocol profiles: named sets of evaluation keys that make crl-bench's evaluation match a protocol that
published rows were measured under (``--profile NAME``; docs/evaluation.md, "Protocol profiles").

A profile is data, ``crl_bench/profiles/<name>.yaml``::

    envs: [alfworld, webshop]          # the env ids the protocol is defined for
    reported: [gigpo-table1]           # results/reported/<file>.yaml rows it can stand beside
    eval: {temperature: 0.4, ...}      # keys of the eval section, nothing else

It sets the evaluation only: a profile file with any other section is refused, so a run's training is the
same with or without it. The profile's name is recorded as ``eval.profile`` and in every evaluation's
protocol. :func:`check_eval_protocol` checks the per-env eval keys a profile (or ``--set``) gives.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

from crl_bench.config_schema import ConfigError

__all__ = ["PROFILE_KEYS", "check_eval_protocol", "check_profile_keys", "check_profile_mix", "list_profiles",
           "profile_data", "profile_layer"]

#: the top-level keys of a profile file
PROFILE_KEYS = ("envs", "reported", "eval")


def list_profiles() -> list[str]:
    """Names of the profiles shipped in ``crl_bench/profiles``."""
    return sorted(p.name[:-5] for p in resources.files("crl_bench").joinpath("profiles").iterdir()
                  if p.name.endswith(".yaml"))


def profile_data(name: str) -> dict[str, Any]:
    """The checked content of profile ``name``: ``{"envs": [...], "reported": [...], "eval": {...}}``.

    Raises:
        ConfigError: an unknown profile, or a file with a key other than :data:`PROFILE_KEYS`, no env
            list, or an ``eval`` section that is not a mapping or names ``profile`` itself.
    """
    if name not in list_profiles():
        raise ConfigError(f"unknown profile {name!r}; known: {', '.join(list_profiles())}")
    data = yaml.safe_load(resources.files("crl_bench").joinpath("profiles", f"{name}.yaml").read_text()) or {}
    extra = sorted(set(data) - set(PROFILE_KEYS))
    if extra:
        raise ConfigError(f"profile {name!r}: key(s) {', '.join(extra)} not allowed; a profile sets the eval "
                          f"section only ({', '.join(PROFILE_KEYS)})")
    envs = data.get("envs")
    if not isinstance(envs, list) or not envs or not all(isinstance(e, str) for e in envs):
        raise ConfigError(f"profile {name!r}: 'envs' must be a non-empty list of env ids")
    ev = data.get("eval")
    if not isinstance(ev, dict) or "profile" in ev:
        raise ConfigError(f"profile {name!r}: 'eval' must be a mapping of eval keys (without 'profile')")
    return {"envs": list(envs), "reported": list(data.get("reported") or []), "eval": dict(ev)}


def profile_layer(name: str) -> dict[str, Any]:
    """The config layer of profile ``name``: ``{"eval": {...its eval keys, "profile": name}}``.

    Raises:
        ConfigError: as :func:`profile_data`.
    """
    return {"eval": {**profile_data(name)["eval"], "profile": name}}


def check_profile_mix(profile: str, env_ids: list[str] | tuple[str, ...]) -> None:
    """Refuse evaluating envs a profile does not define its protocol for.

    Args:
        profile: ``eval.profile`` (``""``: no profile, nothing to check).
        env_ids: the envs of the run's mixture.

    Raises:
        ConfigError: an env of ``env_ids`` is not in the profile's ``envs``.
    """
    if not profile:
        return
    known = profile_data(profile)["envs"]
    outside = [e for e in env_ids if e not in known]
    if outside:
        raise ConfigError(f"eval.profile={profile}: the protocol is defined for {', '.join(known)}, not for "
                          f"{', '.join(outside)} of rollout.mix")


def check_profile_keys(ec: Any) -> None:
    """Refuse an ``eval.profile`` whose keys were changed after it was applied: a protocol that names a
    profile holds every value the profile sets (per env for the mappings). Two keys may differ:
    ``draw_count``, and ``samples`` when draws are on (``--draws``: a task's samples are what the
    draws pick from; the each-task-once success rate over them estimates the same rate).

    Raises:
        ConfigError: naming the key, its value and the profile's.
    """
    for key, want in profile_data(ec.profile)["eval"].items():
        if key == "draw_count" or (key == "samples" and ec.draw_size > 0):
            continue
        have = getattr(ec, key)
        pairs = [(f"{key}.{k}", have.get(k) if isinstance(have, dict) else None, v) for k, v in want.items()] \
            if isinstance(want, dict) else [(key, have, want)]
        for name, mine, theirs in pairs:
            if mine != theirs:
                raise ConfigError(f"eval.{name}={mine!r} is not profile {ec.profile}'s {theirs!r}: a profile's "
                                  "protocol is every key it sets (without --profile, set the eval keys you want)")


def check_eval_protocol(ec: Any, max_episode_steps: int) -> None:
    """Check the eval keys whose values are per-env mappings, and the ones tied to them.

    ``ec`` is an :class:`~crl_bench.config.EvalConfig`: ``splits`` maps env ids to split names,
    ``max_steps`` to action limits (1 .. ``max_episode_steps``), ``draw_replace`` to booleans; a
    ``profile`` is a shipped one; ``draw_size`` above 0 needs ``samples`` above 1 (the draws pick among
    each task's samples).

    Raises:
        ConfigError: naming the key (``eval.max_steps.alfworld``) and what was expected.
    """
    def mapping(key: str, ok: Any, want: str) -> None:
        value = getattr(ec, key)
        if not isinstance(value, dict):
            raise ConfigError(f"eval.{key}: expected a mapping of env id -> {want}, got {value!r}")
        for env_id, v in value.items():
            if not isinstance(env_id, str) or not ok(v):
                raise ConfigError(f"invalid value for eval.{key}.{env_id}: {v!r} (must be {want})")

    mapping("splits", lambda v: isinstance(v, str) and bool(v), "a split name")
    mapping("max_steps", lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= max_episode_steps,
            f"an integer in 1..{max_episode_steps}")
    mapping("draw_replace", lambda v: isinstance(v, bool), "true or false")
    if ec.profile:
        if ec.profile not in list_profiles():
            raise ConfigError(f"invalid value for eval.profile: {ec.profile!r}; known: {', '.join(list_profiles())}")
        check_profile_keys(ec)
    if ec.draw_size > 0 and not (isinstance(ec.samples, int) and ec.samples > 1):
        raise ConfigError(f"eval.draw_size={ec.draw_size} needs eval.samples above 1: each draw picks among the "
                          "sampled episodes of every eval task (e.g. --set eval.samples=8)")
