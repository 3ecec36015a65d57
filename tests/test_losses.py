"""Tests for stabledrl_mcore.algorithms.losses / losses_token / noise.

Every loss's gradient with respect to logp is pinned against a hand-written
closed form (Python loops over groups, float64) on random inputs that include
ratio outliers of 1e-4 and 1e4 with both advantage signs.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from stabledrl_mcore.algorithms.losses import (
    available_policy_losses,
    available_token_policy_losses,
    get_policy_loss,
    register_policy_loss,
    sequence_policy_loss,
    spg_select_bound,
    token_policy_loss,
)
from stabledrl_mcore.algorithms.losses_common import exp_overflow_at, nonfinite_loss_cause
from stabledrl_mcore.algorithms.ratio_noise import RatioNoise, perturb_log_ratio

EPS = 0.2
OUTLIER = math.log(1e4)


# --------------------------------------------------------------------------- fixtures


def make_inputs(seed: int, dtype: torch.dtype = torch.float64):
    """13 samples in 3 unequal groups with shuffled, non-contiguous ids; the
    first four samples are ratio outliers 1e4/1e-4 with A of both signs."""
    g = torch.Generator().manual_seed(seed)
    group_index = torch.tensor([7] * 5 + [2] * 6 + [40] * 2, dtype=torch.long)
    perm = torch.randperm(13, generator=g)
    group_index = group_index[perm]
    logp = (torch.randn(13, generator=g, dtype=dtype) * 3 - 20).requires_grad_(True)
    log_ratio = torch.randn(13, generator=g, dtype=dtype) * 0.3
    adv = torch.randn(13, generator=g, dtype=dtype)
    log_ratio[:4] = torch.tensor([OUTLIER, OUTLIER, -OUTLIER, -OUTLIER], dtype=dtype)
    adv[:4] = torch.tensor([-1.5, 0.7, -0.4, 1.2], dtype=dtype)
    old_logp = logp.detach() - log_ratio
    return logp, old_logp, adv, group_index


def groups_of(group_index: torch.Tensor) -> list[list[int]]:
    out: dict[int, list[int]] = {}
    for i, gid in enumerate(group_index.tolist()):
        out.setdefault(gid, []).append(i)
    return list(out.values())


def autograd_grad(name, logp, old_logp, adv, gi, **kw):
    loss, metrics = sequence_policy_loss(name, logp, old_logp, adv, gi, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, metrics


def ppo_active(rho: float, a: float, eps: float) -> bool:
    return rho <= 1 + eps if a >= 0 else rho >= 1 - eps


# --------------------------------------------------------------------------- closed forms


def ref_stabledrl(logp, old, adv, gi, eps=EPS):
    grad = [0.0] * len(old)
    value = 0.0
    groups = groups_of(gi)
    for idx in groups:
        c = [min(max(math.exp(logp[i] - old[i]), 1 - eps), 1 + eps) for i in idx]
        for i, ci in zip(idx, c):
            w = ci / sum(c)
            grad[i] = -w * adv[i] / len(groups)
            value -= w * adv[i] / len(groups)
    return value, torch.tensor(grad, dtype=torch.float64)


def ref_released(logp, old, adv, gi, cap=math.log(5)):
    grad = [0.0] * len(old)
    groups = groups_of(gi)
    for idx in groups:
        e = [math.exp(min(float(logp[i] - old[i]), cap)) for i in idx]
        for i, ei in zip(idx, e):
            grad[i] = -(ei / sum(e)) * adv[i] / len(groups)
    return torch.tensor(grad, dtype=torch.float64)


def ref_grpo(logp, old, adv, gi, eps=EPS):
    grad = [0.0] * len(old)
    groups = groups_of(gi)
    for idx in groups:
        for i in idx:
            rho = math.exp(logp[i] - old[i])
            if ppo_active(rho, adv[i], eps):
                grad[i] = -rho * adv[i] / (len(groups) * len(idx))
    return torch.tensor(grad, dtype=torch.float64)


def ref_espo(logp, old, adv, lengths, eps=EPS):
    n = len(old)
    grad = [0.0] * len(old)
    for i in range(n):
        rho = math.exp((logp[i] - old[i]) / lengths[i])
        if ppo_active(rho, adv[i], eps):
            grad[i] = -rho * adv[i] / (n * lengths[i])
    return torch.tensor(grad, dtype=torch.float64)


def ref_spg(adv, gi):
    grad = [0.0] * len(adv)
    groups = groups_of(gi)
    for idx in groups:
        for i in idx:
            grad[i] = -adv[i] / (len(groups) * len(idx))
    return torch.tensor(grad, dtype=torch.float64)


def ref_kl_grad(logp, ref, gi, estimator):
    grad = [0.0] * len(ref)
    groups = groups_of(gi)
    for idx in groups:
        for i in idx:
            d = 1 - math.exp(ref[i] - logp[i]) if estimator == "k3" else logp[i] - ref[i]
            grad[i] = d / (len(groups) * len(idx))
    return torch.tensor(grad, dtype=torch.float64)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stabledrl_gradient_and_value_closed_form(seed):
    logp, old, adv, gi = make_inputs(seed)
    loss, grad, _ = autograd_grad("stabledrl", logp, old, adv, gi, eps=EPS)
    value, expected = ref_stabledrl(logp.detach().tolist(), old.tolist(), adv.tolist(), gi)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    assert loss.item() == pytest.approx(value, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap", [math.log(5), 0.5])
def test_stabledrl_released_gradient_closed_form(seed, cap):
    logp, old, adv, gi = make_inputs(seed)
    _, grad, m = autograd_grad("stabledrl_released", logp, old, adv, gi, log_weight_cap=cap)
    expected = ref_released(logp.detach().tolist(), old.tolist(), adv.tolist(), gi, cap)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    assert m["clip_frac_low"] == 0.0 and m["clip_frac_high"] > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_gradient_closed_form(seed):
    logp, old, adv, gi = make_inputs(seed)
    _, grad, _ = autograd_grad("grpo", logp, old, adv, gi, eps=EPS)
    expected = ref_grpo(logp.detach().tolist(), old.tolist(), adv.tolist(), gi)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    # the 1e4 outlier with A < 0 passes straight through (sample 0)
    assert abs(grad[0].item()) > 1e3 * abs(ref_stabledrl(logp.detach().tolist(), old.tolist(), adv.tolist(), gi)[1][0])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("with_lengths", [True, False])
def test_espo_gradient_closed_form(seed, with_lengths):
    logp, old, adv, gi = make_inputs(seed)
    lengths = torch.arange(1, 14, dtype=torch.long) if with_lengths else None
    if with_lengths:  # keep the 1e4 / 1e-4 outliers outliers after length normalisation
        lengths[:4] = 1
    kw = {"lengths": lengths} if with_lengths else {}
    _, grad, _ = autograd_grad("espo", logp, old, adv, gi, eps=EPS, **kw)
    ls = lengths.tolist() if with_lengths else [1] * 13
    expected = ref_espo(logp.detach().tolist(), old.tolist(), adv.tolist(), ls)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_spg_gradient_closed_form(seed):
    logp, old, adv, gi = make_inputs(seed)
    _, grad, m = autograd_grad("spg", logp, old, adv, gi)
    torch.testing.assert_close(grad, ref_spg(adv.tolist(), gi), rtol=1e-10, atol=1e-12)
    assert m["ess"] == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_spg_length_weighted_closed_form_per_group(seed):
    """``aggregation: length_weighted`` (llada_8b_spg.yaml): each group's lengths are normalised
    within the group, d loss / d logp_i = -A_i L_i / (G sum_{j in g(i)} L_j), on 3 groups of
    unequal sizes and unequal lengths (a batch-wide normalisation would differ)."""
    logp, old, adv, gi = make_inputs(seed)
    lengths = torch.tensor([3, 17, 5, 9, 1, 12, 7, 2, 30, 4, 6, 11, 8])
    loss, grad, _ = autograd_grad("spg", logp, old, adv, gi, aggregation="length_weighted", completion_lengths=lengths)
    groups = groups_of(gi)
    want, value = [0.0] * 13, 0.0
    for idx in groups:
        total = sum(int(lengths[j]) for j in idx)
        for i in idx:
            want[i] = -float(adv[i]) * int(lengths[i]) / (len(groups) * total)
            value += want[i] * float(logp[i])
    torch.testing.assert_close(grad, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert loss.item() == pytest.approx(value, rel=1e-10)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
@pytest.mark.parametrize("name", ["stabledrl", "grpo"])
def test_kl_term_gradient_closed_form(name, estimator):
    logp, old, adv, gi = make_inputs(3)
    ref = logp.detach() + 0.3 * torch.randn(13, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    _, g0, m0 = autograd_grad(name, logp, old, adv, gi)
    _, g1, m1 = autograd_grad(name, logp, old, adv, gi, kl_coef=0.05, ref_logp=ref, kl_estimator=estimator)
    expected = 0.05 * ref_kl_grad(logp.detach().tolist(), ref.tolist(), gi, estimator)
    torch.testing.assert_close(g1 - g0, expected, rtol=1e-8, atol=1e-12)
    assert "kl" not in m0 and m1["kl"] > 0
    assert m1["loss"] == pytest.approx(m1["policy_loss"] + 0.05 * m1["kl"])


def test_diffu_grpo_token_gradient_closed_form():
    g = torch.Generator().manual_seed(5)
    n, t, eps = 6, 9, 0.5
    logp = (torch.randn(n, t, generator=g, dtype=torch.float64) - 2).requires_grad_(True)
    lr = torch.randn(n, t, generator=g, dtype=torch.float64) * 0.4
    lr[0, 0], lr[1, 1], lr[2, 2], lr[3, 3] = OUTLIER, -OUTLIER, OUTLIER, -OUTLIER
    old = logp.detach() - lr
    adv = torch.tensor([-1.0, 0.5, 0.8, -0.3, 0.0, 1.1], dtype=torch.float64)
    mask = torch.rand(n, t, generator=g) > 0.3
    mask[:4, :4] = True
    gi = torch.tensor([0, 0, 0, 1, 1, 1])
    loss, m = token_policy_loss("diffu_grpo", logp, old, adv, mask, gi, eps=eps)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.zeros_like(old)
    for i in range(n):
        n_i = int(mask[i].sum())
        for j in range(t):
            rho = math.exp(lr[i, j])
            if mask[i, j] and ppo_active(rho, adv[i].item(), eps):
                expected[i, j] = -rho * adv[i] / (n * n_i)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    assert "diffu_grpo" in available_token_policy_losses()
    assert 0 < m["clip_frac_high"] < 1 and 0 < m["clip_frac_low"] < 1


def test_float32_inputs_give_float32_loss():
    logp, old, adv, gi = make_inputs(0, dtype=torch.float32)
    loss, grad, m = autograd_grad("stabledrl", logp, old.float(), adv.float(), gi)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32
    assert all(isinstance(v, float) for v in m.values())


# --------------------------------------------------------------------------- convex hull


class TinyLM(nn.Module):
    """Prompt embedding + position embedding -> MLP -> per-token log-probs;
    logp_i = sum_t log p(y_it) is the sample's sequence log-likelihood."""

    def __init__(self, vocab: int = 11, hidden: int = 16, length: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(length, hidden))
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, vocab))

    def forward(self, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
        h = self.emb(prompts)[:, None, :] + self.pos
        logprobs = torch.log_softmax(self.mlp(h), dim=-1)
        return logprobs.gather(-1, completions[..., None]).squeeze(-1).sum(-1)


def flat_grad(out: torch.Tensor, params) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(out, params, retain_graph=True)])


