"""Issue 25, custom rewards: ``rollout.reward_fn=file.py:fn`` (or ``module:fn``) replaces any task's
reward; each call is time-limited; raising, timing-out and non-number calls score 0, are counted
in ``reward_errors`` and shown once; bad specs are refused before any rank starts; a tiny training
run on a parquet file with ``rollout.task=qa`` calls the function (in-process, one gloo rank).

Issue 40: any exception but KeyboardInterrupt (SystemExit too) and any value that is not a finite
float (``10**400``, NaN, a failing ``__float__``) is a counted failure in both
``rollout.reward_isolation`` modes; ``process`` runs the function in a persistent worker process
that a timeout kills (so a function that swallows ``BaseException`` cannot outlive its limit) and
that a crash or a timeout replaces; pre-emption stays the trainer's (a flag no reward can swallow)."""

import contextlib
import json
import os
import signal
import textwrap
import threading
import time

import datasets
import pytest
import torch

from stabledrl_mcore.cli.app import main
from stabledrl_mcore.common.errors import UserError
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.tasks import get_task
from stabledrl_mcore.tasks.custom_reward import CustomRewardTask, load_reward_fn
from stabledrl_mcore.tasks.from_config import build_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")

REWARDS = textwrap.dedent('''
    import os, time

    def length(completion, reference):
        return len(completion) / 10

    def raises(completion, reference):
        raise ValueError(f"cannot score {completion!r}")

    def sleeps(completion, reference):
        time.sleep(30)
        return 1.0

    def not_a_number(completion, reference):
        return "high"

    def one_argument(completion):
        return 1.0

    def marked(completion, reference):
        """Each call appends a line to $MARKER (under a lock: the calls run in several workers);
        the calls that write its 4th, 8th, ... line raise, the others return 0.25."""
        import fcntl
        with open(os.environ["MARKER"], "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            handle.write(reference + "\\n")
            handle.flush()
            handle.seek(0)
            count = len(handle.read().splitlines())
        if count % 4 == 0:
            raise RuntimeError("every fourth call fails")
        return 0.25
''')


HOSTILE = textwrap.dedent('''
    import os, time

    def huge(completion, reference):
        return 10**400

    def not_finite(completion, reference):
        return float("nan")

    def exits(completion, reference):
        import sys
        sys.exit(3)

    class NoFloat:
        def __float__(self):
            raise RuntimeError("no float here")

    def bad_float(completion, reference):
        return NoFloat()

    def interrupts(completion, reference):
        raise KeyboardInterrupt("stop")

    def stubborn(completion, reference):
        """Swallows every exception (the deadline's too) for 30 s, then scores 1."""
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                time.sleep(0.01)
            except BaseException:
                pass
        return 1.0

    def worker_pid(completion, reference):
        return os.getpid()

    def dies_on_a(completion, reference):
        if completion == "a":
            os._exit(7)
        return 1.0

    def daemonizes(completion, reference):
        """Starts two sleepers that leave the worker's session: one by setsid(), one double-forked
        (its parent exits at once) and setsid()ed; appends their pids to $PIDS, then scores 1 (or,
        for the completion "hang", sleeps past any time limit)."""
        import subprocess
        direct = subprocess.Popen(["sleep", "600"], start_new_session=True)
        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:
            grandchild = os.fork()
            if grandchild == 0:
                os.setsid()
                os.execvp("sleep", ["sleep", "600"])
            os.write(write, str(grandchild).encode())
            os._exit(0)
        os.close(write)
        orphan = int(os.read(read, 64))
        os.waitpid(middle, 0)
        with open(os.environ["PIDS"], "a") as handle:
            handle.write(f"{os.getpid()} {direct.pid} {orphan}\\n")
        if completion == "hang":
            time.sleep(600)
        return 1.0

    def own_group(completion, reference):
        """Starts a sleeper in a process group of its own (setpgid), in the worker's session;
        appends the worker's and its pid to $PIDS, then scores 1."""
        import subprocess
        child = subprocess.Popen(["sleep", "600"], process_group=0)
        with open(os.environ["PIDS"], "a") as handle:
            handle.write(f"{os.getpid()} {child.pid}\\n")
        return 1.0

    def signals_itself(completion, reference):
        """Sends the job's pre-emption signals to its own process, swallowing whatever follows."""
        import signal
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        except BaseException:
            pass
        return 1.0

''')


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARDS)
    return str(path)


