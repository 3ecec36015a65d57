"""Countdown: combine the given numbers with + - * / to reach a target.

Puzzles (d1 convention): 3 numbers (``num_counts=(3, 4)`` mixes in 4-number
ones) drawn from 1..99; the target is the value of a random expression tree
over all of them, kept if it is an integer in 1..``max_target`` (100), and
then *proved* reachable by ``solve``. Generation is pure Python,
deterministic in ``(seed, split)``.

Arithmetic is exact (``fractions.Fraction``) and any division by a non-zero
value is allowed, intermediate fractions included (d1 allows real division);
generator, solver and checker share this rule.

Splits: a puzzle (sorted numbers, target) belongs to ``test`` iff
``sha256(key) % 10 == 0``, else to ``train``; the splits are disjoint by
construction and each holds far more puzzles than any run needs.

Reward (reference ``{"numbers": [...], "target": int}``): the expression is
the ``<answer>`` tag content (else the last ``\\boxed{}``), taken left of any
``=``. 1.0 if it uses each given number exactly once and equals the target,
0.1 if it is well formed (characters ``0-9 + - * / ( ) .`` and an AST of
numbers, binary + - * /, unary +/- only) but wrong, 0.0 otherwise. Python's
``eval`` is never used; expressions over ``MAX_EXPR_CHARS`` or
``MAX_NODES`` nodes are malformed, and intermediate values whose numerator or
denominator exceeds ``MAX_MAGNITUDE`` make the expression wrong.
"""

from __future__ import annotations

import ast
import hashlib
import random
from fractions import Fraction
from typing import Any

from stabledrl_mcore.tasks.base import Example, Task, register_task
from stabledrl_mcore.tasks.extract import tag_then_boxed
from stabledrl_mcore.tasks.prompts import COUNTDOWN_SYSTEM_PROMPT

MAX_EXPR_CHARS = 200
MAX_NODES = 64
MAX_MAGNITUDE = 10**12
_ALLOWED_CHARS = frozenset("0123456789+-*/(). \t")
_UNICODE_OPS = str.maketrans({"\u00d7": "*", "\u00b7": "*", "\u00f7": "/", "\u2212": "-", "\u2013": "-"})
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)
DEFAULT_N = {"train": 10000, "test": 256}


class MalformedExpression(ValueError):
    """The text is not an expression under the whitelist."""


class EvaluationError(ValueError):
    """A well-formed expression that cannot be evaluated (division by zero, too large)."""


def parse_expression(text: str) -> ast.Expression:
    """Parse ``text`` under the whitelist; ``MalformedExpression`` otherwise."""
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
        if isinstance(node, ast.BinOp) and isinstance(node.op, _BINOPS):
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
    if b == 0:
        raise EvaluationError("division by zero")
    return _check(a / b)


def evaluate_expression(text: str) -> tuple[Fraction, list[Fraction]]:
    """Exact value of ``text`` and the numbers it uses (raises the two errors above)."""
    tree = parse_expression(text)
    used: list[Fraction] = []
    return _eval(tree.body, used), used


