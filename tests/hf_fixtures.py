"""Tiny random checkpoints in the exact upstream formats of LLaDA, SDAR and SDAR-MoE (converter tests).

Written independently of the converter's mapping tables: names and shapes
follow the upstream modeling files (LLaDA: OLMo names under
``model.transformer.``; SDAR: Qwen3 names; SDAR-MoE: Qwen3-MoE names, one tensor per
expert as the released safetensors hold them), configs carry every key the
released ``config.json`` files have, and each directory gets a tiny fast
tokenizer (built offline with ``tokenizers``), ``tokenizer_config.json``,
``generation_config.json`` and stubs of the upstream ``*.py`` remote code.
Norm weights are perturbed away from 1 so that a misplaced norm shows in logits.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, Optional

import torch

LLADA_CONFIG = {
    "activation_type": "silu",
    "alibi": False,
    "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0,
    "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "auto_map": {
        "AutoConfig": "configuration_llada.LLaDAConfig",
        "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        "AutoModel": "modeling_llada.LLaDAModelLM",
    },
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": "llama",
    "d_model": 32,
    "embedding_dropout": 0.0,
    "embedding_size": 99,
    "eos_token_id": 95,
    "flash_attention": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "init_cutoff_factor": None,
    "init_device": "meta",
    "init_fn": "mitchell",
    "init_std": 0.02,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "mask_token_id": 96,
    "max_sequence_length": 64,
    "mlp_hidden_size": 48,
    "mlp_ratio": 4,
    "model_type": "llada",
    "multi_query_attention": None,
    "n_heads": 4,
    "n_kv_heads": 4,
    "n_layers": 4,
    "pad_token_id": 95,
    "precision": "amp_bf16",
    "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope": True,
    "rope_full_precision": True,
    "rope_theta": 500000.0,
    "scale_logits": False,
    "transformers_version": "4.46.3",
    "use_cache": False,
    "vocab_size": 97,
    "weight_tying": False,
}

SDAR_CONFIG = {
    "architectures": ["SDARForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_sdar.SDARConfig",
        "AutoModel": "modeling_sdar.SDARModel",
        "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
    },
    "block_size": 4,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 48,
    "mask_token_id": 127,
    "max_position_embeddings": 64,
    "max_window_layers": 4,
    "model_type": "sdar",
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.52.4",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 128,
}

# JetLM/SDAR-30B-A3B-Chat: Qwen3-MoE's config keys (Qwen/Qwen3-30B-A3B) under model_type sdar_moe.
SDAR_MOE_CONFIG = {
    **{k: v for k, v in SDAR_CONFIG.items() if k not in ("architectures", "auto_map", "model_type")},
    "architectures": ["SDARMoeForCausalLM"],
    "model_type": "sdar_moe",
    "auto_map": {
        "AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
        "AutoModel": "modeling_sdar_moe.SDARMoeModel",
        "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM",
    },
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 24,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "max_window_layers": 2,
}

STUBS = {
    "llada": {
        "modeling_llada.py": '"""Stand-in for upstream modeling_llada.py (tests check it is copied)."""\n',
        "configuration_llada.py": '"""Stand-in for upstream configuration_llada.py."""\n',
    },
    "sdar": {
        "modeling_sdar.py": '"""Stand-in for upstream modeling_sdar.py (tests check it is copied)."""\n',
        "configuration_sdar.py": '"""Stand-in for upstream configuration_sdar.py."""\n',
    },
    "sdar_moe": {
        "modeling_sdar_moe.py": '"""Stand-in for upstream modeling_sdar_moe.py."""\n',
        "configuration_sdar_moe.py": '"""Stand-in for upstream configuration_sdar_moe.py."""\n',
    },
}
MASK_TOKEN = {"llada": "<|mdm_mask|>", "sdar": "<|MASK|>", "sdar_moe": "<|MASK|>"}
CONFIGS = {"llada": LLADA_CONFIG, "sdar": SDAR_CONFIG, "sdar_moe": SDAR_MOE_CONFIG}


def upstream_config(arch: str, **overrides) -> dict:
    """``arch``: ``llada``, ``sdar`` or ``sdar_moe`` (the fixture kind, not our arch name)."""
    config = dict(CONFIGS[arch])
    config.update(overrides)
    return {k: v for k, v in config.items() if v is not _DROP}


_DROP = object()
DROP = _DROP
"""Pass as an override value to remove a key from the config."""


def upstream_shapes(arch: str, config: dict) -> Dict[str, tuple]:
    """Every tensor name and shape of the upstream checkpoint (from the modeling files)."""
    if arch == "llada":
        h, f, rows = config["d_model"], config["mlp_hidden_size"], config.get("embedding_size") or config["vocab_size"]
        heads, kv = config["n_heads"], config.get("n_kv_heads") or config["n_heads"]
        d = h // heads
        p = "model.transformer."
        out = {p + "wte.weight": (rows, h), p + "ln_f.weight": (h,)}
        if not config.get("weight_tying"):
            out[p + "ff_out.weight"] = (rows, h)
        for i in range(config["n_layers"]):
            b = f"{p}blocks.{i}."
            out.update(
                {
                    b + "attn_norm.weight": (h,),
                    b + "q_proj.weight": (heads * d, h),
                    b + "k_proj.weight": (kv * d, h),
                    b + "v_proj.weight": (kv * d, h),
                    b + "attn_out.weight": (h, heads * d),
                    b + "ff_norm.weight": (h,),
                    b + "ff_proj.weight": (f, h),
                    b + "up_proj.weight": (f, h),
                    b + "ff_out.weight": (h, f),
                }
            )
        return out
    h, f, rows = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    out = {"model.embed_tokens.weight": (rows, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings"):
        out["lm_head.weight"] = (rows, h)
    for i in range(config["num_hidden_layers"]):
        b = f"model.layers.{i}."
        out.update(
            {
                b + "input_layernorm.weight": (h,),
                b + "post_attention_layernorm.weight": (h,),
                b + "self_attn.q_proj.weight": (heads * d, h),
                b + "self_attn.k_proj.weight": (kv * d, h),
                b + "self_attn.v_proj.weight": (kv * d, h),
                b + "self_attn.o_proj.weight": (h, heads * d),
                b + "self_attn.q_norm.weight": (d,),
                b + "self_attn.k_norm.weight": (d,),
                b + "mlp.gate_proj.weight": (f, h),
                b + "mlp.up_proj.weight": (f, h),
                b + "mlp.down_proj.weight": (h, f),
            }
        )
        if arch == "sdar_moe":  # Qwen3MoeSparseMoeBlock: router ``gate`` + per-expert SwiGLU MLPs
            for name in ("gate_proj", "up_proj", "down_proj"):
                del out[f"{b}mlp.{name}.weight"]
            m = config["moe_intermediate_size"]
            out[b + "mlp.gate.weight"] = (config["num_experts"], h)
            for e in range(config["num_experts"]):
                out.update(
                    {
                        f"{b}mlp.experts.{e}.gate_proj.weight": (m, h),
                        f"{b}mlp.experts.{e}.up_proj.weight": (m, h),
                        f"{b}mlp.experts.{e}.down_proj.weight": (h, m),
                    }
                )
    return out


def random_tensors(shapes: Dict[str, tuple], seed: int = 0, dtype=torch.float32) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:  # RMSNorm weights: around 1, perturbed
            t = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif name.endswith("mlp.gate.weight"):  # MoE router: logits far apart, clear top-k choices
            t = torch.randn(shape, generator=gen)
        else:
            t = 0.1 * torch.randn(shape, generator=gen)
        out[name] = t.to(dtype)
    return out


def write_tokenizer(path: str, vocab_rows: int, mask_token: str, mask_id: int, eos_id: int, pad_id: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {(mask_token if i == mask_id else f"tok{i}"): i for i in range(vocab_rows)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="tok0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([mask_token])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as handle:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "mask_token": mask_token,
                "eos_token": f"tok{eos_id}",
                "pad_token": f"tok{pad_id}",
                "model_max_length": 64,
            },
            handle,
            indent=2,
        )


def write_safetensors(path: str, tensors: Dict[str, torch.Tensor], shards: int = 1) -> None:
    """One ``model.safetensors``, or ``shards`` files plus ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    names = list(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[k * per : (k + 1) * per]}
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=2)


