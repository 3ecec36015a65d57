"""The last line of a successful ``stabledrl train`` / ``sft`` names the newest checkpoint and the
commands that resume the run and evaluate (``train``) or sample from (``sft``) it; those commands
parse and pass their own checks on that checkpoint (issue #42 item 7)."""

import os
import shlex
import signal
import subprocess
import sys

import pytest

from stabledrl_mcore.checkpoint.state import find_latest
from stabledrl_mcore.cli.app import main, parse_args

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
    "steps=1",
]
TINY_SFT = [
    f"sft.data_path={ROOT}/examples/sft/reverse.jsonl",
    "logging.wandb_mode=disabled",
    "logging.progress=false",
    "sft.batch_size=8",
    "steps=1",
]


def _stabledrl(argv, cwd, timeout=600):
    """``python -m stabledrl_mcore.cli *argv`` in ``cwd``; killed by its PID past ``timeout`` s."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "stabledrl_mcore.cli", *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def _fields(line):
    """``checkpoint: P  resume: CMD  eval: CMD`` -> {name: text}."""
    fields = {}
    for part in line.split("  "):
        name, _, value = part.partition(": ")
        fields[name] = value
    return fields


@pytest.mark.parametrize("command", ["train", "sft"])
def test_the_last_line_names_the_checkpoint_and_commands_that_work(command, tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    config, tiny = (CONFIG, TINY) if command == "train" else (SFT_CONFIG, TINY_SFT)
    code, out, err = _stabledrl([command, "--config", config, f"logging.run_dir={run_dir}", *tiny], str(tmp_path))
    assert code == 0, err[-3000:]
    last = out.strip().splitlines()[-1]
    fields = _fields(last)
    use = "eval" if command == "train" else "generate"
    assert list(fields) == ["checkpoint", "resume", use], last

    newest = find_latest(os.path.join(run_dir, "checkpoints"))  # independent: the checkpoint store's own listing
    assert newest is not None and os.path.isdir(fields["checkpoint"])
    assert os.path.samefile(fields["checkpoint"], newest)

    monkeypatch.chdir(tmp_path)
    resume = shlex.split(fields["resume"])
    assert resume[:2] == ["stabledrl", command] and resume[-2:] == ["--resume", "auto"]
    again = parse_args(resume[1:])
    assert again.config == config and again.overrides == [f"logging.run_dir={run_dir}", *tiny]
    # the run directory holds this run: a fresh start would be refused, the resume command is accepted
    assert main([*resume[1:], "--print-config"]) == 0
    assert main([command, "--config", config, f"logging.run_dir={run_dir}", *tiny, "--print-config"]) == 2

    follow = shlex.split(fields[use])
    assert follow[:2] == ["stabledrl", use]
    args = parse_args(follow[1:])
    assert os.path.samefile(args.ckpt, newest)
    if command == "train":  # eval --check: task, data, prompt flags, checkpoint config, sampling, no model
        assert main([*follow[1:], "--check"]) == 0
