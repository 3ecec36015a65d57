"""Launch RL runs of an experiment and read their metrics back.

``run_in_process_ranks`` starts ``nproc`` local ranks of one run (gloo, one
thread each). ``run_side_by_side`` starts independent single-rank runs as
``stabledrl train`` subprocesses, ``parallel`` at a time, each logging to its
own file; on any failure or interrupt the children are stopped by PID.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from stabledrl_mcore.config.schema import load_config, save_config
from stabledrl_mcore.parallel.launch import spawn
from stabledrl_mcore.rl.trainer import train_rank


def write_run_config(run_dir: str, overrides: Sequence[str], config: Optional[str] = None) -> str:
    """Resolve ``config`` (or the defaults) plus ``overrides`` into ``run_dir/rl_config.yaml``
    (validated) and return its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "rl_config.yaml")
    save_config(load_config(config, list(overrides)), path)
    return path


def run_in_process_ranks(config_path: str, nproc: int) -> None:
    """``stabledrl train --config config_path --nproc nproc`` without a new interpreter for the launcher."""

    spawn(train_rank, nproc, (config_path, ()), timeout=float("inf"), threads=1)


def train_command(config_path: str) -> List[str]:
    """``stabledrl train`` of one config, without progress bars (its console goes to a log file)."""
    return [sys.executable, "-m", "stabledrl_mcore.cli", "train", "--config", config_path, "logging.progress=false"]


def run_side_by_side(
    config_paths: Sequence[str],
    *,
    parallel: int = 2,
    poll: float = 1.0,
    command: Optional[Callable[[str], List[str]]] = None,
) -> List[int]:
    """Run ``command(config)`` (default :func:`train_command`) per config, ``parallel`` at a time.

    Returns the exit codes. Each run's console goes to ``<its run dir>/train.log``.
    """
    command = command or train_command
    pending = list(enumerate(config_paths))
    running: Dict[int, subprocess.Popen] = {}
    codes: List[int] = [0] * len(config_paths)
    logs = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        while pending or running:
            while pending and len(running) < parallel:
                index, path = pending.pop(0)
                log = open(os.path.join(os.path.dirname(path), "train.log"), "w")
                logs.append(log)
                running[index] = subprocess.Popen(command(path), stdout=log, stderr=subprocess.STDOUT, env=env)
            for index, proc in list(running.items()):
                if proc.poll() is not None:
                    codes[index] = proc.returncode
                    del running[index]
            time.sleep(poll)
    finally:
        for proc in running.values():  # interrupted: stop what we started, by PID
            proc.kill()
            proc.wait()
        for log in logs:
            log.close()
    return codes


def read_metrics(run_dir: str) -> List[Dict[str, float]]:
    """The run's ``metrics.jsonl`` rows."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def eval_history(rows: List[Dict[str, float]]) -> List[tuple]:
    """``[(step, test_accuracy), ...]`` of the held-out evaluations."""
    return [(r["step"], r["test_accuracy"]) for r in rows if "test_accuracy" in r]


def mean_of_last(values: Sequence[float], count: int) -> float:
    """Mean of the last ``count`` values (all of them when fewer)."""
    tail = list(values)[-count:]
    return sum(tail) / len(tail)
