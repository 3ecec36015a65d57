"""LLaDA rollout throughput per decoding mode: exact vs prefix cache vs dual cache (+ threshold).

Single process, TP=1, one randomly initialised model of ``--preset`` (or ``--ckpt``), the
same left-padded random prompts for every mode. For each mode it times ``--repeats``
whole decodes (after one short warm-up) and prints completion tokens per second (the
median repeat), the speed-up over exact decoding, and the forwards per completion
(NFE): full-sequence forwards and cached block forwards apart. ``--gap`` adds each
cached mode's mean ``|log p_cached - log p_exact|`` of the committed tokens (it runs the
exact forward beside every cached step: slow, and excluded from the timing). Wall and
process CPU time are both reported: on a shared machine with ``--threads 1`` the CPU time
is the steadier figure::

    PYTHONPATH=. .venv/bin/python tools/bench_rollout.py --preset llada-100m --gen-length 256 \\
        --block-length 32 --steps 128 --batch 2 --repeats 2 --threads 1

A random model is never confident, so ``threshold`` commits only the schedule's count
there; give a trained ``--ckpt`` (and ``--task`` for its prompts) to see parallel decoding
cut the forwards, e.g. the demo's SFT model (``make demo``)::

    PYTHONPATH=. .venv/bin/python tools/bench_rollout.py --ckpt runs/demo/sft_checkpoint --task sudoku \\
        --gen-length 18 --block-length 6 --steps 18 --batch 100 --gap
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

MODES = {
    "exact": ("none", None),
    "prefix": ("prefix", None),
    "dual": ("dual", None),
    "dual+t0.9": ("dual", 0.9),
    "prefix+t0.9": ("prefix", 0.9),
    "exact+t0.9": ("none", 0.9),
}


def _model(args):
    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    if args.ckpt:
        from stabledrl_mcore.convert.loader import load_model

        return load_model(args.ckpt, device=args.device).model
    bootstrap.initialize(1, 1, seed=0)
    return build_model(get_preset(args.preset), device=args.device).eval()


def _prompts(cfg, batch, length, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(cfg.vocab_size, cfg.mask_token_id), (batch, length), generator=g)
    valid = torch.ones(batch, length, dtype=torch.bool)
    for row in range(batch):  # left padding as rollouts have it: up to a quarter of the prompt
        valid[row, : int(torch.randint(0, length // 4 + 1, (1,), generator=g))] = False
    return ids.to(device), valid.to(device)


def _task_prompts(args):
    """The first ``--batch`` test prompts of ``--task``, encoded with the checkpoint's tokenizer."""
    from stabledrl_mcore.cli.args import cli_tokenizer
    from stabledrl_mcore.tasks import get_task
    from stabledrl_mcore.tasks.prompts import encode_prompts

    tokenizer = cli_tokenizer(argparse.Namespace(tokenizer=None, ckpt=args.ckpt))
    task = get_task(args.task, prompt_style=args.prompt_style)
    examples = task.load("test", n=args.batch, seed=0)
    return encode_prompts(tokenizer, [task.prompt(ex, tokenizer) for ex in examples], device=args.device)