@pytest.fixture
def hostile_file(tmp_path):
    """Issue 40's functions: huge / non-finite values, SystemExit, deadline swallowing, crashes."""
    path = tmp_path / "hostile_reward.py"
    path.write_text(HOSTILE)
    return str(path)


def test_a_reward_file_replaces_the_task_reward_and_keeps_its_accuracy(reward_file):
    task = CustomRewardTask(get_task("gsm8k"), load_reward_fn(f"{reward_file}:length"), spec="x")
    assert task.reward("\\boxed{7}", "7") == 0.9 and task.is_correct("\\boxed{7}", "7")  # accuracy: GSM8K's
    assert task.name == "gsm8k" and task.pop_failures() == 0
    task.prompt_style = "compact"  # settings reach the task inside
    assert task.task.prompt_style == "compact"
    module_fn = load_reward_fn("stabledrl_mcore.tasks.extract:numbers_equal")  # package.module:function
    assert module_fn("72.0", "72") is True
    shaped = CustomRewardTask(
        get_task("gsm8k", anti_short_boxed=True), load_reward_fn(f"{reward_file}:length"), spec="x"
    )
    assert shaped.reward("\\boxed{7}", "7") == 0.9 + 0.0 and shaped.reward("x" * 300, "7") == 30.0 + 1.0


def test_task_options_that_only_shape_the_task_reward_are_refused_with_a_reward_fn(reward_file, capsys):
    assert (
        main(
            [
                "train",
                "--config",
                CONFIG,
                "rollout.task=gsm8k",
                "rollout.task_options.format_weight=0.1",
                f"rollout.reward_fn={reward_file}:length",
                "--print-config",
            ]
        )
        == 2
    )
    assert "rollout.task_options.format_weight shapes the task's own reward" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, shown",
    [
        ("raises", "raised ValueError: cannot score 'a'"),
        ("not_a_number", "returned 'high', not a finite number"),
        ("sleeps", "took longer than rollout.reward_timeout_s=0.2 s"),
    ],
)
def test_failing_calls_score_zero_are_counted_and_shown_once(reward_file, capsys, name, shown):
    task = CustomRewardTask(
        get_task("gsm8k"), load_reward_fn(f"{reward_file}:{name}"), spec=f"my_reward.py:{name}", timeout_s=0.2
    )
    assert [task.reward(c, "7") for c in ("a", "b")] == [0.0, 0.0]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and shown in err[0] and "rollout.reward_fn=my_reward.py:" + name in err[0], err
    assert "reward_errors" in err[0] and task.pop_failures() == 2 and task.pop_failures() == 0


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_the_time_limit_holds_off_the_main_thread_too(reward_file, isolation):
    task = CustomRewardTask(
        get_task("gsm8k"), load_reward_fn(f"{reward_file}:sleeps"), spec="s", timeout_s=0.2, isolation=isolation
    )
    out = []
    worker = threading.Thread(target=lambda: out.append(task.reward("x", "7")))
    worker.start()
    worker.join(5)
    assert out == [0.0] and task.pop_failures() == 1


def _task(path, name, isolation, timeout_s=10.0):
    fn = load_reward_fn(f"{path}:{name}")
    return CustomRewardTask(get_task("gsm8k"), fn, spec=f"r.py:{name}", timeout_s=timeout_s, isolation=isolation)


@pytest.mark.parametrize("isolation", ["process", "thread"])
@pytest.mark.parametrize(
    "name, shown",
    [
        ("huge", "returned 1" + "0" * 76 + "..., too large for a float"),
        ("not_finite", "returned nan, not a finite number"),
        ("exits", "raised SystemExit: 3"),
        ("bad_float", "raised RuntimeError: no float here"),
    ],
)
def test_any_exception_or_non_float_value_is_a_counted_failure(hostile_file, capsys, isolation, name, shown):
    task = _task(hostile_file, name, isolation)
    assert [task.reward(c, "7") for c in ("a", "b")] == [0.0, 0.0]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and shown in err[0] and "rollout.reward_fn=r.py:" + name in err[0], err
    assert task.pop_failures() == 2
    task.close()


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_keyboard_interrupt_propagates(hostile_file, isolation):
    task = _task(hostile_file, "interrupts", isolation)
    with pytest.raises(KeyboardInterrupt):
        task.reward("a", "7")
    assert task.pop_failures() == 0
    task.close()


