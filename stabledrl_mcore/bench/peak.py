"""The peak that MFU divides by: a GPU's dense bf16 rating, or a CPU's measured bf16 matmul rate.

On GPU, MFU is taken against the vendor's *dense* (no sparsity) bf16 tensor-core
peak of the device (:data:`GPU_BF16_PEAK_TFLOPS`, matched on
``torch.cuda.get_device_name()``). On CPU there is no rating to trust, so the
peak is *measured* in the same run, with the same number of threads: square
bf16 matrix multiplies of a few sizes, each timed several times, best rate
kept (``2 n^3`` FLOPs per ``n x n`` product). The benchmark measures before and
after its phases and keeps the best (another job on the machine can only lower a
rate). The fp32 rate is measured the same way and reported beside it, since a CPU
without bf16 units (no AVX512-BF16/AMX) runs bf16 matmuls slower than fp32 ones.
"""

from __future__ import annotations

import time
from typing import Dict, Optional, Sequence

import torch

# Dense bf16 tensor-core peaks (TFLOP/s, no 2:4 sparsity), from the vendors' data sheets.
# Longer names first: the first substring match wins.
GPU_BF16_PEAK_TFLOPS = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),   # SXM
    ("H800", 989.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A6000", 155.0),
    ("A10", 125.0),
    ("L4", 121.0),
)


def gpu_peak_flops(name: str) -> Optional[float]:
    """Dense bf16 peak (FLOP/s) of a GPU by its ``torch.cuda.get_device_name()``; None if unknown."""
    upper = name.upper()
    for key, tflops in GPU_BF16_PEAK_TFLOPS:
        if key.upper() in upper:
            return tflops * 1e12
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_flops(dtype: torch.dtype = torch.bfloat16, *, device: Optional[torch.device] = None,
                         sizes: Optional[Sequence[int]] = None, repeats: int = 3,
                         min_seconds: float = 0.05) -> Dict[str, float]:
    """Best measured ``n x n @ n x n`` rate: ``{"flops": FLOP/s, "size": n, "seconds": t}``.

    Each size is warmed up once, then timed ``repeats`` times (a timing repeats the
    product until ``min_seconds`` have passed, so tiny products are not timer noise).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if sizes is None:
        sizes = (4096, 8192) if device.type == "cuda" else (256, 512, 1024, 1536)
    best = {"flops": 0.0, "size": 0, "seconds": 0.0}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        torch.mm(a, b)
        _sync(device)
        for _ in range(max(1, repeats)):
            count, start = 0, time.perf_counter()
            while True:
                torch.mm(a, b)
                count += 1
                _sync(device)
                elapsed = time.perf_counter() - start
                if elapsed >= min_seconds:
                    break
            rate = 2.0 * n ** 3 * count / elapsed
            if rate > best["flops"]:
                best = {"flops": rate, "size": n, "seconds": elapsed / count}
        del a, b
    return best


def device_peak(*, measure_fp32: bool = True, override_tflops: Optional[float] = None,
                previous: Optional[Dict[str, object]] = None) -> Dict[str, object]:
    """The peak MFU is taken against, and how it was obtained.

    Returns ``{"device", "kind": "rated"|"measured"|"given", "peak_flops", "bf16_matmul_flops",
    "fp32_matmul_flops", "threads", "measurements"}``; ``peak_flops`` is the rated bf16 peak on a
    known GPU, ``override_tflops`` when given, else the measured bf16 matmul rate. ``previous``
    (an earlier result of this run, e.g. from before the benchmark) is merged in: the best
    rates of all measurements are kept, since a neighbour's load can only lower a measurement.
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name() if cuda else _cpu_name()
    bf16 = measure_matmul_flops(torch.bfloat16, device=device)
    fp32 = measure_matmul_flops(torch.float32, device=device) if measure_fp32 else None
    rated = gpu_peak_flops(name) if cuda else None
    if override_tflops:
        kind, peak = "given", float(override_tflops) * 1e12
    elif rated:
        kind, peak = "rated", rated
    else:
        kind, peak = "measured", bf16["flops"]
    runs = list((previous or {}).get("measurements", [])) + [
        {"bf16": bf16["flops"], "bf16_size": bf16["size"], "fp32": fp32["flops"] if fp32 else None,
         "time": time.strftime("%H:%M:%S")}]
    best = max(runs, key=lambda r: r["bf16"])
    best16 = best["bf16"]
    best32 = max((r["fp32"] for r in runs if r["fp32"]), default=None)
    if kind == "measured":
        peak = best16
    return {"device": name, "kind": kind, "peak_flops": peak, "bf16_matmul_flops": best16,
            "bf16_matmul_size": best.get("bf16_size"), "fp32_matmul_flops": best32,
            "threads": torch.get_num_threads(), "measurements": runs}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return "CPU: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return "CPU: " + (platform.processor() or platform.machine())
