"""Streaming safetensors I/O: memory-mapped reads, sharded writes with an index.

Reading (:class:`SafetensorsReader`) accepts the two layouts Hugging Face uses:
a single ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards
listed in ``model.safetensors.index.json`` (``{"metadata": {...},
"weight_map": {name: file}}``). Shapes and dtypes come from the file headers
without touching tensor data; :meth:`SafetensorsReader.get` opens the file for
one tensor and returns a tensor backed by the memory map, so its pages are
released as soon as the caller drops it.

Writing (:class:`SafetensorsWriter`) takes the full list of tensors (name,
shape, dtype) up front, assigns them to shards of at most ``max_shard_bytes``,
and then writes each tensor's bytes straight to disk in that order: every
file's header is known before its first byte of data, so no shard is ever
assembled in memory. The format is the public one: an 8-byte little-endian
header length, a JSON header (``{name: {"dtype", "shape", "data_offsets"}}``
plus ``"__metadata__": {"format": "pt"}``) padded with spaces to 8 bytes,
then the raw little-endian tensor bytes.

A NaN or inf read from a safetensors file is refused by name (:func:`check_finite`,
:class:`FiniteReader`) wherever weights are read for use: the converter, :func:`~.loader.load_hf_weights`
(``load_model``, ``model.checkpoint=<HF dir>``); each has its opt-in (``--allow-nonfinite``,
``allow_nonfinite=True``).
"""

from __future__ import annotations

import json
import os
import struct
from typing import BinaryIO, Dict, Iterable, List, Optional, Tuple

import torch
from safetensors import safe_open

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.common.files import special_kind

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
CONVERT_ANYWAY = "pass --allow-nonfinite to convert it anyway"


def check_finite(name: str, tensor: torch.Tensor, source: str, hint: str = CONVERT_ANYWAY) -> None:
    """Refuse a tensor with NaN/inf entries: one line naming it, its source, the counts and ``hint``."""
    if not tensor.is_floating_point():
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        nan = int(torch.isnan(tensor).sum())
        raise ConversionError(
            f"{source}: tensor {name!r} holds {nan} NaN and {bad - nan} inf value(s) of {tensor.numel()}; {hint}"
        )


