"""The RL loop on a mixture-of-experts SDAR under expert parallelism: EP=2, EP=2 x TP=2 and
EP=2 x DP=2 equal one process, and a run resumes at EP=2.

Two StableDRL steps of ``sdar-moe-tiny`` (staircase likelihood, KV-cached block rollouts, two
inner iterations, held-out evaluations over 3 prompts, which split unevenly over data-parallel
ranks) start from one random Megatron checkpoint. Expert parallelism puts the experts of one
all-to-all group on ranks of different data-parallel replicas, which run different numbers of
forwards (the unevenly split evaluation, update chunks without weight): the lockstep of
:mod:`stabledrl_mcore.engine.expert` must keep them matched, and the runs must still be the
single process's (weights to 1e-5; metrics, router statistics included, to 1e-4).
"""

import os

import pytest
import torch
from hf_fixtures import write_tokenizer
from test_pipeline_rl import CONFIG, TokenDigitsTask, _assert_replicas_equal, _metrics

from stabledrl_mcore.parallel.launch import spawn
from stabledrl_mcore.tasks.base import register_task


class UnevenDigitsTask(TokenDigitsTask):
    """TokenDigitsTask, but every completion of some prompts earns the same reward: those groups'
    advantages are 0, their update chunks carry no weight and are skipped, so data-parallel ranks
    run different numbers of update forwards (the lockstep's dummy forward + backward rounds)."""

    name = "test_uneven_digits"

    def _reward(self, completion, reference):
        if sum(map(ord, str(reference))) % 3 == 0:
            return 0.5
        return super()._reward(completion, reference)


COMPARED = (
    "reward_mean",
    "loss",
    "grad_norm",
    "clip_frac_high",
    "log_ratio_var_first",
    "skipped_updates",
    "router_load_max",
    "router_load_min",
    "router_load_cv",
    "router_dropped_frac",
)
LAYOUTS = {
    "single": (1, {}),
    "ep2": (2, {"parallel.expert_parallel": 2}),
    "ep2tp2": (4, {"parallel.expert_parallel": 2, "parallel.tensor_parallel": 2}),
    "ep2dp2": (4, {"parallel.expert_parallel": 2}),
}
RESUME = {"optim.name": "adam", "optim.distributed": True, "optim.lr": 1e-3, "checkpoint.save_every": 1}


def _overrides(root, name, **extra):
    base = {
        "logging.run_dir": os.path.join(root, name),
        "logging.wandb_mode": "disabled",
        "model.preset": "sdar-moe-tiny",
        "model.checkpoint": os.path.join(root, "start"),
        "model.tokenizer": os.path.join(root, "tokenizer"),
        "rollout.task": "test_uneven_digits",
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.gen_length": 8,
        "rollout.steps": 4,
        "rollout.block_length": 4,
        "parallel.micro_batch_size": 2,
        "checkpoint.save_every": 2,
        "steps": 2,
        "optim.name": "sgd",
        "optim.distributed": False,
        "optim.weight_decay": 0.0,
        "optim.lr": 0.05,
        "optim.clip_grad": 0.0,
        "algo.inner_iterations": 2,
        "algo.num_mc": 2,
        "algo.mask_sampling": "fresh",
        "algo.likelihood": "staircase",
        "eval.every": 2,
        "eval.num_examples": 3,
        "eval.micro_batch_size": 1,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _start_checkpoint(root):
    """A random ``sdar-moe-tiny`` saved at EP=1 (norms and router perturbed so every expert is used)."""
    from stabledrl_mcore.checkpoint.mcore_io import save_model_checkpoint
    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1, seed=3)
    model = build_model(get_preset("sdar-moe-tiny"))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
            elif "router" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
    save_model_checkpoint(model, os.path.join(root, "start"))


def _runs_worker(root, runs, final=None):
    from megatron.core import parallel_state

    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl.trainer import train
    from stabledrl_mcore.tasks import available_tasks

    if "test_uneven_digits" not in available_tasks():
        register_task("test_uneven_digits")(UnevenDigitsTask)
    for name, extra, stop_after, resume in runs:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        cfg = load_config(CONFIG, _overrides(root, name, **extra))
        _assert_replicas_equal(train(cfg, stop_after=stop_after, resume=resume).model)
    if final:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        _save_final_weights(root, final)


