"""``crl-bench eval``: success rate and mean steps on a split, of a model or of a finished run's
checkpoint guided by its own bank (read-only), with the memory controls; an interrupted greedy
evaluation resumes from its finished modes (``<out>.partial``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from crl_bench.commands.options import add_config_args, episodes, resolve_config
from crl_bench.config import ConfigError

__all__ = ["HELP", "add_parser", "run"]

HELP = "success rate and mean steps on a split"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``eval`` with its options to the ``crl-bench`` subcommands; returns its parser."""
    e = subparsers.add_parser("eval", help=HELP)
    add_config_args(e, with_method=False)
    e.add_argument("--run", help="a run folder: evaluate its checkpoint with its config (and, for complementary/"
                                 "static, guided by its own bank, read-only, and free)")
    e.add_argument("--split", default="eval")
    e.add_argument("--episodes", type=episodes, help="episodes per env (a number, or 'all')")
    e.add_argument("--modes", type=_eval_modes, help="comma-separated eval modes: free, guided, shuffled, "
                                                     "empty, and the memory forms raw, condensed, both "
                                                     "(default: the run's final-eval modes; free without "
                                                     "--run)")
    e.add_argument("--out", help="write the result JSON here")
    e.add_argument("--save-run", metavar="DIR",
                   help="without --run: also write DIR (new) as an evaluation-only run folder (method "
                        "eval-only: config.yaml, versions.json, data.json, eval.json), which the leaderboard "
                        "shows as a row, e.g. for a released checkpoint this project did not train")
    e.add_argument("--engine", choices=["transformers", "vllm", "openai"],
                   help="generation engine (default: the config's); openai: a model behind an OpenAI-compatible "
                        "server, named by --model, at --base-url (docs/serving.md \"Scoring a served model\")")
    e.add_argument("--base-url", help="with --engine openai: the server's API root, e.g. http://127.0.0.1:8000/v1")
    e.add_argument("--api", choices=["completions", "chat"], default="completions",
                   help="with --engine openai: completions (token-id prompts, exact; open-model servers) or chat "
                        "(messages; chat-only servers; no prefill)")
    e.add_argument("--tokenizer", help="with --engine openai: the model whose tokenizer builds the prompts "
                                       "(default: --model for completions, the default model for chat)")
    e.add_argument("--quiet", action="store_true")
    return e


def _eval_modes(text: str) -> list[str]:
    """``--modes free,guided,shuffled`` -> the list (argparse type; a bad name is a usage error)."""
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    known = ("free", "guided", "shuffled", "empty", "raw", "condensed", "both")
    bad = [m for m in modes if m not in known]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown eval mode(s) {', '.join(bad) or '(none given)'}; "
                                         f"known: {', '.join(known)}")
    return modes


