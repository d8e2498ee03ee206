"""Fault injection on the save and resume path: a run is killed (SIGKILL, no clean-up) at each point
where it writes its folder, or its files are truncated and corrupted afterwards, and ``crl-bench run
--resume`` must finish it without losing anything that was complete before the fault.

Real runs of the tiny random actor (conftest ``tiny_model_dir``) with the real extractor loop on the
``diag-vault`` env: the kills happen in a child ``crl-bench run`` process whose one function is
wrapped to SIGKILL itself at a chosen call (KILLER below), so no ``finally`` or ``except`` runs,
as with ``kill -9`` or a power cut. Resumes run in this process through ``crl_bench.cli.main``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from crl_bench.cli import main
from crl_bench.results.run_folder import RunInUseError, RunLock
from crl_bench.trainer.checkpoint import checkpoint_folders, read_meta

pytestmark = pytest.mark.slow      # each test runs the real loop (about 10-40 s on 2 cores)

#: The child process: ``python -c KILLER <point> <n> <crl-bench run args...>`` runs the CLI with the
#: function of ``point`` wrapped so that its n-th call kills the process with SIGKILL part-way.
KILLER = r'''
import os, signal, sys
point, nth, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
calls = [0]

def due():
    calls[0] += 1
    return calls[0] == nth

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if point == "checkpoint":          # after the n-th file torch.save wrote (only checkpoints use it)
    import torch
    real_save = torch.save
    def save(*a, **k):
        real_save(*a, **k)
        if due():
            die()
    torch.save = save
elif point == "metrics":           # half of the n-th metrics line written, then killed
    from crl_bench.results.run_folder import RunWriter
    real_log = RunWriter.log_metrics
    def log_metrics(self, row):
        if due():
            import json
            line = json.dumps(row) + "\n"
            with self.metrics_path.open("a") as f:
                f.write(line[: len(line) // 2])
            die()
        real_log(self, row)
    RunWriter.log_metrics = log_metrics
elif point == "summary":           # the summary's temporary file half written, then killed
    import crl_bench.results.summary as sm
    def write_json_atomic(path, data):
        import json
        from pathlib import Path
        tmp = Path(path).with_name(".summary.json.killed.tmp")
        tmp.write_text(json.dumps(data)[:50])
        die()
    sm.write_json_atomic = write_json_atomic
elif point == "final":             # the final weights: the actor saved, the rest not
    from crl_bench.trainer.loop import Trainer
    def save_checkpoint(self, path):
        self.model.save_pretrained(path)
        die()
    Trainer.save_checkpoint = save_checkpoint
else:
    raise SystemExit(f"unknown point {point}")

from crl_bench.cli import main
sys.exit(main(args))
'''


@pytest.fixture(scope="module")
def cfg_file(tmp_path_factory):
    """3 steps of complementary on diag-vault, a checkpoint after every step (the newest 2 kept)."""
    path = tmp_path_factory.mktemp("cfg") / "faults.yaml"
    path.write_text(yaml.safe_dump({
        "train": {"steps": 3, "groups_per_step": 2, "group_size": 2, "checkpoint_every": 1,
                  "keep_checkpoints": 2, "lr": 1e-3, "seed": 3},
        "model": {"dtype": "float32", "gradient_checkpointing": False},
        "rollout": {"max_steps": 1},
        "generation": {"max_new_tokens": 6},
        "eval": {"episodes": 2, "at_start": False, "controls": [], "lesson_follow": 0},
        "extractor": {"max_new_tokens": 12},
        "experience": {"recency_window_s": 0},
    }))
    return path


def _args(tmp_path: Path, tiny_model_dir: Path, cfg_file: Path, run_id: str = "run") -> list[str]:
    return ["run", "--method", "complementary", "--mix", "diag-vault", "--preset", "smoke",
            "--config", str(cfg_file), "--model", str(tiny_model_dir), "--output-dir", str(tmp_path),
            "--run-id", run_id, "--quiet"]


def _kill_at(point: str, nth: int, args: list[str]) -> None:
    """Run ``crl-bench run args`` in a child that SIGKILLs itself at the ``nth`` call of ``point``."""
    proc = subprocess.run([sys.executable, "-c", KILLER, point, str(nth), *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, f"the child was not killed (exit {proc.returncode}): {proc.stderr[-2000:]}"


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir, cfg_file):
    """One uninterrupted run of the same settings (copied by the tests that damage a finished run)."""
    root = tmp_path_factory.mktemp("finished")
    assert main(_args(root, tiny_model_dir, cfg_file)) == 0
    return root / "run"


def _tree(run: Path) -> dict[str, str]:
    """sha256 of every file under ``run`` (relative path -> hash)."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _entries(bank: Path) -> list[tuple]:
    c = sqlite3.connect(f"file:{bank}?mode=ro", uri=True)
    try:
        return c.execute("SELECT id, title, content, created_step FROM entries ORDER BY id").fetchall()
    finally:
        c.close()


