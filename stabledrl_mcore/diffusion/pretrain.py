"""Masked-diffusion SFT/pre-training loss (LLaDA eq. 3, SFT variant).

For a sequence ``[prompt | answer]`` draw t ~ U(0, 1), mask every answer token
with probability p = (1 - eps) t + eps, and minimise
``- sum_{masked i} log p(x_i | x_t) / p`` divided by the number of answer
tokens (LLaDA's SFT normalisation). Prompt tokens are never masked.
"""

from __future__ import annotations

from typing import Optional

import torch

from .likelihood import gather_log_probs
from .masking import build_plan


def masked_diffusion_loss(model, ids: torch.Tensor, completion_mask: torch.Tensor, *,
                          mask_id: int, generator: torch.Generator, eps: float = 1e-3,
                          attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scalar SFT loss of a ``[B, S]`` batch (stratified t across the batch)."""
    plan = build_plan(completion_mask, num_mc=1, generator=generator, mode="ratio", eps=eps)
    noisy = ids.masked_fill(plan.masked[0], mask_id)
    logits = model(noisy, attention_mask=attention_mask)
    logp = gather_log_probs(logits, ids, plan.scored[0])
    weighted = (plan.weight[0].to(logp.dtype) * logp).sum()
    return -weighted / completion_mask.sum().clamp(min=1)
