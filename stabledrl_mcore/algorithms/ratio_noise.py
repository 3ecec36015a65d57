"""Ratio-noise stress switch (Zhong et al. 2026, Sec. "stress test").

The paper injects artificially explosive importance weights to show that
GRPO-style losses collapse while StableDRL does not. We reproduce this by
multiplying every estimated ratio rho_i by a heavy-tailed factor exp(n_i):

    log rho_i  ->  log rho_i + n_i,     n_i ~ sigma * N(0, 1)      ("lognormal")
                                        n_i ~ sigma * t_dof        ("student_t")

The noise has location 0 on the log scale (the multiplicative factor has
median 1), is drawn from the caller's own ``torch.Generator`` (never the
global RNG) and is always detached: it perturbs the ratio, not the gradient
path. ``sequence_policy_loss(..., ratio_noise=RatioNoise(...),
noise_generator=g)`` applies it by shifting ``old_logp`` by ``-n``, so every
loss sees the same noisy ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

NOISE_KINDS = ("lognormal", "student_t")


@dataclass(frozen=True)
class RatioNoise:
    """Configuration of the multiplicative ratio noise.

    kind:  "lognormal" (Gaussian noise on the log-ratio) or "student_t"
           (Student-t noise on the log-ratio, heavier tails for small dof).
    sigma: scale of the noise on the log-ratio (>= 0; 0 disables it).
    dof:   degrees of freedom of the Student-t (> 0); ignored for lognormal.
    """

    kind: str = "lognormal"
    sigma: float = 1.0
    dof: float = 3.0

    def __post_init__(self) -> None:
        if self.kind not in NOISE_KINDS:
            raise ValueError(f"unknown ratio-noise kind {self.kind!r}; valid: {', '.join(NOISE_KINDS)}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"ratio-noise sigma must be finite and >= 0, got {self.sigma}")
        if not (math.isfinite(self.dof) and self.dof > 0):
            raise ValueError(f"ratio-noise dof must be finite and > 0, got {self.dof}")

    def sample(
        self,
        shape: torch.Size | tuple[int, ...],
        *,
        generator: torch.Generator,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        """Draw log-ratio noise n of ``shape`` from ``generator`` (see module docstring)."""
        return sample_log_ratio_noise(
            shape, kind=self.kind, sigma=self.sigma, dof=self.dof, generator=generator, device=device, dtype=dtype
        )


def sample_log_ratio_noise(
    shape: torch.Size | tuple[int, ...],
    *,
    kind: str = "lognormal",
    sigma: float = 1.0,
    dof: float = 3.0,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Zero-location noise on the log-ratio, drawn in float64 on the generator's device.

    lognormal: n = sigma * z, z ~ N(0, 1).
    student_t: n = sigma * z / sqrt(g / dof), g ~ chi2(dof) = 2 * Gamma(dof / 2).
    The draw depends only on (shape, kind, sigma, dof, generator state), never
    on the global RNG or on the output dtype/device.
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError("ratio noise needs its own torch.Generator (the global RNG is never used)")
    RatioNoise(kind, sigma, dof)  # validates the arguments
    gen_device = generator.device
    z = torch.randn(shape, generator=generator, device=gen_device, dtype=torch.float64)
    if kind == "student_t":
        alpha = torch.full(z.shape, dof / 2.0, device=gen_device, dtype=torch.float64)
        chi2 = 2.0 * torch._standard_gamma(alpha, generator=generator)
        z = z / torch.sqrt(chi2.clamp_min(torch.finfo(torch.float64).tiny) / dof)
    noise = sigma * z
    return noise.to(device=device if device is not None else gen_device, dtype=dtype)


def perturb_log_ratio(
    log_ratio: Tensor, *, kind: str = "lognormal", sigma: float = 1.0, dof: float = 3.0, generator: torch.Generator
) -> Tensor:
    """Return ``log_ratio + n`` with n detached noise (i.e. rho -> rho * exp(n)).

    Gradients of the result with respect to ``log_ratio`` are the identity.
    """
    noise = sample_log_ratio_noise(
        log_ratio.shape,
        kind=kind,
        sigma=sigma,
        dof=dof,
        generator=generator,
        device=log_ratio.device,
        dtype=log_ratio.dtype,
    )
    return log_ratio + noise
