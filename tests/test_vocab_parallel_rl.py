"""At TP=2 the RL, likelihood and SFT paths take vocab-parallel log-probs (issue #39).

One spawned 2-rank gloo job (TP=2, PP=1) builds a tiny LLaDA (ELBO) and a tiny SDAR
(staircase likelihood) with a padded vocabulary (250 ids padded to 256: rank 1's shard holds
six padding columns) and, on each rank:

- ``rl.estimates.all_token_logp`` (no-grad and graph-retaining) and the gradients of
  ``rl.update.accumulate_gradients`` (a fresh forward, and the retained graphs) equal a
  reference computed in the same process from *gathered* logits (``gather_output=True``,
  a full-vocabulary ``log_softmax`` at every completion position, zeroed off the scored set);
- ``diffusion.elbo`` / ``block_elbo_staircase`` and the SFT loss
  (``diffusion.pretrain.sft_sequence_losses``) equal the same estimators fed gathered logits
  (values and parameter gradients);
- no logits gather happens on those calls: ``tensor_parallel.gather_from_tensor_model_parallel_region``
  (what ``DLLMModel.forward`` gathers with) and every ``torch.distributed`` all-gather are
  counted, and the count must be 0 (the reference's gathered forwards count > 0, so the
  counter sees the model's gather).

Tolerance (float32 model): token log-probs and estimates to ``1e-5`` absolute; parameter
gradients to ``1e-5 * max(1, max |grad|)`` per tensor. Megatron's kernel normalises with a
max/sum all-reduce instead of one ``log_softmax``, so a few ulps differ.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from stabledrl_mcore.parallel.launch import spawn

TOL = 1e-5
VOCAB, MASK_ID, PAD_MULTIPLE = 250, 249, 64  # padded to 256 at TP=2 (a multiple of 64 x 2)
P, L, N, MICRO = 4, 8, 4, 2


@contextlib.contextmanager
def counting_gathers():
    """Count the model's logits gathers and every tensor all-gather of torch.distributed."""
    import megatron.core.tensor_parallel as tp_pkg
    import megatron.core.tensor_parallel.mappings as mappings

    calls = []
    saved = [
        (tp_pkg, "gather_from_tensor_model_parallel_region"),
        (mappings, "dist_all_gather_func"),
        (torch.distributed, "all_gather"),
        (torch.distributed, "all_gather_into_tensor"),
    ]
    originals = [getattr(owner, name) for owner, name in saved]

    def counted(label, fn):
        def wrapper(*args, **kwargs):
            calls.append(label)
            return fn(*args, **kwargs)

        return wrapper

    for (owner, name), fn in zip(saved, originals):
        setattr(owner, name, counted(name, fn))
    try:
        yield calls
    finally:
        for (owner, name), fn in zip(saved, originals):
            setattr(owner, name, fn)


