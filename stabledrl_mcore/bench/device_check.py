"""``tools/gpu_check.py``: the 8B recipes' device code path, checked on one accelerator.

Six checks, each ``ok``, ``FAIL`` or ``skipped`` (with the reason), printed as
one table and written as one JSON:

1. ``te_vs_local``: Transformer Engine spec vs local spec logits with the same
   weights (copied through a Megatron checkpoint: both specs share its keys), bf16,
   LLaDA- and SDAR-8B-shaped layers (full width, 2 layers), and the TE model's checkpoint
   back into a local one (bit for bit). Tolerance: max ``|dlogit|`` <= :data:`BF16_REL_TOL`
   x max ``|logit|``.
2. ``flex_vs_sdpa``: flex attention vs SDPA with the dense mask, staircase and
   block-causal layouts with left padding, SDAR-8B-shaped layers (GQA): logits
   (same tolerance) and one weight gradient (relative L2 <= :data:`GRAD_REL_TOL`).
3. ``staircase_memory``: peak memory of one staircase likelihood forward +
   backward over ``[x_t | x_0]`` of 8k tokens, flex vs dense SDPA.
4. ``moe_layer``: the mixture-of-experts layer at the MoE preset's width (SDAR-30B-A3B:
   hidden 2048, 128 experts of width 768, top-8; 2 layers, bf16). With TE: the TE spec's
   grouped-GEMM experts vs the local spec's ``SequentialMLP``, same weights through a checkpoint
   and back (as ``te_vs_local``): logits (same tolerance) and the routers' gradients (relative
   L2 <= :data:`GRAD_REL_TOL`) over the tokens both route alike (at least
   :data:`MOE_ROUTED_ALIKE_MIN` of them; near-ties may fall either way in bf16). Without TE the
   local spec alone (against Megatron's stock local layer, whose experts are the same), reported
   ``ok`` with the grouped GEMM marked not compared. Everywhere: every expert of every layer
   gets tokens of the check's batch (tokens per expert, min-max), every gradient is finite,
   and one MoE layer's forward + backward is timed (ms, tokens/s).
5. ``train_llada`` / ``train_sdar``: three StableDRL steps of the tiny presets in
   bf16 with Megatron's distributed optimizer and activation recompute, a
   checkpoint after steps 2 and 3, and a second run resumed from step 2 whose
   step 3 is compared with the first (bit for bit on CPU; reported on GPU, where
   kernels need not be deterministic).
6. ``bench_llada`` / ``bench_sdar``: ``stabledrl bench`` (train phase) on
   8B-shaped layers (full width, 4 layers, the recipe's likelihood, bf16), MFU against
   the device's rated dense bf16 peak (on CPU: the measured matmul rate of the model's
   dtype, see :mod:`.peak`); target :data:`MFU_TARGET`.

``cpu=True`` (``--cpu``) runs the same checks shrunk (tiny presets, short
sequences, eager flex attention) on the CPU; CI runs that mode. Each check is
isolated: one that raises is reported as ``FAIL`` with its error, the others
still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

from stabledrl_mcore.bench.memory import _reset_peak, _status
from stabledrl_mcore.bench.peak import _cpu_name, describe
from stabledrl_mcore.bench.report import write_json
from stabledrl_mcore.checkpoint.mcore_io import load_model_weights, save_model_checkpoint
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.diffusion.likelihood import gather_log_probs
from stabledrl_mcore.models import AttentionLayout, build_model, default_device, get_preset, staircase_position_ids
from stabledrl_mcore.models.moe import RoutingRecorder
from stabledrl_mcore.models.specs import te_unavailable_reason
from stabledrl_mcore.parallel import bootstrap
from stabledrl_mcore.parallel.launch import spawn
from stabledrl_mcore.rl.trainer import train
from stabledrl_mcore.tasks.base import Task

BF16_REL_TOL = 3e-2
"""Logit agreement of two bf16 kernels: max abs difference over max abs logit."""
GRAD_REL_TOL = 5e-2
"""Gradient agreement of two bf16 kernels: relative L2 difference of one weight's gradient."""
MOE_ROUTED_ALIKE_MIN = 0.5
"""Share of the tokens two bf16 MoE specs must route to the same experts in every layer (the
others, near-ties of two experts' scores, are left out of the logit and gradient comparison)."""
MFU_TARGET = 0.45
"""Model-FLOP utilisation the bench should reach on 8B-shaped layers (of the rated bf16 peak)."""

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = {
    "llada": os.path.join(ROOT, "examples", "configs", "llada_8b_stabledrl.yaml"),
    "sdar": os.path.join(ROOT, "examples", "configs", "sdar_8b_stabledrl.yaml"),
}
TINY_CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")


