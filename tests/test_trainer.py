"""The distributed StableDRL loop: DP=2 == DP=1, TP=2 trains, exact resume, kill during save."""

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from stabledrl_mcore.parallel.launch import spawn
from stabledrl_mcore.tasks.base import register_task
from stabledrl_mcore.tasks.sudoku import SudokuTask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")


class DigitsTask(SudokuTask):
    """Sudoku prompts with a dense reward a random model already varies on: share of digits
    plus variety (so greedy decoding of a random model scores above 0 too)."""

    name = "test_digits"

    def _reward(self, completion, reference):
        text = completion[:16]
        return 0.5 * sum(ch.isdigit() for ch in text) / 16.0 + 0.5 * len(set(text)) / 16.0


@contextlib.contextmanager
def in_process_trainer():
    """For a trainer run inside the test process: the test task registered, one torch thread, and
    Megatron's state, the CPU shims and the thread count restored afterwards, also on failure."""
    from stabledrl_mcore.parallel import bootstrap, cpu_compat
    from stabledrl_mcore.tasks import available_tasks
    from stabledrl_mcore.tasks import base as task_base

    added = DigitsTask.name not in available_tasks()
    if added:
        task_base.register_task(DigitsTask.name)(DigitsTask)
    from megatron.core import parallel_state

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    held = None  # a module fixture's TP=1 state (megatron_tp1), brought back for the tests after this one
    if parallel_state.model_parallel_is_initialized():
        held = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
    try:
        yield
    finally:
        if added:  # other modules check the registry's exact contents
            task_base._REGISTRY.pop(DigitsTask.name)
        bootstrap.destroy()
        cpu_compat.disable()
        torch.set_num_threads(threads)
        if held is not None:
            bootstrap.initialize(*held, seed=0)


