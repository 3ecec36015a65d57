"""Megatron's checkpoint writer never hangs a run: a write worker that fails, dies or stalls is one
error on every rank naming it and its file, a missing ``psutil`` is refused by name, SIGTERM during a
stalled write ends it within seconds, and a training run whose writer fails exits with that error
(bounded by the spawn timeouts and watchdogs below: a hang fails the test)."""

import errno
import json
import multiprocessing
import os
import signal
import sys
import threading
import time

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
    process memory (psutil) before writing, outside its own error handling; ``hang`` stalls there
    as on a stalled file system (nothing fails, nothing ends)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def missing_psutil():
        raise RuntimeError(PSUTIL_MESSAGE)

    def killed():
        os.kill(os.getpid(), signal.SIGKILL)

    def hangs():
        time.sleep(600)

    filesystem_async._process_memory = {"psutil": missing_psutil, "sigkill": killed, "hang": hangs}[how]


def _save_worker(out_dir, cases):
    """Rank r of 2 (TP=2: each writes its own shards): a good save, then one save per ``(how,
    broken rank)`` case with that rank's writer broken; a record per case and rank."""
    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from stabledrl_mcore.checkpoint.state import TrainState, list_checkpoints, save_checkpoint
    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(2, 1, backend="gloo")
    rank = torch.distributed.get_rank()
    model = build_model(get_preset("llada-tiny"), device="cpu")
    root = os.path.join(out_dir, "ckpts")
    save_checkpoint(
        root, TrainState(step=1, world_size=2, tensor_parallel=2), model.sharded_state_dict
    )  # a good one first
    working = filesystem_async._process_memory
    for case, (how, broken_rank) in enumerate(cases):
        if rank == broken_rank:
            _break_writer(how)
        try:
            save_checkpoint(
                root,
                TrainState(step=2 + case, world_size=2, tensor_parallel=2),
                model.sharded_state_dict,
                write_timeout_s=3.0 if how == "hang" else None,
            )
            outcome = {"type": None}
        except Exception as err:  # noqa: BLE001 - the record names the type
            outcome = {"type": type(err).__name__, "message": str(err)}
        filesystem_async._process_memory = working
        outcome["checkpoints"] = [os.path.basename(p) for p in list_checkpoints(root)]
        with open(os.path.join(out_dir, f"case{case}.rank{rank}.json"), "w") as handle:
            json.dump(outcome, handle)


@pytest.mark.parametrize(
    "cases,expected",
    [
        (
            [("psutil", 1), ("hang", 0)],
            [
                "a checkpoint write worker failed (rank 1, writing __1_",
                "the checkpoint write timed out after 3 s (checkpoint.write_timeout_s): a checkpoint write "
                "worker (pid ",
            ],
        ),
        ([("sigkill", 0)], ["died with signal SIGKILL before reporting"]),
    ],
)
def test_a_failed_dead_or_stalled_write_worker_is_an_error_on_every_rank(tmp_path, cases, expected):
    """Every rank's one line names the failing rank's worker and file (rank 0 stalled: rank 1 too)."""
    spawn(_save_worker, 2, (str(tmp_path), cases), timeout=240)
    for case, ((how, broken_rank), words) in enumerate(zip(cases, expected)):
        records = [json.load(open(tmp_path / f"case{case}.rank{r}.json")) for r in range(2)]
        for rank, record in enumerate(records):
            assert record["type"] == "CheckpointError", (how, rank, record)
            assert "\n" not in record["message"]
            assert record["checkpoints"] == ["step_00000001"], "the failed save must not replace the good one"
            assert words in record["message"], (how, rank, record["message"])
            assert f"rank {broken_rank}, writing __{broken_rank}_" in record["message"], (how, rank, record)
        if how == "psutil":
            assert all(PSUTIL_MESSAGE in record["message"] for record in records)


