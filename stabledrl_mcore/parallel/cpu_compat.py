"""Make megatron-core 0.16 run on a CPU-only machine (tests, CI, the tiny demo).

megatron-core has no device abstraction: it calls ``torch.cuda.current_device()``,
``torch.cuda.synchronize()``, builds tensors with ``device="cuda"``, keeps its
RNG tracker on the CUDA generator and asserts ``tensor.type()`` strings such as
``'torch.cuda.FloatTensor'`` (``optimizer/clip_grads.py``, ``optimizer/optimizer.py``).
``tests/test_cpu_compat.py`` checks each redirection and that none is installed with CUDA.

:func:`enable` redirects exactly those entry points to the CPU, once, *before*
any Megatron object is built, and only when CUDA is unavailable. On a machine
with CUDA it does nothing at all (``tests/test_cpu_compat.py`` checks this), so
the GPU path is megatron-core as shipped.

Redirected:
- ``torch.cuda.current_device`` -> ``"cpu"``; ``torch.cuda.synchronize`` -> no-op;
- the ``device=`` keyword of the tensor factories: ``"cuda"``/``"cuda:N"`` -> CPU;
- ``Tensor.cuda()`` -> the tensor itself;
- ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` -> a stream whose waits are no-ops
  (Megatron's all-to-all MoE token dispatcher copies split sizes on a side stream), and that
  dispatcher's split sizes become numpy arrays as its CUDA path makes them;
- ``torch.distributed.all_gather`` / ``reduce_scatter`` of uneven sizes (NCCL takes them, gloo does
  not; Megatron's MoE dispatcher sends them at expert-tensor-parallel > 1) -> padded / all-reduced;
- ``Tensor.type()`` (no argument) reports CPU tensors under their CUDA names,
  which is what Megatron's optimizer and grad-clip asserts compare against;
- the CUDA RNG API used by Megatron's RNG tracker and activation recompute
  (``torch.cuda.{get,set}_rng_state``, ``manual_seed``, and
  ``tensor_parallel.random._{get,set}_cuda_rng_state``) -> the CPU generator,
  so tensor-parallel-rank-specific dropout streams and recompute stay correct.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Dict, List, Tuple

import torch

_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "linspace",
    "rand",
    "randn",
    "randint",
    "randperm",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "eye",
)

_lock = threading.Lock()
_active = False
# (owner, attribute name, original value) for every patch, so that tests can undo them.
_saved: List[Tuple[Any, str, Any]] = []


def is_active() -> bool:
    """True when the CPU redirection is installed in this process."""
    return _active


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _cpu_device_kwarg(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    wrapper.__stabledrl_cpu_compat__ = True  # type: ignore[attr-defined]
    return wrapper


def _tensor_type(original: Callable) -> Callable:
    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if (
            not args
            and not kwargs
            and isinstance(result, str)
            and self.device.type == "cpu"
            and not result.startswith("torch.cuda.")
        ):  # a TorchFunctionMode may call us twice
            return result.replace("torch.", "torch.cuda.", 1)
        return result

    return type_


def _patch(owner: Any, name: str, value: Any) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def enable(force: bool = False) -> bool:
    """Install the CPU redirection if CUDA is unavailable (or ``force``).

    Returns whether the layer is active afterwards. Idempotent and thread-safe.
    """
    global _active
    with _lock:
        if _active:
            return True
        if torch.cuda.is_available() and not force:
            return False
        for name in _FACTORIES:
            _patch(torch, name, _cpu_device_kwarg(getattr(torch, name)))
        _patch(torch.Tensor, "to", _tensor_to(torch.Tensor.to))
        _patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
        _patch(torch.Tensor, "type", _tensor_type(torch.Tensor.type))
        _patch(torch.cuda, "current_device", lambda: "cpu")
        _patch(torch.cuda, "synchronize", lambda *a, **k: None)
        _patch(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
        _patch(torch.cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
        _patch(torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(seed))
        _patch(torch.cuda, "manual_seed_all", lambda seed: None)  # torch.manual_seed calls it
        _patch(torch.cuda, "empty_cache", lambda: None)
        # Megatron's all-to-all MoE dispatcher copies its split sizes on a side stream
        _patch(torch.cuda, "Stream", _CPUStream)
        _patch(torch.cuda, "current_stream", lambda *a, **k: _CPU_STREAM)
        _patch(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
        _patch(torch.distributed, "all_gather", _uneven_all_gather(torch.distributed.all_gather))
        _patch(torch.distributed, "reduce_scatter", _uneven_reduce_scatter(torch.distributed.reduce_scatter))
        from megatron.core.transformer.moe import token_dispatcher

        _patch(
            token_dispatcher, "maybe_move_tensor_to_cpu", _host_split_sizes(token_dispatcher.maybe_move_tensor_to_cpu)
        )
        from megatron.core.tensor_parallel import random as mpu_random

        _patch(mpu_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
        _patch(mpu_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
        _active = True
        return True


class _CPUEvent:
    """A recorded point on :class:`_CPUStream`: CPU work is already complete."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True


class _CPUStream:
    """``torch.cuda.Stream`` stand-in: CPU ops run in program order, so every wait is a no-op."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> _CPUEvent:
        return event or _CPUEvent()

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CPUStream()


def _uneven_all_gather(original: Callable) -> Callable:
    """gloo's all-gather takes equal sizes only (NCCL takes uneven ones, which Megatron's MoE
    dispatcher sends at expert-tensor-parallel > 1): uneven first dims are padded, gathered, trimmed."""

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.shape[0] if t.dim() else 1 for t in tensor_list]
        if async_op or tensor.dim() == 0 or len(set(sizes)) == 1:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(sizes)
        padded = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        original(gathered, padded, group=group)
        for out, part, size in zip(tensor_list, gathered, sizes):
            out.copy_(part[:size])
        return None

    return all_gather


def _uneven_reduce_scatter(original: Callable) -> Callable:
    """gloo has no uneven reduce-scatter: an all-reduce of the whole input, this rank's part kept."""

    @functools.wraps(original)
    def reduce_scatter(output, input_list, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if async_op or len({t.shape for t in input_list}) == 1:  # gloo reduce-scatters equal sizes
            return original(output, input_list, op=op, group=group, async_op=async_op)
        whole = torch.cat([t.flatten() for t in input_list])
        torch.distributed.all_reduce(whole, op=op, group=group)
        rank = torch.distributed.get_rank(group)
        start = sum(t.numel() for t in input_list[:rank])
        output.copy_(whole[start : start + output.numel()].view(output.shape))
        return None

    return reduce_scatter


def _host_split_sizes(original: Callable) -> Callable:
    """Megatron's ``maybe_move_tensor_to_cpu`` turns a CUDA tensor into the numpy split sizes the
    all-to-all takes (``as_numpy``) but leaves a CPU tensor as it is, which ``all_to_all_single``
    refuses: CPU tensors get the numpy conversion too."""

    @functools.wraps(original)
    def move(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move


def _tensor_to(original: Callable) -> Callable:
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            args = ("cpu",) + args[1:]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        return original(self, *args, **kwargs)

    return to


def disable() -> None:
    """Undo :func:`enable` (for tests)."""
    global _active
    with _lock:
        while _saved:
            owner, name, value = _saved.pop()
            setattr(owner, name, value)
        _active = False


def patched_names() -> Dict[str, bool]:
    """Which torch factory functions are currently redirected (diagnostics)."""
    return {n: getattr(getattr(torch, n), "__stabledrl_cpu_compat__", False) for n in _FACTORIES}
