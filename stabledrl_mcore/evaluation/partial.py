"""An evaluation's rows kept as they finish, and a resume from them.

Every data-parallel rank appends its finished batches to ``<out>.rank<R>.partial``, whose first line
is a header naming it partial and recording what produced it (the checkpoint's fingerprint, the task,
data, prompt and sampling settings, the seed and the number of ranks). A finished run merges the
partials into ``<out>`` and removes them. ``stabledrl eval --resume`` reads them back, refuses them by
name if anything that shapes the rows differs, keeps each rank's whole batches (a row cut by a kill
is dropped with its batch) and decodes only the rest: the batches keep their boundaries and the
sampled chunks their own seeds, so the final file equals an uninterrupted run's (lm-evaluation-
harness keeps a cache of finished requests for the same reason).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from stabledrl_mcore.checkpoint.integrity import CHECKSUM_FILE
from stabledrl_mcore.common.errors import UserError
from stabledrl_mcore.evaluation.scoring import JsonlAppender, write_jsonl

HEADER_KEY = "stabledrl_eval_partial"
"""The key of a partial file's first line: ``{HEADER_KEY: {"fingerprint": ..., "rank": R, "world": W}}``."""


def partial_path(out: str, rank: int) -> str:
    """Rank ``rank``'s partial results file of the evaluation written to ``out``."""
    return f"{out}.rank{rank}.partial"


def partial_files(out: str) -> List[str]:
    """The partial files of ``out`` that exist (a run stopped part-way left them)."""
    return sorted(glob.glob(glob.escape(out) + ".rank*.partial"))


def checkpoint_fingerprint(path: str) -> str:
    """A digest of what a checkpoint holds: its ``checksums.json`` (the sha256 of every file) where it
    has one, else every file's name, size and modification time (an HF directory)."""
    digest = hashlib.sha256()
    manifest = os.path.join(path, CHECKSUM_FILE)
    if os.path.isfile(manifest):
        with open(manifest, "rb") as handle:
            digest.update(handle.read())
        return digest.hexdigest()
    for base, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(base, name)
            stat = os.stat(full)
            digest.update(f"{os.path.relpath(full, path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def open_partial(out: str, rank: int, world: int, fingerprint: Dict[str, Any], kept: Sequence[dict]) -> JsonlAppender:
    """Rank ``rank``'s partial file, written anew (atomically: a reader sees the old file or the new
    one): the header, then the ``kept`` rows of a resumed run; later batches are appended as they finish."""
    path = partial_path(out, rank)
    write_jsonl(path + ".tmp", [{HEADER_KEY: {"fingerprint": fingerprint, "rank": rank, "world": world}}, *kept])
    os.replace(path + ".tmp", path)
    return JsonlAppender(path, append=True)


def read_partial(path: str) -> Tuple[Optional[dict], List[dict]]:
    """``(header, rows)`` of a partial file; a last line cut by a kill is dropped, and a file without
    a header (written by an older stabledrl) has header None."""
    rows: List[dict] = []
    header = None
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number >= len(lines) - 2:  # the last line, cut part-way
                break
            raise UserError(
                f"{path}: line {number + 1} is not JSON; pass --overwrite to start the evaluation again"
            ) from None
        if number == 0 and isinstance(row, dict) and HEADER_KEY in row:
            header = row[HEADER_KEY]
        else:
            rows.append(row)
    return header, rows


def _differences(was: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    return [
        f"{key} {was.get(key)!r} (now {now.get(key)!r})"
        for key in sorted(set(was) | set(now))
        if was.get(key) != now.get(key)
    ]


def resumable_rows(out: str, fingerprint: Dict[str, Any], world: int) -> Dict[int, List[dict]]:
    """Every rank's kept rows of the evaluation stopped while writing ``out``, checked against this
    run's ``fingerprint`` and data-parallel size; a :class:`UserError` naming what differs (or what is
    missing) otherwise. ``{}`` when nothing was kept."""
    found = partial_files(out)
    kept: Dict[int, List[dict]] = {}
    for path in found:
        header, rows = read_partial(path)
        if header is None:
            raise UserError(
                f"{path} has no header (written by an older stabledrl): it cannot be checked against this run; "
                f"pass --overwrite to start the evaluation again"
            )
        if header.get("world") != world:
            raise UserError(
                f"{path} was written by {header.get('world')} data-parallel rank(s), this run has {world}: "
                f"resume with the same --nproc / --tp (or pass --overwrite to start again)"
            )
        differ = _differences(header.get("fingerprint", {}), fingerprint)
        if differ:
            raise UserError(
                f"{path} was written with another setting: {'; '.join(differ)}; resume with the same "
                f"checkpoint, task, data and sampling flags, or pass --overwrite to start again"
            )
        kept[int(header["rank"])] = rows
    return kept


def whole_batches(rows: Sequence[dict], batches: Sequence[int]) -> List[dict]:
    """The longest prefix of ``rows`` made of whole batches of the sizes ``batches`` (in rows, in
    order): a batch cut part-way is decoded again."""
    count = 0
    for size in batches:
        if count + size > len(rows):
            break
        count += size
    return list(rows[:count])
