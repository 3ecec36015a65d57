"""Shared pieces of the RL loss library: group segment ops,
input validation, KL estimators and the weight diagnostics.

Everything here is a pure function of tensors; nothing reads global state.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch
from torch import Tensor

from stabledrl_mcore.common.registry import unknown_name_error

F = TypeVar("F", bound=Callable)


# --------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class Groups:
    """Compact view of a ``group_index``: groups may have any size and order.

    inverse: [N] long, compact group id in 0..G-1 of each sample.
    sizes:   [G] float, number of samples per group.
    """

    inverse: Tensor
    sizes: Tensor
    num_groups: int

    @staticmethod
    def from_index(group_index: Tensor, dtype: torch.dtype = torch.float32) -> "Groups":
        unique, inverse = torch.unique(group_index, return_inverse=True)
        num_groups = unique.numel()
        sizes = torch.zeros(num_groups, dtype=dtype, device=inverse.device)
        sizes = sizes.index_add(0, inverse, torch.ones_like(inverse, dtype=dtype))
        return Groups(inverse=inverse, sizes=sizes, num_groups=num_groups)

    def sum(self, x: Tensor) -> Tensor:
        """[N] -> [G] per-group sum (differentiable in x)."""
        return x.new_zeros(self.num_groups).index_add(0, self.inverse, x)

    def mean(self, x: Tensor) -> Tensor:
        """[N] -> [G] per-group mean."""
        return self.sum(x) / self.sizes.to(x.dtype)

    def max(self, x: Tensor) -> Tensor:
        """[N] -> [G] per-group max."""
        out = x.new_full((self.num_groups,), -math.inf)
        return out.scatter_reduce(0, self.inverse, x, reduce="amax", include_self=True)

    def expand(self, g: Tensor) -> Tensor:
        """[G] -> [N] broadcast of per-group values back to the samples."""
        return g[self.inverse]

    def size_of_sample(self, dtype: torch.dtype) -> Tensor:
        """[N] size of each sample's group."""
        return self.expand(self.sizes).to(dtype)


# --------------------------------------------------------------------------- validation


def work_dtype(*tensors: Tensor) -> torch.dtype:
    """At least float32, promoted over the given floating tensors."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def check_tensor(name: str, t: object, *, ndim: int | None = None, floating: bool = True) -> Tensor:
    """Type/rank check (reads nothing on the device; finiteness: :func:`check_finite`)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    return t


def first_nonfinite(named: Sequence[tuple[str, Tensor | None]]) -> str | None:
    """``"non-finite values in NAME: k of n entries"`` for the first tensor holding NaN/inf, else
    None (one host read for all of them; floating tensors only, None entries skipped)."""
    named = [(name, t) for name, t in named if t is not None and t.is_floating_point()]
    if not named:
        return None
    ok = torch.stack([torch.isfinite(t.detach()).all() for _, t in named]).tolist()
    for (name, t), good in zip(named, ok):
        if not good:
            return f"non-finite values in {name}: {int((~torch.isfinite(t.detach())).sum())} of {t.numel()} entries"
    return None


def check_finite(named: Sequence[tuple[str, Tensor | None]]) -> None:
    """Raise ``ValueError("non-finite values in <name>: k of M entries")`` for the first of
    ``named`` holding NaN or +-inf (one host read for all of them)."""
    reason = first_nonfinite(named)
    if reason is not None:
        raise ValueError(reason)


def check_group_index(group_index: object, n: int) -> Tensor:
    t = check_tensor("group_index", group_index, ndim=1, floating=False)
    if t.dtype != torch.long:
        raise TypeError(f"group_index must be a torch.long tensor, got {t.dtype}")
    if t.shape[0] != n:
        raise ValueError(f"group_index has shape {tuple(t.shape)}, expected ({n},)")
    return t


def check_same_shape(ref_name: str, ref: Tensor, **others: Tensor) -> None:
    for name, t in others.items():
        if t.shape != ref.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)} like {ref_name}")


