"""The KL penalty: a frozen reference policy, k1/k2/k3 on the loss's own likelihood, same masks."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_mask_sampling import toy_batch

from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig
from stabledrl_mcore.parallel.launch import spawn
from stabledrl_mcore.rl.estimates import LikelihoodSpec, all_token_logp, draw_plan, estimate, sequence_estimates
from stabledrl_mcore.rl.update import loss_coefficients

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def toy(seed):
    return ToyDiffusionLM(
        ToyDLLMConfig(vocab_size=12, mask_token_id=11, eos_token_id=1, pad_token_id=1, hidden_size=16),
        seed=seed,
        dtype=torch.float64,
    )


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_is_the_estimator_on_the_sequence_estimates(estimator):
    batch, spec = toy_batch(n=6), LikelihoodSpec(kind="spg", num_mc=2)
    policy, reference = toy(0), toy(5)
    plan = draw_plan(batch, spec, lambda k: torch.Generator().manual_seed(k), micro_batch=3)
    tok = all_token_logp(policy, batch, plan, spec, micro_batch=3, mask_id=11)
    ref_tok = all_token_logp(reference, batch, plan, spec, micro_batch=3, mask_id=11)
    old = estimate(tok, plan, batch, spec)
    common = dict(plan=plan, old=old, loss="stabledrl", eps=0.2, ratio_noise=None, noise_generator=None)
    coef0, m0 = loss_coefficients(tok, batch, spec, **common)
    coef, m = loss_coefficients(tok, batch, spec, kl_coef=0.3, kl_estimator=estimator, ref_tok=ref_tok, **common)
    theta, ref = sequence_estimates(tok, plan, batch, spec), sequence_estimates(ref_tok, plan, batch, spec)
    d = theta - ref
    per_seq = {"k1": d, "k2": 0.5 * d**2, "k3": torch.exp(-d) + d - 1}[estimator]
    groups = batch.group_index
    want = torch.stack([per_seq[groups == g].mean() for g in groups.unique()]).mean()
    assert m["kl"] == pytest.approx(float(want), rel=1e-9)
    assert m["loss"] == pytest.approx(m0["loss"] + 0.3 * float(want), rel=1e-9)
    assert not torch.allclose(coef, coef0)  # the penalty moves the update


def _kl_worker(run_dir):
    from stabledrl_mcore.bench.workload_checks import probe_reward
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl.trainer import train
    from stabledrl_mcore.tasks.base import Task

    Task.reward = probe_reward  # dense: a random tiny model would earn 0 everywhere

    cfg = load_config(
        os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml"),
        [
            f"logging.run_dir={run_dir}",
            "logging.wandb_mode=disabled",
            "logging.progress=false",
            "steps=2",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.gen_length=8",
            "rollout.steps=4",
            "rollout.block_length=8",
            "parallel.micro_batch_size=4",
            "algo.kl_coef=0.05",
            "algo.kl_estimator=k2",
            "optim.lr=0.01",
            "checkpoint.save_every=0",
        ],
    )
    from stabledrl_mcore.rl.setup import build_training

    s = build_training(cfg)
    initial = {k: v.clone() for k, v in s.model.state_dict().items() if isinstance(v, torch.Tensor)}
    train(cfg, setup=s)
    ref = s.reference.state_dict()
    moved = max((s.model.state_dict()[k] - initial[k]).abs().max().item() for k in initial)
    frozen = max((ref[k] - initial[k]).abs().max().item() for k in initial)
    with open(os.path.join(run_dir, "kl.json"), "w") as handle:
        json.dump(
            {"moved": moved, "frozen": frozen, "requires_grad": any(p.requires_grad for p in s.reference.parameters())},
            handle,
        )


@pytest.mark.multiprocess
def test_training_with_a_kl_penalty_keeps_the_reference_frozen(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    spawn(_kl_worker, 1, (run_dir,), timeout=300)
    result = json.load(open(os.path.join(run_dir, "kl.json")))
    assert result["moved"] > 0 and result["frozen"] == 0.0 and not result["requires_grad"], result
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert all("kl" in r and r["kl"] >= 0 for r in rows), rows
    assert rows[-1]["kl"] > 0  # the policy has moved away from its frozen copy


def test_plan_counts_the_reference_weights():
    from stabledrl_mcore.bench.plan import PlanSpec
    from stabledrl_mcore.bench.plan import estimate as plan_estimate
    from stabledrl_mcore.models import get_preset

    base = PlanSpec(model=get_preset("llada-8b"), nodes=4, tp=2)
    with_ref = PlanSpec(model=get_preset("llada-8b"), nodes=4, tp=2, reference_model=True)
    a, b = plan_estimate(base), plan_estimate(with_ref)
    assert b["reference_weights"] == a["weights"] and b["total"] - a["total"] == pytest.approx(a["weights"])


def _sync_worker(run_dir, steps, resume):
    from stabledrl_mcore.bench.workload_checks import probe_reward
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl.trainer import train
    from stabledrl_mcore.tasks.base import Task

    Task.reward = probe_reward  # dense: a random tiny model would earn 0 everywhere
    cfg = load_config(
        os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml"),
        [
            f"logging.run_dir={run_dir}",
            "logging.wandb_mode=disabled",
            "logging.progress=false",
            f"steps={steps}",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.gen_length=8",
            "rollout.steps=4",
            "rollout.block_length=8",
            "parallel.micro_batch_size=4",
            "algo.kl_coef=0.05",
            "optim.lr=0.01",
            "algo.reference_sync_every=1",
            "algo.reference_mixup=0.5",
            "checkpoint.save_every=1",
        ],
    )
    s = train(cfg, resume=resume)
    torch.save(
        {k: v.clone() for k, v in s.reference.state_dict().items() if isinstance(v, torch.Tensor)},
        os.path.join(run_dir, "reference.pt"),
    )


@pytest.mark.multiprocess
def test_a_synced_reference_is_checkpointed_and_resumes_exactly(tmp_path):
    import shutil

    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    spawn(_sync_worker, 1, (straight, 2, None), timeout=300)
    os.makedirs(os.path.join(resumed, "checkpoints"))
    shutil.copytree(
        os.path.join(straight, "checkpoints", "step_00000001"), os.path.join(resumed, "checkpoints", "step_00000001")
    )
    spawn(_sync_worker, 1, (resumed, 2, "auto"), timeout=300)
    a = torch.load(os.path.join(straight, "reference.pt"))
    b = torch.load(os.path.join(resumed, "reference.pt"))
    assert all(torch.equal(a[k], b[k]) for k in a), "the synced reference did not resume exactly"
    last = [json.loads(line) for line in open(os.path.join(straight, "metrics.jsonl"))][-1]
    again = [json.loads(line) for line in open(os.path.join(resumed, "metrics.jsonl"))][-1]
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(("time", "step_s", "tokens_per_s"))}  # noqa
    assert drop(last) == drop(again) and last["kl"] > 0
