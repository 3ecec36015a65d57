"""The CPU layer redirects Megatron's CUDA calls on CPU and changes nothing with CUDA."""

import pytest
import torch

from stabledrl_mcore.parallel import cpu_compat


@pytest.fixture
def clean_layer():
    was_active = cpu_compat.is_active()
    cpu_compat.disable()
    yield
    cpu_compat.disable()
    if was_active:
        cpu_compat.enable()


def _snapshot():
    from megatron.core.tensor_parallel import random as mpu_random

    names = list(cpu_compat._FACTORIES)
    funcs = {f"torch.{n}": getattr(torch, n) for n in names}
    funcs.update(
        {
            f"torch.cuda.{n}": getattr(torch.cuda, n)
            for n in (
                "current_device",
                "synchronize",
                "get_rng_state",
                "set_rng_state",
                "manual_seed",
                "manual_seed_all",
                "empty_cache",
            )
        }
    )
    funcs.update({f"Tensor.{n}": getattr(torch.Tensor, n) for n in ("to", "cuda", "type")})
    funcs.update({f"mpu.{n}": getattr(mpu_random, n) for n in ("_get_cuda_rng_state", "_set_cuda_rng_state")})
    return funcs


def test_noop_when_cuda_is_available(clean_layer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = _snapshot()
    assert cpu_compat.enable() is False
    assert not cpu_compat.is_active()
    after = _snapshot()
    changed = [name for name in before if before[name] is not after[name]]
    assert changed == []


def test_redirects_cuda_calls_on_cpu(clean_layer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cpu_compat.enable() is True and cpu_compat.is_active()
    assert all(cpu_compat.patched_names().values())
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
    torch.cuda.synchronize()
    t = torch.ones(2)
    assert t.cuda() is t and t.to("cuda").device.type == "cpu"
    assert t.type() == "torch.cuda.FloatTensor" and t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert t.type(torch.float64).dtype == torch.float64
    # RNG tracker state lives on the CPU generator and round-trips.
    state = torch.cuda.get_rng_state()
    a = torch.rand(3)
    torch.cuda.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))


def test_megatron_rng_tracker_forks_on_cpu(clean_layer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_compat.enable()
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 99)
    torch.manual_seed(0)
    outside_before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside_before), "fork must restore the default stream"
    with tracker.fork():
        second = torch.rand(4)
    assert not torch.equal(first, second), "the tracked stream must advance"
    torch.manual_seed(99)
    assert torch.equal(first, torch.rand(4))
    tracker.reset()


def test_disable_restores_everything(clean_layer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = _snapshot()
    cpu_compat.enable()
    cpu_compat.disable()
    after = _snapshot()
    assert [n for n in before if before[n] is not after[n]] == []
