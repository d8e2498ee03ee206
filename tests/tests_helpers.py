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
