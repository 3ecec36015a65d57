"""``stabledrl generate``: completions from an HF directory, a converted checkpoint or a training checkpoint (``step_XXXXXXXX``)."""

from __future__ import annotations

import argparse
import sys
from typing import List

import torch

from stabledrl_mcore.checkpoint.loader import load_model
from stabledrl_mcore.cli.args import (
    PROMPT_FLAGS,
    add_sampling_arguments,
    chat_prompt,
    cli_prompt_format,
    cli_tokenizer,
    refuse_existing,
    sampling_options,
)
from stabledrl_mcore.diffusion import generate
from stabledrl_mcore.evaluation.scoring import write_jsonl
from stabledrl_mcore.models.placement import eval_mode, model_device
from stabledrl_mcore.tasks.prompts import encode_prompts


def run_generate(args: argparse.Namespace) -> int:
    """Single process: print (or write as JSONL) one completion per prompt.

    Prompts go through the tokenizer's chat template (``--no-chat-template``: as given);
    each JSONL record holds the ``input`` as given and the exact ``prompt`` the model saw."""

    prompts: List[str] = list(args.prompt or [])
    if args.prompts:
        with open(args.prompts) as handle:
            prompts += [line.rstrip("\n") for line in handle if line.strip()]
    if not prompts:
        print("stabledrl generate: error: give --prompt TEXT or --prompts FILE", file=sys.stderr)
        return 2
    if args.out and refuse_existing("generate", args.out, args.overwrite):
        return 2
    if args.no_chat_template and any(getattr(args, f[2:].replace("-", "_")) is not None for f in PROMPT_FLAGS):
        print(
            f"stabledrl generate: error: --no-chat-template feeds the prompts as given; drop it or "
            f"{'/'.join(PROMPT_FLAGS)}",
            file=sys.stderr,
        )
        return 2
    fmt = cli_prompt_format(args)
    tokenizer = cli_tokenizer(args)
    texts = prompts if args.no_chat_template else [chat_prompt(p, tokenizer, fmt) for p in prompts]
    model = load_model(args.ckpt)
    sampling = sampling_options(args, model.config)
    device = model_device(model)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    results = []
    for start in range(0, len(prompts), args.batch_size):
        chunk = texts[start : start + args.batch_size]
        ids, valid = encode_prompts(tokenizer, chunk, device=device)
        with torch.no_grad(), eval_mode(model):
            out = generate(
                model, ids, generator=generator, prompt_valid=valid, progress=not args.no_progress, **sampling
            )
        results += [
            {"input": given, "prompt": text, "completion": tokenizer.decode(row)}
            for given, text, row in zip(prompts[start:], chunk, out[:, ids.shape[1] :].tolist())
        ]
    if args.out:
        write_jsonl(args.out, results)
    else:
        for record in results:
            print(record["completion"])
    return 0


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_sampling_arguments(parser)
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
