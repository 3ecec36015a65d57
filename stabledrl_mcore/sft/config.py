"""The config of ``stabledrl sft``: the run sections of ``train`` plus an ``sft`` data section.

:class:`SFTConfig` reuses ``model``, ``parallel``, ``optim``, ``checkpoint`` and
``logging`` of :mod:`stabledrl_mcore.config.schema` (same fields, same meaning; one optimizer
update per step) and adds :class:`SFTSection`. Fields of those sections that only the
RL loop reads are refused by name when set (:data:`RL_ONLY`), so nothing is accepted
and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from stabledrl_mcore.config.schema import CheckpointSection, LoggingSection, ModelSection, OptimizerSection, ParallelSection
from stabledrl_mcore.config.io import get_dotted
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.checks import validate_logging_and_saving
from stabledrl_mcore.config.checks import choice

CHAT_TEMPLATES = ("auto", "never")
RL_ONLY = ("parallel.retain_update_graph",)
"""Fields of the shared sections with no meaning for SFT (refused unless left at their default)."""


@dataclass
class SFTSection:
    """The conversations to fine-tune on and how they become token rows."""

    data_path: Optional[str] = None
    """A local ``.jsonl``, ``.json``, ``.parquet`` or ``.csv`` file, a ``datasets.save_to_disk`` folder or a
    folder of ``<split>.<ext>`` files (required; the formats of ``rollout.data_path``, docs/data.md)."""
    split: str = "train"
    """The split of a folder of split files or of a saved ``DatasetDict`` (a file is read whatever it is)."""
    prompt_key: str = "prompt"
    """Column of the prompt text (prompt/response rows)."""
    response_key: str = "response"
    """Column of the answer text (prompt/response rows)."""
    messages_key: str = "messages"
    """Column of a chat (a list of ``{role, content}``; the last turn must be the assistant's
    answer, every earlier turn is prompt). Needs a tokenizer with a chat template."""
    chat_template: str = "auto"
    """``auto``: prompts go through the tokenizer's chat template when it has one (a user turn and
    the generation prompt, no system prompt), else as plain text; ``never``: always plain text."""
    batch_size: int = 16
    """Sequences per optimizer step over the whole job (split over data-parallel ranks, then into
    ``parallel.micro_batch_size`` micro-batches whose gradients accumulate)."""
    max_length: Optional[int] = None
    """Tokens per row (prompt + answer + EOS); every row is padded with EOS to this length (None:
    to the longest row of the data). A longer row is refused, naming it."""
    eps: float = 1e-3
    """Smallest mask probability: p = (1 - eps) t + eps (LLaDA)."""
    max_skipped_updates: Optional[int] = 10
    """Optimizer updates that may be skipped in a row (a non-finite loss or gradient on any rank skips
    it on every rank); one more ends the run with a non-zero exit, as does a run that applied none.
    None = no limit."""


@dataclass
class SFTConfig:
    """A masked-diffusion SFT run: ``steps`` optimizer steps on ``sft.data_path``."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optim: OptimizerSection = field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=lambda: LoggingSection(run_dir="runs/sft"))
    sft: SFTSection = field(default_factory=SFTSection)
    steps: int = 100
    """Optimizer steps to run."""

    def validate(self) -> "SFTConfig":
        """Check values that types alone cannot; raise :class:`ConfigError`."""
        choice("model.dtype", self.model.dtype, ("fp32", "bf16"))
        choice("parallel.backend", self.parallel.backend, ("auto", "nccl", "gloo"))
        choice("optim.name", self.optim.name, ("adam", "sgd"))
        choice("optim.decay_style", self.optim.decay_style, ("constant", "linear", "cosine"))
        choice("logging.wandb_mode", self.logging.wandb_mode, ("offline", "online", "disabled"))
        choice("sft.chat_template", self.sft.chat_template, CHAT_TEMPLATES)
        if not self.sft.data_path:
            raise ConfigError("sft.data_path is required: a JSONL or parquet file of prompt/response or "
                              "messages rows (or a datasets.save_to_disk folder)")
        for name in ("parallel.tensor_parallel", "parallel.micro_batch_size", "sft.batch_size",
                     "checkpoint.keep_last"):
            if get_dotted(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {get_dotted(self, name)}")
        if self.parallel.pipeline_parallel != 1:
            raise ConfigError(f"parallel.pipeline_parallel={self.parallel.pipeline_parallel}: SFT runs on "
                              f"tensor and data parallelism only; set it to 1")
        if self.parallel.expert_parallel != 1 or self.parallel.expert_tensor_parallel is not None:
            raise ConfigError("parallel.expert_parallel / expert_tensor_parallel: SFT runs on tensor and data "
                              "parallelism only (experts replicated); set them to 1 / null")
        if self.sft.max_length is not None and self.sft.max_length < 2:
            raise ConfigError(f"sft.max_length must be >= 2 or null, got {self.sft.max_length}")
        if not 0.0 <= self.sft.eps < 0.5:
            raise ConfigError(f"sft.eps must be in [0, 0.5), got {self.sft.eps}")
        if self.optim.distributed and self.optim.name != "adam":
            raise ConfigError(f"optim.distributed=true needs optim.name=adam; set optim.distributed=false "
                              f"for {self.optim.name!r}")
        if self.optim.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.optim.lr}")
        if self.sft.max_skipped_updates is not None and self.sft.max_skipped_updates < 0:
            raise ConfigError(f"sft.max_skipped_updates must be >= 0 or null, got {self.sft.max_skipped_updates}")
        if self.steps < 0 or self.checkpoint.save_every < 0:
            raise ConfigError("steps and checkpoint.save_every must be >= 0")
        validate_logging_and_saving(self.logging, self.checkpoint)
        defaults = SFTConfig(sft=SFTSection(data_path="-"))
        for name in RL_ONLY:
            if get_dotted(self, name) != get_dotted(defaults, name):
                raise ConfigError(f"{name} belongs to the RL loop ('stabledrl train'); SFT does not use it: "
                                  f"remove it")
        return self


