"""Task rules exhaustively (issue 30): Countdown's exactly-once multiset rule, exact division and
precedence; Sudoku over generated puzzles of every blank count, solved iff every blank is right;
boundary formats of the math answer extraction. Cases are generated and checked against rules
written here (a reference solver, the puzzle's own solution), not against hand-picked examples.
"""

from __future__ import annotations

import pytest

from stabledrl_mcore.tasks import get_task
from stabledrl_mcore.tasks.countdown import solve


def answer(text: str) -> str:
    return f"reasoning ... <answer>{text}</answer>"


@pytest.fixture(scope="module")
def countdown_puzzles():
    task = get_task("countdown", num_counts=(3, 4))
    return task, task.load("train", n=40, seed=5)


def test_countdown_accepts_every_solvers_expression(countdown_puzzles):
    task, puzzles = countdown_puzzles
    for ex in puzzles:
        expr = solve(ex.reference["numbers"], ex.reference["target"])
        assert expr is not None
        assert task.reward(answer(expr), ex.reference) == 1.0 and task.is_correct(answer(expr), ex.reference), expr


def test_countdown_uses_every_number_exactly_once(countdown_puzzles):
    """Reusing a given number, omitting one or adding one that was not given, each with the target
    still hit, is wrong (a set comparison would accept the reuse: ``3*5+7+3-3``)."""
    task, puzzles = countdown_puzzles
    for ex in puzzles:
        numbers, target = ex.reference["numbers"], ex.reference["target"]
        expr = solve(numbers, target)
        for n in numbers:  # reuse: the value is unchanged, a number appears three times
            reused = f"({expr})+{n}-{n}"
            assert task.reward(answer(reused), ex.reference) == 0.1, reused
            assert not task.is_correct(answer(reused), ex.reference)
        extra = max(numbers) + 1  # a number that was not given
        assert task.reward(answer(f"({expr})+{extra}-{extra}"), ex.reference) == 0.1
        omitted = dict(ex.reference, numbers=list(numbers) + [extra])  # the expression skips one number
        assert task.reward(answer(expr), omitted) == 0.1 and not task.is_correct(answer(expr), omitted)


def test_countdown_multiset_with_repeated_numbers_and_exact_arithmetic():
    task = get_task("countdown")
    ref = {"numbers": [3, 3, 5], "target": 11}
    for expr, correct in [
        ("3+3+5", True),
        ("5+3+3", True),
        ("3*3+5", False),
        ("3+5", False),
        ("3+3+5+3-3", False),
        ("3+3+3+2", False),
    ]:
        assert task.is_correct(answer(expr), ref) is correct, expr
    # exact fractions: (8/3)*3 is 8, not 7.999...
    assert task.is_correct(answer("(8/3)*3"), {"numbers": [8, 3, 3], "target": 8})
    # precedence: 2+4*8 = 34, (2+4)*8 = 48
    assert task.is_correct(answer("2+4*8"), {"numbers": [2, 4, 8], "target": 34})
    assert not task.is_correct(answer("2+4*8"), {"numbers": [2, 4, 8], "target": 48})
    assert task.is_correct(answer("(2+4)*8"), {"numbers": [2, 4, 8], "target": 48})
    # a division by zero or a non-integer value never hits an integer target
    assert task.reward(answer("8/(4-4)+2"), {"numbers": [8, 4, 4, 2], "target": 2}) < 1.0
    assert not task.is_correct(answer("8/(4+2)"), {"numbers": [8, 4, 2], "target": 1})


@pytest.mark.parametrize("blanks", range(1, 13))
def test_sudoku_is_solved_iff_every_blank_is_right(blanks):
    """Every blank count: the solution is solved (reward 1); one wrong blank is not (its fraction is
    exactly (n-1)/n, and with a solved bonus no bonus is paid)."""
    task, bonus_task = (
        get_task("sudoku", blanks=(blanks, blanks)),
        get_task("sudoku", blanks=(blanks, blanks), solved_bonus=1.0),
    )
    for ex in task.load("train", n=6, seed=blanks):
        puzzle, solution = ex.reference["puzzle"], ex.reference["solution"]
        holes = [i for i, c in enumerate(puzzle) if c == "0"]
        assert len(holes) == blanks
        assert task.reward(answer(solution), ex.reference) == 1.0 and task.is_correct(answer(solution), ex.reference)
        assert bonus_task.reward(answer(solution), ex.reference) == 1.0
        for cell in holes:
            wrong_digit = "1234"[("1234".index(solution[cell]) + 1) % 4]
            wrong = solution[:cell] + wrong_digit + solution[cell + 1 :]
            fraction = (blanks - 1) / blanks
            assert task.reward(answer(wrong), ex.reference) == pytest.approx(fraction)
            assert not task.is_correct(answer(wrong), ex.reference)
            assert bonus_task.reward(answer(wrong), ex.reference) == pytest.approx(fraction / 2.0)
            assert not bonus_task.is_correct(answer(wrong), ex.reference)


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("so the answer is \\boxed{42}", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),  # the last box counts
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("<answer>7</answer>", "7"),  # no box: the tag
        ("\\boxed{3} <answer>9</answer>", "3"),  # a box wins over the tag
        ("no final answer here", None),
        ("\\boxed{", None),  # unclosed
    ],
)
def test_math_answer_extraction_boundaries(completion, expected):
    assert get_task("math500").extract_answer(completion) == expected


