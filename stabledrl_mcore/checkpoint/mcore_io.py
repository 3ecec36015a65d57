"""Model-only Megatron checkpoints (``torch_dist``): layout, metadata, save and load.

A converted checkpoint is a directory::

    <out>/stabledrl_model.json   marker + metadata, written last (see MARKER_FIELDS)
    <out>/model_config.json      the resolved DLLMConfig (DLLMConfig.to_dict())
    <out>/hf/                    non-weight upstream files: config.json, tokenizer
                                 files, generation_config.json, upstream *.py code
    <out>/.metadata, *.distcp, common.pt, metadata.json   dist_checkpointing files
    <out>/checksums.json         size and SHA-256 of every file above (:mod:`.integrity`),
                                 written last; a load without it is refused unless trusted

Tensors are stored under Megatron-Core's own sharded keys (e.g.
``decoder.layers.self_attention.linear_qkv.weight`` with a leading layer axis)
as *global* tensors, so the directory loads into :func:`build_model` at any
TP/PP (:func:`load_model_weights`; Megatron reshards on load, and the vocab
rows of embedding/head may differ in padding, ``allow_shape_mismatch``). The
layout recorded in the marker (``suggested_layout``) is advisory: the
conversion itself always runs in one process at TP=1/PP=1.

Unlike training checkpoints (:mod:`.state`, ``train_state.json``), these hold
no optimizer or RNG state; the marker is what makes the directory valid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import fnmatch
import json
import os
import random
import shutil
import socket
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import psutil
import torch

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.checkpoint.extra_state import check_model_fit, drop_absent_extra_state, stored_object_keys
from stabledrl_mcore.checkpoint.info import (
    DTYPE_NAMES,
    FORMAT,
    FORMAT_VERSION,
    HF_ASSETS,
    MARKER,
    MODEL_CONFIG,
    read_json,
    write_json,
)
from stabledrl_mcore.checkpoint.integrity import check_finite, verify_checksums, write_checksums
from stabledrl_mcore.checkpoint.trust import load_sharded, stored_tensors, verify_metadata
from stabledrl_mcore.checkpoint.writers import save_sharded
from stabledrl_mcore.common.version import __version__
from stabledrl_mcore.models import DLLMConfig, DLLMModel, dllm_layer_spec, place_model, to_transformer_config
from stabledrl_mcore.parallel import bootstrap

WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.gguf",
    "*.distcp",
)


def write_marker(
    out_dir: str,
    cfg: DLLMConfig,
    *,
    dtype: torch.dtype,
    tied: bool,
    layout: Dict[str, int],
    source: Dict[str, Any],
    padded_vocab: Optional[int] = None,
) -> None:
    """Write ``model_config.json`` then the marker (last: its presence means complete)."""

    write_json(os.path.join(out_dir, MODEL_CONFIG), cfg.to_dict())
    write_json(
        os.path.join(out_dir, MARKER),
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "arch": cfg.arch,
            "dtype": DTYPE_NAMES[dtype],
            "tied_embeddings": tied,
            "padded_vocab_size": padded_vocab or cfg.padded_vocab_size(1),
            "suggested_layout": layout,
            "source": source,
            "stabledrl_version": __version__,
        },
    )


# ------------------------------------------------------------------ atomic output
OWNER_SUFFIX = ".owner.json"  # beside each temporary output: who is writing it (stale ones are removed)
CLAIM_SUFFIX = ".claim.json"  # ``.<name>.claim.json`` beside ``out``: the one writer of ``out``


def claim_path(out: str) -> str:
    """Where the claim on ``out`` lives: ``.<name>.claim.json`` beside it."""
    out = os.path.abspath(out)
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}{CLAIM_SUFFIX}")


def _read_claim(fd: int) -> dict:
    try:
        owner = json.loads(os.read(fd, 1 << 16).decode() or "null")
    except (OSError, ValueError):
        owner = None
    return owner if isinstance(owner, dict) else {}


def _claim_is_stale(owner: dict) -> str:
    """Why a claim (or an owner file) of a process on this host is stale, or '' if it may still be
    written by its process: that pid no longer runs, or it runs a process started after the claim
    was made (the claimer died and its pid was reused). Another host's claim is never stale."""
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int):
        return ""
    if not _pid_alive(pid):
        return "which no longer runs"
    if _started_after(pid, owner.get("started")):
        return "whose pid now runs a process started after the claim"
    return ""


