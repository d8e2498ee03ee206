"""Container engines of the SWE-bench sandbox: Docker, or Podman through its Docker-compatible API.

The sandbox, the image helpers and the grader all talk to an engine through the ``docker`` Python SDK
(the Docker Engine REST API). Podman serves the same API (``podman system service``), so the setting
``engine: podman`` changes only *which socket* the SDK connects to, plus the few places where Podman
answers differently (:func:`container_ulimits`, :func:`normalize_image_name`).

Podman's socket, in this order (the first that answers as Podman is used):

1. ``CONTAINER_HOST`` (Podman's own variable) when set; it must answer, and answer as Podman;
2. ``DOCKER_HOST`` when set and it answers as Podman (one that answers as Docker is skipped);
3. rootless: ``$XDG_RUNTIME_DIR/podman/podman.sock`` (without ``XDG_RUNTIME_DIR``: Podman's own fallback,
   ``/run/user/<uid>`` when it exists, else ``$TMPDIR/podman-run-<uid>``); as root this comes second;
4. rootful: ``/run/podman/podman.sock``.

When none answers, ``podman system service --time=0 unix://<socket>`` is started in the background (its
log in ``$TMPDIR/crl-bench-podman-<uid>.log``; it keeps running for later runs, as ``install.sh`` leaves
``dockerd`` running) at ``CONTAINER_HOST``'s socket when that is a ``unix://`` address, else at the first
default one (rootless as a user, rootful as root), and waited for (:data:`SERVICE_WAIT_S`). A second
process doing the same at the same moment waits on a lock file beside the socket instead of starting a
second service. Where no containers.conf of the machine or user sets anything, that service gets one
that shortens ``exit_command_delay`` to :data:`EXEC_SESSION_KEEP_S` (Podman keeps every API exec
session, and a ``conmon`` process, 300 s by default).

What Podman is told differently from Docker: explicit ``nofile``/``nproc`` limits
(:func:`container_ulimits`); image names compared without Podman's ``localhost/``/``docker.io/``
prefixes (:func:`normalize_image_name`) and pulled fully qualified (:func:`qualify_for_pull`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import resource
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from crl_bench.env_api import EnvUnavailableError

log = logging.getLogger(__name__)

#: The container engines the SWE-bench env can use (its ``engine`` setting).
ENGINES = ("docker", "podman")
#: Environment variable giving the engine when the caller names none (``crl-bench swe base-image``, tests).
ENGINE_ENV = "CRL_BENCH_SWE_ENGINE"
#: Seconds to wait for a ``podman system service`` this module started to answer.
SERVICE_WAIT_S = 60.0
#: What installs Podman (named in the errors).
PODMAN_INSTALL = ("apt-get install podman catatonit (Debian/Ubuntu; catatonit is the init process the "
                  "sandbox asks for), dnf install podman (Fedora/RHEL)")
ROOTFUL_SOCKET = "/run/podman/podman.sock"
#: Podman's default for ``nofile``/``nproc`` in a rootful container (``define.RLimitDefaultValue``).
PODMAN_RLIMIT_DEFAULT = 1 << 20
#: ``exit_command_delay`` (seconds) of a service this module starts: how long an exec session (and its
#: ``conmon`` process) outlives its command. Podman's default, 300, mimics Docker's exec cleanup; with two
#: or three execs per agent command that is hundreds of idle ``conmon`` processes per running env.
EXEC_SESSION_KEEP_S = 30


class DockerUnavailableError(EnvUnavailableError):
    """No container engine can be reached through the Engine API (Docker's daemon, or Podman's service
    for :class:`PodmanUnavailableError`)."""


class PodmanUnavailableError(DockerUnavailableError):
    """``engine: podman``, and no Podman API answers nor can one be started; the message names the
    setting, every socket tried and how to install Podman."""


def resolve_engine(engine: str | None = None) -> str:
    """The engine to use: ``engine`` when given, else ``$CRL_BENCH_SWE_ENGINE``, else ``"docker"``.

    Raises:
        ValueError: not one of :data:`ENGINES`.
    """
    name = (engine if engine is not None else os.environ.get(ENGINE_ENV) or "docker").strip().lower()
    if name not in ENGINES:
        raise ValueError(f"swebench: engine must be one of {', '.join(ENGINES)}, got {engine!r}"
                         + ("" if engine is not None else f" (from ${ENGINE_ENV})"))
    return name


def _rootless_runtime_dir(environ, uid: int) -> str:
    """Where rootless Podman keeps its runtime files: ``XDG_RUNTIME_DIR``, else ``/run/user/<uid>`` when
    it is this user's directory, else ``$TMPDIR/podman-run-<uid>`` (Podman's own fallback)."""
    xdg = environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return xdg
    run_user = Path(f"/run/user/{uid}")
    with contextlib.suppress(OSError):
        if run_user.is_dir() and run_user.stat().st_uid == uid:
            return str(run_user)
    return os.path.join(tempfile.gettempdir(), f"podman-run-{uid}")


def podman_socket_candidates(environ=None, uid: int | None = None) -> list[tuple[str, str]]:
    """Podman API addresses to try, in order, each with where it came from: ``[(url, origin)]``.

    ``url`` is what the SDK takes (``unix:///path``, ``tcp://host:port``, ``ssh://...``); ``origin`` is
    ``"CONTAINER_HOST"``, ``"DOCKER_HOST"``, ``"rootless"`` or ``"rootful"``. ``environ`` defaults to
    ``os.environ`` and ``uid`` to the effective UID (root puts the rootful socket first).
    """
    environ = os.environ if environ is None else environ
    uid = os.geteuid() if uid is None else uid
    out: list[tuple[str, str]] = []
    for var in ("CONTAINER_HOST", "DOCKER_HOST"):
        if environ.get(var):
            out.append((environ[var], var))
    rootless = ("unix://" + os.path.join(_rootless_runtime_dir(environ, uid), "podman", "podman.sock"), "rootless")
    rootful = ("unix://" + ROOTFUL_SOCKET, "rootful")
    out += [rootful, rootless] if uid == 0 else [rootless, rootful]
    seen: set[str] = set()
    return [(u, o) for u, o in out if not (u in seen or seen.add(u))]


def _unix_path(url: str) -> str | None:
    if url.startswith("unix://"):
        return url[len("unix://"):]
    return url if url.startswith("/") else None


def engine_of(client) -> str:
    """``"podman"`` when ``client`` talks to Podman's service, else ``"docker"`` (asked once per client:
    the ``/version`` answer's component names). Unknown clients (no ``version()``) count as Docker."""
    name = getattr(client, "_crl_engine", None)
    if name is None:
        try:
            components = client.version().get("Components") or []
            name = "podman" if any("podman" in str(c.get("Name", "")).lower() for c in components) else "docker"
        except Exception:  # noqa: BLE001 - a stub or a failing daemon: treat as Docker
            name = "docker"
        with contextlib.suppress(Exception):
            client._crl_engine = name
    return name


def _connect(url: str, timeout: int):
    """A pinged SDK client for ``url``, or the exception that prevented it."""
    import docker

    path = _unix_path(url)
    if path is not None and not os.path.exists(path):
        return FileNotFoundError(f"no socket at {path}")
    try:
        client = docker.DockerClient(base_url=url if path is None else f"unix://{path}", version="auto",
                                     timeout=timeout)
        client.ping()
        return client
    except Exception as e:  # noqa: BLE001 - anything here means "nothing answers there"
        return e


_start_lock = threading.Lock()
_services: dict[str, subprocess.Popen] = {}     # socket path -> a service this process started


def start_podman_service(url: str, wait_s: float = SERVICE_WAIT_S, timeout: int = 120):
    """Start ``podman system service --time=0 <url>`` in the background and return a pinged client of it.

    The service runs in a session of its own (it outlives this process, as ``dockerd`` does) with its
    output in ``$TMPDIR/crl-bench-podman-<uid>.log``, from ``/``: conmon starts in the service's working
    folder, and once that folder is deleted (a checkout, a test's temporary folder) every container
    start fails with "write child: broken pipe". A lock file beside the socket (``<socket>.lock``)
    makes concurrent callers start one service: a caller that finds one answering once it holds the lock
    uses it.

    Args:
        url: ``unix:///path/podman.sock`` (parent folders are created, mode 0700).
        wait_s: seconds to wait for it to answer. timeout: the returned client's API timeout (s).

    Raises:
        PodmanUnavailableError: ``podman`` is not installed, the address is not a unix socket, the
            service exited, or it did not answer within ``wait_s``; the message carries its log's tail.
    """
    path = _unix_path(url)
    if path is None:
        raise PodmanUnavailableError(f"engine: podman: cannot start a Podman service at {url} (only a unix:// "
                                     f"socket can be started here)")
    exe = shutil.which("podman")
    if exe is None:
        raise PodmanUnavailableError(
            f"engine: podman: no Podman API answers at {url} and the `podman` command is not installed: "
            f"install it ({PODMAN_INSTALL}) or point CONTAINER_HOST at a running Podman API socket")
    logfile = os.path.join(tempfile.gettempdir(), f"crl-bench-podman-{os.geteuid()}.log")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = open(path + ".lock", "a+")        # held (flock) for the whole start
    except OSError as e:
        raise PodmanUnavailableError(f"engine: podman: cannot start a Podman service at {url}: {e}") from None
    with _start_lock, lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        got = _connect(url, timeout)
        if not isinstance(got, Exception):
            return got
        env = {k: v for k, v in os.environ.items() if k not in ("CONTAINER_HOST", "CONTAINER_CONNECTION")}
        conf = _short_exec_sessions_conf()
        if conf:
            env["CONTAINERS_CONF"] = conf
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)                     # a stale socket of a dead service
        log_from = os.path.getsize(logfile) if os.path.exists(logfile) else 0
        with open(logfile, "ab") as out:
            proc = subprocess.Popen([exe, "system", "service", "--time=0", f"unix://{path}"], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True, cwd="/")
        _services[path] = proc
        log.info("started `podman system service` (pid %d) at unix://%s, log %s", proc.pid, path, logfile)
        deadline = time.monotonic() + wait_s
        while True:
            got = _connect(url, timeout)
            if not isinstance(got, Exception):
                return got
            code = proc.poll()
            if code is not None or time.monotonic() > deadline:
                tail = ""
                with contextlib.suppress(OSError), open(logfile, "rb") as f:
                    f.seek(log_from)
                    tail = f.read().decode("utf-8", "replace")[-1500:].strip()
                why = (f"exited with status {code}" if code is not None
                       else f"did not answer within {wait_s:g} s (still running: pid {proc.pid})")
                raise PodmanUnavailableError(
                    f"engine: podman: no Podman API answered, and `podman system service --time=0 unix://{path}` "
                    f"{why}. Its log ({logfile}):\n{tail or '(empty)'}")
            time.sleep(0.25)


