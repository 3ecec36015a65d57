"""``stabledrl bench``: per-phase throughput, MFU, baseline speed-up and weak scaling of a config.

Runs on however many ranks it is launched with (one process, ``torchrun`` or
``srun``: ``slurm/bench_throughput.sh``); ``--dp-scaling`` additionally starts 2
local data-parallel ranks (gloo on CPU) with twice the prompts, i.e. the same
work per rank, and reports weak-scaling efficiency = per-rank tokens/s at 2
ranks / tokens/s at 1 rank.

JSON top level (``--json PATH``): ``mfu`` (training forward+backward model FLOP/s
over ``matmul_peak_flops`` x TP x PP), ``matmul_peak_flops`` (the matmul rate of the
model's dtype: GPU, bf16 model: rated dense bf16 peak; CPU, or an fp32 model on GPU:
the rate measured in this run; ``peak.kind`` and ``peak.dtype`` say which, see
:mod:`.peak`), ``mfu_vs_fp32`` (the same over the measured fp32 matmul rate; equal
to ``mfu`` for an fp32 model with the measured peak), ``step_tokens_per_s``
(prompt + completion tokens of one step's sequences, all ranks, per second of
the median whole step), ``train_tokens_per_s``, ``speedup_vs_baseline`` (per
phase, ours over the baseline's tokens/s, or seconds for ``optimizer``; only
when the baseline ran; ``speedup_vs_baseline_cpu_time`` is the same from process
CPU time), ``weak_scaling_efficiency`` (with ``--dp-scaling``),
``phases`` / ``baseline.phases`` (median, quartiles, IQR, min/max seconds,
tokens/s, model FLOP/s, MFU per phase), ``model`` (``params`` total, ``active_params``: a
mixture-of-experts model's router + top-k experts per token, what the model FLOPs count), ``layout``, ``workload``,
``peak``, ``config``, ``load_average``; with ``--rollout-mode``: ``rollout_modes`` (per mode:
tokens/s, NFE per completion, greedy held-out accuracy with a checkpoint, speed-ups; see
:mod:`.modes`) and ``rollout_modes_baseline`` (the baseline's rollout, timed alongside).
"""

from __future__ import annotations

import gc
import os
import socket
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from stabledrl_mcore.algorithms.losses import available_token_policy_losses
from stabledrl_mcore.bench.baseline import BaselineStep
from stabledrl_mcore.bench.flops import FlopCounter, matmul_params
from stabledrl_mcore.bench.modes import RolloutMode, summarize_modes
from stabledrl_mcore.bench.peak import device_peak
from stabledrl_mcore.bench.phases import PHASES, StableDRLPhases, VocabGuard, log, measure
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.config.schema import RunConfig
from stabledrl_mcore.engine.pipeline import timed_stage_forward
from stabledrl_mcore.parallel import bootstrap
from stabledrl_mcore.rl.setup import build_training


def parse_phases(text: str, allowed: Sequence[str] = PHASES) -> List[str]:
    if text.strip() == "all":
        return list(allowed)
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in allowed]
    if bad or not names:
        raise ConfigError(f"unknown bench phase(s) {', '.join(bad) or repr(text)}; choose from {', '.join(allowed)}")
    return [p for p in allowed if p in names]