@dataclasses.dataclass
class Sizes:
    """Shapes of one mode (GPU: the 8B widths; CPU: tiny)."""

    presets: Dict[str, str]
    layers: int
    seq: int  # tokens of the TE / flex comparisons
    staircase_n: int  # noisy-half length of the memory check (2n tokens)
    moe_preset: str  # the MoE layer check's preset, at ``layers`` layers
    moe_batch: int  # rows of ``seq`` tokens the MoE layer check routes and times
    moe_repeats: int  # timed forward + backward passes of one MoE layer
    bench_layers: int
    bench_overrides: Dict[str, List[str]]  # per arch, and "all"
    timeout_s: int


MATH500 = os.path.join(ROOT, "tests", "fixtures", "math500_test.jsonl")  # the SDAR recipe's task is file-backed
GPU = Sizes(
    presets={"llada": "llada-8b", "sdar": "sdar-8b"},
    layers=2,
    seq=1024,
    staircase_n=4096,
    moe_preset="sdar-30b-a3b",
    moe_batch=4,
    moe_repeats=5,
    bench_layers=4,
    timeout_s=300,
    bench_overrides={
        "llada": ["rollout.gen_length=256", "rollout.steps=128", "rollout.block_length=32"],
        "sdar": ["rollout.gen_length=256", f"rollout.data_path={MATH500}"],
        "all": [
            "rollout.prompts_per_step=2",
            "rollout.group_size=8",
            "parallel.micro_batch_size=16",
            "model.recompute=false",
        ],
    },
)
CPU = Sizes(
    presets={"llada": "llada-tiny", "sdar": "sdar-tiny"},
    layers=2,
    seq=64,
    staircase_n=128,
    moe_preset="sdar-moe-tiny",
    moe_batch=2,
    moe_repeats=2,
    bench_layers=2,
    timeout_s=300,
    bench_overrides={
        "llada": ["rollout.steps=8", "rollout.block_length=8"],
        "sdar": [f"rollout.data_path={MATH500}"],
        "all": [
            "rollout.prompts_per_step=1",
            "rollout.group_size=4",
            "rollout.gen_length=16",
            "parallel.micro_batch_size=4",
            "model.recompute=false",
            "parallel.threads=1",
        ],
    },
)


def _device() -> torch.device:

    return default_device()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _shaped(preset: str, layers: int):

    return get_preset(preset, num_layers=layers, init_std=0.02)


