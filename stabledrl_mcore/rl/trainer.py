"""The StableDRL training loop: named, timed phases over library functions.

    for step in steps:
        rollout  -> score -> filter (dynamic sampling) -> old-policy likelihood (masks saved)
        mu x [coefficients -> micro-batch backward -> grad sync -> clip -> optimizer step]
        log, checkpoint

Runs on any number of ranks (torchrun, srun, or ``stabledrl train --nproc N``);
each data-parallel rank takes its own prompts, tensor-parallel ranks share them.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from stabledrl_mcore.algorithms.ratio_noise import RatioNoise
from stabledrl_mcore.checkpoint.writers import bind_checkpoint_writers
from stabledrl_mcore.common.errors import disk_full_is_one_line
from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.config.schema import RunConfig, load_config, save_config
from stabledrl_mcore.engine.expert import (
    expert_group,
    lockstep_dummy_rounds,
    phase_model,
    routing_statistics,
    summed_over_ranks,
)
from stabledrl_mcore.engine.gradients import agree_ok, agreed_reason, grads_finite, sync_gradients
from stabledrl_mcore.engine.health import RunHealth
from stabledrl_mcore.engine.metrics import create_logger, logger_options, progress_bar
from stabledrl_mcore.engine.model_setup import sync_reference, synced_reference
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
from stabledrl_mcore.engine.seeding import chunk_generators, first_chunk, phase_generator
from stabledrl_mcore.models.placement import model_device
from stabledrl_mcore.rl.drift import drift_metrics
from stabledrl_mcore.rl.dynamic_sampling import filter_uniform_groups
from stabledrl_mcore.rl.estimates import LikelihoodSpec, all_token_logp, iteration_inputs, old_policy_likelihood
from stabledrl_mcore.rl.heldout import is_eval_step, make_heldout_evaluator
from stabledrl_mcore.rl.rollout import generate_rollouts, score_rollouts
from stabledrl_mcore.rl.sample_dump import dump_samples
from stabledrl_mcore.rl.setup import TrainingSetup, build_training
from stabledrl_mcore.rl.step_metrics import first_reward_error, step_metrics
from stabledrl_mcore.rl.update import accumulate_gradients, loss_coefficients
from stabledrl_mcore.tasks.custom_reward import check_reward_errors


class PhaseTimer:
    """``with timer("rollout"):`` accumulates wall seconds per named phase."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def likelihood_spec(cfg: RunConfig, model) -> LikelihoodSpec:
    a = cfg.algo
    block = model.dllm_config.block_size if a.likelihood == "staircase" else None
    options = (("block_length", cfg.rollout.block_length),) if a.mask_scheme == "block_random" else ()
    return LikelihoodSpec(
        kind=a.likelihood,
        num_mc=a.num_mc,
        coupled=a.coupled_masks,
        length_normalize=a.length_normalize,
        block_size=block,
        beta=a.spg_beta,
        omega=a.spg_omega,
        scheme=a.mask_scheme,
        scheme_options=options,
        prefix_mask_prob=a.prefix_mask_prob,
        post_eos=a.post_eos,
        normalize_by=a.normalize_by,
        staircase_t=a.staircase_t,
    )


