"""Mixture-of-experts layers: Megatron-Core's ``MoELayer`` inside the dLLM layer spec.

The attention (bidirectional, block-causal, staircase) is unchanged; only each layer's MLP
becomes router + experts (:func:`~.specs.dllm_layer_spec` with ``num_experts``; routing in
:func:`~.presets.moe_transformer_config`). Expert parallelism splits the experts over
``parallel.expert_parallel`` ranks of the data-parallel dimension (Megatron's expert grid:
``world = PP x ETP x EP x expert-DP``); tokens go to their experts' ranks and back by
all-to-all in every layer, so the ranks of one expert-parallel group must run the same
number of forwards (see :mod:`stabledrl_mcore.engine.expert`).

Checkpoint layout: Megatron's ``SequentialMLP`` (CPU) and TE's grouped experts (GPU) both write
``decoder.layers.L.mlp.experts.experts.linear_fc{1,2}.weight`` sharded along a global expert axis, so
a checkpoint converted or saved on one loads on the other and at any expert-parallel size.

megatron-core 0.16.1 fix: ``moe_utils`` names ``te_general_gemm`` in the router's gating linear
but binds it only when Transformer Engine imports, so without TE every router forward raised
``NameError``; importing this module binds it to None (the torch matmul path, as intended).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer

from stabledrl_mcore.parallel.bootstrap import comm_device

if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


class _TokenShard(torch.autograd.Function):
    """This tensor-parallel rank's share of the tokens ``[T, 1, H]`` every TP rank holds alike;
    backward: each rank's share's gradient in its rows, summed over ``group`` into the gradient
    of the replicated input (the same on every rank). :class:`_GatherTokens` undoes the split."""

    @staticmethod
    def forward(ctx, tokens, sizes, rank, group):
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        return tokens.split(sizes)[rank].clone()

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros((sum(ctx.sizes),) + tuple(grad.shape[1:]))
        offset = sum(ctx.sizes[: ctx.rank])
        full[offset : offset + grad.shape[0]] = grad
        torch.distributed.all_reduce(full, group=ctx.group)
        return full, None, None, None


class _GatherTokens(torch.autograd.Function):
    """All-gather of every TP rank's share (uneven sizes padded); backward: the gradient of the
    replicated output is the same on every rank, so each rank keeps its own share's rows and
    the shares' gradients are summed back into the replicated input by an all-reduce."""

    @staticmethod
    def forward(ctx, share, sizes, rank, group):
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        longest = max(sizes)
        padded = share.new_zeros((longest,) + tuple(share.shape[1:]))
        padded[: share.shape[0]] = share
        out = share.new_empty((longest * len(sizes),) + tuple(share.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded.contiguous(), group=group)
        return torch.cat([out[i * longest : i * longest + n] for i, n in enumerate(sizes)])

    @staticmethod
    def backward(ctx, grad):
        offset = sum(ctx.sizes[: ctx.rank])
        return grad[offset : offset + ctx.sizes[ctx.rank]].contiguous(), None, None, None


class DLLMMoELayer(MoELayer):
    """Megatron's ``MoELayer`` at TP > 1 without sequence parallelism: each tensor-parallel rank
    routes its own share of the (replicated) tokens, and the outputs are gathered back.

    Megatron refuses MoE with TP > 1 unless sequence parallelism splits the tokens over the TP
    ranks; otherwise every TP rank would send the same tokens to the experts (TP times the expert
    work, and TP times each expert's weight gradient). The dLLM's forwards (prompt prefixes,
    4-token blocks against a KV cache, staircase rows) have lengths that need not divide by TP,
    which sequence parallelism requires, so this model splits the tokens for the MoE layer only:
    the ``S x B`` tokens in near-equal shares (``tensor_split`` sizes), the layer run on the share
    (the layer's own guard sees a split input, as under sequence parallelism), the shares
    all-gathered; in backward each rank's share gets its rows of the (replicated) output gradient
    and an all-reduce returns the replicated input its full gradient. EP=2 x TP=2 equals one
    process (``tests/test_moe_rl.py``). The router, replicated on every TP rank, then sees only
    its rank's share: its gradient is scaled by TP and marked for Megatron's TP-average in
    ``finalize_model_grads`` (``average_gradients_across_tp_domain``), which makes it the sum over
    the shares, identical on every TP rank. So are the experts' weights when every TP rank holds
    them whole (``expert_tensor_parallel=1`` without expert parallelism): Megatron's DDP reduces
    them as dense weights, over the data-parallel ranks only, and no dispatcher collective brings
    the other shares' tokens to them. (With ``expert_tensor_parallel`` = TP the dispatcher gathers
    the shares within the expert-TP group; with expert parallelism the all-to-all does.) EP = 1 with
    1 < ``expert_tensor_parallel`` < TP is refused: neither reduction covers it.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        world = self.attn_tp_group.size()
        if world > 1 and not config.sequence_parallel:
            shared = list(self.router.parameters())
            etp = config.expert_tensor_parallel_size or world
            if config.expert_model_parallel_size == 1 and etp == 1:
                shared += list(self.experts.parameters())
            elif config.expert_model_parallel_size == 1 and etp != world:
                raise NotImplementedError(
                    f"an MoE layer at tensor_parallel={world} without sequence parallelism needs "
                    f"expert_tensor_parallel 1 or {world} when expert_parallel=1, got {etp}"
                )
            for param in shared:
                param.average_gradients_across_tp_domain = True
                param.register_hook(lambda grad, world=world: grad * world)

    def forward(self, hidden_states, *args, **kwargs):
        group = self.attn_tp_group
        if group.size() == 1 or self.config.sequence_parallel:
            return super().forward(hidden_states, *args, **kwargs)
        if kwargs.get("padding_mask") is not None or args:
            raise NotImplementedError("DLLMMoELayer at TP > 1 takes hidden states only")
        seq, batch, hidden = hidden_states.shape
        world, rank = group.size(), group.rank()
        count = seq * batch
        if count < world and not torch.is_grad_enabled():  # too few to share: every rank routes all
            return self._unguarded_forward(hidden_states)
        if count < world:
            raise ValueError(f"an MoE forward at tensor_parallel={world} needs at least {world} tokens, got {count}")
        sizes = [count // world + (1 if r < count % world else 0) for r in range(world)]  # tensor_split's
        share = _TokenShard.apply(hidden_states.reshape(count, 1, hidden), sizes, rank, group)
        output, bias = self._unguarded_forward(share)
        output = _GatherTokens.apply(output, sizes, rank, group)
        return output.reshape(seq, batch, hidden), bias

    def _unguarded_forward(self, hidden_states):
        """Megatron's forward past its TP-without-SP guard (only this layer's ``training`` flag is
        lowered; the router's stays, so router losses are computed in training as configured)."""
        self.training, training = False, self.training
        try:
            return super().forward(hidden_states)
        finally:
            self.training = training


@contextlib.contextmanager
def router_loss_scale(scale: float):
    """Inside the block, Megatron's router losses (auxiliary, z-loss) enter each backward with
    weight ``scale`` (``MoEAuxLossAutoScaler``'s class-wide scale; the previous one is restored)."""

    MoEAuxLossAutoScaler = moe_utils.MoEAuxLossAutoScaler
    previous = MoEAuxLossAutoScaler.main_loss_backward_scale
    kept = None if previous is None else previous.clone()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(scale), device=comm_device()))
    try:
        yield
    finally:
        if kept is None:
            MoEAuxLossAutoScaler.main_loss_backward_scale = None
        else:
            MoEAuxLossAutoScaler.set_loss_scale(kept)


