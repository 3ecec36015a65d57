"""Megatron's distributed optimizer resumed at another pipeline-parallel size (same TP).

Its ``dp_reshardable`` state (:mod:`.optimizer_state`) is one 1-D tensor per grad bucket and
state name (fp32 main params, ``exp_avg``, ``exp_avg_sq``) per model-parallel rank, cut along
buckets that hold other parameters at another PP size. At save, :func:`bucket_map` records in
the format file, for every model-parallel rank and bucket, the saved tensor key and each
parameter's layout-independent name (the key of its sharded tensor with its offsets in the
global tensor: the global layer number, the TP shard) with its ``[start, end)`` in the bucket,
plus the keys of the small common state (param groups, Adam's step). At a layout change,
:func:`plan` finds for every parameter range this rank's optimizer shard owns the contiguous
range of the old bucket tensor that holds it, and :func:`load` reads just those ranges
(``dist_checkpointing`` reads sub-ranges of a saved 1-D tensor), straight into this rank's
state tensors, plus the old common state: no rank gathers the optimizer state or holds a
second copy of its shard. The values are read as saved: bit for bit.

Not covered (refused in one line by :mod:`.optimizer_state`): a different tensor-parallel size
(parameters would have to be re-sliced across ranks), checkpoints written before the map, and
Megatron's precision-aware optimizer (its state is stored scaled). The param groups'
hyper-parameters come from the old checkpoint, as on Megatron's own path (the trainer then
applies the current config's and the LR schedule's).

Built on :mod:`.optimizer_state` (the format record, the compatibility check, the torch-Adam
adapter), which never imports or calls this module.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from stabledrl_mcore.checkpoint.optimizer_state import (
    MAP_FIELD,
    OptimizerFormatError,
    all_gather_objects,
    distributed_parts,
    inner_optimizers,
    load_optimizer_state,
    loaded_parts,
    prepare_for_checkpoint,
)
from stabledrl_mcore.checkpoint.trust import load_sharded


def parameter_names(model_sharded_state_dict: dict) -> Dict[int, str]:
    """``id(parameter)`` -> a name that does not depend on the PP layout: the key of the
    parameter's sharded tensor and its offsets in the global tensor (the layer axis that
    Megatron prepends for stacked layers, the TP shard)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    names: Dict[int, str] = {}
    for value in nested_values(model_sharded_state_dict):
        if not isinstance(getattr(value, "data", None), torch.Tensor) or id(value.data) in names:
            continue
        if isinstance(value, ShardedTensorFactory):  # e.g. SwiGLU's fc1: the tensors it builds
            offsets = [tuple(t.global_offset) for t in nested_values(value.build()) if isinstance(t, ShardedTensor)]
        elif isinstance(value, ShardedTensor):
            offsets = [tuple(value.global_offset)]
        else:
            continue
        names[id(value.data)] = f"{value.key}@{';'.join(','.join(map(str, o)) for o in offsets)}"
    return names


# ---------------------------------------------------------------------------- save
def _local_map(optimizer, model_sharded_state_dict: dict, optimizer_sharded_state_dict) -> Optional[dict]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    names = parameter_names(model_sharded_state_dict)
    parts = loaded_parts(optimizer, optimizer_sharded_state_dict)
    out: Dict[str, Any] = {}
    for index, opt in distributed_parts(optimizer):
        if opt.data_parallel_group.rank() != 0:  # every DP rank of a model-parallel rank has the same map
            continue
        part, buckets = parts[index], []
        for gbuf_idx, ranges in enumerate(opt.gbuf_ranges):
            buffer = opt.buffers[gbuf_idx]
            for dtype, per_bucket in ranges.items():
                saved = part["param_state"][gbuf_idx][dtype]
                for bucket_idx in range(len(per_bucket)):
                    bucket = buffer.buckets[bucket_idx]
                    tensors = {k: v for k, v in saved[bucket_idx][0].items() if isinstance(v, ShardedTensor)}
                    prefixes = {v.key.rsplit(".", 1)[0] for v in tensors.values()}
                    params = []
                    for param, (start, end, owner) in buffer.param_index_map.items():
                        if owner != bucket_idx:
                            continue
                        if id(param) not in names:
                            return None  # a parameter without a sharded tensor: no map, no reshard
                        params.append([names[id(param)], start - bucket.offset, end - bucket.offset])
                    assert len(prefixes) == 1, prefixes
                    buckets.append(
                        {
                            "key": prefixes.pop(),
                            "numel": int(bucket.numel_unpadded),
                            "states": sorted(k.rsplit(".", 1)[1] for k in (v.key for v in tensors.values())),
                            "params": sorted(params, key=lambda p: p[1]),
                        }
                    )
        common = {name: value.key for name, value in part.items() if isinstance(value, ShardedObject)}
        out[f"{index}:{opt.data_parallel_group_idx}"] = {"buckets": buckets, "common": common}
    return out


