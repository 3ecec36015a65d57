"""Evaluate a (possibly distributed) model on a task: generate, score, gather over DP ranks.

Examples are sharded contiguously over data-parallel ranks; tensor-parallel
ranks of one replica generate identical tokens (same inputs, same generator).
Rank 0 returns the accuracy over all examples and the gathered records.

With ``n > 1`` samples per prompt (or ``temperature > 0``) the examples are cut into
chunks of ``max(1, micro_batch // n)`` consecutive examples, each decoded as one batch
of its examples' n samples with its own generator (seeded by ``seed`` and the chunk's
index), and the chunks are sharded over data-parallel ranks: the samples do not
depend on the number of ranks. ``n == 1`` at temperature 0 is the greedy path.
Metrics over the samples (pass@k, maj@k, mean@k): :mod:`~stabledrl_mcore.evaluation.at_k`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from tqdm.auto import tqdm

from stabledrl_mcore.diffusion import generate
from stabledrl_mcore.engine.expert import finish_forwards
from stabledrl_mcore.evaluation.at_k import check_ks, default_ks, sample_metrics, summarize
from stabledrl_mcore.evaluation.partial import whole_batches
from stabledrl_mcore.evaluation.scoring import evaluate_completions, shard_examples, shard_indices
from stabledrl_mcore.models.decoding import prompt_padding
from stabledrl_mcore.models.placement import eval_mode, model_device
from stabledrl_mcore.tasks.base import Example
from stabledrl_mcore.tasks.prompts import encode_prompts


@dataclass
class EvalResult:
    accuracy: float
    mean_reward: float
    num_examples: int
    records: List[Dict[str, Any]]
    n: int = 1
    """Samples per example."""
    metrics: Dict[str, float] = field(default_factory=dict)
    """``pass@k``, ``maj@k``, ``mean@k`` for every k (means over examples)."""


def data_parallel_position() -> tuple:
    """``(rank, world)`` of this process among the data-parallel ranks (``(0, 1)`` undistributed)."""
    return _dp_group()[1:]


def _dp_group():
    if not torch.distributed.is_initialized():
        return None, 0, 1
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return None, torch.distributed.get_rank(), torch.distributed.get_world_size()


def evaluate_model(
    model,
    tokenizer,
    task,
    examples: Sequence[Example],
    *,
    gen_length: int,
    steps: int,
    block_length: int,
    temperature: float = 0.0,
    threshold: Optional[float] = None,
    micro_batch: int = 16,
    seed: int = 0,
    progress: bool = False,
    cache: str = "none",
    n: int = 1,
    ks: Optional[Sequence[int]] = None,
    compile: str = "none",
    on_records: Optional[Callable[[List[Dict[str, Any]]], None]] = None,
    kept: Sequence[Dict[str, Any]] = (),
) -> EvalResult:
    """Greedy (or sampled) completions for ``examples``; accuracy = share of samples with full reward.

    Each record holds the exact ``prompt`` the model saw (``task.prompt``) and the ``question``;
    with ``n > 1`` also ``samples`` (every sample's completion, extracted answer, reward,
    correct) and the example's own ``pass@k`` / ``maj@k`` / ``mean@k`` (``ks``: default
    :func:`~stabledrl_mcore.evaluation.at_k.default_ks`); the top-level fields are those of the first sample.
    ``compile``: how the decoding forwards run (``rollout.compile`` / ``--compile``; prompts are then
    left-padded to a multiple of :data:`~stabledrl_mcore.models.decoding.PROMPT_MULTIPLE` tokens).
    ``progress``: one bar over rank 0's examples for the whole evaluation (the samplers show none).
    ``on_records``: called on every rank with each batch's (chunk's) finished records of that rank,
    in order, as they finish (what ``stabledrl eval`` appends to its results file). ``kept``: this
    rank's records of a stopped run of the same evaluation (``eval --resume``, see
    :mod:`~stabledrl_mcore.evaluation.partial`): its whole batches are taken as they are, not decoded
    again, and the rest decodes as the uninterrupted run would (same batches, same seeds)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks = check_ks(ks, n) if ks is not None else default_ks(n)
    sampling = dict(
        gen_length=gen_length,
        steps=steps,
        block_length=block_length,
        temperature=temperature,
        threshold=threshold,
        progress=False,  # one bar for the whole evaluation (below), none per decoded batch
        cache=cache,
        compile=compile,
    )
    group, rank, world = _dp_group()
    batches = rank_batches(len(examples), rank, world, micro_batch=micro_batch, n=n, temperature=temperature)
    kept = whole_batches(kept, batches)
    total = sum(batches)
    desc = "eval" if world == 1 else f"eval (rank 0's {total} of {len(examples)})"
    shown = progress and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
    with tqdm(total=total, initial=len(kept), desc=desc, unit="example", disable=not shown, dynamic_ncols=True) as bar:
        if n == 1 and temperature == 0:
            records = _greedy_records(
                model, tokenizer, task, examples, rank, world, micro_batch, seed, sampling, bar, on_records, kept
            )
        else:
            records = _sampled_records(
                model, tokenizer, task, examples, rank, world, micro_batch, seed, n, ks, sampling, bar, on_records, kept
            )
    finish_forwards(model)  # expert parallelism: peers may still run forwards (see parallel.expert)
    if world > 1:
        gathered: List[Any] = [None] * world
        torch.distributed.all_gather_object(gathered, records, group=group)
        records = [r for part in gathered for r in part]
    per_example = [rec if "samples" in rec else sample_metrics([rec], ks, task.same_answer) for rec in records]
    samples = [s for rec in records for s in rec.get("samples", [rec])]
    count = max(len(samples), 1)
    return EvalResult(
        accuracy=sum(s["correct"] for s in samples) / count,
        mean_reward=sum(s["reward"] for s in samples) / count,
        num_examples=len(records),
        records=records,
        n=n,
        metrics=summarize(per_example, ks),
    )


