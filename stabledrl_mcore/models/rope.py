"""Rotary position embedding from explicit position ids (rotate-half, fp32).

Megatron's ``GPTModel`` builds its RoPE table for positions ``0..S-1`` and
ignores ``position_ids``; the staircase layout reuses positions ``0..n-1`` in
both halves and KV-cached decoding starts at the cached length, so the model
computes the angles itself and hands them to ``TransformerBlock`` as
``rotary_pos_emb``. Megatron's ``apply_rotary_pos_emb`` (non-interleaved)
then rotates ``t * cos + rotate_half(t) * sin`` -- the HF-Llama / NeoX
convention that LLaDA and SDAR (Qwen3) use -- with cos/sin taken in fp32
and cast to the activation dtype, as HF does.

The local spec rotates with :func:`rotary_cos_sin` + :func:`rotate_heads_major`
instead (see :class:`~stabledrl_mcore.models.attention.HeadsMajorRotarySelfAttention`):
the same arithmetic, bitwise, with cos/sin taken once per forward (already
heads-major, the sign of ``rotate_half`` folded into sin) rather than per layer
for q and k, without Megatron's slice/concatenate of the (here empty)
non-rotated part, and with the result already in the ``[b, heads, s, d]``
memory layout that CPU SDPA wants.
"""

from __future__ import annotations

import torch


def inv_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """``theta ** (-2i / d)`` for ``i < d/2`` in fp32 (same arithmetic as HF's default RoPE)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponent)


def rotary_angles(position_ids: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Angles for Megatron's ``apply_rotary_pos_emb``: ``[S, B, 1, head_dim]`` fp32.

    ``position_ids``: ``[B, S]`` or ``[1, S]`` (broadcast over the batch). The
    last dimension is ``[freqs, freqs]`` (rotate-half layout); the singleton
    third dimension broadcasts over heads, so per-row positions work.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [B, S], got shape {tuple(position_ids.shape)}")
    inv_freq = inv_frequencies(head_dim, theta, device=position_ids.device)
    freqs = position_ids.float()[..., None] * inv_freq  # [B, S, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.transpose(0, 1)[:, :, None, :].contiguous()


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """:func:`cos_sin_heads_major` of :func:`rotary_angles`: ``[2, B, 1, S, head_dim]`` fp32.

    One tensor (not a pair) so that Megatron's activation checkpointing, which
    saves its tensor arguments, can carry it as ``rotary_pos_emb``.
    """
    return cos_sin_heads_major(rotary_angles(position_ids, head_dim, theta))


def cos_sin_heads_major(angles: torch.Tensor) -> torch.Tensor:
    """``[S, B, 1, d]`` angles -> ``[2, B, 1, S, d]``: cos, and sin with its first half negated.

    ``rotate_half(t) * sin = cat(-t2, t1) * sin`` equals ``cat(t2, t1) * signed_sin``
    bitwise (a product's sign is the XOR of its factors' signs), so the rotation
    needs no negation; heads-major so it broadcasts over ``[b, heads, s, d]``.
    """
    cos, sin = torch.cos(angles), torch.sin(angles)
    half = angles.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return torch.stack((cos, signed_sin)).permute(0, 2, 3, 1, 4).contiguous()


def rotate_heads_major(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``t * cos + rotate_half(t) * sin`` for ``t`` of shape ``[s, b, heads, d]``.

    ``cos``/``signed_sin``: :func:`cos_sin_heads_major`'s two halves, in ``t``'s
    dtype. Bitwise equal to Megatron's unfused ``_apply_rotary_pos_emb_bshd`` (cos/sin
    cast to ``t``'s dtype; fp addition commutes exactly), but the result is a
    ``[s, b, heads, d]`` view of ``[b, heads, s, d]``-contiguous memory, so the core
    attention's permute to ``[b, heads, s, d]`` needs no copy.
    """
    heads_major = t.permute(1, 2, 0, 3)
    first, second = heads_major.chunk(2, dim=-1)
    swapped = torch.cat((second, first), dim=-1)  # contiguous [b, heads, s, d]
    # The contiguous operand first: the sum takes its layout.
    return (swapped * signed_sin + heads_major * cos).permute(2, 0, 1, 3)
