"""The options every task takes (``tasks.base.BASE_TASK_OPTIONS``): the anti short boxed term."""

from __future__ import annotations

import time

import pytest

from stabledrl_mcore.evaluation.scoring import evaluate_completions
from stabledrl_mcore.tasks import (
    BASE_TASK_OPTIONS,
    CountdownTask,
    Example,
    Gsm8kTask,
    Math500Task,
    SudokuTask,
    Task,
    anti_short_boxed_bonus,
    available_tasks,
    get_task,
)
from stabledrl_mcore.tasks import base as task_base

CPU_BOUND_S = 10.0
"""CPU seconds one hostile input may cost (generous: linear code takes milliseconds)."""

MB = 1 << 20
REASONING = (
    "First compute six times seven, which is forty two, then check it by dividing forty two by "
    "seven to get six again, so the result holds, and then write the final answer in the box given below. "
)
# 154 non-whitespace characters: with a box of up to 24 it is short but over 85% outside the box


def non_ws(text: str) -> int:
    return sum(not c.isspace() for c in text)


def test_reasoning_fixture_sizes():
    assert non_ws(REASONING) == 154 and 154 / (154 + 24) >= 0.85 and 154 * 2 >= 200


# ----------------------------------------------------------------- the term itself (release cases)


@pytest.mark.parametrize(
    "text",
    [
        "\\boxed{42}",
        "  \\boxed{42}\n",
        "$\\boxed{42}$",
        "$$ \\boxed{x^2 + 1} $$.",
        "\\boxed{42}.",
        "\\boxed{42}!?",
        "\\boxed{42}\u201d",
        "\\boxed{42}'\"\u2019 ",
        "\\boxed{}",
        "\\boxed{a\nb}",
        "\u00a0\\boxed{42}\u3000",
    ],
)
def test_pure_boxed_answer_scores_zero(text):
    assert anti_short_boxed_bonus(text) == 0.0


def test_long_reasoning_with_boxed_scores_one():
    long = REASONING * 2 + "\\boxed{42}"
    assert non_ws(long) >= 200
    assert anti_short_boxed_bonus(long) == 1.0
    # long enough, even if it is almost all box: the length rule comes first
    assert anti_short_boxed_bonus("\\boxed{" + "9" * 300 + "}") == 1.0
    # short, but mostly reasoning outside the box
    short = REASONING + "\\boxed{42}"
    assert non_ws(short) < 200
    assert anti_short_boxed_bonus(short) == 1.0
    assert anti_short_boxed_bonus("<answer>1234341221434321</answer>") == 1.0  # no box at all
    assert anti_short_boxed_bonus("42") == 1.0


@pytest.mark.parametrize(
    "text",
    [
        "Answer: \\boxed{123456789}",  # 7 outside of 24
        "I computed six times seven and got \\boxed{42}",  # 28 of 38: below 85%
        "So \\boxed{\\frac{1}{2}}",  # the span ends at the first '}': 6 of 21 outside
        "\\boxed{1} and \\boxed{2}",  # two boxes, 'and' outside
        "",
        "   \n\t ",  # nothing outside a box either
    ],
)
def test_short_text_mostly_boxed_scores_zero(text):
    assert anti_short_boxed_bonus(text) == 0.0


def test_unclosed_box_counts_as_outside():
    # no '}' after '\boxed{': nothing is removed, as in the release
    assert anti_short_boxed_bonus("\\boxed{42") == 1.0
    assert anti_short_boxed_bonus("x \\boxed{1} \\boxed{2") == 0.0  # first box closed: 1 + 9 of 18 outside


