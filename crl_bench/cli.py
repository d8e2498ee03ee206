"""The ``crl-bench`` command line.

Commands::

    crl-bench run   --method grpo --mix minihack-room [--preset smoke] [--config FILE] [--steps N]
                    [--model NAME] [--seed S] [--set section.key=value ...]
    crl-bench sweep --methods grpo,static,complementary --seeds 0,1,2 --mix M [--preset P] [--set ...]
    crl-bench leaderboard [DIR ...] [--out DIR]
    crl-bench report RUN_OR_SWEEP ... [--out DIR]
    crl-bench submission check DIR | crl-bench submission pack RUN ... --name NAME
    crl-bench eval  --mix sokoban [--run RUN_DIR | --model NAME] [--split eval] [--episodes N|all] [--modes M,...]
    crl-bench envs list | crl-bench envs play ENV [--task N]
    crl-bench bench env | rollout | retrieval | overhead | step [--mix M --preset P --train-steps N]
    crl-bench bank show RUN | crl-bench bank stats RUN
    crl-bench model prepare
    crl-bench data list | crl-bench data download alfworld|webshop|swebench ... [--data-dir DIR] [--source S]
    crl-bench swe filter --model M --k 16 --low 0 --high 0.8 [--tasks FILE] [--out FILE]
    crl-bench swe base-image
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from crl_bench import bench
from crl_bench.config import (
    ConfigError,
    RunConfig,
    build_config,
    check_name,
    load_yaml,
    parse_override,
    preset_data,
)
from crl_bench.data import ChecksumError, DataMissingError, dataset_names
from crl_bench.env_api import EnvUnavailableError
from crl_bench.llm.default_model import ModelNotAvailable
from crl_bench.results.run_folder import RunFolderError, is_storage_error


def _add_config_args(p: argparse.ArgumentParser, with_method: bool = True) -> None:
    if with_method:
        p.add_argument("--method", default="grpo", help="training method (grpo; see docs)")
    p.add_argument("--mix", help="env id, mixture name (3task, 6task), mixture YAML or id:w,id:w")
    p.add_argument("--preset", default="default", help="preset: default, smoke, cpu, diag, paper")
    p.add_argument("--config", help="YAML file with the same sections as a run's config.yaml")
    p.add_argument("--model", help="actor model: smollm2-135m-instruct (default) or a HF path/name")
    p.add_argument("--extractor-model", help="experience extractor model (default: same as the actor, "
                                             "separate weights)")
    p.add_argument("--seed", type=int, help="seed of the run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any setting, e.g. --set train.lr=1e-5 (repeatable)")


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("local", "ray"),
                   help="local (default: one process) or ray (envs, engines and the experience manager in Ray "
                        "actors; crl_bench/ray_backend.py)")
    p.add_argument("--ray-address", help="with --backend ray: the cluster to join (default RAY_ADDRESS, else a "
                                         "local Ray)")


def _episodes(text: str) -> int | str:
    """``--episodes``: a non-negative integer or ``all``."""
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'all', got {text!r}") from None


def resolve_config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> RunConfig:
    """Layer preset < --config < method < flags < --set into a validated RunConfig."""
    from crl_bench.methods import get_method

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
    flags: dict[str, Any] = {}
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


def cmd_run(args: argparse.Namespace) -> int:
    from crl_bench.trainer.lifecycle import resume_training, run_training

    if args.resume:
        given = [flag for flag, value in (("--mix", args.mix), ("--config", args.config), ("--model", args.model),
                                          ("--extractor-model", args.extractor_model), ("--seed", args.seed),
                                          ("--set", args.set), ("--steps", args.steps),
                                          ("--output-dir", args.output_dir), ("--run-id", args.run_id),
                                          ("--method", args.method), ("--preset", args.preset),
                                          ("--backend", args.backend), ("--ray-address", args.ray_address)) if value]
        if given:
            raise ConfigError(f"--resume continues the run with its own config.yaml; drop {', '.join(given)}")
        from crl_bench.trainer.checkpoint import CheckpointError

        try:
            path = resume_training(args.resume, quiet=args.quiet, start_over=args.start_over,
                                   allow_config_change=args.allow_config_change)
        except CheckpointError as e:
            raise ConfigError(f"--resume {args.resume!r}: {e}") from None
        print(f"run folder: {path}")
        return 0
    for flag, value in (("--start-over", args.start_over), ("--allow-config-change", args.allow_config_change)):
        if value:
            raise ConfigError(f"{flag} only applies with --resume RUN_DIR")
    if args.run_id:
        check_name(args.run_id, "--run-id")
    args.method = args.method or "grpo"
    args.preset = args.preset or "default"
    extra: dict[str, Any] = {}
    if args.steps is not None:
        extra["train.steps"] = args.steps
    cfg = resolve_config(args, extra)
    if args.output_dir:
        cfg.output_dir = args.output_dir
    if args.run_id:
        cfg.run_id = args.run_id
    path = run_training(cfg, quiet=args.quiet)
    print(f"run folder: {path}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from crl_bench.sweep import SweepSpec, describe, parse_list, run_sweep

    if not args.mix:
        raise ConfigError("sweep: --mix is required")
    if args.seed is not None:
        raise ConfigError("sweep: use --seeds (a list), not --seed")
    if args.name is not None:
        check_name(args.name, "--name")
    spec = SweepSpec(methods=parse_list(args.methods, str, "methods"), seeds=parse_list(args.seeds, int, "seeds"),
                     mix=args.mix, preset=args.preset, config=args.config, model=args.model, steps=args.steps,
                     sets=list(args.set))

    def resolve(method: str, seed: int) -> RunConfig:
        ns = argparse.Namespace(**{**vars(args), "method": method, "seed": seed})
        return resolve_config(ns, {"train.steps": args.steps} if args.steps is not None else None)

    for line in describe(spec):
        print(line, flush=True)
    path, failures = run_sweep(spec, args.output_dir, resolve, name=args.name, quiet=not args.verbose,
                               print_fn=lambda line: print(line, flush=True))
    print(f"sweep folder: {path}" + (f"; {len(failures)} run(s) failed (rerun the same command to retry them)"
                                     if failures else ""))
    return 1 if failures else 0


def cmd_leaderboard(args: argparse.Namespace) -> int:
    from crl_bench.results.leaderboard import main_leaderboard

    return main_leaderboard(args.dirs or ["results"], args.out)


def cmd_report(args: argparse.Namespace) -> int:
    from crl_bench.results.leaderboard import collect, display_frame, leaderboard_frame
    from crl_bench.results.report import make_report

    for p in args.paths:
        if not Path(p).is_dir():
            raise ConfigError(f"report: {p!r} is not a run or sweep folder")
    out = Path(args.out) if args.out else (Path(args.paths[0]) / "report" if len(args.paths) == 1
                                           else Path("results") / "report")
    warnings: list[str] = []
    summaries = collect(args.paths, warnings=warnings)
    table = display_frame(leaderboard_frame(summaries, warnings=warnings)) if summaries else None
    for w in warnings:
        print(f"crl-bench report: warning: {w}", file=sys.stderr)
    try:
        path = make_report(args.paths, out, table=table, title=args.title)
    except (ValueError, FileNotFoundError) as e:         # no run folder under the paths, or a damaged one
        raise ConfigError(f"report: {e}") from None
    print(f"report: {path}")
    return 0


def cmd_submission(args: argparse.Namespace) -> int:
    from crl_bench.results.submission import main_submission_check, main_submission_pack, main_submission_verify

    if args.submission_cmd == "check":
        return main_submission_check(args.dir)
    if args.submission_cmd == "verify":
        import tempfile

        work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="crl-bench-verify-"))
        print(f"re-runs go to {work}")

        def rerun(config_path: Path, run_id: str) -> Path:
            """Train and evaluate ``config_path`` again as ``work/run_id`` (``crl-bench run``)."""
            from crl_bench.trainer.lifecycle import run_training

            cfg = build_config([load_yaml(config_path)])
            cfg.output_dir, cfg.run_id = str(work), run_id
            return Path(run_training(cfg, quiet=args.quiet))

        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
        return main_submission_verify(args.dir, rerun, seeds)
    return main_submission_pack(args.runs, args.name, args.out, trajectories=args.trajectories)


def _eval_modes(text: str) -> list[str]:
    """``--modes free,guided,shuffled`` -> the list (argparse type; a bad name is a usage error)."""
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    known = ("free", "guided", "shuffled", "empty")
    bad = [m for m in modes if m not in known]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown eval mode(s) {', '.join(bad) or '(none given)'}; "
                                         f"known: {', '.join(known)}")
    return modes


def cmd_eval(args: argparse.Namespace) -> int:
    """``crl-bench eval``: evaluate a model, or a finished run's checkpoint with its own bank.

    With ``--run``: the run's ``checkpoint/`` (refused, exit 2, when there is none: nothing trained to
    evaluate) under the run's config; a ``complementary``/``static`` run is evaluated guided by its own
    ``experience.sqlite`` (opened read-only: no entry, counter or file changes), with the memory
    controls, and experience-free, like the run's final ``eval.json`` (``--modes`` picks the modes).
    The result, with its protocol, goes to ``RUN/checkpoint-<split>-split.json`` unless ``--out``
    says otherwise (the leaderboard reads it as a row of that protocol). Without ``--run``: the model
    free (no bank to guide it).

    A greedy evaluation (``eval.temperature`` 0) also keeps each finished mode in ``<out>.partial``
    (no leaderboard reads it) until the whole result is written, so an interrupted one, run again
    with the same arguments, evaluates only the modes it had not finished: every mode starts from an
    empty prefix store and greedy decoding draws nothing, so a mode's result does not depend on the
    modes before it (a sampled evaluation's draws do, so it always runs whole). A partial file is
    used only when it was written for the same settings, model and bank files (path, size,
    modification time); any other is ignored and replaced. An ``--out`` whose folder does not exist
    is a ``ConfigError`` before any model loads.
    """
    from tqdm import tqdm

    from crl_bench.experience.bank import EmbeddingDimError, ExperienceBank, NotABankError
    from crl_bench.results.summary import write_json_atomic
    from crl_bench.trainer.loop import Trainer

    run_dir = Path(args.run) if args.run else None
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
    extra: dict[str, Any] = {"eval.split": args.split}
    if args.episodes is not None:
        extra["eval.episodes"] = args.episodes
    cfg = resolve_config(args, extra)
    if run_dir is not None and cfg.model.lora and args.model == str(run_dir / "checkpoint"):
        # a LoRA run's checkpoint is peft's adapter: load_model_and_tokenizer loads its base model and
        # merges the adapter in, so the eval must not wrap the merged weights in a fresh adapter
        cfg.model.lora = False
    out = Path(args.out) if args.out else (run_dir / f"checkpoint-{cfg.eval.split}-split.json" if run_dir else None)
    if out is not None and not out.parent.is_dir():
        raise ConfigError(f"--out {str(out)!r}: folder {str(out.parent)!r} does not exist")
    bank = None
    if run_dir is not None and cfg.method_spec.uses_experience:
        bank = run_dir / "experience.sqlite"
        if not bank.is_file():
            raise ConfigError(f"--run {args.run!r} is a {cfg.method} run without its experience.sqlite")
        try:                            # checked before the models load: a bad bank fails at once
            ExperienceBank.stored_dim(bank)
        except NotABankError as e:
            raise ConfigError(f"--run {args.run!r}: {e}") from None
    try:
        trainer = Trainer(cfg, writer=None, read_only_bank=bank)
    except NotABankError as e:          # unreadable past its header (corrupt pages, bad embeddings)
        raise ConfigError(f"--run {args.run!r}: {e}") from None
    except EmbeddingDimError as e:      # the bank was filled with another experience.embedder
        raise ConfigError(f"--run {args.run!r}: {e}; evaluate with the run's own experience.embedder "
                          f"({cfg.experience.embedder!r} is set here)") from None
    ev: dict[str, Any] = {"model": cfg.model.name, "method": cfg.method, "run": str(run_dir) if run_dir else None}
    partial = out.with_name(out.name + ".partial") if out is not None and cfg.eval.temperature == 0 else None
    try:
        modes = list(trainer.evaluator.modes if bank is not None else ["free"]) if args.modes is None else args.modes
        if bank is None and any(m != "free" for m in modes):
            raise ConfigError(f"--modes {','.join(modes)}: only 'free' can be evaluated without a run's "
                              "experience bank (--run RUN of a method with experience)")
        ev["protocol"] = trainer.evaluator.protocol()
        data_files = trainer.data_files
        key: dict[str, Any] = {}
        done: dict[str, Any] = {}
        if partial is not None:
            key = _partial_eval_key(cfg, args.model, bank, ev)
            done = _partial_eval_modes(partial, key)
        if done and any(m in done for m in modes):
            print(f"resuming from {partial}: {', '.join(m for m in modes if m in done)} already evaluated",
                  file=sys.stderr)
        total = trainer.evaluator.episode_count(modes=modes)
        with tqdm(total=total, desc=f"eval {cfg.eval.split}", unit="ep", disable=args.quiet) as bar:
            for mode in modes:
                if mode in done:
                    ev[mode] = done[mode]
                    bar.update(trainer.evaluator.episode_count(modes=[mode]))
                    continue
                ev[mode] = trainer.evaluator.evaluate(progress=bar.update, mode=mode)
                if partial is not None:
                    write_json_atomic(partial, {"key": key, "modes": {**done, **{m: ev[m] for m in modes if m in ev}}})
    finally:
        trainer.close()
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "tasks"} if isinstance(v, dict) else v)
                      for k, v in ev.items()}, indent=2))
    if out:
        out.write_text(json.dumps(ev, indent=2))
        print(f"wrote {out}")
        if partial is not None:
            partial.unlink(missing_ok=True)
    if save is not None:
        _save_eval_run(save, cfg, ev, data_files)
        print(f"wrote {save} (an evaluation-only run folder: crl-bench leaderboard {save.parent})")
    return 0


def _partial_eval_key(cfg: Any, model: str | None, bank: Path | None, ev: dict[str, Any]) -> dict[str, Any]:
    """What an evaluation's finished modes depend on, as JSON data: its settings (``cfg.to_dict()``),
    model name, method, run and protocol (``ev`` so far), and the path, size and modification time
    (ns) of each file of the model folder (when ``model`` is a local path) and of the bank with its
    write-ahead log. Equal keys mean :func:`cmd_eval` may keep a partial file's modes."""
    files: dict[str, list[int]] = {}
    paths = [Path(model)] if model and Path(model).exists() else []
    if bank is not None:
        paths += [bank, bank.with_name(bank.name + "-wal")]
    for p in paths:
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                st = f.stat()
                files[str(f)] = [st.st_size, st.st_mtime_ns]
    return json.loads(json.dumps({"settings": cfg.to_dict(), "eval": ev, "files": files}, default=str))


def _partial_eval_modes(partial: Path, key: dict[str, Any]) -> dict[str, Any]:
    """The finished modes (``{mode: result block}``) that ``partial`` holds for an evaluation with
    ``key`` (:func:`_partial_eval_key`); ``{}`` when there is no such file, or it is unreadable or
    was written for another key (it is then replaced by the first mode this evaluation finishes)."""
    from crl_bench.safe_io import InputFileError, load_json

    if not partial.is_file():
        return {}
    try:
        data = load_json(partial)
    except InputFileError:
        return {}
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("modes"), dict):
        return {}
    return data["modes"]


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
    writer.write_versions(model=cfg.model.name, dtype=cfg.model.dtype)
    writer.write_json("data.json", {"data_checksums": data_checksums(data_files)})
    writer.write_json("eval.json", {**ev, "step": 0, "method": EVAL_ONLY})


