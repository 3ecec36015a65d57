"""AIME 2024 and AIME 2025: competition problems with integer answers 0-999, from local files.

Public formats, read by :mod:`.local_datasets` (JSONL, parquet, ...):

* ``aime2024``: Hugging Face ``Maxwell-Jia/AIME_2024`` (its only split is ``train``), columns
  ``ID, Problem, Solution, Answer`` (``Answer`` an integer);
* ``aime2025``: ``opencompass/AIME2025`` (``AIME2025-I`` and ``AIME2025-II``, split ``test``),
  ``{"question": str, "answer": "70"}``.

Default path ``<data_root>/aime2024/<split>.jsonl`` (or ``.parquet``, ...), as for GSM8K; the
evaluation split is ``test``, so save the 30 problems as ``test``. The answer is taken from
the last ``\\boxed{}`` (else the ``<answer>`` tag) and must be the same integer (``070`` = ``70``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from stabledrl_mcore.tasks.base import Example, register_task
from stabledrl_mcore.tasks.extract import parse_number
from stabledrl_mcore.tasks.local_datasets import answer_value, text_value
from stabledrl_mcore.tasks.math_tasks import _FileMathTask

_INTEGER = re.compile(r"[+]?([0-9]+)(?:\.0+)?")


def aime_answer(text: str) -> int:
    """The integer 0-999 a reference spells (``"204"``, ``"070"``, ``204.0``); ``ValueError`` otherwise."""
    match = _INTEGER.fullmatch(text.strip())
    if match is None or int(match.group(1)) > 999:
        raise ValueError(f"AIME answer must be an integer 0-999, got {text!r}")
    return int(match.group(1))


class _AimeTask(_FileMathTask):
    """Shared by both years: integer references, exact integer compare."""

    extra_meta: tuple[str, ...] = ()

    def _example(self, row: dict[str, Any], index: int) -> Example:
        reference = self.check_reference(answer_value(row, self.answer_key))
        meta = {"index": index, **{k: row[k] for k in self.extra_meta if k in row}}
        return Example(prompt=text_value(row, self.prompt_key), reference=reference, meta=meta)

    def check_reference(self, reference: Any) -> str:
        return str(aime_answer(super().check_reference(reference)))

    def _correct(self, answer: str | None, reference: str) -> bool:
        value = parse_number(answer)
        return value is not None and value == int(reference)


@register_task("aime2024")
class Aime2024Task(_AimeTask):
    """AIME 2024 (``Maxwell-Jia/AIME_2024``: ``ID, Problem, Solution, Answer``)."""

    name = "aime2024"
    dir_name = "aime2024"
    hf_id = ("Maxwell-Jia/AIME_2024",)
    fields = ("Problem", "Answer")
    extra_meta = ("ID", "Solution")
    format_hint = "'Problem' and 'Answer' (an integer 0-999) fields, as Maxwell-Jia/AIME_2024"

    def _download_command(self, path: Path, split: str) -> str:
        return (
            f"python -c \"import datasets; datasets.load_dataset('Maxwell-Jia/AIME_2024')['train'].to_json('{path}')\""
        )


@register_task("aime2025")
class Aime2025Task(_AimeTask):
    """AIME 2025 I and II (``opencompass/AIME2025``: ``question, answer``)."""

    name = "aime2025"
    dir_name = "aime2025"
    hf_id = ("opencompass/AIME2025",)
    fields = ("question", "answer")
    format_hint = "'question' and 'answer' (an integer 0-999) fields, as opencompass/AIME2025"

    def _download_command(self, path: Path, split: str) -> str:
        return (
            f"python -c \"import datasets as d; d.concatenate_datasets([d.load_dataset('opencompass/AIME2025', "
            f"c)['test'] for c in ('AIME2025-I', 'AIME2025-II')]).to_json('{path}')\""
        )
