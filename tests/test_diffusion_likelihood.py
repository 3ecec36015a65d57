"""Likelihood proxies: exact unbiasedness, variance reduction, replay, bounds, gradients.

Exact targets (the issue's "exact likelihood"):

- ``test_mc_elbo_is_unbiased_against_enumeration``: for a context-dependent toy
  denoiser (vocab 3 + mask, 4 completion tokens) the exact expectation of each
  estimator is computed by enumerating all 2^4 masks: count mode
  sum_l (1/l) mean_{|m|=l} f(m) (= the ELBO); ratio mode
  sum_m f(m) int_0^1 p^(|m|-1) (1-p)^(L-|m|) dt with p = (1-eps)t + eps (for
  coupled pairs p = eps + (1-2eps)t, averaged with the complement's 1-p), by
  exact Gauss-Legendre quadrature;
  f(m) = sum of log p(x_i | x_m) over masked i.
- ``test_factorised_model_elbo_and_eubo_equal_log_p``: a denoiser whose
  predictions ignore the context is a factorised model; its ELBO (and EUBO)
  equal log p(x) = sum_i log q_i(x_i) exactly.
"""

import itertools
import math

import numpy as np
import pytest
import torch

from stabledrl_mcore.diffusion import (
    build_plan,
    elbo,
    elbo_eubo,
    eubo,
    mean_field_logp,
    mixture,
)
from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig

P, L = 2, 4
SEQ = torch.tensor([0, 2, 1, 0, 2, 2])


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def toy():
    cfg = ToyDLLMConfig(vocab_size=4, mask_token_id=3, hidden_size=16, num_layers=1, num_heads=2, logit_scale=2.0)
    return ToyDiffusionLM(cfg, seed=1, dtype=torch.float64)


def batch(R):
    comp = torch.zeros(R, P + L, dtype=torch.bool)
    comp[:, P:] = True
    return SEQ.expand(R, -1).clone(), comp


def _f_of_masks(model):
    """{mask tuple: f(mask)} for every subset of the completion positions."""
    masks = list(itertools.product([0, 1], repeat=L))
    m = torch.zeros(len(masks), P + L, dtype=torch.bool)
    m[:, P:] = torch.tensor(masks, dtype=torch.bool)
    with torch.no_grad():
        logits = model(SEQ.expand(len(masks), -1).masked_fill(m, 3))
    lp = torch.log_softmax(logits, -1).gather(-1, SEQ.expand(len(masks), -1)[..., None])[..., 0]
    return [(int(k.sum()), float((lp * k).sum())) for k, lp in zip(m[:, P:].double(), lp[:, P:])]


def exact_expectation(model, mode, coupled=False, eps=1e-3):
    terms = _f_of_masks(model)
    if mode == "count":
        by_l = {l_: [f for k, f in terms if k == l_] for l_ in range(1, L + 1)}
        return sum(np.mean(by_l[l_]) / l_ for l_ in by_l)
    x, w = np.polynomial.legendre.leggauss(32)
    t, w = (x + 1) / 2, w / 2
    p = (1 - (2 if coupled else 1) * eps) * t + eps  # coupled pairs use p = eps + (1 - 2 eps) t

    def integral(q):
        return sum(f * np.sum(w * q ** (k - 1) * (1 - q) ** (L - k)) for k, f in terms if k > 0)

    return 0.5 * (integral(p) + integral(1 - p)) if coupled else integral(p)


def estimates(model, R, **kw):
    ids, comp = batch(R)
    with torch.no_grad():
        return elbo(model, ids, comp, **kw).seq


@pytest.mark.parametrize(
    "mode,coupled,stratified",
    [
        ("count", False, True),
        ("count", False, False),
        ("count", True, True),
        ("ratio", False, True),
        ("ratio", True, False),
    ],
)
def test_mc_elbo_is_unbiased_against_enumeration(toy, mode, coupled, stratified):
    # ratio mode with eps = 1e-3 has weights up to 1000 (heavy tails, variance ~100 here); eps = 0.05 keeps
    # the 3-standard-error check meaningful (the exact target uses the same eps)
    eps = 0.05 if mode == "ratio" else 1e-3
    exact = exact_expectation(toy, mode, coupled, eps)
    est = estimates(
        toy,
        20000,
        num_mc=2 if coupled else 1,
        generator=gen(11),
        mode=mode,
        coupled=coupled,
        stratified=stratified,
        eps=eps,
    )
    se = est.std().item() / len(est) ** 0.5
    assert abs(est.mean().item() - exact) < 3 * se, (est.mean().item(), exact, se)
    if mode == "count":  # count weights give exactly the ELBO, coupled or not
        assert exact == pytest.approx(exact_expectation(toy, "count", not coupled))


