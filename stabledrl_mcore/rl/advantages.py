"""Group-relative advantages, registered by name.

For the G completions of one prompt with rewards r_i (Zhong et al. 2026,
Sec. 3; GRPO):

- "center" (default, as in the released StableDRL code): A_i = r_i - mean_g r.
- "zscore" (GRPO/d1 variant): A_i = (r_i - mean_g r) / (std_g r + eps), with
  the Bessel-corrected (unbiased) group std as in TRL/d1; a group of one
  sample has std 0 and advantage 0.

Groups are given by ``group_index`` ([N] long, any values, order and sizes).
NaN/inf rewards raise ``ValueError("non-finite values in rewards: ...")``.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from stabledrl_mcore.rl.losses_common import Groups, Registry, check_group_index, check_tensor, work_dtype

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


def group_advantages(rewards: Tensor, group_index: Tensor, *, mode: str = "center",
                     eps: float = 1e-6) -> Tensor:
    """Advantages [N] (float, no gradient) from rewards [N] and group_index [N]."""
    fn = get_advantage(mode)
    check_tensor("rewards", rewards, ndim=1)
    check_group_index(group_index, rewards.shape[0])
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    r = rewards.detach().to(work_dtype(rewards))
    return fn(r, Groups.from_index(group_index, r.dtype), float(eps))