SHIPPED_CONF = Path("/usr/share/containers/containers.conf")


def _admin_containers_confs() -> list[Path]:
    """containers.conf files of the machine's administrator or of this user (``/etc/containers``,
    ``$XDG_CONFIG_HOME/containers``, with their ``.d`` folders) that exist."""
    home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    found = []
    for base in ("/etc/containers", os.path.join(home, "containers")):
        for f in [Path(base, "containers.conf"), *sorted(Path(base, "containers.conf.d").glob("*.conf"))]:
            if f.is_file():
                found.append(f)
    return found


def _short_exec_sessions_conf() -> str | None:
    """A containers.conf for a service started here: the distribution's own
    (``/usr/share/containers/containers.conf``) with ``exit_command_delay = EXEC_SESSION_KEEP_S`` added
    to its ``[engine]`` table. ``None`` (Podman's configuration stands untouched) when ``CONTAINERS_CONF``
    is set, when an administrator's or the user's containers.conf exists, or when the distribution's file
    sets ``exit_command_delay`` itself: ``CONTAINERS_CONF`` replaces every other file."""
    if os.environ.get("CONTAINERS_CONF") or _admin_containers_confs():
        return None
    try:
        lines = SHIPPED_CONF.read_text(errors="replace").splitlines() if SHIPPED_CONF.is_file() else []
    except OSError:
        return None
    if any(line.strip().startswith("exit_command_delay") for line in lines):
        return None
    setting = f"exit_command_delay = {EXEC_SESSION_KEEP_S}"
    at = next((i for i, line in enumerate(lines) if line.strip() == "[engine]"), None)
    if at is None:
        lines += ["", "[engine]", setting]
    else:
        lines.insert(at + 1, setting)
    path = os.path.join(tempfile.gettempdir(), f"crl-bench-containers-{os.geteuid()}.conf")
    try:
        with open(path, "w") as f:
            f.write(f"# {SHIPPED_CONF} with {setting}, written by crl-bench for the Podman service it starts\n")
            f.write("\n".join(lines) + "\n")
    except OSError:
        return None
    return path


