"""LLaDA sampling: semi-autoregressive low-confidence remasking (upstream ``generate.py``).

The answer (``gen_length`` mask tokens after the prompt) is split into blocks of
``block_length``; each block gets ``steps / num_blocks`` steps. Every step runs
one bidirectional forward over the whole sequence, takes x0 = argmax of the
Gumbel-perturbed logits (float64 noise, temperature 0 = greedy), scores each
masked position of the current block by the softmax probability of x0
("low_confidence") or a uniform draw ("random"), and commits the top-k, k being
the block's masked count split evenly over its steps (remainder to the first
steps). Positions outside the current block are never committed (upstream gives
them -inf confidence).

Options beyond upstream, all off by default: ``threshold`` (commit every position
whose confidence exceeds it when that is at least k, as SDAR / Fast-dLLM),
``stop_at_eos`` (see :func:`generate_llada`), ``prompt_valid`` (left padding).
Classifier-free guidance follows upstream: the unconditional input has the
prompt replaced by masks, logits = u + (cfg_scale + 1) (c - u).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from stabledrl_mcore.diffusion.likelihood import dllm_config
from stabledrl_mcore.diffusion.masking import uniform
from stabledrl_mcore.diffusion.sampling_common import (
    commit_transfer,
    check_prompt,
    fill_after_eos,
    first_eos_settled,
    gumbel_argmax,
    num_transfer_tokens,
    progress_bar,
    select_transfer,
)
from stabledrl_mcore.models.masks import padding_mask

# on_step(step, transfer [B, S] bool, x [B, S] after the commit)
StepHook = Callable[[int, Tensor, Tensor], None]


def _logits(model, x: Tensor, attn: Optional[Tensor], cfg_scale: float, prompt_len: int, mask_id: int) -> Tensor:
    if cfg_scale <= 0.0:
        return model(x, position_ids=None, attention_mask=attn)
    un_x = x.clone()
    un_x[:, :prompt_len] = mask_id
    both = model(torch.cat([x, un_x]), position_ids=None,
                 attention_mask=None if attn is None else torch.cat([attn, attn]))
    cond, uncond = both.chunk(2, dim=0)
    return uncond + (cfg_scale + 1.0) * (cond - uncond)


@torch.no_grad()
def generate_llada(model, prompt_ids: Tensor, *, gen_length: int = 128, steps: int = 128, block_length: int = 128,
                   temperature: float = 0.0, cfg_scale: float = 0.0, remasking: str = "low_confidence",
                   threshold: Optional[float] = None, generator: Optional[torch.Generator] = None,
                   mask_id: Optional[int] = None, eos_id: Optional[int] = None, stop_at_eos: bool = False,
                   prompt_valid: Optional[Tensor] = None, progress: Optional[bool] = None,
                   on_step: Optional[StepHook] = None) -> Tensor:
    """Decode ``gen_length`` tokens after ``prompt_ids`` ``[B, P]``; returns ``[B, P + gen_length]``.

    ``steps`` is the total number of denoising steps (must divide by the number of
    blocks, as upstream). ``stop_at_eos``: a row is settled once it has committed an
    EOS with no mask before it; when every row is settled decoding stops, and in
    every row all positions after its first EOS are set to EOS (LLaDA pads its
    answers with EOS, so this only skips work). ``generator`` is required for
    ``temperature > 0`` or ``remasking="random"``. The model's train/eval mode is
    left as is.
    """
    check_prompt(prompt_ids, prompt_valid)
    cfg = dllm_config(model)
    mask_id = int(cfg.mask_token_id) if mask_id is None else int(mask_id)
    eos_id = int(cfg.eos_token_id) if eos_id is None else int(eos_id)
    if remasking not in ("low_confidence", "random"):
        raise ValueError(f"remasking must be 'low_confidence' or 'random', got {remasking!r}")
    if remasking == "random" and generator is None:
        raise TypeError("remasking='random' needs an explicit torch.Generator")
    if gen_length % block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError(f"steps ({steps}) must be a multiple of the number of blocks ({num_blocks})")
    steps_per_block = steps // num_blocks

    B, P = prompt_ids.shape
    device = prompt_ids.device
    x = torch.full((B, P + gen_length), mask_id, dtype=torch.long, device=device)
    x[:, :P] = prompt_ids
    attn = None
    if prompt_valid is not None:
        attn = padding_mask(torch.cat([prompt_valid.bool(), torch.ones(B, gen_length, dtype=torch.bool,
                                                                        device=device)], dim=1))
    bar = progress_bar(steps, progress, "llada")
    step, done = 0, False
    for blk in range(num_blocks):
        s, e = P + blk * block_length, P + (blk + 1) * block_length
        schedule = num_transfer_tokens((x[:, s:e] == mask_id).sum(-1), steps_per_block)
        for i in range(steps_per_block):
            logits = _logits(model, x, attn, cfg_scale, P, mask_id)[:, s:e]
            cur = x[:, s:e]
            masked = cur == mask_id
            x0 = gumbel_argmax(logits, temperature, generator)
            if remasking == "low_confidence":
                conf = torch.softmax(logits.float(), -1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
            else:
                conf = uniform(x0.shape, generator, device)
            conf = torch.where(masked, conf, torch.full_like(conf, -torch.inf))
            transfer = select_transfer(conf, schedule[:, i], threshold)
            step = commit_transfer(x, s, e, x0, transfer, step, bar, on_step)
            if stop_at_eos and bool(first_eos_settled(x[:, P:], mask_id, eos_id)[0].all()):
                done = True
                break
        if done:
            break
    bar.close()
    if stop_at_eos:
        x = fill_after_eos(x, P, eos_id)
    return x
