"""Named mask schemes (uniform, block_random, full), regions and post-EOS policies."""

import math

import pytest
import torch

from stabledrl_mcore.diffusion import (
    POST_EOS_POLICIES,
    MaskRegions,
    apply_post_eos,
    available_mask_schemes,
    block_random_draw,
    build_mask_plan,
    build_plan,
    elbo_from_draws,
    eubo_from_draws,
    get_mask_scheme,
    mask_schemes,
    register_mask_scheme,
)

P, G, BL = 3, 12, 4  # prompt width, generated length, block length: nb = 3 blocks
LENGTHS = (12, 9, 6, 2, 0)  # completion lengths up to the first EOS: nc = 3, 3, 2, 1, 0
PADS = (0, 1, 0, 2, 0)  # left padding of each prompt


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def batch(lengths=LENGTHS, pads=PADS, prompt=P, generated=G):
    B, S = len(lengths), prompt + generated
    seq = torch.randint(5, 50, (B, S), generator=gen(123))
    comp = torch.zeros(B, S, dtype=torch.bool)
    valid = torch.ones(B, prompt, dtype=torch.bool)
    for b, (L, pad) in enumerate(zip(lengths, pads)):
        comp[b, prompt : prompt + L] = True
        valid[b, :pad] = False
    return seq, comp, valid


def regions(**kw):
    seq, comp, valid = batch(**kw)
    return MaskRegions.from_batch(seq, P, completion_mask=comp, prompt_valid=valid)


def per_draw_elbo(plan, logp, completion):
    """[M, B] length-normalised ELBO of each single draw (elbo_from_draws on one-draw plans)."""
    out = []
    for m in range(plan.num_mc):
        one = type(plan)(
            masked=plan.masked[m : m + 1], weight=plan.weight[m : m + 1], ratio=plan.ratio[m : m + 1], mode=plan.mode
        )
        out.append(elbo_from_draws(logp[m : m + 1], one, completion, length_normalize=True)[0])
    return torch.stack(out)


# ----------------------------------------------------------------------------- regions and registry


def test_regions_from_batch_eos_shapes_and_checks():
    seq = torch.tensor([[0, 7, 7, 5, 2, 9, 9], [7, 7, 7, 5, 5, 5, 5], [0, 0, 7, 2, 9, 2, 9]])
    valid = torch.tensor([[False, True, True], [True, True, True], [False, False, True]])
    r = MaskRegions.from_batch(seq, 3, prompt_valid=valid, eos_id=2)
    want_comp = torch.tensor([[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0, 0]]).bool()
    assert torch.equal(r.completion, want_comp)
    assert torch.equal(r.post_eos, torch.tensor([[0, 0, 0, 0, 0, 1, 1], [0] * 7, [0, 0, 0, 0, 1, 1, 1]]).bool())
    assert torch.equal(r.prompt[:, :3], valid) and not r.prompt[:, 3:].any()
    # the same from a [B, S] or generation-only completion mask and a [B, S] prompt_valid (RolloutBatch's)
    full_valid = torch.cat([valid, torch.ones(3, 4, dtype=torch.bool)], 1)
    for cm in (want_comp, want_comp[:, 3:]):
        r2 = MaskRegions.from_batch(seq, 3, completion_mask=cm, prompt_valid=full_valid)
        assert all(torch.equal(getattr(r, f), getattr(r2, f)) for f in ("completion", "prompt", "post_eos"))
    with pytest.raises(TypeError):
        MaskRegions.from_batch(seq, 3)
    with pytest.raises(ValueError):
        MaskRegions.from_batch(seq, 3, completion_mask=torch.ones(3, 7, dtype=torch.bool))  # marks the prompt
    with pytest.raises(ValueError):
        MaskRegions(want_comp, want_comp, torch.zeros_like(want_comp))  # overlapping regions
    scored = r.with_post_eos("score")
    assert torch.equal(scored.completion, r.completion | r.post_eos) and not scored.post_eos.any()
    assert torch.equal(r.scored_region("mask_and_skip"), r.completion) and r.with_post_eos("visible") is r
    with pytest.raises(ValueError, match="post-EOS policy"):
        r.with_post_eos("drop")
    empty = MaskRegions.of(want_comp)
    assert not empty.prompt.any() and not empty.post_eos.any()


