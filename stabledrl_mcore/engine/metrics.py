"""One metrics logger: compact console lines, a JSONL file, wandb and TensorBoard; a no-op twin
for other ranks.

``create_logger(run_dir, ...)`` returns a :class:`MetricsLogger` on rank 0 and a
:class:`NullLogger` everywhere else, so training code logs unconditionally
(:func:`logger_options` turns a ``logging`` config section into its keywords).
wandb runs offline by default (``WANDB_MODE=offline`` semantics, files under
``<run_dir>/wandb``); ``mode="online"`` syncs, ``"disabled"`` skips it. The wandb run id
is kept in ``<run_dir>/wandb_run_id`` (written once), so every relaunch into the run
directory (a SLURM requeue, ``--resume``) continues the same wandb run; ``--overwrite``
moves the file aside with the run, so the next run gets a new id. wandb's x axis is the
``step`` metric (a resume that repeats steps logs them again, wandb never drops them).
TensorBoard (``tensorboard=True``) writes scalars to ``<run_dir>/tensorboard``; a
resumed run purges the events of the steps it repeats.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
import shutil
import string
import sys
import time
from typing import Any, Dict, Iterable, Optional, Sequence, TextIO

import torch
from tqdm import tqdm

from stabledrl_mcore.common.errors import UserError
from stabledrl_mcore.config.schema import RunConfig

WANDB_ID_FILE = "wandb_run_id"
TENSORBOARD_DIR = "tensorboard"


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

    def table(self, step: int, key: str, rows: Sequence[Dict[str, Any]]) -> None:
        """Rows of one table (e.g. sample dumps) to wandb, when it is on."""

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

    def __init__(
        self,
        run_dir: str,
        *,
        config: Optional[Dict[str, Any]] = None,
        wandb_mode: str = "offline",
        wandb_project: str = "stabledrl",
        run_name: Optional[str] = None,
        wandb_entity: Optional[str] = None,
        wandb_group: Optional[str] = None,
        wandb_tags: Sequence[str] = (),
        tensorboard: bool = False,
        start_step: int = 0,
        console_keys: Iterable[str] = (),
        stream: Optional[TextIO] = None,
        jsonl_name: str = "metrics.jsonl",
    ):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, jsonl_name)
        self._jsonl: Optional[TextIO] = None  # opened at the first record: a run that fails before
        # its first step leaves no metrics file, so the next fresh run does not take it for a used run
        self._stream = stream  # None: sys.stdout as it is when a line is written
        self._console_keys = tuple(console_keys)
        self._start = time.time()
        self._wandb = self._tensorboard = None
        if wandb_mode != "disabled":
            self._wandb = self._start_wandb(
                run_dir,
                config,
                mode=wandb_mode,
                project=wandb_project,
                name=run_name,
                entity=wandb_entity,
                group=wandb_group,
                tags=list(wandb_tags),
            )
        if tensorboard:
            self._tensorboard = _start_tensorboard(run_dir, start_step)

    @staticmethod
    def _start_wandb(run_dir, config, **options):
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb
        except ImportError:
            raise UserError(WANDB_MISSING.format(mode=options.get("mode"))) from None
        run = wandb.init(
            dir=run_dir,
            config=config or {},
            id=wandb_run_id(run_dir),
            resume="allow",
            reinit="finish_previous",
            **options,
        )
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run

    def log(self, step: int, metrics: Dict[str, Any], *, console: bool = True) -> None:
        record = {"step": step, "time": round(time.time() - self._start, 3)}
        record.update({k: _jsonable(v) for k, v in metrics.items()})
        if self._jsonl is None:
            self._jsonl = open(self.path, "a", buffering=1)
        self._jsonl.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._wandb is not None:
            self._wandb.log({**scalars, "step": step})
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, global_step=step)
            self._tensorboard.flush()
        if console:
            keys = self._console_keys or [k for k in metrics if isinstance(record[k], (int, float))]
            parts = [f"step {step:>5d}"] + [_fmt(k, record[k]) for k in keys if k in record]
            self.info(" | ".join(parts))

    def table(self, step: int, key: str, rows: Sequence[Dict[str, Any]]) -> None:
        if self._wandb is None or not rows:
            return
        import wandb

        columns = list(rows[0])
        data = [[_jsonable(row[c]) for c in columns] for row in rows]
        self._wandb.log({key: wandb.Table(columns=columns, data=data), "step": step})

    def info(self, message: str) -> None:
        tqdm.write(message, file=self._stream or sys.stdout)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._jsonl is not None and not self._jsonl.closed:
            self._jsonl.close()


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key} {value:.4g}"
    return f"{key} {value}"


def logger_options(logging) -> Dict[str, Any]:
    """:func:`create_logger` keywords from a ``logging`` config section."""
    return dict(
        wandb_mode=logging.wandb_mode,
        wandb_project=logging.wandb_project,
        wandb_entity=logging.wandb_entity,
        run_name=logging.wandb_name,
        wandb_group=logging.wandb_group,
        wandb_tags=tuple(logging.wandb_tags),
        tensorboard=logging.tensorboard,
    )


def wandb_run_id(run_dir: str) -> str:
    """The wandb run id of ``run_dir``: read from ``<run_dir>/wandb_run_id``, or a new one written
    there atomically, once (a hard link, so two writers can never both win)."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if not os.path.exists(path):
        new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(12))
        part = f"{path}.{os.getpid()}.part"
        with open(part, "w") as handle:
            handle.write(new + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(part, path)
        except FileExistsError:
            pass
        finally:
            os.remove(part)
    with open(path) as handle:
        run_id = handle.read().strip()
    if not run_id or any(ch not in string.ascii_letters + string.digits + "-_" for ch in run_id):
        raise UserError(f"{path}: not a wandb run id ({run_id!r}); delete the file for a new wandb run")
    return run_id


def _start_tensorboard(run_dir: str, start_step: int):
    """A SummaryWriter on ``<run_dir>/tensorboard``; a run continued from ``start_step`` purges the
    earlier events of the steps it logs again."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(
            "logging.tensorboard=true needs the tensorboard package: pip install tensorboard "
            "(or set logging.tensorboard=false)"
        ) from None
    log_dir = os.path.join(run_dir, TENSORBOARD_DIR)
    purge = (start_step + 1 if start_step else 0) if os.path.isdir(log_dir) else None
    return SummaryWriter(log_dir=log_dir, purge_step=purge)


WANDB_MISSING = (
    "logging.wandb_mode={mode} needs the wandb package: pip install wandb (or set logging.wandb_mode=disabled)"
)


def wandb_available() -> bool:

    return importlib.util.find_spec("wandb") is not None


def tensorboard_available() -> bool:

    return importlib.util.find_spec("tensorboard") is not None


def create_logger(run_dir: str, *, rank: Optional[int] = None, **kwargs) -> NullLogger:
    """A :class:`MetricsLogger` on rank 0, a :class:`NullLogger` elsewhere."""
    if rank is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return MetricsLogger(run_dir, **kwargs) if rank == 0 else NullLogger()


def keep_steps_through(path: str, step: int, attic: str) -> Optional[str]:
    """Drop the records of steps after ``step`` from the JSONL file ``path`` (a resume from
    ``step`` repeats them), losslessly: the old file is first copied to ``attic`` (returned),
    then the kept lines replace it atomically. Unreadable lines (a write cut by a kill) are
    dropped too. Nothing happens (None) when every line is kept."""

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


def progress_bar(cfg: RunConfig, start: int, end: int):

    rank0 = torch.distributed.get_rank() == 0
    return tqdm(
        total=end,
        initial=start,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        disable=not (cfg.logging.progress and rank0),
    )
