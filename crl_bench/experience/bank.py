"""The experience bank: SQLite (WAL) storage + FAISS vector index (docs/method.md).

This module holds the storage, the transactions, the checks of operations that need the database,
eviction and statistics. Two modules beside it hold the rest:

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
    list) and ``origin`` hold the vote count and the lineage; banks written before they existed are
    migrated when opened for writing and read with the defaults (0, no parents, ``add``) when opened
    read-only. Table ``rejections`` logs every refused operation (time,
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
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from crl_bench.experience.insights import (
    APPLY_ORDER,
    INSIGHT_INIT,
    Insight,
    InsightOp,
    InsightResult,
    normalise,
)
from crl_bench.experience.types import OP_KINDS, VOTE_KINDS, WRITE_KINDS, ApplyResult, ExperienceEntry, Operation
from crl_bench.experience.validation import (
    REJECT_EMBED_FAILED,
    REJECT_UNKNOWN_TARGET,
    REJECT_WRITE_FAILED,
    REJECT_WRONG_ENV,
    check_operation,
)
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

__all__ = ["BANK_TABLES", "EVICTION_POLICIES", "ExperienceBank", "NotABankError"]

BANK_TABLES = ("entries", "rejections", "counters", "meta")    # what makes a SQLite file a bank
EVICTION_POLICIES = ("fifo", "lru")

UTILITY_INIT = 0.5
"""An entry's utility before any guided episode used it (RetroAgent, arXiv 2603.08561, section 3.3)."""

_ENTRY_COLS = ("id", "env_id", "title", "content", "created_step", "updated_step", "source_extraction",
               "generation", "times_retrieved", "times_success", "times_failure", "last_retrieved")
