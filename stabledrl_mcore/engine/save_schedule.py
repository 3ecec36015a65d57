"""When the trainer checkpoints, and how long a checkpoint takes.

A step ends with a save when it is the last step, a pre-emption was agreed, ``step`` is a
multiple of ``checkpoint.save_every``, or ``checkpoint.save_every_minutes`` have passed on
rank 0's clock since the last save (rank 0 decides and broadcasts, so every rank saves the
same step whatever its own clock says). A pre-emption signal that arrives during a save stops the
run right after it (:meth:`SaveSchedule.save_if_due`): that checkpoint is the step's.

Every save is timed; rank 0 keeps the newest measurement in ``<run_dir>/checkpoint_timing.json``
(``save_s``, the slowest ``max_save_s``, ``step_s``). A pre-emption signal arrives
``checkpoint.preemption_lead_s`` seconds before the hard kill (SLURM ``--signal=...@N``); the ranks
first finish the current step, then save, so the lead must cover one step plus the save. The
trainer warns (once per launch) when it is shorter than ``step_s + 2 * save_s``, at start from an
earlier launch's measurement and after each save.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Optional

import torch
import yaml

from stabledrl_mcore.checkpoint.state import TrainState, save_checkpoint
from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.engine.model_setup import synced_reference
from stabledrl_mcore.engine.preemption import preemption_agreed
from stabledrl_mcore.models.lora import checkpointed
from stabledrl_mcore.parallel.bootstrap import comm_device

TIMING_FILE = "checkpoint_timing.json"

clock: Callable[[], float] = time.monotonic
"""Rank 0's clock for ``save_every_minutes`` (module level, so tests can put a fake one in)."""


def rank0_decides(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a broadcast; the flag itself when not distributed)."""
    if not torch.distributed.is_initialized():
        return flag

    value = torch.tensor([1.0 if flag else 0.0], device=comm_device())
    torch.distributed.broadcast(value, src=0)
    return bool(value.item() > 0)


def margin_warning(timing: dict, lead_s: Optional[float]) -> Optional[str]:
    """The warning for a pre-emption lead that cannot cover a step and twice the save, or None."""
    if not lead_s or not timing:
        return None
    save_s, step_s = float(timing.get("max_save_s", timing.get("save_s", 0.0))), float(timing.get("step_s", 0.0))
    needed = step_s + 2.0 * save_s
    if lead_s >= needed:
        return None
    return (
        f"warning: the pre-emption lead time is {lead_s:.0f} s (checkpoint.preemption_lead_s, from SLURM "
        f"--signal=...@N), but finishing a step ({step_s:.0f} s) and saving ({save_s:.0f} s measured, x2 "
        f"margin) needs {needed:.0f} s: a pre-emption may be killed before its checkpoint is complete; "
        f"raise --signal to at least USR1@{int(needed) + 1} or save more often (checkpoint.save_every_minutes)"
    )


def read_timing(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, TIMING_FILE)) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


class SaveSchedule:
    """``due(step, end, preempted=...)`` on every rank after each step; ``save(fn, step, step_s)``
    runs and times a save. ``logger`` is the run's (a no-op off rank 0)."""

    def __init__(self, checkpoint, run_dir: str, logger, *, rank: int = 0):
        self.every, self.minutes = checkpoint.save_every, checkpoint.save_every_minutes
        self.lead_s, self.run_dir, self.logger, self.rank = checkpoint.preemption_lead_s, run_dir, logger, rank
        self.last_save = clock()
        self.warned = False
        self._warn(read_timing(run_dir) if rank == 0 else {})

    def due(self, step: int, end: int, *, preempted: bool) -> bool:
        if preempted or step == end or (self.every and step % self.every == 0):
            return True  # the same answer on every rank
        if not self.minutes:
            return False
        return rank0_decides(self.rank == 0 and clock() - self.last_save >= 60.0 * self.minutes)

    def save_if_due(
        self,
        write: Callable[[], object],
        step: int,
        end: int,
        step_s: Optional[float] = None,
        *,
        preempted: bool,
        stop_early: bool = False,
    ) -> bool:
        """Save after ``step`` when :meth:`due` (a pre-emption, ``stop_early``, the last step, ...);
        returns whether the run stops here pre-empted: ``preempted``, or a signal caught during the
        save (agreed on every rank; the checkpoint just written is this step's)."""
        if not self.due(step, end, preempted=preempted or stop_early):
            return preempted
        self.save(write, step, step_s)
        return preempted or preemption_agreed()

    def save(self, write: Callable[[], object], step: int, step_s: Optional[float] = None):
        start = time.perf_counter()
        result = write()
        seconds = time.perf_counter() - start
        self.last_save = clock()
        if self.rank == 0:
            earlier = read_timing(self.run_dir)
            timing = {
                "step": step,
                "save_s": round(seconds, 3),
                "step_s": round(float(step_s or 0.0), 3),
                "max_save_s": round(max(seconds, float(earlier.get("max_save_s", 0.0))), 3),
                "time": time.time(),
            }
            _write_json(os.path.join(self.run_dir, TIMING_FILE), timing)
            self._warn(timing)
        return result

    def _warn(self, timing: dict) -> None:
        message = None if self.warned else margin_warning(timing, self.lead_s)
        if message:
            self.logger.info(message)
            self.warned = True


def _write_json(path: str, data: dict) -> None:
    part = f"{path}.part"
    with open(part, "w") as handle:
        json.dump(data, handle)
        handle.write("\n")
    os.replace(part, path)


def save_training_checkpoint(s, root: str, step: int) -> str:

    state = TrainState(
        step=step,
        data_position=s.prompts.position(step),
        scheduler=s.scheduler.state_dict(),
        world_size=torch.distributed.get_world_size(),
        tensor_parallel=s.cfg.parallel.tensor_parallel,
        pipeline_parallel=s.cfg.parallel.pipeline_parallel,
    )
    model_config = json.dumps(s.model.dllm_config.to_dict(), indent=2, sort_keys=True)
    assets = {"hf": s.tokenizer.path} if s.tokenizer.path else None
    return save_checkpoint(
        root,
        state,
        checkpointed(s.model).sharded_state_dict,
        optimizer=s.optimizer,
        config_yaml=yaml.safe_dump(to_dict(s.cfg), sort_keys=False),
        keep_last=s.cfg.checkpoint.keep_last,
        extra_files={"model_config.json": model_config},
        assets=assets,
        extra_modules=synced_reference(s),
        write_timeout_s=s.cfg.checkpoint.write_timeout_s,
    )
