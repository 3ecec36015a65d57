"""The device checks of layers and kernels (:mod:`.device_check` lists them): Transformer Engine
vs the local spec, flex attention vs SDPA, the staircase likelihood's peak memory, the MoE layer."""

from __future__ import annotations

import gc
import os
import tempfile
import time
from typing import Any, Callable, Dict

import torch

from stabledrl_mcore.bench.check_sizes import (
    BF16_REL_TOL,
    GRAD_REL_TOL,
    MOE_ROUTED_ALIKE_MIN,
    Sizes,
    check_device,
    left_padded_ids,
    rel_l2,
    rel_max,
    shaped_preset,
    synchronize,
)
from stabledrl_mcore.bench.memory import _reset_peak, _status
from stabledrl_mcore.checkpoint.mcore_io import load_model_weights, save_model_checkpoint
from stabledrl_mcore.diffusion.likelihood import gather_log_probs
from stabledrl_mcore.models import AttentionLayout, build_model, staircase_position_ids
from stabledrl_mcore.models.moe import RoutingRecorder
from stabledrl_mcore.models.specs import te_unavailable_reason


def _same_weights(cfg, other: Dict[str, Any], label: str):
    """The local spec and ``build_model(cfg, **other)``, bf16, in eval mode, with the same weights
    (saved from the local model, loaded into the other: the specs share checkpoint keys, and
    ``_extra_state`` only one side has is left out, see :mod:`..checkpoint.extra_state`); then
    the other model's checkpoint back into a fresh local one, which must equal the first bit for bit."""

    local = build_model(cfg, params_dtype=torch.bfloat16, use_te=False).eval()
    twin = build_model(cfg, params_dtype=torch.bfloat16, **other).eval()
    back = build_model(cfg, params_dtype=torch.bfloat16, use_te=False).eval()
    with tempfile.TemporaryDirectory() as tmp:
        save_model_checkpoint(local, os.path.join(tmp, "ckpt"))
        load_model_weights(twin, os.path.join(tmp, "ckpt"))
        save_model_checkpoint(twin, os.path.join(tmp, "back"))
        load_model_weights(back, os.path.join(tmp, "back"))
    if not all(torch.equal(a, b) for a, b in zip(local.parameters(), back.parameters())):
        raise AssertionError(f"{label}: local -> {other} -> local did not give the same weights back")
    del back
    return local, twin


def _spec_agreement(sizes: Sizes, other: Dict[str, Any]) -> Dict[str, float]:
    """Per arch: max rel |dlogit| of the local spec vs ``build_model(**other)``, same weights
    and the round trip back checked (:func:`_same_weights`)."""

    out = {}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for arch, preset in sizes.presets.items():
        cfg = shaped_preset(preset, sizes.layers)
        local, twin = _same_weights(cfg, other, arch)
        ids = torch.randint(3, cfg.vocab_size - 2, (2, sizes.seq), generator=gen).to(check_device())
        with torch.no_grad():
            out[arch] = rel_max(twin(ids), local(ids))
        del local, twin
    return out


def check_te_vs_local(sizes: Sizes) -> Dict[str, Any]:
    """TE vs local spec; without TE the same transfer and comparison against Megatron's stock
    local layer (so the check's own path runs everywhere), reported as skipped."""

    reason = te_unavailable_reason()
    if reason:
        stock = _spec_agreement(sizes, {"use_te": False, "stock_local": True})
        return {
            "status": "skipped",
            "detail": f"{reason} (stock local layer vs ours: max rel |dlogit| {max(stock.values()):.1e})",
            "stock_local": stock,
        }
    out: Dict[str, Any] = {"tolerance": BF16_REL_TOL, **_spec_agreement(sizes, {"use_te": True})}
    worst = max(out[a] for a in sizes.presets)
    out.update(
        status="ok" if worst <= BF16_REL_TOL else "FAIL",
        value=f"max rel |dlogit| {worst:.2e} (LLaDA {out['llada']:.1e}, SDAR {out['sdar']:.1e})",
    )
    return out


