"""Whole-step benchmark of dynamic sampling on a task where about half the prompt groups are uniform.

On a random model every completion of a Sudoku prompt scores 0, so every group is uniform and
``rollout.filter_uniform_groups`` would drop them all. This tool runs ``stabledrl bench`` in this
process with the given arguments, after wrapping the rollout scoring: a prompt whose solution
hashes odd gets, for each completion, a reward hashed from its token ids in [0, 1] (a group whose
rewards differ whenever its completions do); the others keep the task's reward (0: a uniform
group). Advantages are recomputed from those rewards. It prints how many groups each timed step
kept::

    PYTHONPATH=. .venv/bin/python tools/bench_dynamic_sampling.py --config examples/configs/tiny_cpu.yaml \\
        model.preset=llada-100m rollout.prompts_per_step=4 rollout.group_size=4 \\
        rollout.filter_uniform_groups=true --phases step --warmup 0 --repeats 1

The HF-style baseline never filters, so its step trains on every group.
"""

from __future__ import annotations

import hashlib
import sys


def _digest(value) -> int:
    return hashlib.sha256(repr(value).encode()).digest()[0]


def _half_uniform_scoring() -> None:
    from stabledrl_mcore.algorithms.advantages import group_advantages
    from stabledrl_mcore.rl import rollout, trainer

    real_score, real_filter = rollout.score_rollouts, trainer.filter_phase

    def score(batch, task, *, advantage="center"):
        batch = real_score(batch, task, advantage=advantage)
        rewards = batch.rewards.clone()
        tokens = batch.sequences[:, batch.prompt_len :].tolist()
        for row, reference in enumerate(batch.references):
            if _digest(reference) % 2:
                rewards[row] = _digest(tokens[row]) / 255.0
        batch.rewards = rewards
        batch.advantages = group_advantages(rewards, batch.group_index, mode=advantage)
        return batch

    def counted(s, batch, timer):
        kept = real_filter(s, batch, timer)
        groups = batch.size // s.cfg.rollout.group_size
        got = 0 if kept is None else kept.size // s.cfg.rollout.group_size
        print(f"[dynamic sampling] kept {got} of {groups} groups", flush=True)
        return kept

    rollout.score_rollouts, trainer.filter_phase = score, counted


def main(argv=None) -> int:
    from stabledrl_mcore import cli

    _half_uniform_scoring()
    return cli.main(["bench", *list(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