def _busy_rank_saves(out_dir):
    """Rank 0 of 1 with the threads a training rank runs alive when its writer forks -- gloo's, an
    OpenMP pool warmed and kept busy by a thread of matmuls, inductor's (a compiled graph), a
    wandb-like thread logging to stderr -- and one thread stuck for good inside a ``sys.stdout``
    write (a pipe nobody reads: it holds the stream's lock at every fork); three saves, each timed."""
    import logging

    import torch

    from stabledrl_mcore.checkpoint.writers import save_sharded
    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1, backend="gloo")
    model = build_model(get_preset("llada-tiny"), device="cpu")
    torch.set_num_threads(2)
    stop = threading.Event()

    def matmuls():
        x = torch.randn(128, 128)
        while not stop.is_set():
            (x @ x).sum()
            time.sleep(0.001)

    def wandb_like():
        log = logging.getLogger("wandb_like")
        log.addHandler(logging.StreamHandler(sys.stderr))
        log.propagate = False
        step = 0
        while not stop.is_set():
            log.warning("step %d", step)
            step += 1
            time.sleep(0.002)

    compiled = torch.compile(lambda x: torch.relu(x * 2.0 + 1.0).sum(), backend="inductor")
    compiled(torch.randn(16)).item()
    unread, stuck_end = os.pipe()
    stuck = open(stuck_end, "w")
    writer = threading.Thread(target=lambda: (stuck.write("x" * (1 << 20)), stuck.flush()), daemon=True)
    threads = [threading.Thread(target=f, daemon=True) for f in (matmuls, wandb_like)] + [writer]
    sys.stdout = stuck  # the parent's own stdout is the stuck one: a flush of it in any process hangs
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    times = []
    try:
        for save in range(3):
            directory = os.path.join(out_dir, f"save{save}")
            os.makedirs(directory)
            started = time.monotonic()
            save_sharded(model.sharded_state_dict(), directory, timeout_s=60.0)
            times.append(time.monotonic() - started)
    finally:
        stop.set()
        sys.stdout = sys.__stdout__
        drain = threading.Thread(target=lambda: [None for _ in iter(lambda: os.read(unread, 1 << 16), b"")])
        drain.start()  # the stuck write ends, then its stream closes (so no exit flush waits on it)
        writer.join(30)
        stuck.close()
        drain.join(30)
    with open(os.path.join(out_dir, "times.json"), "w") as handle:
        json.dump(times, handle)


def test_a_rank_with_threads_alive_and_one_inside_a_stdout_write_saves(tmp_path):
    """A write worker forked while other threads hold locks (issue 74) neither waits on them nor
    makes its parent wait: no flush of the inherited streams before or after the fork, no feeder
    thread, no garbage collection, no exit handlers in the worker. Before, the save never ended."""
    spawn(_busy_rank_saves, 1, (str(tmp_path),), timeout=240, threads=2)
    times = json.load(open(tmp_path / "times.json"))
    assert len(times) == 3 and max(times) < 30, times
    for save in range(3):
        names = os.listdir(tmp_path / f"save{save}")
        assert ".metadata" in names and any(n.endswith(".distcp") for n in names), names


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


# ----------------------------------------------------------------- write_buckets in this process
def _fake_write(transform_list, index, bucket, results, count_queue, use_fsync, **kwargs):
    """Stands in for Megatron's ``write_preloaded_data`` in a forked worker: writes its pid beside the
    bucket's file, then fails (``fail*``), hangs as on a stalled file system (``hang*``) or reports."""
    path = bucket[0]
    with open(path + ".pid", "w") as handle:
        handle.write(str(os.getpid()))
    name = os.path.basename(path)
    if name.startswith("fail"):  # once every sibling has started (a loaded machine may not have run it yet)
        deadline = time.monotonic() + 30
        while not all(os.path.exists(p) for p in _PID_FILES) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise OSError(errno.EIO, "Input/output error", path)
    if name.startswith("hang"):
        time.sleep(600)
    if name.startswith("slow"):
        time.sleep(2)
    results.put((index, [f"wrote {name}"]))


_PID_FILES: list = []
"""The pid files of the write in progress (the forked workers inherit it)."""


