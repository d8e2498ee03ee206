"""A run folder's lifecycle: ``crl-bench run`` (:func:`run_training`) and ``crl-bench run --resume``
(:func:`resume_training`) around the :class:`~crl_bench.trainer.loop.Trainer`.

A new run checks what it can before writing anything (:func:`preflight`), writes config.yaml and
versions.json, and removes its folder again if it fails before its first step. A resumed run verifies
and reads a checkpoint before it changes anything in the folder (docs/resume.md). Both then go
through one body: the step-0 eval, the training steps with periodic evals and checkpoints, the final
eval, the final weights and summary.json. Each holds the folder's lock throughout.

``crl-bench eval`` evaluates a saved actor again, a finished run's checkpoint with its own bank opened
read-only, or any model (:func:`evaluate_saved`), resuming an interrupted greedy evaluation at its
first unfinished mode.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from crl_bench.config import RunConfig
from crl_bench.data import data_checksums
from crl_bench.mixtures import resolve_mixture
from crl_bench.results.alarms import alert_line
from crl_bench.results.run_folder import RunLock, RunWriter, make_run_id
from crl_bench.results.tracking import open_trackers
from crl_bench.trainer.loop import Trainer


def preflight(cfg: RunConfig) -> None:
    """What can be checked before a run folder is written, so a run that cannot start writes nothing:
    the mixture resolves, the model names an existing folder or a hub id, the run has a final
    evaluation, and the output folder can be created and written.

    Raises:
        ModelNotAvailable: a model or extractor folder does not exist.
        ConfigError: ``model.dtype`` float16 with training steps (no loss scaler), a run that does not fit the
            machine's GPUs (:func:`crl_bench.trainer.memory_plan.check_before_loading`), ``eval.episodes`` is 0 (a run
            ends with the evaluation its summary.json reports;
            ``crl-bench bench step`` measures training alone), or the output folder cannot be created
            or written (names it and why).
    """
    import tempfile

    from crl_bench.config import ConfigError
    from crl_bench.llm.default_model import check_model_name

    if cfg.model.dtype == "float16" and cfg.train.steps > 0:
        raise ConfigError("model.dtype=float16 cannot train: float16 gradients of the update's per-token losses "
                          "(weights near 1 / (sequences x tokens)) underflow without a loss scaler, which the "
                          "updaters do not run; train in bfloat16 (or auto / float32); float16 serves evaluation "
                          "(crl-bench eval)")
    if cfg.eval.episodes == 0:
        raise ConfigError("eval.episodes: 0 leaves the run without the final evaluation its summary.json, "
                          "sweeps and the leaderboard report; set 1 or more (or 'all'); training alone "
                          "is timed by `crl-bench bench step`")
    resolve_mixture(cfg.rollout.mix)            # a mixture file that is missing or malformed
    check_model_name(cfg.model.name)
    if cfg.extractor.model != "same":
        check_model_name(cfg.extractor.model)
    if cfg.backend == "local":                   # on CUDA: the layout's GPU memory, before anything loads
        from crl_bench.trainer.memory_plan import check_before_loading

        check_before_loading(cfg)
    out = Path(cfg.output_dir)
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output folder {str(out)!r} cannot be created: {str(existing)!r} is a file")
    try:
        with tempfile.TemporaryDirectory(dir=existing, prefix=".crl-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"output folder {str(out)!r} cannot be written ({str(existing)!r}: "
                          f"{e.strerror or e})") from None


def run_training(cfg: RunConfig, quiet: bool = False) -> str:
    """``crl-bench run``: train for ``cfg.train.steps`` steps, evaluate, write the run folder.

    The folder gets config.yaml, versions.json, seeds.json, data.json (data checksums),
    metrics.jsonl and episodes.jsonl as the run goes, then eval.json, checkpoint/ and summary.json
    (crl_bench/results/run_folder.py). A run that fails before its first step is logged (a bad env, missing
    data or engine, a model that does not load, Ctrl-C, SIGTERM: :func:`sigterm_as_exit`) removes its
    folder again.

    Returns the run folder path.
    """
    import shutil

    if quiet:                       # also transformers' own loading/saving progress bars
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    if cfg.generation.engine == "openai":
        from crl_bench.config import ConfigError

        raise ConfigError("generation.engine=openai evaluates a model behind a server; it cannot train (there are "
                          "no weights here to update): crl-bench eval --engine openai --model NAME --base-url URL")
    if not cfg.run_id:
        cfg.run_id = make_run_id(cfg.method, cfg.rollout.mix, cfg.train.seed)
    preflight(cfg)
    created = [p for p in [Path(cfg.output_dir), *Path(cfg.output_dir).parents] if not p.exists()]
    run_dir = Path(cfg.output_dir) / cfg.run_id
    existed = run_dir.exists()          # then RunWriter refuses it, and it is not ours to remove
    lock: RunLock | None = None
    with sigterm_as_exit():
        try:
            writer = RunWriter(cfg.output_dir, cfg.run_id)
            lock = RunLock(writer.dir).acquire()    # held until summary.json is written
            writer.write_config(cfg.to_dict())
            writer.write_versions(model=cfg.model.name, dtype=cfg.model.dtype)
            _train_in_folder(cfg, writer, quiet)
        except BaseException:
            # the writer and trainer are closed by now (trackers' files may live in the folder removed below)
            metrics = run_dir / "metrics.jsonl"
            started = metrics.is_file() and metrics.stat().st_size > 0
            if not started and not existed:     # a run that never started leaves nothing behind
                if lock is not None:
                    lock.release()
                shutil.rmtree(run_dir, ignore_errors=True)
                for folder in created:  # innermost first: the output folders made for it, if still empty
                    try:
                        folder.rmdir()
                    except OSError:
                        break
            if lock is not None:
                lock.release()
            raise
        from crl_bench.results.summary import write_summary
        try:
            write_summary(writer.dir)
        finally:
            lock.release()
    return str(writer.dir)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While inside, SIGTERM raises ``SystemExit(143)`` in the main thread instead of ending the process
    at once, so the ``except``/``finally`` blocks run: a run killed while it starts removes its half-made
    folder, one killed later closes its files and keeps the folder for ``--resume``. Off the main
    thread (where Python cannot set handlers) nothing changes. The previous handler is restored."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _train_in_folder(cfg: RunConfig, writer: RunWriter, quiet: bool, resumed: bool = False,
                     loaded: Any = None) -> None:
    """The one body of :func:`run_training` and :func:`resume_training`, once the folder is ready:
    trackers, the trainer, then (resumed) the checkpoint's states or (new) seeds.json and data.json,
    then :func:`_train_and_evaluate`. The writer and the trainer are closed when it returns or raises.

    Args:
        resumed: the folder is an existing run's (no seeds.json / data.json written again).
        loaded: the :class:`~crl_bench.trainer.checkpoint.LoadedCheckpoint` a resumed run continues
            from, or ``None`` (a new run, or a resumed one with no checkpoint: it starts over).
    """
    from crl_bench.trainer.checkpoint import apply_checkpoint

    trainer: Trainer | None = None
    try:
        writer.attach_trackers(open_trackers(cfg.logging, writer.dir, cfg.run_id, cfg.to_dict()))
        trainer = Trainer(cfg, writer)
        initial = None
        if not resumed:
            writer.write_json("seeds.json", {"seed": cfg.train.seed, "task_sampler_seed": cfg.train.seed,
                                             "torch_seed": cfg.train.seed, "torch_threads": trainer.threads})
            writer.write_json("data.json", {"data_checksums": data_checksums(trainer.data_files)})
        else:
            if loaded is not None:
                apply_checkpoint(trainer, loaded)
                loaded.states.clear()           # the trainer holds them now
                initial = initial_eval(writer.dir)
            if not quiet:
                print(f"resuming {writer.dir} at step {trainer.step} of {cfg.train.steps}"
                      + (f" ({loaded.path.name})" if loaded else " (no checkpoint: starting over)"), flush=True)
        _train_and_evaluate(cfg, trainer, writer, quiet, initial=initial)
    finally:
        writer.close()
        if trainer is not None:
            trainer.close()


def _train_and_evaluate(cfg: RunConfig, trainer: Trainer, writer: RunWriter, quiet: bool,
                        initial: dict[str, Any] | None = None) -> None:
    """The body of :func:`run_training` and :func:`resume_training`: the step-0 eval, the steps from
    ``trainer.step`` on with periodic evals and resumable checkpoints, the final eval and checkpoint.
    ``initial``: the step-0 eval of a resumed run (read back from metrics.jsonl)."""
    from tqdm import tqdm

    from crl_bench.trainer.checkpoint import save_checkpoint

    def checkpoint() -> None:
        if cfg.train.checkpoint_every:
            save_checkpoint(trainer, writer.dir, keep=cfg.train.keep_checkpoints)

    per_step = cfg.train.groups_per_step * cfg.train.group_size
    if cfg.eval.at_start and trainer.step == 0 and initial is None:
        # the untrained actor on the same tasks and protocol as the final eval (the step-0 point of
        # the eval curve); a method with a bank has nothing in it yet, so this is experience-free
        with tqdm(total=sum(map(len, trainer.evaluator.task_ids().values())), desc="eval (step 0)",
                  unit="ep", disable=quiet, leave=False, smoothing=0) as bar:
            initial = trainer.evaluator.evaluate(progress=bar.update, guided=False)
        writer.log_metrics({"step": 0, "eval": {"free": initial}, **trainer.peaks.take()})
        if not quiet:
            print(f"eval at step 0 ({cfg.eval.split}, free): success {initial['success_rate']:.3f}  "
                  f"over {initial['episodes']} episodes", flush=True)
        checkpoint()                    # a kill during step 1 does not cost the step-0 eval again
    walls: list[float] = []             # wall seconds of this process's steps (evals, checkpoints in)
    while trainer.step < cfg.train.steps:
        t_step = time.perf_counter()
        with tqdm(total=per_step, desc=f"step {trainer.step + 1}/{cfg.train.steps} rollout"
                  + progress_note(walls, cfg.train.steps - trainer.step), unit="ep", disable=quiet,
                  leave=False) as bar:
            res = trainer.train_step(progress=bar.update)
        writer.log_metrics(res.metrics)
        writer.log_episodes(res.metrics["step"], res.trajectories, cfg.logging.transcripts)
        if not quiet:
            print(step_line(res.metrics), flush=True)
            for alert in res.metrics.get("alerts", ()):
                print(alert_line(alert), flush=True)
        if cfg.eval.every and trainer.step % cfg.eval.every == 0 and trainer.step < cfg.train.steps:
            trainer.prepare_step()      # released order: flush and merge pass, then the evaluation
            ev = trainer.evaluator.evaluate()
            writer.log_metrics({"step": trainer.step, "eval": ev, **trainer.peaks.take()})
        if cfg.train.checkpoint_every and (trainer.step % cfg.train.checkpoint_every == 0
                                           or trainer.step == cfg.train.steps):
            checkpoint()
        walls.append(time.perf_counter() - t_step)
        if not quiet and trainer.step < cfg.train.steps:
            print(f"  {progress_note(walls, cfg.train.steps - trainer.step).strip(' ()')}", flush=True)
    # training is over and its resumable state is on disk: the final evaluation runs without the
    # optimisers' moments resident (about 1.1 GB per trainable 135M model)
    trainer.release_training_state()
    # one stream of every mode's episodes: they end steadily, so the bar's rate (averaged since the start,
    # smoothing=0) and ETA are the stream's
    journal = final_eval_journal(trainer, writer.dir)
    try:
        kept = journal.count(trainer.evaluator.modes) if journal is not None else 0
        if kept and not quiet:
            print(f"resuming the final evaluation: {kept} episode(s) already evaluated ({journal.path.name})",
                  flush=True)
        with tqdm(total=trainer.evaluator.episode_count() - kept, desc="eval", unit="ep", disable=quiet,
                  leave=False, smoothing=0) as bar:
            ev = trainer.evaluator.evaluate_all(progress=bar.update, journal=journal)
    finally:
        if journal is not None:
            journal.close()
    if initial is not None:
        ev["initial"] = {"step": 0, "free": initial}
    writer.write_json("eval.json", ev)
    if journal is not None:
        journal.close(remove=True)          # eval.json holds every episode's outcome now
    writer.log_to_trackers({"step": trainer.step, "eval": {m: ev[m] for m in trainer.evaluator.modes if m in ev}})
    if not quiet:
        for mode in trainer.evaluator.modes:
            if mode in ev:
                e = ev[mode]
                print(f"eval ({cfg.eval.split}, {mode}): success {e['success_rate']:.3f}  steps {e['steps_mean']:.1f}  "
                      f"invalid {e['invalid_action_rate']:.3f}  over {e['episodes']} episodes", flush=True)
    if cfg.train.save_checkpoint:
        save_final_weights(trainer, writer.dir)


FINAL_EVAL_JOURNAL = "eval.json.episodes.jsonl"
"""The run's final evaluation's episode journal, removed once ``eval.json`` is written."""


def final_eval_journal(trainer: Trainer, run_dir: Path) -> Any:
    """The episode journal (:class:`~crl_bench.trainer.eval_journal.EpisodeJournal`) of the run's final
    evaluation, so that a run killed during it and resumed rolls out only the episodes it had not
    finished; ``None`` where the run has no checkpoint of its final step (``train.checkpoint_every: 0``)
    or evaluates with ``eval.trials`` > 1 (attempts depend on each other), and then the evaluation runs
    whole as before.

    The key is the final step's checkpoint (its name and every file's sha256 from its meta.json: the
    weights, optimiser and bank copy the evaluation starts from) and the evaluation's protocol, so a
    journal is used only by a resume from that same checkpoint; any other key moves it aside
    (``<path>.stale-<hash>``, kept). A resumed greedy episode is the one the uninterrupted evaluation
    would have played wherever the engine's replies do not depend on the batch (trainer/eval_journal.py);
    each mode's block counts the kept episodes (``resumed_episodes``)."""
    from crl_bench.trainer.checkpoint import CHECKPOINTS, checkpoint_name
    from crl_bench.trainer.eval_journal import EpisodeJournal

    if trainer.cfg.eval.trials != 1:
        return None
    ckpt = Path(run_dir) / CHECKPOINTS / checkpoint_name(int(trainer.step))
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        return None
    key = {"final_eval_of": ckpt.name, "files": meta["files"], "config_sha256": meta.get("config_sha256"),
           "protocol": trainer.evaluator.protocol()}
    return EpisodeJournal(Path(run_dir) / FINAL_EVAL_JOURNAL, key)     # hashed as JSON there


