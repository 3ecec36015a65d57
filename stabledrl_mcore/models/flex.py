"""flex attention for the masked dLLM layouts on GPU (no dense ``(2S)^2`` mask).

Kernel choice (documented in :class:`~stabledrl_mcore.models.attention.SDPACoreAttention`):

- bidirectional: SDPA with no mask (flash / memory-efficient kernels on GPU);
- block-causal and staircase on CUDA with >= :data:`FLEX_MIN_QUERY` queries:
  ``torch.nn.attention.flex_attention`` with a ``BlockMask`` built from the
  layout's ``mask_mod``. The BlockMask stores one entry per 128x128 tile, so
  a 2x8K staircase costs ~16 KB instead of a 256 MB bool mask, and fully
  masked tiles are skipped (about 3/4 of the staircase at long lengths: all of
  clean->noisy, all but the diagonal of noisy->noisy, half of the rest). TE's
  ``arbitrary`` mask type was not chosen: it consumes a dense ``[b, h, s, s]``
  mask, the very tensor this avoids;
- short queries (KV-cached decode of one block) and CPU: SDPA with a dense
  bool mask, which is tiny (``S_q x S_k``) or unavoidable there.

On CPU, ``attention_backend="flex"`` runs flex attention *eagerly* (it then
materialises scores); that path exists so the mask_mods are tested here.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

from .masks import AttentionLayout

FLEX_MIN_QUERY = 256
"""``auto`` uses flex attention on CUDA from this many queries on."""


@functools.lru_cache(maxsize=1)
def flex_importable() -> bool:
    """True when this torch ships ``torch.nn.attention.flex_attention``."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def use_flex(backend: str, layout: AttentionLayout, sq: int, device: torch.device) -> bool:
    """Whether this call should run flex attention (see the module docstring)."""
    if layout.kind == "bidirectional" or backend == "sdpa":
        return False
    if backend == "flex":
        if not flex_importable():
            raise RuntimeError("attention_backend='flex' needs torch.nn.attention.flex_attention")
        return True
    return device.type == "cuda" and sq >= FLEX_MIN_QUERY and flex_importable()


@functools.lru_cache(maxsize=16)
def block_mask(layout: AttentionLayout, sq: int, sk: int, device: str):
    """The (cached) flex ``BlockMask`` of a layout for ``sq`` queries and ``sk`` keys."""
    from torch.nn.attention.flex_attention import create_block_mask

    # _compile=True builds the tile map without a dense sq x sk intermediate (CUDA only).
    return create_block_mask(layout.mask_mod(sq, sk), None, None, sq, sk, device=device,
                             _compile=device.startswith("cuda"))


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=None)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout,
                   scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
    """``[b, h, s, d]`` attention of ``q`` over ``k``/``v`` under ``layout`` (compiled on CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention as eager

    mask = block_mask(layout, q.shape[2], k.shape[2], str(q.device))
    if q.device.type == "cuda":
        return _compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return eager(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa)