def rank_batches(count: int, rank: int, world: int, *, micro_batch: int, n: int = 1, temperature: float = 0.0):
    """The sizes, in examples (= records), of the batches ``rank`` of ``world`` decodes, in order, for
    ``count`` examples: ``micro_batch`` examples of its shard at a time on the greedy path, else its
    chunks of ``max(1, micro_batch // n)`` examples (see the module docstring)."""
    if n == 1 and temperature == 0:
        mine = len(shard_indices(count, rank, world))
        return [min(micro_batch, mine - start) for start in range(0, mine, micro_batch)]
    per_chunk = max(1, micro_batch // n)
    chunks = -(-count // per_chunk)
    return [min(per_chunk, count - c * per_chunk) for c in shard_indices(chunks, rank, world)]


def _greedy_records(
    model, tokenizer, task, examples, rank, world, micro_batch, seed, sampling, bar=None, sink=None, kept=()
):
    """One completion per example, batches of ``micro_batch`` within this rank's shard, each batch
    scored (and handed to ``sink``) as it finishes; ``kept``: the records of the first whole batches,
    not decoded again (the greedy samplers draw nothing, so the generator is not advanced)."""
    mine = shard_examples(list(examples), rank, world)
    records: List[Dict[str, Any]] = list(kept)
    prompts = [task.prompt(ex, tokenizer) for ex in mine]  # the exact texts, recorded with the results
    device = model_device(model)
    generator = torch.Generator(device=device).manual_seed(seed + rank)
    with torch.no_grad(), eval_mode(model):
        for start in range(len(kept), len(mine), micro_batch):
            batch = prompts[start : start + micro_batch]
            padding = prompt_padding(sampling["compile"], model, sampling.get("block_length"))
            ids, valid = encode_prompts(tokenizer, batch, device=device, **padding)
            out = generate(model, ids, generator=generator, prompt_valid=valid, **sampling)
            completions = [tokenizer.decode(row) for row in out[:, ids.shape[1] :].tolist()]
            scored = evaluate_completions(task, mine[start : start + len(batch)], completions, batch)[1]
            for j, record in enumerate(scored):  # an example without its own index: its place in the shard
                record["index"] = mine[start + j].meta.get("index", start + j)
            records += scored
            if sink is not None:
                sink(scored)
            if bar is not None:
                bar.update(ids.shape[0])
    return records


def chunk_seed(seed: int, chunk: int) -> int:
    """The generator seed of chunk ``chunk`` of a sampled evaluation (independent of the ranks)."""
    digest = hashlib.sha256(f"stabledrl-eval:{seed}:{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _sampled_records(
    model, tokenizer, task, examples, rank, world, micro_batch, seed, n, ks, sampling, bar=None, sink=None, kept=()
):
    """``n`` samples per example, chunk by chunk (see the module docstring); one record per example.
    ``kept``: the records of the first whole chunks, not decoded again (each chunk has its own seed)."""
    examples = list(examples)
    per_chunk = max(1, micro_batch // n)
    chunks = [examples[i : i + per_chunk] for i in range(0, len(examples), per_chunk)]
    device = model_device(model)
    records: List[Dict[str, Any]] = list(kept)
    mine = shard_indices(len(chunks), rank, world)
    done, rows = 0, 0
    while done < len(mine) and rows + len(chunks[mine[done]]) <= len(kept):  # the kept chunks
        rows += len(chunks[mine[done]])
        done += 1
    with torch.no_grad(), eval_mode(model):
        for c in mine[done:]:
            prompts = [task.prompt(ex, tokenizer) for ex in chunks[c]]
            padding = prompt_padding(sampling["compile"], model, sampling.get("block_length"))
            ids, valid = encode_prompts(tokenizer, prompts, device=device, **padding)
            ids, valid = ids.repeat_interleave(n, 0), valid.repeat_interleave(n, 0)
            generator = torch.Generator(device=device).manual_seed(chunk_seed(seed, c))
            out = generate(model, ids, generator=generator, prompt_valid=valid, **sampling)
            texts = [tokenizer.decode(row) for row in out[:, ids.shape[1] :].tolist()]
            for j, ex in enumerate(chunks[c]):
                mine = texts[j * n : (j + 1) * n]
                _, scored = evaluate_completions(task, [ex] * n, mine, [prompts[j]] * n)
                samples = [{key: r[key] for key in ("completion", "extracted", "reward", "correct")} for r in scored]
                record = {key: value for key, value in scored[0].items()}
                record["index"] = ex.meta.get("index", c * per_chunk + j)
                record.update(samples=samples, **sample_metrics(samples, ks, task.same_answer))
                records.append(record)
            if sink is not None:
                sink(records[-len(chunks[c]) :])
            if bar is not None:
                bar.update(len(chunks[c]))
    return records
