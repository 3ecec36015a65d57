"""Distributed start-up: launcher environment -> torch.distributed -> Megatron parallel state.

Supported launchers (checked in this order):

- ``torchrun`` / any launcher that sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``;
- SLURM ``srun`` with one task per rank: ``SLURM_PROCID`` -> rank,
  ``SLURM_NTASKS`` -> world size, ``SLURM_LOCALID`` -> local rank, the master
  address is the first host of ``SLURM_JOB_NODELIST`` and the port comes from
  ``MASTER_PORT`` or is derived from ``SLURM_JOB_ID`` (so two jobs sharing a
  node do not collide);
- a plain single process (world size 1; an in-process store unless ``MASTER_PORT`` is set).

NCCL is used when CUDA is available, gloo otherwise (then the CPU
compatibility layer :mod:`stabledrl_mcore.parallel.cpu_compat` is enabled).
"""

from __future__ import annotations

import datetime
import gc
import itertools
import os
import random
import re
import socket
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from stabledrl_mcore.common.errors import UserError
from stabledrl_mcore.parallel import cpu_compat


class ParallelLayoutError(UserError, ValueError):
    """The requested tensor/pipeline/data layout cannot be built."""


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, read from the launcher's variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "single"
    agent_store: bool = False  # the launcher serves the store on master_port; every rank is a client
    local_world_size: Optional[int] = None
    """Ranks on this host as the environment says (``LOCAL_WORLD_SIZE``, else ``SLURM_NTASKS_PER_NODE``,
    whichever launcher: an sbatch shell has no ``SLURM_PROCID``); None where neither is a positive number."""


AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"
"""torch's own switch (set by torchrun and by :func:`stabledrl_mcore.parallel.launch.spawn`):
``True`` means the launcher already serves the rendezvous store on ``MASTER_PORT``, bound before any
rank started, so no other process can take the port in between, and every rank joins as a client."""


