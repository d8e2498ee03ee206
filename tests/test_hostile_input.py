"""Files from other people (submissions, summaries, banks, configs) and names from the command line,
read as a hostile submitter would write them: each probe of the audit, one test; none loads a model."""

from __future__ import annotations

import io
import json
import os
import sqlite3
from pathlib import Path

import pytest
import yaml
from test_summary import make_run

from crl_bench import safe_io
from crl_bench.cli import main
from crl_bench.config import ConfigError, check_name, load_yaml
from crl_bench.experience.bank import EmbeddingDimError, ExperienceBank, NotABankError
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.types import Operation
from crl_bench.results.leaderboard import collect, main_leaderboard
from crl_bench.results.submission import check_submission, main_submission_check, main_submission_pack, pack_submission
from crl_bench.results.summary import summary_problems
from crl_bench.safe_io import InputFileError, load_json, parse_json, parse_yaml, printable, read_text

SECRET = "root:$6$SECRET-HASH:19000:0:99999:7:::"
HOSTILE_TITLE = "evil \x1b[2J\x1b]0;pwned\x07 title"
HOSTILE_CONTENT = "nul\x00here \x9b31m and \x1b[31mred\x1b[0m\nline2\ttab"


def _submission(root: Path, name: str) -> Path:
    """A valid submission folder ``root/name`` packed from two synthetic runs."""
    dirs = [make_run(root / "runs" / name, f"{name}-r{s}", seed=s) for s in range(2)]
    folder = pack_submission(dirs, root / "subs" / name, name)
    meta = yaml.safe_load((folder / "metadata.yaml").read_text())
    meta.update(authors=["Ada"], contact="ada@example.org", description="two seeds", code="https://example.org")
    (folder / "metadata.yaml").write_text(yaml.safe_dump(meta))
    assert check_submission(folder) == []
    return folder


