"""Hugging Face ``config.json`` <-> :class:`~stabledrl_mcore.models.DLLMConfig`, in each model's own words.

LLaDA (GSAI-ML/LLaDA-8B-*) keeps OLMo's field names: ``d_model``, ``n_layers``,
``n_heads``, ``n_kv_heads``, ``mlp_hidden_size`` (width of *each* of the
SwiGLU gate and up projections), ``vocab_size`` / ``embedding_size`` (rows of
``wte``), ``max_sequence_length``, ``rope_theta``, ``rms_norm_eps``,
``mask_token_id``, ``weight_tying``. SDAR (JetLM/SDAR-*) uses Qwen3's names
(``hidden_size``, ``num_hidden_layers``, ``num_key_value_heads``,
``intermediate_size``, ``head_dim``, ``tie_word_embeddings``) plus
``block_size`` and ``mask_token_id``; released configs sometimes omit those
two, which then default with a warning (the mask id is looked up as
``<|MASK|>`` in the tokenizer files first).

Each model has one field table (:data:`FIELDS`) and one table of architecture
switches that must hold for the Megatron backbone to compute the same function
(:data:`REQUIRED_VALUES`); a config that violates one is refused by name.

Mixture of experts (JetLM/SDAR-30B-A3B-*, ``model_type`` ``sdar_moe``, architectures
``SDARMoeForCausalLM``; Qwen/Qwen3-30B-A3B's ``qwen3_moe`` / ``Qwen3MoeForCausalLM`` is the same
layout, read as ``sdar`` with SDAR's block-causal attention): :data:`MOE_FIELDS` adds
``num_experts``, ``num_experts_per_tok`` (``moe_router_topk``), ``moe_intermediate_size``
(``moe_ffn_hidden_size``) and ``norm_topk_prob`` (``moe_norm_topk_prob``; absent = False, as
``Qwen3MoeConfig``). Every layer must be an MoE layer without shared experts
(:data:`MOE_REQUIRED_VALUES`: ``decoder_sparse_step`` 1, ``mlp_only_layers`` empty).
``router_aux_loss_coef`` is *not* imported: it is a pre-training setting, and RL runs with the
router losses off (``DLLMConfig.moe_aux_loss_coeff`` stays 0); on export the base config's value
is kept as it was.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.models import DLLMConfig, ModelConfigError

Default = Union[None, float, int, Callable[[Dict[str, Any]], Any]]


@dataclass(frozen=True)
class Field:
    """One ``DLLMConfig`` field read from one HF config key."""

    ours: str
    theirs: str
    required: bool = True
    default: Default = None
    """Used when the key is absent or null; a callable gets the HF config (and may look further)."""
    warn: bool = False
    """Warn when the default is used (fields that released configs are known to omit)."""


MODEL_TYPES = {"llada": "llada", "sdar": "sdar", "sdar_moe": "sdar", "qwen3_moe": "sdar"}  # -> our arch
MOE_MODEL_TYPES = ("sdar_moe", "qwen3_moe")
"""``model_type`` values whose upstream class is the mixture-of-experts one (SDARMoe / Qwen3Moe)."""
ARCHITECTURES = {"llada": ["LLaDAModelLM"], "sdar": ["SDARForCausalLM"]}
MOE_ARCHITECTURES = {"SDARMoeForCausalLM": "sdar_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}
"""MoE class name (``architectures``) -> its ``model_type`` (read when ``model_type`` is missing)."""
TIE_KEY = {"llada": "weight_tying", "sdar": "tie_word_embeddings"}
SDAR_MASK_TOKEN = "<|MASK|>"
SDAR_DEFAULT_MASK_ID = 151669
SDAR_DEFAULT_BLOCK_SIZE = 4


def _rope_theta(default: float) -> Callable[[Dict[str, Any]], float]:
    def read(hf: Dict[str, Any]) -> float:  # transformers 5 nests it in ``rope_parameters``
        nested = hf.get("rope_parameters") or {}
        return float(nested.get("rope_theta", default))

    return read


FIELDS: Dict[str, List[Field]] = {
    "llada": [
        Field("hidden_size", "d_model"),
        Field("num_layers", "n_layers"),
        Field("num_attention_heads", "n_heads"),
        Field("num_query_groups", "n_kv_heads", False, lambda hf: hf["n_heads"]),
        Field("ffn_hidden_size", "mlp_hidden_size"),
        Field("vocab_size", "embedding_size", False, lambda hf: _need(hf, "vocab_size", "llada")),
        Field("rope_theta", "rope_theta", False, 10000.0),
        Field("norm_eps", "rms_norm_eps", False, 1e-5),
        Field("max_position_embeddings", "max_sequence_length", False, 4096),
        Field("mask_token_id", "mask_token_id"),
        Field("eos_token_id", "eos_token_id"),
        Field("pad_token_id", "pad_token_id", False, lambda hf: _first(hf["eos_token_id"])),
        Field("bos_token_id", "bos_token_id", False, None),
    ],
    "sdar": [
        Field("hidden_size", "hidden_size"),
        Field("num_layers", "num_hidden_layers"),
        Field("num_attention_heads", "num_attention_heads"),
        Field("num_query_groups", "num_key_value_heads", False, lambda hf: hf["num_attention_heads"]),
        Field("head_dim", "head_dim", False, lambda hf: hf["hidden_size"] // hf["num_attention_heads"]),
        Field("ffn_hidden_size", "intermediate_size"),
        Field("vocab_size", "vocab_size"),
        Field("rope_theta", "rope_theta", False, _rope_theta(10000.0)),
        Field("norm_eps", "rms_norm_eps", False, 1e-6),
        Field("max_position_embeddings", "max_position_embeddings", False, 32768),
        Field("block_size", "block_size", False, SDAR_DEFAULT_BLOCK_SIZE, warn=True),
        Field("mask_token_id", "mask_token_id", False, lambda hf: _sdar_mask_id(hf), warn=True),
        Field("eos_token_id", "eos_token_id"),
        Field("pad_token_id", "pad_token_id", False, lambda hf: _first(hf["eos_token_id"])),
        Field("bos_token_id", "bos_token_id", False, None),
    ],
}

# Switches that must have these values when present (the backbone implements nothing else).
REQUIRED_VALUES: Dict[str, Dict[str, Tuple[Any, ...]]] = {
    "llada": {
        "rope": (True, False),
        "alibi": (False, None),
        "layer_norm_type": ("rms",),
        "include_bias": (False,),
        "include_qkv_bias": (False, None),
        "activation_type": ("silu",),
        "block_type": ("llama",),
        "attention_layer_norm": (False, None),
        "scale_logits": (False, None),
        "input_emb_norm": (False, None),
        "layer_norm_with_affine": (True, None),
        "block_group_size": (1, None),
        "multi_query_attention": (False, None),
        "clip_qkv": (None,),
    },
    "sdar": {
        "hidden_act": ("silu",),
        "attention_bias": (False, None),
        "mlp_bias": (False, None),
        "use_sliding_window": (False, None),
        "rope_scaling": (None,),
    },
}


MOE_FIELDS: List[Field] = [
    Field("num_experts", "num_experts"),
    Field("moe_router_topk", "num_experts_per_tok"),
    Field("moe_ffn_hidden_size", "moe_intermediate_size"),
    Field("moe_norm_topk_prob", "norm_topk_prob", False, False),
]

# What the MoE backbone cannot build (it makes every layer a routed-experts layer, nothing shared).
MOE_REQUIRED_VALUES: Dict[str, Tuple[Any, ...]] = {
    "decoder_sparse_step": (1, None),
    "mlp_only_layers": ([], None),
    "shared_expert_intermediate_size": (0, None),
    "n_shared_experts": (0, None),
    "num_shared_experts": (0, None),
    "moe_shared_expert_intermediate_size": (0, None),
}
MOE_UNSUPPORTED_HINT = (
    "stabledrl builds every layer as a routed mixture-of-experts layer without "
    "shared experts (decoder_sparse_step 1, mlp_only_layers [])"
)


def is_moe_config(hf_cfg: Dict[str, Any]) -> bool:
    """Whether ``config.json`` describes the mixture-of-experts class (``sdar_moe``/``qwen3_moe``)."""
    return _model_type(hf_cfg) in MOE_MODEL_TYPES


def _model_type(hf_cfg: Dict[str, Any]) -> Any:
    model_type = hf_cfg.get("model_type")
    if model_type is None:
        for name in hf_cfg.get("architectures") or ():
            if name in MOE_ARCHITECTURES:
                return MOE_ARCHITECTURES[name]
    return model_type


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) else value


def _need(hf: Dict[str, Any], key: str, arch: str) -> Any:
    if hf.get(key) is None:
        raise ConversionError(f"{arch} config.json is missing the required field {key!r}")
    return hf[key]


def _sdar_mask_id(hf: Dict[str, Any]) -> int:
    found = token_id_in_tokenizer(hf.get("_source_dir"), SDAR_MASK_TOKEN)
    return SDAR_DEFAULT_MASK_ID if found is None else found


def token_id_in_tokenizer(hf_dir: Optional[str], token: str) -> Optional[int]:
    """Id of an added token in ``tokenizer.json`` / ``tokenizer_config.json``, or None."""
    if not hf_dir:
        return None
    try:
        with open(os.path.join(hf_dir, "tokenizer.json")) as handle:
            for added in json.load(handle).get("added_tokens", []):
                if added.get("content") == token:
                    return int(added["id"])
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(hf_dir, "tokenizer_config.json")) as handle:
            for key, added in json.load(handle).get("added_tokens_decoder", {}).items():
                if added.get("content") == token:
                    return int(key)
    except (OSError, ValueError):
        pass
    return None


# ------------------------------------------------------------------------------ reading
def read_hf_config(hf_dir: str) -> Dict[str, Any]:
    """The parsed ``config.json`` of an HF model directory."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir} is not a directory")
    if not os.path.isfile(path):
        raise ConversionError(f"{hf_dir} has no config.json (not a Hugging Face model directory)")
    try:
        with open(path) as handle:
            data = json.load(handle)
    except ValueError as err:
        raise ConversionError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} must hold a JSON object")
    return data


