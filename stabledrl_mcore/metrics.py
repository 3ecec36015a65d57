"""One metrics logger: compact console lines, a JSONL file and wandb; a no-op twin for other ranks.

``create_logger(run_dir, ...)`` returns a :class:`MetricsLogger` on rank 0 and a
:class:`NullLogger` everywhere else, so training code logs unconditionally.
wandb runs offline by default (``WANDB_MODE=offline`` semantics, files under
``<run_dir>/wandb``); ``mode="online"`` syncs, ``"disabled"`` skips it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Dict, Iterable, Optional, TextIO


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class NullLogger:
    """Accepts everything, writes nothing (non-zero ranks, tests)."""

    def log(self, step: int, metrics: Dict[str, Any], *, console: bool = True) -> None:
        pass

    def info(self, message: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class MetricsLogger(NullLogger):
    """Rank-0 logger. ``console_keys`` chooses what the compact console line shows."""

    def __init__(self, run_dir: str, *, config: Optional[Dict[str, Any]] = None,
                 wandb_mode: str = "offline", wandb_project: str = "stabledrl",
                 run_name: Optional[str] = None, console_keys: Iterable[str] = (),
                 stream: Optional[TextIO] = None, jsonl_name: str = "metrics.jsonl"):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, jsonl_name)
        self._jsonl = open(self.path, "a", buffering=1)
        self._stream = stream  # None: sys.stdout as it is when a line is written
        self._console_keys = tuple(console_keys)
        self._start = time.time()
        self._wandb = None
        if wandb_mode != "disabled":
            self._wandb = self._start_wandb(run_dir, config, wandb_mode, wandb_project, run_name)

    @staticmethod
    def _start_wandb(run_dir, config, mode, project, name):
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb
        except ImportError:  # pragma: no cover - wandb is a hard dependency
            return None
        return wandb.init(project=project, name=name, dir=run_dir, mode=mode, config=config or {},
                          reinit="finish_previous")

    def log(self, step: int, metrics: Dict[str, Any], *, console: bool = True) -> None:
        record = {"step": step, "time": round(time.time() - self._start, 3)}
        record.update({k: _jsonable(v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items()
                             if isinstance(v, (int, float)) and k != "step"}, step=step)
        if console:
            keys = self._console_keys or [k for k in metrics if isinstance(record[k], (int, float))]
            parts = [f"step {step:>5d}"] + [_fmt(k, record[k]) for k in keys if k in record]
            self.info(" | ".join(parts))

    def info(self, message: str) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(message, file=self._stream or sys.stdout)
        except ImportError:  # pragma: no cover
            print(message, file=self._stream or sys.stdout, flush=True)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if not self._jsonl.closed:
            self._jsonl.close()


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key} {value:.4g}"
    return f"{key} {value}"


def create_logger(run_dir: str, *, rank: Optional[int] = None, **kwargs) -> NullLogger:
    """A :class:`MetricsLogger` on rank 0, a :class:`NullLogger` elsewhere."""
    if rank is None:
        import torch

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return MetricsLogger(run_dir, **kwargs) if rank == 0 else NullLogger()


def keep_steps_through(path: str, step: int, attic: str) -> Optional[str]:
    """Drop the records of steps after ``step`` from the JSONL file ``path`` (a resume from
    ``step`` repeats them), losslessly: the old file is first copied to ``attic`` (returned),
    then the kept lines replace it atomically. Unreadable lines (a write cut by a kill) are
    dropped too. Nothing happens (None) when every line is kept."""
    import shutil

    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        lines = handle.readlines()
    kept = [line for line in lines if _record_step(line) is not None and _record_step(line) <= step]
    if len(kept) == len(lines) and all(line.endswith("\n") for line in lines):
        return None
    os.makedirs(attic, exist_ok=True)
    saved = os.path.join(attic, os.path.basename(path))
    shutil.copy2(path, saved)
    with open(path + ".part", "w") as handle:
        handle.writelines(kept)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".part", path)
    return saved


def _record_step(line: str) -> Optional[int]:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def read_metrics(path: str) -> list:
    """Records of a metrics JSONL file (for plots and tests)."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
