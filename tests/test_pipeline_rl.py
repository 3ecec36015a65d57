"""The RL loop under pipeline parallelism: PP=2, TP=2 x PP=2 and DP=2 x PP=2 equal one process,
and a run resumes at another pipeline size.

Two StableDRL steps (rollouts, old-policy likelihood, two inner iterations of the update, a
held-out evaluation) of a tiny LLaDA (ELBO) and a tiny SDAR (staircase likelihood, prefix-shared
rollouts with the KV cache) start from the same upstream-format checkpoint. Each run's final
checkpoint is loaded into one TP=PP=1 model (``load_model_weights`` reshards any TP/PP) and
compared with the single-process run's weights; the logged metrics must match too. All runs
share four launches (one per world size in turn), made once for the module.
"""

import json
import os

import pytest
import torch
from hf_fixtures import write_hf_checkpoint

from stabledrl_mcore.parallel.launch import spawn
from stabledrl_mcore.tasks.base import register_task
from stabledrl_mcore.tasks.sudoku import SudokuTask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
COMPARED = ("reward_mean", "loss", "grad_norm", "clip_frac_high", "log_ratio_var_first", "skipped_updates")


class TokenDigitsTask(SudokuTask):
    """Sudoku prompts scored by the digits of the decoded word-level tokens (``tok17``): a reward
    that varies within every group of a random model."""

    name = "test_token_digits"

    def _reward(self, completion, reference):
        return sum(ch.isdigit() for ch in completion[:40]) / 40.0


def _overrides(run_dir, checkpoint, arch, **extra):
    base = {
        "logging.run_dir": run_dir,
        "logging.wandb_mode": "disabled",
        "model.checkpoint": checkpoint,
        "rollout.task": "test_token_digits",
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 4,
        "rollout.gen_length": 8,
        "rollout.steps": 4,
        "rollout.block_length": 4,
        "parallel.micro_batch_size": 4,
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
        "eval.every": 2,
        "eval.num_examples": 4,
        "eval.micro_batch_size": 2,
    }
    if arch == "sdar":
        base.update({"algo.likelihood": "staircase"})
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


RESUME_OPTIM = {"optim.name": "adam", "optim.distributed": True, "optim.lr": 1e-3, "checkpoint.save_every": 1}
LAYOUTS = {
    "single": {},
    "pp2": {"parallel.pipeline_parallel": 2},
    "tp2pp2": {"parallel.pipeline_parallel": 2, "parallel.tensor_parallel": 2},
    "dp2pp2": {"parallel.pipeline_parallel": 2},  # on 4 ranks
}
ARCHS = ("llada", "sdar")


def _runs_worker(root, runs, final_weights=None):
    """Train every ``(name, arch, overrides, stop_after, resume)`` of ``runs`` in turn in these
    processes; then, with ``final_weights``, save those runs' final weights (:func:`_save_final_weights`)."""
    from megatron.core import parallel_state

    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl.trainer import train
    from stabledrl_mcore.tasks import available_tasks

    if "test_token_digits" not in available_tasks():
        register_task("test_token_digits")(TokenDigitsTask)
    for name, arch, extra, stop_after, resume in runs:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        cfg = load_config(CONFIG, _overrides(os.path.join(root, name), os.path.join(root, f"hf_{arch}"), arch, **extra))
        _assert_replicas_equal(train(cfg, stop_after=stop_after, resume=resume).model)
    if final_weights:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        _save_final_weights(root, final_weights)


def _assert_replicas_equal(model):
    """Parameters every tensor-parallel rank holds whole (norms, q/k-norm) stay identical across ranks."""
    from megatron.core import parallel_state as ps

    group, size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    for name, param in model.named_parameters():
        if size == 1 or getattr(param, "tensor_model_parallel", False):
            continue
        copies = [torch.empty_like(param) for _ in range(size)]
        torch.distributed.all_gather(copies, param.detach().contiguous(), group=group)
        assert all(torch.equal(c, copies[0]) for c in copies), f"{name} differs across tensor-parallel ranks"


def _save_final_weights(root, names):
    """``weights.pt`` (rank 0): each ``(run, arch)``'s step-2 checkpoint loaded at TP=PP=1."""
    from stabledrl_mcore.checkpoint.mcore_io import load_model_weights
    from stabledrl_mcore.convert.loader import read_config
    from stabledrl_mcore.models import build_model
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1)
    result = {}
    for name, arch in names:
        model = build_model(read_config(os.path.join(root, f"hf_{arch}")))
        load_model_weights(model, os.path.join(root, name, "checkpoints", "step_00000002"))
        result[name] = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    if torch.distributed.get_rank() == 0:
        torch.save(result, os.path.join(root, "weights.pt"))


