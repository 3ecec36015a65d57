"""Named mask schemes: which positions of a batch are corrupted, and which are scored.

A scheme maps the regions of a batch (:class:`MaskRegions`) to a
:class:`~.masking.MaskPlan` of ``num_mc`` corruptions. The weights are chosen so
the existing reductions (:func:`~.likelihood.elbo_from_draws`,
:func:`~.likelihood.eubo_from_draws`) give each scheme's estimator:

- ``uniform``: :func:`~.masking.build_plan`'s count (L/l) or ratio (1/p) scheme
  over the completion (LLaDA; coupled / stratified / block-wise options kept),
  prompt positions optionally masked with ``prefix_mask_prob`` (never scored);
- ``block_random``: SPG's ``forward_type="block_random"`` (StableDRL release).
  The completion is cut into blocks of ``block_length``; a block index
  ``k = u mod nc`` with ``u ~ U{0..nb-1}`` (nb blocks in the generated region,
  nc blocks holding completion tokens) is drawn per row and draw; inside block k
  ``c ~ U{1..m}`` of its m completion positions are masked uniformly; every
  completion position after block k is masked; every prompt / completion
  position before it is masked independently with ``prefix_mask_prob``.
  Scored: the masked completion positions (earlier blocks included, prompt
  never), weight ``L / n`` (n = scored count of the draw, L = completion
  length), so the length-normalised ELBO is the per-draw *mean* of log p over
  the scored positions and the EUBO's 1/t is SPG's empirical ``L / n``;
- ``full``: d1's mean-field estimate: the whole completion masked, weight 1,
  prompt positions masked with ``prefix_mask_prob`` (d1: 0.15), not scored.

Positions generated after the first EOS follow a policy (``post_eos=``):
``"visible"`` (kept clean and unscored; the project's behaviour so far),
``"mask_and_skip"`` (masked in every draw, never scored: the release's
``~completion_mask`` term) or ``"score"`` (treated as completion tokens: the
scheme sees ``completion | post_eos``). With ``"score"`` the ELBO/EUBO must be
length-normalised by ``regions.with_post_eos("score").completion``; use
:meth:`MaskRegions.scored_region` for the ``completion_mask`` argument.

Every random draw uses the explicit generator; all tensors stay on the
inputs' device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from stabledrl_mcore.common.registry import Registry
from stabledrl_mcore.diffusion.masking import (
    MaskPlan,
    _require_generator,
    build_plan,
    mask_exact_counts,
    prompt_mask,
    uniform,
)

POST_EOS_POLICIES = ("visible", "mask_and_skip", "score")


def _check_policy(policy: str) -> str:
    if policy not in POST_EOS_POLICIES:
        raise ValueError(f"unknown post-EOS policy {policy!r}; choose from {POST_EOS_POLICIES}")
    return policy


@dataclass(frozen=True, eq=False)
class MaskRegions:
    """The regions of a ``[B, S]`` batch that a mask scheme needs (all bool, disjoint).

    completion: the scored candidates: generated tokens up to and including the first EOS;
    prompt: valid prompt positions (left padding excluded), maskable as conditioning noise;
    post_eos: generated positions after the first EOS.
    Positions in none of them (padding) are never masked.
    """

    completion: Tensor
    prompt: Tensor
    post_eos: Tensor

    def __post_init__(self):
        shape = tuple(self.completion.shape)
        if len(shape) != 2:
            raise ValueError(f"regions must be [B, S], got completion of shape {shape}")
        for name in ("completion", "prompt", "post_eos"):
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"region {name} has shape {tuple(t.shape)}, completion has {shape}")
            if t.dtype != torch.bool:
                object.__setattr__(self, name, t.bool())
        if ((self.completion & self.prompt) | (self.completion & self.post_eos) | (self.prompt & self.post_eos)).any():
            raise ValueError("completion, prompt and post_eos regions must be disjoint")

    @classmethod
    def _disjoint(cls, completion: Tensor, prompt: Tensor, post_eos: Tensor) -> "MaskRegions":
        """Regions disjoint by construction (bool, one shape): no check, so no host read."""
        regions = object.__new__(cls)
        for name, t in (("completion", completion), ("prompt", prompt), ("post_eos", post_eos)):
            object.__setattr__(regions, name, t)
        return regions

    @classmethod
    def of(
        cls, completion: Tensor, prompt: Optional[Tensor] = None, post_eos: Optional[Tensor] = None
    ) -> "MaskRegions":
        """Regions from a completion mask; missing regions are empty."""
        completion = completion.bool()
        empty = torch.zeros_like(completion)
        return cls(
            completion, empty if prompt is None else prompt.bool(), empty if post_eos is None else post_eos.bool()
        )

    @classmethod
    def from_batch(
        cls,
        sequences: Tensor,
        prompt_len: int,
        *,
        completion_mask: Optional[Tensor] = None,
        prompt_valid: Optional[Tensor] = None,
        eos_id: Optional[int] = None,
    ) -> "MaskRegions":
        """Regions of ``sequences [B, S]`` = (left-padded) prompt of width ``prompt_len``, then generation.

        ``completion_mask`` ([B, S], or [B, S - prompt_len] over the generation) marks the
        tokens up to and including the first EOS; without it, it is derived from ``eos_id``
        (all generated tokens when a row has no EOS). ``prompt_valid`` ([B, prompt_len] or
        [B, S], as :class:`~stabledrl_mcore.rl.rollout.RolloutBatch` keeps it) excludes left
        padding from the prompt. Generated positions outside the completion are post-EOS.
        """
        B, S = sequences.shape
        P = int(prompt_len)
        if not 0 <= P <= S:
            raise ValueError(f"prompt_len {P} outside [0, {S}]")
        device = sequences.device
        generated = torch.zeros(B, S, dtype=torch.bool, device=device)
        generated[:, P:] = True
        if completion_mask is None:
            if eos_id is None:
                raise TypeError("pass completion_mask or eos_id")
            is_eos = sequences[:, P:] == int(eos_id)
            after_first = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
            completion = torch.zeros_like(generated)
            completion[:, P:] = ~after_first
        else:
            cm = completion_mask.bool().to(device)
            if tuple(cm.shape) == (B, S - P) and S - P != S:
                completion = torch.zeros_like(generated)
                completion[:, P:] = cm
            elif tuple(cm.shape) == (B, S):
                completion = cm
                if (completion & ~generated).any():
                    raise ValueError("completion_mask marks prompt positions")
            else:
                raise ValueError(f"completion_mask of shape {tuple(cm.shape)} fits neither {(B, S)} nor {(B, S - P)}")
        prompt = ~generated
        if prompt_valid is not None:
            pv = prompt_valid.bool().to(device)
            if pv.shape[-1] == S:
                pv = pv[:, :P]
            if tuple(pv.shape) != (B, P):
                raise ValueError(
                    f"prompt_valid of shape {tuple(prompt_valid.shape)} fits neither {(B, P)} nor {(B, S)}"
                )
            prompt = prompt.clone()
            prompt[:, :P] = pv
        return cls._disjoint(completion, prompt, generated & ~completion)  # prompt = not generated

    def with_post_eos(self, policy: str) -> "MaskRegions":
        """The regions a scheme sees under ``policy`` (``score``: post-EOS joins the completion)."""
        if _check_policy(policy) == "score":
            return MaskRegions._disjoint(self.completion | self.post_eos, self.prompt, torch.zeros_like(self.post_eos))
        return self

    def scored_region(self, policy: str = "visible") -> Tensor:
        """The ``completion_mask`` to pass to the ELBO/EUBO reductions under ``policy``."""
        return self.with_post_eos(policy).completion

    def to(self, device) -> "MaskRegions":
        return MaskRegions._disjoint(self.completion.to(device), self.prompt.to(device), self.post_eos.to(device))


def apply_post_eos(plan: MaskPlan, regions: MaskRegions, policy: str) -> MaskPlan:
    """``mask_and_skip``: post-EOS positions masked in every draw with weight 0; else unchanged.

    (``score`` acts before the scheme, through :meth:`MaskRegions.with_post_eos`.)
    """
    if _check_policy(policy) != "mask_and_skip":
        return plan
    post = regions.post_eos.to(plan.masked.device).unsqueeze(0)
    return replace(plan, masked=plan.masked | post, weight=plan.weight.masked_fill(post, 0.0))


# ----------------------------------------------------------------------------- registry

MaskSchemeFn = Callable[..., MaskPlan]  # fn(regions, *, num_mc, generator, **options) -> MaskPlan
_SCHEMES: Registry[MaskSchemeFn] = Registry(
    "mask scheme", unknown=lambda name, valid: ValueError(f"unknown mask scheme {name!r}; choose from {valid}")
)


def register_mask_scheme(name: str, fn: Optional[MaskSchemeFn] = None, *, overwrite: bool = False):
    """Register ``fn(regions, *, num_mc, generator, **options) -> MaskPlan`` under ``name``.

    Usable as a decorator. The registered callable (what :func:`get_mask_scheme`
    returns) also takes ``post_eos=`` (default ``"visible"``): ``fn`` sees the regions
    of that policy and the policy is applied to its plan, so every scheme handles
    post-EOS positions the same way.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("a mask scheme needs a non-empty name")

    def deco(f: MaskSchemeFn) -> MaskSchemeFn:
        if name in _SCHEMES and not overwrite:  # checked before wrapping: the wrapper is always new
            raise ValueError(f"mask scheme {name!r} is already registered (pass overwrite=True)")

        def scheme(
            regions: MaskRegions, *, num_mc: int, generator: torch.Generator, post_eos: str = "visible", **options
        ) -> MaskPlan:
            if not isinstance(regions, MaskRegions):
                raise TypeError(f"mask scheme {name!r} needs MaskRegions, got {type(regions).__name__}")
            if int(num_mc) < 1:
                raise ValueError(f"num_mc must be >= 1, got {num_mc}")
            _require_generator(generator, f"mask scheme {name!r}")
            plan = f(regions.with_post_eos(post_eos), num_mc=int(num_mc), generator=generator, **options)
            return apply_post_eos(plan, regions, post_eos)

        scheme.__name__ = f"mask_scheme_{name}"
        scheme.__doc__ = f.__doc__
        scheme.__wrapped__ = f
        _SCHEMES.add(name, scheme, overwrite=True)
        return f

    return deco if fn is None else deco(fn)


