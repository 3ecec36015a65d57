"""Pipeline-parallel forwards and backwards of the RL loop, on Megatron-Core's schedules.

Under pipeline parallelism every stage runs the same RL code (sampler, estimators,
losses) on the same tensors; only the model's forward is split. Each forward goes
through Megatron's ``get_forward_backward_func()`` (1F1B without interleaving), the
last stage reduces the logits of every micro-batch to what the caller needs (token
log-probs, or the logits themselves for the samplers) and broadcasts the results to
the other stages of its pipeline group, so every stage continues with identical values
(the same draws, the same coefficients, the same metrics).

- :func:`pipeline_forward`: forward-only passes of many micro-batches (stages overlap:
  while stage 1 runs micro-batch k, stage 0 runs k + 1); consecutive micro-batches of
  equal shape share one schedule call.
- :func:`pipeline_forward_backward`: forward and backward of a scalar surrogate per
  micro-batch, computed on the last stage and back-propagated through every stage; the
  gradient is the sum over micro-batches (Megatron's per-micro-batch averaging is off).
- :class:`PipelinedModel`: a module whose forward returns the logits on every stage,
  for code that calls the model as a function (the samplers, the KV cache: every stage
  keeps its own layers' keys in the shared :class:`~..models.KVCache`).

Without pipeline parallelism the first two are plain loops on this rank (a forward, or a forward
and a backward, per micro-batch), so a phase calls them at every pipeline size.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from stabledrl_mcore.models.masks import AttentionLayout

MicroBatch = Dict[str, Any]
"""Keyword arguments of one ``DLLMModel.forward`` call (``input_ids`` [b, S] on every stage)."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
_MAX_DIMS = 6


def pipeline_world_size() -> int:
    """Stages of Megatron's pipeline group (1 before ``parallel_state`` is initialised)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    return ps.get_pipeline_model_parallel_world_size()


def is_pipelined(model) -> bool:
    """True for a :class:`PipelinedModel` spanning more than one stage."""
    return isinstance(model, PipelinedModel) and pipeline_world_size() > 1


def pipelined(module):
    """``module`` as a :class:`PipelinedModel` under pipeline parallelism (None stays None)."""
    if module is None or pipeline_world_size() == 1 or isinstance(module, PipelinedModel):
        return module
    return PipelinedModel(module)


def _stage_module(model) -> torch.nn.Module:
    return model.module if isinstance(model, PipelinedModel) else model


def _shape_runs(micro_batches: Sequence[MicroBatch]) -> Iterator[range]:
    """Index ranges of consecutive micro-batches with the same ``input_ids`` shape."""
    start = 0
    for i in range(1, len(micro_batches) + 1):
        if i == len(micro_batches) or micro_batches[i]["input_ids"].shape != micro_batches[start]["input_ids"].shape:
            yield range(start, i)
            start = i


@contextlib.contextmanager
def _summed_microbatch_losses(config):
    """Megatron divides each micro-batch's loss by the micro-batch count unless it is a per-token
    loss; the RL surrogates are sums, so the per-token path (loss, tokens, data) is used with
    ``calculate_per_token_loss`` on for the call: no division at all."""
    saved = config.calculate_per_token_loss
    config.calculate_per_token_loss = True
    try:
        yield
    finally:
        config.calculate_per_token_loss = saved


def _run_schedule(
    model,
    micro_batches: Sequence[MicroBatch],
    indices: range,
    *,
    forward_only: bool,
    last_stage_fn: Callable[[torch.Tensor, int], Any],
) -> List[Any]:
    """One Megatron schedule call over ``micro_batches[indices]`` (all of one shape)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    stage = _stage_module(model)
    config = get_model_config(stage)
    order = iter(indices)
    batch, seq = micro_batches[indices[0]]["input_ids"].shape

    def forward_step(data_iterator, module):
        index = next(data_iterator)
        output = module(**micro_batches[index])

        def reduce(output_tensor, non_loss_data: bool = False):
            value = last_stage_fn(output_tensor, index)
            if forward_only:
                return value
            return value, torch.ones((), dtype=torch.int), {}

        return output, reduce

    schedule = get_forward_backward_func()
    context = contextlib.nullcontext() if forward_only else _summed_microbatch_losses(config)
    with context:
        return schedule(
            forward_step_func=forward_step,
            data_iterator=order,
            model=[stage],
            num_microbatches=len(indices),
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )


def broadcast_from_last_stage(
    values: Optional[List[torch.Tensor]], count: int, device: torch.device
) -> List[torch.Tensor]:
    """``values`` of the last pipeline stage on every stage of its group (shapes sent first)."""
    from megatron.core import parallel_state as ps

    group, src = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
    last = ps.is_pipeline_last_stage()
    header = torch.zeros(count, 2 + _MAX_DIMS, dtype=torch.int64, device=device)
    if last:
        for i, value in enumerate(values):
            if value.dim() > _MAX_DIMS or value.dtype not in _DTYPES:
                raise ValueError(f"cannot broadcast a {value.dtype} tensor of shape {tuple(value.shape)}")
            header[i, 0], header[i, 1] = _DTYPES.index(value.dtype), value.dim()
            header[i, 2 : 2 + value.dim()] = torch.tensor(value.shape)
    torch.distributed.broadcast(header, src, group=group)
    out = []
    for i, row in enumerate(header.tolist()):
        shape = row[2 : 2 + row[1]]
        tensor = values[i].contiguous() if last else torch.empty(shape, dtype=_DTYPES[row[0]], device=device)
        torch.distributed.broadcast(tensor, src, group=group)
        out.append(tensor)
    return out


