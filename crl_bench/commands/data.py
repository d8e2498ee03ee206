"""``crl-bench data list|download``: the data sets of the ``crl_bench.datasets`` entry points, fetched
from their public sources (or a local copy) into the data dir and verified (crl_bench/data.py)."""

from __future__ import annotations

import argparse
import sys

from crl_bench.config import ConfigError
from crl_bench.data import dataset_names

__all__ = ["HELP", "add_parser", "run"]

HELP = "download benchmark data into the data dir ($CRL_BENCH_DATA)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``data`` and its ``list`` and ``download`` subcommands to the ``crl-bench`` subcommands;
    returns the ``data`` parser."""
    d = subparsers.add_parser("data", help=HELP)
    ds = d.add_subparsers(dest="data_cmd", required=True)
    ds.add_parser("list", help="the data sets that `data download` knows (entry points of crl_bench.datasets)")
    dl = ds.add_parser("download", help="fetch a data set from its original public source and verify it")
    dl.add_argument("dataset", nargs="+", choices=dataset_names(), help="one or more data sets, in order")
    dl.add_argument("--data-dir", help="data root (default: $CRL_BENCH_DATA or ~/.cache/crl-bench/data)")
    dl.add_argument("--source", help="a local copy of one data set to use instead of the public sources "
                                     "(alfworld: an archive of the games; swebench: the parquet file; webshop: "
                                     "a folder or base URL holding its three JSON files)")
    dl.add_argument("--no-verify", action="store_true",
                    help="skip the checksum checks (only for a trusted mirror whose files differ)")
    return d


def run(args: argparse.Namespace) -> int:
    """List the data sets, or download and verify each of ``args.dataset``; returns 0, or 2 when a
    source cannot be reached or a fetched file is not what the data set holds (one line each)."""
    import urllib.error

    from crl_bench.data import data_dir, downloader
    from crl_bench.safe_io import printable

    if args.data_cmd == "list":
        for name in dataset_names():
            print(name)
        return 0
    if args.source and len(args.dataset) > 1:
        raise ConfigError("--source names the copy of one data set; download one data set at a time with it")
    root = data_dir(args.data_dir)
    for name in dict.fromkeys(args.dataset):
        try:
            out = downloader(name)(root, source=args.source, verify=not args.no_verify)
        except urllib.error.URLError as e:
            print(f"crl-bench: error: {name}: a source cannot be reached ({printable(str(e.reason))}); check the "
                  f"network, or give a local copy with --source", file=sys.stderr)
            return 2
        except ValueError as e:                  # a fetched file that is not what the data set holds
            print(f"crl-bench: error: {name}: {printable(str(e))}", file=sys.stderr)
            return 2
        print(f"{name}: ready in {out} (use it with CRL_BENCH_DATA={root})")
    return 0
