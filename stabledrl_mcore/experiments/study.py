"""The instability study (``stabledrl study``): GRPO vs StableDRL under the estimator's own noise.

The paper's loop (Zhong et al. 2026): a noisy importance ratio bypasses GRPO's conditional
clipping, the gradient spikes, the policy drifts, the ratio variance grows, and so on. The
stress test (:mod:`.stress`) shows the collapse with *injected* noise; this study looks for it
with natural noise only: ``algo.mask_sampling=fresh`` (the old policy and every inner
iteration draw their own masks, so even the first ratio is an estimate), no
``algo.ratio_noise``, a one-draw ELBO (or the mean-field estimate) by default.

From one SFT checkpoint of the embedded tiny Sudoku setting, ``len(algos) x len(seeds)``
arms run side by side (``seed`` = the RL seed: rollouts, masks and the prompt order; the SFT
start and the held-out set are shared). A *regime* (:data:`REGIMES`) sets the harshness (LR,
inner iterations, draws); overrides change anything else. Every step logs the first
iteration's log-ratio variance, the clip fractions, the grad norm and the drift from the
initial policy (``logging.drift_to_initial``, :mod:`~stabledrl_mcore.rl.drift`); the held-out
accuracy every ``eval_every`` steps.

Resumable: an arm whose ``arm_done.json`` records the same config is not run again; an
interrupted arm continues from its newest checkpoint (``checkpoint.resume=auto``, saved every
``save_every`` steps). Outputs: the SFT start under ``<out>`` (shared by the regimes), and under
``<out>/<regime>`` one run directory per arm, ``study_summary.json`` and ``study.png``.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.experiments.plots import plot_study
from stabledrl_mcore.experiments.runs import percentile, read_metrics, run_side_by_side, train_summary, write_run_config
from stabledrl_mcore.experiments.tiny_sudoku import TinySudoku, prepare_sft_checkpoint, rl_overrides

REGIMES: Dict[str, Tuple[str, ...]] = {
    # the tiny setting's recipe, natural noise only
    "base": ("optim.lr=3e-5", "algo.inner_iterations=2", "algo.num_mc=1"),
    # 10x the LR and twice the inner iterations: more drift per rollout batch
    "harsh": ("optim.lr=3e-4", "algo.inner_iterations=4", "algo.num_mc=1"),
    # harsher still: 30x the LR, 8 inner iterations
    "harsher": ("optim.lr=1e-3", "algo.inner_iterations=8", "algo.num_mc=1"),
}
ALGOS = ("grpo", "stabledrl")
DONE = "arm_done.json"


@dataclass
class StudyOptions:
    out: str = "runs/study"
    setting: TinySudoku = field(default_factory=TinySudoku)
    regime: str = "harsh"
    overrides: Sequence[str] = ()  # after the regime's, for every arm
    algos: Sequence[str] = ALGOS
    seeds: Sequence[int] = (0, 1, 2)
    steps: int = 400
    likelihood: str = "elbo"
    prompts_per_step: int = 8  # puzzles per step (x G=8 completions)
    rollout_steps: int = 8  # denoising steps of the rollout
    eval_every: int = 25
    eval_examples: int = 100
    save_every: int = 25
    parallel: int = 2
    window: int = 20  # steps averaged for reward_start / reward_end
    collapse_drop: float = 0.1  # collapsed: reward_end < reward_start - drop (absolute)


def arm_name(algo: str, seed: int) -> str:
    return f"{algo}_s{seed}"


def arm_overrides(sft: Dict, algo: str, seed: int, opts: StudyOptions, run_dir: str) -> List[str]:
    """One arm's config: the tiny recipe, natural noise only, the regime, then the user's overrides."""
    if opts.regime not in REGIMES:
        raise ValueError(f"unknown regime {opts.regime!r}; choose from {', '.join(REGIMES)}")
    base = rl_overrides(
        sft,
        run_dir,
        seed=seed,
        steps=opts.steps,
        nproc=1,
        eval_every=opts.eval_every,
        eval_examples=opts.eval_examples,
        loss=algo,
        rollout_steps=opts.rollout_steps,
        likelihood=opts.likelihood,
    )
    rows = opts.prompts_per_step * 8
    return [
        *base,
        f"rollout.prompts_per_step={opts.prompts_per_step}",
        f"parallel.micro_batch_size={rows}",
        f"eval.seed={opts.setting.seed}",  # one held-out set for every arm
        "algo.mask_sampling=fresh",
        "algo.ratio_noise=null",
        "logging.drift_to_initial=true",
        f"checkpoint.save_every={opts.save_every}",
        "checkpoint.resume=auto",
        "checkpoint.overwrite=false",  # resume=auto continues an interrupted arm
        "logging.wandb_mode=disabled",
        *REGIMES[opts.regime],
        *opts.overrides,
    ]


def arm_done(run_dir: str, config: Dict) -> bool:
    """The arm finished with this very config (``arm_done.json``)."""
    path = os.path.join(run_dir, DONE)
    if not os.path.exists(path):
        return False
    with open(path) as handle:
        return json.load(handle).get("config") == config


def summarise_study_arm(rows: List[Dict[str, float]], *, algo: str, seed: int, opts: StudyOptions) -> Dict:
    """One ``study_summary.json`` entry: :func:`~.runs.train_summary` plus the study's curves."""
    train = [r for r in rows if "reward_mean" in r]
    curve = lambda key: [r.get(key, float("nan")) for r in train]  # noqa: E731
    var = [v for v in curve("log_ratio_var_first") if math.isfinite(v)]
    drift = curve("drift_to_initial")
    evals = [(r["step"], r["test_accuracy"]) for r in rows if "test_accuracy" in r]
    return {
        "algo": algo,
        "seed": seed,
        **train_summary(rows, window=opts.window, collapse_drop=opts.collapse_drop),
        "log_ratio_var_mean": sum(var) / max(len(var), 1),
        "log_ratio_var_p99": percentile(var, 99),
        "drift_final": drift[-1] if drift else float("nan"),
        "test_accuracy_start": evals[0][1] if evals else float("nan"),
        "test_accuracy_end": evals[-1][1] if evals else float("nan"),
        "test_accuracy_best": max((a for _, a in evals), default=float("nan")),
        "eval_curve": evals,
        "log_ratio_var_curve": curve("log_ratio_var_first"),
        "clip_frac_low_curve": curve("clip_frac_low"),
        "clip_frac_high_curve": curve("clip_frac_high"),
        "drift_curve": drift,
        "drift_k3_curve": curve("drift_to_initial_k3"),
    }


