"""``_extra_state`` across layer specs: a checkpoint of one spec loads into a model of the other.

Transformer Engine modules carry an ``_extra_state`` entry (their FP8 scaling history,
``get_extra_state``/``set_extra_state``) that Megatron saves as a ``ShardedObject``. The local
spec has it on its linears too (Megatron's ``ColumnParallelLinear`` keeps one, ``None``, "for
compatibility with TE"), but not on its norms; TE 2.x's ``RMSNorm`` (q/k norms, the final norm)
and any fused module of a later TE may have one. So a checkpoint written with the local spec
(every conversion: ``mcore_io.build_shell``) lacks objects that a TE model asks for, and
``dist_checkpointing.load`` fails on the first ("Missing key in checkpoint state_dict ...
_extra_state/shard_0_4"); Megatron checks missing keys only inside that load.

:func:`drop_absent_extra_state` removes, *before* the load, exactly the ``_extra_state`` objects
the checkpoint does not hold (the module then keeps the state it was built with: TE starts its
FP8 history afresh, as a new run would), and :func:`check_model_fit` accepts those and nothing
else as missing after ``load_state_dict(strict=False)``. Objects the checkpoint holds and the
model does not ask for (a TE checkpoint loaded without TE) are never requested, so never read.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Set, Tuple

from stabledrl_mcore.checkpoint.trust import stored_objects

EXTRA_STATE = "_extra_state"


def stored_object_keys(path: str) -> Set[str]:
    """The ``ShardedObject`` keys (without their ``/shard_...`` suffix) that checkpoint ``path`` holds
    (its ``.metadata`` read by :mod:`.trust`'s restricted unpickler)."""
    return stored_objects(path)


def _is_extra_state_object(entry: Any) -> bool:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return isinstance(entry, ShardedObject) and entry.key.endswith(EXTRA_STATE)


def drop_absent_extra_state(sharded: Dict[str, Any], stored: Set[str]) -> Tuple[Dict[str, Any], List[str]]:
    """``(sharded without the _extra_state objects absent from stored, their state-dict keys)``.

    ``sharded``: a (nested) sharded state dict, e.g. ``{"model": model.sharded_state_dict()}``;
    ``stored``: :func:`stored_object_keys` of the checkpoint. The returned keys are relative to
    the top level of the innermost dict (``decoder.layers.0.self_attention.q_layernorm._extra_state``).
    """
    dropped: List[str] = []

    def walk(node: Dict[str, Any]) -> Dict[str, Any]:
        kept = {}
        for name, entry in node.items():
            if isinstance(entry, dict):
                kept[name] = walk(entry)
            elif _is_extra_state_object(entry) and entry.key not in stored:
                dropped.append(name)
            else:
                kept[name] = entry
        return kept

    return walk(sharded), dropped


def check_model_fit(
    missing: Iterable[str], unexpected: Iterable[str], dropped: Iterable[str], path: str, error
) -> None:
    """Raise ``error`` unless the only keys ``load_state_dict(strict=False)`` missed are ``dropped``
    (the _extra_state the checkpoint does not hold) and none were unexpected."""
    missing = sorted(set(missing) - set(dropped))
    unexpected = sorted(unexpected)
    if missing or unexpected:
        raise error(
            f"checkpoint {path} does not fit the model: missing {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + f", unexpected {unexpected[:5]}"
        )
