"""Check a whole run config once, before any rank starts (``stabledrl train``, ``--print-config``).

:func:`preflight` checks what :meth:`RunConfig.validate` cannot without reading
files: the preset name, every path (``model.checkpoint``, ``model.tokenizer``,
``rollout.data_path``), the parallel layout against the model's own shape (from
the preset and ``model.overrides``, or the checkpoint's config), the rows each
rank holds against ``parallel.micro_batch_size``, the prompt format (``rollout.chat_template``
exists and renders), and the training (and held-out) examples: they load and are not empty; last,
that no other run holds ``logging.run_dir``'s lock (:mod:`~stabledrl_mcore.engine.run_lock`; a SLURM
requeue waits ``logging.lock_wait_s`` for its earlier instance). It builds no model and reads only
config files, safetensors headers and the data, so a bad run fails in seconds
with one line naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import json
import os
from dataclasses import dataclass
from typing import Optional

from stabledrl_mcore.checkpoint.info import MARKER, MODEL_CONFIG, read_checkpoint_info
from stabledrl_mcore.checkpoint.integrity import check_verifiable
from stabledrl_mcore.cli.memory_check import check_memory
from stabledrl_mcore.common.errors import ConfigError, DataError
from stabledrl_mcore.config.checks import (
    check_compile_cache_dir,
    check_layout,
    check_lora_model,
    check_model_options,
    check_pipeline_options,
)
from stabledrl_mcore.config.io import get_dotted
from stabledrl_mcore.config.schema import RunConfig
from stabledrl_mcore.convert import hf_config
from stabledrl_mcore.convert.safetensors_io import SafetensorsReader
from stabledrl_mcore.engine import metrics
from stabledrl_mcore.engine.resume import check_resume
from stabledrl_mcore.engine.run_lock import check_run_dir_unlocked
from stabledrl_mcore.models import DLLMConfig, ModelConfigError, available_presets, get_preset
from stabledrl_mcore.parallel.bootstrap import ParallelLayoutError, validate_parallel_layout
from stabledrl_mcore.sft.checks import check_batch, check_data, sft_tokenizer
from stabledrl_mcore.sft.config import SFTConfig
from stabledrl_mcore.sft.data import PlainText, SFTData, load_sft_data, read_rows, render
from stabledrl_mcore.tasks import GENERATED_TASKS
from stabledrl_mcore.tasks.from_config import build_task, check_prompt_lengths, heldout_examples, load_train_examples
from stabledrl_mcore.tasks.local_datasets import check_local
from stabledrl_mcore.tasks.tokenizer import load_tokenizer

_TOKEN_FIELDS = ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id")
_GENERATED_SAMPLE = 8  # generated tasks: a few examples prove the options work; the run draws its own


@dataclass
class PreflightReport:
    """What was checked; ``summary()`` is one line for the console."""

    model: str
    world_size: Optional[int]
    data_parallel: Optional[int]
    train_examples: int
    eval_examples: Optional[int] = None
    generated: bool = False
    """The task generates its examples: ``train_examples`` is the size of the sample checked."""

    def summary(self) -> str:
        layout = (
            f"world {self.world_size}, data-parallel {self.data_parallel}"
            if self.world_size
            else "world size unknown (give --nproc or run under torchrun/srun to check it)"
        )
        kind = "generated examples checked" if self.generated else "examples"
        data = f"train: {self.train_examples} {kind}" + (
            f", eval: {self.eval_examples} {kind}" if self.eval_examples is not None else ""
        )
        return f"preflight ok: {self.model}; {layout}; {data}"


def preflight(cfg: RunConfig, world_size: Optional[int] = None) -> PreflightReport:
    """Validate ``cfg`` against the files it names and the job's ``world_size`` (None = unknown).

    Raises :class:`ConfigError` (a field), :class:`~stabledrl_mcore.parallel.bootstrap.ParallelLayoutError`,
    :class:`DataError` or ``FileNotFoundError`` (data), each with a one-line message.
    """
    check_pipeline_options(cfg)
    resume = cfg.checkpoint.resume
    if resume not in ("none", "auto") and not os.path.isdir(resume):
        raise ConfigError(f"checkpoint.resume: {resume} is not a checkpoint directory (or use auto / none)")
    mcfg, description = model_shape(cfg)
    _check_tokenizer(cfg)
    _check_logging(cfg)
    check_compile_cache_dir(cfg)  # rollout.compile's graphs: a directory this user can create or write in
    try:
        data_parallel = check_layout(cfg, mcfg, world_size)
    except ParallelLayoutError as err:
        p = cfg.parallel
        experts = (
            f", parallel.expert_parallel={p.expert_parallel}"
            if p.expert_parallel > 1 or p.expert_tensor_parallel
            else ""
        )
        raise ParallelLayoutError(
            f"parallel.tensor_parallel={p.tensor_parallel}, parallel.pipeline_parallel="
            f"{p.pipeline_parallel}{experts} on {description}: {err}"
        ) from None
    check_model_options(cfg, mcfg, description)
    check_memory(cfg, mcfg, world_size)  # stabledrl plan's estimate of one rank against its device's memory
    for name in ("rollout.data_path", "eval.data_path"):  # local files only, refused by the field's name
        if get_dotted(cfg, name):
            check_local(get_dotted(cfg, name), name)
    task = _task(cfg)
    train = _load(cfg, task, "train")
    check_prompt_lengths(train, cfg, mcfg, "rollout")
    report = PreflightReport(
        description, world_size, data_parallel, len(train), generated=cfg.rollout.task in GENERATED_TASKS
    )
    if cfg.eval.every:
        heldout = _load(cfg, task, cfg.eval.split)  # a sample for generated tasks
        check_prompt_lengths(heldout, cfg, mcfg, "eval")
        report.eval_examples = len(heldout)
    check_run_dir_unlocked(cfg)  # another run in logging.run_dir (a requeue waits for its earlier instance)
    return report


def model_shape(cfg: RunConfig):
    """``(DLLMConfig, description)``: the checkpoint's or the preset's config with ``model.overrides``.

    Token ids of a random-init model come from its tokenizer at build time; they are not checked here.
    """

    if cfg.model.preset not in available_presets():
        close = difflib.get_close_matches(cfg.model.preset, available_presets(), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(
            f"model.preset: unknown preset {cfg.model.preset!r}{hint} (choose from {', '.join(available_presets())})"
        )
    if cfg.model.checkpoint:
        base = checkpoint_config(cfg.model.checkpoint, trust_unverified=cfg.checkpoint.trust_unverified)
        description = f"model.checkpoint {cfg.model.checkpoint}"
    else:
        base, description = get_preset(cfg.model.preset), f"model.preset {cfg.model.preset}"
    names = [f.name for f in dataclasses.fields(DLLMConfig)]
    for key in cfg.model.overrides:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"model.overrides: {key!r} is not a DLLMConfig field{hint}")
    changes = dict(cfg.model.overrides)
    if not cfg.model.checkpoint:
        changes.update({k: None for k in _TOKEN_FIELDS if k not in cfg.model.overrides})
    try:
        mcfg = dataclasses.replace(base, **changes).validate()
    except (ModelConfigError, TypeError) as err:
        raise ConfigError(f"model.overrides do not fit {description}: {err}") from None
    shape = (
        f"{mcfg.arch}, {mcfg.num_layers} layers, {mcfg.num_attention_heads} heads, {mcfg.num_query_groups} query groups"
    )
    return mcfg, f"{description} ({shape})"


def checkpoint_config(path: str, *, trust_unverified: bool = False):
    """The :class:`DLLMConfig` of an HF directory, a converted or a training checkpoint; a missing
    or unrecognised directory is a :class:`ConfigError` naming ``model.checkpoint``, one that would
    not load (a link, a FIFO, no ``checksums.json``: :func:`~..checkpoint.integrity.check_verifiable`)
    a :class:`CheckpointError`."""

    if not os.path.exists(path):
        raise ConfigError(
            f"model.checkpoint: {path} does not exist (give an HF model directory, a "
            f"converted checkpoint from 'stabledrl convert hf-to-mcore', or a training "
            f"checkpoint step_*; or unset it for a random init)"
        )
    if not os.path.isdir(path):
        raise ConfigError(f"model.checkpoint: {path} is a file, not a model directory")
    if os.path.isfile(os.path.join(path, MARKER)):
        check_verifiable(path, trust_unverified=trust_unverified)  # as load_weights does, before any read
        return read_checkpoint_info(path).config
    if os.path.isfile(os.path.join(path, MODEL_CONFIG)) and os.path.isfile(os.path.join(path, ".metadata")):
        check_verifiable(path, trust_unverified=trust_unverified)
        with open(os.path.join(path, MODEL_CONFIG)) as handle:  # a training checkpoint
            return DLLMConfig.from_dict(json.load(handle))
    if os.path.isfile(os.path.join(path, "config.json")):
        SafetensorsReader(path)  # headers only: a missing or truncated weight file fails here
        return hf_config.hf_to_dllm_config(hf_config.read_hf_config(path), source_dir=path)
    raise ConfigError(
        f"model.checkpoint: {path} is not a model directory (no config.json, {MARKER} or {MODEL_CONFIG} + .metadata)"
    )


def _has_tokenizer(path: str) -> bool:
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, "tokenizer.json")) or bool(glob.glob(os.path.join(path, "*.model")))
    return path.endswith(".model") and os.path.isfile(path)


def _check_tokenizer(cfg: RunConfig) -> None:
    """``model.tokenizer``, else the checkpoint's own (also under ``hf/``); random init trains one."""
    if cfg.model.tokenizer:
        if not _has_tokenizer(cfg.model.tokenizer):
            raise ConfigError(
                f"model.tokenizer: no tokenizer at {cfg.model.tokenizer} (a directory with "
                f"tokenizer.json or a sentencepiece *.model, or a *.model file)"
            )
        return
    path = cfg.model.checkpoint
    if path and not (_has_tokenizer(path) or _has_tokenizer(os.path.join(path, "hf"))):
        raise ConfigError(
            f"model.checkpoint {path} holds no tokenizer (tokenizer.json or *.model, "
            f"also looked in {os.path.join(path, 'hf')}); set model.tokenizer=DIR"
        )


