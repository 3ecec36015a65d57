"""RL tasks for dLLM post-training: GSM8K, MATH500, AIME 2024/2025, Countdown, 4x4 Sudoku, and
``qa`` (your own dataset with a chosen verifier, :mod:`.qa`).

``get_task(name)`` returns a task with ``load(split, ...)``, ``prompt(example,
tokenizer)``, ``reward(completion, reference) -> float in reward_range`` ([0, 1],
or [0, 2] with the ``anti_short_boxed`` option every task takes),
``extract_answer(completion)`` and ``is_correct``. Scoring completions and pass@k live in
:mod:`stabledrl_mcore.evaluation`.
"""

from stabledrl_mcore.tasks.aime import Aime2024Task, Aime2025Task
from stabledrl_mcore.tasks.base import (
    BASE_TASK_OPTIONS,
    GENERATED_TASKS,
    REWARD_RANGE,
    Example,
    Task,
    TaskProtocol,
    available_tasks,
    get_task,
    register_task,
)
from stabledrl_mcore.tasks.countdown import CountdownTask, evaluate_expression
from stabledrl_mcore.tasks.countdown import solve as solve_countdown
from stabledrl_mcore.tasks.extract import answer_tag, last_boxed, parse_number
from stabledrl_mcore.tasks.math_equiv import math_equal
from stabledrl_mcore.tasks.math_tasks import Gsm8kTask, Math500Task, resolve_data_root
from stabledrl_mcore.tasks.prompts import SYSTEM_PROMPT, PromptFormat, build_prompt, prompt_format
from stabledrl_mcore.tasks.qa import QaTask
from stabledrl_mcore.tasks.shaping import anti_short_boxed_bonus
from stabledrl_mcore.tasks.sudoku import SudokuTask, count_solutions
from stabledrl_mcore.tasks.sudoku import solve as solve_sudoku

__all__ = [
    "BASE_TASK_OPTIONS",
    "GENERATED_TASKS",
    "REWARD_RANGE",
    "Example",
    "Task",
    "TaskProtocol",
    "available_tasks",
    "get_task",
    "register_task",
    "CountdownTask",
    "evaluate_expression",
    "solve_countdown",
    "answer_tag",
    "last_boxed",
    "parse_number",
    "math_equal",
    "Gsm8kTask",
    "Math500Task",
    "resolve_data_root",
    "Aime2024Task",
    "Aime2025Task",
    "QaTask",
    "SYSTEM_PROMPT",
    "PromptFormat",
    "build_prompt",
    "prompt_format",
    "anti_short_boxed_bonus",
    "SudokuTask",
    "count_solutions",
    "solve_sudoku",
]
