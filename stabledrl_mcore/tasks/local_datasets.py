"""Rows of local dataset files: JSONL, JSON, parquet, CSV and ``datasets.save_to_disk`` folders.

:func:`load_rows` turns a path and a split into ``(where, row)`` pairs, ``where``
naming the file and line (JSONL, CSV) or the row index (JSON, parquet, Arrow
folders), so a bad row is reported where the user can find it (bytes that are not UTF-8 too: the
file and line, or the row and column, with how to re-encode). The path is

* a file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``): the rows of the
  requested split, whatever its name;
* a ``save_to_disk`` folder of one dataset, or of a ``DatasetDict`` (the split
  is picked from it);
* a folder of split files, ``<dir>/<split>.<ext>``.

Nothing is ever downloaded: a hub name (``openai/gsm8k``) or a URL is refused.
Parquet and Arrow folders are read through Hugging Face ``datasets`` (in memory
or memory-mapped, no cache files written); JSONL, JSON and CSV are read with the
standard library, so every value of a CSV is a string.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable

from stabledrl_mcore.common.errors import DataError
from stabledrl_mcore.common.files import special_kind

FILE_FORMATS = (".jsonl", ".json", ".parquet", ".csv")
"""Suffixes of the data files read here, in the order a folder of split files is searched."""
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

Row = dict[str, Any]


def check_local(path: str | os.PathLike, field: str = "path") -> Path:
    """``path`` as a :class:`Path`; a URL or a hub name that is not a local path, or a FIFO or a
    device (reading one blocks or never ends), raises :class:`DataError`."""
    text = os.fspath(path)
    if "://" in text or text.startswith(("hf:", "hf.co/", "huggingface.co/")):
        raise DataError(
            f"{field}={text}: only local files are read (no downloads); save the dataset first, "
            f"e.g. datasets.load_dataset(...).save_to_disk(DIR), and give DIR"
        )
    local = Path(text)
    refuse_special(local, field)
    if not local.exists() and _HUB_NAME.fullmatch(text) and not local.suffix:
        raise DataError(
            f"{field}={text}: no such local file or folder, and only local files are read (a hub "
            f"dataset is not downloaded): python -c \"import datasets; datasets.load_dataset('{text}')"
            f".save_to_disk('data/{local.name}')\" and give that folder"
        )
    return local


def refuse_special(path: Path, field: str) -> None:
    """Raise :class:`DataError` naming ``path`` if it is a FIFO, a device or a socket (not opened)."""
    kind = special_kind(path)
    if kind:
        raise DataError(f"{field}={path} is {kind}, not a regular file; give a data file or folder")


def is_saved_dataset(path: Path) -> bool:
    """True for a ``save_to_disk`` folder (one ``Dataset`` or a ``DatasetDict``)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def split_file(folder: Path, split: str) -> Path | None:
    """``<folder>/<split>.<ext>`` for the first suffix of :data:`FILE_FORMATS` that exists, else None."""
    for suffix in FILE_FORMATS:
        candidate = folder / f"{split}{suffix}"
        if candidate.is_file() or special_kind(candidate):  # a FIFO is found, then refused by name
            return candidate
    return None


def load_rows(
    path: str | os.PathLike, split: str = "train", *, required: Iterable[str] = (), field: str = "path"
) -> list[tuple[str, Row]]:
    """``(where, row)`` for every row of ``split`` at ``path`` (see the module docstring).

    ``required`` columns must exist (a JSONL/JSON row without one names its line/index; a
    columnar file without one names the column and lists those it has). ``field`` names the
    setting the path came from in error messages. Missing paths raise ``FileNotFoundError``.
    """
    required = tuple(required)
    local = check_local(path, field)
    if not local.exists():
        raise FileNotFoundError(
            f"{field}={local}: no such file or directory (a .jsonl, .json, .parquet or .csv "
            f"file, a save_to_disk folder, or a folder of <split>.<ext> files)"
        )
    if local.is_dir() and not is_saved_dataset(local):
        found = split_file(local, split)
        if found is None:
            have = sorted(p.name for p in local.iterdir() if p.suffix in FILE_FORMATS) or ["no data files"]
            raise FileNotFoundError(
                f"{field}={local}: no {split}.jsonl/.json/.parquet/.csv for split {split!r} "
                f"in this folder (it holds: {', '.join(have)})"
            )
        local = found
    refuse_special(local, field)
    if local.is_dir():
        rows = _saved_rows(local, split)
    elif local.suffix == ".jsonl":
        rows = [(f"{local}:{n}", row) for n, row in _jsonl_rows(local)]
    elif local.suffix == ".json":
        rows = _json_rows(local)
    elif local.suffix == ".parquet":
        rows = _parquet_rows(local)
    elif local.suffix == ".csv":
        rows = _csv_rows(local)
    else:
        raise DataError(
            f"{field}={local}: unknown data file type {local.suffix!r} (use {', '.join(FILE_FORMATS)} "
            f"or a save_to_disk folder)"
        )
    if not rows:
        raise DataError(f"{local} holds no examples (empty file)")
    _check_required(local, rows, required)
    return rows


