"""Our samplers vs the peers' released code: same random model, same prompts, one CPU thread.

Side by side, A/B interleaved (ours, theirs, ours, theirs, ... ``--repeats`` times after one
warm-up each; medians), process CPU time and wall time, token agreement (greedy: exact equality
expected). Workloads (``--workloads``, default all):

- ``exact``: ``generate_llada(cache="none")`` vs ML-GSAI/LLaDA ``generate.py:generate``, batch 1;
- ``dual`` / ``prefix``: ``cache="dual"`` / ``"prefix"`` vs Fast-dLLM ``generate_with_dual_cache`` /
  ``generate_with_prefix_cache``, batch 1 and 4 (that Fast-dLLM code is batch-1 only, so its batch 4
  is four batch-1 calls; the row says so);
- ``sdar``: ``generate_sdar`` vs SDAR ``generate.py:block_diffusion_generate`` (``low_confidence_static``,
  block 4, 4 steps per block), batch 1; plus ours alone for one prompt x group 16 (``repeats=16``);
- ``forward``: our model's forward vs Fast-dLLM's ``LLaDAModelLM`` forward, batch 1 and 4 x 320 tokens.

The random model is written in the upstream Hugging Face layout (``tests/hf_fixtures.py``), loaded
for the peers by their own modeling files (ML-GSAI/LLaDA ships none: its ``generate`` runs on
Fast-dLLM's ``modeling_llada.py``, the LLaDA-8B remote code plus a KV cache) and for us converted
with ``stabledrl convert hf-to-mcore --verify`` and loaded with ``load_model``. CUDA-only imports of
the peers get CPU stand-ins (``tools/peer_adapters.py``), listed in the output ("stand-ins:").

The peers need the transformers they were written for (SDAR's modeling file: 4.52/4.53), so run this
in a side environment of its own, which ``tools/peers_env.sh`` builds: a venv that inherits nothing
from the project's ``.venv`` (whose transformers 5 pulls ``kernels``, which needs huggingface-hub >= 1
and breaks the peers' transformers 4.53.3), with torch, this repository (editable) and transformers
4.53.3. Nothing of the peers enters the repo; from the repository root::

    tools/peers_env.sh /tmp/peers/venv
    # clones (or `git archive` exports) of the peers; the output's "peers:" line names each one's
    # commit (`git rev-parse HEAD`; an export has no .git: write the commit to DIR/PEER_COMMIT,
    # e.g. `git -C <clone> rev-parse HEAD > /tmp/peers/sdar/PEER_COMMIT`, or it reads "unknown")
    git clone https://github.com/NVlabs/Fast-dLLM /tmp/peers/fast-dllm
    git clone https://github.com/ML-GSAI/LLaDA /tmp/peers/llada
    git clone https://github.com/JetAstra/SDAR /tmp/peers/sdar

    /tmp/peers/venv/bin/python tools/bench_peers.py --shape 20m \\
        --fast-dllm /tmp/peers/fast-dllm --llada /tmp/peers/llada --sdar /tmp/peers/sdar \\
        --json /tmp/peers/results/20m.json
    /tmp/peers/venv/bin/python tools/bench_peers.py --shape llada-100m --repeats 2 \\
        --workloads exact dual prefix forward --fast-dllm /tmp/peers/fast-dllm --llada /tmp/peers/llada \\
        --json /tmp/peers/results/llada-100m.json
    /tmp/peers/venv/bin/python tools/bench_peers.py --shape sdar-100m --repeats 2 \\
        --workloads sdar --sdar /tmp/peers/sdar --json /tmp/peers/results/sdar-100m.json
    # smoke run (tiny shape and lengths, a few minutes)
    /tmp/peers/venv/bin/python tools/bench_peers.py --quick --fast-dllm /tmp/peers/fast-dllm \\
        --llada /tmp/peers/llada --sdar /tmp/peers/sdar

Shapes: ``20m`` (hidden 512, 4 layers, 8 heads of 64, FFN 1408, vocab 8192; SDAR: 4 KV heads, qk-norm,
block 4), ``llada-100m`` / ``sdar-100m`` (the presets; a LLaDA-only or SDAR-only preset runs the
other architecture at the same widths). tokens/s = generated tokens / CPU seconds (``forward``:
input tokens); "ours/theirs" > 1 means ours is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_adapters as pa  # noqa: E402

WORKLOADS = ("exact", "dual", "prefix", "sdar", "forward")
NEEDS = {
    "exact": ("fast_dllm", "llada"),
    "dual": ("fast_dllm",),
    "prefix": ("fast_dllm",),
    "sdar": ("sdar",),
    "forward": ("fast_dllm",),
}
FLAGS = {"fast_dllm": "--fast-dllm", "llada": "--llada", "sdar": "--sdar"}


def shape_configs(shape: str):
    """(llada DLLMConfig, sdar DLLMConfig) of a named shape."""
    from stabledrl_mcore.models import get_preset

    if shape in ("20m", "quick"):
        h, layers, vocab, ffn = (512, 4, 8192, 1408) if shape == "20m" else (128, 2, 512, 352)
        common = dict(
            hidden_size=h,
            num_layers=layers,
            vocab_size=vocab,
            ffn_hidden_size=ffn,
            num_attention_heads=h // 64,
            max_position_embeddings=2048,
            mask_token_id=vocab - 1,
            eos_token_id=2,
            pad_token_id=0,
            bos_token_id=1,
        )  # the 100m presets' ids
        return (
            get_preset("llada-100m", **common, num_query_groups=h // 64),
            get_preset("sdar-100m", **common, num_query_groups=max(1, h // 128), head_dim=64),
        )
    if shape in ("llada-100m", "sdar-100m"):
        return get_preset("llada-100m"), get_preset("sdar-100m")
    raise SystemExit(f"bench_peers: error: unknown --shape {shape!r} (20m, llada-100m, sdar-100m)")


def prompts(cfg, batch: int, length: int, seed: int) -> torch.Tensor:
    """Random ids, never a special id (pad/bos/eos below 3, mask = the last id)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg.mask_token_id, (batch, length), generator=g)


