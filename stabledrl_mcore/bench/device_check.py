"""``tools/gpu_check.py``: the 8B recipes' device code path, checked on one accelerator in one short run.

Parts (:data:`.check_parts.PARTS`, most important first), each ``ok``, ``FAIL``, ``TIMEOUT``,
``skipped`` (with the reason) or ``not run`` (the budget was spent), printed as tables and
written as one JSON:

1. ``rollout_llada`` / ``rollout_sdar`` (:mod:`.rollout_checks`): LLaDA-8B and SDAR-8B at their real
   shapes (32 / 36 layers, random bf16 weights, no optimizer) decode the recipe's rollout (prompt
   256, 256 new tokens, the recipe's block, steps, threshold, cache and rows per decoding forward)
   eager and with the captured step (``rollout.compile=reduce-overhead``): tokens/s, ms per forward,
   host vs device ms per forward, compile/capture seconds, peak memory, tokens equal.
2. ``recipe_step_llada`` / ``recipe_step_sdar`` (:mod:`.workload_checks`): the recipe's training
   step as configured (micro-batch, recompute, dtype) at full width and as many layers as fit the
   GPU (``stabledrl plan``'s memory model), MFU against the rated and the measured matmul peak.
3. ``te_vs_local_decode`` (:mod:`.rollout_checks`): Transformer Engine vs the local spec on the
   KV-cached decoding steps (LLaDA's dual-cache block step, SDAR's block step), logits compared.
4. ``te_vs_local``, ``flex_vs_sdpa``, ``staircase_memory``, ``moe_layer`` (:mod:`.kernel_checks`):
   TE vs local on uncached forwards (and the checkpoint round trip), flex attention vs SDPA, the
   staircase likelihood's peak memory, the MoE layer at SDAR-30B-A3B's width.
5. ``train_llada`` / ``train_sdar`` (:mod:`.workload_checks`): three bf16 StableDRL steps of the tiny
   presets with the distributed optimizer and recompute, checkpointed and resumed (bitwise on CPU).

A budget (:data:`.check_parts.GPU_BUDGET_S`, ``--budget``) bounds the whole run: every part runs in
its own child process under ``min(its limit, the budget left)``; one that raises is ``FAIL``, one past
its limit is killed (its process group, by PID) and reported ``TIMEOUT``, and the others still run.
``cpu=True`` (``--cpu``) runs every part shrunk on the CPU (:mod:`.check_sizes`): the rollouts at the
8B layer counts but tiny width, fp32, with ``torch.compile``'s ``eager`` backend; CI runs that mode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from stabledrl_mcore.bench import part_targets  # noqa: F401 - the parts' targets (and the bundle's import closure)
from stabledrl_mcore.bench.check_parts import CPU_BUDGET_S, GPU_BUDGET_S, PARTS, Part, PartOptions, run_parts
from stabledrl_mcore.bench.peak import _cpu_name
from stabledrl_mcore.bench.report import write_json

HEADER = f"{'check':<20}{'status':<9}{'s':>7}{'limit':>7}  result"
ROLLOUT_COLUMNS = (
    "part",
    "layers",
    "rows",
    "side",
    "tokens/s",
    "ms/forward",
    "host ms/forward",
    "device ms/forward",
    "compile s",
    "peak GiB",
    "tokens equal",
)
"""The rollout table's columns (docs/performance.md's "first GPU run" table has the same)."""
STEP_COLUMNS = (
    "part",
    "layers (fit)",
    "micro-batch",
    "recompute",
    "dtype",
    "train tokens/s",
    "MFU rated",
    "MFU measured",
)
"""The recipe-step table's columns (docs/performance.md has the same)."""


