"""Library side of evaluation: scoring, sharding over DP ranks, JSONL output.

Sharding (``shard_indices`` / ``shard_examples``), deterministic, no RNG:

* ``"contiguous"`` (default): rank r gets one block of consecutive examples;
  block sizes differ by at most one, the first ``len % world_size`` ranks
  get the extra one. Concatenating the shards in rank order restores the
  original order.
* ``"strided"``: rank r gets examples r, r + world_size, r + 2 world_size...

Each shard is a partition (every example on exactly one rank). Records carry
``index`` (``example.meta["index"]``, the position in the full split, else the
position in the list given) so gathered records can be re-ordered.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence, TypeVar

from stabledrl_mcore.tasks.base import Example, Task

T = TypeVar("T")
SHARD_MODES = ("contiguous", "strided")


def evaluate_completions(
    task: Task, examples: Sequence[Example], completions: Sequence[str], prompts: Sequence[str] | None = None
) -> tuple[float, list[dict[str, Any]]]:
    """Score one completion per example; returns (accuracy, records).

    accuracy = mean of ``task.is_correct`` (full reward), 0.0 for no examples.
    A task with a batch method ``rewards(completions, references)`` (``rollout.reward_fn``) scores
    through it. Each record: index, prompt, reference, completion, extracted, reward, correct. With
    ``prompts`` (the exact texts the model was given, chat template included) ``prompt`` is
    that text and ``question`` the example's own; without, ``prompt`` is the example's.
    """
    if len(examples) != len(completions):
        raise ValueError(f"got {len(examples)} examples but {len(completions)} completions")
    if prompts is not None and len(prompts) != len(examples):
        raise ValueError(f"got {len(examples)} examples but {len(prompts)} prompts")
    records: list[dict[str, Any]] = []
    batch = getattr(task, "rewards", None)  # rollout.reward_fn: the calls run in parallel
    rewards = batch(list(completions), [ex.reference for ex in examples]) if batch is not None else None
    for i, (ex, completion) in enumerate(zip(examples, completions)):
        try:
            extracted = task.extract_answer(completion)
        except Exception:
            extracted = None
        reward = task.reward(completion, ex.reference) if rewards is None else rewards[i]
        records.append(
            {
                "index": ex.meta.get("index", i),
                "prompt": ex.prompt if prompts is None else prompts[i],
                **({} if prompts is None else {"question": ex.prompt}),
                "reference": ex.reference,
                "completion": completion,
                "extracted": extracted,
                "reward": reward,
                "correct": bool(task.is_correct(completion, ex.reference)),
            }
        )
    accuracy = sum(r["correct"] for r in records) / len(records) if records else 0.0
    return accuracy, records


def write_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> Path:
    """Write one JSON object per line (parent dirs created); returns the path.

    Non-JSON values are written with ``str``; lone surrogates in model output
    are written as ``\\uXXXX`` escapes, so the file is always valid UTF-8 JSONL.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8", errors="backslashreplace") as f:
        for rec in records:
            f.write(_line(rec))
    return out


def _line(rec: dict[str, Any]) -> str:
    return json.dumps(rec, ensure_ascii=False, default=str) + "\n"


class JsonlAppender:
    """A JSONL file written as the records finish: each :meth:`append` writes its records and
    flushes them, so a run killed part-way leaves every finished row on disk (as :func:`write_jsonl`
    writes them). The file is created empty (replaced) when opened, or appended to with ``append``."""

    def __init__(self, path: str | os.PathLike, *, append: bool = False) -> None:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        self.path = out
        self._file = open(out, "a" if append else "w", encoding="utf-8", errors="backslashreplace")

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        self._file.write("".join(_line(rec) for rec in records))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def shard_indices(n: int, rank: int, world_size: int, mode: str = "contiguous") -> list[int]:
    """Indices of ``range(n)`` that ``rank`` of ``world_size`` handles (see module docstring)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if mode == "strided":
        return list(range(rank, n, world_size))
    if mode != "contiguous":
        raise ValueError(f"unknown shard mode {mode!r}; valid: {', '.join(SHARD_MODES)}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


def shard_examples(examples: Sequence[T], rank: int, world_size: int, mode: str = "contiguous") -> list[T]:
    """The examples of ``rank``'s shard (see ``shard_indices``)."""
    return [examples[i] for i in shard_indices(len(examples), rank, world_size, mode)]
