"""``stabledrl plan``: per-GPU memory and throughput of a layout (the planner is :mod:`stabledrl_mcore.bench.plan`)."""

from __future__ import annotations

import argparse
import dataclasses

from stabledrl_mcore.bench.plan import PlanSpec, all_layouts, estimate, format_plan, layout_key
from stabledrl_mcore.bench.plan_plot import check_plot_path, plot_plan
from stabledrl_mcore.bench.report import write_json
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.schema import RolloutSection
from stabledrl_mcore.models.presets import ModelConfigError, get_preset


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", required=True, metavar="PRESET", help="llada-8b, sdar-8b or any model preset")
    a("--nodes", type=int, default=1)
    a("--gpus-per-node", type=int, default=8)
    a("--gpu-memory", type=float, default=80.0, metavar="GIB", help="memory per GPU (GiB)")
    a("--tp", type=int, default=1)
    a("--pp", type=int, default=1)
    a("--ep", type=int, default=1, help="expert parallel (mixture-of-experts models; PP must be 1)")
    a("--etp", type=int, default=None, help="expert tensor parallel (default: --tp)")
    a("--micro-batch", type=int, default=2, help="sequences per forward/backward micro-batch")
    a(
        "--group-size",
        type=int,
        default=RolloutSection.group_size,
        help=f"completions per prompt (rollout.group_size; default {RolloutSection.group_size})",
    )
    a(
        "--decode-rows",
        type=int,
        default=None,
        help="rows per decoding forward (rollout.decode_rows): a multiple of lcm(--micro-batch, --group-size), "
        "by default that lcm, the fewest a run decodes (as train's preflight counts them)",
    )
    a(
        "--rollout-cache",
        default="none",
        choices=["none", "prefix", "dual"],
        help="LLaDA's rollout.cache (SDAR always caches)",
    )
    a("--seq-len", type=int, default=512, help="prompt + completion tokens")
    a("--gen-length", type=int, default=None, help="completion tokens (default: half of --seq-len)")
    a("--global-batch", type=int, default=1024, help="sequences per step (prompts x group size)")
    a("--recompute", default="none", choices=["none", "full", "selective"])
    a("--dtype", default="bf16", choices=["bf16", "fp32"])
    a("--optimizer", default="adam", choices=["adam", "sgd"])
    a("--no-distributed-optimizer", action="store_true", help="replicate optimizer states over DP")
    a(
        "--likelihood",
        default=None,
        choices=["elbo", "staircase"],
        help="training layout (default: elbo for LLaDA, staircase for SDAR)",
    )
    a("--impl", default="te", choices=["te", "local"], help="kernels whose saved activations to count")
    a("--overhead", type=float, default=4.0, metavar="GIB", help="CUDA context, buffers, fragmentation")
    a("--gpu-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (989 = H100/H200)")
    a("--mfu", type=float, default=0.40, help="assumed training MFU")
    a("--rollout-mfu", type=float, default=0.10, help="assumed rollout MFU")
    a("--rollout-steps", type=int, default=None, help="LLaDA: total denoising steps; SDAR: steps per block")
    a("--num-mc", type=int, default=2)
    a("--inner", type=int, default=2, help="policy updates per rollout batch")
    a(
        "--reference-model",
        action="store_true",
        help="count a frozen reference copy of the weights (the KL penalty, algo.kl_coef > 0)",
    )
    a(
        "--lora-rank",
        type=int,
        default=0,
        help="model.lora.rank (all-linear): train adapters only; no reference copy (default 0: full parameters)",
    )
    a("--json", metavar="PATH", help="also write the estimates as JSON")
    a("--plot", metavar="FILE.png", help="also draw every layout's per-GPU memory by component (bar chart)")


def spec_from_args(args: argparse.Namespace) -> PlanSpec:

    try:
        model = get_preset(args.model)
    except ModelConfigError as err:
        raise ConfigError(f"--model: {err}") from None
    return PlanSpec(
        model=model,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_gib=args.gpu_memory,
        tp=args.tp,
        pp=args.pp,
        micro_batch=args.micro_batch,
        decode_rows=args.decode_rows,
        group_size=args.group_size,
        rollout_cache=args.rollout_cache,
        seq_len=args.seq_len,
        gen_length=args.gen_length or max(args.seq_len // 2, 1),
        global_batch=args.global_batch,
        recompute=args.recompute,
        dtype=args.dtype,
        optimizer=args.optimizer,
        distributed_optimizer=not args.no_distributed_optimizer,
        likelihood=args.likelihood or ("staircase" if model.arch == "sdar" else "elbo"),
        impl=args.impl,
        overhead_gib=args.overhead,
        peak_tflops=args.gpu_tflops,
        mfu=args.mfu,
        rollout_mfu=args.rollout_mfu,
        rollout_steps=args.rollout_steps,
        num_mc=args.num_mc,
        inner_iterations=args.inner,
        reference_model=args.reference_model,
        lora_rank=args.lora_rank,
        ep=args.ep,
        etp=args.etp,
    ).validate()


def run_plan(args: argparse.Namespace) -> int:
    """The ``stabledrl plan`` command: the requested layout in detail, then every layout."""
    spec = spec_from_args(args)
    if args.plot:
        check_plot_path(args.plot)
    chosen = estimate(spec)
    rows = all_layouts(spec)
    print(format_plan(spec, chosen, rows))
    if args.json:
        plain = dataclasses.asdict(dataclasses.replace(spec, model=None))
        params = {"total": spec.model.num_parameters(), "active": spec.model.num_active_parameters()}
        write_json(
            {"spec": dict(plain, model=args.model), "model_params": params, "chosen": chosen, "layouts": rows},
            args.json,
        )
    if args.plot:
        plot_plan(
            rows,
            spec.gpu_memory_gib,
            args.plot,
            title=format_plan(spec, chosen, rows).splitlines()[0],
            requested=layout_key(chosen),
        )
        print(f"written: {args.plot}")
    return 0
