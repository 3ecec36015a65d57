"""Tests for stabledrl_mcore.algorithms.advantages."""

from __future__ import annotations

import pytest
import torch

from stabledrl_mcore.algorithms.advantages import available_advantages, group_advantages


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


def _leave_one_out_by_loop(rewards, group_index):
    """Direct definition: A_i = r_i - mean of the other rewards of i's group (0 alone)."""
    out = torch.zeros_like(rewards)
    for i in range(rewards.numel()):
        others = [rewards[j] for j in range(rewards.numel()) if j != i and group_index[j] == group_index[i]]
        out[i] = rewards[i] - sum(others) / len(others) if others else 0.0
    return out


def test_leave_one_out_matches_direct_loop():
    assert "leave_one_out" in available_advantages()
    rewards, gi = make_rewards()
    gi = torch.cat([gi, torch.tensor([7])])  # plus a group of one
    rewards = torch.cat([rewards, torch.tensor([0.3], dtype=rewards.dtype)])
    adv = group_advantages(rewards, gi, mode="leave_one_out")
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, _leave_one_out_by_loop(rewards, gi), rtol=1e-12, atol=1e-12)
    assert adv[-1] == 0.0
    # = n / (n - 1) times the centred advantage, so it still sums to 0 per group
    centred = group_advantages(rewards, gi)
    for k in gi.unique():
        sel = gi == k
        n = int(sel.sum())
        if n > 1:
            torch.testing.assert_close(adv[sel], centred[sel] * n / (n - 1))
        assert adv[sel].sum().abs() < 1e-12


def test_leave_one_out_float32_binary_rewards_and_no_grad():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], requires_grad=True)
    gi = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, gi, mode="leave_one_out")
    assert adv.dtype == torch.float32 and not adv.requires_grad
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0]))
    torch.testing.assert_close(adv, _leave_one_out_by_loop(rewards.detach(), gi))


def test_config_accepts_leave_one_out():
    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.schema import RunConfig

    cfg = RunConfig()
    cfg.algo.advantage = "leave_one_out"
    cfg.validate()
    cfg.algo.advantage = "rloo"
    with pytest.raises(ConfigError, match="leave_one_out"):
        cfg.validate()