def solve(numbers: list[int], target: int) -> str | None:
    """An expression using every number exactly once that equals ``target``, or None."""
    goal = Fraction(target)

    def rec(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == goal else None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (a, ea), (b, eb) = items[i], items[j]
                rest = [items[k] for k in range(len(items)) if k not in (i, j)]
                cands = [
                    (a + b, f"({ea} + {eb})"),
                    (a - b, f"({ea} - {eb})"),
                    (b - a, f"({eb} - {ea})"),
                    (a * b, f"({ea} * {eb})"),
                ]
                if b != 0:
                    cands.append((a / b, f"({ea} / {eb})"))
                if a != 0:
                    cands.append((b / a, f"({eb} / {ea})"))
                for value, expr in cands:
                    found = rec(rest + [(value, expr)])
                    if found is not None:
                        return found
        return None

    found = rec([(Fraction(x), str(x)) for x in numbers])
    return None if found is None else (found[1:-1] if found.startswith("(") and len(numbers) > 1 else found)


def _split_of(numbers: list[int], target: int) -> str:
    key = f"{sorted(numbers)}:{target}".encode()
    return "test" if int(hashlib.sha256(key).hexdigest(), 16) % 10 == 0 else "train"


@register_task("countdown")
class CountdownTask(Task):
    """Countdown arithmetic puzzles generated by seed (see module docstring)."""

    name = "countdown"
    system_prompt = COUNTDOWN_SYSTEM_PROMPT

    def compact_prompt(self, example: Example) -> str:
        """``"n1 n2 n3 -> target ="``; the answer is the expression."""
        ref = example.reference
        return " ".join(str(n) for n in ref["numbers"]) + f" -> {ref['target']} ="

    def __init__(
        self, num_counts: tuple[int, ...] = (3,), max_number: int = 99, max_target: int = 100, **options: Any
    ) -> None:
        super().__init__(**options)  # the options every task takes (base.BASE_TASK_OPTIONS)
        if not num_counts or any(k not in (2, 3, 4, 5) for k in num_counts):
            raise ValueError(f"num_counts must be a non-empty tuple of 2..5, got {num_counts!r}")
        if max_number < 1 or max_target < 1:
            raise ValueError("max_number and max_target must be >= 1")
        self.num_counts, self.max_number, self.max_target = tuple(num_counts), max_number, max_target

    def _candidate(self, rng: random.Random) -> tuple[list[int], int] | None:
        numbers = [rng.randint(1, self.max_number) for _ in range(rng.choice(self.num_counts))]
        items = [Fraction(x) for x in numbers]
        while len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            a, b = items[i], items[j]
            op = rng.choice("+-*/")
            if op == "/" and b == 0:
                return None
            value = {"+": a + b, "-": a - b, "*": a * b}[op] if op != "/" else a / b
            items = [items[k] for k in range(len(items)) if k not in (i, j)] + [value]
        t = items[0]
        if t.denominator != 1 or not 1 <= t <= self.max_target:
            return None
        return numbers, int(t)

    def load(
        self, split: str, *, path: str | None = None, limit: int | None = None, seed: int = 0, n: int | None = None
    ) -> list[Example]:
        """``n`` distinct puzzles of ``split`` ('train' or 'test'), deterministic in ``seed``."""
        if split not in DEFAULT_N:
            raise ValueError(f"countdown: split must be one of {sorted(DEFAULT_N)}, got {split!r}")
        if path is not None:
            raise ValueError("countdown puzzles are generated; 'path' is not supported")
        count = n if n is not None else (limit if limit is not None else DEFAULT_N[split])
        rng = random.Random(f"countdown/{split}/{seed}")
        seen: set[tuple[tuple[int, ...], int]] = set()
        examples: list[Example] = []
        while len(examples) < count:
            cand = self._candidate(rng)
            if cand is None:
                continue
            numbers, target = cand
            key = (tuple(sorted(numbers)), target)
            if key in seen or _split_of(numbers, target) != split:
                continue
            solution = solve(numbers, target)
            if solution is None:  # cannot happen: the tree is a witness; kept as a proof check
                raise RuntimeError(f"generated unreachable countdown puzzle {numbers} -> {target}")
            seen.add(key)
            ref = {"numbers": numbers, "target": target}
            examples.append(
                Example(
                    prompt=self.question(numbers, target),
                    reference=ref,
                    meta={"index": len(examples), "solution": solution},
                )
            )
        return examples[:limit] if limit is not None else examples

    @staticmethod
    def question(numbers: list[int], target: int) -> str:
        return (
            f"Using the numbers {list(numbers)}, create an equation that equals {target}. "
            "You can use basic arithmetic operations (+, -, *, /) and parentheses, and each "
            "number must be used exactly once. Give the final expression in <answer> </answer> tags."
        )

    def check_reference(self, reference: Any) -> dict[str, Any]:
        ok = (
            isinstance(reference, dict)
            and isinstance(reference.get("numbers"), (list, tuple))
            and 0 < len(reference["numbers"]) <= 8
            and all(isinstance(x, int) and not isinstance(x, bool) for x in reference["numbers"])
            and isinstance(reference.get("target"), int)
            and not isinstance(reference["target"], bool)
        )
        if not ok:
            raise ValueError(
                f"countdown: reference must be {{'numbers': [int, ...], 'target': int}}, got {reference!r}"
            )
        return reference

    def extract_answer(self, completion: str) -> str | None:
        """``<answer>`` tag content (else last ``\\boxed{}``), or None."""
        return tag_then_boxed(completion)

    def _reward(self, completion: str, reference: dict[str, Any]) -> float:
        expr = self.extract_answer(completion)
        if expr is None:
            return 0.0
        try:
            value, used = evaluate_expression(expr)
        except MalformedExpression:
            return 0.0
        except EvaluationError:
            return 0.1
        given = sorted(Fraction(x) for x in reference["numbers"])
        return 1.0 if sorted(used) == given and value == reference["target"] else 0.1
