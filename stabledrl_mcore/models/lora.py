"""LoRA adapters on Megatron-Core's tensor-parallel linears (Hu et al. 2021, with PEFT's semantics).

A targeted projection ``p`` computes ``W_p x + (alpha / r) B_p A_p dropout(x)`` with ``A_p``
``[r, in]`` drawn as PEFT draws it (``kaiming_uniform_(a=sqrt(5))``: U(-1/sqrt(in), 1/sqrt(in))) and
``B_p = 0``, so the adapted model starts equal to its base. Targets are the projections PEFT users
name (``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``; LLaDA's ``attn_out``, ``ff_proj``
and ``ff_out`` are ``o_proj``, ``gate_proj`` and ``down_proj``), each with its own rank-``r`` pair
as in PEFT (Megatron-Bridge calls this "canonical" LoRA), although Megatron fuses q/k/v into
``linear_qkv`` and gate/up into ``linear_fc1``: the adapter of a fused linear stacks its targeted
parts' ``A`` (``[k r, in]``) and holds one ``B`` ``[out, k r]`` whose block structure (part ``j``'s
rows read only columns ``j r .. (j+1) r``) is kept by a fixed 0/1 mask.

Tensor parallelism follows the base layer's split, as Megatron-Bridge's ``ParallelLinearAdapter``:

- column-parallel base (``linear_qkv``, ``linear_fc1``; output split over TP): ``B`` split like the
  base's output rows; ``A`` replicated (Bridge splits it along the rank and all-gathers ``A x``):
  ``h = A x`` enters the TP region with Megatron's ``copy_to_tensor_model_parallel_region``
  (identity forward, all-reduce of its gradient, so every rank's ``A`` gets the same full gradient);
- row-parallel base (``linear_proj``, ``linear_fc2``; input split over TP): ``A`` split along its
  input like the base weight, ``h = reduce_from_tensor_model_parallel_region(A_r x_r)`` (an
  all-reduce of ``[tokens, r]``, as Bridge), ``B`` replicated; the delta is added after the base's reduce.

Only the adapters train (:func:`apply_lora` freezes everything else, so Megatron's DDP and
(distributed) optimizer hold adapter parameters only). :func:`adapters_disabled` runs the base
model, which is the KL reference of a LoRA run (no second copy of the weights). Dropout applies
to the adapter input in forwards that record a graph (updates, SFT), not in sampling or no-grad
scoring. Sequence parallelism and Transformer Engine's fused norm+linear (whose normalised input
never leaves the kernel) are refused by name; experts of a mixture-of-experts MLP are not adapted.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from stabledrl_mcore.config.checks import LORA_TARGETS
from stabledrl_mcore.models.presets import DLLMConfig

PROJECTIONS: Dict[str, Tuple[str, Optional[str]]] = dict(
    zip(
        LORA_TARGETS,  # q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
        [
            ("self_attention.linear_qkv", "q"),
            ("self_attention.linear_qkv", "k"),
            ("self_attention.linear_qkv", "v"),
            ("self_attention.linear_proj", None),
            ("mlp.linear_fc1", "gate"),
            ("mlp.linear_fc1", "up"),
            ("mlp.linear_fc2", None),
        ],
    )
)
"""Target name -> (the Megatron linear of a layer that holds it, its part of a fused output)."""

ALL_LINEAR = LORA_TARGETS
PART_ORDER = {"self_attention.linear_qkv": ("q", "k", "v"), "mlp.linear_fc1": ("gate", "up")}
ROW_PARALLEL = ("self_attention.linear_proj", "mlp.linear_fc2")
ADAPTER_KEY = re.compile(r"\.lora\.(a|b|b_[a-z]+)$")
"""State-dict keys of adapter weights match this (``a``; ``b`` or one ``b_<part>`` per fused part)."""


class LoRAError(ValueError):
    """A LoRA setting that cannot apply to this model."""


@dataclass(frozen=True)
class LoRASettings:
    """``model.lora`` as the model layer reads it."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: Tuple[str, ...] = ALL_LINEAR
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def resolve_targets(targets: Sequence[str]) -> Tuple[str, ...]:
    """Targets in :data:`PROJECTIONS` order; ``all-linear`` is every projection."""
    names = list(ALL_LINEAR) if list(targets) == ["all-linear"] else list(targets)
    unknown = [t for t in names if t not in PROJECTIONS]
    if unknown or not names:
        raise LoRAError(
            f"model.lora.targets: unknown {unknown or 'empty list'}; use any of {list(ALL_LINEAR)} or [all-linear]"
        )
    return tuple(t for t in ALL_LINEAR if t in names)


