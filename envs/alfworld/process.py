"""ALFWorld's worker processes: a launcher per trainer process that imports TextWorld and ALFWorld
once and forks one worker per env, the worker loop that plays one game at a time, and
:class:`Worker`, the parent's handle of one worker.

Why a launcher: a fresh interpreter needs 2-4 s of CPU to import TextWorld (its generator data and
grammar, prompt_toolkit through ``textworld.agents``) before it can load a game, and a run starts a
worker for every live and every prefetched episode (64 for an evaluation of 32 live episodes) and
again whenever a worker is recycled. A worker forked from the launcher, which has done those imports,
starts in milliseconds and shares their pages until it writes them.

The launcher (``python -m crl_bench.envs.alfworld.worker --launcher``) reads spawn requests on a Unix
socket; each carries, as passed file descriptors (``socket.send_fds``), the worker's end of a fresh
socket pair and the file its output goes to. The launcher forks, replies with the child's pid, and
lets the kernel reap finished children (``SIGCHLD`` ignored). The launcher and its workers end when the
trainer process does: their sockets reach end-of-file.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any


class EnvWorkerError(RuntimeError):
    """The ALFWorld worker process died, timed out or failed; the episode is lost, the env is not."""


def memory_mb() -> dict[str, float]:
    """This process's memory in MB from one read of Linux's ``/proc/self/status``: ``rss_mb``, the
    peak resident size (``VmHWM``; a forked worker's starts from the launcher's, i.e. the imports'
    ~70 MB, not a trainer's: ``ru_maxrss`` would report a trainer's peak, so it is only the fallback
    where ``/proc`` is missing) and ``vm_mb``, the address space now (``VmSize``: what ``RLIMIT_AS``
    caps; 0 without ``/proc``)."""
    found: dict[str, float] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmSize:")):
                    found[line[:line.index(":")]] = int(line.split()[1]) / 1024.0
    except OSError:
        pass
    if "VmHWM" not in found:
        import resource
        found["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return {"rss_mb": found["VmHWM"], "vm_mb": found.get("VmSize", 0.0)}


def _import_alfworld() -> str | None:
    """Import TextWorld and ALFWorld's wrappers; ``None``, or the error to report to the parent."""
    try:
        import textworld
        import textworld.gym  # noqa: F401 - imported to be loaded (the worker uses it after the fork)
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos  # noqa: F401 - loaded
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises a clear error
        return (f"cannot import ALFWorld ({type(e).__name__}: {e}); "
                f"install the extra: pip install 'crl-bench[alfworld]'")
    return None


# ---- the worker (a child of the launcher) --------------------------------------------------------

def worker_main(channel: socket.socket, memory_limit_mb: int) -> None:
    """Worker loop: owns one TextWorld game at a time, talking to its env over ``channel``.

    Protocol: one JSON array per line each way. Requests ``["reset", gamefile]``, ``["step", command]``
    or ``["close"]``; replies ``["ok", payload]`` or ``["error", message]``. Payload: ``{"obs": str,
    "admissible": list[str], "won": bool, "done": bool, "rss_mb": float, "vm_mb": float}`` (peak
    resident memory, address space now); the first line is ``["ok", {"pid": int, "rss_mb": float,
    "vm_mb": float}]``. The address space is capped at ``memory_limit_mb`` (``RLIMIT_AS``; 0 = no cap).
    Returns at ``close`` or when the env's end of ``channel`` closes. Runs in a child of
    :func:`launcher_main`, which has imported TextWorld and ALFWorld.
    """
    rfile = channel.makefile("rb")

    def send(*msg: Any) -> None:
        channel.sendall((json.dumps(msg) + "\n").encode())

    if memory_limit_mb > 0:
        import resource
        limit = int(memory_limit_mb) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # loaded already: the launcher forks a worker only after these imports succeeded
    import textworld
    import textworld.gym
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    send("ok", {"pid": os.getpid(), **memory_mb()})
    env, loaded = None, None
    request = textworld.EnvInfos(won=True, admissible_commands=True)
    for line in rfile:
        try:
            msg = json.loads(line)
            cmd = msg[0]
            if cmd == "close":
                break
            if cmd == "reset":
                gamefile = msg[1]
                if gamefile != loaded:
                    if env is not None:
                        env.close()
                    env_id = textworld.gym.register_game(
                        gamefile, request, max_episode_steps=1_000_000,
                        wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])
                    env, loaded = textworld.gym.make(env_id), gamefile
                obs, infos = env.reset()
                done = False
            elif cmd == "step":
                if env is None:
                    raise RuntimeError("step before reset")
                obs, _score, done, infos = env.step(msg[1])
            else:
                raise ValueError(f"unknown worker command {cmd!r}")
            send("ok", {"obs": obs, "admissible": list(infos["admissible_commands"]),
                        "won": bool(infos["won"]), "done": bool(done), **memory_mb()})
        except MemoryError:
            send("error", f"MemoryError: the worker hit its {memory_limit_mb} MB limit")
            break
        except Exception as e:  # noqa: BLE001 - one bad request fails the episode, not the worker
            send("error", f"{type(e).__name__}: {e}")
    if env is not None:
        env.close()


