"""Tests for stabledrl_mcore.rl.advantages."""

from __future__ import annotations

import pytest
import torch

from stabledrl_mcore.rl.advantages import available_advantages, group_advantages


def make_rewards():
    g = torch.Generator().manual_seed(0)
    group_index = torch.tensor([3, 9, 3, 1, 9, 9, 3, 1, 3, 9, 9])  # unequal sizes, any order
    return torch.rand(11, generator=g, dtype=torch.float64), group_index


def test_centered_sums_to_zero_per_group():
    rewards, gi = make_rewards()
    adv = group_advantages(rewards, gi)
    for k in gi.unique():
        sel = gi == k
        assert adv[sel].sum().abs() < 1e-12
        torch.testing.assert_close(adv[sel], rewards[sel] - rewards[sel].mean())


def test_zscore_has_unit_std_per_group():
    rewards, gi = make_rewards()
    adv = group_advantages(rewards, gi, mode="zscore", eps=0.0)
    for k in gi.unique():
        sel = gi == k
        assert adv[sel].mean().abs() < 1e-12
        assert adv[sel].std().item() == pytest.approx(1.0, rel=1e-10)


def test_degenerate_groups_give_zero_advantage():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.5])
    gi = torch.tensor([0, 0, 0, 1])  # constant group and a singleton
    for mode in available_advantages():
        assert torch.equal(group_advantages(rewards, gi, mode=mode), torch.zeros(4))


def test_errors():
    rewards, gi = make_rewards()
    with pytest.raises(ValueError, match=r"closest first\): zscore"):
        group_advantages(rewards, gi, mode="zscor")
    bad = rewards.clone()
    bad[2] = float("nan")
    with pytest.raises(ValueError, match="non-finite values in rewards: 1 of 11 entries"):
        group_advantages(bad, gi)
    with pytest.raises(TypeError, match="group_index must be a torch.long"):
        group_advantages(rewards, gi.int())
