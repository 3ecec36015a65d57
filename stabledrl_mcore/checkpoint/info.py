"""What a model checkpoint says about itself, read without building a model: the marker and
``model_config.json`` of a converted checkpoint (:mod:`.mcore_io`), the config of a training
checkpoint, the stored dtype. The preflight reads them before any rank starts; imports no
megatron-core (the ``.metadata`` check uses torch's distributed-checkpoint reader, :mod:`.trust`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.checkpoint.trust import METADATA_FILE, stored_tensors, verify_metadata
from stabledrl_mcore.common.files import special_kind
from stabledrl_mcore.models import DLLMConfig

MARKER = "stabledrl_model.json"
MODEL_CONFIG = "model_config.json"
HF_ASSETS = "hf"
FORMAT = "stabledrl-mcore-model"
FORMAT_VERSION = 1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MARKER_FIELDS = (
    "format",
    "version",
    "arch",
    "dtype",
    "tied_embeddings",
    "padded_vocab_size",
    "suggested_layout",
    "source",
)


@dataclass
class CheckpointInfo:
    """What a converted (or training) checkpoint says about itself."""

    path: str
    config: DLLMConfig
    dtype: torch.dtype
    tied_embeddings: bool = False
    suggested_layout: Optional[Dict[str, int]] = None
    hf_assets: Optional[str] = None
    """Directory with the upstream config/tokenizer files, if the checkpoint carries one."""


def is_model_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def read_json(path: str) -> Any:
    kind = special_kind(path)
    if kind:  # reading a FIFO would block
        raise ConversionError(f"cannot read {path}: it is {kind}, not a regular file")
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError) as err:
        raise ConversionError(f"cannot read {path}: {err}") from None


def write_json(path: str, data: Any) -> None:
    with open(path, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")


def read_checkpoint_info(path: str) -> CheckpointInfo:
    """Metadata of a converted checkpoint, or of a training checkpoint (``train_state.json``)
    that carries a ``model_config.json`` (dtype then read from the tensors)."""
    if not os.path.isdir(path):
        raise ConversionError(f"checkpoint {path} is not a directory")
    assets = os.path.join(path, HF_ASSETS)
    assets = assets if os.path.isdir(assets) else None
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        verify_metadata(path)  # every consumer (convert, load_model, eval, preflight) starts here
    if is_model_checkpoint(path):
        marker = read_json(os.path.join(path, MARKER))
        if marker.get("format") != FORMAT or marker.get("version") != FORMAT_VERSION:
            raise ConversionError(
                f"{path}/{MARKER}: unsupported format {marker.get('format')!r} version {marker.get('version')!r}"
            )
        cfg = DLLMConfig.from_dict(read_json(os.path.join(path, MODEL_CONFIG)))
        return CheckpointInfo(
            path, cfg, DTYPES[marker["dtype"]], bool(marker["tied_embeddings"]), marker.get("suggested_layout"), assets
        )
    if os.path.isfile(os.path.join(path, MODEL_CONFIG)) and os.path.isfile(os.path.join(path, METADATA_FILE)):
        cfg = DLLMConfig.from_dict(read_json(os.path.join(path, MODEL_CONFIG)))
        return CheckpointInfo(path, cfg, stored_dtype(path), False, None, assets)
    raise ConversionError(
        f"{path} is not a converted checkpoint (no {MARKER}; a training "
        f"checkpoint needs a {MODEL_CONFIG} beside its tensors)"
    )


def stored_dtype(path: str) -> torch.dtype:
    for key, record in stored_tensors(path).items():
        if key.startswith("optimizer."):  # training checkpoints: Adam moments are fp32 whatever the model
            continue
        if key.endswith(("word_embeddings.weight", "linear_qkv.weight", ".lora.a")):  # .lora.a: LoRA runs
            return record.properties.dtype
    raise ConversionError(f"{path} holds no embedding or attention tensor")
