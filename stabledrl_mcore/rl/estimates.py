"""Phase 3 and the likelihood half of phase 4: mask plans and sequence log-likelihood estimates.

A :class:`LikelihoodSpec` says how a sequence log-likelihood is estimated (which
estimator, which masks, what is scored and how it is normalised). The old policy
is scored at rollout time (:func:`old_policy_likelihood`); each inner iteration
then gets its mask plan and the current policy's token log-probs from
:func:`iteration_inputs`, by ``algo.mask_sampling``:

- ``fresh`` (the StableDRL release's ``random_masking``): the old-policy estimate and
  every inner iteration draw independent masks, so even the first ratio is a noisy
  estimate, exp(l_theta(plan_k) - l_old(plan_old));
- ``replay``: one plan per rollout batch for the old policy and every iteration
  (common random numbers, LLaDA-1.5's VRPO): at the first iteration the ratio is 1;
- ``per_iteration`` (d1): iteration k replays its own plan, scored for the old policy
  at rollout time.

Every draw comes from a generator of (seed, step, global micro-batch, phase), so the
masks do not depend on the data-parallel split and a resume replays them exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from stabledrl_mcore.algorithms.losses import spg_select_bound
from stabledrl_mcore.diffusion.likelihood import (
    dllm_config,
    elbo_from_draws,
    eubo_from_draws,
    gather_log_probs,
    vocab_sharded_logits,
)
from stabledrl_mcore.diffusion.mask_schemes import MaskRegions, build_mask_plan
from stabledrl_mcore.diffusion.masking import MaskPlan
from stabledrl_mcore.engine.pipeline import pipeline_forward, pipeline_world_size
from stabledrl_mcore.models.masks import AttentionLayout, padding_mask, staircase_position_ids
from stabledrl_mcore.models.positions import position_inputs, valid_positions
from stabledrl_mcore.rl.rollout import RolloutBatch

ESTIMATORS = ("elbo", "mean_field", "spg", "staircase")
MASK_SAMPLING = ("fresh", "replay", "per_iteration")
ChunkGenerators = Callable[[str], Callable[[int], torch.Generator]]


STAIRCASE_T = ("per_block", "per_sequence")
"""Values of ``algo.staircase_t``."""


@dataclass(frozen=True)
class LikelihoodSpec:
    """How sequence log-likelihoods are estimated (see ``diffusion.likelihood``).

    ``kind``: elbo | mean_field | spg (SPG's ELBO/EUBO sandwich) | staircase (SDAR);
    ``scheme``/``scheme_options``: the masks (``diffusion.masking``); ``post_eos``:
    visible | mask_and_skip | score; ``normalize_by``: completion | generation (the
    fixed generation width, ESPO) when ``length_normalize``.
    """

    kind: str = "elbo"
    num_mc: int = 2
    length_normalize: bool = True
    coupled: bool = False
    beta: float = 1.5  # SPG EUBO temperature
    omega: float = 0.5  # SPG mixture weight for A <= 0
    block_size: Optional[int] = None  # staircase / block-wise masking
    scheme: str = "uniform"
    scheme_options: Tuple[Tuple[str, object], ...] = ()
    prefix_mask_prob: float = 0.0
    post_eos: str = "visible"
    normalize_by: str = "completion"
    staircase_t: str = "per_block"  # staircase: a count per block, or SDAR's one t per sequence

    def __post_init__(self):
        if self.kind not in ESTIMATORS:
            raise ValueError(f"unknown likelihood {self.kind!r}; choose from {', '.join(ESTIMATORS)}")
        if self.kind == "staircase" and not self.block_size:
            raise ValueError("the staircase likelihood needs the model's block_size (SDAR)")
        if self.staircase_t not in STAIRCASE_T:
            raise ValueError(f"staircase_t must be one of {STAIRCASE_T}, got {self.staircase_t!r}")
        if self.normalize_by not in ("completion", "generation"):
            raise ValueError(f"normalize_by must be completion or generation, got {self.normalize_by!r}")


@dataclass
class OldEstimate:
    """The old policy under one mask plan: token log-probs ``[M, N, S]``, the estimate the
    loss differentiates (``logp`` [N]) and the one importance ratios compare (``ratio_logp``)."""

    plan: MaskPlan
    token_logp: torch.Tensor
    logp: torch.Tensor
    ratio_logp: torch.Tensor


def scored_region(batch: RolloutBatch, spec: LikelihoodSpec) -> torch.Tensor:
    """``[N, S]`` positions a likelihood may score: the completion up to and including EOS,
    or every generated position with ``post_eos="score"``."""
    if spec.post_eos != "score":
        return batch.completion_mask
    positions = torch.arange(batch.sequences.shape[1], device=batch.sequences.device)
    return (positions >= batch.prompt_len)[None].expand_as(batch.completion_mask)


def draw_plan(
    batch: RolloutBatch,
    spec: LikelihoodSpec,
    chunk_generator: Callable[[int], torch.Generator],
    *,
    micro_batch: int,
    first_chunk: int = 0,
) -> MaskPlan:
    """The masks of one likelihood evaluation of the rank batch.

    Drawn per micro-batch ``k`` from ``chunk_generator(first_chunk + k)`` (stratified
    within it), so the masks do not depend on the data-parallel split. The scheme
    (``diffusion.mask_schemes``): ``full`` for mean field (one draw), ``uniform`` with a
    count per block for the staircase, else ``spec.scheme``; then the post-EOS policy.
    """
    if batch.source is not None:  # dynamic sampling: a kept row keeps the masks it has in the unfiltered batch
        full = draw_plan(batch.source, spec, chunk_generator, micro_batch=micro_batch, first_chunk=first_chunk)
        return dataclasses.replace(
            full, **{name: getattr(full, name)[:, batch.source_rows] for name in ("masked", "weight", "ratio")}
        )
    scheme, options = _scheme(spec)
    plans = []
    for k, start in enumerate(range(0, batch.size, micro_batch)):
        rows = slice(start, start + micro_batch)
        regions = MaskRegions.from_batch(
            batch.sequences[rows],
            batch.prompt_len,
            completion_mask=batch.completion_mask[rows, batch.prompt_len :],  # the generation: nothing to check
            prompt_valid=batch.prompt_valid[rows],
        )
        plans.append(
            build_mask_plan(
                regions,
                scheme,
                num_mc=1 if scheme == "full" else spec.num_mc,
                generator=chunk_generator(first_chunk + k),
                post_eos=spec.post_eos,
                **options,
            )
        )
    return dataclasses.replace(
        plans[0], **{name: torch.cat([getattr(p, name) for p in plans], 1) for name in ("masked", "weight", "ratio")}
    )


def _scheme(spec: LikelihoodSpec):
    """``(scheme name, options)`` of ``spec`` for :func:`~..diffusion.mask_schemes.build_mask_plan`."""
    if spec.kind == "mean_field":
        return "full", {"prefix_mask_prob": spec.prefix_mask_prob}
    if spec.kind == "staircase":
        if spec.staircase_t == "per_sequence":  # SDAR's objective: p = eps + (1 - eps) t, weight 1/p
            return "uniform", {"block_size": spec.block_size, "mode": "ratio", "one_ratio_per_sequence": True}
        return "uniform", {"block_size": spec.block_size, "coupled": spec.coupled}
    if spec.scheme == "uniform":
        return "uniform", {"coupled": spec.coupled, "prefix_mask_prob": spec.prefix_mask_prob}
    return spec.scheme, dict(spec.scheme_options, prefix_mask_prob=spec.prefix_mask_prob)


def token_logp_inputs(
    batch: RolloutBatch,
    plan: MaskPlan,
    spec: LikelihoodSpec,
    *,
    rows: slice,
    mask_id: int,
    draw: int,
    model_config,
) -> Tuple[Dict[str, object], Callable[[torch.Tensor], torch.Tensor]]:
    """``(model keyword arguments, reduce)`` of :func:`token_logp`: ``reduce(logits)`` gives the
    ``[n, S]`` token log-probs (under pipeline parallelism it runs on the last stage).

    The position ids do not count the prompts' left padding (``model_config``'s scheme, see
    :func:`~..models.positions.position_inputs`): a row is scored as it was decoded, and as it
    would be alone, whatever the batch's width.

    At TP > 1 the model is asked for vocab-sharded logits (``gather_output=False``) and
    ``reduce`` takes the scored rows' log-probs with the vocab-parallel cross-entropy
    (:func:`~..diffusion.likelihood.gather_log_probs`), a TP-group collective: no rank
    gathers ``[n, S, V]``. At TP = 1 both are what they always were (gathered logits,
    full-vocab ``log_softmax``)."""
    ids = batch.sequences[rows]
    noisy = ids.masked_fill(plan.masked[draw, rows], mask_id)
    scored = plan.scored[draw, rows]
    n = ids.shape[1]
    pads = batch.prompt_pads()
    # the padding never counts as a position: the row scores as it decoded (and as it would alone)
    valid = None if pads is not None and not any(pads) else batch.prompt_valid[rows]
    if spec.kind == "staircase":
        x = torch.cat([noisy, ids], 1)
        pos = staircase_position_ids(n, device=ids.device) if valid is None else valid_positions(valid).repeat(1, 2)
        positions = {"position_ids": pos}
        layout = AttentionLayout.staircase(spec.block_size)
    else:
        x, layout = noisy, AttentionLayout.bidirectional()
        positions = position_inputs(model_config, noisy, valid)
    if pads is not None:
        mask = layout.with_padding(pads[rows])
    else:  # not a left pad (never made by the rollout): a dense key mask
        keys_ok = batch.prompt_valid[rows]
        keys = padding_mask(torch.cat([keys_ok, keys_ok], 1) if spec.kind == "staircase" else keys_ok)
        pattern = layout.dense(x.shape[1], x.shape[1], device=ids.device)
        mask = keys if pattern is None else pattern | keys
    # The head runs on the completion's positions only (prompt positions are never scored).
    p = batch.prompt_len
    sharded = vocab_sharded_logits()
    return (
        {
            "input_ids": x,
            "position_ids": None,
            **positions,
            "attention_mask": mask,
            "logit_positions": slice(p, n),
            "gather_output": not sharded,
        },
        lambda logits: F.pad(gather_log_probs(logits, ids[:, p:], scored[:, p:], vocab_parallel=sharded), (p, 0)),
    )


def token_logp(
    model, batch: RolloutBatch, plan: MaskPlan, spec: LikelihoodSpec, *, rows: slice, mask_id: int, draw: int
) -> torch.Tensor:
    """log p(clean token | noisy input) for ``rows`` under draw ``draw``: ``[n, S]``, 0 off the scored set.

    The attention is an :class:`AttentionLayout` (staircase for SDAR, bidirectional for
    LLaDA) carrying the prompts' left-pad counts, so no dense mask is built on GPU;
    the counts are read once per batch (``RolloutBatch.prompt_pads`` keeps them).
    """
    inputs, reduce = token_logp_inputs(
        batch, plan, spec, rows=rows, mask_id=mask_id, draw=draw, model_config=dllm_config(model)
    )
    return reduce(model(**inputs))


def chunks(num_mc: int, size: int, micro_batch: int):
    """``(draw, start, rows)`` of every draw x micro-batch, in the order the update visits them."""
    for draw in range(num_mc):
        for start in range(0, size, micro_batch):
            yield draw, start, slice(start, start + micro_batch)


def token_logp_micro_batches(
    batch: RolloutBatch,
    plan: MaskPlan,
    spec: LikelihoodSpec,
    order: Sequence[Tuple[int, int, slice]],
    *,
    mask_id: int,
    model_config,
) -> Tuple[List[Dict[str, object]], Callable[[torch.Tensor, int], torch.Tensor]]:
    """``(micro-batches, last_stage_fn)`` of the ``(draw, start, rows)`` chunks ``order`` for
    :func:`~..engine.pipeline.pipeline_forward` and ``pipeline_forward_backward``:
    ``last_stage_fn(logits, i)`` gives chunk ``i``'s ``[n, S]`` token log-probs (:func:`token_logp`)."""
    parts = [
        token_logp_inputs(batch, plan, spec, rows=rows, mask_id=mask_id, draw=draw, model_config=model_config)
        for draw, _, rows in order
    ]
    return [inputs for inputs, _ in parts], lambda logits, i: parts[i][1](logits)


