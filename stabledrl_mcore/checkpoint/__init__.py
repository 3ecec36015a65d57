"""Checkpoint formats: HF <-> Megatron-Core conversion (mapping tables + one engine) and training state.

Where things are::

    convert.hf_to_mcore(hf_dir, out, model="llada", tp=2, pp=2)   # upstream dir -> torch_dist checkpoint
    convert.mcore_to_hf(ckpt, out)                                 # and back (safetensors + config + tokenizer)
    loader.load_model(path)                                        # HF dir or converted ckpt -> logits module
    mcore_io.load_model_weights(model, ckpt)                       # into build_model() at any TP/PP
    loader.load_hf_weights(model, hf_dir)                          # HF dir straight into a sharded model
    mcore_io.save_model_checkpoint(model, out)                     # model-only checkpoint from any layout
    state.save_checkpoint / load_checkpoint                        # a training checkpoint (model, optimizer, RNG)

Layout of a converted checkpoint: :mod:`.mcore_io`; tables: :mod:`.mappings`; the ``stabledrl convert``
command: :mod:`stabledrl_mcore.cli.convert`.
"""