ENV_DOC_PAGES = {"minihack-": "minihack", "diag-": "diag", "swebench-": "swebench"}
"""Env id prefixes whose envs share one docs/envs page (the others have a page of their own name)."""


def env_doc(env_id: str) -> str:
    """The docs page of ``env_id`` (``docs/envs/<family>.md``) as a path relative to the checkout."""
    family = next((page for prefix, page in ENV_DOC_PAGES.items() if env_id.startswith(prefix)), env_id)
    return f"docs/envs/{family}.md"


def _short(text: str, limit: int = 140) -> str:
    """``text`` on one line, at most ``limit`` characters (cut at a word, with an ellipsis)."""
    one = " ".join(text.split())
    if len(one) <= limit:
        return one
    return one[:limit].rsplit(" ", 1)[0] + " ..."


def cmd_envs(args: argparse.Namespace) -> int:
    from crl_bench.env_api import list_envs, make_env

    if args.envs_cmd == "list":
        import warnings

        for env_id in list_envs():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("ignore")
                warnings.simplefilter("always", UserWarning)     # an env's setup notes, said once each
                try:
                    env = make_env(env_id)
                    splits = ", ".join(f"{k}: {len(v)}" for k, v in env.splits.items())
                    actions = env.admissible_actions()
                    # None: an open action set (WebShop's search[...] / click[...]), whose syntax
                    # the env's page gives
                    shown = (f"free text, as {env_doc(env_id)} says" if actions is None
                             else ", ".join(actions) if actions else "the admissible commands of each state")
                    # the env is built anyway for its splits and actions, so its chance rate (which
                    # depends on its settings) costs nothing more; shown only where the env knows it
                    chance = env.chance_success_rate()
                    known = "" if chance is None else f"; chance success: {chance:.4g}"
                    print(f"{env_id:18s} tasks ({splits}); actions: {shown}{known}")
                    env.close()
                except Exception as e:  # noqa: BLE001 - list what we can, say why one is unavailable
                    print(f"{env_id:18s} unavailable here ({type(e).__name__}: {_short(str(e))}); "
                          f"see {env_doc(env_id)}")
                    caught = []             # the reason above is what matters; its setup notes are not
            for w in caught:
                print(f"{'':18s} note: {_short(str(w.message))}")
        return 0
    return play(args.env, args.task, args.max_steps)