def podman_client(timeout: int = 120):
    """A pinged SDK client of a Podman API service (found or started as the module docstring says).

    Raises:
        PodmanUnavailableError: nothing answers as Podman and no service can be started; the message
            lists each socket tried with its answer, and how to install Podman.
    """
    tried: list[str] = []
    explicit = None
    for url, origin in podman_socket_candidates():
        got = _connect(url, timeout)
        if isinstance(got, Exception):
            tried.append(f"{url} ({origin}): {type(got).__name__}: {str(got)[:200]}")
            if origin == "CONTAINER_HOST":
                explicit = url
                break                          # an explicit address is the one to use (or start)
            continue
        if engine_of(got) != "podman":
            tried.append(f"{url} ({origin}): answers as Docker, not Podman")
            got.close()
            if origin == "CONTAINER_HOST":
                raise PodmanUnavailableError(
                    f"engine: podman, but CONTAINER_HOST={url} answers as Docker's daemon: point it at a "
                    f"Podman socket, or unset it, or use engine: docker")
            continue
        got._crl_engine = "podman"
        return got
    start_at = explicit or next(u for u, o in podman_socket_candidates() if o in ("rootless", "rootful"))
    try:
        client = start_podman_service(start_at, timeout=timeout)
    except PodmanUnavailableError as e:
        raise PodmanUnavailableError(f"{e}\nSockets tried: " + "; ".join(tried)) from None
    client._crl_engine = "podman"
    return client