def _laughs(levels: int, leaf: str = '"lol"') -> str:
    """A "billion laughs" YAML document: ``levels`` anchors, each a list of 9 aliases of the one before."""
    lines = [f"a0: &a0 [{', '.join([leaf] * 9)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _set_rate(folder: Path, token: str) -> None:
    """Write ``token`` (raw JSON text) as the first run's sokoban success rate."""
    data = json.loads((folder / "summary.json").read_text())
    data["runs"][0]["eval"]["free"]["per_env"]["sokoban"]["success_rate"] = "@RATE@"
    (folder / "summary.json").write_text(json.dumps(data).replace('"@RATE@"', token))


def _bank(path: Path) -> Path:
    """A bank written by the project, holding one lesson with terminal escapes, a C1 control and a NUL."""
    bank = ExperienceBank(path, HashEmbedder(384))
    res = bank.apply([Operation("ADD", HOSTILE_TITLE, HOSTILE_CONTENT)], env_id="sokoban", step=1,
                     extraction_id="x", extractor_version=0)
    assert not res.rejected
    bank.close()
    return path


def _journal_mode(path: Path) -> str:
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return con.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        con.close()


def _state(path: Path) -> tuple:
    """Bytes, mtime and journal mode of a SQLite file, and the files beside it."""
    return (path.read_bytes(), path.stat().st_mtime_ns, _journal_mode(path),
            sorted(p.name for p in path.parent.iterdir()))


# ---- 4: no symbolic link out of the submission ----------------------------------------------------------
def test_submission_check_refuses_a_symlink_out_of_the_folder_and_shows_nothing_of_its_target(tmp_path):
    folder = _submission(tmp_path, "linked")
    secret = tmp_path / "shadow"
    secret.write_text(SECRET + "\n")
    (folder / "metadata.yaml").unlink()
    (folder / "metadata.yaml").symlink_to(secret)
    problems = check_submission(folder)
    assert len(problems) == 1 and "symbolic link" in problems[0] and "metadata.yaml" in problems[0]
    err = io.StringIO()
    assert main_submission_check(folder, io.StringIO(), err) == 1
    assert "SECRET" not in err.getvalue()
    # a link to a file inside the folder is fine
    (folder / "metadata.yaml").unlink()
    (folder / "meta.real.yaml").write_text(yaml.safe_dump({"name": "x"}))
    (folder / "metadata.yaml").symlink_to("meta.real.yaml")
    assert not any("symbolic link" in p for p in check_submission(folder))


# ---- 5: report opens banks read-only and never makes a foreign file a bank ------------------------------
def test_report_leaves_banks_and_foreign_sqlite_files_as_they_were(tmp_path):
    from crl_bench.results.report import make_report

    wal_run = make_run(tmp_path / "runs", "wal", method="complementary")
    _bank(wal_run / "experience.sqlite")                               # WAL mode, closed cleanly
    copy_run = make_run(tmp_path / "runs", "copy", method="complementary", seed=1)
    with ExperienceBank(wal_run / "experience.sqlite", HashEmbedder(384)) as bank:
        bank.backup(copy_run / "experience.sqlite")                   # the project's copy: rollback journal
    foreign_run = make_run(tmp_path / "runs", "foreign", method="complementary", seed=2)
    con = sqlite3.connect(foreign_run / "experience.sqlite")
    con.execute("CREATE TABLE notes (body TEXT)")
    con.commit()
    con.close()
    paths = [r / "experience.sqlite" for r in (wal_run, copy_run, foreign_run)]
    before = [_state(p) for p in paths]
    assert [b[2] for b in before] == ["wal", "delete", "delete"]
    with pytest.warns(UserWarning, match="not a crl-bench experience bank"):
        page = make_report([tmp_path / "runs"], tmp_path / "out").read_text()
    assert [_state(p) for p in paths] == before
    con = sqlite3.connect(f"{paths[2].resolve().as_uri()}?mode=ro", uri=True)
    assert [r[0] for r in con.execute("SELECT name FROM sqlite_master")] == ["notes"]
    con.close()
    assert "not a crl-bench experience bank" in page
    assert "evil" in page                                              # the real banks were read


def test_bank_show_and_stats_leave_the_bank_as_it_was(tmp_path, capsys):
    path = _bank(tmp_path / "experience.sqlite")
    copy = tmp_path / "copy" / "experience.sqlite"
    copy.parent.mkdir()
    with ExperienceBank(path, HashEmbedder(384)) as bank:
        bank.backup(copy)
    for p in (path, copy):
        before = _state(p)
        assert main(["bank", "show", str(p)]) == 0 and main(["bank", "stats", str(p)]) == 0
        assert _state(p) == before


# ---- 6: names from the command line stay inside their folder --------------------------------------------
@pytest.mark.parametrize("bad", ["../escaped", "/tmp/abs", "a/b", "..", "a..b", ".hidden", "-x", "x" * 129, ""])
def test_check_name_refuses_what_could_leave_the_folder(bad):
    with pytest.raises(ConfigError, match="--run-id"):
        check_name(bad, "--run-id")


def test_check_name_accepts_ordinary_names():
    for ok in ("smoke", "2024-01-01-grpo-sokoban-s0", "a.b_c-d", "x" * 128):
        assert check_name(ok, "--run-id") == ok


def test_run_id_and_names_outside_the_output_folder_are_refused(tmp_path, capsys):
    out = tmp_path / "inner" / "runs"
    base = ["run", "--method", "grpo", "--preset", "smoke", "--mix", "sokoban", "--steps", "0",
            "--output-dir", str(out)]
    for argv, flag in ((base + ["--run-id", "../escaped"], "--run-id"),
                       (base + ["--run-id", str(tmp_path / "abs")], "--run-id"),
                       (base + ["--set", "run_id=../escaped"], "run_id"),
                       (["sweep", "--mix", "sokoban", "--preset", "smoke", "--methods", "grpo", "--seeds", "0",
                         "--output-dir", str(out), "--name", "../escaped"], "--name")):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("crl-bench: error:") and flag in err and "Traceback" not in err, err
    run = make_run(tmp_path / "runs", "r")
    err = io.StringIO()
    assert main_submission_pack([run], "../escaped", root=tmp_path / "subs", stderr=err) == 2
    assert "--name" in err.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]           # nothing created anywhere