def run(args: argparse.Namespace) -> int:
    """``crl-bench eval``: evaluate a model, or a finished run's checkpoint with its own bank.

    With ``--run``: the run's ``checkpoint/`` (refused, exit 2, when there is none: nothing trained to
    evaluate) under the run's config; a ``complementary``/``static`` run is evaluated guided by its own
    ``experience.sqlite`` (opened read-only: no entry, counter or file changes), with the memory
    controls, and experience-free, like the run's final ``eval.json`` (``--modes`` picks the modes).
    The result, with its protocol, goes to ``RUN/checkpoint-<split>-split.json`` (with ``--profile
    P``: ``checkpoint-<split>-P-split.json``) unless ``--out`` says otherwise (the leaderboard reads
    it as a row of that protocol). Without ``--run``: the model
    free (no bank to guide it).

    A greedy evaluation (``eval.temperature`` 0) also keeps each finished mode in ``<out>.partial``
    (no leaderboard reads it) until the whole result is written, so an interrupted one, run again
    with the same arguments, evaluates only the modes it had not finished: every mode starts from an
    empty prefix store and greedy decoding draws nothing, so a mode's result does not depend on the
    modes before it. Every evaluation with an output file also keeps each finished episode in
    ``<out>.episodes.jsonl`` (:class:`~crl_bench.trainer.eval_journal.EpisodeJournal`), so that one
    interrupted mid-mode, greedy or sampled, rolls out only the episodes it had not finished; a mode
    with kept episodes says how many (``resumed_episodes``). Partial and journal files are used only
    when written for the same settings, model and bank files (path, size, modification time); any
    other is ignored and replaced; both are removed once the result is written. An ``--out`` whose
    folder does not exist is a ``ConfigError`` before any model loads.
    """
    from crl_bench.trainer.lifecycle import evaluate_saved

    run_dir = Path(args.run) if args.run else None
    served = _served(args, run_dir)          # checked first: with --engine openai, --model is the served name
    save = Path(args.save_run) if getattr(args, "save_run", None) else None
    if save is not None and run_dir is not None:
        raise ConfigError("--save-run writes a new evaluation-only run folder; with --run the result goes to "
                          "that run's folder (--out for another file)")
    if save is not None and save.exists():
        raise ConfigError(f"--save-run {str(save)!r} exists; give a new folder")
    if run_dir is not None:
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--run {args.run!r} is not a run folder (no config.yaml)")
        ckpt = run_dir / "checkpoint"
        if not args.model:
            if not ckpt.is_dir():
                raise ConfigError(f"--run {args.run!r} has no checkpoint/ (run with train.save_checkpoint: false, "
                                  "or it did not finish): there is no trained actor to evaluate; for the base "
                                  f"model use --config {run_dir / 'config.yaml'}")
            args.model = str(ckpt)
        args.config = args.config or str(run_dir / "config.yaml")
    extra: dict[str, Any] = {"eval.split": args.split, **served}
    if args.episodes is not None:
        extra["eval.episodes"] = args.episodes
    cfg = resolve_config(args, extra)
    if run_dir is not None and cfg.model.lora and args.model == str(run_dir / "checkpoint"):
        # a LoRA run's checkpoint is peft's adapter: load_model_and_tokenizer loads its base model and
        # merges the adapter in, so the eval must not wrap the merged weights in a fresh adapter
        cfg.model.lora = False
    profile = f"-{cfg.eval.profile}" if cfg.eval.profile else ""
    out = Path(args.out) if args.out else (run_dir / f"checkpoint-{cfg.eval.split}{profile}-split.json"
                                           if run_dir else None)
    if out is not None and not out.parent.is_dir():
        raise ConfigError(f"--out {str(out)!r}: folder {str(out.parent)!r} does not exist")
    bank = None
    if run_dir is not None and cfg.method_spec.uses_experience:
        bank = run_dir / "experience.sqlite"
        if not bank.is_file():
            raise ConfigError(f"--run {args.run!r} is a {cfg.method} run without its experience.sqlite")
    partial = out.with_name(out.name + ".partial") if out is not None and cfg.eval.temperature == 0 else None
    journal = out.with_name(out.name + ".episodes.jsonl") if out is not None else None
    ev, data_files = evaluate_saved(cfg, bank=bank, modes=args.modes, partial=partial, journal=journal,
                                    model_key=args.model,
                                    run=str(run_dir) if run_dir else None, where=f"--run {args.run!r}",
                                    quiet=args.quiet)
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "tasks"} if isinstance(v, dict) else v)
                      for k, v in ev.items()}, indent=2))
    if out:
        out.write_text(json.dumps(ev, indent=2))
        print(f"wrote {out}")
        if partial is not None:
            partial.unlink(missing_ok=True)
        journal.unlink(missing_ok=True)
    if save is not None:
        _save_eval_run(save, cfg, ev, data_files)
        print(f"wrote {save} (an evaluation-only run folder: crl-bench leaderboard {save.parent})")
    return 0


def _served(args: argparse.Namespace, run_dir: Path | None) -> dict[str, Any]:
    """The settings of ``--engine``, ``--base-url``, ``--api`` (``{"section.key": value}``); with ``--engine
    openai``, ``args.model`` becomes the tokenizer's model (``--tokenizer``; with ``--run``, the run's
    checkpoint) and ``--model`` the name the server knows.

    Raises:
        ConfigError: ``--engine openai`` without ``--model`` or ``--base-url``; those flags without it.
    """
    out: dict[str, Any] = {}
    if args.engine and args.engine != "openai":
        out["generation.engine"] = args.engine
    if args.engine != "openai":
        if args.base_url or args.tokenizer:
            raise ConfigError("--base-url and --tokenizer go with --engine openai")
    else:
        if not args.model or not args.base_url:
            raise ConfigError("--engine openai needs --model NAME (the name the server knows) and --base-url URL")
        out.update({"generation.engine": "openai", "generation.openai_model": args.model,
                    "generation.openai_base_url": args.base_url, "generation.openai_api": args.api,
                    "generation.constrained": False})
        if args.api == "chat":
            out["generation.prefill"] = ""
        args.model = args.tokenizer or (None if args.api == "chat" or run_dir is not None else args.model)
    return out


def _save_eval_run(folder: Path, cfg: Any, ev: dict[str, Any], data_files: dict[str, dict[str, str]]) -> None:
    """Write ``folder`` as an evaluation-only run folder: ``config.yaml`` (the evaluation's settings,
    method :data:`EVAL_ONLY`, no training steps), ``versions.json`` (with the model's description),
    ``data.json`` (sha256 of the data files the envs read) and ``eval.json`` (``step`` 0)."""
    from crl_bench.data import data_checksums
    from crl_bench.results.run_folder import RunWriter
    from crl_bench.results.summary import EVAL_ONLY

    writer = RunWriter(folder.parent, folder.name)
    config = cfg.to_dict()
    config.update(method=EVAL_ONLY, run_id=folder.name, output_dir=str(folder.parent))
    config["train"]["steps"] = 0
    writer.write_config(config)
    served = cfg.generation.engine == "openai"
    writer.write_versions(model=cfg.generation.openai_model if served else cfg.model.name,
                          dtype=None if served else cfg.model.dtype)
    writer.write_json("data.json", {"data_checksums": data_checksums(data_files)})
    writer.write_json("eval.json", {**ev, "step": 0, "method": EVAL_ONLY})