def test_registry_names_errors_and_custom_schemes():
    assert {"uniform", "block_random", "full"} <= set(available_mask_schemes())
    with pytest.raises(ValueError, match="block_random.*full.*uniform"):
        get_mask_scheme("spg")
    with pytest.raises(ValueError, match="already registered"):
        register_mask_scheme("uniform", lambda r, **kw: None)

    @register_mask_scheme("test_everything")
    def everything(r, *, num_mc, generator):
        return build_plan(r.completion, num_mc=num_mc, generator=generator, mode="full")

    try:
        r = regions()
        plan = build_mask_plan(r, "test_everything", num_mc=2, generator=gen(), post_eos="mask_and_skip")
        assert torch.equal(plan.masked[0], r.completion | r.post_eos) and not (plan.weight[:, r.post_eos] != 0).any()
        plan = get_mask_scheme("test_everything")(r, num_mc=1, generator=gen(), post_eos="score")
        assert torch.equal(plan.masked[0], r.completion | r.post_eos)
        with pytest.raises(TypeError):
            build_mask_plan(r, "test_everything", num_mc=1, generator=None)
        with pytest.raises(TypeError):
            build_mask_plan(r, "test_everything", num_mc=1, generator=gen(), no_such_option=1)
        with pytest.raises(ValueError):
            build_mask_plan(r, "test_everything", num_mc=0, generator=gen())
        with pytest.raises(ValueError, match="post-EOS"):
            build_mask_plan(r, "test_everything", num_mc=1, generator=gen(), post_eos="drop")
    finally:
        mask_schemes._SCHEMES.pop("test_everything", None)


SCHEMES = {
    "uniform": dict(),
    "uniform_ratio_coupled": dict(mode="ratio", coupled=True, prefix_mask_prob=0.3),
    "block_random": dict(block_length=BL),
    "full": dict(),
}


def _scheme(key):
    return ("uniform" if key.startswith("uniform") else key), SCHEMES[key]


@pytest.mark.parametrize("key", list(SCHEMES))
def test_every_scheme_is_deterministic_on_its_generator_and_finite(key):
    name, opts = _scheme(key)
    r = regions()
    state = torch.get_rng_state()
    a = build_mask_plan(r, name, num_mc=4, generator=gen(7), **opts)
    b = build_mask_plan(r, name, num_mc=4, generator=gen(7), **opts)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.masked, b.masked) and torch.equal(a.weight, b.weight) and torch.equal(a.ratio, b.ratio)
    c = build_mask_plan(r, name, num_mc=4, generator=gen(8), **opts)
    assert not torch.equal(a.masked, c.masked)
    assert torch.isfinite(a.weight).all() and (a.weight >= 0).all() and torch.isfinite(a.ratio).all()
    assert a.masked.shape == a.weight.shape == (4, *r.completion.shape)
    assert not a.masked[:, ~(r.completion | r.prompt | r.post_eos)].any()  # left padding never masked
    assert not (a.weight[:, ~r.completion] != 0).any() and not a.masked[:, -1, P:].any()  # the empty row
    # an all-empty batch is finite too
    empty = MaskRegions.of(torch.zeros(2, 6, dtype=torch.bool), prompt=torch.ones(2, 6, dtype=torch.bool))
    e = build_mask_plan(empty, name, num_mc=2, generator=gen(), **opts)
    assert torch.isfinite(e.weight).all() and not (e.weight != 0).any()
    logp = -torch.rand(2, 2, 6)
    assert torch.isfinite(elbo_from_draws(logp, e, empty.completion, True)[0]).all()
    assert torch.isfinite(eubo_from_draws(logp, e, empty.completion, 1.5, True)[0]).all()


@pytest.mark.parametrize("policy", POST_EOS_POLICIES)
@pytest.mark.parametrize("key", list(SCHEMES))
def test_post_eos_policies(key, policy):
    name, opts = _scheme(key)
    r = regions()
    plan = build_mask_plan(r, name, num_mc=6, generator=gen(), post_eos=policy, **opts)
    post = plan.masked[:, r.post_eos]
    if policy == "mask_and_skip":
        assert post.all() and not (plan.weight[:, r.post_eos] != 0).any()
    elif policy == "visible":
        assert not post.any() and not (plan.weight[:, r.post_eos] != 0).any()
    else:  # scored like completion tokens: same as the scheme on completion | post_eos
        want = build_mask_plan(
            MaskRegions.of(r.completion | r.post_eos, r.prompt), name, num_mc=6, generator=gen(), **opts
        )
        assert torch.equal(plan.masked, want.masked) and torch.equal(plan.weight, want.weight)
        assert (plan.weight[:, r.post_eos] > 0).any()
    scored = plan.weight > 0
    assert not (scored & ~r.scored_region(policy)).any()
    assert torch.equal(scored, plan.masked & r.scored_region(policy))  # every masked candidate is scored
    if name != "uniform" or opts.get("mode", "count") == "count":  # count weights: exactly -1 per draw
        comp = r.scored_region(policy)
        lp = per_draw_elbo(plan, -torch.ones(plan.masked.shape), comp)
        has = comp.any(-1)
        torch.testing.assert_close(lp[:, has], -torch.ones_like(lp[:, has]))
        assert (lp[:, ~has] == 0).all()


