"""Masked-diffusion supervised fine-tuning (``stabledrl sft``): LLaDA's SFT recipe, SDAR's
block variant through the staircase layout. See docs/sft.md."""

from stabledrl_mcore.sft.config import SFTConfig, SFTSection  # noqa: F401
from stabledrl_mcore.sft.data import SFTData, encode_rows, load_sft_data  # noqa: F401
from stabledrl_mcore.sft.setup import SFTSetup  # noqa: F401 (API)
from stabledrl_mcore.sft.trainer import sft_update, train_sft  # noqa: F401