def _load() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def bench_in_process(
    cfg: RunConfig,
    phases: Sequence[str],
    *,
    warmup: int,
    repeats: int,
    baseline: Optional[bool] = None,
    peak_tflops: Optional[float] = None,
    measure_peak: bool = True,
    rollout_modes: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Build the training set-up of ``cfg`` on this process's ranks and time ``phases``.

    ``rollout_modes``: name -> (overrides, the mode's RunConfig) (see :mod:`.modes`), timed
    after the phases, with the baseline's rollout alongside when the baseline runs.

    Returns the result dict (the same on every rank); everything built is freed
    and the process group destroyed before returning.
    """

    load_before = _load()
    log(f"building {cfg.model.preset} ({cfg.model.dtype}) and the training set-up")
    try:
        s = build_training(cfg)
    except ValueError as err:  # layouts, model shapes, batch splits: a config problem, one line
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err).splitlines()[0]) from err
    s.tokenizer = VocabGuard(s.tokenizer)
    ours = base = None
    try:
        world = torch.distributed.get_world_size()

        token_loss = cfg.algo.loss in available_token_policy_losses()
        if baseline and token_loss:
            raise ConfigError(
                f"the baseline implements sequence-level losses only, not {cfg.algo.loss!r}; run with --no-baseline"
            )
        if baseline is None:  # by default: in a one-process run, for the losses it implements
            baseline = world == 1 and not token_loss
            if token_loss:
                log(f"no baseline: it implements sequence-level losses only, not {cfg.algo.loss!r}")
        peak = device_peak(cfg.model.dtype, override_tflops=peak_tflops) if measure_peak else None
        log("preparing one rollout batch (generation, scoring, old-policy likelihood)")
        ours = StableDRLPhases(s)
        if cfg.parallel.pipeline_parallel > 1:  # stage busy time: pipeline_bubble_fraction per phase
            timed_stage_forward(s.model)
        if baseline:
            log("building the baseline (transformers model, torch AdamW)")
            base = BaselineStep(ours)
        dcfg = s.model.dllm_config
        jobs, counters = {}, {}
        ours_counter = FlopCounter(s.model, dcfg)
        base_counter = FlopCounter(base.model, dcfg) if base else None
        for name, fn in ours.jobs(phases).items():
            jobs[name], counters[name] = fn, ours_counter
        if base:
            for name, fn in base.jobs(phases).items():
                jobs["baseline/" + name], counters["baseline/" + name] = fn, base_counter
        with ours_counter:
            if base_counter:
                base_counter.__enter__()
            try:
                results = _measure_by_phase(jobs, counters, phases, warmup, repeats)
            finally:
                if base_counter:
                    base_counter.__exit__(None, None, None)
        mode_out = (
            _bench_modes(s, rollout_modes, base, results, counters, ours_counter, base_counter, warmup, repeats)
            if rollout_modes
            else None
        )
        if peak:
            log("measuring the matmul peak again (the best of both measurements is kept)")
            peak = device_peak(cfg.model.dtype, override_tflops=peak_tflops, previous=peak)
        mp = cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel
        peak_flops = peak["peak_flops"] if peak else None
        out = _assemble(
            cfg,
            s,
            ours,
            results,
            phases,
            peak,
            peak_flops,
            mp,
            warmup,
            repeats,
            world,
            matmul_params(dcfg),
            with_baseline=base is not None,
        )
        if mode_out:
            modes, mode_results, accuracy = mode_out
            base_rollout = (
                mode_results["baseline/rollout"].summary(peak_flops, mp) if "baseline/rollout" in mode_results else None
            )
            out["rollout_modes"] = summarize_modes(modes, mode_results, peak_flops, mp, accuracy, base_rollout)
            out["rollout_modes_baseline"] = base_rollout
        out["load_average"] = {"before": load_before, "after": _load()}
        return out
    finally:
        s = ours = base = None  # noqa: F841 - free both models before any scaling run starts
        gc.collect()
        bootstrap.destroy()


def _bench_modes(s, rollout_modes, base, results, counters, ours_counter, base_counter, warmup, repeats):
    """Time each rollout mode (interleaved, with the baseline's rollout); greedy accuracy with a checkpoint."""

    modes = [RolloutMode(s, name, mcfg, overrides) for name, (overrides, mcfg) in rollout_modes.items()]
    jobs = {f"rollout[{m.name}]": m.rollout for m in modes}
    mode_counters = {name: ours_counter for name in jobs}
    if base:
        jobs["baseline/rollout"], mode_counters["baseline/rollout"] = base.rollout, base_counter
    with ours_counter:
        if base_counter:
            base_counter.__enter__()
        try:
            mode_results = measure(jobs, warmup=warmup, repeats=repeats, counters=mode_counters)
        finally:
            if base_counter:
                base_counter.__exit__(None, None, None)
    accuracy = {}
    if s.cfg.model.checkpoint:
        for m in modes:
            log(f"rollout[{m.name}]: greedy held-out accuracy")
            accuracy[m.name] = m.accuracy()
    return modes, mode_results, accuracy


def _measure_by_phase(jobs, counters, phases, warmup, repeats):
    """Ours and the baseline interleaved phase by phase (so both see the same machine load)."""
    results = {}
    for p in phases:
        group = {k: v for k, v in jobs.items() if k in (p, "baseline/" + p)}
        results.update(measure(group, warmup=warmup, repeats=repeats, counters=counters))
    return results


def _assemble(cfg, s, ours, results, phases, peak, peak_flops, mp, warmup, repeats, world, n_mm, *, with_baseline):
    dcfg = s.model.dllm_config
    batch = ours.batch
    phase_out = {p: results[p].summary(peak_flops, mp) for p in phases}
    fp32 = peak.get("fp32_matmul_flops") if peak else None
    out: Dict[str, Any] = {
        "mfu": None,
        "matmul_peak_flops": peak_flops,
        "step_tokens_per_s": None,
        "train_tokens_per_s": None,
        "model": {
            "name": cfg.model.preset,
            "arch": dcfg.arch,
            "params": dcfg.num_parameters(),
            "active_params": dcfg.num_active_parameters(),
            "num_experts": dcfg.num_experts,
            "moe_router_topk": dcfg.moe_router_topk if dcfg.is_moe else None,
            "matmul_params": n_mm,
            "dtype": cfg.model.dtype,
            "vocab_size": dcfg.vocab_size,
            "recompute": cfg.model.recompute,
        },
        "layout": {
            "world_size": world,
            "tp": cfg.parallel.tensor_parallel,
            "pp": cfg.parallel.pipeline_parallel,
            "dp": s.dp_size,
            "threads": torch.get_num_threads(),
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        },
        "workload": {
            "sequences": batch.size,
            "seq_len": batch.sequences.shape[1],
            "prompt_len": batch.prompt_len,
            "generated": batch.sequences.shape[1] - batch.prompt_len,
            "num_mc": batch.plan.num_mc,
            "inner_iterations": cfg.algo.inner_iterations,
            "micro_batch": cfg.parallel.micro_batch_size,
            "likelihood": cfg.algo.likelihood,
            "staircase_block": ours.block,
            "rollout_steps": cfg.rollout.steps,
            "block_length": cfg.rollout.block_length,
        },
        "peak": peak,
        "warmup": warmup,
        "repeats": repeats,
        "phases": phase_out,
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": to_dict(cfg),
    }
    key = "train" if "train" in phase_out else ("step" if "step" in phase_out else None)
    if key and phase_out[key].get("mfu") is not None:
        out["mfu"] = phase_out[key]["mfu"]
        out["mfu_phase"] = key
        out["mfu_cpu_time"] = phase_out[key].get("mfu_cpu_time")
        if fp32:
            out["mfu_vs_fp32"] = phase_out[key]["model_flops_per_s"] / (fp32 * mp)
    if "step" in phase_out:
        out["step_tokens_per_s"] = phase_out["step"]["tokens_per_s"]
        out["step_mfu"] = phase_out["step"].get("mfu")
    if "train" in phase_out:
        out["train_tokens_per_s"] = phase_out["train"]["tokens_per_s"]
    if with_baseline:
        base = {p: results["baseline/" + p].summary(peak_flops, mp) for p in phases}
        hf_class = (
            "LlamaForCausalLM"
            if dcfg.arch == "llada"
            else ("Qwen3MoeForCausalLM" if dcfg.is_moe else "Qwen3ForCausalLM")
        )
        out["baseline"] = {"implementation": f"transformers {hf_class}, torch AdamW", "phases": base}
        out["speedup_vs_baseline"] = {p: speedup(phase_out[p], base[p]) for p in phases}
        out["speedup_vs_baseline_cpu_time"] = {p: speedup_cpu(phase_out[p], base[p]) for p in phases}
    return out


def speedup_cpu(ours: Dict[str, Any], base: Dict[str, Any]) -> Optional[float]:
    """The same ratio from process CPU time: on a shared machine with one thread per rank
    it is much less disturbed by other jobs than wall time (both clocks agree when idle)."""
    if ours.get("cpu_median_s") and base.get("cpu_median_s"):
        return base["cpu_median_s"] / ours["cpu_median_s"]
    return None


def speedup(ours: Dict[str, Any], base: Dict[str, Any]) -> Optional[float]:
    """Ours over the baseline: ratio of tokens/s, or of seconds when a phase has no tokens."""
    if ours.get("tokens_per_s") and base.get("tokens_per_s"):
        return ours["tokens_per_s"] / base["tokens_per_s"]
    if ours["median_s"] > 0:
        return base["median_s"] / ours["median_s"]
    return None
