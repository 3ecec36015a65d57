"""Samplers: LLaDA step-for-step against a naive upstream reference; SDAR cache == no cache."""

import pytest
import torch

from stabledrl_mcore.diffusion import generate, generate_llada, generate_sdar, num_transfer_tokens, select_transfer
from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig
from stabledrl_mcore.models.positions import take_positions

MASK, EOS = 15, 1


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def toy(arch, dtype=torch.float64, seed=0, **kw):
    cfg = ToyDLLMConfig(
        arch=arch,
        vocab_size=16,
        mask_token_id=MASK,
        eos_token_id=EOS,
        block_size=4,
        hidden_size=32,
        num_layers=2,
        logit_scale=3.0,
        **kw,
    )
    return ToyDiffusionLM(cfg, seed=seed, dtype=dtype)


def prompts(B=3, P=5, seed=1):
    return torch.randint(2, 15, (B, P), generator=gen(seed))


def naive_llada(model, prompt, *, gen_length, steps, block_length, cfg_scale=0.0, mask_id=MASK):
    """Upstream LLaDA ``generate`` written naively: one sample, one block, one step at a time.

    Greedy (x0 = argmax), confidence = softmax probability of x0, -inf for committed
    positions and beyond the current block, top-k commit with k = the block's
    masked count split evenly over its steps (remainder to the first steps).
    Returns the final sequences and, per sample, the committed positions of each step.
    """
    finals, traces = [], []
    P = prompt.shape[1]
    num_blocks = gen_length // block_length
    per_block = steps // num_blocks
    for b in range(prompt.shape[0]):
        x = torch.cat([prompt[b], torch.full((gen_length,), mask_id)])
        trace = []
        for blk in range(num_blocks):
            end = P + (blk + 1) * block_length
            n_masked = int((x[P + blk * block_length : end] == mask_id).sum())
            ks = [n_masked // per_block + (1 if i < n_masked % per_block else 0) for i in range(per_block)]
            for k in ks:
                logits = model(x[None])[0]
                if cfg_scale > 0:
                    un = x.clone()
                    un[:P] = mask_id
                    u = model(un[None])[0]
                    logits = u + (cfg_scale + 1) * (logits - u)
                x0 = logits.argmax(-1)
                prob = torch.softmax(logits, -1)
                conf = torch.empty(len(x), dtype=prob.dtype)
                for j in range(len(x)):
                    conf[j] = prob[j, x0[j]] if (x[j] == mask_id and j < end) else -float("inf")
                chosen = torch.topk(conf, k).indices.tolist()
                for j in chosen:
                    x[j] = x0[j]
                trace.append(sorted(chosen))
        finals.append(x)
        traces.append(trace)
    return torch.stack(finals), traces


def recorder(B):
    trace = [[] for _ in range(B)]

    def hook(step, transfer, x):
        for b in range(B):
            trace[b].append(sorted(transfer[b].nonzero().flatten().tolist()))

    return trace, hook


@pytest.mark.parametrize("gen_length,steps,block_length,cfg_scale", [(12, 8, 6, 0.0), (8, 8, 8, 0.0), (8, 4, 4, 0.5)])
def test_greedy_llada_follows_upstream_step_for_step(gen_length, steps, block_length, cfg_scale):
    model, p = toy("llada"), prompts()
    with torch.no_grad():
        want, want_trace = naive_llada(
            model, p, gen_length=gen_length, steps=steps, block_length=block_length, cfg_scale=cfg_scale
        )
    trace, hook = recorder(3)
    got = generate_llada(
        model,
        p,
        gen_length=gen_length,
        steps=steps,
        block_length=block_length,
        cfg_scale=cfg_scale,
        on_step=hook,
        progress=False,
    )
    assert trace == want_trace
    assert torch.equal(got, want)
    assert not (got == MASK).any()


@pytest.mark.parametrize(
    "threshold,P,dtype",
    [(None, 5, torch.float32), (0.3, 5, torch.float32), (0.3, 8, torch.float64), (None, 2, torch.float32)],
)
def test_greedy_sdar_with_cache_equals_without(threshold, P, dtype):
    model, p = toy("sdar", dtype=dtype), prompts(P=P)
    kw = dict(gen_length=16, steps=4, threshold=threshold, progress=False)
    calls = []
    lengths = lambda step, transfer, x: calls.append(step)  # noqa: E731
    cached = generate_sdar(model, p, use_cache=True, on_step=lengths, **kw)
    plain = generate_sdar(model, p, use_cache=False, **kw)
    assert cached.shape == (3, -(-(P + 16) // 4) * 4)
    assert torch.equal(cached, plain)
    assert torch.equal(cached[:, :P], p) and not (cached == MASK).any()
    if threshold is not None:
        assert len(calls) < 4 * (cached.shape[1] // 4 - P // 4)  # the threshold finishes blocks early


def test_sdar_cache_only_runs_the_current_block():
    model, p = toy("sdar"), prompts(P=5)
    seen = []
    inner = model.forward

    def spy(ids, *a, **k):
        seen.append((ids.shape[1], k.get("kv_cache") is not None))
        return inner(ids, *a, **k)

    model.forward = spy
    generate_sdar(model, p, gen_length=8, steps=2, progress=False)
    assert seen[0] == (4, True)  # prefill of the one whole prompt block
    assert all(cached for _, cached in seen)
    # blocks [4, 8) (prompt tail), [8, 12) and [12, 16), 2 steps each; a block's first forward also
    # stores the finished block before it (8 tokens); no separate storing forward
    assert [n for n, _ in seen] == [4, 4, 4, 8, 4, 8, 4]


def test_sdar_left_padded_prompts_match_without_cache():
    model, p = toy("sdar"), prompts(P=6)
    valid = torch.ones_like(p, dtype=torch.bool)
    valid[0, :2] = False
    a = generate_sdar(model, p, gen_length=8, steps=4, prompt_valid=valid, progress=False)
    b = generate_sdar(model, p, gen_length=8, steps=4, prompt_valid=valid, use_cache=False, progress=False)
    assert torch.equal(a, b)


def test_sampling_is_reproducible_with_a_generator():
    for arch, extra in (("llada", dict(block_length=4, remasking="random")), ("sdar", dict(block_length=4))):
        model, p = toy(arch, dtype=torch.float32), prompts()
        kw = dict(gen_length=8, steps=4, temperature=1.0, progress=False, **extra)
        a = generate(model, p, generator=gen(1), **kw)
        b = generate(model, p, generator=gen(1), **kw)
        c = generate(model, p, generator=gen(2), **kw)
        assert torch.equal(a, b) and not torch.equal(a, c), arch
        with pytest.raises(TypeError):
            generate(model, p, **kw)


class EosModel(torch.nn.Module):
    """Wraps a toy model and makes EOS the most likely token at positions >= ``start``."""

    def __init__(self, model, start):
        super().__init__()
        self.model, self.start, self.calls = model, start, 0
        self.dllm_config = model.dllm_config

    def forward(self, ids, position_ids=None, attention_mask=None, **kw):
        self.calls += 1
        logits = self.model(ids, position_ids, attention_mask, **kw).clone()
        pos = position_ids if position_ids is not None else torch.arange(ids.shape[1])[None]
        if position_ids is None and kw.get("cache_slots") is not None:  # a slot-addressed step
            pos = kw["cache_slots"][None]
        read = kw.get("logit_positions")
        pos = pos.expand(ids.shape)
        pos = take_positions(pos, read if read is not None else slice(None), 1)
        logits[..., EOS] += 50.0 * (pos >= self.start).to(logits.dtype)
        return logits


def test_stop_at_eos_stops_early_and_fills_with_eos():
    p = prompts(P=4)
    llada = EosModel(toy("llada"), start=4 + 6)
    out = generate(llada, p, gen_length=16, steps=16, block_length=4, stop_at_eos=True, progress=False)
    assert out.shape == (3, 20) and llada.calls < 16
    assert (out[:, 10:] == EOS).all() and not (out == MASK).any()
    full = generate(EosModel(toy("llada"), start=10), p, gen_length=16, steps=16, block_length=4, progress=False)
    assert torch.equal(out[:, :10], full[:, :10])
    sdar = EosModel(toy("sdar"), start=12)
    out = generate(sdar, p, gen_length=32, steps=4, block_length=None, stop_at_eos=True, progress=False)
    assert out.shape == (3, 36) and (out[:, 12:] == EOS).all() and sdar.calls < 8 * 4


def test_generate_dispatch_and_schedules():
    p = prompts(P=5)
    assert generate(toy("llada"), p, gen_length=8, steps=4, block_length=4, progress=False).shape == (3, 13)
    assert generate(toy("sdar"), p, gen_length=8, steps=4, block_length=None, progress=False).shape == (3, 16)
    bad = toy("llada")
    bad.dllm_config.arch = "gpt"
    with pytest.raises(ValueError):
        generate(bad, p, gen_length=8, steps=4, block_length=4)
    with pytest.raises(ValueError):
        generate(toy("llada"), p, gen_length=8, steps=3, block_length=4)
    assert num_transfer_tokens(torch.tensor([6, 3, 0]), 4).tolist() == [[2, 2, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]]
    conf = torch.tensor([[0.9, 0.2, 0.95, -float("inf")], [0.1, 0.3, -float("inf"), -float("inf")]])
    assert select_transfer(conf, torch.tensor([1, 5])).tolist() == [
        [False, False, True, False],
        [True, True, False, False],
    ]
    assert select_transfer(conf, torch.tensor([1, 1]), threshold=0.5).tolist() == [
        [True, False, True, False],
        [False, True, False, False],
    ]


def test_progress_bar_runs(capsys):
    generate(toy("llada"), prompts(), gen_length=4, steps=4, block_length=4, progress=True)
    assert "llada" in capsys.readouterr().err


PROBS = [0.06, 0.4, 0.1, 0.25, 0.04, 0.15]  # a 6-token vocabulary, not in sorted order


def _kept_by_hand(top_k=0, top_p=1.0):
    """The tokens SDAR's filter keeps: the k most likely; then, in descending order, every token
    whose preceding mass is <= top_p (so the one that crosses top_p is kept)."""
    order = sorted(range(len(PROBS)), key=lambda t: -PROBS[t])
    kept = order[:top_k] if top_k else order
    if top_p < 1.0:
        mass = sum(PROBS[t] for t in kept)
        out, before = [], 0.0
        for t in kept:
            if before <= top_p:
                out.append(t)
            before += PROBS[t] / mass
        kept = out
    return sorted(kept)


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (1, 1.0), (6, 1.0), (0, 0.5), (0, 0.3), (0, 0.7), (4, 0.5)])
def test_top_k_and_top_p_sample_exactly_the_kept_tokens_in_proportion(top_k, top_p):
    from stabledrl_mcore.diffusion.sampling_common import sample_tokens

    kept = _kept_by_hand(top_k, top_p)
    n = 4000
    logits = torch.log(torch.tensor(PROBS, dtype=torch.float64)).expand(n, -1)
    tok, prob = sample_tokens(logits, 1.0, top_k, top_p, gen(3))
    assert sorted(set(tok.tolist())) == kept
    mass = sum(PROBS[t] for t in kept)
    want = torch.tensor([PROBS[t] / mass for t in tok.tolist()], dtype=torch.float32)
    torch.testing.assert_close(prob, want, rtol=1e-5, atol=1e-6)  # the renormalised probability
    freq = torch.bincount(tok, minlength=len(PROBS)).double() / n
    for t in kept:  # binomial standard error <= 0.008 at n = 4000: 4 of them
        assert abs(float(freq[t]) - PROBS[t] / mass) < 0.035, (t, freq)
