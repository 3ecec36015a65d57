"""Evaluate a (possibly distributed) model on a task: generate, score, gather over DP ranks.

Examples are sharded contiguously over data-parallel ranks; tensor-parallel
ranks of one replica generate identical tokens (same inputs, same generator).
Rank 0 returns the accuracy over all examples and the gathered records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from .diffusion import generate
from .models.placement import eval_mode, model_device
from .rl.rollout import encode_prompts
from .tasks.base import Example
from .tasks.evaluation import evaluate_completions, shard_examples


@dataclass
class EvalResult:
    accuracy: float
    mean_reward: float
    num_examples: int
    records: List[Dict[str, Any]]


def _dp_group():
    if not torch.distributed.is_initialized():
        return None, 0, 1
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return None, torch.distributed.get_rank(), torch.distributed.get_world_size()


def evaluate_model(model, tokenizer, task, examples: Sequence[Example], *, gen_length: int, steps: int,
                   block_length: int, temperature: float = 0.0, threshold: Optional[float] = None,
                   micro_batch: int = 16, seed: int = 0, progress: bool = False, cache: str = "none") -> EvalResult:
    """Greedy (or sampled) completions for ``examples``; accuracy = share with full reward.

    Each record holds the exact ``prompt`` the model saw (``task.prompt``) and the ``question``."""
    group, rank, world = _dp_group()
    mine = shard_examples(list(examples), rank, world)
    completions: List[str] = []
    prompts = [task.prompt(ex, tokenizer) for ex in mine]  # the exact texts, recorded with the results
    device = model_device(model)
    generator = torch.Generator(device=device).manual_seed(seed + rank)
    with torch.no_grad(), eval_mode(model):
        for start in range(0, len(mine), micro_batch):
            ids, valid = encode_prompts(tokenizer, prompts[start:start + micro_batch], device=device)
            out = generate(model, ids, gen_length=gen_length, steps=steps, block_length=block_length,
                           temperature=temperature, threshold=threshold, generator=generator,
                           prompt_valid=valid, progress=progress, cache=cache)
            completions += [tokenizer.decode(row) for row in out[:, ids.shape[1]:].tolist()]
    _, records = evaluate_completions(task, mine, completions, prompts)
    if world > 1:
        gathered: List[Any] = [None] * world
        torch.distributed.all_gather_object(gathered, records, group=group)
        records = [r for part in gathered for r in part]
    n = len(records)
    return EvalResult(accuracy=sum(r["correct"] for r in records) / max(n, 1),
                      mean_reward=sum(r["reward"] for r in records) / max(n, 1),
                      num_examples=n, records=records)
