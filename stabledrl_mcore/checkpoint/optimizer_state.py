"""Optimizer state in training checkpoints: format record, compatibility check, torch-Adam adapter.

:mod:`.state` saves the optimizer through Megatron's ``optimizer.sharded_state_dict``
and ``dist_checkpointing``. This module decides *how*, records it beside the tensors
(:data:`FORMAT_FILE`), refuses a checkpoint whose optimizer format the current
optimizer cannot read (one line: what differs and how to proceed), and adapts
Megatron's distributed optimizer to a plain ``torch.optim`` Adam.

Sharding type of Megatron's distributed optimizer: :data:`SHARDING_TYPE` =
``dp_reshardable``, passed explicitly as ``metadata={"distrib_optim_sharding_type": ...}``
on save and on load (with no metadata Megatron 0.16.1 picks ``fully_sharded_model_space``,
whose flattened ``ShardedTensor`` ranges its own ``dist_checkpointing`` refuses:
``CheckpointingException: ShardedTensor.flattened_range is not supported``). Each rank
writes its own contiguous shard of the grad-buffer-shaped state (fp32 main params,
``exp_avg``, ``exp_avg_sq``) into one 1-D tensor per bucket, at offsets that do not
depend on the data-parallel size (the DP-multiple padding at the end of a bucket is not
stored; with ``overlap_grad_reduce`` off each buffer is one bucket whatever the DP
size). Saving and loading therefore need no gather and no extra memory, and a
checkpoint loads at any data-parallel size, bit for bit. At another pipeline-parallel
size the buckets hold other parameters: the record also holds every model-parallel rank's
bucket map (which parameter lies where), and :mod:`.optimizer_reshard` reads each
parameter's range from the old buckets, again without a gather. A different
tensor-parallel size or parameter dtype, or a PP change of a checkpoint written before
the map, is refused with one line instead of a shape error inside Megatron.
``fully_reshardable`` would also reshard TP/PP, but gathers the whole optimizer state on every rank on save and on load (tens
of GB of host memory per rank at 8B), and its loader fails with torch Adam (below).

The adapter (:func:`prepare_for_checkpoint`, :func:`load_optimizer_state`). Megatron's
``DistributedOptimizer`` is written for TE/apex ``FusedAdam``, which keeps Adam's step
count in ``param_groups[i]["step"]``. Without TE/apex (``distrib_optimizer.HAVE_APEX_OR_TE``
False, e.g. on CPU) it wraps ``torch.optim.AdamW``, which keeps a 0-dim ``step`` tensor
per parameter, and Megatron's code paths for that case break in three ways:

1. ``DistributedOptimizer.state_dict()`` asserts that the torch state holds exactly one
   step value (``assert len(steps) == 1``). Before the first ``optimizer.step()`` the
   state is empty, so every *load* into a fresh optimizer fails
   (``sharded_state_dict(is_loading=True)`` calls ``state_dict()`` first), and so does
   a save before any update. FusedAdam has no such assert, and Megatron allocates its
   dummy state itself. Fix: give every shard parameter the state torch Adam would
   create lazily on its first update (``step`` 0, zero ``exp_avg``/``exp_avg_sq``),
   which changes nothing about that update.
2. The step count is lost on load. ``DistributedOptimizer.load_state_dict()`` puts the
   checkpoint's step (saved in the param groups) into *one* tensor shared by every
   parameter's state, and then ``load_parameter_state_from_dp_reshardable`` copies the
   load template's ``step`` (a non-persistent entry, i.e. the value from *before* the
   load) over it, for every key of the live state. A resume would restart Adam's bias
   correction from the old count, and the shared tensor would then advance once per
   parameter per update. Fix: after loading, give every parameter its own ``step``
   tensor holding the checkpoint's param-group step.
3. ``load_parameter_state_from_dp_reshardable`` copies into the main parameters without
   ``torch.no_grad()``; for fp32 models those are views of the model parameters
   (``requires_grad``), so the in-place copy raises. Fix: load under ``no_grad`` (the
   same on GPU).

4. ``get_megatron_optimizer`` builds plain SGD with ``init_state_fn=None``, and a
   non-distributed optimizer's ``sharded_state_dict(is_loading=True)`` calls it, so
   resuming an ``optim.name=sgd`` run fails with ``'NoneType' object is not callable``.
   Fix: momentum-free SGD (the only SGD we build) has no state; give it a no-op.

With TE/apex FusedAdam (GPU) Megatron's path is used as shipped; the adapter only turns
a float param-group ``step`` (written by torch Adam) into the int FusedAdam counts in,
so a checkpoint written on CPU resumes on GPU and vice versa (the tensors are the same:
main params, ``exp_avg``, ``exp_avg_sq``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

FORMAT_FILE = "optimizer_format.json"
FORMAT_VERSION = 1
SHARDING_TYPE = "dp_reshardable"
READABLE_SHARDING_TYPES = ("dp_reshardable",)
MAP_FIELD = "bucket_map"  # per-rank bucket contents (:mod:`.optimizer_reshard` fills it in)


class OptimizerFormatError(ValueError):
    """A checkpoint's optimizer state cannot be loaded into the current optimizer (one line)."""


