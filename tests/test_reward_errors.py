"""Issue 42, item 6: user rewards that keep failing end the run by name, and a batch's rewards are
scored by a pool of workers.

* ``rollout.max_reward_error_frac``: a tiny training run whose reward raises on every call exits 1
  with the field, the share and the first failure named, after logging the step and before any
  checkpoint or skip count; a share equal to the limit keeps training, one above it stops; 1 never
  stops; bad values are refused by name before any rank starts.
* ``rollout.reward_workers``: the rewards of a batch are the serial ones, in sample order (both
  isolation modes, and through ``score_rollouts``' tensor); calls overlap (a rendezvous that only
  completes when ``K`` calls are in flight at once, bounded); a function that hangs on every call
  costs one time limit per wave of workers: ``K`` calls all time out while all ``K`` are in flight
  together (counted, never timed).
"""

import json
import os
import signal
import textwrap
import threading
import time

import datasets
import pytest
import torch
from test_custom_reward import python_ctrl_c

from stabledrl_mcore.cli.app import main
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.rl.rollout import RolloutBatch, score_rollouts
from stabledrl_mcore.tasks import get_task
from stabledrl_mcore.tasks.custom_reward import CustomRewardTask, default_reward_workers, load_reward_fn
from stabledrl_mcore.tasks.from_config import build_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
RENDEZVOUS_BOUND_S = 60.0
"""How long a rendezvous call waits for the others (a bound on a failing test, never reached when it passes)."""