# ---- 7: YAML aliases are bounded ----------------------------------------------------------------------
def test_billion_laughs_metadata_is_refused_at_once(tmp_path, monkeypatch):
    folder = _submission(tmp_path, "laughs")
    (folder / "metadata.yaml").write_text(_laughs(6) + "name: laughs\n")     # 9^6 values expanded
    for config in (folder / "configs").iterdir():      # the check parses them too: count metadata.yaml only
        config.unlink()
    # the work is counted, not timed: YAML nodes composed and documents constructed by the check
    composed, constructed = [], []
    compose, construct = safe_io._BoundedLoader.compose_node, safe_io._BoundedLoader.construct_document
    monkeypatch.setattr(safe_io._BoundedLoader, "compose_node",
                        lambda self, parent, index: composed.append(1) or compose(self, parent, index))
    monkeypatch.setattr(safe_io._BoundedLoader, "construct_document",
                        lambda self, node: constructed.append(1) or construct(self, node))
    problems = check_submission(folder)
    assert len(problems) == 1 and "aliases" in problems[0] and "metadata.yaml" in problems[0]
    # refused at the first alias (line 2) while composing: the 15 nodes up to it (the top mapping, key
    # a0 and its list of 9, key a1, its list, the alias), nothing expanded, no Python object built
    assert "line 2," in problems[0] and len(composed) == 15 and constructed == [], (problems, len(composed))


def test_billion_laughs_config_is_refused_and_ordinary_anchors_still_load(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_laughs(10, "1") + "train: {seed: 1}\n")                 # 9^10 values expanded
    with pytest.raises(ConfigError, match="once its aliases are expanded"):
        load_yaml(bomb)
    ok = tmp_path / "ok.yaml"
    ok.write_text("rollout: &r {max_steps: 6}\neval: {episodes: 2}\nextra: *r\n")
    assert load_yaml(ok)["extra"] == {"max_steps": 6}


