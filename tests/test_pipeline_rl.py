"""The RL loop under pipeline parallelism: PP=2, TP=2 x PP=2 and DP=2 x PP=2 equal one process.

Two StableDRL steps (rollouts, old-policy likelihood, two inner iterations of the update) of a
tiny LLaDA (ELBO) and a tiny SDAR (staircase likelihood, prefix-shared rollouts with the KV
cache) start from the same upstream-format checkpoint. Each layout's final checkpoint is loaded
into one single-process model (``load_model_weights`` reshards any TP/PP) and compared with the
single-process run's weights; the logged metrics must match too.
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
    base = {"logging.run_dir": run_dir, "logging.wandb_mode": "disabled", "model.checkpoint": checkpoint,
            "rollout.task": "test_token_digits", "rollout.prompts_per_step": 2, "rollout.group_size": 4,
            "rollout.gen_length": 8, "rollout.steps": 4, "rollout.block_length": 4,
            "parallel.micro_batch_size": 4, "checkpoint.save_every": 2, "steps": 2, "optim.name": "sgd",
            "optim.distributed": False, "optim.weight_decay": 0.0, "optim.lr": 0.05, "optim.clip_grad": 0.0,
            "algo.inner_iterations": 2, "algo.num_mc": 2, "algo.mask_sampling": "fresh", "eval.every": 2,
            "eval.num_examples": 4, "eval.micro_batch_size": 2}
    if arch == "sdar":
        base.update({"algo.likelihood": "staircase"})
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _runs_worker(root, runs):
    """Train every ``(name, arch, layout)`` of ``runs`` in turn in these processes."""
    from megatron.core import parallel_state

    from stabledrl_mcore.config import load_config
    from stabledrl_mcore.rl.trainer import train
    from stabledrl_mcore.tasks import available_tasks

    if "test_token_digits" not in available_tasks():
        register_task("test_token_digits")(TokenDigitsTask)
    for name, arch, layout in runs:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        cfg = load_config(CONFIG, _overrides(os.path.join(root, name), os.path.join(root, f"hf_{arch}"), arch,
                                             **layout))
        _assert_replicas_equal(train(cfg).model)


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


def _reference_and_compare_worker(root, archs, names):
    """The single-process runs, then each run's final checkpoint loaded at TP=PP=1 (resharded)."""
    from megatron.core import parallel_state

    from stabledrl_mcore.checkpoint.loader import read_config
    from stabledrl_mcore.checkpoint.mcore_io import load_model_weights
    from stabledrl_mcore.models import build_model

    _runs_worker(root, [(f"{a}_single", a, {}) for a in archs])
    assert parallel_state.get_pipeline_model_parallel_world_size() == 1
    result = {}
    for name, arch in names:
        model = build_model(read_config(os.path.join(root, f"hf_{arch}")))
        load_model_weights(model, os.path.join(root, name, "checkpoints", "step_00000002"))
        result[name] = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.save(result, os.path.join(root, "weights.pt"))


