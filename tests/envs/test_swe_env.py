"""SWE-Bench-Verified env end to end in real containers, on a synthetic SWE-bench-shaped task.

Needs a running Docker daemon (``.ci/run`` and ``install.sh`` with the test extra install Debian's
docker.io and start it) and debootstrap for the base image, built once per daemon (about a minute).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crl_bench.env_api import EnvUnavailableError
from crl_bench.envs.swebench.engine import docker_client
from crl_bench.envs.swebench.env import SWEBenchEnv
from crl_bench.envs.swebench.sandbox import LABEL, DockerSandbox, ImageUnavailableError

sys.path.insert(0, str(Path(__file__).parent))
from swe_synthetic import GOLD, INSTANCE_ID, TASK_IMAGE, build_task

pytestmark = [pytest.mark.filterwarnings("ignore:swebench-verified. no task_list"),
              pytest.mark.xdist_group("containers")]     # one container engine user at a time


def call(name: str, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


FIX = call("str_replace_editor", command="str_replace", path="/testbed/calc/__init__.py",
           old_str="return a - b", new_str="return a + b")


@pytest.fixture(scope="session")
def client():
    return docker_client(timeout=600)


@pytest.fixture(scope="session")
def instances(tmp_path_factory, client):
    return build_task(tmp_path_factory.mktemp("swe"), client)


def our_containers(client) -> list[str]:
    return [c.name for c in client.containers.list(all=True, filters={"label": f"{LABEL}=1"})]


@pytest.fixture()
def make_env(instances, client):
    made = []

    def make(**kw):
        kw.setdefault("command_timeout_s", 10)
        env = SWEBenchEnv(instances=str(instances), max_steps=kw.pop("max_steps", 8), **kw)
        made.append(env)
        return env

    before = set(our_containers(client))
    yield make
    for env in made:
        env.close()
    assert set(our_containers(client)) <= before, "a test left a sandbox container behind"


def test_scripted_fix_through_the_editor_is_resolved(make_env, client):
    env = make_env()
    obs, info = env.reset(options={"task": 0})
    assert "/testbed" in obs and info["instance_id"] == INSTANCE_ID
    assert "add(2, 3) returns -1" in env.task_prompt()
    name = env.sb.name
    o, r, term, trunc, info = env.step(call("str_replace_editor", command="view", path="/testbed/calc/__init__.py"))
    assert "return a - b" in o and r == 0 and not term and not info["invalid_action"]
    o, r, term, trunc, info = env.step(FIX)
    assert "return a + b" in o
    o, r, term, trunc, info = env.step(call("submit"))
    assert term and not trunc and r == 1.0 and info["success"]
    g = info["grade"]
    assert g["resolved"] and g["patch_applied"]
    assert g["tests_status"]["FAIL_TO_PASS"]["success"] == ["tests/test_calc.py::test_add"]
    assert g["tests_status"]["PASS_TO_PASS"]["success"] == ["tests/test_calc.py::test_mul"]
    assert "-    return a - b\n+    return a + b" in info["patch"]
    assert name not in our_containers(client), "the episode's container must be gone after the episode"


def test_doing_nothing_gets_zero(make_env):
    env = make_env(grade_empty_patch=True)       # run the eval script even though nothing changed
    env.reset(options={"task": 0})
    o, r, term, trunc, info = env.step(call("submit"))
    assert term and r == 0.0 and not info["success"]
    status = info["grade"]["tests_status"]
    assert status["FAIL_TO_PASS"]["failure"] == ["tests/test_calc.py::test_add"]
    assert status["PASS_TO_PASS"]["success"] == ["tests/test_calc.py::test_mul"]
    env2 = make_env()                             # default: an empty diff is 0 without running tests
    env2.reset(options={"task": 0})
    _, r, term, _, info = env2.step(call("submit"))
    assert term and r == 0.0 and info["grade"]["error"] == "no changes to grade"


def test_breaking_a_passing_test_is_not_resolved(make_env):
    env = make_env()
    env.reset(options={"task": 0})
    env.step(FIX)
    env.step(call("str_replace_editor", command="str_replace", path="/testbed/calc/__init__.py",
                  old_str="return a * b", new_str="return a ** b"))
    _, r, term, _, info = env.step(call("submit"))
    assert term and r == 0.0
    assert info["grade"]["tests_status"]["PASS_TO_PASS"]["failure"] == ["tests/test_calc.py::test_mul"]


def test_step_limit_grades_the_tree_and_same_container_grading(make_env):
    env = make_env(max_steps=2, grade_in="same")
    env.reset(options={"task": 0})
    env.step(call("bash", command="sed -i 's/return a - b/return a + b/' calc/__init__.py"))
    o, r, term, trunc, info = env.step("I give up")           # invalid last action: still graded
    assert trunc and not term and info["invalid_action"]
    assert r == 1.0 and info["success"] and "resolved" in o


def test_command_timeout_kills_the_command(make_env):
    env = make_env(command_timeout_s=2)
    env.reset(options={"task": 0})
    o, r, term, _, info = env.step(call("bash", command="(sleep 60; touch /tmp/late) & sleep 60; echo finished"))
    assert "ran past 2 s and was killed" in o and "finished" not in o and not term
    o, *_ = env.step(call("bash", command="ps -u agent -o comm= | grep -c '^sleep$' || true"))
    assert o.strip().splitlines()[-1] == "0", "the timed-out command's children must be killed too"
    # no clock: had the step waited for the command's child to end on its own, /tmp/late would be there
    o, *_ = env.step(call("bash", command="test -e /tmp/late && echo late || echo absent"))
    assert o.strip().splitlines()[-1] == "absent", "the step waited for the timed-out command's child"


def test_no_network_non_root_and_limits(make_env, client):
    env = make_env()
    env.reset(options={"task": 0})
    cfg = client.api.inspect_container(env.sb.container.id)["HostConfig"]
    assert cfg["NetworkMode"] == "none" and cfg["Memory"] == 4096 << 20 and cfg["PidsLimit"] == 1024
    probe = ("python3 -c \"import socket\nfor h in [('1.1.1.1', 53), ('172.17.0.1', 2375)]:\n"
             " try:\n  socket.create_connection(h, timeout=3); print('REACHED', h)\n"
             " except OSError as e: print('blocked', e.errno)\"; getent hosts pypi.org || echo no-dns")
    o, *_ = env.step(call("bash", command=probe))
    assert "REACHED" not in o and o.count("blocked") == 2 and "no-dns" in o
    o, *_ = env.step(call("bash", command="id -u; touch /etc/x 2>&1 | tail -1"))
    uid = env.sb.agent_uid          # a UID of its own per container (per-user kernel limits per sandbox)
    assert uid >= 20000 and f"\n{uid}\n" in o + "\n" and "Permission denied" in o
    o, *_ = env.step(call("bash", command="head -c 200000 /dev/zero | tr '\\0' x"))
    assert "characters truncated" in o and len(o) < 9000


def _agent_processes(env) -> int:
    """Live (non-zombie) processes of the agent user. A root exec can find the container briefly busy
    right after a fork bomb was killed (its processes still exiting): asked again, up to 20 s."""
    for _ in range(20):
        r = env.sb.exec("ps -e -o uid=,stat=", user="root")
        rows = [line.split() for line in r.output.splitlines() if len(line.split()) == 2]
        if r.exit_code == 0 and rows:
            return sum(1 for uid, stat in rows if uid == str(env.sb.uid) and not stat.startswith("Z"))
        time.sleep(1)
    raise AssertionError(f"ps did not run in the container: {r.exit_code} {r.output[-300:]!r}")


def test_no_process_outlives_its_command(make_env):
    """A fork bomb or a nohup busy loop is killed after its command, the observation says so, and the
    next command runs. A sandbox that let them survive would sit at the pid limit (~950 processes)
    with the CPU quota used up and every later command failing with "fork failed"."""
    env = make_env(cpus=0.5, command_timeout_s=5)
    env.reset(options={"task": 0})
    o, *_ = env.step(call("bash", command=":(){ :|:& };:"))
    assert "left running were killed" in o, o
    assert _agent_processes(env) == 0
    o, *_ = env.step(call("bash", command="echo still-works; ls /testbed | head -1"))
    assert "still-works" in o and "fork" not in o and "left running" not in o
    o, *_ = env.step(call("bash", command="nohup sh -c 'while :; do :; done' >/dev/null 2>&1 & echo started"))
    assert "started" in o and "1 process(es) this command left running were killed" in o
    assert _agent_processes(env) == 0



def test_root_command_that_outlives_its_timeout_is_killed(client):
    """A root command that timeout(1) cannot end (here it stops timeout itself) is ended by the
    host-side watchdog: every process carrying the command's marker is killed, and nothing else. A
    watchdog that passed the exec's host PID to ``kill`` inside the container (another PID namespace)
    would fail this: the command runs on, or the container itself is ended (exit 137)."""
    with DockerSandbox(TASK_IMAGE, client=client, command_timeout_s=1) as sb:
        r = sb.exec("echo started; kill -STOP $PPID; sleep 300", user="root", timeout_s=1)
        assert "started" in r.output and r.timed_out
        ps = sb.exec("ps -e -o args=", user="root").output.splitlines()
        assert not [p for p in ps if p.startswith("sleep 300")], ps


def test_a_stopped_container_is_explained(client):
    """When the container stops under a command, the error says how it ended (not only 'conflict')."""
    from crl_bench.envs.swebench.sandbox import SandboxError
    with DockerSandbox(TASK_IMAGE, client=client) as sb:
        sb.container.kill()
        with pytest.raises(SandboxError, match=r"the container stopped: status exited, exit code 137"):
            sb.exec("true")

def test_disk_quota_bounds_what_the_agent_writes(make_env):
    """A large dd does not write through to the host's disk: each file is capped at disk_mb, and the
    writable layer's growth past disk_mb stops the command."""
    env = make_env(disk_mb=32, command_timeout_s=30)
    env.reset(options={"task": 0})
    o, *_ = env.step(call("bash", command="dd if=/dev/zero of=/tmp/big bs=1M count=200 2>/dev/null; "
                                          "stat -c %s /tmp/big"))
    assert "File size limit exceeded" in o, o                   # dd was stopped by RLIMIT_FSIZE
    # stat's size on a line of its own; bash's notice of the killed dd goes to stderr, which reaches the
    # output before or after stat's stdout depending on scheduling
    assert [int(x) for x in o.strip().splitlines() if x.strip().isdigit()] == [32 << 20], o
    o, *_ = env.step(call("bash", command="for i in 1 2 3 4; do head -c 20M /dev/zero > /tmp/f$i; done; echo wrote"))
    assert "disk quota" in o, o
    o, *_ = env.step(call("bash", command="rm -f /tmp/big /tmp/f*; echo cleaned"))
    assert "cleaned" in o


