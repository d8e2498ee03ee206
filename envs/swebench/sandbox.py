"""Per-episode container sandbox of the SWE-bench env: one container, commands with a timeout, files.

Everything goes through the Docker Engine API (the ``docker`` SDK), never a CLI; the engine behind it is
Docker's daemon or Podman's Docker-compatible service (``engine: podman``, :mod:`.engine`: how its socket
is found or its service started, and what Podman is told differently).  A :class:`DockerSandbox` is one
container started from an instance image with

* no network (``network_mode="none"``) unless ``network=True``;
* resource limits: memory (``memory_mb``, swap included), CPUs (``cpus``), processes (``pids``); read
  back after the start, those the engine dropped (rootless Podman without delegated cgroup controllers)
  are listed in ``unenforced`` and warned about;
* ``no-new-privileges`` and an init process (reaps zombies, forwards signals);
* the agent's commands run as a non-root user (``agent``, created at start and given the working tree)
  where the image allows it (``useradd`` present), else as root with a warning; the user gets a UID of
  its own per container (derived from the container name), so per-user kernel limits are per sandbox;
* a per-command timeout: the command runs under coreutils ``timeout`` (its whole process group is
  killed), with a host-side watchdog for commands that outlive even that (a child that left the
  process group and holds the output open): it kills every process of the agent user, or for a root
  command every process carrying that command's marker in its environment;
* **no process outlives its command**: after each agent command every process of the agent user still
  running (a ``nohup`` or ``&`` job, a fork bomb) is killed and the observation says how many. Agent
  commands run with ``ulimit -u pids - 32`` (RLIMIT_NPROC, hard), so a fork bomb cannot take the last
  process slots: the clean-up always has room to start. It runs as the agent user and ends all its
  processes with one ``kill -KILL -1`` (repeated while any is listed), so its time does not grow with
  how many there are or how little CPU the quota leaves;
* **disk**: overlay2 on ext4 (the usual Docker setup) cannot cap a container's size (``--storage-opt
  size`` needs xfs with project quotas), so the writable layer is bounded another way: every file an
  agent command writes is capped at ``disk_mb`` (``ulimit -f``, the write fails with "File size limit
  exceeded"), and the layer's growth since the start (``SizeRw``) is polled every 2 s while an agent
  command runs and after it: past ``disk_mb`` the command's processes are killed and the observation
  says so. A burst between two polls can overshoot by what one process writes in 2 s;
* output truncated to ``max_output_chars`` (head and tail kept, the middle elided and counted), and
  never more than ``8 * max_output_chars`` bytes held in memory while reading;
* labels naming the owning process, so :func:`reap_orphans` removes containers whose owner died without
  cleaning up (e.g. SIGKILL); containers are also removed by :meth:`DockerSandbox.close`, by the context
  manager, and at interpreter exit.

:class:`ContainerWorkspace` implements :class:`.tools.Workspace` inside the container, so the
``str_replace_editor`` tool behaves exactly as on a local directory.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import posixpath
import shlex
import socket
import tarfile
import threading
import time
import uuid
import weakref
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

from crl_bench.env_api import EnvUnavailableError

from .engine import container_ulimits, docker_client, engine_of
from .tools import ToolError

log = logging.getLogger(__name__)

LABEL = "crl-bench.sandbox"
LABEL_PID = "crl-bench.owner-pid"
LABEL_HOST = "crl-bench.owner-host"
AGENT_USER = "agent"
AGENT_UID_RANGE = (20000, 60000)      # the agent's UID is drawn from here per container (by name)
ROOT_PID_RESERVE = 32                 # process slots the agent user cannot take (cleanup runs as root)
DISK_POLL_S = 2.0                     # seconds between writable-layer size checks during a command

# kill every live (non-zombie) process of the user that runs it, but itself: ``kill -KILL -1`` signals
# them all in one system call (a process forking at that moment loses its child), sent at least once
# and repeated while a scan of /proc still finds one (a killed process is listed until it has exited);
# bash builtins only, so it needs no free process slot per victim. Run as the agent user: as root,
# ``kill -1`` would end the container's own processes. Prints how many distinct processes its scans found
# (a lower bound: ``kill -1`` does not say whether it reached any). The first signal is sent whatever the
# first scan found: a scan is slow under a CPU quota shared with a fork bomb, and one that finds only
# processes that died since its glob (bomb processes die of SIGPIPE once Podman closes the exec's
# output) while their children, born after it, live on, would end the clean-up with survivors.
_REAP = r"""declare -A seen
for ((round=0; round<50; round++)); do
  n=0
  for d in /proc/[0-9]*; do
    p=${d#/proc/}; [ "$p" = "$$" ] && continue
    state=; while read -r k v _; do
      case "$k" in
        State:) state=$v ;;
        Uid:) [ "$v" = "$UID" ] && [ "$state" != Z ] && { seen[$p]=1; n=$((n+1)); }; break ;;
      esac
    done 2>/dev/null < "$d/status"
  done
  [ $n -eq 0 ] && [ $round -gt 0 ] && break
  kill -KILL -1 2>/dev/null
