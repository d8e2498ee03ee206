"""Finished trajectories as the text records that the memory kinds write from.

The rollout's :class:`~crl_bench.rollout.Trajectory` is read by duck typing (``turns``, ``tool_calls``,
``final_obs``, ``env_id``, ``task_prompt``, ``success``, ``reward``, ``group_id``, ``meta``, ``query``),
so that this layer stays below the rollout: every memory kind (:mod:`crl_bench.experience.memory`)
turns the episodes of a finished step into its requests with these functions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from crl_bench.experience.transcripts import EpisodeRecord


def step_text(traj: Any, k: int) -> tuple[str, str, str]:
    """``(observation, action, feedback)`` of turn ``k`` of ``traj`` (a search-tool call reads
    ``(search) question``, its feedback the search results)."""
    from crl_bench.env_api import feedback_of  # the env layer, imported when an episode is written

    turn = traj.turns[k]
    nxt = traj.turns[k + 1].observation if k + 1 < len(traj.turns) else traj.final_obs
    if turn.tool:
        call = next((c for c in traj.tool_calls if c.turn == k), None)
        return turn.observation, f"(search) {call.query if call else turn.reply}", \
            f"Search results: {call.answer}" if call else ""
    return turn.observation, turn.action or turn.reply, feedback_of(nxt)


def episode_record(traj: Any) -> EpisodeRecord:
    """The text record of a finished episode that the extractor reads (each step's observation,
    action and feedback, and the actor's whole replies for ``extractor.transcript: full``)."""
    steps = [step_text(traj, k) for k in range(len(traj.turns))]
    return EpisodeRecord(env_id=traj.env_id, task_prompt=traj.task_prompt, steps=steps, success=traj.success,
                         reward=traj.reward, final_obs=traj.final_obs, group_id=traj.group_id,
                         source=(traj.group_id, traj.meta.get("rollout")), replies=[t.reply for t in traj.turns])


def turn_record(traj: Any, k: int) -> EpisodeRecord:
    """The record of turn ``k`` alone that turn-level distillation reads (released turn-based update:
    the step's action and the env's feedback, keyed by the observation it was taken in)."""
    turn = traj.turns[k]
    obs, action, feedback = step_text(traj, k)
    nxt = traj.turns[k + 1].observation if k + 1 < len(traj.turns) else traj.final_obs
    return EpisodeRecord(env_id=traj.env_id, task_prompt=traj.task_prompt, steps=[(obs, action, feedback)],
                         success=traj.success and k + 1 == len(traj.turns), reward=turn.reward, final_obs=nxt,
                         group_id=traj.group_id, source=(traj.group_id, traj.meta.get("rollout"), k),
                         replies=[turn.reply], outcome=f"one step of an episode (step reward {turn.reward:.2f})")


def entry_key(traj: Any) -> str:
    """What the entries distilled from the whole episode ``traj`` are keyed by with
    ``experience.key: query``: the env's own key (:attr:`~crl_bench.rollout.Trajectory.key`, MiniHack's
    released raw key), else the episode's retrieval query."""
    return getattr(traj, "key", "") or traj.query


def turn_query(traj: Any, k: int) -> str:
    """The retrieval query of turn ``k``'s observation (recorded by turn-level retrieval), else the
    episode's query."""
    return traj.turns[k].query or traj.query


def by_group(trajs: Sequence[Any]) -> dict[int, list[Any]]:
    """``trajs`` by GRPO group, groups and episodes in rollout order."""
    out: dict[int, list[Any]] = defaultdict(list)
    for t in trajs:
        out[t.group_id].append(t)
    return out
