"""LoRA training checkpoints on the way out: merged upstream weights, or an adapter in PEFT's format.

A LoRA run's checkpoint holds the adapters only (``*.lora.a`` / ``*.lora.b``, any TP/PP) and its
``config.yaml`` names the base (``model.checkpoint``: a converted Megatron checkpoint or an
upstream HF directory). :func:`read_lora_run` finds both; :class:`Adapters` loads the adapters into
a TP=1 shell and gives, per Megatron weight, the full change ``scale (B * mask) A`` that
``mcore-to-hf`` adds to the base tensor as it streams by (so the export is the adapted model,
merged): in float32, from the base's stored values, rounded once to the dtype written (the run's
``model.dtype`` or ``--dtype``), never first to the base's dtype. :func:`write_peft_adapter` writes PEFT's ``adapter_config.json`` +
``adapter_model.safetensors``: per targeted upstream projection ``lora_A`` = its ``A`` rows and
``lora_B`` = the rows of ``B`` its output occupies in Megatron's fused layout (PEFT computes
``W x + (lora_alpha / r) B A x``, the same function).
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from safetensors.torch import save_file

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.checkpoint.info import CheckpointInfo, read_checkpoint_info
from stabledrl_mcore.checkpoint.mcore_io import build_shell, iter_full_tensors
from stabledrl_mcore.checkpoint.state import read_lora_run
from stabledrl_mcore.convert import hf_config as hfc
from stabledrl_mcore.convert.engine import MappingEngine
from stabledrl_mcore.convert.hf_config import read_hf_config
from stabledrl_mcore.convert.loader import is_hf_dir, load_adapters
from stabledrl_mcore.convert.mappings import table_for
from stabledrl_mcore.convert.safetensors_io import FiniteReader, SafetensorsReader
from stabledrl_mcore.models import DLLMConfig
from stabledrl_mcore.models.lora import (
    PART_ORDER,
    LoRASettings,
    adapters,
    apply_lora,
)


class Adapters:
    """A LoRA checkpoint's adapters at TP=1 (small: held whole), by the Megatron weight they change."""

    def __init__(self, ckpt: str, cfg: DLLMConfig, settings: LoRASettings):
        shell = build_shell(cfg, torch.float32)
        apply_lora(shell, settings)
        load_adapters(shell, ckpt)
        self.cfg, self.settings = cfg, settings
        self.by_weight = {f"{name}.weight": adapter for name, adapter in adapters(shell)}

    def delta(self, megatron_name: str) -> Optional[torch.Tensor]:
        """The full fp32 change of one Megatron weight, or None where nothing is adapted."""
        adapter = self.by_weight.get(megatron_name)
        return None if adapter is None else adapter.delta_weight()

    def merged(self, megatron_name: str, full: torch.Tensor) -> torch.Tensor:
        """The adapted weight in float32, ``W + delta`` from the base's stored values ``full`` (the
        caller rounds it once, to the dtype it writes); an unadapted weight unchanged."""
        delta = self.delta(megatron_name)
        return full if delta is None else full.float() + delta.float()

    def peft_tensors(self) -> Iterator[Tuple[str, torch.Tensor, torch.Tensor]]:
        """``(upstream module path, lora_A [r, in], lora_B [out, r])`` of every adapted projection."""
        table = table_for(self.cfg.arch, self.cfg)
        r = self.settings.rank
        for weight_name, adapter in self.by_weight.items():
            layer_module = weight_name.split(".", 3)[3][: -len(".weight")]  # decoder.layers.{i}.<module>
            layer = int(weight_name.split(".")[2])
            mapping = next(m for m in table.layer if m.megatron == "decoder.layers.{i}." + layer_module + ".weight")
            hf_names = [n.replace("{i}", str(layer)) for n in mapping.hf_names()]
            for j, part in enumerate(adapter.parts):
                hf = hf_names[0] if len(hf_names) == 1 else hf_names[PART_ORDER[layer_module].index(part)]
                # a part's rows in Megatron's order are the upstream projection's rows (mappings.py)
                yield hf[: -len(".weight")], adapter.a[j * r : (j + 1) * r].detach(), adapter.part_b(part).detach()


def peft_target_regex(modules: List[str]) -> str:
    """PEFT ``target_modules`` as a full-match regex of exactly these module paths, any layer (a
    list of names would also catch LLaDA's LM head ``model.transformer.ff_out`` by its suffix)."""
    return "|".join(sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(m)) for m in modules}))


def write_peft_adapter(out: str, found: Adapters, *, base_name: str, dtype: torch.dtype) -> str:
    """PEFT's adapter directory (``PeftModel.from_pretrained(base, out)`` loads it)."""
    os.makedirs(out, exist_ok=True)
    tensors: Dict[str, torch.Tensor] = {}
    modules = []
    for module, a, b in found.peft_tensors():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(dtype).contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(dtype).contiguous()
        modules.append(module)
    s = found.settings
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_name,
        "r": s.rank,
        "lora_alpha": s.alpha,
        "lora_dropout": s.dropout,
        "target_modules": peft_target_regex(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "adapter_config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
        handle.write("\n")
    return out


def base_source(base: str, ckpt: str):
    """``(CheckpointInfo of the base, tensors(shell, engine) -> (group, name, full))``: the base a
    LoRA checkpoint was trained on, streamed in Megatron's full layout from a converted checkpoint
    or an upstream HF directory (which also supplies the exported config and tokenizer)."""
    if is_hf_dir(base):
        raw = read_hf_config(base)
        cfg = hfc.hf_to_dllm_config(raw, None, source_dir=base)
        reader = SafetensorsReader(base)
        engine = MappingEngine(table_for(cfg.arch, cfg), cfg, tied=hfc.is_tied(raw, cfg.arch))
        dtype = reader.dtype(engine.groups()[0][1][0].hf_names()[0])
        info = CheckpointInfo(base, cfg, dtype, hfc.is_tied(raw, cfg.arch), None, base)

        def tensors(shell, engine):
            for group, name, blocks in engine.iter_megatron(FiniteReader(reader), dtype):
                yield group, name, blocks[0] if len(blocks) == 1 else torch.cat(blocks)

        return info, tensors
    info = read_checkpoint_info(base)
    if read_lora_run(base) is not None:
        raise ConversionError(f"{ckpt}: its base {base} is itself a LoRA checkpoint; export that one merged first")
    return info, lambda shell, engine: iter_full_tensors(base, shell, engine.groups(), info.dtype)
