"""``crl-bench swe filter|base-image``: SWE-bench tools: keep the instances whose pass rate over k
samples of the base model lies in (low, high] (crl_bench/envs/swebench/filter.py), and build the small
local base image the tests use."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from crl_bench.commands.options import add_config_args, resolve_config
from crl_bench.config import ConfigError

__all__ = ["HELP", "add_parser", "run"]

HELP = "SWE-bench tools: task filter, local base image"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``swe`` and its ``filter`` and ``base-image`` subcommands to the ``crl-bench`` subcommands;
    returns the ``swe`` parser."""
    w = subparsers.add_parser("swe", help=HELP)
    ws = w.add_subparsers(dest="swe_cmd", required=True)
    fl = ws.add_parser("filter", help="run the base model k times per instance; keep pass rates in (low, high]")
    add_config_args(fl, with_method=False)
    fl.add_argument("--env", default="swebench-verified", help="the SWE-bench env id")
    fl.add_argument("--k", type=int, default=16, help="samples per instance")
    fl.add_argument("--low", type=float, default=0.0, help="keep pass rates above this")
    fl.add_argument("--high", type=float, default=0.8, help="keep pass rates up to this")
    fl.add_argument("--instances", help="instance file (.parquet/.jsonl/.json; default SWE-bench Verified)")
    fl.add_argument("--tasks", help="only these instance ids (a task-list file)")
    fl.add_argument("--max-steps", type=int, help="tool calls per episode")
    fl.add_argument("--per-call", type=int, default=16, help="episodes rolled out at once")
    fl.add_argument("--retries", type=int, default=3,
                    help="rounds replaying episodes lost to infrastructure errors (default 3)")
    fl.add_argument("--out", help="result file (default results/swe_filter/<model>-k<k>.json); "
                                  "samples are kept beside it and a rerun resumes")
    fl.add_argument("--quiet", action="store_true", help="no progress bar")
    bi = ws.add_parser("base-image", help="build the small Debian image (debootstrap) the tests use")
    bi.add_argument("--tag", default="crl-bench/swe-base:bookworm")
    bi.add_argument("--rebuild", action="store_true")
    return w


def run(args: argparse.Namespace) -> int:
    """Build the base image (``swe base-image``) or run the filter (``swe filter``) and print what it
    kept; returns 0.

    Raises:
        ConfigError: ``--env`` is not a SWE-bench env, a bad setting, or a result file the filter
            cannot resume from.
    """
    if args.swe_cmd == "base-image":
        from crl_bench.envs.swebench.images import build_base_image

        print(f"base image ready: {build_base_image(tag=args.tag, rebuild=args.rebuild)}")
        return 0
    from crl_bench.envs.swebench.filter import FilterStateError, run_filter
    from crl_bench.trainer.loop import Trainer

    if not args.env.startswith("swebench"):
        raise ConfigError(f"swe filter: --env must be a SWE-bench env, got {args.env!r}")
    args.mix, args.method = args.env, "grpo"
    extra: dict[str, Any] = {}
    if args.max_steps is not None:
        extra["rollout.max_steps"] = args.max_steps
    cfg = resolve_config(args, extra)
    kw = cfg.rollout.env_kwargs.setdefault(args.env, {})
    if args.instances:
        kw["instances"] = args.instances
    if args.tasks:
        kw["task_list"] = args.tasks
    safe = cfg.model.name.strip("/").replace("/", "__")
    out = Path(args.out) if args.out else Path("results") / "swe_filter" / f"{safe}-k{args.k}.json"
    trainer = Trainer(cfg, writer=None)
    try:
        env = trainer.pool.acquire(args.env)
        trainer.pool.release(args.env, env)
        res = run_filter(lambda specs: trainer.runner.collect(specs, trainer.sampling), env, args.env, args.k,
                         args.low, args.high, out, cfg.model.name, per_call=args.per_call, retries=args.retries,
                         progress=not args.quiet)
    except FilterStateError as e:
        raise ConfigError(str(e)) from None
    finally:
        trainer.close()
    print(f"kept {len(res['kept'])} of {res['instances']} instances with pass rate in ({args.low}, {args.high}] "
          f"over k={args.k}" + (f"; {len(res['incomplete'])} incomplete (rerun to finish)" if res["incomplete"]
                                else "") + f"; wrote {out}")
    return 0
