"""Weak scaling over data-parallel ranks: the same work per rank at 1 and 2 ranks.

The 2-rank run starts local ranks with :func:`stabledrl_mcore.parallel.launch.spawn`
(gloo on CPU, NCCL when CUDA is present) and doubles ``rollout.prompts_per_step``
so every rank holds the same sequences as the 1-rank run. Per phase

    efficiency = (tokens/s of the 2-rank job / 2) / tokens/s of the 1-rank job

(seconds ratio ``t_1 / t_2`` for ``optimizer``, which has no tokens). 1.0 means
perfect weak scaling; gradient all-reduce, stragglers and, on a small machine,
ranks competing for the same cores all lower it. The 1-rank figures are taken
from the main run when it measured the same phases in one process.
``efficiency_cpu_time`` repeats the ratio with process CPU time, which ignores time spent
waiting (for the other rank or for a core taken by another job).

On CPU, ``machine_ceiling`` measures what the machine itself allows: the fp32 matmul
rate of each of ``ranks`` processes running at once over the rate of one alone (no
communication at all). Shared caches, memory bandwidth, clock boost and vCPUs that
are hyper-threads of one core put it below 1.0; ``efficiency_vs_ceiling`` divides
the measured efficiency by it, i.e. the part of the loss our code is responsible for.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from stabledrl_mcore.bench.phases import bench_config, log
from stabledrl_mcore.bench.run import bench_in_process
from stabledrl_mcore.parallel.launch import spawn


def _rank_main(
    config: Optional[str],
    overrides: Sequence[str],
    phases: Sequence[str],
    warmup: int,
    repeats: int,
    out_path: str,
    keep_tokenizer_vocab: bool,
) -> None:
    """One rank of a scaling run (module level, so ``spawn`` can import it)."""

    cfg = bench_config(config, overrides, keep_tokenizer_vocab=keep_tokenizer_vocab)
    result = bench_in_process(cfg, phases, warmup=warmup, repeats=repeats, baseline=False, measure_peak=False)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as handle:
            json.dump(result, handle)


def run_ranks(
    config: Optional[str],
    overrides: Sequence[str],
    phases: Sequence[str],
    ranks: int,
    *,
    warmup: int,
    repeats: int,
    keep_tokenizer_vocab: bool = False,
    timeout: float = 3600.0,
) -> Dict[str, Any]:
    """The benchmark on ``ranks`` local data-parallel ranks, ``prompts_per_step`` scaled by ``ranks``."""

    cfg = bench_config(config, overrides, keep_tokenizer_vocab=keep_tokenizer_vocab)
    extra = [f"rollout.prompts_per_step={cfg.rollout.prompts_per_step * ranks}"]
    fd, out_path = tempfile.mkstemp(prefix="stabledrl-scaling-", suffix=".json")
    os.close(fd)
    try:
        spawn(
            _rank_main,
            ranks,
            (config, list(overrides) + extra, list(phases), warmup, repeats, out_path, keep_tokenizer_vocab),
            timeout=timeout,
            threads=cfg.parallel.threads or torch.get_num_threads(),
        )
        with open(out_path) as handle:
            return json.load(handle)
    finally:
        os.unlink(out_path)


def efficiency(one: Dict[str, Any], many: Dict[str, Any], ranks: int) -> Optional[float]:
    """Per-rank throughput at ``ranks`` over throughput at 1 rank (phase summaries)."""
    if one.get("tokens_per_s") and many.get("tokens_per_s"):
        return many["tokens_per_s"] / ranks / one["tokens_per_s"]
    if many.get("median_s"):
        return one["median_s"] / many["median_s"]
    return None


def efficiency_cpu(one: Dict[str, Any], many: Dict[str, Any], ranks: int) -> Optional[float]:
    """The same from process CPU time (slowest rank): blind to waiting in collectives, so only
    a hint of how much of a wall-clock loss comes from other jobs on a shared machine."""
    if one.get("tokens_per_cpu_s") and many.get("tokens_per_cpu_s"):
        return many["tokens_per_cpu_s"] / ranks / one["tokens_per_cpu_s"]
    if many.get("cpu_median_s"):
        return one["cpu_median_s"] / many["cpu_median_s"]
    return None


def _matmul_window(a: torch.Tensor, b: torch.Tensor, seconds: float) -> float:
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        count += 1
    return 2.0 * a.shape[0] ** 3 * count / (time.perf_counter() - start)


def _ceiling_worker(rank: int, barrier, queue, size: int, seconds: float, threads: int, rounds: int) -> None:
    """Each round: rank 0 runs a window alone (the others wait), then all ranks run one together."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    for _ in range(3):
        torch.mm(a, b)  # warm-up
    for round_ in range(rounds):
        barrier.wait()
        if rank == 0:
            queue.put(("alone", round_, _matmul_window(a, b, seconds)))
        barrier.wait()
        queue.put(("together", round_, _matmul_window(a, b, seconds)))


