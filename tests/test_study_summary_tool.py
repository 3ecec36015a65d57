"""``tools/study_summary.py``: a study's summary from its finished arms, nothing trained."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from stabledrl_mcore.experiments.study import StudyOptions, aggregate, summarise_study_arm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("study_summary", os.path.join(ROOT, "tools", "study_summary.py"))
tool = sys.modules.setdefault("study_summary", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(tool)


def fake_arm(run_dir, steps, done, shift):
    """An arm dir with ``rl_config.yaml`` (``steps``) and ``done`` rows of metrics (evals at 0 and every 4)."""
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "rl_config.yaml"), "w") as handle:
        handle.write(f"algo:\n  loss: x\nsteps: {steps}\n")
    rows = [{"step": 0, "test_accuracy": 0.1}]
    for s in range(1, done + 1):
        rows.append(
            {
                "step": s,
                "reward_mean": 0.5 + shift * s / steps,
                "grad_norm": 0.1 * s,
                "log_ratio_var_first": 0.2,
                "drift_to_initial": 0.01 * s,
                "clip_frac_high": 0.1,
                "clip_frac_low": 0.1,
            }
        )
        if s % 4 == 0:
            rows.append({"step": s, "test_accuracy": 0.1 + shift})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def test_finished_arms_are_summarised_as_the_study_would_and_partial_ones_left_out(tmp_path, capsys):
    out = tmp_path / "study"
    os.makedirs(out)
    manifest = {"options": {"overrides": [], "likelihood": "elbo"}, "cells": {"c1": ["optim.lr=1"], "c2": ["x=1"]}}
    (out / "study.json").write_text(json.dumps(manifest))
    rows = {
        ("grpo", 0): fake_arm(out / "c1" / "grpo_s0", 8, 8, -0.3),
        ("stabledrl", 0): fake_arm(out / "c1" / "stabledrl_s0", 8, 8, 0.2),
    }
    fake_arm(out / "c1" / "grpo_s1", 8, 3, 0.0)  # partial: left out
    fake_arm(out / "c2" / "grpo_s0", 8, 5, 0.0)  # a cell with nothing finished
    os.makedirs(out / "c2" / "stabledrl_s0")  # not started: no rl_config.yaml yet
    before = sorted(os.listdir(out / "c1"))

    assert tool.main([str(out)]) == 0

    dest = out / "summary_so_far"
    grid = json.loads((dest / "grid_summary.json").read_text())
    expected = aggregate([summarise_study_arm(r, algo=a, seed=s, opts=StudyOptions()) for (a, s), r in rows.items()])
    assert grid["table"] == {"c1": json.loads(json.dumps(expected))}
    assert grid["table"]["c1"]["grpo"]["collapsed"] == 1 and grid["table"]["c1"]["stabledrl"]["collapsed"] == 0
    assert grid["finished"] == ["c1/grpo_s0", "c1/stabledrl_s0"]
    assert grid["partial"] == ["c1/grpo_s1 3/8", "c2/grpo_s0 5/8"]
    assert grid["steps"] == 8 and grid["seeds"] == [0]
    assert (dest / "grid.png").stat().st_size > 0 and (dest / "c1" / "study.png").stat().st_size > 0
    assert not (dest / "c2").exists()
    assert sorted(os.listdir(out / "c1")) == before  # the study's own directories untouched
    printed = capsys.readouterr().out
    assert ["c1", "grpo", "1", "of", "1"] in [line.split()[:5] for line in printed.splitlines()]
    assert "partial, left out (2): c1/grpo_s1 3/8" in printed


def test_a_directory_without_study_json_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        tool.main([str(tmp_path)])
