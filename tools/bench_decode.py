"""The captured decoding step on CPU: host time per forward, graphs per generation, rows per forward.

Three measurements (``models/decoding.py``), single process, TP=1, random weights, one CPU thread
by default; ``--json`` writes every figure:

- ``host``: one decoding forward at the 8B layer counts (32 LLaDA / 36 SDAR layers) but tiny width
  (hidden 64: nearly all of a forward is host time, Python and dispatch, the part a GPU decoder pays
  per launch), eager vs ``compile=default`` (inductor, Python wrapper) vs ``reduce-overhead`` (on
  CPU: inductor's C++ wrapper), for LLaDA's exact full-sequence step, its dual-cache block step
  (32 tokens) and SDAR's 4-token block step, at batch 1 and 16: median ms per forward (process CPU
  time; wall beside it), the compile seconds, and the largest logit difference to eager::

      PYTHONPATH=. .venv/bin/python tools/bench_decode.py host --json /tmp/decode_host.json

- ``graphs``: every decoding mode (LLaDA exact, prefix, dual, dual + threshold; SDAR, SDAR +
  threshold) in fp32 and bf16, batch 1 and 16, a 4-block generation twice: graphs compiled, the
  denoising step that compiled the last of them (none after the first step of block 2: SDAR's
  store-by-next-block step runs first there), graphs compiled by a second generation (0
  expected), and whether the tokens equal the eager sampler's. ``fullgraph=True`` turns any graph break into an error (reported as such)::

      PYTHONPATH=. .venv/bin/python tools/bench_decode.py graphs --backend aot_eager

- ``rows``: generated tokens per CPU-second of a recipe-shaped rollout (prompt 256, 256 new tokens;
  SDAR: block 4, 4 steps per block; LLaDA: dual cache, block 32, 128 steps) at 16, 64 and 128 rows
  per decoding forward, at the 8B layer count and tiny width (``--width``), eager or ``--compile``::

      PYTHONPATH=. .venv/bin/python tools/bench_decode.py rows --rows 16 64 128

- ``cold``: the cold compile seconds per graph (a fresh ``TORCHINDUCTOR_CACHE_DIR``, the FX graph
  cache off) and ms per forward of LLaDA's dual block step and SDAR's block step at 4 and at the 8B
  layer counts (batch 1, tiny width), eager, with the layers as one nested compile region (``on``,
  shipped) and inlined (``off``, as before issue 73)::

      PYTHONPATH=. .venv/bin/python tools/bench_decode.py cold --layers 4 32 --sdar-layers 4 36

- ``generate``: ms per LLaDA generation (``--cache``, default prefix; prompt ``--prompt-length``,
  ``--gen-length`` new tokens, ``--block-length``, ``--gen-steps``) at ``--batches``, eager vs each
  ``--modes`` compiled, ``--gen-layers`` layers at ``--width``: median CPU and wall ms of
  ``--gen-repeats`` generations after one warm-up (which compiles), graphs, tokens against eager
  (``--prefix-windows N``: the compiled prefix step's window count instead of the shipped one)::

      PYTHONPATH=. .venv/bin/python tools/bench_decode.py generate --batches 4 --modes none default

Compile time is paid once per process and shape; every timed figure excludes it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

MODES = ("none", "default", "reduce-overhead")


def _model(arch: str, layers: int, width: int, dtype=torch.float32, positions: int = 1024):
    from stabledrl_mcore.models import build_model, get_preset

    heads = max(1, width // 16)
    groups = heads if arch == "llada" else max(1, heads // 2)
    cfg = get_preset(
        f"{arch}-tiny",
        num_layers=layers,
        hidden_size=width,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=int(width * 2.75),
        max_position_embeddings=positions,
        init_std=0.2,
        **({"head_dim": 16} if arch == "sdar" else {}),
    )
    torch.manual_seed(0)
    return build_model(cfg, params_dtype=dtype).eval()


def _timed(fn, repeats: int):
    """(median CPU ms, median wall ms) of ``repeats`` calls after two warm-up calls."""
    fn()
    fn()
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        fn()
        cpu.append((time.process_time() - c) * 1e3)
        wall.append((time.perf_counter() - w) * 1e3)
    return statistics.median(cpu), statistics.median(wall)


def _step(model, fwd, step: str, x, P: int):
    """The timed forward of ``step`` on the rows ``x`` (prompt ``P`` tokens) through ``fwd``, after
    what it needs (a filled cache: a graph of its own for LLaDA's dual step, eager for SDAR)."""
    from stabledrl_mcore.models import AttentionLayout

    batch, L = x.shape
    if step == "exact":  # a full forward, the logits of one 32-token block
        read = torch.arange(P, P + 32)
        return lambda: fwd(x, logit_positions=read)
    cache = fwd.cache(batch, L)
    if step == "dual":  # the filled cache, then a 32-token block step against it
        fwd(x, kv_cache=cache, logit_positions=torch.arange(P, P + 32))
        slots = torch.arange(P + 64, P + 96)
        return lambda: fwd(x[:, P + 64 : P + 96], kv_cache=cache, cache_slots=slots)
    # SDAR: the prompt's blocks prefilled, a 4-token block step
    with cache.storing():
        model(x[:, :P], attention_mask=AttentionLayout.block_causal(4), kv_cache=cache)
    slots = torch.arange(P + 8, P + 12)
    layout = AttentionLayout.block_causal(4)
    return lambda: fwd(x[:, P + 8 : P + 12], kv_cache=cache, cache_slots=slots, layout=layout)


def host(args) -> list:
    """Per-forward host time of the three step kinds, eager vs compiled."""
    from stabledrl_mcore.models.decoding import DecodingForward

    P, G = args.prompt_length, args.gen_length
    L = P + G
    rows = []
    kinds = (("llada", "exact", 32), ("llada", "dual", 32), ("sdar", "block", 36))
    for arch, step, layers in [k for k in kinds if k[1] in args.steps]:
        model = _model(arch, layers, args.width)
        for batch in args.batches:
            x = torch.randint(3, 250, (batch, L), generator=torch.Generator().manual_seed(1))
            reference = None
            for mode in args.modes:
                torch._dynamo.reset()
                fwd = DecodingForward(model, mode)
                with torch.no_grad():
                    start = time.perf_counter()
                    call = _step(model, fwd, step, x, P)
                    out = call()
                    first_s = time.perf_counter() - start
                    cpu_ms, wall_ms = _timed(call, args.repeats)
                if reference is None:
                    reference = out
                row = dict(
                    arch=arch,
                    step=step,
                    layers=layers,
                    batch=batch,
                    compile=mode,
                    graphs=fwd.stats.graphs,
                    compile_s=round(fwd.stats.compile_s if fwd.compiled else first_s, 2),
                    cpu_ms=cpu_ms,
                    wall_ms=wall_ms,
                    max_abs_diff_to_eager=float((out - reference).abs().max()),
                )
                rows.append(row)
                print(
                    f"  {arch} {step} b{batch} {mode:>15}: {cpu_ms:7.2f} ms/forward (wall {wall_ms:.2f}), "
                    f"{row['graphs']} graph(s), compile {row['compile_s']} s, |diff| {row['max_abs_diff_to_eager']:.1e}",
                    flush=True,
                )
    for row in rows:
        eager = next(
            r
            for r in rows
            if (r["arch"], r["step"], r["batch"], r["compile"]) == (row["arch"], row["step"], row["batch"], "none")
        )
        row["host_speedup"] = eager["cpu_ms"] / row["cpu_ms"]
    return rows


GRAPH_MODES = {
    "llada-exact": ("llada", dict(cache="none", steps=8, block_length=4)),
    "llada-prefix": ("llada", dict(cache="prefix", steps=8, block_length=4)),
    "llada-dual": ("llada", dict(cache="dual", steps=8, block_length=4)),
    "llada-dual-threshold": ("llada", dict(cache="dual", steps=16, block_length=4, threshold=0.2)),
    "sdar": ("sdar", dict(steps=2)),
    "sdar-threshold": ("sdar", dict(steps=4, threshold=0.3)),
}


def graphs(args) -> list:
    """Graphs per generation for every mode, dtype and batch; tokens against eager."""
    from stabledrl_mcore.diffusion import generate_llada, generate_sdar
    from stabledrl_mcore.models.decoding import DecodingForward

    rows = []
    for name, (arch, options) in GRAPH_MODES.items():
        for dtype in (torch.float32, torch.bfloat16):
            model = _model(arch, 2, 64, dtype)
            for batch in args.batches:
                torch._dynamo.reset()
                ids = torch.randint(3, 250, (batch, 6), generator=torch.Generator().manual_seed(1))
                valid = torch.ones_like(ids, dtype=torch.bool)
                valid[-1, :2] = False
                fn = generate_llada if arch == "llada" else generate_sdar
                seen = []

                def on_step(step, *_):
                    seen.append(fwd.stats.graphs)

                fwd = DecodingForward(model, "default", backend=args.backend)
                row = dict(mode=name, dtype=str(dtype).replace("torch.", ""), batch=batch)
                try:
                    with torch.no_grad():
                        kw = dict(prompt_valid=valid, gen_length=16, progress=False, **options)
                        out = fn(model, ids, compile=fwd, on_step=on_step, **kw)
                        row["graphs"] = fwd.stats.graphs
                        row["steps"] = len(seen)  # denoising steps over the 4 blocks
                        row["last_graph_at_step"] = seen.index(row["graphs"]) + 1  # SDAR's store step: block 2
                        again = fn(model, ids, compile=fwd, **kw)
                        row["graphs_second_generation"] = fwd.stats.graphs - row["graphs"]
                        eager = fn(model, ids, **kw)
                        row["tokens_equal_eager"] = bool(torch.equal(out, eager) and torch.equal(again, eager))
                        row["graph_breaks"] = 0  # fullgraph=True: a break raises
                except Exception as err:  # reported, the other modes still run
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                rows.append(row)
                print(f"  {row}", flush=True)
    return rows


def rows_sweep(args) -> list:
    """Tokens per CPU-second of recipe-shaped rollouts at several rows per decoding forward."""
    from stabledrl_mcore.diffusion import generate_llada, generate_sdar

    P, G = args.prompt_length, args.gen_length
    out = []
    for arch in ("sdar", "llada"):
        model = _model(arch, 36 if arch == "sdar" else 32, args.width)
        for n in args.rows:
            ids = torch.randint(3, 250, (n, P), generator=torch.Generator().manual_seed(2))
            if arch == "sdar":
                kw = dict(gen_length=G, steps=4, temperature=1.0, threshold=None)
                fn = generate_sdar
            else:
                kw = dict(gen_length=G, steps=128, block_length=32, cache="dual", temperature=1.0)
                fn = generate_llada

            def run(n=n, fn=fn, kw=kw, ids=ids):
                return fn(
                    model, ids, generator=torch.Generator().manual_seed(3), progress=False, compile=args.compile, **kw
                )

            with torch.no_grad():
                run()  # warm-up (and compile)
                cpu, wall = time.process_time(), time.perf_counter()
                run()
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            row = dict(arch=arch, rows=n, tokens=n * G, cpu_s=cpu, wall_s=wall, tok_per_cpu_s=n * G / cpu)
            out.append(row)
            print(
                f"  {arch} rows {n}: {row['tok_per_cpu_s']:.0f} tok/cpu-s ({cpu:.1f} cpu-s, {wall:.1f} s wall)",
                flush=True,
            )
    return out


def cold_compile(args) -> list:
    """Cold compile seconds per graph (a fresh inductor cache, FX graph cache off) and ms per
    forward of the compiled step at several layer counts, with the layers as one nested compile
    region (the default) and without (``--regions on off``: each layer inlined, as before issue 73)."""
    import tempfile

    from stabledrl_mcore.models import model as model_module
    from stabledrl_mcore.models.decoding import DecodingForward

    P = args.prompt_length
    L = P + args.gen_length
    shipped = model_module._compiled_layer
    rows = []
    for arch, step in (("llada", "dual"), ("sdar", "block")):
        if step not in args.steps:
            continue
        for layers in args.layers if arch == "llada" else args.sdar_layers:
            model = _model(arch, layers, args.width)
            x = torch.randint(3, 250, (1, L), generator=torch.Generator().manual_seed(1))
            reference = None
            for region in ["none"] + args.regions:
                model_module._compiled_layer = shipped if region == "on" else model_module._layer
                torch._dynamo.reset()
                fwd = DecodingForward(model, "none" if region == "none" else "default")
                with tempfile.TemporaryDirectory(prefix="inductor-cold-") as cache_dir, torch.no_grad():
                    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
                    with torch._inductor.config.patch(fx_graph_cache=False):
                        call = _step(model, fwd, step, x, P)
                        out = call()
                        cpu_ms, wall_ms = _timed(call, args.repeats)
                model_module._compiled_layer = shipped
                reference = out if reference is None else reference
                graphs = fwd.stats.graphs
                row = dict(
                    arch=arch,
                    step=step,
                    layers=layers,
                    region=region,
                    graphs=graphs,
                    compile_s_per_graph=round(fwd.stats.compile_s / graphs, 1) if graphs else 0.0,
                    cpu_ms=cpu_ms,
                    wall_ms=wall_ms,
                    max_abs_diff_to_eager=float((out - reference).abs().max()),
                    load_avg=os.getloadavg()[0],
                )
                rows.append(row)
                print(
                    f"  {arch} {step} {layers} layers, region {region:>4}: {row['compile_s_per_graph']} s/graph cold "
                    f"({graphs} graphs), {cpu_ms:.2f} ms/forward (wall {wall_ms:.2f}), "
                    f"|diff| {row['max_abs_diff_to_eager']:.1e}, load {row['load_avg']:.1f}",
                    flush=True,
                )
    return rows


def generation(args) -> list:
    """Milliseconds per LLaDA generation, eager vs compiled, per batch."""
    from stabledrl_mcore.diffusion import generate_llada, sampling_llada
    from stabledrl_mcore.models.decoding import DecodingForward

    if args.prefix_windows and hasattr(sampling_llada, "PREFIX_WINDOWS"):
        sampling_llada.PREFIX_WINDOWS = args.prefix_windows
    model = _model("llada", args.gen_layers, args.width)
    kw = dict(
        gen_length=args.gen_length,
        block_length=args.block_length,
        steps=args.gen_steps,
        cache=args.cache,
        progress=False,
    )
    rows = []
    for batch in args.batches:
        ids = torch.randint(3, 250, (batch, args.prompt_length), generator=torch.Generator().manual_seed(2))
        eager = None
        for mode in args.modes:
            fwd = DecodingForward(model, mode)
            with torch.no_grad():
                out = generate_llada(model, ids, compile=fwd, **kw)  # warm-up: compiles
                cpu, wall = [], []
                for _ in range(args.gen_repeats):
                    c, w = time.process_time(), time.perf_counter()
                    generate_llada(model, ids, compile=fwd, **kw)
                    cpu.append((time.process_time() - c) * 1e3)
                    wall.append((time.perf_counter() - w) * 1e3)
            eager = out if mode == "none" else eager
            row = dict(
                cache=args.cache,
                batch=batch,
                compile=mode,
                cpu_ms=statistics.median(cpu),
                wall_ms=statistics.median(wall),
                graphs=fwd.stats.graphs,
                compile_s=round(fwd.stats.compile_s, 1),
                tokens_equal_eager=None if eager is None else bool(torch.equal(out, eager)),
                load_avg=os.getloadavg()[0],
            )
            rows.append(row)
            print(
                f"  {args.cache} b{batch} {mode:>15}: {row['cpu_ms']:.0f} ms/generation (wall {row['wall_ms']:.0f}), "
                f"{row['graphs']} graphs ({row['compile_s']} s), tokens = eager: {row['tokens_equal_eager']}, "
                f"load {row['load_avg']:.1f}",
                flush=True,
            )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("host", "graphs", "rows", "cold", "generate"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--steps",
        nargs="+",
        default=["dual", "block"],
        choices=("exact", "dual", "block"),
        help="host: step kinds (exact is a 512-token forward: compute, not host time, at batch 16)",
    )
    parser.add_argument("--width", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30, help="timed forwards per figure (host)")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--compile", default="none", choices=MODES, help="rows: how the rollout decodes")
    parser.add_argument("--backend", default="inductor", help="graphs: torch.compile backend (aot_eager: no codegen)")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32], help="cold: LLaDA layer counts")
    parser.add_argument("--sdar-layers", type=int, nargs="+", default=[4, 36], help="cold: SDAR layer counts")
    parser.add_argument(
        "--regions",
        nargs="+",
        default=["on", "off"],
        choices=("on", "off"),
        help="cold: the layers as one nested compile region (on, shipped) or inlined (off, before issue 73)",
    )
    parser.add_argument("--cache", default="prefix", choices=("none", "prefix", "dual"), help="generate: LLaDA cache")
    parser.add_argument("--gen-layers", type=int, default=4, help="generate: layers")
    parser.add_argument("--block-length", type=int, default=32, help="generate: block length")
    parser.add_argument("--gen-steps", type=int, default=128, help="generate: denoising steps")
    parser.add_argument("--gen-repeats", type=int, default=3, help="generate: timed generations")
    parser.add_argument("--prefix-windows", type=int, help="generate: window lengths of the compiled prefix step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1, seed=0)
    load = os.getloadavg()
    print(f"{args.what}: torch {torch.__version__}, {args.threads} thread(s), load {load[0]:.1f}", flush=True)
    results = {"host": host, "graphs": graphs, "rows": rows_sweep, "cold": cold_compile, "generate": generation}
    results = results[args.what](args)
    if args.json:
        meta = dict(argv=sys.argv, torch=torch.__version__, python=platform.python_version(), load_avg=load)
        with open(args.json, "w") as handle:
            json.dump(dict(meta=meta, rows=results), handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
