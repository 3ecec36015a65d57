"""Countdown as the StableDRL release ran it (``task_options.reward_rule: release``).

The release's ``dataloaders/logic_puzzles.py`` (JianyuanZhong/StableDRL), re-derived:

* data: JSONL rows ``{"input": "30,100,93", "output": "23"}`` (``countdown_cd3_test.jsonl``),
  read through ``rollout.data_path``;
* prompt: the user turn ``Given numbers [30, 100, 93], find an equation that equals 23.`` plus
  :data:`RELEASE_INSTRUCTION`, no system prompt (its chat template gets the user message only);
* reward: the last ``<answer>...</answer>`` (stripped) is the equation; none: 0. Every integer in
  it (``\\d+``, so ``1.5`` uses 1 and 5) must come from the given numbers, each at most as often as
  given (a sub-multiset: not all need be used), else 0.1. It must consist of ``0-9 + - * / ( ) .``
  and whitespace and evaluate (as Python would: ``**`` and ``//`` included; here exactly, never by
  ``eval``), else 0.1. Then 1.0 if ``|value - target| < 1e-5``, else 0.1.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Optional

from stabledrl_mcore.tasks.arithmetic import EvaluationError, MalformedExpression, evaluate_expression
from stabledrl_mcore.tasks.base import Example
from stabledrl_mcore.tasks.local_datasets import load_rows

RELEASE_INSTRUCTION = (
    " Please put the reasoning in <reasoning> tags and the final equation in <answer> tags, "
    "e.g. <answer> 1 + 1 </answer>."
)
FORMAT_SCORE = 0.1
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_CHARS = re.compile(r"[\d+\-*/().\s]+")


def release_question(numbers: list[int], target: int) -> str:
    """The release's prompt text (``collate_fn_countdown``)."""
    return f"Given numbers {list(numbers)}, find an equation that equals {target}.{RELEASE_INSTRUCTION}"


def release_equation(completion: str) -> Optional[str]:
    """The last ``<answer>`` tag's content, stripped (None without one)."""
    found = _ANSWER.findall(completion)
    return found[-1].strip() if found else None


def release_score(completion: str, reference: dict[str, Any]) -> float:
    """1 / 0.1 / 0 as in the module docstring."""
    equation = release_equation(completion)
    if equation is None:
        return 0.0
    left = Counter(reference["numbers"])
    left.subtract(int(n) for n in re.findall(r"\d+", equation))
    if any(count < 0 for count in left.values()):
        return FORMAT_SCORE
    if not _CHARS.fullmatch(equation):
        return FORMAT_SCORE
    try:
        value, _ = evaluate_expression(equation, release_ops=True)
    except (MalformedExpression, EvaluationError):
        return FORMAT_SCORE
    return 1.0 if abs(value - reference["target"]) < 1e-5 else FORMAT_SCORE


def load_release_rows(path: str, split: str, limit: Optional[int] = None) -> list[Example]:
    """Examples of a file in the release's format (``input`` = comma-separated numbers, ``output`` =
    the target); a row that does not parse is named with its file and line."""
    examples = []
    for where, row in load_rows(path, split, required=("input", "output"), field="rollout.data_path"):
        try:
            numbers = [int(part.strip()) for part in str(row["input"]).split(",")]
            target = int(str(row["output"]).strip())
        except ValueError:
            raise ValueError(
                f'{where}: countdown (reward_rule=release) expects input like "30,100,93" and output '
                f'like "23", got input={row["input"]!r} output={row["output"]!r}'
            ) from None
        reference = {"numbers": numbers, "target": target}
        examples.append(
            Example(prompt=release_question(numbers, target), reference=reference, meta={"index": len(examples)})
        )
        if limit is not None and len(examples) >= limit:
            break
    return examples
