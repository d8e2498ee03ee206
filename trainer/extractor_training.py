"""The experience extractor's training signal: reward of one use, batch advantages, training samples.

Complementary RL (arXiv 2603.17621, docs/method.md) trains the extractor with CISPO
(:func:`crl_bench.trainer.losses.cispo_loss`) on its own samples (:class:`Extraction`, sampled by
:class:`crl_bench.experience.extractor.Extractor`): each extraction call is rewarded by the outcome of
the guided episodes that used the entries it wrote (credited in :mod:`crl_bench.trainer.experience_track`),
and its advantage is that reward against the batch mean
(:func:`crl_bench.trainer.advantages.grouped_advantages` with one key for the whole batch).

* The extractor's reward, all of it here: :func:`use_reward` (one use of an entry by a guided
  episode) built from :func:`binary_reward` (the released live reward), :func:`relative_reward` (an
  option) and :func:`critic_reward` (the actor-critic judge's mapping, :mod:`~crl_bench.trainer.actor_critic`);
  :func:`answer_reward` (an answer of the search tool).
* :func:`extraction_sample`: an extraction as a :class:`~crl_bench.trainer.policy.TokenSample`.
"""

from __future__ import annotations

from collections.abc import Sequence

from crl_bench.experience.extractor import Extraction
from crl_bench.rollout import Trajectory
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


def critic_reward(decision: str, score: float) -> float:
    """The extractor's reward for one use of its knowledge under the judge (released mapping):
    reject -1, refine 0.5, accept ``score + 1``; ``invalid`` (or no judge) gives the plain ``score``.

    The caller then maps a reward of exactly 0 to -1 (:func:`binary_reward`), as the released pipeline
    does after this step (:func:`use_reward`).
    """
    if decision == "reject":
        return -1.0
    if decision == "refine":
        return 0.5
    if decision == "accept":
        return float(score) + 1.0
    return float(score)


def use_reward(traj: Trajectory, free_scores: Sequence[float], kind: str) -> float:
    """The reward one use of an entry by guided episode ``traj`` gives the extraction that wrote it.

    ``binary`` (released live path, ``_collect_triggered_interactions_to_buffer``): the episode's
    score (its return), with a score of exactly 0 counted as -1.  ``relative``: +1 / 0 / -1 against the
    mean score of the group's experience-free episodes (``binary`` when the group has none).  With an
    actor-critic judgement on the record, :func:`critic_reward` applies
    first (reject -1, refine 0.5, accept score + 1), then the 0 -> -1 rule.
    """
    rec = traj.retrieval
    if kind == "relative" and free_scores:
        r = relative_reward(traj.reward, free_scores)
        if rec is not None and rec.judgement:
            r = critic_reward(rec.judgement, r)
        return r
    score = float(traj.reward)
    if rec is not None and rec.judgement:
        score = critic_reward(rec.judgement, score)
    return binary_reward(score)


def answer_reward(traj: Trajectory) -> float:
    """The reward of the extractor's answer to a search-tool query of guided episode ``traj``: the
    episode's :func:`binary_reward` (an answer is not judged by the actor-critic judge, so no
    :func:`critic_reward` applies)."""
    return binary_reward(float(traj.reward))


def extraction_sample(extraction: Extraction, advantage: float) -> TokenSample:
    """``extraction`` as one CISPO training sequence: its prompt ids (masked out of the loss), its
    response ids with their behaviour log-probs, and ``advantage`` broadcast over the response tokens.
    The lists are copied."""
    return TokenSample(list(extraction.prompt_ids), list(extraction.response_ids), list(extraction.logprobs),
                       float(advantage))
