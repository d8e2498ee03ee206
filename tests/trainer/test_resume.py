"""Resumable checkpoints and ``crl-bench run --resume`` (trainer/checkpoint.py).

Fast tests drive the real loop with a tiny random actor and a scripted extractor on a toy env; the
slow test SIGKILLs a real complementary smoke run (the tiny model, an extractor that writes a lesson
per extraction) mid-step and resumes it.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests_helpers import LESSON_WRITER_CLI, CoinEnv, coin_config, install_lesson_writer

from crl_bench.cli import main
from crl_bench.env_api import register_env
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.llm.base import Generation
from crl_bench.results.run_folder import RunWriter, read_metrics
from crl_bench.trainer.checkpoint import (
    CHECKPOINTS,
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_run_files,
    save_checkpoint,
)
from crl_bench.trainer.loop import Trainer

ADD = "<op>ADD</op><title>Call heads</title><content>Heads wins the coin toss.</content>"

#: metrics that measure the machine or a cache, not the computation (a resumed run starts with empty
#: caches: no prefetched resets, no cached query embeddings)
MACHINE_KEYS = ("tokens_per_s", "peak_rss_gb", "rss_gb", "prefetched_resets", "retrieval_query_cache_hit_rate")


def _computed(row: dict) -> dict:
    return {k: v for k, v in row.items()
            if not k.startswith(("time_", "peak_rss_gb/", "peak_gpu_gb/")) and k not in MACHINE_KEYS}


class ScriptedEngine:
    """The extractor's engine replies with one fixed ADD (log-probs -1), so the bank fills."""

    def __init__(self, real, prefill=""):
        self.real = real
        self.tokenizer = real.tokenizer
        self.prefill = prefill
        self.store = real.store

    def generate(self, prompts, params, allowed=None):
        text = "<ops>\n" + ADD + "\n</ops>"
        text = text[len(self.prefill):] if text.startswith(self.prefill) else text
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return [Generation(list(p), ids, [-1.0] * len(ids), text, "stop") for p in prompts]

    def sync_weights(self, model):
        self.real.sync_weights(model)

    def clear_prefix_cache(self):
        self.real.clear_prefix_cache()


@pytest.fixture(autouse=True)
def _coin():
    register_env("test-coin", CoinEnv)


def _trainer(run_dir: Path, actor, extractor, tokenizer, method="complementary") -> Trainer:
    # binary extractor rewards and this seed: the credited extractions' rewards differ, so CISPO takes an
    # optimiser step after the checkpoint; float32 so that machines with and without bf16 units agree
    cfg = coin_config(method, train={"steps": 4, "lr_warmup_steps": 2, "seed": 1}, model={"dtype": "float32"},
                      experience={"recency_window_s": 0}, extractor={"reward": "binary"})
    writer = RunWriter(run_dir.parent, run_dir.name) if not run_dir.exists() else RunWriter.reopen(run_dir)
    tr = Trainer(cfg, writer=writer, model=actor, tokenizer=tokenizer, embedder=HashEmbedder(64),
                 extractor_model=extractor)
    if tr.experience is not None:
        ext = tr.experience.extractor
        ext.engine = ScriptedEngine(tr.experience.engine, ext.prompts.prefill)
    return tr


def _bank_rows(path: Path) -> list[tuple]:
    c = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return c.execute("SELECT id, env_id, title, content, created_step, times_retrieved, times_success, "
                         "times_failure FROM entries ORDER BY id").fetchall()
    finally:
        c.close()


