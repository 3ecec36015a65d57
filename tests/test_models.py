"""Backbone behaviour in one process: configs, attention modes, staircase exactness,
KV cache, recompute, log-probs and checkpoint keys (issue: model backbones)."""

from __future__ import annotations

import pytest
import torch
from test_models_hf import megatron_tp1  # noqa: F401  (module-scoped Megatron TP=1 state)

from stabledrl_mcore.models import (
    AttentionLayout,
    DLLMConfig,
    KVCache,
    ModelConfigError,
    available_presets,
    block_causal_mask,
    build_model,
    get_preset,
    segment_positions,
    staircase_mask,
    staircase_position_ids,
    to_transformer_config,
    vocab_parallel_log_probs,
)


def _model(name, seed=0, **overrides):
    torch.manual_seed(seed)
    return build_model(get_preset(name, init_std=0.2, **overrides)).eval()


# ----------------------------------------------------------------------------- configs
def test_presets_have_the_published_shapes():
    assert set(available_presets()) >= {"llada-8b", "sdar-8b", "llada-tiny", "sdar-tiny", "llada-100m", "sdar-100m"}
    llada, sdar = get_preset("llada-8b"), get_preset("sdar-8b")
    assert (llada.vocab_size, llada.num_layers, llada.num_query_groups, llada.mask_token_id) == (126464, 32, 32, 126336)
    assert (sdar.num_layers, sdar.num_query_groups, sdar.kv_channels, sdar.block_size) == (36, 8, 128, 4)
    assert abs(llada.num_parameters() / 1e9 - 8.02) < 0.01
    assert abs(sdar.num_parameters() / 1e9 - 8.19) < 0.01
    for name in ("llada-tiny", "sdar-tiny"):
        assert 1e5 < get_preset(name).num_parameters() < 5e5
    for name in ("llada-100m", "sdar-100m"):
        assert 0.9e8 < get_preset(name).num_parameters() < 1.2e8
    tc = to_transformer_config(sdar, dict(tensor_model_parallel_size=1), torch.bfloat16, recompute=True)
    assert (tc.kv_channels, tc.num_query_groups, tc.layernorm_epsilon, tc.qk_layernorm) == (128, 8, 1e-6, True)
    assert tc.bf16 and tc.recompute_granularity == "full" and not tc.add_bias_linear


def test_config_validation_and_round_trip():
    cfg = get_preset("sdar-tiny")
    assert DLLMConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ModelConfigError, match="block_size"):
        cfg.replace(block_size=None)
    with pytest.raises(ModelConfigError, match="multiple of num_query_groups"):
        cfg.replace(num_query_groups=3)
    with pytest.raises(ModelConfigError, match="mask_token_id"):
        cfg.replace(mask_token_id=cfg.vocab_size)
    with pytest.raises(ModelConfigError, match="unknown DLLMConfig fields"):
        DLLMConfig.from_dict({**cfg.to_dict(), "hidden": 3})
    with pytest.raises(ModelConfigError, match="unknown preset"):
        get_preset("llada-9b")
    assert get_preset("llada-tiny", make_vocab_size_divisible_by=100).padded_vocab_size(2) == 400


# --------------------------------------------------------------------- position schemes
def test_segment_positions_restart_after_the_separator():
    sep = 9
    ids = torch.tensor([[5, 6, 7, sep, 5, 6, 7, 2], [sep, 1, sep, sep, 4, 4, 4, 4]])
    positions, segments = segment_positions(ids, sep)
    assert positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 0, 1, 0, 0, 1, 2, 3]]
    assert segments.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 2, 3, 3, 3, 3]]
    no_separator, zero = segment_positions(ids[:1, :3], sep)
    assert no_separator.tolist() == [[0, 1, 2]] and zero.tolist() == [[0, 0, 0]]


def test_position_config_errors_are_named():
    cfg = get_preset("llada-tiny")
    with pytest.raises(ModelConfigError, match="position_embedding must be one of"):
        cfg.replace(position_embedding="alibi")
    with pytest.raises(ModelConfigError, match="num_segments > 0 needs segment_separator_id"):
        cfg.replace(num_segments=2)
    with pytest.raises(ModelConfigError, match="segment_separator_id .* outside the vocabulary"):
        cfg.replace(segment_separator_id=cfg.vocab_size)
    with pytest.raises(ModelConfigError, match="embedding_init_std"):
        cfg.replace(embedding_init_std=0.0)


