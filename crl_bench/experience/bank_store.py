"""The experience bank's SQLite layer: the schema, the columns added over time, read-only
connections, the check that a file is a bank, and the JSON written into its columns.

:class:`~crl_bench.experience.bank.ExperienceBank` is built on these; the tables are described in
its module's docstring ("Storage").
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args

from crl_bench.experience.types import Operation

__all__ = ["BANK_TABLES", "EVICTION_POLICIES", "ENTRY_COLS", "LATER_COLS", "SCHEMA", "SQL_CHUNK", "UTILITY_INIT",
           "EmbeddingDimError", "NotABankError", "check_bank", "connect_read_only", "op_json", "parents_json",
           "parse_parents"]


BANK_TABLES = ("entries", "rejections", "counters", "meta")    # what makes a SQLite file a bank
EvictionPolicy = Literal["fifo", "lru"]
"""Values of ``experience.eviction``: which entries a full bank removes first."""
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionPolicy)

UTILITY_INIT = 0.5
"""An entry's utility before any guided episode used it (RetroAgent, arXiv 2603.08561, section 3.3)."""

ENTRY_COLS = ("id", "env_id", "title", "content", "created_step", "updated_step", "source_extraction",
               "generation", "times_retrieved", "times_success", "times_failure", "last_retrieved")
# columns added after the first bank format, with the value an older bank's entries read as
LATER_COLS = {"votes": ("INTEGER NOT NULL DEFAULT 0", "0"),
               "parent_ids": ("TEXT NOT NULL DEFAULT ''", "''"),
               "origin": ("TEXT NOT NULL DEFAULT 'add'", "'add'"),
               "utility": (f"REAL NOT NULL DEFAULT {UTILITY_INIT}", str(UTILITY_INIT)),
               "source_case": ("TEXT NOT NULL DEFAULT ''", "''")}
SQL_CHUNK = 900

SCHEMA = """
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


def connect_read_only(path: Path) -> sqlite3.Connection:
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


def check_bank(c: sqlite3.Connection, path: Path) -> int:
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


def op_json(op: Operation) -> str:
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


def parse_parents(text: str | None) -> tuple[int, ...]:
    """The ``parent_ids`` column (a JSON list of ids, or empty) as a tuple; unreadable text gives ()."""
    if not text:
        return ()
    try:
        ids = json.loads(text)
        return tuple(int(i) for i in ids)
    except (ValueError, TypeError):
        return ()


def parents_json(ids: Sequence[int]) -> str:
    """``ids`` as the ``parent_ids`` column's JSON list ("" for none)."""
    return json.dumps([int(i) for i in ids]) if ids else ""
