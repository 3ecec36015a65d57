"""The forward (noising) process of masked diffusion, with explicit generators.

Two equivalent ways to corrupt the L maskable (completion) tokens of a sequence:

- **ratio** (LLaDA pre-training): draw t ~ U(0, 1), set p = (1 - eps) t + eps and
  mask each token independently with probability p; the ELBO weight is 1/p.
- **count** (LLaDA ``get_log_likelihood.py``): draw l ~ U{1..L} and mask exactly
  l tokens chosen uniformly; the ELBO weight is L/l. Both have the same
  expectation (for eps = 0): sum_l (1/l) E[sum of masked log-probs | l masked].

Variance reduction (LLaDA-1.5 / ESPO / DiffuCoder):

- *stratified* draws: one uniform offset u, t_j = (u + j/N) mod 1 over all N draws
  of a call (draw m of row b is j = m*B + b), so each t_j is marginally U(0, 1)
  (every single estimate stays unbiased) while the draws of one row are
  stratified across the num_mc masks (and, with num_mc = 1, across the batch);
- *coupled* complementary masks (DiffuCoder's coupled sampling): a draw and its
  complement partition the maskable tokens, so each token is scored exactly once
  per pair (antithetic in the noise level too). Ratio mode: p = eps + (1 - 2 eps) t
  and the complement has probability 1 - p, so both are U[eps, 1 - eps] with
  bounded weights 1/p, 1/(1 - p), each draw unbiased on its own. Count mode:
  l ~ U{1..L}, weights L/l and L/(L - l) for the complement, except that at
  l = L (empty complement) the primary gets weight 2; the *pair mean* is then
  exactly unbiased for the ELBO (coefficient of every count k is 1/k).

Every random draw takes an explicit ``torch.Generator`` (drawn on its device,
then moved); nothing here touches the global RNG. A :class:`MaskPlan` stores
the masks as tensors, so the same corruption can be replayed for the current
and the old policy (antithetic sharing, LLaDA-1.5 VRPO).

Named schemes over a batch's regions (prompt / completion / post-EOS), SPG's
``block_random`` among them, and the post-EOS policies: :mod:`.mask_schemes`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

MODES = ("count", "ratio", "full")


def _require_generator(generator: Optional[torch.Generator], what: str) -> torch.Generator:
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"{what} needs an explicit torch.Generator (got {type(generator).__name__})")
    return generator


def uniform(shape: Sequence[int], generator: torch.Generator, device=None, dtype=torch.float32) -> Tensor:
    """U[0, 1) draws made on ``generator``'s device, then moved to ``device``."""
    _require_generator(generator, "uniform")
    out = torch.rand(tuple(shape), generator=generator, device=generator.device, dtype=dtype)
    return out if device is None else out.to(device)


