"""Experience bank: operations, rejections, persistence, eviction, indexes, retrieval re-rank, threads."""

from __future__ import annotations

import math
import random
import sqlite3
import threading
import time

import numpy as np
import pytest
from tests_helpers import run_in_threads

from crl_bench.experience.bank import ExperienceBank
from crl_bench.experience.embedding import HashEmbedder, SentenceEmbedder
from crl_bench.experience.locks import RWLock
from crl_bench.experience.retrieval import Retriever
from crl_bench.experience.types import Operation as Op
from crl_bench.experience.validation import (
    REJECT_ADD_TARGETS,
    REJECT_BAD_TEXT,
    REJECT_EMBED_FAILED,
    REJECT_EMPTY_TEXT,
    REJECT_MERGE_TARGETS,
    REJECT_TOO_LONG,
    REJECT_UNKNOWN_KIND,
    REJECT_UNKNOWN_TARGET,
    REJECT_UPDATE_TARGETS,
    REJECT_VOTE_TARGETS,
    REJECT_WRITE_FAILED,
    REJECT_WRONG_ENV,
    REJECTION_REASONS,
    check_operation,
)
from crl_bench.experience.vector_index import make_shard, searched_kind

EMB = HashEmbedder(64)
KINDS = ("flat", "ivf", "hnsw")
VOCAB = [f"w{i}" for i in range(400)]


def make(tmp_path, name="bank.db", **kw) -> ExperienceBank:
    return ExperienceBank(tmp_path / name, EMB, **kw)


def apply(bank, ops, env="e", step=1, ext="x1", version=0):
    return bank.apply(list(ops), env_id=env, step=step, extraction_id=ext, extractor_version=version)


def add(bank, title, content, env="e", step=1) -> int:
    res = apply(bank, [Op("ADD", title, content)], env=env, step=step)
    assert not res.rejected, res.rejected
    return res.applied[0][1]


def random_texts(n, seed=0, words=8):
    rng = random.Random(seed)
    out = set()
    while len(out) < n:
        out.add(" ".join(rng.sample(VOCAB, words)))
    return sorted(out)


def check_index_consistent(bank):
    """FAISS holds exactly the SQLite ids, once each, with the stored vectors."""
    ids, vecs = bank.index_snapshot()
    ids = ids.tolist()
    assert len(ids) == len(set(ids)), "an id is in the index twice"
    db = bank._db_vectors()
    assert set(ids) == set(db)
    for i, v in zip(ids, vecs):
        np.testing.assert_allclose(v, db[i], atol=1e-6)


def full_state(bank):
    ids, vecs = bank.index_snapshot()
    order = np.argsort(ids)
    counters = bank._conn().execute("SELECT name, value FROM counters ORDER BY name").fetchall()
    return ([tuple(vars(e).values()) for e in bank.entries()], ids[order].tolist(), vecs[order].copy(),
            bank._db_vectors().keys(), counters)


# ------------------------------------------------------------------------------------ embedders
def test_hash_embedder_deterministic_and_normalised():
    a = EMB.encode(["open the door", "open the door", "walk north", ""])
    assert a.shape == (4, 64) and a.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(a[0], a[1])
    np.testing.assert_array_equal(HashEmbedder(64).encode(["open the door"])[0], a[0])


class _FakeST:
    def __init__(self):
        self.calls = []

    def get_embedding_dimension(self):
        return 8

    def encode(self, texts, **kw):
        self.calls.append(list(texts))
        return np.stack([np.arange(1, 9, dtype=np.float32) * (1 + len(t)) for t in texts])


def test_sentence_embedder_cache_lru_and_threads():
    emb = object.__new__(SentenceEmbedder)
    fake = _FakeST()
    emb._setup(fake, model_name="fake", device="cpu", batch_size=4, cache_size=3)
    out = emb.encode(["a", "bb", "a"])
    assert out.shape == (3, 8) and fake.calls == [["a", "bb"]]        # duplicates embedded once
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-6)
    emb.encode(["a"])
    assert len(fake.calls) == 1                                        # cache hit
    emb.encode(["c", "d"])                                             # evicts "bb" (least recent)
    emb.encode(["bb"])
    assert fake.calls[-1] == ["bb"]

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(200):
            t = [rng.choice("abcdefg") * rng.randint(1, 3) for _ in range(3)]
            v = emb.encode(t)
            np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)

    errors = run_in_threads(worker, 6, join_timeout=10)
    assert not errors and emb.cache_info()["size"] <= 3


@pytest.mark.slow
def test_sentence_embedder_real_model():
    emb = SentenceEmbedder()
    assert emb.dim == 384
    v = emb.encode(["use the key on the locked door", "open the locked door with the key",
                    "walk north to reach the stairs"])
    assert v.shape == (3, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2]
    again = emb.encode(["open the locked door with the key"])
    np.testing.assert_allclose(again[0], v[1], atol=1e-6)
    assert emb.cache_info()["hits"] >= 1


