"""A checkpoint directory is read as data: nothing in it can make a load run code.

Megatron's ``torch_dist`` format keeps three kinds of pickles beside the tensor bytes:

* ``.metadata``: torch's distributed-checkpoint ``Metadata``, which torch's ``FileSystemReader``
  reads with a plain ``pickle.load`` (any global, so a crafted file runs a command). Here it is
  read by :class:`MetadataUnpickler`, which builds exactly the classes such a file holds
  (:data:`METADATA_GLOBALS`, found by unpickling the metadata of converted checkpoints and of
  training checkpoints with either optimizer, dense and MoE) and refuses any other by name;
  then its storage entries must name plain files of the directory.
* the sharded objects inside ``__*.distcp`` (``_extra_state``, the distributed optimizer's
  bucket sizes), which torch's load planner reads with ``torch.load(weights_only=False)``: here
  each object's bytes are first read with ``weights_only=True`` (torch's own restricted
  unpickler) and refused unless that succeeds.
* ``common.pt``, which Megatron reads with ``torch.load``'s default (``weights_only=True`` since
  torch 2.6): its refusal becomes a one-line :class:`CheckpointError` instead of a traceback, and a
  file that is not ``torch.save``'s format (a raw ``pickle.dump``, which only a full unpickle could
  read) is refused by :func:`check_common` before Megatron opens it, saying what it is.

Every load in :mod:`stabledrl_mcore.checkpoint` goes through :func:`load_sharded` (which binds
the safe readers into Megatron, :func:`bind_safe_reads`, and verifies ``.metadata`` first) and
reads the checkpoint's keys with :func:`stored_tensors` / :func:`stored_objects`; the openers
(``state.load_checkpoint``, ``mcore_io.read_checkpoint_info`` / ``load_model_weights``) call
:func:`verify_metadata` before anything else reads the directory.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import traceback
from typing import Any, BinaryIO, Dict, Set

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from stabledrl_mcore.checkpoint.integrity import CheckpointError
from stabledrl_mcore.common.files import special_kind

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"
METADATA_GLOBALS: Dict[str, frozenset] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    # Megatron keeps every rank's save plan in the metadata (``all_local_plans``)
    "torch.distributed.checkpoint.planner": frozenset({"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}),
    "torch": frozenset({"Size"}),
}
"""The classes a ``.metadata`` holds, by module. Besides these: a dtype (pickled as ``torch.<name>``,
e.g. ``torch.bfloat16``; only names whose value is a ``torch.dtype``) and a layout (pickled as a call
of ``torch.serialization._get_layout`` with its name; answered here by a lookup of the layouts)."""
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_LAYOUTS = {str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)}
_REFUSED_GLOBAL = re.compile(r"(?:[Uu]nsupported global: |unsupported )GLOBAL ([\w.]+)")


class _NotMetadata(pickle.UnpicklingError):
    """A global outside :data:`METADATA_GLOBALS` (its ``module.name`` is the message)."""


def _layout(name: str) -> torch.layout:
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that builds only the classes of :data:`METADATA_GLOBALS` (dtypes, layouts)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise _NotMetadata(f"{module}.{name}")


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def load_metadata(stream: BinaryIO, path: str) -> Metadata:
    """The ``Metadata`` pickled in ``stream`` (the file ``path``), read without running code.

    :class:`CheckpointError` for a global that is not checkpoint metadata (named), an unreadable
    pickle, or storage entries that name anything but a plain file of the checkpoint."""
    try:
        metadata = MetadataUnpickler(stream).load()
    except _NotMetadata as err:
        raise CheckpointError(
            f"{path}: refused to unpickle {err} (not checkpoint metadata); the checkpoint is not trusted"
        ) from None
    except Exception as err:  # noqa: BLE001 - a truncated file, a foreign pickle: never fall back to pickle
        raise CheckpointError(
            f"{path} is not readable checkpoint metadata ({type(err).__name__}: {_first_line(err)}); "
            "the checkpoint is corrupt"
        ) from None
    _check_structure(metadata, path)
    return metadata


def _plain_file_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.path.basename(name) == name


def _check_structure(metadata: Any, path: str) -> None:
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(
            f"{path} holds a {type(metadata).__name__}, not checkpoint metadata; the checkpoint is corrupt"
        )
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(f"{path}: entry {key!r} is not a tensor or object record; the checkpoint is corrupt")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not _plain_file_name(name):
            raise CheckpointError(
                f"{path}: a shard is stored in {name!r}, not in a file of the checkpoint; the checkpoint is not trusted"
            )


def read_metadata(directory: str) -> Metadata:
    """``<directory>/.metadata`` through :func:`load_metadata`."""
    path = os.path.join(str(directory), METADATA_FILE)
    kind = special_kind(path)
    if kind:  # opening a FIFO blocks until something writes to it
        raise CheckpointError(f"{path} is {kind}, not a regular file; the checkpoint is not trusted")
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a torch_dist checkpoint (no {METADATA_FILE})") from None
    except OSError as err:
        raise CheckpointError(f"{path} is unreadable ({err})") from None
    with handle:
        return load_metadata(handle, path)


def verify_metadata(directory: str) -> None:
    """Raise :class:`CheckpointError` unless ``<directory>/.metadata`` is plain checkpoint metadata."""
    read_metadata(directory)


def stored_tensors(directory: str) -> Dict[str, TensorStorageMetadata]:
    """Sharded-tensor key -> its record (global ``size``, ``properties.dtype``), read safely."""
    return {
        key: entry
        for key, entry in read_metadata(directory).state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


def stored_objects(directory: str) -> Set[str]:
    """The keys of the sharded objects (without their ``/shard_<offset>_<shape>`` part), read safely."""
    keys = set()
    for unique_key, entry in read_metadata(directory).state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            key, _, shard = unique_key.rpartition("/")
            if not key or not shard.startswith("shard_"):
                raise CheckpointError(
                    f"{directory}/{METADATA_FILE}: object key {unique_key!r} is malformed; the checkpoint is corrupt"
                )
            keys.add(key)
    return keys


# ---------------------------------------------------------------------------- inside Megatron's load
class SafeMetadataReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``read_metadata`` is :func:`read_metadata` (read once per reader).

    Its signature takes no ``rank``: torch then never falls back to rank-local metadata files,
    which no save here writes."""

    def __init__(self, path: Any) -> None:
        super().__init__(path)
        self._safe_metadata = None

    def read_metadata(self, *args: Any) -> Metadata:  # noqa: D102
        if self._safe_metadata is None:
            metadata = read_metadata(str(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._safe_metadata = metadata
        return self._safe_metadata


def _safe_reader(checkpoint_dir: Any, cache_metadata: bool = False) -> SafeMetadataReader:
    return SafeMetadataReader(checkpoint_dir)


class _ObjectRefused(Exception):
    """A sharded object whose bytes torch's ``weights_only`` unpickler refuses: (key, reason)."""


def refused_global(err: BaseException) -> str:
    """What torch's ``weights_only`` refusal names: ``an object built by MODULE.NAME``, else its first line."""
    found = _REFUSED_GLOBAL.search(str(err))
    return found.group(1) if found else _first_line(err)


def _checked_load_bytes(original):
    def load_bytes(self, read_item, value) -> None:
        data = value.getvalue() if isinstance(value, io.BytesIO) else value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as err:  # noqa: BLE001 - refused or unreadable: never fall back to a full pickle
            raise _ObjectRefused(read_item.dest_index.fqn, refused_global(err)) from None
        return original(self, read_item, io.BytesIO(data))  # the same bytes, now known to hold data only

    load_bytes.stabledrl_checked = True
    return load_bytes


def bind_safe_reads() -> None:
    """Make Megatron's ``torch_dist`` loads read ``.metadata`` with :class:`MetadataUnpickler` and
    refuse sharded objects that are more than data (idempotent; every load here calls it)."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    torch_strategy._get_filesystem_reader = _safe_reader
    planner = torch_strategy.MCoreLoadPlanner
    if not getattr(planner.load_bytes, "stabledrl_checked", False):
        planner.load_bytes = _checked_load_bytes(planner.load_bytes)


class _NoGlobals(pickle.Unpickler):
    """Reads plain values only: the first object of a legacy ``torch.save`` file is an int."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}")


def _common_format(path: str) -> str:
    """``"zip"`` or ``"legacy"`` (the two ``torch.save`` formats), ``"pickle"`` (a raw pickle) or ``""``."""
    with open(path, "rb") as handle:
        head = handle.read(4)
        if head == b"PK\x03\x04":
            return "zip"
        if not head.startswith(b"\x80"):  # every pickle of protocol 2 or later starts with PROTO
            return ""
        handle.seek(0)
        try:
            first = _NoGlobals(handle).load()
        except Exception:  # noqa: BLE001 - a pickle of objects: what it names is never built here
            return "pickle"
    return "legacy" if first == torch.serialization.MAGIC_NUMBER else "pickle"


def check_common(directory: str) -> None:
    """Raise :class:`CheckpointError` unless ``<directory>/common.pt`` (if present) is ``torch.save``'s
    format, naming what it is instead: a raw pickle, which ``weights_only`` loading cannot read and a
    full unpickle would run code from, or something else."""
    path = os.path.join(str(directory), COMMON_FILE)
    if not os.path.isfile(path):
        return  # missing: Megatron names it; a FIFO or a link: refused before any read by the openers
    try:
        kind = _common_format(path)
    except OSError as err:
        raise CheckpointError(f"{path} is unreadable ({err})") from None
    if kind == "pickle":
        raise CheckpointError(
            f"{path} is a raw pickle, not a torch.save file (zip or legacy): refused, since "
            "torch.load(weights_only=True) cannot read it and a full unpickle would run any code it names; "
            "re-save the checkpoint with the version that wrote it, or convert it again "
            "(--trust-unverified does not waive this)"
        )
    if not kind:
        raise CheckpointError(f"{path} is not a torch.save file (neither zip nor pickle); the checkpoint is corrupt")


def _from_common_load(err: BaseException) -> bool:
    return any(frame.name == "load_common" for frame in traceback.extract_tb(err.__traceback__))


_SHAPE_MISMATCH = re.compile(r"Global shape mismatch for loaded \((.*?)\) and expected \((.*?)\) tensor for key (\S+)")
"""Megatron's ``CheckpointingException`` when a stored tensor's shape differs from the model's."""


def _shape(text: str) -> str:
    return "[" + ", ".join(re.findall(r"\d+", text)) + "]"


def shape_mismatch(err: BaseException, directory: str) -> str:
    """The one line for Megatron's global shape mismatch (the tensor, both shapes, what to do), else ''."""
    found = _SHAPE_MISMATCH.search(str(err))
    if found is None:
        return ""
    stored, expected, key = found.groups()
    return (
        f"{directory}: the checkpoint's tensors do not match the config it is loaded with: {key} is stored as "
        f"{_shape(stored)}, the model built from its model_config.json (or the run's model settings) has "
        f"{_shape(expected)}; load it with the model config it was saved with (its own model_config.json, "
        f"unedited), or use the checkpoint those files came from"
    )


def load_sharded(sharded: Dict[str, Any], directory: str, **kwargs: Any) -> Dict[str, Any]:
    """``dist_checkpointing.load(sharded, directory, **kwargs)`` that runs no code from the checkpoint:
    a refused ``.metadata``, sharded object or ``common.pt`` is one :class:`CheckpointError` naming it."""
    from megatron.core import dist_checkpointing

    bind_safe_reads()
    verify_metadata(directory)
    check_common(directory)
    try:
        return dist_checkpointing.load(sharded, directory, **kwargs)
    except pickle.UnpicklingError as err:  # Megatron's torch.load of the common state refused a global
        where = f"{directory}/{COMMON_FILE}" if _from_common_load(err) else str(directory)
        raise CheckpointError(
            f"{where}: refused to unpickle {refused_global(err)} (not checkpoint data); the checkpoint is not trusted"
        ) from None
    except CheckpointException as err:  # torch's wrapper of every rank's failure inside the load
        for failure, _ in err.failures.values():
            if isinstance(failure, CheckpointError):
                raise CheckpointError(str(failure)) from None
            mismatch = shape_mismatch(failure, directory)
            if mismatch:
                raise CheckpointError(mismatch) from err
            if isinstance(failure, _ObjectRefused):
                key, reason = failure.args
                raise CheckpointError(
                    f"{directory}: refused to unpickle {reason} from the sharded object {key} (not checkpoint "
                    "data); the checkpoint is not trusted"
                ) from None
        verify_metadata(directory)  # a .metadata replaced during the load is named, not a traceback
        raise
    except Exception as err:  # noqa: BLE001 - Megatron's own exceptions, raised outside torch's wrapper
        mismatch = shape_mismatch(err, directory)
        if mismatch:
            raise CheckpointError(mismatch) from err
        raise