def _forward_backward(model, ids, layout, positions, backend: str, backward: bool):
    """Logits and (with ``backward``) the first layer's ``linear_qkv`` weight gradient."""
    for attention in model.core_attentions():
        attention.backend = backend
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        logits = model(ids, position_ids=positions, attention_mask=layout)
    if not backward:
        return logits.detach(), None
    logits.float().logsumexp(-1).mean().backward()
    grad = next(p for n, p in model.named_parameters() if "linear_qkv.weight" in n).grad.detach().clone()
    return logits.detach(), grad


def check_flex_vs_sdpa(sizes: Sizes, cpu: bool) -> Dict[str, Any]:
    """Forward and backward on GPU; forward only on CPU, where torch has no flex backward."""

    cfg = shaped_preset(sizes.presets["sdar"], sizes.layers)
    model = build_model(cfg, params_dtype=torch.bfloat16).train()
    gen = torch.Generator(device="cpu").manual_seed(1)
    device = check_device()
    out: Dict[str, Any] = {"tolerance_logits": BF16_REL_TOL, "tolerance_grad": GRAD_REL_TOL}
    n = sizes.seq
    ids, pads = left_padded_ids(cfg, 2, n, gen, device)
    cases = {
        "staircase": (
            torch.cat([ids, ids], 1),
            AttentionLayout.staircase(cfg.block_size, pad=pads),
            staircase_position_ids(n, device=device),
        ),
        "block_causal": (ids, AttentionLayout.block_causal(cfg.block_size, pad=pads), None),
    }
    worst = 0.0
    for name, (x, layout, pos) in cases.items():
        ref_logits, ref_grad = _forward_backward(model, x, layout, pos, "sdpa", backward=not cpu)
        logits, grad = _forward_backward(model, x, layout, pos, "flex", backward=not cpu)
        valid = torch.cat([torch.arange(x.shape[1], device=device)[None] % n >= p for p in pads])
        d_logits = rel_max(logits[valid], ref_logits[valid])  # pad rows are never scored
        d_grad = None if cpu else rel_l2(grad, ref_grad)
        out[name] = {"logits": d_logits, "grad": d_grad}
        worst = max(worst, d_logits / BF16_REL_TOL, (d_grad or 0.0) / GRAD_REL_TOL)
    out.update(
        status="ok" if worst <= 1.0 else "FAIL",
        value=" ".join(
            f"{k}: logits {v['logits']:.1e}" + ("" if v["grad"] is None else f" grad {v['grad']:.1e}")
            for k, v in out.items()
            if isinstance(v, dict)
        )
        + (" (forward only: no flex backward on CPU)" if cpu else ""),
    )
    return out


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def _peak_bytes(fn: Callable[[], None]) -> int:
    """Peak memory of ``fn``: CUDA allocator peak on GPU, resident-set high-water mark on CPU."""

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        synchronize()
        return torch.cuda.max_memory_allocated() - base

    _reset_peak()
    base = _status("VmRSS")
    fn()
    return _status("VmHWM") - base


def check_staircase_memory(sizes: Sizes, cpu: bool) -> Dict[str, Any]:
    """Forward + backward on GPU; on CPU the forward alone (torch has no flex backward there)."""

    cfg = shaped_preset(sizes.presets["sdar"], sizes.layers)
    model = build_model(cfg, params_dtype=torch.bfloat16).train()
    device, n = check_device(), sizes.staircase_n
    gen = torch.Generator(device="cpu").manual_seed(2)
    ids = torch.randint(3, cfg.vocab_size - 2, (1, n), generator=gen).to(device)
    masked = (torch.rand(1, n, generator=gen) < 0.5).to(device)
    noisy = ids.masked_fill(masked, cfg.mask_token_id)
    layout, pos = AttentionLayout.staircase(cfg.block_size), staircase_position_ids(n, device=device)

    def likelihood(backend: str) -> Callable[[], None]:
        def run():
            for attention in model.core_attentions():
                attention.backend = backend
            model.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(not cpu):
                logits = model(torch.cat([noisy, ids], 1), position_ids=pos, attention_mask=layout)[:, :n]
                loss = gather_log_probs(logits, ids, masked).sum()
            if not cpu:
                loss.backward()

        return run

    out: Dict[str, Any] = {"tokens": 2 * n, "backward": not cpu}
    for backend in ("flex", "sdpa"):
        likelihood(backend)()  # warm-up (compilation, allocator)
        out[f"{backend}_peak_bytes"] = _peak_bytes(likelihood(backend))
    flex, dense = out["flex_peak_bytes"], out["sdpa_peak_bytes"]
    out.update(
        status="ok",
        value=f"{2 * n} tokens: flex {_size(flex)}, dense {_size(dense)}"
        + (f" ({dense / flex:.1f}x)" if flex > 0 else ""),
    )
    return out


