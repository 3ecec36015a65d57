"""Issue 42, item 4: every sampler shape rule is one line at ``stabledrl train --print-config`` (the
preflight and every rank call ``config/checks.check_sampler_shape``), its fix passes, and a run
that fails before its first step leaves its run directory usable by the next fresh run."""

from __future__ import annotations

import os
import re

import pytest
import torch

from stabledrl_mcore.cli.app import main
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.checks import check_sampler_shape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")


def test_the_llada_rule_is_exactly_where_the_sampler_raises():
    """For every small (gen_length, block_length, steps) the check refuses iff generate_llada raises."""
    from stabledrl_mcore.diffusion.sampling_llada import generate_llada
    from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig

    model = ToyDiffusionLM(ToyDLLMConfig(), seed=0).eval()
    prompt = torch.tensor([[2, 3]])
    refused = 0
    for gen in range(1, 9):
        for block in range(1, 9):
            for steps in range(1, 9):
                try:
                    check_sampler_shape("llada", None, gen_length=gen, steps=steps, block_length=block)
                    checked = None
                except ConfigError as err:
                    checked = str(err)
                try:
                    with torch.no_grad():
                        generate_llada(model, prompt, gen_length=gen, steps=steps, block_length=block)
                    raised = False
                except ValueError:
                    raised = True
                assert (checked is not None) == raised, (gen, block, steps, checked)
                refused += raised
    assert 0 < refused < 8**3


def test_sdar_block_length_must_be_the_models():
    check_sampler_shape("sdar", 4, gen_length=16, steps=4, block_length=4)
    check_sampler_shape("sdar", 4, gen_length=16, steps=4, block_length=None)  # None = the model's
    with pytest.raises(ConfigError, match=r"rollout.block_length=8: .* blocks of 4 tokens .* rollout.block_length=4"):
        check_sampler_shape("sdar", 4, gen_length=16, steps=4, block_length=8)


@pytest.mark.parametrize(
    "overrides, needle, fix",
    [
        (
            ["rollout.gen_length=8", "rollout.block_length=16"],
            "rollout.gen_length=8 is not a whole number of blocks of rollout.block_length=16",
            "rollout.block_length",
        ),
        (
            ["rollout.gen_length=16", "rollout.block_length=4", "rollout.steps=6"],
            "rollout.steps=6 is not a multiple of the number of blocks, 16 / 4 = 4",
            "rollout.steps",
        ),
        (
            ["model.preset=sdar-tiny", "algo.likelihood=staircase", "rollout.block_length=16"],
            "rollout.block_length=16: model.preset sdar-tiny",
            "rollout.block_length",
        ),
    ],
)
def test_print_config_refuses_each_late_failing_shape_in_one_line(capsys, overrides, needle, fix):
    argv = ["train", "--config", CONFIG, "logging.wandb_mode=disabled", *overrides, "--print-config"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "" and needle in lines[0], captured
    # the line names the fix with a value: following it passes
    value = re.search(rf"(?:set {re.escape(fix)}=(\d+)|e\.g\. (\d+))", lines[0])
    assert value, lines[0]
    assert main(argv[:-1] + [f"{fix}={value.group(1) or value.group(2)}", "--print-config"]) == 0
    capsys.readouterr()


def test_a_run_that_fails_before_its_first_step_leaves_no_metrics_file(tmp_path, monkeypatch, capsys):
    """A run whose first rollout raises (as an out-of-memory would) leaves no metrics.jsonl, so the
    next fresh run into the directory is not refused as an earlier run's (``--print-config`` runs
    that check)."""
    from stabledrl_mcore.engine import preemption
    from stabledrl_mcore.parallel import bootstrap, cpu_compat
    from stabledrl_mcore.rl import trainer

    run_dir = tmp_path / "run"
    tiny = [
        "logging.wandb_mode=disabled",
        "logging.progress=false",
        f"logging.run_dir={run_dir}",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.gen_length=4",
        "rollout.steps=2",
        "rollout.block_length=4",
        "parallel.micro_batch_size=4",
        "algo.inner_iterations=1",
        "algo.num_mc=1",
        "checkpoint.save_every=0",
        "steps=1",
    ]
    calls = []

    def rollout_fails(setup, step, logger):
        calls.append(step)
        raise RuntimeError("the rollout of step 1 failed")

    monkeypatch.setattr(preemption, "install_preemption_handlers", lambda: None)
    monkeypatch.setattr(trainer, "install_preemption_handlers", lambda: None)
    monkeypatch.setattr(trainer, "rollout_phase", rollout_fails)
    try:
        with pytest.raises(RuntimeError, match="step 1 failed"):
            main(["train", "--config", CONFIG, *tiny])
    finally:
        bootstrap.destroy()
        cpu_compat.disable()
    assert calls == [0] and run_dir.is_dir()  # the run got as far as its first rollout
    assert not (run_dir / "metrics.jsonl").exists(), os.listdir(run_dir)
    capsys.readouterr()
    assert main(["train", "--config", CONFIG, *tiny, "--print-config"]) == 0, capsys.readouterr().err
