"""The device checks of decoding (:mod:`.check_parts` lists them): the recipes' rollouts at full depth,
eager and captured, and Transformer Engine vs the local spec on the KV-cached decoding step.

``rollout_<arch>`` (:func:`check_rollout`) builds the 8B model at its real shape (LLaDA-8B: 32 layers,
SDAR-8B: 36; random weights, bf16, no optimizer: nothing but the weights and the KV cache is held)
and decodes the recipe's rollout (``examples/configs/<arch>_8b_stabledrl.yaml``: block length, steps
per block, threshold, LLaDA's ``rollout.cache``, temperature, group size; rows per decoding forward
``rollout.decode_rows``, or where the recipe leaves it unset the smallest decoding batch it makes,
``lcm(micro_batch, group_size)`` rows, :func:`~stabledrl_mcore.rl.group_rollout.decode_rows`) for a
prompt of :attr:`~.check_sizes.RolloutSizes.prompt` tokens and
:attr:`~.check_sizes.RolloutSizes.gen` new ones, twice: eager and with the captured step
(``rollout.compile=reduce-overhead``, :class:`~stabledrl_mcore.models.decoding.DecodingForward`:
CUDA graphs on GPU). Each side first runs a warm-up generation (the captured side's compiles its graphs),
stopped once two blocks are committed (every graph of a generation has run by then: LLaDA's fill
and block steps in block 1, SDAR's store step at block 2; with LLaDA's prefix cache, whose shortest
window first runs at the last block, the whole generation), then a timed one. Per side: tokens/s of the
generation, ms per decoding forward, host ms vs device ms per forward (CUDA events around each
forward; on CPU, process CPU ms vs wall ms), compile/capture seconds, peak memory, and whether the
captured side's tokens equal the eager side's (same seed: the same Gumbel draws).

Both sides build the local layer spec (the captured step needs it: TE's modules are not captured).
``--cpu`` runs the same code at the 8B layer count but the tiny presets' width, shorter sequences,
fp32 and ``torch.compile``'s ``eager`` backend (Dynamo captures the whole step, fullgraph, without
inductor's code generation, which takes minutes on a 2-core CPU).

``te_vs_local_decode`` (:func:`check_te_vs_local_decode`): the same weights in both specs (through a
Megatron checkpoint, as :func:`.kernel_checks.check_te_vs_local`), LLaDA's dual-cache block step (the
cache filled by a full forward, then a 32-token block step against it) and SDAR's block step (the
prompt's blocks prefilled, then a 4-token block step), logits compared. Without TE (or CUDA) the
same path against Megatron's stock local layer, reported skipped with the reason.
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional

import torch

from stabledrl_mcore.bench.check_sizes import (
    BF16_REL_TOL,
    RECIPES,
    RolloutSizes,
    Sizes,
    check_device,
    rel_max,
    shaped_preset,
    synchronize,
)
from stabledrl_mcore.bench.kernel_checks import _same_weights
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.diffusion import generate_llada, generate_sdar
from stabledrl_mcore.models import AttentionLayout, build_model, get_preset
from stabledrl_mcore.models.decoding import DecodingForward
from stabledrl_mcore.models.specs import te_unavailable_reason
from stabledrl_mcore.rl.group_rollout import decode_rows

EIGHT_B = {"llada": "llada-8b", "sdar": "sdar-8b"}


class _WarmedUp(Exception):
    """Stops a side's warm-up generation once its blocks are committed (every graph has run)."""


class TimedForward(DecodingForward):
    """A :class:`DecodingForward` that times each call: host seconds (wall of the call, which returns
    once its kernels are queued on GPU; process CPU seconds on CPU) and device seconds (CUDA events
    recorded before and after the call, read after the generation; wall seconds on CPU)."""

    def __init__(self, model, mode: str, *, backend: str):
        super().__init__(model, mode, backend=backend)
        self.timing = False
        self.host: List[float] = []
        self.device: List[float] = []
        self._events: List[Any] = []
        self._cuda = next(model.parameters()).is_cuda

    def __call__(self, *args, **kwargs):
        if not self.timing:
            return super().__call__(*args, **kwargs)
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        wall, cpu = time.perf_counter(), time.process_time()
        logits = super().__call__(*args, **kwargs)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if self._cuda:
            end.record()
            self._events.append((start, end))
            self.host.append(wall)
        else:
            self.host.append(cpu)
            self.device.append(wall)
        return logits

    def collect(self) -> None:
        """Reads the CUDA events (after a synchronisation)."""
        synchronize()
        self.device += [a.elapsed_time(b) / 1e3 for a, b in self._events]
        self._events = []


def recipe_rollout(arch: str) -> Dict[str, Any]:
    """The recipe's rollout settings the check decodes with."""
    cfg = load_config(RECIPES[arch])
    r, mb = cfg.rollout, cfg.parallel.micro_batch_size
    blocks = r.gen_length // r.block_length
    return {
        "recipe": RECIPES[arch].rsplit("/", 1)[-1],
        "block_length": r.block_length,
        "steps_per_block": r.steps if arch == "sdar" else r.steps // blocks,
        "threshold": r.threshold,
        "cache": r.cache if arch == "llada" else "kv (always)",
        "temperature": r.temperature,
        "group_size": r.group_size,
        "micro_batch": mb,
        "decode_rows": r.decode_rows or decode_rows(mb, r.group_size),
        "decode_rows_from": "rollout.decode_rows" if r.decode_rows else "lcm(micro_batch, group_size)",
    }


