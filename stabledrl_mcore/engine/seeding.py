"""Every random draw of a run from a generator seeded by (seed, step, rank or micro-batch, phase): exact resume needs no RNG state, and DP=2 reproduces DP=1."""

from __future__ import annotations

import hashlib
from typing import Any, Union

import torch

from stabledrl_mcore.config.schema import RunConfig


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any parts (seed, step, rank, phase)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def phase_generator(
    seed: int, step: int, dp_rank: int, phase: str, device: Union[str, torch.device] = "cpu"
) -> torch.Generator:
    """Every random draw of a step comes from here: exact resume needs no RNG state.

    The generator lives on ``device`` (the model's), so Gumbel noise over a
    ``[B, L, V]`` logit tensor is drawn where the logits are. CUDA and CPU
    generators give different (each deterministic) streams for the same seed.
    """
    return torch.Generator(device=device).manual_seed(derive_seed(seed, step, dp_rank, phase))


def first_chunk(s) -> int:
    """Global index of this rank's first micro-batch (so draws do not depend on the DP split)."""
    rows = s.cfg.rollout.generated_prompts // s.dp_size * s.cfg.rollout.group_size
    return s.dp_rank * rows // s.cfg.parallel.micro_batch_size


def chunk_generators(cfg: RunConfig, step: int, device="cpu"):
    """``chunks(phase)(k)``: the generator (on ``device``) of global micro-batch ``k`` of ``phase``
    at ``step``."""
    return lambda phase: lambda k: phase_generator(cfg.parallel.seed, step, k, phase, device)