def test_exactly_at_the_thresholds():
    box = "\\boxed{x}"  # 9 non-whitespace characters
    at_ratio = "a " * 51 + box  # 51 / 60 = 0.85 outside: not below
    assert anti_short_boxed_bonus(at_ratio) == 1.0
    assert anti_short_boxed_bonus("a " * 50 + box) == 0.0  # 50 / 59 < 0.85
    at_chars = "\\boxed{" + "9" * 192 + "}"  # exactly 200 non-whitespace characters
    assert non_ws(at_chars) == 200 and anti_short_boxed_bonus(at_chars) == 1.0
    below = "\\boxed{" + "9" * 191 + "}"
    assert non_ws(below) == 199 and anti_short_boxed_bonus(below) == 0.0
    # whitespace (any unicode whitespace) is not counted
    assert anti_short_boxed_bonus("\\boxed{" + " 9\u00a0" * 191 + "}") == 0.0
    # thresholds are parameters
    assert anti_short_boxed_bonus("\\boxed{42}", min_chars=10) == 1.0
    assert anti_short_boxed_bonus("\\boxed{42}", min_chars=11) == 0.0
    assert anti_short_boxed_bonus("", min_chars=0) == 1.0
    assert anti_short_boxed_bonus("Answer: \\boxed{123456789}", min_ratio=0.0) == 1.0  # only pure boxes fail
    assert anti_short_boxed_bonus("\\boxed{123456789}", min_ratio=0.0) == 0.0
    assert anti_short_boxed_bonus("a " * 51 + box, min_ratio=1.0) == 0.0


class _BadStr:
    def __str__(self):
        raise RuntimeError("no")


def test_non_str_is_scored_as_its_str_and_never_raises():
    assert anti_short_boxed_bonus(12345) == 1.0  # "12345"
    assert anti_short_boxed_bonus(None) == 1.0  # "None"
    assert anti_short_boxed_bonus(["\\boxed{1}"]) == 0.0  # "['\\\\boxed{1}']": 5 of 14 outside
    assert anti_short_boxed_bonus(_BadStr()) == 0.0