def test_grading_container_has_no_network(make_env, monkeypatch):
    """The agent's patch runs as root in the grading container, so that container has no network."""
    from crl_bench.envs.swebench import env as env_mod

    seen = []
    original = env_mod.SWEBenchEnv._new_sandbox

    def spy(self, inst, network, non_root):
        sb = original(self, inst, network, non_root)
        host = sb.client.api.inspect_container(sb.container.id)["HostConfig"]
        seen.append((non_root, host["NetworkMode"]))
        return sb

    monkeypatch.setattr(env_mod.SWEBenchEnv, "_new_sandbox", spy)
    env = make_env()
    env.reset(options={"task": 0})
    env.step(FIX)
    *_, info = env.step(call("submit"))
    assert info["success"]                              # the offline grading still resolves the fix
    assert seen == [(True, "none"), (False, "none")]


def test_malformed_call_is_an_invalid_action_fed_back(make_env):
    env = make_env()
    env.reset(options={"task": 0})
    o, r, term, _, info = env.step('<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>')
    assert info["invalid_action"] and not term and r == 0 and "Invalid action" in o and "command" in o
    o, _, _, _, info = env.step(call("str_replace_editor", command="str_replace", path="/testbed/calc/__init__.py",
                                     old_str="return", new_str="return"))
    assert not info["invalid_action"] and "error" in o and "lines 6, 11" in o.replace("line ", "lines ")


