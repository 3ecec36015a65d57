"""The instability study (``stabledrl study``, docs/experiments.md) and its drift metric."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
from test_mask_sampling import toy_batch

from stabledrl_mcore.cli.app import main
from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig
from stabledrl_mcore.experiments import study
from stabledrl_mcore.experiments.runs import read_metrics
from stabledrl_mcore.experiments.study import StudyMismatch, StudyOptions, claim_out, grid_cells, run_study
from stabledrl_mcore.experiments.tiny_sudoku import TinySudoku
from stabledrl_mcore.rl.drift import drift_from_estimates, drift_metrics
from stabledrl_mcore.rl.estimates import LikelihoodSpec, all_token_logp, draw_plan, old_policy_likelihood


def toy(seed):
    return ToyDiffusionLM(
        ToyDLLMConfig(vocab_size=12, mask_token_id=11, eos_token_id=1, pad_token_id=1, hidden_size=16),
        seed=seed,
        dtype=torch.float64,
    ).eval()


def test_drift_is_the_mean_log_ratio_and_k3_by_hand():
    old, initial = (
        torch.tensor([0.5, -0.2], dtype=torch.float64),
        torch.tensor([0.1, 0.3], dtype=torch.float64),
    )  # d = old - initial = [0.4, -0.5]
    got = drift_from_estimates(old, initial)
    assert got["drift_to_initial"] == pytest.approx(-0.05, abs=1e-12)
    want_k3 = ((math.exp(-0.4) - 1 + 0.4) + (math.exp(0.5) - 1 - 0.5)) / 2
    assert got["drift_to_initial_k3"] == pytest.approx(want_k3, abs=1e-12)
    assert drift_from_estimates(old, old) == {"drift_to_initial": 0.0, "drift_to_initial_k3": 0.0}


@pytest.mark.parametrize("kind", ["elbo", "mean_field", "spg"])
def test_drift_metrics_score_the_initial_policy_on_the_old_policys_masks(kind):
    """The old policy's ratio likelihood (``old_ratio_logp``) against the initial policy's; under
    SPG it differs from the loss's ``old_logp`` (the ELBO / EUBO sandwich), the case of the drift."""
    spec = LikelihoodSpec(kind=kind, num_mc=1)
    policy = toy(0)
    batch = old_policy_likelihood(
        policy,
        toy_batch(n=6),
        spec,
        micro_batch=3,
        mask_id=11,
        chunk_generator=lambda k: torch.Generator().manual_seed(k),
    )
    if kind == "spg":
        assert (batch.old_logp - batch.old_ratio_logp).abs().max() > 1e-3, "SPG's two estimates must differ here"
    same = drift_metrics(copy.deepcopy(policy), batch, spec, micro_batch=3, mask_id=11)
    assert same == {"drift_to_initial": 0.0, "drift_to_initial_k3": 0.0}  # the policy has not moved
    other = toy(5)
    got = drift_metrics(other, batch, spec, micro_batch=2, mask_id=11)
    # independently: the other model's masked-token log-probs summed on the batch's own masks, per scored token
    plan = batch.plan
    assert torch.equal(
        plan.masked, draw_plan(batch, spec, lambda k: torch.Generator().manual_seed(k), micro_batch=3).masked
    )
    tok = all_token_logp(other, batch, plan, spec, micro_batch=6, mask_id=11)[0]
    weight = plan.weight[0] * plan.masked[0]
    initial = (tok * weight).sum(-1) / batch.completion_mask.sum(-1)
    d = batch.old_ratio_logp - initial
    assert got["drift_to_initial"] == pytest.approx(float(d.mean()), rel=1e-9)
    assert got["drift_to_initial_k3"] == pytest.approx(float((torch.exp(-d) - 1 + d).mean()), rel=1e-9)


TINY = TinySudoku(
    labelled=32,
    validation=4,
    sft_steps=2,
    sft_batch=8,
    sft_eval_every=100,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    ffn_hidden_size=64,
)