done
echo "${#seen[@]}"
"""

# kill every process whose environment holds EXEC_MARKER=<token> (one command and all it started, even
# those that left its process group); used when a root command outlives its timeout
EXEC_MARKER = "CRL_BENCH_EXEC"
_KILL_MARKED = r"""m=%s
for ((round=0; round<20; round++)); do
  pids=()
  for d in /proc/[0-9]*; do
    p=${d#/proc/}; [ "$p" = "$$" ] && continue
    while IFS= read -r -d '' kv; do [ "$kv" = "$m" ] && { pids+=("$p"); break; }; done 2>/dev/null < "$d/environ"
  done
  [ ${#pids[@]} -eq 0 ] && break
  kill -KILL "${pids[@]}" 2>/dev/null
done
"""


class SandboxError(RuntimeError):
    """The container failed (could not start, died, or an API call failed); the episode is lost."""


class ImageUnavailableError(EnvUnavailableError):
    """An instance image is not present locally and can be neither pulled nor built."""


@dataclass(frozen=True)
class ExecResult:
    """One command's outcome.

    Attributes:
        output: stdout and stderr interleaved as produced, decoded as UTF-8 (errors replaced), already
            truncated to the sandbox's ``max_output_chars`` when ``truncated``.
        exit_code: the command's exit status; 124/137 after a timeout, ``None`` if unknown.
        timed_out: the command was killed at its timeout.
        truncated: characters were elided from the middle of ``output``.
        seconds: wall time.
        notes: what the sandbox did after or during the command, for the agent to read (processes it
            left behind that were killed, the disk quota stopping it).
        leftovers_killed: processes of the agent user still running after the command, killed.
        disk_exceeded: the writable layer grew past ``disk_mb`` during or by the command.
    """

    output: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    seconds: float
    notes: tuple[str, ...] = ()
    leftovers_killed: int = 0
    disk_exceeded: bool = False


def truncate_middle(text: str, limit: int) -> tuple[str, bool]:
    """Keep the first and last ``limit // 2`` characters of ``text`` with a marker counting the
    elided ones between them; ``(text, False)`` when it fits."""
    if limit <= 0 or len(text) <= limit:
        return text, False
    half = limit // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters truncated ...]\n{text[-half:]}", True


# (engine, unenforced limits) already warned about in this process
_WARNED: set[tuple[str, tuple[str, ...]]] = set()

# live sandboxes of this process, removed at interpreter exit if still there
_LIVE: weakref.WeakSet[DockerSandbox] = weakref.WeakSet()


@atexit.register
def _remove_live() -> None:
    for sb in list(_LIVE):
        try:
            sb.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphans(client) -> list[str]:
    """Remove this host's sandbox containers whose owning process is gone; returns their names.

    Containers are matched by the :data:`LABEL` label and :data:`LABEL_HOST`; a container whose
    :data:`LABEL_PID` process no longer runs was left behind by a crashed run."""
    gone = []
    host = socket.gethostname()
    for c in client.containers.list(all=True, filters={"label": f"{LABEL}=1"}):
        labels = c.labels or {}
        if labels.get(LABEL_HOST) != host:
            continue
        try:
            pid = int(labels.get(LABEL_PID, "0"))
        except ValueError:
            pid = 0
        if pid and _pid_alive(pid):
            continue
        try:
            c.remove(force=True)
            gone.append(c.name)
        except Exception:  # noqa: BLE001 - raced with another reaper
            pass
    return gone


class DockerSandbox:
    """One container for one episode.  Use as a context manager, or call :meth:`start` and
    :meth:`close` (idempotent; also run at interpreter exit).

    Args:
        image: image name (must exist locally: see :func:`.images.ensure_image`).
        workdir: the working tree inside the image (``/testbed`` in swebench images).
        client: a ``docker.DockerClient`` (default :func:`docker_client`).
        network: give the container the default bridge network (default: none at all).
        memory_mb: memory limit in MiB (swap included); cpus: CPU quota in cores; pids: process limit
            (the agent user may hold ``pids - 32``).
        disk_mb: how much the container's files may grow (MiB) through agent commands: each file is
            capped at this size and the writable layer is checked during and after each command
            (module docstring); 0 turns the check off.
        command_timeout_s: default per-command timeout in seconds.
        max_output_chars: output kept per command (head and tail).
        non_root: run agent commands as the ``agent`` user when the image allows it.
        name_prefix: container names are ``<prefix>-<pid>-<n>``.
        engine: ``"docker"`` or ``"podman"`` (see :mod:`.engine`); used only when ``client`` is None
            (default ``$CRL_BENCH_SWE_ENGINE``, else Docker).

    Attributes:
        unenforced: after :meth:`start`, the limits the engine accepted but did not apply (a subset of
            ``("memory", "cpus", "pids")``, read back from the container's ``HostConfig``), e.g. all
            three under rootless Podman on cgroup v1; a warning names them once per process.

    Raises:
        DockerUnavailableError: no daemon (PodmanUnavailableError for Podman). SandboxError: the
        container cannot be started.
    """

    _count = 0
    _count_lock = threading.Lock()

    def __init__(self, image: str, workdir: str = "/testbed", client=None, network: bool = False,
                 memory_mb: int = 4096, cpus: float = 2.0, pids: int = 1024, disk_mb: int = 4096,
                 command_timeout_s: float = 120.0, max_output_chars: int = 10_000, non_root: bool = True,
                 name_prefix: str = "crl-swe", engine: str | None = None) -> None:
        if (command_timeout_s <= 0 or max_output_chars < 100 or memory_mb < 64 or cpus <= 0
                or pids < 2 * ROOT_PID_RESERVE or disk_mb < 0):
            raise ValueError(f"sandbox: need command_timeout_s > 0, max_output_chars >= 100, memory_mb >= 64, "
                             f"cpus > 0, pids >= {2 * ROOT_PID_RESERVE}, disk_mb >= 0")
        self.image = image
        self.workdir = posixpath.normpath(workdir)
        self.client = client
        self.engine = engine
        self.unenforced: tuple[str, ...] = ()
        self.network = bool(network)
        self.memory_mb, self.cpus, self.pids, self.disk_mb = int(memory_mb), float(cpus), int(pids), int(disk_mb)
        self.command_timeout_s = float(command_timeout_s)
        self.max_output_chars = int(max_output_chars)
        self.want_non_root = bool(non_root)
        with DockerSandbox._count_lock:
            DockerSandbox._count += 1
            n = DockerSandbox._count
        self.name = f"{name_prefix}-{os.getpid()}-{n}"
        self.container = None
        self.user = "root"
        self.uid, self.gid = 0, 0
        self._disk_base: int | None = None     # writable-layer size (bytes) once the sandbox was set up

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> DockerSandbox:
        """Create and start the container, then set up the agent user. Returns ``self``."""
        if self.container is not None:
            return self
        if self.client is None:
            self.client = docker_client(engine=self.engine)
        reap_orphans(self.client)
        kwargs: dict[str, Any] = dict(
            command=["sleep", "infinity"], detach=True, name=self.name, init=True,
            working_dir=self.workdir, user="root", stdin_open=False, tty=False,
            labels={LABEL: "1", LABEL_PID: str(os.getpid()), LABEL_HOST: socket.gethostname()},
            mem_limit=f"{self.memory_mb}m", memswap_limit=f"{self.memory_mb}m",
            nano_cpus=int(self.cpus * 1e9), pids_limit=self.pids,
            security_opt=["no-new-privileges"], environment={"PIP_NO_INPUT": "1", "PAGER": "cat"})
        if not self.network:
            kwargs["network_mode"] = "none"
            kwargs["environment"]["PIP_NO_INDEX"] = "1"      # pip fails at once instead of retrying
        ulimits = container_ulimits(self.client)           # Podman: nofile/nproc it may set (see engine)
        if ulimits:
            kwargs["ulimits"] = ulimits
        try:
            self.container = self.client.containers.run(self.image, **kwargs)
        except Exception as e:
            self.container = None
            raise SandboxError(f"cannot start a container from {self.image}: {e}") from e
        _LIVE.add(self)
        try:
            self._check_limits()
            self._setup_user()
            if self.disk_mb:
                self._disk_base = self.disk_usage()
        except Exception:
            self.close()
            raise
        return self

    def _check_limits(self) -> None:
        """Read the container's limits back (``HostConfig``) and note those the engine dropped: rootless
        Podman ignores memory, CPU and process limits on cgroup v1, and on cgroup v2 those whose
        controller is not delegated to the user, with a warning that the Engine API's client never sees."""
        try:
            host = self.client.api.inspect_container(self.container.id).get("HostConfig") or {}
        except Exception as e:  # noqa: BLE001 - a failing inspect is reported by the next call
            log.debug("sandbox %s: cannot inspect the container's limits: %s", self.name, e)
            return
        quota, period = host.get("CpuQuota") or 0, host.get("CpuPeriod") or 0
        cpus = (host.get("NanoCpus") or 0) / 1e9 or (quota / period if quota > 0 and period > 0 else 0.0)
        missing = []
        if (host.get("Memory") or 0) != self.memory_mb << 20:
            missing.append("memory")
        if abs(cpus - self.cpus) > 0.01:
            missing.append("cpus")
        if (host.get("PidsLimit") or 0) != self.pids:
            missing.append("pids")
        self.unenforced = tuple(missing)
        key = (engine_of(self.client), self.unenforced)
        if missing and key not in _WARNED:
            _WARNED.add(key)
            log.warning("sandbox %s: the %s engine does not enforce the container's %s limit(s) here (rootless "
                        "Podman applies cgroup limits only on cgroup v2 with the controllers delegated to the "
                        "user); agent commands keep their per-command limits (ulimit -u, ulimit -f, the disk "
                        "check, the timeout)", self.name, key[0], ", ".join(missing))

    @property
    def agent_uid(self) -> int:
        """The UID the agent user gets in this container (stable per container name)."""
        lo, hi = AGENT_UID_RANGE
        return lo + zlib.crc32(self.name.encode()) % (hi - lo)

    def _setup_user(self) -> None:
        if not self.want_non_root:
            return
        uid = self.agent_uid
        # an image's own agent user is moved to this container's UID (usermod keeps its home's files);
        # a UID of its own makes RLIMIT_NPROC, which the kernel counts per UID, a per-sandbox limit
        script = (f"if id -u {AGENT_USER} >/dev/null 2>&1; then usermod -u {uid} {AGENT_USER} 2>/dev/null; "
                  f"else useradd -m -u {uid} -s /bin/bash {AGENT_USER} 2>/dev/null || "
                  f"useradd -m -s /bin/bash {AGENT_USER} || exit 3; fi; "
                  f"chown -R {AGENT_USER}: {shlex.quote(self.workdir)} || exit 4; "
                  f"git config --system --add safe.directory '*' 2>/dev/null; "
                  f"id -u {AGENT_USER}; id -g {AGENT_USER}")
        r = self.exec(script, user="root", timeout_s=600)
        lines = r.output.split()
        if r.exit_code == 0 and len(lines) >= 2 and lines[-1].isdigit() and lines[-2].isdigit():
            self.user, self.uid, self.gid = AGENT_USER, int(lines[-2]), int(lines[-1])
        else:
            log.warning("sandbox %s: cannot run as a non-root user in %s (exit %s: %s); commands run "
                        "as root", self.name, self.image, r.exit_code, r.output.strip()[-200:])

    def close(self) -> None:
        """Remove the container (forcibly; idempotent)."""
        c, self.container = self.container, None
        _LIVE.discard(self)
        if c is not None:
            try:
                c.remove(force=True)
            except Exception as e:  # noqa: BLE001 - already gone, or the daemon went away
                if "No such container" not in str(e):
                    log.warning("sandbox %s: removing the container failed: %s", self.name, e)

    def __enter__(self) -> DockerSandbox:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """Whether the container exists and runs."""
        if self.container is None:
            return False
        try:
            self.container.reload()
            return self.container.status == "running"
        except Exception:  # noqa: BLE001 - removed, or the daemon went away: not alive
            return False

    # ---- commands ----------------------------------------------------------------------------------
    def exec(self, command: str, timeout_s: float | None = None, user: str | None = None,
             workdir: str | None = None, truncate: bool = True) -> ExecResult:
        """Run ``bash -c command`` in the container.

        Args:
            command: shell text. timeout_s: seconds (default ``command_timeout_s``). user: default the
            agent user. workdir: default the working tree. truncate: cut the output to
            ``max_output_chars`` (off for eval logs, which are then held whole).

        Raises:
            SandboxError: the container is not running or the API call failed.
        """
        if self.container is None:
            raise SandboxError(f"sandbox {self.name} is not running")
        timeout = float(timeout_s if timeout_s is not None else self.command_timeout_s)
        user = user or self.user
        api = self.client.api
        agent = user != "root"
        if agent:           # hard limits the command cannot raise: process slots, size of any one file
            # (a hard limit already lower than these stays: the error is then harmless and hidden)
            limits = f"ulimit -u {self.pids - ROOT_PID_RESERVE} 2>/dev/null"
            if self.disk_mb:
                limits += f"; ulimit -f {self.disk_mb * 1024} 2>/dev/null"
            command = f"{limits}\n{command}"
        argv = ["timeout", "-k", "5", f"{timeout:g}", "bash", "-c", command]
        marker = f"{EXEC_MARKER}={uuid.uuid4().hex}"     # inherited by all the command starts
        t0 = time.perf_counter()
        try:
            exec_id = api.exec_create(self.container.id, argv, user=user, workdir=workdir or self.workdir,
                                      environment={"HOME": "/root" if user == "root" else f"/home/{user}",
                                                   EXEC_MARKER: marker.split("=", 1)[1]})
            stream = api.exec_start(exec_id, stream=True)
        except Exception as e:
            raise self._failure("exec failed", e) from e
        cap = 8 * self.max_output_chars if truncate else 1 << 30
        head, tail, tail_len, dropped = bytearray(), deque(), [0], [0]
        err: list[BaseException] = []

        def pump() -> None:
            try:
                for chunk in stream:
                    if len(head) < cap // 2:
                        take = cap // 2 - len(head)
                        head.extend(chunk[:take])
                        chunk = chunk[take:]
                    if chunk:
                        tail.append(chunk)
                        tail_len[0] += len(chunk)
                        while tail_len[0] - len(tail[0]) >= cap // 2:
                            dropped[0] += len(tail[0])
                            tail_len[0] -= len(tail.popleft())
            except Exception as e:  # noqa: BLE001 - the stream died with the container
                err.append(e)

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        watch_disk = agent and self.disk_mb and self._disk_base is not None
        disk_exceeded = False
        deadline = time.monotonic() + timeout + 15
        while th.is_alive() and time.monotonic() < deadline:
            th.join(min(DISK_POLL_S, max(0.0, deadline - time.monotonic())) if watch_disk else
                    max(0.0, deadline - time.monotonic()))
            if watch_disk and th.is_alive() and self._over_disk_quota():
                disk_exceeded = True
                self._kill_command(user, marker)
                th.join(10)
        watchdog = th.is_alive()
        if watchdog:                      # timeout(1) could not end it: kill what it started
            self._kill_command(user, marker)
            th.join(10)
        seconds = time.perf_counter() - t0
        try:
            code = api.exec_inspect(exec_id).get("ExitCode")
        except Exception:  # noqa: BLE001 - the exit code is unknown, the output is still the agent's
            code = None
        raw = bytes(head) + (f"\n[... {dropped[0]} bytes not kept ...]\n".encode() if dropped[0] else b"") \
            + b"".join(tail)
        text = raw.decode("utf-8", errors="replace")
        truncated = bool(dropped[0])
        if truncate:
            text, cut = truncate_middle(text, self.max_output_chars)
            truncated = truncated or cut
        timed_out = watchdog or code in (124, 137) and seconds >= timeout - 0.5
        if err and not self.alive:
            raise self._failure("the container died", err[0])
        notes: list[str] = []
        killed = 0
        if agent:
            killed = self.kill_leftovers()
            if killed:
                notes.append(f"[sandbox: {killed} process(es) this command left running were killed; a command "
                             "may not leave processes behind (no background jobs, nohup or daemons)]")
            if watch_disk and not disk_exceeded and self._over_disk_quota():
                disk_exceeded = True
        if disk_exceeded:
            notes.append(f"[sandbox: the container's files grew past the {self.disk_mb} MiB disk quota; the "
                         "command was stopped. Delete what you wrote to free space]")
        return ExecResult(text, code, bool(timed_out), truncated, seconds, tuple(notes), killed, disk_exceeded)

    def kill_leftovers(self) -> int:
        """Kill every process of the agent user (run after each agent command: none may outlive it);
        returns how many were killed (0 when the sandbox runs commands as root).

        The killer runs as the agent user itself (``kill -KILL -1``, see ``_REAP``), outside the
        command's limits, so one system call ends a fork bomb whatever the CPU quota leaves it.

        Raises:
            SandboxError: the container is not running or the API call failed.
        """
        if self.user == "root" or self.container is None:
            return 0
        try:
            exec_id = self.client.api.exec_create(self.container.id, ["bash", "-c", _REAP], user=self.user)
            out = self.client.api.exec_start(exec_id)
        except Exception as e:
            raise self._failure("cleaning up after the command failed", e) from e
        last = out.decode("utf-8", "replace").strip().splitlines()[-1:] or ["0"]
        return int(last[0]) if last[0].isdigit() else 0

    def disk_usage(self) -> int:
        """Bytes in the container's writable layer (Docker's ``SizeRw``). Raises SandboxError."""
        try:
            rows = self.client.api.containers(all=True, size=True, filters={"id": self.container.id})
        except Exception as e:
            raise SandboxError(f"sandbox {self.name}: cannot read the container's size: {e}") from e
        return int(rows[0].get("SizeRw") or 0) if rows else 0

    def _over_disk_quota(self) -> bool:
        try:
            return self.disk_usage() - (self._disk_base or 0) > self.disk_mb * (1 << 20)
        except SandboxError:
            return False

    def _kill_command(self, user: str, marker: str) -> None:
        """Kill a command that outlived its timeout: an agent command with every process of the agent
        user, a root command with every process that carries its ``marker`` in its environment (the
        exec's own PID from the API is a host PID, meaningless inside the container)."""
        try:
            if user != "root":
                self.container.exec_run(["bash", "-c", _REAP], user=self.user, detach=True)
            else:
                self.container.exec_run(["bash", "-c", _KILL_MARKED % shlex.quote(marker)], user="root",
                                        detach=True)
        except Exception:  # noqa: BLE001 - the container may already be gone
            pass

    def _failure(self, what: str, err: BaseException) -> SandboxError:
        """A :class:`SandboxError` for ``what`` failing with ``err``, saying why when the container has
        stopped (its exit code, whether the kernel's OOM killer ended it, Docker's error)."""
        state = ""
        try:
            st = self.client.api.inspect_container(self.container.id)["State"]
            if not st.get("Running"):
                state = (f"; the container stopped: status {st.get('Status')}, exit code {st.get('ExitCode')}, "
                         f"OOM-killed {st.get('OOMKilled')}, error {st.get('Error') or 'none'}, "
                         f"finished at {st.get('FinishedAt')}")
        except Exception as e:  # noqa: BLE001 - removed, or the daemon went away
            state = f"; the container cannot be inspected ({e})"
        return SandboxError(f"sandbox {self.name}: {what}: {err}{state}")

    # ---- files -------------------------------------------------------------------------------------
    def write_file(self, path: str, data: bytes, mode: int = 0o644, owner: tuple[int, int] | None = None) -> None:
        """Write ``data`` to the absolute ``path`` (parent directories created, owned by ``owner``,
        default the agent user).  Raises SandboxError."""
        uid, gid = owner if owner is not None else (self.uid, self.gid)
        parent, name = posixpath.split(posixpath.normpath(path))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.uid, info.gid, info.mtime = len(data), mode, uid, gid, int(time.time())
            tar.addfile(info, io.BytesIO(data))
        mk = self.exec(f"mkdir -p {shlex.quote(parent)}", user="root" if uid == 0 else self.user, timeout_s=30)
        if mk.exit_code != 0:
            raise SandboxError(f"cannot create {parent}: {mk.output.strip()[:300]}")
        try:
            if not self.client.api.put_archive(self.container.id, parent, buf.getvalue()):
                raise SandboxError(f"cannot write {path}")
        except SandboxError:
            raise
        except Exception as e:
            raise SandboxError(f"cannot write {path}: {e}") from e

    def read_file(self, path: str, limit: int = 64 << 20) -> bytes:
        """Bytes of the regular file ``path``.  Raises SandboxError (missing, not a file, over ``limit``)."""
        try:
            stream, stat = self.client.api.get_archive(self.container.id, path)
        except Exception as e:
            raise SandboxError(f"cannot read {path}: {e}") from e
        if stat.get("size", 0) > limit:
            raise SandboxError(f"{path} is {stat['size']} bytes, over the {limit}-byte limit")
        buf = io.BytesIO(b"".join(stream))
        with tarfile.open(fileobj=buf) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise SandboxError(f"{path} is not a regular file")
            f = tar.extractfile(member)
            return f.read() if f else b""

    # ---- the working tree --------------------------------------------------------------------------
    def diff(self, base: str = "HEAD") -> str:
        """The working tree's changes against ``base`` as a git patch, new (untracked, not ignored)
        files included, file modes ignored: ``git add -A`` then ``git diff --cached`` (run as root, so it
        sees every file).  Raises SandboxError if git fails."""
        cmd = (f"git -c core.fileMode=false add -A >/dev/null 2>&1; "
               f"git -c core.fileMode=false diff --cached --binary {shlex.quote(base)}")
        r = self.exec(cmd, user="root", timeout_s=300, truncate=False)
        if r.exit_code != 0:
            raise SandboxError(f"git diff failed in {self.workdir}: {r.output.strip()[:500]}")
        return r.output if r.output.endswith("\n") or not r.output else r.output + "\n"


class ContainerWorkspace:
    """:class:`.tools.Workspace` inside a sandbox: the agent's tree is ``sandbox.workdir`` and paths are
    the container's own (absolute, or relative to the working tree).  Paths leading outside the working
    tree (also through symbolic links) are refused, as in :class:`.tools.LocalWorkspace`; files are
    written with their previous mode and owner (new files: the agent user's, mode 644)."""

    def __init__(self, sandbox: DockerSandbox) -> None:
        self.sb = sandbox
        self.mount = sandbox.workdir

    def _probe(self, path: str) -> tuple[str, str, int, int, int]:
        """(canonical path, kind 'f'/'d'/'o'/'-', mode, uid, gid) of ``path``; ToolError if invalid."""
        if not isinstance(path, str) or not path.strip() or "\x00" in path:
            raise ToolError(f"Invalid path {path!r}: expected a non-empty string.")
        norm = posixpath.normpath(posixpath.join(self.mount, path.strip()))
        rel = posixpath.relpath(norm, self.mount)
        if rel == ".." or rel.startswith("../"):
            raise ToolError(f"Path {path!r} is outside the workspace; use paths under {self.mount}.")
        q = shlex.quote(norm)
        script = (f"r=$(realpath -m -- {q}) || exit 2; printf '%s\\n' \"$r\"; "
                  f"if [ -d \"$r\" ]; then k=d; elif [ -f \"$r\" ]; then k=f; elif [ -e \"$r\" ]; then k=o; "
                  f"else k=-; fi; echo $k; [ $k = - ] && echo '0 0 0' || stat -c '%a %u %g' -- \"$r\"")
        try:
            r = self.sb.exec(script, user="root", timeout_s=30)
        except SandboxError as e:
            raise ToolError(f"Cannot access {norm}: {e}") from None
        lines = r.output.splitlines()
        if r.exit_code != 0 or len(lines) < 3:
            raise ToolError(f"Cannot resolve path {path!r}.")
        real, kind = lines[0], lines[1]
        if real != self.mount and not real.startswith(self.mount.rstrip("/") + "/"):
            raise ToolError(f"Path {path!r} leads outside the workspace (through a symbolic link).")
        mode, uid, gid = lines[2].split()
        return norm, kind, int(mode, 8), int(uid), int(gid)

    def resolve(self, path: str) -> str:
        """See :meth:`.tools.Workspace.resolve`."""
        return self._probe(path)[0]

    def read(self, path: str) -> str:
        """See :meth:`.tools.Workspace.read`."""
        norm, kind, *_ = self._probe(path)
        if kind != "f":
            raise ToolError(f"Cannot access {norm}: " + ("Is a directory." if kind == "d" else
                                                         "No such file or directory."))
        try:
            return self.sb.read_file(norm).decode("utf-8")
        except UnicodeError:
            raise ToolError(f"{norm}: not valid UTF-8 text.") from None
        except SandboxError as e:
            raise ToolError(f"Cannot access {norm}: {e}") from None

    def write(self, path: str, text: str) -> None:
        """See :meth:`.tools.Workspace.write`."""
        norm, kind, mode, uid, gid = self._probe(path)
        if kind == "d":
            raise ToolError(f"Cannot access {norm}: Is a directory.")
        try:
            data = text.encode("utf-8")
        except UnicodeError:
            raise ToolError(f"{norm}: not valid UTF-8 text.") from None
        owner = (uid, gid) if kind == "f" else None
        try:
            self.sb.write_file(norm, data, mode=mode if kind == "f" else 0o644, owner=owner)
        except SandboxError as e:
            raise ToolError(f"Cannot access {norm}: {e}") from None

    def remove(self, path: str) -> None:
        """See :meth:`.tools.Workspace.remove`."""
        norm, kind, *_ = self._probe(path)
        if kind in ("d", "-"):
            raise ToolError(f"Cannot access {norm}: " + ("Is a directory." if kind == "d" else
                                                         "No such file or directory."))
        r = self.sb.exec(f"rm -f -- {shlex.quote(norm)}", user="root", timeout_s=30)
        if r.exit_code != 0:
            raise ToolError(f"Cannot access {norm}: {r.output.strip()[:200]}")

    def exists(self, path: str) -> bool:
        """See :meth:`.tools.Workspace.exists`."""
        return self._probe(path)[1] != "-"

    def is_dir(self, path: str) -> bool:
        """See :meth:`.tools.Workspace.is_dir`."""
        return self._probe(path)[1] == "d"

    def listdir(self, path: str, depth: int = 2) -> list[str]:
        """See :meth:`.tools.Workspace.listdir` (same order and marks as the local workspace)."""
        norm, kind, *_ = self._probe(path)
        if kind != "d":
            raise ToolError(f"Cannot access {norm}: Not a directory.")
        r = self.sb.exec(f"cd {shlex.quote(norm)} && find . -mindepth 1 -maxdepth {int(depth)} "
                         f"-name '.*' -prune -o -printf '%y %P\\n'", user="root", timeout_s=60,
                         truncate=False)
        if r.exit_code != 0:
            raise ToolError(f"Cannot access {norm}: {r.output.strip()[:200]}")
        entries = []
        for line in r.output.splitlines():
            if len(line) > 2 and line[1] == " ":
                kind_, rel = line[0], line[2:]
                entries.append((rel.split("/"), rel + ("/" if kind_ == "d" else "")))
        return [shown for _, shown in sorted(entries)]
