"""``tools/gpu_check.py``: the 8B recipes' device code path, checked on one accelerator.

Six checks, each ``ok``, ``FAIL`` or ``skipped`` (with the reason), printed as
one table and written as one JSON:

1. ``te_vs_local``: Transformer Engine spec vs local spec logits with the same
   weights (copied through a Megatron checkpoint: both specs share its keys), bf16,
   LLaDA- and SDAR-8B-shaped layers (full width, 2 layers), and the TE model's checkpoint
   back into a local one (bit for bit). Tolerance: max ``|dlogit|`` <= :data:`BF16_REL_TOL`
   x max ``|logit|``.
2. ``flex_vs_sdpa``: flex attention vs SDPA with the dense mask, staircase and
   block-causal layouts with left padding, SDAR-8B-shaped layers (GQA): logits
   (same tolerance) and one weight gradient (relative L2 <= :data:`GRAD_REL_TOL`).
3. ``staircase_memory``: peak memory of one staircase likelihood forward +
   backward over ``[x_t | x_0]`` of 8k tokens, flex vs dense SDPA.
4. ``moe_layer``: the mixture-of-experts layer at the MoE preset's width (SDAR-30B-A3B:
   hidden 2048, 128 experts of width 768, top-8; 2 layers, bf16). With TE: the TE spec's
   grouped-GEMM experts vs the local spec's ``SequentialMLP``, same weights through a checkpoint
   and back (as ``te_vs_local``): logits (same tolerance) and the routers' gradients (relative
   L2 <= :data:`GRAD_REL_TOL`) over the tokens both route alike (at least
   :data:`MOE_ROUTED_ALIKE_MIN` of them; near-ties may fall either way in bf16). Without TE the
   local spec alone (against Megatron's stock local layer, whose experts are the same), reported
   ``ok`` with the grouped GEMM marked not compared. Everywhere: every expert of every layer
   gets tokens of the check's batch (tokens per expert, min-max), every gradient is finite,
   and one MoE layer's forward + backward is timed (ms, tokens/s).
5. ``train_llada`` / ``train_sdar``: three StableDRL steps of the tiny presets in
   bf16 with Megatron's distributed optimizer and activation recompute, a
   checkpoint after steps 2 and 3, and a second run resumed from step 2 whose
   step 3 is compared with the first (bit for bit on CPU; reported on GPU, where
   kernels need not be deterministic).
6. ``bench_llada`` / ``bench_sdar``: ``stabledrl bench`` (train phase) on
   8B-shaped layers (full width, 4 layers, the recipe's likelihood, bf16), MFU against
   the device's rated dense bf16 peak (on CPU: the measured matmul rate of the model's
   dtype, see :mod:`.peak`); target :data:`MFU_TARGET`.

The checks live in :mod:`.kernel_checks` (1-4) and :mod:`.workload_checks` (5-6), their shapes
and tolerances in :mod:`.check_sizes`. ``cpu=True`` (``--cpu``) runs the same checks shrunk (tiny presets, short
sequences, eager flex attention) on the CPU; CI runs that mode. Each check is
isolated: one that raises is reported as ``FAIL`` with its error, the others
still run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

from stabledrl_mcore.bench.check_sizes import CPU, GPU
from stabledrl_mcore.bench.kernel_checks import (
    check_flex_vs_sdpa,
    check_moe_layer,
    check_staircase_memory,
    check_te_vs_local,
)
from stabledrl_mcore.bench.peak import _cpu_name
from stabledrl_mcore.bench.report import write_json
from stabledrl_mcore.bench.workload_checks import check_bench, check_train
from stabledrl_mcore.parallel import bootstrap


def run_checks(*, cpu: bool, workdir: Optional[str] = None, only: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run every check (or ``only`` those); returns the JSON-ready result."""

    if not cpu and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: run with --cpu for the CPU variant")
    sizes = CPU if cpu else GPU
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="stabledrl-gpu-check-")
    checks: Dict[str, Callable[[], Dict[str, Any]]] = {
        "te_vs_local": lambda: check_te_vs_local(sizes),
        "flex_vs_sdpa": lambda: check_flex_vs_sdpa(sizes, cpu),
        "staircase_memory": lambda: check_staircase_memory(sizes, cpu),
        "moe_layer": lambda: check_moe_layer(sizes, cpu),
        "train_llada": lambda: check_train("llada", sizes, workdir, cpu),
        "train_sdar": lambda: check_train("sdar", sizes, workdir, cpu),
        "bench_llada": lambda: check_bench("llada", sizes, workdir, cpu),
        "bench_sdar": lambda: check_bench("sdar", sizes, workdir, cpu),
    }
    unknown = sorted(set(only or ()) - set(checks))
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(checks)}")
    results: Dict[str, Any] = {}
    torch.manual_seed(0)
    bootstrap.initialize(1, 1, seed=0)
    try:
        for name, fn in checks.items():
            if only and name not in only:
                continue
            start = time.perf_counter()
            try:
                results[name] = fn()
            except Exception as err:  # noqa: BLE001 - one broken check must not hide the others
                results[name] = {
                    "status": "FAIL",
                    "value": f"{type(err).__name__}: {str(err).splitlines()[0]}" if str(err) else type(err).__name__,
                    "traceback": traceback.format_exc()[-4000:],
                }
            results[name]["seconds"] = round(time.perf_counter() - start, 1)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        bootstrap.destroy()
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    return {
        "mode": "cpu" if cpu else "gpu",
        "device": _device_name(),
        "torch": torch.__version__,
        "transformer_engine": _te_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "ok": all(r["status"] != "FAIL" for r in results.values()),
        "checks": results,
    }


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()

    return _cpu_name()


def _te_version() -> Optional[str]:
    try:
        import transformer_engine

        return getattr(transformer_engine, "__version__", "unknown")
    except ImportError:
        return None


def format_table(result: Dict[str, Any]) -> str:
    """One row per check: name, status, seconds, headline figure."""
    rows = [
        f"device check ({result['mode']}) on {result['device']}, torch {result['torch']}, "
        f"TE {result['transformer_engine'] or 'not installed'}",
        "",
    ]
    header = f"{'check':<18}{'status':<9}{'s':>7}  result"
    rows += [header, "-" * 100]
    for name, r in result["checks"].items():
        value = r.get("value") or r.get("detail") or ""
        rows.append(f"{name:<18}{r['status']:<9}{r.get('seconds', 0):>7.1f}  {value}")
    rows += ["", "all checks passed" if result["ok"] else "SOME CHECKS FAILED"]
    return "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> int:

    parser = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the shrunk CPU variant (what CI runs)")
    parser.add_argument("--json", metavar="PATH", default="gpu_check.json", help="result file (default %(default)s)")
    parser.add_argument("--only", metavar="LIST", help="comma-separated subset of the checks")
    parser.add_argument("--workdir", metavar="DIR", help="keep the runs' files here (default: a temporary dir)")
    args = parser.parse_args(argv)
    only = [c.strip() for c in args.only.split(",")] if args.only else None
    try:
        result = run_checks(cpu=args.cpu, workdir=args.workdir, only=only)
    except (ValueError, RuntimeError) as err:  # bad --only, no CUDA without --cpu
        print(f"gpu_check: error: {err}", file=sys.stderr)
        return 2
    print(format_table(result), flush=True)

    write_json(result, args.json)
    print(f"wrote {args.json}")
    return 0 if result["ok"] else 1