def run_checks(
    *,
    cpu: bool,
    workdir: Optional[str] = None,
    only: Optional[List[str]] = None,
    budget_s: Optional[float] = None,
    layers: Optional[int] = None,
    backend: Optional[str] = None,
    rows: Optional[int] = None,
    parts: Optional[Sequence[Part]] = None,
    echo: bool = False,
) -> Dict[str, Any]:
    """Run every part (or ``only`` those) in child processes; returns the JSON-ready result.

    ``parts``: the registry to run (default :data:`.check_parts.PARTS`; a test plants its own).
    ``layers`` / ``backend`` / ``rows``: the rollout parts' depth, compile backend and rows per
    decoding forward (defaults: the 8B layer counts, the mode's backend, the recipe's rows).
    ``echo``: print each part's row as it ends."""
    if not cpu and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: run with --cpu for the CPU variant")
    parts = list(PARTS if parts is None else parts)
    names = [p.name for p in parts]
    unknown = [n for n in only or () if n not in names]
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    for name, value in (("layers", layers), ("rollout rows", rows), ("budget", budget_s)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if backend is not None and backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(
            f"unknown torch.compile backend {backend!r}; choose from {', '.join(torch._dynamo.list_backends(exclude_tags=()))}"
        )
    if only:
        parts = [p for p in parts if p.name in only]
    budget = budget_s or (CPU_BUDGET_S if cpu else GPU_BUDGET_S)
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="stabledrl-gpu-check-")
    options = PartOptions(cpu=cpu, workdir=os.path.abspath(workdir), layers=layers, backend=backend, rows=rows)
    start = time.perf_counter()

    def show(name: str, r: Dict[str, Any]) -> None:
        if echo:
            print(_row(name, r), flush=True)

    try:
        if echo:
            print(f"device check ({'cpu' if cpu else 'gpu'}), budget {budget:g} s\n{HEADER}\n{'-' * 110}", flush=True)
        results = run_parts(parts, options, budget, on_done=show)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    devices = [r["device"] for r in results.values() if r.get("device")]
    return {
        "mode": "cpu" if cpu else "gpu",
        "device": devices[0] if devices else (_cpu_name() if cpu else "unknown"),
        "torch": torch.__version__,
        "transformer_engine": _te_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "budget_s": budget,
        "seconds": round(time.perf_counter() - start, 1),
        "ran": [n for n, r in results.items() if r.get("ran")],
        "not_run": [n for n, r in results.items() if not r.get("ran")],
        "ok": all(r["status"] not in ("FAIL", "TIMEOUT") for r in results.values()),
        "checks": results,
    }


def _te_version() -> Optional[str]:
    try:
        import transformer_engine

        return getattr(transformer_engine, "__version__", "unknown")
    except ImportError:
        return None


def _row(name: str, r: Dict[str, Any]) -> str:
    value = r.get("value") or r.get("detail") or ""
    return f"{name:<20}{r['status']:<9}{r.get('seconds', 0):>7.1f}{r.get('limit_s', 0):>7.0f}  {value}"


def _num(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def rollout_rows(result: Dict[str, Any]) -> List[List[str]]:
    """One row per rollout part and side (eager, captured), in :data:`ROLLOUT_COLUMNS` order."""
    rows = []
    for name, r in result["checks"].items():
        if not name.startswith("rollout_") or "eager" not in r:
            continue
        for side in ("eager", "captured"):
            s = r[side]
            peak = s.get("peak_gib") if s.get("peak_gib") is not None else r.get("peak_rss_gib")
            rows.append(
                [
                    name,
                    str(r["shape"]["layers"]),
                    str(r["shape"]["rows"]),
                    side if side == "eager" else f"captured ({r['backend']})",
                    _num(s["tokens_per_s"]),
                    _num(s["ms_per_forward"], 2),
                    _num(s["host_ms_per_forward"], 2),
                    _num(s["device_ms_per_forward"], 2),
                    _num(s["compile_s"]) if side == "captured" else "-",
                    _num(peak, 2),
                    ("yes" if r["tokens_equal"] else f"{100 * r['token_agreement']:.1f}%")
                    if side == "captured"
                    else "-",
                ]
            )
    return rows


def step_rows(result: Dict[str, Any]) -> List[List[str]]:
    """One row per recipe-step part, in :data:`STEP_COLUMNS` order."""
    rows = []
    for name, r in result["checks"].items():
        if not name.startswith("recipe_step_") or "mfu" not in r:
            continue
        fit = r["layers_fit"]
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        rows.append(
            [
                name,
                f"{r['layers']} ({fit['layers']} of {fit['of']} fit {fit['memory_gib']:.0f} GiB)",
                str(r["micro_batch"]),
                str(r["recompute"]),
                str(r["dtype"]),
                _num(r["train_tokens_per_s"]),
                pct(r["mfu"]),
                pct(r["mfu_vs_measured"]),
            ]
        )
    return rows


def _grid(columns: Sequence[str], rows: List[List[str]]) -> List[str]:
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(columns)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(columns), "-" * (sum(widths) + 2 * (len(widths) - 1))] + [line(r) for r in rows]