def test_grid_cells_scale_the_regimes_lr_and_set_its_inner_iterations():
    cells = grid_cells(StudyOptions(regimes=("base", "harsh"), lr_scales=(1, 3), inner=(1, 4)))
    assert [c.name for c in cells] == [
        "base_lr1x_in1",
        "base_lr1x_in4",
        "base_lr3x_in1",
        "base_lr3x_in4",
        "harsh_lr1x_in1",
        "harsh_lr1x_in4",
        "harsh_lr3x_in1",
        "harsh_lr3x_in4",
    ]
    got = {c.name: c.overrides for c in cells}
    assert got["base_lr3x_in4"] == ("optim.lr=9e-05", "algo.inner_iterations=4", "algo.num_mc=1")
    assert got["harsh_lr1x_in1"] == ("optim.lr=0.0003", "algo.inner_iterations=1", "algo.num_mc=1")
    # one axis only: the other keeps the regime's value
    only_inner = grid_cells(StudyOptions(regimes=("harsh",), inner=(1,)))
    assert [(c.name, c.overrides) for c in only_inner] == [
        ("harsh_lr1x_in1", ("optim.lr=0.0003", "algo.inner_iterations=1", "algo.num_mc=1"))
    ]
    # no axis: the regime itself, as before the grid
    assert [(c.name, c.overrides) for c in grid_cells(StudyOptions(regimes=("base",)))] == [
        ("base", study.REGIMES["base"])
    ]
    # an axis that an override would undo in every cell is refused by name
    with pytest.raises(StudyMismatch, match="--lr-scale sets optim.lr .* optim.lr=1e-4"):
        grid_cells(StudyOptions(lr_scales=(2,), overrides=("optim.lr=1e-4",)))
    with pytest.raises(StudyMismatch, match="--inner sets algo.inner_iterations"):
        grid_cells(StudyOptions(inner=(2,), overrides=("algo.inner_iterations=3",)))
    with pytest.raises(StudyMismatch, match="--lr-scale must be positive"):
        grid_cells(StudyOptions(lr_scales=(0,)))
    with pytest.raises(StudyMismatch, match="--inner must be"):
        grid_cells(StudyOptions(inner=(0,)))


