"""Group-relative advantages, registered by name.

For the G completions of one prompt with rewards r_i (Zhong et al. 2026,
Sec. 3; GRPO):

- "center" (default): A_i = r_i - mean_g r. What the released StableDRL code
  uses, and also d1's released diffu-GRPO trainer (``diffu_grpo_trainer.py``
  computes the group std only to log the share of zero-std groups) and
  Dr. GRPO (Liu et al. 2025).
- "zscore": A_i = (r_i - mean_g r) / (std_g r + eps), with the
  Bessel-corrected (unbiased) group std (``torch.std``), as in the original
  GRPO (Shao et al. 2024) and TRL's ``GRPOTrainer`` by default
  (``scale_rewards``; TRL adds 1e-4, here ``eps``); a group of one sample has
  std 0 and advantage 0.
- "leave_one_out" (RLOO, Ahmadian et al. 2024; what ESPO's released trainer
  uses, with its recipes' ``scale_rewards: false``): A_i = r_i -
  mean_{j != i in g(i)} r_j = |g| / (|g| - 1) * (r_i - mean_g r), the centred
  advantage with a baseline independent of r_i; a group of one sample gets 0.

Groups are given by ``group_index`` ([N] long, any values, order and sizes).
NaN/inf rewards raise ``ValueError("non-finite values in rewards: ...")``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from stabledrl_mcore.algorithms.losses_common import Groups, check_finite, check_group_index, check_tensor, work_dtype
from stabledrl_mcore.common.registry import Registry

AdvantageFn = Callable[[Tensor, Groups, float], Tensor]
_REGISTRY: Registry[AdvantageFn] = Registry("advantage mode")


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register ``fn(rewards [N], groups, eps) -> advantages [N]``."""
    return _REGISTRY.register(name)


def get_advantage(name: str) -> AdvantageFn:
    return _REGISTRY.get(name)


def available_advantages() -> tuple[str, ...]:
    return _REGISTRY.names()


@register_advantage("center")
def centered_advantages(rewards: Tensor, groups: Groups, eps: float) -> Tensor:
    """A_i = r_i - mean_{j in g(i)} r_j (sums to 0 in every group)."""
    return rewards - groups.expand(groups.mean(rewards))


@register_advantage("zscore")
def zscore_advantages(rewards: Tensor, groups: Groups, eps: float) -> Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + eps), std unbiased (n - 1)."""
    centred = centered_advantages(rewards, groups, eps)
    dof = (groups.sizes.to(rewards.dtype) - 1.0).clamp_min(1.0)
    std = (groups.sum(centred.square()) / dof).sqrt()
    return centred / (groups.expand(std) + eps)


@register_advantage("leave_one_out")
def leave_one_out_advantages(rewards: Tensor, groups: Groups, eps: float) -> Tensor:
    """A_i = r_i - mean_{j in g(i), j != i} r_j = n / (n - 1) (r_i - mean_g r); 0 for n = 1."""
    n = groups.size_of_sample(rewards.dtype)
    scale = torch.where(n > 1, n / (n - 1.0).clamp_min(1.0), torch.zeros_like(n))
    return centered_advantages(rewards, groups, eps) * scale


def group_advantages(rewards: Tensor, group_index: Tensor, *, mode: str = "center", eps: float = 1e-6) -> Tensor:
    """Advantages [N] (float, no gradient) from rewards [N] and group_index [N]."""
    fn = get_advantage(mode)
    check_tensor("rewards", rewards, ndim=1)
    check_finite([("rewards", rewards)])
    check_group_index(group_index, rewards.shape[0])
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    r = rewards.detach().to(work_dtype(rewards))
    return fn(r, Groups.from_index(group_index, r.dtype), float(eps))
