"""Per-layer key/value cache for SDAR block decoding.

SDAR decodes block by block: the cache holds only *finished* (clean) blocks;
the current block is denoised with repeated forwards that attend to
``[cached keys | current keys]`` without storing anything, and once the block
is final it is run once more with storing switched on so its keys/values are
appended (upstream SDAR's ``block_diffusion_generate``, JetAstra/SDAR).

Usage::

    cache = KVCache()
    with cache.storing():
        model(prompt_ids, attention_mask=AttentionLayout.block_causal(bs), kv_cache=cache)
    logits = model(block_ids, attention_mask=None, kv_cache=cache)   # sees cache + block
    with cache.storing():
        model(final_block_ids, attention_mask=None, kv_cache=cache)  # append the block

Keys are cached *after* RoPE and q/k-norm (exactly what the core attention
receives), ``[S, B, groups, head_dim]`` per layer, keyed by Megatron's global
``layer_number``. Under tensor parallelism every rank caches its own head
partition; under pipeline parallelism each stage's model keeps its own layers
(use one cache object per stage, or share one: keys never collide). With a
cache, position ids default to ``cache.length + arange(S)``, and a mask (bool
tensor or :class:`AttentionLayout`) has ``key_len = cache.length + S``.

Appends are concatenations (O(L) copy per stored block), which is negligible
next to the forward for block sizes >= 4.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional, Tuple

import torch

KV = Tuple[torch.Tensor, torch.Tensor]


class KVCache:
    """Keys/values of finished tokens, per transformer layer."""

    def __init__(self, store: bool = False):
        self.store = store
        """When True, a forward appends its keys/values after attending."""
        self._layers: Dict[int, KV] = {}
        self._pending: Dict[int, KV] = {}
        self._length = 0

    @property
    def length(self) -> int:
        """Number of cached positions (the same for every layer)."""
        return self._length

    def reset(self) -> None:
        """Drop everything (start a new batch)."""
        self._layers.clear()
        self._pending.clear()
        self._length = 0

    @contextlib.contextmanager
    def storing(self) -> Iterator["KVCache"]:
        """Within the block, forwards append their keys/values."""
        previous, self.store = self.store, True
        try:
            yield self
        finally:
            self.store = previous

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` cached positions."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of length {self._length} to {length}")
        self._layers = {n: (k[:length], v[:length]) for n, (k, v) in self._layers.items()}
        self._length = length

    def repeat_interleave(self, repeats) -> None:
        """Repeat every cached row ``repeats`` times along the batch, in place (an int, or
        one count per row as a tensor): a prompt's prefix shared by its G completions."""
        if self._pending:
            raise RuntimeError("cannot repeat a KV cache with staged keys; commit or discard them first")
        self._layers = {n: (k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1))
                        for n, (k, v) in self._layers.items()}

    # -- used by the core attention and the model ----------------------------------
    def get(self, layer_number: int) -> Optional[KV]:
        """Cached ``(key, value)`` of one layer, or None if empty."""
        return self._layers.get(layer_number)

    def extend(self, layer_number: int, key: torch.Tensor, value: torch.Tensor) -> KV:
        """``[cached | current]`` keys and values; stage the current ones if storing."""
        cached = self._layers.get(layer_number)
        if self._length and cached is None:
            raise RuntimeError(f"KV cache has {self._length} positions but none for layer "
                               f"{layer_number}; was it filled by another model?")
        if self.store:
            self._pending[layer_number] = (key.detach(), value.detach())
        if cached is None:
            return key, value
        if cached[0].shape[1:] != key.shape[1:]:
            raise ValueError(f"KV cache batch/heads {tuple(cached[0].shape[1:])} do not match "
                             f"the current keys {tuple(key.shape[1:])}")
        return torch.cat([cached[0], key], 0), torch.cat([cached[1], value], 0)

    def commit(self) -> None:
        """Append what the last forward staged (called by the model after its layers ran)."""
        if not self._pending:
            return
        lengths = {k.shape[0] for k, _ in self._pending.values()}
        if len(lengths) != 1:
            raise RuntimeError(f"layers staged different lengths {sorted(lengths)}")
        for number, (key, value) in self._pending.items():
            cached = self._layers.get(number)
            self._layers[number] = (key, value) if cached is None else (
                torch.cat([cached[0], key], 0), torch.cat([cached[1], value], 0))
        self._length += lengths.pop()
        self._pending.clear()

    def discard_pending(self) -> None:
        """Forget staged keys (the forward failed)."""
        self._pending.clear()