PID_START_SLACK_S = 2.0
"""How much later than a claim's time its process may seem to have started (a process's start time is
known to about a clock tick, the boot time it counts from to a second)."""


def _started_after(pid: int, claimed: Any) -> bool:
    """True if process ``pid`` started after the time ``claimed`` (so it cannot have made that claim);
    False if it started before, or either time is unknown."""
    if not isinstance(claimed, (int, float)) or isinstance(claimed, bool):
        return False
    try:
        return psutil.Process(pid).create_time() > float(claimed) + PID_START_SLACK_S
    except Exception:  # noqa: BLE001 - gone meanwhile, not readable: assume it is the claimer
        return False


def claim_output(out: str, tmp: str) -> str:
    """Claim ``out`` for this process (writing ``tmp``), atomically; returns the claim file.

    The claim appears complete or not at all (written aside, then hard-linked into place, which
    fails if a claim exists). A live claimer's claim is refused, naming its pid, its date and the fix;
    one of a process of this host that no longer runs, or whose pid now runs a process started after
    the claim (:func:`_claim_is_stale`), is taken over (under a lock on the stale file, so one taker
    wins), with a line saying so. Release with :func:`release_output`.
    """
    out, claim = os.path.abspath(out), claim_path(out)
    mine = f"{claim}.{os.getpid()}.new"
    program = os.path.basename(sys.argv[0] or "python")
    argv = " ".join(["stabledrl" if program == "__main__.py" else program] + sys.argv[1:])
    record = {"out": out, "tmp": tmp, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    write_json(mine, dict(record, command=argv))
    try:
        for _ in range(100):
            try:
                os.link(mine, claim)
                return claim
            except FileExistsError:
                pass
            try:
                fd = os.open(claim, os.O_RDONLY)
            except FileNotFoundError:
                continue  # released meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    same = os.stat(claim).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    continue  # replaced or released meanwhile: look again
                owner = _read_claim(fd)
                stale = _claim_is_stale(owner)
                if not stale:
                    raise ConversionError(_claimed_message(out, claim, owner))
                os.replace(mine, claim)
                print(
                    f"stabledrl: took over the claim on {out} from pid {owner.get('pid')}, {stale} "
                    f"(an interrupted conversion, {_since(owner)})",
                    file=sys.stderr,
                )
                return claim
            finally:
                os.close(fd)
        raise ConversionError(f"could not claim {out}: {claim} keeps changing; try again")
    finally:
        if os.path.exists(mine):
            os.remove(mine)


def _since(owner: dict) -> str:
    """``since YYYY-MM-DD HH:MM:SS UTC``: when the claim was made (with its date: a claim may be old)."""
    started = owner.get("started")
    if not isinstance(started, (int, float)) or isinstance(started, bool):
        return "since an unknown time"
    return time.strftime("since %Y-%m-%d %H:%M:%S UTC", time.gmtime(started))


def _claimed_message(out: str, claim: str, owner: dict) -> str:
    if not owner:
        return (
            f"output {out} is claimed by another conversion ({claim} is unreadable); choose another --out, "
            f"or remove {claim} if no conversion into {out} runs"
        )
    who = f"pid {owner.get('pid')}" + (f" on {owner.get('host')}" if owner.get("host") != socket.gethostname() else "")
    return (
        f"output {out} is being written by another conversion ({who}, {_since(owner)}: "
        f"{owner.get('command', '?')}); "
        f"wait for it to finish or choose another --out (remove {claim} only if that process is gone)"
    )


def release_output(out: str, tmp: str) -> None:
    """Remove the claim on ``out`` if it is this process's claim for ``tmp``."""
    claim = claim_path(out)
    try:
        fd = os.open(claim, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        owner = _read_claim(fd)
    finally:
        os.close(fd)
    if owner.get("pid") == os.getpid() and owner.get("tmp") == tmp and owner.get("host") == socket.gethostname():
        os.remove(claim)


def prepare_output(out: str, overwrite: bool, protect: Optional[str] = None) -> str:
    """Claim ``out`` (:func:`claim_output`), check it may be written and return a fresh temporary
    directory beside it.

    The directory ``.tmp-<name>-*`` gets an owner file beside it (``<dir>.owner.json``:
    output, host, pid); temporaries of ``out`` whose owner process on this host is
    gone (a killed conversion) are removed first. Finish with :func:`finalize_output`
    (the commit), then :func:`discard_output` in any case (it also releases the claim).
    """
    out = os.path.abspath(out)
    if protect is not None:
        src = os.path.abspath(protect)
        if out == src or src.startswith(out + os.sep) or out.startswith(src + os.sep):
            raise ConversionError(f"output {out} must lie outside the source {src}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConversionError(f"output {out} exists and is not a directory")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(out)}-{os.getpid()}-{time.time_ns()}")
    claim_output(out, tmp)
    try:
        if os.path.isdir(out) and os.listdir(out) and not overwrite:
            raise ConversionError(
                f"output directory {out} is not empty; pass --overwrite to move it aside (to {out}{ASIDE}<UTC>) "
                "and write anew"
            )
        remove_stale_outputs(out)
        os.mkdir(tmp)
        write_json(
            tmp + OWNER_SUFFIX, {"out": out, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        )
    except BaseException:
        discard_output(tmp, out)
        raise
    return tmp


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, TypeError, ValueError):
        return True  # someone else's process, or unreadable: assume it is still writing
    return True


def remove_stale_outputs(out: str) -> List[str]:
    """Remove ``.tmp-<name>-*`` beside ``out`` left by a killed writer of ``out`` on this host.

    Only directories with an owner file naming ``out``, this host and a pid that no
    longer runs or now runs a later process (:func:`_claim_is_stale`); anything else (another
    output's, another host's, a live one) stays.
    """
    out = os.path.abspath(out)
    parent, prefix, removed = os.path.dirname(out), f".tmp-{os.path.basename(out)}-", []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in sorted(names):
        if not (name.startswith(prefix) and name.endswith(OWNER_SUFFIX)):
            continue
        owner_file = os.path.join(parent, name)
        try:
            owner = read_json(owner_file)
        except (ConversionError, OSError, ValueError):
            continue
        if not isinstance(owner, dict) or owner.get("out") != out or not _claim_is_stale(owner):
            continue
        shutil.rmtree(owner_file[: -len(OWNER_SUFFIX)], ignore_errors=True)
        os.remove(owner_file)
        removed.append(owner_file[: -len(OWNER_SUFFIX)])
    for path in removed:
        print(f"stabledrl: removed {path}, left by an interrupted write of {out}", file=sys.stderr)
    return removed


def discard_output(tmp: str, out: Optional[str] = None) -> None:
    """Remove an unfinished temporary output and its owner file; release the claim on ``out``."""
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.exists(tmp + OWNER_SUFFIX):
        os.remove(tmp + OWNER_SUFFIX)
    if out is not None:
        release_output(out, tmp)


ASIDE = ".overwritten-"  # ``<out>.overwritten-<UTC>``: what ``--overwrite`` replaced


def finalize_output(tmp: str, out: str) -> str:
    """Commit the finished ``tmp`` as ``out`` by rename; a non-empty ``out`` (``--overwrite``) is
    first moved aside to ``<out>.overwritten-<UTC>``, never deleted (a line says where)."""
    out = os.path.abspath(out)
    aside = None
    if os.path.isdir(out) and os.listdir(out):
        aside = candidate = out + ASIDE + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        n = 1
        while os.path.lexists(aside):
            n += 1
            aside = f"{candidate}-{n}"
        os.rename(out, aside)
    try:
        os.rename(tmp, out)  # onto nothing, or an empty directory
    except OSError as err:
        if aside is not None:
            os.rename(aside, out)
        raise ConversionError(
            f"cannot commit {out}: {err.strerror}; it was written meanwhile by another program"
        ) from err
    if os.path.exists(tmp + OWNER_SUFFIX):
        os.remove(tmp + OWNER_SUFFIX)
    if aside is not None:
        print(
            f"stabledrl: moved the earlier contents of {out} to {aside} (--overwrite; delete it when no longer needed)",
            file=sys.stderr,
        )
    return out


# ------------------------------------------------------------------ assets
def copy_assets(src: str, dst: str, *, skip=("config.json",)) -> list:
    """Copy every top-level non-weight file (tokenizer, generation config, ``*.py`` code)."""
    os.makedirs(dst, exist_ok=True)
    copied = []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if (
            name.startswith(".")
            or not os.path.isfile(path)
            or name in skip
            or any(fnmatch.fnmatch(name, p) for p in WEIGHT_PATTERNS)
        ):
            continue
        shutil.copy2(path, os.path.join(dst, name))
        copied.append(name)
    return copied


def save_model_checkpoint(
    model, out: str, *, hf_assets: Optional[str] = None, tied: bool = False, overwrite: bool = False
) -> str:
    """Save a (TP/PP-sharded) model as a model-only checkpoint; every rank calls it.

    Written atomically like a conversion (rank 0 prepares, renames and writes the
    marker); ``hf_assets``: upstream config/tokenizer directory to keep beside it.
    """
    from megatron.core import parallel_state

    rank = torch.distributed.get_rank()
    box: List[Any] = [None]
    if rank == 0:
        try:
            box = [("ok", prepare_output(out, overwrite))]
        except ConversionError as err:
            box = [("error", str(err))]
    torch.distributed.broadcast_object_list(box, src=0)  # every rank raises the same error
    status, tmp = box[0]
    if status == "error":
        raise ConversionError(tmp)
    try:
        save_sharded(model.sharded_state_dict(), tmp)
        torch.distributed.barrier()
        if rank == 0:
            if hf_assets:
                copy_assets(hf_assets, os.path.join(tmp, HF_ASSETS), skip=())
            cfg = model.dllm_config
            layout = {
                "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
                "pipeline_parallel": parallel_state.get_pipeline_model_parallel_world_size(),
            }
            if cfg.is_moe:
                layout["expert_parallel"] = parallel_state.get_expert_model_parallel_world_size()
            write_marker(
                tmp,
                cfg,
                dtype=model.config.params_dtype,
                tied=tied,
                layout=layout,
                source={"saved_from_layout": layout},
                padded_vocab=model.padded_vocab_size,
            )
        torch.distributed.barrier()
        write_checksums(tmp)  # collective; after the marker, so that it is covered too
        if rank == 0:
            finalize_output(tmp, out)
    finally:
        if rank == 0:
            discard_output(tmp, out)
    torch.distributed.barrier()
    return os.path.abspath(out)


# ------------------------------------------------------------------ single process
@contextlib.contextmanager
def _rng_preserved():
    states: List[Any] = [random.getstate(), torch.get_rng_state(), np.random.get_state()]
    try:
        yield
    finally:
        random.setstate(states[0])
        torch.set_rng_state(states[1])
        np.random.set_state(states[2])


def ensure_single_process() -> bool:
    """Make sure Megatron runs with TP=PP=1 here; True if this call initialised it.

    The caller's RNG streams are left as they were (initialisation seeds them).
    """
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() != 1
            or parallel_state.get_pipeline_model_parallel_world_size() != 1
        ):
            raise ConversionError(
                "conversion and load_model run with TP=PP=1, but Megatron is "
                "initialised with another layout in this process"
            )
        return False
    with _rng_preserved():
        bootstrap.initialize(1, 1, backend="gloo", environ=None if torch.distributed.is_initialized() else {})
    return True


def build_shell(cfg: DLLMConfig, dtype: torch.dtype):
    """A TP=1/PP=1 model whose parameters are allocated but never initialised or touched
    (so they cost address space, not memory). Local layer spec (same checkpoint keys as TE), on
    the CPU, every parameter in ``dtype`` (norms included, :func:`~..models.place_model`); an MoE
    model holds all its experts (EP=1: local expert index = global one)."""

    config = to_transformer_config(
        cfg,
        dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1),
        dtype,
        perform_initialization=False,
        use_cpu_initialization=True,
    )
    spec = dllm_layer_spec(qk_layernorm=cfg.qk_layernorm, use_te=False, num_experts=cfg.num_experts)
    model = DLLMModel(cfg, config, spec)
    return place_model(model, "cpu", dtype)


