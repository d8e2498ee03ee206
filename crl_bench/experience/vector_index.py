"""FAISS vector index of the experience bank: one shard per env id, four index kinds (docs/method.md).

The bank (:class:`~crl_bench.experience.bank.ExperienceBank`) keeps one shard per env id, built with
:func:`make_shard`; this module knows nothing of SQLite. Every shard holds ``(id, vector)`` rows:
ids are int64 entry ids (positive), vectors float32 ``(dim,)`` rows with unit L2 norm, and a search
scores by inner product (= cosine). All shards share the :class:`Shard` interface.

Index kinds
    * ``auto`` (the bank's default, :class:`AutoShard`): exact ``flat`` search while a shard holds
      at most ``auto_threshold`` (:data:`AUTO_THRESHOLD`, 20,000) vectors; when it grows past that,
      the shard is rebuilt once as ``auto_index`` (``hnsw``), and back as flat if it shrinks below
      half the threshold. Why 20,000: up to about that size single-query exact search stays within a
      ~1-2 ms p99 budget on a 2-core CPU, beyond it HNSW is several times faster at recall@16 ~0.99
      (docs/performance.md, "Retrieval: exact-search threshold and index settings"). HNSW rather than
      IVF because at 100k it kept equal or better recall at half IVF's p99, needs no retraining as the
      shard grows, and the switch is one graph build (under the write lock). The switch is
      decided once a write is complete (after capacity eviction: the bank calls
      :meth:`AutoShard.settle`), so the ``paper`` preset's 20,000-entry cap keeps every shard exact.
    * ``flat`` (:class:`FlatShard`): ``IndexIDMap2(IndexFlatIP)``, ids = entry ids. Exact.
    * ``ivf`` (:class:`IVFShard`): ``IndexIVFFlat`` (inner product, ids = entry ids, hash-table
      direct map so single ids can be removed and reconstructed). Until a shard holds
      ``ivf_min_train`` vectors it is searched exactly with a flat index. It is (re)trained from all
      its vectors when it first reaches that size and again each time it has doubled (or shrunk
      below a quarter) since the last training; ``nlist = min(ivf_nlist, n // 39)`` (FAISS wants
      >= 39 points per centroid; ``ivf_nlist`` 2048). Lists probed per query: ``ivf_nprobe`` if set
      (> 0), else ``ceil(nlist * max(ivf_nprobe_fraction, ivf_min_scan / n))`` with the current
      shard size ``n`` (defaults 1/8 and 10,000), i.e. about ``max(n / 8, 10000)`` vectors scanned:
      recall at a fixed fraction of lists falls as shards get smaller, so small shards scan a larger
      share (a shard of <= 10,000 is scanned whole; flat is cheaper there). The rule does not depend
      on ``k``.
    * ``hnsw`` (:class:`HNSWShard`): ``IndexHNSWFlat`` (inner product, ``hnsw_m`` 32,
      ``hnsw_ef_construction`` 80). efSearch of a k-NN query = ``max(hnsw_ef_search, hnsw_ef_per_k
      * k, k)`` (defaults 128 and 8: 128 up to k = 16, 256 at k = 32). HNSW cannot remove vectors,
      so deletions (MERGE targets, evictions, the old vector of an UPDATE) are **tombstones**: the
      internal label is marked dead and searches pass FAISS an ``IDSelectorBitmap`` of live labels,
      so dead vectors are never returned and no oversampling guess is needed. The shard is rebuilt
      from its live vectors when tombstones exceed ``max(hnsw_rebuild_min, hnsw_rebuild_fraction *
      live)``. Internal labels map to entry ids through an array kept beside the index.

    The defaults (IVF nlist 2048 / adaptive nprobe, HNSW efSearch ``max(128, 8k)``) keep recall@16
    >= 0.95 at 100k sentence-shaped entries with p99 well under 5 ms; the recall and latency of these
    and of other settings are in docs/performance.md ("Retrieval: exact-search threshold and index
    settings", measured with ``crl-bench bench retrieval``).

    GPU FAISS is not used (faiss-cpu here); the flat index is the one that would benefit.

Threads (:func:`omp_threads`, :func:`lower_blas_threshold`)
    OpenMP: the bank runs searches with ``search_threads`` OpenMP threads (default 1), set for the
    calling thread only (OpenMP's thread count is a per-thread setting) and restored after the call.
    On a 2-core CPU with a trainer busy beside it, FAISS's default 2 threads make a single-query
    search many times slower (docs/performance.md) because its threads wait on a barrier for a
    descheduled sibling; parallelism across queries comes from the manager's
    search threads and from batching. ``search_threads=0`` leaves OpenMP as it is (e.g. on a
    many-core machine).

    BLAS for batched exact search: FAISS computes exact inner products with BLAS only when
    ``n_queries * dim >= faiss.cvar.distance_compute_blas_threshold`` (128000 by default, i.e.
    >= 334 queries at dim 384), so a 64-query batch would run the same per-query SIMD scan as 64
    single searches. The bank lowers that process-wide threshold to ``flat_blas_min_queries * dim``
    (default 8 queries; it only ever lowers it), so such a batch runs as one BLAS product, several
    times faster (docs/performance.md); single queries are unchanged.
    ``flat_blas_min_queries=0`` leaves FAISS's threshold alone.

Thread-safety: a shard is not locked. ``add`` / ``remove`` / ``settle`` / ``rebuild`` must not
overlap each other or a search (the bank's caller serialises writes); searches may run
concurrently with each other.

FAISS is imported lazily (inside the functions that need it), so importing this module is cheap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, Protocol, get_args

import numpy as np

IndexKind = Literal["auto", "flat", "ivf", "hnsw"]
"""Index kinds a bank (and :func:`make_shard`) accepts: values of ``experience.index``."""
INDEX_KINDS: tuple[str, ...] = get_args(IndexKind)
#: approximate kinds, the choices of ``auto_index``
APPROX_KINDS = ("ivf", "hnsw")
#: ``index="auto"``: a shard of more than this many entries leaves exact search for ``auto_index``
AUTO_THRESHOLD = 20000


class Shard(Protocol):
    """What every shard kind offers (the bank uses nothing else, apart from :meth:`AutoShard.settle`).

    * ``len(shard)``: live vectors (int).
    * ``add(ids, vecs)``: ids int64 ``(n,)`` not already in the shard, vecs float32 ``(n, dim)``
      C-contiguous unit rows.
    * ``remove(ids)``: a sequence of int ids; ids not in the shard are ignored.
    * ``search(q, k)``: q float32 ``(Q, dim)`` C-contiguous, ``k >= 1``; returns ``(scores, ids)``,
      float32 and int64 ``(Q, k)``, best first, inner products; ``-1`` ids (with arbitrary scores)
      pad rows with fewer than ``k`` hits.
    * ``search_params(k)``: the FAISS ``SearchParameters`` a ``k``-NN search uses now (``None``:
      an exact search with no parameters).
    * ``snapshot()``: ``(ids, vecs)`` as held by the FAISS structures: int64 ``(n,)``, float32
      ``(n, dim)``; an id held twice appears twice (for consistency checks).
    """

    def __len__(self) -> int: ...

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None: ...

    def remove(self, ids: Sequence[int]) -> None: ...

    def search_params(self, k: int) -> Any: ...

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]: ...

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]: ...


class VectorStore:
    """Live ``(id, vector)`` rows of one shard, contiguous, O(1) removal by swapping in the last row.

    The copy of the vectors the IVF and HNSW shards retrain / rebuild from (FAISS cannot hand back
    the live rows of an HNSW graph with tombstones, nor cheaply those of an IVF index).

    Args:
        dim: vector dimension.

    Attributes:
        ids: int64 ``(capacity,)``, of which the first ``n`` are live.
        vecs: float32 ``(capacity, dim)``, rows matching ``ids``.
        n: number of live rows.
        pos: ``{id: row}`` of the live rows.
    """

    def __init__(self, dim: int):
        self.dim = dim
        self.ids = np.empty(0, dtype=np.int64)
        self.vecs = np.empty((0, dim), dtype=np.float32)
        self.n = 0
        self.pos: dict[int, int] = {}

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        """Append rows: ids int64 ``(m,)`` not yet stored, vecs float32 ``(m, dim)``. Storage grows
        by doubling."""
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
        """Drop the rows of ``ids`` (ids not stored are ignored); row order changes."""
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
        """Views of the live rows: ids int64 ``(n,)``, vecs float32 ``(n, dim)`` (not copies: valid
        until the next ``add`` / ``remove``)."""
        return self.ids[:self.n], self.vecs[:self.n]


def _flat_idmap(dim: int, ids: np.ndarray | None = None, vecs: np.ndarray | None = None):
    """A new ``IndexIDMap2(IndexFlatIP(dim))``, holding ``ids`` / ``vecs`` if given."""
    import faiss

    index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
    if ids is not None and len(ids):
        index.add_with_ids(np.ascontiguousarray(vecs), np.ascontiguousarray(ids))
    return index


def _flat_snapshot(index) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, vecs)`` held by an ``IndexIDMap2(IndexFlatIP)``: int64 ``(n,)``, float32 ``(n, dim)``."""
    import faiss

    ids = faiss.vector_to_array(index.id_map).astype(np.int64)
    vecs = index.index.reconstruct_n(0, index.ntotal) if index.ntotal else np.empty((0, index.d), np.float32)
    return ids, np.asarray(vecs, dtype=np.float32)


