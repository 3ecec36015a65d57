"""Forward+backward throughput of a Megatron backbone vs the same ``transformers`` model.

Single process, TP=1, same shapes, same loss (sum of per-token log-probs of
random targets), measured in one run with the two models alternating so that
machine noise hits both. LLaDA is compared with ``LlamaForCausalLM`` given an
all-zero additive 4-D mask (bidirectional); SDAR with ``Qwen3ForCausalLM``
given the equivalent dense additive mask (staircase over ``[x_t | x_0]`` by
default, the training workload). Not a test: it prints numbers. The headline
ratio is the median of per-step-pair CPU-time ratios (transformers / megatron,
> 1 means Megatron is faster); with one intra-op thread (the default) both
models run the same kernels on the same core.

``--reference stock-megatron`` times the same backbone built from Megatron's
stock local layer instead (its own linears and ``SelfAttention``, only the core
attention ours; same weights): what the local spec's changes buy, in one run.

    PYTHONPATH=. .venv/bin/python tools/bench_backbone.py --preset llada-tiny \
        --seq-len 128 --batch 8 --steps 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch


def _hf_model(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from stabledrl_mcore.convert.hf_config import transformers_shape

    common = transformers_shape(cfg, tied=False, attn_implementation="sdpa")
    if cfg.arch == "llada":
        return LlamaForCausalLM(LlamaConfig(mlp_bias=False, **common))
    return Qwen3ForCausalLM(Qwen3Config(use_sliding_window=False, **common))


def _inputs(cfg, mode, batch, seq_len):
    from stabledrl_mcore.models import AttentionLayout, staircase_position_ids

    gen = torch.Generator().manual_seed(0)
    if mode == "staircase":
        n = seq_len // 2
        ids = torch.randint(0, cfg.vocab_size, (batch, 2 * n), generator=gen)
        layout, pos = AttentionLayout.staircase(cfg.block_size), staircase_position_ids(n)
    else:
        ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)
        pos = torch.arange(seq_len)[None]
        layout = (
            AttentionLayout.bidirectional() if mode == "bidirectional" else AttentionLayout.block_causal(cfg.block_size)
        )
    s = ids.shape[1]
    blocked = layout.dense(s, s)
    blocked = torch.zeros(1, 1, s, s, dtype=torch.bool) if blocked is None else blocked
    hf_mask = torch.zeros(batch, 1, s, s).masked_fill(blocked, torch.finfo(torch.float32).min)
    targets = torch.randint(0, cfg.vocab_size, ids.shape, generator=gen)
    return ids, pos.expand(batch, -1), layout, hf_mask, targets


def _median_ratio(theirs, ours) -> float:
    """Median over paired steps of ``theirs[i] / ours[i]`` (> 1: ours is faster)."""
    return statistics.median(t / o for t, o in zip(theirs, ours))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llada-tiny")
    parser.add_argument(
        "--mode",
        default="auto",
        choices=["auto", "bidirectional", "block_causal", "staircase"],
        help="auto: bidirectional for LLaDA, staircase for SDAR",
    )
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per row (staircase: 2n)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model (median taken)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1 is fastest for small models on few cores)"
    )
    parser.add_argument(
        "--reference",
        default="transformers",
        choices=["transformers", "stock-megatron"],
        help="what to time against (see the module docstring)",
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    from stabledrl_mcore.models import build_model, get_preset, vocab_parallel_log_probs
    from stabledrl_mcore.parallel import bootstrap

    cfg = get_preset(args.preset)
    mode = args.mode if args.mode != "auto" else ("bidirectional" if cfg.arch == "llada" else "staircase")
    bootstrap.initialize(1, 1, seed=0)
    torch.manual_seed(0)
    ours = build_model(cfg).train()
    ids, pos, layout, hf_mask, targets = _inputs(cfg, mode, args.batch, args.seq_len)
    stock = args.reference == "stock-megatron"
    if stock:  # Megatron's stock local layer with our weights
        theirs = build_model(cfg, use_te=False, stock_local=True).train()
        theirs.load_state_dict(ours.state_dict())
    else:
        theirs = _hf_model(cfg).float().train()

    def step_ours():
        vocab_parallel_log_probs(ours(ids, pos, layout), targets).sum().backward()
        ours.zero_grad(set_to_none=True)

    def step_theirs():
        logits = (
            theirs(ids, pos, layout)
            if stock
            else theirs(input_ids=ids, attention_mask=hf_mask, position_ids=pos).logits
        )
        vocab_parallel_log_probs(logits, targets).sum().backward()
        theirs.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step_ours()
        step_theirs()
    # Steps alternate A B B A ... and each is timed alone, in wall time and in process
    # CPU time: on a shared machine CPU time is far less disturbed by other jobs, so
    # the ratio is taken from it (with one intra-op thread both clocks agree when idle).
    wall = {"megatron": [], "transformers": []}
    cpu = {"megatron": [], "transformers": []}
    pair = [("megatron", step_ours), ("transformers", step_theirs)]
    for i in range(args.steps):
        for name, fn in pair if i % 2 == 0 else pair[::-1]:
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    tokens = ids.numel()
    result = {
        "preset": args.preset,
        "mode": mode,
        "batch": args.batch,
        "seq_len": ids.shape[1],
        "params": cfg.num_parameters(),
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "torch": torch.__version__,
        "reference": args.reference,
    }
    for name in wall:
        result[f"{name}_step_s"] = statistics.median(wall[name])
        result[f"{name}_cpu_step_s"] = statistics.median(cpu[name])
        result[f"{name}_tokens_per_s"] = tokens / result[f"{name}_step_s"]
        result[f"{name}_tokens_per_cpu_s"] = tokens / result[f"{name}_cpu_step_s"]
    # The ratio is the median over steps of the per-pair ratio (the two steps of a
    # pair ran back to back, so a slow phase of the machine cancels out), which is
    # steadier than the ratio of the two medians (also reported, as *_of_medians).
    result["ratio"] = _median_ratio(cpu["transformers"], cpu["megatron"])
    result["ratio_wall"] = _median_ratio(wall["transformers"], wall["megatron"])
    result["ratio_of_medians"] = result["transformers_cpu_step_s"] / result["megatron_cpu_step_s"]
    result["ratio_wall_of_medians"] = result["transformers_step_s"] / result["megatron_step_s"]
    print(
        f"{args.preset} ({cfg.num_parameters() / 1e6:.1f}M params, {mode}, batch {args.batch} x "
        f"{ids.shape[1]} tokens, {result['threads']} threads)"
    )
    for name in wall:
        print(
            f"  {name:<13} {result[f'{name}_tokens_per_cpu_s']:>10.0f} tokens/CPU-s "
            f"{result[f'{name}_tokens_per_s']:>10.0f} tokens/s  "
            f"(median of {args.steps} fwd+bwd steps: {1e3 * result[f'{name}_cpu_step_s']:.1f} ms CPU, "
            f"{1e3 * result[f'{name}_step_s']:.1f} ms wall)"
        )
    reference = "stock megatron" if stock else "transformers"
    if stock:
        print("  (the 'transformers' line is the stock Megatron-Core local layer)")
    print(
        f"  throughput ratio megatron/{reference} = {result['ratio']:.3f}x "
        f"(median of per-step-pair CPU-time ratios; wall-clock {result['ratio_wall']:.3f}x; "
        f"ratio of medians {result['ratio_of_medians']:.3f}x)"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    bootstrap.destroy()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
