"""crl-bench sweep: the grid runs one cell after another into one folder and resumes after a kill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from crl_bench.config import ConfigError, build_config
from crl_bench.sweep import SweepSpec, cell_id, parse_list, run_sweep


def _resolve(method: str, seed: int):
    return build_config([{"method": method, "train": {"seed": seed, "steps": 1}, "rollout": {"mix": "sokoban"}}])


class FakeTrain:
    """Stands in for run_training: writes a run folder like the real one; can die at a chosen call."""

    def __init__(self, die_at: int | None = None, checkpoint: bool = False) -> None:
        self.calls: list[tuple[str, int]] = []
        self.resumed: list[tuple[str, int]] = []
        self.die_at = die_at
        self.checkpoint = checkpoint

    def __call__(self, cfg, quiet: bool = True, resume: bool = False) -> str:
        run = Path(cfg.output_dir) / cfg.run_id
        if resume:
            self.resumed.append((cfg.method, cfg.train.seed))
            assert (run / "metrics.jsonl").is_file()        # the folder was kept
        else:
            self.calls.append((cfg.method, cfg.train.seed))
            run.mkdir(parents=True)
            (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
            (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "success_rate": 0.5}) + "\n")
        if self.die_at is not None and len(self.calls) == self.die_at:
            if self.checkpoint:               # a complete resumable checkpoint of step 1
                ckpt = run / "checkpoints" / "step-000001"
                ckpt.mkdir(parents=True)
                (ckpt / "meta.json").write_text(json.dumps({"step": 1, "format": 1}))
            raise KeyboardInterrupt          # killed mid-run: the folder stays, without summary.json
        (run / "eval.json").write_text(json.dumps({"free": {"success_rate": 0.25}}))
        (run / "summary.json").write_text("{}")
        return str(run)


def test_sweep_runs_grid_in_order_with_a_line_per_run(tmp_path):
    spec = SweepSpec(methods=["grpo", "complementary"], seeds=[0, 1], mix="sokoban", preset="smoke")
    lines: list[str] = []
    train = FakeTrain()
    path, failures = run_sweep(spec, tmp_path, _resolve, print_fn=lines.append, train=train)
    assert failures == []
    assert train.calls == [("grpo", 0), ("grpo", 1), ("complementary", 0), ("complementary", 1)]
    assert sorted(p.name for p in (path / "runs").iterdir()) == sorted(
        cell_id(m, s) for m in spec.methods for s in spec.seeds)
    done = [line for line in lines if "done in" in line]
    assert len(done) == 4 and all("eval success free 0.250" in line for line in done)
    assert done[0].startswith("[1/4] grpo seed 0")
    meta = yaml.safe_load((path / "sweep.yaml").read_text())
    assert meta["methods"] == ["grpo", "complementary"] and meta["seeds"] == [0, 1] and meta["preset"] == "smoke"


def test_sweep_resumes_after_a_kill_and_skips_finished_runs(tmp_path):
    spec = SweepSpec(methods=["grpo", "static"], seeds=[0, 1], mix="sokoban", preset="smoke")
    first = FakeTrain(die_at=3)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, tmp_path, _resolve, print_fn=lambda s: None, train=first)
    assert first.calls == [("grpo", 0), ("grpo", 1), ("static", 0)]
    path = tmp_path / spec.default_name()
    assert not (path / "runs" / "static-s0" / "summary.json").exists()      # the killed cell
    second = FakeTrain()
    lines: list[str] = []
    run_sweep(spec, tmp_path, _resolve, print_fn=lines.append, train=second)
    assert second.calls == [("static", 0), ("static", 1)]                  # finished cells skipped
    assert sum("skipped" in line for line in lines) == 2
    assert any("restarting" in line for line in lines)
    assert all((path / "runs" / cell_id(m, s) / "summary.json").is_file() for m in spec.methods for s in spec.seeds)
    third = FakeTrain()
    run_sweep(spec, tmp_path, _resolve, print_fn=lambda s: None, train=third)
    assert third.calls == []


def test_sweep_resumes_a_killed_cell_from_its_checkpoint(tmp_path):
    """A killed cell with a checkpoint folder goes on with --resume (its folder kept), also when that
    folder is torn (no meta.json): --resume verifies it and refuses rather than the sweep deleting it;
    a cell killed before any checkpoint folder starts over."""
    spec = SweepSpec(methods=["grpo"], seeds=[0, 1], mix="sokoban", preset="smoke")
    first = FakeTrain(die_at=2, checkpoint=True)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, tmp_path, _resolve, print_fn=lambda s: None, train=first)
    second = FakeTrain()
    lines: list[str] = []
    run_sweep(spec, tmp_path, _resolve, print_fn=lines.append, train=second)
    assert second.resumed == [("grpo", 1)] and second.calls == []
    assert any("resuming it from step-000001" in line for line in lines)

    spec2 = SweepSpec(methods=["grpo"], seeds=[0], mix="sokoban", preset="smoke")
    torn = FakeTrain(die_at=1, checkpoint=True)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec2, tmp_path, _resolve, name="torn", print_fn=lambda s: None, train=torn)
    (tmp_path / "torn" / "runs" / "grpo-s0" / "checkpoints" / "step-000001" / "meta.json").unlink()
    again = FakeTrain()
    run_sweep(spec2, tmp_path, _resolve, name="torn", print_fn=lambda s: None, train=again)
    assert again.resumed == [("grpo", 0)] and again.calls == []

    early = FakeTrain(die_at=1)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec2, tmp_path, _resolve, name="early", print_fn=lambda s: None, train=early)
    fresh = FakeTrain()
    run_sweep(spec2, tmp_path, _resolve, name="early", print_fn=lambda s: None, train=fresh)
    assert fresh.calls == [("grpo", 0)] and fresh.resumed == []


def test_sweep_never_touches_a_cell_another_process_holds(tmp_path):
    """An unfinished cell folder locked by a live process (a run or --resume of it) is neither removed
    nor run: the cell is reported as failed, the others go on."""
    from crl_bench.results.run_folder import RunLock

    spec = SweepSpec(methods=["grpo"], seeds=[0, 1], mix="sokoban", preset="smoke")
    busy = tmp_path / spec.default_name() / "runs" / "grpo-s0"
    busy.mkdir(parents=True)
    (busy / "metrics.jsonl").write_text('{"step": 1}\n')
    train = FakeTrain()
    lines: list[str] = []
    with RunLock(busy):
        _, failures = run_sweep(spec, tmp_path, _resolve, print_fn=lines.append, train=train)
    assert [f[:2] for f in failures] == [("grpo", 0)] and "in use by PID" in failures[0][2]
    assert train.calls == [("grpo", 1)]
    assert (busy / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_sweep_failed_cell_does_not_stop_the_others(tmp_path):
    spec = SweepSpec(methods=["grpo"], seeds=[0, 1], mix="sokoban")

    def train(cfg, quiet=True, resume=False):
        if cfg.train.seed == 0:
            raise RuntimeError("boom")
        return FakeTrain()(cfg)

    _, failures = run_sweep(spec, tmp_path, _resolve, print_fn=lambda s: None, train=train)
    assert failures == [("grpo", 0, "RuntimeError: boom")]


def test_sweep_refuses_a_folder_with_another_grid(tmp_path):
    run_sweep(SweepSpec(["grpo"], [0], "sokoban", sets=["train.lr=1e-5"]), tmp_path, _resolve, name="x",
              print_fn=lambda s: None, train=FakeTrain())
    with pytest.raises(ConfigError, match="set"):
        run_sweep(SweepSpec(["grpo"], [0], "sokoban", sets=["train.lr=1e-4"]), tmp_path, _resolve, name="x",
                  print_fn=lambda s: None, train=FakeTrain())
    with pytest.raises(ConfigError, match="profile"):
        run_sweep(SweepSpec(["grpo"], [0], "sokoban", sets=["train.lr=1e-5"], profile="balrog"), tmp_path,
                  _resolve, name="x", print_fn=lambda s: None, train=FakeTrain())


def test_sweep_bad_setting_fails_before_any_run(tmp_path):
    train = FakeTrain()

    def resolve(method, seed):
        if method == "static":
            raise ConfigError("unknown config key 'train.lrr'")
        return _resolve(method, seed)

    with pytest.raises(ConfigError, match="lrr"):
        run_sweep(SweepSpec(["grpo", "static"], [0], "sokoban"), tmp_path, resolve, train=train)
    assert train.calls == []


def test_default_names_differ_with_settings_and_lists_parse():
    a = SweepSpec(["grpo"], [0], "6task", "smoke")
    b = SweepSpec(["grpo"], [0], "6task", "smoke", sets=["train.lr=1e-4"])
    assert a.default_name() == "6task-smoke" and b.default_name().startswith("6task-smoke-")
    # an evaluation profile or draw size is part of the grid: another folder, and a reopened one must match
    c = SweepSpec(["grpo"], [0], "alfworld", "smoke", profile="verl-agent", draws=128)
    assert c.default_name() != SweepSpec(["grpo"], [0], "alfworld", "smoke").default_name()
    assert "profile" not in a.grid() and c.grid()["profile"] == "verl-agent" and c.grid()["draws"] == 128
    assert parse_list("0, 1,2", int, "seeds") == [0, 1, 2]
    with pytest.raises(ConfigError, match="--seeds"):
        parse_list("0,x", int, "seeds")
    with pytest.raises(ConfigError, match="repeated"):
        parse_list("grpo,grpo", str, "methods")


def test_sweep_stops_at_a_missing_engine(tmp_path):
    """A missing engine or data set fails every cell alike: the sweep stops (the CLI exits 2)."""
    from crl_bench.env_api import EnvUnavailableError

    calls = []

    def train(cfg, quiet=True, resume=False):
        calls.append(cfg.method)
        raise EnvUnavailableError("env 'webshop' needs the [webshop] extra")

    with pytest.raises(EnvUnavailableError):
        run_sweep(SweepSpec(["grpo", "static"], [0, 1], "sokoban"), tmp_path, _resolve, print_fn=lambda s: None,
                  train=train)
    assert calls == ["grpo"]


def test_a_cell_that_exits_2_stops_the_sweep_with_its_log(tmp_path, monkeypatch):
    """The default runner starts `crl-bench run` in a subprocess; an unknown env exits 2 there, which
    stops the sweep with the log's tail (no model is loaded: the env id fails first). The cell imports
    only the package: an `argparse.py` in the current folder is never run."""
    from crl_bench.sweep import run_in_subprocess

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "argparse.py").write_text(f"open({str(tmp_path / 'planted-ran')!r}, 'w').close()\n"
                                     "raise SystemExit(7)\n")
    monkeypatch.chdir(cwd)

    def resolve(method, seed):
        return build_config([{"method": method, "train": {"seed": seed}, "rollout": {"mix": "no-such-env"}}])

    with pytest.raises(ConfigError, match="no-such-env"):
        run_sweep(SweepSpec(["grpo"], [0, 1], "no-such-env"), tmp_path, resolve, name="x", print_fn=lambda s: None,
                  train=run_in_subprocess)
    assert (tmp_path / "x" / "configs" / "grpo-s0.yaml").is_file()
    assert "no-such-env" in (tmp_path / "x" / "logs" / "grpo-s0.log").read_text()
    assert not (tmp_path / "x" / "runs" / "grpo-s1").exists()
    assert not (tmp_path / "planted-ran").exists()


def test_a_second_sweep_of_the_same_folder_is_refused_while_the_first_runs(tmp_path):
    """Two sweeps with one name would both write each cell's log and folder (the second truncating the
    first's log): the sweep folder has one sweep process at a time, the other is a clear error."""
    spec = SweepSpec(methods=["grpo"], seeds=[0, 1], mix="sokoban", preset="smoke")
    second = FakeTrain()
    refused: list[str] = []

    class FirstSweep(FakeTrain):
        def __call__(self, cfg, quiet: bool = True, resume: bool = False) -> str:
            if not self.calls:                    # while the first cell runs, the same sweep is started again
                with pytest.raises(ConfigError, match="is being run by PID") as e:
                    run_sweep(spec, tmp_path, _resolve, print_fn=lambda s: None, train=second)
                refused.append(str(e.value))
            return super().__call__(cfg, quiet, resume)

    first = FirstSweep()
    _, failures = run_sweep(spec, tmp_path, _resolve, print_fn=lambda s: None, train=first)
    assert not failures and first.calls == [("grpo", 0), ("grpo", 1)]
    assert refused and second.calls == [] and "another --name" in refused[0]
    assert not (tmp_path / spec.default_name() / ".lock").exists()       # released when the sweep ends
    _, failures = run_sweep(spec, tmp_path, _resolve, print_fn=lambda s: None, train=second)
    assert not failures and second.calls == []                           # both cells finished: skipped
