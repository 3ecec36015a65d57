"""``algo.mask_sampling``: fresh masks make the first ratio a noisy estimate, replay makes it 1.

On a toy model, the first inner iteration's log-ratio with ``fresh`` masks is the
difference of two independent single-draw ELBO estimates of the same policy, so
its variance must be twice the estimator's variance, which is computed here
exactly by enumerating every mask (count l ~ U{1..L}, then a uniform subset of
size l, as LLaDA's likelihood evaluation draws it).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig
from stabledrl_mcore.rl.estimates import LikelihoodSpec, elbo_estimates, iteration_inputs, old_policy_likelihood
from stabledrl_mcore.rl.rollout import RolloutBatch

P, L = 2, 4  # prompt and completion lengths


def toy_batch(n=4, seed=0, vocab=12):
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(2, vocab - 2, (n, P + L), generator=g)
    comp = torch.zeros(n, P + L, dtype=torch.bool)
    comp[:, P:] = True
    return RolloutBatch(
        sequences=seqs,
        prompt_len=P,
        prompt_valid=torch.ones_like(comp),
        completion_mask=comp,
        group_index=torch.arange(n) // 2,
        completions=[""] * n,
        references=[None] * n,
        advantages=torch.tensor([1.0, -1.0] * (n // 2)),
    )


def toy_model():
    return ToyDiffusionLM(
        ToyDLLMConfig(vocab_size=12, mask_token_id=11, eos_token_id=1, pad_token_id=1, hidden_size=16),
        seed=3,
        dtype=torch.float64,
    ).eval()


def generators(step):
    return lambda phase: lambda k: torch.Generator().manual_seed(hash((step, phase, k)) % 2**62)


def exact_estimator_variance(model, batch):
    """Var of the length-normalised single-draw ELBO of every row, by enumeration."""
    out = []
    mask_id = model.dllm_config.mask_token_id
    for row in batch.sequences:
        values, probs = [], []
        for count in range(1, L + 1):
            for subset in itertools.combinations(range(L), count):
                noisy = row.clone()
                pos = [P + j for j in subset]
                noisy[pos] = mask_id
                with torch.no_grad():
                    logp = torch.log_softmax(model(noisy[None])[0].double(), -1)
                values.append(sum(float(logp[p, row[p]]) for p in pos) / count)
                probs.append(1.0 / L / math.comb(L, count))
        v, p = torch.tensor(values, dtype=torch.float64), torch.tensor(probs, dtype=torch.float64)
        mean = (p * v).sum()
        out.append(float((p * (v - mean) ** 2).sum()))
    return torch.tensor(out, dtype=torch.float64)


def first_log_ratio(model, batch, spec, sampling, step, inner=0):
    gens = generators(step)
    old_policy_likelihood(
        model,
        batch,
        spec,
        micro_batch=batch.size,
        mask_id=11,
        chunk_generator=gens("masks"),
        sampling=sampling,
        iteration_generators=lambda k: gens(f"masks/iter{k}"),
        iterations=2,
    )
    old, plan, current, _ = iteration_inputs(
        model,
        batch,
        spec,
        inner,
        sampling=sampling,
        micro_batch=batch.size,
        mask_id=11,
        chunk_generator=gens(f"masks/iter{inner}"),
    )
    return elbo_estimates(current, plan, batch, spec) - old.ratio_logp


def test_fresh_first_iteration_log_ratio_variance_is_twice_the_estimator_variance():
    model, batch = toy_model(), toy_batch()
    spec = LikelihoodSpec(kind="elbo", num_mc=1, length_normalize=True)
    draws = torch.stack([first_log_ratio(model, batch, spec, "fresh", step) for step in range(600)])
    measured = draws.var(0)
    predicted = 2 * exact_estimator_variance(model, batch)
    assert (predicted > 1e-3).all(), predicted  # the toy model's estimates really vary with the mask
    assert draws.mean(0).abs().max() < 4 * (predicted / 600).sqrt().max()  # two draws of one estimator
    rel = (measured / predicted - 1).abs()
    assert rel.max() < 0.25, (measured, predicted)  # ~6% standard error per row at 600 draws


@pytest.mark.parametrize("sampling", ["replay", "per_iteration"])
def test_replayed_plans_give_exactly_one_at_the_first_iteration(sampling):
    model, batch = toy_model(), toy_batch()
    spec = LikelihoodSpec(kind="elbo", num_mc=2, length_normalize=True)
    assert torch.equal(first_log_ratio(model, batch, spec, sampling, 0), torch.zeros(batch.size, dtype=torch.float64))


def test_plans_per_sampling_mode():
    model, batch = toy_model(), toy_batch()
    spec = LikelihoodSpec(kind="elbo", num_mc=2)
    gens = generators(7)
    for sampling in ("fresh", "replay", "per_iteration"):
        old_policy_likelihood(
            model,
            batch,
            spec,
            micro_batch=2,
            mask_id=11,
            chunk_generator=gens("masks"),
            sampling=sampling,
            iteration_generators=lambda k: gens(f"masks/iter{k}"),
            iterations=3,
        )
        plans = [
            iteration_inputs(
                model,
                batch,
                spec,
                k,
                sampling=sampling,
                micro_batch=2,
                mask_id=11,
                chunk_generator=gens(f"masks/iter{k}"),
            )[1]
            for k in range(3)
        ]
        same = [torch.equal(p.masked, batch.plan.masked) for p in plans]
        if sampling == "replay":
            assert same == [True, True, True]
        elif sampling == "per_iteration":
            assert same == [True, False, False] and len(batch.iteration_estimates) == 3
            assert torch.equal(plans[2].masked, batch.iteration_estimates[2].plan.masked)
        else:
            assert same == [False, False, False]
            assert not torch.equal(plans[1].masked, plans[2].masked)
