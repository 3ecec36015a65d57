"""Parameter mapping tables: one declarative table per model, HF names <-> Megatron-Core names.

Each row says how one Megatron parameter (full, unsharded, TP=1 layout) is
made from one or more upstream tensors, and back:

- :class:`Direct` -- the same tensor under another name (norms, ``linear_proj``,
  ``linear_fc2``);
- :class:`VocabRows` -- embedding / LM head: rows padded with zeros up to the
  padded vocabulary (``DLLMConfig.padded_vocab_size``) and cut back on export;
  an LM head tied to the embedding (``weight_tying`` / ``tie_word_embeddings``)
  is read from the embedding;
- :class:`QKV` -- ``linear_qkv`` rows grouped per KV group ``g``:
  ``[q heads of g; k_g; v_g]`` for ``g = 0..G-1`` (LLaDA: 32 groups of one head,
  SDAR-8B: 8 groups of 4). No RoPE permutation: both models are rotate-half;
- :class:`GatedMLP` -- ``linear_fc1 = [gate; up]`` (SwiGLU; under TP each rank
  holds ``[gate_r; up_r]``, which Megatron's checkpoint factory handles).

Shapes are declared with symbols resolved from the config: ``H`` hidden,
``F`` SwiGLU width, ``V`` vocabulary rows, ``D`` head dim, ``Q`` = heads x D,
``K`` = KV groups x D, ``E`` experts, ``M`` width of one expert. Names containing
``{i}`` repeat for every layer, and ``{e}`` (MoE tables) for every expert of a layer.
Upstream layouts: LLaDA's ``modeling_llada.py`` (GSAI-ML/LLaDA-8B-Instruct, OLMo names),
SDAR's ``modeling_sdar.py`` (JetLM/SDAR-8B-Chat, Qwen3 names) and, for the mixture of experts,
``modeling_sdar_moe.py`` (JetLM/SDAR-30B-A3B-Chat, Qwen3-MoE names: the router
``mlp.gate`` [E, H], per-expert ``mlp.experts.{e}.{gate,up,down}_proj``).

Megatron's expert names are those of a model holding every expert (EP=1, as the converter's
shell): ``mlp.experts.local_experts.{e}`` with ``e`` the global expert. At expert parallelism EP a
rank holds experts ``[r E/EP, (r+1) E/EP)`` as ``local_experts.0..`` (:func:`global_expert_name`);
in the ``torch_dist`` checkpoint they are one tensor per layer with a global expert axis
(``decoder.layers.mlp.experts.experts.linear_fc1.weight`` [L, E, 2M, H]), so it loads at any EP.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from stabledrl_mcore.models import DLLMConfig

Shape = Tuple[str, ...]


def resolve_shape(shape: Shape, cfg: DLLMConfig) -> Tuple[int, ...]:
    """Symbols -> sizes for one config (see the module docstring)."""
    sizes = {
        "H": cfg.hidden_size,
        "F": cfg.ffn_hidden_size,
        "V": cfg.vocab_size,
        "D": cfg.kv_channels,
        "Q": cfg.num_attention_heads * cfg.kv_channels,
        "K": cfg.num_query_groups * cfg.kv_channels,
        "P": cfg.max_position_embeddings,
        "T": cfg.num_segments,
        "E": cfg.num_experts or 0,
        "M": cfg.moe_ffn_hidden_size or 0,
    }
    return tuple(sizes[s] for s in shape)


@dataclass(frozen=True)
class Mapping:
    """One Megatron parameter and the upstream tensors it is made of."""

    megatron: str

    def hf_names(self) -> Tuple[str, ...]:
        raise NotImplementedError

    def hf_shapes(self, cfg: DLLMConfig) -> Dict[str, Tuple[int, ...]]:
        raise NotImplementedError

    def to_megatron(self, hf: Dict[str, torch.Tensor], cfg: DLLMConfig, padded_vocab: int) -> List[torch.Tensor]:
        """Row blocks whose concatenation (dim 0) is the full Megatron tensor."""
        raise NotImplementedError

    def to_hf(self, full: torch.Tensor, cfg: DLLMConfig) -> List[Tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def for_layer(self, i: int, e: Optional[int] = None) -> "Mapping":
        """A copy with ``{i}`` (and ``{e}``, the expert) replaced in every name."""

        def fill(name: str) -> str:
            name = name.replace("{i}", str(i))
            return name if e is None else name.replace("{e}", str(e))

        changes = {
            f.name: fill(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), str)
        }
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Direct(Mapping):
    hf: str
    shape: Shape

    def hf_names(self):
        return (self.hf,)

    def hf_shapes(self, cfg):
        return {self.hf: resolve_shape(self.shape, cfg)}

    def to_megatron(self, hf, cfg, padded_vocab):
        return [hf[self.hf]]

    def to_hf(self, full, cfg):
        return [(self.hf, full)]


@dataclass(frozen=True)
class VocabRows(Mapping):
    hf: str
    tied_to: Optional[str] = None
    """HF name of the embedding this LM head shares when the config ties them."""

    def hf_names(self):
        return (self.hf,)

    def hf_shapes(self, cfg):
        return {self.hf: (cfg.vocab_size, cfg.hidden_size)}

    def to_megatron(self, hf, cfg, padded_vocab):
        rows = hf[self.hf]
        if padded_vocab == rows.shape[0]:
            return [rows]
        return [rows, rows.new_zeros(padded_vocab - rows.shape[0], rows.shape[1])]

    def to_hf(self, full, cfg):
        return [(self.hf, full[: cfg.vocab_size])]


@dataclass(frozen=True)
class QKV(Mapping):
    q: str
    k: str
    v: str

    def hf_names(self):
        return (self.q, self.k, self.v)

    def hf_shapes(self, cfg):
        return {
            self.q: resolve_shape(("Q", "H"), cfg),
            self.k: resolve_shape(("K", "H"), cfg),
            self.v: resolve_shape(("K", "H"), cfg),
        }

    def to_megatron(self, hf, cfg, padded_vocab):
        groups, d, h = cfg.num_query_groups, cfg.kv_channels, cfg.hidden_size
        q = hf[self.q].reshape(groups, -1, h)  # [G, heads_per_group * D, H]
        k, v = hf[self.k].reshape(groups, d, h), hf[self.v].reshape(groups, d, h)
        return [torch.cat([q, k, v], dim=1).reshape(-1, h)]

    def to_hf(self, full, cfg):
        groups, d, h = cfg.num_query_groups, cfg.kv_channels, cfg.hidden_size
        per_group = cfg.num_attention_heads // groups * d
        grouped = full.reshape(groups, per_group + 2 * d, h)
        q, k, v = grouped.split([per_group, d, d], dim=1)
        return [(self.q, q.reshape(-1, h)), (self.k, k.reshape(-1, h)), (self.v, v.reshape(-1, h))]


@dataclass(frozen=True)
class GatedMLP(Mapping):
    gate: str
    up: str
    width: str = "F"
    """Shape symbol of the gate/up rows: ``F`` (dense MLP) or ``M`` (one expert)."""

    def hf_names(self):
        return (self.gate, self.up)

    def hf_shapes(self, cfg):
        shape = resolve_shape((self.width, "H"), cfg)
        return {self.gate: shape, self.up: shape}

    def to_megatron(self, hf, cfg, padded_vocab):
        return [hf[self.gate], hf[self.up]]

    def to_hf(self, full, cfg):
        gate, up = full.chunk(2, dim=0)
        return [(self.gate, gate), (self.up, up)]


@dataclass(frozen=True)
class ModelTable:
    """All mappings of one model: global rows first/last, per-layer rows in between."""

    arch: str
    head: Sequence[Mapping]
    """Before the layers (the embedding)."""
    layer: Sequence[Mapping]
    """Names with ``{i}``; repeated for every layer."""
    tail: Sequence[Mapping]
    """After the layers (final norm, LM head)."""
    ignored: Sequence[str] = ()
    """Regexes of upstream keys that carry no weights (non-persistent buffers some exports keep)."""
    expert: Sequence[Mapping] = ()
    """Names with ``{i}`` and ``{e}``: repeated for every expert of every layer (MoE tables)."""

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.ignored)


_L = "decoder.layers.{i}."

LLADA = ModelTable(
    arch="llada",
    head=[VocabRows("embedding.word_embeddings.weight", "model.transformer.wte.weight")],
    layer=[
        Direct(_L + "input_layernorm.weight", "model.transformer.blocks.{i}.attn_norm.weight", ("H",)),
        QKV(
            _L + "self_attention.linear_qkv.weight",
            "model.transformer.blocks.{i}.q_proj.weight",
            "model.transformer.blocks.{i}.k_proj.weight",
            "model.transformer.blocks.{i}.v_proj.weight",
        ),
        Direct(_L + "self_attention.linear_proj.weight", "model.transformer.blocks.{i}.attn_out.weight", ("H", "Q")),
        Direct(_L + "pre_mlp_layernorm.weight", "model.transformer.blocks.{i}.ff_norm.weight", ("H",)),
        GatedMLP(
            _L + "mlp.linear_fc1.weight",
            "model.transformer.blocks.{i}.ff_proj.weight",
            "model.transformer.blocks.{i}.up_proj.weight",
        ),
        Direct(_L + "mlp.linear_fc2.weight", "model.transformer.blocks.{i}.ff_out.weight", ("H", "F")),
    ],
    tail=[
        Direct("decoder.final_layernorm.weight", "model.transformer.ln_f.weight", ("H",)),
        VocabRows("output_layer.weight", "model.transformer.ff_out.weight", tied_to="model.transformer.wte.weight"),
    ],
)

SDAR = ModelTable(
    arch="sdar",
    head=[VocabRows("embedding.word_embeddings.weight", "model.embed_tokens.weight")],
    layer=[
        Direct(_L + "input_layernorm.weight", "model.layers.{i}.input_layernorm.weight", ("H",)),
        QKV(
            _L + "self_attention.linear_qkv.weight",
            "model.layers.{i}.self_attn.q_proj.weight",
            "model.layers.{i}.self_attn.k_proj.weight",
            "model.layers.{i}.self_attn.v_proj.weight",
        ),
        Direct(_L + "self_attention.q_layernorm.weight", "model.layers.{i}.self_attn.q_norm.weight", ("D",)),
        Direct(_L + "self_attention.k_layernorm.weight", "model.layers.{i}.self_attn.k_norm.weight", ("D",)),
        Direct(_L + "self_attention.linear_proj.weight", "model.layers.{i}.self_attn.o_proj.weight", ("H", "Q")),
        Direct(_L + "pre_mlp_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight", ("H",)),
        GatedMLP(
            _L + "mlp.linear_fc1.weight", "model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"
        ),
        Direct(_L + "mlp.linear_fc2.weight", "model.layers.{i}.mlp.down_proj.weight", ("H", "F")),
    ],
    tail=[
        Direct("decoder.final_layernorm.weight", "model.norm.weight", ("H",)),
        VocabRows("output_layer.weight", "lm_head.weight", tied_to="model.embed_tokens.weight"),
    ],
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
)

_MOE_MLP = _L + "mlp.experts.local_experts.{e}."
SDAR_MOE = dataclasses.replace(
    SDAR,
    layer=[
        *[m for m in SDAR.layer if ".mlp." not in m.megatron],
        Direct(_L + "mlp.router.weight", "model.layers.{i}.mlp.gate.weight", ("E", "H")),
    ],
    expert=[
        GatedMLP(
            _MOE_MLP + "linear_fc1.weight",
            "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
            "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
            width="M",
        ),
        Direct(_MOE_MLP + "linear_fc2.weight", "model.layers.{i}.mlp.experts.{e}.down_proj.weight", ("H", "M")),
    ],
)
"""SDAR-MoE (SDAR-30B-A3B, the Qwen3-MoE layout): SDAR's rows with the MLP made router + experts."""