# ------------------------------------------------------------------------------------ operations
@pytest.mark.parametrize("kind", KINDS)
def test_add_update_merge_none(tmp_path, kind):
    bank = make(tmp_path, index=kind, ivf_min_train=4)
    res = apply(bank, [Op("ADD", "go north", "walk north to find the stairs"),
                       Op("ADD", "open door", "apply the key to a locked door"),
                       Op("NONE"),
                       Op("ADD", "push boulder", "push the boulder into the river")], step=3, ext="ex-a", version=2)
    assert [i for _, i in res.applied] == [1, 2, None, 3] and not res.rejected and not res.evicted
    e1 = bank.get([1])[0]
    assert (e1.env_id, e1.title, e1.content, e1.created_step, e1.updated_step, e1.source_extraction,
            e1.extractor_version) == ("e", "go north", "walk north to find the stairs", 3, 3, "ex-a", 2)
    before = full_state(bank)
    assert apply(bank, [Op("NONE")]).applied == [(Op("NONE"), None)]
    assert full_state(bank)[0] == before[0]

    bank.record_retrieval([1, 1], when=100.0)
    bank.record_outcome([1], True)
    bank.record_outcome([2], False)
    bank.record_retrieval([2], when=50.0)
    apply(bank, [Op("UPVOTE", targets=(1,))])
    # UPDATE: the released delete + new uid: a new entry (new id) with fresh counters, no votes, the
    # replaced entry as its parent
    res = apply(bank, [Op("UPDATE", "stairs", "the stairs are often to the east", (1,))], step=7, ext="ex-b",
                version=3)
    assert res.applied[0][1] == 4 and bank.get([1]) == []
    u = bank.get([4])[0]
    assert (u.title, u.content, u.created_step, u.updated_step, u.source_extraction, u.extractor_version) == \
        ("stairs", "the stairs are often to the east", 7, 7, "ex-b", 3)
    assert (u.times_retrieved, u.times_success, u.times_failure, u.last_retrieved, u.votes) == (0, 0, 0, 0.0, 0)
    assert (u.parent_ids, u.origin) == ((1,), "update")
    top = bank.search(["stairs: the stairs are often to the east"], 1, "e")[0][0]
    assert top[0] == 4 and top[1] == pytest.approx(1.0, abs=1e-5)
    check_index_consistent(bank)

    # MERGE: targets removed, one new entry with fresh counters and both parents
    res = apply(bank, [Op("MERGE", "doors and stairs", "find the key, then the stairs", (4, 2, 4))],
                step=9, ext="ex-c", version=4)
    (op, new_id), = res.applied
    assert new_id == 5 and bank.get([4, 2]) == []
    m = bank.get([5])[0]
    assert (m.times_retrieved, m.times_success, m.times_failure, m.last_retrieved) == (0, 0, 0, 0.0)
    assert (m.created_step, m.updated_step, m.source_extraction, m.extractor_version) == (9, 9, "ex-c", 4)
    assert (m.parent_ids, m.origin) == ((4, 2), "merge")
    assert [e.id for e in bank.entries()] == [3, 5] and len(bank) == 2
    hits = bank.search(["go north: walk north to find the stairs"], 10, "e")[0]
    assert {i for i, _ in hits} <= {3, 5}
    check_index_consistent(bank)
    lineage = bank.stats()["lineage"]
    assert lineage == {"by_origin": {"add": 1, "merge": 1}, "with_parents": 1}
    bank.close()


def test_rewritten_entries_start_fresh_so_the_rerank_favours_them(tmp_path):
    """Released: an update deletes the old uid (and its usage counters) and adds a new one, so the
    re-rank (frequency penalty, recency) sees a new entry. An UPDATE that kept the counters pushed a
    rewritten lesson below an equally similar fresh one."""
    bank = make(tmp_path)
    a = add(bank, "north", "the stairs are north of the door")
    b = add(bank, "north again", "the stairs are north of the door!")
    now = time.time()
    for _ in range(10):
        bank.record_retrieval([a], when=now)
    res = apply(bank, [Op("UPDATE", "north", "the stairs are north of the door", (a,))])
    new = res.applied[0][1]
    r = Retriever(bank, k=1, oversample=4, top1_demote_p=0.0, seed=0)
    got = r.retrieve(["north: the stairs are north of the door"], ["e"], now=now + 1)[0]
    assert got[0].id == new and got[0].times_retrieved == 0 and b != new
    bank.close()


def test_votes(tmp_path):
    """UPVOTE / DOWNVOTE (released votes_count): +1 / -1 on each target still in the bank; a count below
    0 deletes the entry (a new entry's first downvote deletes it); deleted targets are skipped, made-up
    ones and other envs' rejected; stats count them."""
    bank = make(tmp_path)
    a, b, c = (add(bank, f"t{i}", f"lesson number {i}") for i in range(3))
    other = add(bank, "o", "lesson of another env", env="f")
    res = apply(bank, [Op("UPVOTE", targets=(a, b)), Op("DOWNVOTE", targets=(a,)), Op("DOWNVOTE", targets=(c,))])
    assert [(o.kind, i) for o, i in res.applied] == [("UPVOTE", None), ("DOWNVOTE", None), ("DOWNVOTE", None)]
    assert res.deleted_by_vote == [c] and bank.get([c]) == []
    assert {e.id: e.votes for e in bank.entries("e")} == {a: 0, b: 1}
    res = apply(bank, [Op("DOWNVOTE", targets=(a, c)), Op("UPVOTE", targets=(c,)), Op("UPVOTE", targets=(999,)),
                       Op("UPVOTE", targets=(other,)), Op("UPVOTE", targets=())])
    assert res.deleted_by_vote == [a] and [o.kind for o, _ in res.applied] == ["DOWNVOTE"]
    assert [r for _, r in res.rejected] == [REJECT_UNKNOWN_TARGET, REJECT_UNKNOWN_TARGET, REJECT_WRONG_ENV,
                                            REJECT_VOTE_TARGETS]
    st = bank.stats()
    assert st["applied"]["UPVOTE"] == 1 and st["applied"]["DOWNVOTE"] == 3
    assert st["votes"] == {"upvotes": 2, "downvotes": 3, "deleted_by_vote": 2, "entries_voted": 1, "votes_sum": 1}
    check_index_consistent(bank)
    assert [i for i, _ in bank.search(["t0: lesson number 0"], 5, "e")[0]] == [b]
    bank.close()


def test_replace_is_the_merge_pass_transaction(tmp_path):
    """One env's merge pass: the replaced entries go, the new lessons come (keyed by their own text,
    origin fold, the replaced ids as parents, the crediting extraction as source); nothing happens
    when an entry to replace is already gone (released optimistic check)."""
    bank = make(tmp_path)
    ids = [add(bank, f"t{i}", f"lesson number {i}") for i in range(4)]
    keep = add(bank, "other env", "not touched", env="f")
    new = bank.replace("e", ids[:3], [("joined", "lessons zero to two in one"), ("", "no title")], step=5,
                       extraction_id="merge-call", extractor_version=2)
    assert len(new) == 1 and bank.get(ids[:3]) == []
    e = bank.get(new)[0]
    assert (e.title, e.origin, e.parent_ids, e.source_extraction, e.extractor_version, e.created_step) == \
        ("joined", "fold", tuple(ids[:3]), "merge-call", 2, 5)
    assert bank.key_texts(new) == {new[0]: "joined: lessons zero to two in one"}
    assert [e.id for e in bank.entries("e")] == [ids[3], new[0]] and bank.get([keep])
    assert bank.rejections()[-1]["reason"] == REJECT_EMPTY_TEXT
    assert bank.replace("e", [ids[0], ids[3]], [("x", "y z")], step=6, extraction_id="m2",
                        extractor_version=2) is None                 # ids[0] is gone: skipped
    assert len(bank.entries("e")) == 2
    bank.record_merge_calls(3, 1)
    st = bank.stats()["merge_pass"]
    assert st == {"calls": 3, "calls_failed": 1, "applied": 1, "skipped": 1, "entries_removed": 3,
                  "entries_written": 1}
    check_index_consistent(bank)
    bank.close()