def play(env_id: str, task: int, max_steps: int, stdin: Any = None, stdout: Any = None) -> int:
    """Let a human play ``env_id`` in the terminal (bare action names are accepted)."""
    from crl_bench.env_api import make_env

    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    if stdin is None or getattr(stdin, "closed", False):
        raise ConfigError("envs play reads your actions from standard input, which is closed")
    env = make_env(env_id, max_steps=max_steps)
    try:
        obs, info = env.reset(options={"task": task})
    except BaseException:
        env.close()
        raise
    print(f"{env_id}, task {task}. {env.task_prompt()}  (type an action, or 'quit')\n", file=stdout)
    total = 0.0
    while True:
        print(obs, file=stdout)
        print("> ", end="", file=stdout, flush=True)
        try:
            line = stdin.readline()
        except (OSError, ValueError):       # stdin closed or unreadable mid-game: end like EOF
            line = ""
        if not line or line.strip().lower() in ("quit", "exit", "q"):
            print("\nbye", file=stdout)
            break
        reply = line if "<answer>" in line.lower() else f"<answer>{line.strip()}</answer>"
        obs, r, term, trunc, info = env.step(reply)
        total += r
        if term or trunc:
            print(obs, file=stdout)
            outcome = "success" if info["success"] else ("truncated" if trunc else "failed")
            print(f"\nEpisode over: {outcome}, reward {total:g}, {info['steps']} steps, "
                  f"{info['invalid_actions']} invalid.", file=stdout)
            break
    env.close()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    return bench.main(args)


