"""Sequence log-likelihood proxies of a masked diffusion LM.

All estimators share one pipeline: a :class:`~.masking.MaskPlan` (M corruptions
of the batch), one forward per corruption, per-token log-probs of the clean
tokens at the scored (masked) positions, then a reduction:

- **ELBO** (LLaDA eq. 3 / ``get_log_likelihood.py``; ESPO): per draw
  ``sum_i w_i log p(x_i | x_t)`` with w = 1/p (ratio mode) or L/l (count
  mode), averaged over the M draws. Unbiased for the ELBO <= log p(x).
- **mean field** (d1 / diffu-GRPO): one forward with the whole completion
  masked (prompt tokens optionally masked with prob. 0.15), weight 1:
  ``sum_i log p(x_i | prompt, all masks)``.
- **EUBO** (SPG, Wang et al. 2025, arXiv:2510.09541, Rényi-type upper bound):
  ``(1/beta) sum_i log E_{t, x_t}[ w_i 1[x_t^i = M] p(x_i | x_t)^beta ]``, the
  inner expectation estimated by the mean over the M draws (as SPG's code:
  weight 1/t with the empirical mask fraction t, i.e. our count-mode L/l),
  computed in log space. Tokens that no draw masked are left out and the sum
  is rescaled to all L tokens (L * mean over covered tokens); with
  ``length_normalize`` that is SPG's mean over covered tokens. beta = 1.5 in
  StableDRL's release (1.0 for Sudoku, 2.0 for Countdown in SPG).
- **mixture** (SPG): ``omega * EUBO + (1 - omega) * ELBO`` on the same draws.

Estimates carry gradients unless called under ``torch.no_grad()``. Pass
``plan=`` (e.g. ``old.plan``) to replay the exact masks of an earlier call, so
new-minus-old differences are not dominated by mask noise (antithetic
sharing, LLaDA-1.5). ``logprob_fn(logits, targets) -> [B, S]`` replaces the
default log-probs; when given, the model is called with ``gather_output=False``.

Tensor parallelism: at TP > 1 (:func:`vocab_sharded_logits`) the forwards keep the LM
head's logits vocab-sharded (``gather_output=False``, ``[B, S, V_p/tp]``) and
:func:`gather_log_probs` takes the scored rows' log-probs with Megatron's vocab-parallel
cross-entropy (one max and two sum all-reduces of ``[K]`` over the TP group), so no rank
ever holds ``[B, S, V]``. At TP = 1 the model's (gathered) logits and a full-vocab
``log_softmax`` of the scored rows are used, as they always were. The samplers
(``sampling_*``) still gather: they draw tokens from the whole vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from stabledrl_mcore.diffusion.masking import MaskPlan, build_plan
from stabledrl_mcore.models.logprobs import tensor_parallel_size, vocab_parallel_log_probs

LogprobFn = Callable[[Tensor, Tensor], Tensor]
# forward_logp(noisy [B, S], ids [B, S], scored [B, S]) -> log p(ids | noisy) [B, S], zero where not scored
ForwardLogp = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass
class LikelihoodEstimate:
    """seq: [B] per-sequence estimate; token: [B, S] per-token terms; plan: the masks used."""

    seq: Tensor
    token: Tensor
    plan: MaskPlan


def dllm_config(model):
    """``model.dllm_config``, looking through wrappers (``.module``)."""
    m = model
    for _ in range(8):
        cfg = getattr(m, "dllm_config", None)
        if cfg is not None:
            return cfg
        m = getattr(m, "module", None)
        if m is None:
            break
    raise AttributeError("model has no dllm_config (needed for mask_token_id / arch)")


def resolve_mask_id(model, mask_id: Optional[int]) -> int:
    return int(dllm_config(model).mask_token_id) if mask_id is None else int(mask_id)


def _float(logits: Tensor) -> Tensor:
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def vocab_sharded_logits() -> bool:
    """Whether the likelihood / update / SFT forwards keep the logits vocab-sharded: TP > 1.

    Then the model is called with ``gather_output=False`` and :func:`gather_log_probs` with
    ``vocab_parallel=True``; at TP = 1 with the model's default (gathered) logits. Every rank
    of a TP group gets the same answer (it is the group's size), so the collectives match.
    """
    return tensor_parallel_size() > 1


def gather_log_probs(
    logits: Tensor,
    targets: Tensor,
    scored: Optional[Tensor] = None,
    logprob_fn: Optional[LogprobFn] = None,
    *,
    vocab_parallel: bool = False,
) -> Tensor:
    """log p(target) per position, ``[B, S]``; zero where ``scored`` is False.

    Every row of ``logits`` is normalised and the unscored ones are zeroed (``torch.where``, so
    they carry no gradient): no boolean-mask indexing, whose data-dependent row count is a host
    read (a pipeline drain on a GPU) in every likelihood forward. Callers run the head on the
    rows that can be scored only (``logit_positions``: the completion, the staircase's noisy half),
    so the normalised rows are those, ``[B, S_scored, V]``.
    ``vocab_parallel``: ``logits`` are this rank's vocabulary shard ``[B, S, V_p/tp]``
    (``model(..., gather_output=False)`` at TP > 1, padded columns at ``finfo.min``) and go
    through Megatron's vocab-parallel cross-entropy
    (:func:`~..models.logprobs.vocab_parallel_log_probs`, float32), a collective of the TP
    group. ``False`` (TP = 1) is the full-vocab ``log_softmax`` of the logits' own float dtype.
    """
    if logprob_fn is not None:
        lp = logprob_fn(logits, targets)
        return lp if scored is None else lp * scored.to(lp.dtype)
    if vocab_parallel:
        vals = vocab_parallel_log_probs(logits, targets, vocab_parallel=True)
    else:
        vals = torch.log_softmax(_float(logits), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return vals if scored is None else torch.where(scored, vals, torch.zeros((), dtype=vals.dtype, device=vals.device))


def model_forward_logp(
    model,
    *,
    attention_mask: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
    logprob_fn: Optional[LogprobFn] = None,
) -> ForwardLogp:
    """The plain (bidirectional or caller-masked) forward used by LLaDA-style estimators
    (vocab-sharded logits at TP > 1, see :func:`vocab_sharded_logits`)."""

    def forward(noisy: Tensor, ids: Tensor, scored: Tensor) -> Tensor:
        sharded = logprob_fn is not None or vocab_sharded_logits()
        logits = model(noisy, position_ids=position_ids, attention_mask=attention_mask, gather_output=not sharded)
        return gather_log_probs(logits, ids, scored, logprob_fn, vocab_parallel=sharded)

    return forward


def draw_log_probs(forward: ForwardLogp, ids: Tensor, plan: MaskPlan, mask_id: int) -> Tensor:
    """``[M, B, S]`` log-probs of the clean tokens under each corruption (zero off the scored set)."""
    plan.check(ids)
    noisy = plan.noisy(ids, mask_id)
    scored = plan.scored
    return torch.stack([forward(noisy[m], ids, scored[m]) for m in range(plan.num_mc)])


def _lengths(completion_mask: Tensor) -> Tensor:
    return completion_mask.sum(-1).clamp(min=1)


def elbo_from_draws(
    logp: Tensor, plan: MaskPlan, completion_mask: Tensor, length_normalize: bool = False
) -> Tuple[Tensor, Tensor]:
    """(seq [B], token [B, S]) of the MC ELBO from per-draw log-probs."""
    token = (plan.weight.to(logp.dtype) * logp).mean(0)
    if length_normalize:
        token = token / _lengths(completion_mask).to(token.dtype).unsqueeze(-1)
    return token.sum(-1), token


def eubo_from_draws(
    logp: Tensor, plan: MaskPlan, completion_mask: Tensor, beta: float = 1.5, length_normalize: bool = False
) -> Tuple[Tensor, Tensor]:
    """(seq [B], token [B, S]) of SPG's EUBO; see the module docstring for the formula."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    w = plan.weight.to(logp.dtype)
    used = w > 0
    # unscored draws get a finite floor (not -inf) so gradients stay finite; uncovered tokens are dropped below
    terms = torch.where(used, w.clamp(min=1e-30).log() + beta * logp, torch.full_like(w, -1e4))
    log_mean = torch.logsumexp(terms, dim=0) - math.log(plan.num_mc)  # [B, S]
    covered = used.any(0)
    token = torch.where(covered, log_mean, torch.zeros_like(log_mean)) / beta
    n_cov = covered.sum(-1).clamp(min=1).to(token.dtype)
    mean_cov = token.sum(-1) / n_cov
    if length_normalize:
        return mean_cov, token / n_cov.unsqueeze(-1)
    scale = _lengths(completion_mask).to(token.dtype) / n_cov
    return mean_cov * _lengths(completion_mask).to(token.dtype), token * scale.unsqueeze(-1)


def _plan(completion_mask: Tensor, plan: Optional[MaskPlan], generator, **kw) -> MaskPlan:
    if plan is not None:
        return plan
    if generator is None:
        raise TypeError("pass a torch.Generator (generator=...) or a MaskPlan to replay (plan=...)")
    return build_plan(completion_mask, generator=generator, **kw)


def _draws(
    model,
    ids,
    completion_mask,
    *,
    num_mc,
    generator,
    plan,
    mode,
    coupled,
    eps,
    stratified,
    prompt_mask_prob,
    mask_id,
    attention_mask,
    position_ids,
    logprob_fn,
):
    plan = _plan(
        completion_mask,
        plan,
        generator,
        num_mc=num_mc,
        mode=mode,
        coupled=coupled,
        eps=eps,
        stratified=stratified,
        prompt_mask_prob=prompt_mask_prob,
    )
    forward = model_forward_logp(model, attention_mask=attention_mask, position_ids=position_ids, logprob_fn=logprob_fn)
    return draw_log_probs(forward, ids, plan, resolve_mask_id(model, mask_id)), plan


def elbo(
    model,
    ids: Tensor,
    completion_mask: Tensor,
    *,
    num_mc: int = 1,
    generator: Optional[torch.Generator] = None,
    plan: Optional[MaskPlan] = None,
    mode: str = "count",
    coupled: bool = False,
    eps: float = 1e-3,
    stratified: bool = True,
    length_normalize: bool = False,
    prompt_mask_prob: float = 0.0,
    mask_id: Optional[int] = None,
    attention_mask: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
    logprob_fn: Optional[LogprobFn] = None,
) -> LikelihoodEstimate:
    """Monte-Carlo ELBO of the completion tokens with ``num_mc`` masks (see module docstring)."""
    logp, plan = _draws(
        model,
        ids,
        completion_mask,
        num_mc=num_mc,
        generator=generator,
        plan=plan,
        mode=mode,
        coupled=coupled,
        eps=eps,
        stratified=stratified,
        prompt_mask_prob=prompt_mask_prob,
        mask_id=mask_id,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logprob_fn=logprob_fn,
    )
    seq, token = elbo_from_draws(logp, plan, completion_mask, length_normalize)
    return LikelihoodEstimate(seq, token, plan)


def mean_field_logp(
    model,
    ids: Tensor,
    completion_mask: Tensor,
    *,
    generator: Optional[torch.Generator] = None,
    plan: Optional[MaskPlan] = None,
    prompt_mask_prob: float = 0.15,
    length_normalize: bool = False,
    mask_id: Optional[int] = None,
    attention_mask: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
    logprob_fn: Optional[LogprobFn] = None,
) -> LikelihoodEstimate:
    """d1's one-step estimate: completion fully masked, prompt masked with ``prompt_mask_prob``.

    ``token`` holds the per-token log-probs (d1's token-level ratios); a
    generator is only needed when ``prompt_mask_prob > 0``.
    """
    if plan is None and prompt_mask_prob <= 0.0 and generator is None:
        generator = torch.Generator(device=ids.device)  # no draw is made from it
    logp, plan = _draws(
        model,
        ids,
        completion_mask,
        num_mc=1,
        generator=generator,
        plan=plan,
        mode="full",
        coupled=False,
        eps=0.0,
        stratified=False,
        prompt_mask_prob=prompt_mask_prob,
        mask_id=mask_id,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logprob_fn=logprob_fn,
    )
    seq, token = elbo_from_draws(logp, plan, completion_mask, length_normalize)
    return LikelihoodEstimate(seq, token, plan)


def elbo_eubo(
    model,
    ids: Tensor,
    completion_mask: Tensor,
    *,
    beta: float = 1.5,
    num_mc: int = 2,
    generator: Optional[torch.Generator] = None,
    plan: Optional[MaskPlan] = None,
    mode: str = "count",
    coupled: bool = False,
    eps: float = 1e-3,
    stratified: bool = True,
    length_normalize: bool = False,
    prompt_mask_prob: float = 0.0,
    mask_id: Optional[int] = None,
    attention_mask: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
    logprob_fn: Optional[LogprobFn] = None,
) -> Tuple[LikelihoodEstimate, LikelihoodEstimate]:
    """Both SPG bounds from one set of forwards: ``(elbo, eubo)`` (for ``rl.losses.spg_select_bound``)."""
    logp, plan = _draws(
        model,
        ids,
        completion_mask,
        num_mc=num_mc,
        generator=generator,
        plan=plan,
        mode=mode,
        coupled=coupled,
        eps=eps,
        stratified=stratified,
        prompt_mask_prob=prompt_mask_prob,
        mask_id=mask_id,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logprob_fn=logprob_fn,
    )
    lo = LikelihoodEstimate(*elbo_from_draws(logp, plan, completion_mask, length_normalize), plan)
    hi = LikelihoodEstimate(*eubo_from_draws(logp, plan, completion_mask, beta, length_normalize), plan)
    return lo, hi


def eubo(model, ids: Tensor, completion_mask: Tensor, *, beta: float = 1.5, **kw) -> LikelihoodEstimate:
    """SPG's evidence upper bound (keyword arguments as :func:`elbo_eubo`)."""
    return elbo_eubo(model, ids, completion_mask, beta=beta, **kw)[1]


def mixture(
    model, ids: Tensor, completion_mask: Tensor, *, omega: float = 0.5, beta: float = 1.5, **kw
) -> LikelihoodEstimate:
    """SPG's mixture ``omega * EUBO + (1 - omega) * ELBO`` on shared masks."""
    if not 0.0 <= omega <= 1.0:
        raise ValueError(f"omega must be in [0, 1], got {omega}")
    lo, hi = elbo_eubo(model, ids, completion_mask, beta=beta, **kw)
    return LikelihoodEstimate(omega * hi.seq + (1 - omega) * lo.seq, omega * hi.token + (1 - omega) * lo.token, lo.plan)
