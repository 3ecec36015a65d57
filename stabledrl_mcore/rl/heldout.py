"""Held-out evaluation inside the training loop (``eval.every``).

Greedy decoding with the rollout's length and block settings, one token per
denoising step, sharded over data-parallel ranks (``evaluation.evaluate_model``).
Logged as ``test_accuracy`` (share of fully correct answers) and
``test_reward`` (mean task reward) at step 0, every ``eval.every`` steps and
after the last step; with ``rollout.reward_fn`` also ``test_reward_errors``, its calls that
failed and scored 0 (over all ranks; ``rollout.max_reward_error_frac`` watches training steps only).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from stabledrl_mcore.config.schema import RunConfig
from stabledrl_mcore.evaluation.distributed import evaluate_model
from stabledrl_mcore.rl.step_metrics import dp_sum
from stabledrl_mcore.tasks.from_config import heldout_examples


def make_heldout_evaluator(cfg: RunConfig, task, tokenizer) -> Optional[Callable[[object], Dict[str, float]]]:
    """``evaluate(model) -> {"test_accuracy", "test_reward"}``, or None when ``eval.every`` is 0."""
    if not cfg.eval.every:
        return None

    examples = heldout_examples(cfg, task)
    r = cfg.rollout

    def evaluate(model) -> Dict[str, float]:
        result = evaluate_model(
            model,
            tokenizer,
            task,
            examples,
            gen_length=r.gen_length,
            steps=r.gen_length,
            block_length=r.block_length,
            temperature=0.0,
            micro_batch=cfg.eval.micro_batch_size,
            seed=cfg.eval.seed,
            compile=r.compile,
        )
        out = {"test_accuracy": result.accuracy, "test_reward": result.mean_reward}
        if hasattr(task, "pop_failure_report"):  # rollout.reward_fn: its failed calls here, not the next step's
            out["test_reward_errors"] = dp_sum(torch.tensor([float(task.pop_failure_report()[0])]))[0]
        return out

    return evaluate


def is_eval_step(cfg: RunConfig, step: int, last: int) -> bool:
    """Evaluate after ``step`` (1-based) when it is a multiple of ``eval.every`` or the last one."""
    return bool(cfg.eval.every) and (step % cfg.eval.every == 0 or step == last)
