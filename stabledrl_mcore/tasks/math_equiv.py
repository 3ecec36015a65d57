"""Mathematical equivalence of two short LaTeX answers, with a hard time limit.

``math_equal(pred, gold, timeout_s)`` answers in three stages:

1. strict normalised string compare (``normalize_latex``): cheap, exact;
2. exact numeric compare when both sides are plain numbers (``parse_number``);
3. HF ``math-verify`` (``parse`` + ``verify``, LaTeX extraction only, so no
   ``sympy.parse_expr``/``eval`` is ever reached) under a wall-clock deadline.

The deadline is our own ``signal.setitimer`` alarm covering parse *and*
verify together (math-verify's own timeouts are whole seconds per call and
are disabled here). Signals only work in the main thread, so when called
from another thread, or while some other ``ITIMER_REAL`` alarm is armed,
stage 3 is skipped: the answer is decided by stages 1-2 alone (documented
fallback, never a hang). Predictions longer than ``MAX_MATH_ANSWER_CHARS``,
nested deeper than ``MAX_NESTING`` or containing ``__`` never reach sympy.
"""

from __future__ import annotations

import functools
import logging
import re
import signal
import threading
from typing import Any, Callable, TypeVar

from stabledrl_mcore.common.errors import UserError
from stabledrl_mcore.tasks.extract import parse_number

T = TypeVar("T")

MAX_MATH_ANSWER_CHARS = 1000
MAX_NESTING = 40
DEFAULT_TIMEOUT_S = 0.5


class Deadline(BaseException):
    """Raised by the alarm handler; a BaseException so library ``except Exception`` can't swallow it."""


class _QuietTimeoutWarning(logging.Filter):
    """Drop math-verify's 'Timeout is disabled' warning: we enforce our own deadline."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_QuietTimeoutWarning())


def signals_available() -> bool:
    """True if a SIGALRM deadline can be used here (main thread, no alarm already armed)."""
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    )


def _inside(frame: Any, code: Any) -> bool:
    """True if ``frame`` or one of its callers runs ``code``."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def call_with_deadline(fn: Callable[[], T], seconds: float, default: T) -> T:
    """Run ``fn()`` with a SIGALRM deadline; ``default`` if it runs out.

    Caller must check ``signals_available()`` first. If a library swallows the
    interrupt, the alarm re-fires every 50 ms until ``fn`` gives up. The alarm
    raises only inside ``fn`` (its frame is on the interrupted stack): one that
    lands after ``fn`` returned or while its :class:`Deadline` unwinds, before
    the timer is disarmed, is ignored, so no :class:`Deadline` ever escapes and
    the handler is always restored (under load such a late alarm is common).
    """
    state = {"armed": True}

    def run_fn() -> T:
        return fn()

    def handler(signum: int, frame: Any) -> None:
        if state["armed"] and _inside(frame, run_fn.__code__):
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            raise Deadline()

    old = signal.signal(signal.SIGALRM, handler)
    result = default
    try:
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
        result = run_fn()
    except Deadline:
        result = default
    finally:
        state["armed"] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return result


_WRAPPERS = re.compile(r"\\(?:left|right|displaystyle|!|,|;|:|\s)|\$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def normalize_latex(s: str) -> str:
    """Strict normalisation for string compare: spacing, ``\\left``/``\\right``, ``\\text{}``, ``dfrac``."""
    s = s.strip()
    s = _TEXT.sub(r"\1", s)
    s = _WRAPPERS.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("^\\circ", "")
    s = s.replace("^{\\circ}", "").replace("\\%", "").replace("%", "")
    s = "".join(s.split())
    return s.rstrip(".")


def _max_nesting(s: str) -> int:
    depth = best = 0
    for c in s:
        if c in "{([":
            depth += 1
            best = max(best, depth)
        elif c in "})]":
            depth = max(0, depth - 1)
    return best


def _is_plain_number(s: str) -> bool:
    return re.fullmatch(r"[-+]?[0-9][0-9,]*(?:\.[0-9]+)?|[-+]?\.[0-9]+", s) is not None


_WARMUP = (
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\pi/3)"),
    ("9\\pi", "28\\pi"),
    ("x^2 + 2x + 1", "(x+1)^2"),
    ("[-2, 7)", "[-2,7]"),
    ("\\frac{1}{2}", "0.5"),
    ("\\text{(A)}", "A"),
    ("-2, 3", "3, -2"),
    ("3\\sqrt{2}", "\\sqrt{18}"),
    ("x = 2", "2"),
)


@functools.lru_cache(maxsize=1)
def _math_verify() -> tuple[Any, Any, list[Any]]:
    """Import math-verify and warm its LaTeX parser once, outside any deadline."""
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise UserError("the math answer checker needs the math-verify package: pip install math-verify") from None

    config = [LatexExtractionConfig()]
    for gold, pred in _WARMUP:  # sympy imports code paths lazily; first uses can take ~1 s
        verify(
            parse(f"$\\boxed{{{gold}}}$", extraction_config=config, parsing_timeout=None),
            parse(f"$\\boxed{{{pred}}}$", extraction_config=config, parsing_timeout=None),
            timeout_seconds=None,
        )
    return parse, verify, config


def _sympy_equal(pred: str, gold: str) -> bool:
    parse, verify, config = _math_verify()
    gold_parsed = parse(f"$\\boxed{{{gold}}}$", extraction_config=config, parsing_timeout=None)
    pred_parsed = parse(f"$\\boxed{{{pred}}}$", extraction_config=config, parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def math_equal(pred: str | None, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """True if ``pred`` is mathematically equivalent to ``gold`` (see module docstring)."""
    if pred is None or not pred.strip() or len(pred) > MAX_MATH_ANSWER_CHARS:
        return False
    pn, gn = normalize_latex(pred), normalize_latex(gold)
    if pn == gn:
        return True
    if _is_plain_number(pn) and _is_plain_number(gn):
        a, b = parse_number(pn), parse_number(gn)
        return a is not None and a == b
    if "__" in pred or _max_nesting(pred) > MAX_NESTING or not signals_available():
        return False
    _math_verify()  # import + warm-up must not eat into the deadline
    return call_with_deadline(lambda: _sympy_equal(pred, gold), timeout_s, False)