@pytest.fixture(scope="module")
def tiny_setup():
    torch.manual_seed(0)
    model = TinyLM().double()
    params = list(model.parameters())
    gi = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1, 0, 1])
    prompts = torch.tensor([3, 8] * 5)
    completions = torch.randint(0, 11, (10, 5), generator=torch.Generator().manual_seed(1))
    logp = model(prompts, completions)
    per_sample = torch.stack([flat_grad(logp[i], params) for i in range(10)])
    return params, logp, per_sample, gi


def expected_weights(name, log_ratio, gi, eps=0.2, cap=math.log(5.0)):
    """The self-normalised weights re-derived from the paper (clip then normalise per group) and
    from the release (upper-capped log-weight, group softmax)."""
    raw = log_ratio.exp().clamp(1 - eps, 1 + eps) if name == "stabledrl" else log_ratio.clamp_max(cap).exp()
    return raw / torch.stack([raw[gi == k].sum() for k in (0, 1)])[gi]


@pytest.mark.parametrize("name", ["stabledrl", "stabledrl_released"])
def test_convex_hull_bound_on_tiny_model(tiny_setup, name):
    params, logp, per_sample, gi = tiny_setup
    per_norm = per_sample.norm(dim=1)
    g = torch.Generator().manual_seed(123)
    for trial in range(60):
        rewards = torch.randn(10, generator=g, dtype=torch.float64)
        adv = rewards - torch.stack([rewards[gi == k].mean() for k in (0, 1)])[gi]
        log_ratio = torch.randn(10, generator=g, dtype=torch.float64) * (0.1 + trial / 10)
        outliers = torch.rand(10, generator=g) < 0.3
        signs = torch.where(torch.rand(10, generator=g) < 0.5, -1.0, 1.0).double()
        log_ratio = torch.where(outliers, signs * OUTLIER, log_ratio)
        loss, _ = sequence_policy_loss(name, logp, logp.detach() - log_ratio, adv, gi)
        grad = flat_grad(loss, params)
        bound = (adv.abs() * per_norm).max()
        assert grad.norm() <= bound + 1e-6, (trial, grad.norm().item(), bound.item())
        # the convex hull itself: non-negative weights summing to 1 per group, and the update is
        # exactly -(1/groups) sum_i w_i A_i grad logp_i
        w = expected_weights(name, log_ratio, gi)
        assert (w >= 0).all() and torch.allclose(
            torch.stack([w[gi == k].sum() for k in (0, 1)]), torch.ones(2, dtype=w.dtype)
        )
        torch.testing.assert_close(grad, -(w * adv) @ per_sample / 2, rtol=1e-9, atol=1e-12)


