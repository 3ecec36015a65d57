"""SIGUSR1/SIGTERM pre-emption: caught on every rank, agreed at the step's end, exit status 75 and the PREEMPTED marker."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any, Callable

import torch

from stabledrl_mcore.parallel.bootstrap import any_rank
from stabledrl_mcore.parallel.launch import take_held_signals

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "stopped early on purpose; requeue me"


_PREEMPTION = {"caught": False, "installed": False}


def install_preemption_handlers() -> None:
    """Catch SIGUSR1/SIGTERM from now on (call early: a signal during start-up is kept too)."""

    if _PREEMPTION["installed"] or threading.current_thread() is not threading.main_thread():
        return
    for name in ("SIGUSR1", "SIGTERM"):
        signal.signal(getattr(signal, name), lambda signum, frame: _PREEMPTION.update(caught=True))
    _PREEMPTION["installed"] = True

    if take_held_signals():  # forwarded by the --nproc launcher while this rank was starting
        _PREEMPTION["caught"] = True


def preemption_agreed() -> bool:
    """True on every rank once any rank caught a pre-emption signal."""
    return any_rank(_PREEMPTION["caught"])


PREEMPTED_MARKER = "PREEMPTED"  # in the run directory: the last launch ended by a pre-emption


def run_with_preemption_marker(run_dir: str, run: Callable[[], Any]) -> int:
    """``run()`` (a training loop returning its set-up); 0, or :data:`EXIT_PREEMPTED` with rank 0
    leaving ``<run_dir>/PREEMPTED`` (an earlier launch's marker is removed first)."""

    marker = os.path.join(run_dir, PREEMPTED_MARKER)
    try:
        os.remove(marker)  # every rank may try: the first one wins
    except FileNotFoundError:
        pass
    if not run().preempted:
        return 0
    if torch.distributed.get_rank() == 0:
        with open(marker, "w") as handle:
            handle.write(json.dumps({"exit_status": EXIT_PREEMPTED, "time": time.time()}) + "\n")
    return EXIT_PREEMPTED
