"""Megatron's parallel linears with a plain-autograd matmul where no communication is fused.

``ColumnParallelLinear`` / ``RowParallelLinear`` route every matmul through
``_forward_impl``, Megatron's hook for the matmul itself, which by default is the
custom autograd function ``LinearWithGradAccumulationAndAsyncCommunication``.
That function exists to overlap the tensor-parallel all-reduce (or sequence-parallel
reduce-scatter) of the input gradient with the weight-gradient GEMM, and to
accumulate weight gradients straight into ``main_grad`` (gradient-accumulation
fusion, a CUDA kernel). When none of that is in play -- no input-gradient
all-reduce, no sequence parallelism, no fusion, no deferred weight gradients:
every row-parallel layer without sequence parallelism, and column-parallel layers
at TP=1 -- it computes exactly ``F.linear`` and its gradients, but each call pays
for a Python ``autograd.Function`` and its backward (~5% of a tiny model's
step on CPU, measured with ``tools/bench_backbone.py``). These subclasses
take ``F.linear`` then and defer to Megatron's function otherwise. Parameters,
names, initialisation and ``sharded_state_dict`` are inherited unchanged, so
checkpoints are identical.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def _plain_matmul_applies(kwargs) -> bool:
    """True when Megatron's linear function would add nothing to ``F.linear``."""
    return not (
        kwargs.get("gradient_accumulation_fusion")
        or kwargs.get("allreduce_dgrad")
        or kwargs.get("sequence_parallel")
        or kwargs.get("grad_output_buffer") is not None
    )


class _PlainMatmulWhenUnfused:
    """Mixin for a Megatron parallel linear: ``F.linear`` when nothing is fused into the matmul.

    At TP=1 it also sets Megatron's ``explicit_expert_comm`` (the switch Megatron's
    shared experts use to say "the caller handles tensor-parallel communication"):
    with one rank there is none, and the layer then skips the identity autograd
    functions of the tensor-parallel regions (copy-to before a column-parallel
    matmul, reduce-from after a row-parallel one), ~2% of a tiny model's step on CPU.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        row_parallel = isinstance(self, RowParallelLinear)
        if (
            self.tp_group is not None
            and self.tp_group.size() == 1
            and not self.sequence_parallel
            and (self.skip_bias_add or not row_parallel)
        ):  # Megatron asserts this for rows
            self.explicit_expert_comm = True

    def _forward_impl(self, input, weight, *args, **kwargs):
        if args or not _plain_matmul_applies(kwargs):
            return super()._forward_impl(input, weight, *args, **kwargs)
        return F.linear(input, weight, kwargs.get("bias"))


class AutogradColumnParallelLinear(_PlainMatmulWhenUnfused, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose matmul is ``F.linear`` when nothing is fused into it."""


class AutogradRowParallelLinear(_PlainMatmulWhenUnfused, RowParallelLinear):
    """``RowParallelLinear`` whose matmul is ``F.linear`` when nothing is fused into it
    (the tensor-parallel reduce of its output stays Megatron's)."""
