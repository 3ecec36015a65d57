"""The stability experiment (``stabledrl stress``): GRPO vs StableDRL, with and without ratio noise.

From one SFT checkpoint, four arms run side by side with the same seed and
budget: ``{grpo, stabledrl} x {no noise, heavy-tailed noise on the estimated
log-ratio}`` (``algo.ratio_noise``, :mod:`stabledrl_mcore.algorithms.ratio_noise`). The
paper's claim (Zhong et al. 2026, stress test): under noise GRPO's gradient
spikes and its reward falls below its start, while StableDRL's clipped,
self-normalised update stays bounded (in the convex hull of per-sample
gradients) and keeps improving.

Outputs under ``--out``: one run directory per arm, ``stress_summary.json``
(one object per arm) and ``stress.png`` (reward and grad-norm curves).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from stabledrl_mcore.experiments.plots import plot_stress
from stabledrl_mcore.experiments.runs import read_metrics, run_side_by_side, train_summary, write_run_config
from stabledrl_mcore.experiments.tiny_sudoku import TinySudoku, prepare_sft_checkpoint, rl_overrides

ALGOS = ("grpo", "stabledrl")


@dataclass
class StressOptions:
    out: str = "runs/stress"
    setting: TinySudoku = field(default_factory=TinySudoku)
    config: Optional[str] = None  # a base RL config instead of the embedded tiny setting
    overrides: Sequence[str] = ()
    steps: int = 60
    noise: str = "lognormal"  # algo.ratio_noise of the noisy arms
    sigma: float = 1.5  # algo.ratio_noise_sigma
    parallel: int = 2  # arms running at once (one thread each)
    window: int = 10  # steps averaged for reward_start / reward_end
    collapse_drop: float = 0.1  # collapsed: reward_end < reward_start - drop (absolute)
    likelihood: str = "mean_field"  # algo.likelihood of the embedded setting: 1.6x cheaper
    # per step than "elbo", so 60 steps fit in 15 min on 2 cores


def arm_overrides(algo: str, noisy: bool, opts: StressOptions) -> List[str]:
    # a noisy arm may overflow its loss on purpose: its skips are counted (skipped_updates), not fatal
    noise = (
        [f"algo.ratio_noise={opts.noise}", f"algo.ratio_noise_sigma={opts.sigma}", "algo.max_skipped_updates=null"]
        if noisy
        else ["algo.ratio_noise=null"]
    )
    return [f"algo.loss={algo}", *noise, f"steps={opts.steps}", "eval.every=0"]


def summarise_arm(rows: List[Dict[str, float]], *, algo: str, noisy: bool, opts: StressOptions) -> Dict:
    """One ``stress_summary.json`` entry from an arm's metrics."""
    summary = train_summary(rows, window=opts.window, collapse_drop=opts.collapse_drop)
    return {
        "algo": algo,
        "noise": noisy,
        "noise_kind": opts.noise if noisy else None,
        "noise_sigma": opts.sigma if noisy else 0.0,
        **summary,
    }


def run_stress(opts: StressOptions, log=print) -> List[Dict]:
    """Run the four arms, write ``stress_summary.json`` and ``stress.png``; return the summaries."""
    started = time.time()
    os.makedirs(opts.out, exist_ok=True)
    if opts.config is None:
        sft = prepare_sft_checkpoint(opts.out, opts.setting, log=log)
        base = rl_overrides(
            sft,
            "",
            seed=opts.setting.seed,
            steps=opts.steps,
            nproc=1,
            eval_every=0,
            eval_examples=1,
            rollout_steps=8,
            likelihood=opts.likelihood,
        )
    else:
        base = []
    arms = [(algo, noisy) for noisy in (False, True) for algo in ALGOS]
    configs = []
    for algo, noisy in arms:
        run_dir = os.path.join(opts.out, f"{algo}_{'noise' if noisy else 'clean'}")
        overrides = [
            *base,
            *opts.overrides,
            *arm_overrides(algo, noisy, opts),
            f"logging.run_dir={run_dir}",
            "parallel.threads=1",
            "checkpoint.overwrite=true",
        ]
        configs.append(write_run_config(run_dir, overrides, config=opts.config))
    log(
        f"[stress] {len(arms)} arms x {opts.steps} steps, {opts.parallel} at a time; "
        f"noise {opts.noise} sigma {opts.sigma}; logs in <arm>/train.log"
    )
    codes = run_side_by_side(configs, parallel=opts.parallel)
    failed = [os.path.dirname(c) for c, code in zip(configs, codes) if code != 0]
    if failed:
        raise RuntimeError(f"stress arms failed (see train.log): {', '.join(failed)}")
    runs = [
        summarise_arm(read_metrics(os.path.dirname(path)), algo=algo, noisy=noisy, opts=opts)
        for (algo, noisy), path in zip(arms, configs)
    ]
    plot_stress(runs, os.path.join(opts.out, "stress.png"))
    record = {
        "runs": runs,
        "wall_seconds": round(time.time() - started, 1),
        "collapse_rule": f"reward_end < reward_start - {opts.collapse_drop:g}",
        "reward_window": opts.window,
    }
    tmp = os.path.join(opts.out, "stress_summary.json.tmp")
    with open(tmp, "w") as handle:
        json.dump(runs, handle, indent=1)
    os.replace(tmp, os.path.join(opts.out, "stress_summary.json"))
    with open(os.path.join(opts.out, "stress_meta.json"), "w") as handle:
        json.dump({k: v for k, v in record.items() if k != "runs"}, handle, indent=2)
    return runs


def format_stress(runs: Sequence[Dict]) -> str:
    """The console's final table."""
    head = (
        f"{'algo':<10} {'noise':<6} {'reward start':>12} {'reward end':>10} {'max |g|':>9} "
        f"{'p99 |g|':>9} {'clip hi':>8} {'collapsed':>9}"
    )
    lines = ["", "Stability experiment", head, "-" * len(head)]
    for r in runs:
        lines.append(
            f"{r['algo']:<10} {str(r['noise']):<6} {r['reward_start']:>12.3f} {r['reward_end']:>10.3f} "
            f"{r['max_grad_norm']:>9.3g} {r['p99_grad_norm']:>9.3g} {r['clip_frac_high']:>8.3f} "
            f"{str(r['collapsed']):>9}"
        )
    return "\n".join(lines)
