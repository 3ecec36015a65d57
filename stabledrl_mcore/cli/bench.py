"""``stabledrl bench``: per-phase throughput, MFU, baseline speed-up and weak scaling of a config (the library side is :mod:`stabledrl_mcore.bench`)."""

from __future__ import annotations

import argparse

import torch

from stabledrl_mcore.bench.modes import mode_configs, parse_rollout_modes
from stabledrl_mcore.bench.phases import PHASES, bench_config
from stabledrl_mcore.bench.report import format_table, write_json
from stabledrl_mcore.bench.run import bench_in_process, parse_phases
from stabledrl_mcore.bench.scaling import weak_scaling
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.parallel.bootstrap import detect_launch_env


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML run config (see examples/configs/)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. model.preset=llada-100m rollout.gen_length=32",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON here")
    parser.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed runs per phase (default 1)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N", help="timed runs per phase (default 3)")
    parser.add_argument(
        "--phases", default="all", metavar="LIST", help=f"comma-separated subset of {','.join(PHASES)} (default all)"
    )
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the side-by-side plain-PyTorch baseline (default: only in a one-process run)",
    )
    parser.add_argument(
        "--dp-scaling",
        action="store_true",
        help="also run 2 local data-parallel ranks and report weak-scaling efficiency",
    )
    parser.add_argument(
        "--scaling-phases", default="step", metavar="LIST", help="phases measured at 1 and 2 ranks (default: step)"
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        metavar="X",
        help="peak to take MFU against (TFLOP/s, for the model's dtype), e.g. for a GPU missing from "
        "the table (default: rated bf16 peak of a bf16 model on a known GPU, else the "
        "matmul rate of the model's dtype measured in the run)",
    )
    parser.add_argument(
        "--rollout-mode",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="also time the rollout with these rollout.* overrides (repeatable; 'NAME:' alone is "
        "the config as given), e.g. --rollout-mode exact: --rollout-mode "
        "fast:rollout.threshold=0.9,rollout.steps=2; reports tokens/s, forwards per "
        "completion (NFE) and, with model.checkpoint, greedy held-out accuracy per mode",
    )
    parser.add_argument(
        "--keep-tokenizer-vocab",
        action="store_true",
        help="size the embedding to the tokenizer (default: keep the preset's vocabulary)",
    )


def run_bench(args: argparse.Namespace) -> int:
    """The ``stabledrl bench`` command."""

    phases = parse_phases(args.phases)
    if args.warmup < 0 or args.repeats < 1:
        raise ConfigError(f"--warmup must be >= 0 and --repeats >= 1 (got {args.warmup}, {args.repeats})")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise ConfigError(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    scaling_phases = parse_phases(args.scaling_phases) if args.dp_scaling else []
    cfg = bench_config(args.config, args.overrides, keep_tokenizer_vocab=args.keep_tokenizer_vocab)
    rollout_modes = None
    if args.rollout_mode:
        parsed = parse_rollout_modes(args.rollout_mode)
        configs = mode_configs(args.config, args.overrides, parsed, keep_tokenizer_vocab=args.keep_tokenizer_vocab)
        rollout_modes = {name: (overrides, configs[name]) for name, overrides in parsed}
    if cfg.parallel.threads:
        torch.set_num_threads(cfg.parallel.threads)

    launch = detect_launch_env()
    if args.dp_scaling and launch.world_size > 1:
        raise ConfigError("--dp-scaling starts its own local ranks: run it as one process, not under torchrun/srun")
    result = bench_in_process(
        cfg,
        phases,
        warmup=args.warmup,
        repeats=args.repeats,
        baseline=args.baseline,
        peak_tflops=args.peak_tflops,
        rollout_modes=rollout_modes,
    )
    if launch.rank != 0:
        return 0
    if args.dp_scaling:
        result["scaling"] = weak_scaling(
            args.config,
            list(args.overrides),
            scaling_phases,
            warmup=args.warmup,
            repeats=args.repeats,
            reference=result,
            keep_tokenizer_vocab=args.keep_tokenizer_vocab,
        )
        result["weak_scaling_efficiency"] = result["scaling"]["headline"]
    print(format_table(result), flush=True)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}", flush=True)
    return 0