# ---- the launcher --------------------------------------------------------------------------------

def launcher_main(control_fd: int) -> None:
    """Launcher loop (``python -m crl_bench.envs.alfworld.worker --launcher --control-fd N``): import
    TextWorld and ALFWorld, then for each request on the control socket (one JSON object per line,
    ``{"memory_mb": int}``, with two passed descriptors: the worker's socket and its output file) fork
    a worker running :func:`worker_main` and reply ``["ok", pid]`` (or ``["error", message]`` when the
    imports failed). Returns when the parent closes its end."""
    control = socket.socket(fileno=control_fd)
    error = _import_alfworld()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)          # the kernel reaps finished workers
    while True:
        try:                            # one request per message: the parent waits for each reply
            data, fds, _flags, _addr = socket.recv_fds(control, 4096, 2)
        except OSError:
            break
        if not data:
            break                                           # the trainer process is gone
        request = json.loads(data)
        if error is not None or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            control.sendall((json.dumps(["error", error or "a spawn request without its sockets"]) + "\n").encode())
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:                                        # the worker
            code = 0
            try:
                control.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.dup2(fds[1], 1)                          # whatever the libraries print: the output file
                os.dup2(fds[1], 2)
                os.close(fds[1])
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.close(null)
                worker_main(socket.socket(fileno=fds[0]), int(request["memory_mb"]))
            except BaseException:  # noqa: BLE001 - a worker must never return into the launcher's loop
                import traceback
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        for fd in fds:
            os.close(fd)
        control.sendall((json.dumps(["ok", pid]) + "\n").encode())


class _LauncherGone(EnvWorkerError):
    """The launcher process died or stopped answering (a fresh one may be started)."""


class _Launcher:
    """Parent-side handle of the launcher process: a fresh interpreter (``subprocess``), so it shares
    no state with the trainer and works from scripts, notebooks and tests alike."""

    def __init__(self) -> None:
        self.control, theirs = socket.socketpair()
        self.log = tempfile.TemporaryFile(mode="w+b")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "crl_bench.envs.alfworld.worker", "--launcher",
                 "--control-fd", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        finally:
            theirs.close()
        self.rfile = self.control.makefile("rb")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, memory_limit_mb: int, timeout_s: float) -> tuple[int, socket.socket, Any]:
        """Fork a worker; returns ``(pid, the env's socket, the worker's output file)``.

        Raises:
            _LauncherGone: the launcher died or did not answer in ``timeout_s`` (its first answer
                waits for its imports).
            EnvWorkerError: the launcher cannot import ALFWorld (names the extra to install).
        """
        ours, theirs = socket.socketpair()
        log = tempfile.TemporaryFile(mode="w+b")
        try:
            try:
                request = (json.dumps({"memory_mb": int(memory_limit_mb)}) + "\n").encode()
                socket.send_fds(self.control, [request], [theirs.fileno(), log.fileno()])
            except OSError as e:
                raise _LauncherGone(f"the ALFWorld launcher {self.proc.pid} is gone ({e}){_tail(self.log)}") from e
            ready = _readable(self.control, timeout_s)
            try:
                line = self.rfile.readline() if ready else None
            except OSError:
                line = b""                                  # reset by a launcher that died
            if line is None:
                raise _LauncherGone(f"the ALFWorld launcher {self.proc.pid} did not answer in {timeout_s:.0f} s")
            if not line:
                raise _LauncherGone(f"the ALFWorld launcher {self.proc.pid} died{_tail(self.log)}")
            status, payload = json.loads(line)
            if status != "ok":
                raise EnvWorkerError(payload)
        except BaseException:
            ours.close()
            log.close()
            raise
        finally:
            theirs.close()
        return int(payload), ours, log

    def close(self) -> None:
        for f in (self.rfile, self.control):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)                       # it returns at end-of-file
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.log.close()