def test_a_tiny_grid_runs_every_cell_algo_and_seed_and_refuses_a_rerun_with_other_options(tmp_path, monkeypatch):
    opts = StudyOptions(
        out=str(tmp_path),
        setting=TINY,
        regimes=("base",),
        lr_scales=(1, 2),
        seeds=(0, 1),
        steps=2,
        prompts_per_step=2,
        rollout_steps=2,
        eval_every=2,
        eval_examples=4,
        save_every=2,
        window=1,
        trend_window=1,
        early_steps=2,
    )
    record = run_study(opts, log=lambda m: None, progress_every=0.0)
    cells = {"base_lr1x_in2": 3e-5, "base_lr2x_in2": 6e-5}
    assert list(record["table"]) == list(cells)
    grid = json.loads((tmp_path / "grid_summary.json").read_text())
    assert (tmp_path / "grid.png").stat().st_size > 0
    assert grid["table"] == json.loads(json.dumps(record["table"]))
    for cell, lr in cells.items():
        assert (tmp_path / cell / "study.png").stat().st_size > 0
        summary = json.loads((tmp_path / cell / "study_summary.json").read_text())
        assert [(r["algo"], r["seed"], r["steps"]) for r in summary["runs"]] == [
            ("grpo", 0, [1, 2]),
            ("stabledrl", 0, [1, 2]),
            ("grpo", 1, [1, 2]),
            ("stabledrl", 1, [1, 2]),
        ]
        for algo in ("grpo", "stabledrl"):
            assert grid["table"][cell][algo]["seeds"] == 2
        for seed in (0, 1):
            configs = {}
            for algo in ("grpo", "stabledrl"):
                run_dir = tmp_path / cell / f"{algo}_s{seed}"
                cfg = load_config(str(run_dir / "rl_config.yaml"))
                assert (cfg.optim.lr, cfg.algo.inner_iterations, cfg.parallel.seed) == (pytest.approx(lr), 2, seed)
                assert cfg.logging.run_dir == str(run_dir)  # every cell x algo x seed has its own run
                configs[algo] = json.loads(json.dumps(to_dict(cfg)))
                rows = [r for r in read_metrics(str(run_dir)) if "reward_mean" in r]
                # the run in this directory trained at this cell's LR (the trainer's own log)
                assert [(r["step"], r["lr"]) for r in rows] == [(1, pytest.approx(lr)), (2, pytest.approx(lr))]
                assert rows[0]["drift_to_initial"] == 0.0  # step 1's old policy is the initial one
                assert all("log_ratio_var_first" in r and "grad_norm" in r for r in rows)
                assert [r["step"] for r in read_metrics(str(run_dir)) if "test_accuracy" in r] == [0, 2]
            # the two algorithms share everything but the loss (and their run directory)
            grpo, sdrl = configs["grpo"], configs["stabledrl"]
            assert grpo["algo"].pop("loss") == "grpo" and sdrl["algo"].pop("loss") == "stabledrl"
            grpo["logging"].pop("run_dir"), sdrl["logging"].pop("run_dir")
            assert grpo == sdrl

    # a rerun with other overrides or another estimator is refused by name before anything runs
    started = []
    monkeypatch.setattr(study, "run_side_by_side", lambda todo, **kw: started.extend(todo) or [0] * len(todo))
    manifest = (tmp_path / "study.json").read_text()
    changed = StudyOptions(**{**opts.__dict__, "overrides": ("algo.eps=0.3",)})
    with pytest.raises(StudyMismatch, match=r"KEY=VALUE overrides \(\[\] there, \['algo.eps=0.3'\] now\).*new --out"):
        run_study(changed, log=lambda m: None)
    with pytest.raises(StudyMismatch, match="--likelihood .elbo there, mean_field now."):
        run_study(StudyOptions(**{**opts.__dict__, "likelihood": "mean_field"}), log=lambda m: None)
    assert started == [] and (tmp_path / "study.json").read_text() == manifest
    # the same options again: every arm reused, nothing started
    again = run_study(opts, log=lambda m: None)
    assert started == [] and again["table"] == record["table"]
    # more steps for one cell and seed: a changed config, so those arms continue from their step-2 checkpoints
    monkeypatch.undo()
    longer = run_study(StudyOptions(**{**opts.__dict__, "steps": 3, "lr_scales": (2,), "seeds": (0,)}), log=print)
    assert list(longer["table"]) == ["base_lr2x_in2"]
    assert [r["steps"] for r in longer["records"]["base_lr2x_in2"]["runs"]] == [[1, 2, 3], [1, 2, 3]]
    for arm in ("grpo_s0", "stabledrl_s0"):
        assert "resumed from" in (tmp_path / "base_lr2x_in2" / arm / "train.log").read_text()
        assert "resumed from" not in (tmp_path / "base_lr1x_in2" / arm / "train.log").read_text()


def test_the_cli_refuses_a_rerun_with_other_overrides_in_one_line(tmp_path, capsys, monkeypatch):
    def not_refused(*args, **kwargs):
        raise AssertionError("the rerun was not refused: it went on to the SFT start")

    monkeypatch.setattr(study, "prepare_sft_checkpoint", not_refused)  # a failure here must not run a study
    out = str(tmp_path / "study")
    claim_out(StudyOptions(out=out, overrides=("algo.eps=0.2",)), grid_cells(StudyOptions(inner=(2,))))
    # more steps, other seeds, other algos, another cell: allowed (the manifest takes the new cell)
    claim_out(
        StudyOptions(out=out, overrides=("algo.eps=0.2",), steps=9, seeds=(5,), algos=("grpo",)),
        grid_cells(StudyOptions(inner=(1,))),
    )
    assert set(json.loads((tmp_path / "study" / "study.json").read_text())["cells"]) == {
        "harsh_lr1x_in2",
        "harsh_lr1x_in1",
    }
    code = main(["study", "algo.eps=0.3", "--out", out, "--inner", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith("stabledrl study: error: --out ")
    assert "KEY=VALUE overrides (['algo.eps=0.2'] there, ['algo.eps=0.3'] now)" in err and "use a new --out" in err
    assert not os.path.exists(os.path.join(out, "sft.json"))  # refused before the SFT start was made
