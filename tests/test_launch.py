"""The ``--nproc`` launcher (``parallel/launch.py``): one error line for the first failing rank,
returned statuses, signals forwarded to the ranks, ranks dying with a SIGKILLed launcher.

These ranks are plain Python functions (no torch): each test costs about a second. The
launcher runs in a subprocess where a signal is sent to it; every process is stopped by PID.
"""

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from stabledrl_mcore.parallel.launch import WorkerFailed, spawn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _fail_worker():
    rank = int(os.environ["RANK"])
    if rank == 1:
        raise ValueError("num_attention_heads (4) is not divisible by\n tensor_parallel (3)")
    if rank == 2:  # a knock-on error after rank 1's, as a broken collective would raise
        time.sleep(0.5)
        raise RuntimeError("Connection closed by peer")
    time.sleep(300)  # rank 0 hangs until the launcher stops it


def test_first_failing_rank_is_one_line_and_the_others_are_not_errors():
    with pytest.raises(WorkerFailed) as info:  # not the 60 s timeout: the others were stopped (below)
        # grace 20 s: the failing rank exits by itself even on a starved machine (with 2 s a nice-19 run
        # saw it killed mid-exit); rank 0, asleep for 300 s, is then killed by the launcher
        spawn(_fail_worker, 3, timeout=120, threads=None, grace=20)
    err = info.value
    assert str(err) == err.first_error
    assert err.first_error == "rank 1: ValueError: num_attention_heads (4) is not divisible by tensor_parallel (3)"
    assert err.first_type == "builtins.ValueError"
    assert "Traceback" in err.details and "Connection closed by peer" in err.details
    assert "rank 0: stopped by the launcher after rank 1 failed" in err.details
    assert err.exit_codes[1] == 1 and err.exit_codes[0] == -signal.SIGKILL


def _status_worker(value):
    return value


def test_a_returned_status_is_reported_and_only_expected_ones_pass():
    assert spawn(_status_worker, 2, (75,), threads=None, expected_codes=(75,)) == [75, 75]
    with pytest.raises(WorkerFailed, match=r"^rank 0 returned status 3$"):
        spawn(_status_worker, 1, (3,), threads=None, expected_codes=(75,))


def _sys_exit_worker():
    sys.exit(0)  # as user code (a custom reward function) might, on every rank


def test_sys_exit_0_on_every_rank_is_a_failure_not_success():
    with pytest.raises(WorkerFailed) as info:
        spawn(_sys_exit_worker, 2, timeout=60, threads=None, grace=2)
    err = info.value
    assert err.first_type == "builtins.SystemExit", err.first_error
    assert err.first_error.startswith(("rank 0: SystemExit: sys.exit(0)", "rank 1: SystemExit: sys.exit(0)"))
    assert "before the rank's function returned" in err.first_error


def _os_exit_worker(code, late_rank, late_s):
    """``os._exit(code)`` on every rank, rank ``late_rank`` only after ``late_s`` s (None: never, it blocks)."""
    if int(os.environ["RANK"]) == late_rank:
        if late_s is None:
            time.sleep(60)  # as if blocked in a collective with the dead rank
        time.sleep(late_s)
    os._exit(code)


def test_os_exit_0_on_one_rank_is_a_failure_naming_that_rank():
    with pytest.raises(WorkerFailed) as info:
        spawn(_os_exit_worker, 2, (0, 0, None), timeout=60, threads=None, grace=1)
    err = info.value
    assert err.first_error == "rank 1 exited with status 0 before finishing (sys.exit or os._exit in user code?)"
    assert err.exit_codes == [-signal.SIGKILL, 0] and "rank 0: stopped by the launcher after rank 1" in err.details


def test_the_first_rank_to_die_is_named_not_the_lowest():
    # rank 1 dies at once, rank 0 a moment later (within the grace): rank 1 is the first failure
    with pytest.raises(WorkerFailed) as info:
        spawn(_os_exit_worker, 2, (5, 0, 1.0), timeout=60, threads=None, grace=30)
    assert info.value.first_error == "rank 1 exited with status 5", info.value.details
    assert info.value.exit_codes == [5, 5]


