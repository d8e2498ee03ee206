"""Resuming an evaluation episode by episode (trainer/eval_journal.py, Evaluator.evaluate_modes with a
journal): an evaluation interrupted mid-mode, run again with its journal, rolls out only the episodes it
had not finished and gives the block the uninterrupted evaluation gives, saying how many it resumed."""

from __future__ import annotations

import json
import re

import pytest
from tests_helpers import CoinEnv, coin_config

from crl_bench.env_api import register_env
from crl_bench.llm.base import Generation
from crl_bench.rollout import Trajectory, Turn
from crl_bench.trainer.eval_journal import EpisodeJournal, episode_from_record, episode_record
from crl_bench.trainer.loop import Trainer


class NumberedCoin(CoinEnv):
    """The coin, its observation naming the task, so that a scripted actor can play by task."""

    env_id = "test-coin-numbered"

    def _observe(self, message=""):
        return f"Coin number {self.task}. {message}"


register_env("test-coin-numbered", NumberedCoin)


class _Interrupted(Exception):
    """Stands for the process being killed mid-evaluation."""


class ParityEngine:
    """Calls heads on tasks not divisible by 3, tails on the others; raises :class:`_Interrupted` at call
    ``stop_at`` (counting from 1)."""

    def __init__(self, tokenizer, stop_at=None):
        self.tokenizer, self.stop_at, self.calls, self.prompts = tokenizer, stop_at, 0, 0

    def generate(self, prompts, params, allowed=None):
        self.calls += 1
        if self.stop_at is not None and self.calls >= self.stop_at:
            raise _Interrupted
        self.prompts += len(prompts)
        out = []
        for p in prompts:
            task = int(re.findall(r"Coin number (\d+)", self.tokenizer.decode(p))[-1])
            text = ("heads" if task % 3 else "tails") + "</answer>"
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Generation(list(p), ids, [-0.5] * len(ids), text, "stop"))
        return out

    def sync_weights(self, model):
        pass


@pytest.fixture()
def trainer(tiny_model, tokenizer):
    cfg = coin_config("grpo", rollout={"mix": "test-coin-numbered", "max_concurrent": 2},
                      eval={"episodes": "all", "temperature": 0.0})
    t = Trainer(cfg, model=tiny_model, tokenizer=tokenizer)
    yield t
    t.close()


def _free(trainer, engine, journal=None):
    trainer.runner.engine = engine
    return trainer.evaluator.evaluate_modes(["free"], journal=journal)["free"]


def test_an_interrupted_mode_resumes_at_its_unfinished_episodes(trainer, tokenizer, tmp_path):
    whole = _free(trainer, ParityEngine(tokenizer))
    assert whole["per_env"]["test-coin-numbered"]["successes"] == [int(t % 3 != 0) for t in range(100, 110)]
    path = tmp_path / "eval.json.episodes.jsonl"
    with pytest.raises(_Interrupted):
        _free(trainer, ParityEngine(tokenizer, stop_at=4), EpisodeJournal(path, {"k": 1}))
    lines = path.read_text().splitlines()
    assert len(lines) == 6                            # 3 calls of 2 live episodes each ended
    with path.open("a") as f:
        f.write('{"key": "torn')                      # killed mid-line
    engine = ParityEngine(tokenizer)
    journal = EpisodeJournal(path, {"k": 1})
    resumed = _free(trainer, engine, journal)
    journal.close()
    assert engine.prompts == 4                        # only the 4 episodes not in the journal
    assert resumed["resumed_episodes"] == 6
    for key in ("episodes", "success_rate", "steps_mean", "invalid_action_rate", "per_env", "tasks"):
        assert resumed[key] == whole[key], key
    assert len(path.read_text().splitlines()) == 11   # the torn line ended, 4 more episodes recorded


def test_a_journal_of_another_evaluation_is_not_used(trainer, tokenizer, tmp_path):
    path = tmp_path / "j.jsonl"
    with pytest.raises(_Interrupted):
        _free(trainer, ParityEngine(tokenizer, stop_at=3), EpisodeJournal(path, {"model": "a"}))
    before = path.read_text()
    engine = ParityEngine(tokenizer)
    with pytest.warns(UserWarning, match="another evaluation"):
        journal = EpisodeJournal(path, {"model": "b"})
    block = _free(trainer, engine, journal)
    assert engine.prompts == 10 and "resumed_episodes" not in block
    assert {json.loads(x)["key"] for x in path.read_text().splitlines()} == {EpisodeJournal(path, {"model": "b"}).key}
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("j.jsonl.stale-")]
    assert len(aside) == 1 and aside[0].read_text() == before   # the other evaluation's episodes are kept


def test_a_record_keeps_what_a_block_reads():
    turn = Turn([1], [2, 3], [-0.1, -0.2], "up", False, 0.0, reply="<answer>up", entropy=[0.5, 0.25],
                sampling_entropy=[0.1])
    t = Trajectory("sokoban", 7, 1, "guided", turns=[turn],
                   reward=1.0, success=True, steps=1, terminated=True, experience_ids=[4], meta={"sample": 2},
                   error="", context_full=False)
    back = episode_from_record(json.loads(json.dumps(episode_record(t))))
    for name in ("env_id", "task", "group_id", "subgroup", "reward", "success", "steps", "invalid_actions",
                 "terminated", "truncated", "context_full", "error", "experience_ids", "meta"):
        assert getattr(back, name) == getattr(t, name), name
    u, v = back.turns[0], t.turns[0]
    assert (u.action, u.reply, u.entropy, u.sampling_entropy) == (v.action, v.reply, v.entropy, v.sampling_entropy)
    assert u.response_ids == [] and u.prompt_ids == []