def progress_line(arms: Sequence[Tuple[str, str]], steps: int) -> str:
    """``[study] 1234/2400 steps | grpo_s0 400/400 | ...`` from the arms' ``metrics.jsonl``."""
    done = {}
    for name, run_dir in arms:
        path = os.path.join(run_dir, "metrics.jsonl")
        last = 0
        if os.path.exists(path):
            with open(path) as handle:
                for line in handle:
                    if '"reward_mean"' in line:
                        last = max(last, int(json.loads(line)["step"]))
        done[name] = last
    parts = " | ".join(f"{name} {n}/{steps}" for name, n in done.items())
    return f"[study] {sum(done.values())}/{steps * len(arms)} steps | {parts}"


def run_study(opts: StudyOptions, log: Callable[[str], None] = print, progress_every: float = 30.0) -> Dict:
    """Run (or resume) every arm, then write ``study_summary.json`` and ``study.png``."""
    started = time.time()
    os.makedirs(opts.out, exist_ok=True)
    sft = prepare_sft_checkpoint(opts.out, opts.setting, log=log)
    regime_dir = os.path.join(opts.out, opts.regime)  # the SFT start is shared by every regime
    arms, todo, configs = [], [], {}
    for seed in opts.seeds:  # seed-major: the algos of one seed run side by side, under the same load
        for algo in opts.algos:
            run_dir = os.path.join(regime_dir, arm_name(algo, seed))
            overrides = [*arm_overrides(sft, algo, seed, opts, run_dir), "parallel.threads=1"]
            config = json.loads(json.dumps(to_dict(load_config(None, overrides))))
            arms.append((algo, seed, run_dir))
            configs[run_dir] = config
            if arm_done(run_dir, config):
                log(f"[study] {arm_name(algo, seed)}: finished earlier with the same config, reused")
            else:
                todo.append(write_run_config(run_dir, overrides))
    names = [(arm_name(a, s), d) for a, s, d in arms]
    log(
        f"[study] regime {opts.regime} ({' '.join(REGIMES[opts.regime])}); {len(arms)} arms x {opts.steps} "
        f"steps, {len(todo)} to run, {opts.parallel} at a time; logs in <arm>/train.log"
    )
    last = [0.0]

    def report() -> None:
        if time.time() - last[0] >= progress_every:
            last[0] = time.time()
            log(progress_line(names, opts.steps))

    codes = run_side_by_side(todo, parallel=opts.parallel, on_poll=report)
    failed = [os.path.dirname(c) for c, code in zip(todo, codes) if code != 0]
    for path, code in zip(todo, codes):
        if code == 0:
            with open(os.path.join(os.path.dirname(path), DONE), "w") as handle:
                json.dump({"config": configs[os.path.dirname(path)]}, handle)
    if failed:
        raise RuntimeError(f"study arms failed (see train.log): {', '.join(failed)}")
    log(progress_line(names, opts.steps))
    runs = [summarise_study_arm(read_metrics(d), algo=a, seed=s, opts=opts) for a, s, d in arms]
    plot_study(runs, os.path.join(regime_dir, "study.png"))
    record = {
        "regime": opts.regime,
        "regime_overrides": list(REGIMES[opts.regime]),
        "overrides": list(opts.overrides),
        "likelihood": opts.likelihood,
        "steps": opts.steps,
        "seeds": list(opts.seeds),
        "collapse_rule": f"reward_end < reward_start - {opts.collapse_drop:g}",
        "reward_window": opts.window,
        "wall_seconds": round(time.time() - started, 1),
        "table": aggregate(runs),
        "runs": runs,
    }
    tmp = os.path.join(regime_dir, "study_summary.json.tmp")
    with open(tmp, "w") as handle:
        json.dump(record, handle, indent=1)
    os.replace(tmp, os.path.join(regime_dir, "study_summary.json"))
    return record


