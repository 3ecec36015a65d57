"""``optim.lr_step`` (which scheduled rate each update gets) and ``optim.decay_norms_and_biases``
(weight decay on 1-D parameters and biases), through the real trainer's optimizer updates."""

import json
import os

import pytest

from stabledrl_mcore.engine.optimizer import lr_steps_before
from stabledrl_mcore.parallel.launch import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
LR, UPDATES = 1e-3, 6  # 3 steps x 2 inner iterations, linear decay to 0 over 6 updates
OVERRIDES = {
    "logging.wandb_mode": "disabled",
    "logging.progress": False,
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 2,
    "rollout.gen_length": 4,
    "rollout.steps": 2,
    "rollout.block_length": 4,
    "parallel.micro_batch_size": 4,
    "checkpoint.save_every": 0,
    "steps": 3,
    "algo.inner_iterations": 2,
    "optim.lr": LR,
    "optim.min_lr": 0.0,
    "optim.decay_style": "linear",
    "optim.warmup_steps": 0,
}


def _record_worker(run_dir, extra, out):
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl.setup import build_training
    from stabledrl_mcore.rl.trainer import train

    cfg = load_config(CONFIG, [f"{k}={v}" for k, v in {**OVERRIDES, **extra, "logging.run_dir": run_dir}.items()])
    s = build_training(cfg)
    rates, real_step = [], s.optimizer.step

    def recording_step(*args, **kwargs):
        rates.append(s.optimizer.param_groups[0]["lr"])  # the rate this update applies
        return real_step(*args, **kwargs)

    s.optimizer.step = recording_step
    wd = sorted({float(g.get("wd_mult", 1.0)) for g in s.optimizer.param_groups})
    train(cfg, setup=s)
    with open(out, "w") as handle:
        json.dump({"rates": rates, "wd_mult": wd}, handle)


def _schedule(k):  # Megatron's linear decay over UPDATES updates, re-derived: lr * (1 - k / N)
    return LR * (1 - min(k, UPDATES) / UPDATES)


@pytest.mark.multiprocess
@pytest.mark.parametrize("convention", ["before_update", "release"])
def test_each_update_runs_at_the_rate_its_convention_names(tmp_path, convention):
    out = tmp_path / "out.json"
    extra = {"optim.lr_step": convention, "optim.decay_norms_and_biases": convention == "release"}
    spawn(_record_worker, 1, (str(tmp_path / "run"), extra, str(out)), timeout=300)
    got = json.loads(out.read_text())
    # before_update: update k at the schedule's k + 1; release (scheduler.step(training_step) after
    # each update, LambdaLR starting at 0): updates 0 and 1 at 0, update k >= 1 at k - 1
    expected = [_schedule(k + 1) if convention == "before_update" else _schedule(max(k - 1, 0)) for k in range(UPDATES)]
    assert got["rates"] == pytest.approx(expected, rel=1e-9, abs=1e-15), (got["rates"], expected)
    # Megatron's default exempts norms and biases (wd_mult 0); the release decays every parameter
    assert got["wd_mult"] == ([1.0] if convention == "release" else [0.0, 1.0]), got["wd_mult"]


def test_lr_steps_before_counts_whole_steps_and_refuses_unknown_conventions():
    assert [lr_steps_before("release", k) for k in range(4)] == [0, 0, 1, 1]
    assert lr_steps_before("release", 0, 4) == 2 and lr_steps_before("release", 2, 2) == 2
    assert lr_steps_before("before_update", 6, 3) == 3
    with pytest.raises(ValueError, match="optim.lr_step"):
        lr_steps_before("after", 0)
