"""stabledrl_mcore: StableDRL post-training of diffusion language models on Megatron-Core.

The layers, bottom up (docs/architecture.md; tests/test_layers.py keeps them): ``common``,
``parallel``, ``algorithms``, ``tasks``, ``config``, ``models``, ``diffusion``, ``checkpoint``,
``convert``, ``engine``, ``evaluation``, ``rl``, ``sft``, ``bench``, ``experiments``, ``cli``.
"""

import importlib

import stabledrl_mcore.common.quiet  # noqa: F401  (before anything imports megatron-core)
from stabledrl_mcore.common.version import __version__  # noqa: F401  (the package API)

_LAZY = {"load_model": "stabledrl_mcore.convert.loader"}
"""Top-level names loaded on first use, so ``import stabledrl_mcore`` (and ``stabledrl --help``)
does not load torch and megatron-core."""


def __getattr__(name: str):
    """``stabledrl_mcore.load_model``: HF directory or converted checkpoint -> single-process logits
    module (:func:`stabledrl_mcore.convert.loader.load_model`)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stabledrl_mcore' has no attribute {name!r}")
