"""The targets of :data:`.check_parts.PARTS`: each takes the check's
:class:`~.check_parts.PartOptions` and runs one check at the mode's sizes (:mod:`.check_sizes`)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict

import torch

from stabledrl_mcore.bench.check_parts import PartOptions
from stabledrl_mcore.bench.check_sizes import CPU, GPU, Sizes
from stabledrl_mcore.bench.kernel_checks import (
    check_flex_vs_sdpa,
    check_moe_layer,
    check_staircase_memory,
    check_te_vs_local,
)
from stabledrl_mcore.bench.peak import _cpu_name
from stabledrl_mcore.bench.rollout_checks import check_rollout, check_te_vs_local_decode
from stabledrl_mcore.bench.workload_checks import check_recipe_step, check_train
from stabledrl_mcore.parallel import bootstrap


@contextlib.contextmanager
def _megatron():
    """Megatron's state of one rank (seeded) around a part, torn down after it, as the checks expect."""
    torch.manual_seed(0)
    bootstrap.initialize(1, 1, seed=0)
    try:
        yield
    finally:
        bootstrap.destroy()


def _part(fn: Callable[[PartOptions], Dict[str, Any]]) -> Callable[[PartOptions], Dict[str, Any]]:
    """A target: ``fn`` inside :func:`_megatron`, its result tagged with the device it ran on."""

    @functools.wraps(fn)
    def target(o: PartOptions) -> Dict[str, Any]:
        with _megatron():
            result = fn(o)
        result.setdefault("device", torch.cuda.get_device_name() if torch.cuda.is_available() else _cpu_name())
        return result

    return target


def _sizes(o: PartOptions) -> Sizes:
    return CPU if o.cpu else GPU


def _rollout(arch: str, o: PartOptions) -> Dict[str, Any]:
    return check_rollout(arch, _sizes(o), layers=o.layers, backend=o.backend, rows=o.rows)


@_part
def rollout_llada(o: PartOptions) -> Dict[str, Any]:
    return _rollout("llada", o)


@_part
def rollout_sdar(o: PartOptions) -> Dict[str, Any]:
    return _rollout("sdar", o)


def _recipe_step(arch: str, o: PartOptions) -> Dict[str, Any]:
    return check_recipe_step(arch, _sizes(o), o.workdir, o.cpu)


@_part
def recipe_step_llada(o: PartOptions) -> Dict[str, Any]:
    return _recipe_step("llada", o)


@_part
def recipe_step_sdar(o: PartOptions) -> Dict[str, Any]:
    return _recipe_step("sdar", o)


@_part
def te_vs_local_decode(o: PartOptions) -> Dict[str, Any]:
    return check_te_vs_local_decode(_sizes(o))


@_part
def te_vs_local(o: PartOptions) -> Dict[str, Any]:
    return check_te_vs_local(_sizes(o))


@_part
def flex_vs_sdpa(o: PartOptions) -> Dict[str, Any]:
    return check_flex_vs_sdpa(_sizes(o), o.cpu)


@_part
def staircase_memory(o: PartOptions) -> Dict[str, Any]:
    return check_staircase_memory(_sizes(o), o.cpu)


@_part
def moe_layer(o: PartOptions) -> Dict[str, Any]:
    return check_moe_layer(_sizes(o), o.cpu)


def _train(arch: str, o: PartOptions) -> Dict[str, Any]:
    return check_train(arch, _sizes(o), o.workdir, o.cpu)


@_part
def train_llada(o: PartOptions) -> Dict[str, Any]:
    return _train("llada", o)


@_part
def train_sdar(o: PartOptions) -> Dict[str, Any]:
    return _train("sdar", o)
