"""Answer extraction from (hostile) completions: boxed, answer tags, numbers.

All functions take any ``str`` and return quickly, whatever its size:

* the completion is searched with ``str.rfind`` (linear, in C);
* brace matching looks at most ``MAX_SCAN_CHARS`` characters after a
  ``\\boxed{`` and tries at most ``MAX_BOXED_TRIES`` candidates, so the Python
  level work is bounded by a constant;
* numbers longer than ``MAX_NUMBER_DIGITS`` digits are rejected (no huge
  integer conversion).

Digits are ASCII only: ``"٧٢"`` or full-width digits are not numbers here.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_SCAN_CHARS = 4096
MAX_BOXED_TRIES = 8
MAX_TAG_CHARS = 4096
MAX_NUMBER_TEXT = 1000
MAX_NUMBER_DIGITS = 60

_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.S)
_BOXED = "\\boxed"
_OPEN_TAG, _CLOSE_TAG = "<answer>", "</answer>"


def _match_brace(text: str, open_idx: int, max_chars: int) -> str | None:
    """Content of the brace group opening at ``text[open_idx] == '{'`` (escaped braces skipped)."""
    window = text[open_idx + 1 : open_idx + 1 + max_chars]
    depth = 1
    for m in _BRACE_TOKEN.finditer(window):
        tok = m.group()
        if tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
            if depth == 0:
                return window[: m.start()]
    return None


def last_boxed(text: str, *, max_chars: int = MAX_SCAN_CHARS, max_tries: int = MAX_BOXED_TRIES) -> str | None:
    """Stripped content of the last complete ``\\boxed{...}`` in ``text``, or None.

    Candidates are tried from the end; an unbalanced (or longer than
    ``max_chars``) one is skipped, at most ``max_tries`` are tried.
    """
    end = len(text)
    for _ in range(max_tries):
        i = text.rfind(_BOXED, 0, end)
        if i < 0:
            return None
        k = i + len(_BOXED)
        stop = min(len(text), k + 8)
        while k < stop and text[k] in " \t\r\n":
            k += 1
        if k < len(text) and text[k] == "{":
            content = _match_brace(text, k, max_chars)
            if content is not None:
                return content.strip()
        end = i
    return None


def answer_tag(text: str, *, max_chars: int = MAX_TAG_CHARS) -> str | None:
    """Stripped content of the last closed ``<answer>...</answer>``, or None if absent or too long."""
    close = text.rfind(_CLOSE_TAG)
    if close < 0:
        return None
    start = text.rfind(_OPEN_TAG, max(0, close - max_chars - len(_OPEN_TAG)), close)
    if start < 0:
        return None
    return text[start + len(_OPEN_TAG) : close].strip()


def boxed_then_tag(text: str) -> str | None:
    """The last ``\\boxed{}`` content, else the ``<answer>`` tag content, else None."""
    boxed = last_boxed(text)
    return boxed if boxed is not None else answer_tag(text)


def tag_then_boxed(text: str) -> str | None:
    """The ``<answer>`` tag content, else the last ``\\boxed{}`` content, else None."""
    tag = answer_tag(text)
    if tag is not None:
        inner = last_boxed(tag)
        return inner if inner is not None else tag
    return last_boxed(text)


# --------------------------------------------------------------------------- numbers

_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{([^{}]{0,200})\}")
_FRAC = re.compile(r"([-+]?)\s*\\[dt]?frac\s*\{\s*([-+]?[0-9.]{1,60})\s*\}\s*\{\s*([-+]?[0-9.]{1,60})\s*\}")
_THOUSANDS = re.compile(r"(?<=[0-9]),(?=[0-9]{3}(?![0-9]))")
_NUMBER = re.compile(
    r"(?:(?<![0-9])[-+])?(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
    r"(?:\s*/\s*(?:[0-9]+(?:\.[0-9]+)?))?",
    re.ASCII,
)
_DROP = ("\\$", "$", "\\!", "\\,", "\\;", "\\:", "\\%", "%", "\\left", "\\right", "\\ ")


def _to_fraction(token: str) -> Fraction | None:
    token = token.replace(" ", "")
    if sum(c.isdigit() for c in token) > MAX_NUMBER_DIGITS:
        return None
    try:
        if "/" in token:
            num, den = token.split("/", 1)
            d = Fraction(den)
            return None if d == 0 else Fraction(num) / d
        return Fraction(token)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def parse_number(text: str | None) -> Fraction | None:
    """The last number in a short answer string as an exact ``Fraction``, or None.

    Strips ``$``, ``\\$``, ``%``, thousands commas, ``\\text{...}`` wrappers and
    trailing units/punctuation; reads ``\\frac{a}{b}`` and ``a/b``. So
    ``"$1,000.00"``, ``"72.0"``, ``"72 apples."`` and ``"\\boxed{72}"``'s
    content all parse; ``"72.0" == "72"``.
    """
    if text is None or len(text) > MAX_NUMBER_TEXT:
        return None
    s = text.replace("\u2212", "-")
    for tok in _DROP:
        s = s.replace(tok, " ")
    s = _TEXT_CMD.sub(r" \1 ", s)
    s = _FRAC.sub(r" \1\2/\3 ", s)  # a sign before the fraction stays its sign
    s = _THOUSANDS.sub("", s)
    matches = _NUMBER.findall(s)
    if not matches:
        return None
    return _to_fraction(matches[-1])


def numbers_equal(a: str | None, b: str | None) -> bool:
    """True iff both strings parse (``parse_number``) to the same exact value."""
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and x == y