def _open_bank(run: str):
    """Open the experience bank of a run folder (or a ``.sqlite`` path) for inspection, with
    :meth:`ExperienceBank.open_readonly` (nothing written, no model loaded, a file that is not a
    crl-bench bank refused).

    A bank is the ``.sqlite`` file with its ``-wal``/``-shm`` files: after a crash the entries can sit
    only in the ``-wal``, so a near-empty ``.sqlite`` without its ``-wal`` gets a warning (it was
    probably copied without it).

    Raises:
        ConfigError: no bank there, or the file is not a (readable) crl-bench bank.
    """
    from crl_bench.experience.bank import ExperienceBank, NotABankError

    path = Path(run) / "experience.sqlite" if Path(run).is_dir() else Path(run)
    if not path.is_file():
        raise ConfigError(f"{run!r} has no experience bank (experience.sqlite); was it run with "
                          "a method with an experience bank (complementary, static, casebank, expel, reflexion)?")
    wal = path.with_name(path.name + "-wal")
    hint = (f" Its write-ahead log {wal.name} is missing: a bank that was not closed cleanly keeps its "
            f"entries there; copy {path.name} with its -wal and -shm files." if not wal.exists() else "")
    try:
        bank = ExperienceBank.open_readonly(path)
    except NotABankError as e:
        near_empty = path.stat().st_size <= 8192
        raise ConfigError(f"{e}." + (hint if near_empty else "")) from None
    if len(bank) == 0 and hint:
        print(f"crl-bench: warning: {path} holds no entries.{hint}", file=sys.stderr)
    return bank


