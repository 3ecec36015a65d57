"""Sample dumps (``logging.samples_every``): the trainer writes what the policy wrote at the
chosen steps, bounded in count and size, with the rewards and log-ratios the step used."""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.parallel.launch import spawn
from stabledrl_mcore.rl.sample_dump import cut, dump_due, sample_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
OVERRIDES = {
    "logging.wandb_mode": "disabled",
    "logging.progress": False,
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 2,
    "rollout.gen_length": 4,
    "rollout.steps": 2,
    "rollout.block_length": 4,
    "parallel.micro_batch_size": 4,
    "algo.mask_sampling": "fresh",  # a first-iteration log-ratio that is not 0
    "algo.inner_iterations": 1,  # the step's ratio statistics are the first iteration's
    "checkpoint.save_every": 0,
    "steps": 2,
    "logging.samples_every": 2,
    "logging.samples_per_step": 4,  # every row of the (one-rank) batch
    "logging.samples_max_chars": 10,
}


class _CharTokenizer:
    def decode(self, ids, stop_at_eos=True):
        return "".join(chr(i) for i in ids)


def test_rows_decode_only_the_prompts_own_tokens_and_stay_bounded():
    prompt = torch.tensor([[0, 0, 104, 105], [120, 121, 122, 119], [0, 0, 0, 113]])
    batch = SimpleNamespace(
        sequences=torch.cat([prompt, torch.zeros(3, 2, dtype=torch.long)], 1),
        prompt_len=4,
        prompt_valid=prompt != 0,
        group_index=torch.tensor([0, 0, 1]),
        completions=["abc", "a" * 30, "z"],
        references=["r0", "r1", "r2"],
        rewards=torch.tensor([1.0, 0.0, 0.5]),
        advantages=torch.tensor([0.7, -0.7, 0.0]),
    )
    rows = sample_rows(batch, _CharTokenizer(), step=3, count=2, max_chars=8, log_ratio=torch.tensor([0.1, -0.2, 9]))
    assert [r["prompt"] for r in rows] == ["hi", "xyzw"]
    assert rows[1]["completion"] == "aaaaaaaa...[cut 22 chars]"
    assert [(r["group"], r["reward"], r["advantage"]) for r in rows] == [
        (0, 1.0, pytest.approx(0.7)),
        (0, 0.0, pytest.approx(-0.7)),
    ]
    assert rows[0]["log_ratio"] == pytest.approx(0.1) and rows[0]["step"] == 3
    assert sample_rows(batch, _CharTokenizer(), step=1, count=9, max_chars=8, log_ratio=None)[2]["log_ratio"] is None
    assert cut("abc", 3) == "abc" and [s for s in range(1, 10) if dump_due(4, s)] == [4, 8] and not dump_due(0, 4)


def _dump_worker(run_dir):
    from stabledrl_mcore.rl.trainer import train

    train(load_config(CONFIG, [f"{k}={v}" for k, v in {**OVERRIDES, "logging.run_dir": run_dir}.items()]))


@pytest.mark.multiprocess
def test_the_trainer_dumps_the_chosen_steps_with_the_steps_own_rewards_and_log_ratios(tmp_path):
    run_dir = str(tmp_path / "run")
    spawn(_dump_worker, 1, (run_dir,), timeout=300)
    assert sorted(os.listdir(os.path.join(run_dir, "samples"))) == ["step_00000002.jsonl"]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "samples", "step_00000002.jsonl"))]
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][-1]
    assert len(rows) == 4 and {r["step"] for r in rows} == {2} and [r["group"] for r in rows] == [0, 0, 1, 1]
    # the same step's logged statistics, computed by the trainer and the loss from the whole batch
    assert sum(r["reward"] for r in rows) / 4 == pytest.approx(metrics["reward_mean"], abs=1e-6)
    log_ratios = [r["log_ratio"] for r in rows]
    assert any(abs(x) > 1e-6 for x in log_ratios), log_ratios
    mean = sum(log_ratios) / 4  # the batch's population variance, as the loss logs it
    assert sum((x - mean) ** 2 for x in log_ratios) / 4 == pytest.approx(metrics["log_ratio_var_first"], rel=1e-4)
    ratios = [math.exp(x) for x in log_ratios]  # the direction too: current over old
    assert max(ratios) == pytest.approx(metrics["ratio_max"], rel=1e-4)
    assert sum(ratios) / 4 == pytest.approx(metrics["ratio_mean"], rel=1e-4)
    for r in rows:  # advantages of each group sum to 0 (group-relative)
        assert isinstance(r["advantage"], float)
    assert (
        abs(rows[0]["advantage"] + rows[1]["advantage"]) < 1e-5
        and abs(rows[2]["advantage"] + rows[3]["advantage"]) < 1e-5
    )
    for r in rows:
        assert len(r["prompt"]) <= 10 or r["prompt"][:10] + "...[cut" == r["prompt"][: 10 + 7], r["prompt"]
        assert len(r["prompt"]) < 40 and len(r["completion"]) < 40


def test_sft_refuses_the_rl_only_sample_fields():
    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.checks import validate_sft_config
    from stabledrl_mcore.sft.config import SFTConfig, SFTSection

    cfg = SFTConfig(sft=SFTSection(data_path="x.jsonl"))
    cfg.logging.samples_every = 5
    with pytest.raises(ConfigError, match=r"logging.samples_every belongs to the RL loop"):
        validate_sft_config(cfg)
