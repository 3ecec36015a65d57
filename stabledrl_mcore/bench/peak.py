"""The peak that MFU divides by: the matmul rate of the dtype the model runs in.

- GPU, bf16 model: the vendor's *dense* (no sparsity) bf16 tensor-core rating of the
  device (:data:`GPU_BF16_PEAK_TFLOPS`, matched on ``torch.cuda.get_device_name()``);
  ``kind`` "rated". A GPU missing from the table falls back to the measured bf16 rate.
- GPU, fp32 model: the *measured* fp32 matmul rate in this process (``dtype`` "tf32" when
  ``torch.backends.cuda.matmul.allow_tf32`` lets fp32 products use tensor cores, else
  "fp32"); the bf16 rating would understate an fp32 model's MFU several times over. The
  rating is still reported (``rated_bf16_flops``).
- CPU: there is no rating to trust, so the peak is *measured* in the same run, with the
  same number of threads, in the model's dtype: a CPU without bf16 units (no AVX512-BF16
  or AMX) emulates bf16 products far below its fp32 rate, one with them can run bf16
  several times faster, so a peak of the other dtype would give an MFU that is off by
  that factor either way (an fp32 model read over 100% against an emulated bf16 peak).
- ``--peak-tflops`` (``override_tflops``): that figure, ``kind`` "given".

A measurement is square matrix multiplies of a few sizes, each timed several times, best
rate kept (``2 n^3`` FLOPs per ``n x n`` product). Both bf16 and fp32 are measured and
reported; the benchmark measures before and after its phases and keeps the best of each
(another job on the machine can only lower a rate).
"""

from __future__ import annotations

import platform
import time
from typing import Dict, Optional, Sequence, Union

import torch

# Dense bf16 tensor-core peaks (TFLOP/s, no 2:4 sparsity), from the vendors' data sheets.
# Longer names first: the first substring match wins.
GPU_BF16_PEAK_TFLOPS = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
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

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


def gpu_peak_flops(name: str) -> Optional[float]:
    """Dense bf16 peak (FLOP/s) of a GPU by its ``torch.cuda.get_device_name()``; None if unknown."""
    upper = name.upper()
    for key, tflops in GPU_BF16_PEAK_TFLOPS:
        if key.upper() in upper:
            return tflops * 1e12
    return None


def model_dtype_name(dtype: Union[str, torch.dtype]) -> str:
    """``"bf16"`` or ``"fp32"`` for a ``model.dtype`` string or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))
    if dtype not in _DTYPES:
        raise ValueError(f"no matmul peak for dtype {dtype!r}; expected bf16 or fp32")
    return "bf16" if _DTYPES[dtype] is torch.bfloat16 else "fp32"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_flops(
    dtype: torch.dtype = torch.bfloat16,
    *,
    device: Optional[torch.device] = None,
    sizes: Optional[Sequence[int]] = None,
    repeats: int = 3,
    min_seconds: float = 0.05,
) -> Dict[str, float]:
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
            rate = 2.0 * n**3 * count / elapsed
            if rate > best["flops"]:
                best = {"flops": rate, "size": n, "seconds": elapsed / count}
        del a, b
    return best


def _fp32_label(cuda: bool) -> str:
    """What an fp32 matmul runs as here: ``"tf32"`` on a GPU that allows TF32 products, else ``"fp32"``."""
    return "tf32" if cuda and torch.backends.cuda.matmul.allow_tf32 else "fp32"


def _best(runs, key):
    rates = [(r[key], r.get(key + "_size")) for r in runs if r.get(key)]
    return max(rates, default=(None, None))


def device_peak(
    dtype: Union[str, torch.dtype] = "bf16",
    *,
    override_tflops: Optional[float] = None,
    previous: Optional[Dict[str, object]] = None,
) -> Dict[str, object]:
    """The peak MFU is taken against for a model that runs in ``dtype``, and how it was obtained.

    Returns ``{"device", "kind": "rated"|"measured"|"given", "dtype", "model_dtype", "peak_flops",
    "bf16_matmul_flops", "fp32_matmul_flops", "rated_bf16_flops", "threads", "measurements"}``.
    ``peak_flops`` is (see the module docstring) the rated bf16 peak of a known GPU for a bf16
    model, ``override_tflops`` when given, else the measured matmul rate of ``dtype``; ``dtype``
    names the peak's own dtype ("bf16", "fp32" or "tf32"). ``previous`` (an earlier result of
    this run, e.g. from before the benchmark) is merged in: the best rate of each dtype over all
    measurements is kept, since a neighbour's load can only lower a measurement.
    """
    want = model_dtype_name(dtype)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name() if cuda else _cpu_name()
    bf16 = measure_matmul_flops(torch.bfloat16, device=device)
    fp32 = measure_matmul_flops(torch.float32, device=device)
    rated = gpu_peak_flops(name) if cuda else None
    runs = list((previous or {}).get("measurements", [])) + [
        {
            "bf16": bf16["flops"],
            "bf16_size": bf16["size"],
            "fp32": fp32["flops"],
            "fp32_size": fp32["size"],
            "time": time.strftime("%H:%M:%S"),
        }
    ]
    best16, size16 = _best(runs, "bf16")
    best32, size32 = _best(runs, "fp32")
    peak_dtype = want if want == "bf16" else _fp32_label(cuda)
    if override_tflops:
        kind, peak = "given", float(override_tflops) * 1e12
    elif want == "bf16" and rated:
        kind, peak = "rated", rated
    else:
        kind, peak = "measured", best16 if want == "bf16" else best32
    return {
        "device": name,
        "kind": kind,
        "dtype": peak_dtype,
        "model_dtype": want,
        "peak_flops": peak,
        "bf16_matmul_flops": best16,
        "bf16_matmul_size": size16,
        "fp32_matmul_flops": best32,
        "fp32_matmul_size": size32,
        "fp32_matmul_dtype": _fp32_label(cuda),
        "rated_bf16_flops": rated,
        "threads": torch.get_num_threads(),
        "measurements": runs,
    }


def describe(peak: Dict[str, object]) -> str:
    """``"measured fp32"``, ``"rated bf16"``, ``"given"``: which peak MFU divides by, in two words."""
    kind = peak.get("kind", "?")
    if kind == "given":
        return "given"
    return f"{kind} {peak.get('dtype', 'bf16')}"  # results written before peak.dtype existed: bf16


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return "CPU: " + line.split(":", 1)[1].strip()
    except OSError:
        pass

    return "CPU: " + (platform.processor() or platform.machine())