def _check_logging(cfg: RunConfig) -> None:
    if cfg.logging.wandb_mode != "disabled" and not metrics.wandb_available():
        raise ConfigError(metrics.WANDB_MISSING.format(mode=cfg.logging.wandb_mode))
    if cfg.logging.tensorboard and not metrics.tensorboard_available():
        raise ConfigError(
            "logging.tensorboard=true needs the tensorboard package: pip install tensorboard "
            "(or set logging.tensorboard=false)"
        )


def _task(cfg: RunConfig):
    """The run's task as every rank builds it (``rollout.reward_fn`` is imported here once)."""

    try:
        return build_task(cfg)  # also checks the prompt template / chat template file renders
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"rollout.task_options of task {cfg.rollout.task!r}: {err}") from None


def _load(cfg: RunConfig, task, split: str) -> list:
    """The examples of ``split`` as training (``train``) or held-out evaluation would load them
    (a generated task draws a few: generating the run's thousands belongs to the run)."""

    generated = cfg.rollout.task in GENERATED_TASKS
    what = "training" if split == "train" else f"eval.split={split}"
    try:
        if split == "train":
            examples = load_train_examples(cfg, task, sample=_GENERATED_SAMPLE if generated else None)
        elif generated and not cfg.eval.data_path:
            examples = task.load(split, n=min(cfg.eval.num_examples, _GENERATED_SAMPLE), seed=cfg.eval.seed)
        else:
            examples = heldout_examples(cfg, task)
    except (DataError, FileNotFoundError):
        raise
    except ValueError as err:  # a generated task's own refusal (e.g. a path, a split it lacks)
        raise ConfigError(f"rollout.task={cfg.rollout.task} ({what} data): {err}") from None
    if not examples:
        source = f"rollout.data_path={cfg.rollout.data_path}" if cfg.rollout.data_path else f"task {task.name}"
        raise DataError(f"{source}: the {what} data holds no examples")
    return examples


