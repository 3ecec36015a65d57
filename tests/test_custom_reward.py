"""Issue 25, custom rewards: ``rollout.reward_fn=file.py:fn`` (or ``module:fn``) replaces any task's
reward; each call is time-limited; raising, timing-out and non-number calls score 0, are counted
in ``reward_errors`` and shown once; bad specs are refused before any rank starts; a tiny training
run on a parquet file with ``rollout.task=qa`` calls the function (in-process, one gloo rank)."""

import json
import os
import textwrap
import threading

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

    CALLS = []

    def marked(completion, reference):
        """Every 4th call raises; the others return 0.25; each call appends a line to $MARKER."""
        CALLS.append(completion)
        with open(os.environ["MARKER"], "a") as handle:
            handle.write(reference + "\\n")
        if len(CALLS) % 4 == 0:
            raise RuntimeError("every fourth call fails")
        return 0.25
''')


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARDS)
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


def test_the_time_limit_holds_off_the_main_thread_too(reward_file):
    task = CustomRewardTask(get_task("gsm8k"), load_reward_fn(f"{reward_file}:sleeps"), spec="s", timeout_s=0.2)
    out = []
    worker = threading.Thread(target=lambda: out.append(task.reward("x", "7")))
    worker.start()
    worker.join(5)
    assert out == [0.0] and task.pop_failures() == 1


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
