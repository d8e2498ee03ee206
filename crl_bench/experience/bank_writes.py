"""The writes of the experience bank: validating operations against the database and applying
them, one SQLite transaction each, then updating the FAISS shards (docs/method.md).

:class:`EntryWrites` is mixed into :class:`~crl_bench.experience.bank.ExperienceBank` and uses its
plumbing (``_conn``, ``_write``, ``_bump``, ``_check_writable``, ``_faiss_update``, ``_settle``,
``embedder``, ``dim``, ``capacity``, ``eviction``, ``max_text_chars``). The rules (what each
operation does, the rejection reasons, the released behaviour they follow) are in the method
docstrings below and in the bank module's docstring ("Operations").
"""

from __future__ import annotations

import sqlite3
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from crl_bench.experience.bank_store import SQL_CHUNK, op_json, parents_json
from crl_bench.experience.types import VOTE_KINDS, WRITE_KINDS, ApplyResult, Operation
from crl_bench.experience.validation import (
    REJECT_EMBED_FAILED,
    REJECT_UNKNOWN_TARGET,
    REJECT_WRITE_FAILED,
    REJECT_WRONG_ENV,
    check_operation,
)

__all__ = ["EntryWrites"]


class EntryWrites:
    """The bank's entry writes: :meth:`apply`, :meth:`replace`, :meth:`add_vectors` and the capacity
    cap (a mixin of :class:`~crl_bench.experience.bank.ExperienceBank`; see the module docstring)."""

    # ------------------------------------------------------------------ validation (database side)
    def _log_rejection(self, c: sqlite3.Connection, op: Operation, reason: str, env_id: str, step: int,
                       extraction_id: str) -> None:
        """Record a refused operation (outside or inside the caller's transaction); a log write the
        database refuses is reported as a warning, never raised (the refusal itself still stands)."""
        try:
            c.execute("INSERT INTO rejections(time, step, extraction_id, env_id, operation, reason) "
                      "VALUES (?, ?, ?, ?, ?, ?)", (time.time(), int(step), str(extraction_id), str(env_id),
                                                    op_json(op), reason))
        except (sqlite3.Error, ValueError, OverflowError, UnicodeError) as exc:
            warnings.warn(f"could not log a rejected bank operation ({reason}): {exc!r}", stacklevel=2)

    # ------------------------------------------------------------------ writes
    def apply(self, ops: list[Operation], *, env_id: str, step: int, extraction_id: str,
              extractor_version: int, key_text: str | None = None, source_case: str = "") -> ApplyResult:
        """Validate and apply ``ops`` in order (one transaction each), then enforce the capacity cap.

        ``key_text``: what the entries written are indexed by (embedded once for the whole call), e.g.
        the retrieval query of the episode they were distilled from (the released keying; a released
        ``update`` keeps the episode's key too); ``None`` or empty: each entry's own
        ``"title: content"``.

        ``extractor_version``: the extractor's update count, stamped on the entries written (stored in
        column ``generation``).

        ``source_case``: the raw case of the episode the operations were distilled from, stored on each
        entry written (:attr:`~crl_bench.experience.types.ExperienceEntry.source_case`); ``""`` (a merge
        call, no episode): an UPDATE / MERGE entry takes the case of its first target that has one.

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
                                      key_of[i], source_case)
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
                origin: str, source_case: str = "") -> int:
        """Insert one new entry (fresh counters, no votes) inside the caller's transaction; its id."""
        cur = c.execute(
            "INSERT INTO entries(env_id, title, content, created_step, updated_step, source_extraction, generation, "
            "updated_at, embedding, key_text, parent_ids, origin, source_case) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (env_id, title, content, int(step), int(step), str(extraction_id), int(extractor_version), now, blob, key,
             parents_json(parents), origin, str(source_case)))
        return int(cur.lastrowid)

    @staticmethod
    def _parent_case(c: sqlite3.Connection, parents: Sequence[int]) -> str:
        """The ``source_case`` of the first of ``parents`` (in their order) that has one, else ``""``
        (read before the parents are deleted)."""
        ids = [int(p) for p in parents]
        rows = {}
        for lo in range(0, len(ids), SQL_CHUNK):
            chunk = ids[lo:lo + SQL_CHUNK]
            rows.update(c.execute(f"SELECT id, source_case FROM entries WHERE id IN ({','.join('?' * len(chunk))})",
                                  chunk).fetchall())
        return next((str(rows[p]) for p in ids if rows.get(p)), "")

    def _apply_one(self, op: Operation, targets: tuple[int, ...], vec: np.ndarray, env_id: str, step: int,
                   extraction_id: str, extractor_version: int, key: str, source_case: str = "") -> int | str:
        """One ADD / UPDATE / MERGE in one transaction; returns the new entry's id or a rejection reason."""
        title, content = str(op.title).strip(), str(op.content).strip()
        now = time.time()
        blob = np.ascontiguousarray(vec, dtype=np.float32).tobytes()
        origin = {"ADD": "add", "UPDATE": "update", "MERGE": "merge"}[op.kind]

        def body(c: sqlite3.Connection, live: list[int]) -> tuple[int, list[int]]:
            case = source_case or (self._parent_case(c, live) if live else "")
            if live:
                c.execute(f"DELETE FROM entries WHERE id IN ({','.join('?' * len(live))})", live)
            new_id = self._insert(c, env_id, title, content, step, extraction_id, extractor_version, now, blob, key,
                                  live, origin, case)
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
        ``parent_ids`` = ``remove``, fresh counters, crediting ``extraction_id``, the ``source_case`` of
        the first entry of ``remove`` that has one.

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
                case = self._parent_case(c, remove)
                c.execute(f"DELETE FROM entries WHERE id IN ({marks})", remove)
            else:
                case = ""
            for (title, content), text in zip(good, texts):
                if text not in row:
                    continue
                blob = np.ascontiguousarray(row[text], dtype=np.float32).tobytes()
                new_ids.append(self._insert(c, env_id, title, content, step, extraction_id, extractor_version, now,
                                            blob, text, remove, "fold", case))
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
            for s in range(0, len(ids), SQL_CHUNK):
                chunk = ids[s:s + SQL_CHUNK]
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