def detect_arch(hf_cfg: Dict[str, Any], expected: Optional[str] = None) -> str:
    """``'llada'`` or ``'sdar'`` from ``model_type`` (or, without one, an MoE ``architectures``
    entry); checks it against ``expected`` (``--model``)."""
    model_type = _model_type(hf_cfg)
    if model_type not in MODEL_TYPES:
        raise ConversionError(
            f"unknown model_type {model_type!r} in config.json; supported: "
            f"{sorted(MODEL_TYPES)} (LLaDA: 'llada', SDAR: 'sdar', SDAR-MoE: "
            "'sdar_moe')"
        )
    arch = MODEL_TYPES[model_type]
    if expected is not None and expected != arch:
        raise ConversionError(f"--model {expected} was given but config.json has model_type {model_type!r} ({arch})")
    return arch


def is_tied(hf_cfg: Dict[str, Any], arch: str) -> bool:
    """Whether the LM head shares the input embedding (``weight_tying`` / ``tie_word_embeddings``)."""
    return bool(hf_cfg.get(TIE_KEY[arch], False))


def hf_to_dllm_config(
    hf_cfg: Dict[str, Any],
    arch: Optional[str] = None,
    *,
    source_dir: Optional[str] = None,
    make_vocab_size_divisible_by: int = 1,
) -> DLLMConfig:
    """Translate an upstream ``config.json`` dict into a validated :class:`DLLMConfig`."""
    arch = detect_arch(hf_cfg, arch)
    for key, allowed in REQUIRED_VALUES[arch].items():
        if key in hf_cfg and hf_cfg[key] not in allowed:
            raise ConversionError(
                f"{arch} config.json field {key!r} = {hf_cfg[key]!r} is not "
                f"supported (expected {' or '.join(map(repr, allowed))})"
            )
    moe = is_moe_config(hf_cfg)
    for key, allowed in MOE_REQUIRED_VALUES.items() if moe else ():
        if key in hf_cfg and hf_cfg[key] not in allowed:
            raise ConversionError(
                f"{arch} config.json field {key!r} = {hf_cfg[key]!r} is not supported: {MOE_UNSUPPORTED_HINT}"
            )
    view = dict(hf_cfg, _source_dir=source_dir)
    values: Dict[str, Any] = {
        "arch": arch,
        "qk_layernorm": arch == "sdar",
        "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
    }
    for field in FIELDS[arch] + (MOE_FIELDS if moe else []):
        value = hf_cfg.get(field.theirs)
        if value is None:
            if field.required:
                raise ConversionError(
                    f"{arch} config.json is missing the required field {field.theirs!r} ({field.ours})"
                )
            value = field.default(view) if callable(field.default) else field.default
            if field.warn:
                warnings.warn(f"{arch} config.json has no {field.theirs!r}; using {value!r}", stacklevel=2)
        values[field.ours] = _first(value) if field.ours.endswith("token_id") else value
    if arch == "llada" and hf_cfg.get("embedding_size") is not None:
        if hf_cfg["embedding_size"] < _need(hf_cfg, "vocab_size", arch):
            raise ConversionError(
                f"llada config.json: embedding_size ({hf_cfg['embedding_size']}) < vocab_size ({hf_cfg['vocab_size']})"
            )
    for name in ("rope_theta", "norm_eps"):
        values[name] = float(values[name])
    values.update(_read_extensions(hf_cfg, arch))
    try:
        return DLLMConfig.from_dict(values)
    except ModelConfigError as err:
        raise ConversionError(f"config.json describes no valid {arch} model: {err}") from None