def _complete(run: Path) -> dict[str, object]:
    """What a fault must not lose: the newest complete checkpoint's step, the metrics and episodes
    bytes it acknowledged and the bank entries of its copy (when it has one)."""
    ckpt = next(p for p in checkpoint_folders(run) if read_meta(p) is not None)
    meta = read_meta(ckpt)
    out = {"step": meta["step"],
           "metrics": (run / "metrics.jsonl").read_bytes()[:meta["metrics_bytes"]],
           "episodes": (run / "episodes.jsonl").read_bytes()[:meta["episodes_bytes"]]}
    if (ckpt / "experience.sqlite").is_file():
        out["bank"] = _entries(ckpt / "experience.sqlite")
    return out


def _assert_finished_keeping(run: Path, before: dict[str, object]) -> None:
    """The resumed run finished (steps 1..3 once, every line JSON, summary, eval, weights) and holds
    everything ``before`` (:func:`_complete`) recorded."""
    assert (run / "summary.json").is_file() and (run / "eval.json").is_file()
    assert (run / "checkpoint" / "model.safetensors").is_file()
    assert (run / "checkpoint" / "extractor" / "model.safetensors").is_file()
    assert _steps(run) == [1, 2, 3]
    assert (run / "metrics.jsonl").read_bytes().startswith(before["metrics"])
    assert (run / "episodes.jsonl").read_bytes().startswith(before["episodes"])
    for line in (run / "episodes.jsonl").read_text().splitlines():
        json.loads(line)
    if "bank" in before:
        bank = _entries(run / "experience.sqlite")
        assert all(e in bank for e in before["bank"])
    assert not (run / RunLock.NAME).exists()


def test_killed_mid_checkpoint_resumes_from_the_previous_one(tmp_path, tiny_model_dir, cfg_file):
    # torch.save calls per checkpoint: actor, trainer, extractor, experience; the 6th is the second
    # file of step 2's checkpoint
    _kill_at("checkpoint", 6, _args(tmp_path, tiny_model_dir, cfg_file))
    run = tmp_path / "run"
    assert [p.name for p in checkpoint_folders(run)] == ["step-000001"]
    assert list((run / "checkpoints").glob(".step-000002.tmp"))            # the torn save
    before = _complete(run)
    assert before["step"] == 1
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    _assert_finished_keeping(run, before)
    assert not list((run / "checkpoints").glob(".step-*"))


def test_killed_mid_metrics_line_resumes_without_a_torn_line(tmp_path, tiny_model_dir, cfg_file):
    _kill_at("metrics", 3, _args(tmp_path, tiny_model_dir, cfg_file))             # step 3's line, half written
    run = tmp_path / "run"
    assert not (run / "metrics.jsonl").read_text().endswith("\n")
    before = _complete(run)
    assert before["step"] == 2
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    _assert_finished_keeping(run, before)


