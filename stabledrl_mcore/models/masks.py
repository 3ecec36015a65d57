"""Attention masks of the three dLLM attention modes, with optional left padding.

Convention (Megatron's): boolean, ``True`` means the query may **not** attend
to the key; shape ``[1, 1, S_q, S_k]`` (``[B, 1, S_q, S_k]`` with padding) so
it broadcasts over batch and heads.

- bidirectional (LLaDA): no mask at all (``None``);
- block-causal (SDAR inference over a plain sequence): query in block ``b``
  sees every key in blocks ``<= b``;
- staircase (SDAR training over ``[x_t | x_0]``, each half ``n`` tokens, both
  halves with position ids ``0..n-1``): query ``q`` may see key ``k`` iff
  (same block and same half) or (``q`` noisy, ``k`` clean, ``block(q) > block(k)``)
  or (both clean, ``block(q) >= block(k)``). A noisy block never sees its own
  clean copy, so one pass yields every block's ELBO term
  (SDAR's training layout, JetAstra/SDAR).

:class:`AttentionLayout` names one of these patterns without materialising it,
so that GPU kernels (flex attention) never build the dense ``(2S)^2`` tensor.
It may also carry per-row **left-padding** counts (``pad[b]``: positions
``0..pad[b]-1`` of row ``b`` are padding; the staircase pads both halves, whose
positions repeat). Padding rule:

- every non-pad query sees only non-pad keys (what a key-padding mask does);
- bidirectional: pad queries see the non-pad keys too (the plain key-padding
  mask; no row is empty as long as a row has a non-pad key), so its dense form
  stays ``[B, 1, 1, S_k]``;
- block-causal / staircase: a pad query sees only the pad keys its pattern
  allows. A pad query's own key always qualifies, so no row is ever entirely
  masked (no softmax over nothing, whatever the kernel), and pad positions
  never reach a non-pad one. Outputs at non-pad positions equal those of
  ``pattern | padding_mask(valid)``; pad positions are never scored.

:meth:`AttentionLayout.dense` evaluates the layout's ``mask_mod`` predicate on
index grids, so the dense form (SDPA) and the flex-attention form are the same
expression by construction; :func:`block_causal_mask`, :func:`staircase_mask`
and :func:`padding_mask` are independent builders (references in tests, and
dense masks for callers that need one).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

import torch


def block_index(seq_len: int, block_size: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Block number of every position ``0..seq_len-1``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return torch.arange(seq_len, device=device) // block_size


def block_causal_mask(
    seq_len: int,
    block_size: int,
    *,
    offset: int = 0,
    key_len: Optional[int] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Block-causal mask for queries at positions ``offset..offset+seq_len-1``.

    ``key_len`` (default ``offset + seq_len``) covers keys ``0..key_len-1``, which
    is what a KV-cached decode step needs (cached keys first, then the current block).
    """
    key_len = offset + seq_len if key_len is None else key_len
    q_block = (torch.arange(seq_len, device=device) + offset) // block_size
    k_block = torch.arange(key_len, device=device) // block_size
    return (k_block[None, :] > q_block[:, None])[None, None]