def test_grpo_outlier_spike_vs_stabledrl_on_tiny_model(tiny_setup):
    params, logp, per_sample, gi = tiny_setup
    per_norm = per_sample.norm(dim=1)
    g = torch.Generator().manual_seed(7)
    rewards = torch.randn(10, generator=g, dtype=torch.float64)
    adv = rewards - torch.stack([rewards[gi == k].mean() for k in (0, 1)])[gi]
    log_ratio = torch.randn(10, generator=g, dtype=torch.float64) * 0.05
    k = int(torch.nonzero(adv < 0)[0])
    log_ratio[k] = OUTLIER  # one ratio of 1e4 with A < 0
    old = logp.detach() - log_ratio
    grpo, _ = sequence_policy_loss("grpo", logp, old, adv, gi)
    sdrl, m = sequence_policy_loss("stabledrl", logp, old, adv, gi)
    n_grpo, n_sdrl = flat_grad(grpo, params).norm(), flat_grad(sdrl, params).norm()
    assert n_grpo >= 1e3 * n_sdrl, (n_grpo.item(), n_sdrl.item())
    assert n_sdrl <= (adv.abs() * per_norm).max() + 1e-6
    w = expected_weights("stabledrl", log_ratio, gi)  # the outlier's weight is clipped, then normalised
    torch.testing.assert_close(flat_grad(sdrl, params), -(w * adv) @ per_sample / 2, rtol=1e-9, atol=1e-12)
    assert m["ratio_max"] == pytest.approx(1e4, rel=1e-6)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("tensor", ["logp", "old_logp", "advantages", "ref_logp", "lengths"])
