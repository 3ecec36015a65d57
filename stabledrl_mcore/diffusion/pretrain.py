"""Masked-diffusion SFT/pre-training loss (LLaDA eq. 3, SFT variant; SDAR's block variant).

For a sequence ``[prompt | answer]`` draw t ~ U(0, 1), mask every answer token
with probability p = (1 - eps) t + eps, and minimise
``- sum_{masked i} log p(x_i | x_t) / p`` divided by the sequence's number of
answer tokens (LLaDA's SFT normalisation), averaged over the batch. Prompt
tokens are never masked.

Block diffusion (SDAR, ``block_size``): every block of the sequence draws its
own t (the block ELBO of :mod:`.staircase`) and one staircase forward over
``[x_t | x_0]`` scores every block against the clean blocks before it; the same
normalisation applies.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from stabledrl_mcore.diffusion.likelihood import draw_log_probs, model_forward_logp
from stabledrl_mcore.diffusion.masking import MaskPlan, build_plan
from stabledrl_mcore.diffusion.staircase import staircase_forward_logp


def sft_mask_plan(
    answer_mask: torch.Tensor, *, generator: torch.Generator, eps: float = 1e-3, block_size: Optional[int] = None
) -> MaskPlan:
    """One draw of SFT masks: ratio mode, t stratified across the batch (per block with ``block_size``)."""
    return build_plan(answer_mask, num_mc=1, generator=generator, mode="ratio", eps=eps, block_size=block_size)


def sft_sequence_losses(
    model,
    ids: torch.Tensor,
    answer_mask: torch.Tensor,
    *,
    mask_id: int,
    generator: Optional[torch.Generator] = None,
    plan: Optional[MaskPlan] = None,
    eps: float = 1e-3,
    block_size: Optional[int] = None,
    attention_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, MaskPlan]:
    """Per-sequence SFT losses ``[B]`` of a ``[B, S]`` batch and the masks used.

    ``block_size`` selects the staircase layout (SDAR); None the bidirectional
    forward (LLaDA). ``plan`` replays given masks instead of drawing them.
    """
    if plan is None:
        if generator is None:
            raise TypeError("pass a torch.Generator (generator=...) or a MaskPlan to replay (plan=...)")
        plan = sft_mask_plan(answer_mask, generator=generator, eps=eps, block_size=block_size)
    if block_size is not None:
        if attention_mask is not None:
            raise ValueError("the staircase layout builds its own attention mask")

        forward = staircase_forward_logp(model, block_size)
    else:
        forward = model_forward_logp(model, attention_mask=attention_mask)
    logp = draw_log_probs(forward, ids, plan, mask_id)[0]
    weighted = (plan.weight[0].to(logp.dtype) * logp).sum(-1)
    return -weighted / answer_mask.sum(-1).clamp(min=1).to(logp.dtype), plan
