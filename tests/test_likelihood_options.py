"""Every ``algo.*`` field that shapes the likelihood estimate reaches it, by value (issue 72).

A config is loaded with one field away from its default, turned into the trainer's
:class:`LikelihoodSpec` (``rl.trainer.likelihood_spec``), and the masks it draws and the
estimates it gives are checked against what that value means: hand formulas for the
estimates (a stand-in policy whose log-prob of the clean token at a masked position is a
fixed number ``q[n, s]``), structural properties for the masks. A field dropped on its way,
or read with the wrong length, changes what is checked.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.rl.estimates import draw_plan, sequence_estimates_and_elbo
from stabledrl_mcore.rl.rollout import RolloutBatch
from stabledrl_mcore.rl.trainer import likelihood_spec

P, GEN, BLOCK = 2, 6, 2
LENGTHS = [3, 6, 4, 2]  # completion lengths up to and including EOS: unequal, so the length matters
EOS = 1
MODEL = SimpleNamespace(dllm_config=SimpleNamespace(block_size=BLOCK))


def batch() -> RolloutBatch:
    n = len(LENGTHS)
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(2, 10, (n, P + GEN), generator=g)
    comp = torch.zeros(n, P + GEN, dtype=torch.bool)
    for i, length in enumerate(LENGTHS):
        seqs[i, P + length - 1 :] = EOS
        comp[i, P : P + length] = True
    return RolloutBatch(
        sequences=seqs,
        prompt_len=P,
        prompt_valid=torch.ones_like(comp),
        completion_mask=comp,
        group_index=torch.tensor([0, 0, 1, 1]),
        completions=[""] * n,
        references=[None] * n,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
    )


def spec_of(**fields):
    cfg = load_config(None, [f"{k}={v}" for k, v in fields.items()])
    return likelihood_spec(cfg, MODEL)


def drawn(spec, b, seed=1):
    plan = draw_plan(b, spec, lambda k: torch.Generator().manual_seed(seed * 100 + k), micro_batch=2)
    q = -torch.rand(b.sequences.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64) - 0.1
    tok = q * plan.scored.to(q.dtype)  # log p(clean token) = q where scored, 0 elsewhere
    return plan, q, tok


def hand_elbo_sum(plan, q, b):
    """Per row: mean over draws of (L / l) * sum of q over the l masked completion tokens."""
    out = []
    for i in range(b.size):
        comp = b.completion_mask[i]
        length = int(comp.sum())
        draws = []
        for m in range(plan.num_mc):
            hit = plan.masked[m, i] & comp
            draws.append(length / max(int(hit.sum()), 1) * float(q[i][hit].sum()))
        out.append(sum(draws) / len(draws))
    return torch.tensor(out, dtype=torch.float64)


def hand_eubo_mean(plan, q, b, beta):
    """SPG's EUBO per row, mean over covered tokens: q_s + log(mean_m w_m [masked]) / beta."""
    out = []
    for i in range(b.size):
        comp = b.completion_mask[i]
        length = int(comp.sum())
        terms = []
        for s in comp.nonzero().flatten().tolist():
            mass = 0.0
            for m in range(plan.num_mc):
                hit = plan.masked[m, i] & comp
                if hit[s]:
                    mass += length / int(hit.sum()) * math.exp(beta * float(q[i, s]))
            if mass > 0:
                terms.append(math.log(mass / plan.num_mc) / beta)
        out.append(sum(terms) / len(terms))
    return torch.tensor(out, dtype=torch.float64)


def _lengths(b):
    return b.completion_mask.sum(-1).to(torch.float64)


