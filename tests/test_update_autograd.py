"""The RL update against autograd and against its purpose (issue 30).

The trainer never back-propagates a loss through the model in one graph: it computes
``C = d loss / d token_logp`` once (``loss_coefficients``) and back-propagates
``sum(C * token_logp)`` micro-batch by micro-batch (``accumulate_gradients``). Here the
loss is instead computed in ONE autograd graph through a float64 toy model (every draw,
every row at once) and its ``torch.autograd`` gradient must equal the trainer's, for
every registered loss x likelihood the config accepts, at inner iteration 1 (current ==
old weights) and at iteration 2 after an optimizer step (current != old). Then the
purpose: one small step along the trainer's gradient raises the advantage-weighted
log-likelihood, and a second iteration sees ratios away from 1 (the trainer itself is
checked for that, in-process).
"""

from __future__ import annotations

import json

import pytest
import torch

from stabledrl_mcore.algorithms.losses import (
    available_policy_losses,
    available_token_policy_losses,
    sequence_policy_loss,
    token_policy_loss,
)
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig
from stabledrl_mcore.rl.estimates import (
    LikelihoodSpec,
    all_token_logp,
    draw_plan,
    estimate,
    scored_region,
    sequence_estimates_and_elbo,
    token_logp,
)
from stabledrl_mcore.rl.rollout import RolloutBatch
from stabledrl_mcore.rl.update import accumulate_gradients, loss_coefficients

P, GEN, MASK, EOS, BLOCK = 4, 8, 11, 1, 4
MICRO = 3  # 8 rows -> micro-batches of 3, 3, 2: the chunking is exercised
LIKELIHOODS = ("elbo", "mean_field", "spg", "staircase")


def _accepted(loss: str, likelihood: str) -> bool:
    try:
        load_config(None, [f"algo.loss={loss}", f"algo.likelihood={likelihood}"])
    except ConfigError:
        return False
    return True


COMBOS = [
    (loss, lik)
    for loss in available_policy_losses() + available_token_policy_losses()
    for lik in LIKELIHOODS
    if _accepted(loss, lik)
]


def make_batch() -> RolloutBatch:
    """Two groups of four; completions of different lengths; advantages of both signs."""
    g = torch.Generator().manual_seed(7)
    n = 8
    seqs = torch.randint(2, 10, (n, P + GEN), generator=g)
    comp = torch.zeros(n, P + GEN, dtype=torch.bool)
    for i, eos_at in enumerate([9, 6, 11, 8, 10, 7, 11, 5]):
        seqs[i, eos_at:] = EOS
        comp[i, P : eos_at + 1] = True
    comp[:, P + GEN :] = False
    return RolloutBatch(
        sequences=seqs,
        prompt_len=P,
        prompt_valid=torch.ones_like(comp),
        completion_mask=comp,
        group_index=torch.arange(n) // 4,
        completions=[""] * n,
        references=[None] * n,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 0.8, -0.8, 0.3, -0.3]),
    )


def toy(likelihood: str) -> ToyDiffusionLM:
    arch = "sdar" if likelihood == "staircase" else "llada"
    return ToyDiffusionLM(
        ToyDLLMConfig(
            arch=arch,
            vocab_size=12,
            mask_token_id=MASK,
            eos_token_id=EOS,
            pad_token_id=EOS,
            hidden_size=16,
            block_size=BLOCK,
        ),
        seed=3,
        dtype=torch.float64,
    )


def spec_for(likelihood: str) -> LikelihoodSpec:
    return LikelihoodSpec(kind=likelihood, num_mc=2, block_size=BLOCK if likelihood == "staircase" else None)


def one_graph_loss(model, batch, plan, spec, old, loss: str) -> torch.Tensor:
    """The loss through the model in one graph: every draw and row in one forward each, no
    linearisation, no micro-batches."""
    tok = torch.stack(
        [
            token_logp(model, batch, plan, spec, rows=slice(0, batch.size), mask_id=MASK, draw=d)
            for d in range(plan.num_mc)
        ]
    )
    if loss in available_token_policy_losses():
        value, _ = token_policy_loss(
            loss, tok[0], old.token_logp[0], batch.advantages, scored_region(batch, spec), batch.group_index, eps=0.2
        )
        return value
    logp, elbo = sequence_estimates_and_elbo(tok, plan, batch, spec)
    value, _ = sequence_policy_loss(
        loss,
        logp,
        old.logp,
        batch.advantages,
        batch.group_index,
        eps=0.2,
        ratio_logp=elbo,
        old_ratio_logp=old.ratio_logp,
        completion_lengths=scored_region(batch, spec).sum(-1),
    )
    return value


