#!/usr/bin/env python
"""Benchmark the diffusion core (ratios, not timed tests).

(a) block ELBO: one staircase pass over [x_t | x_0] vs. the per-block loop, at
    ``--blocks`` blocks (the loop is timed both truncated to the clean prefix +
    noisy block and over the full sequence);
(b) SDAR decoding of ``--new-tokens`` tokens with the KV cache vs. without it
    (re-running the prefix every step), greedy, same tokens checked.

Models: ``--model toy`` (pure-torch toy dLLM, ``--hidden``/``--layers``) or
``--model sdar-tiny`` / any ``stabledrl_mcore.models`` preset (Megatron backbone,
TP=1, initialised in this process).

    PYTHONPATH=. python tools/bench_diffusion.py --model toy --json bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def build(args):
    if args.model == "toy":
        from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig

        cfg = ToyDLLMConfig(
            arch="sdar",
            vocab_size=args.vocab,
            mask_token_id=args.vocab - 1,
            block_size=4,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=max(1, args.hidden // 64),
        )
        return ToyDiffusionLM(cfg, seed=0).eval()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1, seed=0)
    return build_model(get_preset(args.model)).eval()


def timed(fns, repeats):
    """Min wall time of each function over ``repeats`` interleaved rounds (shared CPUs are noisy;
    interleaving exposes every variant to the same background load)."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def bench_staircase(model, args, vocab):
    from stabledrl_mcore.diffusion import block_elbo_loop, block_elbo_staircase

    bs = args.elbo_block_size
    n = bs * args.blocks
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab - 1, (args.batch, n), generator=g)
    comp = torch.zeros_like(ids, dtype=torch.bool)
    comp[:, bs // 2 :] = True  # the prompt ends inside the first block
    with torch.no_grad():
        plan = block_elbo_staircase(model, ids, comp, bs, generator=g).plan
        st = lambda: block_elbo_staircase(model, ids, comp, bs, plan=plan)  # noqa: E731
        lp = lambda: block_elbo_loop(model, ids, comp, bs, plan=plan)  # noqa: E731
        lf = lambda: block_elbo_loop(model, ids, comp, bs, plan=plan, truncate=False)  # noqa: E731
        diff = (st().seq - lp().seq).abs().max().item()
        t_st, t_loop, t_full = timed([st, lp, lf], args.repeats)
    return dict(
        block_size=bs,
        blocks=args.blocks,
        seq_len=n,
        batch=args.batch,
        staircase_s=t_st,
        loop_truncated_s=t_loop,
        loop_full_s=t_full,
        ratio_vs_truncated_loop=t_loop / t_st,
        ratio_vs_full_loop=t_full / t_st,
        max_abs_diff=diff,
    )


def bench_sdar(model, args, vocab):
    from stabledrl_mcore.diffusion import generate_sdar

    p = torch.randint(0, vocab - 1, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    kw = dict(gen_length=args.new_tokens, steps=args.steps, progress=False)
    outs = {}

    def run(use_cache):
        outs[use_cache] = generate_sdar(model, p, use_cache=use_cache, **kw)

    t_cache, t_plain = timed([lambda: run(True), lambda: run(False)], args.repeats)
    return dict(
        new_tokens=args.new_tokens,
        prompt_len=args.prompt_len,
        steps_per_block=args.steps,
        batch=args.batch,
        block_size=int(model.dllm_config.block_size),
        cache_s=t_cache,
        no_cache_s=t_plain,
        ratio=t_plain / t_cache,
        same_tokens=bool(torch.equal(outs[True], outs[False])),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="toy", help="'toy' or a stabledrl_mcore.models preset (e.g. sdar-tiny)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--elbo-block-size", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4, help="SDAR denoising steps per block")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args)
    vocab = int(model.dllm_config.vocab_size)
    result = dict(
        model=args.model,
        threads=torch.get_num_threads(),
        staircase=bench_staircase(model, args, vocab),
        sdar_decoding=bench_sdar(model, args, vocab),
    )
    s, d = result["staircase"], result["sdar_decoding"]
    print(
        f"[{args.model}] staircase vs per-block loop ({s['blocks']} blocks of {s['block_size']}, batch "
        f"{s['batch']}): {s['ratio_vs_truncated_loop']:.2f}x (truncated loop), {s['ratio_vs_full_loop']:.2f}x "
        f"(full-length loop); max |diff| {s['max_abs_diff']:.2e}"
    )
    print(
        f"[{args.model}] SDAR decoding {d['new_tokens']} new tokens, cache vs no cache: {d['ratio']:.2f}x "
        f"({d['cache_s']:.3f}s vs {d['no_cache_s']:.3f}s), same tokens: {d['same_tokens']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