def overrides(run_dir, **extra):
    base = {
        "logging.run_dir": run_dir,
        "logging.wandb_mode": "disabled",
        "rollout.task": "test_digits",
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.gen_length": 8,
        "rollout.steps": 4,
        "rollout.block_length": 8,
        "parallel.micro_batch_size": 4,
        "checkpoint.save_every": 0,
        "steps": 2,
        "optim.lr": 0.05,
        "optim.clip_grad": 1.0,
        "algo.loss": "stabledrl",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def one_step_config(run_dir, **extra):
    """The config of a short in-process trainer run in ``run_dir``: :func:`overrides` with no
    progress bar, one step of 2 prompts, then ``extra`` on top."""
    from stabledrl_mcore.config.schema import load_config

    base = {"logging.progress": False, "steps": 1, "rollout.prompts_per_step": 2}
    return load_config(CONFIG, overrides(str(run_dir), **{**base, **extra}))


def _train_worker(run_dir, extra, out_name, stop_after=None, resume=None):
    from stabledrl_mcore.tasks import available_tasks

    if "test_digits" not in available_tasks():  # registered in the rank processes only
        register_task("test_digits")(DigitsTask)
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl.trainer import train

    cfg = load_config(CONFIG, overrides(run_dir, **extra))
    setup = train(cfg, resume=resume, stop_after=stop_after)
    state = {k: v.detach().clone() for k, v in setup.model.state_dict().items() if isinstance(v, torch.Tensor)}
    rank = torch.distributed.get_rank()
    if out_name:
        torch.save(state, os.path.join(run_dir, f"{out_name}.rank{rank}.pt"))


def _metrics(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    drop = ("time", "step_s")
    return [{k: v for k, v in r.items() if k not in drop and not k.startswith(("time/", "tokens_per_s"))} for r in rows]


@pytest.mark.multiprocess
def test_dp2_equals_dp1_and_tp2_trains(tmp_path):
    sgd = {
        "optim.name": "sgd",
        "optim.distributed": False,
        "optim.weight_decay": 0.0,
        "eval.every": 1,
        "eval.num_examples": 6,
        "eval.micro_batch_size": 2,
    }
    single, dp2, tp2 = (str(tmp_path / n) for n in ("dp1", "dp2", "tp2"))
    spawn(_train_worker, 1, (single, sgd, "final"), timeout=300)
    spawn(_train_worker, 2, (dp2, sgd, "final"), timeout=300)
    spawn(_train_worker, 2, (tp2, dict(sgd, **{"parallel.tensor_parallel": 2}), "final"), timeout=300)
    ref = torch.load(os.path.join(single, "final.rank0.pt"))
    init_dir = str(tmp_path / "init")
    spawn(_train_worker, 1, (init_dir, dict(sgd, steps=0), "final"), timeout=300)
    init = torch.load(os.path.join(init_dir, "final.rank0.pt"))
    moved = max((ref[k] - init[k]).abs().max().item() for k in ref)
    assert moved > 1e-4, "weights did not move"
    for rank in (0, 1):
        got = torch.load(os.path.join(dp2, f"final.rank{rank}.pt"))
        diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert diff < 1e-5, f"DP=2 rank {rank} differs from DP=1 by {diff}"
    assert _metrics(dp2)[-1]["reward_mean"] == pytest.approx(_metrics(single)[-1]["reward_mean"])
    # held-out evaluation (eval.every): before step 1 and after every step, sharded over DP ranks
    evals = [[(r["step"], r["test_reward"]) for r in _metrics(d) if "test_reward" in r] for d in (single, dp2)]
    assert [s for s, _ in evals[0]] == [s for s, _ in evals[1]] == [0, 1, 2]
    assert any(r > 0 for _, r in evals[0]), "the held-out reward should not be trivially 0"
    assert [r for _, r in evals[1]] == pytest.approx([r for _, r in evals[0]]), (
        "held-out evaluation differs between DP=1 and DP=2"
    )
    tp_state = torch.load(os.path.join(tp2, "final.rank0.pt"))
    tp_init = [k for k in tp_state if k.endswith("linear_fc2.weight")][0]
    assert all(torch.isfinite(v).all() for v in tp_state.values())
    assert tp_state[tp_init].shape[1] * 2 == ref[tp_init].shape[1], "TP=2 should hold half of fc2"
    last = _metrics(tp2)[-1]
    assert last["grad_norm"] > 0 and last["skipped_updates"] == 0


@pytest.mark.multiprocess
def test_retained_update_graph_gives_the_same_weights(tmp_path):
    """parallel.retain_update_graph skips a forward; the update must not change (2 micro-batches)."""
    sgd = {
        "optim.name": "sgd",
        "optim.distributed": False,
        "optim.weight_decay": 0.0,
        "parallel.micro_batch_size": 8,
        "algo.inner_iterations": 3,
        "algo.num_mc": 2,
        "algo.coupled_masks": True,
    }
    plain, retained = str(tmp_path / "plain"), str(tmp_path / "retained")
    spawn(_train_worker, 1, (plain, sgd, "final"), timeout=300)
    spawn(_train_worker, 1, (retained, dict(sgd, **{"parallel.retain_update_graph": True}), "final"), timeout=300)
    ref = torch.load(os.path.join(plain, "final.rank0.pt"))
    got = torch.load(os.path.join(retained, "final.rank0.pt"))
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert diff < 1e-6, f"retaining the update graph changed the weights by {diff}"
    assert _metrics(plain)[-1]["grad_norm"] > 0, "no update happened"
    assert _metrics(plain)[-1]["grad_norm"] == pytest.approx(_metrics(retained)[-1]["grad_norm"], rel=1e-5)


@pytest.mark.multiprocess
def test_exact_resume_bitwise(tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    extra = {"steps": 4, "checkpoint.save_every": 2, "optim.lr": 1e-3}
    spawn(_train_worker, 1, (straight, extra, "final"), timeout=300)
    spawn(_train_worker, 1, (resumed, extra, None, 2), timeout=300)  # stops (process exits) after step 2
    spawn(_train_worker, 1, (resumed, extra, "final", None, "auto"), timeout=300)
    a, b = _metrics(straight), _metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b, "metrics differ after resume"
    sa = torch.load(os.path.join(straight, "final.rank0.pt"))
    sb = torch.load(os.path.join(resumed, "final.rank0.pt"))
    assert all(torch.equal(sa[k], sb[k]) for k in sa), "parameters are not bitwise equal"


def _kill_tree(proc):
    """SIGKILL the training process and every process it started (by PID)."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for pid in [proc.pid] + [c.pid for c in children]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


@pytest.mark.multiprocess
def test_sigkill_during_checkpoint_save_resumes_from_last_complete(tmp_path):
    run_dir = str(tmp_path / "run")
    ckpt = os.path.join(run_dir, "checkpoints")
    cmd = [
        sys.executable,
        "-m",
        "stabledrl_mcore.cli",
        "train",
        "--config",
        CONFIG,
        *overrides(run_dir, **{"rollout.task": "sudoku", "checkpoint.save_every": 1, "steps": 3}),
    ]
    env = dict(os.environ, STABLEDRL_FAULT_PAUSE_BEFORE_COMMIT="2", PYTHONPATH=ROOT)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if os.path.isdir(os.path.join(ckpt, "step_00000001")) and os.path.isdir(
                os.path.join(ckpt, ".tmp-step_00000002")
            ):
                break
            time.sleep(0.02)
        assert proc.poll() is None, "training ended before the second save: " + proc.stderr.read().decode()
    finally:
        _kill_tree(proc)
    assert sorted(os.listdir(ckpt)) == [".tmp-step_00000002", "step_00000001"]
    from stabledrl_mcore.checkpoint.state import CheckpointError, find_latest, read_train_state

    assert find_latest(ckpt).endswith("step_00000001")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):  # the killed save is never loadable
        read_train_state(os.path.join(ckpt, ".tmp-step_00000002"))
    env.pop("STABLEDRL_FAULT_PAUSE_BEFORE_COMMIT")
    done = subprocess.run(cmd + ["--resume", "auto"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {ckpt}/step_00000001 at step 1" in done.stdout, done.stdout[-3000:]  # not the killed save
    assert sorted(os.listdir(ckpt)) == ["step_00000002", "step_00000003"]  # keep_last: 2
    steps = [json.loads(line)["step"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert steps == [1, 2, 3], "each step once: the killed run's step 2 is dropped at the resume"
    kept = [json.loads(line)["step"] for line in open(*glob.glob(os.path.join(run_dir, "attic", "*", "metrics.jsonl")))]
    assert kept == [1, 2], kept


def _one_rank_nan_worker(run_dir):
    """Rank 1's first loss is non-finite; rank 0's is fine (the case that used to hang)."""
    from stabledrl_mcore.rl import trainer

    real, calls = trainer.loss_coefficients, []

    def faulty(*args, **kwargs):
        calls.append(1)
        if torch.distributed.get_rank() == 1 and len(calls) == 1:
            return None, {"nonfinite_reason": "injected: loss is nan"}
        return real(*args, **kwargs)

    trainer.loss_coefficients = faulty
    _train_worker(run_dir, {"parallel.timeout_minutes": 1, "steps": 1}, None)


@pytest.mark.multiprocess
def test_a_nonfinite_loss_on_one_rank_skips_on_every_rank_without_hanging(tmp_path):
    """A rank waiting for a collective the other rank skipped would fail at the 1-minute collective
    timeout (``parallel.timeout_minutes``), and spawn's 150 s limit bounds the rest: no timing here."""
    run_dir = str(tmp_path / "run")
    spawn(_one_rank_nan_worker, 2, (run_dir,), timeout=150)
    rows = _metrics(run_dir)
    # every rank skipped the first of the 2 inner iterations together, then updated together
    assert rows[-1]["skipped_updates"] == 1.0 and rows[-1]["grad_norm"] > 0, rows[-1]
