"""Masked-diffusion supervised fine-tuning (``stabledrl sft``): LLaDA's SFT recipe, SDAR's
block variant through the staircase layout. See docs/sft.md.

The config, the data and the checks before any rank starts import without megatron-core
(``stabledrl sft --print-config``); the set-up and the loop (``_ON_MEGATRON``) load on first use.
"""

import importlib

from stabledrl_mcore.sft.config import SFTConfig, SFTSection
from stabledrl_mcore.sft.data import SFTData, encode_rows, load_sft_data

_ON_MEGATRON = {
    "SFTSetup": "stabledrl_mcore.sft.setup",
    "sft_update": "stabledrl_mcore.sft.trainer",
    "train_sft": "stabledrl_mcore.sft.trainer",
}
"""Names whose modules import megatron-core: loaded by :func:`__getattr__`."""


def __getattr__(name: str):
    """``sft.train_sft``, ``sft.sft_update``, ``sft.SFTSetup``, imported on first use."""
    if name in _ON_MEGATRON:
        value = getattr(importlib.import_module(_ON_MEGATRON[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'stabledrl_mcore.sft' has no attribute {name!r}")


__all__ = ["SFTConfig", "SFTData", "SFTSection", "SFTSetup", "encode_rows", "load_sft_data", "sft_update", "train_sft"]
