"""Phase 4 of a StableDRL step: the policy update on one rollout batch.

The policy losses are functions of *sequence* (or, for d1's diffu-GRPO, *token*)
estimates, and those are differentiable functions of per-draw *token* log-probs.
So the update is linearised exactly: with the current token log-probs ``T`` (no
grad) as a leaf, ``C = d loss / d T`` is computed once for the whole rank batch
(self-normalised weights see every member of a group), and each micro-batch then
back-propagates the surrogate ``sum(C * T_theta)``, whose gradient equals the loss
gradient. This keeps any estimator (ELBO, EUBO mixture, mean field, staircase),
any mask sampling (:mod:`.estimates`) and any registered loss correct under
micro-batching.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from stabledrl_mcore.algorithms.losses import available_token_policy_losses, sequence_policy_loss, token_policy_loss
from stabledrl_mcore.algorithms.losses_common import first_nonfinite
from stabledrl_mcore.algorithms.ratio_noise import RatioNoise
from stabledrl_mcore.diffusion.likelihood import dllm_config
from stabledrl_mcore.diffusion.masking import MaskPlan
from stabledrl_mcore.engine.pipeline import pipeline_forward_backward, pipeline_world_size
from stabledrl_mcore.models.moe import router_loss_scale
from stabledrl_mcore.rl.estimates import (
    LikelihoodSpec,
    OldEstimate,
    chunks,
    old_estimate,
    scored_region,
    sequence_estimates,
    sequence_estimates_and_elbo,
    token_logp_micro_batches,
)
from stabledrl_mcore.rl.rollout import RolloutBatch


def loss_coefficients(
    current_tok: torch.Tensor,
    batch: RolloutBatch,
    spec: LikelihoodSpec,
    *,
    loss: str,
    eps: float,
    ratio_noise: Optional[RatioNoise],
    noise_generator: Optional[torch.Generator],
    plan: Optional[MaskPlan] = None,
    old: Optional[OldEstimate] = None,
    loss_options: Optional[Mapping[str, Any]] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    ref_tok: Optional[torch.Tensor] = None,
) -> Tuple[Optional[torch.Tensor], Dict[str, Any]]:
    """``(d loss / d token_logp, metrics)``; ``(None, {"nonfinite_reason": ...})`` when a value is
    not finite: an input log-prob or estimate, the loss, or its gradient.

    Only non-finite *values* give ``None``: every exception (an unknown loss, a bad option,
    a shape error) propagates. ``current_tok`` [M, N, S] are the current policy's token
    log-probs under ``plan`` (default: the batch's), compared with ``old`` (default: the
    batch's old-policy estimate). ``ref_tok``: the frozen reference policy under the same plan.
    """
    plan = batch.plan if plan is None else plan
    old = old_estimate(batch) if old is None else old
    options = dict(loss_options or {})
    leaf = current_tok.detach().clone().requires_grad_(True)
    inputs = [
        ("current token log-probs", current_tok),
        ("old token log-probs", old.token_logp),
        ("reference token log-probs", ref_tok),
        ("advantages", batch.advantages),
    ]
    try:
        if loss in available_token_policy_losses():  # d1: per-token ratios of the one-step estimate
            reason = first_nonfinite(inputs)  # the one host read of the inputs
            if reason is not None:
                return None, {"nonfinite_reason": reason}
            region = scored_region(batch, spec)
            value, metrics = token_policy_loss(
                loss,
                leaf[0],
                old.token_logp[0],
                batch.advantages,
                region,
                batch.group_index,
                eps=eps,
                ratio_noise=ratio_noise,
                noise_generator=noise_generator,
                kl_coef=kl_coef,
                kl_estimator=kl_estimator,
                ref_logp_tok=None if ref_tok is None else ref_tok[0],
                check_values=False,
                **options,
            )
            token_log_ratio = (leaf[0].detach() - old.token_logp[0]) * region
            sample_log_ratio = token_log_ratio.sum(-1)
        else:
            ref_logp = None if ref_tok is None else sequence_estimates(ref_tok, plan, batch, spec)
            logp, elbo = sequence_estimates_and_elbo(leaf, plan, batch, spec)
            # the one host read of the inputs: the token log-probs first (a non-finite token
            # log-prob makes its estimates non-finite too; the first cause is named)
            reason = first_nonfinite(
                inputs
                + [
                    ("current sequence estimates", logp),
                    ("current ELBO", elbo),
                    ("old sequence estimates", old.logp),
                    ("old ELBO", old.ratio_logp),
                    ("reference sequence estimates", ref_logp),
                ]
            )
            if reason is not None:
                return None, {"nonfinite_reason": reason}
            value, metrics = sequence_policy_loss(
                loss,
                logp,
                old.logp,
                batch.advantages,
                batch.group_index,
                eps=eps,
                ratio_noise=ratio_noise,
                noise_generator=noise_generator,
                ratio_logp=elbo,
                old_ratio_logp=old.ratio_logp,
                completion_lengths=scored_region(batch, spec).sum(-1),
                kl_coef=kl_coef,
                ref_logp=ref_logp,
                kl_estimator=kl_estimator,
                check_values=False,
                **options,
            )
            sample_log_ratio = elbo.detach() - old.ratio_logp
    except FloatingPointError as err:  # the losses' one signal of a non-finite loss, with its cause
        return None, {"nonfinite_reason": str(err)[:400]}
    value.backward()
    coef = leaf.grad
    finite_loss, finite_coef = torch.stack([torch.isfinite(value.detach()), torch.isfinite(coef).all()]).tolist()
    if not finite_loss:  # (a registered loss raises FloatingPointError with its cause first)
        return None, {"nonfinite_reason": f"{loss} loss is {value.item()}"}
    if not finite_coef:
        return None, {"nonfinite_reason": first_nonfinite([("loss gradient", coef)])}
    # [N] the sequence log-ratio each sample's ratio compares (before any injected noise; a
    # tensor, so the trainer's float metrics skip it): read by the sample dumps
    return coef, {**metrics, "sample_log_ratio": sample_log_ratio.float()}


def accumulate_gradients(
    model,
    batch: RolloutBatch,
    spec: LikelihoodSpec,
    coef: torch.Tensor,
    *,
    micro_batch: int,
    mask_id: int,
    retained: Optional[Dict[Tuple[int, int], torch.Tensor]] = None,
    plan: Optional[MaskPlan] = None,
) -> None:
    """Back-propagate ``sum(coef * token_logp_theta)`` micro-batch by micro-batch under ``plan``
    (default: the batch's).

    Every (draw, micro-batch) chunk that carries weight is one micro-batch of
    :func:`~..engine.pipeline.pipeline_forward_backward`: a forward and backward each without
    pipeline parallelism, else Megatron's 1F1B schedules. ``retained`` (the ``graphs`` of
    :func:`all_token_logp`, PP=1 only) reuses forward graphs instead of running the forward
    again; the gradient is the same.
    """
    if retained is not None and pipeline_world_size() > 1:
        raise ValueError("parallel.retain_update_graph cannot be combined with pipeline parallelism")
    plan = batch.plan if plan is None else plan
    # which (draw, micro-batch) chunks carry any weight: one device->host copy for all of them
    starts = list(range(0, batch.size, micro_batch))
    live = torch.stack([coef[:, s : s + micro_batch].flatten(1).ne(0).any(-1) for s in starts], 1).tolist()
    order = list(chunks(plan.num_mc, batch.size, micro_batch))
    todo = [chunk for chunk in order if live[chunk[0]][chunk[1] // micro_batch]]

    def surrogate(tok: torch.Tensor, chunk: Tuple[int, int, slice]) -> torch.Tensor:
        draw, _, rows = chunk
        return (coef[draw, rows].to(tok.dtype) * tok).sum()

    # MoE router losses, if on (never under PP, see config.checks): averaged over the forwards
    # that run (as Megatron's 1 / micro-batches)
    with router_loss_scale(1.0 / max(len(todo), 1)):
        if retained is None:
            inputs, reduce = token_logp_micro_batches(
                batch, plan, spec, todo, mask_id=mask_id, model_config=dllm_config(model)
            )
            pipeline_forward_backward(model, inputs, lambda logits, i: surrogate(reduce(logits, i), todo[i]))
            return
        for chunk in order:  # every graph leaves ``retained``; those of chunks without weight unused
            tok = retained.pop(chunk[:2])
            if live[chunk[0]][chunk[1] // micro_batch]:
                surrogate(tok, chunk).backward()
