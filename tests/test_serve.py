"""``crl-bench serve``: our envs behind OpenEnv's server (crl_bench/serve.py), driven by OpenEnv's own
Python client (openenv-core's GenericEnvClient) and by raw WebSocket / HTTP messages, against servers
started here on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from openenv.core.generic_client import GenericEnvClient
from test_sokoban import solve
from websockets.sync.client import connect

from crl_bench.cli import main
from crl_bench.env_api import make_env
from crl_bench.envs.sokoban import SokobanEnv
from crl_bench.results.panel import build_panel, panel_task_ids
from crl_bench.serve import ServedEnv, ServedSession, ServeError, make_app

SOKOBAN_EVAL = 1_000_000


@contextlib.contextmanager
def serving(served: ServedEnv, max_sessions: int = 4):
    """A uvicorn server of ``served`` in a thread on 127.0.0.1 (a free port); yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(served, max_sessions=max_sessions), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def client(url: str):
    return GenericEnvClient(base_url=url).sync()


def sokoban_served(split: str = "eval", **kw) -> ServedEnv:
    return ServedEnv("sokoban", lambda: SokobanEnv(max_steps=kw.get("max_steps", 30)), split)


def test_cli_serves_the_eval_panel_and_a_scripted_sokoban_solution_succeeds(tmp_path):
    """The command prints the same panel hash as `crl-bench panel export`; a BFS plan of the task played
    through OpenEnv's client succeeds; the state names the task's panel entry and the panel."""
    assert main(["panel", "export", "sokoban", "--episodes", "5", "--out", str(tmp_path / "p.json"),
                 "--quiet"]) == 0
    panel = json.loads((tmp_path / "p.json").read_text())
    proc = subprocess.Popen([sys.executable, "-m", "crl_bench.cli", "serve", "sokoban", "--split", "eval",
                             "--episodes", "5", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no line from crl-bench serve within 120 s"
        line = proc.stdout.readline()
        assert f"panel {panel['panel_hash']} (5 tasks)" in line, line
        url = line.split(" at ")[-1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        task = panel["tasks"][2]["task"]
        local = SokobanEnv()
        local.reset(options={"task": task})
        plan = solve(local.state())
        assert plan
        with client(url) as c:
            r = c.reset(task=task)
            assert r.observation["task"] == task and r.observation["split"] == "eval"
            assert r.observation["system_prompt"] == SokobanEnv.system_prompt
            assert r.observation["admissible_actions"] == ["up", "down", "left", "right"]
            for k, action in enumerate(plan):
                assert not r.done
                r = c.step({"reply": f"<think>step {k}</think><answer>{action}</answer>"})
            assert r.done and r.reward > 0 and r.observation["info"]["success"] is True
            assert r.observation["terminated"] and not r.observation["truncated"]
            state = c.state()
            assert state["task"] == task and state["split"] == "eval" and state["success"] is True
            assert state["panel_hash"] == panel["panel_hash"]
            assert state["task_hash"] == panel["tasks"][2]["hash"]
            assert state["step_count"] == len(plan)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]


def test_off_panel_task_has_its_hash_but_no_panel_hash():
    ids = list(SokobanEnv().task_ids("eval"))[:3]
    env = SokobanEnv()
    panel = build_panel(env, "sokoban", "eval", panel_task_ids(env, "eval", 3), episodes=3)
    served = ServedEnv("sokoban", SokobanEnv, "eval", panel)
    with serving(served) as url, client(url) as c:
        c.reset(task=ids[1])
        assert c.state()["panel_hash"] == panel["panel_hash"]
        with pytest.raises(RuntimeError, match="task 5 is not in split 'eval'"):
            c.reset(task=5)                 # a reset without a split is in the served one
        c.reset(task=5, split="train")      # the other splits are open to resets that name them
        assert c.state()["panel_hash"] is None and c.state()["split"] == "train"
        assert c.state()["task_hash"] == build_panel(env, "sokoban", "train", [5])["tasks"][0]["hash"]


def test_a_scripted_diag_vault_solution_succeeds():
    local = make_env("diag-vault")
    served = ServedEnv("diag-vault", lambda: make_env("diag-vault"), "eval")
    tasks = list(local.task_ids("eval"))[:3]
    with serving(served) as url, client(url) as c:
        for task in tasks:
            r = c.reset(task=task)
            for action in local.solution(task):
                r = c.step({"reply": f"<answer>{action}</answer>"})
            assert r.done and r.reward == 1.0 and r.observation["info"]["success"] is True


EPISODE_ENVS = ["alfworld", "diag-corridor", "diag-vault", "minihack-corridor", "minihack-corridor-battle",
                "minihack-keyroom", "minihack-maze", "minihack-maze-15x15", "minihack-quest-easy",
                "minihack-quest-medium", "minihack-river", "minihack-room", "sokoban", "webshop"]


def test_every_env_but_swebench_is_served():
    """The list below is every env the package registers (SWE-bench's episode is served in its own
    test, in containers; envs the tests register are not the package's)."""
    from importlib import metadata

    ours = {ep.name for ep in metadata.entry_points(group="crl_bench.envs")}
    assert sorted(ours - {"swebench-verified"}) == EPISODE_ENVS


@pytest.mark.parametrize("env_id", EPISODE_ENVS)
def test_an_episode_of_every_env(env_id):
    """A whole episode (three actions, the episode limit set at reset) of each env on its first eval
    task, through OpenEnv's client."""
    served = ServedEnv(env_id, lambda: make_env(env_id), "eval")
    task = int(make_env(env_id).task_ids("eval")[0]) if env_id not in ("alfworld", "webshop") else None
    with serving(served, max_sessions=1) as url, client(url) as c:
        r = c.reset(max_steps=3, **({"task": task} if task is not None else {}))
        obs = r.observation
        assert obs["text"] and obs["system_prompt"] and obs["split"] == "eval" and not r.done
        state = c.state()
        assert state["env"] == env_id and state["max_steps"] == 3 and state["task"] == obs["task"]
        assert isinstance(state["task_hash"], str) and len(state["task_hash"]) == 64
        steps = 0
        while not r.done:
            actions = r.observation["admissible_actions"]
            reply = f"<answer>{actions[0]}</answer>" if actions else "<answer>search[red shirt]</answer>"
            r = c.step({"reply": reply})
            steps += 1
            assert isinstance(r.reward, float)
        assert steps <= 3 and c.state()["done"] is True
        assert r.observation["terminated"] or (r.observation["truncated"] and steps == 3)


@pytest.mark.xdist_group("containers")
@pytest.mark.filterwarnings("ignore:swebench-verified. no task_list")
def test_a_swebench_episode_is_served(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent / "envs"))
    from swe_synthetic import INSTANCE_ID, build_task

    from crl_bench.envs.swebench.engine import docker_client
    from crl_bench.envs.swebench.env import SWEBenchEnv

    instances = build_task(tmp_path, docker_client(timeout=600))

    def make():
        return SWEBenchEnv(instances=str(instances), max_steps=4, command_timeout_s=10)

    split = next(name for name, ids in make().splits.items() if 0 in ids)
    served = ServedEnv("swebench-verified", make, split)

    def call(name, **args):
        return {"reply": "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"}

    with serving(served, max_sessions=1) as url, client(url) as c:
        r = c.reset(task=0)
        assert r.observation["admissible_actions"] is None and "/testbed" in r.observation["text"]
        assert r.observation["info"]["instance_id"] == INSTANCE_ID
        r = c.step(call("str_replace_editor", command="view", path="/testbed/calc/__init__.py"))
        assert "return a - b" in r.observation["text"] and not r.done
        r = c.step(call("str_replace_editor", command="str_replace", path="/testbed/calc/__init__.py",
                        old_str="return a - b", new_str="return a + b"))
        r = c.step(call("submit"))
        assert r.done and r.reward == 1.0 and r.observation["info"]["success"] is True
        assert len(c.state()["task_hash"]) == 64


def test_two_concurrent_sessions_have_their_own_env_and_a_third_is_refused():
    served = sokoban_served()
    with serving(served, max_sessions=2) as url, client(url) as a, client(url) as b:
        ra = a.reset(task=SOKOBAN_EVAL)
        rb = b.reset(task=SOKOBAN_EVAL + 1)
        assert ra.observation["text"] != rb.observation["text"]
        a.step({"reply": "<answer>up</answer>"})
        a.step({"reply": "<answer>left</answer>"})
        b.step({"reply": "<answer>down</answer>"})
        sa, sb = a.state(), b.state()
        assert (sa["task"], sa["step_count"]) == (SOKOBAN_EVAL, 2)
        assert (sb["task"], sb["step_count"]) == (SOKOBAN_EVAL + 1, 1)
        assert sa["episode_id"] != sb["episode_id"]
        with connect(url.replace("http", "ws") + "/ws") as ws:
            reply = json.loads(ws.recv(timeout=30))        # said at once, then the server closes
            assert reply["type"] == "error" and reply["data"]["code"] == "CAPACITY_REACHED"


def _ask(ws, message) -> dict:
    ws.send(message if isinstance(message, str) else json.dumps(message))
    return json.loads(ws.recv(timeout=30))


def test_malformed_messages_get_the_protocols_errors_and_the_session_goes_on():
    import requests

    with serving(sokoban_served()) as url, connect(url.replace("http", "ws") + "/ws") as ws:
        def code(message) -> str:
            reply = _ask(ws, message)
            assert reply["type"] == "error", reply
            return reply["data"]["code"]

        assert code("{not json") == "INVALID_JSON"
        assert code({"type": "jump"}) == "UNKNOWN_TYPE"
        assert code({"type": "step", "data": {}}) == "VALIDATION_ERROR"               # no reply
        assert code({"type": "step", "data": {"reply": 5}}) == "VALIDATION_ERROR"     # not text
        assert code({"type": "step", "data": {"reply": "x", "extra": 1}}) == "VALIDATION_ERROR"
        assert code({"type": "step", "data": {"reply": "x" * (1 << 17)}}) == "VALIDATION_ERROR"
        reply = _ask(ws, {"type": "step", "data": {"reply": "<answer>up</answer>"}})
        assert reply["data"]["code"] == "EXECUTION_ERROR" and "reset first" in reply["data"]["message"]
        for data, said in (({"task": "abc"}, "must be an integer"), ({"task": 5}, "not in split 'eval'"),
                           ({"split": "nope"}, "unknown split"), ({"level": 3}, "unknown reset key(s) 'level'"),
                           ({"task": SOKOBAN_EVAL, "max_steps": 0}, "max_steps")):
            reply = _ask(ws, {"type": "reset", "data": data})
            assert reply["data"]["code"] == "EXECUTION_ERROR" and said in reply["data"]["message"], (data, reply)
        reply = _ask(ws, {"type": "reset", "data": {"task": SOKOBAN_EVAL, "max_steps": 1}})
        assert reply["type"] == "observation" and reply["data"]["observation"]["task"] == SOKOBAN_EVAL
        reply = _ask(ws, {"type": "step", "data": {"reply": "I think I should go up"}})   # no <answer>
        obs = reply["data"]["observation"]
        assert reply["type"] == "observation" and obs["info"]["invalid_action"] is True and obs["truncated"]
        reply = _ask(ws, {"type": "step", "data": {"reply": "<answer>up</answer>"}})
        assert reply["data"]["code"] == "EXECUTION_ERROR" and "episode is over" in reply["data"]["message"]
        assert requests.get(url + "/health", timeout=30).json()["status"] == "healthy"
        assert requests.post(url + "/step", json={"action": {}}, timeout=30).status_code == 422
        refused = requests.post(url + "/step", json={"action": {"reply": "<answer>up</answer>"}}, timeout=30)
        assert refused.status_code == 400 and "reset first" in refused.json()["detail"]
        first = requests.post(url + "/reset", json={"task": SOKOBAN_EVAL}, timeout=30).json()
        assert first["observation"]["task"] == SOKOBAN_EVAL and first["done"] is False
        assert _ask(ws, {"type": "state"})["data"]["done"] is True      # the session lived through it all


class _CrashOnce(SokobanEnv):
    """A Sokoban env whose simulator dies on the first action it is given (a crashed worker)."""

    crashed = 0

    def _apply(self, action):
        if _CrashOnce.crashed == 0:
            _CrashOnce.crashed += 1
            raise RuntimeError("simulator worker died")
        return super()._apply(action)


def test_an_env_that_crashes_mid_episode_is_rebuilt_at_the_next_reset():
    made = []

    def make():
        made.append(_CrashOnce())
        return made[-1]

    with serving(ServedEnv("sokoban", make, "eval")) as url, connect(url.replace("http", "ws") + "/ws") as ws:
        assert _ask(ws, {"type": "reset", "data": {"task": SOKOBAN_EVAL}})["type"] == "observation"
        reply = _ask(ws, {"type": "step", "data": {"reply": "<answer>up</answer>"}})
        assert reply["data"]["code"] == "EXECUTION_ERROR" and "worker died" in reply["data"]["message"]
        reply = _ask(ws, {"type": "step", "data": {"reply": "<answer>up</answer>"}})
        assert "reset first" in reply["data"]["message"]
        assert _ask(ws, {"type": "reset", "data": {"task": SOKOBAN_EVAL}})["type"] == "observation"
        assert _ask(ws, {"type": "step", "data": {"reply": "<answer>up</answer>"}})["type"] == "observation"
    assert len(made) == 2


def test_reset_picks_the_task_by_task_then_seed_then_at_random_within_the_split():
    session = ServedSession(sokoban_served())
    assert session.reset(task=SOKOBAN_EVAL + 7).task == SOKOBAN_EVAL + 7
    assert session.reset(seed=SOKOBAN_EVAL + 3).task == SOKOBAN_EVAL + 3     # seed: the task id, as TextEnv
    assert session.reset(seed=1, task=SOKOBAN_EVAL).task == SOKOBAN_EVAL
    drawn = {session.reset().task for _ in range(20)}
    assert len(drawn) > 1 and all(t in SokobanEnv.splits["eval"] for t in drawn)
    assert session.reset(split="train").split == "train"
    assert session.reset(episode_id="mine").task is not None and session.state.episode_id == "mine"
    with pytest.raises(ServeError, match="not in split 'eval'"):
        session.reset(seed=3)
    session.close()


def test_serve_refuses_bad_options_clearly(capsys):
    assert main(["serve", "sokoban", "--split", "nope", "--port", "0"]) == 2
    assert "unknown split 'nope'" in capsys.readouterr().err
    assert main(["serve", "sokoban", "--port", "70000"]) == 2
    assert main(["serve", "sokoban", "--max-sessions", "0"]) == 2
    assert main(["serve", "no-such-env", "--port", "0"]) == 2
    assert "unknown environment" in capsys.readouterr().err


class _Recording(SokobanEnv):
    """Sokoban that records the tasks it is reset to and the actions it is given, across instances."""

    tasks: list[int] = []
    actions: list[str] = []

    def _reset_task(self, task):
        _Recording.tasks.append(task)
        super()._reset_task(task)

    def _apply(self, action):
        _Recording.actions.append(action)
        return super()._apply(action)


@pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions")
@pytest.mark.filterwarnings("ignore:You are using 'environment_factory'")
def test_the_trl_example_trains_a_step_on_a_served_env(tiny_model_dir, tmp_path):
    """examples/trl_grpo_served_env.py: one GRPO step of TRL's trainer (a tiny random model on CPU) whose
    generations each hold a session of our server: TRL resets the rows' tasks there and reads the
    rewards back. (A random model seldom calls the tool well; that the loop runs is what is checked.)"""
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_example", Path(__file__).parents[1] / "examples" /
                                                  "trl_grpo_served_env.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    _Recording.tasks.clear()
    with serving(ServedEnv("sokoban", _Recording, "train"), max_sessions=4) as url:
        history = example.main(["--url", url, "--model", str(tiny_model_dir), "--chat-template", "qwen2_5",
                                "--tasks", "2", "--first-task", "7", "--num-generations", "2", "--max-steps", "1",
                                "--max-completion-length", "24", "--max-tool-calls", "2",
                                "--output-dir", str(tmp_path / "out")])
    assert sorted(set(_Recording.tasks)) in ([7], [8], [7, 8]) and len(_Recording.tasks) >= 2
    logged = next(h for h in history if "reward" in h)
    assert logged["reward"] == 0.0 or logged["reward"] > 0      # a number read from the envs