def rollout_model(arch: str, rs: RolloutSizes, layers: Optional[int]):
    """The 8B shape (``rs.width`` None) or the tiny preset at the 8B layer count, random weights."""
    depth = layers or get_preset(EIGHT_B[arch]).num_layers
    if rs.width is None:
        cfg = get_preset(EIGHT_B[arch], num_layers=depth, init_std=0.02)
    else:
        cfg = get_preset(
            f"{arch}-tiny", num_layers=depth, init_std=0.2, max_position_embeddings=2 * (rs.prompt + rs.gen)
        )
    dtype = torch.bfloat16 if rs.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    return build_model(cfg, params_dtype=dtype, use_te=False).eval(), cfg


def _generate(arch, model, prompts, settings, rs: RolloutSizes, forward, on_step=None):
    seed = torch.Generator(device=prompts.device).manual_seed(3)
    common = dict(
        gen_length=rs.gen,
        temperature=settings["temperature"],
        threshold=settings["threshold"],
        generator=seed,
        progress=False,
        repeats=settings["repeats"],
        compile=forward,
        on_step=on_step,
    )
    if arch == "llada":
        bl = settings["block_length"]
        steps = settings["steps_per_block"] * (rs.gen // bl)
        cache = settings["cache"]
        return generate_llada(model, prompts, steps=steps, block_length=bl, cache=cache, **common)
    return generate_sdar(
        model, prompts, steps=settings["steps_per_block"], block_length=settings["block_length"], **common
    )


def _side(arch, model, prompts, settings, rs, mode: str, backend: str) -> Dict[str, Any]:
    """One side (eager or captured): a warm-up (captured: the graphs compiled), then one timed generation."""
    forward = TimedForward(model, mode, backend=backend)
    cuda = prompts.is_cuda
    committed = {"n": 0}

    # LLaDA's compiled prefix step has a graph per window length, the shortest first used at the
    # last block (sampling_llada.prefix_window): its warm-up is a whole generation
    blocks = rs.gen // settings["block_length"] if arch == "llada" and settings["cache"] == "prefix" else 2

    def stop_after_two_blocks(step, transfer, x):
        committed["n"] += int(transfer[0].sum())
        if committed["n"] >= blocks * settings["block_length"]:
            raise _WarmedUp

    start = time.perf_counter()
    try:  # both sides: one-time costs (the captured side's graphs, lazy kernels and masks) left out
        with torch.no_grad():
            _generate(arch, model, prompts, settings, rs, forward, stop_after_two_blocks)
    except _WarmedUp:
        pass
    warm_s = time.perf_counter() - start
    graphs, compile_s = forward.stats.graphs, forward.stats.compile_s
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    forward.timing, before = True, forward.stats.forwards
    synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        tokens = _generate(arch, model, prompts, settings, rs, forward)
    synchronize()
    seconds = time.perf_counter() - start
    forward.collect()
    n = forward.stats.forwards - before
    generated = tokens.shape[0] * rs.gen
    out = {
        "compile": mode,
        "seconds": round(seconds, 3),
        "tokens_per_s": generated / seconds,
        "forwards": n,
        "ms_per_forward": 1e3 * seconds / max(n, 1),
        "host_ms_per_forward": 1e3 * sum(forward.host) / max(n, 1),
        "device_ms_per_forward": 1e3 * sum(forward.device) / max(n, 1),
        "host_is": "wall of the call (kernels queued)" if cuda else "process CPU time",
        "device_is": "CUDA events around the call" if cuda else "wall time",
        "graphs": graphs,
        "compile_s": round(compile_s, 2),
        "warmup_s": round(warm_s, 2),
        "graphs_after_warmup": forward.stats.graphs - graphs,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    return out, tokens


def check_rollout(arch: str, sizes: Sizes, *, layers: Optional[int], backend: Optional[str], rows: Optional[int]):
    rs = sizes.rollout
    settings = recipe_rollout(arch)
    if rs.rows is not None or rows is not None:  # the CPU's scaled-down rows, or --rollout-rows
        settings["decode_rows"] = rows or rs.rows
        settings["decode_rows_from"] = "--rollout-rows" if rows else "the CPU sizes"
    n = settings["decode_rows"]
    group = math.gcd(n, settings["group_size"])  # rows of one prompt (the recipe: whole groups)
    settings["repeats"] = [group] * (n // group)
    backend = backend or rs.backend
    if not torch.cuda.is_available():  # one thread: process CPU time then reads as host time
        torch.set_num_threads(1)
    start = time.perf_counter()
    model, cfg = rollout_model(arch, rs, layers)
    build_s = time.perf_counter() - start
    device = check_device()
    gen = torch.Generator(device="cpu").manual_seed(1)
    prompts = torch.randint(3, cfg.vocab_size - 2, (n // group, rs.prompt), generator=gen).to(device)
    eager, eager_tokens = _side(arch, model, prompts, settings, rs, "none", backend)
    captured, tokens = _side(arch, model, prompts, settings, rs, "reduce-overhead", backend)
    same = tokens.shape == eager_tokens.shape and bool(torch.equal(tokens, eager_tokens))
    agree = float((tokens == eager_tokens).float().mean()) if tokens.shape == eager_tokens.shape else 0.0
    speedup = captured["tokens_per_s"] / eager["tokens_per_s"]
    out = {
        "shape": {
            "preset": EIGHT_B[arch] if rs.width is None else f"{arch}-tiny",
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "params": sum(p.numel() for p in model.parameters()),
            "dtype": rs.dtype,
            "prompt": rs.prompt,
            "gen": rs.gen,
            "rows": n,
            "build_s": round(build_s, 1),
        },
        "settings": {k: v for k, v in settings.items() if k != "repeats"},
        "backend": backend,
        "eager": eager,
        "captured": captured,
        "tokens_equal": same,
        "token_agreement": agree,
        "speedup": speedup,
    }
    out["status"] = "ok" if captured["graphs"] > 0 and captured["graphs_after_warmup"] == 0 else "FAIL"
    out["value"] = (
        f"{n} rows x {rs.gen} tokens, {cfg.num_layers} layers: eager {eager['tokens_per_s']:.0f} tok/s "
        f"({eager['ms_per_forward']:.1f} ms/fwd), captured {captured['tokens_per_s']:.0f} tok/s "
        f"({captured['ms_per_forward']:.1f} ms/fwd, {speedup:.2f}x, compile {captured['compile_s']:.0f} s), "
        f"tokens {'equal' if same else f'{100 * agree:.1f}% equal'}"
    )
    if out["status"] == "FAIL":
        out["value"] = (
            f"the captured side compiled {captured['graphs']} graph(s) in warm-up and {captured['graphs_after_warmup']} after; "
            + out["value"]
        )
    return out


def _cached_steps(model, cfg, ids: torch.Tensor, prompt: int) -> Dict[str, torch.Tensor]:
    """Logits of the cached block steps of ``model`` (eager :class:`DecodingForward`)."""
    forward = DecodingForward(model, "none")
    rows, length = ids.shape
    device = ids.device
    with torch.no_grad():
        cache = forward.cache(rows, length)
        if cfg.arch == "llada":  # dual cache: a filling forward, then a 32-token block step against it
            fill = forward(ids, kv_cache=cache, logit_positions=torch.arange(prompt, prompt + 32, device=device))
            slots = torch.arange(prompt + 32, prompt + 64, device=device)
            step = forward(ids[:, prompt + 32 : prompt + 64], kv_cache=cache, cache_slots=slots)
            return {"fill": fill.clone(), "block_step": step.clone()}
        bs = cfg.block_size
        layout = AttentionLayout.block_causal(bs)
        with cache.storing():
            model(ids[:, :prompt], attention_mask=layout, kv_cache=cache, logit_positions=slice(0, 0))
        slots = torch.arange(prompt, prompt + bs, device=device)
        step = forward(ids[:, prompt : prompt + bs], kv_cache=cache, cache_slots=slots, layout=layout)
        return {"block_step": step.clone()}


def _decode_agreement(sizes: Sizes, other: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    out = {}
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompt = sizes.seq
    for arch, preset in sizes.presets.items():
        cfg = shaped_preset(preset, sizes.layers)
        local, twin = _same_weights(cfg, other, arch)
        ids = torch.randint(3, cfg.vocab_size - 2, (2, prompt + 64), generator=gen).to(check_device())
        ours, theirs = _cached_steps(local, cfg, ids, prompt), _cached_steps(twin, cfg, ids, prompt)
        out[arch] = {k: rel_max(theirs[k], ours[k]) for k in ours}
        del local, twin
    return out


def check_te_vs_local_decode(sizes: Sizes) -> Dict[str, Any]:
    """TE vs local on the cached decoding steps; without TE the stock local layer, reported skipped."""
    reason = te_unavailable_reason()
    if reason:
        stock = _decode_agreement(sizes, {"use_te": False, "stock_local": True})
        worst = max(v for a in stock.values() for v in a.values())
        return {
            "status": "skipped",
            "detail": f"{reason} (the same cached steps, stock local layer vs ours: max rel |dlogit| {worst:.1e})",
            "stock_local": stock,
        }
    out: Dict[str, Any] = {"tolerance": BF16_REL_TOL, **_decode_agreement(sizes, {"use_te": True})}
    worst = max(v for a in sizes.presets for v in out[a].values())
    out.update(
        status="ok" if worst <= BF16_REL_TOL else "FAIL",
        value="max rel |dlogit| "
        + ", ".join(f"{a} {k} {v:.1e}" for a in sizes.presets for k, v in out[a].items())
        + f" (tolerance {BF16_REL_TOL:g})",
    )
    return out