# columns added after the first bank format, with the value an older bank's entries read as
_LATER_COLS = {"votes": ("INTEGER NOT NULL DEFAULT 0", "0"),
               "parent_ids": ("TEXT NOT NULL DEFAULT ''", "''"),
               "origin": ("TEXT NOT NULL DEFAULT 'add'", "'add'"),
               "utility": (f"REAL NOT NULL DEFAULT {UTILITY_INIT}", str(UTILITY_INIT))}
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
    key_text TEXT NOT NULL DEFAULT '',
    votes INTEGER NOT NULL DEFAULT 0,
    parent_ids TEXT NOT NULL DEFAULT '',
    origin TEXT NOT NULL DEFAULT 'add'
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
CREATE TABLE IF NOT EXISTS insights (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    env_id TEXT NOT NULL,
    text TEXT NOT NULL,
    importance INTEGER NOT NULL,
    created_step INTEGER NOT NULL DEFAULT 0,
    updated_step INTEGER NOT NULL DEFAULT 0,
    source_call TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS reflections (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    env_id TEXT NOT NULL,
    task INTEGER NOT NULL,
    text TEXT NOT NULL,
    step INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS reflections_task ON reflections(env_id, task);
"""


class NotABankError(ValueError):
    """A file opened as an experience bank is not one (not SQLite, or without the bank's tables)."""


class EmbeddingDimError(ValueError):
    """A bank's stored embeddings have another dimension than the embedder it is opened with (the bank
    was filled with another ``experience.embedder``)."""


def _connect_read_only(path: Path) -> sqlite3.Connection:
    """A connection that never writes ``path`` or creates files beside it.

    ``mode=ro``: SQLite never writes the file. With a ``-wal`` beside it (a writer has it open, or
    crashed) its frames are read through the ``-shm`` index, so entries committed before a crash are
    seen; without one the file is complete and opened ``immutable``, so no ``-wal``/``-shm`` files
    are created either. ``trusted_schema=OFF``: a file from elsewhere cannot make reads run SQL
    functions from its schema (views, triggers, defaults). TEXT that is not UTF-8 is decoded with
    U+FFFD for the bad bytes instead of failing the whole read.
    """
    wal = path.with_name(path.name + "-wal").exists()
    uri = f"{path.resolve().as_uri()}?mode=ro" + ("" if wal else "&immutable=1")
    c = sqlite3.connect(uri, uri=True, timeout=60.0, isolation_level=None)
    c.text_factory = lambda b: b.decode("utf-8", "replace")
    c.execute("PRAGMA busy_timeout=60000")
    c.execute("PRAGMA trusted_schema=OFF")
    return c


def _check_bank(c: sqlite3.Connection, path: Path) -> int:
    """The embedding dimension of the bank on connection ``c``, after checking that it is one.

    Raises:
        NotABankError: not SQLite or corrupt; a table of :data:`BANK_TABLES` missing; ``entries``
            without the bank's columns; no integer ``dim`` in 1..65536 in table ``meta``.
    """
    try:
        tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        missing = [t for t in BANK_TABLES if t not in tables]
        if missing:
            raise NotABankError(f"{path} is not a crl-bench experience bank (no table {', '.join(missing)})")
        cols = {r[1] for r in c.execute("PRAGMA table_info(entries)")}
        if not {"id", "env_id", "title", "content", "embedding"} <= cols:
            raise NotABankError(f"{path} is not a crl-bench experience bank (table entries lacks the bank's "
                                "columns)")
        row = c.execute("SELECT value FROM meta WHERE key='dim'").fetchone()
    except sqlite3.DatabaseError as exc:            # not a database, or a corrupt one
        raise NotABankError(f"{path} is not a readable SQLite experience bank: {exc}") from None
    if row is None:
        raise NotABankError(f"{path} is not a crl-bench experience bank (no embedding dimension recorded in "
                            "table meta)")
    try:
        dim = int(row[0])
    except (TypeError, ValueError):
        dim = 0
    if not 1 <= dim <= 65536:
        raise NotABankError(f"{path} is not a crl-bench experience bank (its recorded embedding dimension "
                            f"{str(row[0])[:40]!r} is not an integer in 1..65536)")
    return dim


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


def _parse_parents(text: str | None) -> tuple[int, ...]:
    """The ``parent_ids`` column (a JSON list of ids, or empty) as a tuple; unreadable text gives ()."""
    if not text:
        return ()
    try:
        ids = json.loads(text)
        return tuple(int(i) for i in ids)
    except (ValueError, TypeError):
        return ()


def _parents_json(ids: Sequence[int]) -> str:
    return json.dumps([int(i) for i in ids]) if ids else ""


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
        c.executescript(_SCHEMA)
        cols = {r[1] for r in c.execute("PRAGMA table_info(entries)")}
        if "key_text" not in cols:                  # banks from <= 0.1
            c.execute("ALTER TABLE entries ADD COLUMN key_text TEXT NOT NULL DEFAULT ''")
        for name, (decl, _) in _LATER_COLS.items():
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
        c = _connect_read_only(p)
        try:
            return _check_bank(c, p)
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
        stored = _check_bank(c, self.path)
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
        later = [name if name in cols else f"{default} AS {name}" for name, (_, default) in _LATER_COLS.items()]
        return "SELECT " + ", ".join(_ENTRY_COLS + tuple(later)) + " FROM entries"

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
                c = _connect_read_only(self.path)
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
                               last_retrieved=r[11], votes=int(r[12] or 0), parent_ids=_parse_parents(r[13]),
                               origin=str(r[14] or "add"), utility=float(r[15]))

    @staticmethod
    def _bump(c: sqlite3.Connection, name: str, by: int = 1) -> None:
        c.execute("INSERT INTO counters(name, value) VALUES (?, ?) "
                  "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value", (name, by))

    # ------------------------------------------------------------------ validation (database side)
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
              extractor_version: int, key_text: str | None = None) -> ApplyResult:
        """Validate and apply ``ops`` in order (one transaction each), then enforce the capacity cap.

        ``key_text``: what the entries written are indexed by (embedded once for the whole call), e.g.
        the retrieval query of the episode they were distilled from (the released keying; a released
        ``update`` keeps the episode's key too); ``None`` or empty: each entry's own
        ``"title: content"``.

        ``extractor_version``: the extractor's update count, stamped on the entries written (stored in
        column ``generation``).

        * ADD inserts a new entry of ``env_id`` (origin ``add``).
        * UPDATE and MERGE delete their targets and insert one new entry (new id, origin ``update`` /
          ``merge``, ``parent_ids`` = the targets deleted) whose retrieval and outcome counters start
          at 0 and whose vote count is 0: the released code deletes the old uids and adds a new one, so
          its re-rank counters start fresh. A target already gone (deleted by an earlier operation of
          the same reply, say) is skipped, as released; the new entry is written all the same. A
          target that was never an id of this bank (a made-up number) rejects the operation
          (``unknown_target``).
        * UPVOTE / DOWNVOTE add +1 / -1 to the vote count of each target still in the bank; a
          DOWNVOTE that takes a count below 0 deletes the entry (released ``votes_count``), listed in
          ``ApplyResult.deleted_by_vote``. A vote none of whose targets is in the bank is rejected
          (``unknown_target``).
        * NONE changes nothing (reported as applied with id None).

        A target of another env is rejected (``target_other_env``). Refused operations are logged and
        returned, never raised.

        The caller must serialise writes (see the module docstring). Raises ``PermissionError`` on a
        bank opened with ``read_only`` (a programming error, not extractor input).
        """
        self._check_writable()
        res = ApplyResult()
        c = self._conn()
        checks = [check_operation(op, self.max_text_chars) for op in ops]
        to_embed = [i for i, (op, (reason, _)) in enumerate(zip(ops, checks))
                    if reason is None and op.kind in WRITE_KINDS]
        vec_of: dict[int, np.ndarray] = {}
        key_of: dict[int, str] = {}
        if to_embed:
            for i in to_embed:
                own = f"{str(ops[i].title).strip()}: {str(ops[i].content).strip()}"
                key_of[i] = key_text if key_text else own
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
            if op.kind in VOTE_KINDS:
                outcome = self._vote(op, targets, env_id, step, extraction_id)
                if isinstance(outcome, str):
                    res.rejected.append((op, outcome))
                else:
                    res.applied.append((op, None))
                    res.deleted_by_vote += outcome
                continue
            outcome = self._apply_one(op, targets, vec_of[i], env_id, step, extraction_id, extractor_version,
                                      key_of[i])
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

    def _targets_of(self, c: sqlite3.Connection, op: Operation, targets: tuple[int, ...], env_id: str, step: int,
                    extraction_id: str) -> list[int] | str:
        """The targets still in the bank (in order), or a rejection reason (logged inside the caller's
        transaction): ``unknown_target`` when one was never an id of this bank (above the id sequence:
        not a deleted entry but a made-up one), ``target_other_env`` when one belongs to another env.
        A target that was deleted (by an earlier operation, a vote, the merge pass) is left out."""
        if not targets:
            return []
        seq = c.execute("SELECT COALESCE(MAX(seq), 0) FROM sqlite_sequence WHERE name='entries'").fetchone()[0]
        if any(t > seq for t in targets):
            self._log_rejection(c, op, REJECT_UNKNOWN_TARGET, env_id, step, extraction_id)
            return REJECT_UNKNOWN_TARGET
        marks = ",".join("?" * len(targets))
        rows = dict(c.execute(f"SELECT id, env_id FROM entries WHERE id IN ({marks})", targets).fetchall())
        if any(env != env_id for env in rows.values()):
            self._log_rejection(c, op, REJECT_WRONG_ENV, env_id, step, extraction_id)
            return REJECT_WRONG_ENV
        return [t for t in targets if t in rows]

    def _one_operation(self, op: Operation, targets: tuple[int, ...], env_id: str, step: int, extraction_id: str,
                       body: Any) -> Any:
        """Run ``body(connection, live targets)`` in one write transaction for ``op`` after
        :meth:`_targets_of`; returns what ``body`` returns, or a rejection reason: a target check's,
        or ``write_failed`` when the database refused the write (rolled back by ``_write``: nothing of
        this operation stays, earlier ones are committed). A rejection ``body`` returns is committed
        with its log entry."""
        began = False
        try:
            with self._write() as c:
                began = True
                live = self._targets_of(c, op, targets, env_id, step, extraction_id)
                return live if isinstance(live, str) else body(c, live)
        except (sqlite3.Error, ValueError, OverflowError, UnicodeError) as exc:
            if not began:      # BEGIN itself failed (e.g. busy past the timeout): not this operation's fault
                raise
            warnings.warn(f"bank write refused ({exc!r}); operation rejected as {REJECT_WRITE_FAILED}", stacklevel=2)
            self._log_rejection(self._conn(), op, REJECT_WRITE_FAILED, env_id, step, extraction_id)
            return REJECT_WRITE_FAILED

    def _vote(self, op: Operation, targets: tuple[int, ...], env_id: str, step: int,
              extraction_id: str) -> list[int] | str:
        """One UPVOTE / DOWNVOTE in one transaction; returns the ids it deleted (a count below 0) or a
        rejection reason."""
        delta = 1 if op.kind == "UPVOTE" else -1

        def body(c: sqlite3.Connection, live: list[int]) -> list[int] | str:
            if not live:
                self._log_rejection(c, op, REJECT_UNKNOWN_TARGET, env_id, step, extraction_id)
                return REJECT_UNKNOWN_TARGET
            c.executemany("UPDATE entries SET votes = votes + ? WHERE id = ?", [(delta, t) for t in live])
            marks = ",".join("?" * len(live))
            gone = [r[0] for r in c.execute(f"SELECT id FROM entries WHERE id IN ({marks}) AND votes < 0", live)]
            if gone:
                c.execute(f"DELETE FROM entries WHERE id IN ({','.join('?' * len(gone))})", gone)
                self._bump(c, "deleted_by_vote", len(gone))
            self._bump(c, f"applied_{op.kind}")
            self._bump(c, f"votes_{op.kind.lower()}", len(live))
            return gone

        out = self._one_operation(op, targets, env_id, step, extraction_id, body)
        if not isinstance(out, str) and out:
            self._faiss_update(env_id, out, [], None)
        return out

    def _insert(self, c: sqlite3.Connection, env_id: str, title: str, content: str, step: int, extraction_id: str,
                extractor_version: int, now: float, blob: bytes, key: str, parents: Sequence[int],
                origin: str) -> int:
        """Insert one new entry (fresh counters, no votes) inside the caller's transaction; its id."""
        cur = c.execute(
            "INSERT INTO entries(env_id, title, content, created_step, updated_step, source_extraction, generation, "
            "updated_at, embedding, key_text, parent_ids, origin) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (env_id, title, content, int(step), int(step), str(extraction_id), int(extractor_version), now, blob, key,
             _parents_json(parents), origin))
        return int(cur.lastrowid)

    def _apply_one(self, op: Operation, targets: tuple[int, ...], vec: np.ndarray, env_id: str, step: int,
                   extraction_id: str, extractor_version: int, key: str) -> int | str:
        """One ADD / UPDATE / MERGE in one transaction; returns the new entry's id or a rejection reason."""
        title, content = str(op.title).strip(), str(op.content).strip()
        now = time.time()
        blob = np.ascontiguousarray(vec, dtype=np.float32).tobytes()
        origin = {"ADD": "add", "UPDATE": "update", "MERGE": "merge"}[op.kind]

        def body(c: sqlite3.Connection, live: list[int]) -> tuple[int, list[int]]:
            if live:
                c.execute(f"DELETE FROM entries WHERE id IN ({','.join('?' * len(live))})", live)
            new_id = self._insert(c, env_id, title, content, step, extraction_id, extractor_version, now, blob, key,
                                  live, origin)
            self._bump(c, f"applied_{op.kind}")
            return new_id, live

        out = self._one_operation(op, targets, env_id, step, extraction_id, body)
        if isinstance(out, str):
            return out
        new_id, removed = out
        self._faiss_update(env_id, removed, [new_id], vec[None, :])
        return new_id

    def replace(self, env_id: str, remove: Sequence[int], items: Sequence[tuple[str, str]], *, step: int,
                extraction_id: str, extractor_version: int) -> list[int] | None:
        """Apply one env's merge pass (the fold of :mod:`crl_bench.experience.manager`) in one transaction:
        delete the entries ``remove`` and write one new entry per ``(title, content)`` of ``items``,
        keyed by its own text (released: a merged entry is keyed by its content), origin ``fold``,
        ``parent_ids`` = ``remove``, fresh counters, crediting ``extraction_id``.

        As released (``merge_memory``), nothing is applied when an entry of ``remove`` is no longer
        in the bank (deleted since the pass read it): returns ``None``. Items whose text fails
        :func:`~crl_bench.experience.validation.check_operation` or cannot be embedded are left out
        (logged as rejections). Returns the new ids. The capacity cap is enforced afterwards.

        Raises:
            PermissionError: the bank was opened ``read_only``.
            sqlite3.Error: the database refused the write (rolled back: nothing changed).
        """
        self._check_writable()
        remove = list(dict.fromkeys(int(i) for i in remove))
        c = self._conn()
        good: list[tuple[str, str]] = []
        for title, content in items:
            op = Operation("ADD", title, content)
            reason, _ = check_operation(op, self.max_text_chars)
            if reason is None:
                good.append((str(title).strip(), str(content).strip()))
            else:
                self._log_rejection(c, Operation("MERGE", title, content, tuple(remove)), reason, env_id, step,
                                    extraction_id)
        texts = [f"{t}: {x}" for t, x in good]
        row = self._embed_each(list(dict.fromkeys(texts))) if texts else {}
        now = time.time()
        new_ids: list[int] = []
        vecs: list[np.ndarray] = []
        with self._write() as c:
            if remove:
                marks = ",".join("?" * len(remove))
                found = {r[0] for r in c.execute(f"SELECT id FROM entries WHERE id IN ({marks}) AND env_id = ?",
                                                 [*remove, env_id])}
                if len(found) != len(remove):
                    self._bump(c, "merge_pass_skipped")
                    return None
                c.execute(f"DELETE FROM entries WHERE id IN ({marks})", remove)
            for (title, content), text in zip(good, texts):
                if text not in row:
                    continue
                blob = np.ascontiguousarray(row[text], dtype=np.float32).tobytes()
                new_ids.append(self._insert(c, env_id, title, content, step, extraction_id, extractor_version, now,
                                            blob, text, remove, "fold"))
                vecs.append(row[text])
            self._bump(c, "merge_pass_applied")
            self._bump(c, "merge_pass_removed", len(remove))
            self._bump(c, "merge_pass_written", len(new_ids))
        self._faiss_update(env_id, remove, new_ids, np.stack(vecs) if vecs else None)
        self._enforce_capacity()
        self._settle()
        return new_ids

    def _enforce_capacity(self) -> list[int]:
        if self.capacity <= 0:
            return []
        with self._write() as c:
            excess = c.execute("SELECT COUNT(*) FROM entries").fetchone()[0] - self.capacity
            if excess <= 0:
                return []
            # fifo: by last write (an UPDATE re-queues the entry, as the released code's delete + re-add)
            order = "updated_at, id" if self.eviction == "fifo" else "MAX(last_retrieved, updated_at), id"
            victims = c.execute(f"SELECT id, env_id FROM entries ORDER BY {order} LIMIT ?", (excess,)).fetchall()
            ids = [v[0] for v in victims]
            for s in range(0, len(ids), _SQL_CHUNK):
                chunk = ids[s:s + _SQL_CHUNK]
                c.execute(f"DELETE FROM entries WHERE id IN ({','.join('?' * len(chunk))})", chunk)
            self._bump(c, "evicted", len(ids))
        per_env: dict[str, list[int]] = {}
        for i, env in victims:
            per_env.setdefault(env, []).append(i)
        for env, ids_env in per_env.items():
            self._faiss_update(env, ids_env, [], None)
        return ids

    def add_vectors(self, env_id: str, vectors: np.ndarray, *, step: int = 0,
                    titles: Sequence[str] | None = None) -> list[int]:
        """Insert pre-computed vectors as new entries of ``env_id`` (benchmarks, imports).

        Skips the embedder and the validation of :meth:`apply`: one SQLite transaction for all rows,
        one FAISS add, then the capacity cap and the ``auto`` switch as after :meth:`apply`. Each
        entry gets ``created_step = updated_step = step``, title ``titles[j]`` (default
        ``"bulk <j>"``), content ``"bulk vector"``, empty key text; counted as applied ADDs in
        :meth:`stats`. The caller serialises writes (see the module docstring).

        Args:
            env_id: env id of the new entries (their shard).
            vectors: float32 ``(n, dim)`` (or anything that reshapes to it, e.g. ``(dim,)`` for one
                row) with unit-norm, finite rows: stored and indexed as given (not normalised or
                checked).
            step: actor training step recorded as the entries' created / updated step.
            titles: ``n`` titles, or ``None`` for ``"bulk 0"``, ``"bulk 1"``, ...

        Returns:
            The new entry ids, in row order (``[]`` for ``n = 0``). Some of them may already be
            evicted again when ``n`` exceeds the free capacity.

        Raises:
            PermissionError: the bank was opened ``read_only``.
            ValueError: ``vectors`` does not reshape to ``(n, dim)``.
            IndexError: fewer than ``n`` titles.
            RuntimeError: the ids SQLite assigned are not the ``n`` new ones (rolled back).
            sqlite3.Error: the database refused the insert (rolled back).
        """
        self._check_writable()
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        n = len(vectors)
        if n == 0:
            return []
        titles = list(titles) if titles is not None else [f"bulk {j}" for j in range(n)]
        now = time.time()
        with self._write() as c:
            before = c.execute("SELECT COALESCE(MAX(seq), 0) FROM sqlite_sequence WHERE name='entries'").fetchone()[0]
            c.executemany(
                "INSERT INTO entries(env_id, title, content, created_step, updated_step, updated_at, embedding, "
                "origin) VALUES (?, ?, 'bulk vector', ?, ?, ?, ?, 'import')",
                ((env_id, titles[j], int(step), int(step), now, vectors[j].tobytes()) for j in range(n)))
            ids = [r[0] for r in c.execute("SELECT id FROM entries WHERE id > ? ORDER BY id", (before,))]
            if len(ids) != n:
                raise RuntimeError("bulk insert id mismatch")
            self._bump(c, "applied_ADD", n)
        self._faiss_update(env_id, [], ids, vectors)
        self._enforce_capacity()
        self._settle()
        return ids

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

    # ------------------------------------------------------------------ insights (expel)
    def insights(self, env_id: str | None = None) -> list[Insight]:
        """The insight list of ``env_id`` (or of every env), most important first, then oldest first
        (the order a guided episode and the extractor see; :mod:`crl_bench.experience.insights`).
        A bank written before insights existed has none."""
        c = self._conn()
        if not self._has_table("insights"):
            return []
        sql = "SELECT id, env_id, text, importance, created_step, updated_step, source_call FROM insights"
        args: tuple = ()
        if env_id is not None:
            sql, args = sql + " WHERE env_id = ?", (env_id,)
        rows = c.execute(sql + " ORDER BY importance DESC, id", args)
        return [Insight(int(r[0]), r[1], r[2], int(r[3]), int(r[4]), int(r[5]), r[6]) for r in rows]

    def apply_insights(self, ops: Sequence[InsightOp], shown: Sequence[Insight], *, env_id: str, step: int,
                       call_id: str) -> InsightResult:
        """Apply one reply's operations to ``env_id``'s insight list, in one transaction, with ExpeL's
        importance arithmetic (arXiv 2308.10144, section 4.2; released ``update_rules``):

        * operations go in :data:`~crl_bench.experience.insights.APPLY_ORDER` (downvotes, upvotes,
          edits, adds), each naming an insight by its number in ``shown`` (the list the extractor
          was shown);
        * ADD writes a new insight of importance 2, unless its text repeats one on the list
          (``duplicate``);
        * EDIT replaces the text and adds 1; an EDIT to the same text counts as an UPVOTE;
        * UPVOTE adds 1; DOWNVOTE takes 1 away and removes an insight that reaches 0;
        * an operation on an insight no longer on the list (another call removed it) is rejected
          (``gone``), as is a number outside ``shown`` (``unknown_number``).

        Rejections are logged in the bank's rejection log and returned, never raised. Counters
        ``insight_<KIND>`` and ``insights_removed`` keep the totals.

        Raises:
            PermissionError: a read-only bank.
        """
        self._check_writable()
        res = InsightResult()
        order = {k: n for n, k in enumerate(APPLY_ORDER)}
        with self._write() as c:
            for op in sorted(ops, key=lambda o: order.get(o.kind, len(order))):
                if op.kind == "ADD":
                    live = {normalise(r[0]) for r in c.execute("SELECT text FROM insights WHERE env_id = ?",
                                                                 (env_id,))}
                    if normalise(op.text) in live:
                        self._reject_insight(c, res, op, "duplicate", env_id, step, call_id)
                        continue
                    cur = c.execute("INSERT INTO insights(env_id, text, importance, created_step, updated_step, "
                                    "source_call) VALUES (?, ?, ?, ?, ?, ?)",
                                    (env_id, op.text, INSIGHT_INIT, int(step), int(step), call_id))
                    res.applied.append((op, int(cur.lastrowid)))
                    self._bump(c, "insight_ADD")
                    continue
                if not 1 <= op.number <= len(shown):
                    self._reject_insight(c, res, op, "unknown_number", env_id, step, call_id)
                    continue
                target = shown[op.number - 1]
                row = c.execute("SELECT text, importance FROM insights WHERE id = ? AND env_id = ?",
                                (target.id, env_id)).fetchone()
                if row is None:
                    self._reject_insight(c, res, op, "gone", env_id, step, call_id)
                    continue
                kind = op.kind
                if kind == "EDIT" and normalise(op.text) == normalise(row[0]):
                    kind = "UPVOTE"
                importance = int(row[1]) + (-1 if kind == "DOWNVOTE" else 1)
                if importance <= 0:
                    c.execute("DELETE FROM insights WHERE id = ?", (target.id,))
                    res.removed.append(target.id)
                    self._bump(c, "insights_removed")
                elif kind == "EDIT":
                    c.execute("UPDATE insights SET text = ?, importance = ?, updated_step = ?, source_call = ? "
                              "WHERE id = ?", (op.text, importance, int(step), call_id, target.id))
                else:
                    c.execute("UPDATE insights SET importance = ?, updated_step = ? WHERE id = ?",
                              (importance, int(step), target.id))
                res.applied.append((op if kind == op.kind else InsightOp(kind, op.number), target.id))
                self._bump(c, f"insight_{kind}")
        return res

    def _reject_insight(self, c: sqlite3.Connection, res: InsightResult, op: InsightOp, reason: str, env_id: str,
                        step: int, call_id: str) -> None:
        res.rejected.append((op, reason))
        c.execute("INSERT INTO rejections(time, step, extraction_id, env_id, operation, reason) "
                  "VALUES (?, ?, ?, ?, ?, ?)",
                  (time.time(), int(step), str(call_id), str(env_id),
                   json.dumps({"kind": op.kind, "number": op.number, "text": op.text, "list": "insights"}), reason))

    # ------------------------------------------------------------------ reflections (reflexion)
    def _has_table(self, name: str) -> bool:
        return self._conn().execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?",
                                    (name,)).fetchone() is not None

    def add_reflections(self, rows: Sequence[tuple[str, int, str, int]]) -> None:
        """Store ``(env_id, task, text, step)`` reflections (:mod:`crl_bench.experience.reflections`),
        in order, in one transaction. Raises ``PermissionError`` on a read-only bank."""
        self._check_writable()
        if not rows:
            return
        with self._write() as c:
            c.executemany("INSERT INTO reflections(env_id, task, text, step) VALUES (?, ?, ?, ?)",
                          [(str(e), int(t), str(x), int(s)) for e, t, x, s in rows])

    def reflections(self, env_id: str, task: int, limit: int = 3) -> list[str]:
        """The most recent ``limit`` reflections on ``env_id``'s task ``task``, oldest first (none in a
        bank written before reflections existed)."""
        if limit <= 0 or not self._has_table("reflections"):
            return []
        rows = self._conn().execute("SELECT text FROM reflections WHERE env_id = ? AND task = ? ORDER BY id DESC "
                                    "LIMIT ?", (env_id, int(task), int(limit))).fetchall()
        return [r[0] for r in reversed(rows)]

    def recent_reflections(self, env_id: str | None = None, limit: int = 20) -> list[tuple[str, int, str, int]]:
        """The ``limit`` most recent reflections as ``(env_id, task, text, step)``, newest first, of one env
        or (``env_id`` None) of all; ``[]`` in a bank written before reflections existed."""
        if limit <= 0 or not self._has_table("reflections"):
            return []
        where, args = ("WHERE env_id = ? ", (env_id,)) if env_id is not None else ("", ())
        rows = self._conn().execute(f"SELECT env_id, task, text, step FROM reflections {where}ORDER BY id DESC "
                                    "LIMIT ?", (*args, int(limit))).fetchall()
        return [(str(e), int(t), str(x), int(s)) for e, t, x, s in rows]

    def reflection_count(self, env_id: str | None = None) -> int:
        """Reflections stored, over all tasks (of ``env_id`` if given)."""
        if not self._has_table("reflections"):
            return 0
        if env_id is None:
            return int(self._conn().execute("SELECT COUNT(*) FROM reflections").fetchone()[0])
        return int(self._conn().execute("SELECT COUNT(*) FROM reflections WHERE env_id = ?", (env_id,)).fetchone()[0])

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
        for s in range(0, len(uniq), _SQL_CHUNK):
            chunk = uniq[s:s + _SQL_CHUNK]
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

    def _insight_stats(self, counters: dict[str, int]) -> dict:
        """The insight lists' part of :meth:`stats`: insights per env, their importance sum, and the
        operations applied per kind and the insights removed over the bank's life."""
        per_env: dict[str, int] = {}
        importance = 0
        for i in self.insights():
            per_env[i.env_id] = per_env.get(i.env_id, 0) + 1
            importance += i.importance
        return {"count": sum(per_env.values()), "per_env": dict(sorted(per_env.items())), "importance_sum": importance,
                "applied": {k: int(counters.get(f"insight_{k}", 0)) for k in ("ADD", "EDIT", "UPVOTE", "DOWNVOTE")},
                "removed": int(counters.get("insights_removed", 0))}

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