def test_nonfinite_inputs_raise_naming_tensor(tensor, bad):
    logp, old, adv, gi = make_inputs(0)
    inputs = {
        "logp": logp.detach().clone(),
        "old_logp": old.clone(),
        "advantages": adv.clone(),
        "ref_logp": old.clone(),
        "lengths": torch.full((13,), 10.0, dtype=torch.float64),
    }
    inputs[tensor][[1, 5, 8]] = bad
    with pytest.raises(ValueError, match=f"non-finite values in {tensor}: 3 of 13 entries"):
        sequence_policy_loss(
            "espo",
            inputs["logp"].requires_grad_(True),
            inputs["old_logp"],
            inputs["advantages"],
            gi,
            ref_logp=inputs["ref_logp"],
            kl_coef=0.1,
            lengths=inputs["lengths"],
        )


def test_token_nonfinite_inputs_raise_naming_tensor():
    logp = torch.zeros(2, 3)
    old = torch.zeros(2, 3)
    old[0, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite values in old_logp_tok: 1 of 6 entries"):
        token_policy_loss(
            "diffu_grpo", logp, old, torch.ones(2), torch.ones(2, 3, dtype=torch.bool), torch.tensor([0, 0])
        )


def test_shape_and_dtype_errors():
    logp, old, adv, gi = make_inputs(0)
    with pytest.raises(ValueError, match="old_logp has shape"):
        sequence_policy_loss("grpo", logp, old[:5], adv, gi)
    with pytest.raises(TypeError, match="group_index must be a torch.long"):
        sequence_policy_loss("grpo", logp, old, adv, gi.int())
    with pytest.raises(ValueError, match="logp must have 1 dimension"):
        sequence_policy_loss("grpo", logp[:, None], old, adv, gi)
    with pytest.raises(TypeError, match="accepts: lengths"):
        sequence_policy_loss("espo", logp, old, adv, gi, log_weight_cap=1.0)
    with pytest.raises(ValueError, match="needs ref_logp"):
        sequence_policy_loss("grpo", logp, old, adv, gi, kl_coef=0.1)


def test_overflowing_unclipped_ratio_raises_instead_of_nan():
    logp = torch.zeros(4, requires_grad=True)
    old = torch.tensor([-200.0, 0.0, 0.0, 0.0])  # finite, but exp(200) overflows float32
    adv = torch.tensor([0.0, 1.0, -1.0, 0.0])
    gi = torch.zeros(4, dtype=torch.long)
    with pytest.raises(
        FloatingPointError,
        match=r"grpo loss is (inf|nan): ratio overflow, the largest \|log-ratio\| is 200 \(exp\(\) overflows "
        r"above 88.72 in torch.float32\)",
    ):
        sequence_policy_loss("grpo", logp, old, adv, gi)
    loss, _ = sequence_policy_loss("stabledrl", logp, old, adv, gi)  # self-normalised: fine
    assert math.isfinite(loss.item())


def test_a_nonfinite_loss_names_its_cause_not_a_fixed_guess():
    """Issue 40: a k3 KL term that overflows is not blamed on a 0.15 log-ratio; each cause by name."""
    logp = torch.zeros(4, requires_grad=True)
    old = torch.tensor([-0.15, 0.1, 0.0, 0.0])
    adv = torch.tensor([0.0, 1.0, -1.0, 0.0])
    gi = torch.zeros(4, dtype=torch.long)
    ref = torch.tensor([100.0, 0.0, 0.0, 0.0])  # exp(ref - logp) = exp(100): inf in float32
    with pytest.raises(FloatingPointError) as err:
        sequence_policy_loss("grpo", logp, old, adv, gi, kl_coef=0.1, ref_logp=ref, kl_estimator="k3")
    message = str(err.value)
    assert (
        message.startswith("grpo loss is inf: the KL term is inf (the policy term is ") and "overflow," not in message
    )
    assert "the largest |log-ratio| is 0.15, below 88.72 where exp() overflows in torch.float32" in message

    lr, w, a = torch.tensor([0.1, -0.2]), torch.ones(2), torch.ones(2)
    kw = dict(policy_value=math.nan, kl_value=None, dtype=torch.float32)
    cases = [
        ((torch.tensor([0.1, math.inf]), w, a), "non-finite values in the log-ratios (1 of 2 entries)"),
        ((torch.tensor([0.1, 90.0]), w, a), "ratio overflow, the largest |log-ratio| is 90"),
        ((lr, w, torch.tensor([math.nan, 1.0])), "non-finite values in the advantages (1 of 2 entries); the largest"),
        ((lr, torch.tensor([1.0, math.inf]), a), "non-finite values in the importance weights (1 of 2 entries)"),
        ((lr, w, a), "the policy term is nan although its inputs are finite; the largest |log-ratio| is 0.2"),
    ]
    for (log_ratio, weights, advantages), cause in cases:
        found = nonfinite_loss_cause("x", math.nan, log_ratio=log_ratio, weights=weights, advantages=advantages, **kw)
        assert found.startswith("x loss is nan: ") and cause in found, found
    assert exp_overflow_at(torch.float64) == pytest.approx(709.78, abs=0.01)


def test_registry_lists_losses_and_rejects_unknown_names():
    names = available_policy_losses()
    assert set(names) >= {"stabledrl", "stabledrl_released", "grpo", "espo", "spg"}
    with pytest.raises(ValueError, match=r"closest first\): stabledrl, ") as err:
        get_policy_loss("stabldrl")
    assert all(n in str(err.value) for n in names)
    with pytest.raises(ValueError, match=r"closest first\): grpo"):
        sequence_policy_loss("gpro", torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("grpo")(lambda b: None)


# --------------------------------------------------------------------------- metrics


def test_metrics_on_hand_built_batch():
    # one group; ratios 1, 1, 10, 0.1; eps 0.2 -> one clipped high, one low
    logp = torch.zeros(4, requires_grad=True)
    old = -torch.log(torch.tensor([1.0, 1.0, 10.0, 0.1]))
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0])
    gi = torch.zeros(4, dtype=torch.long)
    _, m = sequence_policy_loss("stabledrl", logp, old, adv, gi)
    assert m["clip_frac_low"] == 0.25 and m["clip_frac_high"] == 0.25
    assert m["ratio_max"] == pytest.approx(10.0) and m["ratio_mean"] == pytest.approx(12.1 / 4)
    c = torch.tensor([1.0, 1.0, 1.2, 0.8])
    w = c / c.sum()
    assert m["ess"] == pytest.approx((w.sum() ** 2 / (w**2).sum() / 4).item())
    share = (w * adv.abs()).max() / (w * adv.abs()).sum()
    assert m["max_weight_share"] == pytest.approx(share.item())
    assert m["max_weight_share_worst"] == pytest.approx(share.item())
    assert m["log_ratio_var"] == pytest.approx(torch.log(torch.tensor([1.0, 1, 10, 0.1])).var(unbiased=False).item())
    _, m_eq = sequence_policy_loss("stabledrl", logp, logp.detach(), adv, gi)
    assert m_eq["ess"] == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["stabledrl", "grpo", "espo"])
