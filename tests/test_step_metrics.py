"""The per-step metrics users read (``rl.step_metrics``) against hand computations (issue 72)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from stabledrl_mcore.rl.step_metrics import step_metrics

REWARDS = [0.0, 1.0, 0.5, 0.25, 1.0, 1.0, 1.0, 1.0]  # two groups of 4; the second uniform


def _setup(group_size=4):
    rollout = SimpleNamespace(group_size=group_size, task="sudoku", filter_uniform_groups=False)
    cfg = SimpleNamespace(rollout=rollout, algo=SimpleNamespace(num_mc=2, inner_iterations=2))
    return SimpleNamespace(cfg=cfg, optimizer=SimpleNamespace(param_groups=[{"lr": 1e-3}]), dp_size=1)


def _batch(rewards):
    n = len(rewards)
    comp = torch.zeros(n, 6, dtype=torch.bool)
    comp[:, 2:] = True
    return SimpleNamespace(
        rewards=torch.tensor(rewards),
        correct=None,
        completion_mask=comp,
        sequences=torch.zeros(n, 6, dtype=torch.long),
        reward_errors=0,
        stats={},
        gradient_scale=1.0,
    )


def test_reward_mean_std_and_groups_varied_are_the_hand_computed_ones():
    out = step_metrics(_setup(), _batch(REWARDS), {}, {})
    n = len(REWARDS)
    mean = sum(REWARDS) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS) / n)  # over the whole batch, population
    assert out["reward_mean"] == pytest.approx(mean, rel=1e-12)
    assert out["reward_std"] == pytest.approx(std, rel=1e-12)
    assert out["accuracy/sudoku"] == pytest.approx(sum(r >= 1.0 for r in REWARDS) / n)
    assert out["groups_varied"] == pytest.approx(0.5)
