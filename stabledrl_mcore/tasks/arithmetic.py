"""Exact arithmetic expressions for Countdown: a whitelist parser and a ``Fraction`` evaluator.

Characters ``0-9 + - * / ( ) .`` and an AST of numbers, binary + - * / and unary +/- only
(``release_ops`` also allows ``**`` and ``//``, which the release's ``eval`` accepts under the
same character whitelist). Python's ``eval`` is never used; expressions over ``MAX_EXPR_CHARS``
or ``MAX_NODES`` nodes are malformed, and intermediate values whose numerator or denominator
exceeds ``MAX_MAGNITUDE`` (or a power whose exponent exceeds ``MAX_EXPONENT``) cannot be evaluated.
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_EXPR_CHARS = 200
MAX_NODES = 64
MAX_MAGNITUDE = 10**12
MAX_EXPONENT = 64
_ALLOWED_CHARS = frozenset("0123456789+-*/(). \t")
_UNICODE_OPS = str.maketrans({"\u00d7": "*", "\u00b7": "*", "\u00f7": "/", "\u2212": "-", "\u2013": "-"})
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_RELEASE_BINOPS = _BINOPS + (ast.Pow, ast.FloorDiv)


class MalformedExpression(ValueError):
    """The text is not an expression under the whitelist."""


class EvaluationError(ValueError):
    """A well-formed expression that cannot be evaluated (division by zero, too large)."""


def parse_expression(text: str, *, release_ops: bool = False) -> ast.Expression:
    """Parse ``text`` under the whitelist; ``MalformedExpression`` otherwise."""
    binops = _RELEASE_BINOPS if release_ops else _BINOPS
    expr = text.translate(_UNICODE_OPS).split("=", 1)[0].strip()
    if not expr or len(expr) > MAX_EXPR_CHARS or not set(expr) <= _ALLOWED_CHARS:
        raise MalformedExpression("empty, too long or disallowed characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise MalformedExpression(f"syntax: {type(e).__name__}") from None
    count = 0
    for node in ast.walk(tree):
        count += 1
        if count > MAX_NODES:
            raise MalformedExpression("too many nodes")
        if isinstance(node, (ast.Expression, ast.operator, ast.unaryop)):
            continue
        if isinstance(node, ast.BinOp) and isinstance(node.op, binops):
            continue
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            continue
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            continue
        raise MalformedExpression(f"disallowed node {type(node).__name__}")
    return tree


def _check(x: Fraction) -> Fraction:
    if abs(x.numerator) > MAX_MAGNITUDE or x.denominator > MAX_MAGNITUDE:
        raise EvaluationError("intermediate value too large")
    return x


def _eval(node: ast.AST, used: list[Fraction]) -> Fraction:
    if isinstance(node, ast.Constant):
        value = _check(Fraction(node.value))
        used.append(value)
        return value
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, used)
        return -v if isinstance(node.op, ast.USub) else v
    assert isinstance(node, ast.BinOp)
    a, b = _eval(node.left, used), _eval(node.right, used)
    if isinstance(node.op, ast.Add):
        return _check(a + b)
    if isinstance(node.op, ast.Sub):
        return _check(a - b)
    if isinstance(node.op, ast.Mult):
        return _check(a * b)
    if isinstance(node.op, ast.Pow):
        return _power(a, b)
    if b == 0:
        raise EvaluationError("division by zero")
    if isinstance(node.op, ast.FloorDiv):
        return Fraction(a // b)
    return _check(a / b)


def _power(a: Fraction, b: Fraction) -> Fraction:
    """``a ** b`` as Python computes it: exact for an integer exponent (bounded), a real float power
    otherwise; a complex or undefined result (0 ** -1, (-8) ** 0.5) cannot be evaluated."""
    if b.denominator == 1 and abs(b.numerator) <= MAX_EXPONENT:
        if a == 0 and b < 0:
            raise EvaluationError("zero to a negative power")
        return _check(a**b.numerator)
    try:
        value = float(a) ** float(b)
    except (OverflowError, ZeroDivisionError):
        raise EvaluationError("power out of range") from None
    if isinstance(value, complex) or value != value or value in (float("inf"), float("-inf")):
        raise EvaluationError("power is not a real number")
    return _check(Fraction(value))


def evaluate_expression(text: str, *, release_ops: bool = False) -> tuple[Fraction, list[Fraction]]:
    """Exact value of ``text`` and the numbers it uses (raises the two errors above)."""
    tree = parse_expression(text, release_ops=release_ops)
    used: list[Fraction] = []
    return _eval(tree.body, used), used
