"""The SFT checks that need no model, run by the preflight (before any rank starts) and by
:func:`~.setup.build_sft` on every rank: the tokenizer, the data against the model's vocabulary and
positions, the batch against the data-parallel ranks. Imports no megatron-core."""

from __future__ import annotations

import os

import torch

from stabledrl_mcore.common.errors import ConfigError, DataError
from stabledrl_mcore.sft.config import SFTConfig
from stabledrl_mcore.sft.data import SFTData, tokenizer_corpus
from stabledrl_mcore.tasks.tokenizer import load_tokenizer, train_sentencepiece


def sft_tokenizer(cfg: SFTConfig):
    """``model.tokenizer``, else the checkpoint's (also under ``hf/``), else (random init) a tiny
    sentencepiece tokenizer trained on the data into ``<run_dir>/tokenizer`` by rank 0."""

    path = cfg.model.tokenizer or cfg.model.checkpoint
    if path and not cfg.model.tokenizer and os.path.isdir(os.path.join(path, "hf")):
        path = os.path.join(path, "hf")
    if path:
        return load_tokenizer(path)
    target = os.path.join(cfg.logging.run_dir, "tokenizer")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0 and not os.path.isdir(target):
        train_sentencepiece(tokenizer_corpus(cfg.sft), target + ".tmp", vocab_size=64)
        os.replace(target + ".tmp", target)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return load_tokenizer(target)


def check_data(data: SFTData, mcfg, description: str) -> None:
    """Token ids inside the model's vocabulary, rows inside its learned positions (if it has them)."""
    top = int(data.ids.max())
    if top >= mcfg.vocab_size:
        raise DataError(
            f"{data.source}: token id {top} is outside {description}'s vocabulary "
            f"({mcfg.vocab_size}); use the model's own tokenizer (model.tokenizer)"
        )
    if mcfg.position_embedding == "learned" and data.ids.shape[1] > mcfg.max_position_embeddings:
        raise DataError(
            f"{data.source}: rows of {data.ids.shape[1]} tokens exceed {description}'s "
            f"max_position_embeddings={mcfg.max_position_embeddings}; set sft.max_length (and shorten "
            f"the longer rows)"
        )


def check_batch(cfg: SFTConfig, data_parallel: int) -> None:
    """``sft.batch_size`` splits over the data-parallel ranks and then into micro-batches."""

    batch, micro = cfg.sft.batch_size, cfg.parallel.micro_batch_size
    if batch % data_parallel or (batch // data_parallel) % micro:
        raise ConfigError(
            f"sft.batch_size={batch} must split into {data_parallel} data-parallel rank(s) of "
            f"whole parallel.micro_batch_size={micro} micro-batches (batch_size / DP a multiple "
            f"of micro_batch_size)"
        )
