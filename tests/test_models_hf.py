"""Parity of the Megatron backbones with independent ``transformers`` implementations.

LLaDA == ``LlamaForCausalLM`` run with an all-zero additive 4-D mask (non-causal);
SDAR == ``Qwen3ForCausalLM`` with an additive 4-D block-causal (or staircase) mask
(each reproduces the upstream modeling code exactly). transformers 5.x
returns a 4-D mask unchanged (``masking_utils._preprocess_mask_arguments``).
Weights are random (seeded, norms perturbed away from 1) and copied with the
mapping table below; TP slicing follows Megatron's layout. The TP=2 / PP=2
runs live in ``test_models_parallel.py`` and reuse these helpers.
"""

from __future__ import annotations

import pytest
import torch

TOL = 1e-4


def tiny_cfg(arch: str, **overrides):
    """A small config with GQA for SDAR (4 heads, 2 groups) so TP=2 splits whole groups."""
    from stabledrl_mcore.models import get_preset

    base = dict(
        vocab_size=96,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=48,
        mask_token_id=95,
        max_position_embeddings=64,
    )
    if arch == "llada":
        return get_preset("llada-tiny", num_query_groups=4, **base, **overrides)
    return get_preset("sdar-tiny", num_query_groups=2, head_dim=16, block_size=4, **base, **overrides)


def make_hf_model(cfg, seed: int = 0):
    """Random ``LlamaForCausalLM`` (LLaDA) or ``Qwen3ForCausalLM`` (SDAR) of the same shape."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.kv_channels,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=False,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=0.1,
        attention_bias=False,
    )
    torch.manual_seed(seed)
    if cfg.arch == "llada":
        model = LlamaForCausalLM(LlamaConfig(mlp_bias=False, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(use_sliding_window=False, **common))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # RMSNorm weights start at 1: perturb so a wrong mapping shows
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return model.float().eval()


def hf_to_megatron(
    hf_sd,
    cfg,
    *,
    tp_size=1,
    tp_rank=0,
    layer_offset=0,
    num_local_layers=None,
    pre_process=True,
    post_process=True,
    padded_vocab=None,
):
    """Mapping table HF -> Megatron names for one (TP rank, PP stage); returns a state dict."""
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    per_group = heads // groups

    def vocab_rows(w):
        if padded_vocab and padded_vocab > w.shape[0]:
            w = torch.cat([w, w.new_zeros(padded_vocab - w.shape[0], w.shape[1])])
        return w.chunk(tp_size, 0)[tp_rank]

    out = {}
    if pre_process:
        out["embedding.word_embeddings.weight"] = vocab_rows(hf_sd["model.embed_tokens.weight"])
    if post_process:
        out["decoder.final_layernorm.weight"] = hf_sd["model.norm.weight"]
        out["output_layer.weight"] = vocab_rows(hf_sd["lm_head.weight"])
    n_local = cfg.num_layers if num_local_layers is None else num_local_layers
    for local in range(n_local):
        src, dst = f"model.layers.{layer_offset + local}.", f"decoder.layers.{local}."
        q = hf_sd[src + "self_attn.q_proj.weight"].view(groups, per_group * d, -1)
        k = hf_sd[src + "self_attn.k_proj.weight"].view(groups, d, -1)
        v = hf_sd[src + "self_attn.v_proj.weight"].view(groups, d, -1)
        qkv = torch.cat([q, k, v], 1).chunk(tp_size, 0)[tp_rank]  # whole groups per rank
        out[dst + "self_attention.linear_qkv.weight"] = qkv.reshape(-1, cfg.hidden_size)
        out[dst + "self_attention.linear_proj.weight"] = hf_sd[src + "self_attn.o_proj.weight"].chunk(tp_size, 1)[
            tp_rank
        ]
        out[dst + "input_layernorm.weight"] = hf_sd[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf_sd[src + "post_attention_layernorm.weight"]
        gate = hf_sd[src + "mlp.gate_proj.weight"].chunk(tp_size, 0)[tp_rank]
        up = hf_sd[src + "mlp.up_proj.weight"].chunk(tp_size, 0)[tp_rank]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[dst + "mlp.linear_fc2.weight"] = hf_sd[src + "mlp.down_proj.weight"].chunk(tp_size, 1)[tp_rank]
        if cfg.qk_layernorm:
            out[dst + "self_attention.q_layernorm.weight"] = hf_sd[src + "self_attn.q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf_sd[src + "self_attn.k_norm.weight"]
    return out


def load_into(model, state):
    """Copy a mapped state dict into a Megatron model; every parameter must be covered."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)


