"""Expert parallelism in the RL loop: the ranks of an expert group run their forwards in lockstep.

Megatron's MoE layer sends every token to its experts' ranks and back by all-to-all in each
layer, so a forward on one rank of an expert-parallel group is one collective call on all of
them. The ranks of that group belong to different data-parallel replicas, and the RL loop's
replicas do not always run the same number of forwards in a phase: threshold decoding ends a
block as soon as it is decoded, the update skips (draw, micro-batch) chunks that carry no
weight, held-out prompts split unevenly over ranks.

:func:`lockstep` wraps the model for one phase. Every forward is announced first by an
all-reduce (MAX) of 1 over the expert group; when a rank's phase is done, it leaves the ``with``
block by announcing 0 until every rank of the group announces 0, and runs a one-token dummy
forward (and, in an update phase, its backward with a zero loss) for every round in which a peer
still announced a real forward. Each round is then the same collectives on every rank, in the
same order; the dummies add nothing (no KV cache, zero gradients) and are left out of the router
statistics. The extra cost is one 4-byte all-reduce per forward, and a one-token forward for
each forward a peer runs beyond this rank's.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from stabledrl_mcore.diffusion.likelihood import dllm_config
from stabledrl_mcore.engine.pipeline import ModelWrapper, pipelined
from stabledrl_mcore.models.lora import BaseWithoutAdapters, adapters_disabled
from stabledrl_mcore.models.moe import RoutingRecorder, router_loss_scale, routing_recorders_paused
from stabledrl_mcore.parallel.bootstrap import comm_device

_DUMMIES = {"rounds": 0}


def lockstep_dummy_rounds() -> int:
    """Dummy rounds this process has run so far (a step's difference, summed over the ranks, is
    logged as ``expert_lockstep_dummies``: the forwards an imbalance between expert ranks cost)."""
    return _DUMMIES["rounds"]


def summed_over_ranks(value: float) -> float:
    """``value`` summed over every rank of the job (one all-reduce)."""

    total = torch.tensor([float(value)], dtype=torch.float64, device=comm_device())
    torch.distributed.all_reduce(total)
    return float(total.item())


def expert_group():
    """The process group of Megatron's all-to-all token exchange (expert-tensor x expert-parallel
    ranks), or None when nothing is exchanged (no parallel state, or expert_parallel 1)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_expert_model_parallel_world_size() == 1:
        return None
    return ps.get_expert_tensor_and_model_parallel_group()


def _announce(real: bool, group) -> bool:
    """All-reduce MAX of this rank's announcement; True if any rank of ``group`` runs a real forward."""

    flag = torch.tensor([1 if real else 0], dtype=torch.int32, device=comm_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item())


class LockstepModel(ModelWrapper):
    """``module`` whose forwards are announced to the expert group (see the module docstring).
    Attributes the phases read (``dllm_config``, ``zero_grad_buffer``...) come from ``module``."""

    def __init__(self, module: torch.nn.Module, group, *, backward: bool):
        super().__init__(module)
        self.group = group
        self.backward = backward

    def forward(self, *args, **kwargs):
        _announce(True, self.group)
        return self.module(*args, **kwargs)

    def drain(self) -> None:
        """Run dummy rounds until no rank of the group has a real forward left."""
        while _announce(False, self.group):
            _DUMMIES["rounds"] += 1
            self._dummy_round()

    def _dummy_round(self) -> None:
        from megatron.core import parallel_state as ps

        cfg = dllm_config(self.module)  # through Megatron DDP in the update
        device = next(self.module.parameters()).device
        # as many tokens as TP ranks: at TP > 1 each rank routes its own share (see models.moe)
        ids = torch.full(
            (1, ps.get_tensor_model_parallel_world_size()), cfg.pad_token_id, dtype=torch.long, device=device
        )
        # no router-loss gradient from the dummy token either
        with routing_recorders_paused(), router_loss_scale(0.0), torch.set_grad_enabled(self.backward):
            logits = self.module(ids)
            if self.backward:  # the all-to-all's backward too, with zero gradients everywhere
                (logits[..., :1].float().sum() * 0.0).backward()


def finish_forwards(model) -> None:
    """Call where a phase's forwards end and a collective of its own follows (the evaluation's
    gather of results): the expert group's ranks first finish each other's forwards. A no-op
    for any model not in :func:`lockstep`."""
    if isinstance(model, LockstepModel):
        model.drain()


@contextlib.contextmanager
def lockstep(model: Optional[torch.nn.Module], *, backward: bool = False) -> Iterator[Optional[torch.nn.Module]]:
    """``with lockstep(model) as m:`` run one phase's forwards on ``m``; on leaving, wait (with
    dummy forwards) until every rank of the expert group has run its own. ``backward``: the
    phase's forwards are each followed by a backward (the policy update). Without expert
    parallelism ``m`` is ``model`` itself and nothing is added."""
    group = expert_group() if model is not None else None
    if group is None:
        yield model
        return
    wrapped = LockstepModel(model, group, backward=backward)
    yield wrapped
    wrapped.drain()


@contextlib.contextmanager
def phase_model(model: Optional[torch.nn.Module], *, backward: bool = False):
    """The model as one phase of the RL loop runs it: split over stages under pipeline parallelism
    (:func:`~.pipeline.pipelined`), in :func:`lockstep` under expert parallelism (PP and EP are
    not combined, see ``preflight.check_pipeline_options``). A LoRA model's
    :class:`~..models.lora.BaseWithoutAdapters` runs as the base (its adapters off)."""
    if isinstance(model, BaseWithoutAdapters):  # a LoRA model's base: the adapters off for the block
        with adapters_disabled(model.model), lockstep(pipelined(model.model), backward=backward) as phase:
            yield phase
        return
    with lockstep(pipelined(model), backward=backward) as phase:
        yield phase


@contextlib.contextmanager
def routing_statistics(model: torch.nn.Module, into: dict, *, enabled: bool = True):
    """Count the routing of ``model``'s MoE layers inside the block and add the job-wide
    :meth:`~..models.moe.RoutingRecorder.summary` to ``into``, summed over the data- and
    tensor-parallel ranks (each TP rank routes its own share of the tokens, see
    :class:`~..models.moe.DLLMMoELayer`). Nothing for a dense model or when not ``enabled``."""
    if not enabled or not getattr(model.dllm_config, "is_moe", False):
        yield
        return
    from megatron.core import parallel_state as ps

    with RoutingRecorder(model) as recorder:
        yield
    into.update(
        recorder.summary(ps.get_tensor_and_data_parallel_group() if torch.distributed.is_initialized() else None)
    )