def variance_table(model, R=3000, eps=0.05):
    """Per-sequence variance of the MC ELBO for each (mode, coupled, num_mc); used by the test and the report."""
    table = {}
    for mode in ("count", "ratio"):
        for coupled in (False, True):
            for num_mc in (1, 2, 4, 8):
                if coupled and num_mc == 1:
                    continue
                est = estimates(model, R, num_mc=num_mc, generator=gen(5), mode=mode, coupled=coupled, eps=eps)
                table[(mode, coupled, num_mc)] = est.var().item()
    return table


def test_variance_falls_with_num_mc_and_coupling(toy):
    table = variance_table(toy)
    for mode in ("count", "ratio"):
        v = [table[(mode, False, m)] for m in (1, 2, 4, 8)]
        assert v[1] < v[0] and v[2] < v[1] and v[3] < v[2] and v[3] < v[0] / 6, (mode, v)
        for m in (2, 4, 8):
            assert table[(mode, True, m)] < table[(mode, False, m)], (mode, m, table)


def test_factorised_model_elbo_and_eubo_equal_log_p():
    V, S = 5, 6
    table = torch.randn(S, V, generator=gen(2), dtype=torch.float64)

    class Factorised(torch.nn.Module):
        dllm_config = ToyDLLMConfig(vocab_size=V, mask_token_id=V - 1)

        def forward(self, ids, position_ids=None, attention_mask=None, *, kv_cache=None, gather_output=True):
            return table.expand(ids.shape[0], -1, -1)

    ids = torch.tensor([[0, 1, 3, 2, 0, 1]]).expand(6000, -1)
    comp = torch.ones_like(ids, dtype=torch.bool)
    comp[:, 0] = False
    log_p = torch.log_softmax(table, -1).gather(-1, ids[0, :, None])[1:, 0].sum().item()
    est = elbo(Factorised(), ids, comp, num_mc=1, generator=gen()).seq
    assert abs(est.mean().item() - log_p) < 3 * est.std().item() / len(est) ** 0.5
    # EUBO = (1/beta) sum_i log(q_i^beta E[w 1[masked]]) = log p; the MC log-of-mean is only O(1/num_mc) low
    up = eubo(Factorised(), ids[:256], comp[:256], num_mc=64, generator=gen(), beta=1.5).seq
    assert abs(up.mean().item() - log_p) < 0.1 and (up - log_p).abs().max() < 0.4


def test_every_estimator_is_reproducible_and_replays_its_plan(toy):
    ids, comp = batch(3)
    fns = {
        "elbo": lambda **k: elbo(toy, ids, comp, num_mc=4, coupled=True, **k),
        "ratio": lambda **k: elbo(toy, ids, comp, num_mc=2, mode="ratio", **k),
        "mean_field": lambda **k: mean_field_logp(toy, ids, comp, **k),
        "eubo": lambda **k: eubo(toy, ids, comp, num_mc=2, **k),
        "mixture": lambda **k: mixture(toy, ids, comp, num_mc=2, **k),
    }
    for name, fn in fns.items():
        a, b = fn(generator=gen(7)), fn(generator=gen(7))
        assert torch.equal(a.seq, b.seq) and torch.equal(a.token, b.token), name
        assert torch.equal(fn(plan=a.plan).seq, a.seq), name
    with pytest.raises(TypeError):
        elbo(toy, ids, comp, num_mc=1)


def test_shared_masks_cancel_noise_in_new_minus_old(toy):
    """Antithetic sharing (LLaDA-1.5): replaying the old policy's masks makes the log-ratio far less noisy."""
    old = ToyDiffusionLM(toy.dllm_config, seed=1, dtype=torch.float64)
    with torch.no_grad():
        for p, q in zip(old.parameters(), toy.parameters()):
            p.copy_(q + 0.01 * torch.randn(q.shape, generator=gen(3), dtype=q.dtype))
    ids, comp = batch(2000)
    with torch.no_grad():
        new = elbo(toy, ids, comp, num_mc=2, generator=gen(1))
        shared = new.seq - elbo(old, ids, comp, plan=new.plan).seq
        indep = new.seq - elbo(old, ids, comp, num_mc=2, generator=gen(2)).seq
    assert shared.var() < indep.var() / 20


def test_elbo_token_terms_length_normalisation_and_manual_formula(toy):
    ids, comp = batch(2)
    comp[1, -1] = False
    est = elbo(toy, ids, comp, num_mc=3, generator=gen(4))
    torch.testing.assert_close(est.token.sum(-1), est.seq)
    norm = elbo(toy, ids, comp, plan=est.plan, length_normalize=True)
    torch.testing.assert_close(norm.seq, est.seq / comp.sum(-1))
    manual = torch.zeros(2, dtype=torch.float64)
    for m in range(3):
        lp = torch.log_softmax(toy(est.plan.noisy(ids, 3)[m]), -1).gather(-1, ids[..., None])[..., 0]
        manual += (est.plan.weight[m] * lp).sum(-1) / 3
    torch.testing.assert_close(est.seq, manual)