def _left(pids, bound_s=30.0):
    """Which of ``pids`` are still this process's unreaped children after a bounded wait (a SIGKILLed
    worker may take a while to exit on a loaded machine; by their handles: no pid is reused)."""
    deadline = time.monotonic() + bound_s
    while True:
        left = [child.pid for child in multiprocessing.active_children() if child.pid in set(pids)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _pids(tmp_path):
    return [int(p.read_text()) for p in tmp_path.rglob("*.pid") if p.read_text()]


def _ours(tmp_path):
    """This test's write workers not yet reaped, by their handles (a reaped pid may be another's now)."""
    pids = set(_pids(tmp_path))
    return [child for child in multiprocessing.active_children() if child.pid in pids]


@pytest.fixture
def workers_stopped(tmp_path):
    """After the test (its asserts first), any write worker it left running is killed by its handle."""
    yield
    for child in _ours(tmp_path):
        child.kill()
        child.join(30)


def _write(tmp_path, monkeypatch, names, timeout_s=None):
    """``write_buckets`` over one bucket per name; returns what it put on the results queue. A
    watchdog kills the workers after 60 s, so a hang fails instead of blocking."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from stabledrl_mcore.checkpoint import writers

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(_fake_write))
    monkeypatch.setitem(writers._SAVE, "timeout_s", timeout_s)
    buckets = [(str(tmp_path / f"{n}.distcp"), f"{n}.distcp", ([], [])) for n in names]
    monkeypatch.setattr(sys.modules[__name__], "_PID_FILES", [b[0] + ".pid" for b in buckets])
    fired = threading.Event()

    def watchdog():
        fired.set()
        for child in _ours(tmp_path):
            child.kill()

    timer = threading.Timer(60, watchdog)
    timer.start()
    out = queue.Queue()
    try:
        writers.write_buckets([], False, 3, buckets, out)
    finally:
        timer.cancel()
    assert not fired.is_set(), "write_buckets did not return by itself: the watchdog killed its workers"
    return out.get_nowait()


_STALLED_FORKS = [0]
"""Forks still to stall in the child (a test sets it; 0 otherwise: the hooks do nothing)."""


def _stall_in_the_child():  # inside os.fork(), where Python 3.11's after-fork lock wait stalls a child
    if _STALLED_FORKS[0] > 0:
        time.sleep(600)


def _forked():
    _STALLED_FORKS[0] = max(_STALLED_FORKS[0] - 1, 0)


os.register_at_fork(after_in_child=_stall_in_the_child, after_in_parent=_forked)


def test_a_worker_that_never_leaves_fork_is_killed_and_forked_again(tmp_path, monkeypatch, workers_stopped):
    """A rank's write worker stalled inside ``os.fork()`` (the suite saw one wait for ever in
    ``PyOS_AfterFork_Child`` on a lock another thread held at the fork) is killed after
    ``FORK_START_S`` and forked again; the save completes. Stalled every time: a one-line error."""
    from stabledrl_mcore.checkpoint import writers

    monkeypatch.setattr(writers, "FORK_START_S", 2.0)
    before = set(multiprocessing.active_children())
    _STALLED_FORKS[0] = 1
    try:
        done = _write(tmp_path, monkeypatch, ["ok", "ok2"])
    finally:
        _STALLED_FORKS[0] = 0
    assert done == {0: ["wrote ok.distcp"], 1: ["wrote ok2.distcp"]}, done
    assert set(multiprocessing.active_children()) <= before, "the stalled worker was left"
    again = tmp_path / "again"
    again.mkdir()
    _STALLED_FORKS[0] = writers.FORK_TRIES
    try:
        outcome = _write(again, monkeypatch, ["ok"])
    finally:
        _STALLED_FORKS[0] = 0
    assert isinstance(outcome, CheckpointError) and "\n" not in str(outcome), outcome
    assert f"rank 3, writing ok.distcp: a checkpoint write worker did not start: {writers.FORK_TRIES} forks" in str(
        outcome
    )
    assert set(multiprocessing.active_children()) <= before


def test_a_write_that_fails_while_another_hangs_ends_and_kills_the_hung_one(tmp_path, monkeypatch, workers_stopped):
    outcome = _write(tmp_path, monkeypatch, ["fail", "hang"])
    assert isinstance(outcome, CheckpointError), outcome
    assert "a checkpoint write worker failed (rank 3, writing fail.distcp): OSError:" in str(outcome)
    assert len(_pids(tmp_path)) == 2 and not _left(_pids(tmp_path)), "a worker was left"


def test_a_write_that_fails_beside_a_hung_one_ends_at_once_not_at_the_time_limit(
    tmp_path, monkeypatch, workers_stopped
):
    """With a write time limit (``checkpoint.write_timeout_s``), a worker that fails while another
    hangs still ends the write as soon as it reports, naming its own error -- not when the limit
    has run out, as a write waiting for every worker would (a timeout naming the hung one)."""
    limit = 20.0
    started = time.monotonic()
    outcome = _write(tmp_path, monkeypatch, ["fail", "hang"], timeout_s=limit)
    elapsed = time.monotonic() - started
    assert isinstance(outcome, CheckpointError), outcome
    message = str(outcome)
    assert "timed out" not in message and "failed (rank 3, writing fail.distcp): OSError:" in message, message
    assert elapsed < limit / 2, f"the write ended {elapsed:.1f} s after it began (limit {limit:.0f} s)"
    assert not _left(_pids(tmp_path)), "the hung worker was left"


def test_a_stalled_write_times_out_naming_the_file_and_the_worker(tmp_path, monkeypatch, workers_stopped):
    outcome = _write(tmp_path, monkeypatch, ["ok", "hang", "ok2"], timeout_s=1.0)
    assert isinstance(outcome, CheckpointError), outcome
    hung = int((tmp_path / "hang.distcp.pid").read_text())
    message = str(outcome)
    assert "\n" not in message and "timed out after 1 s (checkpoint.write_timeout_s)" in message, message
    assert f"(pid {hung}, rank 3, writing hang.distcp) had not finished" in message, message
    assert not _left([hung])
    again = tmp_path / "again"
    again.mkdir()
    done = _write(again, monkeypatch, ["ok", "ok2"])
    assert done == {0: ["wrote ok.distcp"], 1: ["wrote ok2.distcp"]}, done


def test_sigterm_during_a_stalled_write_ends_it_within_the_grace(tmp_path, monkeypatch, workers_stopped):
    """The pre-emption handler's SIGTERM reaches the writer: the write (limit 10 min) ends
    ``TERM_GRACE_S`` after the signal; SIGUSR1 (a warning with a lead) leaves the write alone, and a
    write that starts after the SIGTERM (the pre-emption checkpoint) keeps its whole limit."""
    from stabledrl_mcore.checkpoint import writers
    from stabledrl_mcore.engine import preemption

    saved = {name: signal.getsignal(getattr(signal, name)) for name in ("SIGUSR1", "SIGTERM")}
    monkeypatch.setattr(preemption, "_PREEMPTION", {"caught": False, "installed": False, "terms": 0})
    monkeypatch.setattr(preemption, "take_held_signals", lambda: [])
    monkeypatch.setattr(writers, "TERM_GRACE_S", 0.5)
    try:
        preemption.install_preemption_handlers()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption._PREEMPTION["caught"] and preemption.terminations() == 0

        def sigterm_once_writing():  # the signal must land during the write (after its worker started)
            deadline = time.monotonic() + 60
            while not (tmp_path / "hang.distcp.pid").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)

        sender = threading.Thread(target=sigterm_once_writing, daemon=True)
        sender.start()
        outcome = _write(tmp_path, monkeypatch, ["hang"], timeout_s=600.0)
        sender.join()
        assert preemption.terminations() == 1
        after = tmp_path / "after"
        after.mkdir()
        later = _write(after, monkeypatch, ["slow"], timeout_s=600.0)  # 2 s > the 0.5 s grace
    finally:
        for name, handler in saved.items():
            signal.signal(getattr(signal, name), handler)
    assert isinstance(outcome, CheckpointError), outcome
    assert "SIGTERM arrived during a checkpoint write and 0.5 s later" in str(outcome), outcome
    assert "writing hang.distcp) had not finished" in str(outcome)
    assert later == {0: ["wrote slow.distcp"]}, later


def test_the_automatic_write_limit_grows_with_the_bytes_a_rank_writes():
    import io

    import torch

    from stabledrl_mcore.checkpoint.writers import bucket_bytes, write_limit_s

    bucket = ("f", "f", ([(None, io.BytesIO(b"x" * 1000))], [(None, torch.zeros(10 * 2**20 // 4))]))
    assert bucket_bytes(bucket) == 1000 + 10 * 2**20
    assert write_limit_s([bucket, bucket]) == pytest.approx(600.0 + 2 + 2000 / 2**20 / 10)
    assert write_limit_s([bucket], 30.0) == 30.0
