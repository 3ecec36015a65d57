"""Every shipped recipe runs: scaled down by shape and length only, on its own code path.

For each ``examples/configs/*.yaml``: the recipe's dtype (bf16 for the 8B ones),
activation recompute, likelihood, sampler settings (temperature, threshold,
block decoding), optimizer (``optim.distributed`` stays on: Megatron's
distributed optimizer) and task are kept; the model comes from a tiny
checkpoint in the real upstream format converted with ``stabledrl convert``
(the 8B recipes start from a converted checkpoint), prompts/group/lengths are
small, and the layout is DP=2 (x TP=2 where the recipe uses tensor parallelism), or, for a
recipe with pipeline parallelism, PP=2 (x TP=2) at DP=1; a mixture-of-experts recipe runs a
tiny SDAR-MoE checkpoint (converted from the upstream per-expert layout) at EP=2 on 2 ranks.
Each recipe trains two steps with a checkpoint after each, a second run resumes
from the first checkpoint and must reproduce step 2 bit for bit (metrics and
weights), and both results go through ``mcore-to-hf`` back to the upstream layout.

Cost: the recipes of one scaled-down world size share one :func:`spawn` (every run in turn in
the same rank processes, as tests/test_pipeline_rl.py does; the expert-parallel recipes in their
own), which also prints each resolved config and exports the checkpoints on rank 0: a handful of
process starts for the module instead of five per recipe.

The tiny random model earns the same (zero) task reward for every completion,
which would make every advantage zero and skip the backward; inside the rank
processes the task's reward is replaced by a deterministic dense score of the
completion text so that the update (backward through recompute, optimizer step)
really runs. Everything else is the recipe.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from hf_fixtures import upstream_config, upstream_shapes, write_hf_checkpoint

from stabledrl_mcore.parallel.launch import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "*.yaml")))
# A recipe that differs from another only in these (the per-task variants of the release recipe,
# a layout variant such as TP x PP) gets the two-step run, in its own scaled-down layout; the fully
# tested twin also the resume and export.
VARIANT_KEYS = {
    "rollout.task",
    "rollout.data_path",
    "optim.lr",
    "logging.run_dir",
    "parallel.tensor_parallel",
    "parallel.pipeline_parallel",
    "parallel.micro_batch_size",
}


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = repr(value)
    return out


def _split_variants(paths):
    """(fully tested recipes, {variant: its twin}) -- the first recipe of a group is the twin."""
    groups = {}
    for path in paths:
        with open(path) as handle:
            flat = _flat(yaml.safe_load(handle))
        key = frozenset((k, v) for k, v in flat.items() if k not in VARIANT_KEYS)
        groups.setdefault(key, []).append(path)
    primary = [group[0] for group in groups.values()]
    variants = {path: group[0] for group in groups.values() for path in group[1:]}
    return sorted(primary), variants


PRIMARY, VARIANTS = _split_variants(RECIPES)
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
FILE_TASKS = {"math500": "math500_test.jsonl", "gsm8k": "gsm8k_test.jsonl"}
TIME_KEYS = ("time", "step_s")
SCALED_EXPERT_PARALLEL = 2  # a mixture-of-experts recipe's experts over 2 ranks (EP=2 x DP=2)
RUN_TIMEOUT_S = 120  # per training run of a shared spawn (measured ~17 s each on 2 cores)


def _cli(*args, timeout=300):
    """``python -m stabledrl_mcore.cli ...`` as its own process (stopped by PID on time-out)."""
    import psutil

    proc = subprocess.Popen(
        [sys.executable, "-m", "stabledrl_mcore.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True) + [proc]:
            child.kill()
        out, _ = proc.communicate()
        pytest.fail(f"stabledrl {' '.join(args)} timed out:\n{out[-3000:]}")
    assert proc.returncode == 0, f"stabledrl {' '.join(args)} exited {proc.returncode}:\n{out[-3000:]}"
    return out


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """Tiny LLaDA and SDAR checkpoints in the upstream HF format, converted as a user would."""
    root = tmp_path_factory.mktemp("tiny_ckpts")
    out = {}
    for kind in ("llada", "sdar", "sdar_moe"):  # sdar_moe: the SDAR-30B-A3B (Qwen3-MoE) layout
        hf = write_hf_checkpoint(str(root / f"hf_{kind}"), kind)
        _cli(
            "convert",
            "hf-to-mcore",
            "--model",
            kind.split("_")[0],
            "--hf-dir",
            hf,
            "--out",
            str(root / f"mcore_{kind}"),
            "--no-progress",
        )
        out[kind] = (hf, str(root / f"mcore_{kind}"))
    return out


def _kind(recipe: dict) -> str:
    """The upstream checkpoint kind of a recipe's model: ``llada``, ``sdar`` or ``sdar_moe``."""
    return _arch(recipe) + ("_moe" if _is_moe(recipe) else "")