def bucket_map(optimizer, model_sharded_state_dict: dict, optimizer_sharded_state_dict) -> Optional[dict]:
    """Every model-parallel rank's bucket map (collective), or None if a rank cannot name a parameter."""
    merged: Dict[str, Any] = {}
    for part in all_gather_objects(_local_map(optimizer, model_sharded_state_dict, optimizer_sharded_state_dict)):
        if part is None:
            return None
        merged.update(part)
    return merged


# ---------------------------------------------------------------------------- load
def changes_layout(saved: Dict[str, Any]) -> bool:
    """Whether a distributed-optimizer checkpoint was saved at another TP/PP layout than this run's."""
    from megatron.core import parallel_state as ps

    return saved.get("kind") == "distributed" and (
        (saved.get("tensor_parallel"), saved.get("pipeline_parallel"))
        != (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
    )


def _old_locations(saved: Dict[str, Any], index: int) -> Dict[str, Tuple[dict, int, int]]:
    """Parameter name -> (old bucket, start, end) over every old model-parallel rank of inner ``index``."""
    found: Dict[str, Tuple[dict, int, int]] = {}
    for key in _old_groups(saved, index):
        for bucket in saved[MAP_FIELD][key]["buckets"]:
            for name, start, end in bucket["params"]:
                found.setdefault(name, (bucket, start, end))  # a tied copy holds the same state
    return found


def _local_plan(optimizer, model_sharded_state_dict: dict, saved: Dict[str, Any], path: str):
    """``(plan, problem)``: per inner optimizer, ``(model_param, {state: (key, numel, offset)}, size)``."""
    names = parameter_names(model_sharded_state_dict)
    plan: Dict[int, List[Any]] = {}
    for index, opt in distributed_parts(optimizer):
        if getattr(opt.config, "use_precision_aware_optimizer", False):
            return None, (
                f"checkpoint {path}: the precision-aware distributed optimizer cannot be resumed "
                f"at another layout; resume at tensor_parallel={saved.get('tensor_parallel')} "
                f"pipeline_parallel={saved.get('pipeline_parallel')}"
            )
        old = _old_locations(saved, index)
        items = []
        for ranges in opt.gbuf_ranges:
            for per_bucket in ranges.values():
                for bucket_ranges in per_bucket:
                    for param, range_map in bucket_ranges["param_map"].items():
                        name = names.get(id(param))
                        if name is None or name not in old:
                            return None, (
                                f"checkpoint {path} holds no distributed-optimizer state for "
                                f"parameter {name or '<unnamed>'}: the model differs; resume with "
                                f"the model it was saved with"
                            )
                        bucket, start, end = old[name]
                        if end - start != param.numel():
                            return None, (
                                f"checkpoint {path}: parameter {name} has {end - start} elements "
                                f"there, {param.numel()} here; resume with the saved model config"
                            )
                        missing = sorted({"param", "exp_avg", "exp_avg_sq"} - set(bucket["states"]))
                        if missing:
                            return None, (
                                f"checkpoint {path} has no {', '.join(missing)} state for {name}; "
                                f"resume with the optimizer it was saved with"
                            )
                        sub = range_map["param"]
                        items.append(
                            (
                                param,
                                {
                                    k: (f"{bucket['key']}.{k}", bucket["numel"], start + sub.start)
                                    for k in bucket["states"]
                                },
                                sub.size,
                            )
                        )
        plan[index] = items
    return plan, None


def plan(optimizer, model_sharded_state_dict: dict, saved: Dict[str, Any], path: str):
    """What each rank reads at a layout change; raises the first rank's problem on every rank."""
    local, problem = _local_plan(optimizer, model_sharded_state_dict, saved, path)
    problems = [p for p in all_gather_objects(problem) if p]
    if problems:
        raise OptimizerFormatError(problems[0])
    return local


def _old_groups(saved: Dict[str, Any], index: int) -> List[str]:
    return sorted((k for k in saved[MAP_FIELD] if k.split(":")[0] == str(index)), key=lambda k: int(k.split(":")[1]))


def _common_request(optimizer, saved: Dict[str, Any]) -> dict:
    """The small common state (param groups, Adam's step) of every old model-parallel rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {
        index: [
            {
                name: ShardedObject(key, None, (1,), (0,), replica_id=0)
                for name, key in saved[MAP_FIELD][group]["common"].items()
            }
            for group in _old_groups(saved, index)
        ]
        for index, _ in distributed_parts(optimizer)
    }


def _range_request(optimizer, local_plan) -> dict:
    """This rank's ranges of the old bucket tensors, read into its own (allocated) state tensors."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    request: Dict[int, List[Dict[str, Any]]] = {}
    for index, opt in distributed_parts(optimizer):
        ranges = []
        for param, states, size in local_plan[index]:
            current = opt._get_main_param_and_optimizer_states(param)
            for k in states:
                assert current[k].shape == (size,) and current[k].is_contiguous(), (k, current[k].shape, size)
            ranges.append(
                {
                    k: ShardedTensor(
                        key,
                        current[k],
                        current[k].dtype,
                        (size,),
                        (numel,),
                        (offset,),
                        axis_fragmentations=None,
                        replica_id=0,
                    )
                    for k, (key, numel, offset) in states.items()
                }
            )
        request[index] = ranges
    return request


def _merged_common(commons: List[dict]) -> dict:
    """The first old rank's common state, with the param groups only other ranks had."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    def ident(group):
        return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys)

    merged = dict(commons[0])
    merged["optimizer"] = dict(merged["optimizer"])
    groups = list(merged["optimizer"]["param_groups"])
    seen = {ident(g) for g in groups}
    for other in commons[1:]:
        for group in other["optimizer"]["param_groups"]:
            if ident(group) not in seen:
                seen.add(ident(group))
                groups.append(group)
    merged["optimizer"]["param_groups"] = groups
    return merged


def load(optimizer, local_plan, saved: Dict[str, Any], path: str) -> None:
    """Read this rank's ranges of the old bucket tensors and the old common state into ``optimizer``."""
    prepare_for_checkpoint(optimizer)
    # requests of parts of the saved state (every rank the same objects, sub-ranges of tensors):
    # Megatron's access check (each saved shard read exactly once) does not apply
    request = {"common": _common_request(optimizer, saved)}
    commons = load_sharded(request, path, validate_access_integrity=False)["common"]  # top level: str keys
    commons = {index: _merged_common(parts) for index, parts in commons.items()}
    inner = inner_optimizers(optimizer)
    load_optimizer_state(optimizer, commons[0] if len(inner) == 1 else commons)  # groups, step, state
    with torch.no_grad():  # fp32 main params are views of the model's parameters
        request = {"ranges": _range_request(optimizer, local_plan)}
        ranges = load_sharded(request, path, validate_access_integrity=False)["ranges"]
        for index, opt in distributed_parts(optimizer):
            for (param, _, _), tensors in zip(local_plan[index], ranges[index]):
                current = opt._get_main_param_and_optimizer_states(param)
                for name, value in tensors.items():
                    if value.data_ptr() != current[name].data_ptr():  # read elsewhere: copy it in
                        current[name].copy_(value)


def layout_note(saved_tp: int, saved_pp: int, saved_world: int) -> Optional[str]:
    """One line naming what changed at a resume at another TP/PP layout (None when none did)."""
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    if (saved_tp, saved_pp) == (tp, pp):
        return None
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    parts = [
        f"PP={pp} from a PP={saved_pp} checkpoint" if pp != saved_pp else f"PP={pp}",
        f"TP={tp}" if tp == saved_tp else f"TP={tp} (saved at TP={saved_tp})",
        f"world {saved_world} -> {world}",
    ]
    return f"resumed at {parts[0]} ({', '.join(parts[1:])}); weights and optimizer state resharded"
