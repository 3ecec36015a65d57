"""The one logger: JSONL + console on rank 0, offline wandb run, silent twin elsewhere."""

import io
import math

from stabledrl_mcore.engine.metrics import MetricsLogger, NullLogger, create_logger, read_metrics


def test_rank0_writes_jsonl_console_and_offline_wandb(tmp_path):
    stream = io.StringIO()
    with create_logger(
        str(tmp_path), rank=0, config={"a": 1}, stream=stream, console_keys=("reward", "loss")
    ) as logger:
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


def test_the_metrics_file_is_opened_at_the_first_record(tmp_path):
    """A logger closed before it logged anything (a run that failed before its first step) leaves
    no metrics.jsonl: the run directory does not look like an earlier run's (engine/run_dir.py)."""
    from stabledrl_mcore.config.schema import RunConfig
    from stabledrl_mcore.engine.run_dir import run_in_use

    cfg = RunConfig()
    cfg.logging.run_dir = str(tmp_path)
    with create_logger(str(tmp_path), rank=0, wandb_mode="disabled", stream=io.StringIO()) as lg:
        lg.info("starting")
    assert not (tmp_path / "metrics.jsonl").exists() and run_in_use(cfg) == []
    with create_logger(str(tmp_path), rank=0, wandb_mode="disabled", stream=io.StringIO()) as lg:
        lg.log(1, {"x": 2})
    [record] = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert record["step"] == 1 and record["x"] == 2
    assert run_in_use(cfg) == [str(tmp_path / "metrics.jsonl")]


class _FakeRun:
    def __init__(self):
        self.logged, self.metrics = [], []

    def define_metric(self, name, **kwargs):
        self.metrics.append((name, kwargs))

    def log(self, data):
        self.logged.append(data)

    def finish(self):
        pass


def _capture_wandb_init(monkeypatch):
    import wandb

    calls = []

    def fake_init(**kwargs):
        calls.append(kwargs)
        return _FakeRun()

    monkeypatch.setattr(wandb, "init", fake_init)
    return calls


def test_wandb_init_gets_entity_name_group_tags_and_the_kept_run_id(tmp_path, monkeypatch):
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.engine.metrics import WANDB_ID_FILE, logger_options

    calls = _capture_wandb_init(monkeypatch)
    cfg = load_config(
        None,
        [
            "logging.wandb_entity=team",
            "logging.wandb_name=exp-1",
            "logging.wandb_group=abl",
            "logging.wandb_tags=[rl, llada]",
            "logging.wandb_project=proj",
        ],
    )
    for _ in range(2):  # a requeue: the same run directory, the same wandb run
        with create_logger(str(tmp_path), rank=0, stream=io.StringIO(), **logger_options(cfg.logging)) as lg:
            lg.log(1, {"reward": 0.5})
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert len(run_id) == 12 and run_id.isalnum()
    for call in calls:
        assert (call["entity"], call["name"], call["group"], call["tags"], call["project"]) == (
            "team",
            "exp-1",
            "abl",
            ["rl", "llada"],
            "proj",
        )
        assert call["id"] == run_id and call["resume"] == "allow" and call["mode"] == "offline"


def test_overwrite_moves_the_wandb_id_aside_so_a_fresh_run_gets_a_new_one(tmp_path, monkeypatch):
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.engine.metrics import WANDB_ID_FILE
    from stabledrl_mcore.engine.run_dir import move_run_aside

    calls = _capture_wandb_init(monkeypatch)
    cfg = load_config(None, [f"logging.run_dir={tmp_path}"])
    with create_logger(str(tmp_path), rank=0, stream=io.StringIO()) as lg:
        lg.log(1, {"x": 1})
    attic = move_run_aside(cfg)
    assert not (tmp_path / WANDB_ID_FILE).exists()
    with create_logger(str(tmp_path), rank=0, stream=io.StringIO()) as lg:
        lg.log(1, {"x": 1})
    old = open(f"{attic}/{WANDB_ID_FILE}").read().strip()
    assert calls[0]["id"] == old != calls[1]["id"]


