"""Attention masks of the three dLLM attention modes.

Convention (Megatron's): boolean, ``True`` means the query may **not** attend
to the key; shape ``[1, 1, S_q, S_k]`` so it broadcasts over batch and heads.

- bidirectional (LLaDA): no mask at all (``None``);
- block-causal (SDAR inference over a plain sequence): query in block ``b``
  sees every key in blocks ``<= b``;
- staircase (SDAR training over ``[x_t | x_0]``, each half ``n`` tokens, both
  halves with position ids ``0..n-1``): query ``q`` may see key ``k`` iff
  (same block and same half) or (``q`` noisy, ``k`` clean, ``block(q) > block(k)``)
  or (both clean, ``block(q) >= block(k)``). A noisy block never sees its own
  clean copy, so one pass yields every block's ELBO term
  (``../shared/notes/models.md``, "Training layout").

:class:`AttentionLayout` names one of these patterns without materialising it,
so that GPU kernels (flex attention) never build the dense ``(2S)^2`` tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def block_index(seq_len: int, block_size: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Block number of every position ``0..seq_len-1``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return torch.arange(seq_len, device=device) // block_size


def block_causal_mask(seq_len: int, block_size: int, *, offset: int = 0,
                      key_len: Optional[int] = None,
                      device: Optional[torch.device] = None) -> torch.Tensor:
    """Block-causal mask for queries at positions ``offset..offset+seq_len-1``.

    ``key_len`` (default ``offset + seq_len``) covers keys ``0..key_len-1``, which
    is what a KV-cached decode step needs (cached keys first, then the current block).
    """
    key_len = offset + seq_len if key_len is None else key_len
    q_block = (torch.arange(seq_len, device=device) + offset) // block_size
    k_block = torch.arange(key_len, device=device) // block_size
    return (k_block[None, :] > q_block[:, None])[None, None]


def staircase_mask(n: int, block_size: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """The ``[1, 1, 2n, 2n]`` staircase mask over ``[x_t | x_0]`` (``n`` tokens each)."""
    blk = block_index(n, block_size, device).repeat(2)
    clean = torch.arange(2 * n, device=device) >= n
    q_blk, k_blk = blk[:, None], blk[None, :]
    q_clean, k_clean = clean[:, None], clean[None, :]
    same_block_same_half = (q_blk == k_blk) & (q_clean == k_clean)
    noisy_sees_clean_past = (~q_clean) & k_clean & (q_blk > k_blk)
    clean_sees_clean_past = q_clean & k_clean & (q_blk >= k_blk)
    allowed = same_block_same_half | noisy_sees_clean_past | clean_sees_clean_past
    return (~allowed)[None, None]


def staircase_position_ids(n: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Position ids ``[0..n-1, 0..n-1]`` of the staircase layout, shape ``[1, 2n]``."""
    pos = torch.arange(n, device=device)
    return torch.cat([pos, pos])[None]


def padding_mask(valid: torch.Tensor) -> torch.Tensor:
    """``[B, 1, 1, S]`` mask hiding keys where ``valid`` (``[B, S]`` bool) is False."""
    return (~valid.bool())[:, None, None, :]


# --------------------------------------------------------------------------- layouts
_KINDS = ("bidirectional", "block_causal", "staircase")
_DESCRIPTOR_TAG = -7_204_611  # first element of a layout descriptor tensor


