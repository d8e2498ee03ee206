"""ALFWorld env on the real TextWorld games (data from the data dir, ../shared/data in CI)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from tests_helpers import FolderServer

from crl_bench.data import ChecksumError, DataMissingError
from crl_bench.env_api import make_env
from crl_bench.envs.alfworld import EVAL_OFFSET, EVAL_SEEN_OFFSET, AlfWorldEnv, EnvWorkerError, check_data
from crl_bench.envs.alfworld import data as data_mod
from crl_bench.envs.alfworld.env import _task_table


@pytest.fixture()
def env(alfworld_env):
    """The session's ALFWorld env (conftest ``alfworld_env``)."""
    return alfworld_env


def test_task_lists_resolve_to_existing_games():
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        ids = check_data()
    assert len(ids["train"]) == 1465 and len(ids["eval"]) == 134 and len(ids["eval_seen"]) == 140
    assert 690 not in ids["train"]                  # the trial the release lacks
    assert ids["eval"] == list(range(EVAL_OFFSET, EVAL_OFFSET + 134))
    assert ids["eval_seen"] == list(range(EVAL_SEEN_OFFSET, EVAL_SEEN_OFFSET + 140))
    e = AlfWorldEnv()
    for t in list(ids["train"]) + list(ids["eval"]) + list(ids["eval_seen"]):
        assert os.path.isfile(e.gamefile(t)), t
    assert all("/valid_unseen/" in e.gamefile(t) for t in ids["eval"])
    assert all("/valid_seen/" in e.gamefile(t) for t in ids["eval_seen"])
    # valid_seen's 140 games by task type, as ALFWorld's split has them (Pick, Look, Clean, Heat, Cool, Pick2)
    types = [e.task_type(t) for t in ids["eval_seen"]]
    assert [types.count(x) for x in ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
                                     "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep",
                                     "pick_two_obj_and_place")] == [35, 13, 27, 16, 25, 24]
    assert all("/train/" in e.gamefile(t) for t in ids["train"])
    with pytest.raises(KeyError):
        e.gamefile(690)


def test_missing_trial_is_reported_with_a_warning():
    _task_table.cache_clear()
    with pytest.warns(UserWarning, match=r"1 train task\(s\) have no game.*line 690"):
        AlfWorldEnv()


def test_walkthrough_replay_solves_sampled_eval_games(env):
    rng = np.random.default_rng(0)
    tasks = [int(t) for t in rng.choice(env.task_ids("eval"), size=3, replace=False)]
    for task in tasks:
        obs, info = env.reset(options={"task": task})
        assert "Admissible commands:" in obs and env.task_prompt()
        assert not info["success"]
        plan = env.walkthrough(task)
        total = 0.0
        for k, cmd in enumerate(plan):
            # free text: case and spacing are tolerated
            obs, r, term, trunc, info = env.step(f"<answer>  {cmd.upper()} </answer>")
            total += r
            assert not info["invalid_action"], (task, cmd, obs)
            if k < len(plan) - 1:
                assert not term
        assert term and not trunc and info["success"], (task, obs)
        assert r == 1.0 and total == 1.0
        assert info["worker_rss_mb"] > 0


def test_expert_replay_wins_sampled_seen_games_and_names_a_loss(monkeypatch):
    """``replay_split`` (the check ``python -m crl_bench.envs.alfworld.expert --split eval_seen`` runs on
    all 140) wins sampled valid_seen games through the env's text layer, and reports a game whose plan
    stops one command short as lost, with the reason."""
    from crl_bench.envs.alfworld import expert

    rng = np.random.default_rng(1)
    tasks = [EVAL_SEEN_OFFSET + int(k) for k in rng.choice(140, size=2, replace=False)]
    res = expert.replay_split("eval_seen", tasks=tasks)
    assert (res["tasks"], res["won"], res["lost"]) == (2, 2, [])
    short = AlfWorldEnv.walkthrough
    monkeypatch.setattr(AlfWorldEnv, "walkthrough", lambda self, task: short(self, task)[:-1])
    res = expert.replay_split("eval_seen", tasks=tasks[:1])
    assert res["won"] == 0 and res["lost"][0]["why"] == "the last command did not win the game"