FINAL_WEIGHTS = "checkpoint"
"""The run folder's final weights (``save_pretrained``), written whole or not at all."""


def save_final_weights(trainer: Trainer, run_dir: Path) -> Path:
    """``trainer.save_checkpoint`` into ``run_dir/.checkpoint.tmp``, then renamed to
    ``run_dir/checkpoint``: a kill mid-save leaves no ``checkpoint/`` folder, never a partial one
    (``resume_training`` then saves again). Returns the folder."""
    import shutil

    final, tmp = run_dir / FINAL_WEIGHTS, run_dir / f".{FINAL_WEIGHTS}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.save_checkpoint(str(tmp))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def initial_eval(run_dir: str | Path) -> dict[str, Any] | None:
    """The step-0 eval row's ``free`` block of a run folder's metrics.jsonl, or ``None``."""
    from crl_bench.results.run_folder import iter_metrics

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    for _, row in iter_metrics(path):
        if row.get("step") == 0 and isinstance(row.get("eval"), dict) and "free" in row["eval"]:
            return row["eval"]["free"]
    return None


def run_finished_but_summary(run_dir: Path, cfg: RunConfig) -> bool:
    """Whether a run folder holds everything of a finished run except summary.json: a readable
    eval.json and, when the run saves them, its final weights (``checkpoint/``, written whole or not
    at all by :func:`save_final_weights`). A kill during :func:`~crl_bench.results.summary.write_summary`
    leaves such a folder; resuming it only writes the summary."""
    try:
        ev = json.loads((run_dir / "eval.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(ev, dict):
        return False
    return not cfg.train.save_checkpoint or (run_dir / FINAL_WEIGHTS).is_dir()


def resume_training(run_dir: str | Path, quiet: bool = False, start_over: bool = False,
                    allow_config_change: bool = False) -> str:
    """``crl-bench run --resume RUN_DIR``: continue a run that was stopped or killed (kill -9
    included) from its newest usable checkpoint (trainer/checkpoint.py), with the configuration in
    its config.yaml, into the same folder.

    Nothing in the folder changes until the checkpoint it continues from has been verified (sizes and
    sha256 recorded at save time) and read into memory: a newest checkpoint that fails is skipped with
    a warning (on stderr and in versions.json) for the previous one, and newer unusable folders are
    then moved aside to ``checkpoints/.unusable-step-<N>-<time>`` (kept, never deleted). Only then are
    the logs cut back to the checkpoint, the bank replaced by its copy, and a stale eval.json or
    partial final save removed. A folder that finished all but its summary.json only gets the summary.
    A folder without any checkpoint folder starts over. The run holds the folder's lock
    (:class:`~crl_bench.results.run_folder.RunLock`) throughout.

    The run then finishes as :func:`run_training` would: the remaining steps, the final eval,
    ``checkpoint/`` and summary.json. versions.json gets a ``resumed`` list (time, step resumed
    from, skipped checkpoints, git commit). Returns the run folder.

    Args:
        start_over: with checkpoint folders of which none is usable, start the run over (logs
            emptied, bank removed, the unusable folders moved aside) instead of refusing.
        allow_config_change: accept a config.yaml whose hash differs from the one the checkpoint
            recorded (the change is recorded in versions.json).

    Raises:
        ConfigError: ``run_dir`` is not a run folder (no config.yaml), its config is invalid, or it
            already finished (summary.json is there).
        RunInUseError: another process holds the folder.
        RunFolderError: checkpoint folders exist but none is usable (without ``start_over``; each
            reason is listed), config.yaml changed since the checkpoint (without
            ``allow_config_change``), or its ``train.steps`` is below the checkpoint's step.
        CheckpointError: the chosen checkpoint does not fit the trainer built from config.yaml.
    """
    import shutil
    import sys

    from crl_bench.config import ConfigError, build_config, load_yaml
    from crl_bench.results.run_folder import RunFolderError
    from crl_bench.results.summary import write_summary
    from crl_bench.trainer.checkpoint import config_sha256, restore_run_files, select_checkpoint

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {str(run_dir)!r} is not a run folder (no config.yaml)")
    with RunLock(run_dir):
        if (run_dir / "summary.json").is_file():
            raise ConfigError(f"--resume {str(run_dir)!r} finished already (summary.json is there); "
                              "nothing to resume")
        data = load_yaml(run_dir / "config.yaml", "run config")
        for key in ("output_dir", "run_id"):     # the folder exists: its own path and name decide
            data.pop(key, None)
        cfg = build_config([data])
        cfg.output_dir, cfg.run_id = str(run_dir.parent), run_dir.name
        for tmp in run_dir.glob(".*.tmp"):       # a write the kill cut short (the real file is whole or absent)
            if tmp.is_file():
                tmp.unlink()
        if run_finished_but_summary(run_dir, cfg):
            write_summary(run_dir)
            if not quiet:
                print(f"{run_dir} had finished training and evaluation; wrote its summary.json", flush=True)
            return str(run_dir)

        # ---- choose and read the checkpoint: nothing below this line changes the folder until it is read
        loaded, skipped = select_checkpoint(run_dir, cfg.method)
        if loaded is None and skipped and not start_over:
            reasons = "\n".join(f"  {p.name}: {why}" for p, why in skipped)
            raise RunFolderError(
                f"--resume {str(run_dir)!r}: no usable checkpoint; the folder is left as it was\n{reasons}\n"
                "pass --start-over to train it again from step 0 (the unusable checkpoint folders are "
                "kept under checkpoints/.unusable-*)")
        changed = False
        if loaded is not None:
            if loaded.step > cfg.train.steps:
                raise RunFolderError(
                    f"--resume {str(run_dir)!r}: config.yaml has train.steps {cfg.train.steps}, but the run "
                    f"is at step {loaded.step} ({loaded.path.name}); set train.steps >= {loaded.step}")
            want, now = loaded.meta.get("config_sha256"), config_sha256(run_dir)
            changed = want is not None and want != now
            if changed and not allow_config_change:
                raise RunFolderError(
                    f"--resume {str(run_dir)!r}: config.yaml differs from the one {loaded.path.name} was "
                    "trained with (its sha256 is recorded in meta.json); restore it, or pass "
                    "--allow-config-change to continue with the edited settings")
        for folder, why in skipped:
            print(f"crl-bench: warning: skipping {folder}: {why}", file=sys.stderr, flush=True)

        # ---- the checkpoint is read: now the folder is put back to how it was when it was taken
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for folder, _ in skipped:
            folder.rename(folder.with_name(f".unusable-{folder.name}-{stamp}"))
        restore_run_files(run_dir, loaded.path if loaded else None, cfg.method_spec.uses_experience)
        for stale in ("eval.json", FINAL_WEIGHTS, f".{FINAL_WEIGHTS}.tmp"):   # a kill during the final eval or save
            p = run_dir / stale
            if p.is_dir():
                shutil.rmtree(p)
            elif p.is_file():
                p.unlink()
        writer = RunWriter.reopen(run_dir)
        writer.record_resume(loaded.step if loaded else 0,
                             skipped=[{"checkpoint": p.name, "reason": why} for p, why in skipped],
                             config_changed=changed)
        _train_in_folder(cfg, writer, quiet, resumed=True, loaded=loaded)
        write_summary(writer.dir)
    return str(writer.dir)


def format_duration(seconds: float) -> str:
    """``seconds`` as a short human duration: ``45 s``, ``12 min``, ``3.4 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def progress_note(walls: list[float], remaining: int) -> str:
    """`` (last step S, ETA T)`` for a progress line: the last step's wall time and the time the
    ``remaining`` steps take at the mean of ``walls`` (this process's step wall times, evaluations and
    checkpoints included; the final evaluation is not); ``""`` before the first step."""
    if not walls:
        return ""
    eta = sum(walls) / len(walls) * remaining
    return f" (last step {format_duration(walls[-1])}, ETA {format_duration(eta)} for {remaining} more)"


def step_line(m: dict[str, Any]) -> str:
    """One console line for a step's metrics row."""
    return (f"step {m['step']}{' (warm-up)' if m.get('warmup') else ''}: success {m['success_rate']:.2f}  "
            f"reward {m['reward_mean']:.2f}  steps {m['steps_mean']:.1f}  invalid {m['invalid_action_rate']:.2f}  "
            f"loss {m.get('loss', 0.0):.4f}"
            + (f"  entropy {m['reply_entropy']:.2f}" if "reply_entropy" in m else "")
            + f"  {m['tokens_per_s']:.1f} tok/s  {m['time_step_s']:.1f}s"
            + (f"  | guided {m['success_rate/guided']:.2f} free {m['success_rate/free']:.2f}  "
               + (f"reflections {m['reflections']}" if "reflections" in m else f"bank {m['bank_size']}")
               if "bank_size" in m else "")
            + (f"  extractor update {m['extractor_update']}: reward {m['extractor_reward_mean']:.2f} "
               f"loss {m['extractor_loss']:.4f}" if "extractor_update" in m else ""))


# ---- an evaluation of a saved actor (crl-bench eval) -------------------------------------------------


def partial_eval_key(cfg: RunConfig, model: str | None, bank: Path | None, ev: dict[str, Any]) -> dict[str, Any]:
    """What an evaluation's finished modes depend on, as JSON data: its settings (``cfg.to_dict()``),
    model name, method, run and protocol (``ev`` so far), and the path, size and modification time
    (ns) of each file of the model folder (when ``model`` is a local path) and of the bank with its
    write-ahead log. Equal keys mean :func:`evaluate_saved` may keep a partial file's modes."""
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


def partial_eval_modes(partial: Path, key: dict[str, Any]) -> dict[str, Any]:
    """The finished modes (``{mode: result block}``) that ``partial`` holds for an evaluation with
    ``key`` (:func:`partial_eval_key`); ``{}`` when there is no such file, or it is unreadable or
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


def evaluate_saved(cfg: RunConfig, *, bank: Path | None = None, modes: Sequence[str] | None = None,
                   partial: Path | None = None, journal: Path | None = None, model_key: str | None = None,
                   run: str | None = None, where: str = "",
                   quiet: bool = False) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """Evaluate the actor ``cfg.model.name`` (a finished run's checkpoint, or any model) on
    ``cfg.eval``'s split: what ``crl-bench eval`` runs.

    Args:
        cfg: the resolved settings (the run's own config for a run).
        bank: the run's ``experience.sqlite``, opened read-only (no entry, counter or file changes);
            ``None``: no bank, only ``free`` can be evaluated.
        modes: the eval modes, in order (default: the method's final-evaluation modes with a bank,
            else ``free``).
        partial: with a greedy evaluation, a file that keeps each finished mode (with
            :func:`partial_eval_key`) so that the same evaluation run again evaluates only the modes
            it had not finished; ``None``: always run whole.
        journal: a file that keeps each finished episode (greedy or sampled,
            :class:`~crl_bench.trainer.eval_journal.EpisodeJournal`, with the same key), so that the
            same evaluation run again rolls out only the episodes it had not finished; removed by the
            caller once the result is written. ``None``: no episode is kept.
        model_key: the model as given (a local folder is part of the partial file's key).
        run: the run folder, recorded in the result.
        where: what the errors name (e.g. ``--run 'RUN'``).
        quiet: no progress bar.

    Returns:
        ``(ev, data_files)``: ``{"model", "method", "run", "protocol", MODE: block...}`` (blocks as
        :meth:`~crl_bench.trainer.evaluation.Evaluator.evaluate`) and the data files each env read (for checksums).

    Raises:
        ConfigError: the bank is not a bank, unreadable, filled with another embedder, or a mode
            other than ``free`` was asked without a bank.
    """
    from tqdm import tqdm

    from crl_bench.config import ConfigError
    from crl_bench.experience.bank import EmbeddingDimError, ExperienceBank, NotABankError
    from crl_bench.results.summary import write_json_atomic

    if bank is not None:
        try:                            # checked before the models load: a bad bank fails at once
            ExperienceBank.stored_dim(bank)
        except NotABankError as e:
            raise ConfigError(f"{where}: {e}") from None
    try:
        trainer = Trainer(cfg, writer=None, read_only_bank=bank)
    except NotABankError as e:          # unreadable past its header (corrupt pages, bad embeddings)
        raise ConfigError(f"{where}: {e}") from None
    except EmbeddingDimError as e:      # the bank was filled with another experience.embedder
        raise ConfigError(f"{where}: {e}; evaluate with the run's own experience.embedder "
                          f"({cfg.experience.embedder!r} is set here)") from None
    served = cfg.generation.engine == "openai"
    ev: dict[str, Any] = {"model": cfg.generation.openai_model if served else cfg.model.name, "method": cfg.method,
                          "run": run}
    episodes = None
    try:
        evaluator = trainer.evaluator
        modes = list(evaluator.modes if bank is not None else ["free"]) if modes is None else list(modes)
        if bank is None and any(m != "free" for m in modes):
            raise ConfigError(f"--modes {','.join(modes)}: only 'free' can be evaluated without a run's "
                              "experience bank (--run RUN of a method with experience)")
        ev["protocol"] = evaluator.protocol()
        data_files = trainer.data_files
        key: dict[str, Any] = {}
        done: dict[str, Any] = {}
        if partial is not None or journal is not None:
            key = partial_eval_key(cfg, model_key, bank, ev)
        if partial is not None:
            done = partial_eval_modes(partial, key)
        if journal is not None:
            from crl_bench.trainer.eval_journal import EpisodeJournal

            episodes = EpisodeJournal(journal, key)
        if done and any(m in done for m in modes):
            print(f"resuming from {partial}: {', '.join(m for m in modes if m in done)} already evaluated",
                  file=sys.stderr)
        todo = [m for m in modes if m not in done]
        resumed = episodes.count(todo) if episodes is not None and cfg.eval.trials == 1 else 0
        if resumed:
            print(f"resuming from {journal}: {resumed} episode(s) already evaluated", file=sys.stderr)
        for mode in modes:
            if mode in done:
                ev[mode] = done[mode]

        def finished(mode: str, block: dict[str, Any]) -> None:
            ev[mode] = block
            if partial is not None:         # a mode is kept as soon as its last episode has ended
                write_json_atomic(partial, {"key": key, "modes": {**done, **{m: ev[m] for m in modes if m in ev}}})

        # the modes still to evaluate run as one stream (docs/evaluation.md "One stream"); the bar
        # counts only its episodes, so its rate and ETA are of this run
        with tqdm(total=evaluator.episode_count(modes=todo) - resumed, desc=f"eval {cfg.eval.split}", unit="ep",
                  disable=quiet or not todo, smoothing=0) as bar:
            if todo:
                evaluator.evaluate_modes(todo, progress=bar.update, on_mode=finished, journal=episodes)
        ev.update({m: ev.pop(m) for m in modes})    # the modes in the order asked
        if served:                                  # requests, tokens and latency of this evaluation
            g = cfg.generation
            ev["served"] = {"engine": "openai", "model": g.openai_model, "api": g.openai_api,
                            "base_url": g.openai_base_url, **trainer.engine.stats.summary()}
    finally:
        if episodes is not None:
            episodes.close()
        trainer.close()
    return ev, data_files
