"""CISPO loss: value, gradient, clipping behaviour, masking, normaliser (hand-computed references)."""

from __future__ import annotations

import math

import pytest
import torch

from crl_bench.trainer.losses import cispo_loss, ppo_clip_loss


def _inputs():
    # ratios exp(new - old): 1.0, 1.5 (above 1 + 0.1), 0.5 (below 1 - 0.1), 1.05 (inside)
    old = torch.log(torch.tensor([[0.4, 0.2, 0.6, 0.5]]))
    new_p = torch.tensor([[0.4, 0.3, 0.3, 0.525]])
    new = torch.log(new_p).requires_grad_(True)
    mask = torch.ones(1, 4)
    return new, old, mask


def test_value_and_gradient_hand_computed():
    new, old, mask = _inputs()
    adv = torch.tensor([2.0])
    loss, stats = cispo_loss(new, old, adv, mask, eps_low=0.1, eps_high=0.1)
    w = [1.0, 1.1, 0.9, 1.05]                     # clipped ratios
    lp = [math.log(p) for p in (0.4, 0.3, 0.3, 0.525)]
    expected = -sum(wi * 2.0 * li for wi, li in zip(w, lp)) / 4
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # stop-gradient on the weight: d loss / d logp_t = -clip(r_t) * A / n, exactly
    assert torch.allclose(new.grad, torch.tensor([[-wi * 2.0 / 4 for wi in w]]), atol=1e-7)
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["clip_frac_high"] == pytest.approx(0.25) and stats["clip_frac_low"] == pytest.approx(0.25)
    assert stats["ratio_mean"] == pytest.approx((1.0 + 1.5 + 0.5 + 1.05) / 4, rel=1e-6)
    assert stats["weight_mean"] == pytest.approx(sum(w) / 4, rel=1e-6)


def test_clipped_tokens_keep_gradient_unlike_ppo():
    new, old, mask = _inputs()
    adv = torch.tensor([1.0])
    loss, _ = cispo_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.2)
    loss.backward()
    g_cispo = new.grad.clone()
    new.grad = None
    ppo, _ = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2)
    ppo.backward()
    g_ppo = new.grad.clone()
    # token 1 (ratio 1.5 > 1.2 with A > 0): PPO gives it no gradient, CISPO weight 1.2
    assert g_ppo[0, 1] == 0.0
    assert float(g_cispo[0, 1]) == pytest.approx(-1.2 / 4)
    # unclipped tokens: both give -r*A/n (PPO through r = exp(logp - old), CISPO through the weight)
    assert float(g_ppo[0, 0]) == pytest.approx(float(g_cispo[0, 0]))
    assert float(g_ppo[0, 3]) == pytest.approx(float(g_cispo[0, 3]), rel=1e-6)


def test_negative_advantage_and_no_lower_bound():
    new, old, mask = _inputs()
    adv = torch.tensor([-1.0])
    loss, stats = cispo_loss(new, old, adv, mask, eps_low=None, eps_high=0.1)
    loss.backward()
    w = [1.0, 1.1, 0.5, 1.05]                     # no lower bound: 0.5 stays 0.5
    assert torch.allclose(new.grad, torch.tensor([[wi / 4 for wi in w]]), atol=1e-7)
    assert stats["clip_frac_low"] == 0.0 and stats["clip_frac_high"] == pytest.approx(0.25)
    new.grad = None
    loss, stats = cispo_loss(new, old, adv, mask, eps_low=None, eps_high=None)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[r / 4 for r in (1.0, 1.5, 0.5, 1.05)]]), atol=1e-6)
    assert stats["clip_frac"] == 0.0


def test_mask_zeroes_gradient_and_normaliser():
    new, old, _ = _inputs()
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, 5.0, 1.0, 5.0]])    # per-token advantages
    loss, stats = cispo_loss(new, old, adv, mask, normalizer=10.0)
    loss.backward()
    assert new.grad[0, 1] == 0.0 and new.grad[0, 3] == 0.0
    assert float(new.grad[0, 0]) == pytest.approx(-1.0 / 10)
    assert float(new.grad[0, 2]) == pytest.approx(-0.9 / 10)
    expected = -(math.log(0.4) + 0.9 * math.log(0.3)) / 10
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(0.5)          # of the 2 masked-in tokens, 1 clipped


def test_padding_with_extreme_values_does_not_leak():
    logp = torch.tensor([[-1.0, -float("inf")]], requires_grad=True)
    old = torch.tensor([[-1.0, -200.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, _ = cispo_loss(logp, old, torch.tensor([1.0]), mask, eps_low=None, eps_high=None)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert float(loss.detach()) == pytest.approx(1.0) and float(logp.grad[0, 1]) == 0.0


def test_works_as_policy_updater_loss_fn():
    """The PolicyUpdater calling convention: (logprobs, old, adv (B,), mask, normalizer=..., **kwargs)."""
    logp = torch.randn(3, 5, requires_grad=True)
    loss, stats = cispo_loss(logp, logp.detach(), torch.tensor([1.0, -1.0, 0.5]), torch.ones(3, 5),
                             normalizer=15.0, eps_low=None, eps_high=5.0)
    loss.backward()
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_frac"] == 0.0
    assert torch.allclose(logp.grad, -torch.tensor([1.0, -1.0, 0.5]).unsqueeze(-1).expand(3, 5) / 15.0)