def cmd_swe(args: argparse.Namespace) -> int:
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


def cmd_panel(args: argparse.Namespace) -> int:
    """``crl-bench panel export ENV`` / ``panel check PANEL``: write an env's eval task panel, or check
    that this machine's data and code reproduce one (:mod:`crl_bench.results.panel`).

    ``export`` exits 0; ``check`` exits 0 when every task reproduces, 1 when any differs (each
    difference printed), 2 for an unreadable panel file or an env that cannot be made.
    """
    from tqdm import tqdm

    from crl_bench.results.panel import PanelError, build_panel, check_panel, panel_task_ids, read_panel
    from crl_bench.rollout import EnvPool

    if args.panel_cmd == "export":
        extra: dict[str, Any] = {"eval.split": args.split}
        if args.episodes is not None:
            extra["eval.episodes"] = args.episodes
        cfg = resolve_config(args, extra)
        settings = dict(cfg.rollout.env_kwargs.get(args.env, {}))
        env = EnvPool({args.env: settings}, cfg.rollout.max_steps).make(args.env)
        try:
            ep = cfg.eval.episodes
            ids = panel_task_ids(env, args.split, ep)
            with tqdm(total=len(ids), desc=f"panel {args.env} {args.split}", unit="task", disable=args.quiet) as bar:
                panel = build_panel(env, args.env, args.split, ids, episodes=ep, env_settings=settings,
                                    progress=bar.update)
        finally:
            env.close()
        out = Path(args.out) if args.out else Path(f"{args.env}-{args.split}.panel.json")
        out.write_text(json.dumps(panel, indent=1) + "\n")
        print(f"panel {panel['panel_hash']}: {args.env} {args.split}, {len(ids)} tasks; wrote {out}")
        return 0
    try:
        panel = read_panel(args.panel)
    except PanelError as e:
        raise ConfigError(str(e)) from None
    env = EnvPool({panel["env"]: panel["env_settings"]}, panel["max_steps"]).make(panel["env"])
    try:
        with tqdm(total=len(panel["tasks"]), desc=f"check {panel['env']}", unit="task", disable=args.quiet) as bar:
            problems = check_panel(panel, env, progress=bar.update)
    finally:
        env.close()
    if problems:
        print(f"panel {panel['panel_hash']} ({panel['env']} {panel['split']}): NOT reproduced here, "
              f"{len(problems)} problem(s):")
        for line in problems:
            print(f"  {_shown(line)}")
        return 1
    print(f"panel {panel['panel_hash']} ({panel['env']} {panel['split']}, {len(panel['tasks'])} tasks): reproduced")
    return 0


