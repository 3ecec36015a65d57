"""Measured peak memory of a real training step on CPU (to check ``stabledrl plan``'s estimates).

``python -m stabledrl_mcore.bench.memory --config FILE [KEY=VALUE ...]`` prints one
JSON line. It is meant to run in a *fresh* process (:func:`measure_in_subprocess`
starts one) because it reads the process's resident memory:

1. glibc is told (``MALLOC_MMAP_THRESHOLD_``) to serve every allocation above
   64 KiB with its own ``mmap``, so freed tensors leave the resident set at once
   and RSS follows the live tensors instead of the heap's high-water mark;
2. a warm-up step of a 1-layer copy of the model touches every code path
   (library pages, lazily built kernels, the tokenizer) before anything is counted;
3. the peak-RSS counter is reset (``echo 5 > /proc/self/clear_refs``) and the
   baseline RSS read; then the set-up is built (``build_training``) and two
   update iterations run on a synthetic rollout batch: zero grads, forward +
   backward of every micro-batch and draw (``accumulate_gradients``), grad
   sync, optimizer step. The second iteration runs with the Adam states
   allocated, as every step of a real run after the first does;
4. reported: ``peak_bytes`` = VmHWM - baseline, plus RSS after the build
   (weights + gradient buffer) for a finer check.

With ``parallel.pipeline_parallel`` (or ``tensor_parallel``) > 1 the command starts one local
rank per model-parallel rank (gloo); each measures its own process as above (the update runs
through Megatron's 1F1B schedule, as the RL loop's does) and the JSON line holds ``ranks``, one
such record per rank with its ``pipeline_rank`` and the parameters of its own stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

import torch

from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.engine.expert import phase_model
from stabledrl_mcore.engine.gradients import sync_gradients
from stabledrl_mcore.engine.seeding import phase_generator
from stabledrl_mcore.parallel import bootstrap
from stabledrl_mcore.parallel.launch import spawn
from stabledrl_mcore.rl.estimates import draw_plan
from stabledrl_mcore.rl.rollout import RolloutBatch
from stabledrl_mcore.rl.setup import build_training
from stabledrl_mcore.rl.trainer import likelihood_spec
from stabledrl_mcore.rl.update import accumulate_gradients

MMAP_THRESHOLD = 65536


def _status(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def synthetic_batch(cfg, vocab: int, seq_len: int, prompt_len: int, generator: torch.Generator):
    """A rollout batch of ``prompts_per_step x group_size`` random sequences (advantages +-1)."""

    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    seqs = torch.randint(5, vocab - 1, (n, seq_len), generator=generator)
    comp = torch.zeros(n, seq_len, dtype=torch.bool)
    comp[:, prompt_len:] = True
    groups = torch.arange(cfg.rollout.prompts_per_step).repeat_interleave(cfg.rollout.group_size)
    batch = RolloutBatch(
        sequences=seqs,
        prompt_len=prompt_len,
        prompt_valid=torch.ones_like(comp),
        completion_mask=comp,
        group_index=groups,
        completions=[""] * n,
        references=[None] * n,
    )
    batch.advantages = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(n)])
    return batch


def _update(s, batch, spec, iterations: int) -> List[int]:

    peaks = []
    coef = batch.plan.scored.float()
    for _ in range(iterations):
        s.ddp.zero_grad_buffer()
        s.optimizer.zero_grad()
        with phase_model(s.ddp, backward=True) as ddp:
            accumulate_gradients(
                ddp,
                batch,
                spec,
                coef,
                micro_batch=s.cfg.parallel.micro_batch_size,
                mask_id=s.model.dllm_config.mask_token_id,
            )
        sync_gradients(s.ddp)
        s.optimizer.step()
        peaks.append(_status("VmHWM"))
    return peaks


def _run(cfg, seq_len: int, prompt_len: int, iterations: int):

    s = build_training(cfg)
    after_build = _status("VmRSS")
    spec = likelihood_spec(cfg, s.model)
    batch = synthetic_batch(cfg, s.model.dllm_config.vocab_size, seq_len, prompt_len, torch.Generator().manual_seed(0))
    batch.plan = draw_plan(
        batch,
        spec,
        lambda k: phase_generator(cfg.parallel.seed, 0, k, "masks"),
        micro_batch=cfg.parallel.micro_batch_size,
    )
    peaks = _update(s, batch, spec, iterations)
    scored = float(batch.plan.scored.float().mean())
    return s, after_build, peaks, scored


def measure(
    config: Optional[str], overrides: Sequence[str], *, seq_len: int, prompt_len: int, iterations: int = 2
) -> Dict[str, float]:
    """Peak RSS growth (bytes) of building + ``iterations`` updates; call in a fresh process."""
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    cfg = load_config(config, list(overrides))
    pp = cfg.parallel.pipeline_parallel
    bootstrap.initialize(cfg.parallel.tensor_parallel, pp, seed=cfg.parallel.seed)
    small = dataclasses.replace(
        cfg,
        model=dataclasses.replace(  # one layer per pipeline stage
            cfg.model, overrides={**cfg.model.overrides, "num_layers": pp}
        ),
    )
    warm = _run(small, seq_len, prompt_len, 2)
    del warm
    gc.collect()
    reset = _reset_peak()
    base = _status("VmRSS")
    s, after_build, peaks, scored = _run(cfg, seq_len, prompt_len, iterations)
    out = {
        "baseline_rss": base,
        "peak_bytes": max(peaks) - base,
        "after_build_bytes": after_build - base,
        "peaks_per_iteration": [p - base for p in peaks],
        "peak_reset": reset,
        "scored_fraction": scored,
        "params": s.model.dllm_config.num_parameters(),
        "stage_params": sum(p.numel() for p in s.model.parameters()),
        "pipeline_rank": ps.get_pipeline_model_parallel_rank(),
        "tensor_rank": ps.get_tensor_model_parallel_rank(),
        "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }
    bootstrap.destroy()
    return out


def _measure_rank(
    config: Optional[str], overrides: Sequence[str], seq_len: int, prompt_len: int, iterations: int, out_dir: str
) -> None:
    """One local rank of a model-parallel measurement: its record as ``rank<R>.json`` in ``out_dir``."""
    out = measure(config, overrides, seq_len=seq_len, prompt_len=prompt_len, iterations=iterations)
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as handle:
        json.dump(out, handle)


def measure_ranks(
    config: Optional[str],
    overrides: Sequence[str],
    *,
    seq_len: int,
    prompt_len: int,
    iterations: int = 2,
    timeout: float = 600.0,
) -> Dict[str, object]:
    """:func:`measure` on every model-parallel rank of ``config`` (local processes, gloo);
    ``{"ranks": [record of rank 0, ...]}``, or one record when the layout has a single rank."""

    cfg = load_config(config, list(overrides))
    world = cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel
    if world == 1:
        return measure(config, overrides, seq_len=seq_len, prompt_len=prompt_len, iterations=iterations)
    with tempfile.TemporaryDirectory(prefix="stabledrl-memory-") as out_dir:
        spawn(
            _measure_rank, world, (config, list(overrides), seq_len, prompt_len, iterations, out_dir), timeout=timeout
        )
        ranks = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as handle:
                ranks.append(json.load(handle))
    return {"ranks": ranks}


def measure_in_subprocess(
    config: Optional[str],
    overrides: Sequence[str],
    *,
    seq_len: int,
    prompt_len: int,
    iterations: int = 2,
    timeout: float = 600.0,
) -> Dict[str, float]:
    """Run :func:`measure` (:func:`measure_ranks` for a model-parallel layout) in a fresh interpreter
    with the allocator settings above."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = [
        sys.executable,
        "-m",
        "stabledrl_mcore.bench.memory",
        "--seq-len",
        str(seq_len),
        "--prompt-len",
        str(prompt_len),
        "--iterations",
        str(iterations),
    ]
    if config:
        cmd += ["--config", config]
    proc = subprocess.run(cmd + list(overrides), capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"memory measurement failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--prompt-len", type=int, required=True)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    print(
        json.dumps(
            measure_ranks(
                args.config,
                args.overrides,
                seq_len=args.seq_len,
                prompt_len=args.prompt_len,
                iterations=args.iterations,
            )
        )
    )


if __name__ == "__main__":
    main()
