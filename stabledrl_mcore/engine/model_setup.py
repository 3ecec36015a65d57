"""The model a run trains: its config (preset or checkpoint, plus model.overrides), its initial weights, the frozen reference policy."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import torch

from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.schema import RunConfig
from stabledrl_mcore.convert.loader import load_weights, read_config
from stabledrl_mcore.models import build_model, get_preset
from stabledrl_mcore.models.lora import BaseWithoutAdapters, LoRASettings, apply_lora, has_lora


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


def lora_settings(cfg) -> Optional[LoRASettings]:
    """``model.lora`` for the model layer (None when off); adapters are seeded from ``parallel.seed``."""
    lora = cfg.model.lora
    if not lora.rank:
        return None
    return LoRASettings(lora.rank, lora.alpha, lora.dropout, tuple(lora.targets), seed=cfg.parallel.seed)


def build_policy(cfg, mcfg, dtype):
    """This rank's stage of the trained model: built, its initial weights loaded (``model.checkpoint``)
    and, with ``model.lora``, its adapters attached and everything else frozen (the local layer
    spec then: Transformer Engine's fused norm+linear hides the adapter's input; also with
    ``rollout.compile``, whose captured step traces the local spec's modules)."""
    settings = lora_settings(cfg)
    rollout = getattr(cfg, "rollout", None)  # SFT configs have no rollouts
    local = settings is not None or (rollout is not None and rollout.compile != "none")
    model = build_model(mcfg, params_dtype=dtype, recompute=cfg.model.recompute, use_te=False if local else None)
    if cfg.model.checkpoint:
        load_initial_weights(model, cfg.model.checkpoint, trust_unverified=cfg.checkpoint.trust_unverified)
    if settings is not None:
        apply_lora(model, settings)
    return model


def reference_policy(model, mcfg, dtype):
    """A frozen copy of ``model`` as it is now (the initial policy), in the same layout and
    dtype, in eval mode: the reference of the KL penalty. A resume rebuilds it the same way
    (from ``model.checkpoint`` or the seeded initialisation) before the run's own weights load.
    A LoRA model's reference is its frozen base without the adapters (no copy).
    """
    if has_lora(model):
        return BaseWithoutAdapters(model)
    reference = build_model(mcfg, params_dtype=dtype, device=next(model.parameters()).device)
    reference.load_state_dict(model.state_dict())
    reference.requires_grad_(False)
    return reference.eval()


@torch.no_grad()
def sync_reference(reference, model, mixup: float) -> None:
    """TR-DPO's reference update (TRL's ``sync_ref_model``, used by d1): ref <- a * theta + (1 - a) * ref."""
    for ref_param, param in zip(reference.parameters(), model.parameters()):
        ref_param.mul_(1.0 - mixup).add_(param.detach().to(ref_param.dtype), alpha=mixup)


def load_initial_weights(model, path: str, *, trust_unverified: bool = False) -> None:
    """Weights from an HF directory, a converted checkpoint or a training checkpoint (any TP/PP; a
    LoRA run's with its adapters merged into its base: :func:`~..convert.loader.load_weights`;
    ``trust_unverified``: a Megatron checkpoint without ``checksums.json`` loads, unverified)."""
    load_weights(model, path, trust_unverified=trust_unverified)


def synced_reference(s) -> Optional[Dict[str, Any]]:
    """The reference policy when it changes during training (so checkpoints must carry it)."""
    return {"reference": s.reference} if s.reference is not None and s.cfg.algo.reference_sync_every else None
