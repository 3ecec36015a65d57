"""Training-state checkpoints through ``dist_checkpointing``, written atomically.

Layout of a checkpoint root::

    <root>/step_00000010/        a complete checkpoint (model + optimizer shards,
        train_state.json          step, data position, scheduler state, world layout)
        config.yaml               the resolved run config
        rng/rank00000.pt          each rank's RNG states (tensors, ints, lists: no pickled objects)
        optimizer_format.json     how the optimizer state is stored (:mod:`.optimizer_state`)
        checksums.json            size and SHA-256 of every other file (:mod:`.integrity`)
        ...dist_checkpointing files (.metadata, common.pt, metadata.json, __*.distcp)
    <root>/.tmp-step_00000012/   a save in progress (ignored by resume)
    <root>/abandoned-<UTC>-after-step_00000002/   later steps of a history a resume left
                                                 (:mod:`~stabledrl_mcore.engine.run_dir`; never pruned)

Every rank writes into the temporary directory; after a barrier rank 0 checks
that every file a resume reads is there, writes ``train_state.json``, the ranks
hash every file into ``checksums.json``, and rank 0 renames the directory to
``step_N``. A crash at any point (even SIGKILL of a rank mid-write) leaves either
the previous complete checkpoints or a ``.tmp-*`` directory that :func:`find_latest`
never returns. Only the newest ``keep_last`` complete checkpoints at the top of the
root are kept: those are the current history (a resume moves later steps aside).

A save refuses non-finite parameters (nothing is written); a load first verifies
the checksums, checks ``train_state.json`` against its directory name and the
loaded parameters for NaN/inf: each failure is a one-line :class:`CheckpointError`
naming the file or tensor. Trust (:mod:`.trust`): nothing in the directory can make a load
run code. ``.metadata`` is read with an allow-list unpickler (here, and inside Megatron's
load), the sharded objects in ``__*.distcp`` with ``weights_only=True`` first, ``common.pt``
with ``torch.load``'s default (``weights_only=True`` since torch 2.6; a refusal is one line),
the RNG files with ``weights_only=True``; the rest is JSON, YAML (``safe_load``) and raw
tensor bytes. The manifest may name only files of the checkpoint, which holds no symbolic
links (:func:`.integrity.verify_checksums`). Checksums detect corruption, not tampering.

Model and optimizer tensors are stored as sharded tensors, so a checkpoint
written at one TP/PP/DP layout loads at another (Megatron reshards on load).
The one exception is the state of Megatron's distributed optimizer, stored per
grad bucket (``dp_reshardable``): it loads at any data-parallel size, at another
pipeline-parallel size through its bucket map (:mod:`.optimizer_reshard`), but only at
the tensor-parallel size it was saved at; :mod:`.optimizer_state` records the
format and refuses any other resume with a one-line :class:`OptimizerFormatError`
(the model weights of such a checkpoint still load anywhere, e.g. as
``model.checkpoint``). A resume at another TP/PP layout prints one line saying so. RNG states are restored only when the world size is unchanged.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import yaml

from stabledrl_mcore.checkpoint import optimizer_reshard, optimizer_state
from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.checkpoint.extra_state import check_model_fit, drop_absent_extra_state, stored_object_keys
from stabledrl_mcore.checkpoint.integrity import (
    CheckpointError,
    check_finite,
    load_rng_file,
    save_rng_file,
    verify_checksums,
    write_checksums,
)
from stabledrl_mcore.checkpoint.optimizer_state import OptimizerFormatError  # noqa: F401 - re-exported
from stabledrl_mcore.checkpoint.trust import load_sharded, verify_metadata
from stabledrl_mcore.checkpoint.writers import save_sharded
from stabledrl_mcore.models.lora import LoRASettings

STEP_DIR = re.compile(r"^step_(\d{8})$")
STATE_FILE = "train_state.json"


@dataclass
class TrainState:
    """What besides tensors a resume needs."""

    step: int
    data_position: int = 0
    scheduler: Optional[Dict[str, Any]] = None
    world_size: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    extra: Optional[Dict[str, Any]] = None


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: str) -> List[str]:
    """Complete checkpoints under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, STATE_FILE)):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def find_latest(root: str) -> Optional[str]:
    """The newest complete checkpoint under ``root`` (``--resume auto``), or None. The top of a
    root holds only the current history (:mod:`~stabledrl_mcore.engine.run_dir` moves abandoned branches aside)."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _broadcast_str(value: str) -> str:
    if not torch.distributed.is_initialized():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def capture_rng_state() -> Dict[str, Any]:
    """Every RNG stream this process uses (restored by :func:`restore_rng_state`)."""
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(
    root: str,
    state: TrainState,
    model_sharded_state_dict: Callable[[], dict],
    *,
    optimizer=None,
    config_yaml: Optional[str] = None,
    rng_state: Optional[Dict[str, Any]] = None,
    keep_last: int = 3,
    extra_files: Optional[Dict[str, str]] = None,
    assets: Optional[Dict[str, str]] = None,
    extra_modules: Optional[Dict[str, Any]] = None,
    write_timeout_s: Optional[float] = None,
) -> str:
    """Write a complete checkpoint for ``state.step`` and prune old ones; returns its path.

    ``write_timeout_s``: the time limit of the shard writes (``checkpoint.write_timeout_s``; None =
    automatic, :func:`~.writers.write_limit_s`); a write past it is a :class:`CheckpointError`.

    ``extra_modules`` (name -> Megatron module) are saved beside the model under keys
    prefixed ``<name>.`` (e.g. a KL reference policy that is synced during training).

    ``model_sharded_state_dict`` returns the model's ``sharded_state_dict()``
    (a callable so that the optimizer state can be mapped onto it). Must be
    called on every rank. ``extra_files`` maps file names to text written beside the
    tensors (e.g. ``model_config.json``); ``assets`` maps a sub-directory name to a
    file or directory copied there (e.g. ``{"hf": tokenizer_dir}``), so a checkpoint
    is self-contained for ``load_model``, ``stabledrl eval`` and ``mcore-to-hf``.
    """

    final = os.path.join(root, step_dir_name(state.step))
    tmp = os.path.join(root, ".tmp-" + step_dir_name(state.step))
    sharded = {"model": model_sharded_state_dict()}
    check_finite(
        sharded_tensors(sharded["model"]),
        f"at step {state.step}: not saving a non-finite checkpoint (the previous ones are kept)",
    )
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)  # dist_checkpointing needs it to exist, and empty
    _barrier()
    fmt = optimizer_state.describe(optimizer)  # collective
    if optimizer is not None:
        sharded["optimizer"] = optimizer_state.sharded_optimizer_state(
            optimizer, sharded["model"], fmt, is_loading=False
        )
        if fmt["kind"] == "distributed":  # collective; what a resume at another PP size reads
            mapping = optimizer_reshard.bucket_map(optimizer, sharded["model"], sharded["optimizer"])
            if mapping is not None:
                fmt[optimizer_reshard.MAP_FIELD] = mapping
    for name, module in (extra_modules or {}).items():
        sharded[name] = module.sharded_state_dict(prefix=f"{name}.")
    save_sharded(sharded, tmp, timeout_s=write_timeout_s)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    save_rng_file(
        os.path.join(tmp, "rng", f"rank{_rank():05d}.pt"), rng_state if rng_state is not None else capture_rng_state()
    )
    _barrier()
    _fault_injection_pause()
    problem = ""
    if _rank() == 0:
        optimizer_state.write_format(tmp, fmt)
        problem = _missing_files(tmp, _world())
    problem = _broadcast_str(problem)  # every rank raises, none waits at the barrier below
    if problem:
        raise CheckpointError(problem)
    if _rank() == 0:
        for name, text in (extra_files or {}).items():
            _write_text(os.path.join(tmp, name), text)
        for name, src in (assets or {}).items():
            dst = os.path.join(tmp, name)
            if os.path.isdir(src):
                shutil.copytree(src, dst)
            else:
                os.makedirs(dst, exist_ok=True)
                shutil.copy2(src, dst)
        if config_yaml is not None:
            _write_text(os.path.join(tmp, "config.yaml"), config_yaml)
        _write_text(os.path.join(tmp, STATE_FILE), json.dumps(state.__dict__, indent=2))
    write_checksums(tmp)  # collective; starts when rank 0 has written everything above
    if _rank() == 0:
        if os.path.isdir(final):  # re-saving the same step (e.g. after a resume)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        for name in os.listdir(root):  # saves that a crash interrupted earlier
            if name.startswith(".tmp-step_"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    _barrier()
    return final


def sharded_tensors(sharded: Any, prefix: str = ""):
    """``(key, local tensor)`` of every sharded tensor (or factory) in a sharded state dict."""
    if isinstance(sharded, dict):
        values = sharded.items()
    elif isinstance(sharded, (list, tuple)):
        values = enumerate(sharded)
    else:
        return
    for name, value in values:
        if isinstance(value, (dict, list, tuple)):
            yield from sharded_tensors(value, f"{prefix}{name}.")
        elif isinstance(getattr(value, "data", None), torch.Tensor):
            yield getattr(value, "key", f"{prefix}{name}"), value.data


def _missing_files(directory: str, world: int) -> str:
    """'' if everything a resume reads is in ``directory`` (checked before it is committed)."""
    from megatron.core.dist_checkpointing.core import check_is_distributed_checkpoint

    missing = [] if check_is_distributed_checkpoint(directory) else ["dist_checkpointing metadata.json"]
    missing += [
        name
        for name in (".metadata", "common.pt", optimizer_state.FORMAT_FILE)
        if not os.path.isfile(os.path.join(directory, name))
    ]
    missing += [
        f"rng/rank{r:05d}.pt"
        for r in range(world)
        if not os.path.isfile(os.path.join(directory, "rng", f"rank{r:05d}.pt"))
    ]
    if not missing:
        return ""
    return (
        f"checkpoint save into {directory} is incomplete (missing {', '.join(missing)}); "
        f"not committed, the previous checkpoints are kept"
    )


def _fault_injection_pause() -> None:
    """Tests set ``STABLEDRL_FAULT_PAUSE_BEFORE_COMMIT`` (seconds) to kill a save mid-way."""
    pause = float(os.environ.get("STABLEDRL_FAULT_PAUSE_BEFORE_COMMIT", "0") or 0)
    if pause > 0:
        time.sleep(pause)


def _write_text(path: str, text: str) -> None:
    with open(path + ".part", "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".part", path)


def read_train_state(path: str) -> TrainState:
    """``path/train_state.json``, checked: known fields, an int step that matches ``step_N``."""
    state_file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_file):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    try:
        with open(state_file) as handle:
            data = json.load(handle)
        state = TrainState(**data)
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"{state_file} is unreadable ({err}); the checkpoint is corrupt") from None
    if not isinstance(state.step, int) or isinstance(state.step, bool) or state.step < 0:
        raise CheckpointError(f"{state_file}: step {state.step!r} is not a step count; the checkpoint is corrupt")
    match = STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if match and int(match.group(1)) != state.step:
        raise CheckpointError(
            f"{state_file} says step {state.step} but its directory is "
            f"{os.path.basename(os.path.normpath(path))}; the checkpoint is corrupt "
            f"(or was renamed)"
        )
    return state


def load_checkpoint(
    path: str,
    model,
    *,
    optimizer=None,
    restore_rng: bool = True,
    extra_modules: Optional[Dict[str, Any]] = None,
    trust_unverified: bool = False,
) -> TrainState:
    """Load model (and optimizer, and ``extra_modules``) shards from ``path`` into the current layout.

    ``model`` is a module (or list of chunks) with ``sharded_state_dict()`` and
    ``load_state_dict()``. Returns the :class:`TrainState`. RNG streams are
    restored when the world size matches the one that saved. Verifies the
    checksums first (one without ``checksums.json`` only with ``trust_unverified``; links and
    FIFOs never) and the loaded parameters after (:class:`CheckpointError`).
    """
    path = _broadcast_str(path)
    verify_checksums(path, trust_unverified=trust_unverified)  # collective; before any file is read
    state = read_train_state(path)
    verify_metadata(path)  # before anything unpickles it
    rng_file = os.path.join(path, "rng", f"rank{_rank():05d}.pt")
    rng = (
        load_rng_file(rng_file) if (restore_rng and state.world_size == _world() and os.path.isfile(rng_file)) else None
    )
    chunks = model if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1:
        raise NotImplementedError("virtual pipeline chunks are not supported yet")
    fmt, reshard = None, None
    if optimizer is not None:
        fmt = optimizer_state.read_format(path)
        optimizer_state.check_compatible(fmt, optimizer, path)  # collective, before any load
    sharded = {"model": chunks[0].sharded_state_dict()}
    if optimizer is not None and optimizer_reshard.changes_layout(fmt):  # another TP/PP: by bucket map
        reshard = optimizer_reshard.plan(optimizer, sharded["model"], fmt, path)  # collective
    elif optimizer is not None:
        sharded["optimizer"] = optimizer_state.sharded_optimizer_state(
            optimizer, sharded["model"], fmt, is_loading=True
        )
    for name, module in (extra_modules or {}).items():
        sharded[name] = module.sharded_state_dict(prefix=f"{name}.")
    # a TE run resumed without TE, or the reverse: only the _extra_state both sides hold is read
    sharded, dropped = drop_absent_extra_state(sharded, stored_object_keys(path))
    loaded = load_sharded(sharded, path)
    check_model_fit(*chunks[0].load_state_dict(loaded["model"], strict=False), dropped, path, CheckpointError)
    for name, module in (extra_modules or {}).items():
        fit = module.load_state_dict({k[len(name) + 1 :]: v for k, v in loaded[name].items()}, strict=False)
        check_model_fit(*fit, [k[len(name) + 1 :] for k in dropped if k.startswith(name + ".")], path, CheckpointError)
    named = list(chunks[0].named_parameters())
    for name, module in (extra_modules or {}).items():
        named += [(f"{name}.{k}", v) for k, v in module.named_parameters()]
    check_finite(named, f"after loading {path}: the checkpoint is corrupt")
    if reshard is not None:
        optimizer_reshard.load(optimizer, reshard, fmt, path)
    elif optimizer is not None:
        optimizer_state.load_optimizer_state(optimizer, loaded["optimizer"])
    if rng is not None:
        restore_rng_state(rng)
    note = optimizer is not None and optimizer_reshard.layout_note(  # the optimizer record knows best
        fmt.get("tensor_parallel", state.tensor_parallel),
        fmt.get("pipeline_parallel", state.pipeline_parallel),
        state.world_size,
    )
    if note and _rank() == 0:  # a resume at another layout says so once
        print(f"stabledrl: {note}", flush=True)
    return state


@dataclass(frozen=True)
class LoRARun:
    settings: LoRASettings
    base: str
    """The run's ``model.checkpoint`` (the weights the adapters were trained on)."""
    dtype: str = "fp32"
    """The run's ``model.dtype``: what the adapted model computed in (the merged export's default)."""