def policy_update(s: TrainingSetup, batch, spec: LikelihoodSpec, step: int) -> Dict[str, Any]:
    """Phase 4: ``inner_iterations`` optimizer steps on one rollout batch (the LR schedule
    advances once per optimizer update, as the release counts steps).

    ``update_skips`` lists, per optimizer update, None (applied) or the reason it was skipped,
    the same on every rank; ``skipped_updates`` counts the skips."""
    cfg, a, mask_id, micro = s.cfg, s.cfg.algo, s.model.dllm_config.mask_token_id, s.cfg.parallel.micro_batch_size
    device = model_device(s.model)
    noise = RatioNoise(a.ratio_noise, a.ratio_noise_sigma, a.ratio_noise_dof) if a.ratio_noise else None
    metrics: Dict[str, Any] = {"skipped_updates": 0.0, "update_skips": []}
    ref, ref_plan = None, None  # the reference's log-probs, scored once per plan until it is synced
    for inner in range(a.inner_iterations):
        # a retained graph is recorded through DDP (refused with PP and EP: phase_model returns it as is)
        with phase_model(s.ddp if cfg.parallel.retain_update_graph else s.model) as model:
            old, plan, current, retained = iteration_inputs(
                model,
                batch,
                spec,
                inner,
                sampling=a.mask_sampling,
                micro_batch=micro,
                mask_id=mask_id,
                retain_graph=cfg.parallel.retain_update_graph,
                chunk_generator=chunk_generators(cfg, step, device)(f"masks/iter{inner}"),
                first_chunk=first_chunk(s),
            )
        if s.reference is not None and plan is not ref_plan:
            with phase_model(s.reference) as reference:
                ref = all_token_logp(reference, batch, plan, spec, micro_batch=micro, mask_id=mask_id)
            ref_plan = plan
        coef, loss_metrics = loss_coefficients(
            current,
            batch,
            spec,
            plan=plan,
            old=old,
            loss=a.loss,
            loss_options=a.loss_options,
            eps=a.eps,
            ratio_noise=noise,
            kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator,
            ref_tok=ref,
            noise_generator=phase_generator(cfg.parallel.seed, step * 1000 + inner, s.dp_rank, "noise", device=device),
        )
        if inner == 0:
            metrics["sample_log_ratio_first"] = loss_metrics.get("sample_log_ratio")  # a tensor: dumps only
            metrics["log_ratio_var_first"] = loss_metrics.get("log_ratio_var", float("nan"))
            for moment in ("log_ratio_m1", "log_ratio_m2"):  # the same keys on every rank
                metrics[moment + "_first"] = loss_metrics.get(moment, float("nan"))
        if coef is not None and batch.gradient_scale != 1.0:  # dynamic sampling: see rl/dynamic_sampling.py
            coef = coef * batch.gradient_scale
        s.ddp.zero_grad_buffer()
        s.optimizer.zero_grad()
        finite_loss = agree_ok(coef is not None)  # the same answer on every rank
        if finite_loss:  # router statistics of the first update's (training) forwards
            # the statistics' all-reduce after the expert group's lockstep has drained
            with routing_statistics(s.model, metrics, enabled=inner == 0), phase_model(s.ddp, backward=True) as ddp:
                accumulate_gradients(
                    ddp, batch, spec, coef, plan=plan, micro_batch=micro, mask_id=mask_id, retained=retained
                )
        retained = None
        sync_gradients(s.ddp)
        s.scheduler.step(increment=lr_steps_before(cfg.optim.lr_step, step * a.inner_iterations + inner))
        # every rank skips together: never short-circuit one rank past grads_finite's all-reduce
        if not finite_loss or not grads_finite(s.model):
            metrics["skipped_updates"] += 1
            metrics["update_skips"].append(
                agreed_reason(loss_metrics.get("nonfinite_reason")) if not finite_loss else "non-finite gradients"
            )
            s.optimizer.zero_grad()
            continue
        _, grad_norm, _ = s.optimizer.step()
        metrics["update_skips"].append(None)
        if s.reference is not None and a.reference_sync_every and s.scheduler.num_steps % a.reference_sync_every == 0:
            sync_reference(s.reference, s.model, a.reference_mixup)
            ref_plan = None
        metrics.update({k: v for k, v in loss_metrics.items() if isinstance(v, (int, float))})
        metrics["grad_norm"] = max(metrics.get("grad_norm", 0.0), float(grad_norm or 0.0))
    if metrics["skipped_updates"]:
        s.optimizer.zero_grad()
    return metrics


def train(
    cfg: RunConfig,
    *,
    resume: Optional[str] = None,
    setup: Optional[TrainingSetup] = None,
    stop_after: Optional[int] = None,
    hooks: Sequence[Callable[[TrainingSetup, int], Dict[str, float]]] = (),
) -> TrainingSetup:
    """Run ``cfg.steps`` StableDRL steps (``stop_after`` ends early, e.g. for tests).

    ``hooks(setup, step)`` run on every rank after each step; the metrics they
    return (e.g. a held-out evaluation) are logged with the step's.

    On SIGUSR1 or SIGTERM (SLURM's pre-emption warning) every rank finishes the
    current step, a checkpoint is written, and ``setup.preempted`` is set; the
    CLI then exits with :data:`EXIT_PREEMPTED` so the job script can requeue.

    Before anything is built, a fresh run into a used directory and a resume the current
    config cannot continue are refused (:mod:`~stabledrl_mcore.engine.run_dir`, :mod:`~stabledrl_mcore.engine.resume`).
    Rank 0 holds the run directory's lock for the whole call, taken before anything in it is
    moved, pruned or deleted: a second run into it is refused (:mod:`~stabledrl_mcore.engine.run_lock`).
    ``sys.exit`` inside (e.g. in a reward function) is :class:`~stabledrl_mcore.common.errors.RunFailed`,
    a full disk (ENOSPC) one line (:class:`~stabledrl_mcore.common.errors.DiskFullError`);
    ``setup.finished`` says the loop reached its last step.
    """
    with disk_full_is_one_line("the training run"), run_dir_lock(cfg), exits_are_errors():
        return _train(cfg, resume or cfg.checkpoint.resume, setup, stop_after, hooks)