def _shown(text: Any) -> str:
    """Bank text for the terminal: control characters escaped (an ESC in a lesson cannot drive the
    terminal), tabs kept and each line after the first indented like the first, so a lesson's
    newline cannot start what looks like another entry."""
    from crl_bench.safe_io import printable

    return printable(text).replace("\n", "\n    ")


def cmd_bank(args: argparse.Namespace) -> int:
    """``crl-bench bank show|stats RUN``: list a bank's entries or print its statistics (JSON).

    Raises:
        ConfigError: no bank, or the file is not a readable crl-bench bank (exit 2, naming it).
    """
    import sqlite3

    bank = _open_bank(args.run)
    try:
        if args.bank_cmd == "stats":
            print(json.dumps(bank.stats(), indent=2))
            return 0
        entries = bank.entries(args.env)
        keys = {"id": lambda e: -e.id, "retrieved": lambda e: e.times_retrieved,
                "success": lambda e: e.times_success, "failure": lambda e: e.times_failure,
                "votes": lambda e: e.votes, "utility": lambda e: e.utility}
        entries.sort(key=keys[args.sort], reverse=True)
        for e in entries[:args.limit]:
            lineage = f"{e.origin}" + (f" of #{', #'.join(map(str, e.parent_ids))}" if e.parent_ids else "")
            print(f"#{e.id} [{_shown(e.env_id)}] {_shown(e.title)}\n    {_shown(e.content)}\n    retrieved "
                  f"{e.times_retrieved}, guided {e.times_success} successes / {e.times_failure} failures, utility "
                  f"{e.utility:.3f}, votes {e.votes:+d}; {_shown(lineage)} at step {e.created_step}, extractor version "
                  f"{e.extractor_version}")
        print(f"{len(entries)} entries" + (f" (showing {args.limit})" if len(entries) > args.limit else ""))
        insights = bank.insights(args.env)
        if insights:                    # a method with insight lists (expel): most important first, per env
            print("\ninsights:")
            for i in insights[:args.limit]:
                print(f"#{i.id} [{_shown(i.env_id)}] importance {i.importance}, added at step {i.created_step}, "
                      f"changed at step {i.updated_step}\n    {_shown(i.text)}")
            print(f"{len(insights)} insights" + (f" (showing {args.limit})" if len(insights) > args.limit else ""))
        reflections = bank.recent_reflections(args.env, args.limit)
        if reflections:                 # reflexion: the newest reflections first, each with its task
            print("\nreflections:")
            for env_id, task, text, step in reflections:
                print(f"[{_shown(env_id)}] task {task}, written at step {step}\n    {_shown(text)}")
            total = bank.reflection_count(args.env)
            print(f"{total} reflections" + (f" (showing the newest {args.limit})" if total > args.limit else ""))
        return 0
    except (sqlite3.Error, ValueError, TypeError) as e:   # rows a crl-bench bank never holds
        raise ConfigError(f"{bank.path} is not a readable crl-bench experience bank: {e}") from None
    finally:
        bank.close()


