"""``stabledrl sft``: masked-diffusion SFT from a config file plus dotted overrides (like ``train``);
the preflight (and ``--print-config``) here, without Megatron-Core; the ranks in :mod:`.ranks`."""

from __future__ import annotations

import argparse

import yaml

from stabledrl_mcore.cli.app import StartRanks
from stabledrl_mcore.cli.args import add_run_arguments, run_config_from_args, world_size
from stabledrl_mcore.cli.preflight import preflight_sft
from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.sft.config import SFTConfig


def add_sft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML SFT config (see examples/sft/tiny_cpu.yaml)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. sft.data_path=data.jsonl model.checkpoint=DIR",
    )
    add_run_arguments(parser)


def run_sft(args: argparse.Namespace):
    """Preflight (config, model, data, run directory) before any rank starts; ``--print-config``
    ends here, else :class:`StartRanks` for :func:`~.ranks.start_sft`."""

    cfg, overrides = run_config_from_args(args, SFTConfig)
    summary = preflight_sft(cfg, world_size=world_size(args.nproc, None if args.print_config else 1))
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        print(f"# {summary}")
        return 0
    print(summary, flush=True)
    return StartRanks(cfg, overrides)
