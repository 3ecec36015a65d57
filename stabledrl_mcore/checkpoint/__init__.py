"""Checkpoint formats on the Megatron side: model-only checkpoints, a run's training state, optimizer state.

Where things are::

    mcore_io.load_model_weights(model, ckpt)                       # into build_model() at any TP/PP
    mcore_io.save_model_checkpoint(model, out)                     # model-only checkpoint from any layout
    state.save_checkpoint / load_checkpoint                        # a training checkpoint (model, optimizer, RNG)

Layout of a model-only (converted) checkpoint: :mod:`.mcore_io`; what it holds, read without a model:
:mod:`.info`. HF <-> Megatron conversion (mapping tables, the engine, safetensors, ``load_model``,
LoRA exports) is the package above, :mod:`stabledrl_mcore.convert`.
"""
