"""Build everything a training run needs from a :class:`~stabledrl_mcore.config.schema.RunConfig`.

Distributed start-up, tokenizer, backbone (random init, a converted
checkpoint, or a training checkpoint on resume), Megatron DDP, the Megatron
optimizer with its LR schedule, the task and its prompt stream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from stabledrl_mcore.config.checks import (
    check_layout,
    check_model_options,
    check_pipeline_options,
    compile_cache_error,
    compile_cache_path,
)
from stabledrl_mcore.config.schema import RunConfig
from stabledrl_mcore.engine.model_setup import build_policy, model_config, reference_policy
from stabledrl_mcore.engine.optimizer import build_optimizer
from stabledrl_mcore.engine.seeding import derive_seed
from stabledrl_mcore.models.decoding import use_compile_cache
from stabledrl_mcore.parallel import bootstrap
from stabledrl_mcore.tasks.base import Example
from stabledrl_mcore.tasks.from_config import build_task, generates_examples, load_train_examples
from stabledrl_mcore.tasks.tokenizer import load_tokenizer, train_sentencepiece


@dataclass
class TrainingSetup:
    cfg: RunConfig
    model: Any  # the DLLMModel (this rank's stage)
    ddp: Any  # Megatron DistributedDataParallel around it
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    task: Any
    prompts: "PromptStream"
    dp_rank: int
    dp_size: int
    reference: Any = None  # frozen copy of the initial policy (algo.kl_coef > 0), same layout
    initial: Any = None  # frozen initial policy of the drift metric (logging.drift_to_initial)
    decode_rows: Optional[int] = None  # rows per decoding forward, chosen at the first rollout when unset
    preempted: bool = False
    finished: bool = False  # the loop reached its last step (only then does a rank exit 0)


class PromptStream:
    """Deterministic prompts for step ``s``: a seeded permutation per epoch, split over DP ranks.

    ``prompts_per_step`` is the number generated per step (``rollout.generated_prompts``: with
    oversampling more than are trained on), so step ``s``'s prompts stay a function of (seed, s).
    ``in_order``: the examples are already a random draw whose first ``k`` do not depend on how many
    were drawn (a generated task: :func:`~stabledrl_mcore.tasks.from_config.load_train_examples`);
    the first epoch takes them as they are, so a step's prompts do not depend on the set's size
    (i.e. on ``steps``); later epochs are shuffled."""

    def __init__(
        self,
        examples: List[Example],
        prompts_per_step: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        *,
        in_order: bool = False,
    ):
        if prompts_per_step % dp_size:
            raise ValueError(
                f"rollout.prompts_per_step + oversample_prompts ({prompts_per_step}) must be "
                f"divisible by the data-parallel size ({dp_size})"
            )
        if not examples:
            raise ValueError("the task produced no training examples")
        self.examples, self.per_step, self.seed = examples, prompts_per_step, seed
        self.dp_rank, self.dp_size, self.in_order = dp_rank, dp_size, in_order

    def position(self, step: int) -> int:
        """Index of the first prompt of ``step`` in the endless stream (saved in checkpoints)."""
        return step * self.per_step

    def for_step(self, step: int) -> List[Example]:
        local = self.per_step // self.dp_size
        start = self.position(step) + self.dp_rank * local
        out = []
        for index in range(start, start + local):
            epoch, offset = divmod(index, len(self.examples))
            if epoch == 0 and self.in_order:
                out.append(self.examples[offset])
                continue
            order = torch.randperm(
                len(self.examples),
                device="cpu",  # host-side data order
                generator=torch.Generator(device="cpu").manual_seed(derive_seed(self.seed, epoch)),
            )
            out.append(self.examples[int(order[offset])])
        return out


def prompt_stream(cfg: RunConfig, examples: List[Example], dp_rank: int, dp_size: int) -> PromptStream:
    """The run's :class:`PromptStream` (a generated task's examples in their drawn order first)."""
    in_order = generates_examples(cfg)
    return PromptStream(examples, cfg.rollout.generated_prompts, dp_rank, dp_size, cfg.parallel.seed, in_order=in_order)


def resolve_tokenizer(cfg: RunConfig, task, run_dir: str):
    """The configured tokenizer, the checkpoint's, or a tiny one trained on the task (rank 0 trains)."""

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
        texts = [task.prompt(ex) for ex in sample] + [str(ex.meta.get("answer_text", ex.reference)) for ex in sample]
        train_sentencepiece(texts, target + ".tmp", vocab_size=64)
        os.replace(target + ".tmp", target)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return load_tokenizer(target)


def build_training(cfg: RunConfig, *, train_examples: Optional[List[Example]] = None) -> TrainingSetup:
    """Initialise distributed state and build model, optimizer, scheduler, tokenizer and prompts."""
    from megatron.core import parallel_state as ps

    if cfg.parallel.threads:
        torch.set_num_threads(cfg.parallel.threads)
    check_pipeline_options(cfg)
    task = build_task(cfg)
    # the data is read (and a bad file refused) before anything distributed or a model is built
    examples = train_examples if train_examples is not None else load_train_examples(cfg, task)
    bootstrap.initialize(
        cfg.parallel.tensor_parallel,
        cfg.parallel.pipeline_parallel,
        seed=cfg.parallel.seed,
        timeout_minutes=cfg.parallel.timeout_minutes,
        backend=None if cfg.parallel.backend == "auto" else cfg.parallel.backend,
        expert_parallel=cfg.parallel.expert_parallel,
        expert_tensor_parallel=cfg.parallel.expert_tensor_parallel,
    )
    tokenizer = resolve_tokenizer(cfg, task, cfg.logging.run_dir)
    mcfg = model_config(cfg, tokenizer)
    check_layout(cfg, mcfg, torch.distributed.get_world_size())
    check_model_options(cfg, mcfg)
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    model = build_policy(cfg, mcfg, dtype)
    if cfg.rollout.compile != "none":
        try:  # the preflight checked it; a directory that changed since is still one line
            use_compile_cache(compile_cache_path(cfg))
        except OSError as err:
            raise compile_cache_error(cfg, f"cannot be made or used ({err.strerror or err})") from None
    reference = reference_policy(model, mcfg, dtype) if cfg.algo.kl_coef > 0 else None
    initial = None  # the drift metric's frozen initial policy (logging.drift_to_initial)
    if cfg.logging.drift_to_initial:
        kept_initial = reference is not None and not cfg.algo.reference_sync_every
        initial = reference if kept_initial else reference_policy(model, mcfg, dtype)
    total = max(cfg.steps * cfg.algo.inner_iterations, 1)  # the schedule counts optimizer updates
    ddp, optimizer, scheduler = build_optimizer(cfg, model, dtype, total)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    prompts = prompt_stream(cfg, examples, dp_rank, dp_size)
    return TrainingSetup(
        cfg,
        model,
        ddp,
        optimizer,
        scheduler,
        tokenizer,
        task,
        prompts,
        dp_rank,
        dp_size,
        reference=reference,
        initial=initial,
    )