def test_the_panels_are_the_documented_ones():
    """docs/envs/alfworld.md states the panel of each eval split (game paths, sha256, goals); a change of
    a list, a game or the fingerprint changes the hash and fails here."""
    import re

    from crl_bench.results.panel import build_panel

    doc = (Path(__file__).resolve().parents[2] / "docs" / "envs" / "alfworld.md").read_text()
    stated = dict(re.findall(r"gives\s+panel\s+`([0-9a-f]{64})`\s+\(\d+\s+(eval|eval_seen)\s+tasks\)", doc))
    assert sorted(stated.values()) == ["eval", "eval_seen"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = AlfWorldEnv()
    try:
        for digest, split in stated.items():
            assert build_panel(e, "alfworld", split, e.task_ids(split))["panel_hash"] == digest, split
    finally:
        e.close()


def test_a_worker_near_its_memory_cap_is_replaced_between_episodes(monkeypatch):
    """TextWorld keeps every game a process has loaded, so a worker's address space grows game after
    game; a reset past ``RECYCLE_FRACTION`` of ``memory_mb`` starts a fresh worker first (counted in
    ``worker_recycles``, not as a failure), and the episode plays normally."""
    from crl_bench.envs.alfworld import env as env_mod

    e = AlfWorldEnv()
    try:
        e.reset(options={"task": EVAL_SEEN_OFFSET})
        first = e.worker_pid
        assert e._worker.vm_mb > 0                       # the worker reports its address space
        e.reset(options={"task": EVAL_SEEN_OFFSET + 1})
        assert e.worker_pid == first and e.recycles == 0
        monkeypatch.setattr(env_mod, "RECYCLE_FRACTION", 0.0)
        _obs, info = e.reset(options={"task": EVAL_SEEN_OFFSET + 2})
        assert e.worker_pid != first and (e.recycles, e.restarts) == (1, 0)
        assert (info["worker_recycles"], info["worker_restarts"]) == (1, 0)
        for cmd in e.walkthrough(EVAL_SEEN_OFFSET + 2):
            _obs, r, term, _trunc, info = e.step(f"<answer>{cmd}</answer>")
        assert term and info["success"] and r == 1.0
    finally:
        e.close()


def test_invalid_command_is_fed_back_not_raised(env):
    obs, info = env.reset(options={"task": EVAL_OFFSET + 1})
    before = env.admissible_actions()
    obs, r, term, trunc, info = env.step("<answer>fly to the moon</answer>")
    assert info["invalid_action"] and info["invalid_actions"] == 1 and info["steps"] == 1
    assert "Last: Invalid action" in obs and not term and not trunc and r == 0.0
    assert env.admissible_actions() == before     # nothing happened in the game
    obs, r, term, trunc, info = env.step("no answer tags at all")
    assert info["invalid_action"] and info["invalid_actions"] == 2
    obs, r, term, trunc, info = env.step(f"<answer>{before[0]}</answer>")
    assert not info["invalid_action"] and "Last: " in obs


def test_step_limit_gives_the_failure_reward():
    e = make_env("alfworld", max_steps=2)
    try:
        e.reset(options={"task": EVAL_OFFSET})
        _, r1, term, trunc, _ = e.step("<answer>look</answer>")
        assert (r1, term, trunc) == (0.0, False, False)
        _, r2, term, trunc, info = e.step("<answer>inventory</answer>")
        assert trunc and not term and r2 == -1.0 and not info["success"]
    finally:
        e.close()


def test_killed_worker_fails_the_episode_and_is_replaced(env):
    env.reset(options={"task": EVAL_OFFSET + 2})
    pid = env.worker_pid
    restarts = env.restarts
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EnvWorkerError, match="died"):
        env.step(f"<answer>{env.admissible_actions()[0]}</answer>")
    obs, info = env.reset(options={"task": EVAL_OFFSET + 2})      # a fresh worker
    assert env.worker_pid != pid and env.restarts == restarts + 1
    assert info["worker_restarts"] == restarts + 1
    plan = env.walkthrough(EVAL_OFFSET + 2)
    for cmd in plan:
        obs, r, term, trunc, info = env.step(f"<answer>{cmd}</answer>")
    assert info["success"]


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_workers_are_forked_from_one_launcher_which_is_replaced_when_it_dies():
    """Every worker of a process is a child of its one launcher (which did TextWorld's imports once);
    a killed launcher is replaced at the next worker start, and the workers it forked play on."""
    from crl_bench.envs.alfworld import process

    a, b = process.Worker(1024, 120), process.Worker(1024, 120)
    try:
        launcher = process.launcher_pid()
        assert launcher is not None and _parent_pid(a.pid) == _parent_pid(b.pid) == launcher
        assert a.pid != b.pid and 0 < a.rss_mb < 1024 and 0 < a.vm_mb < 1024
        os.kill(launcher, signal.SIGKILL)
        c = process.Worker(1024, 120)
        try:
            assert process.launcher_pid() not in (None, launcher) and _parent_pid(c.pid) == process.launcher_pid()
        finally:
            c.close()
        e = AlfWorldEnv()
        a.send("reset", e.gamefile(EVAL_OFFSET))
        status, payload = a.recv(120)
        assert status == "ok" and payload["admissible"] and a.alive()
    finally:
        a.close()
        b.close()
    assert not a.alive() and not b.alive()