def _save_final_weights(root, names):
    from stabledrl_mcore.checkpoint.mcore_io import load_model_weights
    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1)
    result = {}
    for name in names:
        model = build_model(get_preset("sdar-moe-tiny"))
        load_model_weights(model, os.path.join(root, name, "checkpoints", "step_00000002"))
        result[name] = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.save(result, os.path.join(root, "weights.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(root, weights)`` of every run: the four layouts, and ``straight`` (2 steps at EP=1 with the
    distributed Adam) vs ``resumed`` (cut after step 1 at EP=2, resumed at EP=2)."""
    root = str(tmp_path_factory.mktemp("moe_rl"))
    os.makedirs(os.path.join(root, "tokenizer"))
    write_tokenizer(os.path.join(root, "tokenizer"), 256, "<|MASK|>", 255, 2, 0)
    spawn(_start_checkpoint, 1, (root,), timeout=120)
    spawn(
        _runs_worker,
        2,
        (
            root,
            [
                ("ep2", LAYOUTS["ep2"][1], None, None),
                ("resumed", dict(RESUME, **LAYOUTS["ep2"][1]), 1, None),
                ("resumed", dict(RESUME, **LAYOUTS["ep2"][1]), None, "auto"),
            ],
        ),
        timeout=400,
    )
    spawn(_runs_worker, 4, (root, [(n, LAYOUTS[n][1], None, None) for n in ("ep2tp2", "ep2dp2")]), timeout=500)
    names = list(LAYOUTS) + ["straight", "resumed"]
    spawn(_runs_worker, 1, (root, [("single", {}, None, None), ("straight", RESUME, None, None)], names), timeout=300)
    return root, torch.load(os.path.join(root, "weights.pt"))


def _assert_same_weights(got, want, label):
    assert got.keys() == want.keys(), label
    for key in want:
        assert torch.allclose(got[key], want[key], atol=1e-5, rtol=0), (
            f"{label}: {key} differs by {(got[key] - want[key]).abs().max():.2e}"
        )


def _assert_same_metrics(root, name, reference):
    got, want = _metrics(os.path.join(root, name)), _metrics(os.path.join(root, reference))
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want):
        for key in COMPARED + ("test_reward", "test_accuracy"):
            if key in w:
                assert g[key] == pytest.approx(w[key], abs=1e-4), f"{name} step {w['step']} {key}"


@pytest.mark.parametrize("layout", ["ep2", "ep2tp2", "ep2dp2"])
def test_expert_parallel_run_equals_single_process(runs, layout):
    root, weights = runs
    _assert_same_weights(weights[layout], weights["single"], layout)
    _assert_same_metrics(root, layout, "single")


def test_expert_ranks_ran_uneven_phases_in_lockstep(runs):
    """The runs above exercised the lockstep: some steps needed dummy rounds (uneven evaluation
    shards, update chunks without weight) and still matched the single process."""
    root, _ = runs
    for layout in ("ep2", "ep2tp2", "ep2dp2"):
        rows = _metrics(os.path.join(root, layout))
        assert sum(r.get("expert_lockstep_dummies", 0) for r in rows) > 0, layout
    assert all("expert_lockstep_dummies" not in r for r in _metrics(os.path.join(root, "single")))


def test_router_statistics_are_logged(runs):
    root, _ = runs
    first = _metrics(os.path.join(root, "single"))[1]
    assert first["router_load_max"] >= 1.0 >= first["router_load_min"] >= 0.0
    assert first["router_load_cv"] > 0 and first["router_dropped_frac"] == 0.0  # dropless by default


def test_resume_at_expert_parallel_equals_straight_run(runs):
    root, weights = runs
    _assert_same_weights(weights["resumed"], weights["straight"], "resumed at EP=2")
    got, want = _metrics(os.path.join(root, "resumed")), _metrics(os.path.join(root, "straight"))
    assert got[-1]["step"] == want[-1]["step"] == 2
    assert got[-1]["loss"] == pytest.approx(want[-1]["loss"], abs=1e-4)
