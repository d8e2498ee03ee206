"""Small envs shared by tests."""

from crl_bench.env_api import TextEnv


class CoinEnv(TextEnv):
    """One decision: 'heads' succeeds, 'tails' fails. A random policy gives mixed groups."""

    env_id = "test-coin"
    system_prompt = "Call the coin."
    splits = {"train": range(0, 100), "eval": range(100, 110)}

    def _reset_task(self, task):
        pass

    def _apply(self, action):
        win = action == "heads"
        return (1.0 if win else 0.0), True, win, "won" if win else "lost"

    def _observe(self, message=""):
        return f"A coin. {message}"

    def admissible_actions(self):
        return ["heads", "tails"]


def coin_config(method, **extra):
    """A tiny run of ``method`` on :class:`CoinEnv` (registered as ``test-coin``): the smoke preset with
    2 groups x 4 rollouts of at most 2 actions, distillation waited for, no merge pass, extractor
    batch 2; ``extra`` is one more config layer on top."""
    from crl_bench.config import build_config, preset_data

    return build_config([preset_data("smoke"), {
        "method": method,
        "rollout": {"mix": "test-coin", "max_steps": 2},
        "train": {"groups_per_step": 2, "group_size": 4, "lr": 1e-3},
        "model": {"gradient_checkpointing": False},
        "eval": {"episodes": 2},
        "experience": {"wait_distill": True, "merge_every": 0},
        "extractor": {"batch_size": 2, "max_new_tokens": 24, "lr": 1e-3},
    }, extra])
