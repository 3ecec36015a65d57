"""Reward shaping terms that any task can add to its reward (see :class:`~.base.Task`).

``anti_short_boxed_bonus`` is the StableDRL release's "anti short boxed" term
(Zhong et al. 2026, public code): 1.0 for every completion except a *short* one
(fewer than ``min_chars`` non-whitespace characters) that is essentially only a
``\\boxed{...}``, i.e. either

* a *pure boxed answer*: the stripped text is optional ``$`` / whitespace, one
  ``\\boxed{...}`` whose content has no ``}``, then optional ``$`` / whitespace,
  closing punctuation (``. ? ! ' "`` and curly quotes) and whitespace; or
* less than ``min_ratio`` of its non-whitespace characters lie outside the
  ``\\boxed{...}`` spans (each span runs from ``\\boxed{`` to the first ``}``
  after it, so nested braces end the span early, as in the release);

which scores 0.0. It rewards showing the reasoning instead of blurting an answer.
An empty (or all-whitespace) completion has no characters outside a box and scores 0.0.

Ratios exactly at ``min_ratio`` pass (``17 / 20`` is not below ``0.85``); the
release divides by ``n + 1e-6``, which would score such an exact tie 0.0.

Hostile input: every step is a single left-to-right scan in C (``str.split``,
``str.find`` and one-character-class regex runs, which cannot backtrack), and
the box search only runs on completions with fewer than ``min_chars``
non-whitespace characters, so the cost is linear in the length whatever the
content. It never raises: a non-``str`` is scored as ``str(value)`` (as in the
release) and anything that still fails scores 0.0 (the release zeroes the batch's
term when it raises).
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

logger = logging.getLogger(__name__)

ANTI_SHORT_BOXED_MIN_CHARS = 200
"""Completions with at least this many non-whitespace characters always get the bonus."""
ANTI_SHORT_BOXED_MIN_RATIO = 0.85
"""Short completions need at least this share of non-whitespace characters outside ``\\boxed{}``."""

_BOXED_OPEN = "\\boxed{"
# Each regex is one greedy character-class run used with .match at a given position: linear, no backtracking.
_WS_OR_DOLLAR_RUN = re.compile(r"[\s$]*")
_CLOSING_PUNCT_RUN = re.compile("[.?!'\"\u201c\u201d\u2019]*")
_WS_RUN = re.compile(r"\s*")


def _non_ws_count(text: str) -> int:
    """Characters of ``text`` that are not whitespace (``str.isspace``, the same set as regex ``\\s``)."""
    return sum(map(len, text.split()))


def _is_pure_boxed(text: str) -> bool:
    """``text`` (already stripped) is ``[\\s$]* \\boxed{[^}]*} [\\s$]* [closing punct]* \\s*`` and nothing else."""
    start = _WS_OR_DOLLAR_RUN.match(text).end()
    if not text.startswith(_BOXED_OPEN, start):
        return False
    close = text.find("}", start + len(_BOXED_OPEN))
    if close < 0:
        return False
    # [\s$]* then [punct]* then \s*: greedy runs decide it (the three classes only share whitespace,
    # and whitespace the first run takes could only have been taken by the last).
    end = _WS_OR_DOLLAR_RUN.match(text, close + 1).end()
    end = _CLOSING_PUNCT_RUN.match(text, end).end()
    end = _WS_RUN.match(text, end).end()
    return end == len(text)


def _non_ws_inside_boxes(text: str) -> int:
    """Non-whitespace characters inside the ``\\boxed{...}`` spans (``\\boxed{`` up to the first ``}``).

    Spans are taken left to right without overlap; a ``\\boxed{`` with no ``}`` after it ends the search
    (no later one can have a ``}`` either).
    """
    inside, pos = 0, 0
    while True:
        start = text.find(_BOXED_OPEN, pos)
        if start < 0:
            return inside
        close = text.find("}", start + len(_BOXED_OPEN))
        if close < 0:
            return inside
        inside += _non_ws_count(text[start : close + 1])
        pos = close + 1


def check_anti_short_boxed_thresholds(min_chars: Any, min_ratio: Any) -> tuple[int, float]:
    """Validate the two thresholds; returns them as (int, float) or raises ``ValueError``."""
    if isinstance(min_chars, bool) or not isinstance(min_chars, int) or min_chars < 0:
        raise ValueError(f"anti_short_boxed_min_chars must be an int >= 0, got {min_chars!r}")
    if (
        isinstance(min_ratio, bool)
        or not isinstance(min_ratio, (int, float))
        or not math.isfinite(min_ratio)
        or not 0.0 <= min_ratio <= 1.0
    ):
        raise ValueError(f"anti_short_boxed_min_ratio must be a number in [0, 1], got {min_ratio!r}")
    return int(min_chars), float(min_ratio)


def anti_short_boxed_bonus(
    completion: Any, *, min_chars: int = ANTI_SHORT_BOXED_MIN_CHARS, min_ratio: float = ANTI_SHORT_BOXED_MIN_RATIO
) -> float:
    """1.0, or 0.0 for a short completion that is (mainly) just a ``\\boxed{}`` (see module docstring)."""
    try:
        text = completion if isinstance(completion, str) else str(completion)
        total = _non_ws_count(text)
        if total >= min_chars:
            return 1.0
        text = text.strip()
        if _is_pure_boxed(text):
            return 0.0
        outside = total - _non_ws_inside_boxes(text)
        ratio = outside / total if total else 0.0
        return 0.0 if ratio < min_ratio else 1.0
    except Exception:  # hostile input must never crash training
        logger.debug("anti_short_boxed_bonus failed; scoring 0", exc_info=True)
        return 0.0