@pytest.mark.parametrize(
    "completion,reference,correct",
    [
        ("\\boxed{42}", "42", True),
        ("\\boxed{42.0}", "42", True),
        ("\\boxed{1,000}", "1000", True),
        ("\\boxed{-3}", "-3", True),
        ("\\boxed{43}", "42", False),
        ("\\boxed{}", "42", False),
        ("The answer is 42", "42", False),  # no box and no tag: not an answer
    ],
)
def test_gsm8k_correctness_boundaries(completion, reference, correct):
    assert get_task("gsm8k").is_correct(completion, reference) is correct


# --------------------------------------------------------------------------- GSM8K / MATH properties


def _render_number(value, rng) -> str:
    """One of the ways a model writes ``value`` (a Fraction with a short decimal or integer form)."""
    from fractions import Fraction

    sign = "-" if value < 0 else ""
    mag = abs(value)
    if mag.denominator == 1:
        digits = str(mag.numerator)
        style = rng.choice(["plain", "commas", "decimal0", "dollar", "text_unit", "frac_int"])
        if style == "commas":
            digits = f"{mag.numerator:,}"
        elif style == "decimal0":
            digits += "." + "0" * rng.randint(1, 3)
        elif style == "dollar":
            return f"\\${sign}{digits}"
        elif style == "text_unit":
            return f"{sign}{digits} \\text{{apples}}"
        elif style == "frac_int":
            k = rng.randint(2, 5)
            return f"{sign}\\frac{{{mag.numerator * k}}}{{{k}}}"
        return sign + digits
    if rng.random() < 0.5:  # exact decimal (denominators 2, 4, 5, 8, 10 ... only)
        text = f"{float(mag):.6f}".rstrip("0")
        assert Fraction(text) == mag
        return sign + text
    return f"{sign}\\frac{{{mag.numerator}}}{{{mag.denominator}}}"


def _gsm8k_cases(n: int, seed: int):
    """(completion, reference, correct): the written value is the reference, or one near miss."""
    import random
    from fractions import Fraction

    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        ref = Fraction(rng.randint(-5000, 5000), rng.choice([1, 1, 1, 2, 4, 5, 8]))
        written = (
            ref
            if rng.random() < 0.5
            else ref + rng.choice([Fraction(1), Fraction(-1), Fraction(1, 2), Fraction(1, 10), ref * 9 or Fraction(7)])
        )
        distractor = f"First 3 + {rng.randint(10, 99)} = {rng.randint(100, 999)}. "
        wrapper = rng.choice(
            ["\\boxed{%s}", "\\boxed{ %s }", "<answer>%s</answer>", "<answer>The answer is %s.</answer>"]
        )
        ref_text = str(ref.numerator) if ref.denominator == 1 else f"{float(ref):g}"
        cases.append((distractor + wrapper % _render_number(written, rng), ref_text, written == ref))
    return cases


def test_gsm8k_numeric_rule_on_generated_answers():
    """Correct iff the boxed/tagged value equals the reference exactly, however it is written;
    numbers outside the answer never count (each case is built from its true value)."""
    task = get_task("gsm8k")
    cases = _gsm8k_cases(400, seed=11)
    assert 120 < sum(c for _, _, c in cases) < 280  # both outcomes well represented
    wrong = [(comp, ref, want) for comp, ref, want in cases if task.is_correct(comp, ref) is not want]
    assert not wrong, wrong[:5]


def _balanced_latex(rng, depth: int = 0) -> str:
    """A random answer body with balanced (and escaped) braces, as MATH answers have."""
    atoms = ["x", "2", "\\pi", "\\sqrt{3}", "\\{1,2\\}", "a_{n}", "\\frac{1}{2}", "(0,1]", " "]
    parts = []
    for _ in range(rng.randint(1, 4)):
        if depth < 3 and rng.random() < 0.3:
            parts.append("\\frac{" + _balanced_latex(rng, depth + 1) + "}{" + _balanced_latex(rng, depth + 1) + "}")
        else:
            parts.append(rng.choice(atoms))
    return "".join(parts).strip() or "x"


def test_math_extraction_returns_the_last_complete_box_on_generated_latex():
    """The extracted answer is exactly the last balanced ``\\boxed{}`` body, with earlier boxes,
    an unclosed trailing box and ``<answer>`` tags around it as distractors."""
    import random

    rng = random.Random(3)
    task = get_task("math500")
    for _ in range(300):
        body = _balanced_latex(rng)
        earlier = "" if rng.random() < 0.5 else "\\boxed{" + _balanced_latex(rng) + "} so "
        tail = rng.choice(["", ".", " \\boxed{", " <answer>zz</answer>"])
        completion = f"work {earlier}final: \\boxed{{{body}}}{tail}"
        assert task.extract_answer(completion) == body, completion
        # with no box at all, the tag's content is the answer
        assert task.extract_answer(f"work <answer>{body}</answer>") == body
