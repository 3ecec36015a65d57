"""SDAR block decoding with a KV cache of finished blocks (upstream ``block_diffusion_generate``).

The output is the prompt followed by masks up to ``ceil((P + gen_length) / bs) * bs``
tokens (whole blocks, as upstream). The whole prompt blocks are prefilled into
the cache with the block-causal layout (an
:class:`~stabledrl_mcore.models.masks.AttentionLayout` carrying the prompts'
left-pad counts, so no dense mask is passed; the same layout serves every
forward, as queries are always the last keys); then for each remaining block
(the first may hold the prompt's tail): up to ``steps`` denoising steps, each a forward of
the block against ``[cache | block]``; tokens are proposed by
temperature / top-k / top-p sampling (greedy at temperature 0) with confidence
= their probability, and the step commits the scheduled top-k (the block
length split evenly over the steps, remainder first) or, with ``threshold``,
every masked position above it when that is at least k (upstream's
``low_confidence_dynamic``). Upstream then runs the finished block once more to
append its keys/values; here that forward is the next block's first step: the
finished block and the next (all masks) go through one block-causal forward of
``2 x block`` tokens inside ``cache.storing()``, the logits are read for the new
block only and the cache is cut back to the finished block (one forward less per
block: 20% of the forwards at 4 steps per block, the SDAR recipe's setting).

``use_cache=False`` is the reference: every step re-runs the prefix
``x[:, :end_of_block]`` with the block-causal mask; greedy decoding gives the
same tokens with and without the cache.

Prefix sharing (``repeats``): an RL group decodes G completions of one prompt.
With ``repeats=G`` the prompt rows are given once; their whole prompt blocks are
prefilled once per prompt and the cache rows are repeated G times
(``cache.repeat_interleave``), then every block, including the first one holding
the prompt's tail, is decoded for all ``B x G`` rows, prompt-major. Only the
prefill is shared, so the result equals decoding the repeated prompts: the same
tokens greedily, and the same draws from ``generator`` when sampling (the prefill
draws nothing; every decoding step draws for all ``B x G`` rows as before).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from stabledrl_mcore.diffusion.likelihood import dllm_config
from stabledrl_mcore.diffusion.sampling_common import (
    check_prompt,
    chunk_bounds,
    commit_transfer,
    fill_after_eos,
    masked_first,
    progress_bar,
    put_in_place,
    read_count,
    repeat_counts,
    repeat_rows,
    sample_tokens,
    select_transfer,
    transfer_schedule,
)
from stabledrl_mcore.models.decoding import decoding_forward
from stabledrl_mcore.models.kv_cache import KVCache
from stabledrl_mcore.models.masks import AttentionLayout, block_causal_mask, left_pad_counts, padding_mask
from stabledrl_mcore.models.positions import valid_positions

StepHook = Callable[[int, Tensor, Tensor], None]

READ_BUCKETS = 4
"""Read counts a compiled step takes (:func:`~.sampling_common.read_count`): a step reads the
logits of the block's masked positions only, rounded up to a multiple of a quarter of the block
when compiled (one graph per count; at SDAR's block of 4, every count)."""


@torch.no_grad()
def generate_sdar(
    model,
    prompt_ids: Tensor,
    *,
    gen_length: int,
    steps: int,
    block_length: Optional[int] = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    threshold: Optional[float] = None,
    use_cache: bool = True,
    generator: Optional[torch.Generator] = None,
    mask_id: Optional[int] = None,
    eos_id: Optional[int] = None,
    stop_at_eos: bool = False,
    prompt_valid: Optional[Tensor] = None,
    progress: Optional[bool] = None,
    on_step: Optional[StepHook] = None,
    repeats: Union[int, Sequence[int], None] = None,
    row_chunks: Optional[Sequence[Tuple[int, Optional[torch.Generator]]]] = None,
    compile: str = "none",
) -> Tensor:
    """Block-decode after ``prompt_ids`` ``[B, P]``; returns ``[B, ceil((P + gen_length)/bs) * bs]``.

    ``steps`` is the number of denoising steps *per block* (upstream
    ``denoising_steps``); ``block_length`` defaults to ``model.dllm_config.block_size``.
    ``stop_at_eos``: after each block, if every row has an EOS in its generated
    part, decoding stops; in every row, positions after its first EOS become EOS.
    ``repeats``: decode prompt row ``b`` ``repeats[b]`` times (or an int for every row),
    sharing its prefill; the result has ``sum(repeats)`` rows, prompt-major, equal to
    decoding ``prompt_ids.repeat_interleave(repeats, 0)``.
    ``row_chunks``: ``[(rows, generator), ...]`` splitting the result's rows into consecutive
    chunks, each decoded as if it ran alone with its own generator (it draws, and its
    block's steps go on, only while one of its rows has a masked position in the block;
    with ``stop_at_eos`` it stops once each of its rows has an EOS); ``generator`` is then None.
    ``compile``: how the cached forwards run (:data:`~stabledrl_mcore.models.decoding.COMPILE_MODES`;
    the block step and the store-by-next-block step are one graph each for every block, see
    :mod:`stabledrl_mcore.models.decoding`); the reference ``use_cache=False`` runs eagerly only.
    """
    check_prompt(prompt_ids, prompt_valid)
    cfg = dllm_config(model)
    bs = int(cfg.block_size) if block_length is None else int(block_length)
    mask_id = int(cfg.mask_token_id) if mask_id is None else int(mask_id)
    eos_id = int(cfg.eos_token_id) if eos_id is None else int(eos_id)
    counts = repeat_counts(repeats, prompt_ids.shape[0])
    forward = decoding_forward(model, compile)
    if forward.compiled and not use_cache:
        raise ValueError(
            f"compile={forward.mode!r} captures the cached forwards; use_cache=False is the eager reference"
        )
    B, P = prompt_ids.shape
    device = prompt_ids.device
    num_blocks = -(-(P + gen_length) // bs)
    total = num_blocks * bs
    x = torch.full((B, total), mask_id, dtype=torch.long, device=device)
    x[:, :P] = prompt_ids
    pos = torch.arange(total, device=device)
    prefill = P // bs
    share = counts is not None and use_cache and prefill > 0
    if counts is not None and not share:  # nothing to share: decode the repeated prompts
        x, prompt_valid = repeat_rows(x, counts), repeat_rows(prompt_valid, counts)
        B = x.shape[0]
    pads = None if prompt_valid is None else left_pad_counts(prompt_valid)  # one device->host copy
    padded = _padded_positions(prompt_valid, pads, total)
    rows = sum(counts) if share else B
    cache = forward.cache(rows, total) if use_cache else None
    if use_cache and prefill > 0:
        # the prompt's whole blocks, eagerly (flex attention on GPU for long prompts); with
        # prefix sharing, once per prompt into a cache of the prompt rows, then copied per row
        target = KVCache(capacity=total) if share else cache
        with target.storing():
            model(
                x[:, : prefill * bs],
                position_ids=(pos[None] if padded is None else padded)[:, : prefill * bs],
                attention_mask=_mask_fn(prompt_valid, pads, total, bs, device)(0, prefill * bs),
                kv_cache=target,
                logit_positions=slice(0, 0),
            )  # fills the cache: no head
        if share:  # the prompt's cache rows serve each of its completions
            cache.copy_rows_from(target, repeat_rows(torch.arange(B, device=device), counts))
    if share:
        x, prompt_valid = repeat_rows(x, counts), repeat_rows(prompt_valid, counts)
        B = x.shape[0]
        if pads is not None:
            pads = tuple(p for p, c in zip(pads, counts) for _ in range(c))
        padded = None if padded is None else repeat_rows(padded, counts)
    step_mask = _step_mask(prompt_valid, pads, total, bs, device)
    every = torch.arange(bs, device=device).expand(B, bs)  # the read of a whole block
    slots: dict = {}

    def cached(start: int, end: int, read: Tensor):
        """A slot-addressed forward of positions ``[start, end)`` against the cache, the logits at
        ``read`` ``[B, n]`` (counted from ``start``)."""
        if (start, end) not in slots:
            slots[start, end] = pos[start:end].clone()
        extra = {} if padded is None else {"position_ids": padded[:, start:end]}  # else: the slots
        return forward(
            x[:, start:end], kv_cache=cache, cache_slots=slots[start, end], logit_positions=read, **step_mask, **extra
        )

    # a step reads the logits of the block's masked positions only; compiled, a graph per count
    read_buckets = READ_BUCKETS if forward.compiled else 0
    plan = transfer_schedule(bs, steps)  # tokens per step, on the host
    schedule = torch.tensor(plan, device=device)
    chunks = chunk_bounds(row_chunks, generator, B)
    done = [False] * len(chunks)  # with stop_at_eos: every row of the chunk has an EOS

    bar = progress_bar((num_blocks - prefill) * steps, progress, "sdar")
    step, unstored = 0, None  # unstored: start of a finished block whose keys are not cached yet
    for blk in range(prefill, num_blocks):
        s, e = blk * bs, (blk + 1) * bs
        # Masked positions of every row: known on the host without a threshold (each step commits
        # min(k, masked) in every row); with one, an upper bound and the rows are read once a step.
        remaining = e - max(s, P)
        row_masked, has_eos = None, None  # the last device read (None: every row still masked)
        for i in range(steps):
            if remaining <= 0:
                break
            active = [c for c, d in zip(chunks, done) if not d and (row_masked is None or any(row_masked[c[0] : c[1]]))]
            if not active:
                break
            cur = x[:, s:e]
            masked = cur == mask_id
            read = masked_first(masked, read_count(remaining, bs, read_buckets))
            if use_cache and unstored is not None:  # store the finished block, denoise this one
                logits = cached(unstored, e, read + (s - unstored))
                unstored = None  # this block's keys are scratch until it is final
            elif use_cache:
                logits = cached(s, e, read)
            else:
                mask = _mask_fn(prompt_valid, pads, total, bs, device)
                logits = model(
                    x[:, :e],
                    position_ids=(pos[None] if padded is None else padded)[:, :e],
                    attention_mask=mask(0, e),
                    logit_positions=read + s,
                )
            # proposals at the read positions (the draws made for the whole block), put in place
            x0, p = torch.zeros_like(read), torch.full(read.shape, -torch.inf, device=device)
            for a, b, gen in active:
                x0[a:b], p[a:b] = sample_tokens(logits[a:b], temperature, top_k, top_p, gen, rows=(read[a:b], bs))
            x0, conf = put_in_place(cur, masked, read, x0, p)
            transfer = torch.zeros_like(masked)
            for a, b, _ in active:
                transfer[a:b] = select_transfer(conf[a:b], schedule[i].expand(b - a), threshold, kmax=plan[i])
            step = commit_transfer(x, s, e, x0, transfer, step, bar, on_step)
            remaining -= plan[i]
            # At most one device->host read per step: which rows still hold masks (threshold) and,
            # at the block's end, which rows have an EOS (stop_at_eos), read together.
            last = remaining <= 0 or i == steps - 1
            parts = []
            if threshold is not None and not last:
                parts.append((x[:, s:e] == mask_id).any(-1))
            if stop_at_eos and (last or threshold is not None):
                parts.append((x[:, P:e] == eos_id).any(-1))
            if parts:
                flags = torch.cat(parts).tolist()
                if threshold is not None and not last:
                    row_masked = flags[:B]
                if stop_at_eos and (last or threshold is not None):
                    has_eos = flags[-B:]
        if stop_at_eos:
            if has_eos is None:  # no step ran in this block
                has_eos = (x[:, P:e] == eos_id).any(-1).tolist()
            done = [all(has_eos[a:b]) for a, b, _ in chunks]
        finished = all(done)
        if use_cache and unstored is not None:  # no step ran: store the previous block alone
            cached(unstored, s, every)  # a block step's graph (its logits are not read)
            unstored = None
        if use_cache and blk < num_blocks - 1 and not finished:
            unstored = s  # stored by the next block's first forward
        if finished:
            break
    bar.close()
    if stop_at_eos:
        x = fill_after_eos(x, P, eos_id)
    return x


def _padded_positions(prompt_valid: Optional[Tensor], pads, total: int) -> Optional[Tensor]:
    """``[B, total]`` position ids that do not count the prompts' padding
    (:func:`~stabledrl_mcore.models.positions.valid_positions`), or None where nothing is padded
    (positions ``0..total-1``, the cache slots). A row left-padded by a multiple of the block then
    decodes as it would alone; other pad counts also move the block grid over the row's tokens
    (the blocks are columns of the batch, as upstream's batched decoding has them)."""
    if prompt_valid is None or (pads is not None and not any(pads)):
        return None
    return valid_positions(_row_validity(prompt_valid, total))


def _row_validity(prompt_valid: Tensor, total: int) -> Tensor:
    """``[B, total]`` bool: the prompt's own validity, then every generated slot valid."""
    valid = torch.ones(prompt_valid.shape[0], total, dtype=torch.bool, device=prompt_valid.device)
    valid[:, : prompt_valid.shape[1]] = prompt_valid.bool()
    return valid


def _step_mask(prompt_valid: Optional[Tensor], pads, total: int, bs: int, device) -> dict:
    """The mask arguments of a cached step over the ``total`` cache slots: the block-causal layout
    and the pad counts as a tensor (the mask is built inside the step from the slots); a prompt mask
    that is not a left pad adds its keys' validity as ``attention_mask``."""
    layout = AttentionLayout.block_causal(bs)
    if prompt_valid is None or pads is not None:
        return {"layout": layout, "pads": torch.tensor(pads, device=device) if any(pads or ()) else None}
    return {"layout": layout, "pads": None, "attention_mask": padding_mask(_row_validity(prompt_valid, total))}


def _mask_fn(prompt_valid: Optional[Tensor], pads, total: int, bs: int, device):
    """``mask(offset, length)``: the attention of queries ``offset..offset+length-1`` over keys
    ``0..offset+length-1``. A left-padded prompt (the usual case, ``pads`` = its
    :func:`left_pad_counts`) travels as the layout's pad counts; any other key mask falls back
    to a dense mask."""
    if prompt_valid is None:
        pads = ()
    layout = AttentionLayout.block_causal(bs, pad=pads) if pads is not None else None
    valid = _row_validity(prompt_valid, total) if layout is None else None

    def mask(offset: int, length: int):
        if layout is not None:  # queries are the last `length` keys: what the layout assumes
            return layout
        m = block_causal_mask(length, bs, offset=offset, key_len=offset + length, device=device)
        return m | padding_mask(valid[:, : offset + length])

    return mask