def _learned(name="llada-tiny", **overrides):
    settings = dict(
        position_embedding="learned",
        segment_separator_id=9,
        num_segments=2,
        embedding_init_std=1.0,
        max_position_embeddings=32,
    )
    return _model(name, **{**settings, **overrides})


@pytest.mark.parametrize("name", ["llada-tiny", "sdar-tiny"])
def test_learned_positions_add_word_position_and_segment_rows(megatron_tp1, name):
    model = _learned(name)
    ids = torch.tensor([[5, 6, 7, 9, 5, 6, 7, 2, 0], [9, 1, 1, 9, 4, 4, 4, 4, 4]])
    captured = {}
    hook = model.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True
    )
    try:
        model(ids)
    finally:
        hook.remove()
    table = model.embedding
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4], [0, 0, 1, 2, 0, 1, 2, 3, 4]])
    segments = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1, 1]])  # clamped to 2 rows
    expected = (
        table.word_embeddings.weight[ids]
        + table.position_embeddings.weight[positions]
        + table.tokentype_embeddings.weight[segments]
    )
    assert torch.allclose(captured["hidden_states"].transpose(0, 1), expected, atol=1e-6)
    assert captured["rotary_pos_emb"] is None, "learned positions replace RoPE"
    assert table.word_embeddings.weight.std() > 0.5, "embedding_init_std=1.0 reaches the tables"


def test_learned_positions_carry_all_position_information(megatron_tp1):
    """With the position and segment rows zeroed, a bidirectional model without RoPE is
    permutation-equivariant; with them, it is not."""
    model = _learned(segment_separator_id=None, num_segments=0)
    ids = torch.randint(10, 200, (2, 10))
    perm = torch.randperm(10)
    with torch.no_grad():
        assert not torch.allclose(model(ids[:, perm]), model(ids)[:, perm], atol=1e-4)
        model.embedding.position_embeddings.weight.zero_()
        assert torch.allclose(model(ids[:, perm]), model(ids)[:, perm], atol=1e-5)


def test_learned_position_checkpoint_round_trip(megatron_tp1, tmp_path):
    from stabledrl_mcore.checkpoint.mcore_io import load_model_weights, save_model_checkpoint

    model = _learned()
    ids = torch.tensor([[5, 6, 7, 9, 5, 6, 7, 2]])
    save_model_checkpoint(model, str(tmp_path / "ckpt"))
    fresh = _learned(seed=1)
    assert not torch.equal(fresh(ids), model(ids))
    load_model_weights(fresh, str(tmp_path / "ckpt"))
    assert torch.equal(fresh(ids), model(ids))


# ------------------------------------------------------------------------------- masks
@pytest.mark.parametrize("sq,sk", [(12, 12), (4, 16), (8, 20)])
def test_layout_mask_mods_match_dense_masks(sq, sk):
    q, k = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    layouts = [AttentionLayout.block_causal(4)] + ([AttentionLayout.staircase(4)] if sq == sk else [])
    for layout in layouts:
        allowed = layout.mask_mod(sq, sk)(0, 0, q, k)
        assert torch.equal(allowed, ~layout.dense(sq, sk)[0, 0])
        assert AttentionLayout.from_tensor(layout.to_tensor()) == layout
    assert torch.equal(AttentionLayout.block_causal(4).dense(4, 16), block_causal_mask(4, 4, offset=12))
    assert torch.equal(AttentionLayout.staircase(4).dense(24, 24), staircase_mask(12, 4))
    assert AttentionLayout.bidirectional().dense(sq, sk) is None
    with pytest.raises(ValueError):
        AttentionLayout.staircase(4).dense(4, 8)


# --------------------------------------------------------------------- attention modes
def test_llada_is_bidirectional(megatron_tp1):
    model = _model("llada-tiny")
    ids = torch.randint(0, 255, (2, 16))
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1) % 255
    with torch.no_grad():
        assert (model(ids)[:, 0] - model(changed)[:, 0]).abs().max() > 1e-4


