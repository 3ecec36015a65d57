"""Resuming with the current config: which checkpoint, whether it fits, what changed.

:func:`plan_resume` reads only small files (``train_state.json``, ``config.yaml``), so the CLI
runs it before any rank starts. The differences between the checkpoint's ``config.yaml`` and
the current config are listed as dotted keys (``optim.lr: 3e-05 -> 0.001``) and take effect:
the LR schedule is the current config's (only its progress, ``num_steps``, comes from the
checkpoint), as are ``steps``, ``eval.*``, ``logging.*``, ``checkpoint.*``, ``algo.*`` and
``rollout.*``. Refused by name: changes of :data:`FROZEN` keys (model shape and vocabulary,
initial weights, dtype, LoRA adapters, optimizer kind) and a synced KL reference the checkpoint does not
hold; the model shape is also compared field by field with ``model_config.json`` once the
model is built (:func:`check_model_config`). A parallel layout the distributed optimizer's state
cannot be read at (another TP size; another PP size without its bucket map) is refused from
``optimizer_format.json`` (:func:`check_optimizer_layout`). A checkpoint past ``steps`` is refused; one
exactly at ``steps`` means the run is complete (the trainer says so and exits 0, so a
requeued finished job does not fail).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import yaml

from stabledrl_mcore.checkpoint.integrity import CheckpointError, check_verifiable
from stabledrl_mcore.checkpoint.optimizer_state import MAP_FIELD, read_format
from stabledrl_mcore.checkpoint.state import TrainState, find_latest, load_checkpoint, read_train_state
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.config.schema import RunConfig
from stabledrl_mcore.engine.run_dir import (
    abandon_later_steps,
    check_run_dir,
    checkpoint_root,
    continue_metrics,
    prepare_run_dir,
    remove_unfinished_saves,
    resume_requested,
)
from stabledrl_mcore.models.lora import checkpointed
from stabledrl_mcore.parallel.bootstrap import detect_launch_env

FROZEN = (
    "model.preset",
    "model.checkpoint",
    "model.tokenizer",
    "model.dtype",
    "model.overrides",
    "model.lora",
    "optim.name",
    "optim.distributed",
)
NOT_COMPARED = ("checkpoint.resume", "checkpoint.overwrite")
UNSET = "<unset>"


class ResumeConfigError(ConfigError):
    """The current config cannot continue this checkpoint (one line, names the key and the fix)."""


@dataclass
class ResumePlan:
    path: str
    state: TrainState
    steps: int
    """The current config's ``steps``."""
    changes: List[Tuple[str, Any, Any]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.state.step >= self.steps

    def describe_changes(self) -> str:
        return "; ".join(f"{key}: {_show(old)} -> {_show(new)}" for key, old, new in self.changes)


def _show(value: Any) -> str:
    return UNSET if value is UNSET else json.dumps(value) if isinstance(value, (str, list, dict)) else str(value)


def _flatten(data: Dict[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    for key, value in data.items():
        if isinstance(value, dict):  # an empty mapping (e.g. no model.overrides) adds no key
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def config_changes(saved: Dict[str, Any], current: Dict[str, Any]) -> List[Tuple[str, Any, Any]]:
    """``(dotted key, old, new)`` for every difference (``UNSET`` where a side lacks the key)."""
    old, new = dict(_flatten(saved)), dict(_flatten(current))
    return [
        (key, old.get(key, UNSET), new.get(key, UNSET))
        for key in sorted(set(old) | set(new))
        if key not in NOT_COMPARED and old.get(key, UNSET) != new.get(key, UNSET)
    ]


def _as_saved(cfg: RunConfig) -> Dict[str, Any]:
    """``cfg`` as a checkpoint's ``config.yaml`` holds it (YAML types: lists, not tuples)."""

    return yaml.safe_load(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def read_saved_config(path: str) -> Optional[Dict[str, Any]]:

    file = os.path.join(path, "config.yaml")
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as handle:
            data = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError) as err:
        raise CheckpointError(f"{file} is unreadable ({err}); the checkpoint is corrupt") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} is not a config mapping; the checkpoint is corrupt")
    return data


def resolve_checkpoint(cfg: RunConfig, resume: Optional[str] = None) -> Optional[str]:
    """The checkpoint ``resume`` (default ``cfg.checkpoint.resume``) names, or None."""
    resume = resume or cfg.checkpoint.resume
    if not resume_requested(resume):
        return None
    if resume == "auto":
        return find_latest(checkpoint_root(cfg))
    return resume


def _synced_reference(section: Dict[str, Any]) -> bool:
    algo = section.get("algo") or {}
    return bool(algo.get("kl_coef")) and bool(algo.get("reference_sync_every"))


def plan_resume(cfg: RunConfig, resume: Optional[str] = None) -> Optional[ResumePlan]:
    """Check that ``cfg`` can continue the checkpoint it resumes from; None for a fresh start."""
    path = resolve_checkpoint(cfg, resume)
    if path is None:
        return None
    state = read_train_state(path)
    check_verifiable(path, trust_unverified=cfg.checkpoint.trust_unverified)  # no hashing: load_checkpoint does
    if state.step > cfg.steps:
        raise ResumeConfigError(
            f"checkpoint {path} is at step {state.step}, past steps={cfg.steps}; "
            f"raise steps (e.g. steps={state.step + max(cfg.steps, 1)}) to continue it"
        )
    current = _as_saved(cfg)
    saved = read_saved_config(path)
    changes = config_changes(saved, current) if saved is not None else []
    frozen = [(k, o, n) for k, o, n in changes if any(k == f or k.startswith(f + ".") for f in FROZEN)]
    if frozen:
        shown = "; ".join(f"{k}: {_show(o)} -> {_show(n)}" for k, o, n in frozen)
        raise ResumeConfigError(
            f"cannot resume {path} with a changed {shown} (the model, its vocabulary "
            f"or the optimizer would not match); set it back, or start a new run "
            f"from the weights with model.checkpoint={path}"
        )
    check_optimizer_layout(cfg, path)
    if saved is not None and _synced_reference(current) and not _synced_reference(saved):
        raise ResumeConfigError(
            f"cannot resume {path} with algo.kl_coef>0 and algo.reference_sync_every>0: "
            f"the checkpoint holds no synced reference policy; set "
            f"algo.reference_sync_every=0 or start a new run"
        )
    return ResumePlan(path, state, cfg.steps, changes)


def check_optimizer_layout(cfg: RunConfig, path: str) -> None:
    """Refuse, before any rank starts, a layout the checkpoint's distributed-optimizer state cannot
    be read at (:mod:`~stabledrl_mcore.checkpoint.optimizer_reshard`: another PP size needs its bucket map, TP must match)."""

    fmt = read_format(path)
    if fmt.get("kind") != "distributed":
        return
    fresh = f"or start the optimizer afresh from these weights with model.checkpoint={path} and no resume"
    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    if fmt.get("tensor_parallel") != tp:
        raise ResumeConfigError(
            f"cannot resume {path} at parallel.tensor_parallel={tp}: its distributed-optimizer "
            f"state was saved at tensor_parallel={fmt.get('tensor_parallel')} and reshards across "
            f"data- and pipeline-parallel sizes only; set parallel.tensor_parallel="
            f"{fmt.get('tensor_parallel')}, {fresh}"
        )
    if fmt.get("pipeline_parallel") != pp and MAP_FIELD not in fmt:
        raise ResumeConfigError(
            f"cannot resume {path} at parallel.pipeline_parallel={pp}: its distributed-optimizer "
            f"state predates the bucket map that a pipeline-parallel change needs (saved at "
            f"pipeline_parallel={fmt.get('pipeline_parallel')}); set parallel.pipeline_parallel="
            f"{fmt.get('pipeline_parallel')}, {fresh}"
        )


def check_model_config(path: str, model_config: Dict[str, Any]) -> None:
    """Refuse a checkpoint whose ``model_config.json`` differs from the built model's config."""
    file = os.path.join(path, "model_config.json")
    if not os.path.isfile(file):
        return
    try:
        with open(file) as handle:
            saved = json.load(handle)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file} is unreadable ({err}); the checkpoint is corrupt") from None
    current = json.loads(json.dumps(model_config))
    differ = [k for k in sorted(set(saved) | set(current)) if saved.get(k, UNSET) != current.get(k, UNSET)]
    if differ:
        shown = ", ".join(f"{k} {_show(saved.get(k, UNSET))} -> {_show(current.get(k, UNSET))}" for k in differ[:6])
        raise ResumeConfigError(
            f"cannot resume {path}: the model differs from the checkpoint's ({shown}); "
            f"resume with the model settings it was saved with"
        )


def check_resume(cfg: RunConfig) -> Optional[ResumePlan]:
    """Every start-up refusal that reads only files (run directory, resume plan): the CLI calls
    it before any rank starts; :func:`~..rl.trainer.train` repeats it."""
    check_run_dir(cfg)
    return plan_resume(cfg)


def prepare_start(cfg: RunConfig, resume: Optional[str] = None):
    """The refusals of a run's start (read-only but for ``--overwrite`` and, on a resume, the
    unfinished ``.tmp-step_*`` saves of an earlier launch, on rank 0), before any model is built.
    Returns ``(resume plan or None for a fresh start, console messages)``."""

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else detect_launch_env().rank
    moved = prepare_run_dir(cfg, resume, rank=rank)
    notes = (
        [
            f"--overwrite: the earlier run in {cfg.logging.run_dir} was moved aside (run files to {moved}, "
            f"checkpoints to {checkpoint_root(cfg)}/overwritten-*)"
        ]
        if moved
        else []
    )
    if rank == 0 and resume_requested(resume or cfg.checkpoint.resume):  # first: they may fill the disk
        stale = remove_unfinished_saves(checkpoint_root(cfg))
        if stale:
            notes.append(f"removed {', '.join(stale)} in {checkpoint_root(cfg)}: unfinished saves of an earlier launch")
    return plan_resume(cfg, resume), notes


def restore_training_state(s, root: str, plan: Optional[ResumePlan], *, extra_modules=None):
    """Load the plan's checkpoint with the current config's hyper-parameters and LR schedule (its
    progress from the checkpoint); on rank 0 move the abandoned history aside. Returns
    ``(start step, messages for the console)``."""
    rank0 = torch.distributed.get_rank() == 0
    if plan is None:
        moved = continue_metrics(s.cfg.logging.run_dir, -1) if rank0 else None  # --resume auto, no checkpoint
        return 0, [f"no checkpoint to resume: starting at step 0 (old metrics moved to {moved})"] if moved else []
    check_model_config(plan.path, s.model.dllm_config.to_dict())
    fresh = [{k: v for k, v in group.items() if k not in ("params", "step")} for group in s.optimizer.param_groups]
    state = load_checkpoint(
        plan.path,
        checkpointed(s.model),
        optimizer=s.optimizer,
        extra_modules=extra_modules,
        trust_unverified=s.cfg.checkpoint.trust_unverified,
    )
    for group, hyper in zip(s.optimizer.param_groups, fresh):
        group.update(hyper)  # lr bounds, betas, weight decay: the current config's
    if state.scheduler:  # the current schedule, advanced to the checkpoint's progress
        s.scheduler.step(increment=int(state.scheduler["num_steps"]))
    notes = [f"resumed from {plan.path} at step {state.step}"]
    if plan.changes:
        notes.append(f"config changed since that checkpoint (now in effect): {plan.describe_changes()}")
    if plan.complete:
        notes.append(
            f"run already complete: {plan.path} is at steps={plan.steps}; nothing to train (raise steps to continue)"
        )
    if rank0:
        aside = abandon_later_steps(root, state.step)
        if aside:
            notes.append(f"later checkpoints of the abandoned history moved to {aside}")
        moved = continue_metrics(s.cfg.logging.run_dir, state.step)
        if moved:
            notes.append(f"metrics.jsonl now ends at step {state.step} (the old file is kept at {moved})")
    torch.distributed.barrier()
    return state.step, notes
