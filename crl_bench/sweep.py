"""``crl-bench sweep``: a grid of runs (methods x seeds) on one mix and preset, one after another.

Layout of a sweep folder (``results/sweeps/<name>/`` by default)::

    sweep.yaml        the grid: mix, preset, config file, model, steps, --set overrides, methods, seeds
    runs/<method>-s<seed>/   one ordinary run folder per cell (crl_bench/results/run_folder.py)
    configs/<method>-s<seed>.yaml   the resolved config each cell ran with
    logs/<method>-s<seed>.log       each cell's console output

Each cell runs as its own ``crl-bench run`` process (:func:`run_in_subprocess`).

A cell is finished when its run folder holds ``summary.json`` (written last by ``run_training``).
Rerunning the same command skips finished cells and continues unfinished ones: a run killed mid-way
leaves a folder without ``summary.json``; when it holds checkpoint folders
(``train.checkpoint_every``, trainer/checkpoint.py) or its final eval.json, the cell goes on with
``crl-bench run --resume`` (which verifies the checkpoint and stops the sweep, exit 2, when none is
usable, leaving the folder as it is), otherwise the folder is removed and the cell starts from
scratch. A folder another process holds (its lock, crl_bench/results/run_folder.py ``RunLock``) is never
touched: the cell is reported as failed and the others go on. So a sweep resumes after a kill,
losing at most the steps since each cell's last checkpoint. Methods and
seeds may be extended on a rerun; the rest of the grid (mix, preset, config, model, steps, overrides)
must match ``sweep.yaml`` or the sweep refuses to mix them.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from crl_bench.config import ConfigError, RunConfig
from crl_bench.data import ChecksumError, DataMissingError
from crl_bench.env_api import EnvUnavailableError

#: Errors of the machine's setup, not of one run: they stop the sweep (the CLI exits 2).
SETUP_ERRORS = (ConfigError, EnvUnavailableError, DataMissingError, ChecksumError)

#: The keys of sweep.yaml that define what a cell computes (methods and seeds may grow).
GRID_KEYS = ("mix", "preset", "config", "model", "steps", "set", "profile", "draws")


@dataclass
class SweepSpec:
    """The grid of one sweep.

    Attributes:
        methods: method names, e.g. ``["grpo", "static", "complementary"]``.
        seeds: run seeds, e.g. ``[0, 1, 2]``.
        mix: env id, mixture name or file (as ``crl-bench run --mix``).
        preset: preset name.
        config: optional YAML config file layered after the preset.
        model: optional actor model name or path.
        steps: optional training steps (overrides the preset).
        sets: ``section.key=value`` overrides, applied last, in order.
        profile: optional evaluation protocol profile (``--profile``).
        draws: optional sampled-worker draw size (``--draws``).
    """

    methods: list[str]
    seeds: list[int]
    mix: str
    preset: str = "default"
    config: str | None = None
    model: str | None = None
    steps: int | None = None
    sets: list[str] = field(default_factory=list)
    profile: str | None = None
    draws: int | None = None

    def grid(self) -> dict[str, Any]:
        """What must match between runs of one sweep folder (``profile`` and ``draws`` only when set,
        so the ``sweep.yaml`` of a sweep without them is unchanged)."""
        return {"mix": self.mix, "preset": self.preset, "config": self.config, "model": self.model,
                "steps": self.steps, "set": list(self.sets),
                **({"profile": self.profile} if self.profile else {}),
                **({"draws": self.draws} if self.draws is not None else {})}

    def default_name(self) -> str:
        """``<mix>-<preset>`` (file-name safe), plus a short hash of the other grid settings if any."""
        mix = Path(self.mix).stem if self.mix.endswith((".yaml", ".yml")) else self.mix
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{mix}-{self.preset}")
        extra = {k: v for k, v in self.grid().items() if k not in ("mix", "preset") and v}
        if extra:
            name += "-" + hashlib.sha1(json.dumps(extra, sort_keys=True).encode()).hexdigest()[:8]
        return name


def cell_id(method: str, seed: int) -> str:
    """Run folder name of one cell: ``<method>-s<seed>``."""
    return f"{method}-s{seed}"


def is_finished(run_dir: Path) -> bool:
    """A run folder is finished when it holds ``summary.json``."""
    return (run_dir / "summary.json").is_file()


def prepare_sweep_dir(spec: SweepSpec, root: str | Path, name: str | None = None) -> Path:
    """Create (or reopen) the sweep folder and write/check ``sweep.yaml``.

    Raises:
        ConfigError: the folder holds a sweep with a different grid (names the differing keys).
    """
    path = Path(root) / (name or spec.default_name())
    meta = path / "sweep.yaml"
    grid = spec.grid()
    if meta.is_file():
        try:
            old = yaml.safe_load(meta.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{meta} is not valid YAML: {e}") from None
        differing = [k for k in GRID_KEYS if old.get(k) != grid.get(k)]
        if differing:
            raise ConfigError(f"sweep folder {path} holds a different grid ({', '.join(differing)} differ: "
                              f"{ {k: old.get(k) for k in differing} } there); use another --name")
        methods = list(dict.fromkeys(list(old.get("methods") or []) + spec.methods))
        seeds = list(dict.fromkeys(list(old.get("seeds") or []) + spec.seeds))
    else:
        methods, seeds = spec.methods, spec.seeds
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / ".sweep.yaml.tmp"
    tmp.write_text(yaml.safe_dump({**grid, "methods": methods, "seeds": seeds}, sort_keys=False))
    tmp.replace(meta)
    return path


def run_sweep(spec: SweepSpec, root: str | Path, resolve: Callable[[str, int], RunConfig],
              name: str | None = None, quiet: bool = True, print_fn: Callable[[str], None] = print,
              train: Callable[..., str] | None = None) -> tuple[Path, list[tuple[str, int, str]]]:
    """Run every (method, seed) cell not yet finished, in order (methods outer, seeds inner).

    Args:
        spec: the grid.
        root: folder of sweeps (``results/sweeps``).
        resolve: ``(method, seed) -> RunConfig`` (the CLI's layering of preset, config, flags, --set).
            Every cell is resolved before the first run starts, so a bad setting fails at once.
        name: sweep folder name (default :meth:`SweepSpec.default_name`).
        quiet: hide each run's per-step lines.
        print_fn: where progress lines go.
        train: ``(cfg, quiet=..., resume=...) -> run folder``; default :func:`run_in_subprocess` (each
            run its own ``crl-bench run`` process; ``resume``: continue the cell's folder from its
            newest checkpoint); tests pass a stand-in.

    Returns:
        ``(sweep folder, failures)`` with one ``(method, seed, error)`` per cell that raised; a
        failed cell does not stop the others and is retried on the next call.

    Raises:
        ConfigError: a cell's configuration is invalid, the folder holds another grid, or another sweep
            process runs this folder now (the folder's lock: each cell's log and run folder have one writer).
        EnvUnavailableError, DataMissingError, ChecksumError: the machine lacks an env's engine or
            data (every cell would fail alike); cells finished so far stay finished.
    """
    if train is None:
        train = run_in_subprocess
    if not spec.methods or not spec.seeds:
        raise ConfigError("sweep: --methods and --seeds must each name at least one value")
    cells = [(m, s) for m in spec.methods for s in spec.seeds]
    configs = {(m, s): resolve(m, s) for m, s in cells}
    path = prepare_sweep_dir(spec, root, name)
    from crl_bench.results.run_folder import RunInUseError, RunLock

    lock = RunLock(path)                # one sweep process per sweep folder: cells' logs and folders are its own
    try:
        lock.acquire()
    except RunInUseError as e:
        who = f"PID {e.pid}" if e.pid is not None else "another process"
        raise ConfigError(f"sweep folder {str(path)!r} is being run by {who} (a sweep of the same name); wait for "
                          "it to end, or give this one another --name") from None
    try:
        return path, _run_cells(cells, configs, path, quiet, print_fn, train)
    finally:
        lock.release()


def _run_cells(cells: list[tuple[str, int]], configs: dict[tuple[str, int], RunConfig], path: Path, quiet: bool,
               print_fn: Callable[[str], None], train: Callable[..., str]) -> list[tuple[str, int, str]]:
    """:func:`run_sweep`'s loop over the cells, under the sweep folder's lock; the failures."""
    runs = path / "runs"
    failures: list[tuple[str, int, str]] = []
    for i, (method, seed) in enumerate(cells, 1):
        head = f"[{i}/{len(cells)}] {method} seed {seed}"
        run_dir = runs / cell_id(method, seed)
        if is_finished(run_dir):
            print_fn(f"{head}: finished earlier, skipped ({run_dir})")
            continue
        cfg = configs[(method, seed)]
        cfg.output_dir, cfg.run_id = str(runs), cell_id(method, seed)
        resume = False
        if run_dir.exists():
            from crl_bench.results.run_folder import RunInUseError, RunLock
            from crl_bench.trainer.checkpoint import checkpoint_folders

            try:
                # held while the folder is inspected (and removed), so a live run is never touched;
                # released before the cell's own process takes it
                with RunLock(run_dir):
                    has_config = (run_dir / "config.yaml").is_file()
                    folders = checkpoint_folders(run_dir) if has_config else []
                    if folders or (has_config and (run_dir / "eval.json").is_file()):
                        what = f"from {folders[0].name}" if folders else "to write its summary"
                        print_fn(f"{head}: unfinished folder from an interrupted sweep, resuming it {what}")
                        resume = True
                    else:
                        print_fn(f"{head}: unfinished folder from an interrupted sweep without a checkpoint, "
                                 "restarting it")
                        shutil.rmtree(run_dir)
            except RunInUseError as e:
                failures.append((method, seed, f"{type(e).__name__}: {e}"))
                print_fn(f"{head}: skipped: {e}")
                continue
        if not resume:
            print_fn(f"{head}: running ({cfg.train.steps} steps) ...")
        t0 = time.perf_counter()
        try:
            out = train(cfg, quiet=quiet, resume=resume)
        except (KeyboardInterrupt, SystemExit, *SETUP_ERRORS):
            raise                   # a missing engine or data set would fail every cell the same way
        except Exception as e:  # noqa: BLE001 - one failed cell must not lose the others
            failures.append((method, seed, f"{type(e).__name__}: {e}"))
            print_fn(f"{head}: FAILED after {time.perf_counter() - t0:.0f} s: {type(e).__name__}: {e}")
            continue
        print_fn(f"{head}: done in {time.perf_counter() - t0:.0f} s, {eval_line(Path(out))} ({out})")
    return failures


class RunFailed(RuntimeError):
    """A sweep cell's ``crl-bench run`` process exited non-zero (the message ends with its log's tail)."""


def run_in_subprocess(cfg: RunConfig, quiet: bool = True, resume: bool = False) -> str:
    """Run one cell as its own ``crl-bench run`` process and return its run folder.

    The resolved configuration is written to ``<sweep>/configs/<run-id>.yaml`` and run with
    ``--config`` (a full config overrides every preset key), so a crash, a kill or a leak of one run
    cannot take the sweep down and every run starts from a fresh interpreter. With ``resume`` the
    process is ``crl-bench run --resume <run folder>`` instead (the folder's own config.yaml). With
    ``quiet`` the run's output goes to ``<sweep>/logs/<run-id>.log`` (appended to when resuming);
    otherwise it streams to the console. The process starts with ``python -P`` (Python 3.11+, the
    project's minimum): the current folder is not put first on ``sys.path``, so a file there named
    like a module (``argparse.py``) is never imported in place of it; the cell imports only the
    installed package and the standard library.

    Raises:
        ConfigError: the run exited 2 (bad setting, missing engine or data: every cell would fail).
        RunFailed: any other non-zero exit, with the last lines of its log.
    """
    import subprocess
    import sys

    runs = Path(cfg.output_dir)
    sweep = runs.parent
    cfg_file = sweep / "configs" / f"{cfg.run_id}.yaml"
    cfg_file.parent.mkdir(parents=True, exist_ok=True)
    cfg_file.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    if resume:
        cmd = [sys.executable, "-P", "-m", "crl_bench.cli", "run", "--resume", str(runs / cfg.run_id)]
    else:
        cmd = [sys.executable, "-P", "-m", "crl_bench.cli", "run", "--config", str(cfg_file), "--method", cfg.method,
               "--output-dir", str(runs), "--run-id", cfg.run_id]
    cmd += ["--quiet"] if quiet else []
    if quiet:
        log = sweep / "logs" / f"{cfg.run_id}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a" if resume else "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-5:])
    else:
        rc, tail = subprocess.run(cmd).returncode, "(output above)"
    if rc == 2:
        raise ConfigError(f"crl-bench run of {cfg.run_id} stopped (exit 2): {tail}")
    if rc != 0:
        raise RunFailed(f"crl-bench run of {cfg.run_id} exited {rc}: {tail}")
    return str(runs / cfg.run_id)


def eval_line(run_dir: Path) -> str:
    """``eval free 0.250 guided 0.300`` from a run folder's eval.json (empty if none)."""
    p = run_dir / "eval.json"
    if not p.is_file():
        return "no eval.json"
    ev = json.loads(p.read_text())
    parts = [f"{mode} {ev[mode]['success_rate']:.3f}" for mode in ("free", "guided") if isinstance(ev.get(mode), dict)]
    return "eval success " + " ".join(parts) if parts else "eval.json without results"


def parse_list(text: str, kind: type, what: str) -> list[Any]:
    """``"a,b"`` -> ``["a", "b"]`` (``kind`` int for seeds). Raises ConfigError naming ``what``."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        out = [kind(t) for t in items]
    except ValueError:
        raise ConfigError(f"--{what}: expected a comma-separated list of {kind.__name__}s, got {text!r}") from None
    if not out:
        raise ConfigError(f"--{what}: empty list")
    if len(set(out)) != len(out):
        raise ConfigError(f"--{what}: repeated values in {text!r}")
    return out


def describe(spec: SweepSpec) -> Sequence[str]:
    """Human-readable lines for the start of a sweep."""
    return [f"sweep: {len(spec.methods)} methods x {len(spec.seeds)} seeds on {spec.mix} (preset {spec.preset})"]


def seeds_needed_lines(paths: Sequence[str | Path], effect: float = 0.05) -> list[str]:
    """The seeds a sweep needs (crl_bench/results/power.py), from the between-seed spread of the
    finished runs under ``paths``; no line for a protocol where no method has 2 seeds yet."""
    from crl_bench.results.leaderboard import collect, leaderboard_frame
    from crl_bench.results.power import plan_lines

    warnings: list[str] = []
    summaries = collect(paths, warnings)
    return plan_lines(leaderboard_frame(summaries, warnings), summaries, effect) if summaries else []