def test_sdar_block_causal_hides_later_blocks(megatron_tp1):
    model = _model("sdar-tiny")
    ids = torch.randint(0, 255, (2, 16))
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1) % 255
    layout = AttentionLayout.block_causal(4)
    with torch.no_grad():
        a, b = model(ids, attention_mask=layout), model(changed, attention_mask=layout)
    assert torch.equal(a[:, :12], b[:, :12])
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-4


def test_staircase_equals_each_block_after_its_clean_prefix(megatron_tp1):
    model, n, bs = _model("sdar-tiny"), 16, 4
    x0 = torch.randint(0, 255, (2, n))
    xt = torch.where(torch.rand(2, n) < 0.5, torch.full_like(x0, 255), x0)
    with torch.no_grad():
        stair = model(torch.cat([xt, x0], 1), staircase_position_ids(n), AttentionLayout.staircase(bs))[:, :n]
        for b in range(n // bs):
            lo, hi = b * bs, (b + 1) * bs
            alone = model(torch.cat([x0[:, :lo], xt[:, lo:hi]], 1), attention_mask=AttentionLayout.block_causal(bs))[
                :, lo:hi
            ]
            assert (stair[:, lo:hi] - alone).abs().max() < 1e-5, f"block {b}"
            # negative control: seeing its own clean copy changes the result
            leaky = model(
                torch.cat([x0[:, :hi], xt[:, lo:hi]], 1),
                torch.cat([torch.arange(hi), torch.arange(lo, hi)])[None],
                AttentionLayout.bidirectional(),
            )[:, hi:]
            assert (stair[:, lo:hi] - leaky).abs().max() > 1e-3


def test_flex_backend_matches_sdpa(megatron_tp1):
    sdpa = _model("sdar-tiny", attention_backend="sdpa")
    flex = _model("sdar-tiny", attention_backend="flex")
    flex.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, 255, (2, 24))
    cases = [
        (ids, None, AttentionLayout.block_causal(4)),
        (ids, staircase_position_ids(12), AttentionLayout.staircase(4)),
    ]
    with torch.no_grad():
        for ids_, pos, layout in cases:
            assert (sdpa(ids_, pos, layout) - flex(ids_, pos, layout)).abs().max() < 1e-5


# ---------------------------------------------------------------------------- KV cache
def test_kv_cache_block_decoding_matches_full_pass(megatron_tp1):
    model, bs = _model("sdar-tiny"), 4
    ids = torch.randint(0, 255, (2, 20))
    with torch.no_grad():
        full = model(ids, attention_mask=AttentionLayout.block_causal(bs))
        cache = KVCache()
        with cache.storing():
            model(ids[:, :8], attention_mask=AttentionLayout.block_causal(bs), kv_cache=cache)
        assert cache.length == 8
        for lo in (8, 12):
            step = model(ids[:, lo : lo + bs], kv_cache=cache)  # current block sees cache + itself
            assert (step - full[:, lo : lo + bs]).abs().max() < 1e-5
            assert cache.length == lo
            with cache.storing():
                model(ids[:, lo : lo + bs], kv_cache=cache)
        last = model(ids[:, 16:], attention_mask=block_causal_mask(4, bs, offset=16), kv_cache=cache)
        assert (last - full[:, 16:]).abs().max() < 1e-5
        cache.truncate(8)  # two blocks at once after the prompt, block-causal between them
        two = model(ids[:, 8:16], attention_mask=AttentionLayout.block_causal(bs), kv_cache=cache)
        assert (two - full[:, 8:16]).abs().max() < 1e-5
        cache.reset()
        assert cache.length == 0 and cache.get(1) is None
    assert all(a.kv_cache is None for a in model.core_attentions())


def test_kv_cache_refuses_activation_recompute(megatron_tp1):
    model = build_model(get_preset("sdar-tiny"), recompute=True)  # training mode
    with pytest.raises(ValueError, match="recompute"):
        model(torch.randint(0, 255, (1, 4)), kv_cache=KVCache())