def test_a_bad_wandb_id_file_is_named(tmp_path):
    import pytest

    from stabledrl_mcore.common.errors import UserError
    from stabledrl_mcore.engine.metrics import WANDB_ID_FILE, wandb_run_id

    (tmp_path / WANDB_ID_FILE).write_text("not an id!\n")
    with pytest.raises(UserError, match="wandb_run_id: not a wandb run id"):
        wandb_run_id(str(tmp_path))


def test_tensorboard_sink_writes_scalars_and_a_resume_purges_repeated_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with create_logger(str(tmp_path), rank=0, wandb_mode="disabled", tensorboard=True, stream=io.StringIO()) as lg:
        for step in (1, 2, 3):
            lg.log(step, {"reward": step / 10, "note": "text"})
    with create_logger(
        str(tmp_path), rank=0, wandb_mode="disabled", tensorboard=True, start_step=2, stream=io.StringIO()
    ) as lg:  # resumed from step 2: step 3 again
        lg.log(3, {"reward": 0.9})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["reward", "time"]  # strings are not scalars
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("reward")] == [(1, 0.1), (2, 0.2), (3, 0.9)]


def test_wandb_fields_without_wandb_and_tensorboard_missing_are_refused_by_name(monkeypatch):
    import pytest

    from stabledrl_mcore.cli.preflight import _check_logging
    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.engine import metrics

    with pytest.raises(ConfigError, match="logging.wandb_tags has no effect with logging.wandb_mode=disabled"):
        load_config(None, ["logging.wandb_mode=disabled", "logging.wandb_tags=[a]"])
    monkeypatch.setattr(metrics, "tensorboard_available", lambda: False)
    with pytest.raises(ConfigError, match="logging.tensorboard=true needs the tensorboard package: pip install"):
        _check_logging(load_config(None, ["logging.tensorboard=true"]))


def test_missing_wandb_and_math_verify_are_one_line_errors_not_silence(monkeypatch, tmp_path):
    """A bare box (the device bundle) has no wandb or math-verify: a run that asks for them is
    refused by name before any rank starts (wandb) or at the first check (math-verify), never
    logged nowhere or scored as zeros."""
    import sys

    import pytest

    from stabledrl_mcore.cli.preflight import _check_logging
    from stabledrl_mcore.common.errors import ConfigError, UserError
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.engine import metrics
    from stabledrl_mcore.tasks import math_equiv

    monkeypatch.setattr(metrics, "wandb_available", lambda: False)
    with pytest.raises(ConfigError, match=r"logging.wandb_mode=offline needs the wandb package: pip install wandb"):
        _check_logging(load_config(None, []))
    _check_logging(load_config(None, ["logging.wandb_mode=disabled"]))
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(UserError, match=r"logging.wandb_mode=online needs the wandb package"):
        create_logger(str(tmp_path), rank=0, wandb_mode="online", stream=io.StringIO())

    monkeypatch.setitem(sys.modules, "math_verify", None)
    math_equiv._math_verify.cache_clear()
    try:
        with pytest.raises(UserError, match=r"needs the math-verify package: pip install math-verify"):
            math_equiv.math_equal("x^2", "x*x")
    finally:
        math_equiv._math_verify.cache_clear()


def test_a_table_goes_to_wandb_with_its_step_and_nowhere_without_wandb(tmp_path, monkeypatch):
    import wandb

    _capture_wandb_init(monkeypatch)
    rows = [{"prompt": "p", "reward": 1.0}, {"prompt": "q", "reward": 0.0}]
    with create_logger(str(tmp_path), rank=0, stream=io.StringIO()) as logger:
        logger.table(4, "samples", rows)
        (data,) = logger._wandb.logged
    assert data["step"] == 4 and isinstance(data["samples"], wandb.Table)
    assert data["samples"].columns == ["prompt", "reward"] and data["samples"].data == [["p", 1.0], ["q", 0.0]]
    with create_logger(str(tmp_path / "off"), rank=0, wandb_mode="disabled", stream=io.StringIO()) as logger:
        logger.table(4, "samples", rows)  # nothing to send it to, nothing raised
    NullLogger().table(4, "samples", rows)