def test_killed_mid_summary_write_only_writes_the_summary(tmp_path, tiny_model_dir, cfg_file):
    _kill_at("summary", 1, _args(tmp_path, tiny_model_dir, cfg_file))
    run = tmp_path / "run"
    assert not (run / "summary.json").exists() and (run / "eval.json").is_file()
    files = _tree(run)
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    after = _tree(run)
    # nothing trained or evaluated again: every file of the run is byte for byte as it was; the
    # killed process's lock file and temporary summary are gone
    skip = ("summary.json", "versions.json", RunLock.NAME, ".summary.json.killed.tmp")
    assert {k: v for k, v in after.items() if k not in skip} == {k: v for k, v in files.items() if k not in skip}
    assert "summary.json" in after and RunLock.NAME in files and not (run / ".summary.json.killed.tmp").exists()


def test_killed_mid_final_weights_saves_them_again(tmp_path, tiny_model_dir, cfg_file):
    _kill_at("final", 1, _args(tmp_path, tiny_model_dir, cfg_file))
    run = tmp_path / "run"
    assert not (run / "checkpoint").exists() and (run / ".checkpoint.tmp").is_dir()   # never a partial checkpoint/
    before = _complete(run)
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    _assert_finished_keeping(run, before)
    assert not (run / ".checkpoint.tmp").exists()