def test_banks_without_the_vote_and_lineage_columns_open(tmp_path):
    """A bank written before votes, parent_ids and origin existed reads with the defaults read-only
    (nothing written) and is migrated when opened for writing."""
    bank = make(tmp_path)
    add(bank, "old", "an entry of an older bank")
    path = bank.path
    bank.close()
    with sqlite3.connect(path) as c:
        for col in ("votes", "parent_ids", "origin"):
            c.execute(f"ALTER TABLE entries DROP COLUMN {col}")
    c.close()
    ro = ExperienceBank(path, EMB, read_only=True)
    e = ro.entries()[0]
    assert (e.votes, e.parent_ids, e.origin) == (0, (), "add") and ro.stats()["lineage"]["by_origin"] == {"add": 1}
    ro.close()
    with sqlite3.connect(path) as c:
        assert "votes" not in {r[1] for r in c.execute("PRAGMA table_info(entries)")}
    c.close()
    bank = make(tmp_path)
    apply(bank, [Op("UPVOTE", targets=(1,))])
    assert bank.get([1])[0].votes == 1
    bank.close()


def test_extractor_version_lives_in_the_generation_column(tmp_path):
    """The file format did not change with the attribute's name: column ``generation`` holds
    ``ExperienceEntry.extractor_version``, both ways (a bank written before the rename reads the same)."""
    bank = make(tmp_path)
    apply(bank, [Op("ADD", "go north", "walk north")], ext="ex-a", version=7)
    path = bank.path
    bank.close()
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT generation FROM entries WHERE id = 1").fetchone() == (7,)
        c.execute("UPDATE entries SET generation = 11 WHERE id = 1")
    c.close()
    bank = make(tmp_path)
    assert bank.get([1])[0].extractor_version == 11
    bank.close()


def test_mixed_batch_order_and_partial(tmp_path):
    bank = make(tmp_path)
    res = apply(bank, [Op("ADD", "a", "first"), Op("UPDATE", "b", "x", (42,)), Op("ADD", "c", "third"),
                       Op("MERGE", "m", "merged", (1, 2))])
    assert [(o.kind, i) for o, i in res.applied] == [("ADD", 1), ("ADD", 2), ("MERGE", 3)]
    assert res.rejected == [(Op("UPDATE", "b", "x", (42,)), REJECT_UNKNOWN_TARGET)]   # never an id here
    assert [e.id for e in bank.entries()] == [3]
    # targets already merged away: skipped as released, the lesson is still written (no parents left)
    res = apply(bank, [Op("MERGE", "m2", "merged again", (1, 2)), Op("UPDATE", "u", "rewrite", (3,)),
                       Op("UPDATE", "u2", "rewrite of a rewritten entry", (3,))])
    assert [i for _, i in res.applied] == [4, 5, 6] and not res.rejected
    assert [(e.id, e.parent_ids) for e in bank.entries()] == [(4, ()), (5, (3,)), (6, ())]


REJECT_CASES = [
    (Op("DELETE", "t", "c", (1,)), REJECT_UNKNOWN_KIND),
    (Op("add", "t", "c"), REJECT_UNKNOWN_KIND),
    (Op("ADD", "", "content"), REJECT_EMPTY_TEXT),
    (Op("ADD", "title", "   "), REJECT_EMPTY_TEXT),
    (Op("UPDATE", "title", "", (1,)), REJECT_EMPTY_TEXT),
    (Op("MERGE", "", "merged", (1, 2)), REJECT_EMPTY_TEXT),
    (Op("ADD", "title", "x" * 1001), REJECT_TOO_LONG),           # with max_text_chars=1000
    (Op("UPVOTE", "", "", ()), REJECT_VOTE_TARGETS),
    (Op("UPDATE", "t" * 1001, "content", (1,)), REJECT_TOO_LONG),
    (Op("ADD", "title", "content", (1,)), REJECT_ADD_TARGETS),
    (Op("UPDATE", "title", "content", ()), REJECT_UPDATE_TARGETS),
    (Op("UPDATE", "title", "content", (1, 2)), REJECT_UPDATE_TARGETS),
    (Op("MERGE", "title", "content", (1,)), REJECT_MERGE_TARGETS),
    (Op("MERGE", "title", "content", (2, 2)), REJECT_MERGE_TARGETS),
    (Op("UPDATE", "title", "content", (999,)), REJECT_UNKNOWN_TARGET),
    (Op("UPDATE", "title", "content", ("one",)), REJECT_UNKNOWN_TARGET),
    (Op("MERGE", "title", "content", (1, 999)), REJECT_UNKNOWN_TARGET),
    (Op("UPDATE", "title", "content", (3,)), REJECT_WRONG_ENV),
    (Op("MERGE", "title", "content", (1, 3)), REJECT_WRONG_ENV),
    # ids outside SQLite's integer range or not finite: these raised OverflowError mid-reply before
    (Op("UPDATE", "title", "content", (99999999999999999999,)), REJECT_UNKNOWN_TARGET),
    (Op("UPDATE", "title", "content", (float("inf"),)), REJECT_UNKNOWN_TARGET),
    (Op("MERGE", "title", "content", (1, float("-inf"))), REJECT_UNKNOWN_TARGET),
    (Op("UPDATE", "title", "content", (-1,)), REJECT_UNKNOWN_TARGET),
    (Op("UPDATE", "title", "content", 7), REJECT_UNKNOWN_TARGET),
    # a lone surrogate cannot be stored as UTF-8 (raised UnicodeEncodeError before)
    (Op("ADD", "ti\ud800tle", "content"), REJECT_BAD_TEXT),
    (Op("UPDATE", "title", "con\udfffent", (1,)), REJECT_BAD_TEXT),
]
# reasons that depend on the embedder or the database, tested below
RUNTIME_REASONS = {REJECT_EMBED_FAILED, REJECT_WRITE_FAILED}