def _dies_in_a_collective_worker():
    """Rank 1 ends with os._exit(0) between two all-reduces; rank 0 then fails in gloo ("Connection
    reset by peer"), typically before the launcher has noticed rank 1's death."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    value = torch.ones(4)
    dist.all_reduce(value)
    if dist.get_rank() == 1:
        os._exit(0)
    for _ in range(3):
        dist.all_reduce(value)


def test_a_rank_that_fails_of_a_dead_peer_is_not_the_first():
    with pytest.raises(WorkerFailed) as info:
        spawn(_dies_in_a_collective_worker, 2, timeout=60, threads=None, grace=5)
    err = info.value
    assert err.first_error == "rank 1 exited with status 0 before finishing (sys.exit or os._exit in user code?)"
    assert err.first_type is None and "--- rank 0 ---" in err.details, err.details


def _preemptible_worker(out_dir):
    """Writes its pid, starts up for 1 s (a signal now is held), then waits for SIGTERM -> 75."""
    from stabledrl_mcore.parallel.launch import take_held_signals

    rank = os.environ["RANK"]
    with open(os.path.join(out_dir, f"rank{rank}.pid"), "w") as handle:
        handle.write(str(os.getpid()))
    time.sleep(1.0)
    caught = []
    signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
    caught += take_held_signals()
    deadline = time.monotonic() + 30
    while not caught and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(os.path.join(out_dir, f"rank{rank}.caught"), "w") as handle:
        handle.write(repr([int(s) for s in caught]))
    return 75 if caught else 0


LAUNCHER = (
    "import sys; sys.path[:0] = [{here!r}, {root!r}]\n"
    "from test_launch import _preemptible_worker\n"
    "from stabledrl_mcore.parallel.launch import exit_status, spawn\n"
    "sys.exit(exit_status(spawn(_preemptible_worker, 2, ({out!r},), timeout=60, threads=None,"
    " expected_codes=(75,), hold_signals=True)))\n"
)


def _start_launcher(out_dir):
    code = LAUNCHER.format(here=HERE, root=ROOT, out=str(out_dir))
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)


def _rank_pids(out_dir, launcher, n=2, timeout=30):
    deadline = time.monotonic() + timeout
    paths = [os.path.join(out_dir, f"rank{r}.pid") for r in range(n)]
    while time.monotonic() < deadline and launcher.poll() is None:
        if all(os.path.exists(p) for p in paths):
            time.sleep(0.05)
            return [int(open(p).read()) for p in paths]
        time.sleep(0.02)
    raise AssertionError(f"ranks did not start: {launcher.poll()} {launcher.stderr.read()}")


def _alive(pid):
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigterm_to_the_launcher_reaches_starting_ranks_and_exits_75(tmp_path):
    launcher, pids = _start_launcher(tmp_path), []
    try:
        pids = _rank_pids(tmp_path, launcher)
        launcher.send_signal(signal.SIGTERM)  # the ranks are still "starting": they must hold it
        assert launcher.wait(timeout=120) == 75, launcher.stderr.read()  # a bound, not a speed claim
        for rank in (0, 1):
            assert open(tmp_path / f"rank{rank}.caught").read() == repr([int(signal.SIGTERM)])
    finally:
        _kill([launcher.pid] + pids)
        launcher.wait()


def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    launcher, pids = _start_launcher(tmp_path), []
    try:
        pids = _rank_pids(tmp_path, launcher)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "a rank outlived its SIGKILLed launcher"
    finally:
        _kill([launcher.pid] + pids)
        launcher.wait()


# ------------------------------------------------------------------ real training runs (gloo, 2 ranks)
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
TINY = [
    "logging.wandb_mode=disabled",
    "logging.progress=false",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.gen_length=8",
    "rollout.steps=4",
    "rollout.block_length=8",
    "parallel.micro_batch_size=4",
    "algo.inner_iterations=1",
    "algo.num_mc=1",
    "steps=200",
]


def _train(run_dir, launcher, *extra, env=None, **popen):
    """A 2-rank tiny run (200 steps: it never ends by itself within the test's time; ``single``: one
    process); ``popen``: more arguments of ``subprocess.Popen``."""
    over = TINY + [f"logging.run_dir={run_dir}", *extra]
    cli = ["-m", "stabledrl_mcore.cli", "train", "--config", CONFIG, *over]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *cli]
    else:  # nproc: stabledrl's own launcher; single: one process, its rank in-process
        cmd = [sys.executable, *cli] + (["--nproc", "2"] if launcher == "nproc" else [])
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _wait_for(proc, ready, timeout=150):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            return
        time.sleep(0.05)
    raise AssertionError(f"not ready (status {proc.poll()}): {proc.stderr.read()[-3000:] if proc.poll() else ''}")


def _stop_tree(proc, pids=()):
    import psutil

    try:
        pids = list(pids) + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        pass
    _kill([proc.pid] + list(pids))
    proc.wait()


def _stepped(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    return os.path.exists(path) and open(path).read().count("\n") >= 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["nproc", "torchrun"])
def test_sigterm_to_the_launcher_checkpoints_every_rank_and_reports_the_preemption(tmp_path, launcher):
    """--nproc: the launcher forwards SIGTERM and exits 75. torchrun forwards it too but exits 1:
    the run directory's PREEMPTED marker is what tells a job script to requeue (docs/slurm.md)."""
    run_dir = str(tmp_path / "run")
    proc = _train(run_dir, launcher)
    try:
        _wait_for(proc, lambda: _stepped(run_dir))
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
        seconds = time.monotonic() - start
    finally:
        _stop_tree(proc)
    assert code == (75 if launcher == "nproc" else 1), proc.stderr.read()[-3000:]
    assert seconds < 60, seconds
    steps = [int(n.split("_")[1]) for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.startswith("step_")]
    rows = open(os.path.join(run_dir, "metrics.jsonl")).read().splitlines()
    assert steps == [len(rows)] and 0 < len(rows) < 200, (steps, len(rows))
    assert os.path.isfile(os.path.join(run_dir, "PREEMPTED"))


