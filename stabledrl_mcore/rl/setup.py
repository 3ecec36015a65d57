"""Build everything a training run needs from a :class:`~stabledrl_mcore.config.schema.RunConfig`.

Distributed start-up, tokenizer, backbone (random init, a converted
checkpoint, or a training checkpoint on resume), Megatron DDP, the Megatron
optimizer with its LR schedule, the task and its prompt stream.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Union

import torch

from stabledrl_mcore.config.schema import RunConfig
from stabledrl_mcore.tasks import GENERATED_TASKS, get_task
from stabledrl_mcore.tasks.base import Example
from stabledrl_mcore.tasks.prompts import rollout_prompt_format


@dataclass
class TrainingSetup:
    cfg: RunConfig
    model: Any           # the DLLMModel (this rank's stage)
    ddp: Any             # Megatron DistributedDataParallel around it
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    task: Any
    prompts: "PromptStream"
    dp_rank: int
    dp_size: int
    reference: Any = None  # frozen copy of the initial policy (algo.kl_coef > 0), same layout
    preempted: bool = False


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any parts (seed, step, rank, phase)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def phase_generator(seed: int, step: int, dp_rank: int, phase: str,
                    device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """Every random draw of a step comes from here: exact resume needs no RNG state.

    The generator lives on ``device`` (the model's), so Gumbel noise over a
    ``[B, L, V]`` logit tensor is drawn where the logits are. CUDA and CPU
    generators give different (each deterministic) streams for the same seed.
    """
    return torch.Generator(device=device).manual_seed(derive_seed(seed, step, dp_rank, phase))


class PromptStream:
    """Deterministic prompts for step ``s``: a seeded permutation per epoch, split over DP ranks.

    ``prompts_per_step`` is the number generated per step (``rollout.generated_prompts``: with
    oversampling more than are trained on), so step ``s``'s prompts stay a function of (seed, s)."""

    def __init__(self, examples: List[Example], prompts_per_step: int, dp_rank: int, dp_size: int,
                 seed: int):
        if prompts_per_step % dp_size:
            raise ValueError(f"rollout.prompts_per_step + oversample_prompts ({prompts_per_step}) must be "
                             f"divisible by the data-parallel size ({dp_size})")
        if not examples:
            raise ValueError("the task produced no training examples")
        self.examples, self.per_step, self.seed = examples, prompts_per_step, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def position(self, step: int) -> int:
        """Index of the first prompt of ``step`` in the endless stream (saved in checkpoints)."""
        return step * self.per_step

    def for_step(self, step: int) -> List[Example]:
        local = self.per_step // self.dp_size
        start = self.position(step) + self.dp_rank * local
        out = []
        for index in range(start, start + local):
            epoch, offset = divmod(index, len(self.examples))
            order = torch.randperm(len(self.examples), device="cpu",  # host-side data order
                                   generator=torch.Generator(device="cpu").manual_seed(
                                       derive_seed(self.seed, epoch)))
            out.append(self.examples[int(order[offset])])
        return out


def _model_config(cfg: RunConfig, tokenizer):
    """The preset (random init) or the checkpoint's own config, with ``model.overrides`` applied."""
    from stabledrl_mcore.models import get_preset

    if cfg.model.checkpoint:
        from stabledrl_mcore.checkpoint.loader import read_config

        mcfg = read_config(cfg.model.checkpoint)
    else:
        mcfg = get_preset(cfg.model.preset)
    overrides = dict(cfg.model.overrides)
    for name in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
        overrides.setdefault(name, getattr(tokenizer, name))
    if not cfg.model.checkpoint:  # random init: the embedding covers exactly the tokenizer
        overrides.setdefault("vocab_size", tokenizer.vocab_size)
    unknown = [k for k in overrides if k not in {f.name for f in dataclasses.fields(mcfg)}]
    if unknown:
        from stabledrl_mcore.config.schema import ConfigError

        raise ConfigError(f"model.overrides: unknown DLLMConfig field(s) {', '.join(unknown)}")
    return dataclasses.replace(mcfg, **overrides).validate()


def resolve_tokenizer(cfg: RunConfig, task, run_dir: str):
    """The configured tokenizer, the checkpoint's, or a tiny one trained on the task (rank 0 trains)."""
    from stabledrl_mcore.tasks.tokenizer import load_tokenizer, train_sentencepiece

    if cfg.model.checkpoint and not os.path.isdir(cfg.model.checkpoint):
        raise FileNotFoundError(f"model.checkpoint: {cfg.model.checkpoint} does not exist or is not a directory")
    path = cfg.model.tokenizer or cfg.model.checkpoint
    if path and not cfg.model.tokenizer and os.path.isdir(os.path.join(path, "hf")):
        path = os.path.join(path, "hf")  # converted and training checkpoints keep it there
    if path:
        return load_tokenizer(path)
    target = os.path.join(run_dir, "tokenizer")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0 and not os.path.isdir(target):
        data = {"path": cfg.rollout.data_path} if cfg.rollout.data_path else {}  # file-backed tasks
        sample = task.load(cfg.rollout.split, n=256, seed=cfg.parallel.seed, **data)
        texts = [task.prompt(ex) for ex in sample] + [str(ex.meta.get("answer_text", ex.reference))
                                                      for ex in sample]
        train_sentencepiece(texts, target + ".tmp", vocab_size=64)
        os.replace(target + ".tmp", target)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return load_tokenizer(target)


def build_optimizer(cfg, model, dtype: torch.dtype, total_updates: int):
    """``(ddp, optimizer, scheduler)`` of ``cfg.optim`` around ``model``: Megatron DDP, the Megatron
    optimizer (distributed ZeRO-1 on CPU/gloo as on GPU, Adam only: validated) and its LR
    schedule over ``total_updates`` optimizer updates (``train`` and ``sft`` share it)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    distributed = cfg.optim.distributed
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), model)
    opt_cfg = OptimizerConfig(
        optimizer=cfg.optim.name, lr=cfg.optim.lr, min_lr=cfg.optim.min_lr,
        weight_decay=cfg.optim.weight_decay, adam_beta1=cfg.optim.betas[0],
        adam_beta2=cfg.optim.betas[1], sgd_momentum=0.0, clip_grad=cfg.optim.clip_grad,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=distributed)
    optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.optim.warmup_steps else cfg.optim.lr, max_lr=cfg.optim.lr,
        min_lr=cfg.optim.min_lr, lr_warmup_steps=cfg.optim.warmup_steps,
        lr_decay_steps=max(total_updates, cfg.optim.warmup_steps + 1), lr_decay_style=cfg.optim.decay_style,
        start_wd=cfg.optim.weight_decay, end_wd=cfg.optim.weight_decay, wd_incr_steps=total_updates,
        wd_incr_style="constant")
    return ddp, optimizer, scheduler


def build_training(cfg: RunConfig, *, train_examples: Optional[List[Example]] = None) -> TrainingSetup:
    """Initialise distributed state and build model, optimizer, scheduler, tokenizer and prompts."""
    from megatron.core import parallel_state as ps

    from stabledrl_mcore.models import build_model
    from stabledrl_mcore.parallel import bootstrap

    if cfg.parallel.threads:
        torch.set_num_threads(cfg.parallel.threads)
    from stabledrl_mcore.cli.preflight import check_pipeline_options

    check_pipeline_options(cfg)
    task = build_task(cfg)
    # the data is read (and a bad file refused) before anything distributed or a model is built
    examples = train_examples if train_examples is not None else load_train_examples(cfg, task)
    bootstrap.initialize(cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel,
                         seed=cfg.parallel.seed, timeout_minutes=cfg.parallel.timeout_minutes,
                         backend=None if cfg.parallel.backend == "auto" else cfg.parallel.backend,
                         expert_parallel=cfg.parallel.expert_parallel,
                         expert_tensor_parallel=cfg.parallel.expert_tensor_parallel)
    tokenizer = resolve_tokenizer(cfg, task, cfg.logging.run_dir)
    mcfg = _model_config(cfg, tokenizer)
    from stabledrl_mcore.cli.preflight import check_moe_options

    check_moe_options(cfg, mcfg)
    bootstrap.validate_parallel_layout(
        torch.distributed.get_world_size(), cfg.parallel.tensor_parallel,
        cfg.parallel.pipeline_parallel, num_layers=mcfg.num_layers,
        num_attention_heads=mcfg.num_attention_heads, num_query_groups=mcfg.num_query_groups,
        expert_parallel=cfg.parallel.expert_parallel, expert_tensor_parallel=cfg.parallel.expert_tensor_parallel,
        num_experts=mcfg.num_experts or 0)
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    model = build_model(mcfg, params_dtype=dtype, recompute=cfg.model.recompute)
    if cfg.model.checkpoint:
        load_initial_weights(model, cfg.model.checkpoint)
    reference = reference_policy(model, mcfg, dtype) if cfg.algo.kl_coef > 0 else None
    total = max(cfg.steps * cfg.algo.inner_iterations, 1)  # the schedule counts optimizer updates
    ddp, optimizer, scheduler = build_optimizer(cfg, model, dtype, total)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    prompts = PromptStream(examples, cfg.rollout.generated_prompts, dp_rank, dp_size, cfg.parallel.seed)
    rows = cfg.rollout.generated_prompts // dp_size * cfg.rollout.group_size
    if rows % cfg.parallel.micro_batch_size:
        from stabledrl_mcore.config.schema import ConfigError

        raise ConfigError(f"each data-parallel rank holds {rows} sequences (prompts_per_step / DP x "
                          f"group_size), not a multiple of parallel.micro_batch_size "
                          f"({cfg.parallel.micro_batch_size})")
    return TrainingSetup(cfg, model, ddp, optimizer, scheduler, tokenizer, task, prompts,
                         dp_rank, dp_size, reference=reference)


def reference_policy(model, mcfg, dtype):
    """A frozen copy of ``model`` as it is now (the initial policy), in the same layout and
    dtype, in eval mode: the reference of the KL penalty. A resume rebuilds it the same way
    (from ``model.checkpoint`` or the seeded initialisation) before the run's own weights load.
    """
    from stabledrl_mcore.models import build_model

    reference = build_model(mcfg, params_dtype=dtype, device=next(model.parameters()).device)
    reference.load_state_dict(model.state_dict())
    reference.requires_grad_(False)
    return reference.eval()


@torch.no_grad()
def sync_reference(reference, model, mixup: float) -> None:
    """TR-DPO's reference update (TRL's ``sync_ref_model``, used by d1): ref <- a * theta + (1 - a) * ref."""
    for ref_param, param in zip(reference.parameters(), model.parameters()):
        ref_param.mul_(1.0 - mixup).add_(param.detach().to(ref_param.dtype), alpha=mixup)


def load_initial_weights(model, path: str) -> None:
    """Weights from an HF directory, a converted checkpoint or a training checkpoint (any TP/PP)."""
    from stabledrl_mcore.checkpoint.loader import is_hf_dir, load_hf_weights
    from stabledrl_mcore.checkpoint.mcore_io import load_model_weights

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.checkpoint {path} is not a directory")
    if is_hf_dir(path):
        load_hf_weights(model, path)
    else:
        load_model_weights(model, path)


def build_task(cfg: RunConfig):
    """The task of ``cfg.rollout``: ``task`` with ``task_options``, the ``prompt_key`` / ``answer_key``
    columns, and ``reward_fn`` in place of its reward. Fields that cannot apply to the task are
    refused by name (:class:`~..config.ConfigError`); a bad task option raises ``ValueError``."""
    from stabledrl_mcore.config.schema import ConfigError

    r = cfg.rollout
    options = dict(r.task_options)
    for name in ("prompt_key", "answer_key"):
        value = getattr(r, name)
        if value is None:
            continue
        if r.task in GENERATED_TASKS:
            raise ConfigError(f"rollout.{name}={value}: task {r.task} generates its examples (no data columns); "
                              f"it applies to file-backed tasks such as qa, gsm8k, math500, aime2024")
        if name in options:
            raise ConfigError(f"rollout.{name} and rollout.task_options.{name} both set: keep rollout.{name}")
        options[name] = value
    if not r.reward_timeout_s > 0:
        raise ConfigError(f"rollout.reward_timeout_s must be > 0, got {r.reward_timeout_s}")
    if r.reward_timeout_s != type(r).reward_timeout_s and not r.reward_fn:
        raise ConfigError("rollout.reward_timeout_s limits rollout.reward_fn calls: set rollout.reward_fn too")
    task = get_task(r.task, prompt_style=r.prompt_style, **options)
    task.prompt_format = rollout_prompt_format(r)  # the prompts eval and generate use too
    if r.reward_fn:
        from stabledrl_mcore.tasks.custom_reward import TASK_REWARD_OPTIONS, CustomRewardTask, load_reward_fn

        shaping = [k for k in TASK_REWARD_OPTIONS if k in options]
        if shaping:
            raise ConfigError(f"rollout.task_options.{shaping[0]} shapes the task's own reward, which "
                              f"rollout.reward_fn replaces: drop one of them")
        task = CustomRewardTask(task, load_reward_fn(r.reward_fn), spec=r.reward_fn, timeout_s=r.reward_timeout_s)
    return task


def load_train_examples(cfg: RunConfig, task, *, sample: Optional[int] = None) -> List[Example]:
    """The training examples of ``cfg`` (a generated task draws ``sample`` of them when given)."""
    kwargs = {"path": cfg.rollout.data_path} if cfg.rollout.data_path else {}
    if cfg.rollout.task in GENERATED_TASKS:
        kwargs["n"] = sample or max(cfg.rollout.prompts_per_step * max(cfg.steps, 1), 64)
    seed = cfg.parallel.seed if cfg.rollout.data_seed is None else cfg.rollout.data_seed
    return task.load(cfg.rollout.split, seed=seed, **kwargs)