TABLE_KEYS = (
    "reward_start",
    "reward_end",
    "test_accuracy_start",
    "test_accuracy_end",
    "log_ratio_var_mean",
    "clip_frac_low",
    "clip_frac_high",
    "max_grad_norm",
    "p99_grad_norm",
    "drift_final",
)


def aggregate(runs: Sequence[Dict]) -> Dict[str, Dict]:
    """Per algo: ``{key: [mean, min, max]}`` over seeds of :data:`TABLE_KEYS`, and ``collapsed`` (a count)."""
    table: Dict[str, Dict] = {}
    for algo in dict.fromkeys(r["algo"] for r in runs):
        mine = [r for r in runs if r["algo"] == algo]
        row: Dict[str, object] = {"seeds": len(mine), "collapsed": sum(bool(r["collapsed"]) for r in mine)}
        for key in TABLE_KEYS:
            values = [float(r[key]) for r in mine]
            row[key] = [sum(values) / len(values), min(values), max(values)]
        table[algo] = row
    return table


def format_study(record: Dict) -> str:
    """The console's final table (mean over seeds, [min, max])."""
    lines = ["", f"Instability study, regime {record['regime']} ({record['steps']} steps, seeds {record['seeds']})"]
    for algo, row in record["table"].items():
        lines.append(f"{algo} ({row['seeds']} seeds, {row['collapsed']} collapsed)")
        for key in TABLE_KEYS:
            mean, lo, hi = row[key]
            lines.append(f"  {key:<20} {mean:9.4g}  [{lo:.4g}, {hi:.4g}]")
    return "\n".join(lines)
