"""Timing the phases of a StableDRL step: warm-up, repetitions, median and spread.

Phases (:data:`PHASES`), each a callable that does the work once and returns the
tokens it processed on this rank:

- ``rollout``: ``generate_rollouts`` of this rank's prompts (tokens = generated
  positions, prompts x G x gen length);
- ``likelihood_full`` / ``likelihood_staircase``: the old-policy likelihood
  (masks drawn, ``num_mc`` no-grad passes) with full bidirectional attention over
  the sequence, or the one-pass staircase layout over ``[x_t | x_0]`` (block size:
  the model's, else ``rollout.block_length``); tokens = ``num_mc`` x sequences x length;
- ``train``: forward + backward of the update's surrogate over every micro-batch
  and draw, with the data-parallel gradient all-reduce (same tokens);
- ``optimizer``: one Megatron optimizer step (clip + Adam), no tokens;
- ``step``: a whole step as the trainer runs it (rollout -> score -> old-policy
  likelihood -> ``inner_iterations`` updates); tokens = prompt + completion
  tokens of the step's sequences.

:func:`measure` runs several callables interleaved (A B, B A, ...) so that load
from other processes hits all of them alike; with several ranks every
repetition starts at a barrier and takes the slowest rank's time.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.schema import RunConfig, load_config
from stabledrl_mcore.engine.expert import phase_model
from stabledrl_mcore.engine.gradients import sync_gradients
from stabledrl_mcore.engine.pipeline import CLOCK
from stabledrl_mcore.engine.seeding import chunk_generators, first_chunk
from stabledrl_mcore.models import get_preset
from stabledrl_mcore.models.placement import model_device
from stabledrl_mcore.models.presets import ModelConfigError
from stabledrl_mcore.parallel.bootstrap import comm_device
from stabledrl_mcore.rl.estimates import LikelihoodSpec, old_policy_likelihood
from stabledrl_mcore.rl.rollout import score_rollouts
from stabledrl_mcore.rl.trainer import (
    PhaseTimer,
    filter_phase,
    likelihood_spec,
    old_logp_phase,
    policy_update,
    rollout_phase,
)
from stabledrl_mcore.rl.update import accumulate_gradients

PHASES = ("rollout", "likelihood_full", "likelihood_staircase", "train", "optimizer", "step")


@dataclass
class PhaseResult:
    """Repetitions of one phase: wall and process-CPU seconds, tokens and model FLOPs per repetition."""

    name: str
    seconds: List[float] = field(default_factory=list)
    cpu_seconds: List[float] = field(default_factory=list)
    tokens: float = 0.0  # per repetition, summed over data-parallel ranks
    flops: float = 0.0  # model FLOPs per repetition of one model replica
    stage_busy_s: float = 0.0  # pipeline parallelism: seconds inside this stage's forwards (all ranks)
    stage_wall_s: float = 0.0  # ... and inside forward-only pipeline calls (all ranks)

    def summary(self, peak_flops: Optional[float] = None, model_parallel: int = 1) -> Dict[str, float]:
        """median/quartiles/IQR of the wall time, tokens/s at the median, model FLOP/s and MFU."""
        s = sorted(self.seconds)
        med = statistics.median(s)
        q1, q3 = statistics.quantiles(s, n=4, method="inclusive")[::2] if len(s) > 1 else (med, med)
        out = {
            "median_s": med,
            "q1_s": q1,
            "q3_s": q3,
            "iqr_s": q3 - q1,
            "min_s": s[0],
            "max_s": s[-1],
            "repeats": len(s),
            "cpu_median_s": statistics.median(self.cpu_seconds) if self.cpu_seconds else None,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / med if med > 0 and self.tokens else None,
            "model_flops": self.flops,
        }
        if self.stage_wall_s > 0:  # the share of a stage's forward-only pipeline time spent waiting
            out["pipeline_bubble_fraction"] = 1.0 - self.stage_busy_s / self.stage_wall_s
        cpu = out["cpu_median_s"]
        out["tokens_per_cpu_s"] = self.tokens / cpu if cpu and self.tokens else None
        out["model_flops_per_s"] = self.flops / med if med > 0 and self.flops else None
        if peak_flops and out["model_flops_per_s"]:
            out["mfu"] = out["model_flops_per_s"] / (peak_flops * model_parallel)
            if cpu:  # meaningful with one thread per rank: the rate an uncontended core would see
                out["mfu_cpu_time"] = self.flops / cpu / (peak_flops * model_parallel)
        return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _reduce(values: List[float], op) -> List[float]:
    if not _dist() or not values:
        return values

    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    torch.distributed.all_reduce(t, op=op)
    return t.cpu().tolist()


def _model_parallel_size() -> int:
    """Ranks holding one model replica (TP x PP): they all report the replica's tokens."""
    from megatron.core import parallel_state as ps

    if not _dist() or not ps.model_parallel_is_initialized():
        return 1
    return torch.distributed.get_world_size() // ps.get_data_parallel_world_size()