def docker_client(timeout: int = 120, engine: str | None = None):
    """A ``docker.DockerClient`` (API version negotiated) for the engine ``engine`` (default
    :func:`resolve_engine`): Docker's daemon at ``DOCKER_HOST`` (default the local socket), or Podman's
    service (:func:`podman_client`).

    Args:
        timeout: seconds per API call. engine: ``"docker"`` or ``"podman"``.

    Raises:
        DockerUnavailableError: the ``docker`` package is missing or Docker's daemon does not answer;
            PodmanUnavailableError (a subclass) for Podman. Both messages say how to fix it.
        ValueError: an unknown engine.
    """
    name = resolve_engine(engine)
    try:
        import docker
    except ImportError:
        raise DockerUnavailableError(
            "the SWE-bench env needs the Docker SDK (for Docker and Podman alike): install the [swe] extra "
            "(pip install 'crl-bench[swe]')") from None
    if name == "podman":
        return podman_client(timeout)
    try:
        client = docker.from_env(version="auto", timeout=timeout)
        client.ping()
        return client
    except Exception as e:  # noqa: BLE001 - any failure here means "no daemon"
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        raise DockerUnavailableError(
            f"no Docker daemon reachable at {where} ({type(e).__name__}: {e}). The SWE-bench env runs "
            f"every episode in a container: start Docker (e.g. `sudo systemctl start docker`, or "
            f"`dockerd &` as root) or set DOCKER_HOST; without root or a Docker daemon use rootless Podman "
            f"(setting engine: podman).") from None