def expand_slurm_nodelist(nodelist: str) -> List[str]:
    """Expand a SLURM hostlist such as ``node[01-03,07],gpu5`` into host names.

    Follows the format accepted by ``scontrol show hostnames`` for the common
    cases (comma-separated items, one bracketed range group per item, zero-padded
    ranges).
    """
    hosts: List[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        match = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{part}{suffix}")
    return hosts


def detect_launch_env(environ: Optional[dict] = None) -> LaunchEnv:
    """Read rank, world size and rendezvous address from the environment."""
    env = os.environ if environ is None else environ
    local = _local_world_size(env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
            agent_store=env.get(AGENT_STORE_VARIABLE) == "True",
            local_world_size=local,
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        master_addr = env.get("MASTER_ADDR") or expand_slurm_nodelist(nodelist)[0]
        job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
        port = int(env.get("MASTER_PORT") or 20000 + job_id % 20000)
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=master_addr,
            master_port=port,
            launcher="slurm",
            local_world_size=local,
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT") or 0), "single", local_world_size=local)


def _local_world_size(env) -> Optional[int]:
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def validate_parallel_layout(
    world_size: int,
    tensor_parallel: int,
    pipeline_parallel: int,
    *,
    num_layers: Optional[int] = None,
    num_attention_heads: Optional[int] = None,
    num_query_groups: Optional[int] = None,
    vocab_size: Optional[int] = None,
    expert_parallel: int = 1,
    expert_tensor_parallel: Optional[int] = None,
    num_experts: Optional[int] = None,
) -> int:
    """Check a layout before anything is built; return the data-parallel size.

    Experts follow Megatron's expert grid ``world = PP x ETP x EP x expert-DP`` (``ETP`` defaults to
    TP); ``num_experts``: 0 for a dense model, None when the shape is unknown here.

    Every rank runs the same check on the same numbers, so every rank raises
    the same error and none is left waiting in a collective.
    """
    problems = []
    if tensor_parallel < 1 or pipeline_parallel < 1:
        problems.append(f"tensor_parallel ({tensor_parallel}) and pipeline_parallel ({pipeline_parallel}) must be >= 1")
    elif world_size % (tensor_parallel * pipeline_parallel):
        problems.append(
            f"world size {world_size} is not divisible by tensor_parallel x pipeline_parallel "
            f"= {tensor_parallel} x {pipeline_parallel} = {tensor_parallel * pipeline_parallel}"
        )
    if num_attention_heads is not None and tensor_parallel >= 1 and num_attention_heads % tensor_parallel:
        problems.append(
            f"num_attention_heads ({num_attention_heads}) is not divisible by tensor_parallel ({tensor_parallel})"
        )
    if num_query_groups is not None and tensor_parallel >= 1 and num_query_groups % tensor_parallel:
        problems.append(
            f"num_query_groups ({num_query_groups}) is not divisible by tensor_parallel ({tensor_parallel})"
        )
    if num_layers is not None and pipeline_parallel >= 1 and num_layers % pipeline_parallel:
        problems.append(f"num_layers ({num_layers}) is not divisible by pipeline_parallel ({pipeline_parallel})")
    if vocab_size is not None and tensor_parallel >= 1 and vocab_size % tensor_parallel:
        problems.append(
            f"vocab_size ({vocab_size}) is not divisible by tensor_parallel ({tensor_parallel}); pad the vocabulary"
        )
    problems += _expert_layout_problems(
        world_size, tensor_parallel, pipeline_parallel, expert_parallel, expert_tensor_parallel, num_experts
    )
    if problems:
        raise ParallelLayoutError("invalid parallel layout: " + "; ".join(problems))
    return world_size // (tensor_parallel * pipeline_parallel)


def _expert_layout_problems(
    world_size: int,
    tensor_parallel: int,
    pipeline_parallel: int,
    expert_parallel: int,
    expert_tensor_parallel: Optional[int],
    num_experts: Optional[int],
) -> List[str]:
    etp = expert_tensor_parallel or tensor_parallel
    if expert_parallel == 1 and expert_tensor_parallel is None:
        return []
    if expert_parallel < 1 or etp < 1:
        return [f"expert_parallel ({expert_parallel}) and expert_tensor_parallel ({etp}) must be >= 1"]
    problems = []
    if num_experts == 0:
        problems.append(
            f"expert_parallel={expert_parallel} / expert_tensor_parallel={expert_tensor_parallel} "
            f"need a mixture-of-experts model (num_experts); this one is dense: set "
            f"parallel.expert_parallel=1 and parallel.expert_tensor_parallel=null"
        )
    elif num_experts and num_experts % expert_parallel:
        problems.append(f"num_experts ({num_experts}) is not divisible by expert_parallel ({expert_parallel})")
    if (
        pipeline_parallel >= 1
        and world_size % pipeline_parallel == 0
        and (world_size // pipeline_parallel) % (etp * expert_parallel)
    ):
        problems.append(
            f"world size {world_size} / pipeline_parallel {pipeline_parallel} is not divisible by "
            f"expert_tensor_parallel x expert_parallel = {etp} x {expert_parallel}"
        )
    return problems


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch (and Megatron's model-parallel RNG tracker).

    Follows Megatron-LM's convention: each pipeline stage offsets the seed by
    100 x its rank so that stages do not draw identical streams; tensor-parallel
    ranks get distinct dropout streams through the tracker.
    """
    from megatron.core import parallel_state, tensor_parallel

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def initialize(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    *,
    seed: int = 1234,
    backend: Optional[str] = None,
    timeout_minutes: int = 30,
    model_shape: Optional[dict] = None,
    environ: Optional[dict] = None,
    expert_parallel: int = 1,
    expert_tensor_parallel: Optional[int] = None,
) -> LaunchEnv:
    """Start torch.distributed and Megatron's parallel state; seed every RNG.

    ``model_shape`` may carry ``num_layers``, ``num_attention_heads``,
    ``num_query_groups``, ``vocab_size`` and ``num_experts`` so that a layout that cannot hold
    the model fails here, identically on every rank, before any collective.
    ``expert_parallel`` / ``expert_tensor_parallel``: Megatron's expert grid (MoE models).
    Idempotent: a second call with the same layout is a no-op.
    """
    from megatron.core import parallel_state

    launch = detect_launch_env(environ)
    validate_parallel_layout(
        launch.world_size,
        tensor_parallel,
        pipeline_parallel,
        expert_parallel=expert_parallel,
        expert_tensor_parallel=expert_tensor_parallel,
        **(model_shape or {}),
    )
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        cpu_compat.enable()
    if not torch.distributed.is_initialized():
        if use_cuda:
            torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        timeout = datetime.timedelta(minutes=timeout_minutes)
        torch.distributed.init_process_group(
            backend=backend or ("nccl" if use_cuda else "gloo"),
            store=_rendezvous_store(launch, timeout),
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
        )
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() != tensor_parallel
            or parallel_state.get_pipeline_model_parallel_world_size() != pipeline_parallel
            or parallel_state.get_expert_model_parallel_world_size() != expert_parallel
        ):
            raise ParallelLayoutError(
                "Megatron parallel state is already initialised with a different layout; call destroy() first"
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            expert_model_parallel_size=expert_parallel,
            expert_tensor_parallel_size=expert_tensor_parallel,
            distributed_timeout_minutes=timeout_minutes,
            create_gloo_process_groups=True,
        )
    set_seed(seed)
    return launch


def _rendezvous_store(launch: LaunchEnv, timeout: datetime.timedelta):
    """The store the ranks meet in. A single process without ``MASTER_PORT`` needs no port (an
    in-process store); under a launcher that serves the store (torchrun, ``spawn``) every rank is a
    client; otherwise rank 0 serves it on ``MASTER_PORT`` (srun)."""
    if launch.launcher == "single" and not launch.master_port:
        return torch.distributed.HashStore()
    store = torch.distributed.TCPStore(
        launch.master_addr,
        launch.master_port,
        launch.world_size,
        is_master=launch.rank == 0 and not launch.agent_store,
        timeout=timeout,
        wait_for_workers=False,
    )
    if not launch.agent_store:
        return store
    # the launcher's store outlives a destroy(): each start-up gets its own keys (torch restarts
    # its group names from 0 after destroy_process_group)
    return torch.distributed.PrefixStore(f"stabledrl-start{next(_AGENT_STORE_STARTS)}", store)


_AGENT_STORE_STARTS = itertools.count(1)
"""Numbers this process's process-group start-ups in a launcher's store (every rank runs the same
start-ups, so the numbers agree)."""


_GROUPS_MEGATRON_KEEPS = (
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
)
"""Megatron's (0.16) group globals that ``destroy_model_parallel`` does not reset."""


def destroy(*, collect: bool = True) -> None:
    """Tear down Megatron's parallel state and every process group; with ``collect``, free the
    groups now (a process that ends right after may skip the collection, ~0.2 s).

    A gloo group's transport runs a loop thread that wakes every 10 ms until the group is freed,
    and the groups a finished run's model and optimizer hold sit in reference cycles: uncollected,
    they live on until Python's next full collection (in a rank that ran training after training,
    150 groups, 450 threads, were seen waiting for it)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for name in _GROUPS_MEGATRON_KEEPS:
        if getattr(parallel_state, name, None) is not None:
            setattr(parallel_state, name, None)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # the default group and every group made from it
    if collect:
        gc.collect()


def is_main_rank() -> bool:
    """Rank 0 of the job (or a process that never initialised distributed)."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def comm_device() -> str:
    """Where tensors for collectives live: CUDA under NCCL, CPU under gloo."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def any_rank(flag, group=None) -> bool:
    """True on every rank if ``flag`` is True on any rank (all-reduce MAX).

    ``flag`` is a Python bool or a one-element tensor on any device (kept on the
    device: the one host sync is the final read of the reduced value).
    """
    if isinstance(flag, torch.Tensor):
        value = flag.detach().reshape(1).to(device=comm_device(), dtype=torch.float32)
    else:
        value = torch.tensor([1.0 if flag else 0.0], device=comm_device())
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(value.item() > 0)


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
