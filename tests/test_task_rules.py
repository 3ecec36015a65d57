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
    for expr, correct in [("3+3+5", True), ("5+3+3", True), ("3*3+5", False), ("3+5", False),
                          ("3+3+5+3-3", False), ("3+3+3+2", False)]:
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
    task, bonus_task = get_task("sudoku", blanks=(blanks, blanks)), get_task("sudoku", blanks=(blanks, blanks),
                                                                              solved_bonus=1.0)
    for ex in task.load("train", n=6, seed=blanks):
        puzzle, solution = ex.reference["puzzle"], ex.reference["solution"]
        holes = [i for i, c in enumerate(puzzle) if c == "0"]
        assert len(holes) == blanks
        assert task.reward(answer(solution), ex.reference) == 1.0 and task.is_correct(answer(solution), ex.reference)
        assert bonus_task.reward(answer(solution), ex.reference) == 1.0
        for cell in holes:
            wrong_digit = "1234"[("1234".index(solution[cell]) + 1) % 4]
            wrong = solution[:cell] + wrong_digit + solution[cell + 1:]
            fraction = (blanks - 1) / blanks
            assert task.reward(answer(wrong), ex.reference) == pytest.approx(fraction)
            assert not task.is_correct(answer(wrong), ex.reference)
            assert bonus_task.reward(answer(wrong), ex.reference) == pytest.approx(fraction / 2.0)
            assert not bonus_task.is_correct(answer(wrong), ex.reference)


@pytest.mark.parametrize("completion,expected", [
    ("so the answer is \\boxed{42}", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),                       # the last box counts
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                 # nested braces
    ("<answer>7</answer>", "7"),                                # no box: the tag
    ("\\boxed{3} <answer>9</answer>", "3"),                     # a box wins over the tag
    ("no final answer here", None),
    ("\\boxed{", None),                                         # unclosed
])
def test_math_answer_extraction_boundaries(completion, expected):
    assert get_task("math500").extract_answer(completion) == expected


@pytest.mark.parametrize("completion,reference,correct", [
    ("\\boxed{42}", "42", True), ("\\boxed{42.0}", "42", True), ("\\boxed{1,000}", "1000", True),
    ("\\boxed{-3}", "-3", True), ("\\boxed{43}", "42", False), ("\\boxed{}", "42", False),
    ("The answer is 42", "42", False),  # no box and no tag: not an answer
])
def test_gsm8k_correctness_boundaries(completion, reference, correct):
    assert get_task("gsm8k").is_correct(completion, reference) is correct
