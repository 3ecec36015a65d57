"""Model FLOPs of the dLLM backbones: what model FLOPs utilisation (MFU) counts.

For a backbone with ``L`` layers, width ``H``, ``nh`` query heads and ``ng``
key/value groups of width ``hd``, SwiGLU width ``F`` and vocabulary ``V``:

    N_mm = L * (H*hd*(nh + 2*ng) + nh*hd*H + 3*H*F) + V*H     (matmul weights)

(QKV projection, attention output, SwiGLU gate+up and down, LM head; the input
embedding is a lookup and norms, RoPE and softmax are not counted.) A mixture-of-experts
layer (``E`` experts of width ``F_e``, top-``k``) counts the *active* weights a token runs
through, the router and its ``k`` experts: ``3*H*F`` becomes ``E*H + k*3*H*F_e``, so ``N_mm``
is :meth:`~stabledrl_mcore.models.presets.DLLMConfig.num_active_parameters` less the input
embedding and the norms (dropped tokens of a capacity factor are still counted). A forward of
one query token that attends to ``K`` keys costs

    F_fwd(K) = 2 * N_mm + 4 * L * K * nh * hd

(2 FLOPs per multiply-add; ``Q K^T`` and ``P V`` are ``2 K nh hd`` each). Keys are
counted densely, as SDPA with a mask computes them (a staircase pass over
``[x_t | x_0]`` is 2n queries x 2n keys). Forward + backward costs ``3 F_fwd``
(the backward is twice the forward); activation recompute is *not* counted
(model FLOPs, not hardware FLOPs), so MFU does not reward recomputing.

:class:`FlopCounter` hooks a model's forward and adds ``F_fwd`` for every call
(``3 F_fwd`` when autograd records it, since a backward follows), so any phase
(sampling, likelihood passes, training) is counted from the forwards it really runs; the LM head
only on the positions a forward asks logits for (``logit_positions``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def matmul_params(cfg) -> int:
    """``N_mm``: weights that take part in a matrix multiply per token (see module doc; MoE: the active ones)."""
    h, hd, nh, ng = cfg.hidden_size, cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    if getattr(cfg, "is_moe", False):
        mlp = cfg.num_experts * h + cfg.moe_router_topk * 3 * h * cfg.moe_ffn_hidden_size
    else:
        mlp = 3 * h * cfg.ffn_hidden_size
    per_layer = h * hd * (nh + 2 * ng) + nh * hd * h + mlp
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def forward_flops_per_token(cfg, keys: int) -> float:
    """``F_fwd(K) = 2 N_mm + 4 L K nh hd`` for one query token attending to ``keys`` keys."""
    return 2.0 * matmul_params(cfg) + 4.0 * cfg.num_layers * keys * cfg.num_attention_heads * cfg.kv_channels


def forward_flops(cfg, batch: int, queries: int, keys: Optional[int] = None) -> float:
    """One forward of ``batch`` rows x ``queries`` tokens, each attending to ``keys`` (default all queries)."""
    return batch * queries * forward_flops_per_token(cfg, queries if keys is None else keys)


def train_flops_per_token(cfg, seq_len: int) -> float:
    """Forward + backward of one token of a full-attention sequence of ``seq_len``: ``3 F_fwd(S)``."""
    return 3.0 * forward_flops_per_token(cfg, seq_len)


def _shape(args, kwargs):
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        return None
    queries = int(ids.shape[1])
    cache = kwargs.get("kv_cache")
    keys = queries
    if cache is not None and kwargs.get("cache_slots") is not None:  # ours, a decoding step: every slot
        keys = int(cache.capacity)
    elif cache is not None and hasattr(cache, "key_length"):  # ours: appended or overwritten in place
        keys = int(cache.key_length(queries))
    elif cache is not None:
        keys += int(getattr(cache, "length", 0) or 0)
    past = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers caches
    if past is not None and hasattr(past, "get_seq_length"):
        keys = queries + int(past.get_seq_length())
    return int(ids.shape[0]), queries, keys


def _head_rows(kwargs, queries: int) -> int:
    """Positions the LM head runs on: ``logit_positions`` (a slice or a tensor of them) or every query."""
    positions = kwargs.get("logit_positions")
    if isinstance(positions, torch.Tensor):  # shared [n], or each row's own [B, n]
        return int(positions.shape[-1])
    return queries if positions is None else len(range(*positions.indices(queries)))


class FlopCounter:
    """Counts model FLOPs of every forward of ``model`` while active (``with FlopCounter(m, cfg) as c``).

    ``c.flops`` = sum of ``F_fwd`` over no-grad forwards + ``3 F_fwd`` over forwards
    that autograd records; ``c.tokens`` = query tokens seen by the model.
    """

    def __init__(self, model: Any, cfg):
        self.model, self.cfg = model, cfg
        self.flops = 0.0
        self.tokens = 0
        self._handle = None

    def _hook(self, _module, args, kwargs):
        shape = _shape(args, kwargs)
        if shape is None:
            return None
        batch, queries, keys = shape
        factor = 3.0 if torch.is_grad_enabled() else 1.0
        skipped_head = (
            batch * (queries - _head_rows(kwargs, queries)) * 2.0 * self.cfg.vocab_size * self.cfg.hidden_size
        )
        self.flops += factor * (forward_flops(self.cfg, batch, queries, keys) - skipped_head)
        self.tokens += batch * queries
        return None

    def reset(self) -> None:
        self.flops, self.tokens = 0.0, 0

    def __enter__(self) -> "FlopCounter":
        self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
