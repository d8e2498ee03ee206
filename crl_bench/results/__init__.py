"""Everything that writes or reads a run folder, and what is built from run folders.

* :mod:`~crl_bench.results.run_folder`: the run folder (its files, :func:`~.run_folder.is_run_folder`,
  the writer, the lock, metrics readers, versions).
* :mod:`~crl_bench.results.alarms`: learning alarms computed from metrics rows (live and afterwards).
* :mod:`~crl_bench.results.summary`: ``summary.json`` (schema in ``crl_bench/schemas/``).
* :mod:`~crl_bench.results.leaderboard`: tables with confidence intervals from summaries, keyed by protocol
  (:mod:`~crl_bench.results.headline`: one row per method and model).
* :mod:`~crl_bench.results.stats`: the bootstraps (over tasks; over seeds, then tasks), P(A > B), IQM,
  seeds needed; :mod:`~crl_bench.results.compare`: ``crl-bench compare``; :mod:`~crl_bench.results.power`:
  the seeds a sweep needs.
* :mod:`~crl_bench.results.report`: ``report.html`` with plots from run and sweep folders
  (:mod:`~crl_bench.results.report_html`, :mod:`~crl_bench.results.interval_plots`).
* :mod:`~crl_bench.results.submission`: leaderboard submissions (pack, check).
* :mod:`~crl_bench.results.tracking`: optional TensorBoard / Weights & Biases mirrors of ``metrics.jsonl``.
"""