def staircase_mask(n: int, block_size: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """The ``[1, 1, 2n, 2n]`` staircase mask over ``[x_t | x_0]`` (``n`` tokens each).

    A reference written independently of :meth:`AttentionLayout.mask_mod` (tests
    compare the two).
    """
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


_left_pad_memo: list = [None, -1, None]  # (weakref to valid, its _version, counts)


def left_pad_counts(valid: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """Per-row left-pad counts of a ``[B, S]`` key-validity mask, or None if it is not
    a left pad (some row has a False after a True).

    One device->host copy when ``valid`` lives on a GPU; the result for the last
    tensor is remembered (by identity and version), so slicing the counts of one
    batch for every micro-batch costs a single copy.
    """
    if valid.dim() != 2:
        raise ValueError(f"valid must be [B, S], got shape {tuple(valid.shape)}")
    ref, version, counts = _left_pad_memo
    if ref is not None and ref() is valid and valid._version == version:
        return counts
    flags = valid.bool()
    pads = (~flags).sum(1)
    left = torch.arange(flags.shape[1], device=flags.device)[None] >= pads[:, None]
    host = torch.cat([pads, (left == flags).all()[None].long()]).tolist()
    result = tuple(host[:-1]) if host[-1] else None
    try:
        _left_pad_memo[:] = [weakref.ref(valid), valid._version, result]
    except TypeError:  # not weak-referenceable: just do not remember it
        pass
    return result


def _host_to_device(values: Sequence[int], device) -> torch.Tensor:
    """An int64 tensor of host ints on ``device`` without a device sync (pinned, async copy)."""
    device = torch.device(device)
    host = torch.tensor(list(values), dtype=torch.int64, device="cpu")
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


# --------------------------------------------------------------------------- layouts
_KINDS = ("bidirectional", "block_causal", "staircase")
_DESCRIPTOR_TAG = -7_204_611  # first element of a layout descriptor tensor
_HEADER = 5  # [tag, kind, block_size, noisy_len, len(pad)], then the pad counts


@dataclass(frozen=True)
class AttentionLayout:
    """A named attention pattern (plus left padding), resolved lazily per backend.

    Passed as ``attention_mask`` to :meth:`DLLMModel.forward`. The model hands
    it to every layer as a tiny int64 CPU *descriptor* tensor (:meth:`to_tensor`:
    kind, block size, staircase length, pad counts), so that it survives
    Megatron's activation recompute (which only saves tensors, like Megatron's own
    ``attn_mask_type`` tensor in selective recompute) and is decoded on the host
    without a device sync. The core attention turns it into ``None``
    (bidirectional, no padding), a dense bool mask (SDPA), or a flex-attention
    ``BlockMask`` of the pattern plus a padding ``score_mod`` (no ``(2S)^2`` tensor).

    Query/key geometry: queries are the *last* ``S_q`` of ``S_k`` keys (a KV
    cache prepends finished blocks), so block-causal and bidirectional queries
    sit at positions ``S_k - S_q + i``. The staircase needs ``S_q == S_k``: either
    ``2n`` (``noisy_len`` 0), or, with ``noisy_len = n``, any length in
    ``[n, 2n]`` (``[x_t | x_0]`` with a tail of the clean half dropped).

    ``pad``: per-row left-pad counts (host ints, ``()`` = no padding), in positions
    (see the module docstring for what pad queries see).
    """

    kind: str
    block_size: int = 0
    pad: Tuple[int, ...] = ()
    noisy_len: int = 0

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"unknown attention layout {self.kind!r}; one of {_KINDS}")
        if self.kind != "bidirectional" and self.block_size < 1:
            raise ValueError(f"{self.kind} layout needs block_size >= 1, got {self.block_size}")
        pad = tuple(int(p) for p in (self.pad or ()))
        if any(p < 0 for p in pad):
            raise ValueError(f"pad counts must be >= 0, got {pad}")
        object.__setattr__(self, "pad", pad if any(pad) else ())
        if self.noisy_len < 0 or (self.noisy_len and self.kind != "staircase"):
            raise ValueError(f"noisy_len is a staircase length (>= 1), got {self.noisy_len} for {self.kind}")

    @classmethod
    def bidirectional(cls, pad: Optional[Sequence[int]] = None) -> "AttentionLayout":
        """Every query sees every (non-pad) key (LLaDA)."""
        return cls("bidirectional", pad=tuple(pad or ()))

    @classmethod
    def block_causal(cls, block_size: int, pad: Optional[Sequence[int]] = None) -> "AttentionLayout":
        """Query in block ``b`` sees keys in blocks ``<= b`` (SDAR inference)."""
        return cls("block_causal", int(block_size), tuple(pad or ()))

    @classmethod
    def staircase(
        cls, block_size: int, pad: Optional[Sequence[int]] = None, noisy_len: Optional[int] = None
    ) -> "AttentionLayout":
        """SDAR training over ``[x_t | x_0]`` (see the module docstring)."""
        return cls("staircase", int(block_size), tuple(pad or ()), int(noisy_len or 0))

    def with_padding(self, pad: Optional[Sequence[int]]) -> "AttentionLayout":
        """The same pattern with per-row left-pad counts ``pad`` (None / zeros = none)."""
        return replace(self, pad=tuple(pad or ()))

    def without_padding(self) -> "AttentionLayout":
        return self if not self.pad else replace(self, pad=())

    @property
    def unmasked(self) -> bool:
        """True when nothing is masked (bidirectional without padding): no mask at all."""
        return self.kind == "bidirectional" and not self.pad

    # -- descriptor round trip ------------------------------------------------------
    def to_tensor(self) -> torch.Tensor:
        """``int64`` CPU descriptor ``[tag, kind, block_size, noisy_len, B, pad_0..pad_{B-1}]``."""
        return torch.tensor(
            [_DESCRIPTOR_TAG, _KINDS.index(self.kind), self.block_size, self.noisy_len, len(self.pad), *self.pad],
            dtype=torch.int64,
            device="cpu",
        )

    @staticmethod
    def is_descriptor(mask: object) -> bool:
        """True for a tensor made by :meth:`to_tensor` (dense masks are 4-D bool).

        Only CPU tensors qualify, so the check never synchronises a GPU.
        """
        if not (
            isinstance(mask, torch.Tensor)
            and mask.dim() == 1
            and mask.dtype == torch.int64
            and mask.device.type == "cpu"
            and mask.numel() >= _HEADER
        ):
            return False
        return int(mask[0]) == _DESCRIPTOR_TAG and mask.numel() == _HEADER + int(mask[4])

    @classmethod
    def from_tensor(cls, mask: torch.Tensor) -> "AttentionLayout":
        values = mask.tolist()
        _, kind, block, noisy_len, _ = values[:_HEADER]
        return cls(_KINDS[kind], block, tuple(values[_HEADER:]), noisy_len)

    # -- geometry ---------------------------------------------------------------------
    def _half(self, sq: int) -> int:
        """``n``: the length of the noisy half of a staircase of ``sq`` tokens."""
        return self.noisy_len or sq // 2

    def check(self, sq: int, sk: int, batch: Optional[int] = None) -> None:
        """Raise ValueError if this layout cannot describe ``sq`` queries over ``sk`` keys
        (for a batch of ``batch`` rows)."""
        if sk < sq:
            raise ValueError(f"{self.kind}: key length {sk} < query length {sq}")
        if self.kind == "staircase":
            n = self._half(sq)
            if sq != sk or not (n <= sq <= 2 * n) or (not self.noisy_len and sq % 2):
                raise ValueError(
                    f"staircase needs equal query/key lengths of 2n (or n..2n with "
                    f"noisy_len=n), got {sq}, {sk} with noisy_len={self.noisy_len} "
                    "(a KV cache cannot be combined with the staircase layout)"
                )
        if self.pad:
            if batch is not None and len(self.pad) != batch:
                raise ValueError(f"layout pads {len(self.pad)} rows, the batch has {batch}")
            if self.kind == "bidirectional" and max(self.pad) >= sk:
                raise ValueError(f"a row padded over all its {sk} keys would see nothing (pad counts {self.pad})")

    # -- predicates ---------------------------------------------------------------------
    def _positions(self, sq: int, sk: int):
        """``(query position fn, key position fn)`` of query/key indices (for padding)."""
        if self.kind == "staircase":
            n = self._half(sq)

            def pos(i):
                return torch.where(i >= n, i - n, i)

            return pos, pos
        offset = sk - sq
        return (lambda q: q + offset), (lambda k: k)

    def layout_mod(self, sq: int, sk: int):
        """The pattern alone as a flex ``mask_mod(b, h, q_idx, kv_idx) -> allowed``
        (padding ignored; the BlockMask is built from it once per shape)."""
        self.check(sq, sk)
        bs, offset, n = self.block_size, sk - sq, self._half(sq)
        if self.kind == "bidirectional":
            return lambda b, h, q, k: k >= 0
        if self.kind == "block_causal":
            return lambda b, h, q, k: (q + offset) // bs >= k // bs

        def staircase(b, h, q, k):
            q_clean, k_clean = q >= n, k >= n
            q_blk = torch.where(q_clean, q - n, q) // bs
            k_blk = torch.where(k_clean, k - n, k) // bs
            # ~(a ^ b), not a == b: inductor cannot lower == on booleans (create_block_mask
            # with _compile=True fails on it); same truth table.
            same = (q_blk == k_blk) & ~(q_clean ^ k_clean)
            noisy_past = (~q_clean) & k_clean & (q_blk > k_blk)
            clean_past = q_clean & k_clean & (q_blk >= k_blk)
            return same | noisy_past | clean_past

        return staircase

    def padding_mod(self, sq: int, sk: int, pads: torch.Tensor):
        """The padding rule as ``mask_mod(b, h, q_idx, kv_idx) -> allowed`` over ``pads``
        (an int tensor of this layout's pad counts, on the device of the indices), or None
        without padding. Wrapped into a ``score_mod`` for flex attention."""
        if not self.pad:
            return None
        qpos, kpos = self._positions(sq, sk)
        if self.kind == "bidirectional":
            return lambda b, h, q, k: kpos(k) >= pads[b]

        def same_side(b, h, q, k):
            p = pads[b]
            return ~((qpos(q) < p) ^ (kpos(k) < p))

        return same_side

    def mask_mod(self, sq: int, sk: int, pads: Optional[torch.Tensor] = None):
        """Pattern and padding as one ``mask_mod(b, h, q_idx, kv_idx) -> allowed``.

        ``pads``: this layout's pad counts as a tensor on the indices' device
        (default: a CPU tensor of ``self.pad``). Without padding this is :meth:`layout_mod`.
        """
        pattern = self.layout_mod(sq, sk)
        if not self.pad:
            return pattern
        padding = self.padding_mod(sq, sk, _host_to_device(self.pad, "cpu") if pads is None else pads)
        return lambda b, h, q, k: pattern(b, h, q, k) & padding(b, h, q, k)

    # -- resolution -----------------------------------------------------------------
    def over_slots(
        self, slots: torch.Tensor, capacity: int, pads: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        """The mask of queries at KV-cache slots ``slots`` (``[S]``, their positions) over every
        slot ``0..capacity-1`` of the cache: ``[1|B, 1, S, capacity]`` bool, True = blocked
        (``[B, 1, 1, capacity]`` for padded bidirectional), or None when nothing is blocked.

        Built from tensors only (a decoding step's graph reads nothing on the host): block-causal
        by the slots' blocks, so slots past the query's block -- later blocks, scratch, stale
        keys -- are never seen; the padding rule of this layout applied to slot positions.
        ``pads``: the pad counts as a ``[B]`` tensor on the slots' device (default: ``self.pad``
        copied there). Bidirectional and block-causal layouts only (a staircase is never cached).
        """
        if self.kind == "staircase":
            raise ValueError("a staircase layout is never KV-cached; it has no mask over cache slots")
        if pads is None and self.pad:
            pads = _host_to_device(self.pad, slots.device)
        keys = torch.arange(capacity, device=slots.device)
        if self.kind == "bidirectional":
            return None if pads is None else (keys[None, :] < pads[:, None])[:, None, None, :]
        queries = slots[:, None]
        blocked = (keys[None, :] // self.block_size > queries // self.block_size)[None, None]
        if pads is None:
            return blocked
        p = pads[:, None, None, None]
        return blocked | ((queries[None, None] < p) ^ (keys[None, None, None, :] < p))

    def dense(self, sq: int, sk: int, device=None) -> Optional[torch.Tensor]:
        """``[1|B, 1, sq, sk]`` bool mask (True = blocked; ``[B, 1, 1, sk]`` for padded
        bidirectional), or None when nothing is blocked. It is ``~mask_mod`` evaluated on
        the index grids."""
        self.check(sq, sk)
        if self.unmasked:
            return None
        device = torch.device("cpu") if device is None else torch.device(device)
        k = torch.arange(sk, device=device)
        if not self.pad:
            q = torch.arange(sq, device=device)
            return ~self.layout_mod(sq, sk)(0, 0, q[:, None], k[None, :])[None, None]
        pads = _host_to_device(self.pad, device)
        b = torch.arange(len(self.pad), device=device)[:, None, None, None]
        if self.kind == "bidirectional":
            return ~self.padding_mod(sq, sk, pads)(b, 0, None, k[None, None, None, :])
        q = torch.arange(sq, device=device)[None, None, :, None]
        return ~self.mask_mod(sq, sk, pads)(b, 0, q, k[None, None, None, :])
