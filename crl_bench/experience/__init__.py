"""The experience bank and everything around it (Complementary RL, arXiv 2603.17621, docs/method.md).

* :mod:`.types`: entries and operations (ADD / UPDATE / MERGE / NONE).
* :mod:`.operations`: the strict text format the extractor answers in, and its parser.
* :mod:`.embedding`: sentence embeddings (offline all-MiniLM-L6-v2 from PyPI by default), cached.
* :mod:`.validation`: the rejection reasons and the checks of one operation that need no database.
* :mod:`.vector_index`: the FAISS shards (one per env; auto / flat / ivf / hnsw), OpenMP and BLAS settings.
* :mod:`.bank`: SQLite (WAL) storage + the vector index, validated atomic operations, eviction, stats.
* :mod:`.retrieval`: top-k search with the diversity re-rank.
* :mod:`.extractor`: the extractor's inference side (episode record, prompts, sampling an extraction).
* :mod:`.manager`: the background experience manager (distillation queue, locks, micro-batched search);
  :mod:`.requests`: the requests its worker takes, each type with its handler.
* :mod:`.memory`: the memory kinds' interface and registry; one module per kind: :mod:`.lessons`
  (distillation and the merge pass), :mod:`.cases`, :mod:`.insights` (ExpeL), :mod:`.reflections`
  (Reflexion); :mod:`.records`: the finished episodes as the text records they write from.

Nothing here knows the trainer: the extractor's training (reward, advantages, CISPO) is in
:mod:`crl_bench.trainer`.
"""
