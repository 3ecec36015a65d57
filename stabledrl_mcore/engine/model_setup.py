"""The model a run trains: its config (preset or checkpoint, plus model.overrides), its initial weights, the frozen reference policy."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Optional

import torch

from stabledrl_mcore.checkpoint.loader import is_hf_dir, load_hf_weights, read_config
from stabledrl_mcore.checkpoint.mcore_io import load_model_weights
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.schema import RunConfig
from stabledrl_mcore.models import build_model, get_preset


def model_config(cfg: RunConfig, tokenizer):
    """The preset (random init) or the checkpoint's own config, with ``model.overrides`` applied."""

    if cfg.model.checkpoint:
        mcfg = read_config(cfg.model.checkpoint)
    else:
        mcfg = get_preset(cfg.model.preset)
    overrides = dict(cfg.model.overrides)
    for name in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
        overrides.setdefault(name, getattr(tokenizer, name))
    if not cfg.model.checkpoint:  # random init: the embedding covers exactly the tokenizer
        overrides.setdefault("vocab_size", tokenizer.vocab_size)
    unknown = [k for k in overrides if k not in {f.name for f in dataclasses.fields(mcfg)}]
    if unknown:
        raise ConfigError(f"model.overrides: unknown DLLMConfig field(s) {', '.join(unknown)}")
    return dataclasses.replace(mcfg, **overrides).validate()


def reference_policy(model, mcfg, dtype):
    """A frozen copy of ``model`` as it is now (the initial policy), in the same layout and
    dtype, in eval mode: the reference of the KL penalty. A resume rebuilds it the same way
    (from ``model.checkpoint`` or the seeded initialisation) before the run's own weights load.
    """

    reference = build_model(mcfg, params_dtype=dtype, device=next(model.parameters()).device)
    reference.load_state_dict(model.state_dict())
    reference.requires_grad_(False)
    return reference.eval()


@torch.no_grad()
def sync_reference(reference, model, mixup: float) -> None:
    """TR-DPO's reference update (TRL's ``sync_ref_model``, used by d1): ref <- a * theta + (1 - a) * ref."""
    for ref_param, param in zip(reference.parameters(), model.parameters()):
        ref_param.mul_(1.0 - mixup).add_(param.detach().to(ref_param.dtype), alpha=mixup)


def load_initial_weights(model, path: str) -> None:
    """Weights from an HF directory, a converted checkpoint or a training checkpoint (any TP/PP)."""

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.checkpoint {path} is not a directory")
    if is_hf_dir(path):
        load_hf_weights(model, path)
    else:
        load_model_weights(model, path)


def synced_reference(s) -> Optional[Dict[str, Any]]:
    """The reference policy when it changes during training (so checkpoints must carry it)."""
    return {"reference": s.reference} if s.reference is not None and s.cfg.algo.reference_sync_every else None