def stratified_uniform(
    shape: Union[int, Sequence[int]], *, generator: torch.Generator, stratified: bool = True, device=None
) -> Tensor:
    """U[0, 1) draws; if ``stratified``, t_j = (u + j/N) mod 1 over the flattened shape."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = 1
    for s in shape:
        n *= s
    if not stratified:
        return uniform(shape, generator, device, torch.float64).clamp(max=1.0 - 2.0**-24).float()
    u = uniform((1,), generator, device, torch.float64)
    grid = torch.arange(n, dtype=torch.float64, device=u.device) / max(n, 1)
    t = torch.remainder(u + grid, 1.0).clamp(max=1.0 - 2.0**-24)  # stays < 1 in float32
    return t.float().reshape(shape)


def sample_mask_ratios(
    batch: Union[int, Sequence[int]],
    *,
    generator: torch.Generator,
    stratified: bool = True,
    eps: float = 1e-3,
    device=None,
) -> Tensor:
    """Mask probabilities p = (1 - eps) t + eps with t ~ U(0, 1) (stratified over all draws)."""
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    t = stratified_uniform(batch, generator=generator, stratified=stratified, device=device)
    return (1.0 - eps) * t + eps


def stratified_mask_counts(
    lengths: Tensor, num_mc: int, *, generator: torch.Generator, stratified: bool = True, include_zero: bool = False
) -> Tensor:
    """Exact mask counts ``[num_mc, *lengths.shape]``, each marginally U{1..L} (or U{0..L}).

    Stratified over the num_mc draws of each row as in LLaDA's likelihood evaluation.
    Rows with L = 0 get count 0.
    """
    lengths = lengths.long()
    u = stratified_uniform(
        (num_mc, *lengths.shape), generator=generator, stratified=stratified, device=lengths.device
    ).double()
    L = lengths.unsqueeze(0).double()
    if include_zero:
        counts = torch.floor(u * (L + 1)).clamp(max=L)
    else:
        counts = (1 + torch.floor(u * L)).clamp(max=L)
    return counts.long()


def mask_exact_counts(maskable: Tensor, counts: Tensor, *, generator: torch.Generator) -> Tensor:
    """Mask exactly ``counts[...]`` positions, uniformly among ``maskable`` (last dim)."""
    scores = uniform(maskable.shape, generator, maskable.device)
    scores = scores.masked_fill(~maskable.bool(), 2.0)  # unmaskable positions sort last
    rank = scores.argsort(dim=-1).argsort(dim=-1)
    return (rank < counts.unsqueeze(-1)) & maskable.bool()


def mask_completion(
    ids: Tensor, completion_mask: Tensor, ratios: Tensor, mask_id: int, *, generator: torch.Generator
) -> Tuple[Tensor, Tensor]:
    """Mask each completion token independently with probability ``ratios`` ([B] or [B, S]).

    Returns ``(noisy_ids, masked)``; prompt tokens are never masked here.
    """
    p = ratios if ratios.dim() == ids.dim() else ratios.unsqueeze(-1)
    masked = completion_mask.bool() & (uniform(ids.shape, generator, ids.device) < p)
    return ids.masked_fill(masked, mask_id), masked


def complementary_mask(masked: Tensor, completion_mask: Tensor) -> Tensor:
    """The coupled mask: maskable tokens that ``masked`` left clean."""
    return completion_mask.bool() & ~masked.bool()


def prompt_mask(prompt_region: Tensor, prob: float, *, generator: torch.Generator) -> Tensor:
    """Mask prompt tokens independently with probability ``prob`` (d1 uses 0.15)."""
    if prob <= 0.0:
        return torch.zeros_like(prompt_region, dtype=torch.bool)
    return prompt_region.bool() & (uniform(prompt_region.shape, generator, prompt_region.device) < prob)


@dataclass(frozen=True)
class MaskPlan:
    """A replayable set of ``M`` corruptions of a ``[B, S]`` batch.

    masked: ``[M, B, S]`` bool, every position replaced by the mask token
        (completion masks and any prompt masks);
    weight: ``[M, B, S]`` float, the ELBO weight of each scored position
        (1/p, L/l, ...), zero where the position is not scored;
    ratio: ``[M, B, G]`` float, the mask fraction of each draw and segment
        (p in ratio mode, count/L in count mode, 1 in full mode);
    mode, coupled, block_size: how it was drawn (``block_size`` None = one segment).
    """

    masked: Tensor
    weight: Tensor
    ratio: Tensor
    mode: str
    coupled: bool = False
    block_size: Optional[int] = None

    @property
    def num_mc(self) -> int:
        return self.masked.shape[0]

    @property
    def scored(self) -> Tensor:
        return self.weight != 0

    def noisy(self, ids: Tensor, mask_id: int) -> Tensor:
        """``[M, B, S]`` corrupted copies of ``ids``."""
        self.check(ids)
        return ids.unsqueeze(0).masked_fill(self.masked, mask_id)

    def check(self, ids: Tensor) -> None:
        if tuple(self.masked.shape[1:]) != tuple(ids.shape):
            raise ValueError(f"mask plan is for shape {tuple(self.masked.shape[1:])}, ids are {tuple(ids.shape)}")

    def to(self, device) -> "MaskPlan":
        return replace(self, masked=self.masked.to(device), weight=self.weight.to(device), ratio=self.ratio.to(device))


def _segments(x: Tensor, block_size: Optional[int]) -> Tuple[Tensor, int]:
    """[..., S] -> [..., G, bs] (zero-padded) and the original length."""
    S = x.shape[-1]
    bs = S if block_size is None else block_size
    G = -(-S // bs)
    pad = G * bs - S
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], G, bs), S


def build_plan(
    completion_mask: Tensor,
    *,
    num_mc: int,
    generator: torch.Generator,
    mode: str = "count",
    coupled: bool = False,
    eps: float = 1e-3,
    stratified: bool = True,
    block_size: Optional[int] = None,
    prompt_mask_prob: float = 0.0,
    prompt_region: Optional[Tensor] = None,
    one_ratio_per_sequence: bool = False,
) -> MaskPlan:
    """Draw ``num_mc`` corruptions of the completion positions (``[B, S]`` bool).

    mode ``"count"``/``"ratio"`` as in the module docstring; ``"full"`` masks the
    whole completion with weight 1 (d1's one-step mean-field estimate).
    ``block_size`` draws an independent ratio/count per block of that size (the
    block-diffusion ELBO); ``coupled`` needs an even ``num_mc`` (num_mc/2 pairs,
    so cost comparisons stay fair). ``prompt_mask_prob`` additionally masks
    positions of ``prompt_region`` (default: not completion) without scoring them.
    ``one_ratio_per_sequence`` (``"ratio"`` mode with ``block_size``) draws one t per sequence for
    all its blocks, as SDAR's own training objective does (``modeling_sdar.py``), instead of one per
    block; each block term stays unbiased (its mask is still Bernoulli(p) given t).
    """
    if one_ratio_per_sequence and mode != "ratio":
        raise ValueError(f"one_ratio_per_sequence needs mode 'ratio' (a mask probability), got {mode!r}")
    if mode not in MODES:
        raise ValueError(f"unknown mask mode {mode!r}; choose from {MODES}")
    if num_mc < 1:
        raise ValueError(f"num_mc must be >= 1, got {num_mc}")
    if coupled and (mode == "full" or num_mc % 2):
        raise ValueError("coupled masks need mode 'count' or 'ratio' and an even num_mc (pairs)")
    _require_generator(generator, "build_plan")
    comp = completion_mask.bool()
    B, S = comp.shape
    seg, _ = _segments(comp, block_size)  # [B, G, bs]
    G = seg.shape[1]
    L = seg.sum(-1)  # [B, G]
    n_primary = num_mc // 2 if coupled else num_mc
    maskable = seg.unsqueeze(0).expand(n_primary, B, G, seg.shape[-1])
    Lf = L.unsqueeze(0).float()
    if mode == "full":
        masked = maskable.clone()
        weight = torch.ones(masked.shape[:-1], device=comp.device)
        ratio = torch.ones_like(weight)
        parts = [(masked, weight, ratio)]
    elif mode == "ratio":
        if not 0.0 <= eps < 0.5:
            raise ValueError(f"eps must be in [0, 0.5), got {eps}")
        t_shape = (n_primary, B, 1) if one_ratio_per_sequence else (n_primary, B, G)
        t = stratified_uniform(t_shape, generator=generator, stratified=stratified, device=comp.device)
        t = t.expand(n_primary, B, G)
        # coupled: p = eps + (1 - 2 eps) t keeps both p and 1 - p >= eps (bounded weights)
        p = eps + (1.0 - (2.0 if coupled else 1.0) * eps) * t
        masked = maskable & (uniform(maskable.shape, generator, comp.device) < p.unsqueeze(-1))
        parts = [(masked, 1.0 / p, p)]
        if coupled:
            parts.append((maskable & ~masked, 1.0 / (1.0 - p), 1.0 - p))
    else:
        counts = stratified_mask_counts(L, n_primary, generator=generator, stratified=stratified)
        masked = mask_exact_counts(maskable, counts, generator=generator)
        cf = counts.float()
        w = torch.where(cf > 0, Lf / cf.clamp(min=1), 0.0)
        if coupled:  # pair weights: L/l and L/(L-l); at l = L the lone primary carries weight 2
            rest = Lf - cf
            w_rest = torch.where(rest > 0, Lf / rest.clamp(min=1), 0.0)
            w = torch.where((rest == 0) & (cf > 0), torch.full_like(w, 2.0), w)
        parts = [(masked, w, cf / Lf.clamp(min=1))]
        if coupled:
            parts.append((maskable & ~masked, w_rest, rest / Lf.clamp(min=1)))
    # interleave pairs: draw 2k is a primary mask, draw 2k+1 its complement
    masked = torch.stack([m for m, _, _ in parts], 1).flatten(0, 1)
    wseg = torch.stack([w for _, w, _ in parts], 1).flatten(0, 1)
    ratio = torch.stack([r for _, _, r in parts], 1).flatten(0, 1).float()
    weight = torch.where(masked, wseg.unsqueeze(-1), 0.0).flatten(-2)[..., :S]  # no 0 * inf
    masked = masked.flatten(-2)[..., :S]
    if prompt_mask_prob > 0.0:
        region = ~comp if prompt_region is None else prompt_region.bool()
        extra = prompt_mask(region.unsqueeze(0).expand(num_mc, B, S), prompt_mask_prob, generator=generator)
        masked = masked | extra
    return MaskPlan(
        masked=masked, weight=weight.float(), ratio=ratio, mode=mode, coupled=coupled, block_size=block_size
    )