class FlatShard:
    """Exact search: ``IndexIDMap2(IndexFlatIP)`` (see :class:`Shard` for the methods' shapes).

    Args:
        dim: vector dimension.
        cfg: shard settings (see :func:`make_shard`); a flat shard reads none of them.
    """

    def __init__(self, dim: int, cfg: dict):
        self.dim = dim
        self.index = _flat_idmap(dim)

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        """Add ids int64 ``(n,)`` with vecs float32 ``(n, dim)``."""
        self.index.add_with_ids(vecs, ids)

    def remove(self, ids: Sequence[int]) -> None:
        """Remove ``ids`` (unknown ones are ignored)."""
        if len(ids):
            self.index.remove_ids(np.asarray(ids, dtype=np.int64))

    def search_params(self, k: int):
        """``None``: exact search takes no parameters."""
        return None

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` of q float32 ``(Q, dim)``: ``(scores, ids)``, each ``(Q, k)``."""
        return self.index.search(q, k)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, vecs)`` held by the index: int64 ``(n,)``, float32 ``(n, dim)``."""
        return _flat_snapshot(self.index)


class IVFShard:
    """``IndexIVFFlat`` once the shard holds ``ivf_min_train`` vectors, exact flat search before
    (rules: the module docstring; methods' shapes: :class:`Shard`).

    Args:
        dim: vector dimension.
        cfg: shard settings; reads ``ivf_nlist``, ``ivf_nprobe``, ``ivf_nprobe_fraction``,
            ``ivf_min_scan``, ``ivf_min_train`` (``KeyError`` if one is missing).

    Attributes:
        ivf: the trained ``IndexIVFFlat``, or ``None`` while the shard is searched exactly.
        flat: the exact ``IndexIDMap2`` while ``ivf`` is ``None``, else ``None``.
        trained_n: shard size at the last training (0 before any).
        trainings: number of trainings so far.
    """

    def __init__(self, dim: int, cfg: dict):
        self.dim = dim
        self.nlist_max = int(cfg["ivf_nlist"])
        self.nprobe_fixed = int(cfg["ivf_nprobe"])
        self.nprobe_fraction = float(cfg["ivf_nprobe_fraction"])
        self.min_scan = int(cfg["ivf_min_scan"])
        self.min_train = max(2, int(cfg["ivf_min_train"]))
        self.store = VectorStore(dim)
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
        """Add ids int64 ``(n,)`` with vecs float32 ``(n, dim)``; trains or retrains when the size
        asks for it."""
        self.store.add(ids, vecs)
        if self._needs_rebuild():
            self._rebuild()
        elif self.ivf is not None:
            self.ivf.add_with_ids(vecs, ids)
        else:
            self.flat.add_with_ids(vecs, ids)

    def remove(self, ids: Sequence[int]) -> None:
        """Remove ``ids`` (unknown ones are ignored); retrains (or falls back to flat) when the size
        asks for it."""
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
        """Top-``k`` of q float32 ``(Q, dim)``: ``(scores, ids)``, each ``(Q, k)``."""
        if self.ivf is None:
            return self.flat.search(q, k)
        return self.ivf.search(q, k, params=self.search_params(k))

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, vecs)`` held by the index (read from the inverted lists once trained): int64
        ``(n,)``, float32 ``(n, dim)``."""
        if self.ivf is None:
            return _flat_snapshot(self.flat)
        from faiss.contrib.inspect_tools import get_invlist

        all_ids, all_vecs = [], []
        for lst in range(self.ivf.nlist):
            ids, codes = get_invlist(self.ivf.invlists, lst)
            all_ids.append(ids)
            all_vecs.append(codes.view(np.float32).reshape(len(ids), self.dim))
        return np.concatenate(all_ids), np.concatenate(all_vecs)


class HNSWShard:
    """``IndexHNSWFlat`` with tombstones (HNSW has no removal) and a rebuild when they pile up
    (rules: the module docstring; methods' shapes: :class:`Shard`).

    Args:
        dim: vector dimension.
        cfg: shard settings; reads ``hnsw_m``, ``hnsw_ef_construction``, ``hnsw_ef_search``,
            ``hnsw_ef_per_k``, ``hnsw_rebuild_min``, ``hnsw_rebuild_fraction`` (``KeyError`` if one
            is missing).

    Attributes:
        index: the ``IndexHNSWFlat`` (internal labels 0..ntotal-1, live and dead).
        labels: int64 ``(ntotal,)``, internal label -> entry id.
        alive: bool ``(ntotal,)``, whether a label is live.
        rebuilds: number of rebuilds so far.
    """

    def __init__(self, dim: int, cfg: dict):
        self.dim = dim
        self.m = int(cfg["hnsw_m"])
        self.ef_construction = int(cfg["hnsw_ef_construction"])
        self.ef_search = int(cfg["hnsw_ef_search"])
        self.ef_per_k = int(cfg["hnsw_ef_per_k"])
        self.rebuild_min = int(cfg["hnsw_rebuild_min"])
        self.rebuild_fraction = float(cfg["hnsw_rebuild_fraction"])
        self.store = VectorStore(dim)
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
        """Add ids int64 ``(n,)`` with vecs float32 ``(n, dim)`` to the graph."""
        self.store.add(ids, vecs)
        self._append(ids, vecs)
        self._refresh_bits()

    def remove(self, ids: Sequence[int]) -> None:
        """Tombstone ``ids`` (unknown ones are ignored); rebuild when tombstones exceed
        ``max(hnsw_rebuild_min, hnsw_rebuild_fraction * live)``."""
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
        """Build a new graph from the live vectors (drops every tombstone)."""
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
        """Top-``k`` live entries of q float32 ``(Q, dim)``: ``(scores, entry ids)``, each ``(Q, k)``."""
        D, L = self.index.search(q, k, params=self.search_params(k))
        ids = np.where(L >= 0, self.labels[np.maximum(L, 0)] if len(self.labels) else -1, -1)
        return D, ids

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, vecs)`` of the live labels, vectors read back from the graph: int64 ``(n,)``,
        float32 ``(n, dim)``."""
        if not self.index.ntotal:
            return np.empty(0, np.int64), np.empty((0, self.dim), np.float32)
        vecs = self.index.reconstruct_n(0, self.index.ntotal)
        return self.labels[self.alive].copy(), np.asarray(vecs, np.float32)[self.alive]


class AutoShard:
    """Exact flat search while the shard is small, the approximate index (``auto_index``) once it
    holds more than ``auto_threshold`` vectors; back to flat when it shrinks below half of that.
    The switch happens only in :meth:`settle` (methods' shapes: :class:`Shard`).

    Args:
        dim: vector dimension.
        cfg: shard settings; reads ``auto_threshold``, ``auto_index`` (one of :data:`APPROX_KINDS`)
            and, when it switches, those of the ``auto_index`` kind (``KeyError`` if one is missing).

    Attributes:
        kind: what the shard searches with now, ``flat`` or ``auto_index``.
        inner: the shard of that kind that holds the vectors.
        switches: number of switches so far.
    """

    def __init__(self, dim: int, cfg: dict):
        self.dim = dim
        self.cfg = cfg
        self.threshold = int(cfg["auto_threshold"])
        self.approx = str(cfg["auto_index"])
        self.kind = "flat"
        self.inner = FlatShard(dim, cfg)
        self.switches = 0

    def __len__(self) -> int:
        return len(self.inner)

    def _switch(self, kind: str) -> None:
        ids, vecs = self.inner.snapshot()
        new = make_shard(kind, self.dim, self.cfg)
        if len(ids):
            new.add(np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(vecs, dtype=np.float32))
        self.inner, self.kind = new, kind
        self.switches += 1

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        """Add ids int64 ``(n,)`` with vecs float32 ``(n, dim)`` (never switches kind)."""
        self.inner.add(ids, vecs)

    def remove(self, ids: Sequence[int]) -> None:
        """Remove ``ids`` (unknown ones are ignored; never switches kind)."""
        self.inner.remove(ids)

    def settle(self) -> None:
        """Switch kind if the size asks for it. Called by the bank once a write is complete (after
        capacity eviction), so a bank held at its cap by eviction never switches on the transient
        extra entries of a write. Raises whatever FAISS raises while building the new index (the
        bank then rebuilds the shard from SQLite)."""
        if self.kind == "flat" and len(self.inner) > self.threshold:
            self._switch(self.approx)
        elif self.kind != "flat" and len(self.inner) < self.threshold // 2:
            self._switch("flat")

    def search_params(self, k: int):
        """The inner shard's search parameters of a ``k``-NN query."""
        return self.inner.search_params(k)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` of q float32 ``(Q, dim)`` through the inner shard: ``(scores, ids)``, each ``(Q, k)``."""
        return self.inner.search(q, k)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """The inner shard's ``(ids, vecs)``: int64 ``(n,)``, float32 ``(n, dim)``."""
        return self.inner.snapshot()


