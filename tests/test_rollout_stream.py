"""Continuous batching of the rollout (``RolloutRunner.continuous``) and several hook streams in one
queue (``collect_streams``), on a batch-independent scripted engine: the episodes equal the waves'
episodes, the slots stay full, each stream's hooks see only its own episodes, and every episode that
ends (failed ones too) is counted."""

from __future__ import annotations

import re

import pytest
from tests_helpers import PromptHashEngine

from crl_bench.env_api import TextEnv, register_env
from crl_bench.llm.base import SamplingParams
from crl_bench.rollout import EnvPool, EpisodeSpec, Guidance, PromptBuilder, RolloutRunner


class _Lengths(TextEnv):
    """Task ``t`` ends after ``t % 10`` actions (``t`` >= 100: its reset fails); "right" succeeds."""

    env_id = "test-lengths"
    system_prompt = "Pick a side."

    def _reset_task(self, task):
        if task >= 100:
            raise RuntimeError("reset failed")
        self.n, self.won = 0, False

    def _apply(self, action):
        self.n += 1
        self.won = self.won or action == "right"
        done = self.n >= max(1, self.task % 10)
        return (1.0 if done and self.won else 0.0), done, done and self.won, f"step {self.n}"

    def _observe(self, message=""):
        return f"Room {self.task}. {message}"

    def admissible_actions(self):
        return ["left", "right"]


@pytest.fixture(autouse=True)
def _env():
    register_env("test-lengths", _Lengths)


def _runner(tokenizer, continuous, n=2):
    return RolloutRunner(PromptHashEngine(tokenizer), PromptBuilder(tokenizer), EnvPool(),
                         SamplingParams(temperature=0.0, max_new_tokens=8), max_concurrent=n, continuous=continuous)


def _record(t):
    return (t.env_id, t.task, t.group_id, t.subgroup, t.reward, t.success, t.steps, t.invalid_actions, t.terminated,
            t.truncated, t.error, t.guidance, t.experience_ids, t.final_obs, t.query, t.initial_prompt,
            [(x.prompt_ids, x.response_ids, x.logprobs, x.action, x.reward, x.observation, x.reply) for x in t.turns])


def test_continuous_batching_keeps_the_slots_full_and_gives_the_waves_episodes(tokenizer):
    specs = [EpisodeSpec("test-lengths", t, group_id=i) for i, t in enumerate([4, 1, 1, 1, 4, 1, 1, 1])]
    waves, stream = _runner(tokenizer, False), _runner(tokenizer, True)
    before, after = waves.collect(specs), stream.collect(specs)
    assert [_record(t) for t in after] == [_record(t) for t in before]     # spec order, same episodes
    # waves of two wait for their slowest episode: 4 + 1 + 4 + 1 turns, the long waves mostly at batch 1
    assert waves.engine.batches == [2, 1, 1, 1, 2, 2, 1, 1, 1, 2]
    # the stream refills a slot at the next turn: batch 2 until the queue runs dry
    assert stream.engine.batches == [2, 2, 2, 2, 2, 2, 2] and stream.last_stats.generate_calls == 7
    assert sum(waves.engine.batches) == sum(stream.engine.batches) == sum(t.steps for t in after)


def test_streams_take_their_own_hooks_and_guides_are_batched_per_joining_turn(tokenizer):
    asked: dict[str, list[list[int]]] = {"a": [], "b": []}

    def guide(name):
        def call(requests):
            asked[name].append([int(re.search(r"Room (\d+)", q).group(1)) for _, _, q in requests])
            return [Guidance(f"hint {name}", [7]) for _ in requests]
        return call

    runner = _runner(tokenizer, True, n=3)
    a = [EpisodeSpec("test-lengths", t, retrieve=True) for t in (3, 1, 2)]
    b = [EpisodeSpec("test-lengths", t, retrieve=True, subgroup="guided") for t in (1, 1)]
    done: list[tuple[int, int]] = []
    out = runner.collect_streams([(a, {"guide": guide("a")}), (b, {"guide": guide("b")})],
                                 stream_done=lambda k, trajs: done.append((k, len(trajs))))
    assert [t.task for t in out[0]] == [3, 1, 2] and [t.task for t in out[1]] == [1, 1]
    assert all(t.guidance == "hint a" for t in out[0]) and all(t.guidance == "hint b" for t in out[1])
    assert asked["a"] == [[3, 1, 2]]                 # the first three join together: one guide call
    # task 1 ends after turn 1: one of b's joins at turn 2; task 2 ends after turn 2: the other at turn 3
    assert asked["b"] == [[1], [1]]
    assert done == [(0, 3), (1, 2)]                  # both end at turn 3, in queue order
    with pytest.raises(ValueError, match="unknown rollout hooks"):
        runner.collect_streams([(a, {"guides": None})])


def test_every_ended_episode_is_counted_failed_ones_too(tokenizer):
    ticks: list[int] = []
    runner = _runner(tokenizer, True, n=2)
    trajs = runner.collect([EpisodeSpec("test-lengths", t) for t in (2, 100, 1, 101, 3)], progress=ticks.append)
    assert "reset failed" in trajs[1].error and "reset failed" in trajs[3].error
    assert sum(ticks) == 5 and [t.steps for t in trajs] == [2, 0, 1, 0, 3]


class _Prefetched(_Lengths):
    env_id = "test-prefetched"
    prefetch_resets = True


def test_pending_resets_are_prefetched_and_the_next_batch_handed_on(tokenizer):
    register_env("test-prefetched", _Prefetched)
    runner = _runner(tokenizer, True, n=2)
    specs = [EpisodeSpec("test-prefetched", t) for t in (2, 1, 3, 1, 2)]
    nxt = [EpisodeSpec("test-prefetched", t) for t in (11, 12)]
    trajs = runner.collect(specs, prefetch=nxt)
    assert runner.pool.prefetch_hits == 3            # every spec after the first two joined on a started reset
    assert [t.steps for t in trajs] == [2, 1, 3, 1, 2]
    runner.collect(nxt)
    assert runner.pool.prefetch_hits == 5            # the next batch's resets were started during this one
