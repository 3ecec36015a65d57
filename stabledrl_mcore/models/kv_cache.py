"""Per-layer key/value cache for KV-cached diffusion decoding, written in place.

Storage: one buffer per layer and per key/value, heads-major ``[B, groups, capacity,
head_dim]`` (the layout SDPA reads), keyed by Megatron's global ``layer_number``. Keys are
cached *after* RoPE and q/k-norm (exactly what the core attention receives). Under tensor
parallelism every rank caches its own head groups; under pipeline parallelism each stage
its own layers. A forward writes its keys in one of two ways:

**Slot-addressed** (a *decoding step*, what the samplers run; ``cache_slots`` given to the
model forward): the forward's ``S`` keys go to the slots named by a LongTensor (``index_copy_``)
and its queries attend over **every** slot of the buffers, through a mask the caller builds
over ``capacity`` keys (:func:`~stabledrl_mcore.models.masks.block_causal_over_slots`, or a
padding mask). Nothing about the step is a Python number: the slots are a tensor and the
attended view is the whole fixed-size buffer, so a step at block 1 and at block 64 is the
same computation with other tensor values -- one compiled graph, and a CUDA graph can replay
it (the buffers are fixed addresses, see :meth:`KVCache.allocate`). The buffers start as
zeros, so a masked slot never holds a NaN that the attention's weighted sum would carry.
Inside :meth:`KVCache.writing_from` only the slots at or after a start given as a tensor are
written: one window of slots serves a write span that changes per block.

**Appended** (no slots; a prefill, the first step of a cached LLaDA block, or a caller
stepping by hand): the forward's keys go to positions ``offset .. offset+S-1`` (``offset`` =
:attr:`length`, or the ``writing_at`` position) and the queries attend over a *view* of the
first :meth:`key_length` positions (no concatenation, no copy of the cached keys); inside
``storing()`` they become part of :attr:`length` once the forward has run::

    cache = KVCache(capacity=P + gen_length)
    with cache.storing():
        model(prompt_ids, attention_mask=AttentionLayout.block_causal(bs), kv_cache=cache)
    logits = model(block_ids, attention_mask=None, kv_cache=cache)   # sees cache + block
    with cache.storing():
        model(final_block_ids, attention_mask=None, kv_cache=cache)  # append the block

Position ids default to ``offset + arange(S)`` (appended) or the slots (slot-addressed). An
appended forward's mask (bool tensor or :class:`AttentionLayout`) has ``key_len =
key_length(S)``; a slot-addressed forward's mask has ``capacity`` keys.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch

KV = Tuple[torch.Tensor, torch.Tensor]


class KVCache:
    """Keys/values of cached positions, per transformer layer, in preallocated buffers."""

    def __init__(self, store: bool = False, capacity: Optional[int] = None):
        self.store = store
        """When True, an appended forward's positions become part of the cache once it has run."""
        self.capacity = capacity
        """Positions each buffer holds (None: grown on demand by appended forwards)."""
        self.slots: Optional[torch.Tensor] = None
        """The slots the running forward writes (set by the model for a slot-addressed forward)."""
        self.write_from: Optional[torch.Tensor] = None
        """A 0-d LongTensor (see :meth:`writing_from`): a slot-addressed forward writes only the
        slots at or after it; None: every slot it forwards."""
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
        """Where the next appended forward writes its keys (its first position id)."""
        return self._length if self._write_at is None else self._write_at

    def key_length(self, seq_len: int) -> int:
        """Keys an appended forward of ``seq_len`` tokens attends to."""
        return max(self._length, self.offset + seq_len)

    def reset(self) -> None:
        """Drop every position (start a new batch); the buffers are kept for reuse."""
        self._length = 0
        self._staged = None

    def allocate(
        self, layers: Dict[int, Tuple[int, int]], batch: int, dtype, device, keep: bool = False
    ) -> List[torch.Tensor]:
        """Zeroed buffers of ``capacity`` positions for ``layers`` (``{layer_number: (groups,
        head_dim)}``) and ``batch`` rows, and the cache emptied (``keep``: its length kept);
        returns every buffer.

        Buffers of the same shape are zeroed in place, never reallocated, so their addresses
        stay fixed from one generation to the next (what a captured graph replays against).
        """
        if self.capacity is None:
            raise ValueError("KVCache.allocate needs a capacity")
        for number, (groups, head_dim) in layers.items():
            shape = (batch, groups, self.capacity, head_dim)
            held = self._buffers.get(number)
            if held is None or held[0].shape != shape or held[0].dtype != dtype or held[0].device != device:
                self._buffers[number] = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
            else:
                for buffer in held:
                    buffer.zero_()
        if not keep:
            self.reset()
        return [t for number in sorted(layers) for t in self._buffers[number]]

    @contextlib.contextmanager
    def storing(self) -> Iterator["KVCache"]:
        """Within the block, appended forwards add their positions to the cache."""
        previous, self.store = self.store, True
        try:
            yield self
        finally:
            self.store = previous

    @contextlib.contextmanager
    def writing_at(self, position: int) -> Iterator["KVCache"]:
        """Within the block, appended forwards overwrite positions ``position, position + 1, ...``
        (at most up to :attr:`length` + their length) instead of appending."""
        if not 0 <= position <= self._length:
            raise ValueError(f"cannot write at position {position} of a cache of length {self._length}")
        previous, self._write_at = self._write_at, position
        try:
            yield self
        finally:
            self._write_at = previous

    @contextlib.contextmanager
    def writing_from(self, start: torch.Tensor) -> Iterator["KVCache"]:
        """Within the block, slot-addressed forwards write their keys/values only to the slots
        ``>= start`` (a 0-d LongTensor, so a captured step takes it as an input, not a constant):
        the other positions they forward attend to the stored keys and leave them as they are.
        A fixed window of slots then serves any write start (LLaDA's compiled prefix step)."""
        previous, self.write_from = self.write_from, start
        try:
            yield self
        finally:
            self.write_from = previous

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` cached positions."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of length {self._length} to {length}")
        self._length = length

    def repeat_interleave(self, repeats) -> None:
        """Repeat every cached row ``repeats`` times along the batch, in place (an int, or
        one count per row as a tensor): a prompt's prefix shared by its G completions.
        The buffers are replaced (new addresses): see :meth:`copy_rows_from` for fixed ones."""
        if self._staged is not None:
            raise RuntimeError("cannot repeat a KV cache during a forward; commit or discard it first")
        self._buffers = {
            n: (k.repeat_interleave(repeats, 0), v.repeat_interleave(repeats, 0)) for n, (k, v) in self._buffers.items()
        }

    def copy_rows_from(self, source: "KVCache", rows: torch.Tensor) -> None:
        """Fill these buffers with ``source``'s rows ``rows`` (row ``i`` of this cache gets
        ``source``'s row ``rows[i]``), every position, in place (a layer not allocated yet is
        allocated like the source's); the length becomes ``source.length``. A prompt's
        prefilled prefix shared by its completions."""
        for number, (src_key, src_value) in source._buffers.items():
            if number not in self._buffers:
                shape = (src_key.shape[1], src_key.shape[3])
                self.allocate({number: shape}, rows.shape[0], src_key.dtype, src_key.device, keep=True)
            key, value = self._buffers[number]
            if key.shape[2] != src_key.shape[2]:
                raise ValueError(f"KV cache capacities differ: {key.shape[2]} here, {src_key.shape[2]} in the source")
            key.copy_(src_key.index_select(0, rows))
            value.copy_(src_value.index_select(0, rows))
        self._length = source.length

    # -- used by the core attention and the model ----------------------------------
    def get(self, layer_number: int) -> Optional[KV]:
        """Cached ``(key, value)`` of one layer, ``[B, groups, length, head_dim]`` views, or None."""
        buffers = self._buffers.get(layer_number)
        if buffers is None or not self._length:
            return None
        return buffers[0][:, :, : self._length], buffers[1][:, :, : self._length]

    def update(self, layer_number: int, key: torch.Tensor, value: torch.Tensor) -> KV:
        """Write one forward's ``key``/``value`` (``[B, groups, S, head_dim]``, any strides) and
        return the keys/values its queries attend to: every slot (slot-addressed forward) or
        views of the first ``key_length(S)`` positions (appended forward)."""
        if self.slots is not None:
            if layer_number not in self._buffers:  # allocated by the first write (eager callers)
                self.allocate({layer_number: key.shape[1::2]}, key.shape[0], key.dtype, key.device, keep=True)
            keys, values = self._buffers[layer_number]
            key, value = key.to(keys.dtype), value.to(values.dtype)
            if self.write_from is not None:  # the slots before it keep their stored keys/values
                keep = (self.slots < self.write_from)[:, None]
                key = torch.where(keep, keys.index_select(2, self.slots), key)
                value = torch.where(keep, values.index_select(2, self.slots), value)
            keys.index_copy_(2, self.slots, key)
            values.index_copy_(2, self.slots, value)
            return keys, values
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
            new = tuple(torch.zeros(shape, dtype=key.dtype, device=key.device) for _ in range(2))
            if buffers is not None and self._length:
                for old, fresh in zip(buffers, new):
                    fresh[:, :, : self._length].copy_(old[:, :, : self._length])
            buffers = self._buffers[layer_number] = new
        return buffers

    def commit(self) -> None:
        """End of a forward (called by the model after its layers ran): when storing, the
        positions an appended forward wrote become part of the cache."""
        if self._staged is not None and self.store:
            self._length = max(self._length, self._staged)
        self._staged = None

    def discard_pending(self) -> None:
        """The forward failed: nothing it wrote is kept as cached."""
        self._staged = None