def _service_pid(client) -> int | None:
    """PID of the process serving ``client``'s unix socket (``SO_PEERCRED``), if it can be found."""
    try:
        path = getattr(client.api.get_adapter(client.api.base_url), "socket_path", None)
    except Exception:  # noqa: BLE001 - not a unix-socket client
        path = None
    if not path:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return pid or None
    except OSError:
        return None


def _hard_limits(pid: int | None) -> dict[str, int]:
    """Hard ``nofile``/``nproc`` of ``pid`` (from ``/proc/<pid>/limits``), else of this process;
    "unlimited" reads as :data:`PODMAN_RLIMIT_DEFAULT`."""
    rows = {"Max open files": "nofile", "Max processes": "nproc"}
    got: dict[str, int] = {}
    if pid:
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
                for label, key in rows.items():
                    if line.startswith(label):
                        hard = line[len(label):].split()[1]
                        got[key] = PODMAN_RLIMIT_DEFAULT if hard == "unlimited" else int(hard)
    own = {"nofile": resource.RLIMIT_NOFILE, "nproc": resource.RLIMIT_NPROC}
    for key, res in own.items():
        if key not in got:
            hard = resource.getrlimit(res)[1]
            got[key] = PODMAN_RLIMIT_DEFAULT if hard == resource.RLIM_INFINITY else int(hard)
    return got


def container_ulimits(client) -> list:
    """The ``ulimits`` a sandbox container is created with: none for Docker (its containers inherit the
    daemon's limits); for Podman ``nofile`` and ``nproc`` set explicitly (soft = hard) to the lower of
    Podman's default (2**20) and the serving process's hard limits (read through ``SO_PEERCRED`` and
    ``/proc/<pid>/limits``; this process's own when that cannot be read).

    Why: rootful Podman gives every container ``nofile`` and ``nproc`` of 2**20, and raising a hard limit
    needs ``CAP_SYS_RESOURCE``; where root lacks it (a VM or a container such as this project's CI) every
    start fails with ``runc create failed: ... error setting rlimit type 7 (6): operation not permitted``.
    Agent commands still lower ``nproc`` per command (``ulimit -u``), as with Docker.
    """
    if engine_of(client) != "podman":
        return []
    cached = getattr(client, "_crl_ulimits", None)
    if cached is None:
        from docker.types import Ulimit

        hard = _hard_limits(_service_pid(client))
        cached = [Ulimit(name=k, soft=min(v, PODMAN_RLIMIT_DEFAULT), hard=min(v, PODMAN_RLIMIT_DEFAULT))
                  for k, v in sorted(hard.items())]
        with contextlib.suppress(Exception):
            client._crl_ulimits = cached
    return cached


def normalize_image_name(name: str) -> str:
    """``name`` without the registry prefix Podman adds to local names (``localhost/``, ``docker.io/``,
    ``docker.io/library/``), so ``localhost/crl-bench/swe-base:bookworm`` reads as Docker writes it."""
    for prefix in ("docker.io/library/", "docker.io/", "localhost/"):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def qualify_for_pull(image: str) -> str:
    """A fully qualified reference for Podman's pull (``docker.io/`` before a Docker-Hub short name): a
    Podman without ``unqualified-search-registries`` (Debian's default) refuses short names."""
    first = image.split("/", 1)[0]
    if "/" in image and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"docker.io/{image}" if "/" in image else f"docker.io/library/{image}"


__all__ = ["ENGINES", "ENGINE_ENV", "DockerUnavailableError", "PodmanUnavailableError", "container_ulimits",
           "docker_client", "engine_of", "normalize_image_name", "podman_client", "podman_socket_candidates",
           "qualify_for_pull", "resolve_engine", "start_podman_service"]
