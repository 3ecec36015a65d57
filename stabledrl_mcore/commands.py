"""``stabledrl generate`` and ``stabledrl eval``: checkpoint in, completions / accuracy out.

Both take an HF directory, a converted checkpoint or a training checkpoint
(``step_XXXXXXXX``). ``eval`` runs on the training layout: examples sharded
over data-parallel ranks, the model under tensor parallelism (``--tp``), one
command from a laptop (``--nproc``) to a cluster (torchrun / srun).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, metavar="DIR",
                        help="HF directory, converted checkpoint or training checkpoint")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer (default: the checkpoint's)")
    parser.add_argument("--gen-length", type=int, default=256, help="new tokens (default 256)")
    parser.add_argument("--steps", type=int, default=None,
                        help="diffusion steps: LLaDA total (default gen-length), SDAR per block "
                             "(default the block size)")
    parser.add_argument("--block-length", type=int, default=None,
                        help="LLaDA semi-AR block (default 32); SDAR uses its block size")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="confidence threshold, e.g. 0.9 (SDAR's dynamic rule; LLaDA: Fast-dLLM's "
                             "parallel decoding)")
    parser.add_argument("--cache", default="none", choices=("none", "prefix", "dual"),
                        help="LLaDA's approximate KV cache (default none: exact decoding)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per forward batch")


def _tokenizer(args):
    from .tokenizer import load_tokenizer

    path = args.tokenizer or (os.path.join(args.ckpt, "hf") if os.path.isdir(os.path.join(args.ckpt, "hf"))
                              else args.ckpt)
    return load_tokenizer(path)


def _sampling(args, cfg):
    steps = args.steps or (args.gen_length if cfg.arch == "llada" else cfg.block_size)
    block = args.block_length or (min(32, args.gen_length) if cfg.arch == "llada" else None)
    if args.cache != "none" and cfg.arch != "llada":
        from .errors import UserError

        raise UserError(f"--cache {args.cache} is LLaDA's prefix/dual cache; this {cfg.arch} model decodes "
                        f"with its own KV cache of finished blocks (drop --cache)")
    return dict(gen_length=args.gen_length, steps=steps, block_length=block,
                temperature=args.temperature, threshold=args.threshold, cache=args.cache)


def chat_prompt(text: str, tokenizer) -> str:
    """``text`` as a user turn of ``tokenizer``'s chat template (no system prompt), as ``eval``
    formats its prompts (:func:`~.tasks.prompts.build_prompt`); unchanged without a template."""
    from .tasks.prompts import build_prompt

    return build_prompt(text, tokenizer, system_prompt="") if tokenizer.chat_template else text


def _refuse_existing(command: str, path: str, overwrite: bool) -> bool:
    """Print the one-line refusal (and return True) when ``path`` exists and ``overwrite`` is off."""
    if overwrite or not os.path.exists(path):
        return False
    print(f"stabledrl {command}: error: {path} exists; pass --overwrite to replace it or --out FILE to "
          f"write elsewhere", file=sys.stderr)
    return True


def run_generate(args: argparse.Namespace) -> int:
    """Single process: print (or write as JSONL) one completion per prompt.

    Prompts go through the tokenizer's chat template (``--no-chat-template``: as given);
    each JSONL record holds the ``input`` as given and the exact ``prompt`` the model saw."""
    import torch

    from .checkpoint.loader import load_model
    from .diffusion import generate
    from .models.placement import eval_mode, model_device
    from .rl.rollout import encode_prompts
    from .tasks import write_jsonl

    prompts: List[str] = list(args.prompt or [])
    if args.prompts:
        with open(args.prompts) as handle:
            prompts += [line.rstrip("\n") for line in handle if line.strip()]
    if not prompts:
        print("stabledrl generate: error: give --prompt TEXT or --prompts FILE", file=sys.stderr)
        return 2
    if args.out and _refuse_existing("generate", args.out, args.overwrite):
        return 2
    tokenizer = _tokenizer(args)
    texts = prompts if args.no_chat_template else [chat_prompt(p, tokenizer) for p in prompts]
    model = load_model(args.ckpt)
    sampling = _sampling(args, model.config)
    device = model_device(model)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    results = []
    for start in range(0, len(prompts), args.batch_size):
        chunk = texts[start:start + args.batch_size]
        ids, valid = encode_prompts(tokenizer, chunk, device=device)
        with torch.no_grad(), eval_mode(model):
            out = generate(model, ids, generator=generator, prompt_valid=valid,
                           progress=not args.no_progress, **sampling)
        results += [{"input": given, "prompt": text, "completion": tokenizer.decode(row)}
                    for given, text, row in zip(prompts[start:], chunk, out[:, ids.shape[1]:].tolist())]
    if args.out:
        write_jsonl(args.out, results)
    else:
        for record in results:
            print(record["completion"])
    return 0


def default_eval_out(task: str, split: str) -> str:
    """``./eval_<task>_<split>.jsonl`` in the working directory (never beside the checkpoint)."""
    return os.path.abspath(f"eval_{task}_{split}.jsonl")


def run_eval(args: argparse.Namespace) -> int:
    """Distributed evaluation (``--nproc`` local ranks, or under torchrun/srun).

    The output file is chosen (and an existing one refused without ``--overwrite``) here,
    before any rank loads the model."""
    args.out = args.out or default_eval_out(args.task, args.split)
    if _refuse_existing("eval", args.out, args.overwrite):
        return 2
    options = {key: value for key, value in vars(args).items() if key != "handler"}
    if args.nproc > 1:
        from .parallel.launch import spawn

        _eval_inputs(args)  # a bad task or data file fails here, before any rank starts
        spawn(_eval_rank, args.nproc, (options,), timeout=float("inf"), threads=args.threads)
        return 0
    return _eval_rank(options)


def _eval_inputs(args: argparse.Namespace):
    """``(task, examples)`` of an eval, checked before any model is loaded; none is an error."""
    from .errors import DataError, UserError
    from .tasks import GENERATED_TASKS, get_task

    if not os.path.isdir(args.ckpt):
        raise FileNotFoundError(f"--ckpt {args.ckpt}: no such checkpoint directory")
    try:
        task = get_task(args.task, prompt_style=args.prompt_style)
        load_kwargs = {"limit": args.limit, "seed": args.seed}
        if args.data_path:
            load_kwargs["path"] = args.data_path
        if args.task in GENERATED_TASKS:
            load_kwargs["n"] = args.limit or 500
        examples = task.load(args.split, **load_kwargs)
    except (DataError, FileNotFoundError):
        raise
    except ValueError as err:  # an unknown task, split or option
        raise UserError(f"--task {args.task}: {err}") from None
    if not examples:
        source = args.data_path or f"the {args.split} split"
        raise DataError(f"--task {args.task}: {source} holds no examples to evaluate"
                        + (f" with --limit {args.limit}" if args.limit is not None else ""))
    return task, examples


def _eval_rank(options: dict) -> int:
    import torch

    from .checkpoint.loader import read_config
    from .evaluation import evaluate_model
    from .models import build_model
    from .parallel import bootstrap
    from .rl.setup import load_initial_weights
    from .tasks import write_jsonl

    args = argparse.Namespace(**options)
    if args.threads:
        torch.set_num_threads(args.threads)
    task, examples = _eval_inputs(args)
    cfg = read_config(args.ckpt)
    bootstrap.initialize(args.tp, 1, seed=args.seed, model_shape=dict(
        num_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups))
    model = build_model(cfg)
    load_initial_weights(model, args.ckpt)
    tokenizer = _tokenizer(args)
    result = evaluate_model(model, tokenizer, task, examples, micro_batch=args.batch_size,
                            seed=args.seed, progress=not args.no_progress, **_sampling(args, cfg))
    if bootstrap.is_main_rank():
        out = args.out or default_eval_out(args.task, args.split)
        write_jsonl(out, result.records)
        print(f"{args.task}/{args.split}: accuracy {result.accuracy:.4f} "
              f"(mean reward {result.mean_reward:.4f}, {result.num_examples} examples) -> {out}")
    return 0


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_sampling_arguments(parser)
    parser.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable)")
    parser.add_argument("--prompts", metavar="FILE", help="one prompt per line")
    parser.add_argument("--out", metavar="FILE", help="write JSONL (input, exact prompt, completion) "
                                                      "instead of printing")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="feed the prompts as given (default: the tokenizer's chat template, as eval)")
    parser.add_argument("--no-progress", action="store_true")


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    add_sampling_arguments(parser)
    parser.add_argument("--task", required=True, help="gsm8k, math500, countdown or sudoku")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=None, help="first N examples")
    parser.add_argument("--data-path", metavar="PATH", help="local data file/root (GSM8K, MATH500)")
    parser.add_argument("--prompt-style", default="chat", choices=("chat", "compact"))
    parser.add_argument("--out", metavar="FILE",
                        help="per-example JSONL with the exact prompts (default: ./eval_<task>_<split>.jsonl)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--nproc", type=int, default=1, help="local ranks (DP = nproc / tp)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--no-progress", action="store_true")


def add_stress_arguments(parser: argparse.ArgumentParser) -> None:
    from .experiments.stress import StressOptions
    from .experiments.tiny_sudoku import LIKELIHOODS

    d = StressOptions()
    parser.add_argument("--config", metavar="FILE",
                        help="base RL config (needs model.checkpoint); default: the embedded tiny Sudoku "
                             "setting, SFT included")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides for every arm")
    parser.add_argument("--out", default=d.out, help=f"output directory (default {d.out})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the embedded setting (data, SFT, RL)")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"RL steps per arm (default {d.steps})")
    parser.add_argument("--noise", default=d.noise, choices=("lognormal", "student_t"),
                        help="noise on the estimated log-ratio in the noisy arms")
    parser.add_argument("--sigma", type=float, default=d.sigma, help=f"noise scale (default {d.sigma})")
    parser.add_argument("--parallel", type=int, default=d.parallel,
                        help="arms running at once, one CPU thread each (default 2)")
    parser.add_argument("--likelihood", default=d.likelihood, choices=LIKELIHOODS,
                        help=f"likelihood estimator of the embedded setting (default {d.likelihood}; "
                             "ignored with --config)")


def run_stress(args: argparse.Namespace) -> int:
    from .experiments.stress import StressOptions, format_stress, run_stress as run
    from .experiments.tiny_sudoku import TinySudoku

    opts = StressOptions(out=args.out, setting=TinySudoku(seed=args.seed), config=args.config,
                         overrides=tuple(args.overrides), steps=args.steps, noise=args.noise,
                         sigma=args.sigma, parallel=args.parallel, likelihood=args.likelihood)
    print(format_stress(run(opts, log=lambda m: print(m, flush=True))))
    print(f"\nwritten: {args.out}/stress_summary.json, {args.out}/stress.png")
    return 0
