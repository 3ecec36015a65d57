"""Dynamic sampling (``rollout.filter_uniform_groups``): the filter as a pure function, the filtered
update against the unfiltered one, DP=2 == DP=1, exact resume, logging, refusals.

In-process runs (one gloo rank) of the tiny CPU config, but for one 1-rank/2-rank spawn pair."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from test_trainer import CONFIG, DigitsTask, overrides

from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.parallel.launch import spawn
from stabledrl_mcore.rl.dynamic_sampling import filter_uniform_groups, keep_groups, varied_groups
from stabledrl_mcore.rl.rollout import RolloutBatch
from stabledrl_mcore.tasks.base import register_task


class HalfUniformTask(DigitsTask):
    """DigitsTask's varied reward for about half the puzzles, a constant for the others (by a
    hash of the puzzle), so about half the groups are uniform. With the salt "14", 8 prompts per
    step and DP=2, step 1 keeps 3 groups on rank 0 and none on rank 1, step 2 keeps 2 and 4."""

    name = "test_half_uniform"

    def _reward(self, completion, reference):
        if int(hashlib.md5(("14" + reference["puzzle"]).encode()).hexdigest(), 16) % 2:
            return 0.25
        return super()._reward(completion, reference)


class ConstantTask(DigitsTask):
    name = "test_all_uniform"

    def _reward(self, completion, reference):
        return 0.5


FILTER = {"rollout.filter_uniform_groups": True, "rollout.task": "test_half_uniform"}
SGD = {"optim.name": "sgd", "optim.distributed": False, "optim.weight_decay": 0.0}


def _register():
    from stabledrl_mcore.tasks import available_tasks

    added = [t for t in (HalfUniformTask, ConstantTask, DigitsTask) if t.name not in available_tasks()]
    for task in added:
        register_task(task.name)(task)
    return added


def _config(run_dir, **extra):
    return load_config(CONFIG, overrides(str(run_dir), **{"logging.progress": False, **extra}))


@pytest.fixture(scope="module")
def inprocess():
    """Registers the test tasks; one thread; Megatron torn down after the module."""
    from stabledrl_mcore.parallel import bootstrap, cpu_compat
    from stabledrl_mcore.tasks import base as task_base

    added = _register()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    for task in added:
        task_base._REGISTRY.pop(task.name)
    bootstrap.destroy()
    cpu_compat.disable()
    torch.set_num_threads(threads)


def _batch(rewards, group_size):
    n = len(rewards)
    seq = torch.arange(n * 3).reshape(n, 3)
    return RolloutBatch(
        sequences=seq,
        prompt_len=1,
        prompt_valid=torch.ones(n, 3, dtype=torch.bool),
        completion_mask=torch.ones(n, 3, dtype=torch.bool),
        group_index=torch.arange(n // group_size).repeat_interleave(group_size),
        completions=[f"c{i}" for i in range(n)],
        references=[i // group_size for i in range(n)],
        rewards=torch.tensor(rewards),
        advantages=torch.zeros(n),
    )


def test_filter_keeps_exactly_the_varied_groups_whole_and_in_order(monkeypatch):
    rewards = [0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.30001]
    batch = _batch(rewards, 3)
    assert varied_groups(batch.rewards, 3).tolist() == [False, True, False, True]
    kept = filter_uniform_groups(batch, 3)
    assert kept.source_rows.tolist() == [3, 4, 5, 9, 10, 11]
    assert kept.sequences.tolist() == batch.sequences[[3, 4, 5, 9, 10, 11]].tolist()
    assert kept.completions == ["c3", "c4", "c5", "c9", "c10", "c11"] and kept.references == [1, 1, 1, 3, 3, 3]
    assert kept.group_index.tolist() == [1, 1, 1, 3, 3, 3] and kept.source is batch
    assert kept.gradient_scale == 1.0 and kept.stats["groups_kept"] == 2.0
    assert filter_uniform_groups(_batch([0.5] * 6, 3), 3) is None  # nothing kept anywhere
    assert keep_groups(torch.tensor([True, False, True, True]), limit=2).tolist() == [True, False, True, False]
    # two DP ranks (the all-gather simulated): rank 1 has no varied group and keeps a placeholder at weight 0
    import stabledrl_mcore.rl.dynamic_sampling as ds

    both = torch.tensor([False, True, False, False, False, False])
    monkeypatch.setattr(ds, "gather_over_data_parallel", lambda local: both)
    rank0 = filter_uniform_groups(_batch(rewards[:9], 3), 3, dp_rank=0, dp_size=2)
    rank1 = filter_uniform_groups(_batch([0.0] * 9, 3), 3, dp_rank=1, dp_size=2)
    assert rank0.source_rows.tolist() == [3, 4, 5] and rank0.gradient_scale == 2.0  # dp x 1 / 1
    assert rank1.source_rows.tolist() == [0, 1, 2] and rank1.gradient_scale == 0.0
    assert rank1.stats["groups_kept"] == 0.0
    both = torch.tensor([True, True, True, False, True, False])  # limit 2: rank 1's varied group is cut
    rank0 = filter_uniform_groups(_batch([0.0, 1.0, 0.0] * 3, 3), 3, dp_rank=0, dp_size=2, limit=2)
    rank1 = filter_uniform_groups(_batch([0.0] * 9, 3), 3, dp_rank=1, dp_size=2, limit=2)
    assert rank0.source_rows.tolist() == [0, 1, 2, 3, 4, 5] and rank0.gradient_scale == 2.0
    assert rank1.gradient_scale == 0.0


def test_the_filtered_update_is_the_unfiltered_one_over_the_kept_groups(inprocess, tmp_path):
    """Dropped groups have zero advantages, so (same masks, same rows) the filtered gradient is
    G / G_kept times the unfiltered one: checked on the weights after one SGD update."""
    from stabledrl_mcore.rl.rollout import score_rollouts
    from stabledrl_mcore.rl.setup import build_training
    from stabledrl_mcore.rl.trainer import (
        PhaseTimer,
        filter_phase,
        likelihood_spec,
        old_logp_phase,
        policy_update,
        rollout_phase,
    )

    cfg = _config(
        tmp_path, **FILTER, **SGD, **{"algo.inner_iterations": 1, "optim.clip_grad": 0.0, "rollout.prompts_per_step": 8}
    )
    s = build_training(cfg)
    spec = likelihood_spec(cfg, s.model)
    batch = score_rollouts(rollout_phase(s, 0), s.task, advantage=cfg.algo.advantage)
    kept = filter_phase(s, batch, PhaseTimer())
    varied = [g for g in range(8) if batch.rewards[4 * g : 4 * g + 4].unique().numel() > 1]
    assert 0 < len(varied) < 8, "the test task should make some groups uniform and some not"
    assert kept.source_rows.tolist() == [4 * g + i for g in varied for i in range(4)]
    start = {k: v.detach().clone() for k, v in s.model.state_dict().items() if isinstance(v, torch.Tensor)}

    def gradient(b):  # of the one SGD update, from the same weights (Megatron keeps it in main_grad)
        s.model.load_state_dict(start)
        policy_update(s, old_logp_phase(s, b, spec, 0), spec, 0)
        return {k: p.main_grad.detach().clone() for k, p in s.model.named_parameters()}

    filtered = gradient(kept)
    unfiltered = gradient(batch)
    ratio = 8 / len(varied)
    size = max(v.abs().max().item() for v in filtered.values())
    assert size > 0
    diff = max((filtered[k] - ratio * unfiltered[k]).abs().max().item() for k in filtered)
    assert diff < 1e-5 * size, f"filtered gradient differs from {ratio} x the unfiltered one by {diff} (of {size})"


def _rows(run_dir):
    from stabledrl_mcore.engine.metrics import read_metrics

    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def _timeless(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time", "step_s", "tokens_per_s"))} for r in rows]


def _weights(setup):
    return {k: v.detach().clone() for k, v in setup.model.state_dict().items() if isinstance(v, torch.Tensor)}


def test_filtered_runs_log_the_kept_share_and_resume_exactly(inprocess, tmp_path):
    from stabledrl_mcore.rl.trainer import train

    extra = dict(FILTER, **{"rollout.prompts_per_step": 6, "checkpoint.save_every": 1})
    straight = train(_config(tmp_path / "a", **extra))
    rows = _rows(tmp_path / "a")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["groups_kept"] for r in rows] == [r["groups_varied"] for r in rows] == [3 / 6, 2 / 6]
    assert all("time/filter" in r and r["skipped_updates"] == 0 for r in rows)
    a = _weights(straight)
    train(_config(tmp_path / "b", **extra), stop_after=1)
    b = _weights(train(_config(tmp_path / "b", **extra), resume="auto"))
    assert _timeless(_rows(tmp_path / "b")) == _timeless(rows), "metrics differ after resume"
    assert all(torch.equal(a[k], b[k]) for k in a), "resume with filtering is not bitwise exact"
    over = train(
        _config(tmp_path / "c", **dict(extra, **{"rollout.prompts_per_step": 2, "rollout.oversample_prompts": 2}))
    )
    assert over.prompts.per_step == 4  # four prompts generated per step, at most two trained on
    rows = _rows(tmp_path / "c")  # step 1: 3 of the 4 groups vary, the first 2 are kept; step 2: none varies
    assert [(r["groups_varied"], r["groups_kept"]) for r in rows] == [(3 / 4, 2 / 4), (0.0, 0.0)]


def test_a_step_without_any_kept_group_is_no_update_and_such_a_run_fails(inprocess, tmp_path, capsys):
    from stabledrl_mcore.engine.gradients import SkippedUpdatesError
    from stabledrl_mcore.rl.setup import build_training
    from stabledrl_mcore.rl.trainer import train

    cfg = _config(tmp_path, **dict(FILTER, **{"rollout.task": "test_all_uniform", "rollout.prompts_per_step": 2}))
    s = build_training(cfg)
    start = _weights(s)
    with pytest.raises(SkippedUpdatesError, match="no optimizer update in this run.*filter_uniform_groups"):
        train(cfg, setup=s)
    out = capsys.readouterr().out
    assert out.count("rollout.filter_uniform_groups dropped them all: no optimizer update") == 2, out
    assert "skipped=" not in out
    rows = _rows(tmp_path)
    assert [(r["groups_kept"], r["skipped_updates"]) for r in rows] == [(0.0, 0.0), (0.0, 0.0)]
    assert s.scheduler.num_steps == 2 * cfg.algo.inner_iterations  # the LR schedule still advanced
    assert all(torch.equal(v, start[k]) for k, v in _weights(s).items()), "no update means unchanged weights"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"rollout.oversample_prompts": 4}, "rollout.oversample_prompts needs rollout.filter_uniform_groups"),
        (
            {"rollout.filter_uniform_groups": True, "rollout.oversample_prompts": -1},
            "rollout.oversample_prompts must be >= 0",
        ),
        ({"rollout.filter_uniform_groups": True, "algo.kl_coef": 0.1}, "algo.kl_coef=0"),
    ],
)
def test_nonsense_combinations_are_refused_by_name(inprocess, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, **extra)


def test_oversampled_prompts_must_split_over_data_parallel_ranks(inprocess, tmp_path):
    from stabledrl_mcore.cli.preflight import preflight

    cfg = _config(
        tmp_path, **{"rollout.filter_uniform_groups": True, "rollout.oversample_prompts": 1, "rollout.task": "sudoku"}
    )
    with pytest.raises(ConfigError, match="rollout.oversample_prompts .1. must be divisible by the data-parallel"):
        preflight(cfg, world_size=2)


def _dp_worker(run_dir, out_name):
    from test_trainer import _train_worker

    _register()
    _train_worker(run_dir, dict(FILTER, **SGD, **{"rollout.prompts_per_step": 8}), out_name)


@pytest.mark.multiprocess
def test_dp2_equals_dp1_with_filtering(tmp_path):
    single, dp2 = str(tmp_path / "dp1"), str(tmp_path / "dp2")
    spawn(_dp_worker, 1, (single, "final"), timeout=300)
    spawn(_dp_worker, 2, (dp2, "final"), timeout=300)
    ref = torch.load(os.path.join(single, "final.rank0.pt"))
    for rank in (0, 1):
        got = torch.load(os.path.join(dp2, f"final.rank{rank}.pt"))
        diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert diff < 1e-5, f"DP=2 rank {rank} differs from DP=1 by {diff}"
    a, b = _rows(single), _rows(dp2)
    # rank 1 keeps nothing at step 1 (a placeholder at weight 0), the ranks keep 2 and 4 at step 2
    assert [r["groups_kept"] for r in a] == [r["groups_kept"] for r in b] == [3 / 8, 6 / 8]
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)