class Counter:
    """Forward calls of a module (a pre-hook: both sides counted the same way). Forwards inside a
    compiled decoding graph are counted by its ``DecodingForward.stats`` instead: a hook that
    changed a Python int inside the graph would recompile it per call."""

    def __init__(self, module):
        self.n = 0
        self.module = module
        self._compiled_seen = self._compiled()
        module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        if not torch.compiler.is_compiling():
            self.n += 1

    def _compiled(self) -> int:
        held = self.module.__dict__.get("_decoding_forwards", {})
        return sum(f.stats.forwards for f in held.values() if f.compiled)

    def take(self) -> int:
        compiled = self._compiled()
        n, self.n = self.n + compiled - self._compiled_seen, 0
        self._compiled_seen = compiled
        return n


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).double().mean())


def ab(
    name: str,
    batch: int,
    tokens: int,
    ours,
    theirs,
    warm_ours,
    warm_theirs,
    repeats: int,
    counters,
    compare,
    note: str = "",
    compile: str = "none",
) -> dict:
    """A/B interleaved timing of two zero-argument callables; ``compare(out_ours, out_theirs)``.
    ``compile``: how ours decoded (a label of the row; the warm-up compiled its graphs)."""
    warm_ours()
    warm_theirs()
    sides = {"ours": dict(cpu_s=[], wall_s=[]), "theirs": dict(cpu_s=[], wall_s=[])}
    outs = {}
    for c in counters.values():
        c.take()
    for _ in range(repeats):
        for side, fn in (("ours", ours), ("theirs", theirs)):
            outs[side], wall, cpu = timed(fn)
            sides[side]["cpu_s"].append(cpu)
            sides[side]["wall_s"].append(wall)
            sides[side]["forwards"] = counters[side].take() if side in counters else None
    for row in sides.values():
        row["tok_per_cpu_s"] = tokens / statistics.median(row["cpu_s"])
        row["tok_per_wall_s"] = tokens / statistics.median(row["wall_s"])
    out = dict(
        workload=name,
        compile=compile,
        batch=batch,
        tokens=tokens,
        ours=sides["ours"],
        theirs=sides["theirs"],
        ratio_cpu=sides["ours"]["tok_per_cpu_s"] / sides["theirs"]["tok_per_cpu_s"],
        ratio_wall=sides["ours"]["tok_per_wall_s"] / sides["theirs"]["tok_per_wall_s"],
        note=note,
    )
    out.update(compare(outs["ours"], outs["theirs"]))
    print(
        f"  {name} b{batch} ({compile}): ours {sides['ours']['tok_per_cpu_s']:.1f} tok/cpu-s, theirs "
        f"{sides['theirs']['tok_per_cpu_s']:.1f}, ours/theirs {out['ratio_cpu']:.2f}x, "
        f"agreement {out.get('agreement', float('nan')):.4f}",
        flush=True,
    )
    return out