def test_every_reason_is_covered():
    assert {r for _, r in REJECT_CASES} | RUNTIME_REASONS == set(REJECTION_REASONS)


def test_static_checks_need_no_bank():
    """check_operation alone gives every reason of REJECT_CASES except those that need the database
    (a well-formed id that is not in the bank, or is in another env)."""
    for op, reason in REJECT_CASES:
        got, _ = check_operation(op, max_text_chars=1000)
        if got is None:
            assert reason in (REJECT_UNKNOWN_TARGET, REJECT_WRONG_ENV), op
        else:
            assert got == reason, op
    assert check_operation(Op("MERGE", "t", "c", (3, 2.0, 3)), 1000) == (None, (3, 2))
    assert check_operation(Op("NONE", targets=("x",)), 1000) == (None, ())
    assert check_operation(Op("ADD", "t", "c" * 11), 10)[0] == REJECT_TOO_LONG


def test_vector_index_factory_and_bulk_path(tmp_path):
    with pytest.raises(ValueError, match="index must be one of"):
        make_shard("lsh", 4, {})
    shard = make_shard("flat", 4, {})
    shard.add(np.array([7], np.int64), np.eye(4, dtype=np.float32)[:1])
    _, ids = shard.search(np.eye(4, dtype=np.float32)[:1], 2)
    assert ids.tolist() == [[7, -1]] and searched_kind(shard) == "flat"
    bank = make(tmp_path)
    ids = bank.add_vectors("e", EMB.encode(["one", "two"]), step=3)
    assert ids == [1, 2] and [(e.title, e.created_step) for e in bank.entries()] == [("bulk 0", 3), ("bulk 1", 3)]
    assert bank.stats()["applied"]["ADD"] == 2
    check_index_consistent(bank)
    bank.close()
    ro = ExperienceBank(tmp_path / "bank.db", EMB, read_only=True)
    with pytest.raises(PermissionError):
        ro.add_vectors("e", EMB.encode(["three"]))
    ro.close()


def test_bad_operations_in_a_reply_apply_the_rest(tmp_path):
    """A reply mixing good and hostile operations: each good one applied, each bad one rejected and
    logged, nothing raised (OverflowError / UnicodeEncodeError escaped apply() before)."""
    bank = make(tmp_path)
    ops = [Op("ADD", "a", "first"), Op("UPDATE", "b", "x", (99999999999999999999,)),
           Op("ADD", "\ud800", "lone surrogate"), Op("MERGE", "m", "x", (1, float("inf"))),
           Op("ADD", "c", "second")]
    res = apply(bank, ops)
    assert [i for _, i in res.applied] == [1, 2]
    assert [r for _, r in res.rejected] == [REJECT_UNKNOWN_TARGET, REJECT_BAD_TEXT, REJECT_UNKNOWN_TARGET]
    log = bank.rejections()
    assert [r["reason"] for r in log] == [r for _, r in res.rejected]
    assert log[1]["operation"]["title"] == "\ud800"        # logged with an escape, read back as given
    check_index_consistent(bank)


class _FailingEmbedder:
    """Raises on any text containing "boom", embeds the rest like EMB."""
    dim = EMB.dim

    def encode(self, texts):
        if any("boom" in t for t in texts):
            raise RuntimeError("embedder down")
        return EMB.encode(texts)


def test_embedder_failure_rejects_only_that_operation(tmp_path):
    bank = ExperienceBank(tmp_path / "b.db", _FailingEmbedder())
    with pytest.warns(UserWarning, match="embedding a bank entry failed"):
        res = apply(bank, [Op("ADD", "a", "fine"), Op("ADD", "b", "boom"), Op("ADD", "c", "also fine")])
    assert [i for _, i in res.applied] == [1, 2]
    assert res.rejected == [(Op("ADD", "b", "boom"), REJECT_EMBED_FAILED)]
    assert bank.rejections()[0]["reason"] == REJECT_EMBED_FAILED
    check_index_consistent(bank)


def test_database_refusal_rolls_back_one_operation(tmp_path):
    """A write the database refuses (here a trigger) is rolled back and rejected, the others apply."""
    bank = make(tmp_path)
    bank._conn().execute("CREATE TRIGGER no_bad BEFORE INSERT ON entries WHEN NEW.title = 'bad' "
                         "BEGIN SELECT RAISE(ABORT, 'refused'); END")
    with pytest.warns(UserWarning, match="bank write refused"):
        res = apply(bank, [Op("ADD", "a", "one"), Op("ADD", "bad", "two"), Op("ADD", "c", "three")])
    assert [o.title for o, _ in res.applied] == ["a", "c"]
    assert res.rejected == [(Op("ADD", "bad", "two"), REJECT_WRITE_FAILED)]
    assert [e.title for e in bank.entries()] == ["a", "c"]
    assert bank.rejections()[0]["reason"] == REJECT_WRITE_FAILED
    check_index_consistent(bank)


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
@pytest.mark.parametrize("op,reason", REJECT_CASES, ids=[f"{o.kind}-{r}" for o, r in REJECT_CASES])
def test_rejection_changes_nothing(tmp_path, kind, op, reason):
    bank = make(tmp_path, index=kind, max_text_chars=1000)
    add(bank, "a", "lesson one")
    add(bank, "b", "lesson two")
    add(bank, "c", "other env lesson", env="other")
    before = full_state(bank)
    res = apply(bank, [op], env="e", step=5, ext="ex-bad")
    assert res.applied == [] and res.evicted == []
    assert res.rejected == [(op, reason)]
    after = full_state(bank)
    assert after[0] == before[0] and after[1] == before[1] and after[4] == before[4]
    np.testing.assert_array_equal(after[2], before[2])
    log = bank.rejections()
    assert len(log) == 1 and log[0]["reason"] == reason and log[0]["step"] == 5
    assert log[0]["extraction_id"] == "ex-bad" and log[0]["operation"]["kind"] == op.kind
    assert bank.stats()["rejections"] == {reason: 1}
    check_index_consistent(bank)


