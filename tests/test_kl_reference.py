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


MIXUP = 0.3  # not 0.5: swapped weights (0.7 theta + 0.3 ref) are a different reference


@pytest.fixture(scope="module")
def synced_run(tmp_path_factory):
    """One in-process trainer step with a KL penalty, fresh masks, two inner iterations (SGD) and
    ``reference_sync_every=2``: what the loss saw per iteration (plan, current and reference token
    log-probs), when the reference was synced, and the weights around the step."""
    from test_trainer import CONFIG, in_process_trainer, overrides

    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl import trainer

    seen = {"calls": [], "syncs": []}
    real_coefficients, real_update, real_sync = trainer.loss_coefficients, trainer.policy_update, trainer.sync_reference

    def coefficients(current, batch, spec, **kw):
        ref = kw["ref_tok"]
        seen["calls"].append({"plan": kw["plan"], "current": current.clone(), "ref": ref.clone()})
        return real_coefficients(current, batch, spec, **kw)

    def sync(reference, model, mixup):
        seen["syncs"].append((len(seen["calls"]), mixup))
        return real_sync(reference, model, mixup)

    def update(s, batch, spec, step):
        seen["ref_before"] = {n: p.detach().clone() for n, p in s.reference.named_parameters()}
        out = real_update(s, batch, spec, step)
        seen["ref_after"] = {n: p.detach().clone() for n, p in s.reference.named_parameters()}
        seen["policy_after"] = {n: p.detach().clone() for n, p in s.model.named_parameters()}
        seen["skipped"] = out["skipped_updates"]
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "loss_coefficients", coefficients)
        mp.setattr(trainer, "policy_update", update)
        mp.setattr(trainer, "sync_reference", sync)
        with in_process_trainer():
            cfg = load_config(
                CONFIG,
                overrides(
                    str(tmp_path_factory.mktemp("synced") / "run"),
                    **{
                        "logging.progress": False,
                        "rollout.prompts_per_step": 2,
                        "steps": 1,
                        "rollout.temperature": 1.0,
                        "optim.name": "sgd",
                        "optim.distributed": False,
                        "optim.weight_decay": 0.0,
                        "optim.clip_grad": 0.0,
                        "optim.lr": 0.05,
                        "algo.inner_iterations": 2,
                        "algo.mask_sampling": "fresh",
                        "algo.kl_coef": 0.05,
                        "algo.reference_sync_every": 2,
                        "algo.reference_mixup": MIXUP,
                    },
                ),
            )
            trainer.train(cfg)
    return seen


def test_a_sync_moves_the_reference_to_the_mixup_of_policy_and_reference(synced_run):
    """ref <- a theta + (1 - a) ref at the second update (reference_sync_every=2), a = 0.3."""
    seen = synced_run
    assert seen["skipped"] == 0
    assert seen["syncs"] == [(2, MIXUP)], "one sync, after the second update"
    moved = 0.0
    for name, before in seen["ref_before"].items():
        theta, after = seen["policy_after"][name], seen["ref_after"][name]
        torch.testing.assert_close(after, MIXUP * theta + (1 - MIXUP) * before, rtol=1e-5, atol=1e-7)
        moved = max(moved, float((after - before).abs().max()))
    assert moved > 1e-6, "the reference did not move at the sync"


def test_fresh_masks_score_the_reference_under_each_iterations_own_plan(synced_run):
    """With fresh masks every inner iteration has its own plan, and the KL term's reference
    log-probs are the reference's under that plan: non-zero exactly on the plan's scored
    positions (a reference scored once and reused sits on the first plan's), and at the first
    iteration (policy == reference, same plan) equal to the policy's."""
    calls = synced_run["calls"]
    assert len(calls) == 2
    first, second = calls
    assert not torch.equal(first["plan"].scored, second["plan"].scored)
    for call in calls:
        assert torch.equal(call["ref"] != 0, call["plan"].scored)
    torch.testing.assert_close(first["ref"], first["current"], rtol=1e-5, atol=1e-6)
