"""Typed run configuration: one dataclass per concern, YAML + dotted overrides.

A run is described by :class:`RunConfig`; each section is documented field by
field. Load with :func:`load_config` (``YAML file`` + ``["algo.eps=0.1", ...]``),
validated once; :func:`save_config` writes the resolved config that is stored
beside every checkpoint. Unknown keys name the closest valid ones; wrong types
name the field and the expected type.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml


class ConfigError(ValueError):
    """The configuration cannot be used as written."""


@dataclass
class ModelSection:
    """Which backbone to train and where its weights come from."""

    preset: str = "llada-tiny"
    """Architecture preset (``stabledrl_mcore.models.available_presets()``), e.g. ``llada-8b``."""
    overrides: Dict[str, Any] = field(default_factory=dict)
    """Fields of the preset's ``DLLMConfig`` to replace, e.g. ``{num_layers: 2}``."""
    checkpoint: Optional[str] = None
    """A converted Megatron checkpoint or a Hugging Face directory to start from; None = random init."""
    tokenizer: Optional[str] = None
    """Tokenizer directory (HF ``tokenizer.json`` or sentencepiece ``*.model``); None = beside the checkpoint."""
    dtype: str = "fp32"
    """Parameter/compute dtype: ``fp32`` or ``bf16`` (bf16 is the GPU default in the 8B recipes)."""
    recompute: bool = False
    """Full activation recompute of every transformer layer (saves memory, costs ~30% compute)."""


@dataclass
class ParallelSection:
    """How the job is laid out over ranks. Data-parallel size = world / (TP x PP)."""

    tensor_parallel: int = 1
    """Tensor-parallel size (heads, query groups and vocab must divide by it)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (layers must divide by it)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward micro-batch on one rank."""
    backend: str = "auto"
    """``auto`` (NCCL with CUDA, gloo without), ``nccl`` or ``gloo``."""
    timeout_minutes: int = 30
    """Collective time-out before a stuck job fails."""
    threads: Optional[int] = None
    """torch intra-op threads per rank (None = torch's default). 1 is fastest for tiny CPU models."""
    seed: int = 1234
    """Base seed; pipeline stages offset it, TP ranks get distinct dropout streams."""
    retain_update_graph: bool = False
    """Inner iterations after the first keep their scoring forward's graph for the backward
    instead of scoring without gradients and running the forward again: one forward less per
    iteration, but activations of the whole rank batch x ``algo.num_mc`` are held at once."""