def ours_alone(
    name: str, batch: int, tokens: int, fn, warm, repeats: int, counter, note: str = "", compile: str = "none"
) -> dict:
    warm()
    counter.take()
    row = dict(cpu_s=[], wall_s=[])
    for _ in range(repeats):
        _, wall, cpu = timed(fn)
        row["cpu_s"].append(cpu)
        row["wall_s"].append(wall)
    row["forwards"] = counter.take() // repeats
    row["tok_per_cpu_s"] = tokens / statistics.median(row["cpu_s"])
    row["tok_per_wall_s"] = tokens / statistics.median(row["wall_s"])
    print(f"  {name} b{batch} ({compile}): ours {row['tok_per_cpu_s']:.1f} tok/cpu-s (theirs: n/a)", flush=True)
    return dict(workload=name, compile=compile, batch=batch, tokens=tokens, ours=row, theirs=None, note=note)


def gen_compare(P: int, G: int):
    def compare(a, b):
        a, b = a[:, P : P + G], b[:, P : P + G]
        first = (a != b).reshape(-1).nonzero()
        return dict(agreement=agreement(a, b), first_difference=int(first[0]) if len(first) else None)

    return compare


def logit_compare(a, b):
    return dict(agreement=agreement(a.argmax(-1), b.argmax(-1)), max_abs_logit_diff=float((a - b).abs().max()))


def llada_workloads(args, peers, cfg, hf_dir, mcore_dir, out: list, meta: dict) -> None:
    from stabledrl_mcore.convert.loader import load_model
    from stabledrl_mcore.diffusion import generate_llada

    fd, lg = peers.get("fast_dllm"), peers.get("llada")
    ours_m, theirs_m = load_model(mcore_dir), pa.peer_model(fd.model_cls, hf_dir)
    counters = {"ours": Counter(ours_m), "theirs": Counter(theirs_m)}
    P, G, BL, S, M = args.prompt_length, args.gen_length, args.block_length, args.steps, cfg.mask_token_id
    ids4 = prompts(cfg, 4, P, args.seed)
    probe = prompts(cfg, 2, P + G, args.seed + 1)
    with torch.no_grad():
        meta["llada_logit_check"] = logit_compare(ours_m(probe), theirs_m(probe).logits)
    spb = S // (G // BL)
    kw = dict(gen_length=G, steps=S, block_length=BL, temperature=0.0, progress=False)

    def warm(ours_kw):  # a compiled sampler warms up at the timed shape (its graphs depend on it)
        return ours_kw if ours_kw["compile"] != "none" else dict(ours_kw, gen_length=BL, steps=spb)

    peer_kw = dict(steps=S, gen_length=G, block_length=BL, temperature=0.0, remasking="low_confidence", mask_id=M)
    peer_warm = dict(peer_kw, gen_length=BL, steps=spb)
    compare = gen_compare(P, G)
    for name in [w for w in args.workloads if w != "sdar"]:
        print(f"{name}:", flush=True)
        if name == "exact":
            ids = ids4[:1]
            for mode in args.compile:
                ours_kw = dict(kw, compile=mode)
                out.append(
                    ab(
                        name,
                        1,
                        G,
                        lambda ours_kw=ours_kw: generate_llada(ours_m, ids, cache="none", **ours_kw),
                        lambda: lg.generate(theirs_m, ids, **peer_kw),
                        lambda ours_kw=ours_kw: generate_llada(ours_m, ids, cache="none", **warm(ours_kw)),
                        lambda: lg.generate(theirs_m, ids, **peer_warm),
                        args.repeats,
                        counters,
                        compare,
                        note="theirs: ML-GSAI/LLaDA generate on Fast-dLLM's LLaDAModelLM",
                        compile=mode,
                    )
                )
        elif name in ("dual", "prefix"):
            fn = fd.dual if name == "dual" else fd.prefix
            for b in args.batches:
                ids = ids4[:b]

                def theirs(ids=ids, kw_=peer_kw):  # this Fast-dLLM code builds x with batch 1
                    return torch.cat([fn(theirs_m, ids[r : r + 1], **kw_)[0] for r in range(ids.shape[0])])

                for mode in args.compile:
                    ours_kw = dict(kw, compile=mode)
                    out.append(
                        ab(
                            name,
                            b,
                            b * G,
                            lambda ids=ids, ours_kw=ours_kw: generate_llada(ours_m, ids, cache=name, **ours_kw),
                            theirs,
                            lambda ids=ids, ours_kw=ours_kw: generate_llada(ours_m, ids, cache=name, **warm(ours_kw)),
                            lambda ids=ids: theirs(ids, peer_warm),
                            args.repeats,
                            counters,
                            compare,
                            note="" if b == 1 else f"theirs: {b} batch-1 calls (Fast-dLLM code is batch 1)",
                            compile=mode,
                        )
                    )
        elif name == "forward":
            L = args.forward_length
            for b in args.batches:
                x = prompts(cfg, b, L, args.seed + 2)

                def loop(f, x=x):
                    with torch.no_grad():
                        for _ in range(args.forward_iters - 1):
                            f(x)
                        return f(x)

                ours_f, theirs_f = (lambda x: ours_m(x)), (lambda x: theirs_m(x).logits)
                out.append(
                    ab(
                        name,
                        b,
                        args.forward_iters * b * L,
                        lambda: loop(ours_f),
                        lambda: loop(theirs_f),
                        lambda: loop(ours_f),
                        lambda: loop(theirs_f),
                        args.repeats,
                        counters,
                        logit_compare,
                        note=f"{args.forward_iters} forwards of {b}x{L} per sample; tokens = input tokens",
                    )
                )


