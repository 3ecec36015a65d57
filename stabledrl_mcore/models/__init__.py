"""Diffusion-LM backbones (LLaDA, SDAR) built from Megatron-Core pieces.

Public API::

    cfg = get_preset("sdar-tiny")                      # DLLMConfig
    model = build_model(cfg)                           # after parallel.bootstrap.initialize()
    logits = model(ids, pos, AttentionLayout.staircase(cfg.block_size))
    logp = vocab_parallel_log_probs(logits, targets)

The names built on Megatron-Core (``_ON_MEGATRON``) load on first use, so the presets, masks and
configs (``DLLMConfig``, ``get_preset``: what ``stabledrl train --print-config`` checks) import
without megatron-core.
"""

import importlib

from stabledrl_mcore.models.kv_cache import KVCache
from stabledrl_mcore.models.masks import (
    AttentionLayout,
    block_causal_mask,
    padding_mask,
    staircase_mask,
    staircase_position_ids,
)
from stabledrl_mcore.models.placement import default_device, eval_mode, model_device, place_model
from stabledrl_mcore.models.positions import position_inputs, segment_positions, valid_positions
from stabledrl_mcore.models.presets import (
    DLLMConfig,
    ModelConfigError,
    available_presets,
    get_preset,
    to_transformer_config,
)
from stabledrl_mcore.models.rope import rotary_angles

_ON_MEGATRON = {
    "SDPACoreAttention": "stabledrl_mcore.models.attention",
    "vocab_parallel_log_probs": "stabledrl_mcore.models.logprobs",
    "DLLMModel": "stabledrl_mcore.models.model",
    "build_model": "stabledrl_mcore.models.model",
    "dllm_layer_spec": "stabledrl_mcore.models.specs",
    "te_available": "stabledrl_mcore.models.specs",
}
"""Names whose modules import megatron-core at their top: loaded by :func:`__getattr__`."""


def __getattr__(name: str):
    """``models.build_model`` and the other Megatron-Core names, imported on first use."""
    if name in _ON_MEGATRON:
        value = getattr(importlib.import_module(_ON_MEGATRON[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'stabledrl_mcore.models' has no attribute {name!r}")


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
    "position_inputs",
    "valid_positions",
    "staircase_mask",
    "staircase_position_ids",
    "te_available",
    "to_transformer_config",
    "vocab_parallel_log_probs",
]