def log(message: str) -> None:
    """Progress line on rank 0 (stderr, flushed)."""
    if not _dist() or torch.distributed.get_rank() == 0:
        print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure(
    jobs: Dict[str, Callable[[], float]],
    *,
    warmup: int,
    repeats: int,
    counters: Optional[Dict[str, object]] = None,
    label: str = "",
) -> Dict[str, PhaseResult]:
    """Time each job ``warmup`` + ``repeats`` times, interleaved; ``counters[name]`` is a FlopCounter.

    Every job returns its local token count; tokens are summed over ranks and
    each repetition's time is the slowest rank's.
    """

    names = list(jobs)
    results = {n: PhaseResult(n) for n in names}
    for w in range(warmup):
        for n in names:
            log(f"{label}{n}: warm-up {w + 1}/{warmup}")
            jobs[n]()
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            log(f"{label}{n}: repetition {r + 1}/{repeats}")
            counter = (counters or {}).get(n)
            if counter is not None:
                counter.reset()
            if _dist():
                torch.distributed.barrier()
            _sync()
            CLOCK.reset()
            wall, cpu = time.perf_counter(), time.process_time()
            tokens = jobs[n]()
            _sync()
            results[n].seconds.append(time.perf_counter() - wall)
            results[n].stage_busy_s += CLOCK.busy_s
            results[n].stage_wall_s += CLOCK.wall_s
            results[n].cpu_seconds.append(time.process_time() - cpu)
            results[n].tokens = float(tokens or 0)
            if counter is not None:
                results[n].flops = counter.flops
    for n in names:
        res = results[n]
        res.seconds = _reduce(res.seconds, torch.distributed.ReduceOp.MAX if _dist() else None)
        res.cpu_seconds = _reduce(res.cpu_seconds, torch.distributed.ReduceOp.MAX if _dist() else None)
        if _dist():
            res.tokens = _reduce([res.tokens], torch.distributed.ReduceOp.SUM)[0] / _model_parallel_size()
            res.stage_busy_s, res.stage_wall_s = _reduce(
                [res.stage_busy_s, res.stage_wall_s], torch.distributed.ReduceOp.SUM
            )
    return results


def fill_flat_groups(batch) -> None:
    """Give groups whose advantages are all zero a fixed zero-mean pattern (+1, -1, ...).

    An untrained model earns the same reward for every completion of a prompt, so
    every advantage is zero and the update would skip its backward; the pattern
    makes the update do its full work (the values do not change the cost).
    """
    adv = batch.advantages
    for g in torch.unique(batch.group_index):
        rows = (batch.group_index == g).nonzero().flatten()
        if bool((adv[rows] == 0).all()) and len(rows) > 1:
            pattern = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(rows))], device=adv.device)
            if len(rows) % 2:
                pattern[-1] = 0.0
            adv[rows] = pattern.to(adv.dtype)


