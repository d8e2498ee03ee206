"""Quick check of the env benchmark (crl_bench/bench/env.py) and its raw simulator adapters
(crl_bench/bench/raw.py): it runs, both paths take the same steps.

No timing ratio is asserted (machine-dependent); see ``crl-bench bench env`` for numbers.
"""

from __future__ import annotations

import math

import pytest

from crl_bench.bench.env import bench_env, format_table
from crl_bench.bench.raw import raw_simulator
from crl_bench.env_api import make_env

ENVS = ["sokoban", "minihack-room"]
STEPS = 200


@pytest.fixture(scope="module")
def rows():
    return bench_env(ENVS, steps=STEPS)


def test_rows_and_rates(rows):
    assert [r["env"] for r in rows] == ENVS
    for r in rows:
        for key in ("raw_steps_per_s", "text_steps_per_s", "raw_step_us", "text_step_us", "ratio",
                    "raw_reset_ms", "text_reset_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["env"], key, r[key])
        assert r["ratio"] == pytest.approx(r["raw_steps_per_s"] / r["text_steps_per_s"])


def test_same_steps_on_both_paths(rows):
    for r in rows:
        assert r["raw_steps"] == r["text_steps"] == STEPS, r
        # deterministic envs, same actions, same tasks, same episode ends: the same episodes
        assert r["raw_episodes"] == r["text_episodes"] >= 2, r
        assert r["raw_game_ends"] == r["text_game_ends"], r
        assert r["raw_resets"] == r["text_resets"] >= 1, r


def test_format_table(rows):
    table = format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert "ratio" in lines[0] and "raw steps/s" in lines[0]
    for r, line in zip(rows, lines[2:]):
        assert line.startswith(r["env"])


@pytest.mark.parametrize("env_id", ENVS)
def test_raw_path_follows_the_text_env(env_id):
    """The raw simulator plays the same game as reset/step: same episode ends for the same actions."""
    text, env = make_env(env_id), make_env(env_id)
    try:
        raw = raw_simulator(env)
        actions = text.admissible_actions()
        for task in (0, 1, 2):
            text.reset(options={"task": task})
            raw.reset(task)
            for k in range(40):
                a = actions[(7 * k + task) % len(actions)]
                _, _, terminated, truncated, _ = text.step(f"<answer>{a}</answer>")
                assert raw.step(a) is terminated
                if terminated or truncated:
                    break
    finally:
        text.close()
        env.close()


def test_raw_step_reports_the_game_end():
    """minihack-room's fixed room: four steps southeast from the top-left corner reach the stairs."""
    env = make_env("minihack-room")
    try:
        raw = raw_simulator(env)
        for task in (0, 5):
            raw.reset(task)
            assert [raw.step("southeast") for _ in range(4)] == [False, False, False, True]
        env.close()
        with pytest.raises(RuntimeError, match="after close"):
            raw.reset(0)
    finally:
        env.close()


def test_bad_arguments():
    with pytest.raises(ValueError):
        bench_env(["sokoban"], steps=0)
    with pytest.raises(KeyError):
        bench_env(["no-such-env"], steps=10)


# ------------------------------------------------------------------------------------ unavailable envs
def _unavailable(monkeypatch, env_id, message="no Docker daemon (test)"):
    """make_env (as the env bench calls it) raises EnvUnavailableError for ``env_id``, as SWE-bench
    does without a Docker daemon or its container images."""
    import crl_bench.bench.env as be
    from crl_bench.env_api import EnvUnavailableError

    real = be.make_env

    def fake(name, **kw):
        if name == env_id:
            raise EnvUnavailableError(message)
        return real(name, **kw)

    monkeypatch.setattr(be, "make_env", fake)


def test_unavailable_env_is_skipped_with_its_reason(monkeypatch):
    from crl_bench.env_api import EnvUnavailableError

    _unavailable(monkeypatch, "minihack-room")
    skipped = []
    rows = bench_env(["sokoban", "minihack-room"], steps=50, skipped=skipped)
    assert [r["env"] for r in rows] == ["sokoban"]
    assert skipped == [("minihack-room", "EnvUnavailableError: no Docker daemon (test)")]
    with pytest.raises(EnvUnavailableError):            # without a skip list it still raises
        bench_env(["minihack-room"], steps=50)


def test_open_action_set_is_skipped(monkeypatch):
    from crl_bench.bench.env import OpenActionSetError
    from crl_bench.envs.sokoban import SokobanEnv

    monkeypatch.setattr(SokobanEnv, "admissible_actions", lambda self: None)
    skipped = []
    assert bench_env(["sokoban"], steps=50, skipped=skipped) == []
    assert len(skipped) == 1 and skipped[0][0] == "sokoban"
    assert skipped[0][1].startswith("OpenActionSetError: sokoban: bench_env needs a closed action set")
    with pytest.raises(ValueError):                     # OpenActionSetError is a ValueError
        bench_env(["sokoban"], steps=50)
    assert issubclass(OpenActionSetError, ValueError)


def test_cli_bench_env_without_env_skips_and_lists(monkeypatch, capsys):
    """``crl-bench bench env`` (no --env) benchmarks what can run and lists the rest with the reason;
    before, the first unavailable env (SWE-bench without its images) stopped the whole command."""
    import crl_bench.env_api as env_api
    from crl_bench.cli import main

    monkeypatch.setattr(env_api, "list_envs", lambda: ["sokoban", "swebench-verified", "webshop"])
    _unavailable(monkeypatch, "swebench-verified", "swebench-verified: none of the 500 instance images is "
                                                   "present locally (test)")
    assert main(["bench", "env", "--steps", "50"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].startswith("sokoban")
    assert ("skipped swebench-verified (cannot run here): EnvUnavailableError: swebench-verified: none of "
            "the 500 instance images is present locally (test)") in out
    assert "webshop" not in out.split("(not included by default")[0]


# ------------------------------------------------------------------------------ raw simulator registry
def test_raw_simulator_adapters_by_env_class():
    """Sokoban runs its own game logic; every MiniHack task class steps the NLE env it wraps."""
    from crl_bench.bench.raw import GameLogicSimulator, NLESimulator, RawSimulator
    from crl_bench.env_api import TextEnv

    for env_id, kind in (("sokoban", GameLogicSimulator), ("minihack-room", NLESimulator),
                         ("minihack-maze", NLESimulator)):
        env = make_env(env_id)
        try:
            sim = raw_simulator(env)
            assert type(sim) is kind and isinstance(sim, RawSimulator), (env_id, sim)
        finally:
            env.close()
    # the raw stepping lives in the bench, not in the env protocol
    assert not hasattr(TextEnv, "raw_reset") and not hasattr(TextEnv, "raw_step")
    with pytest.raises(TypeError, match="no raw simulator"):
        raw_simulator(object())


def test_registry_names_the_env_classes():
    """The registry names the env classes without importing them; the names must be those classes'."""
    from crl_bench.bench import raw
    from crl_bench.envs.alfworld.env import AlfWorldEnv

    assert raw._REGISTRY[raw._class_key(AlfWorldEnv)] is raw.AlfWorldSimulator
    from crl_bench.envs.minihack.env import MiniHackTextEnv

    assert raw._REGISTRY[raw._class_key(MiniHackTextEnv)] is raw.NLESimulator


def test_registered_adapter_wins_for_subclasses(monkeypatch):
    from crl_bench.bench import raw
    from crl_bench.envs.sokoban import SokobanEnv

    class Counting(raw.GameLogicSimulator):
        pass

    class MySokoban(SokobanEnv):
        pass

    monkeypatch.setattr(raw, "_REGISTRY", dict(raw._REGISTRY))
    raw.register_raw_simulator(SokobanEnv, Counting)
    assert type(raw_simulator(MySokoban())) is Counting
    assert type(raw_simulator(SokobanEnv())) is Counting
    rows = bench_env(["sokoban"], steps=50)
    assert rows[0]["raw_steps"] == rows[0]["text_steps"] == 50


def test_cli_bench_env_json(capsys):
    """``--json`` prints the rows after the table."""
    import json

    from crl_bench.cli import main

    assert main(["bench", "env", "--env", "sokoban", "--steps", "30", "--chunk", "10", "--warmup", "5",
                 "--seed", "3", "--json"]) == 0
    out = capsys.readouterr().out
    table, rows = out.split("\n[", 1)
    rows = json.loads("[" + rows)
    assert table.splitlines()[2].startswith("sokoban")
    assert [r["env"] for r in rows] == ["sokoban"] and rows[0]["raw_steps"] == 30
    assert "not included by default" not in out      # ids were named
