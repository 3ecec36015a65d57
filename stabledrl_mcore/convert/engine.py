"""The one engine that applies a mapping table (:mod:`.mappings`) in both directions.

It works on *full* tensors in the TP=1 layout, whatever the parallel layout of
the model that will hold them: Megatron's ``torch_dist`` checkpoints store
global tensors and reshard on load, and :meth:`MappingEngine.shard_for_rank`
slices a full tensor for a live tensor-parallel rank when loading an HF
directory straight into a sharded model (experts: the caller names the global
expert, :func:`~.mappings.global_expert_name`, and passes the expert-TP rank).

Tensors are processed in groups (the embedding, then one transformer layer at
a time, then the final norm and LM head), and upstream tensors are read one by
one from memory-mapped safetensors (:class:`~.safetensors_io.SafetensorsReader`),
so the engine itself never holds more than one layer beyond what its caller keeps.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.convert.mappings import GatedMLP, Mapping, ModelTable, VocabRows, canonical_megatron_name
from stabledrl_mcore.convert.safetensors_io import Plan, SafetensorsReader
from stabledrl_mcore.models import DLLMConfig

Group = Tuple[str, List[Mapping]]


class MappingEngine:
    """Applies ``table`` for one model shape.

    ``tied``: the upstream LM head shares the embedding (read it from there; on
    export it is omitted when still equal to the embedding). ``padded_vocab``:
    rows of the Megatron embedding/head (default: ``cfg.padded_vocab_size(1)``).
    """

    def __init__(self, table: ModelTable, cfg: DLLMConfig, *, tied: bool = False, padded_vocab: Optional[int] = None):
        if table.arch != cfg.arch:
            raise ValueError(f"table {table.arch} does not fit a {cfg.arch} config")
        self.table, self.cfg, self.tied = table, cfg, tied
        self.padded_vocab = padded_vocab or cfg.padded_vocab_size(1)
        self._by_megatron = {m.megatron: m for _, group in self.groups() for m in group}

    # ----------------------------------------------------------------- structure
    def groups(self) -> List[Group]:
        """``[("embedding", ...), ("layer 0", ...), ..., ("head", ...)]`` with layer names filled in
        (an MoE layer's group holds its router and every expert)."""
        out: List[Group] = [("embedding", list(self.table.head))]
        experts = range(self.cfg.num_experts or 0) if self.table.expert else ()
        for i in range(self.cfg.num_layers):
            rows = [m.for_layer(i) for m in self.table.layer]
            rows += [m.for_layer(i, e) for e in experts for m in self.table.expert]
            out.append((f"layer {i}", rows))
        out.append(("head", list(self.table.tail)))
        return out

    def mapping(self, megatron_name: str) -> Mapping:
        """The row for a (global-layer, local- or TE-spec) Megatron parameter name."""
        name = canonical_megatron_name(megatron_name)
        if name not in self._by_megatron:
            raise ConversionError(
                f"Megatron parameter {megatron_name!r} has no row in the {self.table.arch} mapping table"
            )
        return self._by_megatron[name]

    def megatron_shape(self, mapping: Mapping) -> Tuple[int, ...]:
        shapes = list(mapping.hf_shapes(self.cfg).values())
        if isinstance(mapping, VocabRows):
            return (self.padded_vocab, self.cfg.hidden_size)
        return (sum(s[0] for s in shapes),) + tuple(shapes[0][1:])

    def _is_tied_head(self, mapping: Mapping, available) -> bool:
        return (
            isinstance(mapping, VocabRows) and mapping.tied_to is not None and self.tied and mapping.hf not in available
        )

    def expected_hf(self, available=()) -> Dict[str, Tuple[int, ...]]:
        """Upstream name -> shape of every tensor the source must hold."""
        out: Dict[str, Tuple[int, ...]] = {}
        for _, group in self.groups():
            for mapping in group:
                if not self._is_tied_head(mapping, available):
                    out.update(mapping.hf_shapes(self.cfg))
        return out

    def check_source(self, reader: SafetensorsReader) -> None:
        """Refuse a source with a missing, unexpected or wrongly shaped tensor (names them all)."""
        keys = set(reader.keys())
        expected = self.expected_hf(keys)
        problems: List[str] = []
        missing = [n for n in expected if n not in keys]
        unexpected = sorted(n for n in keys if n not in expected and not self.table.is_ignored(n))
        if missing:
            problems.append(f"missing tensor(s) {_few(missing)}")
        if unexpected:
            problems.append(f"unexpected tensor(s) {_few(unexpected)}")
        for name, shape in expected.items():
            if name in keys and reader.shape(name) != shape:
                problems.append(
                    f"tensor {name!r} has shape {list(reader.shape(name))}, expected {list(shape)} from config.json"
                )
        if problems:
            raise ConversionError(
                f"{reader.root} does not match its config.json ({self.cfg.arch}): " + "; ".join(problems)
            )

    # ------------------------------------------------------------ HF -> Megatron
    def to_megatron(
        self, mapping: Mapping, get: Callable[[str], torch.Tensor], dtype: Optional[torch.dtype] = None, available=None
    ) -> List[torch.Tensor]:
        """Row blocks of one full Megatron tensor (``dtype`` cast, upstream read via ``get``)."""
        tied = self._is_tied_head(mapping, available if available is not None else ())
        names = (mapping.tied_to,) if tied else mapping.hf_names()
        tensors = {}
        for hf_name in names:
            tensor = get(hf_name)
            tensors[mapping.hf if tied else hf_name] = tensor if dtype is None else tensor.to(dtype)
        return mapping.to_megatron(tensors, self.cfg, self.padded_vocab)

    def iter_megatron(
        self, reader: SafetensorsReader, dtype: Optional[torch.dtype] = None
    ) -> Iterator[Tuple[str, str, List[torch.Tensor]]]:
        """``(group, megatron name, row blocks)`` for every parameter, group by group."""
        keys = set(reader.keys())
        for group_name, group in self.groups():
            for mapping in group:
                yield group_name, mapping.megatron, self.to_megatron(mapping, reader.get, dtype, keys)

    # ------------------------------------------------------------ Megatron -> HF
    def to_hf(self, megatron_name: str, full: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        mapping = self.mapping(megatron_name)
        if tuple(full.shape) != self.megatron_shape(mapping) and not isinstance(mapping, VocabRows):
            raise ConversionError(
                f"Megatron tensor {megatron_name!r} has shape {list(full.shape)}, "
                f"expected {list(self.megatron_shape(mapping))}"
            )
        if isinstance(mapping, VocabRows) and full.shape[0] < self.cfg.vocab_size:
            raise ConversionError(
                f"Megatron tensor {megatron_name!r} has {full.shape[0]} rows, "
                f"fewer than the vocabulary ({self.cfg.vocab_size})"
            )
        return mapping.to_hf(full, self.cfg)

    def hf_plan(self, dtype: torch.dtype, *, omit_head: bool = False) -> Plan:
        """The upstream tensors an export writes, in write order (for :class:`SafetensorsWriter`)."""
        plan: Plan = []
        for _, group in self.groups():
            for mapping in group:
                if omit_head and isinstance(mapping, VocabRows) and mapping.tied_to:
                    continue
                plan.extend((n, s, dtype) for n, s in mapping.hf_shapes(self.cfg).items())
        return plan

    # ------------------------------------------------------------ TP slicing
    def shard_for_rank(
        self, megatron_name: str, blocks: List[torch.Tensor], param: torch.Tensor, tp_rank: int, tp_size: int
    ) -> torch.Tensor:
        """This rank's slice of a full tensor, following Megatron's partition attributes.

        Expert weights are sliced like the dense MLP over the *expert* tensor-parallel group
        (ETP, ``tp_rank``/``tp_size`` of that group); the router is replicated."""
        mapping = self.mapping(megatron_name)
        if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
            return blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        dim = param.partition_dim
        if isinstance(mapping, GatedMLP):  # each rank holds [gate_r; up_r]
            return torch.cat([b.chunk(tp_size, dim)[tp_rank] for b in blocks])
        full = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        return full.chunk(tp_size, dim)[tp_rank]


def _few(names: List[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