# ---------------------------------------------------------------------------- inspection
def inner_optimizers(optimizer) -> List[Any]:
    """The Megatron optimizers inside a ``ChainedOptimizer`` (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _distributed_class():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer


def is_distributed(optimizer) -> bool:
    """True when (any part of) ``optimizer`` is Megatron's distributed optimizer."""
    cls = _distributed_class()
    return any(isinstance(o, cls) for o in inner_optimizers(optimizer))


def distributed_parts(optimizer) -> List[Tuple[int, Any]]:
    """``(index in inner_optimizers, optimizer)`` of each distributed part that holds state (no stubs)."""
    cls = _distributed_class()
    return [
        (index, opt)
        for index, opt in enumerate(inner_optimizers(optimizer))
        if isinstance(opt, cls) and not getattr(opt, "is_stub_optimizer", False)
    ]


def _torch_adam_step_layout(dist_opt) -> bool:
    """Whether Megatron takes its torch-Adam ('step' per parameter) path for ``dist_opt``."""
    from megatron.core.optimizer import distrib_optimizer

    inner = getattr(dist_opt, "optimizer", None)
    return not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def _base_name(optimizer) -> str:
    names = sorted({type(getattr(o, "optimizer", o)).__name__ for o in inner_optimizers(optimizer)})
    return "+".join(names)


def local_layout(optimizer) -> Dict[str, Any]:
    """This rank's distributed-optimizer bucket layout, keyed by model-parallel rank.

    ``dp_reshardable`` state is cut along these buckets: a checkpoint loads only where
    every bucket holds the same parameters (same TP/PP, model and parameter dtype).
    """
    layout: Dict[str, Any] = {}
    for index, opt in distributed_parts(optimizer):
        buffers = []
        for numels in opt.per_bucket_numel_unpadded:
            for (param_dtype, grad_dtype), buckets in numels.items():
                buffers.append(
                    {
                        "param_dtype": str(param_dtype).replace("torch.", ""),
                        "grad_dtype": str(grad_dtype).replace("torch.", ""),
                        "buckets": [int(n) for n in buckets],
                    }
                )
        layout[f"{index}:{opt.data_parallel_group_idx}"] = buffers
    return layout


def all_gather_objects(obj: Any) -> List[Any]:
    """Every rank's ``obj`` in rank order (collective; ``[obj]`` without torch.distributed)."""
    if not torch.distributed.is_initialized():
        return [obj]
    out: List[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def describe(optimizer) -> Dict[str, Any]:
    """The optimizer format of a checkpoint written by ``optimizer`` (collective: call on all ranks)."""
    if optimizer is None:
        return {"version": FORMAT_VERSION, "kind": "none"}
    from megatron.core import parallel_state as ps

    if not is_distributed(optimizer):
        return {
            "version": FORMAT_VERSION,
            "kind": "plain",
            "optimizer": _base_name(optimizer),
            "tensor_parallel": ps.get_tensor_model_parallel_world_size(),
            "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
        }

    layout: Dict[str, Any] = {}
    for part in all_gather_objects(local_layout(optimizer)):
        layout.update(part)
    torch_step = any(
        _torch_adam_step_layout(o) for o in inner_optimizers(optimizer) if isinstance(o, _distributed_class())
    )
    return {
        "version": FORMAT_VERSION,
        "kind": "distributed",
        "sharding_type": SHARDING_TYPE,
        "optimizer": _base_name(optimizer),
        "step_layout": "per_param_tensor" if torch_step else "param_groups",
        "data_parallel": ps.get_data_parallel_world_size(),
        "tensor_parallel": ps.get_tensor_model_parallel_world_size(),
        "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
        "layout": layout,
    }


def write_format(directory: str, fmt: Dict[str, Any]) -> None:
    path = os.path.join(directory, FORMAT_FILE)
    with open(path + ".part", "w") as handle:
        json.dump(fmt, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".part", path)


def read_format(directory: str) -> Dict[str, Any]:
    """The recorded optimizer format; checkpoints from before the record hold a plain optimizer."""
    path = os.path.join(directory, FORMAT_FILE)
    if not os.path.isfile(path):
        return {"version": 0, "kind": "plain", "optimizer": "unknown"}
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError) as err:
        raise OptimizerFormatError(f"cannot read {path}: {err}") from None


