"""The instability study (``stabledrl study``, docs/experiments.md) and its drift metric."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from test_mask_sampling import toy_batch

from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig
from stabledrl_mcore.experiments import study
from stabledrl_mcore.experiments.runs import read_metrics
from stabledrl_mcore.experiments.study import StudyOptions, run_study
from stabledrl_mcore.experiments.tiny_sudoku import TinySudoku
from stabledrl_mcore.rl.drift import drift_from_estimates, drift_metrics
from stabledrl_mcore.rl.estimates import LikelihoodSpec, all_token_logp, draw_plan, old_policy_likelihood


def toy(seed):
    return ToyDiffusionLM(
        ToyDLLMConfig(vocab_size=12, mask_token_id=11, eos_token_id=1, pad_token_id=1, hidden_size=16),
        seed=seed,
        dtype=torch.float64,
    ).eval()


def test_drift_is_the_mean_log_ratio_and_k3_by_hand():
    old, initial = (
        torch.tensor([0.5, -0.2], dtype=torch.float64),
        torch.tensor([0.1, 0.3], dtype=torch.float64),
    )  # d = old - initial = [0.4, -0.5]
    got = drift_from_estimates(old, initial)
    assert got["drift_to_initial"] == pytest.approx(-0.05, abs=1e-12)
    want_k3 = ((math.exp(-0.4) - 1 + 0.4) + (math.exp(0.5) - 1 - 0.5)) / 2
    assert got["drift_to_initial_k3"] == pytest.approx(want_k3, abs=1e-12)
    assert drift_from_estimates(old, old) == {"drift_to_initial": 0.0, "drift_to_initial_k3": 0.0}


@pytest.mark.parametrize("kind", ["elbo", "mean_field"])
def test_drift_metrics_score_the_initial_policy_on_the_old_policys_masks(kind):
    spec = LikelihoodSpec(kind=kind, num_mc=1)
    policy = toy(0)
    batch = old_policy_likelihood(
        policy,
        toy_batch(n=6),
        spec,
        micro_batch=3,
        mask_id=11,
        chunk_generator=lambda k: torch.Generator().manual_seed(k),
    )
    same = drift_metrics(copy.deepcopy(policy), batch, spec, micro_batch=3, mask_id=11)
    assert same == {"drift_to_initial": 0.0, "drift_to_initial_k3": 0.0}  # the policy has not moved
    other = toy(5)
    got = drift_metrics(other, batch, spec, micro_batch=2, mask_id=11)
    # independently: the other model's masked-token log-probs summed on the batch's own masks, per scored token
    plan = batch.plan
    assert torch.equal(
        plan.masked, draw_plan(batch, spec, lambda k: torch.Generator().manual_seed(k), micro_batch=3).masked
    )
    tok = all_token_logp(other, batch, plan, spec, micro_batch=6, mask_id=11)[0]
    weight = plan.weight[0] * plan.masked[0]
    initial = (tok * weight).sum(-1) / batch.completion_mask.sum(-1)
    d = batch.old_ratio_logp - initial
    assert got["drift_to_initial"] == pytest.approx(float(d.mean()), rel=1e-9)
    assert got["drift_to_initial_k3"] == pytest.approx(float((torch.exp(-d) - 1 + d).mean()), rel=1e-9)


def test_tiny_study_runs_writes_its_summary_and_reuses_finished_arms(tmp_path, monkeypatch):
    setting = TinySudoku(
        labelled=32,
        validation=4,
        sft_steps=2,
        sft_batch=8,
        sft_eval_every=100,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        ffn_hidden_size=64,
    )
    opts = StudyOptions(
        out=str(tmp_path),
        setting=setting,
        regime="base",
        seeds=(0,),
        steps=2,
        prompts_per_step=2,
        rollout_steps=2,
        eval_every=1,
        eval_examples=4,
        save_every=1,
        window=1,
    )
    record = run_study(opts, log=lambda m: None, progress_every=0.0)
    regime = tmp_path / "base"
    assert (regime / "study.png").stat().st_size > 0
    summary = json.loads((regime / "study_summary.json").read_text())
    assert [(r["algo"], r["seed"], r["steps"]) for r in summary["runs"]] == [
        ("grpo", 0, [1, 2]),
        ("stabledrl", 0, [1, 2]),
    ]
    assert set(summary["table"]) == {"grpo", "stabledrl"}
    for arm in ("grpo_s0", "stabledrl_s0"):
        rows = [r for r in read_metrics(str(regime / arm)) if "reward_mean" in r]
        assert rows[0]["drift_to_initial"] == 0.0  # step 1's old policy is the initial one
        assert all("log_ratio_var_first" in r and "grad_norm" in r for r in rows)
        assert [r["step"] for r in read_metrics(str(regime / arm)) if "test_accuracy" in r] == [0, 1, 2]
    # a rerun reuses both finished arms: nothing is started again
    started = []
    monkeypatch.setattr(study, "run_side_by_side", lambda todo, **kw: started.extend(todo) or [0] * len(todo))
    again = run_study(opts, log=lambda m: None)
    assert started == []
    assert again["table"] == record["table"]
    # more steps: a changed config, so both arms run again, continuing from their step-2 checkpoints
    monkeypatch.undo()
    longer = run_study(StudyOptions(**{**opts.__dict__, "steps": 3}), log=lambda m: None)
    assert [r["steps"] for r in longer["runs"]] == [[1, 2, 3], [1, 2, 3]]
    for arm in ("grpo_s0", "stabledrl_s0"):
        assert "resumed from" in (regime / arm / "train.log").read_text()