def _python_ctrl_c():
    """In the child before exec: SIGINT at its default, unblocked (a suite run in the background
    inherits it ignored, and Python then never turns it into KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["nproc", "single"])
def test_ctrl_c_of_train_is_one_resume_line_and_no_traceback(tmp_path, launcher):
    """Ctrl-C in a terminal sends SIGINT to the launcher and its ranks (one process group): exit 130,
    no traceback from any process, and one line naming the command that resumes the run (issue #62;
    before: 1-4 tracebacks and no such line with --nproc 2, a KeyboardInterrupt traceback in one
    process)."""
    from stabledrl_mcore.checkpoint.state import find_latest
    from stabledrl_mcore.cli.app import main

    run_dir = str(tmp_path / "run")
    proc = _train(run_dir, launcher, "checkpoint.save_every=1", start_new_session=True, preexec_fn=_python_ctrl_c)
    try:
        root = os.path.join(run_dir, "checkpoints")
        _wait_for(proc, lambda: os.path.isdir(root) and find_latest(root) is not None)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=90)
        err = proc.stderr.read()
    finally:
        _stop_tree(proc)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and lines[0].startswith("stabledrl train: interrupted; resume with: stabledrl train "), err
    command, _, where = lines[0].partition("resume with: ")[2].rpartition(" (")
    resume = shlex.split(command)
    tail = ["--nproc", "2", "--resume", "auto"] if launcher == "nproc" else ["--resume", "auto"]
    assert resume[-len(tail) :] == tail and f"logging.run_dir={run_dir}" in resume, resume
    assert where.startswith(f"from {run_dir}/checkpoints/step_"), where
    assert main([*resume[1:], "--print-config"]) == 0  # the command as printed passes its checks


@pytest.mark.multiprocess
def test_sigkill_of_the_launcher_mid_save_leaves_no_rank_or_writer_process(tmp_path):
    import psutil

    run_dir = str(tmp_path / "run")
    ckpt = os.path.join(run_dir, "checkpoints")
    proc, pids = (
        _train(run_dir, "nproc", "checkpoint.save_every=1", env={"STABLEDRL_FAULT_PAUSE_BEFORE_COMMIT": "60"}),
        [],
    )
    try:
        _wait_for(proc, lambda: os.path.isdir(ckpt) and any(n.startswith(".tmp-") for n in os.listdir(ckpt)))
        time.sleep(1.0)  # the ranks are now in the pause after the dist-checkpoint write
        pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(pids) >= 2
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = [(p, " ".join(psutil.Process(p).cmdline())[:80]) for p in pids if _alive(p)]
        assert not survivors, f"outlived the SIGKILLed launcher: {survivors}"
    finally:
        _stop_tree(proc, pids)
    assert not any(n.startswith("step_") for n in os.listdir(ckpt)), "a rank went on to commit a checkpoint"


# ------------------------------------------------------ torchrun/srun: a rank's status is its process's
SYS_EXIT_IN_SCORING = (
    "import sys; sys.path[:0] = [{root!r}]\n"
    "from stabledrl_mcore.cli.app import main\n"
    "from stabledrl_mcore.rl import trainer\n"
    "def score(*args, **kwargs):\n"
    "    sys.exit(0)  # as a custom reward function might\n"
    "trainer.score_rollouts = score\n"
    "sys.exit(main({argv!r}))\n"
)


@pytest.mark.multiprocess
def test_sys_exit_0_inside_the_training_loop_never_exits_0(tmp_path):
    """One rank as torchrun/srun start it (``stabledrl train`` in its own process): sys.exit(0) in
    the scoring phase is a one-line failure with status 1, not a successful end."""
    argv = ["train", "--config", CONFIG, *TINY, "steps=2", f"logging.run_dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SYS_EXIT_IN_SCORING.format(root=ROOT, argv=argv)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        _stop_tree(proc)
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("stabledrl train: error: sys.exit(0) was called inside the training run"), err[-3000:]
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


class _Setup:
    def __init__(self, preempted=False, finished=False):
        self.preempted, self.finished = preempted, finished


def test_a_rank_exits_0_only_once_its_loop_finished(tmp_path, monkeypatch):
    import json

    from stabledrl_mcore.common.errors import RunFailed
    from stabledrl_mcore.engine.preemption import (
        EXIT_PREEMPTED,
        FINISHED_MARKER,
        PREEMPTED_MARKER,
        run_with_preemption_marker,
    )

    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    monkeypatch.setattr("torch.distributed.get_rank", lambda: 0)
    run = str(tmp_path)
    assert run_with_preemption_marker(run, lambda: _Setup(finished=True)) == 0
    finished = json.loads(open(os.path.join(run, FINISHED_MARKER)).read())  # what slurm/common.sh requires
    assert finished["exit_status"] == 0 and finished["slurm_job_id"] == "12" and finished["slurm_restart_count"] == "3"
    with pytest.raises(RunFailed, match=r"returned before its last step without being pre-empted"):
        run_with_preemption_marker(run, lambda: _Setup())

    def exits():
        sys.exit(0)

    with pytest.raises(RunFailed, match=r"^sys.exit\(0\) was called inside the training run"):
        run_with_preemption_marker(run, exits)
    assert not os.path.exists(os.path.join(run, FINISHED_MARKER)), "a later launch kept an earlier FINISHED"
    assert run_with_preemption_marker(run, lambda: _Setup(preempted=True)) == EXIT_PREEMPTED
    marker = json.loads(open(os.path.join(run, PREEMPTED_MARKER)).read())
    assert marker["exit_status"] == 75 and marker["slurm_job_id"] == "12" and marker["slurm_restart_count"] == "3"


def _marker_here(run_dir, name, **env):
    """slurm/common.sh's ``sdrl_marker_here NAME`` in a bash with this job id / restart count."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    script = f'source "{ROOT}/slurm/common.sh"; RUN_DIR="$1"; sdrl_marker_here "$2"'
    proc = subprocess.run(
        ["bash", "-c", script, "bash", str(run_dir), name], env={**clean, **env}, capture_output=True, timeout=60
    )
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode == 0


