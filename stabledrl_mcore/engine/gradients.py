"""Gradient synchronisation and the finite checks every rank agrees on before an optimizer step."""

from __future__ import annotations

import math
from typing import Optional

import torch

from stabledrl_mcore.common.errors import RunFailed
from stabledrl_mcore.parallel.bootstrap import any_rank


class SkippedUpdatesError(RunFailed):
    """The run skipped too many optimizer updates (non-finite losses or gradients) to go on."""


def sync_gradients(ddp) -> None:
    """Megatron's ``finalize_model_grads``: the data-parallel all-reduce of every gradient, and the
    tensor-parallel all-reduce of the parameters every TP rank holds whole but feeds with its own
    heads only (q/k-norm, and norms under sequence parallelism). Without the latter, replicated
    q/k-norm weights (SDAR) drift apart across TP ranks."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp])


def grads_finite(model) -> bool:
    """All local gradients finite, agreed over every rank (so all ranks skip together).

    One flag tensor on the gradients' device, one all-reduce, one host sync (a
    per-parameter ``bool(...)`` would synchronise the GPU once per parameter).
    """
    grads = []
    for param in model.parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is not None:
            grads.append(grad)
    if not grads:
        return not any_rank(False)
    bad = torch.stack([torch.isfinite(g).logical_not().any() for g in grads]).any()
    return not any_rank(bad)


def agreed_reason(local: Optional[str]) -> str:
    """The reason of a skip every rank agreed on: the first rank's that had one (all ranks call it)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world == 1:
        return local or "non-finite loss"
    reasons: list = [None] * world
    torch.distributed.all_gather_object(reasons, local)
    rank, reason = next(((r, text) for r, text in enumerate(reasons) if text), (0, "non-finite loss"))
    return f"rank {rank}: {reason}"


def agree_ok(ok: bool) -> bool:
    """True only if ``ok`` holds on every rank."""
    return not any_rank(not ok)


def finite_or_nan(value) -> float:
    value = float(value)
    return value if math.isfinite(value) else float("nan")
