"""Rollouts decoded a group at a time: a prompt's G completions share one decoding batch.

Rows (prompt-major groups of G) are decoded in batches of whole micro-batches
that end on a group boundary (:func:`decode_rows`: ``lcm(micro_batch, G)`` rows),
so a prompt's completions are decoded together whatever the micro-batch and each
forward's GEMMs see more rows. SDAR prefills a prompt's whole prompt blocks once
and repeats the cache rows (``generate_sdar(repeats=...)``); LLaDA's bidirectional
attention leaves no prefix to share, so its prompt rows are repeated
(``generate_llada(repeats=...)``). Inside a batch, micro-batch ``k`` still draws
from ``chunk_generator(first_chunk + k)`` exactly as when decoded alone
(``row_chunks``: a chunk draws, and its block's steps go on, only while one of its
rows has a masked position), so the rollout equals micro-batch by micro-batch
decoding of the repeated prompts.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch

from stabledrl_mcore.diffusion import generate
from stabledrl_mcore.models.decoding import decode_row_bytes, decode_rows_for_memory, free_decoding_memory
from stabledrl_mcore.models.placement import model_device

MAX_DECODE_FACTOR = 4
"""A decoding batch holds at most this many times ``max(micro_batch, G)`` rows (else one micro-batch)."""


def decode_rows(micro_batch: int, group_size: int) -> int:
    """Rows decoded together: the smallest run of whole micro-batches ending on a group boundary
    (``lcm(micro_batch, G)``), or one micro-batch when that would exceed
    ``MAX_DECODE_FACTOR x max(micro_batch, G)`` rows (odd sizes such as 7 and 16)."""
    rows = math.lcm(micro_batch, group_size)
    return rows if rows <= MAX_DECODE_FACTOR * max(micro_batch, group_size) else micro_batch


def memory_decode_rows(
    model, *, micro_batch: int, group_size: int, rows: int, capacity: int, block: int, query: int, cached: bool
) -> int:
    """Rows per decoding batch when ``rollout.decode_rows`` is unset: as many whole groups and
    micro-batches as the memory left for decoding holds (:func:`~..models.decoding.decode_row_bytes`
    of a ``capacity``-position sequence, a ``query``-token largest forward, a KV cache if ``cached``
    and a ``block``-token step), at most this rank's ``rows``; one micro-batch when not even
    ``lcm(micro_batch, group_size)`` rows fit."""
    vocab = int(getattr(model.dllm_config, "vocab_size", 0) or 0)
    unit = math.lcm(micro_batch, group_size)
    free = free_decoding_memory(model_device(model))
    per_row = decode_row_bytes(model, capacity, block, vocab, query=query, cached=cached)
    if free < unit * per_row:
        return micro_batch
    return decode_rows_for_memory(free, per_row, unit, rows)


def prompt_counts(start: int, stop: int, group_size: int):
    """Rows ``start..stop-1`` of a prompt-major ``[prompts x G]`` batch as (prompt slice, rows per prompt)."""
    first, last = start // group_size, (stop - 1) // group_size
    counts = [min(stop, (p + 1) * group_size) - max(start, p * group_size) for p in range(first, last + 1)]
    return slice(first, last + 1), counts


def group_rollouts(
    model,
    prompt_ids: torch.Tensor,
    prompt_valid: torch.Tensor,
    *,
    group_size: int,
    gen_length: int,
    steps: int,
    block_length: int,
    temperature: float,
    threshold: Optional[float],
    micro_batch: int,
    chunk_generator: Callable[[int], torch.Generator],
    first_chunk: int = 0,
    progress: bool = False,
    rows: Optional[int] = None,
    **sampler_options,
) -> List[torch.Tensor]:
    """``group_size`` completions of each prompt row (``[B, P]``, each prompt once): the decoded
    batches, rows prompt-major (what ``generate_rollouts`` concatenates). ``sampler_options`` go
    to :func:`~..diffusion.generate` (LLaDA's ``cache`` and ``stats``, ``compile``). ``rows``: rows per
    decoding batch, a multiple of ``lcm(micro_batch, group_size)`` (``rollout.decode_rows``); None =
    :func:`decode_rows`."""
    total = prompt_ids.shape[0] * group_size
    rows = decode_rows(micro_batch, group_size) if rows is None else rows
    if rows % math.lcm(micro_batch, group_size) and rows != micro_batch:
        raise ValueError(
            f"decoding batches of {rows} rows split groups of {group_size} or micro-batches of {micro_batch}"
        )
    outputs = []
    for start in range(0, total, rows):
        stop = min(start + rows, total)
        prompts, counts = prompt_counts(start, stop, group_size)
        chunks = [
            (min(micro_batch, stop - a), chunk_generator(first_chunk + a // micro_batch))
            for a in range(start, stop, micro_batch)
        ]
        outputs.append(
            generate(
                model,
                prompt_ids[prompts],
                gen_length=gen_length,
                steps=steps,
                block_length=block_length,
                temperature=temperature,
                threshold=threshold,
                prompt_valid=prompt_valid[prompts],
                progress=progress,
                repeats=counts,
                row_chunks=chunks,
                **sampler_options,
            )
        )
    return outputs