@pytest.mark.parametrize(
    "text",
    [
        "\\boxed{" * (MB // 7),
        "\\boxed{" + " " * MB,
        "\\boxed{1}" + " \n" * MB + "X",
        " " * MB + "\\boxed{1}" + " " * MB,
        "$" * 150 + " " * MB + "\\boxed{1}" + " $" * MB,
        "\\boxed{1}" + " " * MB + "." * 50 + " " * MB + "!",
        "}" * MB,
        "{" * MB,
        "\\boxed{1}" * 20 + " " * MB + "\\boxed{",
        "\\" * MB,
        "\ud800" * 100 + "\\boxed{\udfff}",
        "\x00" * MB,
        "\u3000" * MB + "\\boxed{1}" + "\u201d" * 10,
    ],
)
def test_hostile_input_is_linear_and_safe(text):
    """CPU seconds of this process, not wall-clock: other processes' load does not count. Linear
    scanning of these megabyte inputs takes milliseconds; a backtracking regex takes minutes, so the
    generous bound tells them apart under any load."""
    t0 = time.process_time()
    value = anti_short_boxed_bonus(text)
    assert value in (0.0, 1.0)
    assert time.process_time() - t0 < CPU_BOUND_S


# ----------------------------------------------------------------- as a task option

REF = {
    "gsm8k": "72",
    "math500": "\\frac{14}{3}",
    "countdown": {"numbers": [3, 5, 7], "target": 22},
    "sudoku": {"puzzle": "1030040220404300", "solution": "1234341221434321"},
}
ANSWER = {"gsm8k": "72", "math500": "\\frac{14}{3}", "countdown": "3*5+7", "sudoku": "1234341221434321"}
WRONG = {"gsm8k": "71", "math500": "\\frac{1}{3}", "countdown": "3+5+7", "sudoku": "not a grid"}


def completions(name: str) -> list[tuple[str, float, float]]:
    """(completion, base reward, bonus) for one task."""
    right, wrong = ANSWER[name], WRONG[name]
    full_wrong = 0.1 if name == "countdown" else 0.0  # countdown: a valid but wrong expression scores 0.1
    return [
        (f"\\boxed{{{right}}}", 1.0, 0.0),  # correct but a bare box
        (f"{REASONING}\\boxed{{{right}}}", 1.0, 1.0),  # correct with reasoning
        (f"{REASONING * 2}<answer>{right}</answer>", 1.0, 1.0),
        (f"{REASONING}\\boxed{{{wrong}}}", full_wrong, 1.0),  # wrong with reasoning
        (f"$\\boxed{{{wrong}}}$.", full_wrong if name != "sudoku" else 0.0, 0.0),
        ("", 0.0, 0.0),
    ]


@pytest.mark.parametrize("name", sorted(REF))
def test_option_adds_the_bonus_to_each_task(name):
    off = get_task(name)
    on = get_task(name, anti_short_boxed=True)
    assert off.reward_range == (0.0, 1.0) and on.reward_range == (0.0, 2.0)
    assert on.base_reward_range == (0.0, 1.0) and not off.anti_short_boxed and on.anti_short_boxed
    for completion, base, bonus in completions(name):
        assert off.reward(completion, REF[name]) == pytest.approx(base), completion
        assert on.base_reward(completion, REF[name]) == pytest.approx(base), completion
        assert on.reward(completion, REF[name]) == pytest.approx(base + bonus), completion
        assert on.is_correct(completion, REF[name]) == off.is_correct(completion, REF[name]) == (base == 1.0)
    # the thresholds travel with the option
    lax = get_task(name, anti_short_boxed=True, anti_short_boxed_min_chars=5)
    assert lax.reward(f"\\boxed{{{ANSWER[name]}}}", REF[name]) == 2.0
    strict = get_task(name, anti_short_boxed=True, anti_short_boxed_min_ratio=1.0)
    assert strict.reward(f"{REASONING}\\boxed{{{ANSWER[name]}}}", REF[name]) == 1.0
    assert (lax.anti_short_boxed_min_chars, strict.anti_short_boxed_min_ratio) == (5, 1.0)
    assert on.anti_short_boxed_min_chars == 200 and on.anti_short_boxed_min_ratio == 0.85


def test_accuracy_ignores_the_bonus():
    on, off = get_task("gsm8k", anti_short_boxed=True), get_task("gsm8k")
    examples = [Example(prompt="q", reference="72", meta={"index": i}) for i in range(4)]
    outs = ["\\boxed{72}", f"{REASONING}\\boxed{{72}}", f"{REASONING}\\boxed{{71}}", "\\boxed{71}"]
    acc_on, rec_on = evaluate_completions(on, examples, outs)
    acc_off, rec_off = evaluate_completions(off, examples, outs)
    assert acc_on == acc_off == 0.5
    assert [r["correct"] for r in rec_on] == [r["correct"] for r in rec_off] == [True, True, False, False]
    assert [r["reward"] for r in rec_on] == [1.0, 2.0, 1.0, 0.0]
    assert [r["reward"] for r in rec_off] == [1.0, 1.0, 0.0, 0.0]
    # sudoku's partial credit: a reasoned, almost right grid is not correct whatever its bonus
    sudoku = get_task("sudoku", anti_short_boxed=True)
    almost = f"{REASONING}<answer>1234341221434312</answer>"
    assert 1.0 < sudoku.reward(almost, REF["sudoku"]) < 2.0 and not sudoku.is_correct(almost, REF["sudoku"])


def test_direct_construction_takes_the_options():
    tasks = [
        SudokuTask(blanks=(6, 8), anti_short_boxed=True),
        CountdownTask(anti_short_boxed=True),
        Gsm8kTask(format_weight=0.5, anti_short_boxed=True),
        Math500Task(timeout_s=2.0, anti_short_boxed=True, anti_short_boxed_min_chars=50),
    ]
    for task in tasks:
        assert task.anti_short_boxed and task.reward_range == (0.0, 2.0)
    assert tasks[3].anti_short_boxed_min_chars == 50 and tasks[3].timeout_s == 2.0
    assert tasks[2].format_weight == 0.5 and tasks[0].blanks == (6, 8)
    assert "anti_short_boxed=True" in repr(tasks[0]) and "anti_short_boxed" not in repr(SudokuTask())
    with pytest.raises(TypeError):
        SudokuTask(no_such_option=1)
    t = get_task("countdown")
    t.set_anti_short_boxed(True, min_chars=10)
    assert t.reward_range == (0.0, 2.0) and t.reward("<answer>3*5+7</answer>", REF["countdown"]) == 2.0
    t.set_anti_short_boxed(False)
    assert t.reward_range == (0.0, 1.0) and t.reward("<answer>3*5+7</answer>", REF["countdown"]) == 1.0


def test_unknown_and_bad_options_are_refused():
    for name in available_tasks():
        with pytest.raises(
            ValueError,
            match=rf"task '{name}': unknown option\(s\) 'anti_short'; valid options: "
            r"(.*, )?anti_short_boxed, anti_short_boxed_min_chars, ",
        ):
            get_task(name, anti_short=True)
    with pytest.raises(ValueError, match="valid options: .*blanks, solved_bonus"):
        get_task("sudoku", blank=(1, 2))
    for bad in ({"anti_short_boxed": "yes"}, {"anti_short_boxed": 1}):
        with pytest.raises(ValueError, match="anti_short_boxed must be true or false"):
            get_task("gsm8k", **bad)
    for bad in (-1, 2.5, True, "200", None):
        with pytest.raises(ValueError, match="anti_short_boxed_min_chars must be an int >= 0"):
            get_task("gsm8k", anti_short_boxed=True, anti_short_boxed_min_chars=bad)
    for bad in (-0.1, 1.5, float("nan"), float("inf"), "0.85", True):
        with pytest.raises(ValueError, match=r"anti_short_boxed_min_ratio must be a number in \[0, 1\]"):
            SudokuTask(anti_short_boxed_min_ratio=bad)
    # thresholds alone do not turn the term on
    quiet = get_task("gsm8k", anti_short_boxed_min_chars=10)
    assert not quiet.anti_short_boxed and quiet.reward_range == (0.0, 1.0)
    assert set(BASE_TASK_OPTIONS) == {"anti_short_boxed", "anti_short_boxed_min_chars", "anti_short_boxed_min_ratio"}


def test_run_config_task_options_reach_the_task():
    from stabledrl_mcore.config.schema import RunConfig

    cfg = RunConfig()
    cfg.rollout.task = "sudoku"
    cfg.rollout.task_options = {"blanks": [6, 8], "anti_short_boxed": True, "anti_short_boxed_min_ratio": 0.5}
    cfg.validate()
    task = get_task(cfg.rollout.task, prompt_style=cfg.rollout.prompt_style, **cfg.rollout.task_options)
    assert task.anti_short_boxed and task.anti_short_boxed_min_ratio == 0.5 and task.reward_range == (0.0, 2.0)


# ----------------------------------------------------------------- any subclass


class _OldStyleTask(Task):
    """A third-party task: own __init__ that does not forward options, old-style ``reward_range``."""

    name = "old_style"
    reward_range = (0.0, 2.0)

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def extract_answer(self, completion):
        return completion.strip() or None

    def _reward(self, completion, reference):
        return 5.0 if completion.endswith(reference) else self.scale  # 5.0 is clamped to the base range


def _factory(**kwargs):  # a plain function factory taking anything
    return _OldStyleTask(**kwargs)


def test_any_subclass_gets_the_option(monkeypatch):
    monkeypatch.setitem(task_base._REGISTRY, "old_style", _OldStyleTask)
    monkeypatch.setitem(task_base._REGISTRY, "old_style_fn", _factory)
    assert _OldStyleTask.base_reward_range == (0.0, 2.0) and _OldStyleTask().reward_range == (0.0, 2.0)
    for name in ("old_style", "old_style_fn"):
        task = get_task(name, scale=0.5, anti_short_boxed=True)
        assert task.reward_range == (0.0, 3.0) and task.scale == 0.5
        assert task.reward("\\boxed{ok}", "ok}") == 2.0  # base clamped to 2, bare box: +0
        assert task.reward(f"{REASONING} ok", "ok") == 3.0
        assert task.reward(f"{REASONING} no", "ok") == 1.5
        assert task.is_correct(f"{REASONING} ok", "ok") and task.is_correct("\\boxed{ok}", "ok}")
        assert not task.is_correct(f"{REASONING} no", "ok")
    with pytest.raises(ValueError, match="task 'old_style': unknown option.*valid options: .*, scale"):
        get_task("old_style", sclae=1.0)
