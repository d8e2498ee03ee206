"""Top-k experience retrieval with the diversity re-rank (docs/method.md).

What is implemented (source: the paper and the authors' released code,
``roll/pipeline/agentic/memory/async_memory_manager.py::_diversify_uids_by_usage`` with the values of
``examples/singletask-agentic/single_task_complementaryrl.yaml``: ``diversity_candidate_multiplier:
16``, ``diversity_lambda: 0.4``, ``diversity_recent_seconds: 300``, ``diversity_dropout_p: 0.5``,
``memory_fetch_num: 1``):

1. All queries are embedded in one batch, through a bounded LRU cache of query text -> embedding
   (:class:`~crl_bench.experience.embedding.QueryCache`, ``query_cache`` entries; the released code
   caches query embeddings too): only texts not seen recently are embedded. Its counters
   (:meth:`Retriever.cache_info`: hits, misses, evictions, hit rate) reach every metrics row of the
   experience methods as ``retrieval_query_cache_hit_rate``. Queries are grouped by env id and each group is
   searched with one batched FAISS call for ``k * oversample`` candidates, ordered by cosine
   similarity.
2. For candidate ``m`` at 0-based position ``r(m)`` in that order::

       s(m) = s_rank(m) - lambda * log(1 + c(m)) - 1[recent(m)]

   with ``c(m)`` = ``times_retrieved``, ``recent(m)`` = ``last_retrieved > 0 and now -
   last_retrieved < recency_window_s``. ``s_rank`` is a setting:

   * ``rank_score="position"`` (default, as released): ``s_rank(m) = -r(m)``. The penalties are
     therefore measured in rank positions: being recent costs one position, 10 past retrievals
     cost 0.4 * log(11) = 0.96 positions.
   * ``rank_score="cosine"``: ``s_rank(m)`` = the cosine similarity (the penalties then dominate
     because cosine gaps between candidates are usually much smaller than 1).

   Candidates are sorted by ``s`` descending; ties keep the similarity order.
3. Top-1 demotion: if the top candidate after step 2 is recent, with probability
   ``top1_demote_p`` it is moved to the end of the candidate list (released behaviour; with k=1 the
   runner-up is returned instead). Draws come from ``random.Random(seed)`` owned by the retriever,
   so a given seed and call sequence gives the same results.
4. The first ``k`` candidates are returned and their retrieval is recorded
   (``bank.record_retrieval(ids, now)``): only returned entries count, not the candidates.

**Utility re-rank** (``rerank="utility"``, ``experience.rerank: utility``), instead of steps 2-3: the
SimUtil-UCB retrieval of RetroAgent (Zhang et al., arXiv 2603.08561, section 3.3, Eqs. 8-10, with the
values of its Table 10; released code zhangxy-2019/RetroAgent, ``agent_system/memory/memory.py``
``ReflectionMemory.retrieve``). The candidates are every entry of the query's env
(``utility_candidates="all"``, as released; ``"nearest"``: the ``k * oversample`` nearest); those whose
cosine similarity ``s(m)`` is below ``utility_min_sim`` (0.4) are dropped; the rest are sorted by::

    S(m) = alpha * s(m) + (1 - alpha) * (u(m) + kappa * sqrt(ln N / max(n(m), 1)))

with ``u(m)`` the entry's utility (:attr:`ExperienceEntry.utility`: 0.5 for a new entry, moved by
``experience.utility.beta`` towards the success of each guided training episode it was shown to),
``n(m)`` = ``utility_count_start`` + its ``times_retrieved`` (released: a count that starts at 1),
``N`` the sum of ``n`` over the bank (at least 1), ``alpha`` = ``utility_alpha`` (0.7) and ``kappa`` =
``utility_ucb`` (1.0). Read-only calls (evaluation) leave the exploration bonus out, as the authors'
released code evaluates (``greedy``: ``alpha * s + (1 - alpha) * u``), and return ``utility_eval_k``
entries (released ``top_k`` 3 in evaluation, 1 in training; 0 = ``k``). Ties keep the similarity
order; no demotion. The released code counts ``n`` when an episode's outcome updates the entry,
crl-bench at retrieval (the paper); the two differ only by episodes in flight.

**Own task skipped** (``skip_same_key``; banks of cases, ``experience.cases.skip_own``): candidates
keyed by the query itself (the episode's own task: a case is keyed by the retrieval query of the
episode it was written from) are dropped before the re-rank (the search is widened by
:data:`SKIP_WIDEN` so that ``k * oversample`` candidates of other tasks remain), and of several candidates with one key
only the best ranked is returned, as ExpeL's retrieval skips the current task and a task already
among the chosen examples (LeapLabTHU/ExpeL ``agent/expel.py``, ``topk_docs``).

A read-only call (``count_retrievals=False``, used by evaluation) changes nothing: no counters are written and
its demotion draws come from a separate generator, so evaluating between training steps leaves the
training retrievals exactly as they would have been. :meth:`Retriever.begin_readonly` (called by the
trainer before each evaluation) fixes the read-only clock at the bank's last training retrieval and
from then on draws each read-only query's demotion from a generator seeded by the evaluation's key,
the query's env and the query text: a read-only evaluation's retrievals are a function of the bank
and the query, so they depend neither on the evaluations run before it (another mode, the extra
attempts of ``eval.trials``), nor on the order its episodes retrieve in (the evaluation stream
interleaves every mode's episodes, trainer/evaluation.py), nor on how long after training it runs:
"recent" then means retrieved in the last ``recency_window_s`` of training.  The same query in one
evaluation gets the same draw (e.g. the ``shuffled`` control is shown what ``guided`` is shown for
its donor task's first observation).

As in the released code, the usage counters are read once per ``retrieve`` call, before its
retrievals are recorded: queries in the same batch do not see each other's retrievals. The returned
:class:`ExperienceEntry` objects carry those pre-retrieval counters.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Sequence
from typing import Literal, get_args

from crl_bench.experience.embedding import QueryCache
from crl_bench.experience.types import ExperienceEntry

RANK_SCORES = ("position", "cosine")
Rerank = Literal["released", "utility"]
"""Values of ``experience.rerank``: how retrieval orders its candidates."""
RERANKS: tuple[str, ...] = get_args(Rerank)
UtilityCandidates = Literal["all", "nearest"]
"""Values of ``experience.utility.candidates``: which entries the utility re-rank scores."""
UTILITY_CANDIDATES: tuple[str, ...] = get_args(UtilityCandidates)
SKIP_WIDEN = 4
"""With ``skip_same_key`` the search returns this many times the candidates, so that the own task's
entries, dropped, leave ``k * oversample`` candidates of other tasks (unless the env has fewer)."""


class Retriever:
    """Batched top-k retrieval with frequency / recency re-rank over an :class:`ExperienceBank`.

    Args:
        bank: the experience bank (its ``embedder`` embeds the queries).
        k: entries returned per query (1 released).
        oversample: candidates searched per returned entry (16 released).
        freq_penalty: lambda of ``lambda * log(1 + times_retrieved)`` (0.4 released).
        recency_window_s: an entry retrieved less than this many seconds ago is "recent" (300 s).
        top1_demote_p: probability of demoting a recent top-1 candidate (0.5 released).
        seed: seed of the demotion draws.
        rank_score: ``position`` (released) or ``cosine``; see the module docstring.
        count_retrievals: count the returned entries as retrieved in the bank (on by default).
        query_cache: most query embeddings kept in the LRU query cache (0 = no cache).
        rerank: ``released`` (the diversity re-rank) or ``utility`` (SimUtil-UCB); see the module
            docstring. ``utility_alpha``, ``utility_ucb``, ``utility_min_sim``: its alpha, kappa and
            similarity floor; ``utility_candidates`` (``all`` or ``nearest``), ``utility_count_start``
            and ``utility_eval_k``: what it scores, a new entry's use count and its read-only k.
        skip_same_key: drop the entries keyed by the query itself and return one entry per key
            (the own task skipped; see the module docstring).

    Raises:
        ValueError: an unknown ``rank_score``, ``rerank`` or ``utility_candidates``, or
            ``utility_alpha`` outside [0, 1].

    ``retrieve`` may be called from several threads while no bank write happens (the random draws
    are guarded by a lock; their interleaving across threads is then not deterministic).
    """

    def __init__(self, bank, k: int = 1, oversample: int = 16, freq_penalty: float = 0.4,
                 recency_window_s: float = 300.0, top1_demote_p: float = 0.5, seed: int = 0, *,
                 rank_score: str = "position", count_retrievals: bool = True, query_cache: int = 4096,
                 rerank: str = "released", utility_alpha: float = 0.7, utility_ucb: float = 1.0,
                 utility_min_sim: float = 0.4, utility_candidates: str = "all", utility_count_start: int = 1,
                 utility_eval_k: int = 3, skip_same_key: bool = False):
        if rank_score not in RANK_SCORES:
            raise ValueError(f"rank_score must be one of {RANK_SCORES}")
        if rerank not in RERANKS:
            raise ValueError(f"rerank must be one of {RERANKS}, got {rerank!r}")
        if utility_candidates not in UTILITY_CANDIDATES:
            raise ValueError(f"utility_candidates must be one of {UTILITY_CANDIDATES}, got {utility_candidates!r}")
        if not 0.0 <= utility_alpha <= 1.0:
            raise ValueError(f"utility_alpha must be in [0, 1], got {utility_alpha}")
        self.rerank_mode = rerank
        self.utility_alpha = float(utility_alpha)
        self.utility_ucb = float(utility_ucb)
        self.utility_min_sim = float(utility_min_sim)
        self.utility_candidates = utility_candidates
        self.utility_count_start = max(0, int(utility_count_start))
        self.utility_eval_k = max(0, int(utility_eval_k))
        self.skip_same_key = bool(skip_same_key)
        self.bank = bank
        self.k = int(k)
        self.oversample = max(1, int(oversample))
        self.freq_penalty = float(freq_penalty)
        self.recency_window_s = float(recency_window_s)
        self.top1_demote_p = float(top1_demote_p)
        self.rank_score = rank_score
        self.count_retrievals = count_retrievals
        self._rng = random.Random(seed)
        self._readonly_rng = random.Random(seed + 1)
        self._readonly_now: float | None = None     # read-only clock (begin_readonly); None: wall clock
        self._readonly_key: str | None = None       # read-only draws per query (begin_readonly); None: _readonly_rng
        self._rng_lock = threading.Lock()
        self.query_cache = QueryCache(bank.embedder, query_cache)

    def begin_readonly(self, key: str, now: float) -> None:
        """Start a read-only evaluation: reseed the read-only demotion draws from ``key`` (e.g. the
        run's seed and the eval mode) and let read-only calls without an explicit ``now`` take
        ``now`` (seconds since the epoch; the bank's :meth:`last_retrieval_time`) as the time instead
        of the wall clock. From then on each read-only query draws its demotion from a generator of its
        own, seeded by ``key``, the query's env and the query text (order-free). Counting calls
        (training) are unaffected. See the module docstring."""
        with self._rng_lock:
            self._readonly_rng = random.Random(f"readonly:{key}")
            self._readonly_key = str(key)
            self._readonly_now = float(now)

    def _readonly_draws(self, env_id: str, query: str) -> random.Random:
        """The generator of a read-only query's demotion draw: one seeded by the evaluation's key, the env
        and the query after :meth:`begin_readonly`, else the shared read-only generator."""
        if self._readonly_key is None:
            return self._readonly_rng
        return random.Random(f"readonly:{self._readonly_key}:{env_id}:{query}")

    def state_dict(self) -> dict:
        """The retriever's generators (training and read-only demotion draws), for checkpoints."""
        with self._rng_lock:
            return {"rng": self._rng.getstate(), "readonly_rng": self._readonly_rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        with self._rng_lock:
            self._rng.setstate(state["rng"])
            self._readonly_rng.setstate(state["readonly_rng"])

    def cache_info(self) -> dict:
        """Counters of the query-embedding cache since the retriever was made: ``size, capacity,
        hits, misses, evictions, hit_rate`` (:meth:`QueryCache.info`)."""
        return self.query_cache.info()

    def _recent(self, e: ExperienceEntry, now: float) -> bool:
        return e.last_retrieved > 0 and (now - e.last_retrieved) < self.recency_window_s

    def rerank(self, cands: list[tuple[ExperienceEntry, float]], now: float,
               rng: random.Random | None = None) -> list[ExperienceEntry]:
        """Re-rank ``(entry, cosine)`` candidates given in similarity order (best first); demotion
        draws come from ``rng`` (default: the retriever's own generator)."""
        scored = []
        for r, (e, cos) in enumerate(cands):
            base = -float(r) if self.rank_score == "position" else float(cos)
            s = base - self.freq_penalty * math.log1p(e.times_retrieved) - (1.0 if self._recent(e, now) else 0.0)
            scored.append((s, r, e))
        scored.sort(key=lambda x: (-x[0], x[1]))
        out = [e for _, _, e in scored]
        if out and self.top1_demote_p > 0 and self._recent(out[0], now):
            with self._rng_lock:
                draw = (rng or self._rng).random()
            if draw < self.top1_demote_p:
                out = out[1:] + out[:1]
        return out

    def utility_rank(self, cands: list[tuple[ExperienceEntry, float]], total_retrievals: int,
                     explore: bool = True) -> list[ExperienceEntry]:
        """The ``utility`` re-rank of ``(entry, cosine)`` candidates (module docstring): candidates
        under ``utility_min_sim`` dropped, the rest by ``S(m)`` descending (ties: similarity order);
        ``explore`` adds the UCB bonus with ``N = max(total_retrievals, 1)`` (``total_retrievals``: the
        sum of the use counts ``n``, ``utility_count_start`` per entry included) and ``n(m) =
        utility_count_start + times_retrieved``."""
        log_n = math.log(max(int(total_retrievals), 1))
        start = self.utility_count_start
        scored = []
        for r, (e, cos) in enumerate(cands):
            if cos < self.utility_min_sim:
                continue
            n = max(start + e.times_retrieved, 1)
            u = e.utility + (self.utility_ucb * math.sqrt(log_n / n) if explore else 0.0)
            scored.append((self.utility_alpha * float(cos) + (1.0 - self.utility_alpha) * u, r, e))
        scored.sort(key=lambda x: (-x[0], x[1]))
        return [e for _, _, e in scored]

    @staticmethod
    def _one_per_key(ranked: list[ExperienceEntry], keys: dict[int, str]) -> list[ExperienceEntry]:
        """``ranked`` without the entries whose key an earlier one has (entries without a key kept)."""
        seen: set[str] = set()
        out = []
        for e in ranked:
            key = keys.get(e.id, "")
            if key and key in seen:
                continue
            seen.add(key)
            out.append(e)
        return out

    def retrieve(self, queries: Sequence[str], env_ids: Sequence[str], now: float | None = None,
                 count_retrievals: bool | None = None) -> list[list[ExperienceEntry]]:
        """Up to ``k`` entries per query (of that query's env), best first after the re-rank.

        ``count_retrievals`` (default: the retriever's ``count_retrievals`` setting) counts the returned entries as
        retrieved; ``count_retrievals=False`` is read-only (see the module docstring).
        """
        count_retrievals = self.count_retrievals if count_retrievals is None else count_retrievals
        if len(queries) != len(env_ids):
            raise ValueError("queries and env_ids must have the same length")
        if now is None:
            now = self._readonly_now if not count_retrievals and self._readonly_now is not None else time.time()
        now = float(now)
        out: list[list[ExperienceEntry]] = [[] for _ in queries]
        if not queries or self.k <= 0:
            return out
        utility = self.rerank_mode == "utility"
        k = self.utility_eval_k if utility and not count_retrievals and self.utility_eval_k > 0 else self.k
        n_search = k * self.oversample
        if utility and self.utility_candidates == "all":
            n_search = max(n_search, len(self.bank))      # every entry of the env: the floor decides
        # with the own task skipped, search wider so that its cases do not crowd out the candidates
        wide = n_search * SKIP_WIDEN if self.skip_same_key else n_search
        vecs = self.query_cache.encode(list(queries))
        groups: dict[str, list[int]] = {}
        for i, env in enumerate(env_ids):
            groups.setdefault(env, []).append(i)
        hits: list[list[tuple[int, float]]] = [[] for _ in queries]
        for env, idx in groups.items():
            res = self.bank.search_vectors(vecs[idx], wide, env)
            for i, r in zip(idx, res):
                hits[i] = r
        by_id = {e.id: e for e in self.bank.get(list({i for h in hits for i, _ in h}))}
        keys = {i: " ".join(t.split()) for i, t in self.bank.key_texts(list(by_id)).items()} \
            if self.skip_same_key and by_id else {}
        total = 0
        if utility and by_id:
            total = self.bank.total_retrievals() + self.utility_count_start * len(self.bank)
        returned: list[int] = []
        for qi, h in enumerate(hits):
            cands = [(by_id[i], s) for i, s in h if i in by_id]   # ids gone since the search are dropped
            if self.skip_same_key:
                own = " ".join(queries[qi].split())
                cands = [(e, s) for e, s in cands if keys.get(e.id) != own][:n_search]
            if utility:
                ranked = self.utility_rank(cands, total, explore=count_retrievals)
            else:
                draws = None if count_retrievals else self._readonly_draws(env_ids[qi], queries[qi])
                ranked = self.rerank(cands, now, draws)
            out[qi] = (self._one_per_key(ranked, keys) if self.skip_same_key else ranked)[:k]
            returned.extend(e.id for e in out[qi])
        if count_retrievals and returned:
            self.bank.record_retrieval(returned, now)
        return out
