"""Pieces shared by the LLaDA and SDAR samplers (batched, explicit generators).

Under tensor parallelism every TP rank runs the sampler on the same inputs with
full-vocab logits (``gather_output=True``); seed the generators identically on
the ranks of a TP group so every rank commits the same tokens. The samplers keep
the gathered logits on purpose (they draw from the whole vocabulary, on the decoded
block only); the likelihood, update and SFT paths do not gather (vocab-parallel
log-probs, :mod:`.likelihood`).
"""

from __future__ import annotations

import sys
from typing import List, Optional, Tuple

import torch
from torch import Tensor
from tqdm.auto import tqdm

from stabledrl_mcore.diffusion.masking import uniform


def num_transfer_tokens(masked_count: Tensor, steps: int) -> Tensor:
    """``[B, steps]``: split each count evenly over the steps, remainder to the first steps (LLaDA)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    c = masked_count.long().reshape(-1, 1)
    base, rem = c // steps, c % steps
    return base + (torch.arange(steps, device=c.device)[None] < rem).long()


def transfer_schedule(count: int, steps: int) -> List[int]:
    """:func:`num_transfer_tokens` of one host count: the tokens each step commits (no tensor)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    base, rem = divmod(int(count), steps)
    return [base + (i < rem) for i in range(steps)]


def select_transfer(
    confidence: Tensor, k: Tensor, threshold: Optional[float] = None, kmax: Optional[int] = None
) -> Tensor:
    """Positions to commit ``[B, n]`` from ``confidence`` (-inf = not eligible).

    Without ``threshold``: the top-``k[b]`` (LLaDA low-confidence remasking). With a
    threshold (SDAR ``low_confidence_dynamic``): every position above it if there are
    at least ``k[b]`` of them, else the top-``k[b]``. ``k`` is clamped to the number
    of eligible positions, so nothing outside the eligible set is ever committed.
    ``kmax``: a host bound on ``k`` (the samplers know their schedule); without it
    ``max(k)`` is read from the device (one synchronisation).
    """
    eligible = torch.isfinite(confidence)
    k = torch.minimum(k.long().reshape(-1), eligible.sum(-1))
    if kmax is None:
        kmax = int(k.max()) if k.numel() else 0
    kmax = min(int(kmax), confidence.shape[-1])
    top = torch.zeros_like(eligible)
    if kmax > 0:
        idx = torch.topk(confidence, kmax, dim=-1).indices
        keep = torch.arange(kmax, device=k.device)[None] < k[:, None]
        top.scatter_(1, idx, keep)
    if threshold is None:
        return top
    high = eligible & (confidence > threshold)
    use_high = high.sum(-1) >= k
    return torch.where(use_high[:, None], high, top)


def gumbel_argmax(
    logits: Tensor, temperature: float, generator: Optional[torch.Generator], rows: Optional[Tuple[Tensor, int]] = None
) -> Tensor:
    """LLaDA's ``add_gumbel_noise`` + argmax: exp(l) / (-log u)^T in float64; T = 0 is greedy.

    ``rows``: ``(read [B, n], width)`` when ``logits [B, n, V]`` are the rows ``read`` of a
    ``width``-position block (:func:`masked_first`): the noise is drawn for the whole block and
    read at those rows, so a position's draw does not depend on which positions were read."""
    if temperature == 0:
        return logits.argmax(-1)
    if generator is None:
        raise TypeError("temperature > 0 needs an explicit torch.Generator")
    l64 = logits.double()
    noise = _block_noise(l64.shape, generator, l64.device, rows)
    return (l64.exp() / (-torch.log(noise)) ** temperature).argmax(-1)


def _block_noise(shape, generator: torch.Generator, device, rows: Optional[Tuple[Tensor, int]]) -> Tensor:
    """float64 U[0, 1) noise of ``shape`` ``[B, n, V]``; with ``rows = (read [B, n], width)``, drawn
    for the whole ``[B, width, V]`` block and read at ``read``."""
    if rows is None:
        return uniform(shape, generator, device, torch.float64)
    read, width = rows
    noise = uniform((shape[0], width, shape[-1]), generator, device, torch.float64)
    return noise.gather(1, read.unsqueeze(-1).expand(-1, -1, shape[-1]))


def masked_first(masked: Tensor, count: int) -> Tensor:
    """``[B, count]`` positions of each row of ``masked [B, n]``: its masked positions first, then
    its unmasked ones, each in order (distinct within a row). With ``count`` at least a row's masked
    count, the read positions of a step that needs the logits of the masked positions only."""
    return torch.argsort((~masked).to(torch.uint8), dim=1, stable=True)[:, :count]


def put_in_place(cur: Tensor, masked: Tensor, read: Tensor, x0: Tensor, confidence: Tensor):
    """``(x0, confidence)`` ``[B, width]`` of a block ``cur`` from the proposals at its positions
    ``read`` ``[B, n]``: ``cur``'s own tokens elsewhere, and -inf confidence at every position that
    is not ``masked`` (a read position beyond a row's masked ones included)."""
    x0 = cur.scatter(1, read, x0)
    confidence = torch.full(cur.shape, -torch.inf, device=cur.device).scatter(1, read, confidence)
    return x0, torch.where(masked, confidence, torch.full_like(confidence, -torch.inf))


