"""``stabledrl sft``: masked-diffusion SFT from a config file plus dotted overrides (like ``train``)."""

from __future__ import annotations

import argparse

import yaml

from stabledrl_mcore.cli.args import add_run_arguments, run_config_from_args, world_size
from stabledrl_mcore.cli.preflight import preflight_sft
from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.engine.preemption import EXIT_PREEMPTED
from stabledrl_mcore.parallel import launch
from stabledrl_mcore.parallel.launch import exit_status
from stabledrl_mcore.sft.config import SFTConfig
from stabledrl_mcore.sft.trainer import sft_rank


def add_sft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML SFT config (see examples/sft/tiny_cpu.yaml)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. sft.data_path=data.jsonl model.checkpoint=DIR",
    )
    add_run_arguments(parser)


def run_sft(args: argparse.Namespace) -> int:
    """Preflight (config, model, data, run directory) before any rank starts, then the ranks."""

    cfg, overrides = run_config_from_args(args, SFTConfig)
    summary = preflight_sft(cfg, world_size=world_size(args.nproc, None if args.print_config else 1))
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        print(f"# {summary}")
        return 0
    print(summary, flush=True)

    if args.nproc is not None and args.nproc > 1:
        return exit_status(
            launch.spawn(
                sft_rank,
                args.nproc,
                (args.config, tuple(overrides)),
                timeout=float("inf"),
                threads=cfg.parallel.threads,
                expected_codes=(EXIT_PREEMPTED,),
                hold_signals=True,
            )
        )
    return sft_rank(args.config, overrides)
