"""Phases 3-4 of a StableDRL step: old-policy likelihoods (masks saved) and the policy update.

The policy losses are functions of *sequence* estimates, and the sequence
estimates are differentiable functions of per-draw *token* log-probs. So the
update is linearised exactly: with the current token log-probs ``T`` (no grad)
as a leaf, ``C = d loss / d T`` is computed once for the whole rank batch
(self-normalised weights see every member of a group), and each micro-batch
then back-propagates the surrogate ``sum(C * T_theta)``, whose gradient equals
the loss gradient. This keeps any estimator (ELBO, EUBO mixture, mean field,
staircase) and any registered loss correct under micro-batching. On the first
inner iteration the current log-probs equal the old ones (same weights, same
replayed masks), so no extra forward is needed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from ..diffusion.likelihood import elbo_from_draws, eubo_from_draws, gather_log_probs
from ..diffusion.masking import MaskPlan, build_plan
from ..models.masks import AttentionLayout, left_pad_counts, padding_mask, staircase_position_ids
from ..parallel.bootstrap import any_rank
from .losses import sequence_policy_loss, spg_select_bound
from .noise import RatioNoise
from .rollout import RolloutBatch

ESTIMATORS = ("elbo", "mean_field", "spg", "staircase")


@dataclass(frozen=True)
class LikelihoodSpec:
    """How sequence log-likelihoods are estimated (see ``diffusion.likelihood``)."""

    kind: str = "elbo"
    num_mc: int = 2
    length_normalize: bool = True
    coupled: bool = False
    beta: float = 1.5          # SPG EUBO temperature
    omega: float = 0.5         # SPG mixture weight for A <= 0
    block_size: Optional[int] = None  # staircase / block-wise masking

    def __post_init__(self):
        if self.kind not in ESTIMATORS:
            raise ValueError(f"unknown likelihood {self.kind!r}; choose from {', '.join(ESTIMATORS)}")
        if self.kind == "staircase" and not self.block_size:
            raise ValueError("the staircase likelihood needs the model's block_size (SDAR)")


def draw_plan(batch: RolloutBatch, spec: LikelihoodSpec, chunk_generator: Callable[[int], torch.Generator],
              *, micro_batch: int, first_chunk: int = 0) -> MaskPlan:
    """The masks of this step, drawn once and replayed for old and current policy.

    Drawn per micro-batch ``k`` from ``chunk_generator(first_chunk + k)`` (stratified
    within it), so the masks do not depend on the data-parallel split.
    """
    mode = "full" if spec.kind == "mean_field" else "count"
    plans = [build_plan(batch.completion_mask[start:start + micro_batch],
                        num_mc=1 if mode == "full" else spec.num_mc,
                        generator=chunk_generator(first_chunk + k), mode=mode,
                        coupled=spec.coupled and mode != "full",
                        block_size=spec.block_size if spec.kind == "staircase" else None)
             for k, start in enumerate(range(0, batch.size, micro_batch))]
    return dataclasses.replace(plans[0], **{name: torch.cat([getattr(p, name) for p in plans], 1)
                                            for name in ("masked", "weight", "ratio")})


def token_logp(model, batch: RolloutBatch, plan: MaskPlan, spec: LikelihoodSpec, *,
               rows: slice, mask_id: int, draw: int) -> torch.Tensor:
    """log p(clean token | noisy input) for ``rows`` under draw ``draw``: ``[n, S]``, 0 off the scored set.

    The attention is an :class:`AttentionLayout` (staircase for SDAR, bidirectional for
    LLaDA) carrying the prompts' left-pad counts, so no dense mask is built on GPU;
    the counts are read once per batch (``left_pad_counts`` remembers the last one).
    """
    ids = batch.sequences[rows]
    noisy = ids.masked_fill(plan.masked[draw, rows], mask_id)
    scored = plan.scored[draw, rows]
    n = ids.shape[1]
    if spec.kind == "staircase":
        x, pos = torch.cat([noisy, ids], 1), staircase_position_ids(n, device=ids.device)
        layout = AttentionLayout.staircase(spec.block_size)
    else:
        x, pos, layout = noisy, None, AttentionLayout.bidirectional()
    pads = left_pad_counts(batch.prompt_valid)
    if pads is not None:
        mask = layout.with_padding(pads[rows])
    else:  # not a left pad (never made by the rollout): a dense key mask
        keys_ok = batch.prompt_valid[rows]
        keys = padding_mask(torch.cat([keys_ok, keys_ok], 1) if spec.kind == "staircase" else keys_ok)
        pattern = layout.dense(x.shape[1], x.shape[1], device=ids.device)
        mask = keys if pattern is None else pattern | keys
    logits = model(x, position_ids=pos, attention_mask=mask)[:, :n]
    return gather_log_probs(logits, ids, scored)


def chunks(num_mc: int, size: int, micro_batch: int):
    """``(draw, start, rows)`` of every draw x micro-batch, in the order the update visits them."""
    for draw in range(num_mc):
        for start in range(0, size, micro_batch):
            yield draw, start, slice(start, start + micro_batch)


def all_token_logp(model, batch: RolloutBatch, plan: MaskPlan, spec: LikelihoodSpec, *,
                   micro_batch: int, mask_id: int,
                   graphs: Optional[Dict[Tuple[int, int], torch.Tensor]] = None) -> torch.Tensor:
    """``[M, N, S]`` token log-probs of the whole rank batch, detached.

    Without ``graphs`` the forwards run under ``no_grad``. With ``graphs`` (a dict,
    ``parallel.retain_update_graph``) they record autograd and each micro-batch's
    log-probs are kept under ``(draw, start)`` for :func:`accumulate_gradients`: one
    forward less per inner iteration, at the cost of holding activations for the
    whole rank batch x ``num_mc``.
    """
    out = torch.zeros(plan.masked.shape, dtype=torch.float32, device=plan.masked.device)
    with torch.set_grad_enabled(graphs is not None):
        for draw, start, rows in chunks(plan.num_mc, batch.size, micro_batch):
            tok = token_logp(model, batch, plan, spec, rows=rows, mask_id=mask_id, draw=draw)
            out[draw, rows] = tok.detach().float()
            if graphs is not None:
                graphs[(draw, start)] = tok
    return out


def sequence_estimates(tok: torch.Tensor, plan: MaskPlan, batch: RolloutBatch,
                       spec: LikelihoodSpec) -> torch.Tensor:
    """Per-sequence estimates ``[N]``, differentiable in the token log-probs ``tok``."""
    lo, _ = elbo_from_draws(tok, plan, batch.completion_mask, spec.length_normalize)
    if spec.kind != "spg":
        return lo
    hi, _ = eubo_from_draws(tok, plan, batch.completion_mask, spec.beta, spec.length_normalize)
    return spg_select_bound(lo, hi, batch.advantages, mix=spec.omega)


def old_policy_likelihood(model, batch: RolloutBatch, spec: LikelihoodSpec, *, micro_batch: int,
                          mask_id: int, chunk_generator: Callable[[int], torch.Generator],
                          first_chunk: int = 0) -> RolloutBatch:
    """Phase 3: draw the masks, score the old policy, keep both for replay."""
    batch.plan = draw_plan(batch, spec, chunk_generator, micro_batch=micro_batch, first_chunk=first_chunk)
    batch.old_token_logp = all_token_logp(model, batch, batch.plan, spec, micro_batch=micro_batch,
                                          mask_id=mask_id)
    batch.old_logp = sequence_estimates(batch.old_token_logp, batch.plan, batch, spec)
    return batch


def loss_coefficients(current_tok: torch.Tensor, batch: RolloutBatch, spec: LikelihoodSpec, *,
                      loss: str, eps: float, ratio_noise: Optional[RatioNoise],
                      noise_generator: Optional[torch.Generator]
                      ) -> Tuple[Optional[torch.Tensor], Dict[str, float]]:
    """``(d loss / d token_logp, metrics)``; ``(None, {...})`` when the loss is not finite."""
    leaf = current_tok.detach().clone().requires_grad_(True)
    try:
        logp = sequence_estimates(leaf, batch.plan, batch, spec)
        value, metrics = sequence_policy_loss(
            loss, logp, batch.old_logp, batch.advantages, batch.group_index, eps=eps,
            ratio_noise=ratio_noise, noise_generator=noise_generator)
        if not torch.isfinite(value):
            raise FloatingPointError(f"loss is {value.item()}")
        value.backward()
    except (ValueError, FloatingPointError) as err:
        return None, {"nonfinite_reason": str(err)[:200]}
    coef = leaf.grad
    if not torch.isfinite(coef).all():
        return None, {"nonfinite_reason": "non-finite loss gradient"}
    return coef, metrics


def accumulate_gradients(model, batch: RolloutBatch, spec: LikelihoodSpec, coef: torch.Tensor, *,
                         micro_batch: int, mask_id: int,
                         retained: Optional[Dict[Tuple[int, int], torch.Tensor]] = None) -> None:
    """Back-propagate ``sum(coef * token_logp_theta)`` micro-batch by micro-batch.

    ``retained`` (the ``graphs`` of :func:`all_token_logp`) reuses forward graphs
    instead of running the forward again; the gradient is the same.
    """
    # which (draw, micro-batch) chunks carry any weight: one device->host copy for all of them
    starts = list(range(0, batch.size, micro_batch))
    live = torch.stack([coef[:, s:s + micro_batch].flatten(1).ne(0).any(-1) for s in starts], 1).tolist()
    for draw, start, rows in chunks(batch.plan.num_mc, batch.size, micro_batch):
        weights = coef[draw, rows]
        tok = retained.pop((draw, start)) if retained is not None else None
        if not live[draw][start // micro_batch]:
            continue
        if tok is None:
            tok = token_logp(model, batch, batch.plan, spec, rows=rows, mask_id=mask_id, draw=draw)
        (weights.to(tok.dtype) * tok).sum().backward()


def grads_finite(model) -> bool:
    """All local gradients finite, agreed over every rank (so all ranks skip together).

    One flag tensor on the gradients' device, one all-reduce, one host sync (a
    per-parameter ``bool(...)`` would synchronise the GPU once per parameter).
    """
    grads = []
    for param in model.parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is not None:
            grads.append(grad)
    if not grads:
        return not any_rank(False)
    bad = torch.stack([torch.isfinite(g).logical_not().any() for g in grads]).any()
    return not any_rank(bad)


def agree_ok(ok: bool) -> bool:
    """True only if ``ok`` holds on every rank."""
    return not any_rank(not ok)


def finite_or_nan(value) -> float:
    value = float(value)
    return value if math.isfinite(value) else float("nan")