@contextlib.contextmanager
def python_ctrl_c():
    """Python's own Ctrl-C (``default_int_handler``, SIGINT unblocked) inside the block, restored after:
    a process started in the background by a non-interactive shell (``make test &``, ``nohup``) inherits
    SIGINT ignored, and Python then never raises KeyboardInterrupt (two Ctrl-C tests failed so)."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def test_ctrl_c_while_waiting_for_the_worker_propagates_and_stops_it(hostile_file):
    """Ctrl-C is pressed every 0.5 s until the call ends (``stubborn`` would score 1 after 30 s):
    Python drops a KeyboardInterrupt that lands in a destructor or weakref callback (an unraisable
    exception), which a starved machine showed once; a user presses it again too."""
    task = _task(hostile_file, "stubborn", "process", timeout_s=120)
    done = threading.Event()

    def press():
        while not done.wait(0.5):
            os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press, daemon=True)
    try:
        with python_ctrl_c(), pytest.raises(KeyboardInterrupt):
            presser.start()
            value = task.reward("a", "7")
            pytest.fail(f"no KeyboardInterrupt: scored {value}")
    finally:
        done.set()
        presser.join()
    assert task.worker.worker_pid is None and task.pop_failures() == 0


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_function_that_swallows_the_deadline_is_killed_in_process_mode(hostile_file, capsys):
    """``stubborn`` would score 1 after 30 s; with a 0.5 s limit its worker is killed instead, the
    next call runs in a fresh worker (and the killed one is gone)."""
    task = _task(hostile_file, "stubborn", "process", timeout_s=0.5)
    assert task.reward("a", "7") == 0.0 and task.pop_failures() == 1
    assert "took longer than rollout.reward_timeout_s=0.5 s (its worker process was killed" in capsys.readouterr().err
    probe = _task(hostile_file, "worker_pid", "process")
    first = probe.reward("a", "7")
    assert first == probe.reward("b", "7") != os.getpid() and probe.worker.starts == 1  # one persistent worker
    probe.timeout_s = 1e-9  # the next call cannot answer in time: killed, then a fresh worker
    assert probe.reward("c", "7") == 0.0 and probe.pop_failures() == 1
    probe.timeout_s = 10.0
    second = probe.reward("d", "7")
    assert second != first and _gone(int(first)) and probe.worker.starts == 2
    for t in (task, probe):
        t.close()
    assert _gone(int(second))


def test_a_worker_that_dies_is_a_counted_crash_and_is_replaced(hostile_file, capsys):
    task = _task(hostile_file, "dies_on_a", "process")
    assert [task.reward(c, "7") for c in ("a", "b", "a", "b")] == [0.0, 1.0, 0.0, 1.0]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its worker process exited (7) during the call" in err[0], err
    assert task.pop_failures() == 2 and task.worker.starts == 3
    task.close()


def test_preemption_signals_stay_the_trainers(hostile_file, monkeypatch):
    """Pre-emption is a flag its handler sets: a thread-mode reward that swallows everything
    cannot hide it; a process-mode worker ignores the job's signals (the call still scores)."""
    from stabledrl_mcore.engine import preemption

    saved = {name: signal.getsignal(getattr(signal, name)) for name in ("SIGUSR1", "SIGTERM")}
    monkeypatch.setattr(preemption, "_PREEMPTION", {"caught": False, "installed": False})
    monkeypatch.setattr(preemption, "take_held_signals", lambda: False)
    try:
        preemption.install_preemption_handlers()
        task = _task(hostile_file, "signals_itself", "thread")
        assert task.reward("a", "7") == 1.0 and preemption._PREEMPTION["caught"]
        preemption._PREEMPTION["caught"] = False
        task = _task(hostile_file, "signals_itself", "process")
        assert task.reward("a", "7") == 1.0 and task.pop_failures() == 0
        assert not preemption._PREEMPTION["caught"]  # the worker's signals are its own
        task.close()
    finally:
        for name, handler in saved.items():
            signal.signal(getattr(signal, name), handler)


def test_process_isolation_needs_a_function_it_can_send(reward_file):
    with pytest.raises(UserError, match="rollout.reward_isolation=process needs a module-level function"):
        CustomRewardTask(get_task("gsm8k"), lambda c, r: 1.0, spec="x", isolation="process")
    assert CustomRewardTask(get_task("gsm8k"), lambda c, r: 1.0, spec="x", isolation="thread").reward("a", "7") == 1.0