def _train(
    cfg: RunConfig, resume: str, setup: Optional[TrainingSetup], stop_after: Optional[int], hooks
) -> TrainingSetup:
    plan, moved_aside = prepare_start(cfg, resume)
    s = setup or build_training(cfg)
    ckpt_root = checkpoint_root(cfg)
    start, notes = restore_training_state(s, ckpt_root, plan, extra_modules=synced_reference(s))
    notes = moved_aside + notes
    spec, timer = likelihood_spec(cfg, s.model), PhaseTimer()
    logger = create_logger(
        cfg.logging.run_dir,
        config=to_dict(cfg),
        **logger_options(cfg.logging),
        start_step=start,
        console_keys=("reward_mean", "loss", "grad_norm", "clip_frac_high", "step_s", "test_accuracy"),
    )
    if torch.distributed.get_rank() == 0:
        save_config(cfg, f"{cfg.logging.run_dir}/config.yaml")
        for note in notes:
            logger.info(note)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = progress_bar(cfg, start, end)
    install_preemption_handlers()
    evaluate = make_heldout_evaluator(cfg, s.task, s.tokenizer)
    saves = SaveSchedule(cfg.checkpoint, cfg.logging.run_dir, logger, rank=torch.distributed.get_rank())
    with logger:
        if evaluate and start == 0:
            with phase_model(s.model) as model:
                logger.log(0, evaluate(model))
        health = RunHealth(cfg.algo.max_skipped_updates, logger, from_step_zero=start == 0)
        for step in range(start, end):
            timer.seconds.clear()
            dummies = lockstep_dummy_rounds()
            with timer("rollout"):
                batch = rollout_phase(s, step, logger)
            with timer("score"):
                batch = score_rollouts(batch, s.task, advantage=cfg.algo.advantage)
            kept = filter_phase(s, batch, timer)  # None: dynamic sampling dropped every group
            if kept is None:
                update = no_update(s, step, logger)
            else:
                with timer("old_logp"):
                    kept = old_logp_phase(s, kept, spec, step)
                if s.initial is not None:  # logging.drift_to_initial, before this step's updates
                    with timer("drift"):
                        drift = drift_metrics(
                            s.initial,
                            kept,
                            spec,
                            micro_batch=s.cfg.parallel.micro_batch_size,
                            mask_id=s.model.dllm_config.mask_token_id,
                        )
                with timer("update"):
                    update = policy_update(s, kept, spec, step)
                if s.initial is not None:
                    update.update(drift)
            metrics = step_metrics(s, batch, update, timer.seconds, kept=kept)
            if evaluate and is_eval_step(cfg, step + 1, cfg.steps):
                with phase_model(s.model) as model:
                    metrics.update(evaluate(model))
            if expert_group() is not None:  # forwards all ranks spent keeping the expert groups in lockstep
                metrics["expert_lockstep_dummies"] = summed_over_ranks(lockstep_dummy_rounds() - dummies)
            for hook in hooks:
                metrics.update(hook(s, step + 1) or {})
            logger.log(step + 1, metrics, console=(step + 1) % cfg.logging.log_every == 0)
            dump_samples(cfg.logging, logger, batch, kept, update, s.tokenizer, step + 1)
            check_reward_errors(  # the share is the same on every rank: all stop together
                cfg.rollout.max_reward_error_frac,
                metrics["reward_error_frac"],
                metrics["reward_errors"],
                step + 1,
                lambda: first_reward_error(batch),
            )
            health.after_step(step + 1, update["update_skips"], metrics, final=step + 1 == end)
            bar.update(1)
            stop = saves.save_if_due(
                lambda: save_training_checkpoint(s, ckpt_root, step + 1),
                step + 1,
                end,
                metrics.get("step_s"),
                preempted=preemption_agreed(),
            )
            if stop:
                logger.info(f"pre-empted: checkpoint written at step {step + 1}; exiting for requeue")
                s.preempted = True
                break
        else:  # no break: every step of the run ran (or none was left)
            s.finished = True
    bar.close()
    return s


