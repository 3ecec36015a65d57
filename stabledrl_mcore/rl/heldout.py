"""Held-out evaluation inside the training loop (``eval.every``).

Greedy decoding with the rollout's length and block settings, one token per
denoising step, sharded over data-parallel ranks (``evaluation.evaluate_model``).
Logged as ``test_accuracy`` (share of fully correct answers) and
``test_reward`` (mean task reward) at step 0, every ``eval.every`` steps and
after the last step.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from stabledrl_mcore.config.schema import RunConfig
from stabledrl_mcore.tasks import GENERATED_TASKS
from stabledrl_mcore.tasks.base import Example


def heldout_examples(cfg: RunConfig, task) -> List[Example]:
    """``eval.num_examples`` examples of ``eval.split`` (generated with ``eval.seed``, or read from
    ``eval.data_path`` / the task's default file of that split)."""
    e = cfg.eval
    if cfg.rollout.task in GENERATED_TASKS:
        return task.load(e.split, n=e.num_examples, seed=e.seed)
    kwargs = {"path": e.data_path} if e.data_path else {}  # held out: never the training file
    return task.load(e.split, limit=e.num_examples, **kwargs)


def make_heldout_evaluator(cfg: RunConfig, task, tokenizer) -> Optional[Callable[[object], Dict[str, float]]]:
    """``evaluate(model) -> {"test_accuracy", "test_reward"}``, or None when ``eval.every`` is 0."""
    if not cfg.eval.every:
        return None
    from stabledrl_mcore.evaluation.distributed import evaluate_model

    examples = heldout_examples(cfg, task)
    r = cfg.rollout

    def evaluate(model) -> Dict[str, float]:
        result = evaluate_model(model, tokenizer, task, examples, gen_length=r.gen_length,
                                steps=r.gen_length, block_length=r.block_length, temperature=0.0,
                                micro_batch=cfg.eval.micro_batch_size, seed=cfg.eval.seed)
        return {"test_accuracy": result.accuracy, "test_reward": result.mean_reward}

    return evaluate


def is_eval_step(cfg: RunConfig, step: int, last: int) -> bool:
    """Evaluate after ``step`` (1-based) when it is a multiple of ``eval.every`` or the last one."""
    return bool(cfg.eval.every) and (step % cfg.eval.every == 0 or step == last)