def format_table(result: Dict[str, Any]) -> str:
    """One row per part (name, status, seconds, limit, headline), then the rollout and the
    recipe-step figures (host vs device per forward: on CPU, process CPU ms vs wall ms)."""
    rows = [
        f"device check ({result['mode']}) on {result['device']}, torch {result['torch']}, "
        f"TE {result['transformer_engine'] or 'not installed'}; {result['seconds']:.0f} s of a "
        f"{result['budget_s']:g} s budget",
        "",
        HEADER,
        "-" * 110,
    ]
    rows += [_row(name, r) for name, r in result["checks"].items()]
    rollouts, steps = rollout_rows(result), step_rows(result)
    if rollouts:
        where = "CUDA events" if result["mode"] == "gpu" else "CPU: host = process CPU time, device = wall"
        rows += ["", f"rollouts (host vs device per forward; {where})"] + _grid(ROLLOUT_COLUMNS, rollouts)
    if steps:
        rows += ["", "recipe training step"] + _grid(STEP_COLUMNS, steps)
    if result["not_run"]:
        rows += ["", f"not run (budget spent): {', '.join(result['not_run'])}"]
    rows += ["", "all checks passed" if result["ok"] else "SOME CHECKS FAILED"]
    return "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> int:

    parser = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the shrunk CPU variant (what CI runs)")
    parser.add_argument("--json", metavar="PATH", default="gpu_check.json", help="result file (default %(default)s)")
    parser.add_argument("--only", metavar="LIST", help="comma-separated subset of the checks")
    parser.add_argument("--workdir", metavar="DIR", help="keep the runs' files here (default: a temporary dir)")
    parser.add_argument(
        "--budget",
        type=float,
        metavar="S",
        help=f"seconds for the whole check (default {GPU_BUDGET_S:g} on GPU, {CPU_BUDGET_S:g} with --cpu)",
    )
    parser.add_argument(
        "--layers", type=int, metavar="N", help="layers of the rollout parts (default: 32 LLaDA, 36 SDAR)"
    )
    parser.add_argument(
        "--backend",
        metavar="NAME",
        help="torch.compile backend of the captured step (default: inductor; eager with --cpu)",
    )
    parser.add_argument(
        "--rollout-rows", type=int, metavar="N", help="rows per decoding forward (default: the recipe's)"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the running part is stopped too
    only = [c.strip() for c in args.only.split(",")] if args.only else None
    try:
        result = run_checks(
            cpu=args.cpu,
            workdir=args.workdir,
            only=only,
            budget_s=args.budget,
            layers=args.layers,
            backend=args.backend,
            rows=args.rollout_rows,
            echo=True,
        )
    except (ValueError, RuntimeError) as err:  # bad --only, no CUDA without --cpu
        print(f"gpu_check: error: {err}", file=sys.stderr)
        return 2
    print("\n" + format_table(result), flush=True)
    write_json(result, args.json)
    print(f"wrote {args.json}")
    return 0 if result["ok"] else 1