def test_reward_isolation_takes_effect_or_is_refused_by_name(reward_file, capsys):
    spec = f"{reward_file}:length"
    cfg = load_config(CONFIG, [f"rollout.reward_fn={spec}", "rollout.reward_isolation=thread"])
    assert build_task(cfg).worker is None and build_task(cfg).isolation == "thread"
    assert build_task(load_config(CONFIG, [f"rollout.reward_fn={spec}"])).isolation == "process"
    for override, message in (
        ("rollout.reward_isolation=procss", "rollout.reward_isolation must be one of 'process', 'thread'"),
        ("rollout.reward_isolation=thread", "rollout.reward_isolation=thread chooses where rollout.reward_fn runs"),
    ):
        assert main(["train", "--config", CONFIG, override, "--print-config"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_bad_reward_specs_are_refused_by_name_before_any_rank_starts(reward_file, tmp_path, capsys):
    for spec, message in (
        (f"{tmp_path}/none.py:f", "none.py not found"),
        (f"{reward_file}:nope", "has no function 'nope' (its functions: length, marked,"),
        (f"{reward_file}:one_argument", "cannot be called as fn(completion, reference)"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        (reward_file, "expected path/to/file.py:function"),
    ):
        assert main(["train", "--config", CONFIG, f"rollout.reward_fn={spec}", "--print-config"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"rollout.reward_fn={spec}" in err and message in err, err
    with pytest.raises(UserError, match="importing .* raised ZeroDivisionError"):
        broken = tmp_path / "broken.py"
        broken.write_text("x = 1 / 0\n")
        load_reward_fn(f"{broken}:f")


@pytest.fixture
def inprocess():
    """One thread; Megatron torn down after the test."""
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    bootstrap.destroy()
    cpu_compat.disable()
    torch.set_num_threads(threads)


def test_a_short_qa_run_on_parquet_calls_the_reward_function(inprocess, reward_file, tmp_path, monkeypatch):
    """steps=1 of the tiny config: 4 prompts x 4 completions = 16 calls of ``marked`` on this rank;
    4 raise, so ``reward_errors`` is 4 and ``reward_mean`` is 12 x 0.25 / 16."""
    from stabledrl_mcore.rl.trainer import train

    words = ["apples", "pears", "plums", "grapes", "melons", "cherries", "lemons", "figs"]
    rows = [
        {"question": f"Sam has {i} {w} and gets {i + 2} more {w}. How many {w} now?", "gold": str(2 * i + 2)}
        for i, w in enumerate(words)
    ]
    data = tmp_path / "my.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    marker = tmp_path / "calls.txt"
    monkeypatch.setenv("MARKER", str(marker))
    run_dir = tmp_path / "run"
    overrides = {
        "rollout.task": "qa",
        "rollout.data_path": data,
        "rollout.prompt_key": "question",
        "rollout.answer_key": "gold",
        "rollout.reward_fn": f"{reward_file}:marked",
        "rollout.task_options.verifier": "numeric",
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.gen_length": 8,
        "rollout.steps": 4,
        "rollout.block_length": 8,
        "parallel.micro_batch_size": 8,
        "algo.inner_iterations": 1,
        "steps": 1,
        "checkpoint.save_every": 0,
        "logging.run_dir": run_dir,
        "logging.wandb_mode": "disabled",
        "logging.progress": False,
    }
    cfg = load_config(CONFIG, [f"{k}={v}" for k, v in overrides.items()])
    assert isinstance(build_task(cfg), CustomRewardTask)
    train(cfg)
    calls = marker.read_text().splitlines()
    assert len(calls) == 16 and set(calls) <= {r["gold"] for r in rows}  # called with the references
    (metrics,) = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"reward_mean"' in line]
    assert metrics["reward_errors"] == 4 and metrics["reward_mean"] == pytest.approx(12 * 0.25 / 16)


def _started(pids_file):
    """``[worker, setsid child, orphaned setsid grandchild]`` pids of each ``daemonizes`` call."""
    with open(pids_file) as handle:
        return [[int(p) for p in line.split()] for line in handle if line.strip()]


def _none_left(pids, bound_s=30.0):
    """Wait (bounded) until none of ``pids`` runs (zombies do not count); the ones still running."""
    from stabledrl_mcore.common.process_tree import running

    deadline = time.monotonic() + bound_s
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if running(p)]


@contextlib.contextmanager
def _killed_afterwards(pids_file):
    """Whatever the test leaves running among the recorded pids is SIGKILLed by PID: a ``sleep 600``
    or a reward worker, checked by its command line first (a pid that ended may be another's now)."""
    try:
        yield
    finally:
        recorded = [p for line in _started(pids_file) for p in line] if os.path.exists(pids_file) else []
        for pid in recorded:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    command = handle.read()
            except OSError:
                continue
            if command == b"sleep\x00600\x00" or b"isolated_calls import serve" in command:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("end", ["close", "timeout"])
def test_what_a_reward_starts_goes_with_its_worker_even_after_setsid(hostile_file, tmp_path, monkeypatch, end):
    """A reward that starts sleepers in sessions of their own (setsid, and a double fork whose middle
    process exits): once its worker is stopped (closed, or killed at the time limit) none is left."""
    pids = str(tmp_path / "pids")
    monkeypatch.setenv("PIDS", pids)
    task = _task(hostile_file, "daemonizes", "process", timeout_s=60.0 if end == "close" else 3.0)
    with _killed_afterwards(pids):
        if end == "close":
            assert task.reward("a", "7") == 1.0
            task.close()
        else:
            assert task.reward("hang", "7") == 0.0 and task.pop_failures() == 1
        ((worker, direct, orphan),) = _started(pids)
        assert direct != orphan and worker not in (direct, orphan)
        assert _none_left([worker, direct, orphan]) == []


def test_a_setpgid_child_of_a_reward_goes_when_its_worker_dies_between_calls(hostile_file, tmp_path, monkeypatch):
    """Issue 71 (3b): a reward's child in its own process group (same session) outlives a worker
    killed between calls (nothing waits on the worker then); the next call, which starts a fresh
    worker, kills it with the dead worker's session."""
    from stabledrl_mcore.common.process_tree import running

    pids = str(tmp_path / "pids")
    monkeypatch.setenv("PIDS", pids)
    task = _task(hostile_file, "own_group", "process", timeout_s=60.0)
    with _killed_afterwards(pids):
        try:
            assert task.reward("a", "7") == 1.0
            ((worker, child),) = _started(pids)
            assert os.getpgid(child) == child != worker and os.getsid(child) == worker
            os.kill(worker, signal.SIGKILL)
            assert _none_left([worker]) == [] and running(child)
            assert task.reward("a", "7") == 1.0  # a fresh worker
            assert _none_left([child]) == [], "the dead worker's setpgid child still runs"
        finally:
            task.close()


def test_a_worker_killed_between_calls_is_replaced_as_soon_as_it_is_a_zombie():
    """CI failure of 2026-12-07: a killed worker's main thread shows as a zombie before its second
    thread has exited, and ``waitpid`` reports nothing until then; a call made in that window was
    sent to the dying worker and scored 0 ("killed by signal 9 during the call"). The next call
    waits for it and starts a fresh one (the old code failed 99 of 100 such calls)."""
    from stabledrl_mcore.common.isolated_calls import IsolatedFunction
    from stabledrl_mcore.common.process_tree import running

    fn = IsolatedFunction(abs)
    try:
        for _ in range(20):
            assert fn.call((-1.0,), 30.0) == 1.0
            pid = fn.worker_pid
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while running(pid) and time.monotonic() < deadline:
                pass  # no sleep: the call lands in the window where it is a zombie not yet reported
            assert fn.call((-2.0,), 30.0) == 2.0 and fn.worker_pid != pid
    finally:
        fn.close()


CALLER = """
import os, signal, sys
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[2])]
from hostile_reward import daemonizes
from stabledrl_mcore.common.isolated_calls import IsolatedFunction
assert IsolatedFunction(daemonizes).call(("a", "7"), 60.0) == 1.0
os.kill(os.getpid(), signal.SIGKILL)  # no finaliser runs: the worker is on its own
"""


def test_what_a_reward_starts_goes_when_the_trainer_is_killed(hostile_file, tmp_path):
    """The calling process SIGKILLed: its worker notices (its parent is gone) and ends with
    everything it started, the setsid()ed sleepers included."""
    import subprocess
    import sys

    pids = str(tmp_path / "pids")
    with _killed_afterwards(pids):
        proc = subprocess.run(
            [sys.executable, "-c", CALLER, ROOT, hostile_file],
            env={**os.environ, "PIDS": pids},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        ((worker, direct, orphan),) = _started(pids)
        assert _none_left([worker, direct, orphan]) == []
