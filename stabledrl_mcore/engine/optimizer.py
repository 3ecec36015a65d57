"""Megatron DDP, the Megatron optimizer and its LR schedule, as RL and SFT build them."""

from __future__ import annotations

import torch


def build_optimizer(cfg, model, dtype: torch.dtype, total_updates: int):
    """``(ddp, optimizer, scheduler)`` of ``cfg.optim`` around ``model``: Megatron DDP, the Megatron
    optimizer (distributed ZeRO-1 on CPU/gloo as on GPU, Adam only: validated) and its LR
    schedule over ``total_updates`` optimizer updates (``train`` and ``sft`` share it)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    distributed = cfg.optim.distributed
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
        model,
    )
    opt_cfg = OptimizerConfig(
        optimizer=cfg.optim.name,
        lr=cfg.optim.lr,
        min_lr=cfg.optim.min_lr,
        weight_decay=cfg.optim.weight_decay,
        adam_beta1=cfg.optim.betas[0],
        adam_beta2=cfg.optim.betas[1],
        sgd_momentum=0.0,
        clip_grad=cfg.optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=distributed,
    )
    # {} = no parameter-group overrides: every parameter decays; None = Megatron's default, which
    # gives 1-D parameters (norms) and biases wd_mult 0
    overrides = {} if cfg.optim.decay_norms_and_biases else None
    optimizer = get_megatron_optimizer(opt_cfg, [ddp], config_overrides=overrides)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.optim.warmup_steps else cfg.optim.lr,
        max_lr=cfg.optim.lr,
        min_lr=cfg.optim.min_lr,
        lr_warmup_steps=cfg.optim.warmup_steps,
        lr_decay_steps=max(total_updates, cfg.optim.warmup_steps + 1),
        lr_decay_style=cfg.optim.decay_style,
        start_wd=cfg.optim.weight_decay,
        end_wd=cfg.optim.weight_decay,
        wd_incr_steps=total_updates,
        wd_incr_style="constant",
    )
    return ddp, optimizer, scheduler


def lr_steps_before(convention: str, first_update: int, count: int = 1) -> int:
    """How far the LR schedule advances before updates ``first_update .. first_update + count - 1``
    (0-based, counted over the whole run) under ``optim.lr_step``: ``before_update`` one step per
    update (update k runs at the schedule's rate for k + 1); ``release`` none before updates 0 and 1,
    then one per update (update k >= 1 runs at the rate for k - 1, as the release's
    ``scheduler.step(training_step)`` after each update gives)."""
    if convention == "before_update":
        return count
    if convention == "release":
        return sum(1 for k in range(first_update, first_update + count) if k >= 2)
    raise ValueError(f"optim.lr_step must be 'before_update' or 'release', got {convention!r}")