def test_container_removed_when_the_run_is_killed(instances, client):
    code = ("import sys, time; from crl_bench.envs.swebench.env import SWEBenchEnv\n"
            f"env = SWEBenchEnv(instances={str(instances)!r})\n"
            "env.reset(options={'task': 0}); print(env.sb.name, flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-W", "ignore", "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = p.stdout.readline().strip()
        assert name and name in our_containers(client)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert name in our_containers(client)          # SIGKILL: no cleanup ran in that process...
    with DockerSandbox(TASK_IMAGE, client=client, non_root=False):
        pass                                       # ...the next sandbox start reaps it
    assert name not in our_containers(client)


def test_missing_image_is_a_clear_error(tmp_path, instances):
    row = json.loads(Path(instances).read_text())
    row["image"] = "crl-bench/no-such-image:never"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(ImageUnavailableError) as e:
        SWEBenchEnv(instances=str(bad), pull=False)
    msg = str(e.value)
    assert "crl-bench/no-such-image:never" in msg and "not present locally" in msg and "recipe" in msg
    assert isinstance(e.value, EnvUnavailableError)


def test_run_command_fails_clearly_without_instance_images(tmp_path):
    """`crl-bench run --method grpo --mix swebench-verified` on SWE-bench Verified: no swebench image
    is present and none can be pulled here, so the run stops at once with the reason (exit 2)."""
    env = dict(os.environ, CRL_BENCH_DATA=os.environ["CRL_BENCH_DATA"])
    p = subprocess.run([sys.executable, "-m", "crl_bench.cli", "run", "--method", "grpo", "--mix",
                        "swebench-verified", "--preset", "smoke", "--output-dir", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "none of the 500 instance images is present locally" in p.stderr
    assert "swebench/sweb.eval.x86_64." in p.stderr and "docker pull" in p.stderr
    assert "Traceback" not in p.stderr


def test_gold_patch_resolves_via_grade(instances, client):
    """The grader alone: the data set's gold patch applied in a fresh container is resolved."""
    from crl_bench.envs.swebench.grading import grade
    from crl_bench.envs.swebench.instances import load_instances

    inst = load_instances(instances)[0]
    with DockerSandbox(inst.image, client=client, non_root=False) as sb:
        res = grade(sb, inst, GOLD)
    assert res.resolved and res.patch_applied and not res.error
    with DockerSandbox(inst.image, client=client, non_root=False) as sb:
        res = grade(sb, inst, "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n")
    assert not res.resolved and not res.patch_applied and "does not apply" in res.error
