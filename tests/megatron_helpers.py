"""A small Megatron-Core GPT (our dLLM layer spec) shared by the multi-rank tests."""

import torch


def build_tiny_gpt(tp, pp, *, layers=4, vocab=64, seq=12, parallel_output=True):
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from stabledrl_mcore.models.specs import dllm_layer_spec

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        bf16=False,
    )
    model = GPTModel(
        config,
        dllm_layer_spec(),
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        parallel_output=parallel_output,
    )
    return config, model


def assert_same_tensors(got, ref, what, tol=0.0):
    """Nested dicts of tensors equal: bitwise (and same dtype), or to ``tol`` in absolute value."""
    assert got.keys() == ref.keys(), f"{what}: keys {sorted(got)} != {sorted(ref)}"
    for key in ref:
        a, b = got[key], ref[key]
        if isinstance(a, dict):
            assert_same_tensors(a, b, f"{what}[{key}]", tol)
        elif tol:
            diff = (a.float() - b.float()).abs().max().item()
            assert diff <= tol, f"{what}[{key}] differs by {diff}"
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), f"{what}[{key}] is not bitwise equal"
