"""Reading a run configuration: YAML files and presets within bounds, ``--set`` overrides, old key names,
names that become folders, and setting a section tree's fields from a mapping with their types checked.

:mod:`crl_bench.config` re-exports every public name here; import them from there.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from crl_bench.config_schema import ConfigError, check_value, section_hints
from crl_bench.safe_io import InputFileError, parse_yaml

__all__ = ["CONFIG_MAX_ALIASES", "CONFIG_MAX_BYTES", "NAME_PATTERN", "RENAMED_KEYS", "check_name", "list_presets",
           "load_yaml", "merge_into", "parse_override", "preset_data"]


RENAMED_KEYS: dict[str, str] = {
    "experience.cases": "experience.cases.outcomes",
    "experience.case_tokens": "experience.cases.tokens",
    "experience.insight_pairs": "experience.insights.pairs",
    "experience.insight_successes": "experience.insights.successes",
    "experience.insight_ops": "experience.insights.ops",
    "experience.insights_max": "experience.insights.max",
    "experience.insight_new_tokens": "experience.insights.new_tokens",
    "experience.reflections_shown": "experience.reflections.shown",
    "experience.reflection_tokens": "experience.reflections.tokens",
    "experience.merge_every": "experience.merge.every",
    "experience.merge": "experience.merge.mode",
    "experience.merge_max": "experience.merge.max",
    "experience.merge_threshold": "experience.merge.threshold",
    "experience.utility_alpha": "experience.utility.alpha",
    "experience.utility_ucb": "experience.utility.ucb",
    "experience.utility_min_sim": "experience.utility.min_sim",
    "experience.utility_beta": "experience.utility.beta",
}
"""The flat names of the keys of ``experience``'s sections (each owned by a memory kind's module, or,
for ``utility``, by retrieval): old key -> new key. Configs that use the flat names (the committed run
folders' config.yaml, ``--set experience.case_tokens=...``) are read through this table with a
``DeprecationWarning`` naming both. ``experience.cases`` and ``experience.merge`` are a value in the
old layout and a section in the new: a mapping there is the section."""


def _renamed(data: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``data`` (the mapping at ``prefix``) with the old keys of :data:`RENAMED_KEYS` moved to their
    sections (a new dict; ``data`` is left as it is); warns once per call naming each rename.

    Raises:
        ConfigError: a key is given both by its old and its new name.
    """
    if not any(f"{prefix}{key}" in RENAMED_KEYS for key in data):
        return data
    out: dict[str, Any] = {}
    moved = []
    for key, value in data.items():
        new = RENAMED_KEYS.get(f"{prefix}{key}")
        if new is None or isinstance(value, dict):
            if isinstance(value, dict) and isinstance(out.get(key), dict):      # old keys came first
                both = sorted(set(out[key]) & set(value))
                if both:
                    raise ConfigError(f"{prefix}{key}.{both[0]} is given by its old and its new name")
                out[key] = {**out[key], **value}
            else:
                out[key] = dict(value) if isinstance(value, dict) else value
            continue
        section, _, leaf = new[len(prefix):].partition(".")
        target = out.setdefault(section, {})
        if leaf in target:
            raise ConfigError(f"{new} is given by its old and its new name ({prefix}{key})")
        target[leaf] = value
        moved.append(f"{prefix}{key} -> {new}")
    if moved:
        warnings.warn(f"renamed config keys (read under their new names): {', '.join(moved)}",
                      DeprecationWarning, stacklevel=3)
    return out


def merge_into(obj: Any, data: dict[str, Any], prefix: str = "") -> None:
    """Recursively set fields of dataclass ``obj`` from ``data`` (old keys read through
    :data:`RENAMED_KEYS`).

    Raises:
        ConfigError: a key is not a field (message lists the valid keys) or has the wrong type.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    data = _renamed(data, prefix)
    hints = section_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {dotted!r}; valid keys here: {', '.join(sorted(names))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            merge_into(current, value, prefix=f"{dotted}.")
        elif isinstance(current, dict) and isinstance(value, dict):
            setattr(obj, key, _deep_merge(current, value))
        else:
            setattr(obj, key, check_value(value, hints[key], dotted))


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``update`` laid over it, mappings merged key by key at every depth (so two
    ``--set rollout.env_kwargs.ENV.a=...`` and ``...ENV.b=...`` keep both); a new dict."""
    out = dict(base)
    for k, v in update.items():
        out[k] = _deep_merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``"train.lr=1e-5"`` -> ``{"train": {"lr": 1e-05}}``; the value is parsed as YAML.

    Raises:
        ConfigError: no ``=`` in ``text``, or a value that is not valid YAML (the key is named).
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, _, raw = text.partition("=")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--set {key.strip()}: value {raw!r} is not valid YAML ({problem}); quote it "
                          "to pass a string") from None
    out: dict[str, Any] = {}
    cur = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return out


