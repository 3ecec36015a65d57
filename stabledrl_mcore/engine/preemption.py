"""SIGUSR1/SIGTERM pre-emption: caught on every rank, agreed at the step's end, exit status 75 and the PREEMPTED marker.

A SIGTERM that arrives during a checkpoint write also tells the writer
(:func:`~stabledrl_mcore.checkpoint.writers.watch_termination`): a write that has not ended
:data:`~stabledrl_mcore.checkpoint.writers.TERM_GRACE_S` later is stopped with a
``CheckpointError``, so the rank exits within seconds instead of being killed mid-wait (the
pre-emption checkpoint, written after the signal, keeps its whole time limit).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from stabledrl_mcore.checkpoint.writers import watch_termination
from stabledrl_mcore.common.errors import RunFailed
from stabledrl_mcore.engine.run_lock import launch_rank
from stabledrl_mcore.parallel.bootstrap import any_rank
from stabledrl_mcore.parallel.launch import take_held_signals

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "stopped early on purpose; requeue me"


_PREEMPTION = {"caught": False, "installed": False, "terms": 0}


def install_preemption_handlers() -> None:
    """Catch SIGUSR1/SIGTERM from now on (call early: a signal during start-up is kept too)."""

    if _PREEMPTION["installed"] or threading.current_thread() is not threading.main_thread():
        return
    for name in ("SIGUSR1", "SIGTERM"):
        signal.signal(getattr(signal, name), _caught)
    _PREEMPTION["installed"] = True
    watch_termination(terminations)

    held = take_held_signals()
    if held:  # forwarded by the --nproc launcher while this rank was starting
        _PREEMPTION["caught"] = True
        _PREEMPTION["terms"] = terminations() + held.count(signal.SIGTERM)


def _caught(signum, frame) -> None:
    _PREEMPTION["caught"] = True
    if signum == signal.SIGTERM:
        _PREEMPTION["terms"] = terminations() + 1


def terminations() -> int:
    """SIGTERMs received so far (the job is being ended, not warned): a checkpoint write in progress
    when one arrives gets seconds (:func:`~stabledrl_mcore.checkpoint.writers.watch_termination`)."""
    return int(_PREEMPTION.get("terms", 0))


def preemption_agreed() -> bool:
    """True on every rank once any rank caught a pre-emption signal."""
    return any_rank(_PREEMPTION["caught"])


PREEMPTED_MARKER = "PREEMPTED"  # in the run directory: the last launch ended by a pre-emption
FINISHED_MARKER = "FINISHED"  # in the run directory: the last launch ran its loop to the last step


def marker_record(exit_status: int = EXIT_PREEMPTED) -> dict:
    """What rank 0 writes into ``PREEMPTED`` / ``FINISHED``: the status, the time, and the SLURM job
    and restart count (so slurm/common.sh believes only its own attempt's marker, never an earlier
    one's)."""
    return {
        "exit_status": exit_status,
        "time": time.time(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
        "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT") or "0",
    }


def run_with_preemption_marker(run_dir: str, run: Callable[[], Any]) -> int:
    """``run()`` (a training loop returning its set-up); 0 once it ``finished``, with rank 0 leaving
    ``<run_dir>/FINISHED``, or :data:`EXIT_PREEMPTED` with rank 0 leaving ``<run_dir>/PREEMPTED``.
    A launcher that sees status 0 from every rank (srun, torchrun) cannot tell a finished run from
    ``os._exit(0)`` in user code; ``FINISHED`` of this attempt can (slurm/common.sh requires it).
    Rank 0 removes an earlier launch's markers first (call it holding the run directory's lock:
    :func:`~.run_lock.run_dir_lock`; other ranks touch nothing). A loop that returned neither
    finished nor pre-empted, or ``sys.exit`` inside it (:func:`exits_are_errors`), is
    :class:`~stabledrl_mcore.common.errors.RunFailed`: a rank never exits 0 having trained part."""

    if launch_rank() == 0:
        for marker in (PREEMPTED_MARKER, FINISHED_MARKER):
            try:
                os.remove(os.path.join(run_dir, marker))
            except FileNotFoundError:
                pass
    with exits_are_errors():
        setup = run()
    if not setup.preempted and not setup.finished:
        raise RunFailed(
            "the training loop returned before its last step without being pre-empted; "
            "the run did not finish, so this rank does not exit 0"
        )
    status, marker = (EXIT_PREEMPTED, PREEMPTED_MARKER) if setup.preempted else (0, FINISHED_MARKER)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(run_dir, marker), "w") as handle:
            handle.write(json.dumps(marker_record(status)) + "\n")
    return status


@contextmanager
def exits_are_errors(what: str = "the training run") -> Iterator[None]:
    """``sys.exit`` / ``SystemExit`` raised inside the block (e.g. by user code such as a custom
    reward function) becomes :class:`~stabledrl_mcore.common.errors.RunFailed`: under torchrun or
    srun a rank's status is the process's, and ``sys.exit(0)`` there would end a run that trained
    part or nothing "successfully"."""
    try:
        yield
    except SystemExit as err:
        raise RunFailed(
            f"sys.exit({err.code!r}) was called inside {what} (by user code, e.g. rollout.reward_fn?); "
            f"it stopped before its last step, so this rank fails instead of exiting "
            f"{err.code if isinstance(err.code, int) else 0}"
        ) from err
