"""Masked-diffusion core: forward process, likelihood proxies, samplers.

Pure functions over tensors and a model that follows the contract in
:mod:`stabledrl_mcore.diffusion.toy` (the Megatron model in
``stabledrl_mcore.models`` and the toy model both implement it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from stabledrl_mcore.diffusion.likelihood import (
    LikelihoodEstimate,
    dllm_config,
    draw_log_probs,
    elbo,
    elbo_eubo,
    elbo_from_draws,
    eubo,
    eubo_from_draws,
    gather_log_probs,
    mean_field_logp,
    mixture,
)
from stabledrl_mcore.diffusion.mask_schemes import (
    POST_EOS_POLICIES,
    BlockRandomDraw,
    MaskRegions,
    apply_post_eos,
    available_mask_schemes,
    block_random_draw,
    build_mask_plan,
    get_mask_scheme,
    register_mask_scheme,
)
from stabledrl_mcore.diffusion.masking import (
    MaskPlan,
    build_plan,
    complementary_mask,
    mask_completion,
    mask_exact_counts,
    prompt_mask,
    sample_mask_ratios,
    stratified_mask_counts,
)
from stabledrl_mcore.diffusion.sampling_common import num_transfer_tokens, select_transfer
from stabledrl_mcore.diffusion.sampling_llada import CACHE_MODES, DecodeStats, generate_llada
from stabledrl_mcore.diffusion.sampling_sdar import generate_sdar
from stabledrl_mcore.diffusion.staircase import block_elbo_loop, block_elbo_staircase

__all__ = [
    "CACHE_MODES",
    "DecodeStats",
    "POST_EOS_POLICIES",
    "BlockRandomDraw",
    "MaskRegions",
    "apply_post_eos",
    "available_mask_schemes",
    "block_random_draw",
    "build_mask_plan",
    "get_mask_scheme",
    "register_mask_scheme",
    "LikelihoodEstimate",
    "MaskPlan",
    "block_elbo_loop",
    "block_elbo_staircase",
    "build_plan",
    "complementary_mask",
    "dllm_config",
    "draw_log_probs",
    "elbo",
    "elbo_eubo",
    "elbo_from_draws",
    "eubo",
    "eubo_from_draws",
    "gather_log_probs",
    "generate",
    "generate_llada",
    "generate_sdar",
    "mask_completion",
    "mask_exact_counts",
    "mean_field_logp",
    "mixture",
    "num_transfer_tokens",
    "prompt_mask",
    "sample_mask_ratios",
    "select_transfer",
    "stratified_mask_counts",
]


def generate(
    model,
    prompt_ids: Tensor,
    *,
    gen_length: int,
    steps: int,
    block_length: Optional[int],
    temperature: float = 0.0,
    threshold: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    cache: str = "none",
    **kwargs,
) -> Tensor:
    """Sample completions with the sampler of ``model.dllm_config.arch``.

    - ``'llada'``: :func:`generate_llada`; ``steps`` = total steps over all blocks;
      result ``[B, P + gen_length]``.
    - ``'sdar'``: :func:`generate_sdar`; ``steps`` = denoising steps per block,
      ``block_length`` None = the model's ``block_size``; result rounded up to
      whole blocks, ``[B, ceil((P + gen_length) / bs) * bs]``.

    ``cache``: LLaDA's approximate KV cache (``none`` | ``prefix`` | ``dual``, see
    :class:`~stabledrl_mcore.diffusion.sampling_llada.BlockLogits`); SDAR always decodes
    with its own cache of finished blocks and refuses anything but ``none``.
    The mask id (and EOS) come from the model's config. Extra keyword arguments go
    to the sampler (``cfg_scale``, ``remasking``, ``stop_at_eos``, ``prompt_valid``,
    ``progress``, ``top_k``, ``top_p``, ``use_cache``, ...).
    """
    arch = str(dllm_config(model).arch).lower()
    if arch == "llada":
        if block_length is None:
            block_length = gen_length
        return generate_llada(
            model,
            prompt_ids,
            gen_length=gen_length,
            steps=steps,
            block_length=block_length,
            temperature=temperature,
            threshold=threshold,
            generator=generator,
            cache=cache,
            **kwargs,
        )
    if arch == "sdar":
        if cache != "none":
            raise ValueError(
                f"cache={cache!r} is LLaDA's prefix/dual cache; SDAR decodes with its own KV "
                f"cache of finished blocks (use cache='none')"
            )
        return generate_sdar(
            model,
            prompt_ids,
            gen_length=gen_length,
            steps=steps,
            block_length=block_length,
            temperature=temperature,
            threshold=threshold,
            generator=generator,
            **kwargs,
        )
    raise ValueError(f"unknown dLLM arch {arch!r} (expected 'llada' or 'sdar')")