def test_the_launcher_and_its_workers_end_with_the_process_that_started_them(tmp_path):
    """A trainer that dies leaves no ALFWorld process behind: the launcher and every worker read
    end-of-file on their sockets and exit."""
    import subprocess
    import sys
    import time

    script = ("import os, signal; from crl_bench.envs.alfworld import process\n"
              "w = process.Worker(1024, 120)\n"
              "print(process.launcher_pid(), w.pid, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    pids = [int(x) for x in out.stdout.split()]
    assert len(pids) == 2, out.stderr
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_rollout_marks_a_crashed_episode_failed_and_goes_on(tokenizer, tiny_model):
    from crl_bench.llm.base import SamplingParams
    from crl_bench.llm.hf_engine import HFEngine
    from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner

    pool = EnvPool(max_steps=3)

    class KillingEngine(HFEngine):
        calls = 0

        def generate(self, prompts, sampling, allowed=None):
            KillingEngine.calls += 1
            if KillingEngine.calls == 2:            # after the first actions: one worker dies
                victim = pool._busy[0]
                os.kill(victim.worker_pid, signal.SIGKILL)
            return super().generate(prompts, sampling, allowed)

    orig_acquire_for = pool.acquire_for
    pool._busy = []

    def acquire_for(env_id, task, max_steps=0):
        env, pending = orig_acquire_for(env_id, task, max_steps)
        pool._busy.append(env)
        return env, pending

    pool.acquire_for = acquire_for
    runner = RolloutRunner(KillingEngine(tiny_model, tokenizer, batch_size=4), PromptBuilder(tokenizer),
                           pool, SamplingParams(temperature=1.0, max_new_tokens=12))
    specs = [EpisodeSpec("alfworld", EVAL_OFFSET + k, group_id=k) for k in range(3)]
    try:
        trajs = runner.collect(specs)
        assert "died" in trajs[0].error and not trajs[0].success
        for t in trajs[1:]:
            assert not t.error and t.steps == 3 and t.truncated and t.reward == -1.0
            assert all(not turn.invalid for turn in t.turns)        # constrained to admissible commands
        # the run goes on: the pool gives a working env for the next episodes
        again = runner.collect([EpisodeSpec("alfworld", EVAL_OFFSET, group_id=0)])
        assert not again[0].error and again[0].steps == 3
    finally:
        pool.close()


def test_prefetched_reset_is_used_by_the_next_collect(tokenizer, tiny_model):
    from crl_bench.llm.base import SamplingParams
    from crl_bench.llm.hf_engine import HFEngine
    from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner

    pool = EnvPool(max_steps=1)
    runner = RolloutRunner(HFEngine(tiny_model, tokenizer, batch_size=4), PromptBuilder(tokenizer), pool,
                           SamplingParams(temperature=1.0, max_new_tokens=12))
    first = [EpisodeSpec("alfworld", EVAL_OFFSET + 3)]
    nxt = [EpisodeSpec("alfworld", EVAL_OFFSET + 4), EpisodeSpec("alfworld", EVAL_OFFSET + 4)]
    try:
        runner.collect(first, prefetch=nxt)
        assert len(pool._ready[("alfworld", EVAL_OFFSET + 4, 0)]) == 2      # (env, task, episode limit)
        trajs = runner.collect(nxt)
        assert pool.prefetch_hits == 2 and not pool._ready.get(("alfworld", EVAL_OFFSET + 4, 0))
        assert all(t.steps == 1 and not t.error for t in trajs)
        assert trajs[0].task_prompt == trajs[1].task_prompt != ""
    finally:
        pool.close()


def test_missing_data_names_the_download_command(tmp_path, monkeypatch, capsys):
    with pytest.raises(DataMissingError, match="crl-bench data download alfworld"):
        AlfWorldEnv(data_dir=str(tmp_path))
    from crl_bench.cli import main

    monkeypatch.setenv("CRL_BENCH_DATA", str(tmp_path))
    assert main(["run", "--method", "grpo", "--mix", "alfworld", "--preset", "smoke",
                 "--output-dir", str(tmp_path / "runs")]) == 2
    assert "crl-bench data download alfworld" in capsys.readouterr().err


# ---- download: the network path against a local server, with the real checksums ----------------

def _shared() -> Path:
    return Path(os.environ["CRL_BENCH_DATA"]) / "alfworld"


def _manifest_for(server_url: str, archive_name: str, size: int) -> dict:
    man = json.loads(json.dumps(data_mod.load_manifest("alfworld")))
    man["release"] = {"url": f"{server_url}/{archive_name}", "size": size}
    for name in man["splits"]:
        if man["splits"][name]["url"] is not None:          # the eval_seen list ships with the package
            man["splits"][name]["url"] = f"{server_url}/splits/{name}"
    return man


def test_download_fetches_verifies_and_unpacks(tmp_path, monkeypatch):
    """A partial games folder (a download killed by an older version: no completion marker) is refused
    naming the command; the download removes killed downloads' temp folders, unpacks into a staging
    folder and renames it into place with its marker; a later download re-hashes the games (a lost
    marker is written again without unpacking, a changed game makes it unpack again), and a game
    missing from a marked folder is an error, not a warning."""
    data = tmp_path / "data"
    partial = data / "alfworld" / "json_2.1.1" / "train"
    partial.mkdir(parents=True)
    (data / "alfworld" / "splits").mkdir()
    for name in ("train_1466.jsonl", "eval_134.jsonl"):
        (data / "alfworld" / "splits" / name).write_bytes((_shared() / "splits" / name).read_bytes())
    with pytest.raises(DataMissingError, match="no completion marker.*crl-bench data download alfworld"):
        check_data(str(data))
    for stale in ("tmpab12cd_3", ".staging-x1y2"):
        (data / "alfworld" / stale).mkdir()
        (data / "alfworld" / stale / "game.tw-pddl").write_bytes(b"x" * 1000)
    server = FolderServer(_shared())
    archive = _shared() / "json_2.1.1.tar.xz"
    man = _manifest_for(server.url, archive.name, archive.stat().st_size)
    monkeypatch.setattr(data_mod, "load_manifest", lambda name: man)
    try:
        root = data_mod.download_alfworld(data, progress=False)
    finally:
        server.close()
    assert (root / "splits" / "train_1466.jsonl").is_file()
    games = list((root / "json_2.1.1").rglob("game.tw-pddl"))
    assert len(games) == 1739                       # 1,465 train + 134 valid_unseen + 140 valid_seen
    assert sorted(p.name for p in root.iterdir()) == ["json_2.1.1", "splits"]
    ids = check_data(str(data))
    assert len(ids["train"]) == 1465 and len(ids["eval"]) == 134

    no_games = tmp_path / "empty.tar.gz"
    with tarfile.open(no_games, "w:gz"):
        pass
    marker = root / "json_2.1.1" / ".crl-bench-complete.json"
    marker.unlink()
    _task_table.cache_clear()
    with pytest.raises(DataMissingError, match="no completion marker"):
        check_data(str(data))
    data_mod.download_alfworld(data, source=str(no_games), progress=False)   # re-hashed: nothing unpacked
    assert marker.is_file() and len(check_data(str(data))["train"]) == 1465
    games[0].write_bytes(games[0].read_bytes() + b" ")
    with pytest.raises(DataMissingError, match="none of the 1739"):         # re-hashed: unpacks again
        data_mod.download_alfworld(data, source=str(no_games), progress=False)
    games[0].unlink()
    _task_table.cache_clear()
    with pytest.raises(DataMissingError, match="missing from .*crl-bench data download alfworld"):
        check_data(str(data))
    _task_table.cache_clear()


def test_unpacking_bounds_member_sizes_and_paths_even_without_verification(tmp_path, monkeypatch):
    """A member larger than a game is refused before it is read; a member path that leaves the target
    (an edited split list, ``--no-verify``) is refused and nothing is written outside; an edited split
    line naming ``..`` is refused when the split lists are read."""
    blob = tmp_path / "blob"
    blob.write_bytes(b"g" * 100)
    member = "json_2.1.1/train/a-b/trial_1/game.tw-pddl"
    escape = "json_2.1.1/train/../../../escaped/game.tw-pddl"
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tf:
        tf.add(blob, arcname=member)
        tf.add(blob, arcname=escape)
    monkeypatch.setattr(data_mod, "MAX_GAME_BYTES", 50)
    with pytest.raises(ChecksumError, match="100 bytes, more than a game's 50"):
        data_mod.unpack_alfworld_games(bad, tmp_path / "out", {member: "0" * 64}, verify=False)
    monkeypatch.setattr(data_mod, "MAX_GAME_BYTES", 1000)
    with pytest.raises(ChecksumError, match="outside"):
        data_mod.unpack_alfworld_games(bad, tmp_path / "out", {escape: "0" * 64}, verify=False)
    assert not (tmp_path / "escaped").exists()
    splits = tmp_path / "edited" / "splits"
    splits.mkdir(parents=True)
    line = json.dumps({"goal": "g", "additional_info": {"description": "../../../../tmp/x"}})
    for name in ("train_1466.jsonl", "eval_134.jsonl"):
        (splits / name).write_text(line + "\n")
    with pytest.raises(ChecksumError, match="train_1466.jsonl line 1: description '../../../../tmp/x'"):
        data_mod.game_hashes(splits.parent)


def test_downloads_stop_at_the_expected_size_and_local_sources_must_be_files(tmp_path):
    """``file:///dev/zero`` is read one byte past the expected size (or the cap), then refused;
    nothing is left behind. A device as ``--source`` is refused before it is opened (exit 2, one line)."""
    from crl_bench.cli import main
    from crl_bench.data import DataInvalidError, download_url, local_source

    for kwargs in ({"expected_size": 5000}, {"max_bytes": 3 << 20}):
        with pytest.raises(ChecksumError, match="bytes"):
            download_url("file:///dev/zero", tmp_path / "zero.bin", progress=False, **kwargs)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataInvalidError, match="not a regular file"):
        local_source("/dev/zero")
    assert main(["data", "download", "alfworld", "--source", "/dev/zero", "--data-dir", str(tmp_path)]) == 2
    assert not (tmp_path / "alfworld").exists()


