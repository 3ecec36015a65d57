"""SDAR-MoE (SDAR-30B-A3B, the Qwen3-MoE layout) HF <-> Megatron conversion.

One tiny upstream checkpoint (``hf_fixtures``: per-expert safetensors keys, Qwen3-MoE config keys
under ``model_type`` ``sdar_moe``; norms perturbed, router weights large so the top-2 choices
differ from token to token) converted once with ``--tp 2 --ep 2``. Checks:

- config.json fields in and out (``router_aux_loss_coef`` not imported), refusals by name;
- logits of the converted checkpoint (single process) == transformers' ``Qwen3MoeForCausalLM``
  loaded from the same directory with an additive 4-D block-causal mask;
- EP=2 x TP=2 (4 gloo ranks): the checkpoint loads into ``build_model`` at that layout (equal to
  the HF directory loaded straight into it), its logits match the reference, and the model saved
  from that layout converts back to the source tensors bit for bit.
"""

import argparse
import json
import os

import pytest
import torch
from hf_fixtures import load_all, write_hf_checkpoint

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.cli import convert as convert_cmd
from stabledrl_mcore.convert import convert as conv
from stabledrl_mcore.convert import hf_config as hfc
from stabledrl_mcore.parallel.launch import spawn

TOL = 1e-4
QWEN3_MOE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "tie_word_embeddings",
    "attention_bias",
)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(root, src, ckpt, ids): the fixture converted at the suggested layout TP=2 x EP=2."""
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    torch.set_num_threads(1)
    root = str(tmp_path_factory.mktemp("moe"))
    src = write_hf_checkpoint(os.path.join(root, "hf"), "sdar_moe", seed=7, shards=2)
    ckpt = conv.hf_to_mcore(src, os.path.join(root, "mcore"), model="sdar", tp=2, ep=2, progress=False)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    yield root, src, ckpt, ids
    bootstrap.destroy()
    cpu_compat.disable()


def qwen3_moe_reference(src):
    """transformers' ``Qwen3MoeForCausalLM`` on the upstream directory (config from its raw keys)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    raw = json.load(open(os.path.join(src, "config.json")))
    config = Qwen3MoeConfig(**{k: raw[k] for k in QWEN3_MOE_KEYS}, router_aux_loss_coef=0.0)
    model, info = Qwen3MoeForCausalLM.from_pretrained(src, config=config, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # from_pretrained leaves the RoPE buffers unset in a process running torch.distributed + cpu_compat
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval(), raw["block_size"]


def reference_logits(src, ids):
    from test_models_hf import hf_logits

    from stabledrl_mcore.models import block_causal_mask

    model, block = qwen3_moe_reference(src)
    with torch.no_grad():
        router = model.model.layers[0].mlp.gate(model.model.embed_tokens(ids).flatten(0, 1))
    chosen = {tuple(sorted(row.tolist())) for row in router[2]}
    assert len(chosen) >= 3, f"routing is degenerate: expert pairs {chosen}"
    return hf_logits(model, ids, block_causal_mask(ids.shape[1], block))


# ------------------------------------------------------------------ config.json
def test_config_fields_and_refusals(moe, capsys):
    from stabledrl_mcore.models import get_preset

    _, src, ckpt, _ = moe
    raw = json.load(open(os.path.join(src, "config.json")))
    cfg = hfc.hf_to_dllm_config(raw)
    assert (cfg.arch, cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_norm_topk_prob) == (
        "sdar",
        4,
        2,
        24,
        True,
    )
    assert cfg.moe_aux_loss_coeff == 0.0 and raw["router_aux_loss_coef"] == 0.001  # not imported
    for arch_name in ("SDARMoeForCausalLM", "Qwen3MoeForCausalLM"):  # no model_type: the class says it
        alone = {k: v for k, v in raw.items() if k != "model_type"}
        assert hfc.hf_to_dllm_config(dict(alone, architectures=[arch_name])) == cfg
    assert hfc.hf_to_dllm_config(dict(raw, model_type="qwen3_moe")) == cfg
    assert not hfc.hf_to_dllm_config(dict(raw, norm_topk_prob=None)).moe_norm_topk_prob  # Qwen3MoeConfig default
    for key, value in (("mlp_only_layers", [1]), ("decoder_sparse_step", 2), ("shared_expert_intermediate_size", 64)):
        with pytest.raises(ConversionError, match=f"'{key}' = .* not supported: .*decoder_sparse_step 1"):
            hfc.hf_to_dllm_config(dict(raw, **{key: value}))
    with pytest.raises(ConversionError, match="'moe_intermediate_size'"):
        hfc.hf_to_dllm_config({k: v for k, v in raw.items() if k != "moe_intermediate_size"})
    # written back: into the base unchanged, and from the template as SDARMoeForCausalLM
    assert hfc.dllm_to_hf_config(cfg, raw) == raw
    fresh = hfc.dllm_to_hf_config(get_preset("sdar-30b-a3b"))
    assert fresh["architectures"] == ["SDARMoeForCausalLM"] and fresh["model_type"] == "sdar_moe"
    assert (fresh["num_experts"], fresh["num_experts_per_tok"], fresh["moe_intermediate_size"]) == (128, 8, 768)
    assert hfc.hf_to_dllm_config(fresh) == get_preset("sdar-30b-a3b")
    marker = json.load(open(os.path.join(ckpt, "stabledrl_model.json")))
    assert marker["suggested_layout"] == {"tensor_parallel": 2, "pipeline_parallel": 1, "expert_parallel": 2}
    with pytest.raises(ConversionError, match=r"num_experts \(4\) is not divisible by --ep 3"):
        conv.check_layout(cfg, 1, 1, 3)
    with pytest.raises(ConversionError, match="--ep 2 needs a mixture-of-experts model"):
        conv.check_layout(get_preset("sdar-tiny"), 1, 1, 2)
    with pytest.raises(ConversionError, match=r"--model sdar-moe-tiny: .*moe_ffn_hidden_size 24 \(preset 48\)"):
        conv.check_preset_shape(cfg, "sdar-moe-tiny")
    parser = argparse.ArgumentParser()
    convert_cmd.add_convert_arguments(parser)
    args = parser.parse_args(
        ["hf-to-mcore", "--model", "sdar", "--hf-dir", src, "--out", src + "_ep3", "--ep", "3", "--no-progress"]
    )
    assert convert_cmd.run_convert(args) == 2 and not os.path.exists(src + "_ep3")  # refused before writing
    assert "num_experts (4) is not divisible by --ep 3" in capsys.readouterr().err


def test_checkpoint_layout(moe):
    from megatron.core import dist_checkpointing

    _, _, ckpt, _ = moe
    meta = dist_checkpointing.load_tensors_metadata(ckpt)
    assert tuple(meta["decoder.layers.mlp.router.weight"].global_shape) == (2, 4, 32)
    assert tuple(meta["decoder.layers.mlp.experts.experts.linear_fc1.weight"].global_shape) == (2, 4, 48, 32)
    assert tuple(meta["decoder.layers.mlp.experts.experts.linear_fc2.weight"].global_shape) == (2, 4, 32, 24)
    assert not [
        k
        for k in meta
        if k.startswith("decoder.layers.mlp.linear_fc") and k.endswith(".weight") and "layer_norm" not in k
    ]  # no dense MLP


def test_full_size_key_set():
    """The sdar-30b-a3b preset expects the released checkpoint's 18867 tensors (Qwen3-30B-A3B layout)."""
    from stabledrl_mcore.convert.engine import MappingEngine
    from stabledrl_mcore.convert.mappings import table_for
    from stabledrl_mcore.models import get_preset

    cfg = get_preset("sdar-30b-a3b")
    expected = MappingEngine(table_for("sdar", cfg), cfg).expected_hf()
    assert len(expected) == 18867
    assert expected["model.layers.0.self_attn.q_proj.weight"] == (4096, 2048)
    assert expected["model.layers.0.self_attn.k_proj.weight"] == (512, 2048)
    assert expected["model.layers.47.mlp.gate.weight"] == (128, 2048)
    assert expected["model.layers.47.mlp.experts.127.up_proj.weight"] == (768, 2048)
    assert expected["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)


# ------------------------------------------------------------------ logits, one process
def test_logits_match_qwen3_moe(moe):
    from stabledrl_mcore import load_model
    from stabledrl_mcore.models import block_causal_mask

    _, src, ckpt, ids = moe
    want = reference_logits(src, ids)
    assert want.abs().max() > 0.5
    model = load_model(ckpt)
    with torch.no_grad():
        got, explicit = model(ids), model(ids, attention_mask=block_causal_mask(ids.shape[1], 4))
    assert (got - want).abs().max().item() < TOL and (explicit - want).abs().max().item() < TOL
    direct = load_model(src)  # the HF directory straight into the model (load_hf_weights)
    with torch.no_grad():
        assert torch.equal(direct(ids), got)


# ------------------------------------------------------------------ EP=2 x TP=2
def _ep2_tp2_worker(root, src, ckpt):
    from megatron.core import parallel_state as ps

    from stabledrl_mcore.checkpoint.info import read_checkpoint_info
    from stabledrl_mcore.checkpoint.mcore_io import load_model_weights, save_model_checkpoint
    from stabledrl_mcore.convert.loader import load_hf_weights
    from stabledrl_mcore.models import AttentionLayout, build_model
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(2, 1, seed=0, expert_parallel=2)
    info = read_checkpoint_info(ckpt)
    model = build_model(info.config).eval()
    assert len(model.decoder.layers[0].mlp.experts.local_experts) == 2
    load_model_weights(model, ckpt)
    direct = build_model(info.config)
    load_hf_weights(direct, src)  # this rank's experts and TP slices straight from the HF directory
    for (key, a), (_, b) in zip(model.state_dict().items(), direct.state_dict().items()):
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b), key
    with torch.no_grad():
        logits = model(
            torch.load(os.path.join(root, "ids.pt")), None, AttentionLayout.block_causal(info.config.block_size)
        )
    torch.save(logits, os.path.join(root, f"logits_rank{torch.distributed.get_rank()}.pt"))
    assert ps.get_expert_model_parallel_world_size() == 2
    save_model_checkpoint(model, os.path.join(root, "resaved"), hf_assets=os.path.join(ckpt, "hf"))


@pytest.mark.multiprocess
def test_ep2_tp2_load_forward_save_and_back(moe):
    root, src, ckpt, ids = moe
    torch.save(ids, os.path.join(root, "ids.pt"))
    spawn(_ep2_tp2_worker, 4, (root, src, ckpt), timeout=300)

    want = reference_logits(src, ids)
    for rank in range(4):
        got = torch.load(os.path.join(root, f"logits_rank{rank}.pt"))
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < TOL, f"rank {rank}"
    resaved = os.path.join(root, "resaved")
    marker = json.load(open(os.path.join(resaved, "stabledrl_model.json")))
    assert marker["suggested_layout"] == {"tensor_parallel": 2, "pipeline_parallel": 1, "expert_parallel": 2}
    back = conv.mcore_to_hf(resaved, os.path.join(root, "back"), max_shard_bytes=40_000, progress=False)
    want_t, got_t = load_all(src), load_all(back)
    assert sorted(got_t) == sorted(want_t)
    for key in want_t:
        assert got_t[key].dtype == want_t[key].dtype and torch.equal(got_t[key], want_t[key]), key
    raw_src = json.load(open(os.path.join(src, "config.json")))
    raw_back = json.load(open(os.path.join(back, "config.json")))
    assert {k: v for k, v in raw_back.items() if k != "torch_dtype"} == {
        k: v for k, v in raw_src.items() if k != "torch_dtype"
    }
    assert {"modeling_sdar_moe.py", "configuration_sdar_moe.py", "tokenizer.json"} <= set(os.listdir(back))


def test_docs_tables_are_generated_from_mappings():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "tools", "mapping_tables.py")
    spec = importlib.util.spec_from_file_location("mapping_tables", path)
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    assert tables.stale_tables(os.path.join(os.path.dirname(__file__), "..", "docs", "models.md")) == []
    assert (
        "`decoder.layers.{i}.mlp.router.weight` | `model.layers.{i}.mlp.gate.weight`" in tables.all_tables()["sdar-moe"]
    )


def test_expert_names():
    from stabledrl_mcore.convert.mappings import canonical_megatron_name, global_expert_name

    local = "decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight"
    assert canonical_megatron_name("decoder.layers.3.mlp.experts.linear_fc2.weight1") == local  # TE grouped GEMM
    assert global_expert_name(local, 2, 4) == "decoder.layers.3.mlp.experts.local_experts.9.linear_fc2.weight"
    assert global_expert_name("decoder.layers.3.mlp.router.weight", 2, 4) == "decoder.layers.3.mlp.router.weight"