def _check_required(source: Path, rows: list[tuple[str, Row]], required: tuple[str, ...]) -> None:
    columnar = source.is_dir() or source.suffix in (".parquet", ".csv")
    for where, row in rows:
        missing = [k for k in required if k not in row]
        if not missing:
            continue
        if columnar:  # every row has the same columns: name the file, not a row
            raise DataError(
                f"{source}: no column(s) {missing}; its columns: {', '.join(map(str, row))} "
                f"(choose them with rollout.prompt_key / rollout.answer_key)"
            )
        raise DataError(f"{where}: missing field(s) {missing}; expected {list(required)}")


def _utf8_fix(path: Path) -> str:
    return (
        f"re-encode the file as UTF-8, e.g. iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name} "
        f"(-f: the encoding it was written in)"
    )


def _read_utf8(path: Path) -> str:
    """The text of ``path``; :class:`DataError` naming the line and byte offset of the first byte
    that is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        bad = data[err.start : err.end]
        raise DataError(
            f"{path}:{line}: not valid UTF-8 (byte offset {err.start}: {bad!r}, {err.reason}); {_utf8_fix(path)}"
        ) from None


def _text_lines(path: Path, newline: str | None = None) -> io.StringIO:
    """The file's lines as ``open(path, encoding="utf-8", newline=newline)`` gives them, after a UTF-8 check."""
    return io.StringIO(_read_utf8(path), newline=newline)


def _jsonl_rows(path: Path) -> list[tuple[int, Row]]:
    rows = []
    with _text_lines(path) as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append((lineno, row))
    return rows


def _json_rows(path: Path) -> list[tuple[str, Row]]:
    """A JSON array of objects, ``{"<key>": [objects]}`` with one list, or JSON lines in a .json file."""
    text = _read_utf8(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return [(f"{path}:{n}", row) for n, row in _jsonl_rows(path)]  # JSON lines named .json
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: expected a JSON array of objects (or an object holding one such list)")
        data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of objects, got {type(data).__name__}")
    for index, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {index}: expected a JSON object, got {type(row).__name__}")
    return [(f"{path} row {index}", row) for index, row in enumerate(data)]


def _csv_rows(path: Path) -> list[tuple[str, Row]]:
    rows = []
    with _text_lines(path, newline="") as handle:
        reader = csv.DictReader(handle)
        for index, row in enumerate(reader):
            if None in row:
                raise DataError(
                    f"{path}:{reader.line_num} (row {index}): more values than the header's "
                    f"{len(reader.fieldnames or [])} columns"
                )
            rows.append((f"{path}:{reader.line_num} (row {index})", dict(row)))
    return rows


def _parquet_rows(path: Path) -> list[tuple[str, Row]]:
    import datasets
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises many types for a damaged file
        raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    return _table_rows(str(path), datasets.Dataset(table), table)


def _table_rows(where: str, data, table) -> list[tuple[str, Row]]:
    """``(where row i, row)`` of a ``datasets.Dataset``; a string that is not UTF-8 names its row and column."""
    try:
        return [(f"{where} row {index}", row) for index, row in enumerate(data)]
    except UnicodeDecodeError as err:
        row, column, err = _first_bad_utf8(table) or (None, None, err)
        cell = "" if row is None else f" row {row}, column {column!r}"
        raise DataError(
            f"{where}{cell}: not valid UTF-8 (byte {err.start} of the value: {err.object[err.start : err.end]!r}, "
            f"{err.reason}); rewrite the column as UTF-8 text (e.g. decode it with its real encoding in pandas "
            f"and save again)"
        ) from None


def _first_bad_utf8(table) -> tuple[int, str, UnicodeDecodeError] | None:
    """(row, column, error) of the first string cell of a pyarrow table that is not UTF-8."""
    import pyarrow as pa

    for name in table.column_names:
        column = table.column(name)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            continue
        for index in range(len(column)):
            try:
                column[index].as_py()
            except UnicodeDecodeError as err:
                return index, name, err
    return None


def _saved_rows(path: Path, split: str) -> list[tuple[str, Row]]:
    import datasets

    for inner in sorted(path.rglob("*")):
        if special_kind(inner):
            raise DataError(f"{inner} (in the dataset folder {path}) is {special_kind(inner)}, not a regular file")

    try:
        data = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001
        raise DataError(f"{path}: not a readable save_to_disk folder ({type(err).__name__}: {err})") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DataError(f"{path}: no split {split!r}; its splits: {', '.join(data)}")
        data, where = data[split], f"{path} [{split}]"
    else:
        where = str(path)
    return _table_rows(where, data, data.data.table)


def text_value(row: Row, key: str) -> str:
    """``row[key]`` as a non-empty string; ``ValueError`` naming the field for None, empty or a non-string."""
    value = row.get(key)
    if not isinstance(value, str):
        kind = "empty (null)" if value is None else f"a {type(value).__name__}, not a string"
        raise ValueError(f"field {key!r} is {kind}")
    if not value.strip():
        raise ValueError(f"field {key!r} is empty")
    return value


def answer_value(row: Row, key: str) -> str:
    """``row[key]`` as a non-empty answer string: strings as they are, integers and finite floats
    written out; ``ValueError`` naming the field otherwise (None, empty, bool, list, ...)."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        kind = "empty (null)" if value is None else f"a {type(value).__name__}, not a string or number"
        raise ValueError(f"field {key!r} is {kind}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"field {key!r} is {value}, not a finite number")
    text = str(value)
    if not text.strip():
        raise ValueError(f"field {key!r} is empty")
    return text