def _metrics(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


LAYOUTS = {
    "pp2": {"parallel.pipeline_parallel": 2},
    "tp2pp2": {"parallel.pipeline_parallel": 2, "parallel.tensor_parallel": 2},
    "dp2pp2": {"parallel.pipeline_parallel": 2},
}


@pytest.mark.multiprocess
def test_pipelined_rl_steps_equal_one_process(tmp_path):
    root, archs = str(tmp_path), ("llada", "sdar")
    for arch in archs:
        write_hf_checkpoint(os.path.join(root, f"hf_{arch}"), arch, seed=5)
    spawn(_runs_worker, 2, (root, [(f"{a}_pp2", a, LAYOUTS["pp2"]) for a in archs]), timeout=300)
    spawn(_runs_worker, 4, (root, [(f"{a}_{n}", a, LAYOUTS[n]) for a in archs for n in ("tp2pp2", "dp2pp2")]),
          timeout=600)
    names = [(f"{a}_{n}", a) for a in archs for n in ("single", "pp2", "tp2pp2", "dp2pp2")]
    spawn(_reference_and_compare_worker, 1, (root, archs, names), timeout=300)
    weights = torch.load(os.path.join(root, "weights.pt"))
    for arch in archs:
        ref, ref_metrics = weights[f"{arch}_single"], _metrics(os.path.join(root, f"{arch}_single"))
        trained = [m for m in ref_metrics if "reward_mean" in m]
        assert [m["step"] for m in trained] == [1, 2]
        assert all(m["grad_norm"] > 1e-3 and m["skipped_updates"] == 0 for m in trained), "no update happened"
        assert [m["step"] for m in ref_metrics if "test_reward" in m] == [0, 2], "held-out evaluation missing"
        for layout in ("pp2", "tp2pp2", "dp2pp2"):
            got = weights[f"{arch}_{layout}"]
            assert got.keys() == ref.keys()
            diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
            assert diff < 1e-5, f"{arch} at {layout} differs from one process by {diff}"
            # a data-parallel rank's own spread (log_ratio_var) is averaged over ranks, not pooled
            keys = COMPARED if layout != "dp2pp2" else [k for k in COMPARED if k != "log_ratio_var_first"]
            rows = _metrics(os.path.join(root, f"{arch}_{layout}"))
            assert [m["step"] for m in rows] == [m["step"] for m in ref_metrics]
            for row, want in zip(rows, ref_metrics):
                for key in [k for k in list(keys) + ["test_reward"] if k in want]:
                    assert row[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (arch, layout, key)


def _resume_worker(root, arch, jobs):
    """``(run name, layout, stop_after, resume)`` in turn; each final model's weights gathered to
    TP=PP=1 names are saved by the comparison worker."""
    from megatron.core import parallel_state

    from stabledrl_mcore.config import load_config
    from stabledrl_mcore.rl.trainer import train
    from stabledrl_mcore.tasks import available_tasks

    if "test_token_digits" not in available_tasks():
        register_task("test_token_digits")(TokenDigitsTask)
    for name, layout, stop_after, resume in jobs:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        extra = dict(RESUME_OPTIM, **layout, **{"checkpoint.save_every": 1})
        cfg = load_config(CONFIG, _overrides(os.path.join(root, name), os.path.join(root, f"hf_{arch}"), arch,
                                             **extra))
        train(cfg, stop_after=stop_after, resume=resume)


RESUME_OPTIM = {"optim.name": "adam", "optim.distributed": True, "optim.lr": 1e-3}


@pytest.mark.multiprocess
def test_resume_at_another_pipeline_size_continues_the_run(tmp_path):
    """PP=2 -> PP=1 and PP=1 -> PP=2: a run cut after step 1 and resumed at the other size gives the
    straight run's step 2 (weights to 1e-5, metrics), Adam state and all (distributed optimizer)."""
    root, arch = str(tmp_path), "llada"
    write_hf_checkpoint(os.path.join(root, f"hf_{arch}"), arch, seed=5)
    pp2 = LAYOUTS["pp2"]
    spawn(_resume_worker, 2, (root, arch, [("from_pp2", pp2, 1, None)]), timeout=300)
    spawn(_resume_worker, 1, (root, arch, [("straight", {}, None, None), ("from_pp2", {}, None, "auto"),
                                           ("from_pp1", {}, 1, None)]), timeout=300)
    spawn(_resume_worker, 2, (root, arch, [("from_pp1", pp2, None, "auto")]), timeout=300)
    spawn(_load_worker, 1, (root, arch, ["straight", "from_pp2", "from_pp1"]), timeout=300)
    weights = torch.load(os.path.join(root, "weights.pt"))
    want = _metrics(os.path.join(root, "straight"))[-1]
    assert want["step"] == 2 and want["grad_norm"] > 0
    for name in ("from_pp2", "from_pp1"):
        diff = max((weights[name][k] - weights["straight"][k]).abs().max().item() for k in weights["straight"])
        assert diff < 1e-5, f"{name}: resumed at the other pipeline size, the weights differ by {diff}"
        got = _metrics(os.path.join(root, name))
        assert [m["step"] for m in got if "reward_mean" in m] == [1, 2]
        for key in COMPARED:
            assert got[-1][key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (name, key)


def _load_worker(root, arch, names):
    from stabledrl_mcore.checkpoint.loader import read_config
    from stabledrl_mcore.checkpoint.mcore_io import load_model_weights
    from stabledrl_mcore.models import build_model
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1)
    result = {}
    for name in names:
        model = build_model(read_config(os.path.join(root, f"hf_{arch}")))
        load_model_weights(model, os.path.join(root, name, "checkpoints", "step_00000002"))
        result[name] = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.save(result, os.path.join(root, "weights.pt"))


def test_split_rows_slices_per_row_inputs_and_keeps_shared_ones():
    from stabledrl_mcore.models.masks import AttentionLayout
    from stabledrl_mcore.parallel.pipeline import split_rows

    ids = torch.arange(5 * 3).view(5, 3)
    batch = {"input_ids": ids, "position_ids": torch.arange(3)[None], "segment_ids": ids * 2,
             "attention_mask": AttentionLayout.bidirectional(pad=[0, 1, 2, 0, 0]), "gather_output": False}
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
