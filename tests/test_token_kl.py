"""d1's diffu-GRPO with its token-level KL to a reference policy (issue #40, item 7).

Re-derived here from d1's released trainer (``diffu-grpo/diffu_grpo_trainer.py``,
``DiffuGRPOTrainer.compute_loss``)::

    per_token_kl = exp(ref - logp) - (ref - logp) - 1                  # k3, ref without gradient
    rho = exp(logp - old)
    per_token_loss = -min(rho * A, clip(rho, 1 - eps, 1 + eps) * A) + beta * per_token_kl
    loss = sum(per_token_loss * mask) / sum(mask)                     # aggregation="global_token_mean"

and with this package's default ``aggregation="sequence_mean"`` the same per-token loss as a
masked mean per sequence, then the mean over sequences (``token_losses.token_policy_loss``'s
documented form). Values and gradients of ``token_policy_loss(..., ref_logp_tok=, kl_coef=)``
and of the update's ``loss_coefficients`` (which hands the loss draw 0 of the reference's token
log-probs) must equal the hand-written loss in float64.
"""

import pytest
import torch

from stabledrl_mcore.algorithms.token_losses import token_policy_loss

N, T, EPS, BETA = 6, 7, 0.5, 0.04


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(N, T, generator=g, dtype=torch.float64) - 2.0
    old = logp + 0.4 * torch.randn(N, T, generator=g, dtype=torch.float64)  # some ratios clipped
    ref = logp + 0.8 * torch.randn(N, T, generator=g, dtype=torch.float64)  # KL far from 0
    adv = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.0, 0.9], dtype=torch.float64)
    mask = torch.rand(N, T, generator=g) > 0.3
    mask[:, 0] = True
    mask[2, 3:] = False  # uneven lengths: the two aggregations differ
    return logp, old, ref, adv, mask, torch.arange(N) // 3


def _d1_loss(logp, old, ref, adv, mask, estimator, aggregation):
    """The hand-written per-token loss of d1 (k3 as released; k2 and k1 in the same place)."""
    log_r = ref - logp  # ref is a constant: no gradient flows into it
    if estimator == "k3":
        kl = torch.exp(log_r) - log_r - 1
    elif estimator == "k2":
        kl = 0.5 * log_r**2
    else:
        kl = -log_r
    rho = torch.exp(logp - old)
    a = adv[:, None]
    per_token = -torch.min(rho * a, torch.clamp(rho, 1 - EPS, 1 + EPS) * a) + BETA * kl
    m = mask.to(logp.dtype)
    if aggregation == "global_token_mean":
        return (per_token * m).sum() / m.sum(), (kl * m).sum() / m.sum()
    per_seq = (per_token * m).sum(1) / m.sum(1)
    return per_seq.mean(), ((kl * m).sum(1) / m.sum(1)).mean()


@pytest.mark.parametrize("estimator", ["k3", "k2", "k1"])
@pytest.mark.parametrize("aggregation", ["global_token_mean", "sequence_mean"])
@pytest.mark.parametrize("seed", [0, 1])
def test_diffu_grpo_kl_equals_d1_loss_and_gradient(seed, aggregation, estimator):
    logp, old, ref, adv, mask, gi = _inputs(seed)
    mine = logp.clone().requires_grad_(True)
    hand = logp.clone().requires_grad_(True)
    value, metrics = token_policy_loss(
        "diffu_grpo",
        mine,
        old,
        adv,
        mask,
        gi,
        eps=EPS,
        kl_coef=BETA,
        ref_logp_tok=ref,
        kl_estimator=estimator,
        aggregation=aggregation,
    )
    expected, kl = _d1_loss(hand, old, ref, adv, mask, estimator, aggregation)
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(value, mine)
    (want,) = torch.autograd.grad(expected, hand)
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-13)
    assert metrics["kl"] == pytest.approx(float(kl.detach()), rel=1e-10)
    if estimator == "k3":
        assert metrics["kl"] > 0.05  # the reference is far enough that the term matters
    # the KL term's own gradient, in closed form (k3: beta * (1 - exp(ref - logp)) per token)
    base, _ = token_policy_loss("diffu_grpo", hand, old, adv, mask, gi, eps=EPS, aggregation=aggregation)
    (g0,) = torch.autograd.grad(base, hand)
    if estimator == "k3":
        m = mask.double()
        denom = m.sum() if aggregation == "global_token_mean" else m.sum(1, keepdim=True) * N
        torch.testing.assert_close(grad - g0, BETA * (1 - torch.exp(ref - logp)) * m / denom, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("aggregation", ["global_token_mean", "sequence_mean"])
def test_update_coefficients_carry_the_token_kl(aggregation):
    """``loss_coefficients`` (the update's d loss / d token log-probs) with a reference: draw 0 of
    ``ref_tok`` reaches the token loss, the coefficients are the d1 loss's gradient."""
    from stabledrl_mcore.diffusion.masking import MaskPlan
    from stabledrl_mcore.rl.estimates import LikelihoodSpec, OldEstimate
    from stabledrl_mcore.rl.rollout import RolloutBatch
    from stabledrl_mcore.rl.update import loss_coefficients

    logp, old, ref, adv, mask, gi = _inputs(3)
    p = 2  # prompt positions (never scored): the completion is positions 2.. of S = T + 2
    pad = torch.zeros(N, p, dtype=torch.float64)
    comp = torch.cat([torch.zeros(N, p, dtype=torch.bool), mask], 1)
    full = comp.clone()
    full[:, p:] = True
    batch = RolloutBatch(
        sequences=torch.randint(3, 20, (N, T + p), generator=torch.Generator().manual_seed(0)),
        prompt_len=p,
        prompt_valid=torch.ones(N, T + p, dtype=torch.bool),
        completion_mask=comp,
        group_index=gi,
        completions=[""] * N,
        references=[None] * N,
        advantages=adv,
    )
    plan = MaskPlan(full[None], comp[None].double(), torch.ones(1, N, 1, dtype=torch.float64), mode="full")
    old_tok = torch.cat([pad, old * mask], 1)[None]
    spec = LikelihoodSpec(kind="mean_field", num_mc=1)
    coef, metrics = loss_coefficients(
        torch.cat([pad, logp * mask], 1)[None],
        batch,
        spec,
        plan=plan,
        old=OldEstimate(plan, old_tok, old_tok.sum(-1)[0], old_tok.sum(-1)[0]),
        loss="diffu_grpo",
        loss_options={"aggregation": aggregation},
        eps=EPS,
        ratio_noise=None,
        noise_generator=None,
        kl_coef=BETA,
        kl_estimator="k3",
        ref_tok=torch.cat([pad, ref * mask], 1)[None],
    )
    hand = (logp * mask).requires_grad_(True)
    expected, kl = _d1_loss(hand, old * mask, ref * mask, adv, mask, "k3", aggregation)
    (want,) = torch.autograd.grad(expected, hand)
    assert coef.shape == (1, N, T + p)
    assert torch.equal(coef[0, :, :p], torch.zeros(N, p, dtype=coef.dtype))
    torch.testing.assert_close(coef[0, :, p:], want, rtol=1e-10, atol=1e-13)
    assert metrics["kl"] == pytest.approx(float(kl.detach()), rel=1e-10)
