"""Entry point of an ALFWorld worker process: ``python -m crl_bench.envs.alfworld.worker --worker``
(started by :class:`~crl_bench.envs.alfworld.env.AlfWorldEnv`; the protocol is in
:func:`~crl_bench.envs.alfworld.env._worker_main`)."""

import argparse

from crl_bench.envs.alfworld.env import _worker_main

if __name__ == "__main__":
    p = argparse.ArgumentParser(description="ALFWorld worker process (started by AlfWorldEnv)")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--memory-mb", type=int, default=1024)
    _worker_main(p.parse_args().memory_mb)