def _read_header(path: str) -> Dict[str, dict]:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than the 8-byte header length")
            (size,) = struct.unpack("<Q", raw)
            if size > 100 * 1024**2:
                raise ValueError(f"implausible header length {size}")
            header = json.loads(handle.read(size))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        file_size = os.path.getsize(path)
    except (OSError, ValueError) as err:
        raise ConversionError(f"{path} is not a readable safetensors file: {err}") from None
    header.pop("__metadata__", None)
    try:
        data_end = max((int(info["data_offsets"][1]) for info in header.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise ConversionError(f"{path} is not a readable safetensors file: malformed tensor entries") from None
    if file_size < 8 + size + data_end:
        raise ConversionError(
            f"{path} is truncated: {file_size} bytes, its header needs {8 + size + data_end} "
            f"(an interrupted download or copy?); fetch or convert it again"
        )
    return header


class SafetensorsReader:
    """Lazy access to the tensors of an HF model directory."""

    def __init__(self, hf_dir: str):
        self.root = hf_dir
        index, single = os.path.join(hf_dir, INDEX_FILE), os.path.join(hf_dir, SINGLE_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as handle:
                    weight_map = json.load(handle)["weight_map"]
            except (OSError, ValueError, KeyError) as err:
                raise ConversionError(f"{index} is not a valid safetensors index: {err!r}") from None
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            weight_map, files = None, [SINGLE_FILE]
        elif special_kind(single) or special_kind(index):  # never opened: a FIFO would block the read
            which = single if special_kind(single) else index
            raise ConversionError(f"{which} is {special_kind(which)}, not a regular file")
        else:
            others = [n for n in os.listdir(hf_dir) if n.endswith((".bin", ".pt", ".pth"))]
            hint = f" (found {others}: convert them to safetensors first)" if others else ""
            raise ConversionError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
        self._entries: Dict[str, Tuple[str, dict]] = {}
        for name in files:
            path = os.path.join(hf_dir, name)
            if special_kind(path):
                raise ConversionError(f"{path} is {special_kind(path)}, not a regular file")
            if not os.path.isfile(path):
                raise ConversionError(f"{INDEX_FILE} lists {name}, which is missing from {hf_dir}")
            for key, info in _read_header(path).items():
                if key in self._entries:
                    raise ConversionError(f"tensor {key!r} is stored twice ({self._entries[key][0]}, {path})")
                self._entries[key] = (path, info)
        if weight_map is not None:
            for key, name in weight_map.items():
                if key not in self._entries or os.path.basename(self._entries[key][0]) != name:
                    raise ConversionError(f"{INDEX_FILE} maps {key!r} to {name}, which does not hold it")

    def keys(self) -> List[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._entries[name][1]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self._entries[name][1]["dtype"]
        if code not in DTYPES:
            raise ConversionError(f"tensor {name!r} has unsupported dtype {code}")
        return DTYPES[code]

    def nbytes(self) -> int:
        """Total tensor bytes (the size of the weights on disk)."""
        return sum(int(info["data_offsets"][1]) - int(info["data_offsets"][0]) for _, info in self._entries.values())

    def get(self, name: str) -> torch.Tensor:
        """The tensor, backed by a memory map of its file (freed when dropped)."""

        if name not in self._entries:
            raise ConversionError(f"tensor {name!r} is missing from {self.root}")
        path = self._entries[name][0]
        try:
            with safe_open(path, framework="pt") as handle:
                return handle.get_tensor(name)
        except Exception as err:  # noqa: BLE001 - safetensors' Rust errors name no file
            raise ConversionError(f"{path}: cannot read tensor {name!r} ({err})") from None


class FiniteReader:
    """A :class:`SafetensorsReader` whose ``get`` refuses non-finite tensors (:func:`check_finite`)."""

    def __init__(self, reader: SafetensorsReader, hint: str = CONVERT_ANYWAY):
        self._reader = reader
        self._hint = hint

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def get(self, name: str) -> torch.Tensor:
        tensor = self._reader.get(name)
        check_finite(name, tensor, self._reader.root, self._hint)
        return tensor


# ---------------------------------------------------------------------------- writing
Plan = List[Tuple[str, Tuple[int, ...], torch.dtype]]


def shard_plan(plan: Plan, max_shard_bytes: int) -> List[Plan]:
    """Split the ordered plan into consecutive shards of at most ``max_shard_bytes``
    (a single tensor larger than the limit gets a shard of its own)."""
    shards: List[Plan] = [[]]
    size = 0
    for name, shape, dtype in plan:
        nbytes = _numel(shape) * _itemsize(dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tuple(shape), dtype))
        size += nbytes
    return shards


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class SafetensorsWriter:
    """Write a planned set of tensors as HF safetensors shards, one tensor at a time.

    Call :meth:`write` once per planned tensor, in plan order, then :meth:`close`.
    One shard is written as ``model.safetensors``; several as
    ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
    """

    def __init__(self, out_dir: str, plan: Plan, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        names = [name for name, _, _ in plan]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in the write plan")
        self.out_dir = out_dir
        self.shards = shard_plan(plan, max_shard_bytes)
        n = len(self.shards)
        self.files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._order = [
            (k, name, tuple(shape), dtype) for k, shard in enumerate(self.shards) for name, shape, dtype in shard
        ]
        self._next = 0
        self._handle: Optional[BinaryIO] = None
        self._shard = -1
        self.total_bytes = sum(_numel(s) * _itemsize(d) for _, s, d in plan)

    def _open_shard(self, k: int) -> None:
        if self._handle is not None:
            self._handle.close()
        header: Dict[str, dict] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in self.shards[k]:
            nbytes = _numel(shape) * _itemsize(dtype)
            header[name] = {
                "dtype": DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._handle = open(os.path.join(self.out_dir, self.files[k]), "wb")
        self._handle.write(struct.pack("<Q", len(raw)))
        self._handle.write(raw)
        self._shard = k

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order):
            raise ValueError(f"tensor {name!r} is not in the write plan (all tensors written)")
        k, want, shape, dtype = self._order[self._next]
        if name != want or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"write order violated: expected {want} {shape} {dtype}, got "
                f"{name} {tuple(tensor.shape)} {tensor.dtype}"
            )
        if k != self._shard:
            self._open_shard(k)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._handle.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        """Finish the last shard and write the index (several shards only)."""
        if self._next != len(self._order):
            missing = [name for _, name, _, _ in self._order[self._next :]]
            raise ValueError(f"{len(missing)} planned tensors were never written, first {missing[0]}")
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": {name: self.files[k] for k, name, _, _ in self._order},
            }
            with open(os.path.join(self.out_dir, INDEX_FILE), "w") as handle:
                json.dump(index, handle, indent=2, sort_keys=True)

    def abort(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
