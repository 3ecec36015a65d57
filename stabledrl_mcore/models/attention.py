"""Core attention for diffusion LMs: the one module where a dLLM differs from a GPT.

Plugs into Megatron-Core's ``SelfAttention`` as its ``core_attention``
submodule (the interface of ``megatron.core.transformer.DotProductAttention``):
inputs ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]`` (GQA: ``ng``
query groups per tensor-parallel partition), already q/k-normed and rotated by
``SelfAttention``; output ``[sq, b, np * hn]``.

``attention_mask`` may be

- ``None``: fully bidirectional (LLaDA) -- SDPA without a mask, so the
  flash/memory-efficient kernels apply; (causal only if the layer was built
  with ``AttnMaskType.causal``, which the dLLM spec never does);
- a bool tensor broadcastable to ``[b, np, sq, sk]``, ``True`` = blocked
  (Megatron's convention);
- an :class:`~stabledrl_mcore.models.masks.AttentionLayout` descriptor tensor
  (``layout.to_tensor()``, a host int64 tensor: pattern, block size and per-row
  left-pad counts): decoded on the host (no device sync) and resolved here to
  no mask (bidirectional, no padding), a dense bool mask for SDPA (CPU, short
  queries; cached per layout and shape, so all layers of a forward share it),
  or, on CUDA, flex attention with the pattern's cached ``BlockMask`` and a
  padding ``score_mod`` (:mod:`stabledrl_mcore.models.flex`, which documents the
  kernel choice, GQA included). The descriptor is a tensor argument, so it
  survives Megatron's full-layer recompute (``tensor_parallel.checkpoint``).

While the model runs with a :class:`~stabledrl_mcore.models.kv_cache.KVCache`
it binds the cache to ``self.kv_cache``; the current keys and values are then
written into the cache's buffers and the queries attend over views of them
(``[cached | current]``, or the overwritten span inside ``cache.writing_at``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from stabledrl_mcore.models import flex
from stabledrl_mcore.models.masks import AttentionLayout
from stabledrl_mcore.models.positions import take_positions
from stabledrl_mcore.models.rope import cos_sin_heads_major, rotate_heads_major


@functools.lru_cache(maxsize=8)
def _allowed_mask(layout: AttentionLayout, sq: int, sk: int, device: str) -> Optional[torch.Tensor]:
    """SDPA's convention (True = may attend), built once per layout (padding included) and
    geometry, shared by all layers (``[1|B, 1, sq, sk]``, so few are kept)."""
    blocked = layout.dense(sq, sk, device=torch.device(device))
    return None if blocked is None else ~blocked


_last_descriptor: list = [None, -1, None]  # (descriptor, its _version, its layout)


def _layout_of(attention_mask) -> Optional[AttentionLayout]:
    """The :class:`AttentionLayout` of a descriptor tensor (None for masks / no mask).

    All layers of one forward receive the same descriptor object, so it is decoded
    once (``is_descriptor``/``from_tensor`` read tensor elements from Python).
    """
    if attention_mask is None or attention_mask.dtype != torch.int64:
        return None
    tensor, version, layout = _last_descriptor
    if attention_mask is tensor and attention_mask._version == version:
        return layout
    if not AttentionLayout.is_descriptor(attention_mask):
        return None
    layout = AttentionLayout.from_tensor(attention_mask)
    _last_descriptor[:] = [attention_mask, attention_mask._version, layout]
    return layout


def _mask_rows(allowed: torch.Tensor, rows, batch: int) -> torch.Tensor:
    """The query rows ``rows`` of an SDPA mask ``[b|1, h|1, sq, sk]`` (``take_positions``' rows)."""
    if not isinstance(rows, torch.Tensor) or rows.dim() == 1:  # shared by every sequence
        return take_positions(allowed, rows, 2)
    allowed = allowed.expand(batch, *allowed.shape[1:])
    index = rows[:, None, :, None].expand(batch, allowed.shape[1], rows.shape[1], allowed.shape[-1])
    return allowed.gather(2, index)


class SDPACoreAttention(MegatronModule):
    """Attention over one tensor-parallel partition of heads (SDPA, or flex on GPU).

    ``backend``: ``"auto"`` | ``"sdpa"`` | ``"flex"`` (see :mod:`.flex` for the choice).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        backend: str = "auto",
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        tp_size = config.tensor_model_parallel_size
        self.heads_per_partition = config.num_attention_heads // tp_size
        self.groups_per_partition = (config.num_query_groups or config.num_attention_heads) // tp_size
        self.attn_mask_type = attn_mask_type
        self.layer_number = max(1, layer_number)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.backend = backend
        self.kv_cache = None  # bound by DLLMModel.forward for KV-cached decoding
        self.query_rows = None
        """Bound by ``DLLMModel`` for the last layer of a forward that reads a few positions: only
        those queries attend (``take_positions``' rows: a slice, ``[n]`` or ``[B, n]``); the output
        is ``[n, b, np * hn]``. Every key and value is still computed (and cached)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention supports neither packed sequences nor attention bias")
        sq, b = query.shape[0], query.shape[1]
        rows = self.query_rows
        if rows is not None:
            query = take_positions(query, rows, 0)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if self.kv_cache is not None:  # keys/values copied into the cache, attended as its views
            k, v = self.kv_cache.update(self.layer_number, k, v)
        elif q.device.type == "cpu":
            # CPU flash SDPA is faster on [b, h, s, d]-contiguous inputs than on the
            # [s, b, h, d] views Megatron produces, copy included (~3% of a 100M step).
            k, v = k.contiguous(), v.contiguous()
        if q.device.type == "cpu":
            q = q.contiguous()
        sk = k.shape[2]
        gqa = self.heads_per_partition != self.groups_per_partition
        dropout_p = self.dropout_p if self.training else 0.0

        layout = _layout_of(attention_mask)
        if layout is not None:
            layout.check(sq, sk, b)
            if rows is None and flex.use_flex(self.backend, layout, sq, q.device, gqa):
                if dropout_p > 0:
                    raise ValueError("flex attention path does not implement attention dropout")
                out = flex.flex_attention(q, k, v, layout, scale=self.softmax_scale, enable_gqa=gqa)
                return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
            allowed = _allowed_mask(layout, sq, sk, str(q.device))
        else:
            allowed = None if attention_mask is None else ~attention_mask
        if rows is not None and allowed is not None and allowed.shape[-2] != 1:  # the queries' rows
            allowed = _mask_rows(allowed, rows, b)
        sq = q.shape[2]

        mask_type = attn_mask_type or self.attn_mask_type
        is_causal = attention_mask is None and mask_type == AttnMaskType.causal
        # enable_gqa shares each key/value group across its query heads inside SDPA (also
        # with a mask, measured exact and ~8% faster on CPU than repeating k/v as HF does).
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext()
        with rng:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allowed,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


class HeadsMajorRotarySelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` that rotates q/k itself, heads-major (local spec).

    ``rotary_pos_emb`` may be :func:`~stabledrl_mcore.models.rope.rotary_cos_sin`'s
    ``[2, B|1, 1, S, d]`` tensor (what :class:`DLLMModel` passes: cos/sin taken once
    per forward) or Megatron's ``[S, B|1, 1, d]`` angles (what a stock ``GPTModel``
    passes; cos/sin are then taken here, once for q and k). The rotation is applied
    right after the q/k projections (and q/k norms) by
    :func:`~stabledrl_mcore.models.rope.rotate_heads_major`, and Megatron's own is
    skipped: same result bitwise; see :mod:`.rope` for what it saves. Anything else
    (a ``(q, k)`` pair, partial, interleaved or YaRN rotary) goes through Megatron's path.
    The cos/sin are held for the duration of one call only: full-layer recompute
    re-runs this forward with the same argument, and selective (core-attention)
    recompute sees already-rotated q/k.
    """

    _cos_sin: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (cos, signed sin) during a call

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if args:
            raise TypeError("HeadsMajorRotarySelfAttention takes the arguments after attention_mask by keyword")
        if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
            rotary_pos_emb = None
        cos_sin = self._as_cos_sin(rotary_pos_emb)
        if cos_sin is None and rotary_pos_emb is not None:  # not ours to handle
            return super().forward(hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb, **kwargs)
        # cast once per layer (q and k share it); the rotation runs in the activation dtype
        self._cos_sin = None if cos_sin is None else cos_sin.to(hidden_states.dtype).unbind(0)
        try:
            return super().forward(hidden_states, attention_mask, rotary_pos_emb=None, **kwargs)
        finally:
            self._cos_sin = None

    def _as_cos_sin(self, rotary_pos_emb) -> Optional[torch.Tensor]:
        """``[2, B|1, 1, S, d]`` cos/signed sin for a full-width rotate-half rotary, else None."""
        if (
            not isinstance(rotary_pos_emb, torch.Tensor)
            or self.config.rotary_interleaved
            or hasattr(self.config, "yarn_rotary_scaling_factor")
        ):  # YaRN scales cos/sin
            return None
        if rotary_pos_emb.shape[-1] != self.config.kv_channels:
            return None
        if rotary_pos_emb.dim() == 5:
            return rotary_pos_emb
        if rotary_pos_emb.dim() == 4:
            return cos_sin_heads_major(rotary_pos_emb)
        return None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        tensors = super().get_query_key_value_tensors(
            hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv
        )
        if self._cos_sin is None:
            return tensors
        query, key = tensors[0], tensors[1]
        return (rotate_heads_major(query, *self._cos_sin), rotate_heads_major(key, *self._cos_sin), *tensors[2:])
