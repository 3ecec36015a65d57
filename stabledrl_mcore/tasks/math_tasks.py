"""GSM8K and MATH500: file-backed tasks with numeric / math-verify rewards.

Data comes from local JSONL files in the datasets' public formats:

* GSM8K: ``{"question": str, "answer": "<reasoning> #### <number>"}``,
  default path ``<data_root>/gsm8k/<split>.jsonl``;
* MATH500: ``{"problem": str, "solution": str, "answer": str, ...}``,
  default path ``<data_root>/math500/<split>.jsonl`` (the public set has
  only ``test``).

``data_root`` is the constructor argument, else ``$STABLEDRL_DATA``, else
``./data``. ``load(split, path=...)`` reads an explicit file instead. Both are
read by :mod:`.local_datasets`, so the files may also be parquet, JSON, CSV or a
``save_to_disk`` folder, and ``prompt_key`` / ``answer_key`` (``rollout.prompt_key``
/ ``rollout.answer_key``) rename the two columns.
``load(split, source="hf")`` reads through the ``datasets`` library (needs it
installed and network access); it is never tried implicitly.

Rewards (range (0, 1)): correctness of the answer taken from the last
``\\boxed{}`` (else the ``<answer>`` tag). With ``format_weight = w > 0`` the
reward is ``(1 - w) * correct + w * formatted``, where ``formatted`` means
the completion has a closed ``<answer>...</answer>`` tag containing the
answer; the default ``w = 0`` is pure correctness.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from stabledrl_mcore.common.errors import DataError
from stabledrl_mcore.tasks.base import Example, Task, register_task
from stabledrl_mcore.tasks.extract import answer_tag, boxed_then_tag, numbers_equal, parse_number
from stabledrl_mcore.tasks.local_datasets import (
    answer_value,
    check_local,
    is_saved_dataset,
    load_rows,
    split_file,
    text_value,
)
from stabledrl_mcore.tasks.math_equiv import DEFAULT_TIMEOUT_S, math_equal
from stabledrl_mcore.tasks.prompts import MATH_SYSTEM_PROMPT

DATA_ENV = "STABLEDRL_DATA"


def resolve_data_root(data_root: str | os.PathLike | None = None) -> Path:
    """``data_root`` if given, else ``$STABLEDRL_DATA``, else ``./data``."""
    if data_root is not None:
        return Path(data_root)
    return Path(os.environ.get(DATA_ENV) or "data")


def gsm8k_gold(answer_field: str) -> str:
    """The final answer after ``####`` in a GSM8K ``answer`` field, commas removed."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer_field[-80:]!r}")
    return answer_field.split("####")[-1].strip().replace(",", "")


