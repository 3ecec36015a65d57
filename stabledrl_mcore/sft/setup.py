"""Build an SFT run from an :class:`~.config.SFTConfig`: distributed start-up, tokenizer, data,
backbone (preset or ``model.checkpoint``), Megatron DDP, optimizer and LR schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from stabledrl_mcore.config.checks import check_lora_model
from stabledrl_mcore.engine.model_setup import build_policy, model_config
from stabledrl_mcore.engine.optimizer import build_optimizer
from stabledrl_mcore.engine.seeding import derive_seed
from stabledrl_mcore.parallel import bootstrap
from stabledrl_mcore.sft.checks import check_batch, check_data, sft_tokenizer
from stabledrl_mcore.sft.config import SFTConfig
from stabledrl_mcore.sft.data import SFTData, load_sft_data


def build_sft(cfg: SFTConfig):
    """Initialise distributed state and build everything :func:`~.trainer.train_sft` needs."""
    from megatron.core import parallel_state as ps

    p = cfg.parallel
    if p.threads:
        torch.set_num_threads(p.threads)
    bootstrap.initialize(
        p.tensor_parallel,
        1,
        seed=p.seed,
        timeout_minutes=p.timeout_minutes,
        backend=None if p.backend == "auto" else p.backend,
    )
    tokenizer = sft_tokenizer(cfg)
    data = load_sft_data(cfg.sft, tokenizer)
    mcfg = model_config(cfg, tokenizer)
    check_data(data, mcfg, "the model")
    bootstrap.validate_parallel_layout(
        torch.distributed.get_world_size(),
        p.tensor_parallel,
        1,
        num_layers=mcfg.num_layers,
        num_attention_heads=mcfg.num_attention_heads,
        num_query_groups=mcfg.num_query_groups,
    )
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    check_lora_model(cfg.model.lora, mcfg)
    model = build_policy(cfg, mcfg, dtype)
    ddp, optimizer, scheduler = build_optimizer(cfg, model, dtype, max(cfg.steps, 1))
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    check_batch(cfg, dp_size)
    rows = RowStream(len(data), cfg.sft.batch_size, dp_rank, dp_size, p.seed)
    block_size = int(mcfg.block_size) if mcfg.arch == "sdar" else None
    return SFTSetup(cfg, model, ddp, optimizer, scheduler, tokenizer, data, rows, dp_rank, dp_size, block_size)


class RowStream:
    """Rows of step ``s``: a seeded permutation per epoch, ``batch_size`` per step, split over DP ranks."""

    def __init__(self, num_rows: int, batch_size: int, dp_rank: int, dp_size: int, seed: int):
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def position(self, step: int) -> int:
        """Index of the first row of ``step`` in the endless stream (saved in checkpoints)."""
        return step * self.batch_size

    def for_step(self, step: int) -> torch.Tensor:
        local = self.batch_size // self.dp_size
        start = self.position(step) + self.dp_rank * local
        epochs = {}
        rows = []
        for index in range(start, start + local):
            epoch, offset = divmod(index, self.num_rows)
            if epoch not in epochs:
                g = torch.Generator(device="cpu").manual_seed(derive_seed(self.seed, "sft-rows", epoch))
                epochs[epoch] = torch.randperm(self.num_rows, generator=g)
            rows.append(int(epochs[epoch][offset]))
        return torch.tensor(rows, dtype=torch.long)


@dataclass
class SFTSetup:
    cfg: SFTConfig
    model: Any
    ddp: Any
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    data: SFTData
    prompts: RowStream  # the name train's checkpoint code reads (data position)
    dp_rank: int
    dp_size: int
    block_size: Optional[int]  # SDAR: the staircase layout; None: LLaDA's bidirectional forward
    reference: Any = None  # no KL reference in SFT (train's checkpoint code asks)
    preempted: bool = False
    stopped_early: bool = False
    finished: bool = False  # the loop reached its last step or its stop_when (only then does a rank exit 0)