@pytest.mark.parametrize("method", ["complementary", "grpo"])
def test_a_resumed_trainer_takes_the_same_next_steps(tmp_path, tokenizer, tiny_model, method):
    """Two steps, a checkpoint, two more steps; a fresh trainer loaded from the checkpoint takes the
    same two steps: equal metrics, episodes, weights of actor and extractor, optimiser state and bank."""
    actor0, extractor0 = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    a = _trainer(tmp_path / "a", copy.deepcopy(actor0), copy.deepcopy(extractor0), tokenizer, method)
    for _ in range(2):
        a.train_step()
    ckpt = save_checkpoint(a, a.writer.dir, keep=2)
    assert ckpt.name == "step-000002" and latest_checkpoint(a.writer.dir) == ckpt
    after = [a.train_step() for _ in range(2)]
    if a.experience is not None:
        a.experience.flush()

    b_dir = tmp_path / "b"
    b_dir.mkdir()
    restore_run_files(b_dir, ckpt, has_bank=method == "complementary")
    b = _trainer(b_dir, copy.deepcopy(actor0), copy.deepcopy(extractor0), tokenizer, method)
    load_checkpoint(b, ckpt)
    assert b.step == 2
    again = [b.train_step() for _ in range(2)]
    for x, y in zip(after, again):
        assert _computed(x.metrics) == _computed(y.metrics)
        assert [(t.task, t.subgroup, t.reward, [turn.action for turn in t.turns]) for t in x.trajectories] == \
               [(t.task, t.subgroup, t.reward, [turn.action for turn in t.turns]) for t in y.trajectories]
    assert any(r.metrics.get("optimizer_steps") for r in after)          # the replayed steps trained
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    assert a.updater.scheduler.state_dict()["last_epoch"] == b.updater.scheduler.state_dict()["last_epoch"]
    if method == "complementary":
        b.experience.flush()
        assert any("extractor_update" in r.metrics for r in after)      # CISPO ran in the replayed steps
        for p, q in zip(a.experience.model.parameters(), b.experience.model.parameters()):
            assert torch.equal(p, q)
        assert _bank_rows(a.writer.dir / "experience.sqlite") == _bank_rows(b_dir / "experience.sqlite")
        assert a.experience.extractor_version == b.experience.extractor_version
        opt_a, opt_b = (t.experience.updater.optimizer.state_dict()["state"] for t in (a, b))
        assert opt_a and opt_a.keys() == opt_b.keys()                   # CISPO took optimiser steps
        for k in opt_a:
            assert torch.equal(opt_a[k]["exp_avg"], opt_b[k]["exp_avg"])
    a.close()
    b.close()


def test_torn_and_stale_checkpoints_are_never_loaded_and_old_ones_are_pruned(tmp_path, tokenizer, tiny_model):
    tr = _trainer(tmp_path / "run", tiny_model, copy.deepcopy(tiny_model), tokenizer, "grpo")
    run = tr.writer.dir
    paths = []
    for _ in range(3):
        tr.train_step()
        paths.append(save_checkpoint(tr, run, keep=2))
    assert [p.name for p in list_checkpoints(run)] == ["step-000002", "step-000003"]     # keep 2
    assert not paths[0].exists()
    # a save killed before its rename leaves a .tmp folder; a folder without meta.json, or whose
    # meta.json names another step, is not a checkpoint
    (run / "checkpoints" / ".step-000004.tmp").mkdir()
    (run / "checkpoints" / "step-000005").mkdir()
    bad = run / "checkpoints" / "step-000006"
    bad.mkdir()
    (bad / "meta.json").write_text(json.dumps({"step": 2, "format": 3}))
    torn = run / "checkpoints" / "step-000007"
    torn.mkdir()
    (torn / "meta.json").write_text('{"step": 7, "form')
    assert latest_checkpoint(run).name == "step-000003"
    tr.train_step()
    save_checkpoint(tr, run, keep=2)
    assert not (run / "checkpoints" / ".step-000004.tmp").exists()          # cleaned by the next save
    with pytest.raises(CheckpointError, match="meta.json cannot be read"):
        load_checkpoint(tr, torn)
    other = _trainer(tmp_path / "other", copy.deepcopy(tiny_model), copy.deepcopy(tiny_model), tokenizer,
                     "complementary")
    with pytest.raises(CheckpointError, match="method 'grpo'"):
        load_checkpoint(other, latest_checkpoint(run))
    tr.close()
    other.close()


