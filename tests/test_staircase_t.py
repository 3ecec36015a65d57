"""``algo.staircase_t: per_sequence``: SDAR's own objective draws one t per sequence for all its
blocks (``modeling_sdar.py``); the staircase estimate stays unbiased (each block's (t, mask) has the
same marginal as with a t per block) and its variance is measured against the per-block draws."""

import pytest
import torch

from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.diffusion import block_elbo_staircase
from stabledrl_mcore.diffusion.masking import build_plan
from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig
from stabledrl_mcore.rl.estimates import LikelihoodSpec, draw_plan
from stabledrl_mcore.rl.rollout import RolloutBatch

BS, N = 4, 6000  # block size; Monte Carlo draws (one per row)


def _toy():
    torch.manual_seed(0)
    return ToyDiffusionLM(ToyDLLMConfig(arch="sdar", block_size=BS)).eval()


def _batch(rows: int):
    ids = torch.tensor([[3, 4, 5, 6, 7, 2, 9, 8, 4, 10, 11, 12]]).expand(rows, -1)  # 1 prompt + 2 completion blocks
    comp = torch.zeros_like(ids, dtype=torch.bool)
    comp[:, BS:] = True
    return ids, comp


def _estimates(model, per_sequence: bool, seed: int):
    ids, comp = _batch(N)
    g = torch.Generator().manual_seed(seed)
    plan = build_plan(comp, num_mc=1, generator=g, mode="ratio", block_size=BS, one_ratio_per_sequence=per_sequence)
    with torch.no_grad():
        return block_elbo_staircase(model, ids, comp, plan=plan).seq.double(), plan


def test_one_t_per_sequence_is_shared_by_its_blocks_and_estimates_the_same_block_elbo():
    model = _toy()
    shared, plan = _estimates(model, True, 1)
    per_block, plan_b = _estimates(model, False, 2)
    ratio = plan.ratio[0]  # [N, blocks]: the prompt block has no completion, p only on the two others
    assert torch.equal(ratio[:, 1], ratio[:, 2]) and not torch.equal(plan_b.ratio[0][:, 1], plan_b.ratio[0][:, 2])
    se = (shared.var() / N + per_block.var() / N).sqrt()
    assert abs(shared.mean() - per_block.mean()) < 4 * se, (shared.mean(), per_block.mean(), se)
    # the weight identity behind the unbiasedness: E[1[masked] / p] = 1 at every completion position
    weight = plan.weight[0][:, BS:].double()
    assert (weight.mean(0) - 1).abs().max() < 4 * weight.std(0).max() / N**0.5


def test_the_config_option_reaches_the_trainers_plans_and_is_refused_elsewhere():
    spec = LikelihoodSpec(kind="staircase", block_size=BS, num_mc=2, staircase_t="per_sequence")
    ids, comp = _batch(3)
    batch = RolloutBatch(
        sequences=ids.clone(),
        prompt_len=BS,
        prompt_valid=torch.ones(3, BS, dtype=torch.bool),
        completion_mask=comp.clone(),
        group_index=torch.arange(3),
        completions=["", "", ""],
        references=[None] * 3,
    )
    plan = draw_plan(batch, spec, lambda k: torch.Generator().manual_seed(k), micro_batch=3)
    assert plan.mode == "ratio" and torch.equal(plan.ratio[..., 1], plan.ratio[..., 2])
    with pytest.raises(ValueError, match="staircase_t"):
        LikelihoodSpec(kind="staircase", block_size=BS, staircase_t="per_token")
    with pytest.raises(Exception, match=r"algo.staircase_t=per_sequence chooses the staircase likelihood"):
        load_config(None, ["algo.staircase_t=per_sequence"])
