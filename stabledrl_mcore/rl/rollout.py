"""Phases 1-2 of a StableDRL step: prompts -> G completions each -> rewards -> advantages.

Everything between phases travels in one :class:`RolloutBatch`. Each phase is
a function ``(batch, ...) -> batch`` with explicit ``torch.Generator``s, so a
step is a pure function of (weights, step number, seed) and resume is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from stabledrl_mcore.algorithms.advantages import group_advantages
from stabledrl_mcore.common.isolated_calls import raised
from stabledrl_mcore.diffusion.sampling_llada import DecodeStats
from stabledrl_mcore.models.decoding import decoding_forward, prompt_padding
from stabledrl_mcore.models.masks import left_pad_counts
from stabledrl_mcore.models.placement import eval_mode, model_device
from stabledrl_mcore.rl.group_rollout import group_rollouts, memory_decode_rows
from stabledrl_mcore.tasks.base import Example
from stabledrl_mcore.tasks.prompts import encode_prompts


@dataclass
class RolloutBatch:
    """One rank's share of a step: ``N = prompts x G`` sequences.

    ``sequences [N, S]`` = left-padded prompt then completion; ``completion_mask``
    marks completion tokens up to and including the first EOS (what the
    likelihood scores); ``group_index [N]`` names each sample's prompt.
    """

    sequences: torch.Tensor
    prompt_len: int
    prompt_valid: torch.Tensor
    completion_mask: torch.Tensor
    group_index: torch.Tensor
    completions: List[str]
    references: List[Any]
    rewards: Optional[torch.Tensor] = None
    correct: Optional[torch.Tensor] = None  # [N] bool: the task's full (base) reward, for accuracy
    advantages: Optional[torch.Tensor] = None
    reward_errors: int = 0
    first_reward_error: Optional[str] = None  # this rank's first failed reward of the step, as shown
    old_token_logp: Optional[torch.Tensor] = None  # [M, N, S] per-draw log-probs (no grad)
    old_logp: Optional[torch.Tensor] = None  # [N] sequence estimates (what the loss differentiates)
    old_ratio_logp: Optional[torch.Tensor] = None  # [N] what importance ratios compare (the ELBO)
    plan: Any = None  # diffusion.MaskPlan of the old-policy estimate
    iteration_estimates: List[Any] = field(default_factory=list)  # rl.estimates.OldEstimate per iteration
    stats: Dict[str, float] = field(default_factory=dict)
    # dynamic sampling (rl.dynamic_sampling): the unfiltered batch these rows were kept from, their
    # rows in it (masks are drawn on it, so a kept row keeps its masks), and this rank's gradient scale
    source: Optional["RolloutBatch"] = None
    source_rows: Optional[torch.Tensor] = None
    gradient_scale: float = 1.0

    @property
    def size(self) -> int:
        return self.sequences.shape[0]

    def prompt_pads(self):
        """The left-pad count of every row (``models.masks.left_pad_counts``: None when the prompt
        mask is not a left pad), read from the device once per batch and kept."""
        if "_prompt_pads" not in self.__dict__:
            self.__dict__["_prompt_pads"] = left_pad_counts(self.prompt_valid)
        return self.__dict__["_prompt_pads"]

    @property
    def completion_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def select_rows(self, rows: torch.Tensor, *, gradient_scale: float = 1.0) -> "RolloutBatch":
        """A scored batch of ``rows`` ([n] long, in order) of this one, before any likelihood phase;
        it remembers this batch as its ``source``."""
        if self.old_token_logp is not None:
            raise ValueError("select_rows runs before the likelihood phases (this batch is already scored)")
        host = rows.tolist()
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return RolloutBatch(
            sequences=self.sequences[rows],
            prompt_len=self.prompt_len,
            prompt_valid=self.prompt_valid[rows],
            completion_mask=self.completion_mask[rows],
            group_index=self.group_index[rows],
            completions=[self.completions[i] for i in host],
            references=[self.references[i] for i in host],
            rewards=pick(self.rewards),
            correct=pick(self.correct),
            advantages=pick(self.advantages),
            reward_errors=self.reward_errors,
            source=self,
            source_rows=rows,
            gradient_scale=gradient_scale,
        )


def completion_mask_until_eos(completion: torch.Tensor, eos_id: int) -> torch.Tensor:
    """True up to and including the first EOS of each row (all True when there is none)."""
    is_eos = completion == eos_id
    after_first = (is_eos.cumsum(-1) - is_eos.long()) > 0
    return ~after_first


def generate_rollouts(
    model,
    tokenizer,
    task,
    examples: Sequence[Example],
    *,
    group_size: int,
    gen_length: int,
    steps: int,
    block_length: int,
    temperature: float,
    threshold: Optional[float],
    micro_batch: int,
    chunk_generator: Callable[[int], torch.Generator],
    first_chunk: int = 0,
    progress: bool = False,
    cache: str = "none",
    measure_cache_gap: bool = False,
    compile: str = "none",
    decode_rows: Optional[int] = None,
) -> RolloutBatch:
    """Phase 1: ``group_size`` completions per example, in micro-batches of prompts x G.

    Micro-batch ``k`` of this rank draws from ``chunk_generator(first_chunk + k)``,
    so results do not depend on how the global batch is split over DP ranks. Runs on
    the model's device, in eval mode (no recompute, no dropout) whatever the training
    mode; the mode is restored afterwards. Whole groups are decoded together (SDAR: each prompt
    prefilled once), with the same draws as micro-batch by micro-batch (:mod:`.group_rollout`). ``cache``: LLaDA's approximate
    KV cache (``rollout.cache``); whatever the sampler did, the likelihood phases score with exact
    attention. ``measure_cache_gap`` (LLaDA with a cache) also runs the exact forward at each cached
    step; ``stats`` then holds ``cache_gap_sum`` / ``cache_gap_tokens`` (see ``DecodeStats``).
    ``compile``: ``rollout.compile`` (prompts then left-padded to a multiple of
    :data:`~..models.decoding.PROMPT_MULTIPLE` tokens; ``stats`` gets ``rollout_compile_s``, the
    seconds this call spent compiling graphs). ``decode_rows``: rows per decoding forward
    (``rollout.decode_rows``; None: :func:`~.group_rollout.decode_rows`).
    """
    device = model_device(model)
    texts = [task.prompt(ex, tokenizer) for ex in examples]
    padding = prompt_padding(compile, model)  # SDAR rollouts decode with the model's block_size
    prompt_ids, prompt_valid = encode_prompts(tokenizer, texts, device=device, **padding)
    unique_ids, unique_valid = prompt_ids, prompt_valid
    prompt_ids = prompt_ids.repeat_interleave(group_size, 0)
    prompt_valid = prompt_valid.repeat_interleave(group_size, 0)
    group_index = torch.arange(len(examples), device=device).repeat_interleave(group_size)
    gap = DecodeStats(measure_gap=True) if measure_cache_gap else None
    extra = {} if gap is None else {"stats": gap}
    if cache != "none":
        extra["cache"] = cache
    forward = decoding_forward(model, compile)
    compiled_s = forward.stats.compile_s
    if decode_rows is None:  # from the memory left for this shape's forwards and KV cache
        llada = model.dllm_config.arch == "llada"
        block = block_length if llada else model.dllm_config.block_size
        decode_rows = memory_decode_rows(
            model,
            micro_batch=micro_batch,
            group_size=group_size,
            rows=prompt_ids.shape[0],
            capacity=prompt_ids.shape[1] + gen_length + block,
            block=block,
            # LLaDA's full forwards (every step without a cache, each block's first with one) run over
            # the whole sequence; SDAR's largest is the prompt's prefill
            query=prompt_ids.shape[1] + gen_length if llada else max(prompt_ids.shape[1], block),
            cached=cache != "none" or not llada,
        )
    with torch.no_grad(), eval_mode(model):  # whole groups per decoding batch (SDAR: prefilled once)
        outputs = group_rollouts(
            model,
            unique_ids,
            unique_valid,
            group_size=group_size,
            gen_length=gen_length,
            steps=steps,
            block_length=block_length,
            temperature=temperature,
            threshold=threshold,
            micro_batch=micro_batch,
            chunk_generator=chunk_generator,
            first_chunk=first_chunk,
            progress=progress,
            rows=decode_rows,
            compile=forward,
            **extra,
        )
    sequences = torch.cat(outputs)
    width = prompt_ids.shape[1]
    completion = sequences[:, width:]
    comp_mask = torch.zeros_like(sequences, dtype=torch.bool)
    comp_mask[:, width:] = completion_mask_until_eos(completion, tokenizer.eos_token_id)
    valid = torch.cat([prompt_valid, torch.ones_like(completion, dtype=torch.bool)], 1)
    return RolloutBatch(
        sequences=sequences,
        prompt_len=width,
        prompt_valid=valid,
        completion_mask=comp_mask,
        group_index=group_index,
        completions=[tokenizer.decode(row) for row in completion.tolist()],  # one device->host copy
        references=[ex.reference for ex in examples for _ in range(group_size)],
        stats={
            **({} if gap is None else {"cache_gap_sum": gap.gap_sum, "cache_gap_tokens": float(gap.gap_tokens)}),
            "rollout_decode_rows": float(decode_rows),
            **({"rollout_compile_s": forward.stats.compile_s - compiled_s} if forward.compiled else {}),
        },
    )


def score_rollouts(batch: RolloutBatch, task, *, advantage: str = "center") -> RolloutBatch:
    """Phase 2: rewards (a verifier that raises scores 0 and is counted) and group advantages.

    ``batch.correct`` is the task's own correctness (its full base reward), so accuracy
    does not count shaping terms such as ``anti_short_boxed``. A task with a batch method
    ``rewards(completions, references)`` (``rollout.reward_fn``: its calls run in parallel) scores
    through it; ``batch.first_reward_error`` keeps the step's first failure's message.
    """
    if hasattr(task, "pop_failure_report"):  # rollout.reward_fn: earlier calls (held-out eval) are not this step's
        task.pop_failure_report()
    pairs = list(zip(batch.completions, batch.references))
    given = task.rewards(batch.completions, batch.references) if hasattr(task, "rewards") else None
    rewards, correct, errors, first = [], [], 0, None
    for i, (completion, reference) in enumerate(pairs):
        try:
            value = float(given[i] if given is not None else task.reward(completion, reference))
            right = bool(task.is_correct(completion, reference))
        except Exception as err:  # noqa: BLE001 - hostile model output must never stop training
            value, right = 0.0, False
            errors += 1
            first = first or f"the task's verifier {raised(err)}"
        rewards.append(value)
        correct.append(right)
    if hasattr(task, "pop_failure_report"):  # rollout.reward_fn: calls that raised or timed out scored 0
        count, first_call = task.pop_failure_report()
        errors, first = errors + count, first_call or first
    batch.first_reward_error = first
    device = batch.sequences.device
    batch.rewards = torch.tensor(rewards, dtype=torch.float32, device=device)
    batch.correct = torch.tensor(correct, dtype=torch.bool, device=device)
    batch.reward_errors = errors
    batch.advantages = group_advantages(batch.rewards, batch.group_index, mode=advantage)
    return batch