#: shard class of each index kind (the keys are :data:`INDEX_KINDS`)
SHARD_KINDS: dict[str, type] = {"flat": FlatShard, "ivf": IVFShard, "hnsw": HNSWShard, "auto": AutoShard}


def make_shard(kind: str, dim: int, cfg: dict) -> Shard:
    """A new, empty shard of index ``kind``.

    Args:
        kind: one of :data:`INDEX_KINDS`.
        dim: vector dimension.
        cfg: shard settings, the bank's keyword arguments of the same names: ``ivf_nlist``,
            ``ivf_nprobe``, ``ivf_nprobe_fraction``, ``ivf_min_scan``, ``ivf_min_train`` (ivf);
            ``hnsw_m``, ``hnsw_ef_construction``, ``hnsw_ef_search``, ``hnsw_ef_per_k``,
            ``hnsw_rebuild_min``, ``hnsw_rebuild_fraction`` (hnsw); ``auto_threshold``,
            ``auto_index`` plus those of ``auto_index`` (auto). The dict is kept, not copied, by an
            ``auto`` shard. Values are not range-checked here (the bank does that).

    Raises:
        ValueError: ``kind`` is not one of :data:`INDEX_KINDS`.
        KeyError: ``cfg`` lacks a setting the kind reads.
    """
    cls = SHARD_KINDS.get(kind)
    if cls is None:
        raise ValueError(f"index must be one of {INDEX_KINDS}, got {kind!r}")
    return cls(dim, cfg)


