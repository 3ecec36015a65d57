"""Token-level policy losses for baselines that define one (d1's diffu-GRPO).

Inputs: per-token log-probs ``logp_tok`` [N, T] (carrying gradients) and
``old_logp_tok`` [N, T], sequence advantages [N], a ``token_mask`` [N, T]
(bool or 0/1 float; padded entries must still hold finite values, e.g. 0)
and ``group_index`` [N] long. Same conventions as ``losses.py``: the loss is
minimised, NaN/inf in any input raises ``ValueError`` naming the tensor, a
non-finite loss from finite inputs raises ``FloatingPointError`` naming its cause.

Metrics: ratio and clip statistics over the masked tokens; ess and
max_weight_share over each sequence's summed token coefficients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from stabledrl_mcore.algorithms.losses_common import (
    KL_ESTIMATORS,
    Groups,
    check_eps,
    check_finite,
    check_group_index,
    check_options,
    check_same_shape,
    check_tensor,
    collect_metrics,
    kl_estimate,
    work_dtype,
)
from stabledrl_mcore.algorithms.ratio_noise import RatioNoise
from stabledrl_mcore.common.registry import Registry, unknown_name_error


@dataclass(frozen=True)
class TokenBatch:
    """What a registered token loss receives (working dtype >= float32).

    logp_tok [N, T] with gradients; old_logp_tok [N, T] detached (noise
    applied); advantages [N]; mask [N, T] float 0/1; groups; eps.
    """

    logp_tok: Tensor
    old_logp_tok: Tensor
    advantages: Tensor
    mask: Tensor
    groups: Groups
    eps: float


@dataclass(frozen=True)
class TokenLossTerms:
    """Policy loss, [N, T] detached log-ratio and clip flags, [N] sequence weights."""

    loss: Tensor
    log_ratio: Tensor
    seq_weights: Tensor
    clipped_low: Tensor
    clipped_high: Tensor


TokenLossFn = Callable[..., TokenLossTerms]
_REGISTRY: Registry[TokenLossFn] = Registry("token policy loss")


def register_token_policy_loss(name: str) -> Callable[[TokenLossFn], TokenLossFn]:
    """Decorator: register ``fn(batch: TokenBatch, **options) -> TokenLossTerms``."""
    return _REGISTRY.register(name)


def get_token_policy_loss(name: str) -> TokenLossFn:
    return _REGISTRY.get(name)


def available_token_policy_losses() -> tuple[str, ...]:
    return _REGISTRY.names()


def _masked_seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """[N, T] -> [N]: sum_t m x / max(sum_t m, 1)."""
    return (x * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)


TOKEN_AGGREGATIONS = ("sequence_mean", "global_token_mean")


@register_token_policy_loss("diffu_grpo")
def diffu_grpo_loss(b: TokenBatch, *, aggregation: str = "sequence_mean") -> TokenLossTerms:
    """d1's diffu-GRPO: token-level PPO clip (eps 0.5 by default).

    rho_it = exp(logp_it - sg[old_logp_it]), n_i = sum_t m_it, s_it = m_it min(rho_it A_i,
    clip(rho_it, 1-eps, 1+eps) A_i);
    ``"sequence_mean"``: loss = -(1/N) sum_i (1/n_i) sum_t s_it;
    ``"global_token_mean"`` (d1's released trainer): loss = -sum_it s_it / sum_it m_it;
    d loss / d logp_it = -m_it rho_it A_i / (N n_i) (resp. / sum m) where unclipped
    (A_i >= 0 and rho_it <= 1+eps, or A_i < 0 and rho_it >= 1-eps), else 0.
    """
    if aggregation not in TOKEN_AGGREGATIONS:
        raise unknown_name_error("diffu_grpo aggregation", aggregation, TOKEN_AGGREGATIONS)
    n = b.logp_tok.shape[0]
    adv = b.advantages[:, None]
    rho = torch.exp(b.logp_tok - b.old_logp_tok)
    surr = torch.minimum(rho * adv, rho.clamp(1.0 - b.eps, 1.0 + b.eps) * adv)
    rho_d = rho.detach()
    active = torch.where(adv >= 0, rho_d <= 1.0 + b.eps, rho_d >= 1.0 - b.eps)
    if aggregation == "global_token_mean":
        loss = -(surr * b.mask).sum() / b.mask.sum().clamp_min(1.0)
        seq_weights = (rho_d * active * b.mask).sum(1) / b.mask.sum().clamp_min(1.0) * n
    else:
        loss = -_masked_seq_mean(surr, b.mask).sum() / n
        seq_weights = _masked_seq_mean(rho_d * active, b.mask)
    log_ratio = b.logp_tok.detach() - b.old_logp_tok
    return TokenLossTerms(loss, log_ratio, seq_weights, rho_d < 1.0 - b.eps, rho_d > 1.0 + b.eps)


def token_policy_loss(
    name: str,
    logp_tok: Tensor,
    old_logp_tok: Tensor,
    advantages: Tensor,
    token_mask: Tensor,
    group_index: Tensor,
    *,
    eps: float = 0.5,
    kl_coef: float = 0.0,
    ref_logp_tok: Tensor | None = None,
    kl_estimator: str = "k3",
    ratio_noise: RatioNoise | None = None,
    noise_generator: torch.Generator | None = None,
    check_values: bool = True,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """Token-level loss ``name`` -> (loss, metrics).

    KL (when ``ref_logp_tok`` is given): per-token estimate, aggregated like the
    policy term (masked mean per sequence then over sequences, or one global token
    mean with ``aggregation="global_token_mean"``, d1); loss += kl_coef * kl. ``ratio_noise``
    perturbs every token's log-ratio independently (own generator). ``check_values``: refuse
    NaN/inf inputs, a ``token_mask`` that is not 0/1 and one that selects nothing (one host read
    for all of it); a caller that has checked them (the trainer) passes False.
    """
    fn = get_token_policy_loss(name)
    check_options("token policy loss", name, fn, options)
    check_tensor("logp_tok", logp_tok, ndim=2)
    check_tensor("old_logp_tok", old_logp_tok)
    check_same_shape("logp_tok", logp_tok, old_logp_tok=old_logp_tok)
    n = logp_tok.shape[0]
    check_tensor("advantages", advantages, ndim=1)
    if advantages.shape[0] != n:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected ({n},)")
    check_tensor(
        "token_mask", token_mask, floating=token_mask.is_floating_point() if isinstance(token_mask, Tensor) else True
    )
    check_same_shape("logp_tok", logp_tok, token_mask=token_mask)
    check_group_index(group_index, n)
    eps = check_eps(eps)
    if not (isinstance(kl_coef, (int, float)) and math.isfinite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"kl_coef must be a finite float >= 0, got {kl_coef!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise unknown_name_error("kl_estimator", kl_estimator, KL_ESTIMATORS)
    if kl_coef > 0 and ref_logp_tok is None:
        raise ValueError("kl_coef > 0 needs ref_logp_tok")
    if ref_logp_tok is not None:
        check_tensor("ref_logp_tok", ref_logp_tok)
        check_same_shape("logp_tok", logp_tok, ref_logp_tok=ref_logp_tok)

    dtype = work_dtype(logp_tok, old_logp_tok, advantages)
    mask = token_mask.detach().to(dtype)
    selected = mask.bool()
    if check_values:
        flags = torch.stack([((mask != 0) & (mask != 1)).any(), selected.any()]).tolist()
        if flags[0]:
            raise ValueError("token_mask must be boolean or 0/1")
        if not flags[1]:
            raise ValueError("token_mask selects no tokens")
        check_finite(
            [
                ("logp_tok", logp_tok),
                ("old_logp_tok", old_logp_tok),
                ("advantages", advantages),
                ("ref_logp_tok", ref_logp_tok),
            ]
        )
    logp_w = logp_tok.to(dtype)
    old = old_logp_tok.detach().to(dtype)
    if ratio_noise is not None:
        if not isinstance(ratio_noise, RatioNoise):
            raise TypeError(f"ratio_noise must be a RatioNoise, got {type(ratio_noise).__name__}")
        if noise_generator is None:
            raise ValueError("ratio_noise needs noise_generator (its own torch.Generator)")
        old = old - ratio_noise.sample(old.shape, generator=noise_generator, device=old.device, dtype=dtype)
    groups = Groups.from_index(group_index, dtype)
    adv = advantages.detach().to(dtype)
    terms = fn(TokenBatch(logp_w, old, adv, mask, groups, eps), **options)

    total, kl = terms.loss, None
    if ref_logp_tok is not None:  # aggregated over tokens as the policy term is
        per_token = kl_estimate(logp_w, ref_logp_tok.to(dtype), kl_estimator)
        if options.get("aggregation") == "global_token_mean":
            kl = (per_token * mask).sum() / mask.sum()
        else:
            kl = _masked_seq_mean(per_token, mask).mean()
        if kl_coef > 0:
            total = total + kl_coef * kl
    metrics = collect_metrics(
        name,
        total=total,
        policy=terms.loss,
        kl=kl,
        log_ratio=terms.log_ratio[selected],
        clipped_low=terms.clipped_low[selected],
        clipped_high=terms.clipped_high[selected],
        groups=groups,
        weights=terms.seq_weights,
        advantages=adv,
    )
    return total, metrics