def check_eps(eps: float) -> float:
    if not (isinstance(eps, (int, float)) and 0.0 < eps < 1.0):
        raise ValueError(f"eps must be a float in (0, 1), got {eps!r}")
    return float(eps)


# --------------------------------------------------------------------------- KL

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-sample estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

    k1:            -log r = logp - ref_logp (unbiased, can be negative); d/dlogp = 1.
    k3 (Schulman): r - log r - 1 with log r = ref_logp - logp;
                   d/dlogp = 1 - exp(ref_logp - logp).
    k2:            0.5 * (logp - ref_logp)^2;  d/dlogp = logp - ref_logp.
    """
    log_r = ref_logp.detach() - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return torch.exp(log_r) - log_r - 1.0
    if estimator == "k2":
        return 0.5 * log_r.square()
    raise unknown_name_error("kl_estimator", estimator, KL_ESTIMATORS)


# --------------------------------------------------------------------------- diagnostics


def weight_diagnostics(groups: Groups, weights: Tensor, advantages: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """ESS and max-share of the (detached, non-negative) per-sample coefficients.

    ess:   per group (sum w)^2 / sum w^2 / |g|, in (0, 1]; a group whose
           coefficients are all zero counts as 0. Averaged over groups.
    share: per group max_i |w_i A_i| / sum_j |w_j A_j| (the share of the
           update carried by the largest term). Returned as the mean over
           groups with a non-zero update and as the worst (max) group; groups
           whose update is identically zero (e.g. all A = 0) are skipped.
    Returns (ess, share_mean, share_max) as 0-d tensors.
    """
    w = weights.detach().to(torch.float64)
    s1 = groups.sum(w)
    s2 = groups.sum(w.square())
    ess = torch.where(s2 > 0, s1.square() / s2.clamp_min(1e-300), torch.zeros_like(s2)) / groups.sizes.to(w.dtype)
    contrib = (w * advantages.detach().to(w.dtype)).abs()
    total = groups.sum(contrib)
    top = groups.max(contrib)
    live = total > 0
    share = torch.where(live, top / total.clamp_min(1e-300), torch.zeros_like(total))
    n_live = live.sum()
    share_mean = torch.where(n_live > 0, share.sum() / n_live.clamp_min(1), share.new_zeros(()))
    share_max = share.max() if share.numel() else share.new_zeros(())
    return ess.mean(), share_mean, share_max


def ratio_diagnostics(log_ratio: Tensor, clipped_low: Tensor, clipped_high: Tensor) -> dict[str, Tensor]:
    """Ratio mean/max (of exp(log_ratio), float64), log-ratio variance (population,
    over the batch) and its first two moments (``log_ratio_m1``/``_m2``: averaged over
    data-parallel ranks they give the whole batch's variance, see ``rl.step_metrics``), and the
    fractions clipped low/high. 0-d tensors."""
    lr = log_ratio.detach().to(torch.float64)
    ratio = torch.exp(lr)
    return {
        "ratio_mean": ratio.mean(),
        "ratio_max": ratio.max(),
        "log_ratio_var": lr.var(unbiased=False) if lr.numel() > 1 else lr.new_zeros(()),
        "log_ratio_m1": lr.mean(),
        "log_ratio_m2": (lr * lr).mean(),
        "clip_frac_low": clipped_low.to(torch.float64).mean(),
        "clip_frac_high": clipped_high.to(torch.float64).mean(),
    }


def to_floats(values: dict[str, Tensor]) -> dict[str, float]:
    """One device sync for all metrics."""
    keys = list(values)
    stacked = torch.stack([values[k].detach().to(torch.float64).reshape(()) for k in keys])
    return dict(zip(keys, stacked.cpu().tolist()))


def exp_overflow_at(dtype: torch.dtype) -> float:
    """The smallest x with exp(x) = inf in ``dtype`` (log of its largest finite value)."""
    return math.log(torch.finfo(dtype).max)


def _nonfinite_count(t: Tensor) -> int:
    return int((~torch.isfinite(t.detach())).sum()) if t.is_floating_point() else 0


def nonfinite_loss_cause(
    name: str,
    loss_value: float,
    *,
    policy_value: float,
    kl_value: float | None,
    log_ratio: Tensor,
    weights: Tensor,
    advantages: Tensor,
    dtype: torch.dtype,
) -> str:
    """Why the loss ``name`` is ``loss_value`` (non-finite), from its terms: non-finite log-ratios,
    a ratio whose exp() overflows ``dtype`` (with the largest |log-ratio|), non-finite advantages or
    importance weights, a non-finite KL term, or else the policy term itself."""
    head = f"{name} loss is {loss_value}"
    lr = log_ratio.detach()
    bad = _nonfinite_count(lr)
    if bad:
        return f"{head}: non-finite values in the log-ratios ({bad} of {lr.numel()} entries)"
    worst = float(lr.abs().max()) if lr.numel() else 0.0
    limit = exp_overflow_at(dtype)
    ratios = f"the largest |log-ratio| is {worst:.4g}, below {limit:.4g} where exp() overflows in {dtype}"
    if worst >= limit:
        return (
            f"{head}: ratio overflow, the largest |log-ratio| is {worst:.4g} (exp() overflows above {limit:.4g} "
            f"in {dtype}); skip this step or use a self-normalised loss (stabledrl)"
        )
    for what, t in (("advantages", advantages), ("importance weights", weights)):
        bad = _nonfinite_count(t)
        if bad:
            return f"{head}: non-finite values in the {what} ({bad} of {t.numel()} entries); {ratios}"
    if kl_value is not None and not math.isfinite(kl_value):
        return f"{head}: the KL term is {kl_value} (the policy term is {policy_value}); {ratios}"
    return f"{head}: the policy term is {policy_value} although its inputs are finite; {ratios}"


def option_names(fn: Callable, *, configurable: bool = False) -> tuple:
    """The keyword-only options of the loss ``fn``; ``configurable``: those a config file can
    give (not the tensor-valued ones, such as espo's ``lengths``)."""
    return tuple(
        p
        for p, v in inspect.signature(fn).parameters.items()
        if v.kind is inspect.Parameter.KEYWORD_ONLY and not (configurable and "Tensor" in str(v.annotation))
    )


def check_options(kind: str, name: str, fn: Callable, options: dict) -> None:
    """Reject options the loss ``fn`` does not take, naming the accepted ones."""
    accepted = option_names(fn)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"{kind} {name!r} got unknown option(s) {unknown}; it accepts: "
            f"{', '.join(accepted) if accepted else 'none'}"
        )


def collect_metrics(
    name: str,
    *,
    total: Tensor,
    policy: Tensor,
    kl: Tensor | None,
    log_ratio: Tensor,
    clipped_low: Tensor,
    clipped_high: Tensor,
    groups: Groups,
    weights: Tensor,
    advantages: Tensor,
) -> dict[str, float]:
    """All diagnostics as floats (one sync); raises on a non-finite loss."""
    values = {"loss": total.detach(), "policy_loss": policy.detach()}
    values.update(ratio_diagnostics(log_ratio, clipped_low, clipped_high))
    ess, share_mean, share_max = weight_diagnostics(groups, weights, advantages)
    values.update(ess=ess, max_weight_share=share_mean, max_weight_share_worst=share_max)
    if kl is not None:
        values["kl"] = kl.detach()
    metrics = to_floats(values)
    if not math.isfinite(metrics["loss"]):  # finite inputs can still overflow (exp of a ratio, a KL term)
        cause = nonfinite_loss_cause(
            name,
            metrics["loss"],
            policy_value=metrics["policy_loss"],
            kl_value=metrics.get("kl"),
            log_ratio=log_ratio,
            weights=weights,
            advantages=advantages,
            dtype=total.dtype,
        )
        raise FloatingPointError(cause)
    return metrics
