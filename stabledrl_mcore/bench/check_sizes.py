"""Shapes, tolerances and small helpers of the device checks (:mod:`.device_check`): the GPU
mode runs the 8B widths, the CPU mode (``--cpu``, CI) the tiny presets."""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional

import torch

from stabledrl_mcore.models import default_device, get_preset

BF16_REL_TOL = 3e-2
"""Logit agreement of two bf16 kernels: max abs difference over max abs logit."""
GRAD_REL_TOL = 5e-2
"""Gradient agreement of two bf16 kernels: relative L2 difference of one weight's gradient."""
MOE_ROUTED_ALIKE_MIN = 0.5
"""Share of the tokens two bf16 MoE specs must route to the same experts in every layer (the
others, near-ties of two experts' scores, are left out of the logit and gradient comparison)."""
MFU_TARGET = 0.45
"""Model-FLOP utilisation the bench should reach on 8B-shaped layers (of the rated bf16 peak)."""

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = {
    "llada": os.path.join(ROOT, "examples", "configs", "llada_8b_stabledrl.yaml"),
    "sdar": os.path.join(ROOT, "examples", "configs", "sdar_8b_stabledrl.yaml"),
}
TINY_CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")


@dataclasses.dataclass
class RolloutSizes:
    """The rollout parts' shapes (:mod:`.rollout_checks`): GPU, the 8B models at the recipes' rollout;
    CPU, the 8B layer counts at the tiny width, shorter."""

    prompt: int
    gen: int
    rows: Optional[int]  # rows per decoding forward; None: the recipe's
    width: Optional[int]  # None: the 8B presets' own width; else the tiny presets (this width)
    dtype: str  # "bf16" | "fp32"
    backend: str  # torch.compile backend of the captured step


@dataclasses.dataclass
class Sizes:
    """Shapes of one mode (GPU: the 8B widths; CPU: tiny)."""

    presets: Dict[str, str]
    layers: int
    seq: int  # tokens of the TE / flex comparisons
    staircase_n: int  # noisy-half length of the memory check (2n tokens)
    moe_preset: str  # the MoE layer check's preset, at ``layers`` layers
    moe_batch: int  # rows of ``seq`` tokens the MoE layer check routes and times
    moe_repeats: int  # timed forward + backward passes of one MoE layer
    bench_layers: Optional[int]  # the recipe step's layers; None: as many as fit the GPU (workload_checks)
    bench_overrides: Dict[str, List[str]]  # per arch, and "all"
    timeout_s: int
    rollout: RolloutSizes
    gpu_memory_gib: Optional[float] = None  # the recipe step's layer count is planned for this (None: measured)


MATH500 = os.path.join(ROOT, "tests", "fixtures", "math500_test.jsonl")  # the SDAR recipe's task is file-backed
GPU = Sizes(
    presets={"llada": "llada-8b", "sdar": "sdar-8b"},
    layers=2,
    seq=1024,
    staircase_n=4096,
    moe_preset="sdar-30b-a3b",
    moe_batch=4,
    moe_repeats=5,
    bench_layers=None,
    timeout_s=300,
    rollout=RolloutSizes(prompt=256, gen=256, rows=None, width=None, dtype="bf16", backend="inductor"),
    bench_overrides={  # the recipe's micro-batch, recompute and dtype stay; the rollout only makes the batch
        "llada": ["rollout.gen_length=256", "rollout.steps=8", "rollout.block_length=32"],
        "sdar": ["rollout.gen_length=256", "rollout.steps=1", f"rollout.data_path={MATH500}"],
        "all": ["rollout.prompts_per_step=1", "rollout.group_size=16"],
    },
)
CPU = Sizes(
    presets={"llada": "llada-tiny", "sdar": "sdar-tiny"},
    layers=2,
    seq=64,
    staircase_n=128,
    moe_preset="sdar-moe-tiny",
    moe_batch=2,
    moe_repeats=2,
    bench_layers=2,
    timeout_s=300,
    rollout=RolloutSizes(prompt=64, gen=64, rows=4, width=64, dtype="fp32", backend="eager"),
    gpu_memory_gib=139.0,  # the H200 we may be lent: the layer count printed beside the CPU's run
    bench_overrides={
        "llada": ["rollout.steps=2", "rollout.block_length=8"],
        "sdar": ["rollout.steps=1", f"rollout.data_path={MATH500}"],
        "all": [
            "rollout.prompts_per_step=1",
            "rollout.group_size=4",
            "rollout.gen_length=16",
            "parallel.threads=1",
        ],
    },
)


def check_device() -> torch.device:

    return default_device()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def shaped_preset(preset: str, layers: int):

    return get_preset(preset, num_layers=layers, init_std=0.02)


def left_padded_ids(cfg, batch: int, length: int, generator: torch.Generator, device):
    """Random ids ``[batch, length]`` and per-row left-pad counts (row 0 unpadded)."""
    ids = torch.randint(3, cfg.vocab_size - 2, (batch, length), generator=generator, device="cpu")
    pads = [0] + [length // (4 * (r + 1)) for r in range(1, batch)]
    for row, pad in enumerate(pads):
        ids[row, :pad] = cfg.pad_token_id
    return ids.to(device), pads