class VocabGuard:
    """A tokenizer whose ``decode`` drops ids it does not know (a benchmark model may
    keep its preset's larger vocabulary while prompts come from a small tokenizer)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, ids, **kwargs):
        size = self._tok.vocab_size
        return self._tok.decode([i for i in ids if 0 <= int(i) < size], **kwargs)


class StableDRLPhases:
    """Our step's phases over a built :class:`~stabledrl_mcore.rl.setup.TrainingSetup`.

    One real rollout batch (scored, masks drawn, old policy scored) is prepared
    once and reused by the isolated likelihood/train/optimizer phases.
    """

    def __init__(self, setup):

        s = self.s = setup
        cfg = s.cfg
        self.spec = likelihood_spec(cfg, s.model)
        self.mb = cfg.parallel.micro_batch_size
        self.mask_id = s.model.dllm_config.mask_token_id
        self.block = s.model.dllm_config.block_size or cfg.rollout.block_length
        common = dict(num_mc=cfg.algo.num_mc, length_normalize=cfg.algo.length_normalize)
        self.specs = {
            "likelihood_full": LikelihoodSpec(kind="elbo", **common),
            "likelihood_staircase": LikelihoodSpec(kind="staircase", block_size=self.block, **common),
        }
        batch = rollout_phase(s, 0)
        batch = score_rollouts(batch, s.task, advantage=cfg.algo.advantage)
        fill_flat_groups(batch)
        self.batch = old_logp_phase(s, batch, self.spec, 0)
        self.unit = batch.plan.scored.float()  # surrogate coefficients of the isolated train phase
        self.train()  # leaves gradients for the isolated optimizer phase

    @property
    def seq_tokens(self) -> int:
        return int(self.batch.sequences.numel())

    def rollout(self) -> float:

        batch = rollout_phase(self.s, 0)
        return float(batch.size * (batch.sequences.shape[1] - batch.prompt_len))

    def likelihood(self, name: str) -> float:

        spec = self.specs[name]
        batch = dataclasses.replace(self.batch)
        with phase_model(self.s.model) as model:
            old_policy_likelihood(
                model,
                batch,
                spec,
                micro_batch=self.mb,
                mask_id=self.mask_id,
                chunk_generator=chunk_generators(self.s.cfg, 0, model_device(self.s.model))("masks"),
                first_chunk=first_chunk(self.s),
            )
        return float(batch.plan.num_mc * self.seq_tokens)

    def train(self) -> float:

        self.s.ddp.zero_grad_buffer()
        with phase_model(self.s.ddp, backward=True) as ddp:
            accumulate_gradients(ddp, self.batch, self.spec, self.unit, micro_batch=self.mb, mask_id=self.mask_id)
        sync_gradients(self.s.ddp)
        return float(self.batch.plan.num_mc * self.seq_tokens)

    def optimizer(self) -> float:
        self.s.optimizer.step()
        return 0.0

    def step(self) -> float:

        s = self.s
        batch = rollout_phase(s, 0)
        batch = score_rollouts(batch, s.task, advantage=s.cfg.algo.advantage)
        kept = filter_phase(s, batch, PhaseTimer())  # dynamic sampling, when configured
        if kept is not None:
            fill_flat_groups(kept)
            kept = old_logp_phase(s, kept, self.spec, 0)
            policy_update(s, kept, self.spec, 0)
        return float(batch.sequences.numel())

    def jobs(self, phases: Sequence[str]) -> Dict[str, Callable[[], float]]:
        return phase_jobs(self, phases)


def phase_jobs(runner, phases: Sequence[str]) -> Dict[str, Callable[[], float]]:
    """Phase name -> callable of a runner (ours or the baseline: same method names)."""
    table = {
        "rollout": runner.rollout,
        "train": runner.train,
        "optimizer": runner.optimizer,
        "step": runner.step,
        "likelihood_full": lambda: runner.likelihood("likelihood_full"),
        "likelihood_staircase": lambda: runner.likelihood("likelihood_staircase"),
    }
    return {p: table[p] for p in phases}


def bench_config(config: Optional[str], overrides: Sequence[str], *, keep_tokenizer_vocab: bool = False) -> RunConfig:
    """The run config of a benchmark: the given one, keeping the preset's vocabulary by default
    (a random-init run otherwise shrinks the embedding to the task's tokenizer)."""
    cfg = load_config(config, list(overrides))
    if not keep_tokenizer_vocab and not cfg.model.checkpoint and "vocab_size" not in cfg.model.overrides:
        try:
            cfg.model.overrides["vocab_size"] = get_preset(cfg.model.preset).vocab_size
        except ModelConfigError as err:
            raise ConfigError(f"model.preset: {err}") from None
    return cfg
