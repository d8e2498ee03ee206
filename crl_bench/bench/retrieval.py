"""Retrieval speed and recall of the experience bank, per index kind, bank size and data shape.

For each data shape, bank size and index kind (``flat`` / ``ivf`` / ``hnsw``; ``auto``, the bank's
default, is one of flat / hnsw by shard size, so it is benchmarked only when asked for and a summary
line says which one it uses at each size), side by side in one run:

* a bank is filled through the bank's bulk path :meth:`ExperienceBank.add_vectors` (one SQLite
  transaction, one FAISS add; it skips the embedder, which is not what is measured);
* ``recall@1`` / ``recall@k``: each query's top-``k`` ids against exact search (``IndexFlatIP``)
  over ``recall_queries`` queries;
* (a) one batched ``bank.search_vectors`` call with ``queries`` queries vs ``queries`` calls with
  one query each (median over ``repeats``): ``batch_speedup`` = single total / batched;
* (b) p50 / p99 latency of single-query ``bank.search_vectors`` over ``latency_samples`` calls.

What is timed is the path the trainer uses (``ExperienceBank.search_vectors``: shard lookup, FAISS
call with the shard's search parameters, HNSW tombstone filter, id mapping, conversion to Python
lists); the raw FAISS call (``index.search`` with the same parameters) is reported as ``raw_*``.
``k`` defaults to 16: the retriever asks for ``experience.k * experience.oversample`` = 1 x 16
candidates, which the diversity re-rank then reorders, so recall@16 is the quality that matters.

Data (``--data``)
    ``sentence`` (the representative rows): synthetic vectors shaped like sentence embeddings
    (:class:`SentenceLike`). Queries are *new* draws from the same distribution (a text that is not
    in the bank), the hard case; a query repeating a stored key (same task again) is easier.
    ``gaussian`` (the worst case, kept for reference): i.i.d. Gaussian unit vectors, isotropic in
    all ``dim`` dimensions, no cluster structure, queries = bank vectors plus noise (cosine ~0.9 to
    their source). In 384 dimensions the 2nd..k-th neighbours of such a query are barely closer
    than any other vector, so an approximate index must look at most of the bank to find them: no
    setting of IVF or HNSW reaches recall@16 0.95 there in less time than exact search.
    ``--vectors FILE.npy``: real embeddings (rows, any scale; normalised here): the bank is the
    first ``size`` rows, the queries the last rows (held out).

Why synthetic and not real embeddings of project texts: the default embedder (all-MiniLM-L6-v2 on
CPU) is slow enough that 100k real embeddings would take most of an hour per run on a 2-core CPU,
and the envs' own retrieval queries are near-duplicates (MiniHack-Room's first observation is the
same for every task), on which recall by id is ill-defined (ties). :class:`SentenceLike` is
calibrated on real MiniLM embeddings of 120,000 distinct English sentences; it is a little *harder*
for both indexes than the real sentences, so the recall it shows is conservative. The calibration
table, the figures of the tuned defaults on real and synthetic data, and this benchmark's run time
are in docs/performance.md ("Retrieval benchmark data"). Timings depend on the load: compare rows of
the same run only.

Run: ``crl-bench bench retrieval [--sizes 1000 10000 100000] [--index flat ivf hnsw auto]
[--data sentence gaussian] [--vectors FILE.npy] [--k 16]`` (or ``python -m crl_bench.bench retrieval
...``). Most of the default run (2 data shapes x 3 sizes x 3 indexes) builds the 100k HNSW graphs
and trains the 100k IVF; ``--data sentence`` halves it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from crl_bench.bench.options import non_negative_int, positive_int
from crl_bench.experience.vector_index import AUTO_THRESHOLD, INDEX_KINDS, AutoShard, omp_threads

HELP = "batched vs single search, latency"

DATA_KINDS = ("sentence", "gaussian")
#: recall@k and p99 the approximate indexes must keep at 100k entries on representative data
TARGET_RECALL, TARGET_P99_MS, TARGET_SIZE = 0.95, 5.0, 100_000


class _VectorsOnly:
    """Stand-in embedder with a dimension only (the benchmark inserts and searches vectors)."""

    def __init__(self, dim: int):
        self.dim = dim

    def encode(self, texts):  # pragma: no cover - never called by the benchmark
        raise RuntimeError("the retrieval benchmark searches vectors directly")


def _unit(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x / np.linalg.norm(x, axis=1, keepdims=True), dtype=np.float32)


class SentenceLike:
    """Random unit vectors shaped like sentence embeddings (calibration: docs/performance.md).

    ``x = normalise(common * mu + c_t + spread * s * z)``, where ``mu`` is one fixed unit direction
    (the anisotropy every sentence-embedding model shows: all vectors lean one way); ``c_t`` is the
    centre of topic ``t``, one of ``topics`` topics drawn with Zipf(``zipf``) frequencies (some
    topics are common, most rare); centres and the within-topic offsets ``z`` are Gaussian with a
    power-law spectrum (variance of the i-th direction ~ ``i ** -alpha``, each in its own random
    orientation), so the variance lives in a few dozen directions as in real embeddings rather than
    in all ``dim``; ``s`` normalises the spectrum. ``spread`` sets how much topics overlap (1.7:
    neighbouring topics overlap, so an index cannot simply find "the" cluster).

    Every :meth:`draw` comes from the same distribution (same topics), so bank vectors and queries
    drawn from one instance are related as stored texts and new texts are.
    """

    def __init__(self, dim: int, rng: np.random.Generator, *, topics: int = 1000, alpha: float = 0.8,
                 common: float = 0.55, spread: float = 1.7, zipf: float = 0.5):
        self.dim, self.rng = dim, rng
        self.common, self.spread = common, spread
        self.lam = np.arange(1, dim + 1, dtype=np.float32) ** (-alpha / 2)
        self.scale = float(1.0 / np.sqrt((self.lam ** 2).sum()))
        self.mu = _unit(rng.standard_normal((1, dim)).astype(np.float32))[0]
        rot_c = np.linalg.qr(rng.standard_normal((dim, dim)))[0].astype(np.float32)
        self.rot = np.linalg.qr(rng.standard_normal((dim, dim)))[0].astype(np.float32)
        self.centres = self.scale * (rng.standard_normal((topics, dim), dtype=np.float32) * self.lam) @ rot_c
        w = np.arange(1, topics + 1, dtype=np.float64) ** (-zipf)
        self.weights = w / w.sum()

    def draw(self, n: int) -> np.ndarray:
        t = self.rng.choice(len(self.centres), n, p=self.weights)
        z = (self.rng.standard_normal((n, self.dim), dtype=np.float32) * self.lam) @ self.rot
        return _unit(self.common * self.mu + self.centres[t] + self.spread * self.scale * z)


def make_data(data: str, size: int, n_queries: int, dim: int, seed: int = 0,
              vectors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(bank vectors (size, dim), queries (n_queries, dim))``, unit float32 rows, deterministic in
    ``seed``; ``data`` is ``sentence``, ``gaussian`` or ``file`` (``vectors``: first ``size`` rows for
    the bank, last ``n_queries`` rows as queries)."""
    rng = np.random.default_rng([seed, size, DATA_KINDS.index(data) if data in DATA_KINDS else 9])
    if data == "sentence":
        gen = SentenceLike(dim, rng)
        return gen.draw(size), gen.draw(n_queries)
    if data == "gaussian":
        vecs = _unit(rng.standard_normal((size, dim), dtype=np.float32))
        src = rng.integers(0, size, n_queries)
        noise = rng.standard_normal((n_queries, dim), dtype=np.float32) * (0.5 / np.sqrt(dim))
        return vecs, _unit(vecs[src] + noise)
    if data == "file":
        if vectors is None or len(vectors) < size + n_queries:
            raise ValueError(f"--vectors needs at least size + queries = {size + n_queries} rows")
        v = np.asarray(vectors, dtype=np.float32)
        return _unit(v[:size]), _unit(v[len(v) - n_queries:])
    raise ValueError(f"unknown data {data!r}; use one of {DATA_KINDS} or file")


