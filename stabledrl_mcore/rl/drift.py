"""Policy drift: how far the policy has moved from the initial one (``logging.drift_to_initial``).

At every step, after the old policy is scored (phase 3), the frozen initial policy is
scored on the same rollouts under the same mask plan, and both sequence estimates are
compared. With ``d_i = l_old(y_i) - l_init(y_i)``, the estimated log-ratio of rollout
``y_i`` (the likelihood the importance ratios use: the ELBO, or the one-step mean-field
estimate, length-normalised as the loss is),

- ``drift_to_initial`` = mean_i d_i (k1), and
- ``drift_to_initial_k3`` = mean_i (exp(-d_i) - 1 + d_i) (Schulman's k3, >= 0 per sample).

The rollouts are drawn from the old policy, so with exact log-likelihoods both are
unbiased estimates of KL(pi_old || pi_init) (per scored token when length-normalised);
with the Monte-Carlo estimators they estimate the same KL of the surrogate likelihoods
on shared masks. Both are exactly 0 while the policy equals the initial one.
"""

from __future__ import annotations

from typing import Dict

import torch

from stabledrl_mcore.engine.expert import phase_model
from stabledrl_mcore.rl.estimates import LikelihoodSpec, all_token_logp, sequence_estimates_and_elbo
from stabledrl_mcore.rl.rollout import RolloutBatch


def drift_from_estimates(old_logp: torch.Tensor, initial_logp: torch.Tensor) -> Dict[str, float]:
    """``{"drift_to_initial": mean(d), "drift_to_initial_k3": mean(exp(-d) - 1 + d)}``, ``d = old - initial``."""
    d = (old_logp.double() - initial_logp.double()).flatten()
    if d.numel() == 0:
        return {"drift_to_initial": 0.0, "drift_to_initial_k3": 0.0}
    k3 = torch.expm1(-d) + d
    return {"drift_to_initial": float(d.mean()), "drift_to_initial_k3": float(k3.mean())}


def drift_metrics(initial, batch: RolloutBatch, spec: LikelihoodSpec, *, micro_batch: int, mask_id: int) -> Dict:
    """The drift of the old policy (the batch's ``old_ratio_logp`` under ``batch.plan``) from
    ``initial``, scored under the same plan (no gradient)."""
    with torch.no_grad(), phase_model(initial) as model:
        tok = all_token_logp(model, batch, batch.plan, spec, micro_batch=micro_batch, mask_id=mask_id)
    initial_logp = sequence_estimates_and_elbo(tok, batch.plan, batch, spec)[1]
    old = batch.old_logp if batch.old_ratio_logp is None else batch.old_ratio_logp
    return drift_from_estimates(old, initial_logp)