# Our own keys for position schemes upstream configs cannot express (LLaDA/OLMo has
# learned positions, ``rope: false`` + ``wpe``; nothing upstream has the segment scheme).
EXTENSION_KEYS = {
    "position_embedding": "stabledrl_position_embedding",
    "segment_separator_id": "stabledrl_segment_separator_id",
    "num_segments": "stabledrl_num_segments",
}


def _read_extensions(hf_cfg: Dict[str, Any], arch: str) -> Dict[str, Any]:
    values = {ours: hf_cfg[theirs] for ours, theirs in EXTENSION_KEYS.items() if hf_cfg.get(theirs) is not None}
    if arch == "llada" and hf_cfg.get("rope") is False:
        values["position_embedding"] = "learned"
    return values


def _write_extensions(cfg: DLLMConfig, out: Dict[str, Any]) -> None:
    if cfg.arch == "llada":  # OLMo's own switch says it, not our key
        out["rope"] = cfg.position_embedding == "rope"
    for ours, theirs in EXTENSION_KEYS.items():
        out.pop(theirs, None)
        said_by_olmo = cfg.arch == "llada" and ours == "position_embedding"
        if getattr(cfg, ours) != getattr(DLLMConfig, ours) and not said_by_olmo:
            out[theirs] = getattr(cfg, ours)