def list_presets() -> list[str]:
    """Names of the presets shipped in ``crl_bench/presets``."""
    return sorted(p.name[:-5] for p in resources.files("crl_bench").joinpath("presets").iterdir()
                  if p.name.endswith(".yaml"))


#: Largest config or mixture file :func:`load_yaml` reads (bytes).
CONFIG_MAX_BYTES = 4 * 1024 * 1024
#: Most alias references (``*name``) in one config file: anchors and aliases are fine in a config,
#: their expansion is bounded by ``crl_bench.safe_io.MAX_YAML_NODES`` values.
CONFIG_MAX_ALIASES = 1000

#: The one rule for a name given on the command line or in a config that becomes a folder name
#: (``--run-id``/``run_id``, ``sweep --name``, ``submission pack --name``): a letter or digit, then
#: letters, digits, ``.``, ``_``, ``-``; at most 128 characters; no ``..``.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(value: Any, what: str) -> str:
    """Return ``value`` if it is a valid name (:data:`NAME_PATTERN`, no ``..``), so that it names a
    folder inside the folder it is joined to and never one outside it (no ``/``, no ``..``, not absolute).

    Args:
        value: the name.
        what: the flag or key it came from, for the message (``"--run-id"``, ``"run_id"``).

    Raises:
        ConfigError: naming ``what`` and the rule.
    """
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value) or ".." in value:
        raise ConfigError(f"{what} {value!r}: a name must start with a letter or digit and hold only letters, "
                          "digits, '.', '_' and '-' (at most 128 characters, no '..'): it names a folder")
    return value


def load_yaml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """Read a YAML mapping from ``path`` (``what`` names the file in errors, e.g. ``"mixture file"``).

    Parsed with :func:`crl_bench.safe_io.parse_yaml`: at most :data:`CONFIG_MAX_BYTES`, nested at most
    ``safe_io.MAX_DEPTH`` levels, at most :data:`CONFIG_MAX_ALIASES` aliases and
    ``safe_io.MAX_YAML_NODES`` values once they are expanded.

    Raises:
        ConfigError: the file is missing or unreadable, larger than the limit, not UTF-8 text (a
            binary file), not valid YAML or over a limit of the parser, or not a mapping at top level
            (a list, a scalar).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist")
    try:
        if p.stat().st_size > CONFIG_MAX_BYTES:
            raise ConfigError(f"{what} {str(p)!r} is {p.stat().st_size} bytes, more than the {CONFIG_MAX_BYTES} "
                              "accepted")
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {str(p)!r} is not a text (UTF-8) YAML file") from None
    except OSError as e:
        raise ConfigError(f"{what} {str(p)!r} cannot be read: {e.strerror or e}") from None
    try:
        data = parse_yaml(text, p, max_aliases=CONFIG_MAX_ALIASES)
    except InputFileError as e:
        raise ConfigError(f"{what} {str(p)!r}: {e.problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {str(p)!r} must hold a mapping at top level, not a {type(data).__name__}")
    return data


def preset_data(name: str) -> dict[str, Any]:
    """The mapping of preset ``name``. Raises :class:`ConfigError` for an unknown preset."""
    if name not in list_presets():
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(list_presets())}")
    text = resources.files("crl_bench").joinpath("presets", f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}
