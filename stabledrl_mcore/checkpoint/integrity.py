"""Checks that make a training checkpoint safe to load: checksums, finite tensors, pickle-free RNG files.

* ``checksums.json`` (:func:`write_checksums`, :func:`verify_checksums`): size and SHA-256 of
  every file of a checkpoint, written by rank 0 after every rank has written its shards and
  before the directory is committed; verified before anything is loaded. A missing file, a
  size or a digest that differs is a :class:`CheckpointError` naming the file. The files are
  hashed in 8 MiB chunks, split over the ranks (file ``i`` by rank ``i % world``), so each
  byte is read once more at save and once at load: SHA-256 runs at about 2 GB/s per core
  with SHA-NI, i.e. a 100 GB checkpoint on 64 ranks adds about a second. Before any file is
  hashed, every manifest entry must name a file inside the checkpoint (no absolute path, no
  ``..``, nothing that resolves elsewhere) and the checkpoint must hold no symbolic link (file
  or directory): each is refused by name, so a crafted manifest reads nothing outside. Nor may it
  hold a FIFO, a device or a socket (refused by name before any file is read: reading one blocks).
  A file the manifest does not list (added after the save, or its entry removed) is refused by
  name too: nothing would verify it. A checkpoint without ``checksums.json`` is refused
  (:data:`TRUST_OPTION` loads it unverified, still without links or special files, and loads a
  file the manifest does not list).
* :func:`check_finite`: a NaN or inf parameter is an error after a load and before a save
  (decided on all ranks together), so a corrupt checkpoint never trains and a diverged model
  is never committed.
* :func:`save_rng_file` / :func:`load_rng_file`: per-rank RNG streams as plain tensors,
  ints and lists, read with ``torch.load(weights_only=True)``: a crafted file cannot run code
  (the unpickler refuses any other global) and is reported as unsafe.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from typing import Any, Dict, Iterable, List, Tuple

import torch

from stabledrl_mcore.common.errors import UserError
from stabledrl_mcore.common.files import special_kind

CHECKSUM_FILE = "checksums.json"
CHECKSUM_ALGORITHM = "sha256"
# how a user says "load it without checksums": the flag of eval/generate/convert, the config field of train/sft
TRUST_OPTION = "--trust-unverified (eval, generate, convert) or checkpoint.trust_unverified=true (train, sft)"
RNG_FORMAT = 1
_CHUNK = 8 << 20


class CheckpointError(UserError, RuntimeError):
    """A training checkpoint that cannot be written or read as asked (one-line message)."""


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _gather(value: Any) -> List[Any]:
    """``value`` of every rank (the list itself where not distributed)."""
    if not torch.distributed.is_initialized():
        return [value]
    out: List[Any] = [None] * _world()
    torch.distributed.all_gather_object(out, value)
    return out


# ---------------------------------------------------------------------------- checksums
def file_digest(path: str) -> str:
    digest = hashlib.new(CHECKSUM_ALGORITHM)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            n = handle.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


def _files(directory: str) -> List[str]:
    """Every file under ``directory`` (relative, sorted), except the manifest itself."""
    found = []
    for base, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(base, name), directory)
            if rel != CHECKSUM_FILE:
                found.append(rel)
    return sorted(found)


def _my_share(names: List[str]) -> List[str]:
    rank, world = _rank(), _world()
    return [name for index, name in enumerate(names) if index % world == rank]


def write_checksums(directory: str) -> None:
    """Hash every file now in ``directory`` (split over ranks; call on every rank, after a
    barrier) and write ``checksums.json`` on rank 0."""
    names = _files(directory) if _rank() == 0 else None
    if torch.distributed.is_initialized():
        box = [names]
        torch.distributed.broadcast_object_list(box, src=0)
        names = box[0]
    mine = {
        name: {
            "size": os.path.getsize(os.path.join(directory, name)),
            CHECKSUM_ALGORITHM: file_digest(os.path.join(directory, name)),
        }
        for name in _my_share(names)
    }
    files: Dict[str, Any] = {}
    for part in _gather(mine):
        files.update(part)
    if _rank() == 0:
        tmp = os.path.join(directory, CHECKSUM_FILE + ".part")
        with open(tmp, "w") as handle:
            json.dump({"algorithm": CHECKSUM_ALGORITHM, "files": dict(sorted(files.items()))}, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, os.path.join(directory, CHECKSUM_FILE))


def read_manifest(directory: str) -> Dict[str, Dict[str, Any]]:
    path = os.path.join(directory, CHECKSUM_FILE)
    try:
        with open(path) as handle:
            manifest = json.load(handle)
        files = manifest["files"]
        if manifest.get("algorithm") != CHECKSUM_ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"unsupported algorithm {manifest.get('algorithm')!r}")
        return files
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {directory} has no {CHECKSUM_FILE} (incomplete, written by an older stabledrl, "
            f"or the file was removed), so its files cannot be verified; re-save or re-convert it, or "
            f"load it unverified with {TRUST_OPTION}"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is unreadable ({err}); the checkpoint is corrupt") from None


def symlinks(directory: str) -> List[str]:
    """Every symbolic link under ``directory`` (files and directories; relative, sorted). A linked
    directory is listed, never entered."""
    found = []
    for base, dirs, names in os.walk(directory):
        for name in dirs + names:
            if os.path.islink(os.path.join(base, name)):
                found.append(os.path.relpath(os.path.join(base, name), directory))
    return sorted(found)


def special_files(directory: str) -> List[Tuple[str, str]]:
    """``(relative path, kind)`` of every FIFO, device or socket under ``directory`` (sorted; links
    are :func:`symlinks`' and not followed). Nothing is opened."""
    found = []
    for base, _, names in os.walk(directory):
        for name in names:
            kind = special_kind(os.path.join(base, name), follow_symlinks=False)
            if kind and kind != "a symbolic link":
                found.append((os.path.relpath(os.path.join(base, name), directory), kind))
    return sorted(found)


def _outside(directory: str, name: Any) -> bool:
    """True unless ``name`` is a relative path that stays inside ``directory``."""
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
        return True
    if ".." in name.replace(os.sep, "/").split("/"):
        return True
    root = os.path.realpath(directory)
    return os.path.commonpath([root, os.path.realpath(os.path.join(directory, name))]) != root


def untrusted_entries(directory: str, files: Dict[str, Any]) -> str:
    """'' unless the manifest names a path outside ``directory`` or the directory holds a symbolic
    link; else the one-line problem (checked before any file is opened)."""
    links = symlinks(directory)
    if links:
        path = os.path.join(directory, links[0])
        more = f" (and {len(links) - 1} more)" if len(links) > 1 else ""
        return (
            f"{path} is a symbolic link (to {os.readlink(path)}){more}; a checkpoint holds only its own "
            f"files, the checkpoint is not trusted"
        )
    special = special_files(directory)
    if special:
        name, kind = special[0]
        more = f" (and {len(special) - 1} more)" if len(special) > 1 else ""
        return (
            f"{os.path.join(directory, name)} is {kind}, not a regular file{more}; a checkpoint holds only "
            f"regular files, the checkpoint is not trusted"
        )
    outside = [name for name in sorted(files, key=str) if _outside(directory, name)]
    if outside:
        return (
            f"{os.path.join(directory, CHECKSUM_FILE)} names {outside[0]!r}, a path outside the checkpoint; "
            f"the checkpoint is not trusted"
        )
    return ""


def unlisted_files(directory: str, files: Dict[str, Any]) -> str:
    """'' unless ``directory`` holds a file its manifest ``files`` does not list (one added or
    renamed after the save, or whose entry was removed: nothing would verify it), else the one-line
    problem naming it. The manifest lists every file a save or conversion wrote, written last."""
    unlisted = [name for name in _files(directory) if name not in files]
    if not unlisted:
        return ""
    more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
    return (
        f"{os.path.join(directory, unlisted[0])} is not listed in {CHECKSUM_FILE}{more}, so it cannot be "
        f"verified (added or renamed after the checkpoint was written, or its entry removed); remove it if it "
        f"is not part of the checkpoint, or load the checkpoint unverified with {TRUST_OPTION}"
    )


def _problem(directory: str, name: str, expected: Dict[str, Any]) -> str:
    path = os.path.join(directory, name)
    if not isinstance(expected, dict):
        return f"{os.path.join(directory, CHECKSUM_FILE)} has a malformed entry for {name!r}"
    if not os.path.isfile(path):
        return f"{path} is missing"
    size = os.path.getsize(path)
    if size != expected.get("size"):
        return f"{path} has {size} bytes, {expected.get('size')} were written"
    if file_digest(path) != expected.get(CHECKSUM_ALGORITHM):
        return f"{path} does not match its {CHECKSUM_ALGORITHM} in {CHECKSUM_FILE}"
    return ""


TRAIN_STATE_FILE = "train_state.json"  # a training checkpoint's (checkpoint.state.STATE_FILE)
MODEL_MARKER_FILE = "stabledrl_model.json"  # a converted or model-only checkpoint's (checkpoint.info.MARKER)


def _marker(directory: str) -> Dict[str, Any]:
    """The marker of a model checkpoint, read as plain data, or {} (it may be the corrupt file)."""
    try:
        with open(os.path.join(directory, MODEL_MARKER_FILE)) as handle:
            marker = json.loads(handle.read(1 << 20))
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _plain(value: Any) -> bool:
    return isinstance(value, str) and bool(value) and value.isprintable()


def rewrite_advice(directory: str) -> str:
    """What to do about a corrupt file of ``directory``, for its kind: a training checkpoint is
    resumed from an earlier one; a converted one is converted again (the command, from its marker);
    a model-only save is written again."""
    if os.path.isfile(os.path.join(directory, TRAIN_STATE_FILE)):
        return "resume from an earlier checkpoint"
    if not os.path.isfile(os.path.join(directory, MODEL_MARKER_FILE)):
        return "resume from an earlier checkpoint, or write this one again"
    marker = _marker(directory)
    source = marker.get("source") if isinstance(marker.get("source"), dict) else {}
    if _plain(source.get("hf_dir")):
        options = [("--model", marker.get("arch")), ("--hf-dir", source["hf_dir"]), ("--out", directory)]
        options.append(("--dtype", marker.get("dtype")))
        command = " ".join(f"{flag} {shlex.quote(value)}" for flag, value in options if _plain(value))
        return (
            f"convert it again (with the options of the first conversion): stabledrl convert hf-to-mcore "
            f"{command} --overwrite"
        )
    return "write it again (re-run the conversion or the save that made it)"


def check_verifiable(directory: str, *, trust_unverified: bool = False) -> None:
    """Raise :class:`CheckpointError` if ``directory`` holds a link, a FIFO or a device, or has no
    ``checksums.json`` (unless ``trust_unverified``). Local and cheap (nothing is hashed): the
    pre-run check of a checkpoint to load; :func:`verify_checksums` does it first too."""
    problem = untrusted_entries(directory, {})
    if problem:
        raise CheckpointError(problem)
    if not trust_unverified and not os.path.lexists(os.path.join(directory, CHECKSUM_FILE)):
        read_manifest(directory)  # raises, naming the file and the way to load it anyway


def verify_checksums(directory: str, *, trust_unverified: bool = False) -> None:
    """Raise :class:`CheckpointError` (on every rank) unless every file of the manifest is
    intact. Collective where distributed: each rank hashes its share of the files (after every
    rank has checked that the checkpoint holds no link or special file and that the manifest names
    only files of the checkpoint, :func:`untrusted_entries`, and that it lists every file,
    :func:`unlisted_files`). No manifest is refused unless ``trust_unverified`` (then only the links
    and special files are checked, and files the manifest does not list are loaded unverified)."""
    try:
        check_verifiable(directory, trust_unverified=trust_unverified)
        manifest = os.path.join(directory, CHECKSUM_FILE)
        listed = os.path.lexists(manifest)
        files: Dict[str, Any] = read_manifest(directory) if listed else {}
        local = untrusted_entries(directory, files)
        if local:
            raise CheckpointError(local)
        if listed and not trust_unverified:
            local = unlisted_files(directory, files)
            if local:
                raise CheckpointError(local)
        local = next((p for p in (_problem(directory, n, files[n]) for n in _my_share(sorted(files))) if p), "")
        if local:
            local = f"corrupt checkpoint: {local}; {rewrite_advice(directory)}"
    except CheckpointError as err:
        local = str(err)
    problems = [p for p in _gather(local) if p]
    if problems:
        raise CheckpointError(problems[0])


# ---------------------------------------------------------------------------- finite values
def nonfinite(named: Iterable[Tuple[str, torch.Tensor]]) -> str:
    """'' or 'NAME (K of N values)' for the first tensor holding a NaN or inf."""
    for name, tensor in named:
        if tensor is None or not torch.is_floating_point(tensor):
            continue
        bad = int((~torch.isfinite(tensor.detach())).sum())
        if bad:
            return f"{name} ({bad} of {tensor.numel()} values)"
    return ""


def check_finite(named: Iterable[Tuple[str, torch.Tensor]], what: str) -> None:
    """Raise :class:`CheckpointError` on every rank if any rank holds a non-finite tensor.

    ``what`` completes the message: e.g. "after loading step_00000006 (the checkpoint is corrupt)"."""
    local = nonfinite(named)
    bad = [(rank, p) for rank, p in enumerate(_gather(local)) if p]
    if bad:
        rank, name = bad[0]
        raise CheckpointError(f"non-finite parameter {name} on rank {rank} {what}")


# ---------------------------------------------------------------------------- RNG files
def rng_to_tensors(state: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`~.state.capture_rng_state`'s dict as tensors, ints and lists (no other types)."""
    version, internal, gauss = state["python"]
    out: Dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": state["torch"],
        "tracker": dict(state["tracker"]),
    }
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        out["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    if "cuda" in state:
        out["cuda"] = state["cuda"]
    return out


def rng_from_tensors(saved: Dict[str, Any]) -> Dict[str, Any]:
    """Inverse of :func:`rng_to_tensors`."""
    py = saved["python"]
    state: Dict[str, Any] = {
        "python": (py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]),
        "torch": saved["torch"],
        "tracker": saved["tracker"],
    }
    if "numpy" in saved:
        n = saved["numpy"]
        state["numpy"] = (n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"])
    if "cuda" in saved:
        state["cuda"] = saved["cuda"]
    return state


def save_rng_file(path: str, state: Dict[str, Any]) -> None:
    torch.save(rng_to_tensors(state), path)


def load_rng_file(path: str) -> Dict[str, Any]:
    """Read an RNG file without running code from it; :class:`CheckpointError` if it is not one."""
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # the unpickler names the refused global; never fall back to pickle
        text = str(err)
        refused = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", text)
        reason = (
            f"it holds an object built by {refused.group(1)}"
            if refused
            else (text.strip().splitlines() or [type(err).__name__])[0][:200]
        )
        raise CheckpointError(
            f"{path} is not a safe RNG state file (refused to load it: {reason}); the "
            f"checkpoint is corrupt or untrusted"
        ) from None
    if not isinstance(saved, dict) or saved.get("format") != RNG_FORMAT:
        raise CheckpointError(
            f"{path} is not an RNG state file of format {RNG_FORMAT} (written by an older stabledrl?)"
        )
    try:
        return rng_from_tensors(saved)
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise CheckpointError(f"{path} is a malformed RNG state file ({err})") from None