def test_clip_fractions_on_an_asymmetrically_clipped_batch(name):
    # one group; ratios 0.1, 0.5, 1, 10 with eps 0.2: two below 1 - eps, one above 1 + eps
    ratios = torch.tensor([0.1, 0.5, 1.0, 10.0], dtype=torch.float64)
    logp = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=torch.float64)
    _, m = sequence_policy_loss(name, logp, -torch.log(ratios), adv, torch.zeros(4, dtype=torch.long))
    low = sum(float(r) < 1 - EPS for r in ratios) / 4
    high = sum(float(r) > 1 + EPS for r in ratios) / 4
    assert (low, high) == (0.5, 0.25)
    assert (m["clip_frac_low"], m["clip_frac_high"]) == (low, high)


def test_grpo_weight_diagnostics_leave_out_the_clipped_samples():
    """GRPO's effective weight is rho_i / |g| where the unclipped branch is active, 0 where the
    clip takes over (no gradient): ess and max_weight_share are of those weights."""
    # one group; ratios 1, 1.1, 10 (A > 0: clipped), 0.1 (A < 0: clipped), 0.9
    ratios = torch.tensor([1.0, 1.1, 10.0, 0.1, 0.9], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5], dtype=torch.float64)
    logp = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    _, m = sequence_policy_loss("grpo", logp, -torch.log(ratios), adv, torch.zeros(5, dtype=torch.long))
    w = [float(r) / 5 if ppo_active(float(r), float(a), EPS) else 0.0 for r, a in zip(ratios, adv)]
    assert w[2] == 0.0 and w[3] == 0.0 and all(x > 0 for x in w[:2] + w[4:])
    ess = sum(w) ** 2 / sum(x * x for x in w) / 5
    contrib = [abs(x * float(a)) for x, a in zip(w, adv)]
    assert m["ess"] == pytest.approx(ess, rel=1e-12)
    assert m["max_weight_share"] == pytest.approx(max(contrib) / sum(contrib), rel=1e-12)
    assert m["max_weight_share_worst"] == pytest.approx(max(contrib) / sum(contrib), rel=1e-12)


