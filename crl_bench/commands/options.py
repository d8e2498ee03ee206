"""What several commands share: the option groups of a run's config (``--method``, ``--mix``,
``--preset``, ``--config``, ``--model``, ``--seed``, ``--set``, ...) and of the backend, the argparse
type of ``--episodes``, and :func:`resolve_config`, which layers them into one validated
:class:`~crl_bench.config.RunConfig`."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from crl_bench.config import Backend, ConfigError, RunConfig, build_config, load_yaml, parse_override, preset_data
from crl_bench.methods import get_method, list_methods
from crl_bench.profiles import list_profiles, profile_layer

__all__ = ["add_backend_args", "add_config_args", "episodes", "resolve_config"]


def add_config_args(p: argparse.ArgumentParser, with_method: bool = True) -> None:
    """Add the options that make a run's config to ``p``: ``--method`` (unless ``with_method`` is
    false), ``--mix``, ``--preset``, ``--profile``, ``--draws``, ``--config``, ``--model``,
    ``--extractor-model``, ``--seed`` and ``--set`` (read back by :func:`resolve_config`)."""
    if with_method:
        p.add_argument("--method", default="grpo",
                       help=f"training method, one of: {', '.join(list_methods())} (default grpo; docs/method.md)")
    p.add_argument("--mix", help="env id, mixture name (3task, 6task), mixture YAML or id:w,id:w")
    p.add_argument("--preset", default="default", help="preset: default, smoke, cpu, diag, paper")
    p.add_argument("--profile", help=f"evaluation protocol profile: {', '.join(list_profiles())} (sets eval keys "
                                     "only; docs/evaluation.md \"Protocol profiles\")")
    p.add_argument("--draws", type=int, metavar="N",
                   help="also score eval.draw_count sampled-worker draws of N episodes each (verl-agent's estimator; "
                        "sets eval.draw_size=N and eval.samples=8 unless --set says otherwise)")
    p.add_argument("--config", help="YAML file with the same sections as a run's config.yaml")
    p.add_argument("--model", help="actor model: smollm2-135m-instruct (default) or a HF path/name")
    p.add_argument("--extractor-model", help="experience extractor model (default: same as the actor, "
                                             "separate weights)")
    p.add_argument("--seed", type=int, help="seed of the run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any setting, e.g. --set train.lr=1e-5 (repeatable)")


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """Add ``--backend`` and ``--ray-address`` to ``p`` (read back by :func:`resolve_config`)."""
    p.add_argument("--backend", choices=get_args(Backend),
                   help="local (default: one process) or ray (envs, engines and the experience manager in Ray "
                        "actors; crl_bench/ray_backend.py)")
    p.add_argument("--ray-address", help="with --backend ray: the cluster to join (default RAY_ADDRESS, else a "
                                         "local Ray)")


def episodes(text: str) -> int | str:
    """``--episodes``: a non-negative integer or ``all``."""
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'all', got {text!r}") from None


def resolve_config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> RunConfig:
    """Layer preset < --config < method < profile < flags < --set into a validated RunConfig.

    ``args`` holds the options of :func:`add_config_args` (and, where the command has them, of
    :func:`add_backend_args`); ``extra`` maps ``section.key`` to a value set with the flags (a
    command's own options, e.g. ``{"train.steps": 3}``).

    Raises:
        ConfigError: an unknown method, preset or profile, an unreadable ``--config``, a bad ``--set``
            or a setting the config refuses.
    """
    layers: list[dict[str, Any]] = [preset_data(args.preset)]
    if args.config:
        layers.append(load_yaml(args.config))
    method = getattr(args, "method", None)
    if method:
        try:
            spec = get_method(method)
        except KeyError as e:
            raise ConfigError(str(e.args[0])) from None
        layers.append({"method": spec.name})
    if getattr(args, "profile", None):
        layers.append(profile_layer(args.profile))
    flags: dict[str, Any] = {}
    if getattr(args, "draws", None) is not None:
        if args.draws < 1:
            raise ConfigError(f"--draws {args.draws}: the episodes of one draw must be at least 1")
        flags["eval"] = {"draw_size": args.draws, "samples": 8}
    if args.mix:
        flags.setdefault("rollout", {})["mix"] = args.mix
    if args.model:
        flags.setdefault("model", {})["name"] = args.model
    if args.seed is not None:
        flags.setdefault("train", {})["seed"] = args.seed
    if getattr(args, "extractor_model", None):
        flags.setdefault("extractor", {})["model"] = args.extractor_model
    if getattr(args, "backend", None):
        flags["backend"] = args.backend
    if getattr(args, "ray_address", None):
        flags.setdefault("ray", {})["address"] = args.ray_address
    for k, v in (extra or {}).items():
        section, _, key = k.partition(".")
        flags.setdefault(section, {})[key] = v
    layers.append(flags)
    layers += [parse_override(s) for s in args.set]
    return build_config(layers)