TABLES = {"llada": LLADA, "sdar": SDAR}
MOE_TABLES = {"sdar": SDAR_MOE}
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")

# Transformer Engine fuses the pre-norms into the following linear; same checkpoint keys.
TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def canonical_megatron_name(name: str) -> str:
    """A parameter name of either layer spec (local or TE) -> the name the tables use
    (TE's grouped experts ``mlp.experts.linear_fc1.weight{j}`` -> ``...local_experts.{j}.linear_fc1.weight``)."""
    for te_name, local_name in TE_ALIASES.items():
        if name.endswith(te_name):
            return name[: -len(te_name)] + local_name
    grouped = _GROUPED_EXPERT.search(name)
    if grouped:
        return name[: grouped.start()] + f".mlp.experts.local_experts.{grouped.group(2)}.{grouped.group(1)}.weight"
    return name


def global_expert_name(name: str, ep_rank: int, local_experts: int) -> str:
    """A rank's ``local_experts.{j}`` -> the global expert ``ep_rank * local_experts + j`` (EP layout)."""
    match = _LOCAL_EXPERT.search(name)
    if not match:
        return name
    expert = ep_rank * local_experts + int(match.group(1))
    return name[: match.start()] + f".mlp.experts.local_experts.{expert}." + name[match.end() :]


