"""Check an SFT config before any rank starts: model, tokenizer, layout, data, run directory.

Reads only config files, safetensors headers, the tokenizer and the data (every row is
rendered and, with a known tokenizer, tokenized), so a bad run fails in seconds with one
line naming the field, file or row.
"""

from __future__ import annotations

import os
from typing import Optional

from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.parallel.bootstrap import ParallelLayoutError
from stabledrl_mcore.sft.config import SFTConfig
from stabledrl_mcore.sft.data import PlainText, SFTData, load_sft_data, read_rows, render


def preflight_sft(cfg: SFTConfig, world_size: Optional[int] = None) -> str:
    """Validate ``cfg`` against the files it names and ``world_size`` (None = unknown); one-line summary."""
    from stabledrl_mcore.engine.resume import preflight as check_run_directory
    from stabledrl_mcore.parallel.bootstrap import validate_parallel_layout
    from stabledrl_mcore.cli.preflight import _check_logging, _check_tokenizer, model_shape
    from stabledrl_mcore.sft.setup import check_batch, check_data

    resume = cfg.checkpoint.resume
    if resume not in ("none", "auto") and not os.path.isdir(resume):
        raise ConfigError(f"checkpoint.resume: {resume} is not a checkpoint directory (or use auto / none)")
    mcfg, description = model_shape(cfg)
    _check_tokenizer(cfg)
    _check_logging(cfg)
    p = cfg.parallel
    try:
        data_parallel = validate_parallel_layout(
            world_size or p.tensor_parallel, p.tensor_parallel, 1, num_layers=mcfg.num_layers,
            num_attention_heads=mcfg.num_attention_heads, num_query_groups=mcfg.num_query_groups)
    except ParallelLayoutError as err:
        raise ParallelLayoutError(f"parallel.tensor_parallel={p.tensor_parallel} on {description}: {err}") from None
    if world_size is not None:
        check_batch(cfg, data_parallel)
    data = _data(cfg)
    if isinstance(data, SFTData):
        if cfg.model.checkpoint:  # a random-init model's vocabulary is its tokenizer's
            check_data(data, mcfg, description)
        rows = f"{len(data)} rows of {data.ids.shape[1]} tokens, {int(data.answer.sum())} answer tokens"
    else:
        rows = f"{data} rows"
    check_run_directory(cfg)
    layout = f"data-parallel {data_parallel}" if world_size is not None else "world size unknown"
    return f"preflight ok: {description}; {layout}; sft data {cfg.sft.data_path}: {rows}"


def _data(cfg: SFTConfig):
    """The encoded data with the run's tokenizer when it exists already; else the number of rows
    (each rendered as plain text: a random-init run trains its tokenizer at start-up)."""
    from stabledrl_mcore.tasks.tokenizer import load_tokenizer
    from stabledrl_mcore.sft.setup import sft_tokenizer

    trained = os.path.join(cfg.logging.run_dir, "tokenizer")
    if cfg.model.tokenizer or cfg.model.checkpoint or os.path.isdir(trained):
        tokenizer = sft_tokenizer(cfg) if (cfg.model.tokenizer or cfg.model.checkpoint) else load_tokenizer(trained)
        return load_sft_data(cfg.sft, tokenizer)
    count = 0
    for where, row in read_rows(cfg.sft):
        render(row, where, cfg.sft, PlainText())
        count += 1
    if not count:
        from stabledrl_mcore.common.errors import DataError

        raise DataError(f"sft.data_path={cfg.sft.data_path} holds no rows")
    return count
