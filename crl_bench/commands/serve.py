"""``crl-bench serve ENV``: serve one env to other trainers over OpenEnv's protocol (crl_bench/serve.py,
docs/serving.md)."""

from __future__ import annotations

import argparse

from crl_bench.commands.options import add_config_args, episodes, resolve_config

__all__ = ["HELP", "add_parser", "run"]

HELP = "serve an env over OpenEnv's protocol to other trainers (docs/serving.md)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``serve`` with its options to the ``crl-bench`` subcommands; returns its parser."""
    s = subparsers.add_parser("serve", help=HELP,
                              description="Serve ENV over OpenEnv's WebSocket/HTTP protocol: each session has its "
                                          "own env; reset takes task, split, seed, max_steps, episode_id; an "
                                          "action is {\"reply\": TEXT}. The env's settings come from the config "
                                          "options, as for `crl-bench panel export`.")
    s.add_argument("env", help="env id (crl-bench envs list)")
    add_config_args(s, with_method=False)
    s.add_argument("--split", default="train",
                   help="split of a reset that names none (default train); a split other than train has its "
                        "task panel built at start, and the state of its episodes carries the panel hash")
    s.add_argument("--episodes", type=episodes,
                   help="tasks on the served split's panel, as eval.episodes (default: the config's)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    s.add_argument("--max-sessions", type=int, default=8,
                   help="concurrent sessions, each with its own env instance (default 8)")
    s.add_argument("--session-timeout", type=float,
                   help="close a session idle for this many seconds (default: never)")
    return s


def run(args: argparse.Namespace) -> int:
    """Build the env with the config's settings, the served split's panel, and serve until interrupted;
    prints one line ``serving ENV ... at http://HOST:PORT`` once the port is bound. Returns 0.

    Raises:
        EnvUnavailableError: openenv-core (the ``serve`` extra) is not installed.
        ConfigError: a bad option; KeyError: an unknown env or split.
    """
    import importlib.util
    import socket

    from crl_bench.config import ConfigError
    from crl_bench.env_api import EnvUnavailableError

    if importlib.util.find_spec("openenv") is None:
        raise EnvUnavailableError("crl-bench serve needs the [serve] extra (missing module 'openenv', from "
                                  "openenv-core): CRL_EXTRAS=serve bash install.sh, or pip install "
                                  "'crl-bench[serve]'")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: expected 0..65535")
    if args.max_sessions < 1:
        raise ConfigError(f"--max-sessions {args.max_sessions}: expected at least 1")
    if args.session_timeout is not None and args.session_timeout <= 0:
        raise ConfigError(f"--session-timeout {args.session_timeout}: expected a positive number of seconds")

    import uvicorn

    from crl_bench.results.panel import build_panel, panel_task_ids
    from crl_bench.rollout import EnvPool
    from crl_bench.serve import ServedEnv, make_app

    extra = {"eval.episodes": args.episodes} if args.episodes is not None else {}
    cfg = resolve_config(args, extra)
    pool = EnvPool({args.env: dict(cfg.rollout.env_kwargs.get(args.env, {}))}, cfg.rollout.max_steps)
    env = pool.make(args.env)
    try:
        env.task_ids(args.split)                 # KeyError naming the known splits
        panel = None
        if args.split != "train":
            ids = panel_task_ids(env, args.split, cfg.eval.episodes)
            panel = build_panel(env, args.env, args.split, ids, episodes=cfg.eval.episodes,
                                env_settings=pool.env_kwargs[args.env])
    finally:
        env.close()
    served = ServedEnv(args.env, lambda: pool.make(args.env), args.split, panel)
    app = make_app(served, max_sessions=args.max_sessions, session_timeout=args.session_timeout)

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    sock.listen(2048)             # connections wait in the backlog until the server accepts them
    port = sock.getsockname()[1]
    shown = (f"panel {panel['panel_hash']} ({len(panel['tasks'])} tasks)" if panel
             else "no panel (a training split)")
    host = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    print(f"serving {args.env} split {args.split}, {shown}, at most {args.max_sessions} sessions, "
          f"at http://{host}:{port} (WebSocket ws://{host}:{port}/ws)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:            # uvicorn shuts down gracefully on Ctrl-C, then re-raises it
        print(f"stopped serving {args.env}", flush=True)
    finally:
        sock.close()
    return 0