# ------------------------------------------------------------------------------------ persistence
@pytest.mark.parametrize("kind", KINDS)
def test_persistence_across_reopen(tmp_path, kind):
    texts = random_texts(60, seed=1)
    bank = make(tmp_path, index=kind, ivf_min_train=20)
    ids = [i for _, i in apply(bank, [Op("ADD", f"t{j}", t) for j, t in enumerate(texts)]).applied]
    apply(bank, [Op("UPDATE", "updated", texts[0] + " extra words", (ids[0],)),
                 Op("MERGE", "merged", texts[1], (ids[1], ids[-1]))])     # the largest id is deleted
    bank.record_retrieval(ids[2:5], when=123.0)
    bank.record_outcome(ids[2:3], True)
    queries = [texts[0], texts[1], texts[10], "w1 w2 w3 w4"]
    k = 5 if kind == "hnsw" else 100                      # flat / ivf: every entry, so ties cannot cut
    results = bank.search(queries, k, "e")
    entries = bank.entries()
    max_id = max(e.id for e in entries)
    bank.close()

    again = make(tmp_path, index=kind, ivf_min_train=20)
    assert again.entries() == entries
    got = again.search(queries, k, "e")
    for r1, r2 in zip(got, results):
        np.testing.assert_allclose([s for _, s in r1], [s for _, s in r2], atol=1e-5)
        assert r1[0][0] == r2[0][0]
        if kind != "hnsw":                                  # same (score, id) multiset: tie order may differ
            assert sorted((round(-s, 5), i) for i, s in r1) == sorted((round(-s, 5), i) for i, s in r2)
    check_index_consistent(again)
    new = add(again, "new", "after reopen")
    assert new == max_id + 1 and new not in ids           # ids are never reused
    again.close()


def test_wal_mode_and_dim_mismatch(tmp_path):
    bank = make(tmp_path)
    assert bank._conn().execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    bank.close()
    with pytest.raises(ValueError):
        ExperienceBank(tmp_path / "bank.db", HashEmbedder(32))


# ------------------------------------------------------------------------------------ capacity
@pytest.mark.parametrize("kind", KINDS)
def test_capacity_fifo(tmp_path, kind):
    bank = make(tmp_path, capacity=3, eviction="fifo", index=kind, hnsw_rebuild_min=1)
    for j in range(3):
        assert apply(bank, [Op("ADD", f"t{j}", f"lesson {j}")]).evicted == []
    # an UPDATE writes a new entry at the back of the queue (the released code deletes the updated
    # entry and adds a new one)
    apply(bank, [Op("UPDATE", "t0", "refined lesson 0", (1,))])
    assert [e.id for e in bank.entries()] == [2, 3, 4]
    res = apply(bank, [Op("ADD", "t3", "lesson 3")])
    assert res.evicted == [2]
    res = apply(bank, [Op("ADD", f"t{j}", f"lesson {j}") for j in (4, 5)])
    assert res.evicted == [3, 4]
    assert [e.id for e in bank.entries()] == [5, 6, 7]
    res = apply(bank, [Op("MERGE", "m", "merged", (6, 7)), Op("ADD", "t7", "lesson 7")])
    assert res.evicted == [] and [e.id for e in bank.entries()] == [5, 8, 9]
    assert bank.stats()["evicted_total"] == 3
    assert all(i in {5, 8, 9} for r in bank.search(["lesson 0", "lesson 3"], 5, "e") for i, _ in r)
    check_index_consistent(bank)


def test_capacity_lru(tmp_path):
    bank = make(tmp_path, capacity=3, eviction="lru")
    a, b, c = (add(bank, t, f"lesson {t}") for t in "abc")
    now = time.time()
    bank.record_retrieval([a], when=now + 100)
    d = add(bank, "d", "lesson d")
    assert [e.id for e in bank.entries()] == [a, c, d]                      # b: least recently used
    bank.record_retrieval([c], when=now + 200)
    res = apply(bank, [Op("ADD", "e", "lesson e")])
    assert res.evicted == [d]                                              # d written at ~now < a, c uses
    e = res.applied[0][1]
    res = apply(bank, [Op("ADD", "f", "lesson f")])
    assert res.evicted == [e]
    assert [x.id for x in bank.entries()] == [a, c, res.applied[0][1]]
    check_index_consistent(bank)


# ------------------------------------------------------------------------------------ env filtering
@pytest.mark.parametrize("kind", KINDS)
def test_env_filtering(tmp_path, kind):
    bank = make(tmp_path, index=kind)
    a = add(bank, "door", "open the door with the key", env="a")
    b = add(bank, "door", "open the door with the key", env="b")
    a2 = add(bank, "stairs", "go to the stairs", env="a")
    assert [i for i, _ in bank.search(["open the door"], 5, "a")[0]] == [a, a2]
    assert [i for i, _ in bank.search(["open the door"], 5, "b")[0]] == [b]
    assert bank.search(["open the door"], 5, "nope") == [[]]
    both = bank.search(["door: open the door with the key"], 2, None)[0]
    assert {i for i, _ in both} == {a, b} and both[0][1] == pytest.approx(1.0, abs=1e-5)
    assert [e.id for e in bank.entries("a")] == [a, a2]
    r = Retriever(bank, k=1).retrieve(["open the door", "open the door"], ["a", "b"])
    assert [x[0].id for x in r] == [a, b]
    assert Retriever(bank, k=1).retrieve(["x"], ["unknown"]) == [[]]