def metadata_for(fmt: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``metadata=`` for ``optimizer.sharded_state_dict`` under a recorded format."""
    if fmt.get("kind") != "distributed":
        return None
    return {"distrib_optim_sharding_type": fmt["sharding_type"]}


# ---------------------------------------------------------------------------- compatibility
_FRESH = "to start the optimizer afresh from these weights, train with model.checkpoint={path} and no resume"


def _local_incompatibility(saved: Dict[str, Any], optimizer, path: str) -> Optional[str]:
    fresh = _FRESH.format(path=path)
    kind = saved.get("kind")
    if kind == "none":
        return f"checkpoint {path} holds no optimizer state; {fresh}"
    current = "distributed" if is_distributed(optimizer) else "plain"
    if kind not in ("plain", "distributed"):
        return f"checkpoint {path} records an unknown optimizer format {kind!r} in {FORMAT_FILE}"
    if kind != current:
        want = "true" if kind == "distributed" else "false"
        names = {
            "distributed": "Megatron's distributed (ZeRO-1) optimizer",
            "plain": "the plain (non-distributed) Megatron optimizer",
        }
        return (
            f"checkpoint {path} holds the state of {names[kind]} but this run uses "
            f"{names[current]}; resume with optim.distributed={want}, or {fresh}"
        )
    saved_name, name = saved.get("optimizer", "unknown"), _base_name(optimizer)
    adam = {"Adam", "AdamW", "FusedAdam"}
    if (
        saved_name != "unknown"
        and saved_name != name
        and not (set(saved_name.split("+")) <= adam and set(name.split("+")) <= adam)
    ):
        return (
            f"checkpoint {path} holds {saved_name} optimizer state but this run uses {name}; "
            f"resume with the same optim.name, or {fresh}"
        )
    if kind == "plain":
        return None
    sharding = saved.get("sharding_type")
    if sharding not in READABLE_SHARDING_TYPES:
        return (
            f"checkpoint {path} stores the distributed optimizer as {sharding!r}, which this "
            f"version cannot read (readable: {', '.join(READABLE_SHARDING_TYPES)})"
        )
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    if (saved.get("tensor_parallel"), saved.get("pipeline_parallel")) != (tp, pp):
        mapped = MAP_FIELD in saved
        if mapped and saved.get("tensor_parallel") == tp:
            return _dtype_change(saved, optimizer, path, fresh)  # :mod:`.optimizer_reshard` reads it
        why = (
            "reshards across data- and pipeline-parallel sizes, not tensor-parallel ones"
            if mapped
            else "reshards across data-parallel sizes only (this checkpoint predates the bucket map that "
            "a pipeline-parallel change needs)"
        )
        return (
            f"checkpoint {path} stores the distributed optimizer per grad bucket "
            f"(dp_reshardable), which {why}: it was saved at "
            f"tensor_parallel={saved.get('tensor_parallel')} pipeline_parallel="
            f"{saved.get('pipeline_parallel')}, this run has {tp}/{pp}; resume with that layout, "
            f"or {fresh}"
        )
    recorded = saved.get("layout") or {}
    for key, buffers in local_layout(optimizer).items():
        if key not in recorded:
            return (
                f"checkpoint {path} has no distributed-optimizer state for model-parallel "
                f"group {key}; resume with the layout it was saved at, or {fresh}"
            )
        if recorded[key] != buffers:
            return (
                f"checkpoint {path} was saved with a different distributed-optimizer bucket "
                f"layout ({_short(recorded[key])}) than this run's ({_short(buffers)}): the model "
                f"or model.dtype differs; resume with the saved model config and dtype, or {fresh}"
            )
    return None


def _dtype_change(saved: Dict[str, Any], optimizer, path: str, fresh: str) -> Optional[str]:
    """At a layout change the buckets differ; their parameter dtypes must not."""

    def dtypes(layout):
        return sorted({(b["param_dtype"], b["grad_dtype"]) for buffers in layout.values() for b in buffers})

    before, now = dtypes(saved.get("layout") or {}), dtypes(local_layout(optimizer))
    if now and not set(now) <= set(before):
        return (
            f"checkpoint {path} holds distributed-optimizer state of {before} parameters, this run's "
            f"are {now}: model.dtype differs; resume with the saved dtype, or {fresh}"
        )
    return None


def _short(buffers) -> str:
    return "; ".join(f"{b['param_dtype']}/{b['grad_dtype']} buckets {b['buckets']}" for b in buffers)


def check_compatible(saved: Dict[str, Any], optimizer, path: str) -> None:
    """Raise :class:`OptimizerFormatError` on every rank if any rank cannot load ``saved``.

    Collective (all ranks agree before any of them enters ``dist_checkpointing.load``).
    """
    problems = [p for p in all_gather_objects(_local_incompatibility(saved, optimizer, path)) if p]
    if problems:
        raise OptimizerFormatError(problems[0])


# ---------------------------------------------------------------------------- the adapter
def _scalar_dtype() -> torch.dtype:
    try:
        from torch.optim.optimizer import _get_scalar_dtype

        return _get_scalar_dtype()
    except ImportError:  # pragma: no cover - older torch
        return torch.float32


def _materialize_torch_adam_state(adam: torch.optim.Optimizer) -> int:
    """Give every parameter without state what torch Adam would create on its first step."""
    created = 0
    for group in adam.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for param in group["params"]:
            if adam.state.get(param):
                continue
            state = {
                "step": torch.zeros((), dtype=_scalar_dtype(), device=param.device if on_device else "cpu"),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            adam.state[param] = state
            created += 1
    return created


def prepare_for_checkpoint(optimizer) -> None:
    """Before ``sharded_state_dict`` (save or load): torch-Adam state exists (adapter item 1)."""
    if optimizer is None:
        return
    cls = _distributed_class()
    for opt in inner_optimizers(optimizer):
        if isinstance(opt, cls) and _torch_adam_step_layout(opt):
            _materialize_torch_adam_state(opt.optimizer)
        if getattr(opt, "init_state_fn", "unset") is None:  # adapter item 4
            _stateless_sgd(opt.optimizer)
            opt.init_state_fn = _no_state


def _stateless_sgd(inner) -> None:
    """Refuse anything but momentum-free torch SGD, whose state is empty (adapter item 4)."""
    if not isinstance(inner, torch.optim.SGD) or any(g.get("momentum", 0) for g in inner.param_groups):
        raise OptimizerFormatError(
            f"{type(inner).__name__} has no state initialiser; only momentum-free SGD can be checkpointed without one"
        )


def _no_state(optimizer, config=None) -> None:
    """Momentum-free SGD keeps no per-parameter state: nothing to create before a load."""


def sharded_optimizer_state(
    optimizer, model_sharded_state_dict: dict, fmt: Dict[str, Any], *, is_loading: bool
) -> dict:
    """``optimizer.sharded_state_dict`` in format ``fmt`` (the adapter applied)."""
    prepare_for_checkpoint(optimizer)
    return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata_for(fmt))


def loaded_parts(optimizer, loaded: Any) -> List[Any]:
    """The loaded state of each inner optimizer, in ``inner_optimizers`` order."""
    inner = inner_optimizers(optimizer)
    if len(inner) == 1:
        return [loaded]
    if isinstance(loaded, dict):
        return [v for _, v in sorted(loaded.items())]
    return list(loaded)


def _group_step(part: Any) -> Optional[float]:
    groups = (part.get("optimizer") or {}).get("param_groups", []) if isinstance(part, dict) else []
    steps = {group["step"] for group in groups if group.get("step") is not None}
    if len(steps) > 1:
        raise OptimizerFormatError(
            f"the checkpoint's optimizer param groups disagree on Adam's "
            f"step count ({sorted(steps)}); it cannot be resumed exactly"
        )
    return steps.pop() if steps else None


def _set_torch_steps(adam: torch.optim.Optimizer, step: float) -> None:
    """Every parameter its own ``step`` tensor holding ``step`` (adapter item 2)."""
    for group in adam.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for param in group["params"]:
            state = adam.state.get(param)
            if state:
                state["step"] = torch.tensor(
                    float(step), dtype=_scalar_dtype(), device=param.device if on_device else "cpu"
                )


def load_optimizer_state(optimizer, loaded: Any) -> None:
    """``optimizer.load_state_dict(loaded)`` with the adapter (items 2 and 3, step layout)."""
    cls = _distributed_class()
    fixes = []
    for opt, part in zip(inner_optimizers(optimizer), loaded_parts(optimizer, loaded)):
        if not isinstance(opt, cls):
            continue
        step = _group_step(part)
        if _torch_adam_step_layout(opt):
            if step is None:  # saved before FusedAdam's first update: Megatron's torch path needs one
                step = 0.0
                for group in part["optimizer"]["param_groups"]:
                    group["step"] = step
            fixes.append((opt.optimizer, step))
        elif step is not None:  # FusedAdam counts in ints; torch Adam wrote a float
            for group in part["optimizer"]["param_groups"]:
                if group.get("step") is not None:
                    group["step"] = int(group["step"])
    with torch.no_grad():
        optimizer.load_state_dict(loaded)
    for adam, step in fixes:
        _set_torch_steps(adam, step)