def additive(blocked: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Bool (True = blocked) -> the additive 0 / dtype-min mask transformers expects."""
    return torch.zeros(blocked.shape, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)


def hf_logits(hf_model, ids, blocked=None, position_ids=None):
    """Reference logits; ``blocked`` None = fully bidirectional (all-zero mask)."""
    b, s = ids.shape
    if blocked is None:
        blocked = torch.zeros(1, 1, s, s, dtype=torch.bool)
    mask = additive(blocked.expand(b, 1, s, s))
    with torch.no_grad():
        return hf_model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits


def reference_cases(cfg, seed=3):
    """(name, ids, position_ids, our mask argument, HF bool mask) tuples to compare."""
    from stabledrl_mcore.models import AttentionLayout, block_causal_mask, staircase_mask, staircase_position_ids

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen)
    # per-row position ids [B, S]; row 1 is not a shift of row 0, so rotation errors show
    rows = torch.stack([torch.arange(12), torch.randperm(40, generator=gen)[:12]])
    if cfg.arch == "llada":
        return [("bidirectional", ids, None, None, None), ("bidirectional_per_row_positions", ids, rows, None, None)]
    bs = cfg.block_size
    pair = torch.cat([ids, torch.randint(0, cfg.vocab_size, (2, 12), generator=gen)], 1)
    return [
        ("block_causal", ids, None, AttentionLayout.block_causal(bs), block_causal_mask(12, bs)),
        ("block_causal_bool", ids, None, block_causal_mask(12, bs), block_causal_mask(12, bs)),
        ("block_causal_per_row_positions", ids, rows, AttentionLayout.block_causal(bs), block_causal_mask(12, bs)),
        (
            "staircase",
            pair,
            staircase_position_ids(12).expand(2, -1),
            AttentionLayout.staircase(bs),
            staircase_mask(12, bs),
        ),
    ]


@pytest.fixture(scope="module")
def megatron_tp1():
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    torch.set_num_threads(1)
    bootstrap.initialize(1, 1, seed=0)
    yield
    bootstrap.destroy()
    cpu_compat.disable()


@pytest.mark.parametrize("arch", ["llada", "sdar"])
def test_matches_transformers_tp1(megatron_tp1, arch):
    from stabledrl_mcore.models import build_model

    cfg = tiny_cfg(arch)
    hf = make_hf_model(cfg)
    model = build_model(cfg).eval()
    load_into(model, hf_to_megatron(hf.state_dict(), cfg))
    for name, ids, pos, ours, theirs in reference_cases(cfg):
        with torch.no_grad():
            got = model(ids, pos, ours)
        want = hf_logits(hf, ids, theirs, pos)
        assert want.abs().max() > 0.5, "reference logits too small to be a meaningful check"
        diff = (got - want).abs().max().item()
        assert diff < TOL, f"{arch}/{name}: max |logit diff| = {diff}"
    # The same reference without the bidirectional mask is causal and must differ (sanity).
    if arch == "llada":
        ids = reference_cases(cfg)[0][1]
        with torch.no_grad():
            causal = hf(input_ids=ids).logits
            assert (model(ids) - causal).abs().max() > 1e-2


def test_vocab_padding_is_invisible(megatron_tp1):
    from stabledrl_mcore.models import build_model, vocab_parallel_log_probs

    cfg = tiny_cfg("llada", make_vocab_size_divisible_by=64)
    assert cfg.padded_vocab_size() == 128
    hf = make_hf_model(cfg)
    model = build_model(cfg).eval()
    load_into(model, hf_to_megatron(hf.state_dict(), cfg, padded_vocab=128))
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        full, shard = model(ids), model(ids, gather_output=False)
    assert full.shape[-1] == cfg.vocab_size and shard.shape[-1] == 128
    assert (full - hf_logits(hf, ids)).abs().max() < TOL
    targets = torch.randint(0, cfg.vocab_size, (2, 10))
    torch.testing.assert_close(
        vocab_parallel_log_probs(shard, targets), vocab_parallel_log_probs(full, targets), atol=1e-5, rtol=0
    )