def all_token_logp(
    model,
    batch: RolloutBatch,
    plan: MaskPlan,
    spec: LikelihoodSpec,
    *,
    micro_batch: int,
    mask_id: int,
    graphs: Optional[Dict[Tuple[int, int], torch.Tensor]] = None,
) -> torch.Tensor:
    """``[M, N, S]`` token log-probs of the whole rank batch, detached.

    Every (draw, micro-batch) chunk is one micro-batch of :func:`~..engine.pipeline.pipeline_forward`:
    a plain forward each without pipeline parallelism, else forward-only pipeline schedules with
    the log-probs reduced on the last stage and broadcast to every stage.

    Without ``graphs`` the forwards run under ``no_grad``. With ``graphs`` (a dict,
    ``parallel.retain_update_graph``, PP=1 only) they record autograd and each micro-batch's
    log-probs are kept under ``(draw, start)`` for :func:`accumulate_gradients`: one
    forward less per inner iteration, at the cost of holding activations for the
    whole rank batch x ``num_mc``.
    """
    if graphs is not None and pipeline_world_size() > 1:
        raise ValueError("parallel.retain_update_graph cannot be combined with pipeline parallelism")
    order = list(chunks(plan.num_mc, batch.size, micro_batch))
    inputs, reduce = token_logp_micro_batches(
        batch, plan, spec, order, mask_id=mask_id, model_config=dllm_config(model)
    )
    with torch.set_grad_enabled(graphs is not None):
        toks = pipeline_forward(model, inputs, reduce)
    out = None  # float32, or the log-probs' own dtype if wider (a float64 model in tests)
    for (draw, start, rows), tok in zip(order, toks):
        if out is None:
            out = torch.zeros(
                plan.masked.shape, dtype=torch.promote_types(tok.dtype, torch.float32), device=plan.masked.device
            )
        out[draw, rows] = tok.detach().to(out.dtype)
        if graphs is not None:
            graphs[(draw, start)] = tok
    return out


