"""HF <-> Megatron-Core conversion: mapping tables, one engine, safetensors, loading and exports.

Where things are::

    convert.hf_to_mcore(hf_dir, out, model="llada", tp=2, pp=2)   # upstream dir -> torch_dist checkpoint
    convert.mcore_to_hf(ckpt, out)                                 # and back (safetensors + config + tokenizer)
    verify.verify(hf_dir, ckpt)                                    # logits of both sides compared
    loader.load_model(path)                                        # HF dir or converted ckpt -> logits module
    loader.load_hf_weights(model, hf_dir)                          # HF dir straight into a sharded model
    lora_io                                                        # LoRA exports: merged weights, PEFT adapters

Tables: :mod:`.mappings` (one per architecture), applied by :mod:`.engine`; HF configs:
:mod:`.hf_config`; safetensors reading and writing: :mod:`.safetensors_io`. Built on
:mod:`stabledrl_mcore.checkpoint`, which keeps the Megatron-side I/O (the layout of a converted
checkpoint: :mod:`stabledrl_mcore.checkpoint.mcore_io`) and a run's own state. The ``stabledrl
convert`` command: :mod:`stabledrl_mcore.cli.convert`. Until issue #76 these modules were
``stabledrl_mcore.checkpoint.<module>``.
"""
