"""LLaDA sampling: semi-autoregressive low-confidence remasking (upstream ``generate.py``).

The answer (``gen_length`` mask tokens after the prompt) is split into blocks of
``block_length``; each block gets ``steps / num_blocks`` steps. Every step runs
one bidirectional forward over the whole sequence, takes x0 = argmax of the
Gumbel-perturbed logits (float64 noise, temperature 0 = greedy), scores each
masked position of the current block by the softmax probability of x0
("low_confidence") or a uniform draw ("random"), and commits the top-k, k being
the block's masked count split evenly over its steps (remainder to the first
steps). Positions outside the current block are never committed (upstream gives
them -inf confidence).

Options beyond upstream, all off by default: ``threshold`` (Fast-dLLM's parallel
decoding, see :func:`threshold_transfer`), ``cache`` (Fast-dLLM's approximate
prefix / dual KV cache, see :class:`BlockLogits`), ``stop_at_eos`` (see
:func:`generate_llada`), ``prompt_valid`` (left padding).
Classifier-free guidance follows upstream: the unconditional input has the
prompt replaced by masks, logits = u + (cfg_scale + 1) (c - u).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from stabledrl_mcore.diffusion.likelihood import dllm_config
from stabledrl_mcore.diffusion.masking import uniform
from stabledrl_mcore.diffusion.sampling_common import (
    check_prompt,
    chunk_bounds,
    commit_transfer,
    fill_after_eos,
    first_eos_settled,
    gumbel_argmax,
    masked_first,
    progress_bar,
    put_in_place,
    read_count,
    repeat_counts,
    repeat_rows,
    select_transfer,
    transfer_schedule,
)
from stabledrl_mcore.models.decoding import decoding_forward
from stabledrl_mcore.models.masks import padding_mask
from stabledrl_mcore.models.positions import position_inputs

# on_step(step, transfer [B, S] bool, x [B, S] after the commit)
StepHook = Callable[[int, Tensor, Tensor], None]

CACHE_MODES = ("none", "prefix", "dual")
"""``none``: exact decoding (a full forward per step); ``prefix`` / ``dual``: see :class:`BlockLogits`."""

PREFIX_WINDOWS = 4
"""Window lengths the compiled ``prefix`` step forwards (:func:`prefix_window`): a quarter, a half,
three quarters of the generation and all of it; one graph each, whatever the number of blocks."""


READ_BUCKETS = 4
"""Read counts a compiled exact or ``dual`` step takes (:func:`~.sampling_common.read_count`): a
step reads the logits of the block's masked positions only, rounded up to a multiple of a quarter
of the block when compiled (one graph per count: a quarter, half, three quarters, all)."""


def prefix_window(gen_length: int, block_length: int, suffix: int, windows: Optional[int] = None) -> int:
    """The fixed window a compiled ``prefix`` step forwards for a block whose suffix (the block and
    the positions after it) is ``suffix`` long: the shortest of ``j / windows`` of ``gen_length``
    (``j = 1 .. windows``, rounded up to whole blocks) that covers it. A few static lengths instead
    of one per block; the positions before the block in it are computed and not used. ``windows``:
    default :data:`PREFIX_WINDOWS`."""
    windows = windows or PREFIX_WINDOWS
    lengths = {-(-gen_length * j // (windows * block_length)) * block_length for j in range(1, windows + 1)}
    return min(n for n in lengths if n >= suffix)


def threshold_transfer(confidence: Tensor, k: Tensor, threshold: float, kmax: Optional[int] = None) -> Tensor:
    """Fast-dLLM's parallel-decoding rule (``get_transfer_index`` with a threshold), ``[B, n]`` bool.

    Commits every eligible position (finite ``confidence``) whose confidence is at least
    ``threshold``, and at least the ``max(k[b], 1)`` most confident ones (``k`` = the
    step's scheduled count; with ``steps == gen_length`` it is 1: Fast-dLLM's rule
    exactly, which commits the most confident position whatever its confidence). ``kmax``: a host
    bound on ``max(k, 1)`` (see :func:`select_transfer`).
    """
    eligible = torch.isfinite(confidence)
    floor = torch.minimum(k.long().reshape(-1).clamp(min=1), eligible.sum(-1))
    top = select_transfer(confidence, floor, kmax=kmax)
    return top | (eligible & (confidence >= threshold))


@dataclass
class DecodeStats:
    """What one or more :func:`generate_llada` calls did (filled in place, summed over calls).

    ``full_forwards`` / ``block_forwards``: model calls over the whole sequence / over the
    current block (``prefix``: the block and everything after it) against the cache; a
    call covers the whole batch (and both halves of classifier-free guidance).
    With ``measure_gap`` every cached step also runs the exact forward (a diagnostic that
    costs the exact sampler's work) and ``gap_sum`` accumulates, over committed tokens,
    ``|log p_cached(token) - log p_exact(token)|`` at the state the token was committed
    from; ``gap_tokens`` counts all committed tokens (first steps of a block, computed
    exactly, add 0). :attr:`mean_gap` is their ratio.
    """

    measure_gap: bool = False
    full_forwards: int = 0
    block_forwards: int = 0
    steps: int = 0
    gap_sum: float = 0.0
    gap_tokens: int = 0

    @property
    def forwards(self) -> int:
        return self.full_forwards + self.block_forwards

    @property
    def mean_gap(self) -> float:
        return self.gap_sum / max(self.gap_tokens, 1)


class BlockLogits:
    """Logits of the current block ``[s, e)`` at each step, exactly or from a cache.

    ``none``: a full forward every step (today's sampler). With a cache, the block's first
    step is a full forward that also stores every position's keys/values (after RoPE, per
    layer; under tensor parallelism each rank its own heads); its logits are exact. The
    block's later steps forward only the changing part against the stored keys:

    - ``prefix`` (Fast-dLLM's ``generate_with_prefix_cache``): the block and the suffix
      after it, attending to the stored keys of the prefix (prompt + earlier blocks);
    - ``dual`` (``generate_with_dual_cache``): the block alone, attending to the stored
      prefix *and* suffix (the later blocks, still all masks).

    The cache is written in place (:class:`~stabledrl_mcore.models.KVCache`, one buffer of
    ``L`` positions per layer, the same for every generation of this shape): a cached step's fresh
    keys overwrite the stored keys of the slots it forwards, and each query attends over exactly
    the ``L`` slots, with no mask but the prompts' padding; the padding never counts as a position
    (:func:`~stabledrl_mcore.models.positions.position_inputs`: a padded row decodes as it would
    alone, eager or compiled, whatever the batch's width). Every forward goes through the model's
    :class:`~stabledrl_mcore.models.decoding.DecodingForward` with the block's offsets as tensors
    (the read positions, the slots), so it is a few graphs per kind whatever the block (one per
    read count, :data:`READ_BUCKETS`; each step reads the logits of its masked positions). Compiled,
    ``prefix`` forwards a window of one of :data:`PREFIX_WINDOWS` fixed lengths ending at the
    sequence's end (:func:`prefix_window`) and writes only the slots from the block on
    (:meth:`KVCache.writing_from`): the block and its suffix see the keys they see eagerly, for
    under twice the eager step's tokens while the suffix is over a quarter of the generation.
    What is approximate: the stored keys were computed
    when the block still held the masks of its first step, so within a block the prefix
    (and, for ``dual``, the suffix) does not see the tokens committed since. They are
    recomputed at the next block's first step. ``refresh_every_step`` rebuilds the cache
    at every step (two forwards a step): a reference that decodes exactly as ``none`` up
    to rounding, checking the cached path itself.
    """

    def __init__(
        self,
        model,
        mode: str,
        attn: Optional[Tensor],
        valid: Optional[Tensor],
        cfg_scale: float,
        prompt_len: int,
        mask_id: int,
        stats: Optional[DecodeStats],
        refresh_every_step: bool = False,
        compile: str = "none",
    ):
        self.model, self.mode = model, mode
        self.cfg_scale, self.prompt_len, self.mask_id = cfg_scale, prompt_len, mask_id
        self.stats, self.refresh = stats, refresh_every_step
        self.forward = decoding_forward(model, compile)
        self.attn = attn if attn is None or cfg_scale <= 0.0 else torch.cat([attn, attn])
        self.config = dllm_config(model)
        self.valid = valid if valid is None or cfg_scale <= 0.0 else torch.cat([valid, valid])
        self.separator = getattr(self.config, "segment_separator_id", None)
        # without the separator scheme the positions depend on the padding only: made once
        self.fixed_positions = None if self.separator is not None else position_inputs(self.config, None, self.valid)
        self.cache = None
        self.span = (0, 0)
        self._slots: dict = {}
        self.cached_step = False
        """Whether the last call was served from the cache (not by a full forward)."""

    def _positions(self, start: int, end: int, device) -> Tensor:
        """``arange(start, end)`` (read positions, cache slots), one tensor per span."""
        key = (start, end)
        if key not in self._slots:
            self._slots[key] = torch.arange(start, end, device=device)
        return self._slots[key]

    def _start(self, start: int, device) -> Tensor:
        """``start`` as a 0-d tensor (a write start), one per block."""
        key = ("start", start)
        if key not in self._slots:
            self._slots[key] = torch.tensor(start, device=device)
        return self._slots[key]

    def _rows(self, x: Tensor) -> Tensor:
        """``x``, and with classifier-free guidance its unconditional copy (the prompt masked)."""
        if self.cfg_scale <= 0.0:
            return x
        uncond = x.clone()
        uncond[:, : self.prompt_len] = self.mask_id
        return torch.cat([x, uncond])

    def _guided(self, logits: Tensor) -> Tensor:
        """Upstream's guidance: ``u + (cfg_scale + 1) (c - u)``."""
        if self.cfg_scale <= 0.0:
            return logits
        cond, uncond = logits.chunk(2, dim=0)
        return uncond + (self.cfg_scale + 1.0) * (cond - uncond)

    def _positions_of(self, rows: Tensor, start: int, end: int) -> dict:
        """The position (and separator scheme's segment) ids of ``rows[:, start:end]``, of the whole
        rows, pads not counted; ``{}`` where the model's default ``0..S-1`` is right."""
        inputs = self.fixed_positions
        if inputs is None:  # the separator scheme: from the tokens, as they are now
            inputs = position_inputs(self.config, rows, self.valid)
        return {name: ids[:, start:end] for name, ids in inputs.items()}

    def _read_rows(self, read: Tensor, offset: int) -> Tensor:
        """``read + offset`` (each row's read positions in the forwarded window), for both halves
        of classifier-free guidance."""
        rows = read if offset == 0 else read + offset
        return rows if self.cfg_scale <= 0.0 else torch.cat([rows, rows])

    def exact(self, x: Tensor, s: int, e: int, read: Tensor) -> Tensor:
        """A full forward without a cache (today's step): the logits at the block's positions
        ``read [B, n]`` (counted from ``s``)."""
        rows = self._rows(x)
        extra = self._positions_of(rows, 0, x.shape[1])
        return self._guided(
            self.forward(rows, attention_mask=self.attn, logit_positions=self._read_rows(read, s), **extra)
        )

    def __call__(self, x: Tensor, s: int, e: int, first: bool, read: Tensor) -> Tensor:
        """The logits ``[B, n, V]`` of block ``[s, e)`` at its positions ``read [B, n]`` (counted
        from ``s``; each row its own, :func:`~.sampling_common.masked_first`)."""
        if self.mode == "none":
            if self.stats is not None:
                self.stats.full_forwards += 1
            return self.exact(x, s, e, read)
        if first or self.refresh:
            logits = self._fill(x, s, e, read)
            if first:
                return logits
        return self._block(x, s, e, read)

    def _fill(self, x: Tensor, s: int, e: int, read: Tensor) -> Tensor:
        """Full forward storing every position's keys/values; the block's exact logits."""
        rows = self._rows(x)
        L = x.shape[1]
        if self.cache is None:
            self.cache = self.forward.cache(rows.shape[0], L)
        logits = self.forward(
            rows,
            attention_mask=self.attn,
            kv_cache=self.cache,
            logit_positions=self._read_rows(read, s),
            **self._positions_of(rows, 0, L),
        )
        self.span = (s, L if self.mode == "prefix" else e)
        self.cached_step = False
        if self.stats is not None:
            self.stats.full_forwards += 1
        return self._guided(logits)

    def _block(self, x: Tensor, s: int, e: int, read: Tensor) -> Tensor:
        start, end = self.span
        if start != s:
            raise RuntimeError(f"the cache was filled for the block at {start}, not {s}")
        rows = self._rows(x)
        writes = contextlib.nullcontext()
        if self.mode == "prefix" and self.forward.compiled:
            # A static window [L - n, L) over the suffix, of one of a few lengths whatever the block:
            # the slots before the block keep their stored keys (the queries there are computed and
            # not read), so the block and its suffix attend to what the eager step's do.
            start = end - prefix_window(end - self.prompt_len, e - s, end - s)
            writes = self.cache.writing_from(self._start(s, x.device))
        with writes:
            logits = self.forward(
                rows[:, start:end],
                attention_mask=self.attn,
                kv_cache=self.cache,
                cache_slots=self._positions(start, end, x.device),
                logit_positions=self._read_rows(read, s - start),
                **self._positions_of(rows, start, end),
            )
        self.cached_step = True
        if self.stats is not None:
            self.stats.block_forwards += 1
        return self._guided(logits)


def _propose(
    logits: Tensor, temperature: float, remasking: str, generator: Optional[torch.Generator], read: Tensor, width: int
):
    """``(x0, confidence)`` ``[B, n]`` at the positions ``read`` of a ``width``-position block
    (``logits [B, n, V]``): upstream's Gumbel-max proposal and its remasking score. The random
    draws are made for the whole block and read at ``read``, so a position's draw does not depend
    on which positions a step reads (a compiled step reads a few more)."""
    x0 = gumbel_argmax(logits, temperature, generator, rows=(read, width))
    if remasking == "low_confidence":
        return x0, torch.softmax(logits.float(), -1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    return x0, uniform((read.shape[0], width), generator, logits.device).gather(1, read)


def _log_prob_of(logits: Tensor, tokens: Tensor) -> Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def generate_llada(
    model,
    prompt_ids: Tensor,
    *,
    gen_length: int = 128,
    steps: int = 128,
    block_length: int = 128,
    temperature: float = 0.0,
    cfg_scale: float = 0.0,
    remasking: str = "low_confidence",
    threshold: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    mask_id: Optional[int] = None,
    eos_id: Optional[int] = None,
    stop_at_eos: bool = False,
    prompt_valid: Optional[Tensor] = None,
    progress: Optional[bool] = None,
    on_step: Optional[StepHook] = None,
    cache: str = "none",
    stats: Optional[DecodeStats] = None,
    refresh_every_step: bool = False,
    repeats: Union[int, Sequence[int], None] = None,
    row_chunks: Optional[Sequence[Tuple[int, Optional[torch.Generator]]]] = None,
    compile: str = "none",
) -> Tensor:
    """Decode ``gen_length`` tokens after ``prompt_ids`` ``[B, P]``; returns ``[B, P + gen_length]``.

    ``steps`` is the total number of denoising steps (must divide by the number of
    blocks, as upstream). ``threshold``: each step commits by :func:`threshold_transfer`
    and a block ends as soon as it holds no mask (so ``steps`` is the most a block
    takes, never fewer tokens per step than the schedule). ``cache``: one of
    :data:`CACHE_MODES` (:class:`BlockLogits`; approximate, the default ``none`` is
    exact). ``stats``: a :class:`DecodeStats` to fill. ``stop_at_eos``: a row is
    settled once it has committed an EOS with no mask before it; when every row is
    settled decoding stops, and in every row all positions after its first EOS are set
    to EOS (LLaDA pads its answers with EOS, so this only skips work). ``generator`` is
    required for ``temperature > 0`` or ``remasking="random"``. The model's train/eval
    mode is left as is.

    ``repeats`` / ``row_chunks``: as in :func:`~.sampling_sdar.generate_sdar`: decode prompt row
    ``b`` ``repeats[b]`` times (an RL group; bidirectional attention leaves no prefix to share, so
    the rows are repeated), and split the rows into chunks that each decode as if alone with their
    own generator (a chunk draws only while one of its rows has a masked position in the block and,
    with ``stop_at_eos``, while one is not settled), so one forward serves several micro-batches.

    ``compile``: how the model's forwards run (:data:`~stabledrl_mcore.models.decoding.COMPILE_MODES`:
    eager, or one compiled graph per kind of forward for every block, see
    :mod:`stabledrl_mcore.models.decoding`).
    """
    check_prompt(prompt_ids, prompt_valid)
    cfg = dllm_config(model)
    mask_id = int(cfg.mask_token_id) if mask_id is None else int(mask_id)
    eos_id = int(cfg.eos_token_id) if eos_id is None else int(eos_id)
    if remasking not in ("low_confidence", "random"):
        raise ValueError(f"remasking must be 'low_confidence' or 'random', got {remasking!r}")
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {', '.join(CACHE_MODES)}, got {cache!r}")
    if gen_length % block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError(f"steps ({steps}) must be a multiple of the number of blocks ({num_blocks})")
    steps_per_block = steps // num_blocks

    counts = repeat_counts(repeats, prompt_ids.shape[0])
    if counts is not None:
        prompt_ids, prompt_valid = repeat_rows(prompt_ids, counts), repeat_rows(prompt_valid, counts)
    B, P = prompt_ids.shape
    device = prompt_ids.device
    chunks = chunk_bounds(row_chunks, generator, B)
    if remasking == "random" and any(gen is None for _, _, gen in chunks):
        raise TypeError("remasking='random' needs an explicit torch.Generator")
    x = torch.full((B, P + gen_length), mask_id, dtype=torch.long, device=device)
    x[:, :P] = prompt_ids
    attn = valid = None
    if prompt_valid is not None and not bool(prompt_valid.all()):  # one device read per generation
        valid = torch.cat([prompt_valid.bool(), torch.ones(B, gen_length, dtype=torch.bool, device=device)], dim=1)
        attn = padding_mask(valid)
    block_logits = BlockLogits(model, cache, attn, valid, cfg_scale, P, mask_id, stats, refresh_every_step, compile)
    # compiled: a graph per read count; prefix's window step reads the whole block (its graphs are
    # already one per window, and its forward's cost is the suffix, not the head)
    read_buckets = 0 if not block_logits.forward.compiled else 1 if cache == "prefix" else READ_BUCKETS
    measure = stats is not None and stats.measure_gap and cache != "none"
    bar = progress_bar(steps, progress, "llada")
    # Every block starts with all its positions masked (only the current block is ever committed),
    # so its schedule is known on the host: the k of each step needs no device read.
    schedule = transfer_schedule(block_length, steps_per_block)
    step, settled = 0, [False] * len(chunks)  # settled: every row of the chunk (stop_at_eos)
    for blk in range(num_blocks):
        s, e = P + blk * block_length, P + (blk + 1) * block_length
        row_masked = None  # the last device read of which rows hold masks (None: every row)
        most_masked = block_length  # a host bound on any decoding row's masked count in the block
        for i in range(steps_per_block):
            active = [
                c for c, d in zip(chunks, settled) if not d and (row_masked is None or any(row_masked[c[0] : c[1]]))
            ]
            if not active:
                bar.update(steps_per_block - i)
                break  # the threshold finished the block early
            cur = x[:, s:e]
            masked = cur == mask_id
            # the logits of the masked positions only (the head and the last layer's query side run on them)
            read = masked_first(masked, read_count(most_masked, block_length, read_buckets))
            logits = block_logits(x, s, e, first=i == 0, read=read)
            if len(chunks) == 1:
                x0, conf = _propose(logits, temperature, remasking, chunks[0][2], read, block_length)
            else:
                x0, conf = torch.zeros_like(read), torch.full(read.shape, -torch.inf, device=device)
                for a, b, gen in active:
                    x0[a:b], conf[a:b] = _propose(logits[a:b], temperature, remasking, gen, read[a:b], block_length)
            x0, conf = put_in_place(cur, masked, read, x0, conf)
            most_masked -= schedule[i]
            k = torch.full((B,), schedule[i], dtype=torch.long, device=device)
            if threshold is None:
                transfer = select_transfer(conf, k, kmax=schedule[i])
            else:
                transfer = threshold_transfer(conf, k, threshold, kmax=max(schedule[i], 1))
            if measure and block_logits.cached_step:
                exact = block_logits.exact(x, s, e, read)
                proposed = x0.gather(1, read)
                gap = (_log_prob_of(logits, proposed) - _log_prob_of(exact, proposed)).abs()
                stats.gap_sum += float(gap[transfer.gather(1, read)].double().sum())
            if stats is not None:
                stats.steps += 1
                stats.gap_tokens += int(transfer.sum()) if measure else 0
            step = commit_transfer(x, s, e, x0, transfer, step, bar, on_step)
            # At most one device->host read per step: which rows still hold masks (the threshold
            # may finish the block early) and which are settled (stop_at_eos), read together.
            early = threshold is not None and i < steps_per_block - 1
            parts = []
            if early:
                parts.append((x[:, s:e] == mask_id).any(-1))
            if stop_at_eos:
                parts.append(first_eos_settled(x[:, P:], mask_id, eos_id)[0])
            if parts:
                flags = torch.cat(parts).tolist()
                if early:
                    row_masked = flags[:B]
                if stop_at_eos:
                    settled = [all(flags[-B:][a:b]) for a, b, _ in chunks]
                    if all(settled):
                        break
        if all(settled):
            break
    bar.close()
    if stop_at_eos:
        x = fill_after_eos(x, P, eos_id)
    return x
