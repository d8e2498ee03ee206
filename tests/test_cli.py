"""The command line: listing, playing, config errors, the command modules."""

import io
import warnings

import pytest

from crl_bench.cli import build_parser, main
from crl_bench.commands.envs import env_doc, play


def test_envs_list(capsys):
    assert main(["envs", "list"]) == 0
    out = capsys.readouterr().out
    for env_id in ("sokoban", "minihack-room", "minihack-maze", "minihack-keyroom", "minihack-river"):
        assert env_id in out
    assert "up, down, left, right" in out


def test_envs_list_names_an_open_action_set_by_its_docs_page(capsys, monkeypatch):
    """An env without a closed action set (``admissible_actions`` None, as WebShop) is listed as
    taking free text, with the page that gives its syntax, not as if it had an action named "open"."""
    import crl_bench.env_api as env_api

    real = env_api.make_env

    def make_env(env_id, **kw):
        env = real("sokoban", **kw)
        if env_id == "webshop":
            env.admissible_actions = lambda: None
        return env

    monkeypatch.setattr(env_api, "list_envs", lambda: ["sokoban", "webshop"])
    monkeypatch.setattr(env_api, "make_env", make_env)
    assert main(["envs", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("actions: up, down, left, right")
    assert lines[1].startswith("webshop") and "actions: free text, as docs/envs/webshop.md says" in lines[1]


def test_envs_list_says_warnings_and_unavailable_envs_in_one_short_line(capsys, monkeypatch):
    """A setup warning is a short note under its env (no ``UserWarning`` line with a file path), and
    an env that cannot be built here is one line with its reason cut short and its docs page."""
    import crl_bench.env_api as env_api

    real = env_api.make_env

    def make_env(env_id, **kw):
        if env_id == "swebench-verified":
            raise RuntimeError("no Docker daemon reachable " + "and a very long explanation " * 40)
        if env_id == "sokoban":
            warnings.warn("sokoban: a setup note " + "x" * 500, UserWarning, stacklevel=2)
        return real(env_id, **kw)

    monkeypatch.setattr(env_api, "list_envs", lambda: ["sokoban", "swebench-verified"])
    monkeypatch.setattr(env_api, "make_env", make_env)
    assert main(["envs", "list"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert [line.split()[0] for line in lines] == ["sokoban", "note:", "swebench-verified"]
    assert lines[1].strip().startswith("note: sokoban: a setup note") and lines[1].endswith(" ...")
    assert lines[2].startswith("swebench-verified  unavailable here (RuntimeError: no Docker daemon")
    assert lines[2].endswith("see docs/envs/swebench.md")
    assert all(len(line) < 260 for line in lines)
    assert "UserWarning" not in captured.out + captured.err and ".py:" not in captured.out + captured.err


@pytest.mark.parametrize("env_id, page", [("minihack-room", "minihack"), ("diag-vault", "diag"),
                                          ("swebench-verified", "swebench"), ("sokoban", "sokoban"),
                                          ("alfworld", "alfworld"), ("webshop", "webshop")])
def test_every_env_docs_page_exists(env_id, page):
    from pathlib import Path

    assert env_doc(env_id) == f"docs/envs/{page}.md"
    assert (Path(__file__).resolve().parents[1] / env_doc(env_id)).is_file()


def test_version_and_top_level_help(capsys):
    from crl_bench import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"crl-bench {__version__}"
    text = build_parser().format_help()
    assert "Complementary RL" in text and "``" not in text and "--version" in text


def test_envs_play_scripted_human():
    """A human can play: bare words and tagged answers both work, invalid input is reported."""
    from crl_bench.env_api import make_env

    env = make_env("sokoban")
    env.reset(options={"task": 0})
    stdin = io.StringIO("jump\nup\n<answer>LEFT</answer>\nquit\n")
    out = io.StringIO()
    assert play("sokoban", 0, 10, stdin=stdin, stdout=out) == 0
    text = out.getvalue()
    assert "Legend:" in text and "Invalid action" in text and "bye" in text


def test_envs_play_to_the_end():
    stdin = io.StringIO("north\n" * 3)
    out = io.StringIO()
    play("minihack-room", 0, 2, stdin=stdin, stdout=out)
    assert "Episode over: truncated" in out.getvalue()


def test_bad_config_key_exits_2(capsys):
    rc = main(["run", "--mix", "sokoban", "--preset", "smoke", "--set", "train.lrr=1"])
    assert rc == 2
    assert "train.lrr" in capsys.readouterr().err


def test_unknown_method_and_preset(capsys):
    assert main(["run", "--method", "nope", "--mix", "sokoban"]) == 2
    assert "grpo" in capsys.readouterr().err
    assert main(["run", "--preset", "nope", "--mix", "sokoban"]) == 2
    assert "smoke" in capsys.readouterr().err


def test_parser_has_commands():
    p = build_parser()
    args = p.parse_args(["run", "--method", "grpo", "--mix", "sokoban", "--steps", "3", "--seed", "7"])
    assert args.steps == 3 and args.seed == 7 and args.method == "grpo"


def test_every_command_is_a_module_of_the_commands_table():
    """``crl-bench --help`` lists the commands of ``crl_bench.commands.COMMANDS`` in order; each module
    has ``HELP``, ``add_parser`` and ``run``, and a parsed command carries its module's ``run``."""
    import argparse

    from crl_bench.commands import COMMANDS, command

    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(COMMANDS)
    for name in COMMANDS:
        mod = command(name)
        assert isinstance(mod.HELP, str) and mod.HELP and callable(mod.add_parser) and callable(mod.run), name
    assert p.parse_args(["leaderboard"]).func is command("leaderboard").run
    assert p.parse_args(["envs", "list"]).func is command("envs").run
    with pytest.raises(KeyError, match="known: run, plan, sweep"):
        command("nope")


def test_run_help_lists_every_method(capsys):
    """``crl-bench run --help`` names each registered method and the page that describes them."""
    from crl_bench.methods import list_methods

    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())        # argparse wraps the help to the terminal width
    assert e.value.code == 0
    assert f"one of: {', '.join(list_methods())}" in text and "docs/method.md" in text
    assert {"grpo", "static", "complementary", "casebank", "expel", "reflexion"} <= set(list_methods())


def test_bank_show_and_stats(tmp_path, capsys):
    """`crl-bench bank show/stats RUN` read a run's experience.sqlite."""
    from crl_bench.experience.bank import ExperienceBank
    from crl_bench.experience.embedding import SentenceEmbedder
    from crl_bench.experience.types import Operation

    bank = ExperienceBank(tmp_path / "experience.sqlite", SentenceEmbedder())
    res = bank.apply([Operation("ADD", "Go around walls", "If a move bumps a wall, try the other axis.")],
                     env_id="sokoban", step=1, extraction_id="x1", extractor_version=0)
    eid = res.applied[0][1]
    bank.record_retrieval([eid], 1.0)
    bank.record_outcome([eid], True)
    bank.apply([Operation("UPDATE", "", "", (eid,))], env_id="sokoban", step=1, extraction_id="x2", extractor_version=0)
    res = bank.apply([Operation("ADD", "Push from behind", "Stand behind a box to push it."),
                      Operation("UPVOTE", targets=(eid,))],
                     env_id="sokoban", step=2, extraction_id="x3", extractor_version=0)
    new = bank.apply([Operation("UPDATE", "Push from behind", "Stand on the far side of a box.",
                                (res.applied[0][1],))],
                     env_id="sokoban", step=3, extraction_id="x4", extractor_version=1).applied[0][1]
    bank.close()
    assert main(["bank", "show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"#{eid} [sokoban] Go around walls" in out and "retrieved 1, guided 1 successes" in out
    assert "votes +1; add at step 1" in out
    assert f"#{new} [sokoban] Push from behind" in out and f"update of #{res.applied[0][1]} at step 3" in out
    assert main(["bank", "show", str(tmp_path), "--sort", "votes"]) == 0
    assert capsys.readouterr().out.startswith(f"#{eid} ")
    assert main(["bank", "stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert '"count": 2' in out and "empty_text" in out and '"upvotes": 1' in out
    assert '"update": 1' in out and '"with_parents": 1' in out and '"merge_pass"' in out
    assert main(["bank", "show", str(tmp_path / "nowhere")]) == 2


def test_bank_show_lists_reflections_newest_first(tmp_path, capsys):
    """A reflexion bank: `bank show` prints each reflection with its env, task and step, newest first, escaped,
    and `--env` / `--limit` narrow the list and its count."""
    from crl_bench.experience.bank import ExperienceBank
    from crl_bench.experience.embedding import HashEmbedder

    bank = ExperienceBank(tmp_path / "experience.sqlite", HashEmbedder(16))
    bank.add_reflections([("room", 1, "Go north first.", 1), ("maze", 4, "Turn \x1b[31mleft.", 2),
                          ("room", 2, "Try the east door.", 3)])
    bank.close()
    assert main(["bank", "show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.index("[room] task 2, written at step 3\n    Try the east door.") < \
        out.index("[maze] task 4, written at step 2") < out.index("[room] task 1, written at step 1")
    assert "\x1b" not in out and "3 reflections\n" in out
    assert main(["bank", "show", str(tmp_path), "--env", "room", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "Try the east door." in out and "Go north first." not in out and "maze" not in out
    assert "2 reflections (showing the newest 1)" in out


def test_step_line_names_reflections_for_reflexion():
    """The console line shows the reflection count for reflexion (its bank holds no entries) and the bank size
    for the other experience methods."""
    from crl_bench.trainer.lifecycle import step_line

    row = {"step": 3, "success_rate": 0.25, "reward_mean": 0.25, "steps_mean": 2.0, "invalid_action_rate": 0.0,
           "tokens_per_s": 10.0, "time_step_s": 1.0, "success_rate/guided": 0.5, "success_rate/free": 0.0,
           "bank_size": 0}
    assert step_line(row).endswith("guided 0.50 free 0.00  bank 0")
    assert step_line({**row, "reflections": 7}).endswith("guided 0.50 free 0.00  reflections 7")
    assert "guided" not in step_line({k: v for k, v in row.items() if k != "bank_size"})


def _bank_files(folder):
    return sorted(p.name for p in folder.iterdir())


def test_bank_inspection_never_writes(tmp_path, capsys):
    """`bank show/stats` open the bank read-only: a cleanly closed bank gets no -wal/-shm beside it and
    its bytes are unchanged; an unrelated SQLite file is refused (exit 2), not given the bank's tables
    and switched to WAL; a corrupt file is a clear error, not a traceback."""
    import sqlite3

    from crl_bench.experience.bank import ExperienceBank
    from crl_bench.experience.embedding import HashEmbedder
    from crl_bench.experience.types import Operation

    run = tmp_path / "run"
    run.mkdir()
    bank = ExperienceBank(run / "experience.sqlite", HashEmbedder(384))
    bank.apply([Operation("ADD", "t", "c")], env_id="e", step=1, extraction_id="x", extractor_version=0)
    bank.close()
    before, files = (run / "experience.sqlite").read_bytes(), _bank_files(run)
    assert main(["bank", "stats", str(run)]) == 0 and main(["bank", "show", str(run)]) == 0
    assert (run / "experience.sqlite").read_bytes() == before and _bank_files(run) == files

    other = tmp_path / "other.sqlite"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE notes (body TEXT)")
    con.commit()
    con.close()
    before = other.read_bytes()
    capsys.readouterr()
    for cmd in ("stats", "show"):
        assert main(["bank", cmd, str(other)]) == 2
        assert "not a crl-bench experience bank" in capsys.readouterr().err
    assert other.read_bytes() == before and _bank_files(tmp_path) == ["other.sqlite", "run"]
    con = sqlite3.connect(other)
    assert [r[0] for r in con.execute("SELECT name FROM sqlite_master")] == ["notes"]
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    con.close()

    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 40)
    assert main(["bank", "stats", str(corrupt)]) == 2
    assert "crl-bench: error:" in capsys.readouterr().err


def test_bank_without_its_wal_is_explained(tmp_path, capsys):
    """A bank whose writer never checkpointed keeps its entries in the -wal: read with it, the entries
    are there; the .sqlite copied alone is refused with the reason (its -wal is missing)."""
    import shutil

    from crl_bench.experience.bank import ExperienceBank
    from crl_bench.experience.embedding import HashEmbedder
    from crl_bench.experience.types import Operation

    live = tmp_path / "live"
    live.mkdir()
    bank = ExperienceBank(live / "experience.sqlite", HashEmbedder(384))    # stays open: a "crashed" run
    bank.apply([Operation("ADD", "lesson", "body")], env_id="e", step=1, extraction_id="x", extractor_version=0)
    with_wal, alone = tmp_path / "with_wal", tmp_path / "alone"
    with_wal.mkdir()
    alone.mkdir()
    for name in ("experience.sqlite", "experience.sqlite-wal", "experience.sqlite-shm"):
        shutil.copy(live / name, with_wal / name)
    shutil.copy(live / "experience.sqlite", alone / "experience.sqlite")
    bank.close()
    capsys.readouterr()
    assert main(["bank", "show", str(with_wal)]) == 0
    assert "[e] lesson" in capsys.readouterr().out
    assert main(["bank", "show", str(alone)]) == 2
    assert "experience.sqlite-wal is missing" in capsys.readouterr().err


def test_eval_refuses_a_run_without_checkpoint(tmp_path, capsys):
    """`eval --run` on a run with no checkpoint/ evaluated the base model with exit 0 before."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("method: grpo\nrollout:\n  mix: minihack-room\n")
    assert main(["eval", "--run", str(run), "--quiet"]) == 2
    assert "has no checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_flags_resolve_into_config():
    from crl_bench.commands.options import resolve_config

    args = build_parser().parse_args(["run", "--method", "static", "--mix", "sokoban", "--preset", "smoke",
                                      "--extractor-model", "some/model", "--model", "a/b", "--seed", "3",
                                      "--set", "experience.k=2"])
    cfg = resolve_config(args)
    assert cfg.method == "static" and cfg.extractor.model == "some/model" and cfg.model.name == "a/b"
    assert cfg.train.seed == 3 and cfg.experience.k == 2 and cfg.rollout.mix == "sokoban"


# ------------------------------------------------------------------- bad input: exit 2, nothing written
def _bad_inputs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("envs: [minihack-room\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    listing = tmp_path / "list.yaml"
    listing.write_text("- minihack-room\n- sokoban\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    out = str(tmp_path / "runs")
    base = ["run", "--method", "grpo", "--preset", "smoke", "--output-dir", out]
    return {
        "mixture not YAML": (base + ["--mix", str(bad)], "not valid YAML"),
        "mixture binary": (base + ["--mix", str(binary)], "not a text"),
        "mixture a list": (base + ["--mix", str(listing)], "must hold a mapping"),
        "--set not YAML": (base + ["--mix", "minihack-room", "--set", "train.steps=[1"], "train.steps"),
        "binary --config": (base + ["--mix", "minihack-room", "--config", str(binary)], "not a text"),
        "list --config": (base + ["--mix", "minihack-room", "--config", str(listing)], "must hold a mapping"),
        "--model missing folder": (base + ["--mix", "minihack-room", "--model", str(tmp_path / "nowhere")],
                                   "does not exist"),
        "no final evaluation": (base + ["--mix", "minihack-room", "--set", "eval.episodes=0"],
                                "eval.episodes"),
        "float16 training": (base + ["--mix", "minihack-room", "--set", "model.dtype=float16"], "loss scaler"),
        "--output-dir under a file": (["run", "--method", "grpo", "--preset", "smoke", "--mix", "minihack-room",
                                       "--output-dir", str(a_file / "runs")], "cannot be created"),
        "play sokoban task -5": (["envs", "play", "sokoban", "--task", "-5"], "-5 is not a task id"),
        "play minihack task -5": (["envs", "play", "minihack-room", "--task", "-5"], "-5 is not a task id"),
        "play alfworld-free task": (["envs", "play", "sokoban", "--task", "99999999"], "not a task id"),
    }


def test_bad_input_is_a_clear_error_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """Each bad input is a one-line ``crl-bench: error:`` naming the problem, exit 2, no traceback and
    no run folder; a CLI that let them reach the code below would print a traceback (exit 1) or, for
    minihack --task -5, accept it silently."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    for name, (argv, needle) in _bad_inputs(tmp_path).items():
        capsys.readouterr()
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("crl-bench: error:") and needle in err, (name, err)
        assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()          # no run folder, not even the output folder


def test_envs_play_with_stdin_closed(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", None)
    assert main(["envs", "play", "minihack-room"]) == 2
    assert "standard input" in capsys.readouterr().err
    closed = io.StringIO("north\n")
    closed.close()
    monkeypatch.setattr("sys.stdin", closed)
    assert main(["envs", "play", "minihack-room"]) == 2


def test_task_ids_are_validated_the_same_way_everywhere():
    import pytest

    from crl_bench.env_api import make_env

    for env_id in ("sokoban", "minihack-room"):
        env = make_env(env_id)
        for bad in (-5, 2 ** 40, 1.5, True, "x", None, [1]):
            with pytest.raises(KeyError, match="task id"):
                env.check_task(bad)
        assert env.check_task(3) == 3 and env.check_task(3.0) == 3
        eval_id = env.task_ids("eval")[0]
        assert env.check_task(eval_id) == eval_id
        env.close()
