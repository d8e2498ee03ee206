"""One GRPO training step of the real loop with a tiny random model on a toy env with mixed outcomes."""

import pytest
import torch

from crl_bench.config import build_config, preset_data
from crl_bench.env_api import TextEnv, register_env
from crl_bench.trainer.loop import Trainer, summarise


class _Coin(TextEnv):
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


@pytest.fixture(autouse=True)
def _coin_env():
    register_env("test-coin", _Coin)


def _cfg(**train):
    return build_config([preset_data("smoke"), {
        "rollout": {"mix": "test-coin", "max_steps": 2},
        "train": {"groups_per_step": 2, "group_size": 8, "lr": 1e-3, **train},
        "model": {"gradient_checkpointing": False}, "eval": {"episodes": 4}}])


def test_grpo_step_updates_full_model(tokenizer, tiny_model):
    tr = Trainer(_cfg(), model=tiny_model, tokenizer=tokenizer)
    before = tiny_model.lm_head.weight.detach().clone()
    res = tr.train_step()
    m = res.metrics
    assert m["episodes"] == 16 and m["step"] == 1
    assert 0.0 < m["success_rate"] < 1.0            # mixed outcomes: there is a learning signal
    assert m["groups_with_signal"] >= 1 and m["optimizer_steps"] == 1
    assert not torch.equal(before, tiny_model.lm_head.weight)
    # advantages are centred within each group
    advs = tr.advantages(res.trajectories)
    for g in {t.group_id for t in res.trajectories}:
        assert sum(a for a, t in zip(advs, res.trajectories) if t.group_id == g) == pytest.approx(0.0, abs=1e-6)
    ev = tr.evaluate()
    assert ev["episodes"] == 4 and ev["tasks"] == {"test-coin": [100, 101, 102, 103]}
    tr.close()


def test_grpo_step_with_lora_and_kl(tokenizer, tiny_model):
    cfg = _cfg(kl_coef=0.05)
    cfg.model.lora = True
    cfg.model.lora_r = 4
    tr = Trainer(cfg, model=tiny_model, tokenizer=tokenizer)
    trainable = [n for n, p in tr.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    m = tr.train_step().metrics
    assert m["optimizer_steps"] == 1 and "kl" in m
    tr.close()


def test_learning_signal_drives_success_up(tokenizer, tiny_model):
    """A few GRPO steps on the coin env make 'heads' more likely (the loop learns)."""
    tr = Trainer(_cfg(lr=3e-3), model=tiny_model, tokenizer=tokenizer)
    rates = [tr.train_step().metrics["success_rate"] for _ in range(6)]
    assert sum(rates[-2:]) / 2 > sum(rates[:2]) / 2
    tr.close()


def test_summarise_empty_and_mixed():
    assert summarise([])["episodes"] == 0