def read_lora_run(ckpt: str, base: Optional[str] = None) -> Optional[LoRARun]:
    """The LoRA settings and base of a training checkpoint (its ``config.yaml``; ``base`` replaces
    the saved ``model.checkpoint``), None when the checkpoint holds full weights."""
    path = os.path.join(ckpt, "config.yaml")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as handle:
            saved = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConversionError(f"{path} is unreadable ({err})") from None
    model = saved.get("model") or {}
    lora = model.get("lora") or {}
    if not lora.get("rank"):
        return None
    base = base or model.get("checkpoint")
    if not base:
        raise ConversionError(
            f"{ckpt} holds LoRA adapters of a randomly initialised base (model.checkpoint was None): "
            "there is no base to merge them into"
        )
    if not os.path.isdir(base):
        raise ConversionError(
            f"{ckpt} holds LoRA adapters only and their base model.checkpoint={base} is not a directory here: "
            f"put the base back there, or merge them into it where it is now with `stabledrl convert mcore-to-hf "
            f"--ckpt {ckpt} --lora-base DIR --out MERGED` and use MERGED"
        )
    settings = LoRASettings(
        int(lora["rank"]),
        float(lora.get("alpha", 16.0)),
        float(lora.get("dropout", 0.0)),
        tuple(lora.get("targets") or ["all-linear"]),
        seed=int((saved.get("parallel") or {}).get("seed", 0)),
    )
    return LoRARun(settings, base, str(model.get("dtype", "fp32")))
