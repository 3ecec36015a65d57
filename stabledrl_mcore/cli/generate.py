"""``stabledrl generate``: completions from an HF directory, a converted checkpoint or a training checkpoint (``step_XXXXXXXX``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

import torch
from tqdm.auto import tqdm

from stabledrl_mcore.cli.args import (
    PROMPT_FLAGS,
    add_config_args,
    add_sampling_arguments,
    chat_prompt,
    cli_prompt_format,
    cli_tokenizer,
    refuse_existing,
    sampling_options,
)
from stabledrl_mcore.cli.data_args import GENERATE_FIELDS, command_config, command_task, names_a_task
from stabledrl_mcore.common.errors import UserError
from stabledrl_mcore.common.files import special_kind
from stabledrl_mcore.convert.loader import check_loadable, load_model, read_config
from stabledrl_mcore.diffusion import generate
from stabledrl_mcore.evaluation.scoring import write_jsonl
from stabledrl_mcore.models.decoding import prompt_padding
from stabledrl_mcore.models.placement import eval_mode, model_device
from stabledrl_mcore.tasks.base import Example
from stabledrl_mcore.tasks.from_config import refuse_long_questions
from stabledrl_mcore.tasks.prompts import encode_prompts

GENERATE_FLAGS = (
    "--prompt",
    "--prompts",
    "--out",
    "--overwrite",
    "--no-chat-template",
    "--config",
    "--system-prompt",
    "--prompt-template",
    "--chat-template",
    "--gen-length",
    "--steps",
    "--block-length",
    "--temperature",
    "--threshold",
    "--cache",
    "--compile",
    "--ckpt",
    "--tokenizer",
    "--seed",
    "--batch-size",
)
"""The flags a hint of generate may name (tests/test_eval_options.py checks each against the parser)."""


def _prompt_renderer(args: argparse.Namespace, tokenizer):
    """``text -> prompt``: as given (``--no-chat-template``); with ``--config`` or ``rollout.task``
    as the run's task renders its questions (its system prompt, template, chat template, prompt
    style: the prompts it trained on); else a user turn of the chat template (the prompt flags and
    ``rollout.*`` prompt overrides apply, no system prompt unless one is given)."""

    if args.no_chat_template:
        return lambda text: text
    if not (args.config or args.overrides):
        fmt = cli_prompt_format(args)
        return lambda text: chat_prompt(text, tokenizer, fmt)
    cfg = command_config(args, "generate", GENERATE_FIELDS, GENERATE_FLAGS)
    task = command_task(cfg, args, GENERATE_FLAGS)
    if names_a_task(args):
        return lambda text: task.prompt(Example(prompt=text, reference=None), tokenizer)
    if cfg.rollout.prompt_style == "compact":  # no task named: its system prompt does not apply
        return lambda text: text
    fmt = task.prompt_format
    return lambda text: chat_prompt(text, tokenizer, fmt)


def run_generate(args: argparse.Namespace) -> int:
    """Single process: print (or write as JSONL) one completion per prompt.

    Prompts go through the tokenizer's chat template (``--no-chat-template``: as given; ``--config``
    / ``rollout.*`` overrides: as the run's task renders them); each JSONL record holds the
    ``input`` as given and the exact ``prompt`` the model saw."""

    prompts: List[str] = list(args.prompt or [])
    lines: List[int] = []  # --prompts FILE: each prompt's line number (1-based)
    if args.prompts:
        kind = special_kind(args.prompts)
        if kind:  # reading a FIFO would block until something writes to it
            raise UserError(
                f"--prompts {args.prompts} is {kind}, not a regular file; give a text file, one prompt a line"
            )
        with open(args.prompts) as handle:
            numbered = [(n, line.rstrip("\n")) for n, line in enumerate(handle, 1) if line.strip()]
        lines = [n for n, _ in numbered]
        prompts += [text for _, text in numbered]
    if not prompts:
        print("stabledrl generate: error: give --prompt TEXT or --prompts FILE", file=sys.stderr)
        return 2
    if args.out and refuse_existing("generate", args.out, args.overwrite):
        return 2
    given = [f for f in PROMPT_FLAGS if getattr(args, f[2:].replace("-", "_")) is not None]
    if args.no_chat_template and (given or args.config or args.overrides):
        what = "/".join(given + (["--config"] if args.config else []) + (["the overrides"] if args.overrides else []))
        raise UserError(f"--no-chat-template feeds the prompts as given; drop it or {what}")
    if not os.path.isdir(args.ckpt):
        raise UserError(f"--ckpt {args.ckpt}: no such checkpoint directory")
    check_loadable(args.ckpt, trust_unverified=args.trust_unverified)
    mcfg = read_config(args.ckpt)
    sampling_options(args, mcfg)  # the sampler's shape rules, before the model loads
    given_n = len(args.prompt or [])  # before tokenising: a question longer than the positions allow
    for source, labels, texts in (
        ("--prompt", [f"#{i + 1}" for i in range(given_n)], prompts[:given_n]),
        (f"--prompts {args.prompts}", [f"line {n}" for n in lines], prompts[given_n:]),
    ):
        refuse_long_questions(zip(labels, texts), source, mcfg, args.gen_length, "--gen-length")
    tokenizer = cli_tokenizer(args)
    render = _prompt_renderer(args, tokenizer)
    texts = [render(p) for p in prompts]
    model = load_model(args.ckpt, trust_unverified=args.trust_unverified)
    sampling = sampling_options(args, model.config)
    device = model_device(model)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    results = []
    with tqdm(total=len(prompts), desc="generate", unit="prompt", disable=args.no_progress, dynamic_ncols=True) as bar:
        for start in range(0, len(prompts), args.batch_size):
            chunk = texts[start : start + args.batch_size]
            padding = prompt_padding(args.compile, model, sampling.get("block_length"))
            ids, valid = encode_prompts(tokenizer, chunk, device=device, **padding)
            with torch.no_grad(), eval_mode(model):
                out = generate(model, ids, generator=generator, prompt_valid=valid, progress=False, **sampling)
            results += [
                {"input": given, "prompt": text, "completion": tokenizer.decode(row)}
                for given, text, row in zip(prompts[start:], chunk, out[:, ids.shape[1] :].tolist())
            ]
            bar.update(len(chunk))
    if args.out:
        write_jsonl(args.out, results)
    else:
        for record in results:
            print(record["completion"])
    return 0


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_sampling_arguments(parser)
    add_config_args(
        parser,
        "a run config: render the prompts as its task does (its system prompt, template, chat template)",
        "rollout.* prompt overrides as in train, e.g. rollout.task=gsm8k rollout.system_prompt=''",
    )
    parser.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable)")
    parser.add_argument("--prompts", metavar="FILE", help="one prompt per line")
    parser.add_argument(
        "--out", metavar="FILE", help="write JSONL (input, exact prompt, completion) instead of printing"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument(
        "--no-chat-template",
        action="store_true",
        help="feed the prompts as given (default: the tokenizer's chat template, as eval)",
    )
    parser.add_argument("--no-progress", action="store_true")