def _arch(recipe: dict) -> str:
    from stabledrl_mcore.models import get_preset

    return get_preset(recipe["model"]["preset"]).arch


def _is_moe(recipe: dict) -> bool:
    from stabledrl_mcore.models import get_preset

    return get_preset(recipe["model"]["preset"]).is_moe


def scaled_down(recipe: dict, checkpoints: dict, run_dir: str):
    """``(world size, overrides)``: the recipe at toy shape and length, nothing else changed."""
    arch, rollout = _arch(recipe), recipe["rollout"]
    tp, pp, world = scaled_layout(recipe)
    gen = 16
    over = {
        "logging.run_dir": run_dir,
        "logging.wandb_mode": "disabled",
        "logging.progress": False,
        "parallel.tensor_parallel": tp,
        "parallel.threads": 1,
        "steps": 2,
        "checkpoint.save_every": 1,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 4,
        "rollout.gen_length": gen,
        "parallel.micro_batch_size": min(recipe.get("parallel", {}).get("micro_batch_size", 4), 4),
    }
    if recipe["model"].get("checkpoint"):
        over["model.checkpoint"] = checkpoints[_kind(recipe)][1]
    if arch == "llada":  # same steps per token as the recipe, blocks no longer than the answer
        block = min(rollout["block_length"], gen // 2)
        over["rollout.block_length"] = block
        over["rollout.steps"] = max(gen // block, gen * rollout["steps"] // rollout["gen_length"])
    if rollout.get("group_size", 4) < 4:
        over["rollout.group_size"] = rollout["group_size"]
    if rollout["task"] in FILE_TASKS:
        over["rollout.data_path"] = os.path.join(FIXTURES, FILE_TASKS[rollout["task"]])
    if pp != recipe.get("parallel", {}).get("pipeline_parallel", 1):
        over["parallel.pipeline_parallel"] = pp
    if scaled_expert_parallel(recipe) != recipe.get("parallel", {}).get("expert_parallel", 1):
        over["parallel.expert_parallel"] = scaled_expert_parallel(recipe)
    return world, [f"{k}={v}" for k, v in over.items()]


def scaled_layout(recipe: dict):
    """``(TP, PP, world)``: TP and PP capped at 2; DP=2, or DP=1 under PP (4 ranks at most)."""
    parallel = recipe.get("parallel", {})
    tp, pp = min(parallel.get("tensor_parallel", 1), 2), min(parallel.get("pipeline_parallel", 1), 2)
    return tp, pp, tp * pp if pp > 1 else 2 * tp


def scaled_expert_parallel(recipe: dict) -> int:
    """EP of the scaled-down run: the recipe's, capped at :data:`SCALED_EXPERT_PARALLEL` (DP=2 holds it)."""
    return min(recipe.get("parallel", {}).get("expert_parallel", 1), SCALED_EXPERT_PARALLEL)


def _assert_ran_in_layout(run_dir: str, recipe: dict):
    """The checkpoints record the scaled-down layout (a pipelined recipe really ran pipelined)."""
    tp, pp, world = scaled_layout(recipe)
    with open(os.path.join(run_dir, "checkpoints", "step_00000002", "train_state.json")) as handle:
        state = json.load(handle)
    assert (state["world_size"], state["tensor_parallel"], state["pipeline_parallel"]) == (world, tp, pp), state


def _group_worker(primaries, variants):
    """One rank of a spawn shared by several recipes, everything in turn in these processes: rank 0
    prints each primary's resolved config (``stabledrl train --print-config``), every recipe trains
    through the CLI's own entry (``train_rank``) with a dense reward, each primary resumes from its
    step-1 checkpoint, and rank 0 exports both step-2 checkpoints with ``stabledrl convert mcore-to-hf``."""
    from stabledrl_mcore.bench.workload_checks import probe_reward
    from stabledrl_mcore.cli.app import main
    from stabledrl_mcore.parallel import bootstrap
    from stabledrl_mcore.rl.trainer import train_rank
    from stabledrl_mcore.tasks.base import Task

    Task.reward = probe_reward  # deterministic, varies with the text
    rank0 = os.environ["RANK"] == "0"
    if rank0:
        for job in primaries:
            with open(job["config_out"], "w") as handle, contextlib.redirect_stdout(handle):
                assert main(["train", "--config", job["recipe"], *job["overrides"], "--print-config"]) == 0, job

    def run(recipe, overrides, what):
        # the next recipe may have another layout; and every group goes (destroy_model_parallel alone
        # kept Megatron's groups: ~400 per rank by the last run, their idle gloo threads slowed each
        # run 2-6x)
        bootstrap.destroy()
        try:
            status = train_rank(recipe, overrides)
        except Exception as err:
            raise RuntimeError(f"{what}: {type(err).__name__}: {err}") from err
        assert status == 0, f"{what}: exit status {status}"

    for job in primaries:
        run(job["recipe"], job["overrides"], os.path.basename(job["recipe"]))
    if rank0:  # resume from step 1 in a fresh run directory
        for job in primaries:
            os.makedirs(os.path.join(job["resumed"], "checkpoints"))
            shutil.copytree(
                os.path.join(job["first"], "checkpoints", "step_00000001"),
                os.path.join(job["resumed"], "checkpoints", "step_00000001"),
            )
    if primaries:
        import torch.distributed as dist

        dist.barrier()
    for job in primaries:
        run(job["recipe"], job["resume_overrides"], os.path.basename(job["recipe"]) + " (resumed)")
    for job in variants:
        run(job["recipe"], job["overrides"], os.path.basename(job["recipe"]))
    bootstrap.destroy()
    if rank0:  # a single-process conversion, as `stabledrl convert` runs it
        for job in primaries:
            for name in ("first", "resumed"):
                ckpt = os.path.join(job[name], "checkpoints", "step_00000002")
                status = main(["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", job[f"hf_{name}"], "--no-progress"])
                assert status == 0, f"{os.path.basename(job['recipe'])}: mcore-to-hf of {name} exited {status}"


def _group_of(recipe_path: str):
    """Recipes that share a spawn: the same scaled-down world size; expert-parallel ones apart."""
    with open(recipe_path) as handle:
        recipe = yaml.safe_load(handle)
    return scaled_layout(recipe)[2], scaled_expert_parallel(recipe) > 1


@pytest.fixture(scope="module")
def recipe_runs(tiny_checkpoints, tmp_path_factory):
    """``runs(recipe_path)`` -> that recipe's directories; the first request of a group runs the
    whole group (:func:`_group_worker`) in one spawn; a failed group fails each of its tests."""
    root, done = tmp_path_factory.mktemp("recipe_runs"), {}

    def dirs(path):
        name = os.path.basename(path)[:-5]
        base = root / name
        return {
            "recipe": path,
            "first": str(base / "first"),
            "resumed": str(base / "resumed"),
            "run": str(base / "run"),
            "config_out": str(base / "config.yaml"),
            "hf_first": str(base / "hf_first"),
            "hf_resumed": str(base / "hf_resumed"),
        }

    def run_group(group):
        primaries, variants = [], []
        for path in RECIPES:
            if _group_of(path) != group:
                continue
            with open(path) as handle:
                recipe = yaml.safe_load(handle)
            job = dirs(path)
            os.makedirs(os.path.dirname(job["first"]))
            if path in VARIANTS:
                world, job["overrides"] = scaled_down(recipe, tiny_checkpoints, job["run"])
                variants.append(job)
            else:
                world, job["overrides"] = scaled_down(recipe, tiny_checkpoints, job["first"])
                resume = scaled_down(recipe, tiny_checkpoints, job["resumed"])[1]
                job["resume_overrides"] = resume + ["checkpoint.resume=auto"]
                primaries.append(job)
        runs = 2 * len(primaries) + len(variants)
        spawn(_group_worker, world, (primaries, variants), timeout=RUN_TIMEOUT_S * runs + 120)

    def runs(path):
        group = _group_of(path)
        if group not in done:
            try:
                run_group(group)
                done[group] = None
            except Exception as err:  # noqa: BLE001 - reported by every test of the group
                done[group] = err
        if done[group] is not None:
            pytest.fail(f"the spawn of recipe group {group} (world size, expert-parallel) failed: {done[group]}")
        return dirs(path)

    return runs


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle]
    return [
        {k: v for k, v in r.items() if k not in TIME_KEYS and not k.startswith(("time/", "tokens_per_s"))} for r in rows
    ]


def _hf_tensors(path):
    from hf_fixtures import load_all

    return load_all(path)


def test_every_recipe_is_tested():
    assert set(PRIMARY) | set(VARIANTS) == set(RECIPES) and len(RECIPES) >= 11
    assert all(twin in PRIMARY for twin in VARIANTS.values())


def test_a_pipelined_recipe_is_tested_with_its_pipeline():
    """A recipe with PP > 1 exists and is run at PP=2 (TP capped at 2, DP=1); the others at DP=2 x TP."""
    layouts = {}
    for path in RECIPES:
        with open(path) as handle:
            recipe = yaml.safe_load(handle)
        world, overrides = scaled_down(recipe, {k: ("", "ckpt") for k in ("llada", "sdar", "sdar_moe")}, "run")
        tp, pp, _ = scaled_layout(recipe)
        assert f"parallel.tensor_parallel={tp}" in overrides, (path, overrides)
        layouts[os.path.basename(path)] = (tp, pp, world)
    assert layouts["llada_8b_stabledrl_tp4pp2.yaml"] == (2, 2, 4), layouts
    assert all(world == 2 * tp for tp, pp, world in layouts.values() if pp == 1), layouts


def test_the_moe_recipe_runs_the_tiny_moe_with_expert_parallelism():
    """The SDAR-30B-A3B recipe scales to a tiny converted SDAR-MoE checkpoint at EP=2 on 2 ranks (DP=2),
    its dtype, recompute, optimizer and algorithm untouched; it is the only one in its spawn group."""
    path = os.path.join(ROOT, "examples", "configs", "sdar_30b_a3b_stabledrl.yaml")
    with open(path) as handle:
        recipe = yaml.safe_load(handle)
    assert _is_moe(recipe) and recipe["parallel"]["expert_parallel"] == 8 and path in PRIMARY
    world, overrides = scaled_down(recipe, {"sdar_moe": ("", "moe_ckpt")}, "run")
    keys = {o.split("=", 1)[0] for o in overrides}
    assert world == 2 and "model.checkpoint=moe_ckpt" in overrides
    assert f"parallel.expert_parallel={SCALED_EXPERT_PARALLEL}" in overrides and SCALED_EXPERT_PARALLEL == 2
    assert not keys & {"model.dtype", "model.recompute", "optim.distributed", "optim.name", "algo.likelihood"}
    assert [p for p in RECIPES if _group_of(p) == _group_of(path)] == [path]


@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe_path", list(VARIANTS), ids=[os.path.basename(p)[:-5] for p in VARIANTS])
def test_recipe_variant_trains_and_checkpoints(recipe_path, recipe_runs):
    with open(recipe_path) as handle:
        recipe = yaml.safe_load(handle)
    run = recipe_runs(recipe_path)["run"]
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step_00000001", "step_00000002"]
    _assert_ran_in_layout(run, recipe)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2] and all(r["skipped_updates"] == 0 for r in rows), rows


