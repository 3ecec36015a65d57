"""The local spec's SwiGLU MLP pieces: fc1 hands gate and up over as two tensors.

Megatron's ``MLP`` runs fc1 as one matmul into ``[s, b, 2 * ffn]`` and its unfused
``glu`` takes ``silu`` of the first half and multiplies by the second. Both halves
are then strided views: on CPU, ``silu`` and its gradient on a strided half run
2x slower than on a contiguous tensor, the ``+ glu_linear_offset`` (0.0) costs a
copy, and the backward concatenates the two halves' gradients. At tiny widths
that made the MLP ~25% slower than ``transformers``' (separate gate and up
projections): 6.6 vs 5.2 ms forward+backward per MLP for llada-tiny at 8 x 128
tokens, one thread.

:class:`GateUpColumnParallelLinear` (fc1) instead multiplies by the two row blocks
of its weight -- the same ``[2 * ffn, hidden]`` parameter, so names, TP sharding
and checkpoints are unchanged -- and returns ``(gate, up)``; :class:`SwiGLU`, the
MLP's activation module, returns ``silu(gate) * up``: 5.2 ms per MLP above. The
values equal the fused matmul's to ~1e-9 (each output is the same dot product;
only the BLAS blocking differs).

Megatron builds an MLP's ``activation_func`` submodule from the spec only under
``config.use_te_activation_func`` (its switch for "the activation is a module");
:func:`with_module_activation` sets it for a spec carrying :class:`SwiGLU`, and only
where Megatron's plain SwiGLU would run otherwise (not with its fused kernel, used
on GPU and for large CPU models, nor with biases). Without the switch both classes
fall back to Megatron's behaviour: fc1 returns the usual ``[s, b, 2 * ffn]``.
fc1 splits only where its matmul is a plain ``F.linear`` (see :mod:`.linear`: TP=1,
no sequence parallelism); otherwise :class:`SwiGLU` chunks the fused output itself.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from .linear import AutogradColumnParallelLinear, _plain_matmul_applies


class GateUpColumnParallelLinear(AutogradColumnParallelLinear):
    """The MLP's fc1: ``(x W_gate^T, x W_up^T)`` from its weight's two row blocks when
    the MLP's activation is :class:`SwiGLU`, else Megatron's ``[..., 2 * ffn]`` output."""

    split_gate_up = True  # False: always the fused output (tests compare both)

    def _forward_impl(self, input, weight, *args, **kwargs):
        if (self.split_gate_up and self.config.use_te_activation_func and not args
                and _plain_matmul_applies(kwargs) and kwargs.get("bias") is None):
            gate_weight, up_weight = weight.chunk(2, dim=0)
            return F.linear(input, gate_weight), F.linear(input, up_weight)
        return super()._forward_impl(input, weight, *args, **kwargs)


class SwiGLU(MegatronModule):
    """The MLP's activation module (``MLPSubmodules.activation_func``) of the local spec:
    ``silu(gate) * up`` from fc1's ``(gate, up)`` or from its fused ``[..., 2 * ffn]``
    output (as Megatron's ``glu``). A ``MegatronModule`` because ``MLP.sharded_state_dict``
    asks every child; it has no state."""

    def __init__(self, config) -> None:
        super().__init__(config=config)

    def forward(self, fc1_output) -> torch.Tensor:
        if isinstance(fc1_output, tuple):
            gate, up = fc1_output
        else:
            gate, up = torch.chunk(fc1_output, 2, dim=-1)
        return F.silu(gate) * up


def with_module_activation(config, layer_spec):
    """``config`` with ``use_te_activation_func`` set when ``layer_spec``'s MLP carries
    :class:`SwiGLU` and Megatron's plain SwiGLU would run otherwise; else ``config``."""
    mlp = getattr(layer_spec.submodules, "mlp", None)
    submodules = getattr(mlp, "submodules", None)
    if getattr(submodules, "activation_func", None) is not SwiGLU or config.use_te_activation_func:
        return config
    plain_swiglu = (config.gated_linear_unit and config.activation_func is F.silu
                    and not config.bias_activation_fusion and not config.add_bias_linear
                    and config.glu_linear_offset == 0.0 and config.activation_func_clamp_value is None)
    return dataclasses.replace(config, use_te_activation_func=True) if plain_swiglu else config
