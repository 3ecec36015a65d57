"""The instability study (``stabledrl study``): GRPO vs StableDRL under the estimator's own noise.

The paper's loop (Zhong et al. 2026): a noisy importance ratio bypasses GRPO's conditional
clipping, the gradient spikes, the policy drifts, the ratio variance grows, and so on. The
stress test (:mod:`.stress`) shows the collapse with *injected* noise; this study looks for it
with natural noise only: ``algo.mask_sampling=fresh`` (the old policy and every inner
iteration draw their own masks, so even the first ratio is an estimate), no
``algo.ratio_noise``, a one-draw ELBO (or the mean-field estimate) by default.

From one SFT checkpoint of the embedded tiny Sudoku setting, ``len(cells) x len(algos) x
len(seeds)`` arms run side by side (``seed`` = the RL seed: rollouts, masks and the prompt
order; the SFT start and the held-out set are shared; the two algorithms share everything
but ``algo.loss``). A *regime* (:data:`REGIMES`) sets the harshness (LR, inner iterations,
draws); a *grid* (:func:`grid_cells`) makes cells of one or more regimes with their LR scaled
(``lr_scales``) and their inner iterations set (``inner``); overrides change anything else. Every step logs the first
iteration's log-ratio variance, the clip fractions, the grad norm and the drift from the
initial policy (``logging.drift_to_initial``, :mod:`~stabledrl_mcore.rl.drift`); the held-out
accuracy every ``eval_every`` steps.

Resumable: an arm whose ``arm_done.json`` records the same config is not run again; an
interrupted arm continues from its newest checkpoint (``checkpoint.resume=auto``, saved every
``save_every`` steps). ``<out>/study.json`` records what makes the experiment (overrides,
estimator, batch, evaluation, the setting, every cell's regime overrides): a rerun into the
same ``out`` that changes any of them is refused (:class:`StudyMismatch`), one that changes
only the steps, seeds, algos or adds cells resumes. Outputs: the SFT start under ``<out>``
(shared by the cells); under ``<out>/<cell>`` one run directory per arm,
``study_summary.json`` and ``study.png``; ``<out>/grid_summary.json`` and ``grid.png``
(every cell of the run side by side).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

from stabledrl_mcore.common.errors import UserError
from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.experiments.plots import plot_grid, plot_study
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
MANIFEST = "study.json"
GRID_KEYS = {"lr_scales": "optim.lr", "inner": "algo.inner_iterations"}  # what each grid axis sets


class StudyMismatch(UserError, ValueError):
    """A study's options that cannot be used as given (a rerun into an ``out`` made with others,
    a grid axis an override would undo); the message names them."""


@dataclass
class StudyOptions:
    out: str = "runs/study"
    setting: TinySudoku = field(default_factory=TinySudoku)
    regimes: Sequence[str] = ("harsh",)
    lr_scales: Sequence[float] = ()  # grid: multiples of each regime's optim.lr
    inner: Sequence[int] = ()  # grid: algo.inner_iterations replacing each regime's
    overrides: Sequence[str] = ()  # after the cell's, for every arm
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
    window: int = 20  # steps averaged for reward_start / reward_end / drift_end
    trend_window: int = 50  # steps averaged for the log-ratio variance's first / last value
    early_steps: int = 50  # test_accuracy_early: the last evaluation at a step in (0, early_steps]
    collapse_drop: float = 0.1  # collapsed: reward_end < reward_start - drop (absolute)


IDENTITY = {
    # the StudyOptions fields a rerun into the same out must keep, and how a user sets each
    "overrides": "the KEY=VALUE overrides",
    "likelihood": "--likelihood",
    "prompts_per_step": "--prompts",
    "rollout_steps": "the rollout steps",
    "eval_every": "--eval-every",
    "eval_examples": "--eval-examples",
    "setting": "the embedded setting (--seed)",
}


@dataclass(frozen=True)
class Cell:
    """One point of the grid: a regime's overrides, its LR scaled and/or its inner iterations set."""

    name: str
    regime: str
    overrides: Tuple[str, ...]


