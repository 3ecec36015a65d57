"""Countdown as the StableDRL release ran it (``task_options.reward_rule: release``): its scores on
hand-written completions, its rule re-derived here from ``dataloaders/logic_puzzles.py`` (regex
extraction, multiset check, character whitelist, Python's own evaluation) as a reference, its prompt
and its JSONL format through ``rollout.data_path``."""

import json
import os
import random
import re

import pytest

from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.tasks import get_task
from stabledrl_mcore.tasks.from_config import build_task, heldout_examples, load_train_examples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMS = {"numbers": [3, 5, 7], "target": 8}


def release_reference(completion, ground_truth):
    """The release's compute_score_countdown, re-derived (its eval on the whitelisted string)."""
    found = re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL)
    if not found:
        return 0.0
    equation = found[-1].strip()
    available = list(ground_truth["numbers"])
    for n in (int(x) for x in re.findall(r"\d+", equation)):
        if n not in available:
            return 0.1
        available.remove(n)
    if not re.match(r"^[\d+\-*/().\s]+$", equation):
        return 0.1
    try:  # the comparison too: e.g. "()" evaluates to a tuple
        value = eval(equation, {"__builtins__": None}, {})  # noqa: S307 - whitelisted characters only
        return 1.0 if abs(value - ground_truth["target"]) < 1e-5 else 0.1
    except Exception:  # noqa: BLE001 - the release scores any failure 0.1
        return 0.1


CASES = [
    ("<reasoning>r</reasoning><answer> 3 + 5 </answer>", NUMS, 1.0),  # a sub-multiset: 7 unused
    ("<answer>(3 * 5) - 7</answer>", NUMS, 1.0),
    ("<answer>3 + 5 + 7 - 7</answer>", NUMS, 0.1),  # 7 given once, used twice
    ("<answer>3 + 4 + 1</answer>", NUMS, 0.1),  # numbers not given
    ("<answer>3 +* 5</answer>", NUMS, 0.1),  # malformed: 0.1 here, 0 in the strict rule
    ("<answer>3 + 5 = 8</answer>", NUMS, 0.1),  # '=' is outside the whitelist (8 not given either)
    ("<answer></answer>", NUMS, 0.1),
    ("<answer>5 / (3 - 3)</answer>", {"numbers": [5, 3, 3], "target": 8}, 0.1),
    ("the answer is \\boxed{3 + 5}", NUMS, 0.0),  # no tag: no \\boxed fallback
    ("<answer>3 + 5", NUMS, 0.0),
    ("<answer>1</answer> then <answer>3 + 5</answer>", NUMS, 1.0),  # the last tag counts
    ("<answer>2 ** 3</answer>", {"numbers": [2, 3], "target": 8}, 1.0),  # Python's power
    ("<answer>7 // 3</answer>", {"numbers": [7, 3], "target": 2}, 1.0),
    ("<answer>7 / 3 * 3 + 1</answer>", {"numbers": [7, 3, 3, 1], "target": 8}, 1.0),
]


@pytest.mark.parametrize("completion,reference,score", CASES)
def test_release_scores_on_hand_written_completions(completion, reference, score):
    task = get_task("countdown", reward_rule="release")
    assert release_reference(completion, reference) == score  # the hand-written score is the release's
    assert task.reward(completion, reference) == score


def test_release_rule_equals_the_re_derived_release_on_random_expressions():
    task, rng = get_task("countdown", reward_rule="release"), random.Random(0)
    atoms = ["3", "5", "7", "2", "(", ")", " + ", " - ", " * ", " / ", " ** ", " // ", "=", "x", ".5"]
    for _ in range(3000):
        body = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 7)))
        ref = {"numbers": rng.sample([2, 3, 5, 7, 7], 3), "target": rng.randint(0, 12)}
        completion = f"<answer>{body}</answer>" if rng.random() < 0.9 else body
        assert task.reward(completion, ref) == release_reference(completion, ref), (completion, ref)


def test_strict_rule_is_unchanged():
    strict = get_task("countdown")
    assert strict.reward("<answer> 3 + 5 </answer>", NUMS) == 0.1  # 7 not used
    assert strict.reward("<answer>3 +* 5</answer>", NUMS) == 0.0
    assert strict.reward("<answer>3 + 5 = 8</answer>", {"numbers": [3, 5], "target": 8}) == 1.0


def test_the_releases_prompt_and_data_file_through_the_config(tmp_path):
    data = tmp_path / "countdown_cd3_test.jsonl"
    rows = [{"input": "30,100,93", "output": "23"}, {"input": "4, 7, 9", "output": "12"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        None,
        ["rollout.task=countdown", "rollout.task_options.reward_rule=release", f"rollout.data_path={data}"],
    )
    task = build_task(cfg)
    examples = load_train_examples(cfg, task)
    assert [e.reference for e in examples] == [
        {"numbers": [30, 100, 93], "target": 23},
        {"numbers": [4, 7, 9], "target": 12},
    ]
    assert examples[0].prompt == (
        "Given numbers [30, 100, 93], find an equation that equals 23. Please put the reasoning in "
        "<reasoning> tags and the final equation in <answer> tags, e.g. <answer> 1 + 1 </answer>."
    )
    assert task.system_prompt == "" and task.prompt(examples[0]) == f"Question: {examples[0].prompt}\nAnswer:"
    # held out from its own file (eval.data_path), never the training file
    cfg.eval.data_path, cfg.eval.num_examples = str(data), 1
    assert [e.reference["target"] for e in heldout_examples(cfg, task)] == [23]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input": "1,two", "output": "3"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: countdown \(reward_rule=release\) expects input"):
        task.load("train", path=str(bad))
    with pytest.raises(ValueError, match="needs task_options.reward_rule=release"):
        get_task("countdown").load("train", path=str(data))
    with pytest.raises(ValueError, match="reward_rule must be one of"):
        get_task("countdown", reward_rule="d1")
