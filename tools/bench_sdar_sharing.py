#!/usr/bin/env python
"""Benchmark SDAR prefix sharing: rollout tokens/s of today's cached sampler vs shared decoding.

Both decode ``--prompts`` random left-padded prompts (``--prompt-len`` tokens, the
shorter ones padded) x ``--group`` completions of ``--new-tokens`` tokens with
the KV cache, exactly as ``generate_rollouts`` does:

- ``unshared`` (before issue 24): micro-batch by micro-batch (``--micro-batch``
  rows), each row's prompt prefilled on its own (prompts repeated G times);
- ``shared``: ``rl.group_rollout.group_rollouts``: batches of whole groups
  (``lcm(micro_batch, G)`` rows), each prompt prefilled once, every micro-batch
  drawing from its own generator as before.

Sampling uses the same generators, and the tokens of both are checked equal.
Timings are interleaved (unshared, shared, shared, unshared, ...); every
repetition is printed with its wall and process CPU time (on a shared machine
with one thread the CPU time is far less disturbed by other jobs), and the
medians reported.

    PYTHONPATH=. python tools/bench_sdar_sharing.py --model sdar-100m --group 8 --new-tokens 256 \\
        --micro-batch 8 --repeats 2 --json sdar_sharing.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def build(args):
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if "MASTER_PORT" not in os.environ:  # a free port: another benchmark may hold the default one
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1, seed=0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    return build_model(get_preset(args.model), params_dtype=dtype).eval()


def prompts(args, vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab - 1, (args.prompts, args.prompt_len), generator=g)
    valid = torch.ones_like(ids, dtype=torch.bool)
    for b in range(args.prompts):  # prompts of different lengths, left padded
        pad = (b * args.pad_step) % max(1, args.prompt_len // 2)
        valid[b, :pad] = False
        ids[b, :pad] = 0
    return ids, valid


def unshared(model, ids, valid, args, chunk_generator):
    """Today's ``generate_rollouts`` for SDAR: prompts repeated G times, one micro-batch at a time."""
    from stabledrl_mcore.diffusion import generate

    rep_ids, rep_valid = ids.repeat_interleave(args.group, 0), valid.repeat_interleave(args.group, 0)
    out = []
    for k, start in enumerate(range(0, rep_ids.shape[0], args.micro_batch)):
        sl = slice(start, start + args.micro_batch)
        out.append(
            generate(
                model,
                rep_ids[sl],
                gen_length=args.new_tokens,
                steps=args.steps,
                block_length=None,
                temperature=args.temperature,
                threshold=args.threshold,
                generator=chunk_generator(k),
                prompt_valid=rep_valid[sl],
                progress=False,
            )
        )
    return torch.cat(out)


def shared(model, ids, valid, args, chunk_generator):
    from stabledrl_mcore.rl.group_rollout import group_rollouts

    return torch.cat(
        group_rollouts(
            model,
            ids,
            valid,
            group_size=args.group,
            gen_length=args.new_tokens,
            steps=args.steps,
            block_length=None,
            temperature=args.temperature,
            threshold=args.threshold,
            micro_batch=args.micro_batch,
            chunk_generator=chunk_generator,
        )
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="sdar-100m", help="an SDAR preset (random init)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=190, help="longest prompt (others shorter, left padded)")
    p.add_argument("--pad-step", type=int, default=13, help="prompt b is b x this many tokens shorter")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="denoising steps per block")
    p.add_argument("--threshold", type=float, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch (parallel.micro_batch_size)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args)
    ids, valid = prompts(args, model.dllm_config.vocab_size)

    def chunk_generator(k):
        return torch.Generator().manual_seed(1000 + k)

    variants = {"unshared": unshared, "shared": shared}
    seconds = {n: [] for n in variants}
    cpu_seconds = {n: [] for n in variants}
    outputs = {}
    with torch.no_grad():
        for r in range(args.repeats):
            order = list(variants) if r % 2 == 0 else list(variants)[::-1]
            for name in order:
                start, cpu = time.perf_counter(), time.process_time()
                outputs[name] = variants[name](model, ids, valid, args, chunk_generator)
                seconds[name].append(time.perf_counter() - start)
                cpu_seconds[name].append(time.process_time() - cpu)
                print(
                    f"repetition {r + 1} {name}: {seconds[name][-1]:.2f} s (CPU {cpu_seconds[name][-1]:.2f} s)",
                    flush=True,
                )
    same = torch.equal(outputs["unshared"], outputs["shared"])
    rows = args.prompts * args.group
    tokens = rows * (outputs["shared"].shape[1] - ids.shape[1])  # generated positions
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "group": args.group,
        "new_tokens": args.new_tokens,
        "steps": args.steps,
        "threshold": args.threshold,
        "temperature": args.temperature,
        "micro_batch": args.micro_batch,
        "same_tokens": same,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "tokens": tokens,
        "load_average": os.getloadavg(),
    }
    for name in variants:
        result[f"{name}_tokens_per_s"] = tokens / statistics.median(seconds[name])
        result[f"{name}_tokens_per_cpu_s"] = tokens / statistics.median(cpu_seconds[name])
    result["speedup"] = result["shared_tokens_per_s"] / result["unshared_tokens_per_s"]
    result["speedup_cpu_time"] = result["shared_tokens_per_cpu_s"] / result["unshared_tokens_per_cpu_s"]
    print(
        f"{args.model} {args.dtype}, {torch.get_num_threads()} thread(s): {args.prompts} prompts x G={args.group}, "
        f"prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.steps} steps/block, "
        f"threshold {args.threshold}, micro-batch {args.micro_batch}"
    )
    for name in variants:
        print(
            f"  {name:<9} {result[f'{name}_tokens_per_s']:8.1f} tokens/s, "
            f"{result[f'{name}_tokens_per_cpu_s']:8.1f} tokens/CPU-s  "
            f"(seconds {', '.join(f'{s:.2f}' for s in seconds[name])}; "
            f"CPU {', '.join(f'{s:.2f}' for s in cpu_seconds[name])})"
        )
    print(
        f"  speed-up {result['speedup']:.2f}x wall, {result['speedup_cpu_time']:.2f}x CPU time "
        f"(load average {result['load_average'][0]:.1f}); same tokens: {same}"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