def sdar_workload(args, peers, cfg, hf_dir, mcore_dir, out: list, meta: dict) -> None:
    from stabledrl_mcore.convert.loader import load_model
    from stabledrl_mcore.diffusion import generate_sdar
    from stabledrl_mcore.models import block_causal_mask

    sd = peers["sdar"]
    ours_m, theirs_m = load_model(mcore_dir), pa.peer_model(sd.model_cls, hf_dir)
    counters = {"ours": Counter(ours_m), "theirs": Counter(theirs_m)}
    P, G, BS, S = args.prompt_length, args.sdar_gen_length, args.sdar_block, args.sdar_steps
    ids = prompts(cfg, 1, P, args.seed)
    L = P + G
    probe = prompts(cfg, 2, L, args.seed + 1)
    allowed = ~block_causal_mask(L, BS)[0]
    with torch.no_grad():
        ref = theirs_m(probe, attention_mask=allowed, position_ids=torch.arange(L)[None]).logits
        meta["sdar_logit_check"] = logit_compare(ours_m(probe), ref)
    greedy = args.sdar_sampling == "greedy"
    temp = 0.0 if greedy else 1.0
    kw = dict(gen_length=G, steps=S, block_length=BS, temperature=temp, progress=False)
    peer_kw = dict(
        mask_id=cfg.mask_token_id,
        gen_length=G,
        block_length=BS,
        denoising_steps=S,
        temperature=1.0,
        remasking_strategy="low_confidence_static",
    )

    def ours(ids=ids, g=G, **extra):
        gen = None if greedy else torch.Generator().manual_seed(args.seed)
        return generate_sdar(ours_m, ids, generator=gen, **dict(kw, gen_length=g), **extra)

    def ours_warm(mode, **extra):  # a compiled sampler warms up at the timed shape
        return ours(compile=mode, **extra) if mode != "none" else ours(g=warm, compile=mode, **extra)

    def theirs(g=G):
        torch.manual_seed(args.seed)
        return sd.generate(theirs_m, {"input_ids": ids}, **dict(peer_kw, gen_length=g))

    print("sdar:", flush=True)
    warm = 8 * BS
    for mode in args.compile:
        out.append(
            ab(
                "sdar",
                1,
                G,
                lambda mode=mode: ours(compile=mode),
                theirs,
                lambda mode=mode: ours_warm(mode),
                lambda: theirs(warm),
                args.repeats,
                counters,
                gen_compare(P, G),
                note="theirs: block_diffusion_generate, low_confidence_static"
                + ("" if greedy else "; both sample at temperature 1 (own RNG streams: agreement not expected)"),
                compile=mode,
            )
        )
        if args.group:
            out.append(
                ours_alone(
                    "sdar-group",
                    args.group,
                    args.group * G,
                    lambda mode=mode: ours(repeats=args.group, compile=mode),
                    lambda mode=mode: ours_warm(mode, repeats=args.group),
                    args.repeats,
                    counters["ours"],
                    note=f"ours only: 1 prompt x {args.group} completions (repeats=, prefix shared)",
                    compile=mode,
                )
            )


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    for w in args.workloads:
        for peer in NEEDS[w]:
            if getattr(args, peer) is None:
                raise pa.PeerError(f"workload {w} needs {FLAGS[peer]} DIR")
    peers = {}
    if any(w in args.workloads for w in ("exact", "dual", "prefix", "forward")):
        peers["fast_dllm"] = pa.load_fast_dllm(args.fast_dllm)
    if "exact" in args.workloads:
        peers["llada"] = pa.load_llada(args.llada)
    if "sdar" in args.workloads:
        peers["sdar"] = pa.load_sdar(args.sdar, greedy=args.sdar_sampling == "greedy")
    llada_cfg, sdar_cfg = shape_configs("quick" if args.quick else args.shape)
    work = args.work or os.path.join("/tmp", f"bench_peers_{'quick' if args.quick else args.shape}")
    os.makedirs(work, exist_ok=True)
    import transformers

    import stabledrl_mcore

    meta = dict(
        argv=sys.argv,
        shape="quick" if args.quick else args.shape,
        threads=torch.get_num_threads(),
        seed=args.seed,
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        ours=str(Path(stabledrl_mcore.__file__).parents[1]),
        ours_commit=pa.git_commit(Path(stabledrl_mcore.__file__).parents[1]),
        peers={k: dict(path=str(getattr(args, k)), commit=v.commit) for k, v in peers.items()},
        prompt_length=args.prompt_length,
        gen_length=args.gen_length,
        block_length=args.block_length,
        steps=args.steps,
        sdar=dict(
            gen_length=args.sdar_gen_length,
            block=args.sdar_block,
            steps_per_block=args.sdar_steps,
            sampling=args.sdar_sampling,
        ),
        forward_length=args.forward_length,
        repeats=args.repeats,
        batches=args.batches,
        ours_compile=args.compile,
    )
    rows = []
    if any(w != "sdar" for w in args.workloads):
        model_arg = "llada-100m" if args.shape in ("llada-100m", "sdar-100m") and not args.quick else "llada"
        hf, mc = pa.build_checkpoints("llada", llada_cfg, work, model_arg, args.seed, args.fresh)
        meta["llada_config"], meta["llada_convert"] = llada_cfg.to_dict(), pa.convert_log(work, "llada")
        llada_workloads(args, peers, llada_cfg, hf, mc, rows, meta)
    if "sdar" in args.workloads:
        model_arg = "sdar-100m" if args.shape in ("llada-100m", "sdar-100m") and not args.quick else "sdar"
        hf, mc = pa.build_checkpoints(
            "sdar",
            sdar_cfg,
            work,
            model_arg,
            args.seed,
            args.fresh,
            extra=pa.peer_config_extras(peers["sdar"].model_dir, "sdar"),
        )
        meta["sdar_config"], meta["sdar_convert"] = sdar_cfg.to_dict(), pa.convert_log(work, "sdar")
        sdar_workload(args, peers, sdar_cfg, hf, mc, rows, meta)
    meta["stand_ins"] = list(pa.STAND_INS)
    return dict(meta=meta, rows=rows)


