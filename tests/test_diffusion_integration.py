"""The diffusion core on the real Megatron backbones (``llada-tiny`` / ``sdar-tiny``, TP=1, one process)."""

import pytest
import torch
from test_diffusion_sampling import naive_llada, recorder

from stabledrl_mcore import models  # a project module that fails to import fails this module
from stabledrl_mcore.diffusion import (
    block_elbo_loop,
    block_elbo_staircase,
    elbo,
    generate,
    generate_llada,
    generate_sdar,
)


@pytest.fixture(scope="module")
def megatron():
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    bootstrap.initialize(1, 1, seed=0)
    yield
    bootstrap.destroy()
    cpu_compat.disable()
    torch.set_num_threads(threads)


def build(name):
    torch.manual_seed(0)  # Megatron initialises weights from the global RNG
    return models.build_model(models.get_preset(name, init_std=0.2)).eval()


def prompts(P, seed=0):
    return torch.randint(3, 250, (3, P), generator=torch.Generator().manual_seed(seed))


def test_llada_tiny_greedy_follows_upstream(megatron):
    model = build("llada-tiny")
    p = prompts(5)
    mask_id = model.dllm_config.mask_token_id
    with torch.no_grad():
        want, want_trace = naive_llada(model, p, gen_length=8, steps=8, block_length=4, mask_id=mask_id)
    trace, hook = recorder(3)
    got = generate_llada(model, p, gen_length=8, steps=8, block_length=4, on_step=hook, progress=False)
    assert trace == want_trace and torch.equal(got, want)
    out = generate(
        model,
        p,
        gen_length=8,
        steps=4,
        block_length=4,
        temperature=0.9,
        cfg_scale=0.5,
        generator=torch.Generator().manual_seed(1),
        progress=False,
    )
    assert out.shape == (3, 13) and not (out == mask_id).any()


def test_sdar_tiny_cache_equals_no_cache_and_staircase_equals_loop(megatron):
    model = build("sdar-tiny")
    p = prompts(6)
    for threshold in (None, 0.3):
        a = generate_sdar(model, p, gen_length=16, steps=4, threshold=threshold, progress=False)
        b = generate_sdar(model, p, gen_length=16, steps=4, threshold=threshold, use_cache=False, progress=False)
        assert a.shape == (3, 24) and torch.equal(a, b)
    ids = prompts(32, seed=1)
    comp = torch.zeros_like(ids, dtype=torch.bool)
    comp[:, 6:] = True
    with torch.no_grad():
        st = block_elbo_staircase(model, ids, comp, num_mc=2, generator=torch.Generator().manual_seed(2))
        loop = block_elbo_loop(model, ids, comp, plan=st.plan)
        tp = block_elbo_staircase(model, ids, comp, plan=st.plan, logprob_fn=models.vocab_parallel_log_probs)
    torch.testing.assert_close(st.token, loop.token, atol=1e-5, rtol=0)
    torch.testing.assert_close(st.seq, loop.seq, atol=0, rtol=1e-6)  # float32 sums of ~30 terms of ~5
    torch.testing.assert_close(tp.seq, st.seq)


def test_llada_tiny_elbo_carries_gradients(megatron):
    model = build("llada-tiny")
    ids = prompts(12, seed=3)
    comp = torch.zeros_like(ids, dtype=torch.bool)
    comp[:, 4:] = True
    est = elbo(
        model, ids, comp, num_mc=2, coupled=True, generator=torch.Generator().manual_seed(0), length_normalize=True
    )
    est.seq.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
