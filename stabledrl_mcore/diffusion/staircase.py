"""Block-diffusion ELBO (SDAR / BD3-LM) in one staircase pass.

A block model factorises log p(x) = sum_b log p(x^b | x^{<b}); each block term
has its own masked-diffusion ELBO, estimated with an independent ratio (or
count) per block: ``sum_b w_b sum_{i in b, masked} log p(x_i | x_t^b, x_0^{<b})``.

The per-block reference (:func:`block_elbo_loop`) runs one block-causal forward
per block: the clean prefix followed by the noisy block. The staircase layout
(:func:`block_elbo_staircase`, SDAR's training layout, JetAstra/SDAR) packs every block
into one forward over ``[x_t | x_0]`` (2n tokens, position ids 0..n-1 twice):
noisy block b sees its own noisy block and the clean blocks before it, never
its own clean copy, so its logits equal the loop's exactly (the last clean
block is seen by no noisy block and is left out: 2n - bs tokens). Masks come from
:func:`~.masking.build_plan` with ``block_size``, so both functions (and the
old/new policy) can replay the same :class:`~.masking.MaskPlan`.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from stabledrl_mcore.diffusion.likelihood import (
    LikelihoodEstimate,
    LogprobFn,
    _plan,
    dllm_config,
    draw_log_probs,
    elbo_from_draws,
    gather_log_probs,
    resolve_mask_id,
    vocab_sharded_logits,
)
from stabledrl_mcore.diffusion.masking import MaskPlan
from stabledrl_mcore.models.masks import AttentionLayout, block_causal_mask, staircase_position_ids


def _block_size(model, block_size: Optional[int]) -> int:
    return int(dllm_config(model).block_size) if block_size is None else int(block_size)


def _prepare(model, ids, completion_mask, block_size, num_mc, generator, plan, mode, coupled, eps, stratified):
    bs = _block_size(model, block_size)
    plan = _plan(
        completion_mask,
        plan,
        generator,
        num_mc=num_mc,
        mode=mode,
        coupled=coupled,
        eps=eps,
        stratified=stratified,
        block_size=bs,
    )
    if plan.block_size != bs:
        raise ValueError(f"mask plan was drawn with block_size={plan.block_size}, not {bs}")
    return bs, plan


def staircase_forward_logp(model, block_size: int, logprob_fn: Optional[LogprobFn] = None):
    """forward_logp over ``[x_t | x_0]`` with the staircase layout (one pass for all blocks).

    The layout is an :class:`AttentionLayout` (``noisy_len=n``, the last clean block
    dropped), so GPU backends never build the dense ``(2n)^2`` mask. At TP > 1 the logits
    stay vocab-sharded (:func:`~.likelihood.vocab_sharded_logits`).
    """

    def forward(noisy: Tensor, ids: Tensor, scored: Tensor) -> Tensor:
        n = ids.shape[1]
        keep = n + ((n - 1) // block_size) * block_size  # no noisy query sees the last clean block: drop it
        x = torch.cat([noisy, ids], dim=1)[:, :keep]
        pos = staircase_position_ids(n, device=ids.device)[:, :keep]
        layout = AttentionLayout.staircase(block_size, noisy_len=n)
        sharded = logprob_fn is not None or vocab_sharded_logits()
        logits = model(
            x, position_ids=pos, attention_mask=layout, gather_output=not sharded, logit_positions=slice(0, n)
        )  # the head on the scored noisy half only
        return gather_log_probs(logits, ids, scored, logprob_fn, vocab_parallel=sharded)

    return forward


def loop_forward_logp(model, block_size: int, logprob_fn: Optional[LogprobFn] = None, truncate: bool = True):
    """forward_logp with one block-causal forward per block that has scored tokens.

    ``truncate=True`` feeds only the clean prefix and the noisy block; ``False``
    feeds the whole sequence with block b noised (later blocks cannot affect b).
    """

    def forward(noisy: Tensor, ids: Tensor, scored: Tensor) -> Tensor:
        n = ids.shape[1]
        pieces = []
        for s in range(0, n, block_size):
            e = min(s + block_size, n)
            if not bool(scored[:, s:e].any()):
                pieces.append(torch.zeros(ids.shape[0], e - s, device=ids.device))
                continue
            stop = e if truncate else n
            x = torch.cat([ids[:, :s], noisy[:, s:e], ids[:, e:stop]], dim=1)
            mask = block_causal_mask(stop, block_size, device=ids.device)
            sharded = logprob_fn is not None or vocab_sharded_logits()
            logits = model(
                x,
                position_ids=torch.arange(stop, device=ids.device)[None],
                attention_mask=mask,
                gather_output=not sharded,
                logit_positions=slice(s, e),
            )
            pieces.append(gather_log_probs(logits, ids[:, s:e], scored[:, s:e], logprob_fn, vocab_parallel=sharded))
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in pieces])
        return torch.cat([p.to(dtype) for p in pieces], dim=1)

    return forward


def block_elbo_staircase(
    model,
    ids: Tensor,
    completion_mask: Tensor,
    block_size: Optional[int] = None,
    *,
    num_mc: int = 1,
    generator: Optional[torch.Generator] = None,
    plan: Optional[MaskPlan] = None,
    mode: str = "count",
    coupled: bool = False,
    eps: float = 1e-3,
    stratified: bool = True,
    length_normalize: bool = False,
    mask_id: Optional[int] = None,
    logprob_fn: Optional[LogprobFn] = None,
) -> LikelihoodEstimate:
    """Block ELBO of the completion tokens, one staircase forward per MC draw.

    ``ids`` ``[B, n]`` is prompt + completion laid out from position 0 (blocks of
    ``block_size``, default ``model.dllm_config.block_size``, counted from 0).
    """
    bs, plan = _prepare(
        model, ids, completion_mask, block_size, num_mc, generator, plan, mode, coupled, eps, stratified
    )
    logp = draw_log_probs(staircase_forward_logp(model, bs, logprob_fn), ids, plan, resolve_mask_id(model, mask_id))
    seq, token = elbo_from_draws(logp, plan, completion_mask, length_normalize)
    return LikelihoodEstimate(seq, token, plan)


def block_elbo_loop(
    model,
    ids: Tensor,
    completion_mask: Tensor,
    block_size: Optional[int] = None,
    *,
    num_mc: int = 1,
    generator: Optional[torch.Generator] = None,
    plan: Optional[MaskPlan] = None,
    mode: str = "count",
    coupled: bool = False,
    eps: float = 1e-3,
    stratified: bool = True,
    length_normalize: bool = False,
    mask_id: Optional[int] = None,
    logprob_fn: Optional[LogprobFn] = None,
    truncate: bool = True,
) -> LikelihoodEstimate:
    """The per-block reference of :func:`block_elbo_staircase` (same arguments, same masks)."""
    bs, plan = _prepare(
        model, ids, completion_mask, block_size, num_mc, generator, plan, mode, coupled, eps, stratified
    )
    forward = loop_forward_logp(model, bs, logprob_fn, truncate)
    logp = draw_log_probs(forward, ids, plan, resolve_mask_id(model, mask_id))
    seq, token = elbo_from_draws(logp, plan, completion_mask, length_normalize)
    return LikelihoodEstimate(seq, token, plan)