# ----------------------------------------------------------------------------- uniform and full


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(mode="ratio", eps=0.01),
        dict(coupled=True),
        dict(mode="ratio", coupled=True, stratified=False),
        dict(block_size=4),
    ],
)
def test_uniform_is_build_plan_on_the_completion(opts):
    r = regions()
    plan = build_mask_plan(r, "uniform", num_mc=4, generator=gen(3), **opts)
    want = build_plan(r.completion, num_mc=4, generator=gen(3), **opts)
    assert torch.equal(plan.masked, want.masked) and torch.equal(plan.weight, want.weight)
    assert plan.mode == want.mode and plan.block_size == want.block_size
    with pytest.raises(ValueError, match="full"):
        build_mask_plan(r, "uniform", num_mc=1, generator=gen(), mode="full")


def test_uniform_counts_and_prefix_masks():
    r = regions()
    L = r.completion.sum(-1)
    plan = build_mask_plan(r, "uniform", num_mc=12, generator=gen(), prefix_mask_prob=0.0)
    counts = plan.masked.sum(-1)  # stratified: 12 draws of a row of length 12 / 6 cover 1..L evenly
    assert sorted(counts[:, 0].tolist()) == list(range(1, 13))
    assert sorted(counts[:, 2].tolist()) == sorted(list(range(1, 7)) * 2)
    assert (counts[:, 4] == 0).all() and not plan.masked[:, r.prompt].any()
    plan = build_mask_plan(r, "uniform", num_mc=2000, generator=gen(), prefix_mask_prob=0.2)
    rate = plan.masked[:, r.prompt].float().mean().item()
    assert abs(rate - 0.2) < 0.01
    assert torch.equal(plan.weight > 0, plan.masked & r.completion)
    torch.testing.assert_close(plan.ratio[..., 0], (plan.masked & r.completion).sum(-1) / L.clamp(min=1).float())


def test_full_masks_the_whole_completion_with_unit_weight():
    r = regions()
    plan = build_mask_plan(r, "full", num_mc=1500, generator=gen())  # d1 default: prompt p = 0.15
    assert plan.masked[:, r.completion].all() and torch.equal(plan.weight > 0, r.completion.expand_as(plan.weight))
    assert (plan.weight[:, r.completion] == 1).all() and (plan.ratio == 1).all()
    assert not plan.masked[:, r.post_eos].any()
    assert abs(plan.masked[:, r.prompt].float().mean().item() - 0.15) < 0.01
    none = build_mask_plan(r, "full", num_mc=2, generator=gen(), prefix_mask_prob=0.0)
    assert torch.equal(none.masked, r.completion.expand_as(none.masked))
    seq_lp = elbo_from_draws(-torch.ones(2, *r.completion.shape), none, r.completion, True)[0]
    torch.testing.assert_close(seq_lp, torch.tensor([-1.0, -1, -1, -1, 0]))


# ----------------------------------------------------------------------------- block_random


