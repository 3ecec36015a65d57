"""``load_model``: one call from an HF directory or a converted checkpoint to a working model.

For inspection, scripts and tests, in a single process (Megatron is initialised
with TP=PP=1 if it is not already; the caller's RNG streams are left untouched).
The returned :class:`InspectionModel` wraps the Megatron :class:`DLLMModel`
and applies each model's *inference* attention by default: LLaDA is fully
bidirectional; SDAR is block-causal with the block size from its config
(query in block ``b`` sees keys in blocks ``<= b``), as upstream decoding runs it.
It follows the library's model contract (``dllm_config``, ``kv_cache=`` and
``gather_output=`` pass through), so ``diffusion.generate``, the likelihood
estimators and ``evaluation.evaluate_model`` take it as they take the DLLMModel;
only an omitted ``attention_mask`` means the inference attention above.

:func:`load_hf_weights` fills any (TP/PP-sharded) :class:`DLLMModel` straight
from an upstream directory; converted checkpoints load with
:func:`~..checkpoint.mcore_io.load_model_weights` at any layout.
"""

from __future__ import annotations

import os
import re
from typing import Optional, Union

import torch

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.checkpoint.info import is_model_checkpoint, read_checkpoint_info
from stabledrl_mcore.checkpoint.integrity import check_finite as check_all_finite
from stabledrl_mcore.checkpoint.integrity import check_verifiable, verify_checksums
from stabledrl_mcore.checkpoint.mcore_io import (
    build_shell,
    ensure_single_process,
    load_model_weights,
)
from stabledrl_mcore.checkpoint.state import LoRARun, read_lora_run
from stabledrl_mcore.checkpoint.trust import load_sharded, verify_metadata
from stabledrl_mcore.convert import hf_config as hfc
from stabledrl_mcore.convert.engine import MappingEngine
from stabledrl_mcore.convert.mappings import canonical_megatron_name, global_expert_name, table_for
from stabledrl_mcore.convert.safetensors_io import FiniteReader, SafetensorsReader, check_finite
from stabledrl_mcore.models import AttentionLayout, DLLMConfig, block_causal_mask, padding_mask
from stabledrl_mcore.models.lora import AdapterCheckpointView, apply_lora, merge_adapters

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


class InspectionModel(torch.nn.Module):
    """``forward(input_ids, position_ids=None, attention_mask=None) -> logits [B, S, V]``.

    ``attention_mask``: None (the model's inference attention, see the module
    docstring); a 2-D ``[B, S]`` HF-style key mask (1/True = real token),
    combined with SDAR's block-causal pattern; or anything
    :meth:`DLLMModel.forward` accepts (4-D bool with True = blocked, or an
    :class:`AttentionLayout`), passed through unchanged. Other keywords (``kv_cache``,
    ``gather_output``) go to :meth:`DLLMModel.forward`.
    """

    def __init__(self, model, config: DLLMConfig):
        super().__init__()
        self.model = model
        self.config = config

    @property
    def dllm_config(self) -> DLLMConfig:
        """The wrapped model's config (what the samplers and estimators read)."""
        return self.model.dllm_config

    def kv_cache_layers(self):
        """The wrapped model's KV-cache shape (what a compiled decoding step allocates)."""
        return self.model.kv_cache_layers()

    def kv_cache_dtype(self) -> torch.dtype:
        return self.model.kv_cache_dtype()

    def default_layout(self) -> Optional[AttentionLayout]:
        if self.config.arch == "sdar":
            return AttentionLayout.block_causal(self.config.block_size)
        return None

    def forward(
        self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, attention_mask=None, **kwargs
    ) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = self.default_layout()
        elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            blocked = padding_mask(attention_mask.bool())
            if self.config.arch == "sdar":
                seq = input_ids.shape[1]
                blocked = blocked | block_causal_mask(seq, self.config.block_size, device=blocked.device)
            attention_mask = blocked
        return self.model(input_ids, position_ids, attention_mask, **kwargs)


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and not is_model_checkpoint(path)


def check_loadable(path: str, *, trust_unverified: bool = False) -> None:
    """The cheap pre-load check of :func:`load_weights` (nothing hashed): an HF directory passes; a
    Megatron checkpoint with a link, a FIFO or a device, or without ``checksums.json`` (unless
    ``trust_unverified``) raises :class:`~..checkpoint.integrity.CheckpointError` naming it."""
    if not is_hf_dir(path):
        check_verifiable(path, trust_unverified=trust_unverified)


def _global_names(model):
    """``(global parameter name, parameter)`` with pipeline-local layer indices and this
    expert-parallel rank's local expert indices made global."""
    from megatron.core import parallel_state as ps

    layers = getattr(model.decoder, "layers", [])
    offsets = {j: layer.layer_number - 1 for j, layer in enumerate(layers)}
    cfg = model.dllm_config
    ep_rank, ep_size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    local_experts = (cfg.num_experts or 0) // ep_size
    for name, param in model.named_parameters():
        match = _LAYER.match(name)
        if match:
            name = f"decoder.layers.{offsets[int(match.group(1))]}." + name[match.end() :]
        if cfg.is_moe:
            name = global_expert_name(canonical_megatron_name(name), ep_rank, local_experts)
        yield name, param


LOAD_ANYWAY = "the weights are broken; load_model(..., allow_nonfinite=True) reads them anyway"