def _metrics(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this module: ``(root, weights)``. Resume runs (llada, Adam on the distributed
    optimizer): ``straight`` (2 steps at PP=1); ``from_pp2`` cut after step 1 at PP=2 and resumed at
    PP=1; ``from_pp1`` cut after step 1 at PP=1 and resumed at PP=2."""
    root = str(tmp_path_factory.mktemp("pipeline_rl"))
    for arch in ARCHS:
        write_hf_checkpoint(os.path.join(root, f"hf_{arch}"), arch, seed=5)
    pp2 = LAYOUTS["pp2"]
    spawn(
        _runs_worker,
        2,
        (
            root,
            [(f"{a}_pp2", a, pp2, None, None) for a in ARCHS]
            + [("from_pp2", "llada", dict(RESUME_OPTIM, **pp2), 1, None)],
        ),
        timeout=300,
    )
    spawn(
        _runs_worker,
        4,
        (root, [(f"{a}_{n}", a, LAYOUTS[n], None, None) for a in ARCHS for n in ("tp2pp2", "dp2pp2")]),
        timeout=600,
    )
    spawn(
        _runs_worker,
        1,
        (
            root,
            [(f"{a}_single", a, {}, None, None) for a in ARCHS]
            + [
                ("straight", "llada", RESUME_OPTIM, None, None),
                ("from_pp2", "llada", RESUME_OPTIM, None, "auto"),
                ("from_pp1", "llada", RESUME_OPTIM, 1, None),
            ],
        ),
        timeout=300,
    )
    names = [(f"{a}_{n}", a) for a in ARCHS for n in LAYOUTS] + [
        (n, "llada") for n in ("straight", "from_pp2", "from_pp1")
    ]
    spawn(_runs_worker, 2, (root, [("from_pp1", "llada", dict(RESUME_OPTIM, **pp2), None, "auto")], names), timeout=300)
    return root, torch.load(os.path.join(root, "weights.pt"))


def _assert_same_run(root, weights, name, reference, keys):
    diff = max((weights[name][k] - weights[reference][k]).abs().max().item() for k in weights[reference])
    assert diff < 1e-5, f"{name} differs from {reference} by {diff}"
    rows, want = _metrics(os.path.join(root, name)), _metrics(os.path.join(root, reference))
    assert [m["step"] for m in rows] == [m["step"] for m in want]
    for row, ref in zip(rows, want):
        for key in [k for k in list(keys) + ["test_reward"] if k in ref]:
            assert row[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, row["step"], key)


@pytest.mark.multiprocess
def test_pipelined_rl_steps_equal_one_process(runs):
    root, weights = runs
    for arch in ARCHS:
        ref_metrics = _metrics(os.path.join(root, f"{arch}_single"))
        trained = [m for m in ref_metrics if "reward_mean" in m]
        assert [m["step"] for m in trained] == [1, 2]
        assert all(m["grad_norm"] > 1e-3 and m["skipped_updates"] == 0 for m in trained), "no update happened"
        assert [m["step"] for m in ref_metrics if "test_reward" in m] == [0, 2], "held-out evaluation missing"
        for layout in ("pp2", "tp2pp2", "dp2pp2"):
            # a data-parallel rank's own spread (log_ratio_var) is averaged over ranks, not pooled
            keys = COMPARED if layout != "dp2pp2" else [k for k in COMPARED if k != "log_ratio_var_first"]
            _assert_same_run(root, weights, f"{arch}_{layout}", f"{arch}_single", keys)


@pytest.mark.multiprocess
def test_resume_at_another_pipeline_size_continues_the_run(runs):
    """PP=2 -> PP=1 and PP=1 -> PP=2 (Adam on the distributed optimizer, resharded through its
    bucket map): the resumed run's step 2 is the straight run's (weights to 1e-5, metrics)."""
    root, weights = runs
    straight = _metrics(os.path.join(root, "straight"))
    assert straight[-1]["step"] == 2 and straight[-1]["grad_norm"] > 0
    for name in ("from_pp2", "from_pp1"):
        _assert_same_run(root, weights, name, "straight", COMPARED)


def test_split_rows_slices_per_row_inputs_and_keeps_shared_ones():
    from stabledrl_mcore.engine.pipeline import split_rows
    from stabledrl_mcore.models.masks import AttentionLayout

    ids = torch.arange(5 * 3).view(5, 3)
    batch = {
        "input_ids": ids,
        "position_ids": torch.arange(3)[None],
        "segment_ids": ids * 2,
        "attention_mask": AttentionLayout.bidirectional(pad=[0, 1, 2, 0, 0]),
        "gather_output": False,
    }
    parts = split_rows(batch, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [3, 2]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), ids)
    assert torch.equal(torch.cat([p["segment_ids"] for p in parts]), ids * 2)
    assert all(p["position_ids"] is batch["position_ids"] and p["gather_output"] is False for p in parts)
    assert [p["attention_mask"].pad for p in parts] == [(0, 1, 2), ()]  # all-zero pads normalise to none
    dense = torch.zeros(5, 1, 3, 3, dtype=torch.bool)
    dense[3] = True
    parts = split_rows({"input_ids": ids, "attention_mask": dense}, 5)
    assert len(parts) == 5 and [bool(p["attention_mask"].all()) for p in parts] == [False] * 3 + [True, False]
    assert split_rows(batch, 1) == [batch]
    # read positions of as many entries as rows are positions, not rows (LLaDA's exact step)
    read = torch.arange(5)
    parts = split_rows({"input_ids": torch.zeros(5, 8, dtype=torch.long), "logit_positions": read}, 2)
    assert all(p["logit_positions"] is read for p in parts)
