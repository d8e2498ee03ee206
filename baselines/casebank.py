"""Case-bank baseline: experience without an extractor model.

Finished episodes are stored as cases (the task and the compacted trajectory with its outcome) and a
guided episode is shown the most similar ones (ExpeL's trajectory retrieval, arXiv 2308.10144,
section 4.1; docs/method.md, "Case bank"). Declared with the other methods in
:mod:`crl_bench.methods`; the cases are written by :class:`crl_bench.experience.cases.CaseWriter`.
"""

from crl_bench.methods import CASEBANK

__all__ = ["CASEBANK"]
