"""The experience bank: SQLite (WAL) storage + FAISS vector index (docs/method.md).

This module holds the bank object: opening and restoring it, connections, the FAISS shards'
upkeep, reads, searches, counters, statistics and backups. The modules beside it hold the rest:

* :mod:`crl_bench.experience.bank_store`: the SQLite schema, read-only connections and the check
  that a file is a bank;
* :mod:`crl_bench.experience.bank_writes`: the operations (validation against the database, one
  transaction each), the merge pass's ``replace``, bulk imports and eviction;
* :class:`~crl_bench.experience.insights.InsightTable` and
  :class:`~crl_bench.experience.reflections.ReflectionTable`: the tables of the ``insights`` and
  ``reflections`` memory kinds, in those kinds' modules;
* :mod:`crl_bench.experience.vector_index`: the FAISS shards (index kinds ``auto`` / ``flat`` /
  ``ivf`` / ``hnsw``, their search rules and tuning measurements, OpenMP and BLAS thread settings);
* :mod:`crl_bench.experience.validation`: the rejection reasons and the checks of one operation
  that need no database.

Storage
    One SQLite file in WAL mode. Table ``entries`` holds every :class:`ExperienceEntry` field (column
    ``generation`` holds ``ExperienceEntry.extractor_version``: every bank file, of any version, uses
    that column name, so all open unchanged; the bank maps one to the other where it reads and writes
    entries), the unix time of the entry's last write (``updated_at``, used
    by LRU eviction), the text the entry is keyed by (``key_text``) and that text's embedding as
    float32 bytes.  The key is ``entry.text()``
    unless the writer gives another (the released keying: the retrieval query of the episode the entry
    was distilled from; see :meth:`ExperienceBank.apply`). Columns ``votes``, ``parent_ids`` (a JSON
    list) and ``origin`` hold the vote count and the lineage, ``utility`` the re-rank's moving average,
    ``source_case`` the raw case of the episode the entry was written from
    (:attr:`~crl_bench.experience.types.ExperienceEntry.source_case`); banks written before they existed
    are migrated when opened for writing and read with the defaults (0, no parents, ``add``, 0.5, no
    case) when opened read-only. Table ``rejections`` logs every refused operation (time,
    step, extraction id, env id, the operation as JSON, reason). Table ``counters`` keeps totals
    (operations applied per kind, evictions, entries deleted by votes, merge-pass results). Ids come
    from ``AUTOINCREMENT`` and are never reused,
    even after deletion or reopening. Opening an existing file restores the bank: entries are read
    back and the FAISS index is rebuilt from the stored embeddings (no re-embedding). Entries and
    counters change only inside one ``BEGIN IMMEDIATE`` ... ``COMMIT`` transaction per operation,
    bulk insert, eviction or counter update (``ROLLBACK`` on any error; ``ExperienceBank._write``);
    an operation refused before its transaction is logged in ``rejections`` on its own.

Vector index
    Inner product over L2-normalised embeddings (= cosine). **One index per env id** ("shard", made
    by :func:`~crl_bench.experience.vector_index.make_shard`), so a search filtered by env is exact
    and costs only that env's entries (no oversample-and-filter that can come back short when one
    env dominates the bank); ``env_id=None`` searches every shard and merges the per-shard top-k
    (exact merge). The default kind ``auto`` searches exactly (flat) up to 20,000 entries per shard
    and with HNSW above; ``flat``, ``ivf`` and ``hnsw`` force one kind. The rules and measurements
    are in :mod:`crl_bench.experience.vector_index`. FAISS is updated only after the SQLite commit
    succeeded; when a FAISS update or an ``auto`` switch fails, the shard is rebuilt from the
    embeddings stored in SQLite (with a warning). Searches run with ``search_threads`` OpenMP
    threads in the calling thread (default 1); the bank lowers FAISS's BLAS threshold to
    ``flat_blas_min_queries * dim`` (default 8 queries).

Operations (:meth:`ExperienceBank.apply`, :meth:`ExperienceBank.replace`)
    Each operation is validated (:func:`~crl_bench.experience.validation.check_operation`, then the
    targets against the database), then applied in its own SQLite transaction; the FAISS index is
    updated only after the commit succeeded. A rewrite (UPDATE, MERGE, a merge pass) deletes the
    entries it replaces and writes a new entry with a new id and fresh counters, as the released code
    deletes the old uid and adds a new one (so the retrieval re-rank sees a new entry); the new entry's
    ``parent_ids`` name the entries it replaced. A refused operation is logged in ``rejections`` and
    returned in ``ApplyResult.rejected``; it never raises and changes nothing else. Reasons: see
    :data:`~crl_bench.experience.validation.REJECTION_REASONS`. :meth:`ExperienceBank.add_vectors`
    inserts pre-computed vectors without validation (benchmarks, imports).

Thread-safety
    Writes (``apply``, ``add_vectors``) must be serialised by the caller (the experience
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
import sqlite3
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from crl_bench.experience.bank_store import (
    BANK_TABLES,
    ENTRY_COLS,
    EVICTION_POLICIES,
    LATER_COLS,
    SCHEMA,
    SQL_CHUNK,
    UTILITY_INIT,
    EmbeddingDimError,
    NotABankError,
    check_bank,
    connect_read_only,
    parse_parents,
)
from crl_bench.experience.bank_writes import EntryWrites
from crl_bench.experience.insights import InsightTable
from crl_bench.experience.reflections import ReflectionTable
from crl_bench.experience.types import OP_KINDS, ExperienceEntry
from crl_bench.experience.vector_index import (
    APPROX_KINDS,
    AUTO_THRESHOLD,
    INDEX_KINDS,
    AutoShard,
    Shard,
    lower_blas_threshold,
    make_shard,
    omp_threads,
    searched_kind,
)

__all__ = ["BANK_TABLES", "EVICTION_POLICIES", "UTILITY_INIT", "EmbeddingDimError", "ExperienceBank", "NotABankError"]

# ----------------------------------------------------------------------------- the bank
class ExperienceBank(EntryWrites, InsightTable, ReflectionTable):
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
        max_text_chars: longest accepted title and longest accepted content (0 = no limit, the default:
            the extractor's token budget bounds a lesson, as released).
        ivf_min_train: vectors a shard needs before its IVF is trained (exact search before).
        ivf_nprobe_fraction, ivf_min_scan: the adaptive nprobe rule (1/8 of the lists, at least
            10,000 vectors scanned).
        hnsw_m, hnsw_ef_construction: HNSW graph degree and build beam width.
        hnsw_ef_search, hnsw_ef_per_k: search beam width ``max(hnsw_ef_search, hnsw_ef_per_k * k, k)``
            for a k-NN query.
        hnsw_rebuild_min, hnsw_rebuild_fraction: rebuild a shard when its tombstones exceed
            ``max(hnsw_rebuild_min, hnsw_rebuild_fraction * live)``.
        auto_threshold, auto_index: ``index="auto"``: a shard of more than ``auto_threshold`` entries
            uses ``auto_index`` (``hnsw`` or ``ivf``), and flat again below half of it.
        search_threads: OpenMP threads per FAISS search (calling thread only; 0 = leave as is).
        flat_blas_min_queries: batches of at least this many queries use BLAS for exact search
            (lowers FAISS's process-wide ``distance_compute_blas_threshold``; 0 = leave it).
        read_only: open an existing bank without writing to it (SQLite ``mode=ro``: no schema, no
            WAL switch, no checkpoint; ``apply`` and the counters raise ``PermissionError``), for
            the evaluation of a finished run (tools that only inspect a bank use
            :meth:`open_readonly`). Raises ``FileNotFoundError`` when the file does not exist and
            :class:`NotABankError` when it is not a crl-bench bank; an existing bank whose stored
            embeddings have another dimension than ``embedder`` raises :class:`EmbeddingDimError`.

    Files: a bank is the ``.sqlite`` file together with its ``-wal`` and ``-shm`` files while a
    writer has it open or after a crash (committed entries may sit only in the ``-wal`` until a
    checkpoint); copy or move the three together.
    """

    def __init__(self, path: str | Path, embedder, capacity: int = 0, eviction: str = "fifo",
                 index: str = "auto", ivf_nlist: int = 2048, ivf_nprobe: int = 0, *,
                 max_text_chars: int = 0, ivf_min_train: int = 1024, ivf_nprobe_fraction: float = 0.125,
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
        lower_blas_threshold(flat_blas_min_queries, self.dim)
        self._cfg = {"ivf_nlist": ivf_nlist, "ivf_nprobe": ivf_nprobe, "ivf_min_train": ivf_min_train,
                     "ivf_nprobe_fraction": ivf_nprobe_fraction, "ivf_min_scan": ivf_min_scan,
                     "hnsw_m": hnsw_m, "hnsw_ef_construction": hnsw_ef_construction,
                     "hnsw_ef_search": hnsw_ef_search, "hnsw_ef_per_k": hnsw_ef_per_k,
                     "hnsw_rebuild_min": hnsw_rebuild_min, "hnsw_rebuild_fraction": hnsw_rebuild_fraction,
                     "auto_threshold": auto_threshold, "auto_index": auto_index}
        self.read_only = bool(read_only)
        self._local = threading.local()
        self._closed = False
        self._shards: dict[str, Shard] = {}
        if self.read_only:
            self._open_read_only()
            return
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        c = self._conn()
        mode = c.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise RuntimeError(f"could not put {self.path} in WAL mode (got {mode})")
        c.executescript(SCHEMA)
        cols = {r[1] for r in c.execute("PRAGMA table_info(entries)")}
        if "key_text" not in cols:                  # banks from <= 0.1
            c.execute("ALTER TABLE entries ADD COLUMN key_text TEXT NOT NULL DEFAULT ''")
        for name, (decl, _) in LATER_COLS.items():
            if name not in cols:
                c.execute(f"ALTER TABLE entries ADD COLUMN {name} {decl}")
        self._select_entry = self._entry_select(c)
        row = c.execute("SELECT value FROM meta WHERE key='dim'").fetchone()
        if row is None:
            c.execute("INSERT INTO meta(key, value) VALUES ('dim', ?)", (str(self.dim),))
        elif int(row[0]) != self.dim:
            raise EmbeddingDimError(f"{self.path} holds {row[0]}-dim embeddings, embedder gives {self.dim}")
        self._load_index()

    @classmethod
    def open_readonly(cls, path: str | Path, embedder: Any = None, **kwargs: Any) -> ExperienceBank:
        """Open an existing bank only to read it: the one way the tools that inspect a bank someone
        else wrote (``crl-bench report``, ``bank show``/``stats``, the check of ``eval --run``) open it.

        Nothing is written: not the file, not its journal mode, not a ``-wal``/``-shm`` beside a
        cleanly closed bank (SQLite ``mode=ro``, ``immutable`` without a ``-wal``); the schema is
        not migrated and no ``meta`` row is added. The file must be a crl-bench bank
        (:meth:`stored_dim`). Text that is not UTF-8 is read with U+FFFD in place of the bad bytes.

        Args:
            path: the ``.sqlite`` file.
            embedder: the embedder searches use; default a
                :class:`~crl_bench.experience.embedding.HashEmbedder` of the stored dimension
                (listing entries and statistics need no embedding, so no model is loaded).
            **kwargs: other :class:`ExperienceBank` arguments (default ``index="flat"``: exact, no
                graph to build).

        Returns:
            The bank, ``read_only``; close it (or use it as a context manager).

        Raises:
            FileNotFoundError: no file at ``path``.
            NotABankError: not SQLite, corrupt, or not a crl-bench bank (the message names the file).
            ValueError: ``embedder`` gives another dimension than the stored one.
        """
        from crl_bench.experience.embedding import HashEmbedder

        dim = cls.stored_dim(path)
        kwargs.setdefault("index", "flat")
        return cls(path, embedder if embedder is not None else HashEmbedder(dim), read_only=True, **kwargs)

    @staticmethod
    def stored_dim(path: str | Path) -> int:
        """Check that ``path`` is a crl-bench bank, read-only, and return its embedding dimension.

        Raises:
            FileNotFoundError: no file at ``path``.
            NotABankError: the file is not SQLite or is corrupt, lacks the bank's tables or columns,
                or records no valid dimension (an integer in 1..65536) in table ``meta``.
        """
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"no experience bank at {p}")
        c = connect_read_only(p)
        try:
            return check_bank(c, p)
        finally:
            c.close()

    def _open_read_only(self) -> None:
        """Open an existing bank for inspection or evaluation without writing a byte to it.

        Raises:
            FileNotFoundError: no file at ``path``.
            NotABankError: the file is not SQLite, is corrupt, or lacks the bank's tables, columns,
                its ``dim`` record or well-formed stored embeddings.
            EmbeddingDimError: the stored embeddings have another dimension than the embedder's.
        """
        if not self.path.is_file():
            raise FileNotFoundError(f"no experience bank at {self.path}")
        c = self._conn()
        stored = check_bank(c, self.path)
        if stored != self.dim:
            raise EmbeddingDimError(f"{self.path} holds {stored}-dim embeddings, embedder gives {self.dim}")
        try:
            self._select_entry = self._entry_select(c)
            self._load_index()
        except (sqlite3.DatabaseError, ValueError) as exc:   # corrupt pages, embeddings of the wrong size
            raise NotABankError(f"{self.path} is not a readable crl-bench experience bank: {exc}") from None

    @staticmethod
    def _entry_select(c: sqlite3.Connection) -> str:
        """``SELECT <entry columns> FROM entries`` for this file: the columns a bank written before
        ``votes``, ``parent_ids`` and ``origin`` existed lacks are read as their defaults."""
        cols = {r[1] for r in c.execute("PRAGMA table_info(entries)")}
        later = [name if name in cols else f"{default} AS {name}" for name, (_, default) in LATER_COLS.items()]
        return "SELECT " + ", ".join(ENTRY_COLS + tuple(later)) + " FROM entries"

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
                c = connect_read_only(self.path)
            else:
                c = sqlite3.connect(str(self.path), timeout=60.0, isolation_level=None)
                c.execute("PRAGMA synchronous=NORMAL")
                c.execute("PRAGMA busy_timeout=60000")
            self._local.conn = c
        return c

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction on this thread's connection: ``BEGIN IMMEDIATE`` (takes SQLite's
        write lock now, waiting up to the busy timeout), ``COMMIT`` when the block ends (also by
        ``return``), ``ROLLBACK`` and re-raise when the block or the commit raises. Yields the
        connection."""
        c = self._conn()
        c.execute("BEGIN IMMEDIATE")
        try:
            yield c
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def _shard(self, env_id: str, create: bool = True) -> Shard | None:
        shard = self._shards.get(env_id)
        if shard is None and create:
            shard = make_shard(self.index_kind, self.dim, self._cfg)
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
        """Let ``auto`` shards switch kind now that a write is complete (see
        :meth:`~crl_bench.experience.vector_index.AutoShard.settle`)."""
        for env, shard in list(self._shards.items()):
            if isinstance(shard, AutoShard):
                try:
                    shard.settle()
                except Exception as exc:  # noqa: BLE001 - any FAISS failure: SQLite holds the truth, rebuild
                    warnings.warn(f"FAISS index switch failed ({exc!r}); rebuilding shard {env!r} from SQLite",
                                  stacklevel=2)
                    self._rebuild_shard(env)

    def _rebuild_shard(self, env_id: str) -> None:
        rows = self._conn().execute("SELECT id, embedding FROM entries WHERE env_id=? ORDER BY id",
                                    (env_id,)).fetchall()
        shard = make_shard(self.index_kind, self.dim, self._cfg)
        if rows:
            vecs = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), self.dim)
            shard.add(np.asarray([r[0] for r in rows], dtype=np.int64), np.ascontiguousarray(vecs))
        if isinstance(shard, AutoShard):
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
                               updated_step=r[5], source_extraction=r[6], extractor_version=r[7],
                               times_retrieved=r[8], times_success=r[9], times_failure=r[10],
                               last_retrieved=r[11], votes=int(r[12] or 0), parent_ids=parse_parents(r[13]),
                               origin=str(r[14] or "add"), utility=float(r[15]), source_case=str(r[16] or ""))

    @staticmethod
    def _bump(c: sqlite3.Connection, name: str, by: int = 1) -> None:
        c.execute("INSERT INTO counters(name, value) VALUES (?, ?) "
                  "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value", (name, by))


    def counters(self) -> dict[str, int]:
        """The bank's running totals (table ``counters``: operations applied per kind, evictions,
        entries deleted by votes, merge-pass calls and results), as ``{name: value}``."""
        return {k: int(v) for k, v in self._conn().execute("SELECT name, value FROM counters")}

    def record_merge_calls(self, calls: int, failed: int) -> None:
        """Count the extractor calls of one merge pass (``failed``: those whose reply gave nothing
        usable); reported by :meth:`stats` under ``merge_pass``. Raises ``PermissionError`` on a
        read-only bank."""
        self._check_writable()
        with self._write() as c:
            self._bump(c, "merge_pass_calls", int(calls))
            self._bump(c, "merge_pass_calls_failed", int(failed))

    # ------------------------------------------------------------------ tables
    def _has_table(self, name: str) -> bool:
        return self._conn().execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?",
                                    (name,)).fetchone() is not None


    # ------------------------------------------------------------------ counters (SQLite only)
    def record_retrieval(self, ids: Sequence[int], when: float) -> None:
        """Count one retrieval of each id (repeats count again) and set ``last_retrieved`` to ``when``
        (never moving it backwards). Unknown ids are ignored. Safe beside concurrent reads.
        Raises ``PermissionError`` on a read-only bank."""
        self._check_writable()
        if not len(ids):
            return
        with self._write() as c:
            c.executemany("UPDATE entries SET times_retrieved = times_retrieved + 1, "
                          "last_retrieved = MAX(last_retrieved, ?) WHERE id = ?",
                          [(float(when), int(i)) for i in ids])

    def record_outcome(self, ids: Sequence[int], success: bool, utility_beta: float = 0.0) -> None:
        """Count the outcome of an episode guided by ``ids`` and move each entry's ``utility`` towards
        it: ``utility <- (1 - utility_beta) * utility + utility_beta * success`` (success 1 or 0;
        RetroAgent, arXiv 2603.08561, section 3.3; ``utility_beta`` 0 leaves it as it is). An id
        listed twice counts twice. Unknown ids are ignored.

        Raises:
            PermissionError: a read-only bank.
            ValueError: ``utility_beta`` outside [0, 1].
        """
        self._check_writable()
        if not 0.0 <= utility_beta <= 1.0:
            raise ValueError(f"utility_beta must be in [0, 1], got {utility_beta}")
        if not len(ids):
            return
        col = "times_success" if success else "times_failure"
        target = 1.0 if success else 0.0
        with self._write() as c:
            c.executemany(f"UPDATE entries SET {col} = {col} + 1, utility = (1 - ?) * utility + ? * ? WHERE id = ?",
                          [(float(utility_beta), float(utility_beta), target, int(i)) for i in ids])

    def last_retrieval_time(self) -> float:
        """The latest ``last_retrieved`` over the bank's entries (seconds since the epoch; 0.0 when
        no entry was ever retrieved): the bank's clock at the end of the training that used it."""
        row = self._conn().execute("SELECT COALESCE(MAX(last_retrieved), 0) FROM entries").fetchone()
        return float(row[0])

    def total_retrievals(self, env_id: str | None = None) -> int:
        """Sum of ``times_retrieved`` over the entries (of ``env_id``, or of the whole bank)."""
        c = self._conn()
        if env_id is None:
            row = c.execute("SELECT COALESCE(SUM(times_retrieved), 0) FROM entries").fetchone()
        else:
            row = c.execute("SELECT COALESCE(SUM(times_retrieved), 0) FROM entries WHERE env_id = ?",
                            (env_id,)).fetchone()
        return int(row[0])

    # ------------------------------------------------------------------ reads
    def get(self, ids: Sequence[int]) -> list[ExperienceEntry]:
        """Entries for ``ids`` in the given order; ids not in the bank are skipped."""
        ids = [int(i) for i in ids]
        if not ids:
            return []
        c = self._conn()
        found: dict[int, ExperienceEntry] = {}
        uniq = list(dict.fromkeys(ids))
        for s in range(0, len(uniq), SQL_CHUNK):
            chunk = uniq[s:s + SQL_CHUNK]
            for r in c.execute(f"{self._select_entry} WHERE id IN ({','.join('?' * len(chunk))})", chunk):
                found[r[0]] = self._row_entry(r)
        return [found[i] for i in ids if i in found]

    def vectors(self, ids: Sequence[int]) -> np.ndarray:
        """The index vectors of ``ids`` (``(N, dim)`` float32, in the given order); ids not in the bank
        are skipped."""
        ids = [int(i) for i in ids]
        got: dict[int, np.ndarray] = {}
        c = self._conn()
        uniq = list(dict.fromkeys(ids))
        for s in range(0, len(uniq), SQL_CHUNK):
            chunk = uniq[s:s + SQL_CHUNK]
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
        for s in range(0, len(ids), SQL_CHUNK):
            chunk = ids[s:s + SQL_CHUNK]
            out.update(c.execute(f"SELECT id, key_text FROM entries WHERE id IN ({','.join('?' * len(chunk))})",
                                 chunk).fetchall())
        return out

    def entries(self, env_id: str | None = None) -> list[ExperienceEntry]:
        """All entries (of ``env_id`` if given), by id."""
        c = self._conn()
        if env_id is None:
            rows = c.execute(f"{self._select_entry} ORDER BY id")
        else:
            rows = c.execute(f"{self._select_entry} WHERE env_id=? ORDER BY id", (env_id,))
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
        """Counts per env, retrieval and outcome totals, rejections by reason, applied operations per
        kind, votes (upvotes, downvotes, entries deleted by votes, entries with a non-zero count), the
        merge pass (extractor calls and failed calls, env passes applied and skipped, entries removed
        and written), lineage (entries per origin, entries that replaced others), evictions, the
        insight lists (``insights``: :meth:`_insight_stats`) and the reflections stored."""
        c = self._conn()
        per_env, total, retrieved, succ, fail = {}, 0, 0, 0, 0
        for env, n, r, s, f in c.execute("SELECT env_id, COUNT(*), SUM(times_retrieved), SUM(times_success), "
                                         "SUM(times_failure) FROM entries GROUP BY env_id ORDER BY env_id"):
            per_env[env] = int(n)
            total, retrieved, succ, fail = total + n, retrieved + (r or 0), succ + (s or 0), fail + (f or 0)
        rejections = {reason: int(n) for reason, n in
                      c.execute("SELECT reason, COUNT(*) FROM rejections GROUP BY reason ORDER BY reason")}
        counters = self.counters()
        origins = dict(c.execute("SELECT origin, COUNT(*) FROM (" + self._select_entry + ") GROUP BY origin"))
        voted = c.execute("SELECT COUNT(*), COALESCE(SUM(votes), 0) FROM (" + self._select_entry + ") "
                          "WHERE votes != 0").fetchone()
        with_parents = c.execute("SELECT COUNT(*) FROM (" + self._select_entry + ") "
                                 "WHERE parent_ids != ''").fetchone()[0]
        return {
            "count": int(total),
            "per_env": per_env,
            "retrieved_total": int(retrieved),
            "retrieved_mean": (retrieved / total) if total else 0.0,
            "times_success": int(succ),
            "times_failure": int(fail),
            "rejections": rejections,
            "rejections_total": int(sum(rejections.values())),
            "applied": {k: int(counters.get(f"applied_{k}", 0)) for k in OP_KINDS if k != "NONE"},
            "votes": {"upvotes": int(counters.get("votes_upvote", 0)),
                      "downvotes": int(counters.get("votes_downvote", 0)),
                      "deleted_by_vote": int(counters.get("deleted_by_vote", 0)),
                      "entries_voted": int(voted[0]), "votes_sum": int(voted[1])},
            "merge_pass": {"calls": int(counters.get("merge_pass_calls", 0)),
                           "calls_failed": int(counters.get("merge_pass_calls_failed", 0)),
                           "applied": int(counters.get("merge_pass_applied", 0)),
                           "skipped": int(counters.get("merge_pass_skipped", 0)),
                           "entries_removed": int(counters.get("merge_pass_removed", 0)),
                           "entries_written": int(counters.get("merge_pass_written", 0))},
            "lineage": {"by_origin": {k: int(v) for k, v in sorted(origins.items())},
                        "with_parents": int(with_parents)},
            "evicted_total": int(counters.get("evicted", 0)),
            "insights": self._insight_stats(counters),
            "reflections": self.reflection_count(),
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
        with omp_threads(self.search_threads):
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
        return {env: searched_kind(shard) for env, shard in sorted(self._shards.items())}

    # ------------------------------------------------------------------ inspection
    def index_snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, vectors)`` as held by the FAISS structures themselves, over all shards: ids int64
        ``(n,)``, vectors float32 ``(n, dim)`` read back from the indexes (not from SQLite), in no
        particular order; an id held twice appears twice, tombstoned HNSW vectors do not appear. For
        checking that the index matches the stored entries; reads every shard's vectors (O(n))."""
        parts = [s.snapshot() for s in self._shards.values()]
        if not parts:
            return np.empty(0, np.int64), np.empty((0, self.dim), np.float32)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _db_vectors(self) -> dict[int, np.ndarray]:
        return {i: np.frombuffer(b, dtype=np.float32) for i, b in
                self._conn().execute("SELECT id, embedding FROM entries")}

    def backup(self, dest: str | Path) -> None:
        """Write a consistent copy of the whole bank (entries, rejections, counters, meta, id sequence)
        into a new SQLite file ``dest`` with SQLite's online backup API (``sqlite3.Connection.backup``).

        The caller must hold off writers (the experience manager's write lock, or a drained manager);
        readers may go on. The copy is a complete database on its own (no -wal file): opening it
        with :class:`ExperienceBank` restores the bank and rebuilds the FAISS index from the stored
        embeddings, and AUTOINCREMENT ids continue where they were.

        Raises:
            FileExistsError: ``dest`` exists.
            sqlite3.Error: the copy failed (``dest`` is removed again).
        """
        dest = Path(dest)
        if dest.exists():
            raise FileExistsError(f"{dest} exists")
        dst = sqlite3.connect(str(dest))
        try:
            self._conn().backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")      # one self-contained file
        except BaseException:
            dst.close()
            dest.unlink(missing_ok=True)
            raise
        dst.close()

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
