"""Forward process: ratios, exact counts, coupled masks, prompt masks, replayable plans."""

import pytest
import torch

from stabledrl_mcore.diffusion import (
    build_plan,
    complementary_mask,
    mask_completion,
    mask_exact_counts,
    prompt_mask,
    sample_mask_ratios,
    stratified_mask_counts,
)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def completion(B=4, S=12, start=3, lengths=(9, 7, 5, 9)):
    comp = torch.zeros(B, S, dtype=torch.bool)
    for b, L in enumerate(lengths[:B]):
        comp[b, start : start + L] = True
    return comp


def test_ratios_are_stratified_shifted_grid_and_in_range():
    p = sample_mask_ratios(64, generator=gen(), eps=1e-3)
    assert p.min() >= 1e-3 and p.max() < 1.0
    t = torch.sort((p - 1e-3) / (1 - 1e-3)).values.double()
    gaps = t[1:] - t[:-1]
    torch.testing.assert_close(gaps, torch.full_like(gaps, 1 / 64), atol=1e-5, rtol=0)
    # each draw is marginally uniform: mean over many calls of the first draw ~ 0.5
    first = torch.stack([sample_mask_ratios(8, generator=gen(s), eps=0.0)[0] for s in range(2000)])
    assert abs(first.mean().item() - 0.5) < 0.03
    iid = sample_mask_ratios((3, 5), generator=gen(), stratified=False)
    assert iid.shape == (3, 5)


def test_every_draw_uses_the_explicit_generator_only():
    state = torch.get_rng_state()
    comp = completion()
    a = build_plan(comp, num_mc=4, generator=gen(3), mode="ratio", coupled=True, prompt_mask_prob=0.15)
    b = build_plan(comp, num_mc=4, generator=gen(3), mode="ratio", coupled=True, prompt_mask_prob=0.15)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.masked, b.masked) and torch.equal(a.weight, b.weight)
    c = build_plan(comp, num_mc=4, generator=gen(4), mode="ratio", coupled=True)
    assert not torch.equal(a.masked, c.masked)
    with pytest.raises(TypeError):
        build_plan(comp, num_mc=1, generator=None)


def test_stratified_counts_cover_1_to_L_and_exact_count_masks():
    lengths = torch.tensor([5, 3, 0, 8])
    counts = stratified_mask_counts(lengths, 5, generator=gen())
    assert counts.shape == (5, 4)
    assert sorted(counts[:, 0].tolist()) == [1, 2, 3, 4, 5]  # num_mc == L: one draw per stratum
    assert counts[:, 1].min() >= 1 and counts[:, 1].max() <= 3 and (counts[:, 2] == 0).all()
    zero = stratified_mask_counts(lengths, 6, generator=gen(), include_zero=True)
    assert sorted(zero[:, 0].tolist()) == [0, 1, 2, 3, 4, 5]
    comp = completion()
    k = torch.tensor([4, 1, 5, 0])
    m = mask_exact_counts(comp, k, generator=gen())
    assert torch.equal(m.sum(-1), k) and not (m & ~comp).any()


def test_mask_completion_rate_and_complement_partition():
    comp = completion(B=2, S=400, start=10, lengths=(390, 390))
    noisy, masked = mask_completion(
        torch.zeros(2, 400, dtype=torch.long), comp, torch.tensor([0.2, 0.7]), 9, generator=gen()
    )
    assert not (masked & ~comp).any() and torch.equal(noisy == 9, masked)
    rate = masked.sum(-1).float() / 390
    assert abs(rate[0] - 0.2) < 0.06 and abs(rate[1] - 0.7) < 0.06
    comp_mask = complementary_mask(masked, comp)
    assert torch.equal(comp_mask | masked, comp) and not (comp_mask & masked).any()


def test_prompt_mask_only_in_region():
    region = torch.zeros(2, 2000, dtype=torch.bool)
    region[:, :1000] = True
    m = prompt_mask(region, 0.15, generator=gen())
    assert not m[:, 1000:].any() and abs(m.float()[:, :1000].mean().item() - 0.15) < 0.03
    assert not prompt_mask(region, 0.0, generator=gen()).any()


@pytest.mark.parametrize("mode", ["count", "ratio"])
def test_coupled_plan_pairs_partition_the_completion(mode):
    comp = completion()
    plan = build_plan(comp, num_mc=4, generator=gen(), mode=mode, coupled=True)
    assert plan.num_mc == 4 and plan.coupled
    for k in range(2):
        a, b = plan.masked[2 * k], plan.masked[2 * k + 1]
        assert torch.equal(a | b, comp) and not (a & b).any()
    if mode == "count":  # weights L/count (2 for a lone full primary) on every scored token of a draw
        L = comp.sum(-1).float()
        n = plan.masked.sum(-1).float()
        w = plan.weight.sum(-1) / n.clamp(min=1)
        want = torch.where(n == L, torch.full_like(n, 2.0), L / n.clamp(min=1))  # n = L only for primaries
        torch.testing.assert_close(w[n > 0], want[n > 0])
    with pytest.raises(ValueError):
        build_plan(comp, num_mc=3, generator=gen(), mode=mode, coupled=True)


def test_count_plan_weights_and_prompt_masks_are_unscored():
    comp = completion()
    plan = build_plan(comp, num_mc=3, generator=gen(), mode="count", prompt_mask_prob=0.5)
    scored = plan.weight > 0
    assert not (scored & ~comp).any()
    assert (plan.masked & ~comp).any()  # some prompt tokens are masked ...
    assert torch.equal(scored, plan.masked & comp)  # ... but never scored
    L = comp.sum(-1).float()
    l_ = scored.sum(-1).float()
    torch.testing.assert_close(plan.weight.sum(-1), L.expand_as(l_) * (l_ > 0))  # (L/l) * l = L


def test_block_plan_draws_one_count_per_block_and_replays():
    comp = completion(B=2, S=16, start=3, lengths=(13, 9))
    plan = build_plan(comp, num_mc=2, generator=gen(), mode="count", block_size=4)
    assert plan.block_size == 4 and plan.ratio.shape == (2, 2, 4)
    blocks = plan.masked.reshape(2, 2, 4, 4).sum(-1)
    maskable = comp.reshape(2, 4, 4).sum(-1)
    assert ((blocks >= 1) == (maskable >= 1)).all() and (blocks <= maskable).all()
    ids = torch.arange(32).reshape(2, 16)
    noisy = plan.noisy(ids, 99)
    assert noisy.shape == (2, 2, 16) and torch.equal(noisy == 99, plan.masked)
    with pytest.raises(ValueError):
        plan.noisy(ids[:, :8], 99)
    full = build_plan(comp, num_mc=1, generator=gen(), mode="full")
    assert torch.equal(full.masked[0], comp) and torch.equal(full.weight[0], comp.float())


def test_weights_stay_finite_at_the_edges():
    comp = completion()
    for mode in ("ratio", "count"):
        for eps in (0.0, 1e-3):
            plan = build_plan(comp, num_mc=64, generator=gen(), mode=mode, coupled=True, eps=eps)
            assert torch.isfinite(plan.weight).all() and (plan.weight >= 0).all()