def load_hf_weights(model, hf_dir: str, *, allow_nonfinite: bool = False) -> None:
    """Fill this rank's stage/shard of ``model`` from an upstream HF directory (any TP/PP; MoE
    models also at any EP/ETP: a rank reads only its own experts). A NaN or inf in a tensor it
    reads is a :class:`ConversionError` naming the tensor, unless ``allow_nonfinite``."""
    from megatron.core import parallel_state as ps

    cfg = model.dllm_config
    raw = hfc.read_hf_config(hf_dir)
    hfc.detect_arch(raw, cfg.arch)
    reader = SafetensorsReader(hf_dir)
    engine = MappingEngine(
        table_for(cfg.arch, cfg), cfg, tied=hfc.is_tied(raw, cfg.arch), padded_vocab=model.padded_vocab_size
    )
    get = reader.get if allow_nonfinite else FiniteReader(reader, LOAD_ANYWAY).get
    engine.check_source(reader)
    keys = set(reader.keys())
    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()) if cfg.is_moe else tp
    with torch.no_grad():
        for name, param in _global_names(model):
            mapping = engine.mapping(name)
            blocks = engine.to_megatron(mapping, get, param.dtype, keys)
            shard = engine.shard_for_rank(name, blocks, param, *(etp if ".mlp.experts." in name else tp))
            if tuple(shard.shape) != tuple(param.shape):
                raise ConversionError(
                    f"{name}: mapped shape {list(shard.shape)} does not fit the parameter {list(param.shape)}"
                )
            if not allow_nonfinite:  # finite in the file, but beyond the range of the model's dtype?
                check_finite(name, shard, f"{hf_dir} cast to {param.dtype}", LOAD_ANYWAY)
            param.copy_(shard)


def read_config(path: str, arch: Optional[str] = None) -> DLLMConfig:
    """The :class:`DLLMConfig` of an HF directory or a converted checkpoint."""
    if is_hf_dir(path):
        return hfc.hf_to_dllm_config(hfc.read_hf_config(path), arch, source_dir=path)
    return read_checkpoint_info(path).config


def load_weights(model, path: str, *, allow_nonfinite: bool = False, trust_unverified: bool = False) -> None:
    """Weights from an HF directory, a converted checkpoint or a training checkpoint into ``model``
    (any TP/PP). A LoRA run's checkpoint (adapters only) loads as its base with the adapters merged
    in (:func:`load_lora_merged`). A Megatron checkpoint is checked before anything of it is read
    (:func:`check_loadable`) and its checksums verified (once) before its tensors are: one without
    ``checksums.json`` is refused unless ``trust_unverified``; links, FIFOs and devices always."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.checkpoint {path} is not a directory")
    if is_hf_dir(path):
        load_hf_weights(model, path, allow_nonfinite=allow_nonfinite)
        return
    check_verifiable(path, trust_unverified=trust_unverified)
    lora = read_lora_run(path)
    if lora is not None:
        load_lora_merged(model, path, lora, trust_unverified=trust_unverified)
    else:
        load_model_weights(model, path, trust_unverified=trust_unverified)


def load_lora_merged(model, path: str, lora: LoRARun, *, trust_unverified: bool = False) -> None:
    """The base of a LoRA checkpoint (``lora.base``), its adapters loaded from ``path`` (at any TP/PP:
    Megatron reshards them) and folded into the weights; ``model`` is plain again afterwards. Both
    are verified as :func:`load_weights` does."""
    load_weights(model, lora.base, trust_unverified=trust_unverified)
    apply_lora(model, lora.settings)
    verify_checksums(path, trust_unverified=trust_unverified)
    load_adapters(model, path)
    merge_adapters(model, detach=True)
    check_all_finite(model.named_parameters(), f"after merging the LoRA adapters of {path}")


def load_adapters(model, path: str) -> None:
    """The adapters of ``model`` (:func:`~..models.lora.apply_lora` done) from the LoRA checkpoint
    ``path``, at any TP/PP (Megatron reshards them); a missing one raises naming it."""
    verify_metadata(path)
    view = AdapterCheckpointView(model)
    sharded = view.sharded_state_dict()
    loaded = load_sharded(sharded, path)
    missing, _ = view.load_state_dict({k: v for k, v in loaded.items() if k in sharded})
    if missing:
        raise ConversionError(f"{path} lacks LoRA tensor(s) {missing[:5]} (saved with other model.lora.targets?)")


def load_model(
    path: str,
    *,
    dtype: Union[str, torch.dtype] = torch.float32,
    arch: Optional[str] = None,
    device: Union[str, torch.device] = "cpu",
    allow_nonfinite: bool = False,
    trust_unverified: bool = False,
) -> InspectionModel:
    """A single-process model from an HF directory (``config.json`` + safetensors) or a
    converted checkpoint (``stabledrl_model.json``), in eval mode, on ``device`` (CPU by default).

    ``dtype``: parameter dtype (``torch.float32`` default, or ``"bf16"``/``"fp32"``).
    ``arch``: expected ``"llada"``/``"sdar"`` (checked against an HF config).
    ``allow_nonfinite``: load NaN/inf weights of an HF directory (refused by tensor name otherwise;
    a converted or training checkpoint's are always refused: :func:`~..checkpoint.mcore_io.load_model_weights`).
    ``trust_unverified``: load a converted or training checkpoint that has no ``checksums.json``.
    """
    if isinstance(dtype, str):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if not os.path.isdir(path):
        raise ConversionError(f"{path} is not a directory")
    cfg = read_config(path, arch)
    if arch is not None and cfg.arch != arch:
        raise ConversionError(f"{path} holds a {cfg.arch} model, not {arch}")
    ensure_single_process()
    model = build_shell(cfg, dtype)
    load_weights(model, path, allow_nonfinite=allow_nonfinite, trust_unverified=trust_unverified)
    model.to(device=device).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return InspectionModel(model, cfg).eval()