class StageClock:
    """Seconds this rank spent inside its own stage's forwards vs in pipeline calls.

    ``bubble_fraction`` = 1 - busy / wall over the pipeline calls: the share of a stage's time
    spent waiting for other stages (and in the sends and broadcasts)."""

    def __init__(self):
        self.busy_s = 0.0
        self.wall_s = 0.0
        self.active = False  # inside a forward-only pipeline call

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0

    def reset(self) -> None:
        self.busy_s = self.wall_s = 0.0


CLOCK = StageClock()


def pipeline_forward(
    model, micro_batches: Sequence[MicroBatch], last_stage_fn: Callable[[torch.Tensor, int], torch.Tensor]
) -> List[torch.Tensor]:
    """Forward-only passes of ``micro_batches``; ``last_stage_fn(logits, index)`` of each, on every stage.

    Without pipeline parallelism this is ``[last_stage_fn(model(**mb), i) ...]``.
    """
    stage = _stage_module(model)
    if pipeline_world_size() == 1:
        return [last_stage_fn(stage(**mb), i) for i, mb in enumerate(micro_batches)]
    from megatron.core import parallel_state as ps

    start = time.perf_counter()
    results: List[torch.Tensor] = []
    CLOCK.active = True
    try:
        with torch.no_grad():
            for indices in _shape_runs(micro_batches):
                results += _run_schedule(stage, micro_batches, indices, forward_only=True, last_stage_fn=last_stage_fn)
    finally:
        CLOCK.active = False
    device = micro_batches[0]["input_ids"].device
    out = broadcast_from_last_stage(results if ps.is_pipeline_last_stage() else None, len(micro_batches), device)
    CLOCK.wall_s += time.perf_counter() - start
    return out


def pipeline_forward_backward(
    model, micro_batches: Sequence[MicroBatch], loss_fn: Callable[[torch.Tensor, int], torch.Tensor]
) -> None:
    """Back-propagate ``sum_i loss_fn(logits_i, i)`` (a scalar per micro-batch, on the last stage)
    through every stage; gradients accumulate into the parameters' grad buffers as a plain
    ``loss.backward()`` per micro-batch would.

    Without pipeline parallelism this is ``loss_fn(model(**mb), i).backward()`` for each micro-batch.
    """
    stage = _stage_module(model)
    if pipeline_world_size() == 1:
        for i, mb in enumerate(micro_batches):
            loss_fn(stage(**mb), i).backward()
        return
    for indices in _shape_runs(micro_batches):
        _run_schedule(stage, micro_batches, indices, forward_only=False, last_stage_fn=loss_fn)


class ModelWrapper(torch.nn.Module):
    """A module around ``module`` whose other attributes (``dllm_config``,
    ``zero_grad_buffer``...) are looked up through it: what the phases of the RL loop get."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


class PipelinedModel(ModelWrapper):
    """``model(...)`` with the logits on every pipeline stage: one forward-only pipeline pass,
    the last stage's logits broadcast (``gather_output=False``: each TP rank's own vocabulary
    shard). ``module`` is this rank's stage; attributes the samplers read (``dllm_config``,
    ``zero_grad_buffer``...) are looked up through it.

    Without a KV cache the rows are split into up to ``2 x PP`` micro-batches so that the
    stages overlap (bubble (p - 1) / (m + p - 1)); a cached forward is one micro-batch (the
    cache holds whole rows).
    """

    def __init__(self, module: torch.nn.Module, micro_batches: Optional[int] = None):
        super().__init__(module)
        self.micro_batches = micro_batches

    def forward(
        self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, attention_mask=None, **kwargs
    ) -> torch.Tensor:
        batch = dict(kwargs, input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask)
        parts = [batch] if kwargs.get("kv_cache") is not None else split_rows(batch, self._count(input_ids))
        outs = pipeline_forward(self.module, parts, lambda logits, _: logits)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _count(self, input_ids: torch.Tensor) -> int:
        wanted = self.micro_batches or 2 * pipeline_world_size()
        return max(1, min(wanted, input_ids.shape[0]))


POSITIONAL = ("logit_positions", "cache_slots")
"""Forward arguments that index positions, never rows (a tensor of 4 read positions is not 4 rows)."""


def split_rows(batch: MicroBatch, count: int) -> List[MicroBatch]:
    """``batch`` as ``count`` micro-batches of consecutive rows: per-row tensors (first dim = rows)
    and an :class:`~..models.masks.AttentionLayout`'s pad counts are sliced, shared ones kept
    (``logit_positions`` / ``cache_slots`` name positions, whatever their length)."""

    rows = batch["input_ids"].shape[0]
    if count <= 1 or rows <= 1:
        return [batch]
    size = -(-rows // count)
    parts = []
    for start in range(0, rows, size):
        sl = slice(start, start + size)
        part = {}
        for key, value in batch.items():
            if key in POSITIONAL and not (isinstance(value, torch.Tensor) and value.dim() == 2):
                pass  # positions shared by every row (a [B, n] logit_positions is per row: sliced)
            elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
                value = value[sl]
            elif isinstance(value, AttentionLayout) and value.pad:
                value = value.with_padding(value.pad[sl])
            part[key] = value
        parts.append(part)
    return parts


def timed_stage_forward(module: torch.nn.Module) -> Callable[[], None]:
    """Count the seconds ``module``'s forwards take in :data:`CLOCK` (a benchmark of forward-only
    phases reads ``CLOCK.bubble_fraction``); returns the function that removes the hooks."""
    starts: List[float] = []

    def before(*_):
        starts.append(time.perf_counter())

    def after(*_):
        took = time.perf_counter() - starts.pop()
        if CLOCK.active:
            CLOCK.busy_s += took

    handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    return lambda: [h.remove() for h in handles]
