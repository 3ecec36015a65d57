"""Whole-step benchmark of dynamic sampling on a task where about half the prompt groups are uniform.

On a random model every completion of a Sudoku prompt scores 0, so every group is uniform and
``rollout.filter_uniform_groups`` would drop them all. This tool registers ``half_uniform``: the
Sudoku prompts, where a prompt whose solution hashes even always scores 0 (a uniform group) and
any other scores a hash of its completion in [0, 1] (groups whose rewards differ whenever their
completions do).
It then runs ``stabledrl bench`` in this process with the given arguments plus
``rollout.task=half_uniform`` and prints how many groups each timed step kept::

    PYTHONPATH=. .venv/bin/python tools/bench_dynamic_sampling.py --config examples/configs/tiny_cpu.yaml \\
        model.preset=llada-100m rollout.prompts_per_step=4 rollout.group_size=4 \\
        rollout.filter_uniform_groups=true --phases step --warmup 0 --repeats 1

The HF-style baseline never filters, so its step trains on every group.
"""

from __future__ import annotations

import hashlib
import sys


def _register() -> None:
    from stabledrl_mcore.tasks import available_tasks
    from stabledrl_mcore.tasks.base import register_task
    from stabledrl_mcore.tasks.sudoku import SudokuTask

    class HalfUniformSudoku(SudokuTask):
        """Sudoku prompts; reward 0 for prompts whose solution hashes even, else a completion hash."""

        name = "half_uniform"

        def _reward(self, completion, reference):
            digest = hashlib.sha256(str(reference["solution"]).encode()).digest()
            if digest[0] % 2 == 0:
                return 0.0
            return hashlib.sha256(completion.encode()).digest()[0] / 255.0  # differs between completions

    if "half_uniform" not in available_tasks():
        register_task("half_uniform")(HalfUniformSudoku)


def _report_kept_groups() -> None:
    from stabledrl_mcore.rl import trainer

    real = trainer.filter_phase

    def counted(s, batch, timer):
        kept = real(s, batch, timer)
        groups = batch.size // s.cfg.rollout.group_size
        got = 0 if kept is None else kept.size // s.cfg.rollout.group_size
        print(f"[dynamic sampling] kept {got} of {groups} groups", flush=True)
        return kept

    trainer.filter_phase = counted


def main(argv=None) -> int:
    from stabledrl_mcore import cli

    _register()
    _report_kept_groups()
    args = list(sys.argv[1:] if argv is None else argv)
    return cli.main(["bench", *args, "rollout.task=half_uniform"])


if __name__ == "__main__":
    sys.exit(main())
