"""Checkpoints: HF <-> Megatron-Core conversion (mapping tables + one engine) and training state.

Public API (imported lazily, so ``checkpoint.state`` users do not pay for the converter)::

    hf_to_mcore(hf_dir, out, model="llada", tp=2, pp=2)   # upstream dir -> torch_dist checkpoint
    mcore_to_hf(ckpt, out)                                 # and back (safetensors + config + tokenizer)
    load_model(path)                                       # HF dir or converted ckpt -> logits module
    load_model_weights(model, ckpt)                        # into build_model() at any TP/PP
    load_hf_weights(model, hf_dir)                         # HF dir straight into a sharded model
    save_model_checkpoint(model, out)                      # model-only checkpoint from any layout
    add_convert_arguments(parser) / run_convert(args)      # the `stabledrl convert` command

Layout of a converted checkpoint: :mod:`.mcore_io`; tables: :mod:`.mappings`.
"""

import importlib

_EXPORTS = {
    "ConversionError": "errors",
    "hf_to_mcore": "convert", "mcore_to_hf": "convert", "add_convert_arguments": "convert",
    "run_convert": "convert",
    "load_model": "loader", "load_hf_weights": "loader", "read_config": "loader",
    "InspectionModel": "loader",
    "load_model_weights": "mcore_io", "save_model_checkpoint": "mcore_io",
    "read_checkpoint_info": "mcore_io", "is_model_checkpoint": "mcore_io",
    "MappingEngine": "engine", "table_for": "mappings",
    "hf_to_dllm_config": "hf_config", "dllm_to_hf_config": "hf_config",
    "SafetensorsReader": "safetensors_io", "SafetensorsWriter": "safetensors_io",
    "verify": "verify",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