def _block_of(r):
    rank = r.completion.long().cumsum(-1) - 1
    return torch.where(r.completion, rank // BL, -1)  # [B, S] completion block of each position


def test_block_random_block_index_is_uniform_mod_completion_blocks():
    r = regions()
    nc = torch.tensor([3, 3, 2, 1])
    want = [torch.tensor([(torch.arange(3) % n == k).float().mean().item() for k in range(3)]) for n in nc]
    # stratified (the release's randperm): 3K draws of a row run through K permutations -> exact frequencies
    d = block_random_draw(r, num_mc=300, generator=gen(), block_length=BL)
    assert (d.block[:, 4] == -1).all() and (d.count[:, 4] == 0).all() and (d.start[:, 4] == P + G).all()
    for b in range(4):
        freq = torch.stack([(d.block[:, b] == k).float().mean() for k in range(3)])
        torch.testing.assert_close(freq, want[b])
        perms = d.block[:, b].reshape(100, 3)  # each group of nb = 3 draws: u = a permutation of 0..2
        assert all(sorted(row.tolist()) == sorted((torch.arange(3) % nc[b]).tolist()) for row in perms)
        if nc[b] == 3:  # fresh permutations, not one repeated
            assert len({tuple(row.tolist()) for row in perms}) == 6
    # independent draws: same marginal
    d = block_random_draw(r, num_mc=6000, generator=gen(), block_length=BL, stratified=False)
    for b in range(4):
        freq = torch.stack([(d.block[:, b] == k).float().mean() for k in range(3)])
        torch.testing.assert_close(freq, want[b], atol=0.025, rtol=0)
    # the release's num_blocks = gen_length // block_length on a non-divisible generation (10 // 4 = 2)
    r10 = regions(lengths=(10, 10), pads=(0, 0), generated=10)
    d = block_random_draw(r10, num_mc=40, generator=gen(), block_length=BL, num_blocks=2, prefix_mask_prob=0.0)
    assert set(d.block.flatten().tolist()) == {0, 1}
    assert d.plan.masked[:, :, P + 8 :].all()  # the partial last block is never chosen, so always masked
    d = block_random_draw(r10, num_mc=60, generator=gen(), block_length=BL)  # default: ceil(10 / 4) = 3 blocks
    assert set(d.block.flatten().tolist()) == {0, 1, 2} and set(d.count[d.block == 2].tolist()) == {1, 2}


def test_block_random_mask_distribution():
    r = regions()
    M, p = 4000, 0.15
    d = block_random_draw(r, num_mc=M, generator=gen(1), block_length=BL, prefix_mask_prob=p, post_eos="mask_and_skip")
    masked, blk = d.plan.masked, _block_of(r)
    pos = torch.arange(P + G)
    L = r.completion.sum(-1)
    m_of = lambda b, k: min(BL, int(L[b]) - BL * k)  # noqa: E731
    prefix_hits, prefix_n = 0.0, 0
    for b in range(4):
        for k in range(int(math.ceil(int(L[b]) / BL))):
            sel = d.block[:, b] == k
            rows = masked[sel, b]  # [n, S]
            in_block = blk[b] == k
            assert (d.start[sel, b] == int(pos[in_block].min())).all()
            # the chosen block: exactly `count` masked, count ~ U{1..m}
            assert torch.equal(rows[:, in_block].sum(-1), d.count[sel, b])
            m = m_of(b, k)
            freq = torch.stack([(d.count[sel, b] == c).float().mean() for c in range(1, m + 1)])
            torch.testing.assert_close(freq, torch.full((m,), 1.0 / m), atol=0.05, rtol=0)
            # which positions: uniform inside the block, P(masked) = E[c / m] = (m + 1) / (2 m)
            rate = rows[:, in_block].float().mean(0)
            torch.testing.assert_close(rate, torch.full_like(rate, (m + 1) / (2 * m)), atol=0.06, rtol=0)
            # every later completion position masked; earlier ones and the prompt at rate p
            assert rows[:, r.completion[b] & (blk[b] > k)].all()
            before = (r.prompt[b] | r.completion[b]) & (pos < pos[in_block].min())
            prefix_hits += rows[:, before].float().sum().item()
            prefix_n += rows[:, before].numel()
    assert abs(prefix_hits / prefix_n - p) < 0.01
    # prompt and earlier completion blocks separately (rows 0-1 choose block >= 1 two thirds of the time)
    early = r.completion & (blk == 0)
    later = d.block[:, :2] > 0
    hits = masked[:, :2][later.unsqueeze(-1) & early[:2]]
    assert abs(hits.float().mean().item() - p) < 0.015
    assert abs(masked[:, r.prompt].float().mean().item() - p) < 0.01
    # left padding never, post-EOS always (never scored)
    assert not masked[:, ~(r.prompt | r.completion | r.post_eos)].any()
    assert masked[:, r.post_eos].all() and not (d.plan.weight[:, r.post_eos] != 0).any()


def test_block_random_masks_alone_reveal_block_and_count_without_prefix_noise():
    r = regions()
    d = block_random_draw(r, num_mc=200, generator=gen(2), block_length=BL, prefix_mask_prob=0.0)
    blk = _block_of(r)
    for b in range(4):
        comp_masked = d.plan.masked[:, b] & r.completion[b]
        first_pos = torch.where(comp_masked, torch.arange(P + G), P + G).amin(-1)
        k = blk[b][first_pos]  # first masked completion block = the chosen one
        assert torch.equal(k, d.block[:, b])
        assert torch.equal((comp_masked & (blk[b] == k.unsqueeze(-1))).sum(-1), d.count[:, b])
    assert not d.plan.masked[:, r.prompt].any()


def test_block_random_weights_elbo_and_empirical_t():
    r = regions()
    plan = build_mask_plan(r, "block_random", num_mc=64, generator=gen(), block_length=BL, post_eos="mask_and_skip")
    scored = plan.masked & r.completion
    assert torch.equal(plan.weight > 0, scored)
    n = scored.sum(-1).float()
    L = r.completion.sum(-1).float()
    assert (n[:, :4] >= 1).all()  # every non-empty row scores at least the chosen block's count
    want_w = torch.where(scored, (L / n.clamp(min=1)).unsqueeze(-1), 0.0)
    torch.testing.assert_close(plan.weight, want_w)
    torch.testing.assert_close(plan.ratio[..., 0], n / L.clamp(min=1))  # SPG's empirical t
    lp = per_draw_elbo(plan, -torch.ones(plan.masked.shape), r.completion)
    torch.testing.assert_close(lp[:, :4], -torch.ones(64, 4))
    assert (lp[:, 4] == 0).all()
    # EUBO with log p = 0: (1/beta) log mean_m 1[masked] / t_m, per token; L * (mean over covered) unnormalised
    beta = 1.5
    seq, token = eubo_from_draws(torch.zeros(plan.masked.shape), plan, r.completion, beta, False)
    inv_t = torch.where(scored, (L / n.clamp(min=1)).unsqueeze(-1), 0.0).mean(0)
    cov = inv_t > 0
    want = torch.where(cov, inv_t.clamp(min=1e-30).log() / beta, 0.0)
    torch.testing.assert_close(seq, want.sum(-1) / cov.sum(-1).clamp(min=1) * L.clamp(min=1))


def _release_bounds(logp, masked, completion_mask, beta):
    """SPG / StableDRL-release reductions, re-derived from their formulas on completion-only tensors.

    logp, masked: [M, B, Lc]; completion_mask: [B, Lc]. ELBO: mean over draws of the mean log p over
    masked completion tokens; EUBO: t = (#masked completion) / (completion length), per token
    q = mean_m p^beta 1[masked] / t_m, then (1/beta) mean over tokens with q > 0 of log q.
    """
    cm = completion_mask.float().unsqueeze(0)
    mk = masked.float() * cm
    den = mk.sum(-1)
    elbo = ((logp * mk).sum(-1) / den.clamp(min=1e-8)).mean(0)
    t = den / cm.sum(-1).clamp(min=1e-8)
    q = (logp.exp().pow(beta) * mk / t.unsqueeze(-1).clamp(min=1e-8)).mean(0)
    keep = q > 0
    eubo = (torch.where(keep, q, torch.ones_like(q)).log() * keep).sum(-1) / keep.sum(-1).clamp(min=1e-8) / beta
    return elbo, eubo


@pytest.mark.parametrize("num_mc", [1, 3])
def test_block_random_matches_the_release_estimator(num_mc):
    r = regions()
    plan = build_mask_plan(
        r, "block_random", num_mc=num_mc, generator=gen(5), block_length=BL, post_eos="mask_and_skip"
    )
    logp = -3.0 * torch.rand(plan.masked.shape, generator=gen(6), dtype=torch.float64)
    # the release sees only the generation: scored = completion_mask * (token == mask id)
    rel_elbo, rel_eubo = _release_bounds(logp[..., P:], plan.masked[..., P:], r.completion[:, P:], 1.5)
    ours = elbo_from_draws(logp, plan, r.completion, length_normalize=True)[0]
    ours_eubo = eubo_from_draws(logp, plan, r.completion, beta=1.5, length_normalize=True)[0]
    torch.testing.assert_close(ours, rel_elbo, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_eubo, rel_eubo, rtol=1e-5, atol=1e-5)
    # and the release's post-EOS term: everything after the first EOS is masked
    assert plan.masked[..., P:][:, ~r.completion[:, P:]].all()


def test_apply_post_eos_is_a_noop_without_post_eos_positions():
    r = regions(lengths=(12, 12), pads=(0, 0))
    plan = build_plan(r.completion, num_mc=2, generator=gen())
    same = apply_post_eos(plan, r, "mask_and_skip")
    assert torch.equal(same.masked, plan.masked) and torch.equal(same.weight, plan.weight)
