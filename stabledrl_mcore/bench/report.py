"""Console table and JSON file of a benchmark result (see ``run.py`` for the fields)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, Optional

from stabledrl_mcore.bench.modes import format_modes
from stabledrl_mcore.bench.peak import describe


def _num(value: Optional[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    if value is None:
        return "-"
    return fmt.format(value / scale)


def _millions(count: float) -> str:
    return f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count / 1e6:.3f}M"


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _rate(flops: Optional[float]) -> str:
    if not flops:
        return "-"
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if flops >= scale:
            return f"{flops / scale:.1f} {unit}"
    return f"{flops:.0f} FLOP/s"


def _is_measured_fp32(peak: Dict[str, Any]) -> bool:
    return peak.get("kind") == "measured" and peak.get("dtype") in ("fp32", "tf32")


def peak_label(peak: Dict[str, Any]) -> str:
    """Which peak MFU divides by, e.g. ``measured fp32 matmul rate, fp32 model`` or
    ``rated dense bf16, bf16 model`` (see :mod:`.peak`)."""
    kind, dtype = peak.get("kind"), peak.get("dtype", "bf16")
    text = {"given": "given by --peak-tflops", "rated": f"rated dense {dtype}"}.get(kind, f"{kind} {dtype} matmul rate")
    return text + (f", {peak['model_dtype']} model" if peak.get("model_dtype") else "")


def format_table(result: Dict[str, Any]) -> str:
    """The human-readable summary printed by ``stabledrl bench``."""
    m, lay, w, peak = result["model"], result["layout"], result["workload"], result["peak"]
    lines = [
        f"model {m['name']} ({_millions(m['params'])} params"
        + (
            f", {_millions(m['active_params'])} active: {m['num_experts']} experts, top-{m['moe_router_topk']}"
            if m.get("num_experts")
            else ""
        )
        + f", {m['dtype']}) on {peak['device']}, "
        f"{lay['threads']} thread(s)/rank, world {lay['world_size']} (TP {lay['tp']}, PP {lay['pp']}, "
        f"DP {lay['dp']})",
        f"peak for MFU ({peak_label(peak)}): {_rate(result['matmul_peak_flops'])}   measured matmul: bf16 "
        f"{_rate(peak['bf16_matmul_flops'])}, {peak.get('fp32_matmul_dtype', 'fp32')} "
        f"{_rate(peak.get('fp32_matmul_flops'))}",
        f"workload per rank: {w['sequences']} sequences x {w['seq_len']} tokens (prompt {w['prompt_len']}, "
        f"generated {w['generated']}), num_mc {w['num_mc']}, inner iterations {w['inner_iterations']}, "
        f"micro-batch {w['micro_batch']}; {result['warmup']} warm-up + {result['repeats']} repetitions",
        "",
    ]
    base = (result.get("baseline") or {}).get("phases", {})
    speed = result.get("speedup_vs_baseline") or {}
    speed_cpu = result.get("speedup_vs_baseline_cpu_time") or {}
    header = f"{'phase':<21}{'median s':>10}{'IQR s':>9}{'CPU s':>8}{'tokens/s':>11}{'model FLOP/s':>16}{'MFU':>8}" + (
        f"{'baseline s':>12}{'base tok/s':>12}{'speedup':>9}{'(CPU)':>8}" if base else ""
    )
    lines += [header, "-" * len(header)]
    for name, ph in result["phases"].items():
        row = (
            f"{name:<21}{ph['median_s']:>10.3f}{ph['iqr_s']:>9.3f}"
            f"{_num(ph.get('cpu_median_s'), fmt='{:.3f}'):>8}{_num(ph['tokens_per_s']):>11}"
            f"{_rate(ph['model_flops_per_s']):>16}{_pct(ph.get('mfu')):>8}"
        )
        if base:
            b = base.get(name)
            row += (
                f"{_num(b and b['median_s'], fmt='{:.3f}'):>12}{_num(b and b['tokens_per_s']):>12}"
                f"{_num(speed.get(name), fmt='{:.2f}x'):>9}{_num(speed_cpu.get(name), fmt='{:.2f}x'):>8}"
            )
        lines.append(row)

    lines += format_modes(result)
    lines.append("")
    fp32 = (
        f"   (vs measured {peak.get('fp32_matmul_dtype', 'fp32')} matmul: {_pct(result['mfu_vs_fp32'])})"
        if result.get("mfu_vs_fp32") and not _is_measured_fp32(peak)
        else ""
    )
    if result.get("mfu_cpu_time") and result["layout"]["threads"] == 1:
        fp32 += f"   (from CPU time: {_pct(result['mfu_cpu_time'])})"
    what = "training forward+backward" if result.get("mfu_phase", "train") == "train" else "whole step"
    lines.append(f"MFU ({what} vs {describe(peak)} peak): {_pct(result['mfu'])}{fp32}")
    lines.append(
        f"whole step: {_num(result['step_tokens_per_s'])} tokens/s"
        + (
            f", {speed['step']:.2f}x the baseline (wall clock)"
            + (f", {speed_cpu['step']:.2f}x in CPU time" if speed_cpu.get("step") else "")
            if speed.get("step")
            else ""
        )
    )
    bubbles = [
        f"{name} {_pct(ph['pipeline_bubble_fraction'])}"
        for name, ph in result["phases"].items()
        if ph.get("pipeline_bubble_fraction") is not None
    ]
    if bubbles:
        lines.append(
            "pipeline bubble (share of a stage's forward-only pipeline time not in its own forwards): "
            + ", ".join(bubbles)
        )
    load = result.get("load_average") or {}
    if load.get("before"):
        lines.append(
            f"load average (1, 5, 15 min) before {load['before']}, after {load.get('after')} on {os.cpu_count()} CPUs"
        )
    scaling = result.get("scaling")
    if scaling:
        eff = ", ".join(f"{k} {v * 100:.0f}%" for k, v in scaling["efficiency"].items() if v is not None)
        cpu = ", ".join(
            f"{k} {v * 100:.0f}%" for k, v in scaling.get("efficiency_cpu_time", {}).items() if v is not None
        )
        lines.append(
            f"weak scaling 1 -> {scaling['ranks'][-1]} data-parallel ranks ({scaling['backend']}, "
            f"{scaling['threads_per_rank']} thread(s)/rank): {eff}" + (f" (CPU time: {cpu})" if cpu else "")
        )
        if scaling.get("machine_ceiling"):
            ceil = scaling["machine_ceiling"]["ceiling"]
            rel = ", ".join(f"{k} {v * 100:.0f}%" for k, v in scaling["efficiency_vs_ceiling"].items() if v is not None)
            lines.append(
                f"machine ceiling (fp32 matmuls, 2 processes vs 1, no communication): "
                f"{ceil * 100:.0f}%; efficiency relative to it: {rel}"
            )
    return "\n".join(lines)


def write_json(result: Dict[str, Any], path: str) -> str:
    """Write ``result`` to ``path`` atomically (temp file + rename); returns the path."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".bench-", suffix=".json")
    with os.fdopen(fd, "w") as handle:
        json.dump(result, handle, indent=2, sort_keys=False, default=str)
        handle.write("\n")
    os.replace(tmp, path)
    return path
