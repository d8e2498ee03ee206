"""The SWE-bench sandbox on Podman (setting ``engine: podman``): the Docker-compatible API of ``podman
system service`` driven by the same ``docker`` SDK, rootful as root and rootless as a user.

The unit tests need nothing. The container tests need Podman (``install.sh`` with the test extra installs
Debian's podman and catatonit as root) and skip, with Podman's own error, only when its service cannot
start here. Their images come from Docker's store when Docker has them (``docker save | podman load``
through the API), else the base image is built by debootstrap into Podman; the task image is then built
by Podman's builder from ``tests/envs/swe_synthetic.py``'s recipe.

``test_rootless_sandbox_as_a_new_user`` (root only) creates the user ``crl-rootless`` (``useradd``, with
subordinate UID/GID ranges), loads the task image into that user's store, and runs the sandbox's core
checks as that user, whose own code finds no socket and starts the rootless service.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from crl_bench.env_api import EnvUnavailableError
from crl_bench.envs.swebench import engine as eng
from crl_bench.envs.swebench.images import BASE_IMAGE, copy_image, image_present, local_images
from crl_bench.envs.swebench.sandbox import LABEL, DockerSandbox

sys.path.insert(0, str(Path(__file__).parent))
from swe_synthetic import INSTANCE_ID, TASK_IMAGE, build_task

pytestmark = [pytest.mark.filterwarnings("ignore:swebench-verified. no task_list"),
              pytest.mark.xdist_group("containers")]     # one container engine user at a time

ROOTLESS_USER = "crl-rootless"


def call(name: str, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


# ---------------------------------------------------------------- no engine needed


def test_engine_setting_is_checked_and_reaches_the_client(monkeypatch, tmp_path):
    """``engine`` is a constructor setting of the env (so ``rollout.env_kwargs.swebench-verified.engine``
    reaches it) and picks the client; an unknown engine is refused before anything is loaded."""
    from crl_bench.env_api import make_env
    from crl_bench.envs.swebench import env as swe_env

    with pytest.raises(ValueError, match=r"engine must be one of docker, podman, got 'lxc'"):
        swe_env.SWEBenchEnv(engine="lxc")
    asked = []
    monkeypatch.setattr(swe_env, "docker_client", lambda *a, **kw: asked.append(kw.get("engine")) or object())
    row = {"repo": "r/r", "instance_id": "r__r-1", "base_commit": "0" * 40, "patch": "", "test_patch": "",
           "problem_statement": "p", "version": "1", "FAIL_TO_PASS": "[]", "PASS_TO_PASS": "[]",
           "environment_setup_commit": "0" * 40, "image": "x:y", "eval_script": "true",
           "log_parser": "parse_log_pytest"}
    inst = tmp_path / "i.jsonl"
    inst.write_text(json.dumps(row) + "\n")
    env = make_env("swebench-verified", instances=str(inst), engine="podman", check_images=False)
    assert env.engine == "podman" and asked == ["podman"]
    monkeypatch.setenv(eng.ENGINE_ENV, "podman")              # the default when the setting is absent
    assert swe_env.SWEBenchEnv(instances=str(inst), check_images=False).engine == "podman"
    monkeypatch.delenv(eng.ENGINE_ENV)
    assert swe_env.SWEBenchEnv(instances=str(inst), check_images=False).engine == "docker"
    assert asked == ["podman", "podman", "docker"]


def test_socket_candidates_follow_podmans_conventions(tmp_path):
    env = {"XDG_RUNTIME_DIR": "/run/user/1234"}
    assert eng.podman_socket_candidates(env, uid=1234) == [
        ("unix:///run/user/1234/podman/podman.sock", "rootless"), ("unix:///run/podman/podman.sock", "rootful")]
    assert eng.podman_socket_candidates({}, uid=0)[0] == ("unix:///run/podman/podman.sock", "rootful")
    # no XDG_RUNTIME_DIR and no /run/user/<uid> of ours: Podman's own fallback under the temp dir
    assert eng.podman_socket_candidates({}, uid=987654)[0][0].endswith("/podman-run-987654/podman/podman.sock")
    env = {"CONTAINER_HOST": "unix:///a.sock", "DOCKER_HOST": "tcp://h:2375", "XDG_RUNTIME_DIR": "/x"}
    assert [o for _, o in eng.podman_socket_candidates(env, uid=5)] == [
        "CONTAINER_HOST", "DOCKER_HOST", "rootless", "rootful"]


def test_missing_podman_is_a_clear_error(monkeypatch, tmp_path):
    """Nothing answers at the socket and there is no ``podman`` to start a service: the error names the
    setting, the socket tried and the install command, and is an EnvUnavailableError (runs stop with it)."""
    sock = tmp_path / "nope" / "podman.sock"
    monkeypatch.setenv("CONTAINER_HOST", f"unix://{sock}")
    monkeypatch.setenv("PATH", str(tmp_path))                  # no podman on PATH
    with pytest.raises(eng.PodmanUnavailableError) as e:
        eng.docker_client(engine="podman")
    msg = str(e.value)
    assert "engine: podman" in msg and str(sock) in msg and "apt-get install podman" in msg, msg
    assert isinstance(e.value, EnvUnavailableError)


def test_a_service_that_cannot_start_is_reported_with_its_log(monkeypatch, tmp_path):
    """No socket answers, so the env starts ``podman system service`` at CONTAINER_HOST's socket; when
    that exits, the error says so with the tail of the service's own output (not an older run's). It
    runs from ``/``, not from the caller's folder (a service started from a folder that is deleted later
    fails every container start with "write child: broken pipe")."""
    fake = tmp_path / "bin" / "podman"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho \"args: $*\"\necho \"cwd: $(pwd)\"\necho 'Error: cannot set up namespace' >&2\n"
                    "exit 3\n")
    fake.chmod(0o755)
    sock = tmp_path / "run" / "podman.sock"
    monkeypatch.setenv("CONTAINER_HOST", f"unix://{sock}")
    monkeypatch.setenv("PATH", str(fake.parent))
    monkeypatch.setattr(eng.tempfile, "gettempdir", lambda: str(tmp_path))
    (tmp_path / f"crl-bench-podman-{os.geteuid()}.log").write_text("an older run's line\n")
    with pytest.raises(eng.PodmanUnavailableError) as e:
        eng.docker_client(engine="podman")
    msg = str(e.value)
    assert f"podman system service --time=0 unix://{sock}` exited with status 3" in msg, msg
    assert f"args: system service --time=0 unix://{sock}" in msg and "cannot set up namespace" in msg
    assert "older run" not in msg and str(sock) in msg.split("Sockets tried:")[1]
    # from /: conmon starts in the service's folder; once that is deleted every container start fails
    assert "cwd: /\n" in msg, msg


def test_podman_gets_explicit_rlimits_and_docker_none(monkeypatch):
    """Rootful Podman would ask for nofile/nproc of 2**20, which fails where root lacks CAP_SYS_RESOURCE
    (``error setting rlimit type 7: operation not permitted``, as on this project's CI machine)."""
    import resource

    class Fake:
        def __init__(self, name):
            self.name = name

        def version(self):
            return {"Components": [{"Name": self.name}]}

    assert eng.container_ulimits(Fake("Engine")) == []
    limits = {u["Name"]: (u["Soft"], u["Hard"]) for u in eng.container_ulimits(Fake("Podman Engine"))}
    assert set(limits) == {"nofile", "nproc"}
    for name, res in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        hard = resource.getrlimit(res)[1]
        soft_set, hard_set = limits[name]
        assert soft_set == hard_set <= min(eng.PODMAN_RLIMIT_DEFAULT, hard if hard >= 0 else 1 << 62)


def test_service_started_here_keeps_exec_sessions_30s(monkeypatch, tmp_path):
    """A service the env starts gets the distribution's containers.conf plus exit_command_delay (Podman
    keeps each API exec session and its conmon process 300 s by default); an administrator's or the
    user's own containers.conf stands untouched."""
    shipped = tmp_path / "containers.conf"
    shipped.write_text('[containers]\ndefault_capabilities = ["CHOWN"]\n\n[engine]\n#exit_command_delay = 300\n')
    monkeypatch.setattr(eng, "SHIPPED_CONF", shipped)
    monkeypatch.setattr(eng, "_admin_containers_confs", lambda: [])
    monkeypatch.delenv("CONTAINERS_CONF", raising=False)
    monkeypatch.setattr(eng.tempfile, "gettempdir", lambda: str(tmp_path))
    import tomllib

    conf = tomllib.loads(Path(eng._short_exec_sessions_conf()).read_text())
    assert conf == {"containers": {"default_capabilities": ["CHOWN"]},
                    "engine": {"exit_command_delay": eng.EXEC_SESSION_KEEP_S}}
    monkeypatch.setattr(eng, "_admin_containers_confs", lambda: [shipped])
    assert eng._short_exec_sessions_conf() is None
    monkeypatch.setattr(eng, "_admin_containers_confs", lambda: [])
    monkeypatch.setenv("CONTAINERS_CONF", str(shipped))
    assert eng._short_exec_sessions_conf() is None


def test_image_names_compare_as_docker_writes_them():
    class Img:
        tags = ["localhost/crl-bench/swe-base:bookworm", "docker.io/swebench/sweb.eval.x86_64.a__b-1:latest"]

    class Fake:
        class images:  # mimics client.images
            @staticmethod
            def list():
                return [Img()]

    have = local_images(Fake())
    assert {"crl-bench/swe-base:bookworm", "swebench/sweb.eval.x86_64.a__b-1:latest"} <= have
    assert eng.qualify_for_pull("swebench/sweb.eval.x86_64.a__b-1") == "docker.io/swebench/sweb.eval.x86_64.a__b-1"
    assert eng.qualify_for_pull("quay.io/x/y") == "quay.io/x/y" and eng.qualify_for_pull("ubuntu") == \
        "docker.io/library/ubuntu"


# ---------------------------------------------------------------- a real Podman service


@pytest.fixture(scope="module")
def pclient():
    try:
        client = eng.docker_client(timeout=600, engine="podman")
    except eng.PodmanUnavailableError as e:
        pytest.skip(f"Podman's API service cannot start here: {e}")
    assert eng.engine_of(client) == "podman"
    return client


def _docker_or_none():
    try:
        return eng.docker_client(timeout=600, engine="docker")
    except eng.DockerUnavailableError:
        return None


@pytest.fixture(scope="module")
def pinstances(tmp_path_factory, pclient):
    """The synthetic task's instance file, its image in Podman's store (base image copied from Docker's
    store when there, else built; the task image built by Podman)."""
    if not image_present(pclient, BASE_IMAGE):
        docker = _docker_or_none()
        if docker is not None and image_present(docker, BASE_IMAGE):
            copy_image(BASE_IMAGE, docker, pclient)
    return build_task(tmp_path_factory.mktemp("swe-podman"), pclient)


def _ours(client) -> list[str]:
    return [c.name for c in client.containers.list(all=True, filters={"label": f"{LABEL}=1"})]


def test_client_talks_to_podman(pclient):
    v = pclient.version()
    assert any(c.get("Name") == "Podman Engine" for c in v.get("Components", [])), v
    sock = pclient.api.get_adapter(pclient.api.base_url).socket_path
    assert f"unix://{sock}" in [u for u, _ in eng.podman_socket_candidates()], sock


def test_sandbox_core_behaviours_on_podman(pclient, pinstances):
    """exec, no network, a non-root agent, a timeout that kills the command and its children, no process
    outliving its command, the disk check, cleanup; and the limits the engine enforces."""
    before = set(_ours(pclient))
    with DockerSandbox(TASK_IMAGE, client=pclient, command_timeout_s=2, memory_mb=512, cpus=0.5, pids=256,
                       disk_mb=32) as sb:
        host = pclient.api.inspect_container(sb.container.id)["HostConfig"]
        assert host["NetworkMode"] == "none"
        if os.geteuid() == 0:                       # rootful: every limit is applied
            assert sb.unenforced == ()
            assert host["Memory"] == 512 << 20 and host["PidsLimit"] == 256
        r = sb.exec("echo hello; pwd")
        assert r.exit_code == 0 and r.output.split() == ["hello", "/testbed"]
        probe = ("python3 -c \"import socket\nfor h in [('1.1.1.1', 53), ('10.0.2.2', 80)]:\n"
                 " try:\n  socket.create_connection(h, timeout=3); print('REACHED', h)\n"
                 " except OSError as e: print('blocked', e.errno)\"; getent hosts pypi.org || echo no-dns")
        o = sb.exec(probe, timeout_s=20).output
        assert "REACHED" not in o and o.count("blocked") == 2 and "no-dns" in o, o
        o = sb.exec("id -u; touch /etc/x 2>&1 | tail -1").output
        assert sb.user == "agent" and o.split("\n")[0] == str(sb.agent_uid) and "Permission denied" in o, o
        r = sb.exec("(sleep 60; touch /tmp/late) & sleep 60; echo finished")
        assert r.timed_out and "finished" not in r.output
        assert sb.exec("ps -u agent -o comm= | grep -c '^sleep$' || true").output.strip() == "0"
        # no clock: had the exec waited for the command's child to end on its own, /tmp/late would be there
        assert sb.exec("test -e /tmp/late && echo late || echo absent").output.strip() == "absent"
        r = sb.exec("nohup sh -c 'while :; do :; done' >/dev/null 2>&1 & echo started")
        assert "started" in r.output and r.leftovers_killed == 1
        r = sb.exec(":(){ :|:& };:", timeout_s=5)
        # how many bomb processes are left for the clean-up varies (with Podman the exec's output pipe
        # closes when its first shell exits, and bomb processes writing "fork: retry" die of SIGPIPE;
        # on a loaded machine the first shell can stall on fork until the timeout kills its group):
        # what must hold is that none survives the command and the sandbox still works
        assert r.leftovers_killed == 0 or "left running were killed" in " ".join(r.notes), r
        rows = [row.split() for row in sb.exec("ps -e -o uid=,stat=", user="root").output.splitlines()]
        assert not [row for row in rows if row[:1] == [str(sb.uid)] and not row[1].startswith("Z")], rows
        assert sb.exec("echo still-works").output.strip() == "still-works"
        r = sb.exec("for i in 1 2 3; do head -c 20M /dev/zero > /tmp/f$i; done; echo wrote", timeout_s=30)
        assert r.disk_exceeded and "disk quota" in " ".join(r.notes), r
        sb.write_file("/testbed/new.txt", b"x\n")
        assert sb.read_file("/testbed/new.txt") == b"x\n"
        name = sb.name
        assert name in _ours(pclient)
    assert name not in _ours(pclient) and set(_ours(pclient)) <= before


def test_env_episode_through_podman_is_resolved(pclient, pinstances):
    """The whole env with ``engine: podman``: reset, the fix through the editor, submit; the grading
    container (a second Podman container) resolves it, and no container is left."""
    from crl_bench.envs.swebench.env import SWEBenchEnv

    before = set(_ours(pclient))
    env = SWEBenchEnv(instances=str(pinstances), engine="podman", command_timeout_s=10, max_steps=4)
    try:
        assert eng.engine_of(env.client) == "podman"
        _, info = env.reset(options={"task": 0})
        assert info["instance_id"] == INSTANCE_ID
        o, *_ = env.step(call("bash", command="id -un"))
        assert "agent" in o
        o, *_ = env.step(call("str_replace_editor", command="str_replace", path="/testbed/calc/__init__.py",
                              old_str="return a - b", new_str="return a + b"))
        assert "return a + b" in o, o
        _, r, term, _, info = env.step(call("submit"))
        assert term and r == 1.0 and info["grade"]["resolved"], info.get("grade")
    finally:
        env.close()
    assert set(_ours(pclient)) <= before


# ---------------------------------------------------------------- rootless, as a user created here

ROOTLESS_SCRIPT = r"""
import json, os, site, sys
site.addsitedir(sys.argv[1])
from crl_bench.envs.swebench import engine
from crl_bench.envs.swebench.sandbox import LABEL, DockerSandbox
c = engine.docker_client(engine="podman", timeout=600)
res = {"euid": os.geteuid(), "engine": engine.engine_of(c), "started": sorted(p.pid for p in engine._services.values()),
       "socket": c.api.get_adapter(c.api.base_url).socket_path, "cgroup": c.info().get("CgroupVersion")}
with DockerSandbox(sys.argv[2], client=c, command_timeout_s=2, memory_mb=512, cpus=0.5, pids=256) as sb:
    res["unenforced"] = list(sb.unenforced)
    res["network"] = c.api.inspect_container(sb.container.id)["HostConfig"]["NetworkMode"]
    res["id"] = sb.exec("id -u; getent hosts pypi.org || echo no-dns").output.split()
    res["agent_uid"] = sb.agent_uid
    r = sb.exec("sleep 60 & sleep 60; echo finished")
    res["timeout"] = [r.timed_out, "finished" in r.output]
    res["sleeps_left"] = sb.exec("ps -u agent -o comm= | grep -c '^sleep$' || true").output.strip()
    r = sb.exec(":(){ :|:& };:", timeout_s=3)
    rows = [x.split() for x in sb.exec("ps -e -o uid=,stat=", user="root").output.splitlines()]
    alive = [x for x in rows if x[:1] == [str(sb.uid)] and not x[1].startswith("Z")]
    res["bomb"] = [len(alive), sb.exec("ulimit -u; echo ok").output.split()]
    name = sb.name
res["left"] = name in [x.name for x in c.containers.list(all=True, filters={"label": LABEL + "=1"})]
print("RESULT " + json.dumps(res))
"""


def _as_user(user: str, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    home = f"/home/{user}"
    env = ["env", "-i", f"HOME={home}", f"USER={user}", "LANG=C.UTF-8", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
           "PYTHONDONTWRITEBYTECODE=1"]
    return subprocess.run(["runuser", "-u", user, "--", *env, *argv], capture_output=True, text=True,
                          timeout=timeout, cwd="/tmp")


def _rootless_user() -> str:
    """``crl-rootless``, created when missing, with subordinate ID ranges; its Podman storage set to
    overlay (Debian's default for a user without storage.conf is vfs: a full copy per container)."""
    if subprocess.run(["id", "-u", ROOTLESS_USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", ROOTLESS_USER], check=True, capture_output=True)
    for f, flag in (("/etc/subuid", "--add-subuids"), ("/etc/subgid", "--add-subgids")):
        if not any(line.startswith(f"{ROOTLESS_USER}:") for line in Path(f).read_text().splitlines()):
            subprocess.run(["usermod", flag, "200000-265535", ROOTLESS_USER], check=True, capture_output=True)
    conf = Path(f"/home/{ROOTLESS_USER}/.config/containers/storage.conf")
    if not conf.exists():
        _as_user(ROOTLESS_USER, ["sh", "-c", f"mkdir -p {conf.parent} && printf '[storage]\\ndriver = "
                                 f"\"overlay\"\\n' > {conf}"])
    return ROOTLESS_USER


def _user_python(user: str, site_dir: str) -> str | None:
    """An interpreter ``user`` can run with this venv's packages (the venv's own may live under /root)."""
    probe = "import site, sys; site.addsitedir(sys.argv[1]); import docker, crl_bench.envs.swebench.engine"
    for py in (sys.executable, "/usr/bin/python3", shutil.which("python3") or ""):
        if py and _as_user(user, [py, "-c", probe, site_dir], timeout=120).returncode == 0:
            return py
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="creates a user: runs as root only (as a user, the tests above "
                                               "already run rootless)")
def test_rootless_sandbox_as_a_new_user(pclient, pinstances):
    if shutil.which("runuser") is None or shutil.which("useradd") is None:
        pytest.skip("runuser/useradd not found")
    user = _rootless_user()
    site_dir = sysconfig.get_paths()["purelib"]
    py = _user_python(user, site_dir)
    if py is None:
        pytest.skip(f"no Python interpreter that {user} can run with {site_dir} (the venv's lives where "
                    f"{user} cannot read it and no system python{sys.version_info[0]}.{sys.version_info[1]})")
    if _as_user(user, ["podman", "image", "exists", TASK_IMAGE]).returncode != 0:
        tar = Path("/tmp") / f"crl-swe-task-{os.getpid()}.tar"        # /tmp: readable by the user
        try:
            with open(tar, "wb") as f:
                for chunk in pclient.images.get(TASK_IMAGE).save(named=True):
                    f.write(chunk)
            tar.chmod(0o644)
            load = _as_user(user, ["podman", "load", "-i", str(tar)])
            assert load.returncode == 0, load.stderr[-2000:]
        finally:
            tar.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="crl-rootless-") as tmp:       # pytest's own tmp is root's only
        script = Path(tmp) / "rootless.py"
        script.write_text(ROOTLESS_SCRIPT)
        Path(tmp).chmod(0o755)
        script.chmod(0o644)
        p = _as_user(user, [py, str(script), site_dir, TASK_IMAGE])
    out = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and out, (p.stdout + p.stderr)[-3000:]
    res = json.loads(out[-1][len("RESULT "):])
    try:
        assert res["euid"] != 0 and res["engine"] == "podman"
        uid = int(subprocess.run(["id", "-u", user], capture_output=True, text=True).stdout)
        assert res["socket"] in (f"/run/user/{uid}/podman/podman.sock", f"/tmp/podman-run-{uid}/podman/podman.sock")
        assert res["network"] == "none"
        assert res["id"] == [str(res["agent_uid"]), "no-dns"]
        assert res["timeout"] == [True, False] and res["sleeps_left"] == "0"
        assert res["bomb"] == [0, [str(256 - 32), "ok"]], res       # no bomb process outlived it
        assert res["left"] is False
        if res["cgroup"] == "1":       # rootless Podman applies no cgroup limit on cgroup v1
            assert sorted(res["unenforced"]) == ["cpus", "memory", "pids"], res
    finally:
        for pid in res["started"]:     # the rootless service this test's script started
            subprocess.run(["kill", str(pid)], capture_output=True)