_PAUSED = {"depth": 0}


@contextlib.contextmanager
def routing_recorders_paused():
    """Forwards inside this block are not seen by any :class:`RoutingRecorder` (the lockstep's
    dummy forwards, see :mod:`stabledrl_mcore.engine.expert`)."""
    _PAUSED["depth"] += 1
    try:
        yield
    finally:
        _PAUSED["depth"] -= 1


class RoutingRecorder:
    """``with RoutingRecorder(model) as rec:`` counts, per MoE layer of ``model``, the tokens each
    expert received and the routed slots dropped by the capacity factor (``tokens x topk`` minus
    the slots kept), for every forward inside the block. ``keep_maps`` also keeps each router
    call's ``[tokens, experts]`` routing map (tokens in Megatron's ``[S, B]`` order, s-major).

    The router is replicated, so the counts cover this rank's tokens for all experts;
    :meth:`summary` sums them over a process group (the data-parallel ranks) before reducing.
    """

    def __init__(self, model: torch.nn.Module, *, keep_maps: bool = False):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        experts = self.routers[0].config.num_moe_experts if self.routers else 0
        device = self.routers[0].weight.device if self.routers else torch.device("cpu")
        # kept on the model's device: no host sync per router call
        self.counts = torch.zeros(len(self.routers), experts, dtype=torch.float64, device=device)
        self.slots = torch.zeros(len(self.routers), dtype=torch.float64, device=device)  # tokens x topk
        self.maps: List[List[torch.Tensor]] = [[] for _ in self.routers]
        self.keep_maps = keep_maps
        self._handles: list = []

    def __enter__(self) -> "RoutingRecorder":
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def record(module, inputs, output):
            if _PAUSED["depth"]:
                return
            routing_map = output[1].detach()
            self.counts[layer] += routing_map.sum(0).to(self.counts)
            self.slots[layer] += float(routing_map.shape[0] * module.topk)
            if self.keep_maps:
                self.maps[layer].append(routing_map.cpu())

        return record

    def summary(self, group=None) -> Dict[str, float]:
        """Router statistics (summed over ``group``'s ranks): ``router_load_max`` / ``_min`` (the
        busiest / idlest expert's share over the even share, worst layer), ``router_load_cv``
        (coefficient of variation of the loads, mean over layers), ``router_dropped_frac``
        (routed slots dropped by the capacity factor)."""
        if not self.routers:
            return {}
        counts, slots = self.counts.clone(), self.slots.clone()
        if torch.distributed.is_initialized() and (group is None or torch.distributed.get_world_size(group) > 1):
            both = torch.cat([counts.flatten(), slots]).to(comm_device())
            torch.distributed.all_reduce(both, group=group)
            counts, slots = both[: counts.numel()].view_as(counts), both[counts.numel() :]
        counts, slots = counts.cpu(), slots.cpu()  # the one host copy
        kept = counts.sum(-1)
        if not bool((kept > 0).all()):
            return {}
        share = counts / kept[:, None] * counts.shape[1]  # 1 = the even share
        return {
            "router_load_max": float(share.max()),
            "router_load_min": float(share.min()),
            "router_load_cv": float((share.std(-1, unbiased=False)).mean()),
            "router_dropped_frac": float(((slots - kept) / slots).mean()),
        }