def preflight_sft(cfg: SFTConfig, world_size: Optional[int] = None) -> str:
    """Validate ``cfg`` against the files it names and ``world_size`` (None = unknown); one-line summary."""

    resume = cfg.checkpoint.resume
    if resume not in ("none", "auto") and not os.path.isdir(resume):
        raise ConfigError(f"checkpoint.resume: {resume} is not a checkpoint directory (or use auto / none)")
    mcfg, description = model_shape(cfg)
    check_lora_model(cfg.model.lora, mcfg, description)
    _check_tokenizer(cfg)
    _check_logging(cfg)
    p = cfg.parallel
    try:
        data_parallel = validate_parallel_layout(
            world_size or p.tensor_parallel,
            p.tensor_parallel,
            1,
            num_layers=mcfg.num_layers,
            num_attention_heads=mcfg.num_attention_heads,
            num_query_groups=mcfg.num_query_groups,
        )
    except ParallelLayoutError as err:
        raise ParallelLayoutError(f"parallel.tensor_parallel={p.tensor_parallel} on {description}: {err}") from None
    if world_size is not None:
        check_batch(cfg, data_parallel)
    data = _sft_data(cfg)
    if isinstance(data, SFTData):
        if cfg.model.checkpoint:  # a random-init model's vocabulary is its tokenizer's
            check_data(data, mcfg, description)
        rows = f"{len(data)} rows of {data.ids.shape[1]} tokens, {int(data.answer.sum())} answer tokens"
    else:
        rows = f"{data} rows"
    check_run_dir_unlocked(cfg)
    check_resume(cfg)
    layout = f"data-parallel {data_parallel}" if world_size is not None else "world size unknown"
    return f"preflight ok: {description}; {layout}; sft data {cfg.sft.data_path}: {rows}"


def _sft_data(cfg: SFTConfig):
    """The encoded data with the run's tokenizer when it exists already; else the number of rows
    (each rendered as plain text: a random-init run trains its tokenizer at start-up)."""

    trained = os.path.join(cfg.logging.run_dir, "tokenizer")
    if cfg.model.tokenizer or cfg.model.checkpoint or os.path.isdir(trained):
        tokenizer = sft_tokenizer(cfg) if (cfg.model.tokenizer or cfg.model.checkpoint) else load_tokenizer(trained)
        return load_sft_data(cfg.sft, tokenizer)
    count = 0
    for where, row in read_rows(cfg.sft):
        render(row, where, cfg.sft, PlainText())
        count += 1
    if not count:
        raise DataError(f"sft.data_path={cfg.sft.data_path} holds no rows")
    return count