def _normalised(seq: torch.Tensor, batch: RolloutBatch, spec: LikelihoodSpec) -> torch.Tensor:
    if spec.length_normalize and spec.normalize_by == "generation":
        return seq / float(batch.sequences.shape[1] - batch.prompt_len)
    return seq


def elbo_estimates(tok: torch.Tensor, plan: MaskPlan, batch: RolloutBatch, spec: LikelihoodSpec) -> torch.Tensor:
    """Per-sequence ELBO estimates ``[N]``, differentiable in the token log-probs ``tok``."""
    own_length = spec.length_normalize and spec.normalize_by == "completion"
    lo, _ = elbo_from_draws(tok, plan, scored_region(batch, spec), own_length)
    return _normalised(lo, batch, spec)


def sequence_estimates_and_elbo(
    tok: torch.Tensor, plan: MaskPlan, batch: RolloutBatch, spec: LikelihoodSpec
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(estimate, elbo)``, both ``[N]`` and differentiable in the token log-probs ``tok``.

    ``estimate`` is what the loss differentiates: the ELBO, or SPG's sandwich (ELBO for
    A > 0, ``omega`` EUBO + (1 - omega) ELBO otherwise); ``elbo`` is what importance ratios
    compare (also under the sandwich, as released). One ELBO serves both.
    """
    lo = elbo_estimates(tok, plan, batch, spec)
    if spec.kind != "spg":
        return lo, lo
    own_length = spec.length_normalize and spec.normalize_by == "completion"
    hi, _ = eubo_from_draws(tok, plan, scored_region(batch, spec), spec.beta, own_length)
    return spg_select_bound(lo, _normalised(hi, batch, spec), batch.advantages, mix=spec.omega), lo


def sequence_estimates(tok: torch.Tensor, plan: MaskPlan, batch: RolloutBatch, spec: LikelihoodSpec) -> torch.Tensor:
    """Per-sequence estimates ``[N]`` the loss differentiates (see :func:`sequence_estimates_and_elbo`)."""
    return sequence_estimates_and_elbo(tok, plan, batch, spec)[0]


def estimate(tok: torch.Tensor, plan: MaskPlan, batch: RolloutBatch, spec: LikelihoodSpec) -> OldEstimate:
    """Both estimates of detached token log-probs under ``plan``."""
    logp, elbo = sequence_estimates_and_elbo(tok, plan, batch, spec)
    return OldEstimate(plan, tok, logp.detach(), elbo.detach())


def old_policy_likelihood(
    model,
    batch: RolloutBatch,
    spec: LikelihoodSpec,
    *,
    micro_batch: int,
    mask_id: int,
    chunk_generator: Callable[[int], torch.Generator],
    first_chunk: int = 0,
    sampling: str = "replay",
    iteration_generators: Optional[Callable[[int], Callable[[int], torch.Generator]]] = None,
    iterations: int = 1,
) -> RolloutBatch:
    """Phase 3: draw the masks, score the old policy, keep both on the batch.

    ``batch.plan``/``old_token_logp``/``old_logp``/``old_ratio_logp`` hold the estimate
    under the rollout-time plan. With ``sampling="per_iteration"`` every inner
    iteration ``k >= 1`` also gets its own plan (``iteration_generators(k)``), scored
    here: ``batch.iteration_estimates[k]`` (``[0]`` is the rollout-time estimate).
    """
    if sampling not in MASK_SAMPLING:
        raise ValueError(f"mask sampling must be one of {MASK_SAMPLING}, got {sampling!r}")

    def score(generator) -> OldEstimate:
        plan = draw_plan(batch, spec, generator, micro_batch=micro_batch, first_chunk=first_chunk)
        tok = all_token_logp(model, batch, plan, spec, micro_batch=micro_batch, mask_id=mask_id)
        return estimate(tok, plan, batch, spec)

    first = score(chunk_generator)
    batch.plan, batch.old_token_logp = first.plan, first.token_logp
    batch.old_logp, batch.old_ratio_logp = first.logp, first.ratio_logp
    batch.iteration_estimates = []
    if sampling == "per_iteration":
        if iteration_generators is None:
            raise ValueError("per_iteration mask sampling needs iteration_generators")
        batch.iteration_estimates = [first] + [score(iteration_generators(k)) for k in range(1, iterations)]
    return batch


def old_estimate(batch: RolloutBatch, inner: int = 0, sampling: str = "replay") -> OldEstimate:
    """The old policy's estimate iteration ``inner`` compares against: the batch's rollout-time
    estimate, or with ``per_iteration`` iteration ``inner``'s own."""
    if sampling == "per_iteration" and inner > 0:
        return batch.iteration_estimates[inner]
    return OldEstimate(
        batch.plan,
        batch.old_token_logp,
        batch.old_logp,
        batch.old_logp if batch.old_ratio_logp is None else batch.old_ratio_logp,
    )