def cmd_data(args: argparse.Namespace) -> int:
    import urllib.error

    from crl_bench.data import data_dir, downloader
    from crl_bench.safe_io import printable

    if args.data_cmd == "list":
        for name in dataset_names():
            print(name)
        return 0
    if args.source and len(args.dataset) > 1:
        raise ConfigError("--source names the copy of one data set; download one data set at a time with it")
    root = data_dir(args.data_dir)
    for name in dict.fromkeys(args.dataset):
        try:
            out = downloader(name)(root, source=args.source, verify=not args.no_verify)
        except urllib.error.URLError as e:
            print(f"crl-bench: error: {name}: a source cannot be reached ({printable(str(e.reason))}); check the "
                  f"network, or give a local copy with --source", file=sys.stderr)
            return 2
        except ValueError as e:                  # a fetched file that is not what the data set holds
            print(f"crl-bench: error: {name}: {printable(str(e))}", file=sys.stderr)
            return 2
        print(f"{name}: ready in {out} (use it with CRL_BENCH_DATA={root})")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from crl_bench.llm.default_model import prepare_default_model

    path = prepare_default_model(force=args.force)
    print(f"default model ready at {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from crl_bench import __version__

    p = argparse.ArgumentParser(
        prog="crl-bench",
        description="crl-bench: text environments for LLM agents (MiniHack, Sokoban, ALFWorld, WebShop, "
                    "SWE-Bench-Verified, diagnostic tasks), one batched rollout loop, and a trainer for "
                    "GRPO and Complementary RL (an actor and an experience extractor that co-evolve "
                    "through an experience bank).",
        epilog="Start with: crl-bench run --method complementary --mix 6task --preset smoke. "
               "Each command has --help; the documentation is README.md and docs/.")
    p.add_argument("--version", action="version", version=f"crl-bench {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="train (and finally evaluate) one method on one mix")
    _add_config_args(r)
    r.set_defaults(method=None, preset=None)        # defaults applied in cmd_run, so --resume can refuse them
    _add_backend_args(r)
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped or killed run from its newest "
                                                        "usable checkpoint (its own config.yaml; no other "
                                                        "flags but the two below)")
    r.add_argument("--start-over", action="store_true",
                   help="with --resume: when the run's checkpoint folders are all unusable, train it again "
                        "from step 0 (they are kept aside) instead of refusing")
    r.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: continue although config.yaml differs from the checkpoint's")
    r.add_argument("--steps", type=int, help="training steps")
    r.add_argument("--output-dir", help="runs folder (default results/runs)")
    r.add_argument("--run-id", help="run folder name (default: time-method-mix-seed)")
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(func=cmd_run)

    sw = sub.add_parser("sweep", help="run a grid of methods x seeds into one sweep folder (resumable)")
    _add_config_args(sw, with_method=False)
    _add_backend_args(sw)
    sw.add_argument("--methods", default="grpo,static,complementary", help="comma-separated methods")
    sw.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    sw.add_argument("--steps", type=int, help="training steps of every run")
    sw.add_argument("--output-dir", default="results/sweeps", help="folder of sweeps (default results/sweeps)")
    sw.add_argument("--name", help="sweep folder name (default: <mix>-<preset>[-hash of the other settings])")
    sw.add_argument("--verbose", action="store_true", help="print every run's step lines too")
    sw.set_defaults(func=cmd_sweep)

    lb = sub.add_parser("leaderboard", help="leaderboard.md and leaderboard.csv from run folders and submissions")
    lb.add_argument("dirs", nargs="*", help="folders to read (default: results, i.e. runs, sweeps, submissions)")
    lb.add_argument("--out", default="results", help="where leaderboard.md/.csv go (default results)")
    lb.set_defaults(func=cmd_leaderboard)

    rp = sub.add_parser("report", help="PNG curves and one self-contained report.html of runs or sweeps")
    rp.add_argument("paths", nargs="+", help="run folders, sweep folders, or folders holding them")
    rp.add_argument("--out", help="output folder (default: <the one path>/report, else results/report)")
    rp.add_argument("--title", help="page title")
    rp.set_defaults(func=cmd_report)

    sm = sub.add_parser("submission", help="check or pack a leaderboard submission (results/submissions/<name>)")
    sms = sm.add_subparsers(dest="submission_cmd", required=True)
    sc = sms.add_parser("check", help="validate summary.json and metadata.yaml of a submission folder")
    sc.add_argument("dir")
    sp = sms.add_parser("pack", help="merge the summaries of your runs (one per seed) into a submission")
    sp.add_argument("runs", nargs="+", help="run folders of one method, model, mix and eval protocol")
    sp.add_argument("--name", required=True, help="submission name (folder name)")
    sp.add_argument("--out", help="submission folder (default results/submissions/<name>)")
    sp.add_argument("--trajectories", action="store_true",
                    help="also pack each run's episodes.jsonl as trajectories/<run id>.jsonl.gz")
    sv = sms.add_parser("verify", help="re-run the submission's configs here and set 'verified' in "
                                       "verification.json when the results match within sampling noise")
    sv.add_argument("dir")
    sv.add_argument("--seeds", help="only these seeds, comma-separated (default: every run)")
    sv.add_argument("--work", help="folder for the re-runs (default: a new temporary folder)")
    sv.add_argument("--quiet", action="store_true")
    sm.set_defaults(func=cmd_submission)

    e = sub.add_parser("eval", help="success rate and mean steps on a split")
    _add_config_args(e, with_method=False)
    e.add_argument("--run", help="a run folder: evaluate its checkpoint with its config (and, for complementary/"
                                 "static, guided by its own bank, read-only, and free)")
    e.add_argument("--split", default="eval")
    e.add_argument("--episodes", type=_episodes, help="episodes per env (a number, or 'all')")
    e.add_argument("--modes", type=_eval_modes, help="comma-separated eval modes: free, guided, shuffled, "
                                                     "empty (default: the run's final-eval modes; free "
                                                     "without --run)")
    e.add_argument("--out", help="write the result JSON here")
    e.add_argument("--save-run", metavar="DIR",
                   help="without --run: also write DIR (new) as an evaluation-only run folder (method "
                        "eval-only: config.yaml, versions.json, data.json, eval.json), which the leaderboard "
                        "shows as a row, e.g. for a released checkpoint this project did not train")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=cmd_eval)

    v = sub.add_parser("envs", help="list or play environments")
    vs = v.add_subparsers(dest="envs_cmd", required=True)
    vs.add_parser("list")
    pl = vs.add_parser("play")
    pl.add_argument("env")
    pl.add_argument("--task", type=int, default=0)
    pl.add_argument("--max-steps", type=int, default=50)
    v.set_defaults(func=cmd_envs)

    b = bench.add_parser(sub)            # one subcommand per benchmark, each with its own options
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("data", help="download benchmark data into the data dir ($CRL_BENCH_DATA)")
    ds = d.add_subparsers(dest="data_cmd", required=True)
    ds.add_parser("list", help="the data sets that `data download` knows (entry points of crl_bench.datasets)")
    dl = ds.add_parser("download", help="fetch a data set from its original public source and verify it")
    dl.add_argument("dataset", nargs="+", choices=dataset_names(), help="one or more data sets, in order")
    dl.add_argument("--data-dir", help="data root (default: $CRL_BENCH_DATA or ~/.cache/crl-bench/data)")
    dl.add_argument("--source", help="a local copy of one data set to use instead of the public sources "
                                     "(alfworld: an archive of the games; swebench: the parquet file; webshop: "
                                     "a folder or base URL holding its three JSON files)")
    dl.add_argument("--no-verify", action="store_true",
                    help="skip the checksum checks (only for a trusted mirror whose files differ)")
    d.set_defaults(func=cmd_data)

    w = sub.add_parser("swe", help="SWE-bench tools: task filter, local base image")
    ws = w.add_subparsers(dest="swe_cmd", required=True)
    fl = ws.add_parser("filter", help="run the base model k times per instance; keep pass rates in (low, high]")
    _add_config_args(fl, with_method=False)
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
    w.set_defaults(func=cmd_swe)

    k = sub.add_parser("bank", help="inspect the experience bank of a run")
    ks = k.add_subparsers(dest="bank_cmd", required=True)
    show = ks.add_parser("show", help="list entries with their utility counts")
    show.add_argument("run", help="run folder (or an experience.sqlite file)")
    show.add_argument("--env", help="only this env's entries, insights and reflections")
    show.add_argument("--limit", type=int, default=50)
    show.add_argument("--sort", choices=["id", "retrieved", "success", "failure", "votes", "utility"],
                      default="retrieved")
    st = ks.add_parser("stats", help="counts per env, retrievals, outcomes, operations applied and rejected, "
                                     "votes, merge passes, lineage")
    st.add_argument("run")
    k.set_defaults(func=cmd_bank)

    pn = sub.add_parser("panel", help="task panels: the evaluated task ids with a content hash each "
                                      "(docs/evaluation.md \"Task panels\")")
    pns = pn.add_subparsers(dest="panel_cmd", required=True)
    pe = pns.add_parser("export", help="write an env's eval panel (task ids, content hashes, panel hash)")
    pe.add_argument("env", help="env id")
    _add_config_args(pe, with_method=False)
    pe.add_argument("--split", default="eval", help="split (default eval)")
    pe.add_argument("--episodes", type=_episodes, help="tasks per env as in eval.episodes (default: the config's)")
    pe.add_argument("--out", help="panel file (default <env>-<split>.panel.json)")
    pe.add_argument("--quiet", action="store_true", help="no progress bar")
    pc = pns.add_parser("check", help="check that this machine's data and code reproduce a panel "
                                      "(exit 1 naming the tasks that differ)")
    pc.add_argument("panel", help="a panel file from `panel export`")
    pc.add_argument("--quiet", action="store_true", help="no progress bar")
    pn.set_defaults(func=cmd_panel)

    m = sub.add_parser("model", help="prepare the default model (convert the shipped GGUF once)")
    m.add_argument("action", choices=["prepare"])
    m.add_argument("--force", action="store_true")
    m.set_defaults(func=cmd_model)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, KeyError, FileExistsError, DataMissingError, ChecksumError, EnvUnavailableError,
            ModelNotAvailable, RunFolderError) as e:
        from crl_bench.safe_io import printable

        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"crl-bench: error: {printable(msg)}", file=sys.stderr)     # it may quote a file's text
        return 2
    except OSError as e:
        if not is_storage_error(e):
            raise
        # the disk filled up or cannot be written: one message, no chained tracebacks
        print(f"crl-bench: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