@dataclass(frozen=True)
class AttentionLayout:
    """A named attention pattern, resolved lazily to the cheapest mask form per backend.

    Passed as ``attention_mask`` to :meth:`DLLMModel.forward`. The model hands
    it to every layer as a tiny int64 *descriptor* tensor (:meth:`to_tensor`), so
    that it survives Megatron's activation recompute (which only saves tensors,
    like Megatron's own ``attn_mask_type`` tensor in selective recompute). The
    core attention turns it into ``None`` (bidirectional), a dense bool mask
    (SDPA), or a flex-attention ``BlockMask`` (no ``(2S)^2`` tensor).

    Query/key geometry: queries are the *last* ``S_q`` of ``S_k`` keys (a KV
    cache prepends finished blocks), so block-causal queries sit at positions
    ``S_k - S_q + i``. The staircase needs ``S_q == S_k == 2n``.
    """

    kind: str
    block_size: int = 0

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"unknown attention layout {self.kind!r}; one of {_KINDS}")
        if self.kind != "bidirectional" and self.block_size < 1:
            raise ValueError(f"{self.kind} layout needs block_size >= 1, got {self.block_size}")

    @classmethod
    def bidirectional(cls) -> "AttentionLayout":
        """Every query sees every key (LLaDA)."""
        return cls("bidirectional")

    @classmethod
    def block_causal(cls, block_size: int) -> "AttentionLayout":
        """Query in block ``b`` sees keys in blocks ``<= b`` (SDAR inference)."""
        return cls("block_causal", int(block_size))

    @classmethod
    def staircase(cls, block_size: int) -> "AttentionLayout":
        """SDAR training over ``[x_t | x_0]`` (see the module docstring)."""
        return cls("staircase", int(block_size))

    # -- descriptor round trip ------------------------------------------------------
    def to_tensor(self) -> torch.Tensor:
        """``int64 [3]`` CPU descriptor ``[tag, kind, block_size]``."""
        return torch.tensor([_DESCRIPTOR_TAG, _KINDS.index(self.kind), self.block_size],
                            dtype=torch.int64)

    @staticmethod
    def is_descriptor(mask: object) -> bool:
        """True for a tensor made by :meth:`to_tensor` (dense masks are 4-D bool)."""
        return (isinstance(mask, torch.Tensor) and mask.dim() == 1 and mask.numel() == 3
                and mask.dtype == torch.int64 and int(mask[0]) == _DESCRIPTOR_TAG)

    @classmethod
    def from_tensor(cls, mask: torch.Tensor) -> "AttentionLayout":
        _, kind, block = (int(x) for x in mask.tolist())
        return cls(_KINDS[kind], block)

    # -- resolution -----------------------------------------------------------------
    def _check(self, sq: int, sk: int) -> None:
        if sk < sq:
            raise ValueError(f"{self.kind}: key length {sk} < query length {sq}")
        if self.kind == "staircase" and (sq != sk or sq % 2):
            raise ValueError(f"staircase needs equal, even query/key lengths, got {sq}, {sk} "
                             "(a KV cache cannot be combined with the staircase layout)")

    def dense(self, sq: int, sk: int, device=None) -> Optional[torch.Tensor]:
        """``[1, 1, sq, sk]`` bool mask (True = blocked), or None when nothing is blocked."""
        self._check(sq, sk)
        if self.kind == "bidirectional":
            return None
        if self.kind == "block_causal":
            return block_causal_mask(sq, self.block_size, offset=sk - sq, key_len=sk, device=device)
        return staircase_mask(sq // 2, self.block_size, device=device)

    def mask_mod(self, sq: int, sk: int):
        """flex-attention ``mask_mod(b, h, q_idx, kv_idx) -> allowed`` for this geometry."""
        self._check(sq, sk)
        bs, offset, n = self.block_size, sk - sq, sq // 2
        if self.kind == "bidirectional":
            return lambda b, h, q, k: q >= 0
        if self.kind == "block_causal":
            return lambda b, h, q, k: (q + offset) // bs >= k // bs

        def staircase(b, h, q, k):
            q_clean, k_clean = q >= n, k >= n
            q_blk = torch.where(q_clean, q - n, q) // bs
            k_blk = torch.where(k_clean, k - n, k) // bs
            same = (q_blk == k_blk) & (q_clean == k_clean)
            noisy_past = (~q_clean) & k_clean & (q_blk > k_blk)
            clean_past = q_clean & k_clean & (q_blk >= k_blk)
            return same | noisy_past | clean_past

        return staircase