def trainer_gradient(model, batch, plan, spec, old, loss: str):
    """``(gradients by name, loss metrics)`` of the trainer's path on ``model``."""
    model.zero_grad()
    current = all_token_logp(model, batch, plan, spec, micro_batch=MICRO, mask_id=MASK)
    coef, metrics = loss_coefficients(
        current, batch, spec, plan=plan, old=old, loss=loss, eps=0.2, ratio_noise=None, noise_generator=None
    )
    assert coef is not None, metrics
    accumulate_gradients(model, batch, spec, coef, plan=plan, micro_batch=MICRO, mask_id=MASK)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads, metrics


def autograd_gradient(model, batch, plan, spec, old, loss: str):
    model.zero_grad()
    value = one_graph_loss(model, batch, plan, spec, old, loss)
    value.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads, float(value.detach())


def sgd_step(model, grads, lr):
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.sub_(lr * grads[name])


def assert_same_gradients(got, want):
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-10, msg=name)
    assert max(float(g.abs().max()) for g in want.values()) > 1e-6  # a real gradient, not zeros


def test_every_accepted_combination_is_covered():
    losses = {loss for loss, _ in COMBOS}
    assert losses == set(available_policy_losses() + available_token_policy_losses())
    assert {lik for _, lik in COMBOS} == set(LIKELIHOODS)


@pytest.mark.parametrize("sampling", ["replay", "fresh"])
@pytest.mark.parametrize("loss,likelihood", COMBOS)
def test_trainer_gradient_equals_autograd_at_iterations_one_and_two(loss, likelihood, sampling):
    """``replay``: the current policy is scored under the old estimate's masks; ``fresh``: under
    masks of its own (the old estimate keeps the rollout-time masks)."""
    batch, spec, model = make_batch(), spec_for(likelihood), toy(likelihood)
    old_plan = draw_plan(batch, spec, lambda k: torch.Generator().manual_seed(100 + k), micro_batch=MICRO)
    plan = (
        old_plan
        if sampling == "replay"
        else draw_plan(batch, spec, lambda k: torch.Generator().manual_seed(300 + k), micro_batch=MICRO)
    )
    old = estimate(all_token_logp(model, batch, old_plan, spec, micro_batch=MICRO, mask_id=MASK), old_plan, batch, spec)

    # iteration 1: the current weights are the old ones (ratio 1)
    got, metrics = trainer_gradient(model, batch, plan, spec, old, loss)
    want, value = autograd_gradient(model, batch, plan, spec, old, loss)
    assert metrics["loss"] == pytest.approx(value, rel=1e-9, abs=1e-12)
    assert_same_gradients(got, want)

    # iteration 2 after an optimizer step: current != old, so ratios, clipping and weights act
    sgd_step(model, got, lr=2.0)
    got, metrics = trainer_gradient(model, batch, plan, spec, old, loss)
    want, value = autograd_gradient(model, batch, plan, spec, old, loss)
    if loss != "spg":  # SPG has no importance ratio
        assert abs(metrics["ratio_max"] - 1.0) > 1e-4, metrics
    assert metrics["loss"] == pytest.approx(value, rel=1e-9, abs=1e-12)
    assert_same_gradients(got, want)


@pytest.mark.parametrize("loss,likelihood", COMBOS)
def test_a_small_step_raises_the_advantage_weighted_likelihood(loss, likelihood):
    """Sign test: along the trainer's gradient, sum_i A_i * d logp_i > 0 (logp = the estimate the
    loss differentiates, same masks), and positive-advantage completions gain on negative ones."""
    batch, spec, model = make_batch(), spec_for(likelihood), toy(likelihood)
    plan = draw_plan(batch, spec, lambda k: torch.Generator().manual_seed(200 + k), micro_batch=MICRO)

    def logp():
        with torch.no_grad():
            tok = all_token_logp(model, batch, plan, spec, micro_batch=MICRO, mask_id=MASK)
            return sequence_estimates_and_elbo(tok, plan, batch, spec)[0]

    before = logp()
    old = estimate(all_token_logp(model, batch, plan, spec, micro_batch=MICRO, mask_id=MASK), plan, batch, spec)
    grads, _ = trainer_gradient(model, batch, plan, spec, old, loss)
    sgd_step(model, grads, lr=1e-2)
    change = logp() - before
    adv = batch.advantages.double()
    assert float((adv * change).sum()) > 0, change
    assert float(change[adv > 0].mean()) > float(change[adv < 0].mean()), change


def test_the_trainers_second_inner_iteration_scores_the_current_policy(tmp_path):
    """In the trainer, iteration 2 of a replayed plan scores the updated policy: its ratios differ
    from 1 (a stale ``old_token_logp`` as the current estimate would give exactly 1), while
    iteration 1's log-ratio variance is exactly 0 (same weights, same masks)."""
    from test_trainer import in_process_trainer, one_step_config

    from stabledrl_mcore.rl.trainer import train

    run_dir = tmp_path / "run"
    with in_process_trainer():
        cfg = one_step_config(
            run_dir,
            **{
                "algo.inner_iterations": 2,
                "algo.mask_sampling": "replay",
                "rollout.temperature": 1.0,
                "optim.lr": 0.05,
            },
        )
        train(cfg)
    row = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][-1]
    assert row["skipped_updates"] == 0 and row["reward_std"] > 0, row
    assert row["log_ratio_var_first"] == pytest.approx(0.0, abs=1e-12), row
    assert abs(row["ratio_max"] - 1.0) > 1e-5, row


