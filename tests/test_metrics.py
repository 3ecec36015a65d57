"""The one logger: JSONL + console on rank 0, offline wandb run, silent twin elsewhere."""

import io
import math

from stabledrl_mcore.metrics import MetricsLogger, NullLogger, create_logger, read_metrics


def test_rank0_writes_jsonl_console_and_offline_wandb(tmp_path):
    stream = io.StringIO()
    with create_logger(str(tmp_path), rank=0, config={"a": 1}, stream=stream,
                       console_keys=("reward", "loss")) as logger:
        assert isinstance(logger, MetricsLogger)
        logger.log(1, {"reward": 0.25, "loss": 1.5, "note": "x"})
        logger.log(2, {"reward": 0.5, "loss": float("nan")})
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["reward"] == 0.25 and records[0]["note"] == "x" and records[1]["loss"] == "nan"
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("step     1") and "reward 0.25" in lines[0] and "note" not in lines[0]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_other_ranks_are_silent(tmp_path):
    logger = create_logger(str(tmp_path / "r1"), rank=1)
    assert type(logger) is NullLogger
    logger.log(1, {"x": math.pi})
    logger.close()
    assert not (tmp_path / "r1").exists()


def test_wandb_disabled(tmp_path):
    with create_logger(str(tmp_path), rank=0, wandb_mode="disabled", stream=io.StringIO()) as lg:
        lg.log(3, {"x": 1})
    assert not (tmp_path / "wandb").exists()
    assert read_metrics(str(tmp_path / "metrics.jsonl"))[0]["x"] == 1
