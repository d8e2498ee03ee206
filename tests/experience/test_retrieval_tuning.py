"""Retrieval tuning: recall of the tuned IVF / HNSW search settings, ``index: auto`` (flat
while a shard is small, HNSW above a threshold), the retriever's query-embedding cache, and the
config settings. No timing is asserted (see ``crl-bench bench retrieval`` for latencies)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tests_helpers import run_in_threads

from crl_bench.bench.retrieval import SentenceLike, make_data
from crl_bench.experience.bank import ExperienceBank
from crl_bench.experience.embedding import HashEmbedder, QueryCache
from crl_bench.experience.retrieval import Retriever
from crl_bench.experience.types import Operation as Op
from crl_bench.experience.vector_index import AUTO_THRESHOLD, AutoShard


class _Dim:
    def __init__(self, dim):
        self.dim = dim

    def encode(self, texts):  # pragma: no cover - vectors are added and searched directly
        raise RuntimeError("vectors only")


def _recall(bank, q, gt_ids, k):
    got = bank.search_vectors(q, k, "e")
    return float(np.mean([len({i for i, _ in g} & set(t.tolist())) / k for g, t in zip(got, gt_ids)]))


# ------------------------------------------------------------------------------------ recall of the tuned settings
@pytest.fixture(scope="module")
def sentence_20k():
    """20,000 sentence-embedding-shaped vectors (384-dim, seed 0) and 200 new queries, with the exact
    top-16 (bank ids = positions + 1)."""
    import faiss

    vecs, q = make_data("sentence", 20000, 200, 384, seed=0)
    exact = faiss.IndexFlatIP(384)
    exact.add(vecs)
    _, gt = exact.search(q, 16)
    return vecs, q, gt + 1


def test_ivf_tuned_recall_and_old_settings_fail(tmp_path, sentence_20k):
    vecs, q, gt = sentence_20k
    bank = ExperienceBank(tmp_path / "ivf.db", _Dim(384), index="ivf")
    bank.add_vectors("e", vecs)
    shard = bank._shards["e"]
    # nlist = min(2048, n // 39) = 512; nprobe = ceil(512 * max(1/8, 10000 / 20000)) = 256
    assert (shard.ivf.nlist, shard.nprobe()) == (512, 256)
    assert _recall(bank, q, gt, 16) >= 0.95
    # a coarse setting (nlist 256, nprobe 16): the same data fails the bar by far
    old = ExperienceBank(tmp_path / "ivf-old.db", _Dim(384), index="ivf", ivf_nlist=256, ivf_nprobe=16)
    old.add_vectors("e", vecs)
    assert old._shards["e"].nprobe() == 16
    assert _recall(old, q, gt, 16) < 0.8
    bank.close()
    old.close()


def test_hnsw_tuned_recall_and_old_settings_fail(tmp_path, sentence_20k):
    vecs, q, gt = sentence_20k
    bank = ExperienceBank(tmp_path / "hnsw.db", _Dim(384), index="hnsw")
    bank.add_vectors("e", vecs)
    shard = bank._shards["e"]
    assert [shard.ef(k) for k in (1, 16, 32, 64)] == [128, 128, 256, 512]     # max(128, 8k)
    assert _recall(bank, q, gt, 16) >= 0.95
    # k = 32 (e.g. experience.k 2 x oversample 16): efSearch max(64, k) = 64 misses neighbours;
    # the tuned max(128, 8k) = 256 does not
    _, gt32 = _exact(vecs, q, 32)
    assert _recall(bank, q, gt32, 32) >= 0.95
    shard.ef_search, shard.ef_per_k = 64, 1                                       # max(64, k)
    assert _recall(bank, q, gt32, 32) < 0.95
    bank.close()


def _exact(vecs, q, k):
    import faiss

    exact = faiss.IndexFlatIP(vecs.shape[1])
    exact.add(vecs)
    d, i = exact.search(q, k)
    return d, i + 1


def test_gaussian_worst_case_is_what_it_is():
    """The benchmark's worst-case data: isotropic unit vectors, queries near a stored vector."""
    vecs, q = make_data("gaussian", 500, 10, 64, seed=1)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert float(np.abs(vecs.mean(0)).max()) < 0.2
    top = (q @ vecs.T).max(1)
    assert (top > 0.8).all()                                   # each query has one clear source


def test_sentence_like_is_anisotropic_and_deterministic():
    a = SentenceLike(64, np.random.default_rng(3)).draw(2000)
    b = SentenceLike(64, np.random.default_rng(3)).draw(2000)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    assert np.linalg.norm(a.mean(0)) > 0.15                    # the common direction
    ev = np.linalg.svd(a - a.mean(0), compute_uv=False) ** 2
    assert ev[:10].sum() / ev.sum() > 0.2                      # variance concentrated in few directions