def available_mask_schemes() -> Tuple[str, ...]:
    return _SCHEMES.names()


def get_mask_scheme(name: str) -> MaskSchemeFn:
    """The registered scheme ``name``: ``(regions, *, num_mc, generator, post_eos='visible', **options)``."""
    return _SCHEMES.get(name)


def build_mask_plan(
    regions: MaskRegions,
    scheme: str = "uniform",
    *,
    num_mc: int,
    generator: torch.Generator,
    post_eos: str = "visible",
    **options,
) -> MaskPlan:
    """Draw ``num_mc`` corruptions of ``regions`` with the named scheme."""
    return get_mask_scheme(scheme)(regions, num_mc=num_mc, generator=generator, post_eos=post_eos, **options)


# ----------------------------------------------------------------------------- schemes


@register_mask_scheme("uniform")
def uniform_scheme(
    regions: MaskRegions,
    *,
    num_mc: int,
    generator: torch.Generator,
    mode: str = "count",
    coupled: bool = False,
    eps: float = 1e-3,
    stratified: bool = True,
    block_size: Optional[int] = None,
    prefix_mask_prob: float = 0.0,
    one_ratio_per_sequence: bool = False,
) -> MaskPlan:
    """LLaDA's count (L/l) or ratio (1/p) masks of the completion (:func:`~.masking.build_plan`)."""
    if mode not in ("count", "ratio"):
        raise ValueError(f"uniform scheme mode must be 'count' or 'ratio', got {mode!r} (use scheme 'full')")
    return build_plan(
        regions.completion,
        num_mc=num_mc,
        generator=generator,
        mode=mode,
        coupled=coupled,
        eps=eps,
        stratified=stratified,
        block_size=block_size,
        prompt_mask_prob=_prob(prefix_mask_prob),
        prompt_region=regions.prompt,
        one_ratio_per_sequence=one_ratio_per_sequence,
    )


