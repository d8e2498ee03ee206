"""Registry and base-class protocol."""

import gymnasium as gym
import pytest

from crl_bench.env_api import TextEnv, list_envs, make_env, register_env, register_gymnasium


class _Half(TextEnv):
    def _reset_task(self, task):
        pass


def test_abstract_hooks_must_be_implemented():
    with pytest.raises(TypeError):
        _Half()


def test_registry_lists_builtin_envs_and_rejects_unknown():
    assert {"sokoban", "minihack-room", "minihack-maze", "minihack-keyroom", "minihack-river"} <= set(list_envs())
    with pytest.raises(KeyError, match="known:"):
        make_env("nope")
    with pytest.raises(TypeError):
        make_env("sokoban", no_such_setting=1)


def test_entry_point_must_return_text_env():
    register_env("test-not-a-text-env", lambda **kw: object())
    with pytest.raises(TypeError, match="not a TextEnv"):
        make_env("test-not-a-text-env")


def test_gymnasium_make_and_info_contract():
    register_gymnasium()
    env = gym.make("crl_bench/minihack-room", max_steps=3)
    obs, info = env.reset(options={"task": 1_000_000})
    assert isinstance(obs, str) and info["success"] is False and info["invalid_action"] is False
    assert info["admissible_actions"] and info["steps"] == 0
    obs, r, term, trunc, info = env.step("<answer>wait</answer>")
    assert info["invalid_action"] and info["invalid_actions"] == 1 and r == 0.0 and not term
    env.close()


def test_reset_seed_is_task_and_splits_are_disjoint():
    env = make_env("sokoban")
    a, _ = env.reset(seed=5)
    b, _ = env.reset(options={"task": 5})
    assert a == b and env.task == 5
    train, ev = env.task_ids("train"), env.task_ids("eval")
    assert not set(range(ev.start, ev.stop)) & set(range(train.start, min(train.stop, ev.stop)))
    with pytest.raises(KeyError):
        env.task_ids("test")
