"""Repeated evaluation trials (``eval.trials``): attempt k + 1 runs only the tasks no earlier attempt
solved, a task's best attempt is reported, and the protocol, the summary and the leaderboard carry
the trials."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tests_helpers import CoinEnv, coin_config

from crl_bench.config import ConfigError
from crl_bench.env_api import register_env
from crl_bench.rollout import EpisodeSpec
from crl_bench.trainer.loop import Trainer


@pytest.fixture(autouse=True)
def _coin():
    register_env("test-coin", CoinEnv)


class _ScriptedRunner:
    """Gives each task the outcomes listed for it, one per attempt, and records what each attempt ran."""

    def __init__(self, outcomes):
        self.outcomes = outcomes            # task -> [(success, reward), ...]
        self.calls: list[list[int]] = []

    def collect(self, specs, sampling, progress=None, **hooks):
        k = len(self.calls)
        self.calls.append([s.task for s in specs])
        return [SimpleNamespace(task=s.task, attempt=k, success=self.outcomes[s.task][k][0],
                                reward=self.outcomes[s.task][k][1]) for s in specs]


def test_each_attempt_runs_the_unsolved_tasks_and_the_best_attempt_is_kept(tokenizer, tiny_model):
    tr = Trainer(coin_config("grpo", eval={"trials": 3}), model=tiny_model, tokenizer=tokenizer)
    tr.runner = _ScriptedRunner({
        1: [(False, 0.2), (False, 0.5), (True, 1.0)],   # solved at the third attempt
        2: [(True, 1.0)],                               # solved at once, never run again
        3: [(False, 0.4), (False, 0.1), (False, 0.4)],  # never solved: the best (earliest on ties) is kept
        4: [(False, 0.0), (True, 1.0)],
    })
    specs = [EpisodeSpec("test-coin", t) for t in (1, 2, 3, 4)]
    best, by_trial, attempts = tr.evaluator.trials(specs, None, {})
    assert tr.runner.calls == [[1, 2, 3, 4], [1, 3, 4], [1, 3]]
    assert [(b.task, b.attempt) for b in best] == [(1, 2), (2, 0), (3, 0), (4, 1)]
    assert by_trial == [0.25, 0.5, 0.75] and attempts == 4 + 3 + 2
    tr.close()


def test_trials_in_the_evaluation_protocol_and_summary(tmp_path, tokenizer, tiny_model):
    from crl_bench.results.leaderboard import protocol_label
    from crl_bench.results.run_folder import RunWriter
    from crl_bench.results.summary import build_summary, validate_summary

    cfg = coin_config("grpo", eval={"trials": 3, "temperature": 1.0, "episodes": 6})
    writer = RunWriter(tmp_path, "run")
    tr = Trainer(cfg, writer=writer, model=tiny_model, tokenizer=tokenizer)
    ev = tr.evaluator.evaluate_all()
    block = ev["free"]
    tasks = block["per_env"]["test-coin"]["successes"]
    assert block["episodes"] == len(tasks) == 6
    sbt = block["success_by_trial"]
    assert len(sbt) == 3 and sbt == sorted(sbt) and sbt[-1] == block["success_rate"] == sum(tasks) / 6
    # attempt k + 1 ran the tasks still unsolved after attempt k
    assert block["attempts"] == 6 + round(6 * (1 - sbt[0])) + round(6 * (1 - sbt[1]))
    assert ev["protocol"]["trials"] == 3 and "3 trials" in protocol_label(ev["protocol"])
    assert tr.evaluator.episode_count() == 18
    written = cfg.to_dict()
    written["train"]["steps"] = 0                    # an evaluation-only run folder: no training rows
    writer.write_config(written)
    writer.write_versions()
    writer.write_json("eval.json", ev)
    tr.close()
    s = build_summary(writer.dir)
    assert s["eval_protocol"]["trials"] == 3
    assert s["runs"][0]["eval"]["free"]["success_by_trial"] == sbt
    validate_summary(s)                              # the schema knows the trial keys
    one = Trainer(coin_config("grpo"), model=tiny_model, tokenizer=tokenizer)
    assert "trials" not in one.evaluator.protocol() and "trials" not in protocol_label(one.evaluator.protocol())
    one.close()


@pytest.mark.parametrize("value", [0, -1, "3"])
def test_trials_must_be_a_positive_integer(value):
    with pytest.raises(ConfigError, match="eval.trials"):
        coin_config("grpo", eval={"trials": value})
