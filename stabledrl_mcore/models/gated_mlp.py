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
:func:`with_module_activation` sets it for a spec carrying :class:`SwiGLU` where
Megatron's plain or fused SwiGLU would run otherwise (not with biases). With the fused
kernel on (``bias_activation_fusion``: GPU and large CPU models), training forwards
keep it (fc1's fused output into Megatron's ``bias_swiglu_impl``, whose backward writes
both halves' gradients at once), while forwards without autograd (rollouts,
old-policy likelihoods) take the split path: the compiled kernel's per-call dispatch
(~0.4 ms on CPU) exceeds the whole activation of a 4..32-token decoding forward (8% of
an SDAR block-decoding rollout at hidden 512). Without the switch both classes fall
back to Megatron's behaviour: fc1 returns the usual ``[s, b, 2 * ffn]``.
fc1 splits only where its matmul is a plain ``F.linear`` (see :mod:`.linear`: TP=1,
no sequence parallelism); otherwise :class:`SwiGLU` chunks the fused output itself.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from stabledrl_mcore.models.linear import AutogradColumnParallelLinear, _plain_matmul_applies


class GateUpColumnParallelLinear(AutogradColumnParallelLinear):
    """The MLP's fc1: ``(x W_gate^T, x W_up^T)`` from its weight's two row blocks when
    the MLP's activation is :class:`SwiGLU`, else Megatron's ``[..., 2 * ffn]`` output."""

    split_gate_up = True  # False: always the fused output (tests compare both)

    def _forward_impl(self, input, weight, *args, **kwargs):
        fused_training = fused_swiglu(self.config) and torch.is_grad_enabled()
        if (
            self.split_gate_up
            and self.config.use_te_activation_func
            and not fused_training
            and not args
            and _plain_matmul_applies(kwargs)
            and kwargs.get("bias") is None
        ):
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
        elif fused_swiglu(self.config) and torch.is_grad_enabled():
            from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
            from megatron.core.transformer.mlp import HAVE_TE

            offload = self.config.cpu_offloading and self.config.cpu_offloading_activations and HAVE_TE
            return bias_swiglu_impl(fc1_output, None, self.config.activation_func_fp8_input_store, offload)
        else:
            gate, up = torch.chunk(fc1_output, 2, dim=-1)
        return F.silu(gate) * up


FUSED_SWIGLU_ATTR = "dllm_fused_swiglu"
"""Attribute :func:`with_module_activation` sets on the config it returns: whether training
forwards run Megatron's fused SwiGLU kernel (Megatron refuses ``bias_activation_fusion``
together with ``use_te_activation_func``, so the choice travels beside them)."""


def fused_swiglu(config) -> bool:
    """Whether :class:`SwiGLU` runs Megatron's fused kernel when autograd records."""
    return bool(getattr(config, FUSED_SWIGLU_ATTR, False))


def with_module_activation(config, layer_spec):
    """``config`` with ``use_te_activation_func`` set when ``layer_spec``'s MLP carries
    :class:`SwiGLU` and Megatron's plain or fused SwiGLU would run otherwise (the fused
    choice moved to :func:`fused_swiglu`); else ``config``."""
    mlp = getattr(layer_spec.submodules, "mlp", None)
    submodules = getattr(mlp, "submodules", None)
    if getattr(submodules, "activation_func", None) is not SwiGLU or config.use_te_activation_func:
        return config
    swiglu = (
        config.gated_linear_unit
        and config.activation_func is F.silu
        and not config.add_bias_linear
        and config.glu_linear_offset == 0.0
        and config.activation_func_clamp_value is None
    )
    if not swiglu:
        return config
    fused = config.bias_activation_fusion
    config = dataclasses.replace(config, use_te_activation_func=True, bias_activation_fusion=False)
    setattr(config, FUSED_SWIGLU_ATTR, fused)
    return config