# ------------------------------------------------------------------------------------ approximate indexes
def test_ivf_hnsw_match_flat_top1(tmp_path):
    texts = random_texts(320, seed=2)
    banks = {k: make(tmp_path, f"{k}.db", index=k, ivf_min_train=100, ivf_nlist=16, ivf_nprobe=4,
                     hnsw_rebuild_min=10, hnsw_rebuild_fraction=0.02) for k in KINDS}
    for bank in banks.values():
        for s in range(0, len(texts), 20):
            apply(bank, [Op("ADD", f"t{j}", t) for j, t in enumerate(texts[s:s + 20], s)])
    assert banks["ivf"]._shards["e"].trainings >= 2 and banks["ivf"]._shards["e"].ivf is not None
    queries = [f"t{j}: {t}" for j, t in enumerate(texts)]
    tops = {k: [r[0] for r in b.search(queries, 3, "e")] for k, b in banks.items()}
    assert [i for i, _ in tops["flat"]] == list(range(1, 321))
    for k in ("ivf", "hnsw"):
        assert [i for i, _ in tops[k]] == [i for i, _ in tops["flat"]], k
    # deletions (merge, update) then compare again: tombstones / IVF removal
    for bank in banks.values():
        for j in range(0, 60, 2):
            apply(bank, [Op("MERGE", f"m{j}", texts[j] + " merged", (j + 1, j + 2))])
        for j in range(100, 120):
            apply(bank, [Op("UPDATE", f"u{j}", texts[j] + " updated", (j + 1,))])
        check_index_consistent(bank)
    assert banks["hnsw"]._shards["e"].rebuilds >= 1
    live = {e.id for e in banks["flat"].entries()}
    probe = [f"t{j}: {t}" for j, t in enumerate(texts)]
    ref = banks["flat"].search(probe, 5, "e")
    for k in ("ivf", "hnsw"):
        got = banks[k].search(probe, 5, "e")
        assert all(i in live for r in got for i, _ in r)
        same = sum(g[0][0] == r[0][0] or abs(g[0][1] - r[0][1]) < 1e-6 for g, r in zip(got, ref))
        assert same >= 0.97 * len(ref), (k, same)


# ------------------------------------------------------------------------------------ retrieval re-rank
def _rank_bank(tmp_path, name="r.db"):
    bank = make(tmp_path, name)
    a = add(bank, "alpha", "alpha beta gamma delta")
    b = add(bank, "alpha", "alpha beta gamma epsilon")
    c = add(bank, "zeta", "zeta eta theta iota")
    q = "alpha: alpha beta gamma delta"
    assert [i for i, _ in bank.search([q], 3, "e")[0]] == [a, b, c]
    return bank, q, (a, b, c)


def test_frequency_penalty_changes_order(tmp_path):
    bank, q, (a, b, c) = _rank_bank(tmp_path)
    old = 1000.0                                                 # far outside the recency window
    bank.record_retrieval([a] * 20, when=old)
    now = 10_000.0
    plain = Retriever(bank, k=3, freq_penalty=0.0, count_retrievals=False).retrieve([q], ["e"], now=now)[0]
    assert [e.id for e in plain] == [a, b, c]
    pen = Retriever(bank, k=3, freq_penalty=0.4, count_retrievals=False).retrieve([q], ["e"], now=now)[0]
    # s(a) = 0 - 0.4*log(21) = -1.22 < s(b) = -1
    assert [e.id for e in pen] == [b, a, c]
    assert 0.4 * math.log1p(20) > 1.0
    cos = Retriever(bank, k=3, freq_penalty=0.4, rank_score="cosine",
                    count_retrievals=False).retrieve([q], ["e"], now=now)[0]
    assert cos[0].id == b


def test_recency_penalty_and_window(tmp_path):
    bank, q, (a, b, c) = _rank_bank(tmp_path)
    now = 10_000.0
    bank.record_retrieval([a], when=now - 10)                    # recent: -0.28 - 1 < -1
    r = Retriever(bank, k=1, top1_demote_p=0.0, count_retrievals=False)
    assert r.retrieve([q], ["e"], now=now)[0][0].id == b
    assert r.retrieve([q], ["e"], now=now + 400)[0][0].id == a    # outside the 300 s window: -0.28 > -1


def test_top1_demotion_probability_and_seed(tmp_path):
    bank, q, (a, b, c) = _rank_bank(tmp_path)
    now = 10_000.0
    bank.record_retrieval([a, b, c], when=now - 5)               # all recent, same count: order kept
    never = Retriever(bank, k=1, top1_demote_p=0.0, count_retrievals=False)
    assert never.retrieve([q], ["e"], now=now)[0][0].id == a
    always = Retriever(bank, k=3, top1_demote_p=1.0, count_retrievals=False)
    assert [e.id for e in always.retrieve([q], ["e"], now=now)[0]] == [b, c, a]
    half = Retriever(bank, k=1, top1_demote_p=0.5, seed=7, count_retrievals=False)
    picks = [half.retrieve([q], ["e"], now=now)[0][0].id for _ in range(200)]
    assert set(picks) == {a, b} and 60 < picks.count(a) < 140
    again = Retriever(bank, k=1, top1_demote_p=0.5, seed=7, count_retrievals=False)
    assert [again.retrieve([q], ["e"], now=now)[0][0].id for _ in range(200)] == picks


def test_readonly_evaluation_clock_and_draws(tmp_path):
    """A read-only evaluation judges "recent" by the bank's last training retrieval, not the wall
    clock, and after begin_readonly each query's demotion draw is seeded by the key, the env and the
    query: the same query gets the same pick whenever it is asked, in any order or batch (the
    evaluation stream interleaves the modes' episodes), and another key draws anew."""
    bank, q, (a, b, c) = _rank_bank(tmp_path)
    trained = 1000.0                                             # training ended long ago (1970)
    bank.record_retrieval([b, c], when=trained - 400)            # outside the window at its end
    bank.record_retrieval([a], when=trained - 10)                # retrieved in its last 300 s
    assert bank.last_retrieval_time() == trained - 10
    r = Retriever(bank, k=1, freq_penalty=0.0, top1_demote_p=1.0, count_retrievals=False)
    assert r.retrieve([q], ["e"])[0][0].id == a                  # wall clock: nothing is recent
    r.begin_readonly("0:guided", bank.last_retrieval_time())
    assert r.retrieve([q], ["e"])[0][0].id == b                  # a is recent: penalised and demoted
    assert r.retrieve([q], ["e"], now=trained + 400)[0][0].id == a   # an explicit time still rules
    counted = Retriever(bank, k=1, freq_penalty=0.0, top1_demote_p=1.0)
    counted.begin_readonly("0:guided", trained)
    assert counted.retrieve([q], ["e"], count_retrievals=True)[0][0].id == a   # training: wall clock
    bank.record_retrieval([b, c], when=trained - 5)              # all three recent, same order
    half = Retriever(bank, k=1, freq_penalty=0.0, top1_demote_p=0.5, seed=7, count_retrievals=False)
    half.begin_readonly("0", bank.last_retrieval_time())
    qs = [f"{q} {i}" for i in range(40)]
    picks = [half.retrieve([x], ["e"])[0][0].id for x in qs]
    assert set(picks) == {a, b}                                  # each query draws its own demotion
    assert [half.retrieve([x], ["e"])[0][0].id for x in qs] == picks          # asked again: the same
    assert [e[0].id for e in half.retrieve(qs[::-1], ["e"] * 40)] == picks[::-1]  # in any order / batch
    half.begin_readonly("1", bank.last_retrieval_time())
    assert [half.retrieve([x], ["e"])[0][0].id for x in qs] != picks          # another key draws anew


