"""Sequence-level policy losses for dLLM RL, registered by name.

Reference: Zhong et al. 2026, "Stabilizing Reinforcement Learning for
Diffusion Language Models" (StableDRL), and the peers it compares to.

Conventions shared by every loss (N samples, G prompt groups in the batch,
|g| the size of sample i's group, rho_i = exp(r_i - old_r_i)):

- ``logp`` is the estimate the gradient flows through; the importance ratio
  compares ``ratio_logp`` (default: ``logp``) with ``old_ratio_logp`` (default:
  ``old_logp``). They differ for SPG's sandwich likelihood, where the release
  takes log rho = ELBO_theta - ELBO_old and differentiates the bound; a loss
  whose gradient goes through rho uses rho_i * d logp_i (the same as
  differentiating exp(logp - old_logp) when the two coincide).

- ``loss`` is MINIMISED. Each docstring gives the loss and its exact gradient
  with respect to ``logp``; old_logp and advantages never receive gradients.
- Groups are given by ``group_index`` ([N] long, any values, any order, any
  sizes) and handled with segment ops, never Python loops over samples.
- Inputs are validated: all [N] and equal shapes, ``group_index`` long, and
  NaN/inf in any tensor raises ``ValueError("non-finite values in old_logp:
  3 of 16 entries")``. If finite inputs still give a non-finite loss, a
  ``FloatingPointError`` naming the cause found in its terms is raised instead
  (``losses_common.nonfinite_loss_cause``): a ratio overflow (GRPO with a
  log-ratio > ~88 in float32, the largest |log-ratio| given), non-finite
  weights or advantages, the KL term (k3's exp), or the policy term itself.
- Shared options: ``kl_coef`` (0 = off), ``ref_logp``, ``kl_estimator``
  ("k3" | "k2"): loss += kl_coef * mean_g mean_{i in g} kl_i (see
  ``losses_common.kl_estimate``); ``ratio_noise`` (a ``noise.RatioNoise``)
  with ``noise_generator``: old_logp -> old_logp - n, i.e. rho -> rho*exp(n).

Metrics (floats): loss, policy_loss, ratio_mean, ratio_max, log_ratio_var,
clip_frac_low, clip_frac_high (each loss's own clip rule), ess,
max_weight_share (mean over groups), max_weight_share_worst (max over
groups), and kl when ``ref_logp`` is given. "Weights" are each loss's
effective non-negative per-sample coefficients on A_i * grad logp_i.
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
from stabledrl_mcore.algorithms.token_losses import (  # noqa: F401  (re-exported)
    available_token_policy_losses,
    get_token_policy_loss,
    register_token_policy_loss,
    token_policy_loss,
)
from stabledrl_mcore.common.registry import Registry, unknown_name_error

__all__ = [
    "LossTerms",
    "RatioNoise",
    "SequenceBatch",
    "available_policy_losses",
    "available_token_policy_losses",
    "get_policy_loss",
    "get_token_policy_loss",
    "register_policy_loss",
    "register_token_policy_loss",
    "sequence_policy_loss",
    "spg_select_bound",
    "token_policy_loss",
]


@dataclass(frozen=True)
class SequenceBatch:
    """What a registered sequence loss receives.

    logp: [N] current estimates (carries gradients); old_logp: [N] detached;
    log_ratio: [N] detached log rho (ratio noise already applied, see the module
    docstring); advantages: [N] detached; lengths: [N] completion lengths or
    None; all in the working dtype (>= float32).
    """

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    groups: Groups
    eps: float
    log_ratio: Tensor
    lengths: Tensor | None = None


@dataclass(frozen=True)
class LossTerms:
    """What a registered loss returns: the policy loss and, for diagnostics,
    the (detached) log-ratio it used, its effective per-sample weights and
    its clip flags."""

    loss: Tensor
    log_ratio: Tensor
    weights: Tensor
    clipped_low: Tensor
    clipped_high: Tensor


SequenceLossFn = Callable[..., LossTerms]
_REGISTRY: Registry[SequenceLossFn] = Registry("policy loss")


def register_policy_loss(name: str) -> Callable[[SequenceLossFn], SequenceLossFn]:
    """Decorator: register ``fn(batch: SequenceBatch, **options) -> LossTerms``."""
    return _REGISTRY.register(name)


def get_policy_loss(name: str) -> SequenceLossFn:
    """The registered loss; unknown names raise ValueError (closest first)."""
    return _REGISTRY.get(name)


def available_policy_losses() -> tuple[str, ...]:
    return _REGISTRY.names()


def _unit(logp: Tensor, scale: Tensor | float = 1.0) -> Tensor:
    """Value 1, gradient scale * d logp: lets a loss value read as a weighted advantage."""
    return 1.0 + (logp - logp.detach()) * scale


def _ppo_active(rho: Tensor, adv: Tensor, eps: float) -> Tensor:
    """Where min(rho*A, clip(rho)*A) takes the unclipped branch (gradient flows)."""
    return torch.where(adv >= 0, rho <= 1.0 + eps, rho >= 1.0 - eps)


# --------------------------------------------------------------------------- losses


@register_policy_loss("stabledrl")
def stabledrl_loss(b: SequenceBatch) -> LossTerms:
    """StableDRL (paper's formulation): unconditional clipping + self-normalisation.

    c_i = clip(rho_i, 1-eps, 1+eps) (whatever the sign of A_i),
    w_i = sg[c_i / sum_{j in g(i)} c_j],
    loss = -(1/G) sum_i w_i A_i          (value; gradient via logp)
    d loss / d logp_i = -w_i A_i / G.
    The update is a convex combination of A_i grad logp_i (weights w_i/G sum
    to 1), so its norm never exceeds max_i |A_i| ||grad logp_i||.
    """
    rho = torch.exp(b.log_ratio)
    c = rho.clamp(1.0 - b.eps, 1.0 + b.eps)
    w = c / b.groups.expand(b.groups.sum(c))
    loss = -(w * b.advantages * _unit(b.logp)).sum() / b.groups.num_groups
    return LossTerms(loss, b.log_ratio, w, rho < 1.0 - b.eps, rho > 1.0 + b.eps)


@register_policy_loss("stabledrl_released")
def stabledrl_released_loss(b: SequenceBatch, *, log_weight_cap: float = math.log(5.0)) -> LossTerms:
    """StableDRL as in the public code: upper-capped log-weight, group softmax.

    lw_i = sg[min(r_i - old_r_i, log_weight_cap)]  (no lower bound; r = the ELBO under
    SPG's sandwich likelihood, the gradient then flows through the bound ``logp``),
    w_i = exp(lw_i) / sum_{j in g(i)} exp(lw_j),
    loss = -(1/G) sum_i w_i A_i logp_i   (the release's value: the weighted surrogate),
    d loss / d logp_i = -w_i A_i / G.
    clip_frac_high counts lw capped; clip_frac_low is always 0.
    """
    if not (isinstance(log_weight_cap, (int, float)) and math.isfinite(log_weight_cap)):
        raise ValueError(f"log_weight_cap must be a finite float, got {log_weight_cap!r}")
    lw = b.log_ratio.clamp_max(log_weight_cap)
    e = torch.exp(lw - b.groups.expand(b.groups.max(lw)))
    w = e / b.groups.expand(b.groups.sum(e))
    loss = -(w * b.advantages * b.logp).sum() / b.groups.num_groups
    return LossTerms(loss, b.log_ratio, w, torch.zeros_like(lw, dtype=torch.bool), b.log_ratio > log_weight_cap)


@register_policy_loss("grpo")
def grpo_loss(b: SequenceBatch) -> LossTerms:
    """GRPO with an estimated sequence ratio (the baseline that spikes).

    rho_i = exp(r_i - sg[old_r_i]) with gradient rho_i d logp_i,
    loss = -(1/G) sum_g (1/|g|) sum_{i in g} min(rho_i A_i, clip(rho_i, 1-eps, 1+eps) A_i),
    d loss / d logp_i = -rho_i A_i / (G |g|) where the unclipped branch is
    active (A_i >= 0 and rho_i <= 1+eps, or A_i < 0 and rho_i >= 1-eps), else 0.
    With A_i < 0 the unbounded rho_i passes straight into the gradient.
    """
    size = b.groups.size_of_sample(b.logp.dtype)
    rho_d = torch.exp(b.log_ratio)
    rho = rho_d * _unit(b.logp)
    surr = torch.minimum(rho * b.advantages, rho.clamp(1.0 - b.eps, 1.0 + b.eps) * b.advantages)
    loss = -(surr / size).sum() / b.groups.num_groups
    weights = rho_d * _ppo_active(rho_d, b.advantages, b.eps) / size
    return LossTerms(loss, b.log_ratio, weights, rho_d < 1.0 - b.eps, rho_d > 1.0 + b.eps)


@register_policy_loss("espo")
def espo_loss(b: SequenceBatch, *, lengths: Tensor | None = None) -> LossTerms:
    """ESPO: sequence-level, length-normalised ratio with PPO clipping.

    rho_i = exp((r_i - sg[old_r_i]) / L_i)  (L_i = 1 when ``lengths`` is None, i.e.
    the estimates are already normalised, e.g. by the generation width as ESPO),
    loss = -(1/N) sum_i min(rho_i A_i, clip(rho_i, 1-eps, 1+eps) A_i)
    (ESPO treats each sequence as one action and averages over the sequences
    of the batch; with equal group sizes this is GRPO's per-group average),
    d loss / d logp_i = -rho_i A_i / (N L_i) where unclipped (as in GRPO), else 0.
    """
    n = b.logp.shape[0]
    if lengths is None:
        length = torch.ones_like(b.logp.detach())
    else:
        check_tensor("lengths", lengths, ndim=1, floating=isinstance(lengths, Tensor) and lengths.is_floating_point())
        check_same_shape("logp", b.logp, lengths=lengths)
        length = lengths.detach().to(device=b.logp.device, dtype=b.logp.dtype)
        finite, positive = torch.stack([torch.isfinite(length).all(), (length > 0).all()]).tolist()  # one read
        if not finite:
            check_finite([("lengths", length)])
        if not positive:
            raise ValueError("lengths must be > 0")
    log_ratio = b.log_ratio / length
    rho_d = torch.exp(log_ratio)
    rho = rho_d * _unit(b.logp, 1.0 / length)
    surr = torch.minimum(rho * b.advantages, rho.clamp(1.0 - b.eps, 1.0 + b.eps) * b.advantages)
    loss = -surr.sum() / n
    weights = rho_d * _ppo_active(rho_d, b.advantages, b.eps) / length
    return LossTerms(loss, log_ratio, weights, rho_d < 1.0 - b.eps, rho_d > 1.0 + b.eps)


SPG_AGGREGATIONS = ("group_mean", "length_weighted")


@register_policy_loss("spg")
def spg_loss(b: SequenceBatch, *, aggregation: str = "group_mean") -> LossTerms:
    """SPG (sandwiched policy gradient): no ratio, a likelihood bound per sign.

    ``logp`` is the chosen bound (see ``spg_select_bound``: ELBO for A > 0,
    EUBO/mixture for A <= 0); the ratio serves the diagnostics only.
    ``aggregation="group_mean"``: loss = -(1/G) sum_g (1/|g|) sum_{i in g} A_i logp_i,
    d loss / d logp_i = -A_i / (G |g|);
    ``"length_weighted"`` (SPG's and the StableDRL release's non-SNIS loss, per group
    = per device batch): loss = -(1/G) sum_g sum_{i in g} A_i logp_i L_i / sum_{j in g} L_j,
    d loss / d logp_i = -A_i L_i / (G sum_{j in g} L_j), L = completion lengths.
    Never clips; ratio noise has no effect.
    """
    if aggregation not in SPG_AGGREGATIONS:
        raise unknown_name_error("spg aggregation", aggregation, SPG_AGGREGATIONS)
    if aggregation == "length_weighted":
        if b.lengths is None:
            raise ValueError("spg aggregation='length_weighted' needs completion lengths")
        share = b.lengths / b.groups.expand(b.groups.sum(b.lengths)).clamp_min(1e-12)
    else:
        share = 1.0 / b.groups.size_of_sample(b.logp.dtype)
    loss = -(b.advantages * b.logp * share).sum() / b.groups.num_groups
    none = torch.zeros_like(b.logp, dtype=torch.bool)
    return LossTerms(loss, b.log_ratio, share * torch.ones_like(b.advantages), none, none)


def spg_select_bound(elbo: Tensor, eubo: Tensor, advantages: Tensor, mix: float = 0.5) -> Tensor:
    """SPG's sandwich: ELBO where A_i > 0, mix*EUBO + (1-mix)*ELBO where A_i <= 0."""
    check_tensor("elbo", elbo, ndim=1)
    check_tensor("eubo", eubo)
    check_tensor("advantages", advantages)
    check_same_shape("elbo", elbo, eubo=eubo, advantages=advantages)
    if not (isinstance(mix, (int, float)) and 0.0 <= mix <= 1.0):
        raise ValueError(f"mix must be in [0, 1], got {mix!r}")
    return torch.where(advantages > 0, elbo, mix * eubo + (1.0 - mix) * elbo)


# --------------------------------------------------------------------------- entry point


def sequence_policy_loss(
    name: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    group_index: Tensor,
    *,
    eps: float = 0.2,
    kl_coef: float = 0.0,
    ref_logp: Tensor | None = None,
    kl_estimator: str = "k3",
    ratio_noise: RatioNoise | None = None,
    noise_generator: torch.Generator | None = None,
    ratio_logp: Tensor | None = None,
    old_ratio_logp: Tensor | None = None,
    completion_lengths: Tensor | None = None,
    check_values: bool = True,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """Loss ``name`` (see module docstring) on [N] sequence estimates -> (loss, metrics).

    ``ratio_logp`` / ``old_ratio_logp`` (both or neither): what the importance ratio
    compares, when it is not ``logp`` / ``old_logp`` (see the module docstring).
    ``completion_lengths`` [N]: for losses that weight by length (spg's
    ``length_weighted``). ``options`` are the loss's own keyword options (e.g.
    ``lengths`` for espo, ``log_weight_cap`` for stabledrl_released, ``aggregation``
    for spg); unknown ones raise TypeError. ``check_values``: raise ``ValueError("non-finite
    values in <name>: ...")`` for NaN/inf inputs (one host read for all of them); a caller that
    has checked them already (the trainer) passes False and the loss reads nothing.
    """
    fn = get_policy_loss(name)
    check_options("policy loss", name, fn, options)
    check_tensor("logp", logp, ndim=1)
    check_tensor("old_logp", old_logp)
    check_tensor("advantages", advantages)
    check_same_shape("logp", logp, old_logp=old_logp, advantages=advantages)
    if logp.shape[0] == 0:
        raise ValueError("empty batch: logp has no entries")
    check_group_index(group_index, logp.shape[0])
    eps = check_eps(eps)
    if not (isinstance(kl_coef, (int, float)) and math.isfinite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"kl_coef must be a finite float >= 0, got {kl_coef!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise unknown_name_error("kl_estimator", kl_estimator, KL_ESTIMATORS)
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp")
    if ref_logp is not None:
        check_tensor("ref_logp", ref_logp)
        check_same_shape("logp", logp, ref_logp=ref_logp)
    if (ratio_logp is None) != (old_ratio_logp is None):
        raise ValueError("pass both ratio_logp and old_ratio_logp, or neither")
    if ratio_logp is not None:
        check_tensor("ratio_logp", ratio_logp)
        check_tensor("old_ratio_logp", old_ratio_logp)
        check_same_shape("logp", logp, ratio_logp=ratio_logp, old_ratio_logp=old_ratio_logp)
    if completion_lengths is not None:
        check_tensor(
            "completion_lengths",
            completion_lengths,
            floating=isinstance(completion_lengths, Tensor) and completion_lengths.is_floating_point(),
        )
        check_same_shape("logp", logp, completion_lengths=completion_lengths)
    if check_values:
        check_finite(
            [
                ("logp", logp),
                ("old_logp", old_logp),
                ("advantages", advantages),
                ("ref_logp", ref_logp),
                ("ratio_logp", ratio_logp),
                ("old_ratio_logp", old_ratio_logp),
                ("completion_lengths", completion_lengths),
            ]
        )

    dtype = work_dtype(logp, old_logp, advantages)
    logp_w = logp.to(dtype)
    old = old_logp.detach().to(dtype)
    r_new = (logp if ratio_logp is None else ratio_logp).detach().to(dtype)
    r_old = (old_logp if old_ratio_logp is None else old_ratio_logp).detach().to(dtype)
    if ratio_noise is not None:
        if not isinstance(ratio_noise, RatioNoise):
            raise TypeError(f"ratio_noise must be a RatioNoise, got {type(ratio_noise).__name__}")
        if noise_generator is None:
            raise ValueError("ratio_noise needs noise_generator (its own torch.Generator)")
        r_old = r_old - ratio_noise.sample(r_old.shape, generator=noise_generator, device=r_old.device, dtype=dtype)
    groups = Groups.from_index(group_index, dtype)
    adv = advantages.detach().to(dtype)
    lengths = None if completion_lengths is None else completion_lengths.detach().to(dtype)
    terms = fn(SequenceBatch(logp_w, old, adv, groups, eps, r_new - r_old, lengths), **options)

    total, kl = terms.loss, None
    if ref_logp is not None:
        kl = groups.mean(kl_estimate(logp_w, ref_logp.to(dtype), kl_estimator)).mean()
        if kl_coef > 0:
            total = total + kl_coef * kl
    metrics = collect_metrics(
        name,
        total=total,
        policy=terms.loss,
        kl=kl,
        log_ratio=terms.log_ratio,
        clipped_low=terms.clipped_low,
        clipped_high=terms.clipped_high,
        groups=groups,
        weights=terms.weights,
        advantages=adv,
    )
    return total, metrics
