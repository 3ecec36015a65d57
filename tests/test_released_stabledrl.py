"""``stabledrl_released`` is the public release's update, re-derived here from its formulas.

The release (JianyuanZhong/StableDRL, ``compute_loss_spg`` with ``use_snis``):
per MC draw, ELBO_d = mean over masked completion tokens of log p; ELBO = mean_d;
EUBO = (1/beta) * mean over covered tokens of log mean_d(p^beta * m / t_d) with
t_d = (masked completion tokens) / (completion length); the bound is the ELBO where
A > 0 and 0.5 EUBO + 0.5 ELBO elsewhere; log w = ELBO_theta - ELBO_old (detached),
capped at log 5, softmax over the group; loss = -sum_i w_i A_i bound_i per group.
This test computes that from raw toy-model logits, independently of the project's
estimators, and compares loss and gradients with the trainer's path
(``loss_coefficients`` + ``accumulate_gradients``) on the same masks.
"""

from __future__ import annotations

import math

import pytest
import torch

from stabledrl_mcore.diffusion.mask_schemes import MaskRegions, build_mask_plan
from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig
from stabledrl_mcore.rl.estimates import LikelihoodSpec, all_token_logp, estimate
from stabledrl_mcore.rl.rollout import RolloutBatch
from stabledrl_mcore.rl.update import accumulate_gradients, loss_coefficients

P, GEN, MASK, EOS = 3, 8, 11, 1
BETA, OMEGA, CAP = 1.5, 0.5, math.log(5.0)


def make_batch():
    g = torch.Generator().manual_seed(4)
    n = 8  # two groups of four
    seqs = torch.randint(2, 10, (n, P + GEN), generator=g)
    eos_at = [8, 5, 10, 7, 9, 6, 10, 4]  # some completions end early (EOS, then EOS padding)
    comp = torch.zeros(n, P + GEN, dtype=torch.bool)
    for i, e in enumerate(eos_at):
        seqs[i, e:] = EOS
        comp[i, P : e + 1] = True
    comp[:, P + GEN :] = False
    return RolloutBatch(
        sequences=seqs,
        prompt_len=P,
        prompt_valid=torch.ones_like(comp),
        completion_mask=comp,
        group_index=torch.arange(n) // 4,
        completions=[""] * n,
        references=[None] * n,
        advantages=torch.tensor([0.7, -0.2, -0.5, 0.0, 1.0, -1.0, 0.25, -0.25]),
    )


def model(seed):
    return ToyDiffusionLM(
        ToyDLLMConfig(vocab_size=12, mask_token_id=MASK, eos_token_id=EOS, pad_token_id=EOS, hidden_size=16),
        seed=seed,
        dtype=torch.float64,
    )


def plan_for(batch, seed, scheme, post_eos):
    regions = MaskRegions.from_batch(
        batch.sequences, P, completion_mask=batch.completion_mask, prompt_valid=batch.prompt_valid
    )
    options = {"block_length": 4, "prefix_mask_prob": 0.15} if scheme == "block_random" else {}
    return build_mask_plan(
        regions, scheme, num_mc=2, generator=torch.Generator().manual_seed(seed), post_eos=post_eos, **options
    )


def release_terms(net, batch, plan):
    """(ELBO [N], bound [N]) by the release's formulas, from the model's own logits."""
    comp = batch.completion_mask.double()
    elbo_d, probs = [], []
    for d in range(plan.num_mc):
        noisy = batch.sequences.masked_fill(plan.masked[d], MASK)
        logp_all = torch.log_softmax(net(noisy).double(), -1)
        logp = logp_all.gather(-1, batch.sequences[..., None])[..., 0]
        m = plan.masked[d].double() * comp
        elbo_d.append((logp * m).sum(-1) / m.sum(-1).clamp_min(1e-8))
        t = m.sum(-1) / comp.sum(-1).clamp_min(1e-8)
        probs.append(logp.exp().pow(BETA) * m / t.clamp_min(1e-8)[:, None])
    elbo = torch.stack(elbo_d).mean(0)
    avg = torch.stack(probs).mean(0)
    covered = avg > 0
    eubo = (
        (torch.where(covered, avg, torch.ones_like(avg)).log() * covered).sum(-1) / covered.sum(-1).clamp_min(1) / BETA
    )
    adv = batch.advantages.double()
    return elbo, torch.where(adv > 0, elbo, OMEGA * eubo + (1 - OMEGA) * elbo)


@pytest.mark.parametrize("scheme,post_eos", [("block_random", "mask_and_skip"), ("uniform", "visible")])
def test_released_loss_and_gradient_match_the_release_formulas(scheme, post_eos):
    batch = make_batch()
    policy, old_policy = model(0), model(1)  # a different old policy gives non-trivial weights
    old_plan, plan = plan_for(batch, 10, scheme, post_eos), plan_for(batch, 11, scheme, post_eos)
    spec = LikelihoodSpec(kind="spg", num_mc=2, beta=BETA, omega=OMEGA, post_eos=post_eos)

    # the release, written out
    with torch.no_grad():
        old_elbo, _ = release_terms(old_policy, batch, old_plan)
    elbo, bound = release_terms(policy, batch, plan)
    log_w = (elbo.detach() - old_elbo).clamp_max(CAP)
    ref_loss = 0.0
    for g in batch.group_index.unique():
        rows = batch.group_index == g
        w = torch.softmax(log_w[rows], 0)
        ref_loss = ref_loss - (w * batch.advantages.double()[rows] * bound[rows]).sum()
    ref_loss = ref_loss / batch.group_index.unique().numel()  # DDP / accumulation average over groups
    ref_loss.backward()
    want = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    assert (log_w > CAP - 1e-9).any() or (log_w < CAP).all()

    # the project's trainer path
    old = estimate(
        all_token_logp(old_policy, batch, old_plan, spec, micro_batch=4, mask_id=MASK), old_plan, batch, spec
    )
    current = all_token_logp(policy, batch, plan, spec, micro_batch=4, mask_id=MASK)
    coef, metrics = loss_coefficients(
        current,
        batch,
        spec,
        plan=plan,
        old=old,
        loss="stabledrl_released",
        eps=0.2,
        ratio_noise=None,
        noise_generator=None,
    )
    assert coef is not None, metrics
    accumulate_gradients(policy, batch, spec, coef, plan=plan, micro_batch=4, mask_id=MASK)
    # float64 throughout except the plan's ELBO weights (L/n), stored in float32: ~1e-7 relative
    assert metrics["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    for name, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-9, msg=name)
    assert any(want[n].abs().max() > 0 for n in want)


def test_the_ratio_comes_from_the_elbo_not_the_bound():
    """With A <= 0 the bound mixes in the EUBO; the importance weight must not."""
    batch = make_batch()
    policy = model(0)
    plan = plan_for(batch, 11, "uniform", "visible")
    spec = LikelihoodSpec(kind="spg", num_mc=2)
    tok = all_token_logp(policy, batch, plan, spec, micro_batch=8, mask_id=MASK)
    old = estimate(tok, plan, batch, spec)
    assert not torch.allclose(old.logp, old.ratio_logp)  # the sandwich differs from the ELBO
    _, metrics = loss_coefficients(
        tok, batch, spec, plan=plan, old=old, loss="stabledrl_released", eps=0.2, ratio_noise=None, noise_generator=None
    )
    assert metrics["ratio_max"] == pytest.approx(1.0) and metrics["log_ratio_var"] == pytest.approx(0.0, abs=1e-12)