@dataclass
class RolloutSection:
    """Prompt sampling and generation (phase 1 of a step)."""

    task: str = "sudoku"
    """Task name (``stabledrl_mcore.tasks.available_tasks()``)."""
    data_path: Optional[str] = None
    """Local data file or root for file-backed tasks (GSM8K, MATH500)."""
    data_seed: Optional[int] = None
    """Seed of generated prompt pools (Sudoku, Countdown); None = ``parallel.seed``."""
    prompt_style: str = "chat"
    """``chat`` (system prompt + the tokenizer's chat template) or ``compact`` (bare puzzle, tiny models)."""
    task_options: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task, e.g. ``{blanks: [6, 10], solved_bonus: 1.0}`` for sudoku."""
    prompts_per_step: int = 16
    """Prompts per optimizer step over the whole job (split over data-parallel ranks)."""
    group_size: int = 8
    """Completions per prompt (G)."""
    gen_length: int = 64
    """New tokens per completion."""
    steps: int = 32
    """Diffusion denoising steps per completion."""
    block_length: int = 32
    """Semi-autoregressive block length (LLaDA) / decoding block (SDAR uses the model's block size)."""
    temperature: float = 0.9
    """Gumbel sampling temperature; 0 = greedy."""
    threshold: Optional[float] = None
    """SDAR dynamic confidence threshold (e.g. 0.9); None = fixed schedule."""


@dataclass
class AlgorithmSection:
    """The policy-gradient update (phases 2-4)."""

    loss: str = "stabledrl"
    """Registered policy loss: ``stabledrl``, ``stabledrl_released``, ``grpo``, ``espo``, ``spg``."""
    eps: float = 0.2
    """Clipping range of the importance ratio, [1 - eps, 1 + eps]."""
    advantage: str = "center"
    """Group advantage: ``center`` (r - mean, as released) or ``zscore``."""
    inner_iterations: int = 2
    """Policy updates (mu) per rollout batch."""
    likelihood: str = "elbo"
    """Sequence log-likelihood proxy: ``elbo``, ``mean_field``, ``spg`` (ELBO/EUBO), ``staircase`` (SDAR)."""
    num_mc: int = 2
    """Monte-Carlo masks per sequence, shared between old and new policy."""
    coupled_masks: bool = False
    """Draw masks in complementary pairs (DiffuCoder's coupled sampling): every completion
    token is scored exactly once per pair, a lower-variance ELBO; needs an even ``num_mc``."""
    length_normalize: bool = True
    """Divide sequence log-likelihoods by completion length (as released)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (0 = off)."""
    ratio_noise: Optional[str] = None
    """Stress switch: None, ``lognormal`` or ``student_t`` noise on the estimated log-ratio."""
    ratio_noise_sigma: float = 1.0
    """Scale of the stress noise."""
    ratio_noise_dof: float = 3.0
    """Degrees of freedom of the Student-t stress noise."""


@dataclass
class OptimizerSection:
    """Megatron optimizer and learning-rate schedule."""

    name: str = "adam"
    """``adam`` (AdamW) or ``sgd``."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the decay."""
    betas: Tuple[float, float] = (0.9, 0.99)
    """Adam betas."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    clip_grad: float = 0.2
    """Global gradient-norm clip (0 = off)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    decay_style: str = "constant"
    """``constant``, ``linear`` or ``cosine``."""
    distributed: bool = True
    """Megatron's distributed (ZeRO-1) optimizer (GPU and CPU/gloo): each data-parallel rank keeps
    only its shard of the fp32 main weights and Adam moments. Adam only (Megatron's
    ``DistributedOptimizer`` wraps nothing else: ``sgd`` needs ``distributed: false``). Its
    checkpoints reshard across data-parallel sizes but need the same tensor/pipeline layout to
    resume, and a resume must use the same setting as the save."""


@dataclass
class CheckpointSection:
    """Where and how often the training state is saved."""

    dir: Optional[str] = None
    """Checkpoint directory; None = ``<run_dir>/checkpoints``."""
    save_every: int = 100
    """Save every N steps (0 = only at the end)."""
    keep_last: int = 3
    """Keep the newest K complete checkpoints."""
    resume: str = "none"
    """``none``, ``auto`` (newest complete checkpoint) or a checkpoint path."""


@dataclass
class EvalSection:
    """Held-out evaluation during training (greedy decoding, sharded over data-parallel ranks)."""

    every: int = 0
    """Evaluate every N steps, before the first step and after the last (0 = never)."""
    split: str = "test"
    """Task split to evaluate on."""
    num_examples: int = 200
    """Examples of that split (generated tasks draw this many; file tasks take the first N)."""
    seed: int = 0
    """Seed of generated evaluation sets (Sudoku, Countdown)."""
    micro_batch_size: int = 128
    """Prompts decoded together per rank."""


@dataclass
class LoggingSection:
    """One logger: console, JSONL metrics and wandb, silent on non-zero ranks."""

    run_dir: str = "runs/default"
    """Everything a run writes lives here."""
    log_every: int = 1
    """Console line every N steps."""
    wandb_mode: str = "offline"
    """``offline`` (default), ``online`` or ``disabled``."""
    wandb_project: str = "stabledrl"
    """wandb project name."""
    progress: bool = True
    """Progress bars on the console."""


@dataclass
class RunConfig:
    """A whole run. ``steps`` optimizer steps of StableDRL."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algo: AlgorithmSection = field(default_factory=AlgorithmSection)
    optim: OptimizerSection = field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    eval: EvalSection = field(default_factory=EvalSection)
    steps: int = 10
    """Optimizer steps to run."""

    def validate(self) -> "RunConfig":
        """Check values that types alone cannot; raise :class:`ConfigError`."""
        _choice("model.dtype", self.model.dtype, ("fp32", "bf16"))
        _choice("parallel.backend", self.parallel.backend, ("auto", "nccl", "gloo"))
        _choice("optim.name", self.optim.name, ("adam", "sgd"))
        _choice("optim.decay_style", self.optim.decay_style, ("constant", "linear", "cosine"))
        _choice("logging.wandb_mode", self.logging.wandb_mode, ("offline", "online", "disabled"))
        _choice("algo.advantage", self.algo.advantage, ("center", "zscore"))
        _choice("rollout.prompt_style", self.rollout.prompt_style, ("chat", "compact"))
        _choice("algo.likelihood", self.algo.likelihood, ("elbo", "mean_field", "spg", "staircase"))
        if self.algo.ratio_noise is not None:
            _choice("algo.ratio_noise", self.algo.ratio_noise, ("lognormal", "student_t"))
        for name in ("parallel.tensor_parallel", "parallel.pipeline_parallel",
                     "parallel.micro_batch_size", "rollout.prompts_per_step", "rollout.group_size",
                     "rollout.gen_length", "rollout.steps", "rollout.block_length",
                     "algo.inner_iterations", "algo.num_mc", "checkpoint.keep_last",
                     "eval.num_examples", "eval.micro_batch_size"):
            if get_dotted(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {get_dotted(self, name)}")
        if self.algo.coupled_masks and (self.algo.num_mc % 2 or self.algo.likelihood == "mean_field"):
            raise ConfigError(f"algo.coupled_masks needs an even algo.num_mc (got {self.algo.num_mc}) "
                              f"and a masked estimator, not {self.algo.likelihood!r}")
        if not 0.0 < self.algo.eps < 1.0:
            raise ConfigError(f"algo.eps must be in (0, 1), got {self.algo.eps}")
        if self.optim.distributed and self.optim.name != "adam":
            raise ConfigError(f"optim.distributed=true needs optim.name=adam (Megatron's distributed "
                              f"optimizer wraps Adam only); set optim.distributed=false for "
                              f"{self.optim.name!r}")
        if self.optim.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.optim.lr}")
        if self.steps < 0 or self.checkpoint.save_every < 0 or self.eval.every < 0:
            raise ConfigError("steps, checkpoint.save_every and eval.every must be >= 0")
        return self


def _choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as err:
                errors.append(err)
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=where + ".")
    if origin in (tuple, Tuple):
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or (args and args[-1] is not Ellipsis
                                                    and len(value) != len(args)):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        inner = args if args and args[-1] is not Ellipsis else (args[0],) * len(value)
        return tuple(_coerce(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, inner)))
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (inner,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - every annotation in this module is handled above
        raise ConfigError(f"{where}: unsupported annotation {tp}")
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _unknown_key(key: str, valid: Sequence[str], prefix: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""
    return ConfigError(f"unknown config key {prefix}{key}{hint} (valid: {', '.join(valid)})")


def from_dict(cls: type, data: Dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a (nested) mapping, checking keys and types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in (data or {}).items():
        if key not in names:
            raise _unknown_key(str(key), names, prefix)
        kwargs[key] = _coerce(value, hints[key], prefix + key)
    return cls(**kwargs)


def to_dict(cfg: Any) -> Dict[str, Any]:
    """Plain nested dict (tuples become lists) suitable for YAML/JSON."""
    def plain(value):
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(cfg))


def parse_override(text: str) -> Tuple[List[str], Any]:
    """``"algo.eps=0.1"`` -> (["algo", "eps"], 0.1); the value is parsed as a YAML scalar/list."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: cannot parse value: {err}") from None
    return key.split("."), value


def apply_overrides(data: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """Apply dotted overrides to a nested mapping (keys are checked later by :func:`from_dict`)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return data


def get_dotted(cfg: Any, dotted: str) -> Any:
    """``get_dotted(cfg, "algo.eps")``."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (),
                cls: type = RunConfig) -> Any:
    """Read YAML (optional), apply dotted overrides, build and validate the config."""
    data: Dict[str, Any] = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        with open(path) as handle:
            try:
                data = yaml.safe_load(handle) or {}
            except yaml.YAMLError as err:
                raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    cfg = from_dict(cls, apply_overrides(data, overrides))
    return cfg.validate() if hasattr(cfg, "validate") else cfg


def save_config(cfg: Any, path: str) -> str:
    """Write the resolved config as YAML, atomically (temp file + rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".config-", suffix=".yaml")
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(to_dict(cfg), handle, sort_keys=False)
    os.replace(tmp, path)
    return path