# ---------------------------------------------------------------- recompute, log-probs
@pytest.mark.parametrize("recompute", [True, "selective"])
def test_activation_recompute_gives_the_same_gradients(megatron_tp1, recompute):
    cfg = get_preset("sdar-tiny", init_std=0.2)
    plain, again = build_model(cfg), build_model(cfg, recompute=recompute)
    again.load_state_dict(plain.state_dict())
    ids, targets = torch.randint(0, 255, (2, 24)), torch.randint(0, 255, (2, 24))
    for mask in (AttentionLayout.staircase(4), staircase_mask(12, 4)):
        grads = []
        for model in (plain, again):
            model.zero_grad()
            logp = vocab_parallel_log_probs(model(ids, staircase_position_ids(12), mask), targets)
            logp.sum().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for name, grad in grads[0].items():
            assert torch.allclose(grad, grads[1][name], atol=1e-6, rtol=1e-5), name


def test_log_probs_match_log_softmax():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    got = vocab_parallel_log_probs(logits, targets)
    want = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert logits.grad is not None


# ----------------------------------------------------------------- checkpoint keys
def test_sharded_state_dict_uses_te_names(megatron_tp1):
    from stabledrl_mcore.models import te_available

    def keys(model):
        return {v.key for v in model.sharded_state_dict().values()}

    want = {
        "embedding.word_embeddings.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.self_attention.linear_qkv.weight",
        "decoder.layers.self_attention.q_layernorm.weight",
        "decoder.layers.self_attention.k_layernorm.weight",
        "decoder.layers.self_attention.linear_proj.weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.mlp.linear_fc1.weight",
        "decoder.layers.mlp.linear_fc2.weight",
    }
    local = build_model(get_preset("sdar-tiny"), use_te=False)
    got = {k for k in keys(local) if not k.endswith("_extra_state")}
    assert got == want
    llada = {k for k in keys(build_model(get_preset("llada-tiny"))) if not k.endswith("_extra_state")}
    assert llada == want - {
        "decoder.layers.self_attention.q_layernorm.weight",
        "decoder.layers.self_attention.k_layernorm.weight",
    }
    if te_available():  # GPU machines: the TE spec must produce the same checkpoint keys
        assert keys(build_model(get_preset("sdar-tiny"), use_te=True)) == keys(local)