def _inner(shard):
    return shard.inner if isinstance(shard, AutoShard) else shard


def _raw_index(shard):
    s = _inner(shard)
    if hasattr(s, "ivf"):
        return s.ivf if s.ivf is not None else s.flat
    return s.index


def _search_setting(shard, k: int) -> str:
    s = _inner(shard)
    if hasattr(s, "ivf"):
        return f"nlist={s.ivf.nlist} nprobe={s.nprobe()}" if s.ivf is not None else "exact"
    if hasattr(s, "ef"):
        return f"M={s.m} efSearch={s.ef(k)}"
    return "exact"


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


def bench_retrieval(sizes: Sequence[int] = (1000, 10000, 100000), queries: int = 64, k: int = 16,
                    dim: int = 384, index: str | Sequence[str] = ("flat", "ivf", "hnsw"), *,
                    data: str | Sequence[str] = DATA_KINDS, vectors: np.ndarray | None = None,
                    recall_queries: int = 256, repeats: int = 5, latency_samples: int = 512, seed: int = 0,
                    workdir: str | None = None, bank_kwargs: dict | None = None) -> list[dict[str, Any]]:
    """Measure recall, single-query latency and batched vs single search; one row per
    (data, size, index).

    ``vectors`` (real embeddings) replaces ``data`` with ``"file"``. Returns rows with ``data, index,
    shard_index`` (what the shard searches with: ``auto`` resolves to ``flat`` or its approximate
    index), ``setting`` (nprobe / efSearch used), ``size, build_s, recall@1, recall@k, p50_ms,
    p99_ms, batched_ms, single_total_ms, batch_speedup, raw_batched_ms, raw_single_total_ms,
    raw_batch_speedup, raw_p50_ms, raw_p99_ms``, plus ``queries, recall_queries, k, dim,
    search_threads``.
    """
    import faiss

    from crl_bench.experience.bank import ExperienceBank

    kinds = [index] if isinstance(index, str) else list(index)
    for kind in kinds:
        if kind not in INDEX_KINDS:
            raise ValueError(f"unknown index {kind!r}; use {INDEX_KINDS}")
    datas = ["file"] if vectors is not None else ([data] if isinstance(data, str) else list(data))
    n_q = max(queries, recall_queries)
    rows: list[dict[str, Any]] = []
    tmp = tempfile.TemporaryDirectory(dir=workdir)
    try:
        for dname in datas:
            for size in sizes:
                vecs, q_all = make_data(dname, size, n_q, dim if vectors is None else vectors.shape[1], seed,
                                        vectors)
                d = vecs.shape[1]
                q = q_all[:queries]
                exact = faiss.IndexFlatIP(d)
                exact.add(vecs)
                kk = min(k, size)
                _, gt = exact.search(q_all, kk)            # positions; bank ids are positions + 1
                del exact
                for kind in kinds:
                    path = Path(tmp.name) / f"bank-{dname}-{kind}-{size}.db"
                    bank = ExperienceBank(path, _VectorsOnly(d), index=kind, **(bank_kwargs or {}))
                    t = time.perf_counter()
                    ids = bank.add_vectors("bench", vecs)
                    build_s = time.perf_counter() - t
                    id_arr = np.asarray(ids, dtype=np.int64)
                    shard = bank._shards["bench"]

                    def search(x, _b=bank):
                        return _b.search_vectors(x, k, "bench")

                    raw = _raw_index(shard)
                    params = _inner(shard).search_params(k)

                    def raw_search(x, _i=raw, _p=params, _t=bank.search_threads):
                        with omp_threads(_t):                # same OpenMP threads as the bank path
                            return _i.search(x, k, params=_p) if _p is not None else _i.search(x, k)

                    for _ in range(3):                          # warm-up
                        search(q)
                        raw_search(q)
                    res = search(q_all)
                    got = [[i for i, _ in r] for r in res]
                    gt_ids = id_arr[gt]
                    r1 = float(np.mean([bool(g) and g[0] == t[0] for g, t in zip(got, gt_ids)]))
                    rk = float(np.mean([len(set(g[:kk]) & set(t.tolist())) / kk for g, t in zip(got, gt_ids)]))
                    b, s = _time_batched_vs_single(search, q, repeats)
                    rb, rs = _time_batched_vs_single(raw_search, q, repeats)
                    lat = _latencies(search, q_all, latency_samples)
                    rlat = _latencies(raw_search, q_all, latency_samples)
                    rows.append({
                        "data": dname, "index": kind, "shard_index": bank.shard_kinds()["bench"],
                        "setting": _search_setting(shard, k), "size": size, "queries": queries,
                        "recall_queries": n_q, "k": k, "dim": d, "build_s": build_s,
                        "batched_ms": b * 1e3, "single_total_ms": s * 1e3, "batch_speedup": s / b,
                        "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
                        "raw_batched_ms": rb * 1e3, "raw_single_total_ms": rs * 1e3, "raw_batch_speedup": rs / rb,
                        "raw_p50_ms": float(np.percentile(rlat, 50) * 1e3),
                        "raw_p99_ms": float(np.percentile(rlat, 99) * 1e3),
                        "recall@1": r1, "recall@k": rk, "search_threads": bank.search_threads,
                    })
                    bank.close()
                    del bank, raw, shard, params
                    for suffix in ("", "-wal", "-shm"):
                        Path(str(path) + suffix).unlink(missing_ok=True)
    finally:
        tmp.cleanup()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: recall and bank-path latency first, batching and raw FAISS after."""
    head = ("| data | index | size | recall@1 | recall@k | p50 ms | p99 ms | search setting | batched 64q ms | "
            "64 x single ms | speedup | raw p50 ms | raw p99 ms | build s |")
    sep = "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"
    lines = [head, sep]
    for r in rows:
        name = r["index"] if r["index"] != "auto" else f"auto ({r['shard_index']})"
        lines.append(
            f"| {r['data']} | {name} | {r['size']} | {r['recall@1']:.3f} | {r['recall@k']:.3f} | "
            f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['setting']} | {r['batched_ms']:.2f} | "
            f"{r['single_total_ms']:.2f} | {r['batch_speedup']:.1f}x | {r['raw_p50_ms']:.3f} | "
            f"{r['raw_p99_ms']:.3f} | {r['build_s']:.1f} |")
    return "\n".join(lines)


def target_summary(rows: list[dict[str, Any]], auto_threshold: int = AUTO_THRESHOLD,
                   auto_index: str = "hnsw") -> str:
    """What ``index: auto`` (the default) uses at each size measured, and, for each approximate index
    on the representative data at the target size, whether it keeps recall@k >= 0.95 at single-query
    p99 < 5 ms."""
    out = []
    sizes = sorted({r["size"] for r in rows})
    if sizes:
        uses = ", ".join(f"{n}: {'flat' if n <= auto_threshold else auto_index}" for n in sizes)
        out.append(f"auto (the default index) = flat up to {auto_threshold} entries per shard, {auto_index} "
                   f"above; here {uses}")
    for r in rows:
        if r["data"] in ("sentence", "file") and r["size"] >= TARGET_SIZE and r["shard_index"] != "flat":
            ok = r["recall@k"] >= TARGET_RECALL and r["p99_ms"] < TARGET_P99_MS
            out.append(f"target recall@{r['k']} >= {TARGET_RECALL} at p99 < {TARGET_P99_MS:g} ms, "
                       f"{r['data']} {r['size']}: {r['index']} recall {r['recall@k']:.3f}, p99 "
                       f"{r['p99_ms']:.2f} ms -> {'met' if ok else 'NOT met'}")
    return "\n".join(out)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``retrieval`` (this benchmark and its options) to the ``bench`` subcommands; returns its parser."""
    p = subparsers.add_parser("retrieval", help=HELP, description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=positive_int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--index", nargs="+", default=["flat", "ivf", "hnsw"], choices=list(INDEX_KINDS),
                   help="auto (the bank's default) is flat or hnsw by size: the summary line says which")
    p.add_argument("--data", nargs="+", default=list(DATA_KINDS), choices=list(DATA_KINDS),
                   help="sentence: sentence-embedding-shaped (representative); gaussian: isotropic worst case")
    p.add_argument("--vectors", default=None, help="a .npy file of real embeddings to use instead of --data")
    p.add_argument("--queries", type=positive_int, default=64, help="queries of the batched-vs-single timing")
    p.add_argument("--recall-queries", type=positive_int, default=256, help="queries recall is measured on")
    p.add_argument("--k", type=positive_int, default=16,
                   help="neighbours asked for (the retriever asks k x oversample = 16)")
    p.add_argument("--dim", type=positive_int, default=384)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--latency-samples", type=positive_int, default=512)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--search-threads", type=non_negative_int, default=1,
                   help="OpenMP threads per search (the bank's search_threads; 0 = FAISS default)")
    return p


def run(a: argparse.Namespace) -> int:
    """Run ``crl-bench bench retrieval`` with the options of :func:`add_parser`: prints the table of
    :func:`bench_retrieval` and the :func:`target_summary`; returns 0.

    Raises:
        ValueError: an unknown index kind or data shape, or ``--vectors`` with too few rows.
        OSError: ``--vectors`` cannot be read.
    """
    vectors = np.load(a.vectors) if a.vectors else None
    rows = bench_retrieval(a.sizes, a.queries, a.k, a.dim, a.index, data=a.data, vectors=vectors,
                           recall_queries=a.recall_queries, repeats=a.repeats, latency_samples=a.latency_samples,
                           seed=a.seed, bank_kwargs={"search_threads": a.search_threads})
    print(format_table(rows))
    summary = target_summary(rows)
    if summary:
        print(summary)
    return 0