class _FileMathTask(Task):
    """Shared loading logic for the two JSONL-backed tasks."""

    dir_name: str = ""
    hf_id: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    format_hint: str = ""

    def __init__(
        self,
        data_root: str | os.PathLike | None = None,
        format_weight: float = 0.0,
        prompt_key: str | None = None,
        answer_key: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)  # the options every task takes (base.BASE_TASK_OPTIONS)
        if not 0.0 <= format_weight <= 1.0:
            raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")
        self.data_root = data_root
        self.format_weight = float(format_weight)
        self.system_prompt = MATH_SYSTEM_PROMPT
        for key in (prompt_key, answer_key):
            if key is not None and (not isinstance(key, str) or not key):
                raise ValueError(f"prompt_key / answer_key must be non-empty column names, got {key!r}")
        self.prompt_key = prompt_key or self.fields[0]
        """Column of the question (``rollout.prompt_key``; default: the dataset's public name)."""
        self.answer_key = answer_key or self.fields[1]
        """Column of the reference answer (``rollout.answer_key``)."""

    def default_path(self, split: str) -> Path:
        return resolve_data_root(self.data_root) / self.dir_name / f"{split}.jsonl"

    def _missing_message(self, path: Path, split: str) -> str:
        return (
            f"{self.name}: data file not found: {path} (one JSON object per line with "
            f"{self.format_hint}); point to it with rollout.data_path=FILE (stabledrl train), "
            f"--data-path FILE (stabledrl eval) or path=FILE (Python), or set ${DATA_ENV} to the "
            f"data root holding {self.dir_name}/{split}.jsonl; to download it (network needed): "
            f"{self._download_command(path, split)}"
        )

    def _download_command(self, path: Path, split: str) -> str:
        hf_args = ", ".join(repr(a) for a in self.hf_id)
        return f"python -c \"import datasets; datasets.load_dataset({hf_args})['{split}'].to_json('{path}')\""

    def _rows(self, split: str, path: str | None, source: str) -> list[tuple[str, dict[str, Any]]]:
        """``(where, row)`` pairs, ``where`` naming the file and line (or the dataset and index)."""
        if source == "hf":
            try:
                import datasets  # optional dependency, never used implicitly
            except ImportError:
                raise ImportError(f"{self.name}: source='hf' needs the 'datasets' package") from None
            where = "/".join(self.hf_id)
            return [
                (f"{where}[{split}][{i}]", dict(r)) for i, r in enumerate(datasets.load_dataset(*self.hf_id)[split])
            ]
        if source != "local":
            raise ValueError(f"{self.name}: source must be 'local' or 'hf', got {source!r}")
        keys = (self.prompt_key, self.answer_key)
        if path is not None:
            local = check_local(path)
            if not local.exists():
                raise FileNotFoundError(self._missing_message(local, split))
            return load_rows(local, split, required=keys)
        folder = resolve_data_root(self.data_root) / self.dir_name  # <split>.jsonl (or .parquet, ...)
        if split_file(folder, split) is None and not is_saved_dataset(folder):
            raise FileNotFoundError(self._missing_message(self.default_path(split), split))
        return load_rows(folder, split, required=keys)

    def _example(self, row: dict[str, Any], index: int) -> Example:
        raise NotImplementedError

    def load(
        self,
        split: str,
        *,
        path: str | None = None,
        limit: int | None = None,
        seed: int = 0,
        n: int | None = None,
        source: str = "local",
    ) -> list[Example]:
        """Examples of ``split`` in file order (``seed`` and ``n`` are unused here); first ``limit``."""
        rows = self._rows(split, path, source)
        if limit is not None:
            rows = rows[: max(0, int(limit))]
        examples = []
        for index, (where, row) in enumerate(rows):
            try:
                examples.append(self._example(row, index))
            except ValueError as err:
                raise DataError(f"{where}: {err}") from None
        return examples

    def check_reference(self, reference: Any) -> str:
        if isinstance(reference, (int, float)) and not isinstance(reference, bool):
            reference = str(reference)
        if not isinstance(reference, str) or not reference.strip():
            raise ValueError(f"{self.name}: reference must be a non-empty answer string, got {reference!r}")
        return reference

    def extract_answer(self, completion: str) -> str | None:
        """Last ``\\boxed{}`` content, else ``<answer>`` tag content, else None."""
        return boxed_then_tag(completion)

    def _correct(self, answer: str | None, reference: str) -> bool:
        raise NotImplementedError

    def _reward(self, completion: str, reference: str) -> float:
        correct = float(self._correct(self.extract_answer(completion), reference))
        if self.format_weight == 0.0:
            return correct
        tag = answer_tag(completion)
        formatted = float(bool(tag))
        return (1.0 - self.format_weight) * correct + self.format_weight * formatted

    def same_answer(self, a: str, b: str) -> bool:
        """Two extracted answers are the same when the task's verifier says so (maj@k votes)."""
        try:
            return bool(self._correct(a, b))
        except Exception:
            return super().same_answer(a, b)

    def is_correct(self, completion: str, reference: Any) -> bool:
        ref = self.check_reference(reference)
        try:
            return self._correct(self.extract_answer(completion), ref)
        except Exception:
            return False


@register_task("gsm8k")
class Gsm8kTask(_FileMathTask):
    """GSM8K grade-school math; reference = final number string; exact numeric compare."""

    name = "gsm8k"
    dir_name = "gsm8k"
    hf_id = ("openai/gsm8k", "main")
    fields = ("question", "answer")
    format_hint = "'question' and 'answer' fields, the answer ending in '#### <number>'"

    def _example(self, row: dict[str, Any], index: int) -> Example:
        solution = text_value(row, self.answer_key)
        gold = self.check_reference(gsm8k_gold(solution))
        return Example(
            prompt=text_value(row, self.prompt_key), reference=gold, meta={"index": index, "solution": solution}
        )

    def check_reference(self, reference: Any) -> str:
        ref = super().check_reference(reference)
        if parse_number(ref) is None:
            raise ValueError(f"gsm8k: reference {ref!r} is not a number")
        return ref

    def _correct(self, answer: str | None, reference: str) -> bool:
        return numbers_equal(answer, reference)


@register_task("math500")
class Math500Task(_FileMathTask):
    """MATH500 competition math; reference = LaTeX answer; ``math-verify`` equivalence."""

    name = "math500"
    dir_name = "math500"
    hf_id = ("HuggingFaceH4/MATH-500",)
    fields = ("problem", "answer")
    format_hint = "'problem', 'answer' (LaTeX final answer) and 'solution' fields"

    def __init__(
        self,
        data_root: str | os.PathLike | None = None,
        format_weight: float = 0.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **options: Any,
    ) -> None:
        super().__init__(data_root, format_weight, **options)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)

    def _example(self, row: dict[str, Any], index: int) -> Example:
        meta = {"index": index, "solution": row.get("solution", "")}
        for key in ("subject", "level", "unique_id"):
            if key in row:
                meta[key] = row[key]
        return Example(prompt=text_value(row, self.prompt_key), reference=answer_value(row, self.answer_key), meta=meta)

    def _correct(self, answer: str | None, reference: str) -> bool:
        return math_equal(answer, reference, self.timeout_s)