def _anchored_trainer_run(monkeypatch, run_dir, lr, seen, resume=None, **extra):
    """Run the in-process trainer, recording at each step the weights before the update, the loss
    of one autograd graph through the model on that step's batch, and ``before - lr * grad``."""
    from test_trainer import in_process_trainer, one_step_config

    from stabledrl_mcore.rl import trainer

    real_update = trainer.policy_update

    def anchored_update(s, batch, spec, step):
        params = [p for p in s.model.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        old = estimate(batch.old_token_logp, batch.plan, batch, spec)
        value = one_graph_loss_model(s.model, batch, spec, old, s.model.dllm_config.mask_token_id)
        grads = torch.autograd.grad(value, params)
        out = real_update(s, batch, spec, step)
        seen[step + 1] = {
            "before": before,
            "loss": float(value.detach()),
            "pairs": [(p.detach().clone(), b - lr * g) for p, b, g in zip(params, before, grads)],
            "moved": max(float((p - b).abs().max()) for p, b in zip(params, before)),
        }
        return out

    monkeypatch.setattr(trainer, "policy_update", anchored_update)
    with in_process_trainer():
        cfg = one_step_config(
            run_dir,
            **{
                "rollout.temperature": 1.0,
                "optim.name": "sgd",
                "optim.distributed": False,
                "optim.weight_decay": 0.0,
                "optim.clip_grad": 0.0,
                "optim.lr": lr,
                "optim.decay_style": "constant",
                "parallel.micro_batch_size": 2,
                "algo.inner_iterations": 1,
                "algo.mask_sampling": "replay",
                **extra,
            },
        )
        s = trainer.train(cfg, resume=resume)
        final = [p.detach().clone() for p in s.model.parameters() if p.requires_grad]
    return final


def _assert_sgd_anchor(record):
    assert record["moved"] > 1e-6  # the step did move the weights
    for got, want in record["pairs"]:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_one_trainer_step_is_the_hand_computed_sgd_update(tmp_path, monkeypatch):
    """Absolute anchor for the trainer comparisons (DP=2 vs DP=1, resumed vs straight): one real
    step of the in-process trainer (Megatron model, DDP, optimizer, micro-batches) moves the weights
    by exactly -lr x the autograd gradient of the loss computed in one graph on that step's batch."""
    seen = {}
    _anchored_trainer_run(monkeypatch, tmp_path / "run", 0.05, seen)
    _assert_sgd_anchor(seen[1])


def test_the_resumed_step_starts_from_the_checkpoint_and_is_the_fresh_update(tmp_path, monkeypatch):
    """Absolute anchor for the resume comparison: ``--resume auto`` loads exactly the weights the first
    run ended with, the next step's logged loss is the loss computed afresh (one graph) on that step's
    batch from the loaded weights, and its update is -lr x that loss's autograd gradient."""
    lr, first, second = 0.05, {}, {}
    run_dir = tmp_path / "run"
    saved = _anchored_trainer_run(monkeypatch, run_dir, lr, first, **{"checkpoint.save_every": 1})
    _anchored_trainer_run(monkeypatch, run_dir, lr, second, resume="auto", **{"checkpoint.save_every": 1, "steps": 2})
    assert sorted(second) == [2], "the resumed run must start at step 2"
    for loaded, want in zip(second[2]["before"], saved):
        assert torch.equal(loaded, want), "the resumed weights are not the checkpointed ones"
    rows = {r["step"]: r for r in map(json.loads, open(run_dir / "metrics.jsonl"))}
    assert sorted(rows) == [1, 2]
    assert rows[2]["loss"] == pytest.approx(second[2]["loss"], rel=1e-5, abs=1e-7)
    assert rows[1]["loss"] == pytest.approx(first[1]["loss"], rel=1e-5, abs=1e-7)
    _assert_sgd_anchor(second[2])


def one_graph_loss_model(model, batch, spec, old, mask_id):
    """:func:`one_graph_loss` for the trainer's model and loss (``stabledrl``, eps 0.2)."""
    tok = torch.stack(
        [
            token_logp(model, batch, batch.plan, spec, rows=slice(0, batch.size), mask_id=mask_id, draw=d)
            for d in range(batch.plan.num_mc)
        ]
    )
    logp, elbo = sequence_estimates_and_elbo(tok, batch.plan, batch, spec)
    value, _ = sequence_policy_loss(
        "stabledrl",
        logp,
        old.logp,
        batch.advantages,
        batch.group_index,
        eps=0.2,
        ratio_logp=elbo,
        old_ratio_logp=old.ratio_logp,
        completion_lengths=scored_region(batch, spec).sum(-1),
    )
    return value
