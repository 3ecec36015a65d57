"""Block ELBO: one staircase pass over [x_t | x_0] equals the per-block loop."""

import pytest
import torch

from stabledrl_mcore.diffusion import block_elbo_loop, block_elbo_staircase, build_plan
from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig

BS = 4


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def sdar():
    cfg = ToyDLLMConfig(arch="sdar", vocab_size=16, mask_token_id=15, block_size=BS, hidden_size=32, num_layers=2)
    return ToyDiffusionLM(cfg, seed=3, dtype=torch.float64)


def data(B=3, n=8 * BS, prompt=6):
    ids = torch.randint(0, 15, (B, n), generator=gen(1))
    comp = torch.zeros(B, n, dtype=torch.bool)
    comp[:, prompt:] = True
    comp[1, n - 7 :] = False  # a shorter completion (prompt ends mid-block too)
    return ids, comp


@pytest.mark.parametrize("mode,coupled", [("count", False), ("count", True), ("ratio", False)])
def test_staircase_equals_per_block_loop(sdar, mode, coupled):
    ids, comp = data()
    st = block_elbo_staircase(sdar, ids, comp, num_mc=2, generator=gen(5), mode=mode, coupled=coupled)
    loop = block_elbo_loop(sdar, ids, comp, plan=st.plan)
    full = block_elbo_loop(sdar, ids, comp, plan=st.plan, truncate=False)
    for other in (loop, full):
        torch.testing.assert_close(st.seq, other.seq, atol=1e-5, rtol=0)
        torch.testing.assert_close(st.token, other.token, atol=1e-5, rtol=0)
    assert (st.token[~comp] == 0).all() and st.plan.block_size == BS


def test_staircase_gradients_match_the_loop(sdar):
    ids, comp = data()
    st = block_elbo_staircase(sdar, ids, comp, BS, num_mc=1, generator=gen(2), length_normalize=True)
    g1 = torch.autograd.grad(st.seq.sum(), list(sdar.parameters()))
    loop = block_elbo_loop(sdar, ids, comp, BS, plan=st.plan, length_normalize=True)
    g2 = torch.autograd.grad(loop.seq.sum(), list(sdar.parameters()))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_staircase_is_reproducible_and_block_size_checked(sdar):
    ids, comp = data()
    a = block_elbo_staircase(sdar, ids, comp, num_mc=2, generator=gen(9))
    b = block_elbo_staircase(sdar, ids, comp, num_mc=2, generator=gen(9))
    assert torch.equal(a.seq, b.seq)
    wrong = build_plan(comp, num_mc=1, generator=gen(), block_size=2 * BS)
    with pytest.raises(ValueError):
        block_elbo_staircase(sdar, ids, comp, plan=wrong)


def test_per_block_counts_are_block_local(sdar):
    """Each block gets its own count l_b in 1..L_b and weight L_b / l_b (block-diffusion ELBO)."""
    ids, comp = data()
    plan = block_elbo_staircase(sdar, ids, comp, num_mc=1, generator=gen(4)).plan
    m = plan.masked[0].reshape(3, -1, BS)
    w = plan.weight[0].reshape(3, -1, BS)
    Lb = comp.reshape(3, -1, BS).sum(-1)
    lb = m.sum(-1)
    has = Lb > 0
    assert ((lb >= 1) == has).all()
    torch.testing.assert_close(w.sum(-1)[has], Lb[has].double().float())
