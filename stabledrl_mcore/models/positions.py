"""Position ids that do not count padding.

A batch of prompts is left-padded to one width (and, for compiled decoding, to a multiple of 64
tokens), so the same prompt sits at another column in every batch. A model must see the same
positions for a row whatever its padding, or its answers depend on its neighbours and on the
decoding mode: learned absolute positions (and the separator scheme's, whose first segment starts
at the row's first token) read another embedding row per pad, and RoPE, relative in exact
arithmetic, rounds its angles differently. Here a position counts the *valid* tokens before it
(HF's ``position_ids = attention_mask.cumsum(-1) - 1`` for left-padded generation, as in
``transformers``' ``prepare_inputs_for_generation``); a pad gets position 0 (it is a masked key,
its own output unread). A row alone (no pads) keeps ``0..S-1``.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor


def take_positions(t: Tensor, positions, dim: int) -> Tensor:
    """``t``'s entries at ``positions`` of its sequence dimension ``dim`` (0: ``[S, B, ...]``,
    1: ``[B, S, ...]``; the other of the two is the batch): a ``slice`` or a 1-D LongTensor of
    positions shared by every sequence, or a ``[B, n]`` LongTensor of each sequence's own (a
    decoding step's read positions, :func:`~stabledrl_mcore.diffusion.sampling_common.masked_first`)."""
    if not isinstance(positions, Tensor):
        return t[(slice(None),) * dim + (positions,)]
    if positions.dim() == 1:
        return t.index_select(dim, positions)
    index = positions if dim == 1 else positions.t()
    index = index.reshape(index.shape + (1,) * (t.dim() - 2)).expand(index.shape + t.shape[2:])
    return t.gather(dim, index)


def valid_positions(valid: Tensor) -> Tensor:
    """``[B, S]`` positions of ``valid`` ``[B, S]`` (True = a real token): the number of real tokens
    before each one; 0 on the pads."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


def segment_positions(input_ids: Tensor, separator_id: int, valid: Optional[Tensor] = None):
    """``(position_ids, segment_ids)`` ``[B, S]`` of the separator scheme.

    Positions count from 0 and restart after each ``separator_id`` (the separator
    itself ends its segment); the segment id is the number of separators before a
    token. ``"2400..12=" + "2431..12"`` gives puzzle cell i and answer cell i the same
    position id, in segments 0 and 1. ``valid`` (``[B, S]``, True = a real token): pads are
    not counted (a left-padded row gets the positions and segments of the row alone) and are
    never separators.
    """
    is_sep = input_ids == separator_id
    if valid is None:
        counted = torch.arange(1, input_ids.shape[-1] + 1, device=input_ids.device).expand_as(input_ids)
    else:
        valid = valid.bool()
        is_sep = is_sep & valid
        counted = valid.long().cumsum(dim=-1)  # real tokens up to and including each one
    # real tokens up to and including the last separator strictly before each token
    at_sep = torch.where(is_sep, counted, torch.zeros_like(counted)).cummax(dim=-1).values
    before = torch.cat([torch.zeros_like(at_sep[..., :1]), at_sep[..., :-1]], dim=-1)
    segments = is_sep.long().cumsum(dim=-1) - is_sep.long()
    return (counted - before - 1).clamp(min=0), segments


def position_inputs(config, input_ids: Tensor, valid: Optional[Tensor]) -> Dict[str, Tensor]:
    """The model's ``position_ids`` (and, with the separator scheme, ``segment_ids``) ``[B, S]`` for
    rows whose tokens where ``valid`` is False are padding, for a model of ``config`` (a
    :class:`~.presets.DLLMConfig`); ``{}`` when the model's own default is already right (no
    separator and ``valid`` None, i.e. no padding). Pass them to every forward of those rows,
    sliced to the forwarded columns."""
    separator = getattr(config, "segment_separator_id", None)
    if separator is not None:
        positions, segments = segment_positions(input_ids, separator, valid)
        return {"position_ids": positions, "segment_ids": segments}
    if valid is None:
        return {}
    return {"position_ids": valid_positions(valid)}
