"""The mixture-of-experts backbone in one process: presets, Megatron's routing as Qwen3-MoE routes,
router statistics, configuration refusals, and rollout-vs-training routing consistency (the same
tokens go to the same experts when the sampler decodes a block against its KV cache and when the
staircase likelihood scores that block's noisy state)."""

from __future__ import annotations

import pytest
import torch
from test_models_hf import megatron_tp1  # noqa: F401  (module-scoped Megatron TP=1 state)

from stabledrl_mcore.models import build_model, get_preset
from stabledrl_mcore.models.moe import RoutingRecorder
from stabledrl_mcore.models.presets import ModelConfigError, moe_transformer_config


def _moe_model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = build_model(get_preset("sdar-moe-tiny", init_std=0.2, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "router" in name:  # decisive routing, so a different hidden state shows as another expert
                param.copy_(torch.randn(param.shape, generator=gen))
    return model


def test_moe_presets_have_the_qwen3_moe_shape():
    big = get_preset("sdar-30b-a3b")
    assert (big.num_layers, big.hidden_size, big.num_query_groups, big.kv_channels) == (48, 2048, 4, 128)
    assert (big.num_experts, big.moe_ffn_hidden_size, big.moe_router_topk, big.block_size) == (128, 768, 8, 4)
    h, f, e, k, L, v = 2048, 768, 128, 8, 48, 151936
    attn = h * 128 * (32 + 2 * 4) + 32 * 128 * h + 2 * 128
    per_layer = attn + 3 * h * f * e + e * h + 2 * h  # attention, experts, router, two norms
    assert big.num_parameters() == L * per_layer + 2 * v * h + h
    assert big.num_active_parameters() == big.num_parameters() - L * (e - k) * 3 * h * f
    assert round(big.num_parameters() / 1e9, 1) == 30.5 and round(big.num_active_parameters() / 1e9, 1) == 3.4
    assert get_preset("sdar-tiny").num_active_parameters() == get_preset("sdar-tiny").num_parameters()


def test_moe_config_is_validated_by_name():
    with pytest.raises(ModelConfigError, match="moe_ffn_hidden_size"):
        get_preset("sdar-moe-tiny", moe_ffn_hidden_size=None)
    with pytest.raises(ModelConfigError, match="moe_router_topk"):
        get_preset("sdar-moe-tiny", moe_router_topk=5)
    with pytest.raises(ModelConfigError, match="num_experts is None"):
        get_preset("sdar-tiny", moe_ffn_hidden_size=32)
    routing = moe_transformer_config(get_preset("sdar-moe-tiny"))
    assert routing["moe_router_load_balancing_type"] == "none" and routing["moe_aux_loss_coeff"] == 0.0
    assert not routing["moe_router_pre_softmax"] and routing["moe_router_dtype"] == "fp32"
    on = moe_transformer_config(get_preset("sdar-moe-tiny", moe_aux_loss_coeff=1e-3, moe_z_loss_coeff=1e-4))
    assert (on["moe_router_load_balancing_type"], on["moe_aux_loss_coeff"], on["moe_z_loss_coeff"]) == (
        "aux_loss",
        1e-3,
        1e-4,
    )


def test_moe_layer_routes_as_qwen3_moe(megatron_tp1):  # noqa: F811
    """One MoE layer's output re-derived from its weights: softmax over the router logits, top-k,
    renormalised (Qwen3-MoE ``norm_topk_prob``), each expert ``W2 (silu(W_gate x) * W_up x)``."""
    model = _moe_model()
    layer = model.decoder.layers[0].mlp
    x = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got, _ = layer(x)
        tokens = x.reshape(-1, 64)
        probs = torch.softmax(tokens @ layer.router.weight.T, dim=-1)
        top, idx = probs.topk(2, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        want = torch.zeros_like(tokens)
        for t in range(tokens.shape[0]):
            for weight, e in zip(top[t], idx[t]):
                expert = layer.experts.local_experts[int(e)]
                gate, up = (tokens[t] @ expert.linear_fc1.weight.T).chunk(2)
                want[t] += weight * (torch.nn.functional.silu(gate) * up) @ expert.linear_fc2.weight.T
    assert torch.allclose(got.reshape(-1, 64), want, atol=1e-5)


def test_router_statistics_count_every_routed_slot(megatron_tp1):  # noqa: F811
    model = _moe_model()
    ids = torch.randint(0, 250, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), RoutingRecorder(model, keep_maps=True) as rec:
        model(ids)
    assert rec.counts.shape == (2, 4) and rec.counts.sum().item() == 2 * 30 * 2  # layers x tokens x top-k
    summary = rec.summary()
    loads = rec.counts / rec.counts.sum(-1, keepdim=True) * 4
    assert summary["router_load_max"] == pytest.approx(float(loads.max()))
    assert summary["router_dropped_frac"] == 0.0
    capped = _moe_model(moe_capacity_factor=0.5)
    with torch.no_grad(), RoutingRecorder(capped) as rec:
        capped(ids)
    assert 0.0 < rec.summary()["router_dropped_frac"] < 1.0  # tokens over capacity are dropped and counted


def test_rollout_and_likelihood_route_the_same_tokens_to_the_same_experts(megatron_tp1):  # noqa: F811
    """Every decoding forward of the KV-cached block sampler and the staircase likelihood forward of
    the same noisy block state (clean earlier blocks, the block as the sampler saw it) give every
    token of the block the same experts in every layer."""
    from stabledrl_mcore.diffusion.sampling_sdar import generate_sdar
    from stabledrl_mcore.diffusion.staircase import staircase_forward_logp

    model, bs, mask_id = _moe_model(), 4, 255
    prompt = torch.randint(3, 250, (1, 8), generator=torch.Generator().manual_seed(2))
    states = []

    class Recording(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

        def forward(self, ids, **kwargs):
            slots = kwargs.get("cache_slots")  # a decoding step's cache slots are its positions
            start = int(slots[0] if slots is not None else kwargs["position_ids"][0, 0])
            states.append((ids.clone(), start, slots is None or ids.shape[1] > bs))  # a prefill or a store step
            return self.inner(ids, **kwargs)

    with torch.no_grad(), RoutingRecorder(model, keep_maps=True) as sampled:
        final = generate_sdar(Recording(), prompt, gen_length=8, steps=4, temperature=0.0)
    # after the prefill (states[0]): one forward per step; a block's first step also stores the
    # finished block before it (2 blocks in, the decoded block last)
    assert states[0][2] and all(ids.shape[1] == (2 * bs if store else bs) for ids, _, store in states[1:])
    decoding = [(j, ids[:, -bs:], start + ids.shape[1] - bs) for j, (ids, start, _) in enumerate(states) if j]
    assert len(decoding) == 8  # 2 blocks x 4 steps (one token each)
    n, compared = final.shape[1], 0
    for j, block_state, start in decoding:
        noisy = final.clone()
        noisy[:, start : start + bs] = block_state
        with torch.no_grad(), RoutingRecorder(model, keep_maps=True) as scored:
            staircase_forward_logp(model, bs)(noisy, final, noisy == mask_id)
        for layer in range(2):
            in_sampler = sampled.maps[layer][j][-bs:]  # [4 tokens, experts]
            in_likelihood = scored.maps[layer][0][start : start + bs]  # the noisy copy of the block
            assert torch.equal(in_sampler, in_likelihood), f"step {j} layer {layer}: routing differs"
            compared += 1
        assert n >= start + bs
    assert compared == 16
    # the comparison can fail: the same block after a different prefix routes differently
    other = final.clone()
    other[:, :8] = torch.randint(3, 250, (1, 8), generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), RoutingRecorder(model, keep_maps=True) as shifted:
        staircase_forward_logp(model, bs)(other, other, other == mask_id)
    j, block_state, start = decoding[-1]
    assert not all(
        torch.equal(sampled.maps[layer][j], shifted.maps[layer][0][start : start + bs]) for layer in range(2)
    )


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.expert_parallel=2"], "need a mixture-of-experts model (num_experts); this one is dense"),
        (
            ["model.preset=sdar-moe-tiny", "parallel.expert_parallel=3"],
            "num_experts (4) is not divisible by expert_parallel (3)",
        ),
        (
            ["model.preset=sdar-moe-tiny", "parallel.expert_parallel=2", "parallel.pipeline_parallel=2"],
            "expert parallelism runs with PP=1",
        ),
        (
            ["model.preset=sdar-moe-tiny", "parallel.expert_parallel=2", "parallel.retain_update_graph=true"],
            "parallel.retain_update_graph=true with parallel.expert_parallel=2",
        ),
        (
            ["model.preset=sdar-moe-tiny", "parallel.pipeline_parallel=2", "model.overrides.moe_aux_loss_coeff=0.01"],
            "moe_aux_loss_coeff / moe_z_loss_coeff > 0 with parallel.pipeline_parallel=2",
        ),
        (
            ["model.preset=sdar-moe-tiny", "parallel.expert_parallel=4", "--nproc", "2"],
            "world size 2 / pipeline_parallel 1 is not divisible by expert_tensor_parallel x expert_parallel = 1 x 4",
        ),
    ],
)
def test_expert_layouts_the_run_cannot_honour_are_refused_by_name(capsys, overrides, expected):
    from test_preflight import CONFIG, _refused

    line = _refused(capsys, "train", "--config", CONFIG, "algo.likelihood=staircase", *overrides, "--print-config")
    assert expected in line, line


def test_router_losses_are_averaged_over_the_update_and_absent_from_lockstep_dummies(megatron_tp1):  # noqa: F811
    """With ``moe_aux_loss_coeff`` the router gets the load-balancing gradient, weighted by
    :func:`router_loss_scale` (the update sets 1 / forwards); the lockstep's dummy forward and
    backward add no gradient at all, router loss included."""
    from stabledrl_mcore.engine.expert import LockstepModel
    from stabledrl_mcore.models.moe import router_loss_scale

    model = _moe_model(moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.5).train()
    ids = torch.randint(0, 250, (2, 6), generator=torch.Generator().manual_seed(3))
    router = model.decoder.layers[0].mlp.router.weight

    def router_grad(scale):
        model.zero_grad()
        with router_loss_scale(scale):
            (model(ids)[..., 0].sum() * 0.0).backward()  # only the router losses reach the weights
        return router.grad.clone()

    full, half = router_grad(1.0), router_grad(0.5)
    assert full.abs().sum() > 0 and torch.allclose(half, full / 2, atol=1e-7)
    model.zero_grad()
    LockstepModel(model, group=None, backward=True)._dummy_round()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
