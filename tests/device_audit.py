"""Catch tensors the library creates without naming a device (the device rule, models/placement.py).

On a CPU-only machine every tensor lands on the CPU, so a phase that forgets
``device=`` passes every numerical test and fails at the first GPU forward. This
audit records, while it is active, every tensor factory call (``torch.zeros``,
``arange``, ``full``, ``tensor``, ``rand*``, ...) and every ``torch.Generator``
made *directly* by library code (the first caller frame outside torch) that
names no device, or names one other than the model's device or an explicit
``"cpu"``. ``*_like`` / ``Tensor.new_*`` calls inherit their device and are fine.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = frozenset(
    {
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "range",
        "tensor",
        "as_tensor",
        "rand",
        "randn",
        "randint",
        "randperm",
        "linspace",
        "logspace",
        "eye",
        "empty_strided",
        "scalar_tensor",
        "normal",
        "bernoulli_",
    }
)
PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stabledrl_mcore")
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
PASS_THROUGH = (TORCH_DIR, os.path.join(PACKAGE, "parallel", "cpu_compat.py"), os.path.abspath(__file__))


def _library_caller(skip: Sequence[str]) -> Optional[str]:
    """``path:line`` of the first frame outside torch / the audit, if it is library code."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(PASS_THROUGH):
        frame = frame.f_back
    if frame is None:
        return None
    path = os.path.abspath(frame.f_code.co_filename)
    if not path.startswith(PACKAGE + os.sep):
        return None
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))
    if any(rel.startswith(s) for s in skip):
        return None
    return f"{rel}:{frame.f_lineno}"


def _device_of(value) -> Optional[torch.device]:
    if value is None:
        return None
    if isinstance(value, int):
        return torch.device("cuda", value)
    return torch.device(value)


class DeviceAudit(TorchFunctionMode):
    """``with DeviceAudit(device) as audit: ...``; ``audit.findings`` lists the offending calls.

    ``skip``: library sub-paths (relative to the repository root) not audited, e.g.
    ``"stabledrl_mcore/checkpoint/"`` and ``"stabledrl_mcore/convert/"`` (host-side I/O).
    """

    def __init__(self, device, skip: Sequence[str] = ()):
        super().__init__()
        self.device = torch.device(device)
        self.skip = tuple(skip)
        self.findings: List[str] = []
        self.checked = 0

    def _check(self, what: str, device) -> None:
        where = _library_caller(self.skip)
        if where is None:
            return
        self.checked += 1
        if device is None:
            self.findings.append(f"{where}: {what} without device=")
        elif device != self.device and device != torch.device("cpu"):
            self.findings.append(f"{where}: {what} on {device}, the model is on {self.device}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in FACTORIES and "Tensor" not in getattr(func, "__qualname__", ""):
            self._check(f"torch.{func.__name__}", _device_of(kwargs.get("device")))
        return func(*args, **kwargs)

    def __enter__(self):
        real = torch.Generator
        audit = self

        class _Meta(type):
            def __instancecheck__(cls, obj):
                return isinstance(obj, real)

        class Generator(metaclass=_Meta):
            def __new__(cls, device=None):
                audit._check("torch.Generator", _device_of(device))
                return real() if device is None else real(device=device)

        self._real_generator = real
        torch.Generator = Generator
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Generator = self._real_generator
        return super().__exit__(*exc)