def test_download_rejects_a_wrong_size_or_checksum(tmp_path, monkeypatch):
    server = FolderServer(_shared())
    archive = _shared() / "json_2.1.1.tar.xz"
    man = _manifest_for(server.url, archive.name, archive.stat().st_size + 1)
    monkeypatch.setattr(data_mod, "load_manifest", lambda name: man)
    try:
        with pytest.raises(ChecksumError, match="bytes, expected"):
            data_mod.download_alfworld(tmp_path / "data", progress=False)
        man["splits"]["eval_134.jsonl"]["sha256"] = "0" * 64
        with pytest.raises(ChecksumError, match="sha256"):
            data_mod.download_alfworld(tmp_path / "data2", progress=False)
    finally:
        server.close()
    assert not (tmp_path / "data" / "alfworld" / "json_2.1.1").exists()
    assert not (tmp_path / "data2" / "alfworld" / "splits" / "eval_134.jsonl").exists()


def test_a_tampered_game_is_rejected(tmp_path):
    e = AlfWorldEnv()
    member = e.tasks[EVAL_OFFSET].member
    good = Path(e.gamefile(EVAL_OFFSET)).read_bytes()
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tf:
        blob = good.replace(b"desklamp", b"desklight", 1)
        assert hashlib.sha256(blob).hexdigest() != hashlib.sha256(good).hexdigest()
        src = tmp_path / "game.tw-pddl"
        src.write_bytes(blob)
        tf.add(src, arcname=member)
    hashes = data_mod.game_hashes(_shared())
    with pytest.raises(ChecksumError, match=member.replace("/", ".")[:40]):
        data_mod.unpack_alfworld_games(bad, tmp_path / "out", hashes)
    assert not (tmp_path / "out" / member).exists()