def test_spg_select_bound():
    elbo, eubo = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5, -1.0, -1.0])
    adv = torch.tensor([1.0, 0.0, -1.0])
    out = spg_select_bound(elbo, eubo, adv, mix=0.5)
    torch.testing.assert_close(out, torch.tensor([-1.0, -1.5, -2.0]))
    torch.testing.assert_close(spg_select_bound(elbo, eubo, adv, mix=1.0), torch.tensor([-1.0, -1.0, -1.0]))


# --------------------------------------------------------------------------- noise


@pytest.mark.parametrize("kind", ["lognormal", "student_t"])
def test_noise_reproducible_and_independent_of_global_rng(kind):
    x = torch.zeros(1000)
    torch.manual_seed(1)
    a = perturb_log_ratio(x, kind=kind, sigma=0.7, dof=4.0, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(2)
    state = torch.get_rng_state()
    b = perturb_log_ratio(x, kind=kind, sigma=0.7, dof=4.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert torch.equal(state, torch.get_rng_state())  # global RNG untouched
    c = perturb_log_ratio(x, kind=kind, sigma=0.7, dof=4.0, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(a, c)


def test_noise_scale_and_tails():
    g = torch.Generator().manual_seed(0)
    n = perturb_log_ratio(torch.zeros(200_000), kind="lognormal", sigma=0.5, generator=g)
    assert n.mean().abs() < 0.01 and n.std().item() == pytest.approx(0.5, rel=0.02)
    t = perturb_log_ratio(torch.zeros(200_000), kind="student_t", sigma=1.0, dof=5.0, generator=g)
    assert t.median().abs() < 0.02 and t.std().item() == pytest.approx(math.sqrt(5 / 3), rel=0.05)
    assert (t.abs() > 5).float().mean() > 10 * (n.abs() / 0.5 > 5).float().mean()
    x = torch.zeros(3, requires_grad=True)
    (gx,) = torch.autograd.grad(perturb_log_ratio(x, generator=g).sum(), x)
    assert torch.equal(gx, torch.ones(3))
    with pytest.raises(ValueError, match="unknown ratio-noise kind"):
        RatioNoise("cauchy")


def test_loss_noise_switch_shifts_old_logp():
    logp, old, adv, gi = make_inputs(4)
    noise = RatioNoise("student_t", sigma=0.8, dof=3.0)
    for name in ("stabledrl", "grpo", "stabledrl_released"):
        loss, m = sequence_policy_loss(
            name, logp, old, adv, gi, ratio_noise=noise, noise_generator=torch.Generator().manual_seed(11)
        )
        n = noise.sample((13,), generator=torch.Generator().manual_seed(11), dtype=torch.float64)
        ref, m_ref = sequence_policy_loss(name, logp, old - n, adv, gi)
        assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
        assert m["ratio_mean"] == pytest.approx(m_ref["ratio_mean"], rel=1e-12)
    with pytest.raises(ValueError, match="noise_generator"):
        sequence_policy_loss("grpo", logp, old, adv, gi, ratio_noise=noise)
