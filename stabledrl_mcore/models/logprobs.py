"""Per-token log-probabilities from (possibly vocab-sharded) logits.

Diffusion-LM likelihoods are sums of ``log p(x_0[i] | x_t)`` over masked
positions; this returns the per-position term. Under tensor parallelism the
output layer is column-parallel, so the cheapest path keeps logits sharded
over the vocabulary (``model(..., gather_output=False)``) and uses Megatron's
``tensor_parallel.vocab_parallel_cross_entropy`` (one max and one sum
all-reduce over the TP group instead of gathering ``[B, S, V]``).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel


def tensor_parallel_size() -> int:
    """Ranks of Megatron's tensor-parallel group (1 before ``parallel_state`` is initialised)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def _looks_sharded(logits: torch.Tensor) -> bool:
    """Gathered logits are bit-identical on every TP rank; vocab shards are not.

    Compares a fingerprint (width and a few values) across the TP group with
    one 2-element all-reduce. Shards can only look identical if the output
    layer's row blocks are identical (e.g. an all-zero head); pass
    ``vocab_parallel`` explicitly to skip the check.
    """
    flat = logits.detach().reshape(-1, logits.shape[-1])
    fingerprint = flat[:, :: max(1, logits.shape[-1] // 7)].float().sum() + logits.shape[-1]
    probe = torch.stack([fingerprint, -fingerprint])
    torch.distributed.all_reduce(
        probe, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
    )
    return bool(probe[0] != -probe[1])


def vocab_parallel_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_parallel: Optional[bool] = None
) -> torch.Tensor:
    """``log softmax(logits)[..., target]`` in fp32, shape of ``targets`` (e.g. ``[B, S]``).

    ``logits``: ``[B, S, V]`` (gathered) or ``[B, S, V/tp]`` (this rank's vocab
    shard, ``gather_output=False``). ``vocab_parallel``: whether the logits are
    sharded; None = TP size 1 -> no, otherwise detected (:func:`_looks_sharded`, one extra
    all-reduce; the RL, likelihood and SFT paths pass ``True`` since they asked for shards).
    Differentiable in both cases; the input logits are never modified.

    Padded vocabulary columns (``padded_vocab_size > vocab_size``) must score a very
    negative value, as ``DLLMModel`` makes them (``finfo.min``): their ``exp`` is 0 in the
    sum, so they change neither the values nor the gradients (theirs is 0).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on the leading dimensions"
        )
    tp = tensor_parallel_size()
    if vocab_parallel is None:
        vocab_parallel = tp > 1 and _looks_sharded(logits)
    if vocab_parallel and tp > 1:
        # Megatron's kernel works in place and views its input: give it a contiguous fp32 copy.
        work = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        return -tensor_parallel.vocab_parallel_cross_entropy(work, targets)
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
