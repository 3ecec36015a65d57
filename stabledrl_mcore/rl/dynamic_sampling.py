"""Dynamic sampling (DAPO): drop prompt groups whose rewards are all equal before the likelihood phases.

A group whose completions all score the same has all-zero advantages under every advantage
mode (``center``, ``zscore``, ``leave_one_out``), so it adds nothing to the policy loss's
gradient; scoring it for the old policy and back-propagating it is wasted work.
``rollout.filter_uniform_groups`` removes such groups after scoring (``max == min`` of the
rewards, exactly; not a threshold on the advantages, which float rounding can leave at 1e-9).

Semantics, chosen so a run does not depend on how it is split:

* **Global decision.** Each rank's per-group flags are all-gathered over the data-parallel
  group; the kept set is a function of the whole job's groups in prompt-stream order. With
  ``rollout.oversample_prompts`` only the first ``prompts_per_step`` varied groups in that
  order are kept (DAPO's refill, in one generation round).
* **Whole groups.** Rows are selected group by group (order preserved), so self-normalisation
  and every loss see only complete groups; the loss averages over the kept groups (the
  gradient is G / G_kept times the unfiltered one, as DAPO's).
* **Gradient scale.** DDP averages gradients over the DP ranks and each rank's loss averages
  over its own groups; with unequal kept counts rank ``r``'s loss coefficients are scaled by
  ``dp * kept_r / kept_total`` (``RolloutBatch.gradient_scale``), so the update is the mean
  over all kept groups, as on one rank (exact for losses that average over groups or
  sequences; d1's ``global_token_mean`` stays a per-rank token mean, as without the filter).
* **Masks.** A kept row keeps the masks it would have had unfiltered (``draw_plan`` draws on
  ``batch.source`` and selects the rows), so masks stay a function of (seed, step, row).
* **A rank with no kept group** keeps its first group with gradient scale 0: it scores that
  group like any other and joins every collective, contributing a zero gradient (its
  back-propagation is skipped, as for any all-zero chunk).
* **No group kept anywhere**: the step makes no optimizer update, on every rank together;
  it is not a skipped update (nothing was non-finite), the LR schedule still advances and
  a console line says so (see :func:`~stabledrl_mcore.rl.trainer.no_update`).

Micro-batching: the kept rows need not fill whole micro-batches; the last one is short.
"""

from __future__ import annotations

from typing import Optional

import torch

from stabledrl_mcore.parallel.bootstrap import comm_device
from stabledrl_mcore.rl.rollout import RolloutBatch


def varied_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[n_groups]`` bool: the groups (``group_size`` contiguous rows each) whose rewards differ."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [n_groups * {group_size}], got shape {tuple(rewards.shape)}")
    groups = rewards.reshape(-1, group_size)
    return groups.amax(1) > groups.amin(1)


def keep_groups(varied: torch.Tensor, limit: Optional[int] = None) -> torch.Tensor:
    """``[n_groups]`` bool: the varied groups, at most the first ``limit`` of them (in order)."""
    keep = varied.bool()
    if limit is not None:
        keep = keep & (keep.long().cumsum(0) <= limit)
    return keep


def gather_over_data_parallel(flags: torch.Tensor) -> torch.Tensor:
    """This rank's flags ``[n]`` -> every DP rank's, concatenated in rank order ``[dp * n]``
    (the prompt stream's global order); the same on every rank."""
    if not torch.distributed.is_initialized():
        return flags
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    size = torch.distributed.get_world_size(group=group)
    if size == 1:
        return flags
    local = flags.to(device=comm_device(), dtype=torch.long)
    parts = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(parts, local, group=group)
    return torch.cat(parts).to(device=flags.device, dtype=torch.bool)


def filter_uniform_groups(
    batch: RolloutBatch, group_size: int, *, dp_rank: int = 0, dp_size: int = 1, limit: Optional[int] = None
) -> Optional[RolloutBatch]:
    """The scored ``batch`` restricted to the kept groups (see the module docstring); None when
    no rank keeps any group. All DP ranks must call it together (one all-gather)."""
    local = varied_groups(batch.rewards, group_size)
    everyone = gather_over_data_parallel(local)
    keep = keep_groups(everyone, limit).reshape(dp_size, -1)
    total, mine = keep.sum().tolist(), keep[dp_rank]
    if total == 0:
        return None
    kept_here = int(mine.sum())
    scale = dp_size * kept_here / total
    if kept_here == 0:  # a placeholder group at weight 0, so this rank runs every phase like the others
        mine = torch.zeros_like(mine)
        mine[0] = True
    rows = torch.nonzero(mine.repeat_interleave(group_size), as_tuple=False).flatten()
    kept = batch.select_rows(rows.to(batch.sequences.device), gradient_scale=scale)
    kept.stats["groups_kept"] = float(kept_here)
    return kept