def format_table(result: dict) -> str:
    m = result["meta"]
    lines = [
        f"shape {m['shape']}, {m['threads']} thread(s), torch {m['torch']}, transformers {m['transformers']}; "
        f"prompt {m['prompt_length']}, LLaDA {m['gen_length']} new tokens / block {m['block_length']} / "
        f"{m['steps']} steps, SDAR {m['sdar']['gen_length']} new tokens / block {m['sdar']['block']} / "
        f"{m['sdar']['steps_per_block']} steps per block ({m['sdar']['sampling']}); medians of "
        f"{m['repeats']} A/B repeats",
        "",
        "| workload | ours compiled | batch | ours tok/cpu-s | theirs tok/cpu-s | ours/theirs cpu | ours/theirs wall | "
        "token agreement | forwards per call ours/theirs | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        o, t = r["ours"], r["theirs"]
        agree = f"{r['agreement']:.4f}" if "agreement" in r else "-"
        if "max_abs_logit_diff" in r:
            agree += f" (max abs logit diff {r['max_abs_logit_diff']:.1e})"
        elif r.get("first_difference") is not None:
            agree += f" (first diff at flat index {r['first_difference']})"
        if t is None:
            lines.append(
                f"| {r['workload']} | {r.get('compile', 'none')} | {r['batch']} | {o['tok_per_cpu_s']:.1f} | n/a | - | - | - | "
                f"{o['forwards']} / - | {r['note']} |"
            )
            continue
        lines.append(
            f"| {r['workload']} | {r.get('compile', 'none')} | {r['batch']} | {o['tok_per_cpu_s']:.1f} | {t['tok_per_cpu_s']:.1f} | "
            f"{r['ratio_cpu']:.2f}x | {r['ratio_wall']:.2f}x | {agree} | "
            f"{o['forwards']} / {t['forwards']} | {r['note']} |"
        )
    lines.append("")
    for key in ("llada", "sdar"):
        if f"{key}_logit_check" in m:
            c = m[f"{key}_logit_check"]
            lines.append(
                f"{key} model check (ours vs peer modeling file, 2x{m['prompt_length'] + m['gen_length']}"
                f" tokens): max abs logit diff {c['max_abs_logit_diff']:.2e}, argmax agreement "
                f"{c['agreement']:.4f}; converter: {m.get(key + '_convert') or '-'}"
            )
    lines.append("stand-ins: " + ("; ".join(m["stand_ins"]) or "none"))
    lines.append("peers: " + ", ".join(f"{k} {v['commit'][:12]} ({v['path']})" for k, v in m["peers"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast-dllm", dest="fast_dllm", metavar="DIR", help="clone of NVlabs/Fast-dLLM")
    parser.add_argument("--llada", metavar="DIR", help="clone of ML-GSAI/LLaDA")
    parser.add_argument("--sdar", metavar="DIR", help="clone of JetAstra/SDAR")
    parser.add_argument("--shape", default="20m", choices=("20m", "llada-100m", "sdar-100m"))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="dual/prefix/forward batches")
    parser.add_argument(
        "--compile",
        nargs="+",
        default=["none", "default"],
        choices=("none", "default", "reduce-overhead"),
        help="how our samplers decode, each a row beside theirs (default: eager and compiled)",
    )
    parser.add_argument("--sdar-gen-length", type=int, default=256)
    parser.add_argument("--sdar-block", type=int, default=4)
    parser.add_argument("--sdar-steps", type=int, default=4, help="denoising steps per block")
    parser.add_argument(
        "--sdar-sampling",
        choices=("greedy", "theirs"),
        default="greedy",
        help="greedy: their sampler swapped for argmax (stand-in); theirs: both at temperature 1",
    )
    parser.add_argument("--group", type=int, default=16, help="ours-only SDAR group size (0: skip)")
    parser.add_argument("--forward-length", type=int, default=320)
    parser.add_argument("--forward-iters", type=int, default=4, help="forwards per timed forward sample")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", metavar="DIR", help="model directories (default /tmp/bench_peers_<shape>)")
    parser.add_argument("--fresh", action="store_true", help="rebuild and reconvert the models")
    parser.add_argument("--quick", action="store_true", help="tiny shape and lengths: a smoke run")
    parser.add_argument("--json", metavar="PATH", help="write the figures")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_length, args.gen_length, args.block_length, args.steps = 16, 32, 8, 16
        args.sdar_gen_length, args.forward_length, args.repeats, args.group = 16, 48, 1, 4
        args.forward_iters = 2
    if args.gen_length % args.block_length or args.steps % (args.gen_length // args.block_length):
        parser.error("--gen-length must be a multiple of --block-length, --steps of the number of blocks")
    try:
        result = run(args)
    except pa.PeerError as err:
        print(f"bench_peers: error: {err}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
