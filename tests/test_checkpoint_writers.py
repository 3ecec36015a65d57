"""Megatron's checkpoint writer never hangs a run: a write worker that fails or dies is one
error on every rank, a missing ``psutil`` is refused by name, and a training run whose writer
fails exits with that error (bounded by the spawn timeouts below: a hang fails the test)."""

import json
import os
import signal
import sys

import pytest

from stabledrl_mcore.checkpoint.integrity import CheckpointError
from stabledrl_mcore.parallel.launch import WorkerFailed, spawn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PSUTIL_MESSAGE = "psutil is not installed, please install it with `pip install psutil`"


def test_bind_refuses_a_missing_psutil_by_name(monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from stabledrl_mcore.checkpoint.writers import bind_checkpoint_writers

    monkeypatch.setattr(filesystem_async, "HAVE_PSUTIL", False)
    with pytest.raises(CheckpointError, match=r"psutil is not installed.*pip install psutil") as err:
        bind_checkpoint_writers()
    assert "\n" not in str(err.value)


def _break_writer(how: str) -> None:
    """Make this rank's forked write workers fail the way Megatron's do: its worker reads the
    process memory (psutil) before writing, outside its own error handling."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def missing_psutil():
        raise RuntimeError(PSUTIL_MESSAGE)

    def killed():
        os.kill(os.getpid(), signal.SIGKILL)

    filesystem_async._process_memory = {"psutil": missing_psutil, "sigkill": killed}[how]


def _save_worker(out_dir, how, broken_rank):
    import torch

    from stabledrl_mcore.checkpoint.state import TrainState, list_checkpoints, save_checkpoint
    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(2, 1, backend="gloo")  # TP=2: each rank writes its own shards
    rank = torch.distributed.get_rank()
    model = build_model(get_preset("llada-tiny"), device="cpu")
    root = os.path.join(out_dir, "ckpts")
    save_checkpoint(
        root, TrainState(step=1, world_size=2, tensor_parallel=2), model.sharded_state_dict
    )  # a good one first
    if rank == broken_rank:
        _break_writer(how)
    try:
        save_checkpoint(root, TrainState(step=2, world_size=2, tensor_parallel=2), model.sharded_state_dict)
        outcome = {"type": None}
    except Exception as err:  # noqa: BLE001 - the record names the type
        outcome = {"type": type(err).__name__, "message": str(err)}
    outcome["checkpoints"] = [os.path.basename(p) for p in list_checkpoints(root)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(outcome, handle)


@pytest.mark.parametrize(
    "how,broken_rank,expected",
    [
        ("psutil", 1, "a checkpoint write worker failed (rank 1, writing __1_"),
        ("sigkill", 0, "died with signal SIGKILL before reporting"),
    ],
)
def test_a_failed_or_dead_write_worker_is_an_error_on_every_rank(tmp_path, how, broken_rank, expected):
    spawn(_save_worker, 2, (str(tmp_path), how, broken_rank), timeout=240)
    records = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for rank, record in enumerate(records):
        assert record["type"] == "CheckpointError", (rank, record)
        assert "\n" not in record["message"]
        assert record["checkpoints"] == ["step_00000001"], "the failed save must not replace the good one"
    assert expected in records[broken_rank]["message"]
    if how == "psutil":
        assert PSUTIL_MESSAGE in records[broken_rank]["message"]


def _train_worker(run_dir):
    from test_run_safety import tiny_config

    from stabledrl_mcore.rl.trainer import train

    _break_writer("psutil")
    train(tiny_config(run_dir, **{"steps": 2}))


def test_a_training_run_whose_writer_fails_ends_with_that_error(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(WorkerFailed) as err:
        spawn(_train_worker, 1, (str(run_dir),), timeout=300)
    assert "CheckpointError" in str(err.value) and PSUTIL_MESSAGE in str(err.value)
    saved = [n for n in os.listdir(run_dir / "checkpoints")] if (run_dir / "checkpoints").is_dir() else []
    assert not [n for n in saved if n.startswith("step_")], saved