def _routed_forward(model, ids):
    """``model(ids)`` with its gradients cleared, and a :class:`RoutingRecorder` of that forward
    (counts and every layer's routing map)."""

    model.zero_grad(set_to_none=True)
    with RoutingRecorder(model, keep_maps=True) as recorder:
        logits = model(ids)
    return logits, recorder


def _routed_alike(ours: RoutingRecorder, theirs: RoutingRecorder, batch: int) -> torch.Tensor:
    """``[B, S]``: True where every layer sent the token to the same experts in both forwards."""

    same = torch.stack([(a[-1] == b[-1]).all(-1) for a, b in zip(ours.maps, theirs.maps)]).all(0)
    return same.view(-1, batch).T  # the maps' tokens are [S, B], s-major


def _moe_layer_ms(layer, tokens: int, batch: int, repeats: int) -> float:
    """Milliseconds of one forward + backward of the MoE layer ``layer`` (router + experts) on
    random hidden states ``[tokens / batch, batch, H]`` (one warm-up, then the mean of ``repeats``)."""

    param = layer.router.weight
    gen = torch.Generator(device="cpu").manual_seed(4)
    shape = (tokens // batch, batch, layer.config.hidden_size)
    x = torch.randn(shape, generator=gen).to(param.device, torch.bfloat16).requires_grad_()
    grad = torch.randn(shape, generator=gen).to(param.device, torch.bfloat16)

    def step():
        output, _ = layer(x)
        output.backward(grad)

    step()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    synchronize()
    layer.zero_grad(set_to_none=True)
    return 1e3 * (time.perf_counter() - start) / repeats


def _rate(tokens_per_s: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{unit}"
    return f"{tokens_per_s:.0f}"


def check_moe_layer(sizes: Sizes, cpu: bool) -> Dict[str, Any]:
    """The mixture-of-experts layer (:class:`~stabledrl_mcore.models.moe.DLLMMoELayer`): the MoE
    preset's width at ``sizes.layers`` layers, bf16. With TE: the TE spec (grouped-GEMM experts)
    against the local spec (``SequentialMLP``) with the same weights through a checkpoint
    (:func:`_same_weights`), logits and every router's gradient; without TE the same path against
    Megatron's stock local layer (identical experts: the transfer and comparison still run, the
    grouped GEMM is not compared). Everywhere: every expert of every layer gets tokens of the
    check's batch, every gradient is finite, the router's and an expert weight's are non-zero,
    and one MoE layer's forward + backward is timed on each spec."""

    reason = te_unavailable_reason()
    other = {"use_te": False, "stock_local": True} if reason else {"use_te": True}
    cfg = shaped_preset(sizes.moe_preset, sizes.layers)
    local, twin = _same_weights(cfg, other, sizes.moe_preset)
    gen = torch.Generator(device="cpu").manual_seed(3)
    ids = torch.randint(3, cfg.vocab_size - 2, (sizes.moe_batch, sizes.seq), generator=gen).to(check_device())
    (ours, rec), (theirs, rec_twin) = _routed_forward(local, ids), _routed_forward(twin, ids)
    # a near-tie of two experts' router scores may fall either way under the other spec's bf16
    # kernels: such tokens (and the loss on them) are left out of the comparison, and counted
    alike = _routed_alike(rec, rec_twin, sizes.moe_batch).to(ours.device)
    for logits in (ours, theirs):
        ((logits.float().logsumexp(-1) * alike).sum() / alike.sum().clamp(min=1)).backward()
    grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in (local, twin)]

    counts = rec.counts.cpu()  # [layers, experts], routed slots
    tokens = sizes.moe_batch * sizes.seq
    even = tokens * cfg.moe_router_topk / cfg.num_experts
    routers = [n for n in grads[0] if n.endswith("router.weight")]
    expert = next(n for n in grads[0] if ".experts." in n and "linear_fc1" in n)
    finite = all(bool(torch.isfinite(g).all()) for run in grads for g in run.values())
    nonzero = all(float(grads[0][n].float().norm()) != 0 for n in routers + [expert])  # NaN: not finite
    fraction = float(alike.float().mean())
    d_logits = rel_max(theirs.detach()[alike], ours.detach()[alike]) if alike.any() else float("nan")
    d_router = max(rel_l2(grads[1][n], grads[0][n]) for n in routers)
    del ours, theirs, grads
    for model in (local, twin):
        model.zero_grad(set_to_none=True)
    ms = {
        "local": _moe_layer_ms(local.decoder.layers[0].mlp, tokens, sizes.moe_batch, sizes.moe_repeats),
        "twin": _moe_layer_ms(twin.decoder.layers[0].mlp, tokens, sizes.moe_batch, sizes.moe_repeats),
    }
    out: Dict[str, Any] = {
        "preset": sizes.moe_preset,
        "layers": sizes.layers,
        "experts": cfg.num_experts,
        "topk": cfg.moe_router_topk,
        "tokens": tokens,
        "twin": "te_grouped_gemm" if reason is None else "stock_local",
        "tolerance_logits": BF16_REL_TOL,
        "tolerance_grad": GRAD_REL_TOL,
        "routed_alike": fraction,
        "routed_alike_min": MOE_ROUTED_ALIKE_MIN,
        "logits": d_logits,
        "router_grad": d_router,
        "tokens_per_expert_min": float(counts.min()),
        "tokens_per_expert_max": float(counts.max()),
        "tokens_per_expert_even": even,
        "grads_finite": finite,
        "grads_nonzero": nonzero,
        "layer_ms": ms["twin" if reason is None else "local"],
        "layer_ms_sequential": ms["local"],
        "layer_tokens_per_s": tokens / (1e-3 * ms["twin" if reason is None else "local"]),
    }
    problems = []
    if counts.min() < 1:
        idle = int((counts < 1).sum())
        problems.append(f"{idle} (layer, expert) pairs got no token of {tokens}")
    if not finite:
        problems.append("non-finite gradients")
    if not nonzero:
        problems.append("a zero router / expert gradient")
    if not fraction >= MOE_ROUTED_ALIKE_MIN:
        problems.append(f"only {100 * fraction:.0f}% of the tokens routed alike by {out['twin']} and local")
    if not (d_logits <= BF16_REL_TOL and d_router <= GRAD_REL_TOL):  # NaN fails too
        problems.append(f"{out['twin']} vs local beyond tolerance")
    spread = f"tokens/expert {counts.min():.0f}-{counts.max():.0f} (even {even:.0f})"
    compared = f"max rel |dlogit| {d_logits:.1e}, router grad {d_router:.1e} ({100 * fraction:.0f}% routed alike)"
    if reason is None:
        head = f"grouped GEMM vs sequential: {compared}; {spread}"
        timing = f"MoE layer fwd+bwd {ms['twin']:.2f} ms grouped, {ms['local']:.2f} ms sequential"
    else:
        head = f"no TE: local only, grouped GEMM vs sequential not compared ({reason}); {spread}"
        timing = f"MoE layer fwd+bwd {ms['local']:.2f} ms"
    tail = f"{timing} ({_rate(out['layer_tokens_per_s'])} tok/s)"
    if reason is not None:
        tail += f"; stock-local twin {compared}"
    out.update(
        status="FAIL" if problems else "ok",
        value=(f"{'; '.join(problems)}: " if problems else "") + f"{head}; {tail}",
    )
    del local, twin
    return out