def read_count(masked: int, width: int, buckets: int = 0) -> int:
    """Positions a step reads when at most ``masked`` of the block's ``width`` are masked: ``masked``,
    or with ``buckets`` (a compiled step: one graph per count) rounded up to a multiple of
    ``ceil(width / buckets)``, at most ``width``."""
    if buckets <= 0:
        return max(masked, 1)
    unit = -(-width // buckets)
    return min(width, max(1, -(-masked // unit)) * unit)


def filter_top_k_top_p(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Keep the ``top_k`` largest logits and the smallest nucleus of mass ``top_p`` (others -inf)."""
    if top_k and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p < 1.0:
        srt, idx = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(srt, -1).cumsum(-1)
        drop = cum - torch.softmax(srt, -1) > top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), -torch.inf)
    return logits


def sample_tokens(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
    rows: Optional[Tuple[Tensor, int]] = None,
):
    """SDAR's ``sample_with_temperature_topk_topp``: (token, its probability) per position.

    Sampling uses the Gumbel-max trick on float64 noise from ``generator``
    (same distribution as ``multinomial``, and works with a CPU generator for CUDA logits).
    ``rows``: as :func:`gumbel_argmax`'s (the noise drawn for the whole block, read at the rows).
    """
    logits = logits.float()
    if temperature == 0:
        probs = torch.softmax(logits, -1)
        tok = logits.argmax(-1)
        return tok, probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    if generator is None:
        raise TypeError("temperature > 0 needs an explicit torch.Generator")
    logits = filter_top_k_top_p(logits / temperature, top_k, top_p)
    probs = torch.softmax(logits, -1)
    noise = _block_noise(logits.shape, generator, logits.device, rows)
    tok = (logits.double() - torch.log(-torch.log(noise))).argmax(-1)
    return tok, probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def first_eos_settled(gen: Tensor, mask_id: int, eos_id: int):
    """(settled [B], first_eos [B]): a row is settled once it has a committed EOS
    and no mask token before its first EOS."""
    is_eos = gen == eos_id
    has = is_eos.any(-1)
    first = torch.where(has, is_eos.long().argmax(-1), torch.full_like(has, gen.shape[-1], dtype=torch.long))
    before = torch.arange(gen.shape[-1], device=gen.device)[None] < first[:, None]
    settled = has & ~((gen == mask_id) & before).any(-1)
    return settled, first


def fill_after_eos(x: Tensor, start: int, eos_id: int) -> Tensor:
    """Set every position after a row's first EOS (in ``x[:, start:]``) to EOS."""
    gen = x[:, start:]
    is_eos = gen == eos_id
    has = is_eos.any(-1)
    first = is_eos.long().argmax(-1)
    after = has[:, None] & (torch.arange(gen.shape[-1], device=x.device)[None] > first[:, None])
    return torch.cat([x[:, :start], gen.masked_fill(after, eos_id)], dim=1)


def progress_bar(total: int, progress: Optional[bool], desc: str):
    """tqdm bar; ``progress=None`` shows it for long runs on an interactive rank 0."""

    if progress is None:
        rank0 = (
            not (torch.distributed.is_available() and torch.distributed.is_initialized())
            or torch.distributed.get_rank() == 0
        )
        progress = rank0 and total >= 64 and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, disable=not progress, leave=False)


def check_prompt(prompt_ids: Tensor, prompt_valid: Optional[Tensor]) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.dtype != torch.long:
        raise ValueError(f"prompt_ids must be a [B, P] LongTensor, got {tuple(prompt_ids.shape)} {prompt_ids.dtype}")
    if prompt_valid is not None and prompt_valid.shape != prompt_ids.shape:
        raise ValueError("prompt_valid must have the shape of prompt_ids")


def commit_transfer(x: Tensor, s: int, e: int, x0: Tensor, transfer: Tensor, step: int, bar, on_step=None) -> int:
    """Commit ``x0`` where ``transfer`` inside block ``[s, e)`` of ``x`` (in place), advance the
    progress bar, report ``on_step(step, committed [B, S], x)``; returns the new step count."""
    x[:, s:e] = torch.where(transfer, x0, x[:, s:e])
    step += 1
    bar.update(1)
    if on_step is not None:
        full = torch.zeros_like(x, dtype=torch.bool)
        full[:, s:e] = transfer
        on_step(step, full, x)
    return step


def repeat_counts(repeats, rows: int):
    """``repeats`` as one count per prompt row (None: no repetition); refuses bad counts by name."""
    if repeats is None:
        return None
    counts = [int(repeats)] * rows if isinstance(repeats, int) else [int(c) for c in repeats]
    if len(counts) != rows or any(c < 1 for c in counts):
        raise ValueError(
            f"repeats must be a positive int or one positive count per prompt row ({rows}), got {repeats!r}"
        )
    return counts


def chunk_bounds(row_chunks, generator, rows: int) -> List[Tuple[int, int, Optional[torch.Generator]]]:
    """``[(first row, end row, generator)]`` of ``row_chunks`` (one chunk of every row by default)."""
    if row_chunks is None:
        return [(0, rows, generator)]
    if generator is not None:
        raise ValueError("pass either generator or row_chunks (each chunk's generator), not both")
    bounds, start = [], 0
    for n, gen in row_chunks:
        bounds.append((start, start + int(n), gen))
        start += int(n)
    if start != rows or any(a >= b for a, b, _ in bounds):
        raise ValueError(
            f"row_chunks must split the {rows} decoded rows into non-empty chunks, "
            f"got sizes {[int(n) for n, _ in row_chunks]}"
        )
    return bounds


def repeat_rows(t: Optional[Tensor], counts) -> Optional[Tensor]:
    if t is None:
        return None
    if len(set(counts)) == 1:
        return t.repeat_interleave(counts[0], 0)
    return t.repeat_interleave(torch.tensor(counts, device=t.device), 0, output_size=sum(counts))