# Optional embedding tables (``DLLMConfig.position_embedding="learned"``, ``num_segments``):
# LLaDA/OLMo's own name for learned positions, ours for the rest.
POSITION_ROWS = {"llada": "model.transformer.wpe.weight", "sdar": "model.embed_positions.weight"}
SEGMENT_ROWS = {"llada": "model.transformer.wse.weight", "sdar": "model.embed_segments.weight"}


def table_for(arch: str, cfg: Optional[DLLMConfig] = None) -> ModelTable:
    """The mapping table of ``arch`` (its MoE table when ``cfg.is_moe``), with the optional
    embedding rows ``cfg`` has."""
    if arch not in TABLES:
        raise KeyError(f"no mapping table for {arch!r}; known: {sorted(TABLES)}")
    table = TABLES[arch]
    if cfg is not None and cfg.is_moe:
        if arch not in MOE_TABLES:
            raise KeyError(f"no mixture-of-experts mapping table for {arch!r}; known: {sorted(MOE_TABLES)}")
        table = MOE_TABLES[arch]
    extra: List[Mapping] = []
    if cfg is not None and cfg.position_embedding == "learned":
        extra.append(Direct("embedding.position_embeddings.weight", POSITION_ROWS[arch], ("P", "H")))
    if cfg is not None and cfg.num_segments:
        extra.append(Direct("embedding.tokentype_embeddings.weight", SEGMENT_ROWS[arch], ("T", "H")))
    return dataclasses.replace(table, head=[*table.head, *extra]) if extra else table