@pytest.mark.parametrize("name,state", [("FINISHED", dict(finished=True)), ("PREEMPTED", dict(preempted=True))])
def test_the_job_script_believes_only_this_attempts_marker(tmp_path, monkeypatch, name, state):
    """A marker that rank 0 wrote in restart 0 of job 12 is that attempt's only: the job's requeue
    (restart 1) and another job must not take it for theirs."""
    from stabledrl_mcore.engine.preemption import run_with_preemption_marker

    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setattr("torch.distributed.get_rank", lambda: 0)
    run_with_preemption_marker(str(tmp_path), lambda: _Setup(**state))
    assert _marker_here(tmp_path, name, SLURM_JOB_ID="12", SLURM_RESTART_COUNT="0")
    assert _marker_here(tmp_path, name, SLURM_JOB_ID="12"), "no SLURM_RESTART_COUNT: the first attempt"
    assert not _marker_here(tmp_path, name, SLURM_JOB_ID="12", SLURM_RESTART_COUNT="1"), "a requeue's marker"
    assert not _marker_here(tmp_path, name, SLURM_JOB_ID="13", SLURM_RESTART_COUNT="0"), "another job's marker"
    assert not _marker_here(tmp_path, "FINISHED" if name == "PREEMPTED" else "PREEMPTED", SLURM_JOB_ID="12")