def machine_ceiling(
    ranks: int = 2, *, threads: int = 1, size: int = 512, seconds: float = 2.0, rounds: int = 3, timeout: float = 300.0
) -> Dict[str, Any]:
    """Per-process fp32 matmul rate with ``ranks`` processes at once over one process alone.

    One set of ``ranks`` spawned processes runs ``rounds`` alternating windows of
    ``seconds``: rank 0 alone, then all at once. The ceiling is the median over
    rounds of (mean per-process rate together) / (rate alone): a single short
    window is easily disturbed on a shared machine (readings of 0.78-1.21 were
    seen for one window). Returns ``{"ceiling", "one_process_flops",
    "per_process_flops", "rounds", "per_round"}``; processes are joined, or
    killed by PID after ``timeout``.
    """

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(ranks), ctx.Queue()
    procs = [
        ctx.Process(target=_ceiling_worker, args=(r, barrier, queue, size, seconds, threads, rounds))
        for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    try:
        got = [queue.get(timeout=timeout) for _ in range(rounds * (ranks + 1))]
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    alone = {r: v for kind, r, v in got if kind == "alone"}
    together = {r: statistics.fmean(v for kind, rr, v in got if kind == "together" and rr == r) for r in range(rounds)}
    per_round = [together[r] / alone[r] for r in range(rounds)]
    return {
        "ceiling": statistics.median(per_round),
        "one_process_flops": statistics.median(alone.values()),
        "per_process_flops": statistics.median(together.values()),
        "rounds": rounds,
        "per_round": per_round,
    }


def weak_scaling(
    config: Optional[str],
    overrides: List[str],
    phases: Sequence[str],
    *,
    warmup: int,
    repeats: int,
    reference: Optional[Dict[str, Any]] = None,
    keep_tokenizer_vocab: bool = False,
) -> Dict[str, Any]:
    """1 vs 2 data-parallel ranks; ``reference`` = a 1-rank result that may already hold the phases."""

    have = reference and reference["layout"]["world_size"] == 1 and all(p in reference["phases"] for p in phases)
    if have:
        one = reference
    else:
        log(f"weak scaling: 1 rank ({', '.join(phases)})")
        one = run_ranks(
            config, overrides, phases, 1, warmup=warmup, repeats=repeats, keep_tokenizer_vocab=keep_tokenizer_vocab
        )
    log(f"weak scaling: 2 data-parallel ranks ({', '.join(phases)})")
    two = run_ranks(
        config, overrides, phases, 2, warmup=warmup, repeats=repeats, keep_tokenizer_vocab=keep_tokenizer_vocab
    )
    eff = {p: efficiency(one["phases"][p], two["phases"][p], 2) for p in phases}
    cpu = {p: efficiency_cpu(one["phases"][p], two["phases"][p], 2) for p in phases}
    headline = eff.get("step", next(iter(eff.values()), None))
    ceiling = None if torch.cuda.is_available() else machine_ceiling(2, threads=two["layout"]["threads"] or 1)
    if ceiling:
        log(
            f"machine ceiling: 2 processes at once run fp32 matmuls at {ceiling['ceiling']:.2f}x "
            f"the per-process rate of one alone (median of {ceiling['rounds']} rounds: "
            + ", ".join(f"{r:.2f}" for r in ceiling["per_round"])
            + ")"
        )
    return {
        "ranks": [1, 2],
        "backend": two["layout"]["backend"],
        "threads_per_rank": two["layout"]["threads"],
        "phases": list(phases),
        "efficiency": eff,
        "efficiency_cpu_time": cpu,
        "headline": headline,
        "one_rank": {p: one["phases"][p] for p in phases},
        "two_ranks": {p: two["phases"][p] for p in phases},
        "one_rank_from_main_run": bool(have),
        "load_average": two.get("load_average"),
        "cpu_count": os.cpu_count(),
        "machine_ceiling": ceiling,
        "efficiency_vs_ceiling": (
            {p: (v / ceiling["ceiling"] if v is not None else None) for p, v in eff.items()} if ceiling else None
        ),
    }