# ------------------------------------------------------------------------------------ index: auto
class _RandomEmbedder:
    """Each text -> a fixed random unit vector (seeded by the text): continuous, so no cosine ties."""

    dim = 32

    def encode(self, texts):
        import hashlib

        rows = [np.random.default_rng(int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little"))
                .standard_normal(self.dim) for t in texts]
        x = np.asarray(rows, dtype=np.float32).reshape(len(texts), self.dim)
        return x / np.linalg.norm(x, axis=1, keepdims=True)


EMB = _RandomEmbedder()
VOCAB = [f"w{i}" for i in range(400)]


def _texts(n, seed=0):
    rng = random.Random(seed)
    out = set()
    while len(out) < n:
        out.add(" ".join(rng.sample(VOCAB, 8)))
    return sorted(out)


def _fill(bank, texts, env="e"):
    for s in range(0, len(texts), 25):
        res = bank.apply([Op("ADD", f"t{j}", t) for j, t in enumerate(texts[s:s + 25], s)], env_id=env, step=1,
                         extraction_id="x", extractor_version=0)
        assert not res.rejected


def test_auto_is_the_default_and_switches_by_size(tmp_path):
    assert ExperienceBank(tmp_path / "d.db", EMB).index_kind == "auto"
    assert AUTO_THRESHOLD == 20000
    texts = _texts(160)
    auto = ExperienceBank(tmp_path / "auto.db", EMB, auto_threshold=100)
    flat = ExperienceBank(tmp_path / "flat.db", EMB, index="flat")
    _fill(auto, texts[:100])
    _fill(flat, texts[:100])
    assert auto.shard_kinds() == {"e": "flat"}                  # at the threshold: still exact
    _fill(auto, texts[100:])
    _fill(flat, texts[100:])
    assert auto.shard_kinds() == {"e": "hnsw"} and auto._shards["e"].switches == 1
    assert auto.stats()["shard_index"] == {"e": "hnsw"}
    # an easy case (160 entries, efSearch 128): the approximate index returns what exact search does
    queries = [f"t{j}: {t}" for j, t in enumerate(texts)]
    assert [[i for i, _ in r] for r in auto.search(queries, 5, "e")] == \
           [[i for i, _ in r] for r in flat.search(queries, 5, "e")]
    # ids and vectors in the index = the stored ones
    ids, vecs = auto.index_snapshot()
    db = auto._db_vectors()
    assert sorted(ids.tolist()) == sorted(db)
    for i, v in zip(ids.tolist(), vecs):
        np.testing.assert_allclose(v, db[i], atol=1e-6)
    # shrinking below half the threshold goes back to exact search (each MERGE: 4 entries -> 1)
    for j in range(1, 149, 4):
        auto.apply([Op("MERGE", f"m{j}", f"merged {j}", (j, j + 1, j + 2, j + 3))], env_id="e", step=2,
                   extraction_id="m", extractor_version=0)
        assert auto.shard_kinds() == {"e": "hnsw" if len(auto) >= 50 else "flat"}
    assert len(auto) == 160 - 37 * 3 and auto.shard_kinds() == {"e": "flat"}
    assert auto._shards["e"].switches == 2
    ids, _ = auto.index_snapshot()
    assert sorted(ids.tolist()) == sorted(auto._db_vectors())
    auto.close()
    flat.close()


def test_auto_reopen_and_per_shard(tmp_path):
    bank = ExperienceBank(tmp_path / "a.db", EMB, auto_threshold=50)
    _fill(bank, _texts(75, seed=1), env="big")
    _fill(bank, _texts(20, seed=2), env="small")
    assert bank.shard_kinds() == {"big": "hnsw", "small": "flat"}
    ref = bank.search(["w1 w2 w3"], 4, "big")
    bank.close()
    again = ExperienceBank(tmp_path / "a.db", EMB, auto_threshold=50)
    assert again.shard_kinds() == {"big": "hnsw", "small": "flat"}
    assert isinstance(again._shards["big"], AutoShard)
    assert [i for i, _ in again.search(["w1 w2 w3"], 4, "big")[0]] == [i for i, _ in ref[0]]
    again.close()


def test_auto_at_capacity_stays_exact(tmp_path):
    """A bank held at its cap (= the threshold) by eviction never switches on a write's transient
    extra entry (the ``paper`` preset: 20,000 entries, FIFO)."""
    bank = ExperienceBank(tmp_path / "cap.db", EMB, auto_threshold=40, capacity=40)
    texts = _texts(60, seed=6)
    for j, t in enumerate(texts):
        bank.apply([Op("ADD", f"t{j}", t)], env_id="e", step=1, extraction_id="x", extractor_version=0)
        assert bank.shard_kinds() == {"e": "flat"}
    bank.add_vectors("e", EMB.encode(["a", "b", "c"]))
    assert len(bank) == 40 and bank.shard_kinds() == {"e": "flat"} and bank._shards["e"].switches == 0
    bank.close()


def test_explicit_kinds_and_bad_settings(tmp_path):
    for kind in ("flat", "ivf", "hnsw"):
        b = ExperienceBank(tmp_path / f"{kind}.db", EMB, index=kind)
        _fill(b, _texts(30, seed=4))
        assert b.index_kind == kind and len(b.search(["w5 w6"], 3, "e")[0]) == 3
        b.close()
    with pytest.raises(ValueError):
        ExperienceBank(tmp_path / "x.db", EMB, index="annoy")
    with pytest.raises(ValueError):
        ExperienceBank(tmp_path / "y.db", EMB, auto_index="flat")
    with pytest.raises(ValueError):
        ExperienceBank(tmp_path / "z.db", EMB, ivf_nprobe_fraction=0)


# ------------------------------------------------------------------------------------ query-embedding cache
class _Counting:
    dim = 64

    def __init__(self):
        self.calls: list[list[str]] = []
        self.inner = HashEmbedder(64)

    def encode(self, texts):
        self.calls.append(list(texts))
        return self.inner.encode(texts)


def test_query_cache_hits_misses_eviction():
    emb = _Counting()
    cache = QueryCache(emb, capacity=2)
    a = cache.encode(["a b", "c d", "a b"])                    # "a b" twice in one call: embedded once
    assert emb.calls == [["a b", "c d"]]
    np.testing.assert_array_equal(a[0], a[2])
    np.testing.assert_array_equal(a, emb.inner.encode(["a b", "c d", "a b"]))
    assert cache.info() == {"size": 2, "capacity": 2, "hits": 1, "misses": 2, "evictions": 0,
                            "hit_rate": pytest.approx(1 / 3)}
    cache.encode(["a b"])                                      # hit; "a b" becomes the most recent
    assert len(emb.calls) == 1
    cache.encode(["e f"])                                      # miss; evicts "c d" (least recent)
    cache.encode(["a b"])                                      # still cached
    assert len(emb.calls) == 2
    cache.encode(["c d"])                                      # evicted: embedded again
    assert emb.calls[-1] == ["c d"]
    info = cache.info()
    assert (info["hits"], info["misses"], info["evictions"], info["size"]) == (3, 4, 2, 2)
    assert info["hit_rate"] == pytest.approx(3 / 7)
    assert cache.encode([]).shape == (0, 64)


def test_query_cache_off():
    emb = _Counting()
    cache = QueryCache(emb, capacity=0)
    cache.encode(["x"])
    cache.encode(["x"])
    assert len(emb.calls) == 2 and cache.info()["size"] == 0
    assert (cache.info()["hits"], cache.info()["misses"]) == (0, 2)
    with pytest.raises(ValueError):
        QueryCache(emb, capacity=-1)


def test_query_cache_threads():
    emb = _Counting()
    cache = QueryCache(emb, capacity=5)

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(200):
            t = [rng.choice("abcdefgh") * rng.randint(1, 2) for _ in range(3)]
            np.testing.assert_array_equal(cache.encode(t), emb.inner.encode(t))

    errors = run_in_threads(worker, 4, join_timeout=20)
    info = cache.info()
    assert not errors and info["size"] <= 5
    assert info["hits"] + info["misses"] == 4 * 200 * 3           # every query is counted once


def test_retriever_uses_the_query_cache(tmp_path):
    emb = _Counting()
    bank = ExperienceBank(tmp_path / "r.db", emb)
    _fill(bank, _texts(10, seed=5))
    n_write_calls = len(emb.calls)
    r = Retriever(bank, k=2, query_cache=16)
    first = r.retrieve(["w1 w2", "w3 w4"], ["e", "e"], now=1.0, count_retrievals=False)
    again = r.retrieve(["w1 w2", "w3 w4"], ["e", "e"], now=1.0, count_retrievals=False)
    assert [[e.id for e in x] for x in first] == [[e.id for e in x] for x in again]
    assert len(emb.calls) == n_write_calls + 1                 # the second call embedded nothing
    info = r.cache_info()
    assert (info["hits"], info["misses"], info["hit_rate"]) == (2, 2, 0.5)
    off = Retriever(bank, k=2, query_cache=0)
    off.retrieve(["w1 w2"], ["e"], count_retrievals=False)
    off.retrieve(["w1 w2"], ["e"], count_retrievals=False)
    assert off.cache_info()["hits"] == 0 and off.cache_info()["misses"] == 2
    bank.close()


# ------------------------------------------------------------------------------------ config
def test_experience_config_defaults_and_validation():
    from crl_bench.config import ConfigError, ExperienceConfig, build_config, preset_data

    exp_cfg = ExperienceConfig()
    assert (exp_cfg.index, exp_cfg.query_cache) == ("auto", 4096)
    for index in ("auto", "flat", "ivf", "hnsw"):
        build_config([preset_data("default"), {"experience": {"index": index}}])
    with pytest.raises(ConfigError):
        build_config([preset_data("default"), {"experience": {"index": "annoy"}}])
    with pytest.raises(ConfigError):
        build_config([preset_data("default"), {"experience": {"query_cache": -1}}])