_launcher: _Launcher | None = None
_launcher_lock = threading.Lock()


def _spawn(memory_limit_mb: int, timeout_s: float) -> tuple[int, socket.socket, Any]:
    """Fork a worker from this process's launcher, starting the launcher first when there is none or
    it died (once per call: a launcher that dies again is an error)."""
    global _launcher
    with _launcher_lock:
        for attempt in range(2):
            if _launcher is not None and not _launcher.alive():
                _launcher.close()
                _launcher = None
            if _launcher is None:
                _launcher = _Launcher()
            try:
                return _launcher.spawn(memory_limit_mb, timeout_s)
            except _LauncherGone:
                _launcher.proc.kill()
                _launcher.close()
                _launcher = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


def launcher_pid() -> int | None:
    """Process id of this process's launcher (``None`` before the first worker)."""
    return _launcher.proc.pid if _launcher is not None and _launcher.alive() else None


def _readable(f: Any, timeout_s: float) -> bool:
    """Whether ``f`` (a descriptor or an object with ``fileno()``) has data or end-of-file within
    ``timeout_s`` seconds; ``poll``, not ``select``, which fails on descriptors past 1024."""
    poller = select.poll()
    poller.register(f, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout_s) * 1000.0))


def _tail(log: Any, n: int = 600) -> str:
    try:
        log.seek(0, os.SEEK_END)
        size = log.tell()
        log.seek(max(0, size - n))
        tail = log.read().decode("utf-8", "replace").strip()
        return f"; its last output: ...{tail}" if tail else ""
    except (OSError, ValueError):
        return ""


class Worker:
    """Parent-side handle of one worker, forked from this process's launcher.

    Args:
        memory_limit_mb: the worker's address-space cap (``RLIMIT_AS``; 0 = none).
        start_timeout_s: how long to wait for the launcher and the worker's first line.

    Raises:
        EnvWorkerError: the worker could not be started (the launcher died twice, ALFWorld is not
            installed, or the worker did not answer).
    """

    def __init__(self, memory_limit_mb: int, start_timeout_s: float) -> None:
        self.pid, self.sock, self.log = _spawn(memory_limit_mb, start_timeout_s)
        self._pidfd: int | None = None
        self._killed = False
        if hasattr(os, "pidfd_open"):
            try:                        # signals through a pidfd cannot reach a later process of that pid
                self._pidfd = os.pidfd_open(self.pid)
            except OSError:
                self._pidfd = None      # already gone: the handshake below reports it
        self.rfile = self.sock.makefile("rb")
        try:
            status, payload = self.recv(start_timeout_s)
            if status != "ok":
                raise EnvWorkerError(payload)
        except BaseException:
            self.kill()                 # nothing of a worker that failed to start is kept
            raise
        self.rss_mb: float = payload["rss_mb"]
        self.vm_mb: float = payload.get("vm_mb", 0.0)

    def send(self, *msg: Any) -> None:
        try:
            self.sock.sendall((json.dumps(msg) + "\n").encode())
        except OSError as e:
            raise EnvWorkerError(f"ALFWorld worker {self.pid} died ({e}){_tail(self.log)}") from e

    def recv(self, timeout_s: float) -> tuple[str, Any]:
        if not _readable(self.sock, timeout_s):
            raise EnvWorkerError(f"ALFWorld worker {self.pid} did not answer in {timeout_s:.0f} s")
        try:
            line = self.rfile.readline()
        except OSError:
            line = b""
        if not line:
            raise EnvWorkerError(f"ALFWorld worker {self.pid} died{_tail(self.log)}")
        status, payload = json.loads(line)
        return status, payload

    def alive(self) -> bool:
        if self._killed:
            return False
        if self._pidfd is not None:
            return not _readable(self._pidfd, 0)                    # readable once it has exited
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def close(self) -> None:
        if self.alive():
            try:
                self.send("close")
                _readable(self.sock, 5)                             # end-of-file once it has returned
            except Exception:  # noqa: BLE001 - killed below either way
                pass
        self.kill()

    def kill(self) -> None:
        if self.alive():
            try:
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                    _readable(self._pidfd, 5)                       # readable once it has exited
                else:
                    os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        self._killed = True
        for f in (self.rfile, self.sock, self.log):
            try:
                f.close()
            except OSError:
                pass
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