# ------------------------------------------------------------------------------ writing
_TEMPLATES: Dict[str, Dict[str, Any]] = {
    "llada": {
        "model_type": "llada",
        "architectures": ["LLaDAModelLM"],
        "activation_type": "silu",
        "alibi": False,
        "block_type": "llama",
        "include_bias": False,
        "include_qkv_bias": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "attention_layer_norm": False,
        "rope": True,
        "rope_full_precision": True,
        "scale_logits": False,
        "weight_tying": False,
        "use_cache": False,
    },
    "sdar": {
        "model_type": "sdar",
        "architectures": ["SDARForCausalLM"],
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
}
_MOE_TEMPLATE: Dict[str, Any] = {
    "model_type": "sdar_moe",
    "architectures": ["SDARMoeForCausalLM"],
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
}


def dllm_to_hf_config(
    cfg: DLLMConfig, base: Optional[Dict[str, Any]] = None, *, dtype: Optional[str] = None, tied: Optional[bool] = None
) -> Dict[str, Any]:
    """An upstream-style ``config.json`` dict for ``cfg``.

    ``base`` (the source model's ``config.json``) keeps every key it has (auto_map,
    dropout, init settings, ...); the shape, ids and SDAR block fields are then
    written from ``cfg``. Without a base, a template of the upstream keys is used.
    ``dtype``: ``"bfloat16"``/``"float32"`` for ``torch_dtype``; ``tied``: the head-tying flag.
    An MoE model without a base gets ``model_type`` ``sdar_moe`` / ``SDARMoeForCausalLM``.
    """
    out = dict(base) if base is not None else dict(_TEMPLATES[cfg.arch])
    if base is not None:
        detect_arch(base, cfg.arch)
        if is_moe_config(base) != cfg.is_moe:
            raise ConversionError(
                f"the base config.json (model_type {_model_type(base)!r}) is "
                f"{'' if is_moe_config(base) else 'not '}a mixture-of-experts config but "
                f"the model is {'MoE' if cfg.is_moe else 'dense'}; pass matching --hf-assets"
            )
    elif cfg.is_moe:
        out.update(_MOE_TEMPLATE)
    for field in FIELDS[cfg.arch] + (MOE_FIELDS if cfg.is_moe else []):
        value = getattr(cfg, field.ours)
        if field.theirs == "head_dim" or value is not None or field.theirs in out:
            out[field.theirs] = value if field.ours != "head_dim" else cfg.kv_channels
    if cfg.arch == "llada":
        if out.get("vocab_size") is None or out["vocab_size"] > cfg.vocab_size:
            out["vocab_size"] = cfg.vocab_size
    if cfg.arch == "sdar" and "rope_parameters" in out and "rope_theta" not in (base or {}):
        out.pop("rope_theta", None)
        out["rope_parameters"] = dict(out["rope_parameters"], rope_theta=cfg.rope_theta)
    _write_extensions(cfg, out)
    if tied is not None:
        out[TIE_KEY[cfg.arch]] = tied
    if dtype is not None:
        out["dtype" if "dtype" in out and "torch_dtype" not in out else "torch_dtype"] = dtype
    return out


def transformers_shape(cfg: DLLMConfig, *, tied: bool, **extra: Any) -> Dict[str, Any]:
    """The keyword arguments of a ``transformers`` Llama / Qwen3 config with the shapes of ``cfg``
    (no attention bias), plus ``extra``: the reference models of ``verify`` and the bench baselines."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.kv_channels,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=tied,
        max_position_embeddings=cfg.max_position_embeddings,
        attention_bias=False,
        **extra,
    )
