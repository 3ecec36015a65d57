"""Mixture-of-experts layers: Megatron-Core's ``MoELayer`` inside the dLLM layer spec.

The attention (bidirectional, block-causal, staircase) is unchanged; only each layer's MLP
becomes router + experts (:func:`~.specs.dllm_layer_spec` with ``num_experts``; routing in
:func:`~.presets.moe_transformer_config`). Expert parallelism splits the experts over
``parallel.expert_parallel`` ranks of the data-parallel dimension (Megatron's expert grid:
``world = PP x ETP x EP x expert-DP``); tokens go to their experts' ranks and back by
all-to-all in every layer, so the ranks of one expert-parallel group must run the same
number of forwards (see :mod:`stabledrl_mcore.parallel.expert`).

Checkpoint layout: Megatron's ``SequentialMLP`` (CPU) and TE's grouped experts (GPU) both write
``decoder.layers.L.mlp.experts.experts.linear_fc{1,2}.weight`` sharded along a global expert axis, so
a checkpoint converted or saved on one loads on the other and at any expert-parallel size.

megatron-core 0.16.1 fix: ``moe_utils`` names ``te_general_gemm`` in the router's gating linear
but binds it only when Transformer Engine imports, so without TE every router forward raised
``NameError``; importing this module binds it to None (the torch matmul path, as intended).
"""

from __future__ import annotations

from megatron.core.transformer.moe import moe_utils

if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402


class DLLMMoELayer(MoELayer):
    """Megatron's ``MoELayer``, also trainable at TP > 1 without sequence parallelism.

    Megatron refuses that combination in training ("performance may degrade"): every
    tensor-parallel rank then routes the same tokens, so the experts see each token once per TP
    rank. The result is the same (each copy returns to its own rank; the parity tests check
    EP=2 x TP=2 against one process), only the expert work is repeated. The dLLM's forwards
    (prompt prefixes, 4-token blocks against a KV cache, staircase rows) have lengths that need not
    divide by TP, which sequence parallelism requires, so this model runs without it; MoE recipes
    use TP=1 (the attention of SDAR-30B-A3B is small) and spread the experts instead.
    Only the layer's own ``training`` flag is lowered around the call: the router below keeps
    its own (the auxiliary and z-losses are computed in training as configured).
    """

    def forward(self, hidden_states, *args, **kwargs):
        if not (self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel):
            return super().forward(hidden_states, *args, **kwargs)
        self.training = False
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self.training = True