REWARDS = textwrap.dedent(f'''
    import fcntl, hashlib, os, time, uuid

    def digest(completion, reference):
        """A deterministic value of both arguments; the first samples answer last."""
        time.sleep(0.002 * max(0, 8 - int(completion.split("-")[0])))
        return int(hashlib.sha256((completion + "|" + reference).encode()).hexdigest()[:6], 16) / 2**24

    def _arrive(folder, want):
        """Register this call in ``folder``; True once ``want`` calls are registered (bounded wait)."""
        open(os.path.join(folder, uuid.uuid4().hex), "w").close()
        end = time.monotonic() + {RENDEZVOUS_BOUND_S}
        while time.monotonic() < end:
            if len(os.listdir(folder)) >= want:
                return True
            time.sleep(0.01)
        return False

    def rendezvous(completion, reference):
        """reference = "folder:K": 1.0 when K calls were in flight at once, else 0.0."""
        folder, want = reference.rsplit(":", 1)
        return 1.0 if _arrive(folder, int(want)) else 0.0

    def rendezvous_then_hang(completion, reference):
        """As rendezvous, writes met-<completion> when the others came, then never returns."""
        folder, want = reference.rsplit(":", 1)
        if _arrive(folder, int(want)):
            open(os.path.join(os.path.dirname(folder), "met-" + completion), "w").close()
        time.sleep(600)
        return 1.0

    def interrupts_on_3(completion, reference):
        if completion == "3":
            raise KeyboardInterrupt("stop")
        return 1.0

    def stubborn_unless_warm(completion, reference):
        """Returns at once for "warm"; otherwise swallows every exception for 120 s, then scores 1."""
        end = time.monotonic() + (0 if completion == "warm" else 120)
        while time.monotonic() < end:
            try:
                time.sleep(0.01)
            except BaseException:
                pass
        return 1.0

    def fails_on_rank_0(completion, reference):
        if os.environ.get("RANK") == "0":
            raise ValueError("broken on rank 0")
        return 1.0

    def raises(completion, reference):
        raise ValueError("my reward is broken")

    def marked(completion, reference):
        """Calls writing the 4th, 8th, ... line of $MARKER (under a lock) raise; the others return 0.25."""
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


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "pool_reward.py"
    path.write_text(REWARDS)
    return str(path)


def _task(path, name, isolation="process", workers=1, timeout_s=10.0):
    fn = load_reward_fn(f"{path}:{name}")
    return CustomRewardTask(
        get_task("gsm8k"), fn, spec=f"r.py:{name}", timeout_s=timeout_s, isolation=isolation, workers=workers
    )


def _batch(completions, references):
    n = len(completions)
    return RolloutBatch(
        sequences=torch.zeros(n, 2, dtype=torch.long),
        prompt_len=1,
        prompt_valid=torch.ones(n, 2, dtype=torch.bool),
        completion_mask=torch.ones(n, 2, dtype=torch.bool),
        group_index=torch.arange(n) // 4,
        completions=list(completions),
        references=list(references),
    )


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_parallel_rewards_equal_the_serial_ones_in_sample_order(reward_file, isolation):
    """16 samples, 4 workers: the same values as 1 worker and as the function called here, in order
    (the first samples answer last, so values kept in the order they arrive would be permuted)."""
    completions = [f"{i}-answer" for i in range(16)]
    references = [str(i % 3) for i in range(16)]
    fn = load_reward_fn(f"{reward_file}:digest")
    expected = [fn(c, r) for c, r in zip(completions, references)]
    assert len(set(expected)) == 16
    serial, parallel = _task(reward_file, "digest", isolation), _task(reward_file, "digest", isolation, workers=4)
    try:
        assert serial.rewards(completions, references) == expected
        assert parallel.rewards(completions, references) == expected
        tensors = [score_rollouts(_batch(completions, references), t).rewards for t in (serial, parallel)]
        assert torch.equal(tensors[0], tensors[1]) and tensors[1].tolist() == torch.tensor(expected).tolist()
        assert serial.pop_failures() == parallel.pop_failures() == 0
        if isolation == "process":  # a worker process per slot, none restarted; a slot whose thread
            # found the samples all taken by the others started none (CI, load 290: [1, 1, 1, 0]);
            # that the four are in flight at once is test_a_batchs_calls_are_in_flight_at_once's
            assert len(parallel.pool) == 4 and all(w.starts <= 1 for w in parallel.pool), parallel.pool
            assert sum(w.starts for w in parallel.pool) >= 1 and len(serial.pool) == 1
    finally:
        serial.close()
        parallel.close()


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_batchs_calls_are_in_flight_at_once(reward_file, tmp_path, isolation):
    """Each call returns 1 only once all 4 calls have arrived: one at a time, none could."""
    folder = tmp_path / "arrived"
    folder.mkdir()
    task = _task(reward_file, "rendezvous", isolation, workers=4, timeout_s=RENDEZVOUS_BOUND_S + 60)
    try:
        assert task.rewards([f"{i}-x" for i in range(4)], [f"{folder}:4"] * 4) == [1.0] * 4
        assert task.pop_failures() == 0 and len(os.listdir(folder)) == 4
    finally:
        task.close()


def test_a_function_that_hangs_costs_one_limit_per_wave_not_per_sample(reward_file, tmp_path, capsys):
    """4 samples, 4 workers, a function that never returns: each call met the other three before
    it hung (so all four limits ran together, one wave), and all four timed out and scored 0."""
    folder = tmp_path / "arrived"
    folder.mkdir()
    task = _task(reward_file, "rendezvous_then_hang", "process", workers=4, timeout_s=8.0)
    try:
        assert task.rewards([str(i) for i in range(4)], [f"{folder}:4"] * 4) == [0.0] * 4
        count, first = task.pop_failure_report()
        assert count == 4 and "took longer than rollout.reward_timeout_s=8 s" in first
        assert sorted(p.name for p in tmp_path.glob("met-*")) == [f"met-{i}" for i in range(4)]
        assert [w.starts for w in task.pool] == [1, 1, 1, 1] and all(w.worker_pid is None for w in task.pool)
    finally:
        task.close()
    assert capsys.readouterr().err.count("took longer than") == 1  # shown once


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_keyboard_interrupt_of_one_call_of_a_batch_propagates(reward_file, isolation):
    task = _task(reward_file, "interrupts_on_3", isolation, workers=3)
    try:
        with pytest.raises(KeyboardInterrupt, match="stop"):
            task.rewards([str(i) for i in range(6)], ["7"] * 6)
        assert task.pop_failures() == 0
    finally:
        task.close()


def test_ctrl_c_while_a_batch_waits_propagates_and_stops_every_worker(reward_file, capsys):
    """Two running workers, each in a call that would take 120 s; Ctrl-C (pressed every 0.5 s until
    the call ends, as in test_custom_reward) kills both and propagates. The other call, whose worker
    the Ctrl-C killed, reports nothing (it printed "its worker process was killed by signal 9" once
    its thread ended, possibly into the next test's output)."""
    task = _task(reward_file, "stubborn_unless_warm", "process", workers=2, timeout_s=300)
    done = threading.Event()

    def press():
        while not done.wait(0.5):
            os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press, daemon=True)
    try:
        assert task.rewards(["warm", "warm"], ["7", "7"]) == [1.0, 1.0]  # both workers started
        pids = [w.worker_pid for w in task.pool]
        with python_ctrl_c(), pytest.raises(KeyboardInterrupt):
            presser.start()
            task.rewards(["a", "b", "c", "d"], ["7"] * 4)
        done.set()
        assert None not in pids and [w.worker_pid for w in task.pool] == [None, None]
        for pid in pids:  # killed and reaped before the interrupt propagated
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        deadline = time.monotonic() + RENDEZVOUS_BOUND_S  # the batch's threads end on their own
        while any(t.name.startswith("map_in_threads-") for t in threading.enumerate()):
            assert time.monotonic() < deadline, "a reward thread did not end"
            time.sleep(0.05)
        assert "warning" not in capsys.readouterr().err
        assert task.pop_failures() == 0, "an abandoned batch's calls are not the reward's failures"
    finally:
        done.set()
        presser.join()
        task.close()


def test_reward_workers_and_max_reward_error_frac_take_effect_or_are_refused_by_name(reward_file, capsys):
    spec = f"rollout.reward_fn={reward_file}:digest"
    task = build_task(load_config(CONFIG, [spec, "rollout.reward_workers=3"]))
    assert task.workers == 3 and len(task.pool) == 3
    thread = build_task(load_config(CONFIG, [spec, "rollout.reward_workers=3", "rollout.reward_isolation=thread"]))
    assert thread.workers == 3 and thread.pool == []
    assert build_task(load_config(CONFIG, [spec])).workers == default_reward_workers()
    assert default_reward_workers() == min(8, len(os.sched_getaffinity(0)))
    for value in (1, 0.25):
        assert load_config(CONFIG, [f"rollout.max_reward_error_frac={value}"]).rollout.max_reward_error_frac == value
    for override, message in (
        ("rollout.max_reward_error_frac=0", "rollout.max_reward_error_frac must be in (0, 1]"),
        ("rollout.max_reward_error_frac=1.5", "rollout.max_reward_error_frac must be in (0, 1]"),
        ("rollout.max_reward_error_frac=-0.1", "rollout.max_reward_error_frac must be in (0, 1]"),
        ("rollout.reward_workers=0", "rollout.reward_workers must be an integer >= 1 or null"),
        ("rollout.reward_workers=2", "rollout.reward_workers=2 sets how many rollout.reward_fn calls"),
    ):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("]", r"\]")):
            load_config(CONFIG, [override])
        assert main(["train", "--config", CONFIG, override, "--print-config"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def _qa_data(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "gold": str(2 * i)} for i in range(8)]
    data = tmp_path / "my.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    return data


def _qa_overrides(data, reward, run_dir):
    """Two steps of 4 prompts x 4 completions of a qa file, scored by ``reward``; a checkpoint per step."""
    overrides = {
        "rollout.task": "qa",
        "rollout.data_path": data,
        "rollout.prompt_key": "question",
        "rollout.answer_key": "gold",
        "rollout.reward_fn": reward,
        "rollout.task_options.verifier": "numeric",
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.gen_length": 8,
        "rollout.steps": 4,
        "rollout.block_length": 8,
        "parallel.micro_batch_size": 8,
        "algo.inner_iterations": 1,
        "steps": 2,
        "checkpoint.save_every": 1,
        "logging.run_dir": run_dir,
        "logging.wandb_mode": "disabled",
        "logging.progress": False,
    }
    return [f"{k}={v}" for k, v in overrides.items()]


def _rows(run_dir):
    metrics = os.path.join(run_dir, "metrics.jsonl")
    lines = open(metrics).read().splitlines() if os.path.exists(metrics) else []
    return [json.loads(line) for line in lines if '"reward_mean"' in line]


@pytest.fixture
def qa_run(tmp_path, monkeypatch, capsys):
    """``run(reward, name, *overrides) -> (exit code, stderr, metric rows, run dir)``: ``stabledrl
    train`` in this process (one gloo rank), one step of 4 prompts x 4 completions; Megatron torn
    down after."""
    from stabledrl_mcore.engine import preemption
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    monkeypatch.setattr(preemption, "install_preemption_handlers", lambda: None)
    monkeypatch.delenv("RANK", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    data = _qa_data(tmp_path)

    def run(reward, name, *extra):
        monkeypatch.setenv("MARKER", str(tmp_path / f"{name}.calls"))
        run_dir = tmp_path / name
        code = main(["train", "--config", CONFIG, *_qa_overrides(data, reward, run_dir), *extra])
        err = capsys.readouterr().err
        return code, err, _rows(run_dir), run_dir

    run.data = data
    yield run
    bootstrap.destroy()
    cpu_compat.disable()
    torch.set_num_threads(threads)


def test_a_reward_that_fails_on_every_call_ends_the_run_by_name(qa_run, reward_file):
    """16 of 16 calls raise: the step is logged, then exit 1 naming the field, the share and the
    first failure; no checkpoint, no second step, no skipped update. With the limit at 1 the
    same run trains to its end (and the held-out evaluation's failures are counted apart)."""
    code, err, rows, run_dir = qa_run(f"{reward_file}:raises", "broken", "rollout.reward_workers=4")
    last = err.strip().splitlines()[-1]
    assert code == 1, err
    assert last.startswith("stabledrl train: error: step 1: 16 reward calls failed and scored 0, 1 of the step's")
    assert "(> rollout.max_reward_error_frac=0.5)" in last and "raised ValueError: my reward is broken" in last
    assert f"rollout.reward_fn={reward_file}:raises" in last and "fix the function" in last
    assert len(rows) == 1 and rows[0]["reward_errors"] == 16 and rows[0]["reward_error_frac"] == 1.0
    assert rows[0]["skipped_updates"] == 0 and not (run_dir / "checkpoints").exists()
    held_out = ["eval.every=1", f"eval.data_path={qa_run.data}", "eval.num_examples=4"]
    code, err, rows, run_dir = qa_run(
        f"{reward_file}:raises", "tolerated", "rollout.max_reward_error_frac=1", *held_out
    )
    assert code == 0 and [(r["reward_errors"], r["reward_error_frac"]) for r in rows] == [(16, 1.0)] * 2, err
    # the held-out evaluation's failed calls are its own metric, not the next step's reward_errors
    evals = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"test_reward"' in line]
    assert [(r["step"], r["test_reward_errors"]) for r in evals] == [(0, 4), (1, 4), (2, 4)]


def test_a_share_at_the_limit_trains_and_one_above_it_stops(qa_run, reward_file):
    """``marked``: 4 of each step's 16 calls raise (0.25): kept at max_reward_error_frac=0.25,
    stopped at 0.2."""
    code, err, rows, _ = qa_run(f"{reward_file}:marked", "at", "rollout.max_reward_error_frac=0.25")
    assert code == 0 and [(r["reward_errors"], r["reward_error_frac"]) for r in rows] == [(4, 0.25)] * 2, err
    assert [r["reward_mean"] for r in rows] == [pytest.approx(12 * 0.25 / 16)] * 2
    code, err, rows, _ = qa_run(f"{reward_file}:marked", "above", "rollout.max_reward_error_frac=0.2")
    assert code == 1 and len(rows) == 1, err
    assert "4 reward calls failed and scored 0, 0.25 of the step's samples (> rollout.max_reward_error_frac=0.2)" in err
    assert "raised RuntimeError: every fourth call fails" in err


def _dp_rank(data, reward, run_dir):
    """A rank of a DP=2 run; a RewardErrorsError's message is written to ``stop.rank<R>.txt``."""
    from stabledrl_mcore.rl.trainer import train
    from stabledrl_mcore.tasks.custom_reward import RewardErrorsError

    cfg = load_config(
        CONFIG, _qa_overrides(data, reward, run_dir) + ["rollout.max_reward_error_frac=0.4", "rollout.reward_workers=2"]
    )
    try:
        train(cfg)
    except RewardErrorsError as err:
        with open(os.path.join(run_dir, f"stop.rank{torch.distributed.get_rank()}.txt"), "w") as handle:
            handle.write(str(err))


@pytest.mark.multiprocess
def test_every_data_parallel_rank_stops_together_on_the_jobs_share(reward_file, tmp_path):
    """DP=2, every call fails on rank 0 only: 8 of the step's 16 calls (0.5 > 0.4), so rank 1,
    whose calls all scored, stops too, with the same message naming rank 0's failure."""
    from stabledrl_mcore.parallel.launch import spawn

    run_dir = str(tmp_path / "dp2")
    spawn(_dp_rank, 2, (str(_qa_data(tmp_path)), f"{reward_file}:fails_on_rank_0", run_dir), timeout=180)
    messages = [open(os.path.join(run_dir, f"stop.rank{r}.txt")).read() for r in (0, 1)]
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("step 1: 8 reward calls failed and scored 0, 0.5 of the step's samples (> ")
    assert "raised ValueError: broken on rank 0" in messages[0]
    assert [(r["reward_errors"], r["reward_error_frac"]) for r in _rows(run_dir)] == [(8, 0.5)]


def test_map_in_threads_returns_in_index_order_and_raises_the_lowest_index_error():
    """``common/thread_map.py`` directly: results in index order whatever order the calls end in; when
    two calls raise, the error of the lower index is raised, even though the higher one raised first
    (index 0 raises only once index 1 has raised; bounded wait)."""
    from stabledrl_mcore.common.thread_map import map_in_threads

    assert map_in_threads(lambda slot, i: i * i, 7, 3) == [i * i for i in range(7)]
    assert map_in_threads(lambda slot, i: (slot, i), 3, 1) == [(0, 0), (0, 1), (0, 2)]
    first_raised = threading.Event()
    raised = []

    def call(slot, index):
        if index == 0:
            assert first_raised.wait(RENDEZVOUS_BOUND_S), "index 1 never raised"
        raised.append(index)
        if index == 1:
            first_raised.set()
        raise ValueError(f"call {index}")

    with pytest.raises(ValueError, match=r"^call 0$"):
        map_in_threads(call, 2, 2)
    assert raised == [1, 0], "the case under test: the higher index raised first"
