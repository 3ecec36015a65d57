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

from stabledrl_mcore.config.checks import CHAT_TEMPLATES, RL_ONLY, validate_sft_config  # noqa: F401 (API)
from stabledrl_mcore.config.schema import (
    CheckpointSection,
    LoggingSection,
    ModelSection,
    OptimizerSection,
    ParallelSection,
)


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
        """Check values that types alone cannot (:func:`~stabledrl_mcore.config.checks.validate_sft_config`)."""
        return validate_sft_config(self)
