"""Layouts with padding, flex attention vs SDPA, BlockMask caching and compilation (CPU).

flex attention runs here eagerly (torch's reference implementation) and, for a
few tiny cases, compiled by inductor's CPU template. torch refuses flex
attention's backward on CPU (``_validate_device``), so the backward checks lift
that check for the eager reference only; the compiled CPU backward does not exist.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_models_hf import megatron_tp1  # noqa: F401  (module-scoped Megatron TP=1 state)

from stabledrl_mcore.models import AttentionLayout, build_model, flex, get_preset
from stabledrl_mcore.models.masks import (
    block_causal_mask,
    left_pad_counts,
    padding_mask,
    staircase_mask,
    staircase_position_ids,
)

BS = 4


def _valid(pads, length):
    return torch.arange(length)[None] >= torch.tensor(pads)[:, None]


# (layout, S_q, S_k): every layout with padding, block-causal with a KV-cache offset,
# the staircase over 2n and truncated to n + 2 blocks (what the staircase likelihood feeds).
CASES = {
    "bidirectional": (AttentionLayout.bidirectional(pad=(3, 0)), 20, 20),
    "bidirectional_cached": (AttentionLayout.bidirectional(pad=(3, 0)), 4, 20),
    "block_causal": (AttentionLayout.block_causal(BS, pad=(6, 1)), 20, 20),
    "block_causal_cached": (AttentionLayout.block_causal(BS, pad=(6, 1)), 4, 20),
    "block_causal_unpadded_cached": (AttentionLayout.block_causal(BS), 8, 20),
    "staircase": (AttentionLayout.staircase(BS, pad=(5, 0)), 24, 24),
    "staircase_truncated": (AttentionLayout.staircase(BS, pad=(5, 0), noisy_len=12), 20, 20),
    "staircase_unpadded": (AttentionLayout.staircase(BS), 24, 24),
}


def _reference_blocked(layout, sq, sk):
    """The old way: the pattern's reference mask | a key-padding mask."""
    if layout.kind == "staircase":
        n = layout.noisy_len or sq // 2
        pattern = staircase_mask(n, BS)[..., :sq, :sk]
    elif layout.kind == "block_causal":
        pattern = block_causal_mask(sq, BS, offset=sk - sq, key_len=sk)
    else:
        pattern = torch.zeros(1, 1, sq, sk, dtype=torch.bool)
    if not layout.pad:
        return pattern, None
    if layout.kind == "staircase":
        valid = _valid(layout.pad, layout.noisy_len or sq // 2)
        valid = torch.cat([valid, valid], 1)[:, :sk]
    else:
        valid = _valid(layout.pad, sk)
    return pattern | padding_mask(valid), valid[:, sk - sq :]


# ------------------------------------------------------------------------------- masks
@pytest.mark.parametrize("name", sorted(CASES))
def test_dense_is_the_mask_mod_and_matches_the_references(name):
    layout, sq, sk = CASES[name]
    blocked = layout.dense(sq, sk)
    batch = max(len(layout.pad), 1)
    b = torch.arange(batch)[:, None, None, None]
    q, k = torch.arange(sq)[None, None, :, None], torch.arange(sk)[None, None, None, :]
    allowed = layout.mask_mod(sq, sk)(b, 0, q, k)
    allowed = allowed.expand(batch, 1, sq, sk)
    assert torch.equal(~allowed, blocked.expand(batch, 1, sq, sk))
    assert allowed.any(-1).all(), "a query row sees nothing"
    reference, valid_q = _reference_blocked(layout, sq, sk)
    if valid_q is None:
        assert torch.equal(blocked, reference)
    else:  # identical on every non-pad query row; pad rows are never scored
        rows = valid_q[:, None, :, None].expand(batch, 1, sq, sk)
        assert torch.equal(blocked.expand_as(rows)[rows], reference.expand_as(rows)[rows])
    assert AttentionLayout.from_tensor(layout.to_tensor()) == layout
    assert AttentionLayout.is_descriptor(layout.to_tensor())


def test_layout_validation_and_left_pad_counts():
    assert AttentionLayout.block_causal(BS, pad=(0, 0)).pad == ()  # no padding at all
    assert AttentionLayout.bidirectional().unmasked and not AttentionLayout.bidirectional(pad=(1,)).unmasked
    assert AttentionLayout.bidirectional().dense(4, 4) is None
    with pytest.raises(ValueError, match="rows"):
        AttentionLayout.block_causal(BS, pad=(1, 2)).check(8, 8, batch=3)
    with pytest.raises(ValueError, match="staircase"):
        AttentionLayout.staircase(BS, noisy_len=12).check(26, 26)
    with pytest.raises(ValueError, match="see nothing"):
        AttentionLayout.bidirectional(pad=(8,)).check(8, 8)
    valid = _valid((2, 0, 5), 8)
    assert left_pad_counts(valid) == (2, 0, 5)
    assert left_pad_counts(valid) is left_pad_counts(valid)  # remembered for the same tensor
    holes = valid.clone()
    holes[1, 3] = False
    assert left_pad_counts(holes) is None


def test_kernel_choice():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    stair, bidi = AttentionLayout.staircase(BS, pad=(1,)), AttentionLayout.bidirectional(pad=(1,))
    long, short = flex.FLEX_MIN_QUERY, flex.FLEX_MIN_QUERY - 1
    assert not flex.use_flex("auto", AttentionLayout.bidirectional(), long, cuda, gqa=True)
    assert flex.use_flex("auto", stair, long, cuda) and flex.use_flex("auto", stair, long, cuda, gqa=True)
    assert flex.use_flex("auto", AttentionLayout.block_causal(BS), long, cuda)
    assert not flex.use_flex("auto", stair, short, cuda, gqa=True)  # KV-cached decode: small dense mask
    assert flex.use_flex("auto", bidi, long, cuda, gqa=True)  # SDPA + GQA + mask = math kernel
    assert not flex.use_flex("auto", bidi, long, cuda, gqa=False)  # [B,1,1,S] key mask, mem-efficient
    assert not flex.use_flex("auto", stair, long, cpu)
    assert not flex.use_flex("sdpa", stair, long, cuda)
    assert flex.use_flex("flex", stair, 8, cpu) and flex.use_flex("flex", bidi, 8, cpu)


def test_block_mask_is_cached_per_pattern_and_shape():
    a = flex.block_mask(AttentionLayout.staircase(BS, pad=(1, 2)), 24, 24, "cpu")
    assert flex.block_mask(AttentionLayout.staircase(BS), 24, 24, torch.device("cpu")) is a
    assert flex.block_mask(AttentionLayout.staircase(BS, pad=(3, 0)), 24, 24, "cpu") is a
    assert flex.block_mask(AttentionLayout.staircase(BS), 32, 32, "cpu") is not a
    layout = AttentionLayout.block_causal(BS, pad=(1, 2))
    assert flex.padding_score_mod(layout, 8, 8, "cpu") is flex.padding_score_mod(layout, 8, 8, "cpu")
    assert flex.padding_score_mod(layout.without_padding(), 8, 8, "cpu") is None


def test_staircase_block_mask_compiles():
    layout = AttentionLayout.staircase(BS, noisy_len=32)
    eager = flex.block_mask(layout, 56, 56, "cpu", block_size=8, compile=False)
    compiled = flex.block_mask(layout, 56, 56, "cpu", block_size=8, compile=True)
    assert compiled is not eager
    for name in (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "full_q_num_blocks",
    ):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
    assert torch.equal(compiled.to_dense(), eager.to_dense())
    assert eager.full_kv_num_blocks.sum() > 0  # the case exercises full tiles


# ---------------------------------------------------------------------- flex vs SDPA
def _qkv(batch, sq, sk, heads=4, groups=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, sq, dim, generator=g)
    k, v = (torch.randn(batch, groups, sk, dim, generator=g) for _ in range(2))
    return q, k, v


def _sdpa(q, k, v, layout):
    blocked = layout.dense(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if blocked is None else ~blocked, enable_gqa=q.shape[1] != k.shape[1]
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_flex_forward_and_backward_match_sdpa(name, monkeypatch):
    layout, sq, sk = CASES[name]
    q, k, v = _qkv(max(len(layout.pad), 2), sq, sk)
    with torch.no_grad():
        torch.testing.assert_close(
            flex.flex_attention(q, k, v, layout, enable_gqa=True), _sdpa(q, k, v, layout), atol=1e-5, rtol=1e-5
        )
    # torch refuses the backward on CPU by a device check only; the eager reference has one
    import torch.nn.attention.flex_attention as torch_flex

    monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)
    grads = []
    for fn in (lambda *t: flex.flex_attention(*t, layout, enable_gqa=True), lambda *t: _sdpa(*t, layout)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        (out * torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _doubled(layout: AttentionLayout) -> AttentionLayout:
    """The layout at twice the scale: block size, pad counts and staircase length doubled."""
    return AttentionLayout(layout.kind, 2 * layout.block_size, tuple(2 * p for p in layout.pad), 2 * layout.noisy_len)


@pytest.mark.parametrize("name", ["staircase_truncated", "bidirectional", "block_causal_cached"])
def test_compiled_flex_forward_matches_sdpa(name):
    """inductor's CPU flex kernel on the case at twice its scale with 16-wide tiles (the tile
    structure of the case with 8-wide ones; lengths 8 and 40, not multiples of 16), so full,
    partial and skipped tiles all occur. Not 8-wide: inductor's CPU template is wrong there
    (``flex.CPU_COMPILED_MIN_BLOCK``; the next test)."""
    from torch._dynamo.utils import counters

    layout, sq, sk = CASES[name]
    layout, sq, sk = _doubled(layout), 2 * sq, 2 * sk
    q, k, v = _qkv(2, sq, sk)
    with torch.no_grad():
        got = flex.flex_attention(q, k, v, layout, enable_gqa=True, compiled=True, block_size=16)
        torch.testing.assert_close(got, _sdpa(q, k, v, layout), atol=1e-5, rtol=1e-5)
        if name == "staircase_truncated":  # another padding: same BlockMask, no recompile
            graphs = counters["stats"]["unique_graphs"]
            other = layout.with_padding((4, 18))
            got = flex.flex_attention(q, k, v, other, enable_gqa=True, compiled=True, block_size=16)
            torch.testing.assert_close(got, _sdpa(q, k, v, other), atol=1e-5, rtol=1e-5)
            assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_flex_with_small_cpu_tiles_runs_eagerly_and_right():
    """8-wide tiles: inductor's CPU kernel differs from SDPA by ~1-2 (AVX2 and AVX-512, torch
    2.13), so the call runs eager flex attention instead, with one warning naming the fix."""
    layout, sq, sk = CASES["staircase_truncated"]
    q, k, v = _qkv(2, sq, sk)
    flex._warn_small_cpu_tiles.cache_clear()
    with torch.no_grad(), pytest.warns(UserWarning, match="block_size >= 16"):
        got = flex.flex_attention(q, k, v, layout, enable_gqa=True, compiled=True, block_size=8)
    torch.testing.assert_close(got, _sdpa(q, k, v, layout), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------- the model
def _model(backend, recompute=False):
    torch.manual_seed(0)
    return build_model(get_preset("sdar-tiny", init_std=0.2, attention_backend=backend), recompute=recompute)


def test_model_flex_equals_sdpa_on_padded_staircase(megatron_tp1):
    sdpa, flex_model = _model("sdpa").eval(), _model("flex").eval()
    flex_model.load_state_dict(sdpa.state_dict())
    n, pads = 12, (5, 0)
    x = torch.randint(3, 255, (2, 2 * n))
    layout, pos = AttentionLayout.staircase(BS, pad=pads), staircase_position_ids(n)
    valid = _valid(pads, n)
    old = staircase_mask(n, BS) | padding_mask(torch.cat([valid, valid], 1))
    with torch.no_grad():
        a, b, c = sdpa(x, pos, layout), flex_model(x, pos, layout), sdpa(x, pos, old)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    assert (a - b).abs().max() < 1e-5
    rows = torch.cat([valid, valid], 1)
    assert (a[rows] - c[rows]).abs().max() < 1e-5  # the old dense mask at every non-pad position


def test_padded_layout_survives_full_recompute(megatron_tp1):
    plain, again = _model("sdpa"), _model("sdpa", recompute=True)
    again.load_state_dict(plain.state_dict())
    n, pads = 12, (5, 0)
    x, targets = torch.randint(3, 255, (2, 2 * n)), torch.randint(3, 255, (2, 2 * n))
    layout, pos = AttentionLayout.staircase(BS, pad=pads), staircase_position_ids(n)
    grads = []
    for model in (plain, again):
        model.train()
        logits = model(x, pos, layout)
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad, grads[1][name], atol=1e-6, rtol=1e-5)


def test_token_logp_with_layouts_equals_the_dense_masks(megatron_tp1):
    """The RL loop's likelihood forward (staircase for SDAR, bidirectional for LLaDA) with
    padded layouts gives the log-probs of the old ``pattern | padding_mask`` forward."""
    from stabledrl_mcore.diffusion.likelihood import gather_log_probs
    from stabledrl_mcore.rl.estimates import LikelihoodSpec, draw_plan, token_logp
    from stabledrl_mcore.rl.rollout import RolloutBatch

    P, C, pads = 6, 8, (3, 0, 5)
    n = P + C
    valid = torch.cat([_valid(pads, P), torch.ones(3, C, dtype=torch.bool)], 1)
    comp = torch.zeros(3, n, dtype=torch.bool)
    comp[:, P:] = True
    batch = RolloutBatch(
        sequences=torch.randint(3, 250, (3, n)),
        prompt_len=P,
        prompt_valid=valid,
        completion_mask=comp,
        group_index=torch.arange(3),
        completions=[""] * 3,
        references=[None] * 3,
    )
    for preset, spec in (
        ("sdar-tiny", LikelihoodSpec("staircase", num_mc=1, block_size=BS)),
        ("llada-tiny", LikelihoodSpec("elbo", num_mc=1)),
    ):
        torch.manual_seed(0)
        model = build_model(get_preset(preset, init_std=0.2)).eval()
        plan = draw_plan(batch, spec, lambda k: torch.Generator().manual_seed(k), micro_batch=2)
        for rows in (slice(0, 2), slice(2, 3)):
            with torch.no_grad():
                got = token_logp(model, batch, plan, spec, rows=rows, mask_id=255, draw=0)
                ids, keys = batch.sequences[rows], valid[rows]
                noisy = ids.masked_fill(plan.masked[0, rows], 255)
                if spec.kind == "staircase":
                    mask = staircase_mask(n, BS) | padding_mask(torch.cat([keys, keys], 1))
                    logits = model(torch.cat([noisy, ids], 1), staircase_position_ids(n), mask)[:, :n]
                else:
                    logits = model(noisy, attention_mask=padding_mask(keys))
                want = gather_log_probs(logits, ids, plan.scored[0, rows])
            assert got.abs().sum() > 0
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sdar_sampler_with_padded_layouts(megatron_tp1):
    """Prefill + KV-cached block decode with the padded block-causal layout: the cache changes
    nothing, and flex attention (every forward, the cached decode included) equals SDPA."""
    from stabledrl_mcore.diffusion import generate_sdar

    sdpa, flex_model = _model("sdpa").eval(), _model("flex").eval()
    flex_model.load_state_dict(sdpa.state_dict())
    prompt = torch.randint(3, 250, (2, 6))
    valid = _valid((3, 0), 6)
    kw = dict(gen_length=8, steps=2, prompt_valid=valid, progress=False)
    cached = generate_sdar(sdpa, prompt, **kw)
    assert torch.equal(cached, generate_sdar(sdpa, prompt, use_cache=False, **kw))
    assert torch.equal(cached, generate_sdar(flex_model, prompt, **kw))