def test_a_full_disk_is_a_clear_error_and_keeps_the_earlier_checkpoint(tmp_path, tokenizer, tiny_model,
                                                                         monkeypatch):
    """torch.save reports a full disk as ``RuntimeError: ... unexpected pos``: save_checkpoint turns it
    into an OSError naming the folder and the free space, removes its half-written folder and leaves
    the previous checkpoint loadable."""
    import crl_bench.trainer.checkpoint as ck

    tr = _trainer(tmp_path / "run", tiny_model, copy.deepcopy(tiny_model), tokenizer, "grpo")
    run = tr.writer.dir
    tr.train_step()
    first = save_checkpoint(tr, run, keep=2)
    tr.train_step()
    real_save, calls = torch.save, []

    def full_disk(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 520421568 vs 520421456")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ck.torch, "save", full_disk)
    with pytest.raises(OSError, match=r"could not write the checkpoint .*step-000002 \(.* GiB free") as err:
        save_checkpoint(tr, run, keep=2)
    assert "unexpected pos" in str(err.value) and isinstance(err.value.__cause__, RuntimeError)
    assert list_checkpoints(run) == [first]
    assert not list((run / "checkpoints").glob(".step-*.tmp"))
    monkeypatch.setattr(ck.torch, "save", real_save)
    load_checkpoint(tr, latest_checkpoint(run))
    assert tr.step == 1
    tr.close()


def test_restore_cuts_logs_back_to_the_checkpoint(tmp_path):
    """metrics.jsonl and episodes.jsonl lose the lines (and the torn half line) written after the
    checkpoint; without a checkpoint the run starts over."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-000001"
    ckpt.mkdir(parents=True)
    first = json.dumps({"step": 1, "loss": 0.5}) + "\n"
    (run / "metrics.jsonl").write_text(first + json.dumps({"step": 2}) + "\n" + '{"step": 3, "lo')
    (run / "episodes.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "format": 3, "metrics_bytes": len(first),
                                                "episodes_bytes": len('{"step": 1}\n')}))
    restore_run_files(run, ckpt, has_bank=False)
    assert [r["step"] for r in read_metrics(run)] == [1]
    assert (run / "episodes.jsonl").read_text() == '{"step": 1}\n'
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "format": 99, "metrics_bytes": 0, "episodes_bytes": 0}))
    with pytest.raises(CheckpointError, match="format 99"):
        restore_run_files(run, ckpt, has_bank=False)
    restore_run_files(run, None, has_bank=False)
    assert (run / "metrics.jsonl").read_text() == ""


def test_resume_refuses_flags_finished_runs_and_other_folders(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("method: grpo\n")
    assert main(["run", "--resume", str(tmp_path), "--steps", "3", "--set", "train.lr=1"]) == 2
    assert "drop --set, --steps" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text("{}")
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "finished already" in capsys.readouterr().err


def _entries(path: Path) -> list[tuple]:
    """(env, title, content, created step) of every bank entry, in id order."""
    return [r[1:5] for r in _bank_rows(path)]


#: Prepended to :data:`LESSON_WRITER_CLI` for the run that is killed: the first bank write of step 3
#: that creates an entry holds its thread once committed, so the kill lands after step 3's first
#: write and before step 3 can end (its metrics row, its checkpoint), however fast the run is.
PAUSE_AFTER_STEP3_WRITE = """
import time
from crl_bench.experience.bank_writes import EntryWrites
_apply = EntryWrites.apply
def _apply_then_hold(self, ops, *, step, **kw):
    out = _apply(self, ops, step=step, **kw)
    if step == 3 and any(entry is not None for _, entry in out.applied):
        time.sleep(600)
    return out
EntryWrites.apply = _apply_then_hold
"""


@pytest.mark.slow
def test_sigkill_mid_step_then_resume_equals_the_uninterrupted_run(tmp_path, tiny_model_dir, monkeypatch):
    """A real complementary smoke run (the tiny model as actor and extractor, the real embedder; the
    extractor writes one lesson per extraction, tests_helpers.LessonWriterEngine, in every process) is
    killed with SIGKILL after the step-3 distillation wrote to the bank (the write then holds its thread:
    :data:`PAUSE_AFTER_STEP3_WRITE`) but before step 3's checkpoint;
    ``--resume`` continues it. Its steps are 1, 2, 3 once each, every metrics line parses, step 3
    equals the uninterrupted run's, the bank holds every entry once (as the uninterrupted run's bank),
    and the final actor and extractor weights are the same bytes."""
    install_lesson_writer(monkeypatch)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "train: {steps: 3}\n"
        "rollout: {env_kwargs: {minihack-room: {variant: MiniHack-Room-Random-5x5-v0, goal_offset: true}}}\n"
        "generation: {temperature: 1.5}\n"
        "experience: {recency_window_s: 0}\n")       # the re-rank's demotion then ignores wall time
    args = ["run", "--method", "complementary", "--mix", "minihack-room", "--preset", "smoke",
            "--config", str(cfg), "--output-dir", str(tmp_path), "--quiet", "--model", str(tiny_model_dir)]
    assert main(args + ["--run-id", "whole"]) == 0
    whole = tmp_path / "whole"
    assert any(created == 3 for *_, created in _entries(whole / "experience.sqlite"))

    killed = tmp_path / "killed"
    tests_dir = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", PAUSE_AFTER_STEP3_WRITE + LESSON_WRITER_CLI, *args,
                             "--run-id", "killed"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    ckpt2, ckpt3 = (killed / CHECKPOINTS / checkpoint_name(s) for s in (2, 3))
    acknowledged: list[tuple] = []
    try:
        # wait for step 3's distillation to reach the bank (an entry created at step 3), then kill.
        # The entry count is no signal: the bank's merge at step 3 can first shrink it below step 2's.
        while True:
            assert proc.poll() is None, "the run ended before it could be killed"
            assert not ckpt3.exists(), "step 3's checkpoint was written before step 3's distillation was seen"
            if (ckpt2 / "meta.json").is_file() and (killed / "experience.sqlite").is_file():
                now = _entries(killed / "experience.sqlite")
                if any(created == 3 for *_, created in now):
                    acknowledged = now
                    break
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert latest_checkpoint(killed).name == "step-000002"          # killed inside step 3
    assert [r["step"] for r in read_metrics(killed) if "eval" not in r] == [1, 2]

    assert main(["run", "--resume", str(killed), "--quiet"]) == 0
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]                      # every line parses
    assert [r["step"] for r in rows] == [1, 2, 3] and len(set(lines)) == len(lines)
    want = [_computed(r) for r in read_metrics(whole)]
    assert [_computed(r) for r in read_metrics(killed)] == want
    ep = [json.loads(line) for line in (killed / "episodes.jsonl").read_text().splitlines()]
    assert ep == [json.loads(line) for line in (whole / "episodes.jsonl").read_text().splitlines()]
    bank = _entries(killed / "experience.sqlite")
    assert bank == _entries(whole / "experience.sqlite")
    ids = [r[0] for r in _bank_rows(killed / "experience.sqlite")]
    assert len(ids) == len(set(ids))
    for entry in acknowledged:                          # written before the kill: there, once
        assert bank.count(entry) == _entries(whole / "experience.sqlite").count(entry) >= 1
    for name in ("model.safetensors", "extractor/model.safetensors"):
        assert (killed / "checkpoint" / name).read_bytes() == (whole / "checkpoint" / name).read_bytes()
    versions = json.loads((killed / "versions.json").read_text())
    assert versions["resumed"][0]["from_step"] == 2
    ev_k, ev_w = (json.loads((d / "eval.json").read_text())["free"] for d in (killed, whole))
    assert {k: v for k, v in ev_k.items() if k != "wall_s"} == {k: v for k, v in ev_w.items() if k != "wall_s"}


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: what a crafted checkpoint would do on a resume."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _forged_checkpoint(folder: Path, states: dict[str, object], fmt: int = 3) -> Path:
    """A checkpoint folder whose files are ``torch.save`` of ``states`` and whose meta.json records
    their true sizes and sha256 (as an attacker who writes the folder can)."""
    from crl_bench.data import sha256_file

    folder.mkdir(parents=True)
    for key, obj in states.items():
        torch.save(obj, folder / f"{key}.pt")
    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(folder.iterdir())}
    (folder / "meta.json").write_text(json.dumps({"format": fmt, "step": 1, "method": "grpo", "files": files,
                                                  "metrics_bytes": 0, "episodes_bytes": 0}))
    return folder


def test_a_crafted_pickle_checkpoint_is_refused_and_its_payload_does_not_run(tmp_path):
    """trainer.pt holding an object whose ``__reduce__`` calls ``open``: the weights-only loader refuses
    it with a CheckpointError naming the file, and the file the payload would create is not there."""
    from crl_bench.trainer.checkpoint import read_checkpoint, select_checkpoint

    marker = tmp_path / "pwned"
    ckpt = _forged_checkpoint(tmp_path / "run" / CHECKPOINTS / "step-000001",
                              {"actor": {}, "trainer": {"step": 1, "x": _Payload(marker)}})
    with pytest.raises(CheckpointError, match=r"trainer\.pt cannot be loaded as plain data, refused .*global"):
        read_checkpoint(ckpt)
    loaded, skipped = select_checkpoint(tmp_path / "run")
    assert loaded is None and "refused" in skipped[0][1]
    assert not marker.exists()


def test_plain_state_rebuilds_only_crl_bench_classes(tmp_path):
    """encode/decode round-trip the objects a trainer state holds (generators' states, NumPy arrays,
    sets, crl_bench dataclasses); a tag naming any other class (``os:system``) is refused."""
    import random
    from collections import OrderedDict

    import numpy as np

    from crl_bench.rollout import EpisodeSpec
    from crl_bench.trainer.plain_state import PlainStateError, decode, encode

    state = {"py": random.getstate(), "np": np.random.get_state(), "s": {3, 1}, "od": OrderedDict(b=1, a=2),
             "spec": EpisodeSpec("test-coin", 4, group_id=2), "f": np.float64(0.1), 5: (1, None),
             "__set__": "a key that looks like a tag"}
    torch.save(encode(state), tmp_path / "s.pt")
    back = decode(torch.load(tmp_path / "s.pt", weights_only=True))
    assert back["py"] == state["py"] and back["s"] == {1, 3} and back["od"] == state["od"]
    assert back["np"][0] == "MT19937" and np.array_equal(back["np"][1], state["np"][1])
    assert back["np"][1].dtype == state["np"][1].dtype and back["spec"] == state["spec"]
    assert type(back["f"]) is np.float64 and back[5] == (1, None) and back["__set__"] == state["__set__"]
    for bad in ({"__dataclass__": "os:system", "state": {}}, {"__enum__": "builtins:eval", "value": 1},
                {"__dataclass__": "crl_bench.trainer.checkpoint:CheckpointError", "state": {}},
                {"__ndarray__": [1], "dtype": "O", "shape": [1]}):
        with pytest.raises(PlainStateError, match="refused|not a"):
            decode({"x": [bad]})
    with pytest.raises(TypeError, match=r"\$\.x: a pathlib"):
        encode({"x": tmp_path})


def test_an_older_pickled_checkpoint_is_refused_naming_the_version(tmp_path):
    from crl_bench.trainer.checkpoint import verify_checkpoint

    ckpt = _forged_checkpoint(tmp_path / "step-000001", {"actor": {}, "trainer": {}}, fmt=2)
    with pytest.raises(CheckpointError, match="written by an older crl-bench .*format 2.*pickled"):
        verify_checkpoint(ckpt)


def test_a_missing_state_key_and_a_full_disk_are_named(tmp_path, tokenizer, tiny_model, monkeypatch):
    """apply_checkpoint names the file and the key a checkpoint lacks; save_checkpoint refuses to
    start when the disk has less free space than the checkpoint needs (both numbers in the message)
    and writes nothing."""
    import collections

    import crl_bench.trainer.checkpoint as ck

    tr = _trainer(tmp_path / "run", tiny_model, copy.deepcopy(tiny_model), tokenizer, "grpo")
    run = tr.writer.dir
    tr.train_step()
    loaded = ck.read_checkpoint(save_checkpoint(tr, run, keep=2))
    del loaded.states["trainer"]["sampler_rng"]
    with pytest.raises(CheckpointError, match=r"step-000001/trainer\.pt lacks the state 'sampler_rng'"):
        ck.apply_checkpoint(tr, loaded)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: usage(100, 90, 10))
    tr.step = 2
    with pytest.raises(OSError, match=r"about \d+ bytes needed, 10 free"):
        save_checkpoint(tr, run, keep=2)
    assert [p.name for p in (run / CHECKPOINTS).iterdir()] == ["step-000001"]
    tr.close()


class _KilledMidEval(Exception):
    """Stands for the process being killed during the run's final evaluation."""


