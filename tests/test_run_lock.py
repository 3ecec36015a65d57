"""One run per run directory (``engine/run_lock.py``): rank 0 holds ``<run_dir>/.lock``.

A helper process started here holds the lock as another run's rank 0 would (its pid, and a SLURM
job id from its environment); every process is stopped by PID, also when a test fails. Then a
second run into the directory is refused naming it -- by the CLI's preflight, and by the trainer
itself (RL and SFT) -- with nothing of the first run touched; a SIGKILLed holder leaves no lock; a
requeue of the same SLURM job waits for it (``logging.lock_wait_s``); a file system without locks
is one line naming the fixes.
"""

import errno
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from stabledrl_mcore.parallel.launch import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
SFT_CONFIG = os.path.join(ROOT, "examples", "sft", "tiny_cpu.yaml")
TINY = [
    "logging.wandb_mode=disabled",
    "logging.progress=false",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.gen_length=4",
    "rollout.steps=2",
    "rollout.block_length=4",
    "parallel.micro_batch_size=4",
    "algo.inner_iterations=1",
    "algo.num_mc=1",
    "steps=2",
]
LOCK = ".lock"
# Another run's rank 0, as any process may hold the lock: an exclusive flock on <run_dir>/.lock and
# its record (host, pid, SLURM job from its environment) in the file.
HOLDER = """
import fcntl, json, os, socket, time
os.makedirs({run_dir!r}, exist_ok=True)
fd = os.open(os.path.join({run_dir!r}, ".lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
env = os.environ.get
record = dict(host=socket.gethostname(), pid=os.getpid(), slurm_job_id=env("SLURM_JOB_ID"),
              slurm_step_id=env("SLURM_STEP_ID"), slurm_restart_count=env("SLURM_RESTART_COUNT"),
              started="2030-01-01T00:00:00Z")
os.write(fd, json.dumps(record).encode())
time.sleep(600)
"""
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "SLURM_PROCID", "SLURM_NTASKS")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in SLURM_VARS + ("RANK", "WORLD_SIZE")}
    return dict(env, PYTHONPATH=ROOT, **extra)