# ---- 8: bad encodings, depth, huge numbers: per file, never a traceback, the rest still written ---------
HOSTILE_SUMMARIES = {
    "badutf8": (b'{"kind": "\xff\xfe"}', "not UTF-8"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
    "bignum": (None, "digits"),
    "overflow": (None, "not a finite number"),
}


def _hostile_subs(root: Path) -> dict[str, Path]:
    folders = {}
    for name, (raw, _) in HOSTILE_SUMMARIES.items():
        folder = folders[name] = _submission(root, name)
        if raw is not None:
            (folder / "summary.json").write_bytes(raw)
    _set_rate(folders["bignum"], "9" * 5000)
    _set_rate(folders["overflow"], "1e999")
    return folders


def test_submission_check_reports_bad_encoding_depth_and_huge_numbers_per_file(tmp_path):
    folders = _hostile_subs(tmp_path)
    for name, (_, needle) in HOSTILE_SUMMARIES.items():
        problems = check_submission(folders[name])
        assert len(problems) == 1 and problems[0].startswith(str(folders[name] / "summary.json")), problems
        assert needle in problems[0], problems
    meta = _submission(tmp_path, "meta")
    for text, needle in ((b"name: \xff\xfe\n", "not UTF-8"), (b"a: " + b"[" * 5000 + b"]" * 5000, "nested deeper"),
                         (b"x" * 70_000, "bytes, more than")):
        (meta / "metadata.yaml").write_bytes(text)
        problems = check_submission(meta)
        assert len(problems) == 1 and "metadata.yaml" in problems[0] and needle in problems[0], problems


def test_leaderboard_skips_hostile_summaries_and_writes_the_rest(tmp_path):
    _hostile_subs(tmp_path)
    _submission(tmp_path, "good")
    out, err = io.StringIO(), io.StringIO()
    assert main_leaderboard([tmp_path / "subs"], tmp_path / "lb", out, err) == 0
    assert (tmp_path / "lb" / "leaderboard.md").is_file() and "from 1 summaries" in out.getvalue()
    warned = [line for line in err.getvalue().splitlines() if line.startswith("warning: skipped")]
    assert len(warned) == len(HOSTILE_SUMMARIES)
    for name in HOSTILE_SUMMARIES:
        assert any(str(tmp_path / "subs" / name / "summary.json") in line for line in warned), name


# ---- 9: finite numbers only ---------------------------------------------------------------------------
@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_success_rates_fail_the_check_and_leave_the_leaderboard(tmp_path, token):
    bad = _submission(tmp_path, "bad")
    _set_rate(bad, token)
    problems = check_submission(bad)
    assert len(problems) == 1 and "not a finite number" in problems[0]
    _submission(tmp_path, "good")
    warnings: list[str] = []
    got = collect([tmp_path / "subs"], warnings)
    assert [s["runs"][0]["run_id"] for s in got] == ["good-r0"]
    assert len(warnings) == 1 and "bad" in warnings[0] and "not a finite number" in warnings[0]


def test_summary_problems_flag_nan_in_memory(tmp_path):
    data = json.loads((_submission(tmp_path, "mem") / "summary.json").read_text())
    data["runs"][0]["eval"]["free"]["per_env"]["sokoban"]["success_rate"] = float("nan")
    assert summary_problems(data) == ["$.runs[0].eval.free.per_env.sokoban.success_rate: not a finite number"]


# ---- 10: control characters never reach the terminal or the page raw ----------------------------------
def test_bank_show_escapes_control_characters(tmp_path, capsys):
    _bank(tmp_path / "experience.sqlite")
    capsys.readouterr()
    assert main(["bank", "show", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    for raw in ("\x1b", "\x00", "\x07", "\x9b"):
        assert raw not in shown
    assert "\\x1b[2J" in shown and "\\x00" in shown and "\\x9b" in shown
    assert "\n    line2\ttab" in shown                   # a lesson's newline stays inside the entry


def test_report_html_has_no_raw_control_characters(tmp_path):
    from crl_bench.results.report import make_report

    run = make_run(tmp_path / "runs", "r", method="complementary")
    _bank(run / "experience.sqlite")
    page = make_report([run], tmp_path / "out").read_bytes()
    for raw in (b"\x00", b"\x1b", b"\x07", "\x9b".encode()):
        assert raw not in page
    assert b"\\x1b[2J" in page and b"\\x00" in page


# ---- 11: corrupt and foreign banks, bad UTF-8 in a bank, deep configs, bench sizes --------------------
def _eval_run(tmp_path: Path, bank_bytes: bytes | None) -> Path:
    run = make_run(tmp_path, "ev", method="complementary")
    (run / "checkpoint").mkdir()
    bank = run / "experience.sqlite"
    if bank_bytes is None:
        con = sqlite3.connect(bank)
        con.execute("CREATE TABLE notes (body TEXT)")
        con.commit()
        con.close()
    else:
        bank.write_bytes(bank_bytes)
    return run


@pytest.mark.parametrize("bank_bytes", [None, b"SQLite format 3\x00" + bytes(range(256)) * 16, b"junk" * 100],
                         ids=["foreign", "corrupt", "not-sqlite"])
def test_eval_run_with_a_bad_bank_is_a_clear_error_before_any_model_loads(tmp_path, capsys, monkeypatch,
                                                                           bank_bytes):
    import crl_bench.trainer.lifecycle as lifecycle

    def no_trainer(*a, **k):
        raise AssertionError("the trainer (and its models) must not be built for a bad bank")

    monkeypatch.setattr(lifecycle, "Trainer", no_trainer)
    run = _eval_run(tmp_path, bank_bytes)
    assert main(["eval", "--run", str(run), "--episodes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("crl-bench: error: --run") and str(run / "experience.sqlite") in err


@pytest.mark.parametrize("read_only", [True, False], ids=["read-only", "read-write"])
def test_bank_opened_with_an_embedder_of_another_dimension_says_so(tmp_path, read_only):
    path = _bank(tmp_path / "experience.sqlite")                 # 384-dim
    with pytest.raises(EmbeddingDimError, match="holds 384-dim embeddings, embedder gives 16"):
        ExperienceBank(path, HashEmbedder(16), read_only=read_only)


def test_eval_run_with_another_embedder_is_a_clear_error(tmp_path, capsys, monkeypatch):
    """``eval --run`` with an ``experience.embedder`` of another dimension than the run's bank: one
    ``crl-bench: error:`` line naming the bank and the setting, not a traceback. The stand-in trainer
    opens the run's bank as the real one does, with a 16-dim embedder (models are not loaded)."""
    import crl_bench.trainer.lifecycle as lifecycle

    def trainer_with_a_16_dim_embedder(cfg, writer=None, read_only_bank=None, **_):
        ExperienceBank(read_only_bank, HashEmbedder(16), read_only=True)
        raise AssertionError("the bank opened with an embedder of another dimension")

    monkeypatch.setattr(lifecycle, "Trainer", trainer_with_a_16_dim_embedder)
    run = make_run(tmp_path, "ev", method="complementary")
    (run / "checkpoint").mkdir()
    _bank(run / "experience.sqlite")
    assert main(["eval", "--run", str(run), "--episodes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("crl-bench: error: --run") and "384-dim" in err and "experience.embedder" in err
    assert "Traceback" not in err


def test_bank_with_corrupt_embeddings_is_not_a_bank(tmp_path):
    path = _bank(tmp_path / "experience.sqlite")
    con = sqlite3.connect(path)
    con.execute("UPDATE entries SET embedding = x'00010203'")
    con.commit()
    con.close()
    with pytest.raises(NotABankError, match="experience.sqlite"):
        ExperienceBank.open_readonly(path)


def _tampered_bank(tmp_path, sql: str):
    """A bank of :func:`_bank` with ``sql`` run on it behind the bank's back."""
    path = _bank(tmp_path / "experience.sqlite")
    con = sqlite3.connect(path)
    con.execute(sql)
    con.commit()
    con.close()
    return path


def test_bank_show_on_invalid_utf8_text(tmp_path, capsys):
    path = _tampered_bank(tmp_path, "UPDATE entries SET content = CAST(x'6869fffe' AS TEXT)")
    capsys.readouterr()
    assert main(["bank", "show", str(path)]) == 0
    assert "hi\ufffd\ufffd" in capsys.readouterr().out


def test_bank_show_on_rows_a_bank_never_holds(tmp_path, capsys):
    path = _tampered_bank(tmp_path, "UPDATE entries SET votes = 'many'")
    capsys.readouterr()
    assert main(["bank", "show", str(path)]) == 2
    assert "not a readable crl-bench experience bank" in capsys.readouterr().err


def test_deep_yaml_config_is_a_clear_error(tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("train: " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert main(["run", "--mix", "sokoban", "--preset", "smoke", "--config", str(deep),
                 "--output-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "deep.yaml" in err and "nested deeper" in err and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("sizes", ["-1", "0", "1.5"])
def test_bench_retrieval_bad_sizes_are_a_usage_error(sizes, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "retrieval", f"--sizes={sizes}"])
    assert exit_info.value.code == 2
    assert "--sizes" in capsys.readouterr().err


# ---- the reader itself -------------------------------------------------------------------------------
def test_read_text_refuses_fifos_and_oversized_files_without_reading_them(tmp_path):
    fifo = tmp_path / "summary.json"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match="not a regular file"):
        read_text(fifo)                         # opening a FIFO would block forever
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 100 + "0]")
    with pytest.raises(InputFileError, match="more than the 50 accepted"):
        load_json(big, max_bytes=50)


def test_parsers_refuse_what_the_limits_forbid():
    for text, needle in (("NaN", "not a finite"), ("[1e999]", "overflows"), ("1" * 101, "digits"),
                         ("[" * 65 + "]" * 65, "nested deeper")):
        with pytest.raises(InputFileError, match=needle):
            parse_json(text, "x.json")
    assert parse_json("[" * 64 + "]" * 64, "x.json") is not None
    for text, kw, needle in (("a: &a [*a]", {"max_aliases": 5}, "recursive alias"),
                             ("a: &x 1\nb: *x", {}, "aliases"),
                             ("a: " + "9" * 101, {}, "integer"),
                             ("a: .nan", {"finite": True}, "not a finite"),
                             ("a: !!python/object/apply:os.system [ls]", {}, "constructor")):
        with pytest.raises(InputFileError, match=needle):
            parse_yaml(text, "x.yaml", **kw)


def test_printable_escapes_controls_and_keeps_text():
    assert printable("a\x1b[1mb\x00\x9b\x7f\ud800") == "a\\x1b[1mb\\x00\\x9b\\x7f\\ud800"
    assert printable("line\n\ttab é ✓") == "line\n\ttab é ✓"
    assert printable("a\nb", keep="") == "a\\x0ab"
    assert printable(None) == ""
