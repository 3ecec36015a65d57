"""The trainer's own ``algo.mask_sampling=fresh`` path (issue #40, item 7).

``tests/test_mask_sampling.py`` checks fresh masks with generators it builds itself; this runs
``rl/trainer.py`` (one step, two inner iterations, two micro-batches) and records what each
inner iteration hands the loss. Re-derived here from the documented streams (every draw from a
generator seeded ``sha256(repr((seed, step, global micro-batch, phase)))``, phases ``masks`` for
the old policy at rollout time and ``masks/iter{k}`` for inner iteration ``k``), the plans must
be: the old-policy estimate under ``masks``, iteration ``k`` under ``masks/iter{k}``, all three
different, with the current log-probs scored on exactly the fresh plan's positions; and the
first iteration's log-ratio must not be identically 0 (it is with ``replay``).
"""

import hashlib
import json
import os

import pytest
import torch

from stabledrl_mcore.parallel.launch import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
SEED, INNER, MICRO = 11, 2, 2
OVERRIDES = {
    "logging.wandb_mode": "disabled",
    "logging.progress": False,
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 2,
    "rollout.gen_length": 4,
    "rollout.steps": 2,
    "rollout.block_length": 4,
    "parallel.micro_batch_size": MICRO,  # 4 rows: global micro-batches 0 and 1
    "parallel.seed": SEED,
    "algo.inner_iterations": INNER,
    "algo.num_mc": 2,
    "algo.mask_sampling": "fresh",
    "checkpoint.save_every": 0,
    "steps": 1,
    "optim.lr": 1e-3,
}


def _fresh_worker(run_dir, out):
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl import trainer

    calls = []
    real = trainer.loss_coefficients

    def recording(current, batch, spec, **kwargs):
        plan, old = kwargs["plan"], kwargs["old"]
        calls.append(
            {
                "batch": {k: getattr(batch, k) for k in ("sequences", "prompt_len", "completion_mask", "prompt_valid")},
                "spec": spec,
                "plan": (plan.masked.clone(), plan.weight.clone()),
                "old_plan": (old.plan.masked.clone(), old.plan.weight.clone()),
                "current": current.detach().clone(),
                "old_token_logp": old.token_logp.detach().clone(),
            }
        )
        return real(current, batch, spec, **kwargs)

    trainer.loss_coefficients = recording
    try:
        cfg = load_config(CONFIG, [f"{k}={v}" for k, v in dict(OVERRIDES, **{"logging.run_dir": run_dir}).items()])
        trainer.train(cfg)
    finally:
        trainer.loss_coefficients = real
    torch.save(calls, out)


def _seed(*parts):
    """The documented stream: the first 8 bytes (little endian) of sha256(repr(parts)), 63 bits."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & (2**63 - 1)


def _expected_plan(call, phase, step=0):
    """The plan of ``phase`` re-drawn micro-batch by micro-batch: global micro-batch ``k`` (rows
    ``k * MICRO`` on, one process) from its own generator, LLaDA's uniform scheme per micro-batch
    (``diffusion.mask_schemes``, tested on its own), the draws concatenated along the rows."""
    from stabledrl_mcore.diffusion.mask_schemes import MaskRegions, build_mask_plan

    b, spec = call["batch"], call["spec"]
    assert (spec.kind, spec.scheme) == ("elbo", "uniform"), spec
    masked, weight = [], []
    for k, start in enumerate(range(0, b["sequences"].shape[0], MICRO)):
        rows = slice(start, start + MICRO)
        regions = MaskRegions.from_batch(
            b["sequences"][rows],
            b["prompt_len"],
            completion_mask=b["completion_mask"][rows],
            prompt_valid=b["prompt_valid"][rows],
        )
        plan = build_mask_plan(
            regions,
            "uniform",
            num_mc=spec.num_mc,
            generator=torch.Generator().manual_seed(_seed(SEED, step, k, phase)),
            post_eos=spec.post_eos,
            coupled=spec.coupled,
            prefix_mask_prob=spec.prefix_mask_prob,
        )
        masked.append(plan.masked)
        weight.append(plan.weight)
    return torch.cat(masked, 1), torch.cat(weight, 1)


def _same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.multiprocess
def test_trainer_fresh_masks_come_from_the_documented_streams(tmp_path):
    out = str(tmp_path / "calls.pt")
    spawn(_fresh_worker, 1, (str(tmp_path / "run"), out), timeout=300)
    calls = torch.load(out, weights_only=False)
    assert len(calls) == INNER, len(calls)
    rollout_plan = _expected_plan(calls[0], "masks")
    assert calls[0]["batch"]["sequences"].shape[0] == 2 * MICRO  # two global micro-batches
    plans = []
    for inner, call in enumerate(calls):
        under_masks = _same(call["old_plan"], rollout_plan)
        assert under_masks, f"iteration {inner}: the old estimate is not under 'masks'"
        replayed = _same(call["plan"], call["old_plan"])
        assert not replayed, f"iteration {inner} replays the old policy's masks"
        fresh = _expected_plan(call, f"masks/iter{inner}")
        drawn = _same(call["plan"], fresh)
        assert drawn, f"iteration {inner}'s plan is not drawn from 'masks/iter{inner}'"
        assert not torch.equal(fresh[0], rollout_plan[0]), "fresh masks equal the old policy's"
        # the current policy was scored under the fresh plan: log-probs exactly on its scored positions
        scored = fresh[1] != 0
        assert torch.equal(call["current"] != 0, scored), f"iteration {inner}: log-probs off the fresh plan"
        assert torch.equal(call["old_token_logp"] != 0, rollout_plan[1] != 0)
        plans.append(fresh[0])
    assert not torch.equal(plans[0], plans[1]), "both inner iterations drew the same masks"
    # not replay: the first ratio is a noisy estimate, not identically 1
    assert not torch.equal(calls[0]["current"], calls[0]["old_token_logp"])
    with open(os.path.join(str(tmp_path / "run"), "metrics.jsonl")) as handle:
        last = [json.loads(line) for line in handle][-1]
    assert last["log_ratio_var_first"] > 0, last