def test_mean_field_is_one_step_full_mask(toy):
    ids, comp = batch(2)
    mf = mean_field_logp(toy, ids, comp, prompt_mask_prob=0.0)
    lp = torch.log_softmax(toy(ids.masked_fill(comp, 3)), -1).gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(mf.token, lp * comp)
    with_prompt = mean_field_logp(toy, ids[:1].expand(400, -1), comp[:1].expand(400, -1), generator=gen())
    rate = with_prompt.plan.masked[0, :, :P].float().mean().item()
    assert 0.08 < rate < 0.22  # d1: prompt tokens masked with p = 0.15


def test_eubo_formula_mixture_and_upper_bound_on_average(toy):
    ids, comp = batch(2)
    lo, hi = elbo_eubo(toy, ids, comp, num_mc=4, generator=gen(9), beta=1.5, length_normalize=True)
    plan = lo.plan
    lp = torch.stack(
        [torch.log_softmax(toy(plan.noisy(ids, 3)[m]), -1).gather(-1, ids[..., None])[..., 0] for m in range(4)]
    )
    inner = (plan.weight * lp.exp() ** 1.5).mean(0)  # E[w 1[masked] p^beta], zero where never masked
    cov = inner > 0
    want = torch.where(cov, inner.clamp(min=1e-300).log() / 1.5, 0.0).sum(-1) / cov.sum(-1)
    torch.testing.assert_close(hi.seq, want)
    mix = mixture(toy, ids, comp, plan=plan, omega=0.5, beta=1.5, length_normalize=True)
    torch.testing.assert_close(mix.seq, 0.5 * hi.seq + 0.5 * lo.seq)
    ids_r, comp_r = batch(64)
    with torch.no_grad():
        lo_r, hi_r = elbo_eubo(toy, ids_r, comp_r, num_mc=16, generator=gen(1), beta=1.5)
    assert hi_r.seq.mean() > lo_r.seq.mean()  # the sandwich: EUBO above ELBO


def test_estimates_carry_gradients_and_logprob_hook(toy):
    ids, comp = batch(2)
    est = mixture(toy, ids, comp, num_mc=2, generator=gen())
    est.seq.sum().backward()
    grads = [p.grad for p in toy.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    toy.zero_grad(set_to_none=True)
    seen = {}

    def hook(logits, targets):
        seen["shape"] = tuple(logits.shape)
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]

    ref = elbo(toy, ids, comp, num_mc=2, generator=gen(1))
    got = elbo(toy, ids, comp, plan=ref.plan, logprob_fn=hook)
    assert seen["shape"] == (2, P + L, 4)
    torch.testing.assert_close(got.seq, ref.seq)
    plan = build_plan(comp, num_mc=1, generator=gen(), mode="full")
    assert elbo(toy, ids, comp, plan=plan).plan is plan


def test_eubo_is_exact_where_the_releases_float32_power_underflows():
    """SPG's EUBO term ``(1/beta) log mean_m w_m p_m^beta`` in log space: at token log-probs of
    -120 (beta 1.5) the release's float32 ``p ** beta`` is 0, its log -inf and its gradient NaN;
    here the value equals the float64 formula and the gradient is each draw's share / M."""
    from stabledrl_mcore.diffusion.likelihood import eubo_from_draws
    from stabledrl_mcore.diffusion.masking import MaskPlan

    beta, logp_value = 1.5, -120.0
    masked = torch.ones(2, 1, 3, dtype=torch.bool)
    weight = torch.tensor([[[3.0, 3.0, 3.0]], [[1.5, 1.5, 1.5]]])
    plan = MaskPlan(masked=masked, weight=weight, ratio=torch.ones(2, 1, 1), mode="count")
    logp = torch.full((2, 1, 3), logp_value, requires_grad=True)
    seq, token = eubo_from_draws(logp, plan, torch.ones(1, 3, dtype=torch.bool), beta=beta)
    exact = (math.log((3.0 + 1.5) / 2) + beta * logp_value) / beta  # per token, in float64 by hand
    torch.testing.assert_close(token.double(), torch.full((1, 3), exact, dtype=torch.float64), rtol=1e-6, atol=1e-4)
    seq.sum().backward()
    assert torch.isfinite(logp.grad).all()
    torch.testing.assert_close(logp.grad[:, 0, 0], torch.tensor([3.0 / 4.5, 1.5 / 4.5]))
    # the release's way, in float32: exp underflows, so the log and its gradient are lost
    release = (weight * logp.detach().exp() ** beta).mean(0).log() / beta
    assert torch.isinf(release).all()
