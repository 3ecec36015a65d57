"""checkpoint.save_every_minutes on rank 0's (fake) clock, the save timing record and the
pre-emption margin warning; wandb (offline) and TensorBoard across a simulated requeue."""

import json
import os
import time
from types import SimpleNamespace

import pytest

from stabledrl_mcore.engine import save_schedule
from stabledrl_mcore.engine.save_schedule import TIMING_FILE, SaveSchedule, margin_warning


@pytest.fixture
def tiny_run():
    """``run(run_dir, hooks, **overrides)``: an in-process training run (one gloo rank); Megatron torn
    down after."""
    import torch
    from test_trainer import CONFIG, DigitsTask, overrides

    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.parallel import bootstrap, cpu_compat
    from stabledrl_mcore.rl.trainer import train
    from stabledrl_mcore.tasks import available_tasks
    from stabledrl_mcore.tasks import base as task_base
    from stabledrl_mcore.tasks.base import register_task

    added = DigitsTask.name not in available_tasks()
    if added:
        register_task(DigitsTask.name)(DigitsTask)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def run(run_dir, hooks=(), **extra):
        cfg = load_config(
            CONFIG, overrides(str(run_dir), **{"logging.progress": False, "rollout.prompts_per_step": 2, **extra})
        )
        return train(cfg, hooks=hooks)

    yield run
    if added:
        task_base._REGISTRY.pop(DigitsTask.name)
    bootstrap.destroy()
    cpu_compat.disable()
    torch.set_num_threads(threads)


class _Lines:
    def __init__(self):
        self.lines = []

    def info(self, message):
        self.lines.append(message)


def _checkpoint(every=0, minutes=0.0, lead=None):
    return SimpleNamespace(save_every=every, save_every_minutes=minutes, preemption_lead_s=lead)


def test_save_every_minutes_follows_the_clock_and_restarts_after_each_save(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(save_schedule, "clock", lambda: now[0])
    saves = SaveSchedule(_checkpoint(every=5, minutes=1.0), str(tmp_path), _Lines())
    due = []
    for step in range(1, 9):
        now[0] += 25.0  # a 25 s step
        if saves.due(step, 8, preempted=False):
            saves.save(lambda: None, step, step_s=25.0)
            due.append(step)
    # 75 s after the start (step 3), every 5 steps (5), 75 s after step 5's save (8 is the end anyway)
    assert due == [3, 5, 8]
    timing = json.loads((tmp_path / TIMING_FILE).read_text())
    assert timing["step"] == 8 and timing["step_s"] == 25.0 and timing["save_s"] >= 0


def test_the_margin_warning_names_the_lead_the_step_and_the_save():
    assert margin_warning({"save_s": 100, "step_s": 300}, 600) is None  # 300 + 2 x 100 <= 600
    message = margin_warning({"save_s": 200, "max_save_s": 250, "step_s": 300}, 600)
    assert "lead time is 600 s" in message and "needs 800 s" in message and "USR1@801" in message
    assert margin_warning({"save_s": 200, "step_s": 300}, None) is None


def test_the_warning_comes_once_from_an_earlier_launch_or_after_a_save(tmp_path):
    (tmp_path / TIMING_FILE).write_text(json.dumps({"save_s": 50.0, "step_s": 10.0}))
    log = _Lines()
    saves = SaveSchedule(_checkpoint(lead=60.0), str(tmp_path), log)  # 10 + 2 x 50 > 60
    saves.save(lambda: None, 1, step_s=10.0)
    assert len(log.lines) == 1 and "needs 110 s" in log.lines[0]
    fresh, log = tmp_path / "fresh", _Lines()
    fresh.mkdir()
    saves = SaveSchedule(_checkpoint(lead=60.0), str(fresh), log)
    assert not log.lines
    saves.save(lambda: None, 1, step_s=100.0)  # the step alone is longer than the lead
    assert len(log.lines) == 1 and "finishing a step (100 s)" in log.lines[0]


def _agreement_worker(out_dir, rank, port, seconds_per_step):
    """Rank ``rank`` of 2, its clock advancing ``seconds_per_step[rank]`` per step; writes the steps
    it saved at. A bare gloo group (no Megatron: quick to start and to leave)."""
    import torch.distributed as dist

    from stabledrl_mcore.engine import save_schedule as schedule

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    now = [0.0]
    schedule.clock = lambda: now[0]
    saves = SaveSchedule(_checkpoint(minutes=1.0), out_dir, _Lines(), rank=rank)
    saved = []
    for step in range(1, 7):
        now[0] += seconds_per_step[rank]
        if saves.due(step, 6, preempted=False):
            saves.save(dist.barrier, step)  # a collective, as a checkpoint is: a disagreement hangs
            saved.append(step)
    with open(os.path.join(out_dir, f"saved.rank{rank}.json"), "w") as handle:
        json.dump(saved, handle)
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_every_rank_saves_when_rank0s_clock_says_so(tmp_path):
    import multiprocessing

    from stabledrl_mcore.parallel.bootstrap import free_port

    # alone, rank 1 (100 s steps) would save after every step; rank 0 (40 s) after steps 2, 4, 6
    ctx, port = multiprocessing.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_agreement_worker, args=(str(tmp_path), r, port, (40.0, 100.0))) for r in (0, 1)]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=120)
        assert [proc.exitcode for proc in procs] == [0, 0]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()  # this test's own child, by its handle
                proc.join()
    assert [json.loads((tmp_path / f"saved.rank{r}.json").read_text()) for r in (0, 1)] == [[2, 4, 6]] * 2