def test_retrieval_records_and_is_deterministic(tmp_path):
    runs = []
    for name in ("r1.db", "r2.db"):
        bank, q, ids = _rank_bank(tmp_path, name)
        r = Retriever(bank, k=1, seed=3)
        seq = [r.retrieve([q, q], ["e", "e"], now=10_000.0 + 10 * t)[0][0].id for t in range(30)]
        runs.append(seq)
        st = bank.stats()
        assert st["retrieved_total"] == 60                      # 2 queries x 30 calls x k=1
        assert len(set(seq)) >= 2                                # the re-rank rotates entries
    assert runs[0] == runs[1]


def test_retrieval_batch_reads_counters_once(tmp_path):
    bank, q, (a, b, c) = _rank_bank(tmp_path)
    out = Retriever(bank, k=1).retrieve([q] * 4, ["e"] * 4, now=5000.0)
    assert [x[0].id for x in out] == [a] * 4                     # same snapshot for the whole batch
    e = bank.get([a])[0]
    assert e.times_retrieved == 4 and e.last_retrieved == 5000.0
    assert bank.get([b])[0].times_retrieved == 0                 # candidates are not counted


# ------------------------------------------------------------------------------------ stats
def test_stats(tmp_path):
    bank = make(tmp_path, capacity=4)
    apply(bank, [Op("ADD", "a", "one"), Op("ADD", "b", "two"), Op("ADD", "c", "three")], env="x")
    apply(bank, [Op("ADD", "d", "four"), Op("UPDATE", "", "", (1,)), Op("BAD")], env="y")
    apply(bank, [Op("MERGE", "ab", "one and two", (1, 2)), Op("UPDATE", "c", "three!", (3,))], env="x")
    apply(bank, [Op("ADD", "e", "five"), Op("ADD", "f", "six")], env="y")
    # ids 1-3 (x), 4 (y); MERGE 1,2 -> 5; UPDATE 3 -> 6; ADD 7, 8 (y) -> 5 entries > 4: fifo
    # (oldest write first) evicts 4
    bank.record_retrieval([6, 6, 7], when=1.0)
    bank.record_outcome([6], True)
    bank.record_outcome([6, 7], False)
    st = bank.stats()
    assert st["count"] == 4 and st["per_env"] == {"x": 2, "y": 2}
    assert [e.id for e in bank.entries()] == [5, 6, 7, 8]
    assert st["applied"] == {"ADD": 6, "UPDATE": 1, "MERGE": 1, "UPVOTE": 0, "DOWNVOTE": 0}
    assert st["evicted_total"] == 1
    assert st["rejections"] == {REJECT_EMPTY_TEXT: 1, REJECT_UNKNOWN_KIND: 1} and st["rejections_total"] == 2
    assert st["retrieved_total"] == 3 and st["retrieved_mean"] == pytest.approx(0.75)
    assert st["times_success"] == 1 and st["times_failure"] == 2
    assert st["lineage"] == {"by_origin": {"add": 2, "merge": 1, "update": 1}, "with_parents": 2}
    assert (st["index"], st["capacity"], st["eviction"]) == ("auto", 4, "fifo")
    assert st["shard_index"] == {"x": "flat", "y": "flat"}   # auto: small shards are searched exactly


# ------------------------------------------------------------------------------------ locks + stress
def test_rwlock_writer_preference():
    lock = RWLock()
    order = []
    lock.acquire_read()
    w = threading.Thread(target=lambda: (lock.acquire_write(), order.append("w"), lock.release_write()))
    w.start()
    time.sleep(0.1)
    r = threading.Thread(target=lambda: (lock.acquire_read(), order.append("r"), lock.release_read()))
    r.start()
    time.sleep(0.1)
    assert order == []                         # the writer waits for the reader; the new reader waits too
    lock.release_read()
    w.join(2)
    r.join(2)
    assert order == ["w", "r"]


def _until(pred, what):
    deadline = time.monotonic() + 20               # bounds a hang only
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_rwlock_readers_that_waited_go_before_the_next_writer():
    """Phase fairness: a stream of writers cannot starve readers (a writer-preferring lock did)."""
    lock = RWLock()
    order = []
    lock.acquire_write()

    def reader(name):
        lock.acquire_read()
        order.append(name)
        lock.release_read()

    def writer(name):
        lock.acquire_write()
        order.append(name)
        lock.release_write()

    readers = [threading.Thread(target=reader, args=(f"r{i}",)) for i in range(2)]
    for t in readers:
        t.start()
    _until(lambda: lock._readers_waiting == 2, "readers did not queue")
    w2 = threading.Thread(target=writer, args=("w2",))
    w2.start()
    _until(lambda: lock._writers_waiting == 1, "second writer did not queue")
    lock.release_write()
    for t in [*readers, w2]:
        t.join(20)
    assert sorted(order[:2]) == ["r0", "r1"] and order[2] == "w2"
    assert (lock._readers, lock._writer, lock._admitted, lock._readers_waiting) == (0, False, 0, 0)