@register_mask_scheme("full")
def full_scheme(
    regions: MaskRegions, *, num_mc: int, generator: torch.Generator, prefix_mask_prob: float = 0.15
) -> MaskPlan:
    """d1's mean field: whole completion masked (weight 1), prompt masked with ``prefix_mask_prob``."""
    return build_plan(
        regions.completion,
        num_mc=num_mc,
        generator=generator,
        mode="full",
        prompt_mask_prob=_prob(prefix_mask_prob),
        prompt_region=regions.prompt,
    )


class BlockRandomDraw(NamedTuple):
    """A ``block_random`` plan with its draws: ``block`` [M, B] chosen completion block
    (-1 for an empty completion), ``count`` [M, B] tokens masked inside it, ``start`` [M, B]
    the chosen block's first position (S for an empty completion; positions before it
    are the prefix masked with ``prefix_mask_prob``)."""

    plan: MaskPlan
    block: Tensor
    count: Tensor
    start: Tensor


def _prob(p: float) -> float:
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"prefix_mask_prob must be in [0, 1], got {p}")
    return p


def _block_indices(nb: Tensor, num_mc: int, generator: torch.Generator, stratified: bool) -> Tensor:
    """``[num_mc, B]`` indices, each marginally U{0..nb_b - 1}.

    ``stratified``: the draws of a row run through random permutations of its nb
    indices (the release's ``randperm``; a fresh permutation every nb draws).
    """
    B = nb.shape[0]
    device = nb.device
    if not stratified:
        u = uniform((num_mc, B), generator, device, torch.float64)
        return torch.minimum(torch.floor(u * nb.double()).long(), nb - 1)
    width = int(nb.max())
    n_perm = -(-num_mc // max(int(nb.min()), 1))
    scores = uniform((n_perm, B, width), generator, device)
    scores = scores.masked_fill(torch.arange(width, device=device) >= nb.unsqueeze(-1), 2.0)
    perms = scores.argsort(-1)  # [n_perm, B, width]: the first nb_b entries permute 0..nb_b-1
    j = torch.arange(num_mc, device=device).unsqueeze(-1)
    rows = torch.arange(B, device=device).unsqueeze(0)
    return perms[j // nb, rows, j % nb]


def block_random_draw(
    regions: MaskRegions,
    *,
    num_mc: int,
    generator: torch.Generator,
    block_length: int = 32,
    prefix_mask_prob: float = 0.15,
    num_blocks: Optional[int] = None,
    stratified: bool = True,
    post_eos: str = "visible",
) -> BlockRandomDraw:
    """SPG's ``block_random`` masks with the block and count of every draw (see the module docstring).

    ``num_blocks`` is nb of ``k = U{0..nb-1} mod nc``: default per row
    ``ceil(generated length / block_length)`` (generated = completion + post-EOS;
    the release's ``gen_length // block_length`` when it divides). ``stratified``:
    the block indices of a row's draws come from random permutations (the release);
    False draws them independently. ``post_eos`` as for the registered scheme
    (the release: ``"mask_and_skip"``).
    """
    _require_generator(generator, "block_random")
    full_regions, regions = regions, regions.with_post_eos(post_eos)
    bl = int(block_length)
    if bl < 1:
        raise ValueError(f"block_length must be >= 1, got {block_length}")
    p = _prob(prefix_mask_prob)
    comp = regions.completion
    device = comp.device
    B, S = comp.shape
    M = int(num_mc)
    L = comp.sum(-1)  # [B]
    nc = (L + bl - 1) // bl  # completion blocks up to the first EOS
    if num_blocks is None:
        gen_len = (comp | regions.post_eos).sum(-1)
        nb = ((gen_len + bl - 1) // bl).clamp(min=1)
    else:
        if int(num_blocks) < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        nb = torch.full((B,), int(num_blocks), dtype=torch.long, device=device)
    has = (L > 0).unsqueeze(0)  # [1, B]
    block = _block_indices(nb, M, generator, stratified) % nc.clamp(min=1)  # [M, B]
    m = torch.minimum(torch.full_like(block, bl), L.unsqueeze(0) - block * bl).clamp(min=0)
    u = uniform((M, B), generator, device, torch.float64)
    count = torch.where(has, torch.minimum(1 + torch.floor(u * m.double()).long(), m), 0)
    block = torch.where(has, block, -1)

    rank = comp.long().cumsum(-1) - 1  # [B, S] rank of each completion position
    pos_block = torch.where(comp, torch.div(rank, bl, rounding_mode="floor"), -1).unsqueeze(0)  # [1, B, S]
    blk = block.unsqueeze(-1)
    in_block = comp.unsqueeze(0) & (pos_block == blk)
    after = comp.unsqueeze(0) & (pos_block > blk)
    first = in_block & (rank.unsqueeze(0) == (blk * bl))  # the block's first position
    pos = torch.arange(S, device=device)
    start = torch.where(has, torch.where(first, pos, S).amin(-1), S)  # [M, B]
    before = pos < start.unsqueeze(-1)
    prefix = (regions.prompt | comp).unsqueeze(0) & before
    masked = mask_exact_counts(in_block, count, generator=generator) | after
    masked = masked | prompt_mask(prefix, p, generator=generator)

    scored = masked & comp.unsqueeze(0)
    n = scored.sum(-1)  # [M, B]
    Lf = L.unsqueeze(0).float()
    w = torch.where(n > 0, Lf / n.clamp(min=1).float(), 0.0)
    weight = torch.where(scored, w.unsqueeze(-1), 0.0)
    ratio = (n.float() / Lf.clamp(min=1)).unsqueeze(-1)  # [M, B, 1]: SPG's empirical t
    plan = MaskPlan(masked=masked, weight=weight, ratio=ratio, mode="block_random")
    return BlockRandomDraw(apply_post_eos(plan, full_regions, post_eos), block, count, start)


@register_mask_scheme("block_random")
def block_random_scheme(
    regions: MaskRegions,
    *,
    num_mc: int,
    generator: torch.Generator,
    block_length: int = 32,
    prefix_mask_prob: float = 0.15,
    num_blocks: Optional[int] = None,
    stratified: bool = True,
) -> MaskPlan:
    """SPG's ``block_random`` forward process (StableDRL release); see :func:`block_random_draw`."""
    return block_random_draw(
        regions,
        num_mc=num_mc,
        generator=generator,
        block_length=block_length,
        prefix_mask_prob=prefix_mask_prob,
        num_blocks=num_blocks,
        stratified=stratified,
    ).plan