def searched_kind(shard: Shard) -> str:
    """What ``shard`` searches with now: ``flat``, ``ivf`` or ``hnsw`` (an :class:`AutoShard` reports
    its inner shard; an :class:`IVFShard` not yet trained reports ``flat``: it is searched exactly)."""
    inner = shard.inner if isinstance(shard, AutoShard) else shard
    if isinstance(inner, IVFShard):
        return "ivf" if inner.ivf is not None else "flat"
    return "hnsw" if isinstance(inner, HNSWShard) else "flat"


@contextmanager
def omp_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` OpenMP threads in the calling thread, then restore the previous count.

    OpenMP's thread count is a per-thread setting, so other threads are not affected. ``n <= 0``
    leaves it unchanged. Raises nothing of its own (the block's exceptions pass through, after the
    count is restored).
    """
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


def lower_blas_threshold(min_queries: int, dim: int) -> None:
    """Let FAISS use BLAS for exact search of batches of at least ``min_queries`` queries of ``dim``
    dimensions: lowers the process-wide ``faiss.cvar.distance_compute_blas_threshold`` (counted in
    ``n_queries * dim``) to ``min_queries * dim``; never raises it. ``min_queries <= 0`` leaves it
    alone (see the module docstring for the measurements)."""
    if min_queries > 0:
        import faiss

        want = int(min_queries) * dim
        if want < faiss.cvar.distance_compute_blas_threshold:
            faiss.cvar.distance_compute_blas_threshold = want