def expanded_sharded_state_dict(model) -> Dict[str, Any]:
    """``model.sharded_state_dict()`` with every ShardedTensorFactory built into its
    ShardedTensors (a list), so that each piece can get its own contiguous tensor
    (Megatron would otherwise chunk ``linear_fc1`` and clone the halves when saving)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    out = {}
    for name, entry in model.sharded_state_dict().items():
        if isinstance(entry, ShardedTensorFactory):
            built = entry.build()
            entry = list(built) if isinstance(built, (list, tuple)) else [built]
        out[name] = entry
    return out


def attach(entry: Any, blocks: List[torch.Tensor]) -> None:
    """Give a ShardedTensor (or a factory's list of them) the rows ``blocks`` (TP=1: local = global)."""
    pieces = entry if isinstance(entry, list) else [entry]
    shapes = [tuple(p.local_shape) for p in pieces]
    if len(blocks) != len(pieces) or [tuple(b.shape) for b in blocks] != shapes:
        full = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        if full.shape[0] != sum(s[0] for s in shapes):
            raise ConversionError(
                f"cannot place a tensor of shape {list(full.shape)} into {pieces[0].key} pieces {shapes}"
            )
        blocks = list(full.split([s[0] for s in shapes]))
    for piece, block in zip(pieces, blocks):
        if tuple(block.shape) != tuple(piece.local_shape):
            raise ConversionError(f"{piece.key}: shape {list(block.shape)} != {list(piece.local_shape)}")
        piece.data = block.to(piece.dtype)


def check_keys_present(entries: Dict[str, Any], path: str) -> None:
    """Raise naming every requested tensor key the checkpoint does not hold."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    stored = set(stored_tensors(path))
    wanted = {
        p.key for e in entries.values() for p in (e if isinstance(e, list) else [e]) if isinstance(p, ShardedTensor)
    }
    missing = sorted(wanted - stored)
    if missing:
        raise ConversionError(
            f"checkpoint {path} lacks tensor(s) {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )


def _standalone(piece, dtype: torch.dtype):
    """The same region as a self-contained chunk (no prepended layer axis, no grid), so that
    one layer of a layer-stacked tensor can be loaded without the others."""
    shape = (1,) * piece.prepend_axis_num + tuple(piece.local_shape)
    return dataclasses.replace(
        piece,
        data=torch.empty(shape, dtype=dtype),
        dtype=dtype,
        local_shape=shape,
        prepend_axis_num=0,
        axis_fragmentations=None,
    )


def iter_full_tensors(
    path: str, shell, groups: List[Tuple[str, List[Any]]], dtype: torch.dtype
) -> Iterator[Tuple[str, str, torch.Tensor]]:
    """``(group, megatron name, full tensor)`` read from ``path`` one group at a time (TP=1 view),
    so that only one layer is held in memory."""
    entries = expanded_sharded_state_dict(shell)
    check_keys_present(entries, path)
    for group_name, mappings in groups:
        sub = {}
        for mapping in mappings:
            entry = entries[mapping.megatron]
            sub[mapping.megatron] = [_standalone(p, dtype) for p in (entry if isinstance(entry, list) else [entry])]
        load_sharded(sub, path, validate_access_integrity=False)
        for mapping in mappings:
            pieces = [
                p.data.reshape(p.data.shape[-len(q.local_shape) :])
                for p, q in zip(sub.pop(mapping.megatron), _as_list(entries[mapping.megatron]))
            ]
            yield group_name, mapping.megatron, pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _as_list(entry: Any) -> List[Any]:
    return entry if isinstance(entry, list) else [entry]


def load_model_weights(model, path: str, *, trust_unverified: bool = False) -> None:
    """Load a converted (or training) checkpoint into ``model`` at this process's TP/PP layout.

    Every rank calls it with its own stage of :func:`build_model`; missing tensors raise, and so
    do corrupt files (``checksums.json``; a checkpoint without one unless ``trust_unverified``),
    links, FIFOs and non-finite parameters; nothing in the directory is unpickled beyond plain
    data (:mod:`.trust`)."""
    verify_checksums(path, trust_unverified=trust_unverified)  # collective
    verify_metadata(path)
    check_keys_present(expanded_sharded_state_dict(model), path)
    # a TE model asks for _extra_state that a local-spec checkpoint (every conversion) lacks
    sharded, dropped = drop_absent_extra_state(model.sharded_state_dict(), stored_object_keys(path))
    loaded = load_sharded(sharded, path)
    # a training checkpoint also holds optimizer state in its common part: keep model keys only
    loaded = {key: value for key, value in loaded.items() if key in sharded}
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    check_model_fit(missing, unexpected, dropped, path, ConversionError)
    check_finite(model.named_parameters(), f"after loading {path}: the checkpoint is corrupt")
