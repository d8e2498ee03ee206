"""ExpeL baseline: insights of a frozen extractor and the most similar successful case.

A frozen extractor model compares successful and failed episodes of one task and edits a list of
insights per env with ADD / EDIT / UPVOTE / DOWNVOTE and importance counts; a guided episode is shown
its env's insights and the most similar successful case (ExpeL, arXiv 2308.10144, sections 4.2-4.3;
docs/method.md, "ExpeL insights"). Declared with the other methods in :mod:`crl_bench.methods`; the
insights are written by :class:`crl_bench.experience.insights.InsightWriter`.
"""

from crl_bench.methods import EXPEL

__all__ = ["EXPEL"]
