"""A tiny pure-torch dLLM implementing the model contract, for tests and benchmarks.

Contract (what the Megatron model in ``stabledrl_mcore.models`` provides):
``model(input_ids [B, S], position_ids=None, attention_mask=None, *, kv_cache=None,
gather_output=True, logit_positions=None, cache_slots=None) -> logits [B, S, V]``
(``[B, n, V]`` for a slice or a LongTensor of positions); ``attention_mask`` is None (bidirectional),
bool (True = blocked, broadcastable to ``[B, 1, S, K]``) or an ``AttentionLayout``
(resolved to its dense mask); ``model.dllm_config``
has ``arch, mask_token_id, eos_token_id, pad_token_id, block_size, vocab_size``;
``model.kv_cache_layers()`` / ``model.kv_cache_dtype()`` give a KV cache's shape.

KV cache: the Megatron model's :class:`stabledrl_mcore.models.KVCache` (heads-major
buffers written in place): with ``kv_cache=cache`` the queries attend to
``[cached | current]`` keys (the mask's key length is ``cache.key_length(S)``); inside
``with cache.storing():`` the current keys/values are kept once the forward is done. With
``cache_slots`` (a slot-addressed step) the keys go to those slots and the queries attend to
every slot of the cache (the mask's key length is ``cache.capacity``).

Pre-norm transformer: RMSNorm, multi-head attention with rotate-half RoPE on
the given position ids, SiLU MLP, untied head. Weights are drawn from an
explicit generator (no global RNG).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stabledrl_mcore.models.kv_cache import KVCache
from stabledrl_mcore.models.masks import AttentionLayout
from stabledrl_mcore.models.positions import take_positions


@dataclass
class ToyDLLMConfig:
    arch: str = "llada"  # 'llada' (bidirectional sampler) or 'sdar' (block decoding)
    vocab_size: int = 16
    mask_token_id: int = 15
    eos_token_id: int = 1
    pad_token_id: int = 1
    block_size: int = 4
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    rope_theta: float = 10000.0
    logit_scale: float = 1.0
    suppress_mask: bool = True  # push the mask token's logit down (trained dLLMs never predict it)


def _rms(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotate-half RoPE; x [B, H, S, D], pos [B or 1, S]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)
    ang = (pos.to(torch.float64).unsqueeze(-1) * inv).to(x.dtype)  # [B, S, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class ToyDiffusionLM(nn.Module):
    def __init__(self, config: ToyDLLMConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.dllm_config = config
        c, g = config, torch.Generator().manual_seed(seed)
        h, n = c.hidden_size, c.num_layers

        def param(*shape, std=None):
            std = (1.0 / shape[-1]) ** 0.5 if std is None else std
            return nn.Parameter((torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype))

        self.embed = param(c.vocab_size, h, std=1.0)
        self.qkv = nn.ParameterList([param(3 * h, h) for _ in range(n)])
        # a large attention output gain makes predictions depend strongly on the context
        self.proj = nn.ParameterList([param(h, h, std=3.0 / h**0.5) for _ in range(n)])
        self.up = nn.ParameterList([param(2 * h, h) for _ in range(n)])
        self.down = nn.ParameterList([param(h, 2 * h) for _ in range(n)])
        self.norms = nn.Parameter(torch.ones(2 * n + 1, h, dtype=dtype))
        self.head = param(c.vocab_size, h)

    def kv_cache_layers(self):
        """``{layer: (heads, head_dim)}``: a KV cache's shape."""
        c = self.dllm_config
        return {i: (c.num_heads, c.hidden_size // c.num_heads) for i in range(c.num_layers)}

    def kv_cache_dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Optional[Tensor] = None,
        attention_mask: Optional[Tensor] = None,
        *,
        kv_cache: Optional[KVCache] = None,
        gather_output: bool = True,
        logit_positions=None,
        cache_slots: Optional[Tensor] = None,
    ) -> Tensor:
        c = self.dllm_config
        B, S = input_ids.shape
        H = c.num_heads
        past = kv_cache.offset if kv_cache is not None else 0
        keys = kv_cache.key_length(S) if kv_cache is not None else S
        if cache_slots is not None:
            kv_cache.slots = cache_slots
            position_ids = cache_slots[None] if position_ids is None else position_ids
            if isinstance(attention_mask, AttentionLayout):
                attention_mask = attention_mask.over_slots(cache_slots, kv_cache.capacity)
        if position_ids is None:
            position_ids = torch.arange(past, past + S, device=input_ids.device)[None]
        if isinstance(attention_mask, AttentionLayout):
            attention_mask = attention_mask.dense(S, keys, device=input_ids.device)
        allowed = None if attention_mask is None else ~attention_mask.bool()
        x = self.embed[input_ids]
        for i in range(c.num_layers):
            q, k, v = F.linear(_rms(x, self.norms[2 * i]), self.qkv[i]).chunk(3, dim=-1)
            q, k, v = (t.reshape(B, S, H, -1).transpose(1, 2) for t in (q, k, v))
            q, k = _rope(q, position_ids, c.rope_theta), _rope(k, position_ids, c.rope_theta)
            if kv_cache is not None:
                k, v = kv_cache.update(i, k, v)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
            x = x + F.linear(a.transpose(1, 2).reshape(B, S, -1), self.proj[i])
            x = x + F.linear(F.silu(F.linear(_rms(x, self.norms[2 * i + 1]), self.up[i])), self.down[i])
        if kv_cache is not None:
            kv_cache.commit()
            kv_cache.slots = None
        if logit_positions is not None:
            x = take_positions(x, logit_positions, 1)
        logits = F.linear(_rms(x, self.norms[-1]), self.head) * c.logit_scale
        if c.suppress_mask:
            bias = torch.zeros(c.vocab_size, dtype=logits.dtype, device=logits.device)
            logits = logits + bias.index_fill(0, torch.tensor([c.mask_token_id], device=logits.device), -30.0)
        return logits