@pytest.mark.slow
def test_a_run_killed_in_its_final_eval_resumes_at_its_unfinished_episodes(tmp_path, tiny_model_dir, monkeypatch):
    """A real grpo smoke run (tiny model, MiniHack room, 1 step, greedy final evaluation of 6 tasks) is
    stopped after its final evaluation kept 2 episodes in its journal; ``--resume`` rolls out only the
    other 4 (the journal's 2 are counted, ``resumed_episodes``), writes the eval.json of the uninterrupted
    run, and removes the journal. Before the run's final evaluation kept a journal, the resume played
    all 6 again."""
    from crl_bench.trainer.eval_journal import EpisodeJournal
    from crl_bench.trainer.lifecycle import FINAL_EVAL_JOURNAL

    args = ["run", "--method", "grpo", "--mix", "minihack-room", "--preset", "smoke", "--steps", "1",
            "--set", "eval.episodes=6", "--output-dir", str(tmp_path),
            "--quiet", "--model", str(tiny_model_dir)]
    assert main(args + ["--run-id", "whole"]) == 0
    record, played = EpisodeJournal.record, []

    def record_then_die(self, mode, index, t):
        if len(played) == 2:
            raise _KilledMidEval
        played.append(index)
        record(self, mode, index, t)

    monkeypatch.setattr(EpisodeJournal, "record", record_then_die)
    with pytest.raises(_KilledMidEval):
        main(args + ["--run-id", "killed"])
    killed = tmp_path / "killed"
    assert not (killed / "eval.json").exists()
    assert len((killed / FINAL_EVAL_JOURNAL).read_text().splitlines()) == 2

    played.clear()
    monkeypatch.setattr(EpisodeJournal, "record", lambda self, mode, index, t: (played.append(index),
                                                                                 record(self, mode, index, t)))
    assert main(["run", "--resume", str(killed), "--quiet"]) == 0
    assert len(played) == 4                         # only the episodes the journal did not hold
    assert not (killed / FINAL_EVAL_JOURNAL).exists()
    ev_k, ev_w = (json.loads((d / "eval.json").read_text())["free"] for d in (killed, tmp_path / "whole"))
    assert ev_k.pop("resumed_episodes") == 2
    assert {k: v for k, v in ev_k.items() if k != "wall_s"} == {k: v for k, v in ev_w.items() if k != "wall_s"}