def _left_padded_ids(cfg, batch: int, length: int, generator: torch.Generator, device):
    """Random ids ``[batch, length]`` and per-row left-pad counts (row 0 unpadded)."""
    ids = torch.randint(3, cfg.vocab_size - 2, (batch, length), generator=generator, device="cpu")
    pads = [0] + [length // (4 * (r + 1)) for r in range(1, batch)]
    for row, pad in enumerate(pads):
        ids[row, :pad] = cfg.pad_token_id
    return ids.to(device), pads


# ---------------------------------------------------------------------------------- checks
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
        cfg = _shaped(preset, sizes.layers)
        local, twin = _same_weights(cfg, other, arch)
        ids = torch.randint(3, cfg.vocab_size - 2, (2, sizes.seq), generator=gen).to(_device())
        with torch.no_grad():
            out[arch] = _rel(twin(ids), local(ids))
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

    cfg = _shaped(sizes.presets["sdar"], sizes.layers)
    model = build_model(cfg, params_dtype=torch.bfloat16).train()
    gen = torch.Generator(device="cpu").manual_seed(1)
    device = _device()
    out: Dict[str, Any] = {"tolerance_logits": BF16_REL_TOL, "tolerance_grad": GRAD_REL_TOL}
    n = sizes.seq
    ids, pads = _left_padded_ids(cfg, 2, n, gen, device)
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
        d_logits = _rel(logits[valid], ref_logits[valid])  # pad rows are never scored
        d_grad = None if cpu else _rel_l2(grad, ref_grad)
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
        _sync()
        return torch.cuda.max_memory_allocated() - base

    _reset_peak()
    base = _status("VmRSS")
    fn()
    return _status("VmHWM") - base


def check_staircase_memory(sizes: Sizes, cpu: bool) -> Dict[str, Any]:
    """Forward + backward on GPU; on CPU the forward alone (torch has no flex backward there)."""

    cfg = _shaped(sizes.presets["sdar"], sizes.layers)
    model = build_model(cfg, params_dtype=torch.bfloat16).train()
    device, n = _device(), sizes.staircase_n
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
    _sync()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    _sync()
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
    cfg = _shaped(sizes.moe_preset, sizes.layers)
    local, twin = _same_weights(cfg, other, sizes.moe_preset)
    gen = torch.Generator(device="cpu").manual_seed(3)
    ids = torch.randint(3, cfg.vocab_size - 2, (sizes.moe_batch, sizes.seq), generator=gen).to(_device())
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
    d_logits = _rel(theirs.detach()[alike], ours.detach()[alike]) if alike.any() else float("nan")
    d_router = max(_rel_l2(grads[1][n], grads[0][n]) for n in routers)
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


def probe_reward(task, completion: str, reference) -> float:
    """A dense, deterministic reward of the completion text. A random tiny model earns the same
    task reward for every completion (zero advantages, so no backward would run); this varies."""
    return (sum(map(ord, completion)) % 11) / 10.0


def _train_rank(config: str, overrides: List[str], out_json: str) -> None:
    """One rank of the training check (module level: ``parallel.launch.spawn`` starts it)."""

    Task.reward = probe_reward
    setup = train(load_config(config, overrides))
    digest = hashlib.sha256()
    for name, tensor in sorted(setup.model.state_dict().items()):
        if isinstance(tensor, torch.Tensor):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
    if torch.distributed.get_rank() == 0:
        with open(out_json, "w") as handle:
            json.dump({"weights_sha256": digest.hexdigest()}, handle)


def _metrics(run_dir: str) -> List[Dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle]
    return [{k: v for k, v in r.items() if not k.startswith(("time", "tokens_per_s", "step_s"))} for r in rows]


def check_train(arch: str, sizes: Sizes, workdir: str, cpu: bool) -> Dict[str, Any]:

    preset = "llada-tiny" if arch == "llada" else "sdar-tiny"
    extra = [
        f"model.preset={preset}",
        "model.dtype=bf16",
        "model.recompute=true",
        "optim.distributed=true",
        "steps=3",
        "checkpoint.save_every=2",
        "logging.wandb_mode=disabled",
        "logging.progress=false",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.gen_length=8",
        "parallel.micro_batch_size=4",
        "eval.every=0",
    ]
    extra += (
        ["rollout.steps=4", "rollout.block_length=8"]
        if arch == "llada"
        else [
            "rollout.steps=4",
            "rollout.block_length=4",
            "rollout.threshold=0.9",
            "algo.likelihood=staircase",
            "algo.num_mc=1",
        ]
    )
    first, resumed = os.path.join(workdir, f"train_{arch}"), os.path.join(workdir, f"train_{arch}_resumed")
    runs = {}
    for run_dir in (first, resumed):
        if run_dir == resumed:
            os.makedirs(os.path.join(resumed, "checkpoints"))
            shutil.copytree(
                os.path.join(first, "checkpoints", "step_00000002"),
                os.path.join(resumed, "checkpoints", "step_00000002"),
            )
        over = extra + [f"logging.run_dir={run_dir}"] + (["checkpoint.resume=auto"] if run_dir == resumed else [])
        out_json = os.path.join(run_dir + ".json")
        spawn(_train_rank, 1, (TINY_CONFIG, over, out_json), timeout=sizes.timeout_s)
        with open(out_json) as handle:
            runs[run_dir] = json.load(handle)
    rows, again = _metrics(first), _metrics(resumed)
    trained = all(r.get("grad_norm", 0) > 0 and r.get("skipped_updates", 1) == 0 for r in rows)
    same = again[-1] == rows[-1] and runs[first] == runs[resumed]
    out = {
        "steps": [r["step"] for r in rows],
        "resumed_steps": [r["step"] for r in again],
        "grad_norm": [r.get("grad_norm") for r in rows],
        "resume_bitwise": same,
    }
    ok = trained and out["steps"] == [1, 2, 3] and out["resumed_steps"] == [3] and (same or not cpu)
    out.update(
        status="ok" if ok else "FAIL",
        value=f"3 steps, grad norms {', '.join(f'{g:.2g}' for g in out['grad_norm'])}; resume "
        + ("bitwise" if same else "differs"),
    )
    return out


def check_bench(arch: str, sizes: Sizes, workdir: str, cpu: bool) -> Dict[str, Any]:

    preset = sizes.presets[arch]
    run_dir = os.path.join(workdir, f"bench_{arch}")
    result = os.path.join(workdir, f"bench_{arch}.json")
    cmd = [
        sys.executable,
        "-m",
        "stabledrl_mcore.cli",
        "bench",
        "--config",
        RECIPES[arch],
        f"model.preset={preset}",
        "model.checkpoint=null",
        f"model.overrides.num_layers={sizes.bench_layers}",
        "parallel.tensor_parallel=1",
        f"logging.run_dir={run_dir}",
        *sizes.bench_overrides["all"],
        *sizes.bench_overrides[arch],
        "--phases",
        "train",
        "--no-baseline",
        "--warmup",
        "1",
        "--repeats",
        "3",
        "--json",
        result,
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=sizes.timeout_s,
        env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"stabledrl bench exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    with open(result) as handle:
        bench = json.load(handle)
    mfu, train = bench.get("mfu"), bench["phases"]["train"]
    out = {
        "mfu": mfu,
        "peak": bench["peak"]["kind"],
        "peak_dtype": bench["peak"].get("dtype"),
        "peak_flops": bench["matmul_peak_flops"],
        "train_tokens_per_s": train["tokens_per_s"],
        "model_flops_per_s": train["model_flops_per_s"],
        "params": bench["model"]["params"],
        "workload": bench["workload"],
    }
    met = mfu is not None and mfu >= MFU_TARGET
    out.update(
        status="ok",
        value=f"MFU {100 * (mfu or 0):.1f}% of the {describe(bench['peak'])} peak"
        + ("" if cpu else (" (target met)" if met else f" (below the {100 * MFU_TARGET:.0f}% target)")),
        target_met=None if cpu else met,
    )
    return out


# ---------------------------------------------------------------------------------- driver
def run_checks(*, cpu: bool, workdir: Optional[str] = None, only: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run every check (or ``only`` those); returns the JSON-ready result."""

    if not cpu and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: run with --cpu for the CPU variant")
    sizes = CPU if cpu else GPU
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="stabledrl-gpu-check-")
    checks: Dict[str, Callable[[], Dict[str, Any]]] = {
        "te_vs_local": lambda: check_te_vs_local(sizes),
        "flex_vs_sdpa": lambda: check_flex_vs_sdpa(sizes, cpu),
        "staircase_memory": lambda: check_staircase_memory(sizes, cpu),
        "moe_layer": lambda: check_moe_layer(sizes, cpu),
        "train_llada": lambda: check_train("llada", sizes, workdir, cpu),
        "train_sdar": lambda: check_train("sdar", sizes, workdir, cpu),
        "bench_llada": lambda: check_bench("llada", sizes, workdir, cpu),
        "bench_sdar": lambda: check_bench("sdar", sizes, workdir, cpu),
    }
    unknown = sorted(set(only or ()) - set(checks))
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(checks)}")
    results: Dict[str, Any] = {}
    torch.manual_seed(0)
    bootstrap.initialize(1, 1, seed=0)
    try:
        for name, fn in checks.items():
            if only and name not in only:
                continue
            start = time.perf_counter()
            try:
                results[name] = fn()
            except Exception as err:  # noqa: BLE001 - one broken check must not hide the others
                results[name] = {
                    "status": "FAIL",
                    "value": f"{type(err).__name__}: {str(err).splitlines()[0]}" if str(err) else type(err).__name__,
                    "traceback": traceback.format_exc()[-4000:],
                }
            results[name]["seconds"] = round(time.perf_counter() - start, 1)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        bootstrap.destroy()
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    return {
        "mode": "cpu" if cpu else "gpu",
        "device": _device_name(),
        "torch": torch.__version__,
        "transformer_engine": _te_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "ok": all(r["status"] != "FAIL" for r in results.values()),
        "checks": results,
    }


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()

    return _cpu_name()


def _te_version() -> Optional[str]:
    try:
        import transformer_engine

        return getattr(transformer_engine, "__version__", "unknown")
    except ImportError:
        return None


def format_table(result: Dict[str, Any]) -> str:
    """One row per check: name, status, seconds, headline figure."""
    rows = [
        f"device check ({result['mode']}) on {result['device']}, torch {result['torch']}, "
        f"TE {result['transformer_engine'] or 'not installed'}",
        "",
    ]
    header = f"{'check':<18}{'status':<9}{'s':>7}  result"
    rows += [header, "-" * 100]
    for name, r in result["checks"].items():
        value = r.get("value") or r.get("detail") or ""
        rows.append(f"{name:<18}{r['status']:<9}{r.get('seconds', 0):>7.1f}  {value}")
    rows += ["", "all checks passed" if result["ok"] else "SOME CHECKS FAILED"]
    return "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> int:

    parser = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the shrunk CPU variant (what CI runs)")
    parser.add_argument("--json", metavar="PATH", default="gpu_check.json", help="result file (default %(default)s)")
    parser.add_argument("--only", metavar="LIST", help="comma-separated subset of the checks")
    parser.add_argument("--workdir", metavar="DIR", help="keep the runs' files here (default: a temporary dir)")
    args = parser.parse_args(argv)
    only = [c.strip() for c in args.only.split(",")] if args.only else None
    try:
        result = run_checks(cpu=args.cpu, workdir=args.workdir, only=only)
    except (ValueError, RuntimeError) as err:  # bad --only, no CUDA without --cpu
        print(f"gpu_check: error: {err}", file=sys.stderr)
        return 2
    print(format_table(result), flush=True)

    write_json(result, args.json)
    print(f"wrote {args.json}")
    return 0 if result["ok"] else 1
