"""Flags and helpers more than one command shares: the config file and overrides, the world size, sampling and prompt flags."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from stabledrl_mcore.common.errors import ConfigError, UserError
from stabledrl_mcore.config.checks import COMPILE_MODES, check_sampler_shape
from stabledrl_mcore.config.schema import RunConfig, load_config
from stabledrl_mcore.engine import preemption
from stabledrl_mcore.tasks.prompts import PromptFormat, prompt_format
from stabledrl_mcore.tasks.tokenizer import load_tokenizer


def add_trust_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-unverified",
        action="store_true",
        help="load a converted or training checkpoint that has no checksums.json (written by an older "
        "stabledrl), unverified; refused by default. Links, FIFOs and devices in it are refused either way",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ckpt", required=True, metavar="DIR", help="HF directory, converted checkpoint or training checkpoint"
    )
    add_trust_argument(parser)
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer (default: the checkpoint's)")
    parser.add_argument("--gen-length", type=int, default=256, help="new tokens (default 256)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="diffusion steps: LLaDA total (default gen-length), SDAR per block (default the block size)",
    )
    parser.add_argument(
        "--block-length", type=int, default=None, help="LLaDA semi-AR block (default 32); SDAR uses its block size"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="confidence threshold, e.g. 0.9 (SDAR's dynamic rule; LLaDA: Fast-dLLM's parallel decoding)",
    )
    parser.add_argument(
        "--cache",
        default="none",
        choices=("none", "prefix", "dual"),
        help="LLaDA's approximate KV cache (default none: exact decoding)",
    )
    parser.add_argument(
        "--compile",
        default="none",
        choices=COMPILE_MODES,
        help="decoding forwards: none (eager, default), default (one torch.compile graph per kind of step), "
        "reduce-overhead (CUDA graphs on GPU); prompts are then left-padded to a multiple of 64 tokens",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="sequences per forward batch (eval --n K: batch-size // K prompts x K samples)",
    )
    add_prompt_arguments(parser)


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt format, as ``rollout.system_prompt`` / ``prompt_template`` / ``chat_template``."""
    parser.add_argument(
        "--system-prompt",
        metavar="TEXT",
        default=None,
        help="system prompt (eval default: the task's own; generate: none)",
    )
    parser.add_argument(
        "--prompt-template",
        metavar="TEXT",
        default=None,
        help="user turn with a {question} placeholder (default: the question as is)",
    )
    parser.add_argument(
        "--chat-template", metavar="FILE.jinja", default=None, help="Jinja chat template replacing the tokenizer's"
    )


PROMPT_FLAGS = ("--system-prompt", "--prompt-template", "--chat-template")


def cli_prompt_format(args: argparse.Namespace):
    """The checked :class:`~stabledrl_mcore.tasks.prompts.PromptFormat` of the prompt flags (one line if bad)."""

    return prompt_format(args.system_prompt, args.prompt_template, args.chat_template, names=PROMPT_FLAGS)


def cli_tokenizer(args):

    path = args.tokenizer or (
        os.path.join(args.ckpt, "hf") if os.path.isdir(os.path.join(args.ckpt, "hf")) else args.ckpt
    )
    return load_tokenizer(path)


SAMPLING_FLAGS = ("--gen-length", "--steps", "--block-length")


def sampling_options(args, cfg):
    """The sampler keywords of the sampling flags for a model of config ``cfg``; the sampler's shape
    rules (:func:`~stabledrl_mcore.config.checks.check_sampler_shape`) refused in one line naming the flags."""
    steps = args.steps or (args.gen_length if cfg.arch == "llada" else cfg.block_size)
    block = args.block_length or (min(32, args.gen_length) if cfg.arch == "llada" else None)
    if args.cache != "none" and cfg.arch != "llada":
        raise UserError(
            f"--cache {args.cache} is LLaDA's prefix/dual cache; this {cfg.arch} model decodes "
            f"with its own KV cache of finished blocks (drop --cache)"
        )
    if args.compile != "none" and (getattr(args, "tp", 1) > 1 or getattr(cfg, "is_moe", False)):
        what = f"--tp {args.tp}" if getattr(args, "tp", 1) > 1 else f"this mixture-of-experts {cfg.arch} model"
        raise UserError(
            f"--compile {args.compile} captures one rank's whole dense model; not with {what} (drop --compile)"
        )
    default_block = "" if args.block_length else " (the default)"
    try:
        check_sampler_shape(
            cfg.arch,
            getattr(cfg, "block_size", None),
            gen_length=args.gen_length,
            steps=steps,
            block_length=block,
            names=SAMPLING_FLAGS,
            sep=" ",
            description=f"the {cfg.arch} checkpoint",
        )
    except ConfigError as err:
        raise UserError(
            str(err).replace(f"--block-length {block}", f"--block-length {block}{default_block}", 1)
        ) from None
    return dict(
        gen_length=args.gen_length,
        steps=steps,
        block_length=block,
        temperature=args.temperature,
        threshold=args.threshold,
        cache=args.cache,
        compile=args.compile,
    )


def chat_prompt(text: str, tokenizer, prompt_format=None) -> str:
    """``text`` as a user turn of ``tokenizer``'s chat template (no system prompt unless
    ``prompt_format`` sets one), as ``eval`` formats its prompts (``PromptFormat.render``);
    unchanged without a template (the tokenizer's or ``--chat-template``), system prompt or
    prompt template."""

    fmt = prompt_format or PromptFormat()
    if not tokenizer.chat_template and fmt.is_default:
        return text
    return fmt.render(text, tokenizer)


def refuse_existing(command: str, path: str, overwrite: bool) -> bool:
    """Print the one-line refusal (and return True) when ``path`` exists and ``overwrite`` is off."""
    if overwrite or not os.path.exists(path):
        return False
    print(
        f"stabledrl {command}: error: {path} exists; pass --overwrite to replace it or --out FILE to write elsewhere",
        file=sys.stderr,
    )
    return True


def add_config_args(
    parser: argparse.ArgumentParser,
    config_help: str = "YAML run config (see examples/configs/)",
    overrides_help: str = "dotted overrides, e.g. algo.eps=0.1 parallel.tensor_parallel=2",
) -> None:
    parser.add_argument("--config", metavar="FILE", help=config_help)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides_help)


def world_size(nproc: Optional[int], default: Optional[int]) -> Optional[int]:
    """Ranks of the job: ``--nproc``, else the launcher's (torchrun, srun, sbatch), else ``default``."""
    if nproc is not None:
        return nproc
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return default


def run_config_from_args(args: argparse.Namespace, cls=None):
    """``(config, overrides)`` of ``train`` and ``sft``: the file plus overrides, ``--resume`` /
    ``--overwrite`` as ``checkpoint.*`` overrides (the ranks get the same); ``--nproc`` checked; pre-emption handlers installed first (unless
    ``--print-config``), so an early USR1 during the slow start-up is not fatal."""

    if not args.print_config:
        preemption.install_preemption_handlers()
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    overrides = list(args.overrides) + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    overrides += ["checkpoint.overwrite=true"] if args.overwrite else []
    return load_config(args.config, overrides, cls=cls or RunConfig), overrides


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a training run, ``train`` and ``sft`` alike: resume, overwrite, local ranks, print."""
    parser.add_argument(
        "--resume",
        default=None,
        metavar="auto|none|PATH",
        help="resume from the newest complete checkpoint (auto) or PATH",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a run directory that holds an earlier run (moved aside, never deleted)",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="start N local ranks (gloo on CPU); clusters use torchrun or srun instead",
    )
    parser.add_argument("--print-config", action="store_true", help="validate and print the resolved config, then exit")