def _unfinished_copy(finished: Path, tmp_path: Path) -> Path:
    """The finished run as a kill during its final evaluation leaves it: no eval.json, checkpoint/ or
    summary.json."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for name in ("summary.json", "eval.json"):
        (run / name).unlink()
    shutil.rmtree(run / "checkpoint")
    return run


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, finished, capsys):
    run = _unfinished_copy(finished, tmp_path)
    newest, previous = checkpoint_folders(run)[:2]
    actor = newest / "actor.pt"
    half = actor.stat().st_size // 2
    actor.write_bytes(actor.read_bytes()[:half])
    before = _complete(run)
    before["metrics"] = (run / "metrics.jsonl").read_bytes()[:read_meta(previous)["metrics_bytes"]]
    before["episodes"] = (run / "episodes.jsonl").read_bytes()[:read_meta(previous)["episodes_bytes"]]
    before["bank"] = _entries(previous / "experience.sqlite")
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"skipping {newest}" in err and "actor.pt has" in err and "truncated" in err
    _assert_finished_keeping(run, before)
    kept = list((run / "checkpoints").glob(f".unusable-{newest.name}-*"))        # moved aside, not deleted
    assert len(kept) == 1 and (kept[0] / "actor.pt").stat().st_size == half
    resumed = json.loads((run / "versions.json").read_text())["resumed"][-1]
    assert resumed["from_step"] == 2 and resumed["skipped"][0]["checkpoint"] == newest.name


def test_a_corrupt_bank_copy_is_skipped_and_a_corrupt_live_bank_replaced(tmp_path, finished):
    run = _unfinished_copy(finished, tmp_path)
    newest, previous = checkpoint_folders(run)[:2]
    (run / "experience.sqlite").write_bytes(b"not a database" * 100)      # the live bank, after the checkpoint
    bank = newest / "experience.sqlite"
    data = bytearray(bank.read_bytes())
    data[len(data) // 2] ^= 0xFF                                           # one flipped byte in the copy
    bank.write_bytes(bytes(data))
    want = _entries(previous / "experience.sqlite")
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    assert all(e in _entries(run / "experience.sqlite") for e in want)
    assert json.loads((run / "versions.json").read_text())["resumed"][-1]["from_step"] == 2


def test_no_usable_checkpoint_changes_nothing_until_start_over(tmp_path, finished, capsys):
    """Each checkpoint unusable (a torn meta.json, a meta.json naming another step): exit 2 and the
    folder byte for byte as it was, eval.json and the final weights included; --start-over then
    trains it again and keeps the unusable folders aside."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "summary.json").unlink()
    (run / "eval.json").write_text('{"free": ')                            # torn: the run must go on
    newest, previous = checkpoint_folders(run)[:2]
    (newest / "meta.json").write_text('{"step": 3, "form')
    meta = json.loads((previous / "meta.json").read_text())
    meta["step"] = 7
    (previous / "meta.json").write_text(json.dumps(meta))
    files = _tree(run)
    assert main(["run", "--resume", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no usable checkpoint" in err and "--start-over" in err and "names step 7" in err
    assert _tree(run) == files
    assert main(["run", "--resume", str(run), "--quiet", "--start-over"]) == 0
    assert _steps(run) == [1, 2, 3] and (run / "summary.json").is_file()
    assert len(list((run / "checkpoints").glob(".unusable-step-*"))) == 2


def test_resume_refuses_a_changed_config_and_steps_below_the_checkpoint(tmp_path, finished, capsys):
    run = _unfinished_copy(finished, tmp_path)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["train"]["steps"] = 2
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    files = _tree(run)
    assert main(["run", "--resume", str(run), "--quiet"]) == 2
    assert "train.steps 2" in capsys.readouterr().err and _tree(run) == files
    cfg["train"]["steps"], cfg["train"]["lr"] = 3, 0.5
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    files = _tree(run)
    assert main(["run", "--resume", str(run), "--quiet"]) == 2
    assert "config.yaml differs" in capsys.readouterr().err and _tree(run) == files
    assert main(["run", "--resume", str(run), "--quiet", "--allow-config-change"]) == 0
    assert json.loads((run / "versions.json").read_text())["resumed"][-1]["config_changed"] is True


def test_a_finished_run_whose_summary_is_lost_keeps_its_weights_even_with_broken_checkpoints(
        tmp_path, finished):
    """eval.json and checkpoint/ are complete: a resume writes summary.json and touches nothing else,
    whatever state the resumable checkpoints are in."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "summary.json").unlink()
    for ckpt in checkpoint_folders(run):
        actor = ckpt / "actor.pt"
        actor.write_bytes(actor.read_bytes()[:100])
    files = _tree(run)
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    after = _tree(run)
    assert {k: v for k, v in after.items() if k not in ("summary.json", "versions.json")} == \
        {k: v for k, v in files.items() if k != "versions.json"}


def test_a_run_folder_in_use_is_refused_and_a_dead_holder_is_taken_over(tmp_path, finished, capsys):
    run = _unfinished_copy(finished, tmp_path)
    files = _tree(run)
    with RunLock(run):                                  # another live process writing the folder
        assert main(["run", "--resume", str(run), "--quiet"]) == 2
        assert f"in use by PID {os.getpid()}" in capsys.readouterr().err
        with pytest.raises(RunInUseError):
            RunLock(run).acquire()
    assert {k: v for k, v in _tree(run).items() if k != RunLock.NAME} == files
    # a holder killed with SIGKILL leaves its .lock file (and PID) behind, but no flock
    child = subprocess.run([sys.executable, "-c",
                            "import os, signal, sys; from crl_bench.results.run_folder import RunLock; "
                            "RunLock(sys.argv[1]).acquire(); os.kill(os.getpid(), signal.SIGKILL)", str(run)])
    assert child.returncode == -9 and (run / RunLock.NAME).is_file()
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    assert not (run / RunLock.NAME).exists()


def test_a_full_disk_is_one_line_exit_1_and_the_run_resumes_after(tmp_path, tiny_model_dir, cfg_file, monkeypatch,
                                                                   capsys):
    """torch.save reports a full disk as a RuntimeError deep in its zip writer: the CLI prints one
    line (the checkpoint folder and the free space), no traceback, exit 1; the earlier checkpoints
    stay and the run resumes once there is room."""
    import torch

    real_save, calls = torch.save, []

    def full_disk(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 6:                              # step 2's checkpoint, its second file
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5204 vs 5200")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    assert main(_args(tmp_path, tiny_model_dir, cfg_file)) == 1
    err = capsys.readouterr().err
    assert err.startswith("crl-bench: error: could not write the checkpoint") and "GiB free" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    run = tmp_path / "run"
    assert [p.name for p in checkpoint_folders(run)] == ["step-000001"] and not (run / RunLock.NAME).exists()
    before = _complete(run)
    monkeypatch.setattr(torch, "save", real_save)
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    _assert_finished_keeping(run, before)
