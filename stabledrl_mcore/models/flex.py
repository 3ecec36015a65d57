"""flex attention for the masked dLLM layouts on GPU (no dense ``(2S)^2`` mask).

Kernel choice (:func:`use_flex`, a pure function of backend, layout, query
length, device and GQA; used by
:class:`~stabledrl_mcore.models.attention.SDPACoreAttention`). On CUDA SDPA's
flash kernel takes no mask, its memory-efficient kernel takes a mask but no
GQA (``enable_gqa``), so GQA with any mask falls to the math kernel, which
materialises ``B x heads x S_q x S_k`` scores. Hence, for ``backend="auto"``:

- bidirectional, no padding: SDPA with no mask (flash; GQA included);
- block-causal / staircase (padded or not) on CUDA with >= :data:`FLEX_MIN_QUERY`
  queries: ``torch.nn.attention.flex_attention``, compiled, with a
  ``BlockMask`` built from the layout's pattern (:meth:`AttentionLayout.layout_mod`).
  The BlockMask stores one entry per 128x128 tile, so a 2x8K staircase costs
  ~16 KB instead of a 256 MB bool mask (B times that with per-row padding), and fully
  masked tiles are skipped (about 3/4 of the staircase at long lengths: all of
  clean->noisy, all but the diagonal of noisy->noisy, half of the rest).
  GQA runs inside the kernel (``enable_gqa``). TE's ``arbitrary`` mask type was
  not chosen: it consumes a dense ``[b, h, s, s]`` mask, the very tensor this avoids;
- bidirectional with padding on CUDA, >= :data:`FLEX_MIN_QUERY` queries: flex
  attention with GQA (SDPA would take the math kernel); without GQA SDPA with the
  ``[B, 1, 1, S_k]`` key mask (memory-efficient kernel, nothing quadratic);
- short queries (KV-cached decode of one block) and CPU: SDPA with a dense
  bool mask, which is small (``B x S_q x S_k``) or unavoidable there (with GQA
  on CUDA this is the math kernel, bounded by the short query).

Padding never rebuilds the BlockMask: the BlockMask is the pattern's, cached
per (pattern, S_q, S_k, device) and shared by every layer, batch and padding;
the padding rule (:meth:`AttentionLayout.padding_mod`) is applied by a
``score_mod`` (``-inf`` off the rule) over a ``[B]`` device tensor of pad
counts, copied from the host asynchronously once per distinct padding and
cached. A ``score_mod`` runs on every computed tile, including the "full"
tiles where a ``mask_mod`` is skipped, so padding cannot be lost there; it
costs a compare per score, and a row's left-pad tiles (a small share) are
computed rather than skipped. The padding rule leaves no row empty.

On CPU, ``attention_backend="flex"`` runs flex attention *eagerly* by default
(it then materialises scores); that path exists so the mask_mods are tested
here. ``torch.compile(flex_attention)`` also works on CPU (inductor's C++
template) for the forward; torch refuses flex attention's backward on CPU, eager
or compiled (``NotImplementedError`` in ``_validate_device``). Inductor's CPU template is wrong
for tiles under :data:`CPU_COMPILED_MIN_BLOCK` (torch 2.13, measured on AVX2 and AVX-512 x86: a
causal mask with 8-wide tiles differs from SDPA by 0.8-2.2, sometimes NaN; 16- and 32-wide tiles
agree to 3e-7), so such a call runs eagerly instead, with one warning.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.attention.flex_attention import flex_attention as eager

from stabledrl_mcore.models.masks import AttentionLayout, _host_to_device

FLEX_MIN_QUERY = 256
"""``auto`` uses flex attention on CUDA from this many queries on."""

BLOCK_SIZE = 128
"""Tile size of the BlockMasks (flex attention's default)."""

CPU_COMPILED_MIN_BLOCK = 16
"""Smallest tile for which inductor's compiled CPU flex kernel is right; smaller ones run eagerly."""


@functools.lru_cache(maxsize=1)
def flex_importable() -> bool:
    """True when this torch ships ``torch.nn.attention.flex_attention``."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def use_flex(backend: str, layout: AttentionLayout, sq: int, device: torch.device, gqa: bool = False) -> bool:
    """Whether this call should run flex attention (see the module docstring).

    ``gqa``: the call shares key/value heads between query heads.
    """
    if layout.unmasked or backend == "sdpa":
        return False
    if backend == "flex":
        if not flex_importable():
            raise RuntimeError("attention_backend='flex' needs torch.nn.attention.flex_attention")
        return True
    if torch.device(device).type != "cuda" or sq < FLEX_MIN_QUERY or not flex_importable():
        return False
    return layout.kind != "bidirectional" or gqa


def block_mask(
    layout: AttentionLayout, sq: int, sk: int, device, *, block_size: int = BLOCK_SIZE, compile: Optional[bool] = None
):
    """The (cached) flex ``BlockMask`` of a layout's *pattern* for ``sq`` queries, ``sk`` keys.

    Padding is ignored (it is the ``score_mod`` of :func:`padding_score_mod`), so
    layouts that differ only in padding share one object. ``compile`` (default: on
    CUDA) builds the tile map with ``_compile=True``, without a dense ``sq x sk``
    intermediate.
    """
    device = str(torch.device(device))
    compile = device.startswith("cuda") if compile is None else bool(compile)
    return _block_mask(layout.without_padding(), sq, sk, device, int(block_size), compile)


@functools.lru_cache(maxsize=32)
def _block_mask(layout: AttentionLayout, sq: int, sk: int, device: str, block_size: int, compile: bool):

    return create_block_mask(
        layout.layout_mod(sq, sk), None, None, sq, sk, device=device, BLOCK_SIZE=block_size, _compile=compile
    )


@functools.lru_cache(maxsize=32)
def padding_score_mod(layout: AttentionLayout, sq: int, sk: int, device):
    """flex ``score_mod`` applying the layout's padding (None without padding), cached.

    Scores off the padding rule become ``-inf``; the pad counts live in a small
    int64 device tensor captured by the closure (a traced input for the compiled
    kernel: new paddings do not recompile).
    """
    if not layout.pad:
        return None
    pads = _host_to_device(layout.pad, device)
    allowed = layout.padding_mod(sq, sk, pads)

    def score_mod(score, b, h, q, k):
        return torch.where(allowed(b, h, q, k), score, -float("inf"))

    return score_mod


@functools.lru_cache(maxsize=None)
def _warn_small_cpu_tiles(block_size: int) -> None:
    """One warning per tile size: compiled CPU flex with tiles under 16 falls back to eager."""
    warnings.warn(
        f"flex attention: {block_size}-wide tiles are computed wrongly by inductor's CPU kernel "
        f"(torch {torch.__version__}); running eager flex attention instead "
        f"(use block_size >= {CPU_COMPILED_MIN_BLOCK} to compile on CPU)",
        stacklevel=3,
    )


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=None)


def flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    compiled: Optional[bool] = None,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """``[b, h, s, d]`` attention of ``q`` over ``k``/``v`` under ``layout`` (padding included).

    ``compiled`` (default: on CUDA) runs ``torch.compile(flex_attention)``; else the
    eager (reference) implementation.
    """

    sq, sk = q.shape[2], k.shape[2]
    layout.check(sq, sk, q.shape[0])
    device = str(q.device)
    mask = block_mask(layout, sq, sk, device, block_size=block_size)
    score_mod = padding_score_mod(layout, sq, sk, device)
    compiled = q.device.type == "cuda" if compiled is None else compiled
    if compiled and q.device.type == "cpu" and block_size < CPU_COMPILED_MIN_BLOCK:
        _warn_small_cpu_tiles(block_size)
        compiled = False
    if compiled:
        return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=enable_gqa)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return eager(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=enable_gqa)
