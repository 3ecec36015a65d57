"""Launcher detection (torchrun, SLURM, single) and layout errors before any model is built."""

import pytest

from stabledrl_mcore.parallel.bootstrap import (
    ParallelLayoutError,
    detect_launch_env,
    expand_slurm_nodelist,
    validate_parallel_layout,
)
from stabledrl_mcore.parallel.launch import WorkerFailed, spawn


def test_expand_slurm_nodelist():
    assert expand_slurm_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert expand_slurm_nodelist("localhost") == ["localhost"]
    assert expand_slurm_nodelist("a[9-10]-ib") == ["a9-ib", "a10-ib"]


def test_torchrun_env_wins():
    env = dict(
        RANK="3",
        WORLD_SIZE="8",
        LOCAL_RANK="1",
        MASTER_ADDR="h0",
        MASTER_PORT="1234",
        SLURM_PROCID="0",
        SLURM_NTASKS="2",
    )
    launch = detect_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (3, 8, 1, "torchrun")
    assert (launch.master_addr, launch.master_port) == ("h0", 1234)


def test_slurm_env():
    env = dict(
        SLURM_PROCID="5", SLURM_NTASKS="16", SLURM_LOCALID="5", SLURM_JOB_NODELIST="gpu[003-004]", SLURM_JOB_ID="4242"
    )
    launch = detect_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (5, 16, 5)
    assert launch.master_addr == "gpu003" and launch.launcher == "slurm"
    assert launch.master_port == 20000 + 4242
    assert detect_launch_env(dict(env, MASTER_PORT="3000")).master_port == 3000


def test_single_process_env():
    launch = detect_launch_env({})
    assert (launch.rank, launch.world_size, launch.launcher) == (0, 1, "single")


def test_the_ranks_on_this_host_are_read_whatever_the_launcher():
    """``local_world_size``: ``LOCAL_WORLD_SIZE``, else ``SLURM_NTASKS_PER_NODE`` (an sbatch shell has
    no ``SLURM_PROCID``), a positive whole number or None (what the preflight's memory check divides by)."""
    assert detect_launch_env({}).local_world_size is None
    torchrun = dict(RANK="0", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4", SLURM_NTASKS_PER_NODE="2")
    assert detect_launch_env(torchrun).local_world_size == 4
    batch_shell = dict(SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4")
    assert detect_launch_env(batch_shell).launcher == "single" and detect_launch_env(batch_shell).local_world_size == 4
    assert detect_launch_env(dict(LOCAL_WORLD_SIZE="0", SLURM_NTASKS_PER_NODE="2")).local_world_size == 2
    assert detect_launch_env(dict(SLURM_NTASKS_PER_NODE="4(x2)")).local_world_size is None


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(world_size=6, tensor_parallel=4, pipeline_parallel=1), "world size 6 is not divisible"),
        (
            dict(world_size=4, tensor_parallel=4, pipeline_parallel=1, num_attention_heads=6),
            r"num_attention_heads \(6\) is not divisible by tensor_parallel \(4\)",
        ),
        (dict(world_size=4, tensor_parallel=4, pipeline_parallel=1, num_query_groups=2), r"num_query_groups \(2\)"),
        (dict(world_size=4, tensor_parallel=1, pipeline_parallel=4, num_layers=6), r"num_layers \(6\)"),
    ],
)
def test_layout_errors(kwargs, message):
    with pytest.raises(ParallelLayoutError, match=message):
        validate_parallel_layout(**kwargs)


def test_layout_ok_returns_dp():
    assert validate_parallel_layout(8, 2, 2, num_layers=4, num_attention_heads=4, num_query_groups=2) == 2


def _bad_layout_worker(result_dir):
    import os

    from stabledrl_mcore.parallel import bootstrap

    try:
        bootstrap.initialize(2, 1, model_shape=dict(num_attention_heads=3))
    except ParallelLayoutError as err:
        with open(os.path.join(result_dir, f"rank{os.environ['RANK']}.txt"), "w") as handle:
            handle.write(str(err))
        raise


@pytest.mark.multiprocess
def test_bad_layout_fails_on_every_rank_without_hang(tmp_path):
    with pytest.raises(WorkerFailed, match="num_attention_heads"):
        # grace 60 s: each rank reaches the check by itself, also on a starved machine (at the default 5 s
        # a nice-19 run saw rank 1 stopped by the launcher before it got there)
        spawn(_bad_layout_worker, 2, (str(tmp_path),), timeout=120, grace=60)
    messages = sorted(p.read_text() for p in tmp_path.iterdir())
    assert len(messages) == 2 and all("num_attention_heads (3)" in m for m in messages)


def _two_start_ups_worker(result_dir):
    """Start the process group and Megatron, all-reduce, tear down; twice (the demo's SFT then RL
    phases, the bench's runs): the second start-up meets in the launcher's store under new keys."""
    import os

    import torch

    from stabledrl_mcore.parallel import bootstrap

    sums = []
    for _ in range(2):
        bootstrap.initialize(1, 1, timeout_minutes=1)
        value = torch.ones(1) * (1 + torch.distributed.get_rank())
        torch.distributed.all_reduce(value)
        sums.append(float(value))
        bootstrap.destroy()
    with open(os.path.join(result_dir, f"rank{os.environ['RANK']}.txt"), "w") as handle:
        handle.write(repr(sums))


@pytest.mark.multiprocess
def test_two_process_group_start_ups_in_one_spawned_rank_succeed(tmp_path):
    """Issue 71 (3a): under :func:`spawn` (the launcher serves the store, as torchrun's agent) a rank
    starts its process group twice; each start-up all-reduces (1 + 2 = 3 on both ranks)."""
    spawn(_two_start_ups_worker, 2, (str(tmp_path),), timeout=150, grace=30)
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["[3.0, 3.0]"] * 2


def test_destroy_stops_the_gloo_threads_of_groups_that_garbage_still_holds():
    """A finished run's model and optimizer hold Megatron's groups in reference cycles, so after
    ``destroy`` the groups live on until a garbage collection, and each one's gloo loop thread wakes
    every 10 ms meanwhile (test_recipes' shared ranks piled up ~400 of them: each later run 2-6x
    slower). ``destroy`` collects: the threads stop at once. The collector is off here, as it was
    between its rare full passes in those ranks."""
    import gc

    import torch
    from conftest import gloo_threads, native_threads
    from megatron.core import parallel_state

    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    before = gloo_threads(native_threads())
    enabled = gc.isenabled()
    gc.disable()
    try:
        bootstrap.initialize(1, 1, environ={})
        garbage = {"groups": [parallel_state.get_data_parallel_group(), parallel_state.get_data_parallel_group_gloo()]}
        garbage["itself"] = garbage
        del garbage
        running = gloo_threads(native_threads())
        bootstrap.destroy()
        assert running > before and gloo_threads(native_threads()) <= before, (before, running)
        # none kept by Megatron's own globals either (destroy_model_parallel leaves two of them set)
        held = [k for k, v in vars(parallel_state).items() if isinstance(v, torch.distributed.ProcessGroup)]
        assert not held, held
    finally:
        if enabled:
            gc.enable()
        bootstrap.destroy()
        cpu_compat.disable()