def _value(overrides: Sequence[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(key + "="))


def grid_cells(opts: StudyOptions) -> List[Cell]:
    """The cells of ``opts``: every regime x LR scale x inner iterations, in that order.

    Without a grid axis a cell is the regime itself (named after it); with one, cell
    ``<regime>_lr<scale>x_in<inner>`` is the regime with ``optim.lr`` = scale x the regime's
    and ``algo.inner_iterations`` = inner (an axis left out keeps the regime's). A grid axis
    that an override would replace in every cell is refused.
    """
    unknown = [r for r in opts.regimes if r not in REGIMES]
    if unknown or not opts.regimes:
        raise StudyMismatch(f"unknown regime {unknown or '(none)'}; choose from {', '.join(REGIMES)}")
    if any(not (float(x) > 0) for x in opts.lr_scales):
        raise StudyMismatch(f"--lr-scale must be positive, got {list(opts.lr_scales)}")
    if any(int(n) != n or n < 1 for n in opts.inner):
        raise StudyMismatch(f"--inner must be whole numbers >= 1, got {list(opts.inner)}")
    for axis, flag in (("lr_scales", "--lr-scale"), ("inner", "--inner")):
        clash = [o for o in opts.overrides if o.startswith(GRID_KEYS[axis] + "=")]
        if getattr(opts, axis) and clash:
            raise StudyMismatch(
                f"{flag} sets {GRID_KEYS[axis]} in every cell, and the override {clash[-1]} would undo it; drop one"
            )
    cells = []
    for regime in dict.fromkeys(opts.regimes):
        base = REGIMES[regime]
        if not (opts.lr_scales or opts.inner):
            cells.append(Cell(regime, regime, base))
            continue
        lr = float(_value(base, "optim.lr"))
        for scale in dict.fromkeys(float(x) for x in opts.lr_scales or (1.0,)):
            for inner in dict.fromkeys(int(n) for n in opts.inner or (int(_value(base, "algo.inner_iterations")),)):
                changed = {"optim.lr": f"{lr * scale:.6g}", "algo.inner_iterations": str(inner)}
                overrides = tuple(
                    f"{o.split('=', 1)[0]}={changed[o.split('=', 1)[0]]}" if o.split("=", 1)[0] in changed else o
                    for o in base
                )
                cells.append(Cell(f"{regime}_lr{scale:g}x_in{inner}", regime, overrides))
    return cells


def study_identity(opts: StudyOptions) -> Dict[str, object]:
    """What makes the experiment (:data:`IDENTITY`), as JSON would read it back."""
    values = {key: asdict(opts.setting) if key == "setting" else getattr(opts, key) for key in IDENTITY}
    values["overrides"] = list(opts.overrides)
    return json.loads(json.dumps(values))


def _differences(old: Dict[str, object], new: Dict[str, object]) -> List[str]:
    out = []
    for key, label in IDENTITY.items():
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            fields = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
            a, b = {k: a.get(k) for k in fields}, {k: b.get(k) for k in fields}
        out.append(f"{label} ({a} there, {b} now)")
    return out


def claim_out(opts: StudyOptions, cells: Sequence[Cell]) -> None:
    """Refuse a rerun into ``opts.out`` made with other options (:data:`IDENTITY`) or with a cell of
    the same name and other overrides; otherwise record this run's in ``<out>/study.json``."""
    path = os.path.join(opts.out, MANIFEST)
    mine = {"options": study_identity(opts), "cells": {c.name: list(c.overrides) for c in cells}}
    if os.path.exists(path):
        with open(path) as handle:
            old = json.load(handle)
        differs = _differences(old["options"], mine["options"])
        differs += [
            f"cell {name}'s overrides ({old['cells'][name]} there, {overrides} now)"
            for name, overrides in mine["cells"].items()
            if name in old["cells"] and old["cells"][name] != overrides
        ]
        if differs:
            raise StudyMismatch(
                f"--out {opts.out} holds a study made with other options: {'; '.join(differs)}; use a new --out "
                "(a rerun may change only --steps, --seeds, --algos, --parallel or add cells)"
            )
        mine["cells"] = {**old["cells"], **mine["cells"]}
    os.makedirs(opts.out, exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump(mine, handle, indent=1)
    os.replace(path + ".tmp", path)


def arm_name(algo: str, seed: int) -> str:
    return f"{algo}_s{seed}"


def arm_overrides(sft: Dict, algo: str, seed: int, opts: StudyOptions, run_dir: str, cell: Cell) -> List[str]:
    """One arm's config: the tiny recipe, natural noise only, the cell's overrides, then the user's.
    The algos of a cell and seed differ in ``algo.loss`` (and their run directory) only."""
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
        *cell.overrides,
        *opts.overrides,
    ]


def arm_done(run_dir: str, config: Dict) -> bool:
    """The arm finished with this very config (``arm_done.json``)."""
    path = os.path.join(run_dir, DONE)
    if not os.path.exists(path):
        return False
    with open(path) as handle:
        return json.load(handle).get("config") == config


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarise_study_arm(rows: List[Dict[str, float]], *, algo: str, seed: int, opts: StudyOptions) -> Dict:
    """One ``study_summary.json`` entry: :func:`~.runs.train_summary` plus the study's curves.

    ``log_ratio_var_first`` / ``_last`` are the means over the first / last ``trend_window``
    steps (at most half the run each), ``drift_end`` the mean drift over the last ``window``
    steps, ``test_accuracy_early`` the last evaluation at a step in ``(0, early_steps]``.
    """
    train = [r for r in rows if "reward_mean" in r]
    curve = lambda key: [r.get(key, float("nan")) for r in train]  # noqa: E731
    var_curve = curve("log_ratio_var_first")
    var = [v for v in var_curve if math.isfinite(v)]
    k = min(opts.trend_window, max(len(var_curve) // 2, 1))
    drift = curve("drift_to_initial")
    finite_drift = [d for d in drift if math.isfinite(d)]
    evals = [(r["step"], r["test_accuracy"]) for r in rows if "test_accuracy" in r]
    early = [a for s, a in evals if 0 < s <= opts.early_steps]
    return {
        "algo": algo,
        "seed": seed,
        **train_summary(rows, window=opts.window, collapse_drop=opts.collapse_drop),
        "log_ratio_var_mean": _mean(var),
        "log_ratio_var_p99": percentile(var, 99),
        "log_ratio_var_first": _mean([v for v in var_curve[:k] if math.isfinite(v)]),
        "log_ratio_var_last": _mean([v for v in var_curve[-k:] if math.isfinite(v)]),
        "drift_final": drift[-1] if drift else float("nan"),
        "drift_end": _mean([d for d in drift[-opts.window :] if math.isfinite(d)]),
        "drift_max": max(finite_drift, default=float("nan")),
        "test_accuracy_start": evals[0][1] if evals else float("nan"),
        "test_accuracy_early": early[-1] if early else float("nan"),
        "test_accuracy_end": evals[-1][1] if evals else float("nan"),
        "test_accuracy_best": max((a for _, a in evals), default=float("nan")),
        "eval_curve": evals,
        "log_ratio_var_curve": var_curve,
        "clip_frac_low_curve": curve("clip_frac_low"),
        "clip_frac_high_curve": curve("clip_frac_high"),
        "drift_curve": drift,
        "drift_k3_curve": curve("drift_to_initial_k3"),
    }


def _last_step(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    last = 0
    if os.path.exists(path):
        with open(path) as handle:
            for line in handle:
                if '"reward_mean"' in line:
                    last = max(last, int(json.loads(line)["step"]))
    return last


def progress_line(arms: Sequence[Tuple[str, str]], steps: int) -> str:
    """``[study] 1234/2400 steps, 2/6 arms done | grpo_s1 34/400 | ...`` (the arms under way) from
    the arms' ``metrics.jsonl``."""
    done = {name: min(_last_step(run_dir), steps) for name, run_dir in arms}
    finished = sum(n >= steps for n in done.values())
    parts = "".join(f" | {name} {n}/{steps}" for name, n in done.items() if 0 < n < steps)
    return f"[study] {sum(done.values())}/{steps * len(arms)} steps, {finished}/{len(arms)} arms done{parts}"


def run_study(opts: StudyOptions, log: Callable[[str], None] = print, progress_every: float = 30.0) -> Dict:
    """Run (or resume) every cell x algo x seed, then write each cell's ``study_summary.json`` and
    ``study.png`` and the grid's ``grid_summary.json`` and ``grid.png``; returns the grid record
    with every cell's record (``cells``)."""
    started = time.time()
    cells = grid_cells(opts)
    claim_out(opts, cells)  # before anything is made: a refused rerun leaves the out as it was
    sft = prepare_sft_checkpoint(opts.out, opts.setting, log=log)
    arms, todo, configs = [], [], {}
    for cell in cells:  # cell-major, then seed-major: the algos of one seed run side by side, under the same load
        for seed in opts.seeds:
            for algo in opts.algos:
                run_dir = os.path.join(opts.out, cell.name, arm_name(algo, seed))
                overrides = [*arm_overrides(sft, algo, seed, opts, run_dir, cell), "parallel.threads=1"]
                config = json.loads(json.dumps(to_dict(load_config(None, overrides))))
                arms.append((cell, algo, seed, run_dir))
                configs[run_dir] = config
                if arm_done(run_dir, config):
                    log(f"[study] {cell.name}/{arm_name(algo, seed)}: finished earlier with the same config, reused")
                else:
                    todo.append(write_run_config(run_dir, overrides))
    names = [(f"{c.name}/{arm_name(a, s)}", d) for c, a, s, d in arms]
    for cell in cells:
        log(f"[study] cell {cell.name}: {' '.join(cell.overrides)}")
    log(
        f"[study] {len(cells)} cell(s) x {len(opts.algos)} algos x {len(opts.seeds)} seeds = {len(arms)} arms x "
        f"{opts.steps} steps, {len(todo)} to run, {opts.parallel} at a time; logs in <cell>/<arm>/train.log"
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
    common = {
        "overrides": list(opts.overrides),
        "likelihood": opts.likelihood,
        "steps": opts.steps,
        "seeds": list(opts.seeds),
        "collapse_rule": f"reward_end < reward_start - {opts.collapse_drop:g}",
        "reward_window": opts.window,
        "trend_window": opts.trend_window,
        "early_steps": opts.early_steps,
    }
    records = {}
    for cell in cells:
        cell_dir = os.path.join(opts.out, cell.name)
        runs = [summarise_study_arm(read_metrics(d), algo=a, seed=s, opts=opts) for c, a, s, d in arms if c == cell]
        os.makedirs(cell_dir, exist_ok=True)
        plot_study(runs, os.path.join(cell_dir, "study.png"))
        records[cell.name] = {
            "cell": cell.name,
            "regime": cell.regime,
            "regime_overrides": list(cell.overrides),
            **common,
            "table": aggregate(runs),
            "runs": runs,
        }
        _write_json(os.path.join(cell_dir, "study_summary.json"), records[cell.name])
    grid = {
        "regimes": list(dict.fromkeys(opts.regimes)),
        "lr_scales": list(opts.lr_scales),
        "inner": list(opts.inner),
        "cells": {c.name: list(c.overrides) for c in cells},
        **common,
        "wall_seconds": round(time.time() - started, 1),
        "table": {name: record["table"] for name, record in records.items()},
    }
    plot_grid(grid["table"], os.path.join(opts.out, "grid.png"), title=grid_title(grid))
    _write_json(os.path.join(opts.out, "grid_summary.json"), grid)
    return {**grid, "records": records}


def _write_json(path: str, record: Dict) -> None:
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle, indent=1)
    os.replace(path + ".tmp", path)


def grid_title(grid: Dict) -> str:
    """The grid figure's title: estimator, steps, seeds, overrides."""
    extra = f", {' '.join(grid['overrides'])}" if grid["overrides"] else ""
    return f"{grid['likelihood']}, {grid['steps']} steps, seeds {grid['seeds']}{extra}"


TABLE_KEYS = (
    "reward_start",
    "reward_end",
    "test_accuracy_start",
    "test_accuracy_early",
    "test_accuracy_end",
    "log_ratio_var_mean",
    "log_ratio_var_first",
    "log_ratio_var_last",
    "clip_frac_low",
    "clip_frac_high",
    "max_grad_norm",
    "p99_grad_norm",
    "drift_final",
    "drift_end",
    "drift_max",
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


GRID_COLUMNS = (
    # console column, table key, format
    ("reward", ("reward_start", "reward_end"), "{:.3f}>{:.3f}"),
    ("acc 0/early/end", ("test_accuracy_start", "test_accuracy_early", "test_accuracy_end"), "{:.2f}/{:.2f}/{:.2f}"),
    ("grad max/p99", ("max_grad_norm", "p99_grad_norm"), "{:.3g}/{:.3g}"),
    ("var first>last", ("log_ratio_var_first", "log_ratio_var_last"), "{:.3f}>{:.3f}"),
    ("drift end/max", ("drift_end", "drift_max"), "{:.3f}/{:.3f}"),
)


def format_study(record: Dict) -> str:
    """The console's final table: one line per cell and algo (means over seeds; the [min, max]
    are in ``grid_summary.json``)."""
    lines = ["", f"Instability study ({grid_title(record)})"]
    head = ["cell", "algo", "collapsed", *(c for c, _, _ in GRID_COLUMNS)]
    rows = []
    for cell, table in record["table"].items():
        for algo, row in table.items():
            values = [fmt.format(*(row[k][0] for k in keys)) for _, keys, fmt in GRID_COLUMNS]
            rows.append([cell, algo, f"{row['collapsed']} of {row['seeds']}", *values])
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
    return "\n".join(lines)