def test_a_requeue_continues_the_wandb_run_tensorboard_and_saves_on_the_clock(tiny_run, tmp_path, monkeypatch):
    """Two launches into one run directory with --resume auto (a SLURM requeue), offline wandb."""
    from stabledrl_mcore.engine.metrics import MetricsLogger

    lines, info = [], MetricsLogger.info
    monkeypatch.setattr(MetricsLogger, "info", lambda self, message: (lines.append(message), info(self, message))[1])
    now = [0.0]
    monkeypatch.setattr(save_schedule, "clock", lambda: now[0])
    tick = lambda setup, step: now.__setitem__(0, now[0] + 40.0) or {}  # noqa: E731 - a 40 s step
    run_dir = tmp_path / "run"
    options = {
        "logging.wandb_mode": "offline",
        "logging.wandb_entity": "team",
        "logging.wandb_name": "requeued",
        "logging.wandb_group": "abl",
        "logging.wandb_tags": "[ops-tag]",
        "logging.tensorboard": True,
        "checkpoint.save_every_minutes": 1,
        "checkpoint.keep_last": 5,
        "checkpoint.resume": "auto",
        "checkpoint.preemption_lead_s": 0.001,
    }
    tiny_run(run_dir, hooks=[tick], steps=3, **options)

    def steps():
        return sorted(int(p.name.rsplit("_", 1)[1]) for p in (run_dir / "checkpoints").glob("step_*"))

    assert steps() == [2, 3]  # 80 s after the start (step 2), then the end
    assert "warning: the pre-emption lead time is 0 s" in "\n".join(lines)
    first_id = (run_dir / "wandb_run_id").read_text().strip()
    tiny_run(run_dir, hooks=[tick], steps=4, **options)  # the requeue: resumes at step 3
    assert steps() == [2, 3, 4] and (run_dir / "wandb_run_id").read_text().strip() == first_id
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all((r / f"run-{first_id}.wandb").is_file() for r in runs)
    assert json.loads((run_dir / TIMING_FILE).read_text())["step"] == 4
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3, 4]


def test_a_signal_during_a_save_stops_the_run_after_that_save(tiny_run, tmp_path, monkeypatch):
    """SIGUSR1/SIGTERM caught while step 1's checkpoint is written: the run stops pre-empted right
    after it (that checkpoint is the step's), instead of training step 2 and saving again."""
    from stabledrl_mcore.engine import preemption
    from stabledrl_mcore.rl import trainer

    monkeypatch.setattr(preemption, "_PREEMPTION", {"caught": False, "installed": True, "terms": 0})
    real = trainer.save_training_checkpoint

    def signalled(s, root, step):
        preemption._PREEMPTION["caught"] = True  # what the handler does when the signal lands now
        return real(s, root, step)

    monkeypatch.setattr(trainer, "save_training_checkpoint", signalled)
    run_dir = tmp_path / "run"
    s = tiny_run(run_dir, steps=3, **{"checkpoint.save_every": 1})
    assert s.preempted and not s.finished
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000001"]
    assert [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")] == [1]


def test_write_timeout_s_takes_effect_or_is_refused_by_name(tiny_run, tmp_path, monkeypatch):
    """A stalled shard write (the forked worker hangs before writing) ends the run with the
    setting's error; a limit that is not a positive number is refused before anything starts."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from stabledrl_mcore.checkpoint.integrity import CheckpointError
    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.schema import load_config

    for bad in ("0", "-5"):
        with pytest.raises(ConfigError, match=rf"checkpoint.write_timeout_s must be > 0 seconds or null .*got {bad}"):
            load_config(None, [f"checkpoint.write_timeout_s={bad}"])
    from stabledrl_mcore.checkpoint import writers

    monkeypatch.setattr(writers, "AUTO_LIMIT_BASE_S", 30.0)  # were the setting ignored: 30 s, not 2
    monkeypatch.setattr(filesystem_async, "_process_memory", lambda: time.sleep(600))
    with pytest.raises(CheckpointError, match=r"timed out after 2 s \(checkpoint.write_timeout_s\).*had not finished"):
        tiny_run(tmp_path / "run", steps=1, **{"checkpoint.write_timeout_s": 2})
