"""Per-layer key/value cache for KV-cached diffusion decoding, written in place.

SDAR decodes block by block (upstream ``block_diffusion_generate``, JetAstra/SDAR):
the cache holds only *finished* (clean) blocks; the current block is denoised
with repeated forwards that attend to ``[cached keys | current keys]`` without
committing anything, and once the block is final it is run once more inside
``cache.storing()`` so its keys/values become part of the cache. LLaDA's
approximate caches (Fast-dLLM's prefix / dual cache) store every position once
per block and then re-forward only the changing span: inside
``cache.writing_at(s)`` a forward's keys overwrite positions ``s..s+S-1`` of the
cache and its queries attend to every valid position.

Usage::

    cache = KVCache(capacity=P + gen_length)
    with cache.storing():
        model(prompt_ids, attention_mask=AttentionLayout.block_causal(bs), kv_cache=cache)
    logits = model(block_ids, attention_mask=None, kv_cache=cache)   # sees cache + block
    with cache.storing():
        model(final_block_ids, attention_mask=None, kv_cache=cache)  # append the block

Storage: one preallocated buffer per layer and per key/value, heads-major
``[B, groups, capacity, head_dim]`` (the layout SDPA reads), keyed by Megatron's
global ``layer_number``. A forward of ``S`` tokens copies its keys into positions
``offset .. offset+S-1`` (``offset`` = :attr:`length`, or the ``writing_at``
position) and attends over a *view* of the first :meth:`key_length` positions:
no concatenation, no copy of the cached keys, and no stale keys to mask out
(the old concatenating cache copied the whole cache in every layer on every
forward, and a dual-cache step attended over ``L + block`` keys with the stale
block masked). Positions past :attr:`length` written by a forward that is not
storing are scratch: the next forward overwrites them. With a ``capacity`` the
buffers are allocated once (static shapes: a decode step always reads the same
buffer); without one they grow by doubling. Keys are cached *after* RoPE and
q/k-norm (exactly what the core attention receives). Under tensor parallelism
every rank caches its own head groups; under pipeline parallelism each stage its
own layers.

Position ids default to ``offset + arange(S)``, and a mask (bool tensor or
:class:`AttentionLayout`) has ``key_len = key_length(S)``
(``max(length, offset + S)``).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional, Tuple

import torch

KV = Tuple[torch.Tensor, torch.Tensor]


class KVCache:
    """Keys/values of cached positions, per transformer layer, in preallocated buffers."""

    def __init__(self, store: bool = False, capacity: Optional[int] = None):
        self.store = store
        """When True, a forward's positions become part of the cache once it has run."""
        self.capacity = capacity
        """Positions each buffer holds (None: grown on demand)."""
        self._buffers: Dict[int, KV] = {}
        self._length = 0
        self._write_at: Optional[int] = None
        self._staged: Optional[int] = None  # end of the positions the running forward wrote

    @property
    def length(self) -> int:
        """Number of cached positions (the same for every layer)."""
        return self._length

    @property
    def offset(self) -> int:
        """Where the next forward writes its keys (its first position id)."""
        return self._length if self._write_at is None else self._write_at

    def key_length(self, seq_len: int) -> int:
        """Keys a forward of ``seq_len`` tokens attends to."""
        return max(self._length, self.offset + seq_len)

    def reset(self) -> None:
        """Drop every position (start a new batch); the buffers are kept for reuse."""
        self._length = 0
        self._staged = None

    @contextlib.contextmanager
    def storing(self) -> Iterator["KVCache"]:
        """Within the block, forwards add their positions to the cache."""
        previous, self.store = self.store, True
        try:
            yield self
        finally:
            self.store = previous

    @contextlib.contextmanager
    def writing_at(self, position: int) -> Iterator["KVCache"]:
        """Within the block, forwards overwrite positions ``position, position + 1, ...``
        (at most up to :attr:`length` + their length) instead of appending."""
        if not 0 <= position <= self._length:
            raise ValueError(f"cannot write at position {position} of a cache of length {self._length}")
        previous, self._write_at = self._write_at, position
        try:
            yield self
        finally:
            self._write_at = previous

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` cached positions."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of length {self._length} to {length}")
        self._length = length

    def repeat_interleave(self, repeats) -> None:
        """Repeat every cached row ``repeats`` times along the batch, in place (an int, or
        one count per row as a tensor): a prompt's prefix shared by its G completions."""
        if self._staged is not None:
            raise RuntimeError("cannot repeat a KV cache during a forward; commit or discard it first")
        self._buffers = {
            n: (k.repeat_interleave(repeats, 0), v.repeat_interleave(repeats, 0)) for n, (k, v) in self._buffers.items()
        }

    # -- used by the core attention and the model ----------------------------------
    def get(self, layer_number: int) -> Optional[KV]:
        """Cached ``(key, value)`` of one layer, ``[B, groups, length, head_dim]`` views, or None."""
        buffers = self._buffers.get(layer_number)
        if buffers is None or not self._length:
            return None
        return buffers[0][:, :, : self._length], buffers[1][:, :, : self._length]

    def update(self, layer_number: int, key: torch.Tensor, value: torch.Tensor) -> KV:
        """Write one forward's ``key``/``value`` (``[B, groups, S, head_dim]``, any strides) at
        :attr:`offset` and return views of the keys/values it attends to (``key_length(S)``)."""
        seq = key.shape[2]
        start, end = self.offset, self.offset + seq
        if self._length and layer_number not in self._buffers:
            raise RuntimeError(
                f"KV cache has {self._length} positions but none for layer "
                f"{layer_number}; was it filled by another model?"
            )
        keys, values = self._buffer(layer_number, key, end)
        keys[:, :, start:end].copy_(key)
        values[:, :, start:end].copy_(value)
        self._staged = end if self._staged is None else max(self._staged, end)
        stop = max(self._length, end)
        return keys[:, :, :stop], values[:, :, :stop]

    def _buffer(self, layer_number: int, key: torch.Tensor, needed: int) -> KV:
        buffers = self._buffers.get(layer_number)
        if buffers is not None and buffers[0].shape[:2] != key.shape[:2]:
            if self._length:
                raise ValueError(
                    f"KV cache batch/heads {tuple(buffers[0].shape[:2])} do not match "
                    f"the current keys {tuple(key.shape[:2])}"
                )
            buffers = None  # an empty cache takes a new batch shape
        if buffers is not None and buffers[0].shape[3] != key.shape[3]:
            raise ValueError(f"KV cache head dim {buffers[0].shape[3]} does not match {key.shape[3]}")
        size = 0 if buffers is None else buffers[0].shape[2]
        if needed > size:
            grown = max(needed, self.capacity or 0, 2 * size)
            shape = (*key.shape[:2], grown, key.shape[3])
            new = tuple(torch.empty(shape, dtype=key.dtype, device=key.device) for _ in range(2))
            if buffers is not None and self._length:
                for old, fresh in zip(buffers, new):
                    fresh[:, :, : self._length].copy_(old[:, :, : self._length])
            buffers = self._buffers[layer_number] = new
        return buffers

    def commit(self) -> None:
        """End of a forward (called by the model after its layers ran): when storing, the
        positions it wrote become part of the cache."""
        if self._staged is not None and self.store:
            self._length = max(self._length, self._staged)
        self._staged = None

    def discard_pending(self) -> None:
        """The forward failed: nothing it wrote is kept as cached."""
        self._staged = None
