"""Retrieval speed of the experience bank: batched vs single-query search, latency percentiles.

For each bank size and each index kind (flat / ivf / hnsw), side by side in one run:

* a bank is filled with random unit vectors (``dim``-dimensional, Gaussian then L2-normalised)
  through the bank's internal bulk path :meth:`ExperienceBank._bulk_add_vectors` (one SQLite
  transaction, one FAISS add; it skips the embedder, which is not what is measured here);
* queries are bank vectors plus Gaussian noise (cosine ~0.9 to their source), renormalised;
* (a) one batched ``bank.search_vectors`` call with all ``queries`` vs ``queries`` calls with one
  query each (median over ``repeats``): ``batch_speedup`` = single total / batched;
* (b) p50 / p99 latency of single-query ``bank.search_vectors`` over ``latency_samples`` calls.

What is timed is the path the trainer uses (``ExperienceBank.search_vectors``: shard lookup, FAISS
call, HNSW tombstone filter, id mapping, conversion to Python lists); the same measurements on the
raw FAISS index (``index.search`` only) are reported as ``raw_*`` for reference. ``recall@1`` and
``recall@k`` compare each index with exact search. Timings depend on the machine's load: compare
rows of the same run only.

What to expect (2-core machine, one search thread): batching helps exact (flat) search, which
switches to BLAS for >= 8 queries (~3x at 1k-10k, ~6x at 100k); IVF and HNSW do the same work per
query batched or not (~1.1-1.4x). Single-query p99 at 100k: ivf/hnsw well under 5 ms, flat not.

Run: ``python -m crl_bench.bench_retrieval [--sizes 1000 10000 100000] [--index flat ivf hnsw]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from crl_bench.experience.bank import ExperienceBank, _omp_threads


class _VectorsOnly:
    """Stand-in embedder with a dimension only (the benchmark inserts and searches vectors)."""

    def __init__(self, dim: int):
        self.dim = dim

    def encode(self, texts):  # pragma: no cover - never called by the benchmark
        raise RuntimeError("the retrieval benchmark searches vectors directly")


def _unit(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x / np.linalg.norm(x, axis=1, keepdims=True), dtype=np.float32)


def _raw_index(bank: ExperienceBank, env_id: str):
    shard = bank._shards[env_id]
    if hasattr(shard, "ivf"):
        return shard.ivf if shard.ivf is not None else shard.flat
    return shard.index


def _time_batched_vs_single(search, q: np.ndarray, repeats: int) -> tuple[float, float]:
    batched, single = [], []
    rows = [q[i:i + 1] for i in range(len(q))]
    for _ in range(repeats):
        t = time.perf_counter()
        search(q)
        batched.append(time.perf_counter() - t)
        t = time.perf_counter()
        for r in rows:
            search(r)
        single.append(time.perf_counter() - t)
    return float(np.median(batched)), float(np.median(single))


def _latencies(search, q: np.ndarray, samples: int) -> np.ndarray:
    out = np.empty(samples)
    for j in range(samples):
        r = q[j % len(q):j % len(q) + 1]
        t = time.perf_counter()
        search(r)
        out[j] = time.perf_counter() - t
    return out


def bench_retrieval(sizes: Sequence[int] = (1000, 10000, 100000), queries: int = 64, k: int = 10,
                    dim: int = 384, index: str | Sequence[str] = ("flat", "ivf", "hnsw"), *,
                    repeats: int = 5, latency_samples: int = 512, seed: int = 0, workdir: str | None = None,
                    bank_kwargs: dict | None = None) -> list[dict[str, Any]]:
    """Measure batched vs single-query search and single-query latency; one row per (size, index).

    Returns rows with ``index, size, build_s, batched_ms, single_total_ms, batch_speedup, p50_ms,
    p99_ms, raw_batched_ms, raw_single_total_ms, raw_batch_speedup, raw_p50_ms, raw_p99_ms,
    recall@1, recall@k``, plus ``queries, k, dim, search_threads``.
    """
    import faiss

    kinds = [index] if isinstance(index, str) else list(index)
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    tmp = tempfile.TemporaryDirectory(dir=workdir)
    try:
        for size in sizes:
            vecs = _unit(rng.standard_normal((size, dim), dtype=np.float32))
            src = rng.integers(0, size, queries)
            q = _unit(vecs[src] + rng.standard_normal((queries, dim), dtype=np.float32) * (0.5 / np.sqrt(dim)))
            exact = faiss.IndexFlatIP(dim)
            exact.add(vecs)
            _, gt = exact.search(q, k)                  # positions; bank ids are positions + 1
            del exact
            for kind in kinds:
                path = Path(tmp.name) / f"bank-{kind}-{size}.db"
                bank = ExperienceBank(path, _VectorsOnly(dim), index=kind, **(bank_kwargs or {}))
                t = time.perf_counter()
                ids = bank._bulk_add_vectors("bench", vecs)
                build_s = time.perf_counter() - t
                id_arr = np.asarray(ids, dtype=np.int64)

                def search(x, _b=bank):
                    return _b.search_vectors(x, k, "bench")

                raw = _raw_index(bank, "bench")
                if kind == "hnsw":
                    params = faiss.SearchParametersHNSW()
                    params.efSearch = max(bank._shards["bench"].ef_search, k)

                    def raw_search(x, _i=raw, _p=params, _t=bank.search_threads):
                        with _omp_threads(_t):          # same OpenMP threads as the bank path
                            return _i.search(x, k, params=_p)
                else:
                    def raw_search(x, _i=raw, _t=bank.search_threads):
                        with _omp_threads(_t):
                            return _i.search(x, k)

                for _ in range(3):                      # warm-up
                    search(q)
                    raw_search(q)
                res = search(q)
                got = [[i for i, _ in r] for r in res]
                gt_ids = id_arr[gt]
                r1 = float(np.mean([bool(g) and g[0] == t[0] for g, t in zip(got, gt_ids)]))
                rk = float(np.mean([len(set(g) & set(t.tolist())) / k for g, t in zip(got, gt_ids)]))
                b, s = _time_batched_vs_single(search, q, repeats)
                rb, rs = _time_batched_vs_single(raw_search, q, repeats)
                lat = _latencies(search, q, latency_samples)
                rlat = _latencies(raw_search, q, latency_samples)
                rows.append({
                    "index": kind, "size": size, "queries": queries, "k": k, "dim": dim,
                    "build_s": build_s,
                    "batched_ms": b * 1e3, "single_total_ms": s * 1e3, "batch_speedup": s / b,
                    "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
                    "raw_batched_ms": rb * 1e3, "raw_single_total_ms": rs * 1e3, "raw_batch_speedup": rs / rb,
                    "raw_p50_ms": float(np.percentile(rlat, 50) * 1e3),
                    "raw_p99_ms": float(np.percentile(rlat, 99) * 1e3),
                    "recall@1": r1, "recall@k": rk, "search_threads": bank.search_threads,
                })
                bank.close()
                del bank, raw
                for suffix in ("", "-wal", "-shm"):
                    Path(str(path) + suffix).unlink(missing_ok=True)
    finally:
        tmp.cleanup()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: bank path first, raw FAISS for reference."""
    head = ("| index | size | batched 64q ms | 64 x single ms | speedup | p50 ms | p99 ms | "
            "raw batched ms | raw speedup | raw p50 ms | raw p99 ms | recall@1 | recall@k | build s |")
    sep = "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r['index']} | {r['size']} | {r['batched_ms']:.2f} | {r['single_total_ms']:.2f} | "
            f"{r['batch_speedup']:.1f}x | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['raw_batched_ms']:.2f} | "
            f"{r['raw_batch_speedup']:.1f}x | {r['raw_p50_ms']:.3f} | {r['raw_p99_ms']:.3f} | "
            f"{r['recall@1']:.2f} | {r['recall@k']:.2f} | {r['build_s']:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--index", nargs="+", default=["flat", "ivf", "hnsw"], choices=["flat", "ivf", "hnsw"])
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--latency-samples", type=int, default=512)
    p.add_argument("--search-threads", type=int, default=1,
                   help="OpenMP threads per search (the bank's search_threads; 0 = FAISS default)")
    a = p.parse_args(argv)
    rows = bench_retrieval(a.sizes, a.queries, a.k, a.dim, a.index, repeats=a.repeats,
                           latency_samples=a.latency_samples, bank_kwargs={"search_threads": a.search_threads})
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