def module_parts(targets: Sequence[str]) -> Dict[str, Tuple[str, ...]]:
    """Megatron linear (within a layer) -> its targeted parts, in the fused output's order."""
    out: Dict[str, List[str]] = {}
    for target in resolve_targets(targets):
        module, part = PROJECTIONS[target]
        out.setdefault(module, []).append(part or "all")
    return {m: tuple(p for p in PART_ORDER.get(m, ("all",)) if p in parts) for m, parts in out.items()}


def local_output_parts(module: str, cfg: DLLMConfig, tp_size: int, tp_rank: int) -> List[str]:
    """The part (``q``/``k``/``v``, ``gate``/``up``) of each output row this TP rank's shard of a fused
    column-parallel linear holds: ``linear_qkv`` rows are grouped per KV group ``g`` as
    ``[q heads of g; k_g; v_g]`` and split over TP by whole groups (convert/mappings.py ``QKV``);
    ``linear_fc1`` holds ``[gate_r; up_r]`` (Megatron's SwiGLU sharding)."""
    if module == "self_attention.linear_qkv":
        groups, d = cfg.num_query_groups, cfg.kv_channels
        per_group = ["q"] * (cfg.num_attention_heads // groups * d) + ["k"] * d + ["v"] * d
        return per_group * (groups // tp_size)
    if module == "mlp.linear_fc1":
        width = cfg.ffn_hidden_size // tp_size
        return ["gate"] * width + ["up"] * width
    raise KeyError(module)


class LoRAAdapter(torch.nn.Module):
    """``scale * B_p (A_p dropout(x))`` for each targeted part ``p`` of one Megatron linear.

    ``a`` stacks the parts' ``A`` (``[k r, in]``, split along ``in`` beside a row-parallel base);
    a column-parallel base has one ``b_<part>`` ``[rows of p on this rank, r]`` per part (its rows in
    the base's row order: each part's rows on a TP rank are one contiguous slice of that part), whose
    outputs land on their rows of the fused output through ``index``; a row-parallel base has ``b``
    ``[out, r]``."""

    def __init__(
        self,
        *,
        full_in: int,
        rows_parts: Optional[List[str]],
        parts: Tuple[str, ...],
        settings: LoRASettings,
        tp_group,
        name: str,
        dtype: torch.dtype,
        device: torch.device,
        out_features: int,
    ):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        tp_size, tp_rank = tp_group.size(), tp_group.rank()
        r = settings.rank
        self.row_parallel = rows_parts is None
        self.parts, self.rank, self.tp_group, self.out_features = parts, r, tp_group, out_features
        self.scale, self.dropout, self.enabled = settings.scale, settings.dropout, True
        # the full A of every part from a generator of (seed, layer, module): the same at any TP size
        generator = torch.Generator(device="cpu").manual_seed(_name_seed(settings.seed, name))
        bound = 1.0 / math.sqrt(full_in)  # PEFT: kaiming_uniform_(a=sqrt(5)) on [r, in]
        full_a = torch.empty(len(parts) * r, full_in).uniform_(-bound, bound, generator=generator)
        if self.row_parallel:
            full_a = full_a.chunk(tp_size, dim=1)[tp_rank]
        self.a = torch.nn.Parameter(full_a.to(device=device, dtype=dtype).contiguous())
        set_tensor_model_parallel_attributes(self.a, self.row_parallel, 1, 1)
        if self.row_parallel:
            self.b = torch.nn.Parameter(torch.zeros(out_features, r, device=device, dtype=dtype))
            self.register_buffer("index", None, persistent=False)
            self.part_rows: Dict[str, torch.Tensor] = {}
            return
        self.part_rows = {p: torch.tensor([i for i, q in enumerate(rows_parts) if q == p]) for p in parts}
        for part in parts:
            b = torch.nn.Parameter(torch.zeros(len(self.part_rows[part]), r, device=device, dtype=dtype))
            set_tensor_model_parallel_attributes(b, True, 0, 1)
            self.register_parameter(f"b_{part}", b)
        self.register_buffer("index", torch.cat([self.part_rows[p] for p in parts]).to(device), persistent=False)

    def part_b(self, part: str) -> torch.Tensor:
        return self.b if self.row_parallel else getattr(self, f"b_{part}")

    def _h(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if self.dropout > 0 and self.training and torch.is_grad_enabled():
            x = F.dropout(x, self.dropout, training=True)
        h = F.linear(x, self.a)
        if self.tp_group.size() > 1:
            region = (
                reduce_from_tensor_model_parallel_region if self.row_parallel else copy_to_tensor_model_parallel_region
            )
            h = region(h, self.tp_group)
        return h * self.scale

    def add_to(self, out, x: torch.Tensor):
        """``out`` (the base linear's output: a tensor, or the local fc1's ``(gate, up)``) plus the
        adapters' outputs on their rows."""
        h, r = self._h(x), self.rank
        if self.row_parallel:
            return out + F.linear(h, self.b)
        pieces = [F.linear(h[..., j * r : (j + 1) * r], self.part_b(p)) for j, p in enumerate(self.parts)]
        if isinstance(out, tuple):  # (gate, up): each part's rows are the whole of its own tensor
            halves = dict(zip(("gate", "up"), out))
            for part, piece in zip(self.parts, pieces):
                halves[part] = halves[part] + piece
            return halves["gate"], halves["up"]
        return out.index_add(-1, self.index, torch.cat(pieces, dim=-1))

    def delta_weight(self) -> torch.Tensor:
        """``scale * B_p A_p`` on each part's rows: this rank's shard of the change to the base weight."""
        r = self.rank
        blocks = [self.part_b(p).float() @ self.a[j * r : (j + 1) * r].float() for j, p in enumerate(self.parts)]
        if self.row_parallel:
            return blocks[0] * self.scale
        full = blocks[0].new_zeros(self.out_features, self.a.shape[1])
        return full.index_add(0, self.index, torch.cat(blocks)) * self.scale

    def sharded_entries(self, prefix: str, sharded_offsets, metadata) -> dict:
        """Megatron sharded tensors of ``a`` and the ``b``'s, each split over TP as it is."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        params = {name: param for name, param in self.named_parameters()}
        axes = {"a": 1} if self.row_parallel else {f"b_{p}": 0 for p in self.parts}
        return make_sharded_tensors_for_checkpoint(
            params,
            prefix,
            axes,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )


def _name_seed(seed: int, name: str) -> int:
    digest = 0
    for ch in f"{seed}:{name}":
        digest = (digest * 1_000_003 + ord(ch)) % (2**61 - 1)
    return digest


class _LoRALinear:
    """Mixin put in front of a Megatron linear's class by :func:`apply_lora`: its output plus the
    adapter's; its sharded state dict with the adapter's entries split correctly."""

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        adapter = self.lora
        if not adapter.enabled:
            return out, bias
        return adapter.add_to(out, input_), bias  # the local fc1 may hand gate and up apart (.gated_mlp)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        entries = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        entries = {k: v for k, v in entries.items() if not k.startswith(prefix + "lora.")}
        entries.update(self.lora.sharded_entries(prefix + "lora.", sharded_offsets, metadata))
        return entries


_CLASSES: Dict[type, type] = {}


def _lora_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"LoRA{base.__name__}", (_LoRALinear, base), {})
    return _CLASSES[base]


def apply_lora(model: torch.nn.Module, settings: LoRASettings) -> int:
    """Attach adapters to ``model``'s targeted linears (this pipeline stage's layers), freeze every
    other parameter and return the number of adapter parameters on this rank."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    cfg = model.dllm_config
    parts_of = module_parts(settings.targets)
    if cfg.is_moe and parts_of.keys() & {"mlp.linear_fc1", "mlp.linear_fc2"}:
        raise LoRAError(
            "model.lora.targets: the experts of a mixture-of-experts MLP take no adapters; target attention"
        )
    if model.config.sequence_parallel:
        raise LoRAError("model.lora does not support sequence parallelism yet")
    model.requires_grad_(False)
    count = 0
    for layer in model.decoder.layers:
        for module_name, parts in parts_of.items():
            parent_name, child_name = module_name.split(".")
            linear = getattr(getattr(layer, parent_name), child_name)
            if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                raise LoRAError(
                    f"model.lora: {module_name} is a {type(linear).__name__}, not a Megatron parallel linear "
                    "(LoRA runs on the local layer spec; Transformer Engine's fused norm+linear keeps the "
                    "normalised input the adapter needs inside its kernel)"
                )
            row = module_name in ROW_PARALLEL
            tp = linear.tp_group
            weight = linear.weight
            rows_parts = None if row else local_output_parts(module_name, cfg, tp.size(), tp.rank())
            linear.lora = LoRAAdapter(
                full_in=weight.shape[1] * (tp.size() if row else 1),
                rows_parts=rows_parts,
                parts=parts,  # ("all",) beside a row-parallel base (module_parts)
                settings=settings,
                tp_group=tp,
                name=f"layers.{layer.layer_number - 1}.{module_name}",
                dtype=weight.dtype,
                device=weight.device,
                out_features=weight.shape[0],
            )
            linear.__class__ = _lora_class(type(linear))
            count += sum(p.numel() for p in linear.lora.parameters())
    model.lora_settings = settings
    return count


def adapters(model: torch.nn.Module) -> Iterator[Tuple[str, LoRAAdapter]]:
    """``(name of the linear, its adapter)`` of every adapted linear in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, _LoRALinear):
            yield name, module.lora


def has_lora(model: torch.nn.Module) -> bool:
    return getattr(model, "lora_settings", None) is not None


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Run ``model`` as its frozen base inside the block (every adapter off)."""
    found = [adapter for _, adapter in adapters(model)]
    saved = [adapter.enabled for adapter in found]
    for adapter in found:
        adapter.enabled = False
    try:
        yield model
    finally:
        for adapter, was in zip(found, saved):
            adapter.enabled = was


class BaseWithoutAdapters:
    """The base model of a LoRA ``model`` as a policy (the KL reference, the drift metric's initial
    policy): run it through :func:`~stabledrl_mcore.engine.expert.phase_model`, which switches the
    adapters off for the block. Holds no weights of its own."""

    def __init__(self, model: torch.nn.Module):
        self.model = model


@torch.no_grad()
def merge_adapters(model: torch.nn.Module, *, detach: bool = False) -> None:
    """Fold every adapter into its base weight (``W += scale (B * mask) A``, this rank's shard) and
    switch it off: ``model`` then computes what the adapted model did. ``detach``: also remove the
    adapters (the model is a plain one again, e.g. the base of a new LoRA run)."""
    for _, module in model.named_modules():
        if isinstance(module, _LoRALinear):
            if module.lora.enabled:
                delta = module.lora.delta_weight()
                module.weight.copy_((module.weight.float() + delta).to(module.weight.dtype))
                module.lora.enabled = False
            if detach:
                del module.lora
                module.__class__ = module.__class__.__mro__[2]  # (LoRA<Base>, _LoRALinear, <Base>, ...)
    if detach:
        model.lora_settings = None


def is_adapter_key(key: str) -> bool:
    return ADAPTER_KEY.search(key) is not None


def checkpointed(model):
    """What a training checkpoint holds of ``model``: all of it, or with LoRA its adapters only."""
    return AdapterCheckpointView(model) if has_lora(model) else model


class AdapterCheckpointView:
    """What a checkpoint of a LoRA run saves and loads of ``model``: the adapters only (the base
    comes from ``model.checkpoint`` or the seeded initialisation, as for the KL reference)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def sharded_state_dict(self, *args, **kwargs) -> dict:
        return {k: v for k, v in self.model.sharded_state_dict(*args, **kwargs).items() if is_adapter_key(k)}

    def load_state_dict(self, state_dict, strict: bool = False):
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        return [k for k in missing if is_adapter_key(k)], list(unexpected)

    def named_parameters(self):
        return [(k, v) for k, v in self.model.named_parameters() if is_adapter_key(k)]


def adapter_params_per_layer(cfg: DLLMConfig, tp: int, rank: int, targets: Sequence[str] = ("all-linear",)) -> int:
    """Adapter parameters of one layer on one TP rank (:class:`LoRAAdapter`'s shapes: a column
    linear's ``A [r, in]`` whole and ``B [out/tp, r]``; a row linear's ``A [r, in/tp]`` and ``B [out, r]``);
    the experts of a mixture of experts take none. The planner counts them."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    q, kv = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
    shapes = {  # target -> (in, out, row-parallel)
        "q_proj": (h, q, False),
        "k_proj": (h, kv, False),
        "v_proj": (h, kv, False),
        "o_proj": (q, h, True),
        "gate_proj": (h, f, False),
        "up_proj": (h, f, False),
        "down_proj": (f, h, True),
    }
    total = 0
    for target in resolve_targets(targets):
        if cfg.is_moe and PROJECTIONS[target][0].startswith("mlp."):
            continue
        fan_in, fan_out, row = shapes[target]
        total += rank * (fan_in // tp + fan_out) if row else rank * (fan_in + fan_out // tp)
    return total
