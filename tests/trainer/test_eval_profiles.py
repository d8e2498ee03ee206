"""Evaluation protocols set apart from training (``eval.splits``, ``eval.max_steps``, ``eval.history``,
``eval.prompt``), the protocol profiles that set them (``--profile``), and sampled-worker draws
(``eval.draw_size``, ``--draws``): docs/evaluation.md, "Protocol profiles"."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from tests_helpers import CoinEnv, coin_config, write_evaluated_run

from crl_bench.config import ConfigError, build_config, preset_data
from crl_bench.env_api import TextEnv, register_env
from crl_bench.profiles import check_profile_mix, list_profiles, profile_data, profile_layer
from crl_bench.results.draws import sampled_worker_draws
from crl_bench.rollout import Trajectory
from crl_bench.trainer.loop import Trainer


class SplitCoinEnv(CoinEnv):
    """The coin with a second held-out split (``eval_b``), as ALFWorld has ``eval`` and ``eval_seen``."""

    env_id = "test-coin-splits"
    splits = {"train": range(0, 100), "eval": range(100, 110), "eval_b": range(200, 205)}


class WaitEnv(TextEnv):
    """Every action is ``wait`` and nothing ends an episode but the action limit."""

    env_id = "test-wait"
    system_prompt = "Wait."
    splits = {"train": range(0, 100), "eval": range(100, 110)}

    def _reset_task(self, task):
        self.n = 0

    def _apply(self, action):
        self.n += 1
        return 0.0, False, False, f"waited{self.n}"

    def _observe(self, message=""):
        return f"Room. {message}"

    def admissible_actions(self):
        return ["wait"]


@pytest.fixture(autouse=True)
def _envs():
    register_env("test-coin", CoinEnv)
    register_env("test-coin-splits", SplitCoinEnv)
    register_env("test-wait", WaitEnv)


# ---- the profiles ---------------------------------------------------------------------------------

def test_shipped_profiles_set_only_the_evaluation():
    assert {"verl-agent", "balrog", "balrog-t1"} <= set(list_profiles())
    base = build_config([preset_data("cpu")]).to_dict()
    for name in list_profiles():
        data = profile_data(name)
        assert data["envs"] and data["eval"]
        cfg = build_config([preset_data("cpu"), profile_layer(name)])
        mine = cfg.to_dict()
        assert mine["eval"]["profile"] == name
        assert {k: v for k, v in mine.items() if k != "eval"} == {k: v for k, v in base.items() if k != "eval"}
        # every reported file a profile names exists
        for rep in data["reported"]:
            assert (Path(__file__).parents[2] / "results" / "reported" / f"{rep}.yaml").is_file()


def test_verl_agent_profile_values():
    ev = build_config([profile_layer("verl-agent")]).eval
    assert ev.split_of("alfworld") == "eval_seen" and ev.split_of("webshop") == "eval"
    assert ev.temperature == 0.4 and ev.episodes == "all" and ev.history == 2 and ev.prompt == "window"
    assert ev.max_steps == {"alfworld": 50, "webshop": 15}
    assert ev.draw_replace == {"alfworld": True, "webshop": False} and ev.draw_size == 0
    bal = build_config([profile_layer("balrog")]).eval
    assert (bal.temperature, bal.episodes, bal.history) == (0.0, 5, 16)
    balrog_envs = ("minihack-maze", "minihack-maze-15x15", "minihack-corridor", "minihack-corridor-battle",
                   "minihack-quest-easy", "minihack-quest-medium")
    assert bal.max_steps == dict.fromkeys(balrog_envs, 100)
    assert build_config([profile_layer("balrog-t1")]).eval.temperature == 1.0
    # the balrog-minihack mixture is the balrog profiles' envs, so `--mix balrog-minihack --profile balrog` runs
    from crl_bench.mixtures import resolve_mixture

    mix = resolve_mixture("balrog-minihack")
    assert list(mix.envs) == profile_data("balrog")["envs"] == profile_data("balrog-t1")["envs"] == list(balrog_envs)
    check_profile_mix("balrog", list(mix.envs))


def test_a_profile_file_with_training_keys_is_refused(tmp_path, monkeypatch):
    import crl_bench.profiles as profiles

    folder = tmp_path / "crl_bench" / "profiles"
    folder.mkdir(parents=True)
    (folder / "sly.yaml").write_text("envs: [test-coin]\neval: {temperature: 0.4}\ntrain: {lr: 1.0}\n")
    (folder / "noenvs.yaml").write_text("eval: {temperature: 0.4}\n")
    monkeypatch.setattr(profiles.resources, "files", lambda _pkg: tmp_path / "crl_bench")
    with pytest.raises(ConfigError, match="train"):
        profile_layer("sly")
    with pytest.raises(ConfigError, match="envs"):
        profile_layer("noenvs")
    with pytest.raises(ConfigError, match="unknown profile"):
        profile_layer("verl-agent")


def test_a_profile_refuses_envs_it_does_not_define(tiny_model, tokenizer):
    check_profile_mix("verl-agent", ["alfworld"])
    with pytest.raises(ConfigError, match="test-coin"):
        check_profile_mix("verl-agent", ["alfworld", "test-coin"])
    cfg = coin_config("grpo", eval=profile_layer("balrog")["eval"])
    with pytest.raises(ConfigError, match="defined for minihack-maze"):
        Trainer(cfg, model=tiny_model, tokenizer=tokenizer)


def test_bad_eval_protocol_keys_name_the_key():
    for layer, match in (({"max_steps": {"alfworld": 0}}, "eval.max_steps.alfworld"),
                         ({"max_steps": {"alfworld": "x"}}, "eval.max_steps.alfworld"),
                         ({"splits": {"alfworld": 3}}, "eval.splits.alfworld"),
                         ({"draw_replace": {"webshop": "no"}}, "eval.draw_replace.webshop"),
                         ({"profile": "nope"}, "eval.profile"),
                         ({"draw_size": 128}, "eval.samples"),
                         ({"history": -1}, "eval.history"),
                         ({"prompt": "scroll"}, "eval.prompt")):
        with pytest.raises(ConfigError, match=match.replace(".", r"\.")):
            build_config([{"eval": layer}])


def _args(**kw):
    base = dict(preset="smoke", config=None, method=None, mix=None, model=None, seed=None, set=[], profile=None,
                draws=None)
    return argparse.Namespace(**{**base, **kw})


def test_cli_profile_and_draws_layer_in_order():
    from crl_bench.commands.options import resolve_config

    cfg = resolve_config(_args(profile="verl-agent", draws=128))
    assert cfg.eval.profile == "verl-agent" and cfg.eval.draw_size == 128 and cfg.eval.samples == 8
    cfg = resolve_config(_args(profile="verl-agent", draws=128, set=["eval.samples=16"]))
    assert cfg.eval.samples == 16                                             # --set comes last
    with pytest.raises(ConfigError, match="not profile verl-agent's"):
        resolve_config(_args(profile="verl-agent", set=["eval.temperature=0.7"]))
    with pytest.raises(ConfigError, match="--draws"):
        resolve_config(_args(draws=0))
    with pytest.raises(ConfigError, match="unknown profile"):
        resolve_config(_args(profile="nope"))


# ---- the evaluation under them -------------------------------------------------------------------

def test_eval_split_per_env_and_its_protocol(tiny_model, tokenizer):
    cfg = coin_config("grpo", rollout={"mix": "test-coin-splits"}, eval={"splits": {"test-coin-splits": "eval_b"},
                                                                        "episodes": "all"})
    tr = Trainer(cfg, model=tiny_model, tokenizer=tokenizer)
    assert tr.evaluator.task_ids() == {"test-coin-splits": [200, 201, 202, 203, 204]}
    ev = tr.evaluator.evaluate_all()
    proto = ev["protocol"]
    assert proto["split"] == "eval" and proto["splits"] == {"test-coin-splits": "eval_b"}
    assert ev["free"]["splits"] == {"test-coin-splits": "eval_b"} and ev["free"]["tasks"]["test-coin-splits"][0] == 200
    # the panel is the one of the eval_b tasks, not of eval's first five
    from crl_bench.results.panel import build_panel

    env = SplitCoinEnv()
    assert proto["panels"]["test-coin-splits"] == build_panel(env, "test-coin-splits", "eval_b",
                                                              [200, 201, 202, 203, 204])["panel_hash"]
    plain = Trainer(coin_config("grpo", rollout={"mix": "test-coin-splits"}), model=tiny_model, tokenizer=tokenizer)
    assert "splits" not in plain.evaluator.protocol() and "profile" not in plain.evaluator.protocol()


def test_eval_step_limit_and_history_leave_training_alone(tiny_model, tokenizer):
    cfg = coin_config("grpo", rollout={"mix": "test-wait", "max_steps": 2, "history": 0},
                      eval={"max_steps": {"test-wait": 5}, "history": 3, "episodes": 2})
    tr = Trainer(cfg, model=tiny_model, tokenizer=tokenizer)
    train = tr.runner.collect(tr.episode_specs(), tr.sampling)
    assert {t.steps for t in train} == {2}
    block = tr.evaluator.evaluate_all()["free"]
    assert block["steps_mean"] == 5.0
    # a training episode after the evaluation has the training limit again (the pool's envs are shared)
    assert {t.steps for t in tr.runner.collect(tr.episode_specs(), tr.sampling)} == {2}
    proto = tr.evaluator.protocol()
    assert proto["max_steps"] == {"test-wait": 5}
    assert proto["prompt"] == {"layout": "window", "history": 3}
    # the eval prompts repeat the last 3 steps, the training prompts none
    ev = tr.eval_runner.collect(tr.evaluator._plan("free", tr.evaluator.task_ids())["specs"][:1], tr.eval_sampling)
    last = tokenizer.decode(ev[0].turns[-1].prompt_ids)
    assert len(ev[0].turns) == 5 and last.split("Your last actions:")[1].count("- wait") == 3
    assert "Your last actions" not in tokenizer.decode(train[0].turns[-1].prompt_ids)


def test_env_reset_takes_an_episode_limit():
    env = WaitEnv(max_steps=2)
    env.reset(options={"task": 100, "max_steps": 4})
    assert [env.step("<answer>wait</answer>")[3] for _ in range(4)] == [False, False, False, True]
    env.reset(options={"task": 100})                          # back to the constructor's limit
    assert [env.step("<answer>wait</answer>")[3] for _ in range(2)] == [False, True]
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="max_steps"):
            env.reset(options={"task": 100, "max_steps": bad})


# ---- sampled-worker draws ------------------------------------------------------------------------

def test_draws_by_hand():
    # without replacement, two tasks, draws of 2: every draw holds both tasks once -> 0.5 exactly
    out = sampled_worker_draws([[True, True], [False, False]], 2, 10, replace=False, rng=np.random.default_rng(0))
    assert out["scores"] == [0.5] * 10 and out["sd"] == 0.0 and out["reused_episodes"] == 0
    # with replacement the same draws vary, and average near the panel's 0.5
    out = sampled_worker_draws([[True, True], [False, False]], 2, 400, rng=np.random.default_rng(0))
    assert set(out["scores"]) <= {0.0, 0.5, 1.0} and len(set(out["scores"])) == 3
    assert out["mean"] == pytest.approx(0.5, abs=0.06) and out["p05"] == 0.0 and out["p95"] == 1.0
    # a task drawn 3 times with 1 episode reuses it twice per draw
    out = sampled_worker_draws([[True]], 3, 4, rng=np.random.default_rng(0))
    assert out["scores"] == [1.0] * 4 and out["reused_episodes"] == 8
    # distinct episodes while there are enough: 2 of a task's [True, False] drawn twice -> always 1 of 2
    out = sampled_worker_draws([[True, False]], 2, 20, rng=np.random.default_rng(1))
    assert out["scores"] == [0.5] * 20 and out["reused_episodes"] == 0
    for bad in (([], 2, 1), ([[True]], 0, 1), ([[True]], 1, 0)):
        with pytest.raises(ValueError):
            sampled_worker_draws(*bad)
    with pytest.raises(ValueError, match="without replacement"):
        sampled_worker_draws([[True]], 2, 1, replace=False)


class _ScriptedRunner:
    def __init__(self, outcomes):
        self.outcomes, self.seen = outcomes, {}

    def collect(self, specs, sampling, progress=None, **hooks):
        out = []
        for s in specs:
            i = self.seen.get(s.task, 0)
            self.seen[s.task] = i + 1
            ok = self.outcomes[s.task][i % len(self.outcomes[s.task])]
            out.append(Trajectory(s.env_id, s.task, s.group_id, s.subgroup, success=ok, reward=float(ok), steps=1,
                                  terminated=True))
        return out


def test_draws_in_the_eval_block_and_protocol(tiny_model, tokenizer):
    from crl_bench.results.leaderboard import protocol_label

    cfg = coin_config("grpo", eval={"samples": 4, "temperature": 1.0, "episodes": 2, "draw_size": 3,
                                    "draw_count": 50})
    tr = Trainer(cfg, model=tiny_model, tokenizer=tokenizer)
    tr.runner = _ScriptedRunner({100: [True], 101: [False]})
    ev = tr.evaluator.evaluate_all()
    draws = ev["free"]["per_env"]["test-coin"]["draws"]
    assert draws["size"] == 3 and draws["count"] == 50 and draws["replace"] is True
    # task 100 always wins, 101 never: a draw's score is the share of its 3 picks that were task 100
    assert set(draws["scores"]) <= {0.0, 1 / 3, 2 / 3, 1.0} and len(set(draws["scores"])) > 1
    assert ev["protocol"]["draws"] == {"size": 3, "count": 50, "replace": {"test-coin": True}}
    assert "50 draws of 3" in protocol_label(ev["protocol"])
    # reproducible: the same run's draws again
    tr.runner = _ScriptedRunner({100: [True], 101: [False]})
    assert tr.evaluator.evaluate_all()["free"]["per_env"]["test-coin"]["draws"]["scores"] == draws["scores"]


def test_draws_without_replacement_larger_than_the_tasks_are_refused(tiny_model, tokenizer):
    cfg = coin_config("grpo", eval={"samples": 2, "temperature": 1.0, "episodes": 2, "draw_size": 3,
                                    "draw_replace": {"test-coin": False}})
    with pytest.raises(ConfigError, match="more than the 2 eval tasks of test-coin"):
        Trainer(cfg, model=tiny_model, tokenizer=tokenizer)


def test_protocol_label_and_summary_schema_take_the_new_keys(tmp_path, tiny_model, tokenizer):
    from crl_bench.results.leaderboard import protocol_label
    from crl_bench.results.run_folder import RunWriter
    from crl_bench.results.summary import build_summary, validate_summary

    label = protocol_label({"profile": "verl-agent", "split": "eval", "splits": {"alfworld": "eval_seen"},
                            "episodes": "all", "tasks_per_env": {"alfworld": 140}, "temperature": 0.4,
                            "top_p": 1.0, "max_steps": {"alfworld": 50},
                            "prompt": {"layout": "window", "history": 2}})
    assert label.startswith("profile verl-agent · eval (alfworld: eval_seen) · all tasks")
    assert "window prompt, history 2" in label
    cfg = coin_config("grpo", rollout={"mix": "test-coin-splits"},
                      eval={"splits": {"test-coin-splits": "eval_b"}, "history": 1, "samples": 2,
                            "temperature": 1.0, "draw_size": 2, "draw_count": 3})
    writer = RunWriter(tmp_path / "runs", "run")
    tr = Trainer(cfg, writer=writer, model=tiny_model, tokenizer=tokenizer)
    ev = tr.evaluator.evaluate_all()
    write_evaluated_run(writer, cfg, ev)
    tr.close()
    summary = build_summary(writer.dir)
    validate_summary(summary)                        # the schema knows the protocol's new keys
    proto = summary["eval_protocol"]
    assert proto["splits"] == {"test-coin-splits": "eval_b"} and proto["draws"]["count"] == 3
    assert proto["prompt"] == {"layout": "window", "history": 1}
    assert summary["runs"][0]["eval"]["free"]["per_env"]["test-coin-splits"]["draws"]["count"] == 3


def test_a_profile_name_holds_all_its_values():
    # changed after the profile, or the name set without the keys: refused, naming the key
    with pytest.raises(ConfigError, match=r"eval\.temperature=0\.7 is not profile verl-agent's 0\.4"):
        build_config([profile_layer("verl-agent"), {"eval": {"temperature": 0.7}}])
    with pytest.raises(ConfigError, match=r"eval\.max_steps\.alfworld=20"):
        build_config([profile_layer("verl-agent"), {"eval": {"max_steps": {"alfworld": 20}}}])
    with pytest.raises(ConfigError, match="eval.splits.alfworld=None"):
        build_config([{"eval": {"profile": "verl-agent"}}])
    # the draws' samples and count may differ
    ev = build_config([profile_layer("verl-agent"), {"eval": {"draw_size": 128, "samples": 8, "draw_count": 50}}]).eval
    assert (ev.samples, ev.draw_count) == (8, 50)


def test_a_prefetched_reset_keeps_its_episode_limit():
    """A reset started ahead of time (``EnvPool.prefetch``) carries the episode's limit, and serves only an
    episode with that limit."""
    from crl_bench.env_pool import EnvPool
    from crl_bench.rollout import EpisodeSpec

    class SlowWait(WaitEnv):
        env_id = "test-wait-prefetch"
        prefetch_resets = True

    register_env("test-wait-prefetch", SlowWait)
    pool = EnvPool({}, 2)
    try:
        assert pool.prefetch([EpisodeSpec("test-wait-prefetch", 100, max_steps=4)]) == 1
        env, pending = pool.acquire_for("test-wait-prefetch", 100)        # the training limit: not that reset
        assert not pending
        env, pending = pool.acquire_for("test-wait-prefetch", 100, 4)
        assert pending
        env.reset_wait()
        assert env.episode_max_steps == 4
    finally:
        pool.close()
