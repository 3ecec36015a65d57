"""``qa``: question + reference answer from your own dataset, scored by a chosen verifier.

Rows come from any local file :mod:`.local_datasets` reads (``rollout.data_path``);
``rollout.prompt_key`` / ``rollout.answer_key`` name the two columns (default
``prompt`` and ``answer``). Options (``rollout.task_options``):

* ``verifier`` (default ``math``): how the extracted answer is compared with the reference:

  - ``exact``: equal strings after stripping and collapsing white space;
  - ``numeric``: the same number (``72``, ``72.0``, ``$72``, ``144/2``); references must be numbers;
  - ``math``: mathematically equivalent LaTeX (:func:`~.math_equiv.math_equal`, math-verify);
  - ``choice``: the same multiple-choice letter (``B``, ``(B)``, ``B.``, ``B) 42``, ``Answer: b``);
    references must be one letter;
  - ``regex``: the reference is a Python regular expression the whole answer must match
    (``re.fullmatch``), e.g. ``(12|twelve)``; a reference that does not compile names its row.

* ``pattern`` (default none): a regular expression that extracts the answer from the completion
  (its first group, else the whole match; the last match counts). Without it the answer is the
  last ``\\boxed{}`` content, else the ``<answer>`` tag content, as for GSM8K and MATH500.
* ``timeout_s`` (``math`` only), ``format_weight``, ``data_root`` and the options of every task.

The reward is 1 for a correct answer, else 0 (see ``format_weight`` in :mod:`.math_tasks`).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from stabledrl_mcore.tasks.base import Example, register_task
from stabledrl_mcore.tasks.extract import boxed_then_tag, numbers_equal, parse_number
from stabledrl_mcore.tasks.local_datasets import answer_value, text_value
from stabledrl_mcore.tasks.math_equiv import DEFAULT_TIMEOUT_S, math_equal
from stabledrl_mcore.tasks.math_tasks import _FileMathTask
from stabledrl_mcore.tasks.prompts import MATH_SYSTEM_PROMPT

QA_SYSTEM_PROMPT = (
    "Think step by step inside <reasoning> </reasoning> tags. Then give only the final "
    "answer inside <answer> </answer> tags."
)
CHOICE_SYSTEM_PROMPT = (
    "Think step by step inside <reasoning> </reasoning> tags. Then give only the letter "
    "of the correct option inside <answer> </answer> tags, for example <answer>B</answer>."
)
MAX_ANSWER_CHARS = 1000
"""Answers longer than this are wrong for every verifier (bounds regex and string work)."""


def _squash(text: str) -> str:
    return " ".join(text.split())


_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm)\s*\{([^{}]*)\}")
_CHOICE_ALONE = re.compile(
    r"(?:(?:the\s+)?(?:correct\s+)?(?:answer|option|choice)(?:\s+is)?\s*[:\-]?\s*)?"
    r"[(\[]?([A-Za-z])[)\]]?[.:]?",
    re.I,
)
_CHOICE_LEADING = re.compile(r"[(\[]?([A-Z])[)\].:]\s")


def choice_letter(text: str | None) -> str | None:
    """The option letter an answer names (upper case), or None: ``B``, ``(b)``, ``B.``, ``Answer: B``,
    ``\\text{(B)}`` or an option written out as ``B) 42``."""
    if text is None or len(text) > MAX_ANSWER_CHARS:
        return None
    s = _TEXT_WRAP.sub(r"\1", text).replace("$", "").strip()
    match = _CHOICE_ALONE.fullmatch(s) or _CHOICE_LEADING.match(s)
    return match.group(1).upper() if match else None


def _check_text(ref: str) -> str:
    return ref


def _check_numeric(ref: str) -> str:
    if parse_number(ref) is None:
        raise ValueError(f"reference {ref!r} is not a number (verifier numeric)")
    return ref


def _check_choice(ref: str) -> str:
    letter = choice_letter(ref)
    if letter is None:
        raise ValueError(f"reference {ref!r} is not an option letter such as 'B' (verifier choice)")
    return letter


def _check_regex(ref: str) -> str:
    try:
        re.compile(ref)
    except re.error as err:
        raise ValueError(f"reference {ref!r} is not a valid regular expression ({err}) (verifier regex)") from None
    return ref


@dataclass(frozen=True)
class Verifier:
    """How a ``qa`` answer is judged: ``check`` validates/normalises a reference (``ValueError``),
    ``correct(answer, reference, timeout_s)`` compares."""

    check: Callable[[str], str]
    correct: Callable[[str, str, float], bool]
    system_prompt: str = QA_SYSTEM_PROMPT


VERIFIERS: dict[str, Verifier] = {
    "exact": Verifier(_check_text, lambda a, r, t: _squash(a) == _squash(r)),
    "numeric": Verifier(_check_numeric, lambda a, r, t: numbers_equal(a, r), MATH_SYSTEM_PROMPT),
    "math": Verifier(_check_text, lambda a, r, t: math_equal(a, r, t), MATH_SYSTEM_PROMPT),
    "choice": Verifier(_check_choice, lambda a, r, t: choice_letter(a) == r, CHOICE_SYSTEM_PROMPT),
    "regex": Verifier(_check_regex, lambda a, r, t: re.fullmatch(r, a.strip()) is not None),
}


def get_verifier(name: str) -> Verifier:
    """The verifier called ``name``; ``ValueError`` with the closest name and the choices otherwise."""
    if name not in VERIFIERS:
        close = difflib.get_close_matches(str(name), list(VERIFIERS), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(f"qa: unknown verifier {name!r}{hint} (choose from {', '.join(VERIFIERS)})")
    return VERIFIERS[name]


@register_task("qa")
class QaTask(_FileMathTask):
    """Your dataset: ``prompt_key`` question, ``answer_key`` reference, ``verifier`` judges (module docstring)."""

    name = "qa"
    dir_name = "qa"
    fields = ("prompt", "answer")

    def __init__(
        self,
        verifier: str = "math",
        pattern: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        data_root: str | os.PathLike | None = None,
        format_weight: float = 0.0,
        prompt_key: str | None = None,
        answer_key: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(data_root, format_weight, prompt_key, answer_key, **options)
        self.verifier_name = verifier
        self.verifier = get_verifier(verifier)
        self.system_prompt = self.verifier.system_prompt
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if timeout_s != DEFAULT_TIMEOUT_S and verifier != "math":
            raise ValueError(f"timeout_s applies to verifier math only, not {verifier!r}")
        self.timeout_s = float(timeout_s)
        try:
            self.pattern = None if pattern is None else re.compile(pattern)
        except (re.error, TypeError) as err:
            raise ValueError(f"pattern {pattern!r} is not a regular expression ({err})") from None
        self.format_hint = f"{self.prompt_key!r} (question) and {self.answer_key!r} (reference answer) fields"

    def _missing_message(self, path: Any, split: str) -> str:
        return (
            f"qa: data not found: {path} ({self.format_hint}); give your file or folder with "
            f"rollout.data_path (training), eval.data_path (held-out), --data-path (stabledrl eval) "
            f"or path= (Python)"
        )

    def _rows(self, split: str, path: str | None, source: str) -> list[tuple[str, dict[str, Any]]]:
        if source != "local":
            raise ValueError(f"qa reads local files only (source='local'), got source={source!r}")
        return super()._rows(split, path, source)

    def _example(self, row: dict[str, Any], index: int) -> Example:
        reference = self.check_reference(answer_value(row, self.answer_key))
        return Example(prompt=text_value(row, self.prompt_key), reference=reference, meta={"index": index})

    def check_reference(self, reference: Any) -> str:
        return self.verifier.check(super().check_reference(reference).strip())

    def extract_answer(self, completion: str) -> str | None:
        """The ``pattern`` match (its first group) if a pattern is set, else boxed / ``<answer>`` content."""
        if self.pattern is None:
            return boxed_then_tag(completion)
        last = None
        for last in self.pattern.finditer(completion):
            pass
        if last is None:
            return None
        return (last.group(1) if self.pattern.groups else last.group(0)).strip()

    def _correct(self, answer: str | None, reference: str) -> bool:
        if answer is None or len(answer) > MAX_ANSWER_CHARS:
            return False
        return self.verifier.correct(answer, reference, self.timeout_s)
