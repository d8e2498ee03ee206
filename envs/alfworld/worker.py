"""Entry point of the ALFWorld launcher process: ``python -m crl_bench.envs.alfworld.worker --launcher
--control-fd N`` (started by :class:`~crl_bench.envs.alfworld.process.Worker`; it forks the workers,
see :mod:`crl_bench.envs.alfworld.process`)."""

import argparse

from crl_bench.envs.alfworld.process import launcher_main

if __name__ == "__main__":
    p = argparse.ArgumentParser(description="ALFWorld launcher process (forks AlfWorldEnv's workers)")
    p.add_argument("--launcher", action="store_true", required=True)
    p.add_argument("--control-fd", type=int, required=True)
    launcher_main(p.parse_args().control_fd)
