"""Launch RL runs of an experiment and read their metrics back.

``run_in_process_ranks`` starts ``nproc`` local ranks of one run (gloo, one
thread each). ``run_side_by_side`` starts independent single-rank runs as
``stabledrl train`` subprocesses, ``parallel`` at a time, each logging to its
own file; on any failure or interrupt the children are stopped by PID.
"""

from __future__ import annotations

import json
import math
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
    on_poll: Optional[Callable[[], None]] = None,
) -> List[int]:
    """Run ``command(config)`` (default :func:`train_command`) per config, ``parallel`` at a time.

    Returns the exit codes. Each run's console goes to ``<its run dir>/train.log`` (appended:
    a resumed run keeps its earlier lines). ``on_poll()`` runs after every poll (progress lines).
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
                log = open(os.path.join(os.path.dirname(path), "train.log"), "a")
                logs.append(log)
                running[index] = subprocess.Popen(command(path), stdout=log, stderr=subprocess.STDOUT, env=env)
            for index, proc in list(running.items()):
                if proc.poll() is not None:
                    codes[index] = proc.returncode
                    del running[index]
            if on_poll is not None:
                on_poll()
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


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q``-th percentile (numpy's default rule)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def train_summary(rows: List[Dict[str, float]], *, window: int, collapse_drop: float) -> Dict[str, object]:
    """What every experiment reports of one run's training rows (those with ``reward_mean``):
    the steps, reward start/end (means of the first/last ``window`` steps, at most half the run
    each), ``collapsed`` (end < start - ``collapse_drop``), grad-norm max/p99/median over the
    finite values, mean clip fractions, skipped updates, and the reward and grad-norm curves."""
    train = [r for r in rows if "reward_mean" in r]
    rewards = [r["reward_mean"] for r in train]
    grads = [r.get("grad_norm", float("nan")) for r in train]
    finite = [g for g in grads if math.isfinite(g)]
    k = min(window, max(len(rewards) // 2, 1))
    start, end = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    mean = lambda key: sum(r.get(key, 0.0) for r in train) / max(len(train), 1)  # noqa: E731
    return {
        "steps": [r["step"] for r in train],
        "max_grad_norm": max(finite, default=float("nan")),
        "p99_grad_norm": percentile(finite, 99),
        "median_grad_norm": percentile(finite, 50),
        "reward_start": start,
        "reward_end": end,
        "reward_change": end - start,
        "collapsed": end < start - collapse_drop,
        "clip_frac_low": mean("clip_frac_low"),
        "clip_frac_high": mean("clip_frac_high"),
        "skipped_updates": sum(r.get("skipped_updates", 0.0) for r in train),
        "reward_curve": rewards,
        "grad_norm_curve": grads,
    }
