"""The device checks of whole workloads (:mod:`.device_check` lists them): bf16 training steps
with a checkpoint and a bitwise resume, and ``stabledrl bench``'s MFU on 8B-shaped layers."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from typing import Any, Dict, List

import torch

from stabledrl_mcore.bench.check_sizes import (
    MFU_TARGET,
    RECIPES,
    ROOT,
    TINY_CONFIG,
    Sizes,
)
from stabledrl_mcore.bench.peak import describe
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.parallel.launch import spawn
from stabledrl_mcore.rl.trainer import train
from stabledrl_mcore.tasks.base import Task


def probe_reward(task, completion: str, reference) -> float:
    """A dense, deterministic reward of the completion text. A random tiny model earns the same
    task reward for every completion (zero advantages, so no backward would run); this varies."""
    return (sum(map(ord, completion)) % 11) / 10.0


def _train_rank(config: str, overrides: List[str], out_json: str) -> None:
    """One rank of the training check (module level: ``parallel.launch.spawn`` starts it)."""

    Task.reward = probe_reward
    setup = train(load_config(config, overrides))
    digest = hashlib.sha256()
    for name, tensor in sorted(setup.model.state_dict().items()):
        if isinstance(tensor, torch.Tensor):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
    if torch.distributed.get_rank() == 0:
        with open(out_json, "w") as handle:
            json.dump({"weights_sha256": digest.hexdigest()}, handle)


def _metrics(run_dir: str) -> List[Dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle]
    return [{k: v for k, v in r.items() if not k.startswith(("time", "tokens_per_s", "step_s"))} for r in rows]


def check_train(arch: str, sizes: Sizes, workdir: str, cpu: bool) -> Dict[str, Any]:

    preset = "llada-tiny" if arch == "llada" else "sdar-tiny"
    extra = [
        f"model.preset={preset}",
        "model.dtype=bf16",
        "model.recompute=true",
        "optim.distributed=true",
        "steps=3",
        "checkpoint.save_every=2",
        "logging.wandb_mode=disabled",
        "logging.progress=false",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.gen_length=8",
        "parallel.micro_batch_size=4",
        "eval.every=0",
    ]
    extra += (
        ["rollout.steps=4", "rollout.block_length=8"]
        if arch == "llada"
        else [
            "rollout.steps=4",
            "rollout.block_length=4",
            "rollout.threshold=0.9",
            "algo.likelihood=staircase",
            "algo.num_mc=1",
        ]
    )
    first, resumed = os.path.join(workdir, f"train_{arch}"), os.path.join(workdir, f"train_{arch}_resumed")
    runs = {}
    for run_dir in (first, resumed):
        if run_dir == resumed:
            os.makedirs(os.path.join(resumed, "checkpoints"))
            shutil.copytree(
                os.path.join(first, "checkpoints", "step_00000002"),
                os.path.join(resumed, "checkpoints", "step_00000002"),
            )
        over = extra + [f"logging.run_dir={run_dir}"] + (["checkpoint.resume=auto"] if run_dir == resumed else [])
        out_json = os.path.join(run_dir + ".json")
        spawn(_train_rank, 1, (TINY_CONFIG, over, out_json), timeout=sizes.timeout_s)
        with open(out_json) as handle:
            runs[run_dir] = json.load(handle)
    rows, again = _metrics(first), _metrics(resumed)
    trained = all(r.get("grad_norm", 0) > 0 and r.get("skipped_updates", 1) == 0 for r in rows)
    same = again[-1] == rows[-1] and runs[first] == runs[resumed]
    out = {
        "steps": [r["step"] for r in rows],
        "resumed_steps": [r["step"] for r in again],
        "grad_norm": [r.get("grad_norm") for r in rows],
        "resume_bitwise": same,
    }
    ok = trained and out["steps"] == [1, 2, 3] and out["resumed_steps"] == [3] and (same or not cpu)
    out.update(
        status="ok" if ok else "FAIL",
        value=f"3 steps, grad norms {', '.join(f'{g:.2g}' for g in out['grad_norm'])}; resume "
        + ("bitwise" if same else "differs"),
    )
    return out


def check_bench(arch: str, sizes: Sizes, workdir: str, cpu: bool) -> Dict[str, Any]:

    preset = sizes.presets[arch]
    run_dir = os.path.join(workdir, f"bench_{arch}")
    result = os.path.join(workdir, f"bench_{arch}.json")
    cmd = [
        sys.executable,
        "-m",
        "stabledrl_mcore.cli",
        "bench",
        "--config",
        RECIPES[arch],
        f"model.preset={preset}",
        "model.checkpoint=null",
        f"model.overrides.num_layers={sizes.bench_layers}",
        "parallel.tensor_parallel=1",
        f"logging.run_dir={run_dir}",
        *sizes.bench_overrides["all"],
        *sizes.bench_overrides[arch],
        "--phases",
        "train",
        "--no-baseline",
        "--warmup",
        "1",
        "--repeats",
        "3",
        "--json",
        result,
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=sizes.timeout_s,
        env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"stabledrl bench exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    with open(result) as handle:
        bench = json.load(handle)
    mfu, train = bench.get("mfu"), bench["phases"]["train"]
    out = {
        "mfu": mfu,
        "peak": bench["peak"]["kind"],
        "peak_dtype": bench["peak"].get("dtype"),
        "peak_flops": bench["matmul_peak_flops"],
        "train_tokens_per_s": train["tokens_per_s"],
        "model_flops_per_s": train["model_flops_per_s"],
        "params": bench["model"]["params"],
        "workload": bench["workload"],
    }
    met = mfu is not None and mfu >= MFU_TARGET
    out.update(
        status="ok",
        value=f"MFU {100 * (mfu or 0):.1f}% of the {describe(bench['peak'])} peak"
        + ("" if cpu else (" (target met)" if met else f" (below the {100 * MFU_TARGET:.0f}% target)")),
        target_met=None if cpu else met,
    )
    return out