def run(args) -> dict:
    from stabledrl_mcore.diffusion import DecodeStats, generate_llada

    if args.threads:
        torch.set_num_threads(args.threads)
    model = _model(args)
    cfg = model.dllm_config
    if args.task:
        ids, valid = _task_prompts(args)
        args.prompt_length = ids.shape[1]
    else:
        ids, valid = _prompts(cfg, args.batch, args.prompt_length, args.device)
    sampling = dict(
        gen_length=args.gen_length,
        steps=args.steps,
        block_length=args.block_length,
        prompt_valid=valid,
        progress=False,
        temperature=args.temperature,
    )
    rows = {name: dict(seconds=[], cpu_seconds=[]) for name in args.modes}
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        for name in args.modes:  # warm-up: one block
            cache, threshold = MODES[name]
            generate_llada(
                model,
                ids,
                **dict(sampling, gen_length=args.block_length, steps=args.steps * args.block_length // args.gen_length),
                cache=cache,
                threshold=threshold,
                generator=torch.Generator().manual_seed(0),
            )
        for _ in range(args.repeats):  # the modes alternate, so machine noise hits them alike
            for name in args.modes:
                cache, threshold = MODES[name]
                stats = DecodeStats()
                sync()
                wall, cpu = time.perf_counter(), time.process_time()
                generate_llada(
                    model,
                    ids,
                    cache=cache,
                    threshold=threshold,
                    stats=stats,
                    generator=torch.Generator().manual_seed(0),
                    **sampling,
                )
                sync()
                row = rows[name]
                row["seconds"].append(time.perf_counter() - wall)
                row["cpu_seconds"].append(time.process_time() - cpu)
                row.update(full_forwards=stats.full_forwards, block_forwards=stats.block_forwards)
        for name in args.modes:
            row, tokens = rows[name], args.batch * args.gen_length
            row["tokens_per_s"] = [tokens / t for t in row["seconds"]]
            row["tokens_per_cpu_s"] = [tokens / t for t in row["cpu_seconds"]]
            cache, threshold = MODES[name]
            if args.gap and cache != "none":
                gap = DecodeStats(measure_gap=True)
                generate_llada(
                    model,
                    ids,
                    cache=cache,
                    threshold=threshold,
                    stats=gap,
                    generator=torch.Generator().manual_seed(0),
                    **sampling,
                )
                row["mean_gap"] = gap.mean_gap
    return dict(
        preset=args.ckpt or args.preset,
        batch=args.batch,
        prompt_length=args.prompt_length,
        gen_length=args.gen_length,
        block_length=args.block_length,
        steps=args.steps,
        threads=torch.get_num_threads(),
        device=args.device,
        modes=rows,
    )


def format_table(result: dict) -> str:
    modes = result["modes"]
    median = statistics.median
    base = modes.get("exact")
    lines = [
        f"{result['preset']}: batch {result['batch']}, prompt {result['prompt_length']}, "
        f"{result['gen_length']} new tokens, block {result['block_length']}, {result['steps']} steps, "
        f"{result['threads']} threads, {result['device']}",
        f"{'mode':<12} {'tok/s wall (each)':<22} {'tok/s cpu (each)':<22} {'speed-up wall/cpu':>18} "
        f"{'full fwd':>9} {'block fwd':>10} {'gap':>8}",
    ]
    for name, row in modes.items():
        wall = " / ".join(f"{t:.1f}" for t in row["tokens_per_s"])
        cpu = " / ".join(f"{t:.1f}" for t in row["tokens_per_cpu_s"])
        speed = (
            "-"
            if base is None
            else (
                f"{median(row['tokens_per_s']) / median(base['tokens_per_s']):.2f}x / "
                f"{median(row['tokens_per_cpu_s']) / median(base['tokens_per_cpu_s']):.2f}x"
            )
        )
        gap = f"{row['mean_gap']:.4f}" if "mean_gap" in row else "-"
        lines.append(
            f"{name:<12} {wall:<22} {cpu:<22} {speed:>18} {row['full_forwards']:>9} "
            f"{row['block_forwards']:>10} {gap:>8}"
        )
    lines.append(
        "speed-ups: medians over the repeats; forwards are per completion (one batched call decodes "
        "every row); gap: mean |log p_cached - log p_exact| of the committed tokens"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llada-100m")
    parser.add_argument("--ckpt", help="a checkpoint directory instead of a random --preset model")
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=64, help="random prompts' length (without --task)")
    parser.add_argument(
        "--task",
        help="with --ckpt: the task's test prompts (generated tasks: sudoku, countdown) instead of random ones",
    )
    parser.add_argument("--prompt-style", default="compact", choices=("chat", "compact"))
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--modes", nargs="+", default=["exact", "prefix", "dual", "dual+t0.9"], choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gap", action="store_true", help="also measure the cached modes' log-prob gap")
    parser.add_argument("--json", metavar="FILE", help="write the raw figures")
    args = parser.parse_args(argv)
    if args.task and not args.ckpt:
        parser.error("--task needs --ckpt (a model and tokenizer trained on it)")
    result = run(args)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