def test_bench_alfworld_smoke():
    from crl_bench.bench.alfworld import bench_alfworld, format_result

    r = bench_alfworld(workers=2, episodes=2, resets=1, fresh_starts=1)
    assert r["successes"] == {"1": 2, "2": 2}
    assert r["reset_ms"]["p50"] > 0 and r["step_ms"]["p50"] > 0 and r["worker_rss_mb"] > 0
    assert r["worker_start_ms"]["fresh"] > 0 and r["worker_start_ms"]["forked"] > 0
    assert r["episodes_per_min"]["2"] > 0 and "episodes/min" in format_result(r)
    assert "forked from the launcher" in format_result(r)


def test_raw_simulator_replays_a_walkthrough(env):
    """The env bench's raw path (crl_bench/bench/raw.py) drives the worker directly: a walkthrough wins
    on its last command, as through the text protocol."""
    from crl_bench.bench.raw import AlfWorldSimulator, raw_simulator

    sim = raw_simulator(env)
    assert type(sim) is AlfWorldSimulator
    task = EVAL_OFFSET + 1
    plan = env.walkthrough(task)
    sim.reset(task)
    assert [sim.step(a) for a in plan] == [False] * (len(plan) - 1) + [True]
    env.reset(options={"task": task})                   # the text protocol works again after a reset
    _, _, term, _, info = env.step(f"<answer>{plan[0]}</answer>")
    assert not term and info["steps"] == 1