def test_local_linears_use_a_plain_matmul_with_megatrons_gradients(megatron_tp1):
    """The local spec's linears (models/linear.py) give Megatron's linear function's
    outputs and gradients, and defer to it whenever a collective or fusion is in play."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from stabledrl_mcore.models.linear import (
        AutogradColumnParallelLinear,
        AutogradRowParallelLinear,
        _plain_matmul_applies,
    )
    from stabledrl_mcore.models.specs import te_available

    model = _model("sdar-tiny")
    layer = model.decoder.layers[0]
    if not te_available():  # the TE spec keeps Transformer Engine's own linears
        assert isinstance(layer.self_attention.linear_qkv, AutogradColumnParallelLinear)
        assert isinstance(layer.mlp.linear_fc2, AutogradRowParallelLinear)
    assert isinstance(model.output_layer, AutogradColumnParallelLinear)
    config = model.config
    for plain_cls, ours_cls in (
        (ColumnParallelLinear, AutogradColumnParallelLinear),
        (RowParallelLinear, AutogradRowParallelLinear),
    ):
        kwargs = dict(config=config, init_method=config.init_method, bias=False)
        kwargs.update(gather_output=False) if plain_cls is ColumnParallelLinear else kwargs.update(
            input_is_parallel=True, skip_bias_add=True
        )  # as in the layer
        reference, ours = plain_cls(64, 48, **kwargs), ours_cls(64, 48, **kwargs)
        ours.load_state_dict(reference.state_dict())
        x = torch.randn(5, 3, 64)
        grads, graphs = [], []
        for module in (reference, ours):
            xi = x.clone().requires_grad_(True)
            out = module(xi)[0]
            graphs.append(_graph_node_names(out.grad_fn))
            out.pow(2).sum().backward()
            grads.append((out.detach(), xi.grad, module.weight.grad))
        assert any(n.startswith("LinearWithGradAccumulation") for n in graphs[0])
        assert not any(n.startswith("LinearWithGradAccumulation") for n in graphs[1])
        # TP=1: no identity tensor-parallel region functions around our matmul either
        region = "_CopyToModelParallelRegion" if plain_cls is ColumnParallelLinear else "_ReduceFromModelParallelRegion"
        assert any(n.startswith(region) for n in graphs[0])
        assert not any(n.startswith(region) for n in graphs[1]) and ours.explicit_expert_comm
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert _plain_matmul_applies(
        dict(
            allreduce_dgrad=False, sequence_parallel=False, gradient_accumulation_fusion=False, grad_output_buffer=None
        )
    )
    for key, value in (
        ("allreduce_dgrad", True),
        ("sequence_parallel", True),
        ("gradient_accumulation_fusion", True),
        ("grad_output_buffer", []),
    ):
        assert not _plain_matmul_applies({key: value})


@pytest.mark.parametrize("name", ["llada-tiny", "sdar-tiny"])
def test_local_spec_matches_the_stock_megatron_layer_bitwise(megatron_tp1, name):
    """The local spec (its linears, and its rotation: cos/sin once per forward,
    heads-major output) gives the stock Megatron local layer's results (Megatron's
    linears, ``SelfAttention`` and ``apply_rotary_pos_emb``): logits bit for bit, on the
    staircase layout and with a different position row per sample; gradients bit for
    bit too, except SDAR's q/k-norm weights, whose gradient sums over a differently
    laid-out incoming gradient (same values up to fp32 summation order). The MLP runs
    our SwiGLU activation module on fc1's fused output here (fc1's gate/up split is
    tested against it separately: a different BLAS blocking, not bitwise)."""
    from megatron.core.transformer.attention import SelfAttention

    from stabledrl_mcore.models.attention import HeadsMajorRotarySelfAttention
    from stabledrl_mcore.models.gated_mlp import SwiGLU
    from stabledrl_mcore.models.rope import rotary_angles, rotary_cos_sin

    cfg = get_preset(name, init_std=0.2)
    ours = build_model(cfg, use_te=False)  # the local spec, also where TE is installed
    assert isinstance(ours.decoder.layers[0].self_attention, HeadsMajorRotarySelfAttention)
    reference = build_model(cfg, use_te=False, stock_local=True)
    assert type(reference.decoder.layers[0].self_attention) is SelfAttention  # rotation from angles
    assert isinstance(ours.decoder.layers[0].mlp.activation_func, SwiGLU)
    assert reference.decoder.layers[0].mlp.activation_func is torch.nn.functional.silu
    assert set(ours.state_dict()) == set(reference.state_dict())
    for layer in ours.decoder.layers:
        layer.mlp.linear_fc1.split_gate_up = False
    reference.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 200, (3, 24), generator=torch.Generator().manual_seed(1))
    shifted = torch.arange(24)[None] + torch.tensor([[0], [5], [11]])
    # The last case hands our attention Megatron's angles, as a stock GPTModel would.
    for position_ids, mask, rotary in (
        (staircase_position_ids(12), AttentionLayout.staircase(4), rotary_cos_sin),
        (shifted, None, rotary_cos_sin),
        (shifted, None, rotary_angles),
    ):
        ours._rotary = rotary
        results = []
        for model in (reference, ours):
            model.zero_grad(set_to_none=True)
            logits = model(ids, position_ids, mask)
            logits.float().pow(2).mean().backward()
            results.append([("logits", logits.detach())] + [(n, p.grad) for n, p in model.named_parameters()])
        for (label, a), (_, b) in zip(*results):
            if "_layernorm." in label:  # q_layernorm / k_layernorm weights (SDAR)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
            else:
                assert torch.equal(a, b), label


@pytest.mark.parametrize("name", ["llada-tiny", "sdar-tiny"])
def test_fc1_gate_up_split_matches_the_fused_fc1(megatron_tp1, name):
    """fc1 hands the SwiGLU module gate and up as two matmuls on its weight's row
    blocks (the local spec, TP=1): logits and every gradient match fc1's fused output
    chunked in two (Megatron's layout) to fp32 rounding; the parameter is the same."""
    from stabledrl_mcore.models.gated_mlp import GateUpColumnParallelLinear

    cfg = get_preset(name, init_std=0.2)
    split = build_model(cfg, use_te=False)  # the local spec, also where TE is installed
    fused = build_model(cfg, use_te=False)
    fused.load_state_dict(split.state_dict())
    fc1 = split.decoder.layers[0].mlp.linear_fc1
    assert isinstance(fc1, GateUpColumnParallelLinear) and split.config.use_te_activation_func
    x = torch.randn(5, 2, cfg.hidden_size)
    gate, up = fc1(x)[0]
    fc1.split_gate_up = False
    whole = fc1(x)[0]
    fc1.split_gate_up = True
    torch.testing.assert_close(torch.cat((gate, up), dim=-1), whole, rtol=1e-6, atol=1e-6)
    for layer in fused.decoder.layers:
        layer.mlp.linear_fc1.split_gate_up = False
    ids = torch.randint(0, 200, (3, 24), generator=torch.Generator().manual_seed(2))
    results = []
    for model in (fused, split):
        logits = model(ids)
        logits.float().pow(2).mean().backward()
        results.append([logits.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_swiglu_module_only_with_megatrons_plain_or_fused_swiglu(monkeypatch):
    """``with_module_activation`` turns the module on only where Megatron's plain or fused
    bias-free SwiGLU would run; the module accepts fc1's pair or fused output; with the fused
    kernel on it runs it when autograd records (training) and the eager product without."""
    from stabledrl_mcore.models.gated_mlp import SwiGLU, fused_swiglu, with_module_activation
    from stabledrl_mcore.models.presets import to_transformer_config
    from stabledrl_mcore.models.specs import dllm_layer_spec

    def config(**overrides):
        overrides.setdefault("bias_activation_fusion", False)
        return to_transformer_config(get_preset("llada-tiny"), {"tensor_model_parallel_size": 1}, **overrides)

    local, stock = dllm_layer_spec(use_te=False), dllm_layer_spec(use_te=False, stock_local=True)
    assert with_module_activation(config(), local).use_te_activation_func
    assert not with_module_activation(config(), stock).use_te_activation_func
    fused_config = with_module_activation(config(bias_activation_fusion=True), local)
    assert fused_config.use_te_activation_func and not fused_config.bias_activation_fusion
    assert fused_swiglu(fused_config) and not fused_swiglu(with_module_activation(config(), local))
    assert not with_module_activation(config(glu_linear_offset=1.0), local).use_te_activation_func
    assert not with_module_activation(config(add_bias_linear=True), local).use_te_activation_func
    y = torch.randn(3, 2, 10)
    gate, up = y.chunk(2, dim=-1)
    module = SwiGLU(config())
    expected = torch.nn.functional.silu(gate) * up
    assert torch.equal(module(y), expected) and torch.equal(module((gate, up)), expected)

    from megatron.core.fusions import fused_bias_swiglu

    fused_calls = []
    monkeypatch.setattr(
        fused_bias_swiglu, "bias_swiglu_impl", lambda x, bias, *a: fused_calls.append(x.shape) or expected
    )
    fused = SwiGLU(fused_config)
    assert fused(y) is expected and fused_calls == [y.shape]  # training: Megatron's fused kernel
    with torch.no_grad():
        assert torch.equal(fused(y), expected) and len(fused_calls) == 1  # no autograd: eager


def _graph_node_names(fn, seen=None):
    """Class names of every autograd node reachable from ``fn``."""
    seen = set() if seen is None else seen
    if fn is None or fn in seen:
        return set()
    seen.add(fn)
    names = {type(fn).__name__}
    for child, _ in fn.next_functions:
        names |= _graph_node_names(child, seen)
    return names


def test_staircase_mask_mod_compiles_with_inductor():
    """Regression: the staircase predicate compared booleans with ``==``, which inductor cannot
    lower, so ``create_block_mask(..., _compile=True)`` (the CUDA path) failed on it."""
    from torch.nn.attention.flex_attention import create_block_mask

    mod = AttentionLayout.staircase(4).mask_mod(48, 48)
    compiled = create_block_mask(mod, None, None, 48, 48, device="cpu", BLOCK_SIZE=8, _compile=True)
    eager = create_block_mask(mod, None, None, 48, 48, device="cpu", BLOCK_SIZE=8)
    assert torch.equal(compiled.to_dense(), eager.to_dense())
    assert torch.equal(eager.to_dense()[0, 0].bool(), ~staircase_mask(24, 4)[0, 0].reshape(6, 8, 6, 8).all(-1).all(1))
