"""Repeated samples in evaluation (``eval.samples``): pass@k and pass^k, hand-computed, each task run n
times independently, and the protocol, the summary and the leaderboard carrying them as their own
protocol."""

from __future__ import annotations

import pytest
from tests_helpers import CoinEnv, coin_config, write_evaluated_run

from crl_bench.config import ConfigError
from crl_bench.env_api import register_env
from crl_bench.results.passk import pass_at_k, pass_curves, pass_hat_k
from crl_bench.rollout import Trajectory
from crl_bench.trainer.loop import Trainer


@pytest.fixture(autouse=True)
def _coin():
    register_env("test-coin", CoinEnv)


def test_estimators_by_hand():
    # n = 4 samples, c = 1 success: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6; pass@4 = 1
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == pytest.approx(1.0)
    # c = 3: pass^2 = C(3,2)/C(4,2) = 3/6, pass^3 = 1/4, pass^4 = 0; pass^1 = 3/4
    assert pass_hat_k(4, 3, 1) == pytest.approx(0.75)
    assert pass_hat_k(4, 3, 2) == pytest.approx(0.5)
    assert pass_hat_k(4, 3, 3) == pytest.approx(0.25)
    assert pass_hat_k(4, 3, 4) == 0.0
    assert pass_at_k(4, 0, 3) == 0.0 and pass_hat_k(4, 4, 4) == 1.0
    # two tasks, c = 1 and 3: the means
    at, hat = pass_curves(4, [1, 3])
    # pass@3: c = 1 gives 1 - C(3,3)/C(4,3) = 3/4, c = 3 gives 1 - C(1,3)/C(4,3) = 1
    assert at == pytest.approx({"1": 0.5, "2": (0.5 + (1 - 0 / 6)) / 2, "3": (0.75 + 1.0) / 2, "4": 1.0})
    assert hat == pytest.approx({"1": 0.5, "2": (0.0 + 0.5) / 2, "3": 0.125, "4": 0.0})
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    with pytest.raises(ValueError):
        pass_curves(4, [])


class _ScriptedRunner:
    """Each task's samples succeed by the list given for it, in order; records the tasks run."""

    def __init__(self, outcomes):
        self.outcomes = outcomes
        self.seen: dict[int, int] = {}
        self.calls: list[list[int]] = []

    def collect(self, specs, sampling, progress=None, **hooks):
        self.calls.append([s.task for s in specs])
        out = []
        for s in specs:
            i = self.seen.get(s.task, 0)
            self.seen[s.task] = i + 1
            ok = self.outcomes[s.task][i]
            out.append(Trajectory(s.env_id, s.task, s.group_id, s.subgroup, success=ok, reward=float(ok), steps=1,
                                  terminated=True))
        return out


def test_each_task_runs_n_times_and_the_block_gives_pass_curves(tmp_path, tokenizer, tiny_model):
    from crl_bench.results.leaderboard import collect, leaderboard_frame, leaderboard_markdown, protocol_label
    from crl_bench.results.run_folder import RunWriter
    from crl_bench.results.summary import build_summary, validate_summary

    cfg = coin_config("grpo", eval={"samples": 4, "temperature": 1.0, "episodes": 2})
    writer = RunWriter(tmp_path / "runs", "run")
    tr = Trainer(cfg, writer=writer, model=tiny_model, tokenizer=tokenizer)
    tr.runner = _ScriptedRunner({100: [True, False, False, False], 101: [True, True, True, False]})
    ev = tr.evaluator.evaluate_all()
    assert tr.runner.calls == [[100] * 4 + [101] * 4]            # one collect: 4 independent samples per task
    block = ev["free"]
    assert block["episodes"] == 8 and block["success_rate"] == pytest.approx(4 / 8)
    env = block["per_env"]["test-coin"]
    assert env["successes"] == [0.25, 0.75]
    at, hat = pass_curves(4, [1, 3])
    assert env["pass_at_k"] == pytest.approx(at) and env["pass_hat_k"] == pytest.approx(hat)
    assert block["pass_at_k"] == pytest.approx(at) and block["samples"] == 4
    assert ev["protocol"]["samples"] == 4 and "4 samples" in protocol_label(ev["protocol"])
    assert tr.evaluator.episode_count() == 8
    write_evaluated_run(writer, cfg, ev)
    tr.close()
    s = build_summary(writer.dir)
    validate_summary(s)                              # the schema knows the sample keys
    assert s["eval_protocol"]["samples"] == 4
    assert s["runs"][0]["eval"]["free"]["per_env"]["test-coin"]["pass_hat_k"] == pytest.approx(hat)
    df = leaderboard_frame(collect([tmp_path / "runs"]))
    row = df.iloc[0]
    assert row["pass@k/test-coin"] == pytest.approx(1.0) and row["pass^k/test-coin"] == pytest.approx(0.0)
    md = leaderboard_markdown(df)
    assert "repeated samples, pass@k and pass^k" in md and "0.500 / 1.000 / 0.000" in md
    one = Trainer(coin_config("grpo"), model=tiny_model, tokenizer=tokenizer)
    assert "samples" not in one.evaluator.protocol()
    one.close()


@pytest.mark.parametrize(("extra", "match"), [
    ({"samples": 0}, "eval.samples"),
    ({"samples": "4"}, "eval.samples"),
    ({"samples": 4, "temperature": 0.0}, "eval.temperature above 0"),
    ({"samples": 4, "temperature": 1.0, "trials": 2}, "eval.samples and eval.trials"),
])
def test_bad_samples_settings_name_the_key(extra, match):
    with pytest.raises(ConfigError, match=match):
        coin_config("grpo", eval=extra)