def iteration_inputs(
    model,
    batch: RolloutBatch,
    spec: LikelihoodSpec,
    inner: int,
    *,
    sampling: str,
    micro_batch: int,
    mask_id: int,
    chunk_generator: Callable[[int], torch.Generator],
    first_chunk: int = 0,
    retain_graph: bool = False,
) -> Tuple[OldEstimate, MaskPlan, torch.Tensor, Optional[Dict[Tuple[int, int], torch.Tensor]]]:
    """``(old estimate, plan, current token log-probs, retained graphs)`` of inner iteration ``inner``.

    The plan is the old one (``replay``; ``per_iteration``: iteration ``inner``'s own) or
    freshly drawn from ``chunk_generator`` (``fresh``). At the first iteration of a replayed
    plan the weights are the old ones, so the old log-probs are reused (no forward);
    otherwise the current policy is scored (recording its graph with ``retain_graph``).
    """
    old = old_estimate(batch, inner, sampling)
    if sampling == "fresh":
        plan = draw_plan(batch, spec, chunk_generator, micro_batch=micro_batch, first_chunk=first_chunk)
    else:
        plan = old.plan
    if sampling != "fresh" and inner == 0:
        return old, plan, old.token_logp, None
    graphs = {} if retain_graph else None
    current = all_token_logp(model, batch, plan, spec, micro_batch=micro_batch, mask_id=mask_id, graphs=graphs)
    return old, plan, current, graphs
