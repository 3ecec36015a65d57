"""Run directories and checkpoint histories: never silently reused, never mixed, nothing complete deleted.

* A fresh run (``checkpoint.resume: none``, or ``auto`` with no checkpoint yet) refuses a
  ``logging.run_dir`` that holds ``metrics.jsonl`` or a checkpoint root that holds
  checkpoints (:class:`RunDirInUseError`, one line naming the directory and the two fixes:
  ``--resume auto|PATH`` or ``--overwrite``). The check reads only, so the CLI runs it before
  any rank starts and :func:`~..rl.trainer.train` again before it builds anything.
* ``--overwrite`` (``checkpoint.overwrite``) moves the old run's outputs aside, never deletes:
  ``metrics.jsonl``, ``config.yaml``, ``wandb/``, ``wandb_run_id`` (the next run starts a new wandb
  run), ``tensorboard/``, ``checkpoint_timing.json``, ``samples/`` and a tokenizer the run trained go to
  ``<run_dir>/attic/overwritten-<UTC>/``; the checkpoints (``step_*``, ``.tmp-step_*``,
  ``abandoned-*``) to ``<checkpoint root>/overwritten-<UTC>/``.
* A resume from step ``k`` continues the history of ``step_k``: checkpoints of later steps at
  the top of the root (an abandoned branch, e.g. ``step_6`` when resuming from ``step_2``) are
  moved into ``<root>/abandoned-<UTC>-after-step_k/`` once the load has succeeded, so
  :func:`~stabledrl_mcore.checkpoint.state.find_latest` and ``keep_last`` only ever see the current history (pruning
  happens only after the next checkpoint is committed, so the source survives until then),
  and ``metrics.jsonl`` keeps its lines of steps ``<= k`` (the old file goes to
  ``<run_dir>/attic/resumed-<UTC>-at-step_k/``). A resume from a checkpoint outside the root
  into a root that already holds checkpoints is refused (two histories would mix).
* A resume first deletes the root's ``.tmp-step_*``: saves of an earlier launch that never
  committed (:func:`remove_unfinished_saves`; the only deletion, of nothing a resume could read).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import List, Optional

from stabledrl_mcore.checkpoint.state import STEP_DIR, step_dir_name
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.schema import RunConfig
from stabledrl_mcore.engine.metrics import keep_steps_through

ATTIC = "attic"
METRICS_FILE = "metrics.jsonl"


class RunDirInUseError(ConfigError):
    """A fresh run pointed at a directory that holds another run (one line, names the fixes)."""


def checkpoint_root(cfg: RunConfig) -> str:
    return cfg.checkpoint.dir or os.path.join(cfg.logging.run_dir, "checkpoints")


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _unique(path: str) -> str:
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


def _checkpoint_entries(root: str) -> List[str]:
    """Names of checkpoints (complete or in progress) at the top of ``root``."""
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if STEP_DIR.match(n) or n.startswith(".tmp-step_"))


def run_in_use(cfg: RunConfig) -> List[str]:
    """What in ``cfg``'s run directory / checkpoint root belongs to an earlier run."""
    found = []
    metrics = os.path.join(cfg.logging.run_dir, METRICS_FILE)
    if os.path.isfile(metrics):
        found.append(metrics)
    root = checkpoint_root(cfg)
    entries = _checkpoint_entries(root)
    if entries:
        shown = ", ".join(entries[-3:]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        found.append(f"{root} ({shown})")
    return found


def resume_requested(resume: Optional[str]) -> bool:
    return bool(resume) and resume != "none"


def check_run_dir(cfg: RunConfig, resume: Optional[str] = None) -> None:
    """Refuse (read-only) a fresh run into a used directory, or a resume that would mix
    histories; ``resume`` defaults to ``cfg.checkpoint.resume``."""
    resume = resume or cfg.checkpoint.resume
    root = checkpoint_root(cfg)
    if cfg.checkpoint.overwrite and resume_requested(resume):
        raise ConfigError(
            f"checkpoint.overwrite (--overwrite) starts a fresh run; it cannot be combined "
            f"with checkpoint.resume={resume}"
        )
    if resume_requested(resume):  # auto without a checkpoint starts afresh: metrics moved aside
        if resume != "auto":
            source = os.path.dirname(os.path.realpath(resume))
            if source != os.path.realpath(root) and _checkpoint_entries(root):
                raise RunDirInUseError(
                    f"cannot resume from {resume} into {root}: it holds checkpoints of another run "
                    f"({', '.join(_checkpoint_entries(root)[-2:])}); choose a fresh logging.run_dir "
                    f"(or checkpoint.dir), or resume from a checkpoint of {root}"
                )
        return
    used = run_in_use(cfg)
    if used and not cfg.checkpoint.overwrite:
        raise RunDirInUseError(
            f"run directory {cfg.logging.run_dir} holds an earlier run ({'; '.join(used)}); continue it "
            f"with --resume auto (or --resume PATH), or start afresh with --overwrite (moves it "
            f"aside, deletes nothing)"
        )


def prepare_run_dir(cfg: RunConfig, resume: Optional[str] = None, *, rank: int = 0) -> Optional[str]:
    """:func:`check_run_dir`, then on ``rank`` 0 with ``checkpoint.overwrite`` move the old run
    aside; returns the attic directory (or None). Other ranks only check."""
    resume = resume or cfg.checkpoint.resume
    if cfg.checkpoint.overwrite and rank != 0 and not resume_requested(resume):
        return None  # rank 0 may be moving the directory right now
    check_run_dir(cfg, resume)
    if rank != 0 or not cfg.checkpoint.overwrite or not run_in_use(cfg):
        return None
    return move_run_aside(cfg)


def move_run_aside(cfg: RunConfig) -> str:
    """Move the outputs of the run in ``cfg``'s directories aside (``--overwrite``)."""
    run_dir, root, stamp = cfg.logging.run_dir, checkpoint_root(cfg), _stamp()
    attic = _unique(os.path.join(run_dir, ATTIC, f"overwritten-{stamp}"))
    names = [METRICS_FILE, "config.yaml", "wandb", "wandb_run_id", "tensorboard", "checkpoint_timing.json", "samples"]
    if not cfg.model.tokenizer and not cfg.model.checkpoint:
        names.append("tokenizer")  # trained by that run on its task (rl/setup.resolve_tokenizer)
    for name in names:
        if os.path.exists(os.path.join(run_dir, name)):
            os.makedirs(attic, exist_ok=True)
            os.replace(os.path.join(run_dir, name), os.path.join(attic, name))
    entries = _checkpoint_entries(root)
    if os.path.isdir(root):
        entries += sorted(n for n in os.listdir(root) if n.startswith("abandoned-"))
    if entries:
        aside = _unique(os.path.join(root, f"overwritten-{stamp}"))
        os.makedirs(aside)
        for name in entries:
            os.replace(os.path.join(root, name), os.path.join(aside, name))
    return attic


def remove_unfinished_saves(root: str) -> List[str]:
    """Delete the ``.tmp-step_*`` directories at the top of ``root``: saves of an earlier launch of
    this run that never committed (a crash, a full disk). Call it holding the run directory's lock,
    before anything else is written (they may be what fills the disk). Returns their names."""
    stale = [n for n in _checkpoint_entries(root) if n.startswith(".tmp-step_")]
    for name in stale:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return stale


def abandon_later_steps(root: str, step: int) -> Optional[str]:
    """Move checkpoints of steps after ``step`` (another branch) aside; returns where, or None."""
    later = [
        os.path.join(root, n)
        for n in _checkpoint_entries(root)
        if STEP_DIR.match(n) and int(STEP_DIR.match(n).group(1)) > step
    ]  # complete or not
    if not later:
        return None
    aside = _unique(os.path.join(root, f"abandoned-{_stamp()}-after-{step_dir_name(step)}"))
    os.makedirs(aside)
    for path in later:
        os.replace(path, os.path.join(aside, os.path.basename(path)))
    return aside


def continue_metrics(run_dir: str, step: int) -> Optional[str]:
    """Keep ``metrics.jsonl``'s lines of steps ``<= step`` (all of it moved aside for step < 0);
    returns the attic copy of the old file when lines were dropped."""

    path = os.path.join(run_dir, METRICS_FILE)
    label = f"resumed-{_stamp()}-at-{step_dir_name(step)}" if step >= 0 else f"restarted-{_stamp()}"
    return keep_steps_through(path, step, _unique(os.path.join(run_dir, ATTIC, label)))