def train_rank(config: Optional[str], overrides: Sequence[str] = ()) -> int:
    """One rank of a run from a config file plus dotted overrides; 75 = pre-empted (checkpoint written).

    Never 0 for a run that did not train: too many skipped updates in a row, or none applied at
    all, raise :class:`~stabledrl_mcore.engine.gradients.SkippedUpdatesError` (on every rank together; see
    :mod:`~stabledrl_mcore.engine.health`). Module level, so :func:`..parallel.launch.spawn` can start it on local ranks.
    After a pre-emption rank 0 leaves ``<run_dir>/PREEMPTED`` (removed when a run
    starts), for launchers that cannot pass on the status 75 (torchrun exits 1). A loop that
    returned before its last step, or ``sys.exit`` inside it, raises instead of returning 0.
    """

    bind_checkpoint_writers()  # no checkpoint-writer process outlives this one
    cfg = load_config(config, list(overrides))
    with (
        disk_full_is_one_line("the training run"),
        run_dir_lock(cfg),
    ):  # rank 0, before the marker of an earlier launch is removed
        return run_with_preemption_marker(cfg.logging.run_dir, lambda: train(cfg))


def filter_phase(s: TrainingSetup, batch, timer: PhaseTimer):
    """Dynamic sampling (``rollout.filter_uniform_groups``, timed as ``filter``): the groups the
    update sees, None when there is none on any rank; the batch itself when the filter is off."""
    r = s.cfg.rollout
    if not r.filter_uniform_groups:
        return batch
    with timer("filter"):
        return filter_uniform_groups(
            batch, r.group_size, dp_rank=s.dp_rank, dp_size=s.dp_size, limit=r.prompts_per_step
        )


def no_update(s: TrainingSetup, step: int, logger) -> Dict[str, Any]:
    """A step whose every group was dropped: no optimizer update on any rank (nothing to learn;
    not a skipped update), the LR schedule advances as if the updates had run."""
    inner = s.cfg.algo.inner_iterations
    s.scheduler.step(increment=lr_steps_before(s.cfg.optim.lr_step, step * inner, inner))
    logger.info(
        f"step {step + 1}: every group had identical rewards, so rollout.filter_uniform_groups dropped "
        f"them all: no optimizer update this step (the LR schedule advances)"
    )
    return {"skipped_updates": 0.0, "update_skips": []}


def rollout_phase(s: TrainingSetup, step: int, logger=None):
    """Phase 1: this rank's prompts of ``step``, ``group_size`` completions each. The rows per
    decoding forward chosen at the first rollout (``rollout.decode_rows`` unset) are kept for the
    run and logged once."""
    r = s.cfg.rollout
    unit = math.lcm(s.cfg.parallel.micro_batch_size, r.group_size)
    chosen = s.decode_rows if s.decode_rows and s.decode_rows % unit == 0 else None  # (a bench may change mb)
    with phase_model(s.model) as model:
        batch = generate_rollouts(
            model,
            s.tokenizer,
            s.task,
            s.prompts.for_step(step),
            group_size=r.group_size,
            gen_length=r.gen_length,
            steps=r.steps,
            block_length=r.block_length,
            temperature=r.temperature,
            threshold=r.threshold,
            micro_batch=s.cfg.parallel.micro_batch_size,
            chunk_generator=chunk_generators(s.cfg, step, model_device(s.model))("rollout"),
            first_chunk=first_chunk(s),
            cache=r.cache,
            measure_cache_gap=bool(r.cache_gap_every) and (step + 1) % r.cache_gap_every == 0,
            compile=r.compile,
            decode_rows=r.decode_rows if r.decode_rows is not None else chosen,
        )
    if chosen is None:
        s.decode_rows = int(batch.stats["rollout_decode_rows"])
        if logger is not None:
            how = "rollout.decode_rows" if r.decode_rows is not None else "the memory left for decoding"
            logger.info(f"rollouts decode {s.decode_rows} rows per forward (set by {how})")
    if batch.stats.get("rollout_compile_s") and logger is not None:
        logger.info(
            f"step {step + 1}: compiled the rollout's decoding graphs in {batch.stats['rollout_compile_s']:.1f} s "
            f"(rollout.compile={r.compile}; once per shape and process)"
        )
    return batch


def old_logp_phase(s: TrainingSetup, batch, spec: LikelihoodSpec, step: int):
    """Phase 3: masks drawn and the old policy scored (per iteration with ``per_iteration``)."""
    chunks = chunk_generators(s.cfg, step, model_device(s.model))
    with phase_model(s.model) as model:
        return old_policy_likelihood(
            model,
            batch,
            spec,
            micro_batch=s.cfg.parallel.micro_batch_size,
            mask_id=s.model.dllm_config.mask_token_id,
            chunk_generator=chunks("masks"),
            first_chunk=first_chunk(s),
            sampling=s.cfg.algo.mask_sampling,
            iteration_generators=lambda k: chunks(f"masks/iter{k}"),
            iterations=s.cfg.algo.inner_iterations,
        )
