"""The masked-diffusion SFT loop of ``stabledrl sft`` (and the demo's SFT).

    for step in steps:
        this rank's rows of the step -> micro-batches: masks drawn, loss, backward
        grad sync -> (skip if non-finite on any rank) -> clip -> optimizer step
        log, hooks, checkpoint

Same machinery as ``train``: Megatron DDP and optimizer (:func:`~..rl.setup.build_optimizer`),
tensor and data parallelism, atomic checkpoints with checksums, run-directory rules and
``--resume auto`` (:mod:`~stabledrl_mcore.engine.run_dir`, :mod:`~stabledrl_mcore.engine.resume`), pre-emption
(SIGUSR1/SIGTERM: checkpoint, exit 75). Every draw comes from (seed, step, global
micro-batch index), so the data-parallel split does not change the run and a resume is exact.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from stabledrl_mcore.checkpoint.writers import bind_checkpoint_writers
from stabledrl_mcore.common.errors import disk_full_is_one_line
from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.config.schema import load_config, save_config
from stabledrl_mcore.diffusion.pretrain import sft_sequence_losses
from stabledrl_mcore.engine.gradients import agree_ok, grads_finite, sync_gradients
from stabledrl_mcore.engine.health import RunHealth
from stabledrl_mcore.engine.metrics import create_logger, logger_options, progress_bar
from stabledrl_mcore.engine.optimizer import lr_steps_before
from stabledrl_mcore.engine.preemption import (
    exits_are_errors,
    install_preemption_handlers,
    preemption_agreed,
    run_with_preemption_marker,
)
from stabledrl_mcore.engine.resume import prepare_start, restore_training_state
from stabledrl_mcore.engine.run_dir import checkpoint_root
from stabledrl_mcore.engine.run_lock import run_dir_lock
from stabledrl_mcore.engine.save_schedule import SaveSchedule, save_training_checkpoint
from stabledrl_mcore.engine.seeding import phase_generator
from stabledrl_mcore.models.placement import model_device
from stabledrl_mcore.sft.config import SFTConfig
from stabledrl_mcore.sft.setup import SFTSetup, build_sft

Hook = Callable[["SFTSetup", int], Optional[Dict[str, float]]]


def train_sft(
    cfg: SFTConfig,
    *,
    hooks: Sequence[Hook] = (),
    stop_when: Optional[Callable[[Dict], bool]] = None,
    stop_after: Optional[int] = None,
) -> SFTSetup:
    """Run ``cfg.steps`` SFT steps. ``hooks(setup, step)`` run on every rank after each step (their
    metrics are logged with the step's); ``stop_when(metrics)`` True ends the run there with a
    checkpoint (the demo stops at a validation accuracy; it must decide the same on every rank, e.g.
    from DP-reduced metrics); ``stop_after`` ends early (tests). Rank 0 holds the run directory's
    lock for the whole call (:mod:`~stabledrl_mcore.engine.run_lock`); ``sys.exit`` inside is
    :class:`~stabledrl_mcore.common.errors.RunFailed`, a full disk one line (``DiskFullError``)."""

    with disk_full_is_one_line("the SFT run"), run_dir_lock(cfg), exits_are_errors("the SFT run"):
        return _train_sft(cfg, hooks, stop_when, stop_after)


def _train_sft(cfg: SFTConfig, hooks: Sequence[Hook], stop_when, stop_after: Optional[int]) -> SFTSetup:
    plan, notes = prepare_start(cfg)
    s = build_sft(cfg)
    root = checkpoint_root(cfg)
    start, resumed = restore_training_state(s, root, plan)
    logger = create_logger(
        cfg.logging.run_dir,
        config=to_dict(cfg),
        **logger_options(cfg.logging),
        start_step=start,
        console_keys=("loss", "grad_norm", "lr", "step_s"),
    )
    if torch.distributed.get_rank() == 0:
        save_config(cfg, os.path.join(cfg.logging.run_dir, "config.yaml"))
        for note in notes + resumed:
            logger.info(note)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    install_preemption_handlers()
    saves = SaveSchedule(cfg.checkpoint, cfg.logging.run_dir, logger, rank=torch.distributed.get_rank())
    health = RunHealth(
        cfg.sft.max_skipped_updates,
        logger,
        from_step_zero=start == 0,
        limit_field="sft.max_skipped_updates",
        what="SFT",
    )
    bar = progress_bar(cfg, start, end)
    with logger:
        for step in range(start, end):
            began = time.perf_counter()
            metrics, skip_reason = sft_update(s, step)
            metrics["step_s"] = time.perf_counter() - began
            for hook in hooks:
                metrics.update(hook(s, step + 1) or {})
            logger.log(step + 1, metrics, console=(step + 1) % cfg.logging.log_every == 0)
            bar.update(1)
            s.stopped_early = bool(stop_when and stop_when(metrics)) and step + 1 < end
            health.after_step(step + 1, [skip_reason], metrics, final=step + 1 == end or s.stopped_early)
            s.preempted = saves.save_if_due(
                lambda: save_training_checkpoint(s, root, step + 1),
                step + 1,
                end,
                metrics["step_s"],
                preempted=preemption_agreed(),
                stop_early=s.stopped_early,
            )
            if s.preempted:
                logger.info(f"pre-empted: checkpoint written at step {step + 1}; exiting for requeue")
            if s.preempted or s.stopped_early:
                break
        else:  # no break: every step of the run ran (or none was left)
            s.finished = True
    s.finished = s.finished or s.stopped_early
    bar.close()
    return s


def sft_update(s: SFTSetup, step: int) -> Tuple[Dict[str, float], Optional[str]]:
    """One optimizer step on this rank's rows of ``step`` (gradients accumulated over micro-batches):
    ``(metrics, why the update was skipped or None)``."""
    cfg, device = s.cfg, model_device(s.model)
    rows = s.prompts.for_step(step)
    micro = cfg.parallel.micro_batch_size
    first_chunk = s.dp_rank * (len(rows) // micro)  # global micro-batch index: draws independent of DP
    s.ddp.zero_grad_buffer()
    s.optimizer.zero_grad()
    total = torch.zeros((), device=device, dtype=torch.float64)
    for k, begin in enumerate(range(0, len(rows), micro)):
        chosen = rows[begin : begin + micro]
        ids, answer = s.data.ids[chosen].to(device), s.data.answer[chosen].to(device)
        generator = phase_generator(cfg.parallel.seed, step, first_chunk + k, "sft", device=device)
        losses, _ = sft_sequence_losses(
            s.ddp,
            ids,
            answer,
            mask_id=s.model.dllm_config.mask_token_id,
            generator=generator,
            eps=cfg.sft.eps,
            block_size=s.block_size,
        )
        (losses.sum() / len(rows)).backward()  # DDP averages over data-parallel ranks: the job's mean
        total += losses.detach().sum().double()
    sync_gradients(s.ddp)
    s.scheduler.step(increment=lr_steps_before(cfg.optim.lr_step, step))
    loss = _job_mean(total, len(rows) * s.dp_size)
    lr = s.optimizer.param_groups[0]["lr"]
    finite_loss = agree_ok(bool(torch.isfinite(total)))  # grads_finite only then: every rank alike
    if not finite_loss or not grads_finite(s.model):
        s.optimizer.zero_grad()
        reason = f"non-finite SFT loss (the job's mean is {loss})" if not finite_loss else "non-finite gradients"
        return {"loss": loss, "lr": lr, "skipped_updates": 1.0}, reason
    _, grad_norm, _ = s.optimizer.step()
    return {"loss": loss, "lr": lr, "grad_norm": float(grad_norm or 0.0), "skipped_updates": 0.0}, None


def _job_mean(local_sum: torch.Tensor, rows: int) -> float:
    """Mean per-sequence loss over the data-parallel group (tensor-parallel ranks hold the same rows)."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_world_size() > 1:
        local_sum = local_sum.clone()
        torch.distributed.all_reduce(local_sum, group=ps.get_data_parallel_group())
    return float(local_sum) / rows


def sft_rank(config: Optional[str], overrides: Sequence[str] = ()) -> int:
    """One rank of an SFT run from a config file plus dotted overrides; 75 = pre-empted
    (checkpoint written). Module level, so :func:`..parallel.launch.spawn` can start it."""

    bind_checkpoint_writers()
    cfg = load_config(config, list(overrides), cls=SFTConfig)
    with disk_full_is_one_line("the SFT run"), run_dir_lock(cfg):  # rank 0, before an earlier marker is removed
        return run_with_preemption_marker(cfg.logging.run_dir, lambda: train_sft(cfg))
