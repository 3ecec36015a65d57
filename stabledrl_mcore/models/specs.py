"""Layer specs: a Megatron-Core GPT layer whose only dLLM change is the core attention.

The layer (pre-norm attention + SwiGLU MLP, RMSNorm, optional per-head q/k
RMSNorm) is Megatron's own ``TransformerLayer``; the diffusion LM differs from an
autoregressive LM only in which keys a query may see, which lives in
:class:`~stabledrl_mcore.models.attention.SDPACoreAttention` and the mask passed
to it. The local spec serves CPU; on GPU with Transformer Engine installed
``te_available()`` selects TE's fused linears/norms, with the same checkpoint
keys (Megatron maps the local names to the TE names in ``sharded_state_dict``).
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from stabledrl_mcore.models import moe
from stabledrl_mcore.models.attention import HeadsMajorRotarySelfAttention, SDPACoreAttention
from stabledrl_mcore.models.gated_mlp import GateUpColumnParallelLinear, SwiGLU
from stabledrl_mcore.models.linear import AutogradColumnParallelLinear, AutogradRowParallelLinear


class SpecError(RuntimeError):
    """The requested layer spec cannot be built on this machine."""


def te_unavailable_reason() -> str | None:
    """Why Megatron-Core cannot build its Transformer Engine spec here, or None if it can.

    The test is Megatron's own ``gpt_layer_specs.HAVE_TE`` (TE imported *and*
    ``megatron.core.extensions.transformer_engine`` imported against it), not a bare
    ``import transformer_engine``: a TE version that Megatron cannot use leaves
    ``HAVE_TE`` False, and its spec function would then fail with a ``NameError``.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not getattr(gpt_layer_specs, "HAVE_TE", False):
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            return "transformer_engine is not installed (pip install -e .[gpu])"
        return (
            "transformer_engine is installed but megatron.core.extensions.transformer_engine "
            "does not import with it (a version mismatch with megatron-core)"
        )
    return None


def te_available() -> bool:
    """True when Megatron-Core can use Transformer Engine here (CUDA and Megatron's ``HAVE_TE``)."""
    return te_unavailable_reason() is None


def dllm_layer_spec(
    *, qk_layernorm: bool = False, use_te: bool | None = None, stock_local: bool = False, num_experts: int | None = None
) -> ModuleSpec:
    """The transformer-layer spec for LLaDA (``qk_layernorm=False``) and SDAR (``True``).

    Megatron's own GPT layer (local or TE flavour) with ``attn_mask_type=arbitrary``
    and :class:`SDPACoreAttention` as core attention (``SelfAttention`` calls the
    class directly, so its ``backend`` is set by the model after construction). The
    local flavour's linears are Megatron's with a plain-autograd matmul where nothing
    is fused into it (:mod:`.linear`), and its self-attention rotates q/k with cos/sin
    computed once per forward (:class:`HeadsMajorRotarySelfAttention`, which then
    takes :func:`~.rope.rotary_cos_sin` as ``rotary_pos_emb``), and its MLP's fc1
    returns gate and up as separate tensors to a :class:`~.gated_mlp.SwiGLU` activation
    module (where Megatron's fused SwiGLU is off; :class:`DLLMModel` switches it on);
    names and checkpoints are unchanged. ``num_experts``: the MLP is Megatron's ``MoELayer``
    (router + experts: TE's grouped GEMM on the TE spec, Megatron's ``SequentialMLP`` of stock local
    expert MLPs otherwise; both write one checkpoint layout, see :mod:`.moe`). ``stock_local=True`` keeps Megatron's own local
    linears, ``SelfAttention`` and MLP (only the core attention is ours): the reference that
    ``tools/bench_backbone.py --reference stock-megatron`` times the local spec against.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    reason = te_unavailable_reason() if use_te is not False else None
    if use_te and reason:
        raise SpecError(
            f"use_te=True but the Transformer Engine spec cannot be built: {reason}; "
            "use the local spec (use_te=None or False)"
        )
    use_te = reason is None if use_te is None else use_te
    if num_experts is not None:
        pass
    if use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None, qk_layernorm=qk_layernorm
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm, normalization="RMSNorm"
        )
    spec = copy.deepcopy(spec)
    if num_experts is not None:
        spec.submodules.mlp.module = moe.DLLMMoELayer  # trainable at TP > 1 (see .moe)
        # Megatron's local spec saves the MLP norm under the dense fused name (mlp.linear_fc1.
        # layer_norm_weight) even for MoE layers, whose TE spec saves pre_mlp_layernorm: keep the
        # real name so one checkpoint serves both
        spec.submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.", None)
    attention = spec.submodules.self_attention
    attention.params = dict(attention.params or {}, attn_mask_type=AttnMaskType.arbitrary)
    attention.submodules.core_attention = SDPACoreAttention
    if not use_te and not stock_local:
        attention.module = HeadsMajorRotarySelfAttention  # rotation with shared cos/sin (see .rope)
        # the local linears, with a plain matmul where nothing is fused (see .linear)
        attention.submodules.linear_qkv = AutogradColumnParallelLinear
        attention.submodules.linear_proj = AutogradRowParallelLinear
        if num_experts is None:  # the experts keep Megatron's stock MLPs (per-token probabilities)
            mlp = spec.submodules.mlp.submodules
            mlp.linear_fc1, mlp.linear_fc2 = GateUpColumnParallelLinear, AutogradRowParallelLinear
            mlp.activation_func = SwiGLU  # fc1 hands it gate and up apart (see .gated_mlp)
    return spec
