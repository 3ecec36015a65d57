"""Per-step metrics, reduced over data-parallel ranks: rewards, accuracy, loss diagnostics, speed."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from stabledrl_mcore.parallel.bootstrap import comm_device

_UNFILTERED = object()


def dp_sum(values: torch.Tensor) -> list:
    """Sum over data-parallel ranks; one device->host copy of the result."""
    if torch.distributed.is_initialized():
        from megatron.core import parallel_state as ps

        values = values.to(comm_device())  # NCCL reduces CUDA tensors only
        torch.distributed.all_reduce(values, group=ps.get_data_parallel_group())
    return values.tolist()


def first_reward_error(batch) -> Optional[str]:
    """The first failed reward's message of the lowest data-parallel rank that had one (every rank
    gets the same; a collective: call it on every rank)."""
    mine = batch.first_reward_error
    if not torch.distributed.is_initialized():
        return mine
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    gathered: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, mine, group=group)
    return next((text for text in gathered if text), None)


def step_metrics(
    s, batch, update: Dict[str, float], seconds: Dict[str, float], *, kept: Any = _UNFILTERED
) -> Dict[str, float]:
    """Reward mean/std and accuracy over the global batch; ``groups_varied``, the share of prompt
    groups whose rewards are not all equal (0: every advantage is zero, no learning signal);
    the update's loss diagnostics (averaged over DP ranks, weighted by each rank's share of the
    kept groups; ``log_ratio_var`` from the averaged moments: the whole batch's variance); learning rate; wall seconds and tokens/s per phase; on the steps
    ``rollout.cache_gap_every`` picks, ``rollout_cache_gap`` over the whole job's committed tokens.

    ``kept``: the batch the likelihood phases saw (dynamic sampling's, None when it dropped every
    group); with ``rollout.filter_uniform_groups`` ``groups_kept`` is the share of groups kept."""
    kept = batch if kept is _UNFILTERED else kept
    rewards = batch.rewards.double()
    keys = sorted(k for k, v in update.items() if isinstance(v, (int, float)))
    groups = rewards.reshape(-1, s.cfg.rollout.group_size)  # the rollout keeps each group contiguous
    if kept is None or kept is batch:
        kept_groups = 0.0 if kept is None else float(groups.shape[0])
    else:
        kept_groups = kept.stats["groups_kept"]
    weight = 1.0 if kept is None else kept.gradient_scale  # sums to dp over the ranks
    kept_tokens = 0.0 if kept is None else float(kept.sequences.numel())
    host = [float(rewards.numel()), float(batch.reward_errors), kept_tokens, float(groups.shape[0]), kept_groups]
    host += [float(update[k]) * (1.0 if k == "skipped_updates" else weight) for k in keys]
    gap = [batch.stats[k] for k in ("cache_gap_sum", "cache_gap_tokens") if k in batch.stats]
    host += gap  # every rank measures on the same steps (rollout.cache_gap_every)
    device = rewards.device  # the batch's statistics stay there until the one reduction
    correct = batch.correct if batch.correct is not None else rewards >= 1.0
    varied = (groups.amax(1) > groups.amin(1)).sum().double()
    local = torch.cat(
        [
            torch.stack(
                [
                    rewards.sum(),
                    (rewards**2).sum(),
                    correct.sum().double(),
                    batch.completion_mask.sum().double(),
                    varied,
                ]
            ),
            torch.tensor(host, dtype=torch.float64, device=device),
        ]
    )
    total = dp_sum(local)
    n = max(total[5], 1.0)
    mean = total[0] / n
    out = {
        "reward_mean": mean,
        "reward_std": max(total[1] / n - mean * mean, 0.0) ** 0.5,
        f"accuracy/{s.cfg.rollout.task}": total[2] / n,
        "reward_errors": total[6],
        "reward_error_frac": total[6] / n,  # rollout.max_reward_error_frac ends the run above it
        "groups_varied": total[4] / max(total[8], 1.0),
        **({"groups_kept": total[9] / max(total[8], 1.0)} if s.cfg.rollout.filter_uniform_groups else {}),
        "completion_tokens": total[3],
        "lr": float(s.optimizer.param_groups[0]["lr"]),
    }
    dp = float(s.dp_size)
    for i, key in enumerate(keys):
        value = total[10 + i]
        out[key] = value if key in ("skipped_updates",) else value / dp
    out["skipped_updates"] = out.get("skipped_updates", 0.0) / dp
    for suffix in ("", "_first"):  # the whole batch's log-ratio variance, whatever the DP size
        m1, m2 = out.pop(f"log_ratio_m1{suffix}", None), out.pop(f"log_ratio_m2{suffix}", None)
        if m1 is not None and m2 is not None and f"log_ratio_var{suffix}" in out:
            out[f"log_ratio_var{suffix}"] = max(m2 - m1 * m1, 0.0)
    if gap:
        out["rollout_cache_gap"] = total[-2] / max(total[-1], 1.0)
    for key in ("rollout_decode_rows", "rollout_compile_s"):  # this rank's (every rank decodes alike)
        if key in batch.stats:
            out[key] = batch.stats[key]
    for phase, secs in seconds.items():
        out[f"time/{phase}"] = secs
    out["step_s"] = sum(seconds.values())
    if seconds.get("rollout"):
        out["tokens_per_s/rollout"] = total[3] / seconds["rollout"]
    if seconds.get("update"):
        out["tokens_per_s/update"] = total[7] * s.cfg.algo.num_mc * s.cfg.algo.inner_iterations / seconds["update"]
    if seconds.get("old_logp"):
        out["tokens_per_s/old_logp"] = total[7] * s.cfg.algo.num_mc / seconds["old_logp"]
    return out
