"""``python -m crl_bench.bench NAME [options]``: the same as ``crl-bench bench NAME [options]``."""

from __future__ import annotations

import sys

from crl_bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
