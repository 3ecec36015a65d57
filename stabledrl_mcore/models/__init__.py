"""Diffusion-LM backbones (LLaDA, SDAR) built from Megatron-Core pieces.

Public API::

    cfg = get_preset("sdar-tiny")                      # DLLMConfig
    model = build_model(cfg)                           # after parallel.bootstrap.initialize()
    logits = model(ids, pos, AttentionLayout.staircase(cfg.block_size))
    logp = vocab_parallel_log_probs(logits, targets)
"""

from stabledrl_mcore.models.attention import SDPACoreAttention
from stabledrl_mcore.models.kv_cache import KVCache
from stabledrl_mcore.models.logprobs import vocab_parallel_log_probs
from stabledrl_mcore.models.masks import (
    AttentionLayout,
    block_causal_mask,
    padding_mask,
    staircase_mask,
    staircase_position_ids,
)
from stabledrl_mcore.models.model import DLLMModel, build_model
from stabledrl_mcore.models.placement import default_device, eval_mode, model_device, place_model
from stabledrl_mcore.models.presets import (
    DLLMConfig,
    ModelConfigError,
    available_presets,
    get_preset,
    segment_positions,
    to_transformer_config,
)
from stabledrl_mcore.models.rope import rotary_angles
from stabledrl_mcore.models.specs import dllm_layer_spec, te_available

__all__ = [
    "AttentionLayout",
    "DLLMConfig",
    "DLLMModel",
    "KVCache",
    "ModelConfigError",
    "SDPACoreAttention",
    "available_presets",
    "block_causal_mask",
    "build_model",
    "default_device",
    "dllm_layer_spec",
    "eval_mode",
    "get_preset",
    "model_device",
    "padding_mask",
    "place_model",
    "rotary_angles",
    "segment_positions",
    "staircase_mask",
    "staircase_position_ids",
    "te_available",
    "to_transformer_config",
    "vocab_parallel_log_probs",
]