def _stop(proc):
    """SIGKILL ``proc`` by its PID and reap it."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


@pytest.fixture
def holder_of(request):
    """``holder_of(run_dir, **env)``: a process holding ``run_dir``'s lock (stopped by PID at the end)."""
    procs = []

    def start(run_dir, **env):
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER.format(run_dir=str(run_dir))],
            env=_env(**env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        deadline = time.monotonic() + 60
        while _record(run_dir).get("pid") != proc.pid:
            assert proc.poll() is None and time.monotonic() < deadline, f"holder did not lock: {proc.stderr.read()}"
            time.sleep(0.05)
        return proc

    yield start
    for proc in procs:
        _stop(proc)


def _record(run_dir):
    try:
        return json.loads(open(os.path.join(run_dir, LOCK)).read() or "{}")
    except (OSError, ValueError):
        return {}


def _first_run(run_dir):
    """What an earlier run leaves: metrics, config, checkpoints, a save in progress, the marker."""
    ckpts = run_dir / "checkpoints"
    for step in (1, 2):
        (ckpts / f"step_0000000{step}").mkdir(parents=True)
        (ckpts / f"step_0000000{step}" / "train_state.json").write_text(json.dumps({"step": step}))
    (ckpts / ".tmp-step_00000003").mkdir()
    (ckpts / ".tmp-step_00000003" / "shard.distcp").write_bytes(b"x" * 100)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    (run_dir / "config.yaml").write_text("steps: 3\n")
    (run_dir / "wandb_run_id").write_text("abc\n")
    (run_dir / "PREEMPTED").write_text("{}\n")


def _snapshot(run_dir):
    """Every path under ``run_dir`` but the lock file, with each file's bytes and mtime."""
    found = {}
    for top, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            path = os.path.join(top, name)
            rel = os.path.relpath(path, run_dir)
            if rel == LOCK:
                continue
            if os.path.isfile(path):
                found[rel] = (hashlib.sha256(open(path, "rb").read()).hexdigest(), os.stat(path).st_mtime_ns)
            else:
                found[rel] = "dir"
    return found


def _cli(run_dir, *args, env=None, timeout=300):
    cmd = [sys.executable, "-m", "stabledrl_mcore.cli", "train", "--config", CONFIG, *TINY]
    cmd += [f"logging.run_dir={run_dir}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(**(env or {})), capture_output=True, text=True, timeout=timeout)


def _assert_names_holder(message, holder, job="4242"):
    assert "\n" not in message.strip(), message
    for needle in ("is in use by another run", f"host {socket.gethostname()}", f"pid {holder.pid}"):
        assert needle in message, message
    assert f"SLURM job {job}" in message and "another logging.run_dir" in message, message


# ------------------------------------------------------------------------------ the lock itself
def test_the_lock_is_reentrant_names_its_holder_and_is_empty_once_released(tmp_path, monkeypatch):
    from stabledrl_mcore.engine import run_lock

    monkeypatch.setenv("SLURM_JOB_ID", "31")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    run_dir = str(tmp_path / "new" / "run")
    with run_lock.holding(run_dir):
        with run_lock.holding(run_dir):  # train_rank holds it around train, which takes it again
            pass
        assert run_lock.holds(run_dir)
        record = run_lock.read_holder(run_lock.lock_path(run_dir))
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert record["slurm_job_id"] == "31" and record["slurm_step_id"] == "0" and record["started"]
        run_lock.wait_until_unlocked(run_dir)  # this process's own lock is no refusal
    assert not run_lock.holds(run_dir)
    assert open(run_lock.lock_path(run_dir)).read() == ""
    other = str(tmp_path / "never")
    run_lock.wait_until_unlocked(other)  # the check creates nothing
    assert not os.path.exists(other)


def test_a_held_lock_is_refused_at_once_unless_the_holder_is_this_jobs_earlier_instance(
    tmp_path, holder_of, monkeypatch
):
    from stabledrl_mcore.engine import run_lock
    from stabledrl_mcore.engine.run_lock import RunDirLockedError

    run_dir = str(tmp_path / "run")
    holder = holder_of(run_dir, SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_RESTART_COUNT="0")
    monkeypatch.setenv("SLURM_JOB_ID", "5000")  # another job: refused at once, however long it may wait
    for attempt in (lambda: run_lock.wait_until_unlocked(run_dir, wait_s=120), lambda: run_lock.acquire(run_dir)):
        with pytest.raises(RunDirLockedError) as info:
            attempt()
        _assert_names_holder(str(info.value), holder)
        assert "(restart 0)" in str(info.value) and "waited" not in str(info.value)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # a requeue of that job waits, then refuses naming it
    with pytest.raises(RunDirLockedError, match=r"waited \d+ s \(logging.lock_wait_s\) for this job's earlier"):
        run_lock.acquire(run_dir, wait_s=0.6)
    assert not run_lock.holds(run_dir)


def test_without_slurm_a_held_lock_is_refused_at_once(tmp_path, holder_of, monkeypatch, capsys):
    """Two plain ``stabledrl train`` runs (no SLURM_JOB_ID on either side) are not one job's
    instances: the second is refused at once, not after ``logging.lock_wait_s`` -- by the lock
    itself and by the CLI a user runs (exit 2, one line naming the holder, well inside the wait)."""
    from stabledrl_mcore import cli
    from stabledrl_mcore.engine import preemption, run_lock
    from stabledrl_mcore.engine.run_lock import RunDirLockedError

    run_dir = str(tmp_path / "run")
    holder = holder_of(run_dir)  # no SLURM variables in its environment
    assert run_lock.read_holder(run_lock.lock_path(run_dir))["slurm_job_id"] is None
    for name in SLURM_VARS + ("RANK",):
        monkeypatch.delenv(name, raising=False)
    wait_s = 3.0
    for attempt in (
        lambda: run_lock.wait_until_unlocked(run_dir, wait_s=wait_s),
        lambda: run_lock.acquire(run_dir, wait_s=wait_s),
    ):
        started = time.monotonic()
        with pytest.raises(RunDirLockedError) as info:
            attempt()
        elapsed = time.monotonic() - started
        message = str(info.value)
        assert "waited" not in message and "waiting" not in message, message
        assert f"pid {holder.pid}" in message and "another logging.run_dir" in message, message
        assert elapsed < wait_s / 2, f"refused after {elapsed:.1f} s (wait {wait_s:.0f} s)"
    assert not run_lock.holds(run_dir)
    # the second plain `stabledrl train` into the live run (the preflight, before any rank starts)
    monkeypatch.setattr(preemption, "install_preemption_handlers", lambda: None)
    wait_s = 10.0
    started = time.monotonic()
    code = cli.main(["train", "--config", CONFIG, *TINY, f"logging.run_dir={run_dir}", f"logging.lock_wait_s={wait_s}"])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"pid {holder.pid}" in err, err
    assert "waited" not in err and "waiting" not in err, err
    assert elapsed < wait_s / 2, f"the second train was refused after {elapsed:.1f} s (lock_wait_s {wait_s:.0f})"
    assert holder.poll() is None


def test_a_file_system_without_locks_is_one_line_naming_the_fixes(tmp_path, monkeypatch, capsys):
    from stabledrl_mcore import cli
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.engine import preemption, run_lock
    from stabledrl_mcore.engine.run_lock import RunLockUnsupportedError

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    run_dir = str(tmp_path / "run")
    with pytest.raises(RunLockUnsupportedError) as info:
        run_lock.acquire(run_dir)
    message = str(info.value)
    assert "\n" not in message and "does not support file locks" in message, message
    assert "No locks available" in message and "logging.run_lock=false" in message and "-o flock" in message
    # the documented way out: logging.run_lock=false takes no lock (and nothing refuses a second run)
    with run_lock.run_dir_lock(load_config(CONFIG, [f"logging.run_dir={run_dir}", "logging.run_lock=false"])):
        assert not run_lock.holds(run_dir)
    # the CLI says it in one line, exit 2, before any rank starts (the lock file exists now)
    monkeypatch.setattr(preemption, "install_preemption_handlers", lambda: None)
    monkeypatch.delenv("RANK", raising=False)
    code = cli.main(["train", "--config", CONFIG, *TINY, f"logging.run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "logging.run_lock=false" in err, err


def test_lock_wait_s_must_not_be_negative():
    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.schema import load_config

    with pytest.raises(ConfigError, match=r"logging.lock_wait_s must be >= 0"):
        load_config(CONFIG, ["logging.lock_wait_s=-1"])


# ------------------------------------------------------------------------------ whole runs
def test_a_second_train_is_refused_by_the_preflight_naming_the_holder_and_touches_nothing(
    tmp_path, holder_of, monkeypatch, capsys
):
    from stabledrl_mcore import cli
    from stabledrl_mcore.engine import preemption

    run_dir = tmp_path / "run"
    _first_run(run_dir)
    holder = holder_of(run_dir, SLURM_JOB_ID="4242", SLURM_STEP_ID="0")
    before = _snapshot(run_dir)
    monkeypatch.setattr(preemption, "install_preemption_handlers", lambda: None)
    for name in SLURM_VARS + ("RANK",):
        monkeypatch.delenv(name, raising=False)
    for extra in (
        [],
        ["--overwrite"],
        ["--resume", "auto"],
        ["--nproc", "2", "--resume", "auto", "parallel.micro_batch_size=2"],
    ):
        code = cli.main(["train", "--config", CONFIG, *TINY, f"logging.run_dir={run_dir}", *extra])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, (extra, err)
        _assert_names_holder(err, holder)
        assert _snapshot(run_dir) == before, extra
    assert holder.poll() is None


def _refused_worker(run_dir, sft_data, out):
    """Rank 0 of a second run that passed the preflight (the race): train, train_rank and train_sft
    must each refuse before anything in the run directory is moved, pruned or deleted."""
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl.trainer import train, train_rank
    from stabledrl_mcore.sft import SFTConfig, train_sft

    over = TINY + [f"logging.run_dir={run_dir}"]
    found = {}
    attempts = {
        "train --overwrite": lambda: train(load_config(CONFIG, over + ["checkpoint.overwrite=true"])),
        "train --resume auto": lambda: train(load_config(CONFIG, over), resume="auto"),
        "train_rank": lambda: train_rank(CONFIG, over + ["checkpoint.resume=auto"]),
        "train_sft --overwrite": lambda: train_sft(
            load_config(
                SFT_CONFIG,
                [f"logging.run_dir={run_dir}", f"sft.data_path={sft_data}", "checkpoint.overwrite=true", "steps=2"],
                cls=SFTConfig,
            )
        ),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            found[name] = ["no error", ""]
        except Exception as err:  # noqa: BLE001 - the record names the type
            found[name] = [type(err).__name__, str(err)]
    with open(out, "w") as handle:
        json.dump(found, handle)


@pytest.mark.multiprocess
def test_the_trainers_rank_0_refuses_a_locked_run_dir_before_touching_it(tmp_path, holder_of):
    run_dir = tmp_path / "run"
    _first_run(run_dir)
    holder = holder_of(run_dir, SLURM_JOB_ID="4242")
    before = _snapshot(run_dir)
    out = tmp_path / "refusals.json"
    spawn(_refused_worker, 1, (str(run_dir), os.path.join(ROOT, "examples", "sft", "reverse.jsonl"), str(out)))
    found = json.loads(out.read_text())
    for name, (kind, message) in found.items():
        assert kind == "RunDirLockedError", (name, kind, message)
        _assert_names_holder(message, holder)
    assert _snapshot(run_dir) == before


@pytest.mark.multiprocess
def test_a_sigkilled_holder_leaves_no_lock_and_the_next_run_trains(tmp_path, holder_of):
    run_dir = tmp_path / "run"
    _first_run(run_dir)
    holder = holder_of(run_dir, SLURM_JOB_ID="4242")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    assert _record(run_dir)["pid"] == holder.pid  # the file stays, but locks nothing
    proc = _cli(run_dir, "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    attic = [d for d in os.listdir(run_dir / "attic") if d.startswith("overwritten-")]
    assert len(attic) == 1 and "metrics.jsonl" in os.listdir(run_dir / "attic" / attic[0])
    assert (run_dir / LOCK).read_text() == ""  # released at the end


@pytest.mark.multiprocess
def test_a_requeue_waits_for_its_earlier_instance_then_trains(tmp_path, holder_of):
    """The same SLURM job id as the holder (a requeue started while the old instance still runs):
    the new run waits, touching nothing, and trains once the holder is gone (here: SIGKILLed)."""
    run_dir = tmp_path / "run"
    holder = holder_of(run_dir, SLURM_JOB_ID="777", SLURM_RESTART_COUNT="0")
    cmd = [sys.executable, "-m", "stabledrl_mcore.cli", "train", "--config", CONFIG, *TINY]
    cmd += [f"logging.run_dir={run_dir}", "logging.lock_wait_s=300", "--resume", "auto"]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(SLURM_JOB_ID="777", SLURM_RESTART_COUNT="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("waiting up to 300 s (logging.lock_wait_s)" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.05)
        waiting = next(line for line in lines if "waiting up to" in line)
        assert f"pid {holder.pid}" in waiting and "SLURM job 777" in waiting, waiting
        assert sorted(os.listdir(run_dir)) == [LOCK], "the waiting run touched the directory"
        os.kill(holder.pid, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, "".join(lines)[-3000:]
    finally:
        _stop(proc)
        reader.join(timeout=30)
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