@pytest.mark.parametrize("kind", KINDS + ("auto",))
def test_concurrent_readers_and_writers(tmp_path, kind):
    target = 400                        # writes and reads done before the threads stop (counted, not timed)
    # auto: shards of ~40 entries cross auto_threshold 30 (and half of it) back and forth
    bank = make(tmp_path, index=kind, capacity=80, ivf_min_train=20, ivf_nlist=8, ivf_nprobe=2,
                hnsw_rebuild_min=8, hnsw_rebuild_fraction=0.1, auto_threshold=30)
    retriever = Retriever(bank, k=2)
    lock = RWLock()
    log: list = []                      # (ops, result) in apply order (appended under the write lock)
    errors: list = []
    counts = {"reads": 0, "writes": 0, "evicted": 0}
    stop = threading.Event()
    envs = ("a", "b")

    def writer(seed):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                env = rng.choice(envs)
                with lock.write():
                    live = [e.id for e in bank.entries(env)]
                    ops = []
                    for _ in range(rng.randint(1, 3)):
                        x = rng.random()
                        text = " ".join(rng.sample(VOCAB, 6))
                        if x < 0.5 or len(live) < 3:
                            ops.append(Op("ADD", f"add {seed}", text))
                        elif x < 0.7:
                            ops.append(Op("UPDATE", f"upd {seed}", text, (rng.choice(live),)))
                        elif x < 0.9:
                            ops.append(Op("MERGE", f"mrg {seed}", text, tuple(rng.sample(live, 2))))
                        else:
                            ops.append(Op("UPDATE", "bad", text, (10 ** 9,)))
                    res = bank.apply(ops, env_id=env, step=counts["writes"], extraction_id=f"w{seed}",
                                     extractor_version=0)
                    log.append((env, ops, res))
                    counts["writes"] += 1
                    counts["evicted"] += len(res.evicted)
                time.sleep(0.001)
        except Exception as exc:  # noqa: BLE001 - a worker thread hands any failure to the test
            errors.append(exc)

    def reader(seed):
        rng = random.Random(1000 + seed)
        try:
            while not stop.is_set():
                env = rng.choice(envs + (None,))
                qs = [" ".join(rng.sample(VOCAB, 5)) for _ in range(rng.randint(1, 8))]
                with lock.read():
                    if rng.random() < 0.2 and env is not None:
                        retriever.retrieve(qs, [env] * len(qs))
                    else:
                        res = bank.search(qs, 5, env)
                        ids = [i for r in res for i, _ in r]
                        got = {e.id: e for e in bank.get(ids)}
                        assert set(ids) <= set(got), "search returned an id missing from SQLite"
                        for r in res:
                            scores = [s for _, s in r]
                            assert scores == sorted(scores, reverse=True)
                            assert len({i for i, _ in r}) == len(r)
                        if env is not None:
                            assert all(got[i].env_id == env for i in ids)
                counts["reads"] += 1
        except Exception as exc:  # noqa: BLE001 - a worker thread hands any failure to the test
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(s,), daemon=True) for s in range(8)]
    threads += [threading.Thread(target=writer, args=(s,), daemon=True) for s in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 600            # bounds a hang only: the asserts below then fail
    while ((counts["writes"] < target or counts["reads"] < target or not counts["evicted"]) and not errors
           and time.monotonic() < deadline):
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "deadlock: a thread did not finish"
    assert not errors, errors
    assert counts["writes"] >= target and counts["reads"] >= target and counts["evicted"], counts

    # replay the acknowledged writes in order
    live: dict[int, str] = {}
    n_merges = n_evictions = 0
    for env, _ops, res in log:
        for op, i in res.applied:
            if op.kind == "ADD":
                assert i not in live
                live[i] = env
            elif op.kind in ("UPDATE", "MERGE"):       # targets deleted (those still there), a new entry
                for t in set(op.targets):
                    assert live.pop(t, env) == env
                assert i not in live
                live[i] = env
                n_merges += op.kind == "MERGE"
        for i in res.evicted:
            live.pop(i)
            n_evictions += 1
        assert all(r in REJECTION_REASONS for _, r in res.rejected)
    entries = bank.entries()
    assert {e.id: e.env_id for e in entries} == live
    check_index_consistent(bank)
    db = bank._db_vectors()
    for e in entries:                                      # stored vector = embedding of the final text
        np.testing.assert_allclose(db[e.id], EMB.encode([e.text()])[0], atol=1e-6)
    assert n_merges > 0 and n_evictions > 0
    if kind == "ivf":
        assert any(s.trainings for s in bank._shards.values())            # IVF trained while threads ran
    if kind == "hnsw":
        assert any(s.rebuilds for s in bank._shards.values())             # tombstones compacted
    if kind == "auto":
        assert any(s.switches for s in bank._shards.values())            # flat -> hnsw while threads ran
    bank.close()
    again = make(tmp_path, index=kind, capacity=80)
    assert {e.id for e in again.entries()} == set(live)
    check_index_consistent(again)
    again.close()


def test_bench_retrieval_smoke(tmp_path):
    from crl_bench.bench.retrieval import bench_retrieval, format_table

    rows = bench_retrieval(sizes=(300,), queries=8, k=5, dim=32, repeats=1, latency_samples=16,
                           recall_queries=32, workdir=str(tmp_path), bank_kwargs={"ivf_min_train": 100},
                           index=("flat", "ivf", "hnsw", "auto"))
    assert [(r["data"], r["index"], r["size"]) for r in rows] == \
        [(d, i, 300) for d in ("sentence", "gaussian") for i in ("flat", "ivf", "hnsw", "auto")]
    assert all(r["recall@1"] == 1.0 and r["batched_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in rows)
    assert {r["index"]: r["shard_index"] for r in rows} == {"flat": "flat", "ivf": "ivf", "hnsw": "hnsw",
                                                             "auto": "flat"}
    assert format_table(rows).count("\n") == 9
    vecs = np.random.default_rng(0).standard_normal((340, 16))
    rows = bench_retrieval(sizes=(300,), queries=8, k=5, dim=16, index="flat", vectors=vecs, repeats=1,
                           latency_samples=8, recall_queries=40, workdir=str(tmp_path))
    assert [(r["data"], r["recall@k"]) for r in rows] == [("file", 1.0)]