def test_worker_memory_is_its_own_not_the_parents():
    """The reported peak RSS is the worker's (a fresh interpreter with one game), even when the parent
    holds much more memory than the worker's cap."""
    ballast = bytearray(1500 << 20)           # the parent now holds > 1.5 GB
    ballast[::4096] = b"x" * len(ballast[::4096])
    e = make_env("alfworld")
    try:
        e.reset(options={"task": EVAL_OFFSET})
        assert 20 < e.worker_rss_mb < e.memory_mb
    finally:
        e.close()
        del ballast


ALFWORLD_TASK_TYPES = {"pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
                       "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place"}


def test_task_type_is_read_in_the_main_process_without_a_game():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = AlfWorldEnv()
    try:
        for split in ("train", "eval"):
            ids = e.task_ids(split)
            types = {e.task_type(t) for t in ids}
            assert types == ALFWORLD_TASK_TYPES, split
            for t in ids:                       # the game's task folder, e.g. pick_and_place_simple-Pen-...
                assert e.task_type(t) == Path(e.gamefile(t)).parent.parent.name.split("-", 1)[0]
        assert e.task_type(0) == "pick_and_place_simple"
        assert e.task_type(EVAL_OFFSET) == "look_at_obj_in_light"
        assert e.worker_pid is None             # no worker was started for any of it
        with pytest.raises(KeyError):
            e.task_type(690)
    finally:
        e.close()


def test_data_files_list_the_split_files_and_the_archive_used(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = AlfWorldEnv()                       # ../shared/data holds the packed games
    files = e.data_files()
    e.close()
    assert set(files) == {"alfworld/splits/train_1466.jsonl", "alfworld/splits/eval_134.jsonl",
                          "alfworld/json_2.1.1.tar.xz"}
    assert all(p.is_absolute() and p.is_file() for p in files.values())
    assert files["alfworld/json_2.1.1.tar.xz"].samefile(_shared() / "json_2.1.1.tar.xz")
    # games unpacked in the data dir (a folder of thousands of files): only the split files
    root = tmp_path / "data"
    (root / "alfworld" / "splits").mkdir(parents=True)
    for name in ("train_1466.jsonl", "eval_134.jsonl"):
        (root / "alfworld" / "splits" / name).write_bytes((_shared() / "splits" / name).read_bytes())
    # the games unpacked from the archive (complete, with their marker), linked into this data dir
    (root / "alfworld" / "json_2.1.1").symlink_to(data_mod.alfworld_games_root() / "json_2.1.1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # the trial the release lacks is skipped
        e = AlfWorldEnv(data_dir=str(root))
    assert e.data_files() == {f"alfworld/splits/{n}": (root / "alfworld" / "splits" / n).absolute()
                              for n in ("train_1466.jsonl", "eval_134.jsonl")}
    e.close()
