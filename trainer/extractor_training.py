"""The experience extractor's training signal: reward of one use, batch advantages, training samples.

Complementary RL (arXiv 2603.17621, docs/method.md) trains the extractor with CISPO
(:func:`crl_bench.trainer.losses.cispo_loss`) on its own samples (:class:`Extraction`, sampled by
:class:`crl_bench.experience.extractor.Extractor`): each extraction call is rewarded by the outcome of
the guided episodes that used the entries it wrote (credited in :mod:`crl_bench.trainer.complementary`),
and its advantage is that reward against the batch mean
(:func:`crl_bench.trainer.advantages.grouped_advantages` with one key for the whole batch).

* :func:`binary_reward` (the released live reward) and :func:`relative_reward` (an option): the reward
  one use gives.
* :func:`extraction_sample`: an extraction as a :class:`~crl_bench.trainer.policy.TokenSample`.
"""

from __future__ import annotations

from collections.abc import Sequence

from crl_bench.experience.extractor import Extraction
from crl_bench.trainer.policy import TokenSample


def relative_reward(guided_score: float, free_scores: Sequence[float], tol: float = 1e-9) -> float:
    """+1 / 0 / -1 when the guided episode's score is above / equal to (within ``tol``) / below the
    mean score of the experience-free subgroup (``extractor.reward: relative``).  The released code
    has this function but never calls it; its live reward is :func:`binary_reward`.

    Raises ``ValueError`` when ``free_scores`` is empty (no baseline).
    """
    if not free_scores:
        raise ValueError("relative_reward needs at least one experience-free score")
    base = sum(float(s) for s in free_scores) / len(free_scores)
    diff = float(guided_score) - base
    if abs(diff) <= tol:
        return 0.0
    return 1.0 if diff > 0 else -1.0


def binary_reward(score: float) -> float:
    """The extractor's reward for one use of its experience (``extractor.reward: binary``): the guided
    episode's score, with a score of exactly 0 counted as -1.

    For the 0/1 outcome rewards of most envs this is the paper's binary reward (+1 success, -1
    failure); envs with partial scores (WebShop) keep the score.  Source: the released pipeline's
    ``_collect_triggered_interactions_to_buffer`` (``multi_agentic_pipeline.py``), docs/method.md.
    """
    score = float(score)
    return -1.0 if score == 0.0 else score


def extraction_sample(extraction: Extraction, advantage: float) -> TokenSample:
    """``extraction`` as one CISPO training sequence: its prompt ids (masked out of the loss), its
    response ids with their behaviour log-probs, and ``advantage`` broadcast over the response tokens.
    The lists are copied."""
    return TokenSample(list(extraction.prompt_ids), list(extraction.response_ids), list(extraction.logprobs),
                       float(advantage))
