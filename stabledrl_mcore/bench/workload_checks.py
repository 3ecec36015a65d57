"""The device checks of whole workloads (:mod:`.device_check` lists them): bf16 training steps
with a checkpoint and a bitwise resume, and the recipes' training step (``stabledrl bench``) as
configured, with its MFU, at the 8B width and as many layers as fit one GPU."""

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
    GPU,
    MFU_TARGET,
    RECIPES,
    ROOT,
    TINY_CONFIG,
    Sizes,
)
from stabledrl_mcore.bench.peak import describe
from stabledrl_mcore.bench.plan import PlanSpec, estimate
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.models import get_preset
from stabledrl_mcore.models.specs import te_unavailable_reason
from stabledrl_mcore.parallel.launch import spawn
from stabledrl_mcore.rl.trainer import train
from stabledrl_mcore.tasks.base import Task

EIGHT_B = {"llada": "llada-8b", "sdar": "sdar-8b"}
PROMPT = 256
"""Prompt tokens the layer count is planned for (the rollout check's prompt)."""


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


def layers_that_fit(arch: str, gpu_memory_gib: float, overrides: List[str], te: bool) -> Dict[str, Any]:
    """The most layers of the 8B preset whose recipe training step fits one GPU of ``gpu_memory_gib``,
    by ``stabledrl plan``'s memory model (:mod:`.plan`: weights, fp32 gradients, Adam states, the
    recipe's micro-batch and recompute, the LM head, the rollout's KV cache), at TP = PP = 1."""
    cfg = load_config(RECIPES[arch], overrides)
    r, a = cfg.rollout, cfg.algo
    full = get_preset(EIGHT_B[arch])
    for layers in range(full.num_layers, 0, -1):
        spec = PlanSpec(
            model=get_preset(EIGHT_B[arch], num_layers=layers),
            gpus_per_node=1,
            gpu_memory_gib=gpu_memory_gib,
            micro_batch=cfg.parallel.micro_batch_size,
            group_size=r.group_size,
            seq_len=PROMPT + r.gen_length,
            gen_length=r.gen_length,
            global_batch=r.prompts_per_step * r.group_size,
            recompute="full" if cfg.model.recompute else "none",
            dtype=cfg.model.dtype,
            distributed_optimizer=cfg.optim.distributed,
            likelihood="staircase" if a.likelihood == "staircase" else "elbo",
            impl="te" if te else "local",
            num_mc=a.num_mc,
            inner_iterations=a.inner_iterations,
            rollout_cache=r.cache if arch == "llada" else "none",
        ).validate()
        est = estimate(spec)
        if est["fits"]:
            return {
                "layers": layers,
                "of": full.num_layers,
                "planned_gib": est["total"] / 2**30,
                "memory_gib": gpu_memory_gib,
            }
    return {"layers": 0, "of": full.num_layers, "planned_gib": None, "memory_gib": gpu_memory_gib}


def check_recipe_step(arch: str, sizes: Sizes, workdir: str, cpu: bool) -> Dict[str, Any]:
    """``stabledrl bench --phases train`` on the recipe as configured (its micro-batch, recompute and
    dtype; TP 1 on one device) at full width and as many layers as fit one GPU (:func:`layers_that_fit`;
    on CPU the tiny preset at :attr:`~.check_sizes.Sizes.bench_layers` layers, and the count an H200 would
    hold reported beside it). MFU against the rated peak the bench takes, and against the matmul rate
    it measured in the same run (:mod:`.peak`). The bench's process is in the part's process group:
    the part's time limit (:mod:`.check_parts`) bounds it."""
    te = torch.cuda.is_available() and te_unavailable_reason() is None
    workload = [*sizes.bench_overrides["all"], *sizes.bench_overrides[arch]]
    memory = sizes.gpu_memory_gib or torch.cuda.mem_get_info()[1] / 2**30
    fit = layers_that_fit(arch, memory, [*GPU.bench_overrides["all"], *GPU.bench_overrides[arch]], te)
    layers = sizes.bench_layers or fit["layers"]
    if layers < 1:
        raise RuntimeError(f"not one layer of {EIGHT_B[arch]} fits {memory:.0f} GiB with the recipe's training state")
    preset = sizes.presets[arch]
    run_dir = os.path.join(workdir, f"recipe_step_{arch}")
    result = os.path.join(workdir, f"recipe_step_{arch}.json")
    cmd = [
        sys.executable,
        "-m",
        "stabledrl_mcore.cli",
        "bench",
        "--config",
        RECIPES[arch],
        f"model.preset={preset}",
        "model.checkpoint=null",
        f"model.overrides.num_layers={layers}",
        "parallel.tensor_parallel=1",
        f"logging.run_dir={run_dir}",
        *workload,
        "--phases",
        "train",
        "--no-baseline",
        "--warmup",
        "0" if cpu else "1",  # on CPU the step is checked, not timed: one step keeps CI short
        "--repeats",
        "1" if cpu else "3",
        "--json",
        result,
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"stabledrl bench exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    with open(result) as handle:
        bench = json.load(handle)
    mfu, train, peak = bench.get("mfu"), bench["phases"]["train"], bench["peak"]
    measured = (
        peak.get("bf16_matmul_flops") if peak.get("model_dtype", "bf16") == "bf16" else peak.get("fp32_matmul_flops")
    )
    flops = train["model_flops_per_s"]
    config = bench.get("config", {})
    out = {
        "layers": layers,
        "layers_fit": fit,
        "micro_batch": config.get("parallel", {}).get("micro_batch_size"),
        "recompute": config.get("model", {}).get("recompute"),
        "dtype": config.get("model", {}).get("dtype"),
        "mfu": mfu,
        "mfu_vs_measured": flops / measured if flops and measured else None,
        "peak": peak["kind"],
        "peak_dtype": peak.get("dtype"),
        "peak_flops": bench["matmul_peak_flops"],
        "measured_matmul_flops": measured,
        "train_tokens_per_s": train["tokens_per_s"],
        "model_flops_per_s": flops,
        "params": bench["model"]["params"],
        "workload": bench["workload"],
    }
    met = mfu is not None and mfu >= MFU_TARGET
    where = f"{layers} of {fit['of']} layers" + (
        f" (a {fit['memory_gib']:.0f} GiB GPU holds {fit['layers']})" if cpu else " (as many as fit)"
    )
    out.update(
        status="ok",
        value=f"{where}, micro-batch {out['micro_batch']}, recompute {out['recompute']}, {out['dtype']}: "
        f"MFU {100 * (mfu or 0):.1f}% of the {describe(peak)} peak, "
        f"{100 * (out['mfu_vs_measured'] or 0):.1f}% of the measured matmul rate"
        + ("" if cpu else (" (target met)" if met else f" (below the {100 * MFU_TARGET:.0f}% target)")),
        target_met=None if cpu else met,
    )
    return out