@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe_path", PRIMARY, ids=[os.path.basename(p)[:-5] for p in PRIMARY])
def test_recipe_trains_checkpoints_resumes_bitwise_and_exports(recipe_path, recipe_runs, tiny_checkpoints):
    with open(recipe_path) as handle:
        recipe = yaml.safe_load(handle)
    job = recipe_runs(recipe_path)
    first, resumed = job["first"], job["resumed"]
    _, overrides = scaled_down(recipe, tiny_checkpoints, first)
    with open(job["config_out"]) as handle:  # `stabledrl train --print-config`, printed on rank 0
        resolved = yaml.safe_load(handle)
    overridden = {o.split("=", 1)[0] for o in overrides}
    for section, values in recipe.items():  # only shape and length were overridden
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            if f"{section}.{key}" not in overridden:
                want = list(value) if isinstance(value, tuple) else value
                assert resolved[section][key] == want, (section, key)
    assert resolved["optim"]["distributed"] is True
    assert resolved["parallel"]["expert_parallel"] == scaled_expert_parallel(recipe)

    ckpts = os.path.join(first, "checkpoints")
    assert sorted(os.listdir(ckpts)) == ["step_00000001", "step_00000002"]
    _assert_ran_in_layout(first, recipe)
    rows = _metrics(first)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["skipped_updates"] == 0 and r["grad_norm"] > 0 for r in rows), rows

    # resumed from step 1 in a fresh run directory: step 2 must come out bit for bit
    again = _metrics(resumed)
    assert [r["step"] for r in again] == [2] and again[0] == rows[1], (again, rows[1])

    a, b = _hf_tensors(job["hf_first"]), _hf_tensors(job["hf_resumed"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ"
    if recipe["model"].get("checkpoint"):  # back in the layout the run started from (MoE: every expert)
        kind = _kind(recipe)
        shapes = upstream_shapes(kind, upstream_config(kind))
        assert {k: tuple(v.shape) for k, v in a.items()} == shapes, "mcore-to-hf lost the upstream layout"
    want = torch.bfloat16 if recipe["model"].get("dtype") == "bf16" else torch.float32
    assert {v.dtype for v in a.values()} == {want}


def test_recipe_sources_doc_is_current():
    """docs/recipes.md lists every recipe line with its source (tools/recipe_sources.py --check)."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "recipe_sources.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_recipe_sources_doc_rows_have_three_cells():
    """A `|` inside a source (e.g. `is_mask |= ...`) is escaped, so every row renders as line | value | source."""
    import re

    rows = [line for line in open(os.path.join(ROOT, "docs", "recipes.md")) if line.startswith("| `")]
    assert rows
    bad = [row for row in rows if len(re.findall(r"(?<!\\)\|", row)) != 4]
    assert not bad, bad[:3]