def check_spg_beta(spec, b, plan, q, tok):
    est, elbo = sequence_estimates_and_elbo(tok, plan, b, spec)
    lo = hand_elbo_sum(plan, q, b) / _lengths(b)
    hi = hand_eubo_mean(plan, q, b, beta=2.0)
    want = torch.where(b.advantages > 0, lo, 0.5 * hi + 0.5 * lo)
    torch.testing.assert_close(est, want, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(elbo, lo, rtol=1e-6, atol=1e-9)


def check_spg_omega(spec, b, plan, q, tok):
    est, _ = sequence_estimates_and_elbo(tok, plan, b, spec)
    lo = hand_elbo_sum(plan, q, b) / _lengths(b)
    hi = hand_eubo_mean(plan, q, b, beta=1.5)
    torch.testing.assert_close(est, torch.where(b.advantages > 0, lo, 0.2 * hi + 0.8 * lo), rtol=1e-6, atol=1e-9)


def check_generation_width(spec, b, plan, q, tok):
    est, elbo = sequence_estimates_and_elbo(tok, plan, b, spec)
    torch.testing.assert_close(est, hand_elbo_sum(plan, q, b) / GEN, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(elbo, est)


def check_no_normalisation(spec, b, plan, q, tok):
    est, _ = sequence_estimates_and_elbo(tok, plan, b, spec)
    torch.testing.assert_close(est, hand_elbo_sum(plan, q, b), rtol=1e-6, atol=1e-9)


def check_coupled(spec, b, plan, q, tok):
    # complementary pairs: every completion token is scored by exactly one draw of the pair
    assert plan.num_mc == 2
    assert torch.equal(plan.scored.sum(0), b.completion_mask.long())


def check_num_mc(spec, b, plan, q, tok):
    assert plan.num_mc == 4
    est, _ = sequence_estimates_and_elbo(tok, plan, b, spec)
    torch.testing.assert_close(est, hand_elbo_sum(plan, q, b) / _lengths(b), rtol=1e-6, atol=1e-9)


def check_prefix_mask(spec, b, plan, q, tok):
    prompt = plan.masked[:, :, :P]
    assert prompt.any(), "prefix_mask_prob=0.9 masked no prompt position"
    assert not plan.scored[:, :, :P].any()


def check_post_eos(spec, b, plan, q, tok):
    after = ~b.completion_mask.clone()
    after[:, :P] = False
    assert after.any()
    assert plan.masked[:, after].all(), "mask_and_skip leaves a post-EOS position visible"
    assert not plan.scored[:, after].any()


def check_block_random(spec, b, plan, q, tok):
    # one block (of rollout.block_length = 2) partly masked, every later completion position masked
    for m in range(plan.num_mc):
        for i in range(b.size):
            comp = b.completion_mask[i, P:]
            hit = plan.masked[m, i, P:] & comp
            first = int(hit.nonzero()[0])
            later = torch.arange(GEN) >= (first // BLOCK + 1) * BLOCK
            assert hit[later & comp].all(), (m, i, hit)


def check_mean_field(spec, b, plan, q, tok):
    assert plan.num_mc == 1
    assert torch.equal(plan.scored[0], b.completion_mask)


def check_staircase_per_sequence(spec, b, plan, q, tok):
    assert spec.block_size == BLOCK  # the model's block size
    spans = 0  # rows scored in two or more blocks: where a count per block would differ
    for m in range(plan.num_mc):
        for i in range(b.size):
            sc = plan.scored[m, i]
            w = plan.weight[m, i][sc]
            spans += len({(s - P) // BLOCK for s in sc.nonzero().flatten().tolist()}) > 1
            assert torch.allclose(w, w[:1].expand_as(w)), "one t per sequence: one weight 1/p per row"
    assert spans > 0


def check_staircase_per_block(spec, b, plan, q, tok):
    # a count per block: weight L_b / l_b of each block's own length and count
    for m in range(plan.num_mc):
        for i in range(b.size):
            for start in range(P, P + GEN, BLOCK):
                blk = slice(start, start + BLOCK)
                sc = plan.scored[m, i, blk]
                if sc.any():
                    length = int(b.completion_mask[i, blk].sum())
                    want = torch.full((int(sc.sum()),), length / int(sc.sum()))
                    assert torch.allclose(plan.weight[m, i, blk][sc].float(), want), (m, i, start)


OPTIONS = {
    "spg_beta": ({"algo.likelihood": "spg", "algo.spg_beta": 2.0}, check_spg_beta),
    "spg_omega": ({"algo.likelihood": "spg", "algo.spg_omega": 0.2}, check_spg_omega),
    "normalize_by": ({"algo.normalize_by": "generation"}, check_generation_width),
    "length_normalize": ({"algo.length_normalize": False}, check_no_normalisation),
    "coupled_masks": ({"algo.coupled_masks": True}, check_coupled),
    "num_mc": ({"algo.num_mc": 4}, check_num_mc),
    "prefix_mask_prob": ({"algo.prefix_mask_prob": 0.9}, check_prefix_mask),
    "post_eos": ({"algo.post_eos": "mask_and_skip"}, check_post_eos),
    "mask_scheme": ({"algo.mask_scheme": "block_random", "rollout.block_length": BLOCK}, check_block_random),
    "likelihood": ({"algo.likelihood": "mean_field", "algo.loss": "grpo"}, check_mean_field),
    "staircase_t": ({"algo.likelihood": "staircase", "algo.staircase_t": "per_sequence"}, check_staircase_per_sequence),
    "block_size": ({"algo.likelihood": "staircase"}, check_staircase_per_block),
}


@pytest.mark.parametrize("field", sorted(OPTIONS))
def test_every_likelihood_option_reaches_the_estimate(field):
    fields, check = OPTIONS[field]
    spec, b = spec_of(**fields), batch()
    for seed in (1, 2, 3):
        check(spec, b, *drawn(spec, b, seed))


def test_the_default_options_give_the_completion_normalised_elbo():
    """The anchor the options are compared against: the default spec is the ELBO / own length."""
    spec, b = spec_of(), batch()
    plan, q, tok = drawn(spec, b)
    est, elbo = sequence_estimates_and_elbo(tok, plan, b, spec)
    torch.testing.assert_close(est, hand_elbo_sum(plan, q, b) / _lengths(b), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(elbo, est)