def _full_logp(logits, targets):
    """The reference: full-vocabulary log_softmax of gathered logits, at the targets."""
    return torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class Gathered(torch.nn.Module):
    """The model with gathered logits whatever the caller asks (the reference's forwards)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.dllm_config = module.dllm_config

    def forward(self, *args, gather_output=True, **kwargs):
        return self.module(*args, gather_output=True, **kwargs)


def _grads(model):
    out = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _grad_gap(got, want):
    """Worst per-tensor ``max |diff| / max(1, max |want|)`` (inf if the tensors differ in kind)."""
    if set(got) != set(want) or not want:
        return float("inf")
    return max(((got[k] - want[k]).abs().max() / max(1.0, want[k].abs().max().item())).item() for k in want)


def _batch(seed):
    from stabledrl_mcore.rl.rollout import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(3, MASK_ID, (N, P + L), generator=g)  # ids on both vocabulary shards
    comp = torch.zeros(N, P + L, dtype=torch.bool)
    comp[:, P:] = True
    comp[1, P + L - 2 :] = False  # a row ending early
    valid = torch.ones_like(comp)
    valid[0, :1] = False  # a left-padded prompt: the layout carries its pad count
    seqs[0, :1] = 0
    return RolloutBatch(
        sequences=seqs,
        prompt_len=P,
        prompt_valid=valid,
        completion_mask=comp,
        group_index=torch.arange(N) // 2,
        completions=[""] * N,
        references=[None] * N,
        advantages=torch.tensor([1.0, -1.0] * (N // 2)),
    )


def _rl_checks(model, arch, result):
    import torch.nn.functional as F

    from stabledrl_mcore.rl.estimates import LikelihoodSpec, all_token_logp, chunks, draw_plan, token_logp_inputs
    from stabledrl_mcore.rl.update import accumulate_gradients

    spec = LikelihoodSpec(kind="staircase", num_mc=2, block_size=4) if arch == "sdar" else LikelihoodSpec(num_mc=2)
    batch = _batch(1)
    plan = draw_plan(batch, spec, lambda k: torch.Generator().manual_seed(100 + k), micro_batch=MICRO)
    coef = torch.randn(plan.masked.shape, generator=torch.Generator().manual_seed(7)) * plan.scored
    coef[1, :MICRO] = 0.0  # a chunk without weight: skipped by the update

    # the reference: gathered logits, full-vocab log_softmax at every completion position
    model.zero_grad(set_to_none=True)
    with counting_gathers() as ref_calls:
        want = torch.zeros(plan.masked.shape)
        for draw, _, rows in chunks(plan.num_mc, batch.size, MICRO):
            inputs, _ = token_logp_inputs(
                batch, plan, spec, rows=rows, mask_id=MASK_ID, draw=draw, model_config=model.dllm_config
            )
            logits = model(**dict(inputs, gather_output=True))
            assert logits.shape[-1] == VOCAB
            ids, scored = batch.sequences[rows], plan.scored[draw, rows]
            tok = F.pad(_full_logp(logits, ids[:, P:]), (P, 0)) * scored
            want[draw, rows] = tok.detach()
            (coef[draw, rows] * tok).sum().backward()
    want_grads = _grads(model)
    result[f"{arch}/reference_gathers"] = len(ref_calls)

    with counting_gathers() as calls:
        with torch.no_grad():
            got = all_token_logp(model, batch, plan, spec, micro_batch=MICRO, mask_id=MASK_ID)
        accumulate_gradients(model, batch, spec, coef, micro_batch=MICRO, mask_id=MASK_ID, plan=plan)
        got_grads = _grads(model)
        graphs = {}
        retained = all_token_logp(model, batch, plan, spec, micro_batch=MICRO, mask_id=MASK_ID, graphs=graphs)
        accumulate_gradients(model, batch, spec, coef, micro_batch=MICRO, mask_id=MASK_ID, plan=plan, retained=graphs)
        retained_grads = _grads(model)
    result[f"{arch}/rl_gathers"] = len(calls)
    result[f"{arch}/all_token_logp"] = (got - want).abs().max().item()
    result[f"{arch}/all_token_logp_retained"] = (retained - want).abs().max().item()
    result[f"{arch}/update_grads"] = _grad_gap(got_grads, want_grads)
    result[f"{arch}/update_grads_retained"] = _grad_gap(retained_grads, want_grads)
    result[f"{arch}/scored_positions"] = int(plan.scored.sum())


def _likelihood_checks(model, arch, result):
    from stabledrl_mcore.diffusion.likelihood import elbo
    from stabledrl_mcore.diffusion.pretrain import sft_mask_plan, sft_sequence_losses
    from stabledrl_mcore.diffusion.staircase import block_elbo_staircase

    batch = _batch(2)
    ids, comp = batch.sequences, batch.completion_mask
    bs = 4 if arch == "sdar" else None

    def estimate(m, **kw):
        if arch == "sdar":
            return block_elbo_staircase(m, ids, comp, bs, num_mc=2, mask_id=MASK_ID, **kw)
        return elbo(m, ids, comp, num_mc=2, mask_id=MASK_ID, **kw)

    first = estimate(model, generator=torch.Generator().manual_seed(3))  # draws the plan
    model.zero_grad(set_to_none=True)
    with counting_gathers() as ref_calls:
        ref = estimate(Gathered(model), plan=first.plan, logprob_fn=_full_logp)
        ref.seq.sum().backward()
        ref_grads = _grads(model)
        sft_plan = sft_mask_plan(comp, generator=torch.Generator().manual_seed(4), block_size=bs)
        ref_sft = estimate(Gathered(model), plan=sft_plan, logprob_fn=_full_logp)
        # the SFT loss: -sum_i w_i log p(x_i | x_t) / answer length (one draw: token = w * log p)
        ref_loss = -ref_sft.token.sum(-1) / comp.sum(-1).clamp(min=1)
        ref_loss.sum().backward()
        ref_sft_grads = _grads(model)
    assert ref_calls, "the gathered reference must gather (the counter sees the model's gather)"

    with counting_gathers() as calls:
        got = estimate(model, plan=first.plan)
        got.seq.sum().backward()
        got_grads = _grads(model)
        loss, _ = sft_sequence_losses(model, ids, comp, mask_id=MASK_ID, plan=sft_plan, block_size=bs)
        loss.sum().backward()
        sft_grads = _grads(model)
    result[f"{arch}/likelihood_gathers"] = len(calls)
    result[f"{arch}/likelihood_token"] = (got.token - ref.token).abs().max().item()
    result[f"{arch}/likelihood_seq"] = (got.seq - ref.seq).abs().max().item()
    result[f"{arch}/likelihood_grads"] = _grad_gap(got_grads, ref_grads)
    result[f"{arch}/sft_loss"] = (loss - ref_loss).abs().max().item()
    result[f"{arch}/sft_grads"] = _grad_gap(sft_grads, ref_sft_grads)


def _worker(result_dir):
    from megatron.core import parallel_state

    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    rank = int(os.environ["RANK"])
    bootstrap.initialize(2, 1, seed=0)
    result = {}
    for arch in ("llada", "sdar"):
        cfg = get_preset(
            f"{arch}-tiny",
            vocab_size=VOCAB,
            mask_token_id=MASK_ID,
            make_vocab_size_divisible_by=PAD_MULTIPLE,
            num_layers=2,
            max_position_embeddings=64,
        )
        model = build_model(cfg).train()
        result[f"{arch}/padded_vocab"] = (model.vocab_size, model.padded_vocab_size)
        _rl_checks(model, arch, result)
        _likelihood_checks(model, arch, result)
    torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab_parallel_rl")
    spawn(_worker, 2, (str(out),), timeout=300)  # ranks are stopped by PID on failure or timeout
    return [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]


CLOSE = (
    "all_token_logp",
    "all_token_logp_retained",
    "update_grads",
    "update_grads_retained",
    "likelihood_token",
    "likelihood_seq",
    "likelihood_grads",
    "sft_loss",
    "sft_grads",
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", ["llada", "sdar"])
def test_tp2_rl_paths_match_the_gathered_reference(tp2_results, arch):
    for rank, result in enumerate(tp2_results):
        assert result[f"{arch}/padded_vocab"] == (VOCAB, 256), "the vocabulary must be padded"
        assert result[f"{arch}/scored_positions"] > 0
        far = {k: result[f"{arch}/{k}"] for k in CLOSE if not result[f"{arch}/{k}"] <= TOL}
        assert not far, f"rank {rank} {arch}: above {TOL}: {far}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", ["llada", "sdar"])
def test_tp2_rl_paths_gather_no_logits(tp2_results, arch):
    for rank, result in enumerate(tp2_results):
        assert result[f"{arch}/reference_gathers"] > 0, "the counter must see the gathered reference"
        gathers = {k: result[f"{arch}/{k}_gathers"] for k in ("rl", "likelihood")}
        assert gathers == {"rl": 0, "likelihood": 0}, f"rank {rank} {arch}: all-gathers on the RL paths: {gathers}"
