"""The experience bank: SQLite (WAL) storage + FAISS vector index (docs/method.md).

Storage
    One SQLite file in WAL mode. Table ``entries`` holds every :class:`ExperienceEntry` field, the
    unix time of the entry's last write (``updated_at``, used by LRU eviction), the text the entry is
    keyed by (``key_text``) and that text's embedding as float32 bytes.  The key is ``entry.text()``
    unless the writer gives another (the released keying: the retrieval query of the episode the entry
    was distilled from; see :meth:`ExperienceBank.apply`). Table ``rejections`` logs every refused operation (time,
    step, extraction id, env id, the operation as JSON, reason). Table ``counters`` keeps totals
    (operations applied per kind, evictions). Ids come from ``AUTOINCREMENT`` and are never reused,
    even after deletion or reopening. Opening an existing file restores the bank: entries are read
    back and the FAISS index is rebuilt from the stored embeddings (no re-embedding).

Vector index
    Inner product over L2-normalised embeddings (= cosine). **One index per env id** ("shard"), so a
    search filtered by env is exact and costs only that env's entries (no oversample-and-filter that
    can come back short when one env dominates the bank); ``env_id=None`` searches every shard and
    merges the per-shard top-k (exact merge). Index kinds:

    * ``auto`` (the default): exact ``flat`` search while a shard holds at most ``auto_threshold``
      (20,000) vectors; when it grows past that, the shard is rebuilt once as ``auto_index``
      (``hnsw``), and back as flat if it shrinks below half the threshold. Why 20,000: single-query
      flat p99 through :meth:`search_vectors` (one thread, 384-dim, 2-core machine under load)
      measured 0.5 ms at 10k, 0.8 ms at 15k, 1.7 ms at 20k, 1.9 ms at 30k, 3.5 ms at 50k and 8-13 ms at
      100k: 20k is where exact search leaves the ~1-2 ms budget (HNSW at 20k: p99 0.4 ms, recall@16
      0.99). HNSW rather than IVF because at 100k it kept equal or better recall at half IVF's p99
      (table below), needs no retraining as the shard grows, and the switch is one graph build (~4 s
      at 20k with 2 threads, under the write lock). The switch is decided once a write is complete
      (after capacity eviction), so the ``paper`` preset's 20,000-entry cap keeps every shard exact.
    * ``flat``: ``IndexIDMap2(IndexFlatIP)``, ids = entry ids. Exact.
    * ``ivf``: ``IndexIVFFlat`` (inner product, ids = entry ids, hash-table direct map so single
      ids can be removed and reconstructed). Until a shard holds ``ivf_min_train`` vectors it is
      searched exactly with a flat index. It is (re)trained from all its vectors when it first
      reaches that size and again each time it has doubled (or shrunk below a quarter) since the
      last training; ``nlist = min(ivf_nlist, n // 39)`` (FAISS wants >= 39 points per centroid;
      ``ivf_nlist`` 2048). Lists probed per query: ``ivf_nprobe`` if set (> 0), else
      ``ceil(nlist * max(ivf_nprobe_fraction, ivf_min_scan / n))`` with the current shard size
      ``n`` (defaults 1/8 and 10,000), i.e. about ``max(n / 8, 10000)`` vectors scanned: recall at
      a fixed fraction of lists falls as shards get smaller, so small shards scan a larger share
      (a shard of <= 10,000 is scanned whole; flat is cheaper there). Training the 100k shard
      takes ~20 s (2048 lists). Not k-dependent (measured k = 16 and 32).
    * ``hnsw``: ``IndexHNSWFlat`` (inner product, ``hnsw_m`` 32, ``hnsw_ef_construction`` 80).
      efSearch of a k-NN query = ``max(hnsw_ef_search, hnsw_ef_per_k * k, k)`` (defaults 128 and
      8: 128 up to k = 16, 256 at k = 32). HNSW cannot remove vectors, so deletions (MERGE
      targets, evictions, the old vector of an UPDATE) are **tombstones**: the internal label is
      marked dead and searches pass FAISS an ``IDSelectorBitmap`` of live labels, so dead vectors
      are never returned and no oversampling guess is needed. The shard is rebuilt from its live
      vectors when tombstones exceed ``max(hnsw_rebuild_min, hnsw_rebuild_fraction * live)``.
      Internal labels map to entry ids through an array kept beside the index.

    Tuning (``python -m crl_bench.bench_retrieval``, single-query search through this class, one
    thread, k = 16 = the retriever's ``k * oversample``). On sentence-embedding-shaped data (the
    benchmark's ``sentence`` data, calibrated on real all-MiniLM-L6-v2 embeddings, new queries),
    100k entries, recall@16 / p99:

    ==========================================  ===============  ==============
    setting                                     recall@16        p99 ms
    ==========================================  ===============  ==============
    flat                                        1.000            8-13
    ivf before (nlist 256, nprobe 16)           0.69             1.1
    ivf now (nlist 2048, nprobe 256)            0.98             1.4
    hnsw before (efSearch 64)                   0.96             0.4
    hnsw now (efSearch 128)                     0.98             0.7
    ==========================================  ===============  ==============

    On 100k real MiniLM sentence embeddings (held-out sentences as queries) HNSW efSearch 128 gave
    0.994 (p99 0.7 ms) and IVF 2048/256 0.978 (p99 2.2 ms). On isotropic Gaussian vectors (the
    worst case: no structure) nothing approximate reaches 0.95 under 5 ms: now ivf 0.45, hnsw 0.41
    at p99 0.9-1.6 ms (HNSW needs efSearch ~2048, p99 ~10 ms, slower than exact search); those rows
    are kept in the benchmark as the worst case.

    GPU FAISS is not used (faiss-cpu here); the flat index is the one that would benefit.

    OpenMP: searches run with ``search_threads`` OpenMP threads (default 1), set for the calling
    thread only (OpenMP's thread count is a per-thread setting) and restored after the call. On the
    2-core target with a trainer busy beside it, FAISS's default 2 threads made a single-query flat
    search over 10k vectors ~100x slower (36 ms vs 0.3 ms p50) because its threads wait on a barrier
    for a descheduled sibling; parallelism across queries comes from the manager's search threads
    and from batching. ``search_threads=0`` leaves OpenMP as it is (e.g. on a many-core machine).

    BLAS for batched exact search: FAISS computes exact inner products with BLAS only when
    ``n_queries * dim >= faiss.cvar.distance_compute_blas_threshold`` (128000 by default, i.e.
    >= 334 queries at dim 384), so a 64-query batch ran the same per-query SIMD scan as 64 single
    searches (measured 1.1x). The bank lowers that process-wide threshold to
    ``flat_blas_min_queries * dim`` (default 8 queries; it only ever lowers it): a 64-query batch
    over 100k vectors then took 72 ms instead of 370 ms with one thread, single queries unchanged.
    ``flat_blas_min_queries=0`` leaves FAISS's threshold alone.

Operations (:meth:`ExperienceBank.apply`)
    Each operation is validated, then applied in its own SQLite transaction (``BEGIN IMMEDIATE`` ...
    ``COMMIT``); the FAISS index is updated only after the commit succeeded. A refused operation is
    logged in ``rejections`` and returned in ``ApplyResult.rejected``; it never raises and changes
    nothing else. Reasons: see :data:`REJECTION_REASONS`.

Thread-safety
    Writes (``apply``, ``_bulk_add_vectors``) must be serialised by the caller (the experience
    manager holds an :class:`~crl_bench.experience.locks.RWLock` write lock) and must not overlap
    reads. Reads (``search``, ``search_vectors``, ``get``, ``entries``, ``__len__``, ``stats``)
    may run concurrently from several threads while no write happens: each thread has its own
    SQLite connection (``threading.local``; connections are never shared across threads) and FAISS
    searches are read-only. ``record_retrieval`` / ``record_outcome`` only touch SQLite counters
    (never FAISS), so they may also run concurrently with reads (SQLite serialises them; busy
    timeout 60 s).
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from crl_bench.experience.types import OP_KINDS, ApplyResult, ExperienceEntry, Operation

# ----------------------------------------------------------------------------- rejection reasons
REJECT_UNKNOWN_KIND = "unknown_kind"            # kind not in ADD / UPDATE / MERGE / NONE
REJECT_EMPTY_TEXT = "empty_text"                # ADD / UPDATE / MERGE with an empty title or content
REJECT_TOO_LONG = "too_long"                    # title or content longer than max_text_chars
REJECT_ADD_TARGETS = "add_with_targets"         # ADD naming target ids
REJECT_UPDATE_TARGETS = "update_target_count"   # UPDATE without exactly one target
REJECT_MERGE_TARGETS = "merge_target_count"     # MERGE with fewer than 2 distinct targets
REJECT_UNKNOWN_TARGET = "unknown_target"        # a target id not in the bank (or not an integer)
REJECT_WRONG_ENV = "target_other_env"           # a target belongs to another env id
REJECT_BAD_TEXT = "invalid_text"                # title or content is not encodable text (lone surrogate)
REJECT_EMBED_FAILED = "embedding_failed"        # the embedder raised on the operation's key text
REJECT_WRITE_FAILED = "write_failed"            # the database refused the write (rolled back)
REJECTION_REASONS = (REJECT_UNKNOWN_KIND, REJECT_EMPTY_TEXT, REJECT_TOO_LONG, REJECT_ADD_TARGETS,
                     REJECT_UPDATE_TARGETS, REJECT_MERGE_TARGETS, REJECT_UNKNOWN_TARGET, REJECT_WRONG_ENV,
                     REJECT_BAD_TEXT, REJECT_EMBED_FAILED, REJECT_WRITE_FAILED)
BANK_TABLES = ("entries", "rejections", "counters", "meta")    # what makes a SQLite file a bank
_MAX_ID = 2 ** 63 - 1                           # SQLite INTEGER range; entry ids are positive

INDEX_KINDS = ("auto", "flat", "ivf", "hnsw")
APPROX_KINDS = ("ivf", "hnsw")
#: ``index="auto"``: a shard of more than this many entries leaves exact search for ``auto_index``
AUTO_THRESHOLD = 20000
EVICTION_POLICIES = ("fifo", "lru")

_ENTRY_COLS = ("id", "env_id", "title", "content", "created_step", "updated_step", "source_extraction",
               "generation", "times_retrieved", "times_success", "times_failure", "last_retrieved")
_SELECT_ENTRY = "SELECT " + ", ".join(_ENTRY_COLS) + " FROM entries"
_SQL_CHUNK = 900

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    env_id TEXT NOT NULL,
    title TEXT NOT NULL,
    content TEXT NOT NULL,
    created_step INTEGER NOT NULL DEFAULT 0,
    updated_step INTEGER NOT NULL DEFAULT 0,
    source_extraction TEXT NOT NULL DEFAULT '',
    generation INTEGER NOT NULL DEFAULT 0,
    times_retrieved INTEGER NOT NULL DEFAULT 0,
    times_success INTEGER NOT NULL DEFAULT 0,
    times_failure INTEGER NOT NULL DEFAULT 0,
    last_retrieved REAL NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL DEFAULT 0,
    embedding BLOB NOT NULL,
    key_text TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS entries_env ON entries(env_id);
CREATE TABLE IF NOT EXISTS rejections (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    step INTEGER NOT NULL,
    extraction_id TEXT NOT NULL,
    env_id TEXT NOT NULL,
    operation TEXT NOT NULL,
    reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class NotABankError(ValueError):
    """A file opened as an experience bank is not one (not SQLite, or without the bank's tables)."""


def _op_json(op: Operation) -> str:
    """The operation as JSON for the rejection log; never raises (text that is not valid Unicode, e.g.
    a lone surrogate, is written with ``\\u`` escapes, odd targets as their ``str``)."""
    targets = getattr(op, "targets", ()) or ()
    try:
        targets = list(targets)
    except TypeError:
        targets = [targets]
    doc = {"kind": getattr(op, "kind", None), "title": getattr(op, "title", None),
           "content": getattr(op, "content", None), "targets": targets}
    out = json.dumps(doc, default=str, ensure_ascii=False)
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:
        out = json.dumps(doc, default=str, ensure_ascii=True)
    return out


def _valid_text(text: str) -> bool:
    """Whether ``text`` can be stored and embedded (UTF-8 encodable: no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# ----------------------------------------------------------------------------- vector shards
class _VectorStore:
    """Live (id, vector) rows of one shard, contiguous, O(1) removal by swapping in the last row."""

    def __init__(self, dim: int):
        self.dim = dim
        self.ids = np.empty(0, dtype=np.int64)
        self.vecs = np.empty((0, dim), dtype=np.float32)
        self.n = 0
        self.pos: dict[int, int] = {}

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        m = len(ids)
        if self.n + m > len(self.ids):
            cap = max(16, 2 * len(self.ids), self.n + m)
            new_ids = np.empty(cap, dtype=np.int64)
            new_vecs = np.empty((cap, self.dim), dtype=np.float32)
            new_ids[:self.n] = self.ids[:self.n]
            new_vecs[:self.n] = self.vecs[:self.n]
            self.ids, self.vecs = new_ids, new_vecs
        self.ids[self.n:self.n + m] = ids
        self.vecs[self.n:self.n + m] = vecs
        for j, i in enumerate(ids.tolist()):
            self.pos[i] = self.n + j
        self.n += m

    def remove(self, ids: Iterable[int]) -> None:
        for i in ids:
            p = self.pos.pop(int(i), None)
            if p is None:
                continue
            last = self.n - 1
            if p != last:
                moved = int(self.ids[last])
                self.ids[p] = moved
                self.vecs[p] = self.vecs[last]
                self.pos[moved] = p
            self.n -= 1

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[:self.n], self.vecs[:self.n]


def _flat_idmap(dim: int, ids: np.ndarray | None = None, vecs: np.ndarray | None = None):
    import faiss

    index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
    if ids is not None and len(ids):
        index.add_with_ids(np.ascontiguousarray(vecs), np.ascontiguousarray(ids))
    return index


def _flat_snapshot(index) -> tuple[np.ndarray, np.ndarray]:
    import faiss

    ids = faiss.vector_to_array(index.id_map).astype(np.int64)
    vecs = index.index.reconstruct_n(0, index.ntotal) if index.ntotal else np.empty((0, index.d), np.float32)
    return ids, np.asarray(vecs, dtype=np.float32)


class _FlatShard:
    """Exact search: IndexIDMap2(IndexFlatIP)."""

    def __init__(self, dim: int, cfg: dict):
        self.dim = dim
        self.index = _flat_idmap(dim)

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        self.index.add_with_ids(vecs, ids)

    def remove(self, ids: Sequence[int]) -> None:
        if len(ids):
            self.index.remove_ids(np.asarray(ids, dtype=np.int64))

    def search_params(self, k: int):
        return None

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.search(q, k)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return _flat_snapshot(self.index)


class _IVFShard:
    """IndexIVFFlat once the shard holds ``ivf_min_train`` vectors, exact flat search before."""

    def __init__(self, dim: int, cfg: dict):
        self.dim = dim
        self.nlist_max = int(cfg["ivf_nlist"])
        self.nprobe_fixed = int(cfg["ivf_nprobe"])
        self.nprobe_fraction = float(cfg["ivf_nprobe_fraction"])
        self.min_scan = int(cfg["ivf_min_scan"])
        self.min_train = max(2, int(cfg["ivf_min_train"]))
        self.store = _VectorStore(dim)
        self.flat = _flat_idmap(dim)
        self.ivf = None
        self.trained_n = 0
        self.trainings = 0

    def __len__(self) -> int:
        return self.store.n

    def _needs_rebuild(self) -> bool:
        n = self.store.n
        if self.ivf is None:
            return n >= self.min_train
        return n >= 2 * self.trained_n or n < self.trained_n // 4

    def _rebuild(self) -> None:
        import faiss

        ids, vecs = self.store.live()
        n = len(ids)
        if n < self.min_train:
            self.ivf, self.trained_n = None, 0
            self.flat = _flat_idmap(self.dim, ids, vecs)
            return
        nlist = max(1, min(self.nlist_max, n // 39))
        quantizer = faiss.IndexFlatIP(self.dim)
        ivf = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.train(np.ascontiguousarray(vecs))
        ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
        ivf.add_with_ids(np.ascontiguousarray(vecs), np.ascontiguousarray(ids))
        self._quantizer = quantizer          # keep the quantizer alive with the index
        self.ivf, self.flat, self.trained_n = ivf, None, n
        self.trainings += 1
        ivf.nprobe = self.nprobe()                # the default of a plain ivf.search (benchmark's raw path)

    def nprobe(self) -> int:
        """Lists probed per query (see the module docstring): ``ivf_nprobe`` if > 0, else
        ``ceil(nlist * max(ivf_nprobe_fraction, ivf_min_scan / n))``, within ``[1, nlist]``."""
        nlist = int(self.ivf.nlist) if self.ivf is not None else 1
        if self.nprobe_fixed > 0:
            return max(1, min(self.nprobe_fixed, nlist))
        frac = max(self.nprobe_fraction, self.min_scan / max(1, self.store.n))
        return max(1, min(nlist, math.ceil(frac * nlist - 1e-9)))

    def search_params(self, k: int):
        """FAISS search parameters of a ``k``-NN query now (``None``: exact flat search)."""
        if self.ivf is None:
            return None
        import faiss

        params = faiss.SearchParametersIVF()
        params.nprobe = self.nprobe()
        return params

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        self.store.add(ids, vecs)
        if self._needs_rebuild():
            self._rebuild()
        elif self.ivf is not None:
            self.ivf.add_with_ids(vecs, ids)
        else:
            self.flat.add_with_ids(vecs, ids)

    def remove(self, ids: Sequence[int]) -> None:
        if not len(ids):
            return
        self.store.remove(ids)
        arr = np.asarray(ids, dtype=np.int64)
        if self.ivf is not None:
            self.ivf.remove_ids(arr)
        else:
            self.flat.remove_ids(arr)
        if self._needs_rebuild():
            self._rebuild()

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self.ivf is None:
            return self.flat.search(q, k)
        return self.ivf.search(q, k, params=self.search_params(k))

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        if self.ivf is None:
            return _flat_snapshot(self.flat)
        from faiss.contrib.inspect_tools import get_invlist

        all_ids, all_vecs = [], []
        for lst in range(self.ivf.nlist):
            ids, codes = get_invlist(self.ivf.invlists, lst)
            all_ids.append(ids)
            all_vecs.append(codes.view(np.float32).reshape(len(ids), self.dim))
        return np.concatenate(all_ids), np.concatenate(all_vecs)


class _HNSWShard:
    """IndexHNSWFlat with tombstones (HNSW has no removal) and rebuild when they pile up."""

    def __init__(self, dim: int, cfg: dict):
        self.dim = dim
        self.m = int(cfg["hnsw_m"])
        self.ef_construction = int(cfg["hnsw_ef_construction"])
        self.ef_search = int(cfg["hnsw_ef_search"])
        self.ef_per_k = int(cfg["hnsw_ef_per_k"])
        self.rebuild_min = int(cfg["hnsw_rebuild_min"])
        self.rebuild_fraction = float(cfg["hnsw_rebuild_fraction"])
        self.store = _VectorStore(dim)
        self.rebuilds = 0
        self._reset()

    def _reset(self) -> None:
        import faiss

        self.index = faiss.IndexHNSWFlat(self.dim, self.m, faiss.METRIC_INNER_PRODUCT)
        self.index.hnsw.efConstruction = self.ef_construction
        self.labels = np.empty(0, dtype=np.int64)      # internal label -> entry id
        self.alive = np.empty(0, dtype=bool)
        self.label_of: dict[int, int] = {}
        self.dead = 0
        self.alive_bits: np.ndarray | None = None        # packed bitmap of live labels, when dead > 0

    def __len__(self) -> int:
        return self.store.n

    def _append(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        start = int(self.index.ntotal)
        self.index.add(np.ascontiguousarray(vecs))
        self.labels = np.concatenate([self.labels, ids.astype(np.int64)])
        self.alive = np.concatenate([self.alive, np.ones(len(ids), dtype=bool)])
        for j, i in enumerate(ids.tolist()):
            self.label_of[i] = start + j

    def _refresh_bits(self) -> None:
        self.alive_bits = np.packbits(self.alive, bitorder="little") if self.dead else None

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        self.store.add(ids, vecs)
        self._append(ids, vecs)
        self._refresh_bits()

    def remove(self, ids: Sequence[int]) -> None:
        if not len(ids):
            return
        self.store.remove(ids)
        for i in ids:
            lab = self.label_of.pop(int(i), None)
            if lab is not None and self.alive[lab]:
                self.alive[lab] = False
                self.dead += 1
        if self.dead > max(self.rebuild_min, self.rebuild_fraction * self.store.n):
            self.rebuild()
        else:
            self._refresh_bits()

    def rebuild(self) -> None:
        ids, vecs = self.store.live()
        self._reset()
        if len(ids):
            self._append(ids.copy(), vecs)
        self.rebuilds += 1

    def ef(self, k: int) -> int:
        """efSearch of a ``k``-NN query: ``max(hnsw_ef_search, hnsw_ef_per_k * k, k)``."""
        return max(self.ef_search, self.ef_per_k * k, k)

    def search_params(self, k: int):
        """FAISS search parameters of a ``k``-NN query now (beam width, live-label filter)."""
        import faiss

        params = faiss.SearchParametersHNSW()
        params.efSearch = self.ef(k)
        bits = self.alive_bits
        if bits is not None:
            sel = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))
            params.sel = sel
            params._keep = (sel, bits)          # the selector points into ``bits``: keep both alive
        return params

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        D, L = self.index.search(q, k, params=self.search_params(k))
        ids = np.where(L >= 0, self.labels[np.maximum(L, 0)] if len(self.labels) else -1, -1)
        return D, ids

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.index.ntotal:
            return np.empty(0, np.int64), np.empty((0, self.dim), np.float32)
        vecs = self.index.reconstruct_n(0, self.index.ntotal)
        return self.labels[self.alive].copy(), np.asarray(vecs, np.float32)[self.alive]


class _AutoShard:
    """Exact flat search while the shard is small, the approximate index (``auto_index``) once it
    holds more than ``auto_threshold`` vectors; back to flat when it shrinks below half of that."""

    def __init__(self, dim: int, cfg: dict):
        self.dim = dim
        self.cfg = cfg
        self.threshold = int(cfg["auto_threshold"])
        self.approx = str(cfg["auto_index"])
        self.kind = "flat"
        self.inner = _FlatShard(dim, cfg)
        self.switches = 0

    def __len__(self) -> int:
        return len(self.inner)

    def _switch(self, kind: str) -> None:
        ids, vecs = self.inner.snapshot()
        new = _SHARDS[kind](self.dim, self.cfg)
        if len(ids):
            new.add(np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(vecs, dtype=np.float32))
        self.inner, self.kind = new, kind
        self.switches += 1

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        self.inner.add(ids, vecs)

    def remove(self, ids: Sequence[int]) -> None:
        self.inner.remove(ids)

    def settle(self) -> None:
        """Switch kind if the size asks for it. Called by the bank once a write is complete (after
        capacity eviction), so a bank held at its cap by eviction never switches on the transient
        extra entries of a write."""
        if self.kind == "flat" and len(self.inner) > self.threshold:
            self._switch(self.approx)
        elif self.kind != "flat" and len(self.inner) < self.threshold // 2:
            self._switch("flat")

    def search_params(self, k: int):
        return self.inner.search_params(k)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.search(q, k)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.snapshot()


_SHARDS = {"flat": _FlatShard, "ivf": _IVFShard, "hnsw": _HNSWShard, "auto": _AutoShard}


@contextmanager
def _omp_threads(n: int):
    """Run the block with ``n`` OpenMP threads in the calling thread (0: unchanged), then restore."""
    if n <= 0:
        yield
        return
    import faiss

    prev = faiss.omp_get_max_threads()
    if prev == n:
        yield
        return
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(prev)


# ----------------------------------------------------------------------------- the bank
class ExperienceBank:
    """Persistent experience bank (see the module docstring for storage, index and threading).

    Args:
        path: SQLite file (created if missing; reopened and restored if present).
        embedder: object with ``dim`` and ``encode(list[str]) -> (N, dim)`` float32 unit rows.
        capacity: maximum number of entries over all envs (0 = unlimited).
        eviction: ``fifo`` (oldest write first: an UPDATE re-queues the entry, as the released code's
            delete-and-re-add does) or ``lru`` (least recently used first, where the
            last use is ``max(last_retrieved, time of the last write)``; ties by oldest id).
        index: ``auto`` (flat up to ``auto_threshold`` entries per shard, ``auto_index`` above) |
            ``flat`` | ``ivf`` | ``hnsw``.
        ivf_nlist: IVF lists (upper bound; ``min(ivf_nlist, n // 39)`` at training).
        ivf_nprobe: lists probed per query; 0 (default) = adaptive:
            ``ceil(nlist * max(ivf_nprobe_fraction, ivf_min_scan / n))``.
        max_text_chars: longest accepted title and longest accepted content.
        ivf_min_train: vectors a shard needs before its IVF is trained (exact search before).
        ivf_nprobe_fraction, ivf_min_scan: the adaptive nprobe rule (1/8 of the lists, at least
            10,000 vectors scanned).
        hnsw_m, hnsw_ef_construction: HNSW graph degree and build beam width.
        hnsw_ef_search, hnsw_ef_per_k: search beam width ``max(hnsw_ef_search, hnsw_ef_per_k * k, k)``
            for a k-NN query (``hnsw_ef_search=64, hnsw_ef_per_k=1`` is the rule before issue 13).
        hnsw_rebuild_min, hnsw_rebuild_fraction: rebuild a shard when its tombstones exceed
            ``max(hnsw_rebuild_min, hnsw_rebuild_fraction * live)``.
        auto_threshold, auto_index: ``index="auto"``: a shard of more than ``auto_threshold`` entries
            uses ``auto_index`` (``hnsw`` or ``ivf``), and flat again below half of it.
        search_threads: OpenMP threads per FAISS search (calling thread only; 0 = leave as is).
        flat_blas_min_queries: batches of at least this many queries use BLAS for exact search
            (lowers FAISS's process-wide ``distance_compute_blas_threshold``; 0 = leave it).
        read_only: open an existing bank without writing to it (SQLite ``mode=ro``: no schema, no
            WAL switch, no checkpoint; ``apply`` and the counters raise ``PermissionError``), for
            ``crl-bench bank show/stats`` and the evaluation of a finished run. Raises
            ``FileNotFoundError`` when the file does not exist and :class:`NotABankError` when it is
            not a crl-bench bank.

    Files: a bank is the ``.sqlite`` file together with its ``-wal`` and ``-shm`` files while a
    writer has it open or after a crash (committed entries may sit only in the ``-wal`` until a
    checkpoint); copy or move the three together.
    """

    def __init__(self, path: str | Path, embedder, capacity: int = 0, eviction: str = "fifo",
                 index: str = "auto", ivf_nlist: int = 2048, ivf_nprobe: int = 0, *,
                 max_text_chars: int = 1000, ivf_min_train: int = 1024, ivf_nprobe_fraction: float = 0.125,
                 ivf_min_scan: int = 10000, hnsw_m: int = 32, hnsw_ef_construction: int = 80,
                 hnsw_ef_search: int = 128, hnsw_ef_per_k: int = 8, hnsw_rebuild_min: int = 256,
                 hnsw_rebuild_fraction: float = 0.25, auto_threshold: int = AUTO_THRESHOLD,
                 auto_index: str = "hnsw", search_threads: int = 1, flat_blas_min_queries: int = 8,
                 read_only: bool = False):
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        if index not in INDEX_KINDS:
            raise ValueError(f"index must be one of {INDEX_KINDS}, got {index!r}")
        if auto_index not in APPROX_KINDS:
            raise ValueError(f"auto_index must be one of {APPROX_KINDS}, got {auto_index!r}")
        if ivf_nlist < 1 or ivf_nprobe < 0 or not 0 < ivf_nprobe_fraction <= 1 or ivf_min_scan < 0:
            raise ValueError("need ivf_nlist >= 1, ivf_nprobe >= 0, 0 < ivf_nprobe_fraction <= 1, ivf_min_scan >= 0")
        if hnsw_ef_search < 1 or hnsw_ef_per_k < 0 or auto_threshold < 0:
            raise ValueError("need hnsw_ef_search >= 1, hnsw_ef_per_k >= 0, auto_threshold >= 0")
        if capacity < 0:
            raise ValueError("capacity must be >= 0 (0 = unlimited)")
        self.path = Path(path)
        self.embedder = embedder
        self.dim = int(embedder.dim)
        self.capacity = int(capacity)
        self.eviction = eviction
        self.index_kind = index
        self.max_text_chars = int(max_text_chars)
        self.search_threads = int(search_threads)
        if flat_blas_min_queries > 0:
            import faiss

            want = int(flat_blas_min_queries) * self.dim
            if want < faiss.cvar.distance_compute_blas_threshold:
                faiss.cvar.distance_compute_blas_threshold = want
        self._cfg = {"ivf_nlist": ivf_nlist, "ivf_nprobe": ivf_nprobe, "ivf_min_train": ivf_min_train,
                     "ivf_nprobe_fraction": ivf_nprobe_fraction, "ivf_min_scan": ivf_min_scan,
                     "hnsw_m": hnsw_m, "hnsw_ef_construction": hnsw_ef_construction,
                     "hnsw_ef_search": hnsw_ef_search, "hnsw_ef_per_k": hnsw_ef_per_k,
                     "hnsw_rebuild_min": hnsw_rebuild_min, "hnsw_rebuild_fraction": hnsw_rebuild_fraction,
                     "auto_threshold": auto_threshold, "auto_index": auto_index}
        self.read_only = bool(read_only)
        self._local = threading.local()
        self._closed = False
        self._shards: dict[str, object] = {}
        if self.read_only:
            self._open_read_only()
            return
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        c = self._conn()
        mode = c.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise RuntimeError(f"could not put {self.path} in WAL mode (got {mode})")
        c.executescript(_SCHEMA)
        if "key_text" not in {r[1] for r in c.execute("PRAGMA table_info(entries)")}:   # banks from <= 0.1
            c.execute("ALTER TABLE entries ADD COLUMN key_text TEXT NOT NULL DEFAULT ''")
        row = c.execute("SELECT value FROM meta WHERE key='dim'").fetchone()
        if row is None:
            c.execute("INSERT INTO meta(key, value) VALUES ('dim', ?)", (str(self.dim),))
        elif int(row[0]) != self.dim:
            raise ValueError(f"{self.path} holds {row[0]}-dim embeddings, embedder gives {self.dim}")
        self._load_index()

    def _open_read_only(self) -> None:
        """Open an existing bank for inspection or evaluation without writing a byte to it.

        Raises:
            FileNotFoundError: no file at ``path``.
            NotABankError: the file is not SQLite, or lacks the bank's tables or its ``dim`` record.
            ValueError: the stored embeddings have another dimension than the embedder's.
        """
        if not self.path.is_file():
            raise FileNotFoundError(f"no experience bank at {self.path}")
        try:
            c = self._conn()
            tables = {r[0]: r[1] for r in c.execute("SELECT name, sql FROM sqlite_master WHERE type='table'")}
            missing = [t for t in BANK_TABLES if t not in tables]
            if missing:
                raise NotABankError(f"{self.path} is not a crl-bench experience bank (no table "
                                    f"{', '.join(missing)})")
            cols = {r[1] for r in c.execute("PRAGMA table_info(entries)")}
            if not {"id", "env_id", "title", "content", "embedding"} <= cols:
                raise NotABankError(f"{self.path} is not a crl-bench experience bank (table entries lacks "
                                    "the bank's columns)")
            row = c.execute("SELECT value FROM meta WHERE key='dim'").fetchone()
        except sqlite3.DatabaseError as exc:       # not a database, or a corrupt one
            raise NotABankError(f"{self.path} is not a readable SQLite experience bank: {exc}") from None
        if row is None:
            raise NotABankError(f"{self.path} is not a crl-bench experience bank (no embedding dimension "
                                "recorded in table meta)")
        if int(row[0]) != self.dim:
            raise ValueError(f"{self.path} holds {row[0]}-dim embeddings, embedder gives {self.dim}")
        self._load_index()

    def _check_writable(self) -> None:
        if self.read_only:
            raise PermissionError(f"experience bank {self.path} was opened read-only")

    # ------------------------------------------------------------------ plumbing
    def _conn(self) -> sqlite3.Connection:
        if self._closed:
            raise RuntimeError("ExperienceBank is closed")
        c = getattr(self._local, "conn", None)
        if c is None:
            if self.read_only:
                # mode=ro: SQLite never writes the file. With a -wal beside it (a writer has it open,
                # or crashed) its frames are read through the -shm index, so entries committed before
                # a crash are seen; without one the file is complete and opened immutable, so no
                # -wal/-shm files are created beside it either.
                wal = self.path.with_name(self.path.name + "-wal").exists()
                uri = f"{self.path.resolve().as_uri()}?mode=ro" + ("" if wal else "&immutable=1")
                c = sqlite3.connect(uri, uri=True, timeout=60.0, isolation_level=None)
                c.execute("PRAGMA busy_timeout=60000")
            else:
                c = sqlite3.connect(str(self.path), timeout=60.0, isolation_level=None)
                c.execute("PRAGMA synchronous=NORMAL")
                c.execute("PRAGMA busy_timeout=60000")
            self._local.conn = c
        return c

    def _shard(self, env_id: str, create: bool = True):
        shard = self._shards.get(env_id)
        if shard is None and create:
            shard = _SHARDS[self.index_kind](self.dim, self._cfg)
            self._shards[env_id] = shard
        return shard

    def _load_index(self) -> None:
        self._shards = {}
        per_env: dict[str, tuple[list[int], list[bytes]]] = {}
        for i, env, blob in self._conn().execute("SELECT id, env_id, embedding FROM entries ORDER BY id"):
            ids, blobs = per_env.setdefault(env, ([], []))
            ids.append(i)
            blobs.append(blob)
        for env, (ids, blobs) in per_env.items():
            vecs = np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(ids), self.dim)
            self._shard(env).add(np.asarray(ids, dtype=np.int64), np.ascontiguousarray(vecs))
        self._settle()

    def _settle(self) -> None:
        """Let ``auto`` shards switch kind now that a write is complete (see :class:`_AutoShard`)."""
        for env, shard in list(self._shards.items()):
            if isinstance(shard, _AutoShard):
                try:
                    shard.settle()
                except Exception as exc:  # noqa: BLE001 - any FAISS failure: SQLite holds the truth, rebuild
                    warnings.warn(f"FAISS index switch failed ({exc!r}); rebuilding shard {env!r} from SQLite",
                                  stacklevel=2)
                    self._rebuild_shard(env)

    def _rebuild_shard(self, env_id: str) -> None:
        rows = self._conn().execute("SELECT id, embedding FROM entries WHERE env_id=? ORDER BY id",
                                    (env_id,)).fetchall()
        shard = _SHARDS[self.index_kind](self.dim, self._cfg)
        if rows:
            vecs = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), self.dim)
            shard.add(np.asarray([r[0] for r in rows], dtype=np.int64), np.ascontiguousarray(vecs))
        if isinstance(shard, _AutoShard):
            shard.settle()
        self._shards[env_id] = shard

    def _faiss_update(self, env_id: str, remove: Sequence[int], add_ids: Sequence[int],
                      add_vecs: np.ndarray | None) -> None:
        """Apply a committed change to the shard; on any FAISS error rebuild the shard from SQLite."""
        try:
            shard = self._shard(env_id)
            if remove:
                shard.remove(list(remove))
            if add_ids:
                shard.add(np.asarray(add_ids, dtype=np.int64), np.ascontiguousarray(add_vecs, dtype=np.float32))
        except Exception as exc:  # noqa: BLE001 - any FAISS failure: SQLite holds the truth, rebuild
            warnings.warn(f"FAISS update failed ({exc!r}); rebuilding shard {env_id!r} from SQLite", stacklevel=2)
            self._rebuild_shard(env_id)

    @staticmethod
    def _row_entry(r) -> ExperienceEntry:
        return ExperienceEntry(id=r[0], env_id=r[1], title=r[2], content=r[3], created_step=r[4],
                               updated_step=r[5], source_extraction=r[6], generation=r[7],
                               times_retrieved=r[8], times_success=r[9], times_failure=r[10],
                               last_retrieved=r[11])

    @staticmethod
    def _bump(c: sqlite3.Connection, name: str, by: int = 1) -> None:
        c.execute("INSERT INTO counters(name, value) VALUES (?, ?) "
                  "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value", (name, by))

    # ------------------------------------------------------------------ validation
    def _static_check(self, op: Operation) -> tuple[str | None, tuple[int, ...]]:
        """Checks that need no database; returns (reason or None, distinct targets)."""
        kind = getattr(op, "kind", None)
        if kind not in OP_KINDS:
            return REJECT_UNKNOWN_KIND, ()
        if kind == "NONE":
            return None, ()
        raw = getattr(op, "targets", ()) or ()
        try:
            raw = tuple(raw)
            if any(isinstance(t, bool) or (isinstance(t, float) and not t.is_integer()) for t in raw):
                raise ValueError
            targets = tuple(dict.fromkeys(int(t) for t in raw))
            if any(not 0 < t <= _MAX_ID for t in targets):
                raise ValueError         # ids are positive SQLite integers: 99999999999999999999 is no id
        except (TypeError, ValueError, OverflowError):   # OverflowError: int(float("inf"))
            return REJECT_UNKNOWN_TARGET, ()
        if kind == "ADD" and raw:
            return REJECT_ADD_TARGETS, targets
        if kind == "UPDATE" and len(tuple(raw)) != 1:
            return REJECT_UPDATE_TARGETS, targets
        if kind == "MERGE" and len(targets) < 2:
            return REJECT_MERGE_TARGETS, targets
        title, content = str(op.title or "").strip(), str(op.content or "").strip()
        if not title or not content:
            return REJECT_EMPTY_TEXT, targets
        if not (_valid_text(title) and _valid_text(content)):
            return REJECT_BAD_TEXT, targets
        if len(title) > self.max_text_chars or len(content) > self.max_text_chars:
            return REJECT_TOO_LONG, targets
        return None, targets

    def _log_rejection(self, c: sqlite3.Connection, op: Operation, reason: str, env_id: str, step: int,
                       extraction_id: str) -> None:
        """Record a refused operation (outside or inside the caller's transaction); a log write the
        database refuses is reported as a warning, never raised (the refusal itself still stands)."""
        try:
            c.execute("INSERT INTO rejections(time, step, extraction_id, env_id, operation, reason) "
                      "VALUES (?, ?, ?, ?, ?, ?)", (time.time(), int(step), str(extraction_id), str(env_id),
                                                    _op_json(op), reason))
        except (sqlite3.Error, ValueError, OverflowError, UnicodeError) as exc:
            warnings.warn(f"could not log a rejected bank operation ({reason}): {exc!r}", stacklevel=2)

    # ------------------------------------------------------------------ writes
    def apply(self, ops: list[Operation], *, env_id: str, step: int, extraction_id: str,
              generation: int, key_text: str | None = None) -> ApplyResult:
        """Validate and apply ``ops`` in order (one transaction each), then enforce the capacity cap.

        ``key_text``: what ADD and UPDATE entries are indexed by (embedded once for the whole call),
        e.g. the retrieval query of the episode they were distilled from; ``None`` or empty: each
        entry's own ``"title: content"``. MERGE entries are always keyed by their own text.

        ADD inserts a new entry of ``env_id``. UPDATE rewrites title, content, key, embedding,
        ``updated_step``, ``source_extraction`` and ``generation`` of its one target and keeps its
        counters and ``created_step``. MERGE deletes its targets and inserts one new entry (new id)
        whose ``times_retrieved`` / ``times_success`` / ``times_failure`` are the targets' sums and
        whose ``last_retrieved`` is their maximum. NONE changes nothing (reported as applied with
        id None). Refused operations are logged and returned, never raised.

        The caller must serialise writes (see the module docstring). Raises ``PermissionError`` on a
        bank opened with ``read_only`` (a programming error, not extractor input).
        """
        self._check_writable()
        res = ApplyResult()
        c = self._conn()
        checks = [self._static_check(op) for op in ops]
        to_embed = [i for i, (op, (reason, _)) in enumerate(zip(ops, checks))
                    if reason is None and op.kind != "NONE"]
        vec_of: dict[int, np.ndarray] = {}
        key_of: dict[int, str] = {}
        if to_embed:
            for i in to_embed:
                own = f"{str(ops[i].title).strip()}: {str(ops[i].content).strip()}"
                key_of[i] = key_text if key_text and ops[i].kind != "MERGE" else own
            row = self._embed_each(list(dict.fromkeys(key_of.values())))
            vec_of = {i: row[key_of[i]] for i in to_embed if key_of[i] in row}
            checks = [(REJECT_EMBED_FAILED, t) if i in key_of and i not in vec_of else (r, t)
                      for i, (r, t) in enumerate(checks)]
        for i, op in enumerate(ops):
            reason, targets = checks[i]
            if reason is not None:
                self._log_rejection(c, op, reason, env_id, step, extraction_id)
                res.rejected.append((op, reason))
                continue
            if op.kind == "NONE":
                res.applied.append((op, None))
                continue
            outcome = self._apply_one(c, op, targets, vec_of[i], env_id, step, extraction_id, generation, key_of[i])
            if isinstance(outcome, str):
                res.rejected.append((op, outcome))
            else:
                res.applied.append((op, outcome))
        res.evicted = self._enforce_capacity()
        self._settle()
        return res

    def _embed_each(self, texts: list[str]) -> dict[str, np.ndarray]:
        """Embed ``texts`` in one batch; if the embedder raises, text by text, leaving out those that
        fail (their operations are rejected as ``embedding_failed``)."""
        def encode(batch: list[str]) -> np.ndarray:
            vecs = np.asarray(self.embedder.encode(batch), dtype=np.float32).reshape(len(batch), self.dim)
            if not np.isfinite(vecs).all():
                raise ValueError("non-finite embedding")
            return vecs
        try:
            vecs = encode(texts)
            return {t: vecs[j] for j, t in enumerate(texts)}
        except Exception:  # noqa: BLE001 - find the text that fails, keep the rest
            out = {}
            for t in texts:
                try:
                    out[t] = encode([t])[0]
                except Exception as exc:  # noqa: BLE001 - apply() never raises: the operation is rejected
                    warnings.warn(f"embedding a bank entry failed ({exc!r}); its operation is rejected", stacklevel=2)
            return out

    def _apply_one(self, c: sqlite3.Connection, op: Operation, targets: tuple[int, ...], vec: np.ndarray,
                   env_id: str, step: int, extraction_id: str, generation: int, key: str) -> int | str:
        """One operation in one transaction; returns the resulting id or a rejection reason."""
        title, content = str(op.title).strip(), str(op.content).strip()
        now = time.time()
        blob = np.ascontiguousarray(vec, dtype=np.float32).tobytes()
        c.execute("BEGIN IMMEDIATE")
        try:
            rows = {}
            if targets:
                marks = ",".join("?" * len(targets))
                for r in c.execute("SELECT id, env_id, times_retrieved, times_success, times_failure, "
                                   f"last_retrieved FROM entries WHERE id IN ({marks})", targets):
                    rows[r[0]] = r
                reason = None
                if any(t not in rows for t in targets):
                    reason = REJECT_UNKNOWN_TARGET
                elif any(rows[t][1] != env_id for t in targets):
                    reason = REJECT_WRONG_ENV
                if reason is not None:
                    self._log_rejection(c, op, reason, env_id, step, extraction_id)
                    c.execute("COMMIT")
                    return reason
            if op.kind == "ADD":
                cur = c.execute(
                    "INSERT INTO entries(env_id, title, content, created_step, updated_step, source_extraction, "
                    "generation, updated_at, embedding, key_text) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (env_id, title, content, int(step), int(step), str(extraction_id), int(generation), now, blob,
                     key))
                new_id, removed = int(cur.lastrowid), []
            elif op.kind == "UPDATE":
                (tid,) = targets
                c.execute("UPDATE entries SET title=?, content=?, updated_step=?, source_extraction=?, "
                          "generation=?, updated_at=?, embedding=?, key_text=? WHERE id=?",
                          (title, content, int(step), str(extraction_id), int(generation), now, blob, key, tid))
                new_id, removed = tid, [tid]
            else:  # MERGE
                got = [rows[t] for t in targets]
                marks = ",".join("?" * len(targets))
                c.execute(f"DELETE FROM entries WHERE id IN ({marks})", targets)
                cur = c.execute(
                    "INSERT INTO entries(env_id, title, content, created_step, updated_step, source_extraction, "
                    "generation, times_retrieved, times_success, times_failure, last_retrieved, updated_at, "
                    "embedding, key_text) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (env_id, title, content, int(step), int(step), str(extraction_id), int(generation),
                     sum(r[2] for r in got), sum(r[3] for r in got), sum(r[4] for r in got),
                     max(r[5] for r in got), now, blob, key))
                new_id, removed = int(cur.lastrowid), list(targets)
            self._bump(c, f"applied_{op.kind}")
            c.execute("COMMIT")
        except (sqlite3.Error, ValueError, OverflowError, UnicodeError) as exc:
            c.execute("ROLLBACK")      # nothing of this operation stays; earlier ones are committed
            warnings.warn(f"bank write refused ({exc!r}); operation rejected as {REJECT_WRITE_FAILED}", stacklevel=2)
            self._log_rejection(c, op, REJECT_WRITE_FAILED, env_id, step, extraction_id)
            return REJECT_WRITE_FAILED
        except BaseException:
            c.execute("ROLLBACK")
            raise
        self._faiss_update(env_id, removed, [new_id], vec[None, :])
        return new_id

    def _enforce_capacity(self) -> list[int]:
        if self.capacity <= 0:
            return []
        c = self._conn()
        c.execute("BEGIN IMMEDIATE")
        try:
            excess = c.execute("SELECT COUNT(*) FROM entries").fetchone()[0] - self.capacity
            if excess <= 0:
                c.execute("COMMIT")
                return []
            # fifo: by last write (an UPDATE re-queues the entry, as the released code's delete + re-add)
            order = "updated_at, id" if self.eviction == "fifo" else "MAX(last_retrieved, updated_at), id"
            victims = c.execute(f"SELECT id, env_id FROM entries ORDER BY {order} LIMIT ?", (excess,)).fetchall()
            ids = [v[0] for v in victims]
            for s in range(0, len(ids), _SQL_CHUNK):
                chunk = ids[s:s + _SQL_CHUNK]
                c.execute(f"DELETE FROM entries WHERE id IN ({','.join('?' * len(chunk))})", chunk)
            self._bump(c, "evicted", len(ids))
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        per_env: dict[str, list[int]] = {}
        for i, env in victims:
            per_env.setdefault(env, []).append(i)
        for env, ids_env in per_env.items():
            self._faiss_update(env, ids_env, [], None)
        return ids

    def _bulk_add_vectors(self, env_id: str, vectors: np.ndarray, *, step: int = 0,
                          titles: Sequence[str] | None = None) -> list[int]:
        """Internal (benchmarks, imports): insert pre-computed unit vectors as entries, skipping the
        embedder and per-operation validation; one transaction, one FAISS add. Titles default to
        ``"bulk <n>"``; content is ``"bulk vector"``. Returns the new ids. Caller serialises writes."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        n = len(vectors)
        if n == 0:
            return []
        titles = list(titles) if titles is not None else [f"bulk {j}" for j in range(n)]
        now = time.time()
        c = self._conn()
        c.execute("BEGIN IMMEDIATE")
        try:
            before = c.execute("SELECT COALESCE(MAX(seq), 0) FROM sqlite_sequence WHERE name='entries'").fetchone()[0]
            c.executemany(
                "INSERT INTO entries(env_id, title, content, created_step, updated_step, updated_at, embedding) "
                "VALUES (?, ?, 'bulk vector', ?, ?, ?, ?)",
                ((env_id, titles[j], int(step), int(step), now, vectors[j].tobytes()) for j in range(n)))
            ids = [r[0] for r in c.execute("SELECT id FROM entries WHERE id > ? ORDER BY id", (before,))]
            if len(ids) != n:
                raise RuntimeError("bulk insert id mismatch")
            self._bump(c, "applied_ADD", n)
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        self._faiss_update(env_id, [], ids, vectors)
        self._enforce_capacity()
        self._settle()
        return ids

    # ------------------------------------------------------------------ counters (SQLite only)
    def record_retrieval(self, ids: Sequence[int], when: float) -> None:
        """Count one retrieval of each id (repeats count again) and set ``last_retrieved`` to ``when``
        (never moving it backwards). Unknown ids are ignored. Safe beside concurrent reads.
        Raises ``PermissionError`` on a read-only bank."""
        self._check_writable()
        if not len(ids):
            return
        c = self._conn()
        c.execute("BEGIN IMMEDIATE")
        try:
            c.executemany("UPDATE entries SET times_retrieved = times_retrieved + 1, "
                          "last_retrieved = MAX(last_retrieved, ?) WHERE id = ?",
                          [(float(when), int(i)) for i in ids])
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def record_outcome(self, ids: Sequence[int], success: bool) -> None:
        """Count the outcome of an episode guided by ``ids``. Unknown ids are ignored. Raises
        ``PermissionError`` on a read-only bank."""
        self._check_writable()
        if not len(ids):
            return
        col = "times_success" if success else "times_failure"
        c = self._conn()
        c.execute("BEGIN IMMEDIATE")
        try:
            c.executemany(f"UPDATE entries SET {col} = {col} + 1 WHERE id = ?", [(int(i),) for i in ids])
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------------ reads
    def get(self, ids: Sequence[int]) -> list[ExperienceEntry]:
        """Entries for ``ids`` in the given order; ids not in the bank are skipped."""
        ids = [int(i) for i in ids]
        if not ids:
            return []
        c = self._conn()
        found: dict[int, ExperienceEntry] = {}
        uniq = list(dict.fromkeys(ids))
        for s in range(0, len(uniq), _SQL_CHUNK):
            chunk = uniq[s:s + _SQL_CHUNK]
            for r in c.execute(f"{_SELECT_ENTRY} WHERE id IN ({','.join('?' * len(chunk))})", chunk):
                found[r[0]] = self._row_entry(r)
        return [found[i] for i in ids if i in found]

    def vectors(self, ids: Sequence[int]) -> np.ndarray:
        """The index vectors of ``ids`` (``(N, dim)`` float32, in the given order); ids not in the bank
        are skipped."""
        ids = [int(i) for i in ids]
        got: dict[int, np.ndarray] = {}
        c = self._conn()
        uniq = list(dict.fromkeys(ids))
        for s in range(0, len(uniq), _SQL_CHUNK):
            chunk = uniq[s:s + _SQL_CHUNK]
            for i, b in c.execute(f"SELECT id, embedding FROM entries WHERE id IN ({','.join('?' * len(chunk))})",
                                  chunk):
                got[i] = np.frombuffer(b, dtype=np.float32)
        rows = [got[i] for i in ids if i in got]
        return np.stack(rows) if rows else np.empty((0, self.dim), np.float32)

    def source_extractions(self) -> set[str]:
        """The extraction ids that wrote the entries now in the bank."""
        return {r[0] for r in self._conn().execute("SELECT DISTINCT source_extraction FROM entries")}

    def key_texts(self, ids: Sequence[int]) -> dict[int, str]:
        """``{id: the text the entry is keyed by}`` ("" for entries keyed by their own text before
        keys were stored)."""
        ids = list(dict.fromkeys(int(i) for i in ids))
        out: dict[int, str] = {}
        c = self._conn()
        for s in range(0, len(ids), _SQL_CHUNK):
            chunk = ids[s:s + _SQL_CHUNK]
            out.update(c.execute(f"SELECT id, key_text FROM entries WHERE id IN ({','.join('?' * len(chunk))})",
                                 chunk).fetchall())
        return out

    def entries(self, env_id: str | None = None) -> list[ExperienceEntry]:
        """All entries (of ``env_id`` if given), by id."""
        c = self._conn()
        if env_id is None:
            rows = c.execute(f"{_SELECT_ENTRY} ORDER BY id")
        else:
            rows = c.execute(f"{_SELECT_ENTRY} WHERE env_id=? ORDER BY id", (env_id,))
        return [self._row_entry(r) for r in rows]

    def __len__(self) -> int:
        return int(self._conn().execute("SELECT COUNT(*) FROM entries").fetchone()[0])

    def rejections(self) -> list[dict]:
        """The rejection log, oldest first."""
        rows = self._conn().execute("SELECT time, step, extraction_id, env_id, operation, reason "
                                    "FROM rejections ORDER BY id").fetchall()
        return [{"time": r[0], "step": r[1], "extraction_id": r[2], "env_id": r[3],
                 "operation": json.loads(r[4]), "reason": r[5]} for r in rows]

    def stats(self) -> dict:
        """Counts per env, retrieval and outcome totals, rejections by reason, applied ops, evictions."""
        c = self._conn()
        per_env, total, retrieved, succ, fail = {}, 0, 0, 0, 0
        for env, n, r, s, f in c.execute("SELECT env_id, COUNT(*), SUM(times_retrieved), SUM(times_success), "
                                         "SUM(times_failure) FROM entries GROUP BY env_id ORDER BY env_id"):
            per_env[env] = int(n)
            total, retrieved, succ, fail = total + n, retrieved + (r or 0), succ + (s or 0), fail + (f or 0)
        rejections = {reason: int(n) for reason, n in
                      c.execute("SELECT reason, COUNT(*) FROM rejections GROUP BY reason ORDER BY reason")}
        counters = dict(c.execute("SELECT name, value FROM counters").fetchall())
        return {
            "count": int(total),
            "per_env": per_env,
            "retrieved_total": int(retrieved),
            "retrieved_mean": (retrieved / total) if total else 0.0,
            "times_success": int(succ),
            "times_failure": int(fail),
            "rejections": rejections,
            "rejections_total": int(sum(rejections.values())),
            "applied": {k: int(counters.get(f"applied_{k}", 0)) for k in ("ADD", "UPDATE", "MERGE")},
            "evicted_total": int(counters.get("evicted", 0)),
            "index": self.index_kind,
            "shard_index": self.shard_kinds(),
            "capacity": self.capacity,
            "eviction": self.eviction,
        }

    def search_vectors(self, q: np.ndarray, k: int, env_id: str | None = None) -> list[list[tuple[int, float]]]:
        """Top-``k`` ``(id, cosine)`` per query row, best first; only ``env_id``'s entries if given.

        ``q``: ``(Q, dim)`` (or ``(dim,)``) float32 with unit-norm rows. One FAISS call per shard
        searched (one shard when ``env_id`` is given).
        """
        q = np.ascontiguousarray(q, dtype=np.float32)
        if q.ndim == 1:
            q = q[None, :]
        nq = q.shape[0]
        if k <= 0 or nq == 0:
            return [[] for _ in range(nq)]
        if env_id is not None:
            shard = self._shards.get(env_id)
            shards = [shard] if shard is not None and len(shard) else []
        else:
            shards = [s for s in list(self._shards.values()) if len(s)]
        if not shards:
            return [[] for _ in range(nq)]
        with _omp_threads(self.search_threads):
            found = [s.search(q, k) for s in shards]
        if len(found) == 1:
            dist, ids = found[0]
            return [[(i, d) for i, d in zip(ri, rd) if i >= 0] for ri, rd in zip(ids.tolist(), dist.tolist())]
        all_dist, all_ids = zip(*found)
        dist, ids = np.concatenate(all_dist, axis=1), np.concatenate(all_ids, axis=1)
        dist = np.where(ids >= 0, dist, -np.inf)
        order = np.argsort(-dist, axis=1, kind="stable")[:, :k]
        dist, ids = np.take_along_axis(dist, order, 1), np.take_along_axis(ids, order, 1)
        return [[(i, d) for i, d in zip(ri, rd) if i >= 0] for ri, rd in zip(ids.tolist(), dist.tolist())]

    def search(self, texts: Sequence[str], k: int, env_id: str | None = None) -> list[list[tuple[int, float]]]:
        """Embed ``texts`` (one batch) and :meth:`search_vectors`."""
        return self.search_vectors(self.embedder.encode(list(texts)), k, env_id)

    def shard_kinds(self) -> dict[str, str]:
        """``{env id: the index its shard searches with now}``: ``flat`` / ``ivf`` / ``hnsw`` (an
        ``ivf`` shard below ``ivf_min_train`` is reported as ``flat``: it is searched exactly)."""
        out = {}
        for env, shard in sorted(self._shards.items()):
            inner = shard.inner if isinstance(shard, _AutoShard) else shard
            if isinstance(inner, _IVFShard):
                out[env] = "ivf" if inner.ivf is not None else "flat"
            else:
                out[env] = "hnsw" if isinstance(inner, _HNSWShard) else "flat"
        return out

    # ------------------------------------------------------------------ inspection (tests)
    def _index_snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors) as held by the FAISS structures themselves (duplicates kept)."""
        parts = [s.snapshot() for s in self._shards.values()]
        if not parts:
            return np.empty(0, np.int64), np.empty((0, self.dim), np.float32)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _db_vectors(self) -> dict[int, np.ndarray]:
        return {i: np.frombuffer(b, dtype=np.float32) for i, b in
                self._conn().execute("SELECT id, embedding FROM entries")}

    def close(self) -> None:
        """Close this thread's connection and release the others (closed when their threads exit or
        when this object's thread-local storage is collected). Idempotent."""
        if self._closed:
            return
        c = getattr(self._local, "conn", None)
        if c is not None:
            try:
                if not self.read_only:
                    c.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error:
                pass
            c.close()
        self._closed = True
        self._local = threading.local()
        self._shards = {}

    def __enter__(self) -> ExperienceBank:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
