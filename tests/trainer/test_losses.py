"""GRPO advantages and the PPO-clipped loss against hand-computed values."""

import math

import pytest
import torch

from crl_bench.trainer.advantages import grouped_advantages
from crl_bench.trainer.losses import ppo_clip_loss


def test_group_advantages_mean_centred():
    adv = grouped_advantages([1, 0, 0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1])
    assert adv[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert adv[4:] == [0.0] * 4           # no signal in an all-fail group


def test_group_advantages_std_normalised():
    adv = grouped_advantages([1.0, 0.0, 0.0, 0.0], [7] * 4, std_normalize=True)
    mean, std = 0.25, math.sqrt(0.1875)
    assert adv == pytest.approx([(1 - mean) / std, -mean / std, -mean / std, -mean / std], rel=1e-5)


def test_subgroup_keys_centre_separately():
    keys = [(0, "free"), (0, "free"), (0, "guided"), (0, "guided")]
    adv = grouped_advantages([1, 0, 1, 1], keys)
    assert adv == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_group_advantages_length_mismatch():
    with pytest.raises(ValueError):
        grouped_advantages([1.0], [0, 1])


def test_ppo_loss_hand_values():
    # two tokens of one sequence, one masked-out third position
    lp = torch.tensor([[math.log(0.5), math.log(0.3), 0.0]], requires_grad=True)
    old = torch.tensor([[math.log(0.4), math.log(0.3), 0.0]])
    adv = torch.tensor([2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = ppo_clip_loss(lp, old, adv, mask, clip_eps=0.2)
    # token 1: r = 1.25, A = 2 -> max(-2.5, -2*1.2) = -2.4 (clipped); token 2: r = 1 -> -2
    assert float(loss) == pytest.approx((-2.4 - 2.0) / 2, rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    # clipped token gets no gradient under PPO; unclipped gets -A * r / n = -2 * 1 / 2
    assert lp.grad[0, 0].item() == pytest.approx(0.0, abs=1e-7)
    assert lp.grad[0, 1].item() == pytest.approx(-1.0, rel=1e-6)
    assert lp.grad[0, 2].item() == 0.0   # masked env/pad token: zero gradient


def test_ppo_loss_negative_advantage_clip_low():
    lp = torch.tensor([[math.log(0.2)]], requires_grad=True)
    old = torch.tensor([[math.log(0.4)]])     # r = 0.5 < 0.8
    loss, _ = ppo_clip_loss(lp, old, torch.tensor([-1.0]), torch.ones(1, 1), clip_eps=0.2)
    assert float(loss) == pytest.approx(0.8)   # max(0.5, 0.8)
    loss.backward()
    assert lp.grad.item() == pytest.approx(0.0, abs=1e-7)


def test_ppo_loss_normalizer_and_kl():
    lp = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    ref = torch.full((1, 2), math.log(0.5))
    loss, stats = ppo_clip_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), normalizer=4.0,
                                ref_logprobs=ref, kl_coef=0.1)
    k3 = 0.5 - math.log(0.5) - 1.0
    assert float(loss) == pytest.approx((2 * (-1.0 + 0.1 * k3)) / 4.0, rel=1e-6)
    assert stats["kl"] == pytest.approx(k3, rel=1e-6)
