"""Does a run config fit its ranks' memory? The preflight's check (issue #62, slice 3).

:func:`check_memory` estimates what one rank holds with ``stabledrl plan``'s model
(:func:`~stabledrl_mcore.bench.plan.estimate` of :func:`~stabledrl_mcore.bench.plan.spec_for_run`:
weights, gradients, optimizer states, and the larger of the update's activations and the rollout's
decoding batch) and refuses, in one line naming the fields that drive it, a config whose estimate
exceeds the memory of the device its ranks will use: a GPU's total memory (NVML or ``nvidia-smi``,
read without creating a CUDA context in this process), or on CPU the host's available memory
shared by the ranks of this host. The estimate is a lower bound (no prompt tokens, no overhead,
the fewest decoding rows), so a config it refuses cannot run; one it passes may still not fit.
Where the device's memory cannot be read (a GPU job checked on a login node without GPUs) nothing
is refused.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from typing import Optional, Tuple

import psutil
import torch

from stabledrl_mcore.bench.plan import estimate, spec_for_run
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.parallel.bootstrap import ParallelLayoutError, detect_launch_env

GIB = 1024**3


def _gpu_total_bytes() -> Optional[int]:
    """Total memory of GPU 0 (bytes) from NVML or ``nvidia-smi``; None if neither answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no pynvml, no driver: try nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        return int(float(out.strip().splitlines()[0]) * 2**20)  # MiB
    except Exception:  # noqa: BLE001 - a broken driver: the memory is unknown
        return None


LARGEST_GPU_GIB = 192
"""The most memory one GPU has today (B200: 192 GB), the bound where the ranks' device is unknown."""


def rank_memory(cfg, world_size: Optional[int]) -> Optional[Tuple[float, str, bool]]:
    """``(bytes one rank may use, where that number comes from, on GPU)``; None when unknown.

    ``parallel.backend=nccl`` (or ``auto`` where CUDA is visible): the GPU's total memory.
    ``gloo``: this host's available memory shared by its ranks. ``auto`` with no GPU visible (a login
    node checking a GPU recipe, or a CPU run): the ranks may run on GPUs elsewhere, so only what exceeds
    both this host's share and the largest GPU (:data:`LARGEST_GPU_GIB`) is refused."""
    backend = cfg.parallel.backend
    if backend == "nccl" or (backend == "auto" and torch.cuda.is_available()):
        total = _gpu_total_bytes()
        if total is None:
            return None
        return float(total), f"{total / GIB:.1f} GiB of GPU memory per rank", True
    local = detect_launch_env().local_world_size or world_size or 1
    available = psutil.virtual_memory().available
    share = f" / {local} ranks on this host" if local > 1 else ""
    source = f"{available / GIB:.1f} GiB of host memory available{share}"
    if backend == "gloo" or available / local >= LARGEST_GPU_GIB * GIB:
        return available / local, source, False
    return (
        float(LARGEST_GPU_GIB * GIB),
        f"at most {LARGEST_GPU_GIB} GiB on any GPU (parallel.backend=auto and no GPU is visible here: "
        f"set parallel.backend=gloo to check against {source})",
        False,
    )


def _drivers(cfg, est) -> str:
    """The fields behind the largest part of the estimate, with their values."""
    p, r = cfg.parallel, cfg.rollout
    state = est["weights"] + est["reference_weights"] + est["gradients"] + est["optimizer"]
    peaks = {
        "training": est["training_peak"],
        "rollout": est["rollout_peak"],
        "likelihood": est["likelihood_peak"],
    }
    part, peak = max(peaks.items(), key=lambda kv: kv[1])
    if state >= peak:
        model = (
            f"model.checkpoint={cfg.model.checkpoint}" if cfg.model.checkpoint else f"model.preset={cfg.model.preset}"
        )
        return (
            f"the weights, gradients and optimizer states ({state / GIB:.1f} GiB) of {model} with "
            f"parallel.tensor_parallel={p.tensor_parallel}, parallel.pipeline_parallel={p.pipeline_parallel}"
        )
    if part == "training":
        return (
            f"the update's activations ({peak / GIB:.1f} GiB) of parallel.micro_batch_size={p.micro_batch_size} "
            f"x rollout.gen_length={r.gen_length} tokens (+ the prompt)"
        )
    if part == "rollout":
        rows = (
            f"rollout.decode_rows={r.decode_rows}"
            if r.decode_rows
            else f"lcm(parallel.micro_batch_size={p.micro_batch_size}, rollout.group_size={r.group_size})"
        )
        return (
            f"the rollout's decoding batch ({peak / GIB:.1f} GiB): {rows} rows per decoding forward "
            f"(whole groups) x rollout.gen_length={r.gen_length}"
        )
    return (
        f"the old-policy log-probs ({peak / GIB:.1f} GiB) of rollout.prompts_per_step={r.prompts_per_step} "
        f"x rollout.group_size={r.group_size} x rollout.gen_length={r.gen_length}"
    )


def check_memory(cfg, mcfg, world_size: Optional[int]) -> Optional[dict]:
    """Refuse ``cfg`` (a :class:`ConfigError`, one line) when ``stabledrl plan``'s estimate of one rank
    exceeds the memory of the device its ranks use; the estimate (or None: memory unknown, or a
    layout the planner cannot model, checked elsewhere)."""
    memory = rank_memory(cfg, world_size)
    if memory is None:
        return None
    capacity, source, gpu = memory
    p = cfg.parallel
    etp = p.expert_tensor_parallel or p.tensor_parallel
    smallest = p.pipeline_parallel * _lcm(p.tensor_parallel, etp * p.expert_parallel)
    try:
        spec = spec_for_run(
            cfg, mcfg, world_size or smallest, gpu_memory_gib=capacity / GIB, impl="te" if gpu else "local"
        )
        est = estimate(spec)
    except (ConfigError, ParallelLayoutError, ValueError):
        return None
    if est["total"] > capacity:
        raise ConfigError(
            f"memory: one rank needs at least {est['total'] / GIB:.1f} GiB (stabledrl plan's estimate, "
            f"driven by {_drivers(cfg, est)}) but has {source}; lower those settings (docs/troubleshooting.md)"
        )
    return est


def _lcm(a: int, b: int) -> int:
    return math.lcm(max(a, 1), max(b, 1))