def write_hf_checkpoint(
    path: str,
    arch: str,
    *,
    seed: int = 0,
    dtype=torch.float32,
    shards: int = 1,
    config_overrides: Optional[dict] = None,
    drop: Iterable[str] = (),
    extra: Optional[Dict[str, torch.Tensor]] = None,
    reshape: Optional[Dict[str, tuple]] = None,
) -> str:
    """A complete tiny upstream directory. ``drop``/``extra``/``reshape`` corrupt the weights
    on purpose (error tests). Returns ``path``."""
    os.makedirs(path, exist_ok=True)
    config = upstream_config(arch, **(config_overrides or {}))
    config_for_shapes = dict(config)
    if arch != "llada":
        config_for_shapes.setdefault("num_key_value_heads", config["num_attention_heads"])
    tensors = random_tensors(upstream_shapes(arch, config_for_shapes), seed, dtype)
    for name in drop:
        tensors.pop(name)
    for name, shape in (reshape or {}).items():
        tensors[name] = torch.zeros(shape, dtype=dtype)
    tensors.update(extra or {})
    write_safetensors(path, tensors, shards)
    with open(os.path.join(path, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as handle:
        json.dump({"eos_token_id": config.get("eos_token_id"), "_from_model_config": True}, handle)
    rows = config.get("embedding_size") or config["vocab_size"]
    write_tokenizer(
        path,
        rows,
        MASK_TOKEN[arch],
        config.get("mask_token_id", rows - 1),
        config.get("eos_token_id", 2),
        config.get("pad_token_id", 0) or 0,
    )
    for name, text in STUBS[arch].items():
        with open(os.path.join(path, name), "w") as handle:
            handle.write(text)
    return path


def load_all(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of an HF directory (single file or sharded), read with the safetensors library."""
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for file in files:
        out.update(load_file(os.path.join(path, file)))
    return out
