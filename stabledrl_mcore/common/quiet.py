"""Warnings nobody can act on, silenced before megatron-core is first imported.

megatron-core warns at import that Transformer Engine / apex are absent (expected on CPU), and its
checkpoint loader uses torch.distributed.checkpoint APIs that torch marks deprecated. A CUDA build
of torch on a machine without the CUDA runtime (a CPU box with the cluster's wheel) logs "No CUDA
runtime is found" when megatron-core imports ``torch.utils.cpp_extension``; that would make every
one-line CLI error two lines.
"""

import logging
import warnings

for _text in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
    warnings.filterwarnings("ignore", message=_text, category=UserWarning)
for _text in ("`load_state_dict` is deprecated", "Please use DTensor instead"):
    warnings.filterwarnings("ignore", message=_text, category=FutureWarning)
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
