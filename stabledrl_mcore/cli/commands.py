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
    parser.add_argument("--batch-size", type=int, default=8,
                        help="sequences per forward batch (eval --n K: batch-size // K prompts x K samples)")
    add_prompt_arguments(parser)


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt format, as ``rollout.system_prompt`` / ``prompt_template`` / ``chat_template``."""
    parser.add_argument("--system-prompt", metavar="TEXT", default=None,
                        help="system prompt (eval default: the task's own; generate: none)")
    parser.add_argument("--prompt-template", metavar="TEXT", default=None,
                        help="user turn with a {question} placeholder (default: the question as is)")
    parser.add_argument("--chat-template", metavar="FILE.jinja", default=None,
                        help="Jinja chat template replacing the tokenizer's")


PROMPT_FLAGS = ("--system-prompt", "--prompt-template", "--chat-template")


def cli_prompt_format(args: argparse.Namespace):
    """The checked :class:`~.tasks.prompts.PromptFormat` of the prompt flags (one line if bad)."""
    from stabledrl_mcore.tasks.prompts import prompt_format

    return prompt_format(args.system_prompt, args.prompt_template, args.chat_template, names=PROMPT_FLAGS)


def _tokenizer(args):
    from stabledrl_mcore.tasks.tokenizer import load_tokenizer

    path = args.tokenizer or (os.path.join(args.ckpt, "hf") if os.path.isdir(os.path.join(args.ckpt, "hf"))
                              else args.ckpt)
    return load_tokenizer(path)


def _sampling(args, cfg):
    steps = args.steps or (args.gen_length if cfg.arch == "llada" else cfg.block_size)
    block = args.block_length or (min(32, args.gen_length) if cfg.arch == "llada" else None)
    if args.cache != "none" and cfg.arch != "llada":
        from stabledrl_mcore.common.errors import UserError

        raise UserError(f"--cache {args.cache} is LLaDA's prefix/dual cache; this {cfg.arch} model decodes "
                        f"with its own KV cache of finished blocks (drop --cache)")
    return dict(gen_length=args.gen_length, steps=steps, block_length=block,
                temperature=args.temperature, threshold=args.threshold, cache=args.cache)


def chat_prompt(text: str, tokenizer, prompt_format=None) -> str:
    """``text`` as a user turn of ``tokenizer``'s chat template (no system prompt unless
    ``prompt_format`` sets one), as ``eval`` formats its prompts (``PromptFormat.render``);
    unchanged without a template (the tokenizer's or ``--chat-template``), system prompt or
    prompt template."""
    from stabledrl_mcore.tasks.prompts import PromptFormat

    fmt = prompt_format or PromptFormat()
    if not tokenizer.chat_template and fmt.is_default:
        return text
    return fmt.render(text, tokenizer)


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

    from stabledrl_mcore.checkpoint.loader import load_model
    from stabledrl_mcore.diffusion import generate
    from stabledrl_mcore.models.placement import eval_mode, model_device
    from stabledrl_mcore.tasks.prompts import encode_prompts
    from stabledrl_mcore.evaluation.scoring import write_jsonl

    prompts: List[str] = list(args.prompt or [])
    if args.prompts:
        with open(args.prompts) as handle:
            prompts += [line.rstrip("\n") for line in handle if line.strip()]
    if not prompts:
        print("stabledrl generate: error: give --prompt TEXT or --prompts FILE", file=sys.stderr)
        return 2
    if args.out and _refuse_existing("generate", args.out, args.overwrite):
        return 2
    if args.no_chat_template and any(getattr(args, f[2:].replace("-", "_")) is not None for f in PROMPT_FLAGS):
        print(f"stabledrl generate: error: --no-chat-template feeds the prompts as given; drop it or "
              f"{'/'.join(PROMPT_FLAGS)}", file=sys.stderr)
        return 2
    fmt = cli_prompt_format(args)
    tokenizer = _tokenizer(args)
    texts = prompts if args.no_chat_template else [chat_prompt(p, tokenizer, fmt) for p in prompts]
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
    args.summary = args.summary or summary_path(args.out)
    _check_sampling_flags(args)
    if _refuse_existing("eval", args.out, args.overwrite) or _refuse_existing("eval", args.summary, args.overwrite):
        return 2
    _note_training_prompts(args, cli_prompt_format(args))  # once per job: here, not in every rank
    options = {key: value for key, value in vars(args).items() if key != "handler"}
    if args.check:
        return _check_eval(args)
    if args.nproc > 1:
        from stabledrl_mcore.parallel.launch import spawn

        _eval_inputs(args)  # a bad task or data file fails here, before any rank starts
        spawn(_eval_rank, args.nproc, (options,), timeout=float("inf"), threads=args.threads)
        return 0
    return _eval_rank(options)


def _check_eval(args: argparse.Namespace) -> int:
    """``eval --check``: every input a rank would read (task, data, prompt format, checkpoint
    config, sampling flags, output files), checked in this one process; no model is built."""
    from stabledrl_mcore.checkpoint.loader import read_config

    task, examples = _eval_inputs(args)
    cfg = read_config(args.ckpt)
    _sampling(args, cfg)
    print(f"eval inputs ok: {len(examples)} {task.name}/{args.split} examples x {args.n} samples, {cfg.arch} "
          f"checkpoint {args.ckpt} -> {args.out}, {args.summary}")
    return 0


def _note_training_prompts(args: argparse.Namespace, fmt) -> None:
    """A training checkpoint whose run configured other prompts than this eval uses: say so
    (once, rank 0), naming the flags that reproduce the training prompts."""
    import yaml

    path = os.path.join(args.ckpt, "config.yaml")
    if not os.path.isfile(path) or os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) not in ("", "0"):
        return
    try:
        rollout = (yaml.safe_load(open(path)) or {}).get("rollout") or {}
    except (OSError, yaml.YAMLError):
        return
    trained = {"--system-prompt": rollout.get("system_prompt"),
               "--prompt-template": rollout.get("prompt_template", "{question}"),
               "--chat-template": rollout.get("chat_template")}
    used = {"--system-prompt": fmt.system_prompt, "--prompt-template": fmt.template,
            "--chat-template": fmt.chat_template}
    differ = [f"{flag} {trained[flag]!r}" for flag in PROMPT_FLAGS if trained[flag] != used[flag]]
    if rollout.get("task") == args.task and differ:
        print(f"stabledrl eval: note: {path} trained with other prompts; to evaluate with them pass "
              f"{' '.join(differ)}", file=sys.stderr)


def summary_path(out: str) -> str:
    """``eval_x.jsonl`` -> ``eval_x.summary.json`` (beside the per-example file)."""
    stem = out[:-len(".jsonl")] if out.endswith(".jsonl") else out
    return stem + ".summary.json"


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """``--n`` / ``--k`` / ``--temperature``, refused by name before any rank starts; sets ``args.k``."""
    from stabledrl_mcore.common.errors import UserError
    from stabledrl_mcore.evaluation.at_k import check_ks, default_ks

    if args.n < 1:
        raise UserError(f"--n must be >= 1, got {args.n}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if args.n > 1 and args.temperature == 0:
        raise UserError(f"--n {args.n} at --temperature 0 decodes {args.n} identical greedy samples; "
                        f"set --temperature > 0 (e.g. 0.6) or --n 1")
    if args.k is None:
        args.k = default_ks(args.n)
        return
    try:
        args.k = check_ks([int(k) for k in str(args.k).split(",") if k.strip()], args.n)
    except ValueError as err:
        raise UserError(str(err) if "--k" in str(err) else f"--k {args.k}: give integers like 1,4,8") from None


def _eval_inputs(args: argparse.Namespace):
    """``(task, examples)`` of an eval, checked before any model is loaded; none is an error."""
    from stabledrl_mcore.common.errors import DataError, UserError
    from stabledrl_mcore.tasks import GENERATED_TASKS, get_task

    if not os.path.isdir(args.ckpt):
        raise FileNotFoundError(f"--ckpt {args.ckpt}: no such checkpoint directory")
    try:
        task = get_task(args.task, prompt_style=args.prompt_style)
        if args.prompt_style == "compact" and any(getattr(args, f[2:].replace("-", "_")) is not None
                                                  for f in PROMPT_FLAGS):
            raise UserError(f"{'/'.join(PROMPT_FLAGS)} need --prompt-style chat (compact prompts are the "
                            f"bare question)")
        task.prompt_format = cli_prompt_format(args)  # the same rendering as training
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

    from stabledrl_mcore.checkpoint.loader import read_config
    from stabledrl_mcore.evaluation.distributed import evaluate_model
    from stabledrl_mcore.models import build_model
    from stabledrl_mcore.parallel import bootstrap
    from stabledrl_mcore.engine.model_setup import load_initial_weights
    from stabledrl_mcore.evaluation.scoring import write_jsonl

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
                            seed=args.seed, progress=not args.no_progress, n=args.n, ks=args.k,
                            **_sampling(args, cfg))
    if bootstrap.is_main_rank():
        out = args.out or default_eval_out(args.task, args.split)
        write_jsonl(out, result.records)
        summary = args.summary or summary_path(out)
        write_summary(summary, args, result)
        print(f"{args.task}/{args.split}: accuracy {result.accuracy:.4f} "
              f"(mean reward {result.mean_reward:.4f}, {result.num_examples} examples) -> {out}")
        print(" ".join(f"{name} {value:.4f}" for name, value in result.metrics.items()) + f" -> {summary}")
    return 0


def write_summary(path: str, args: argparse.Namespace, result) -> None:
    """The run's figures and settings as one JSON object (atomically)."""
    import json

    settings = {key: getattr(args, key) for key in ("ckpt", "task", "split", "limit", "n", "k", "temperature",
                                                     "gen_length", "steps", "block_length", "threshold", "cache",
                                                     "seed", "batch_size", "system_prompt", "prompt_template",
                                                     "chat_template", "prompt_style")}
    body = {"accuracy": result.accuracy, "mean_reward": result.mean_reward, "num_examples": result.num_examples,
            "samples_per_example": result.n, **result.metrics, "per_example": os.path.abspath(args.out),
            "settings": settings}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump(body, handle, indent=2)
    os.replace(path + ".tmp", path)


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
    parser.add_argument("--n", type=int, default=1, metavar="K",
                        help="samples per prompt (default 1; > 1 needs --temperature > 0)")
    parser.add_argument("--k", default=None, metavar="K1,K2,..",
                        help="the k of pass@k / maj@k / mean@k (default: powers of two up to --n)")
    parser.add_argument("--summary", metavar="FILE",
                        help="summary JSON (default: the --out file with .summary.json)")
    parser.add_argument("--check", action="store_true",
                        help="check every input (task, data, prompts, checkpoint, flags, outputs), load no model")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--nproc", type=int, default=1, help="local ranks (DP = nproc / tp)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--no-progress", action="store_true")


def add_stress_arguments(parser: argparse.ArgumentParser) -> None:
    from stabledrl_mcore.experiments.stress import StressOptions
    from stabledrl_mcore.experiments.tiny_sudoku import LIKELIHOODS

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
    from stabledrl_mcore.experiments.stress import StressOptions, format_stress, run_stress as run
    from stabledrl_mcore.experiments.tiny_sudoku import TinySudoku

    opts = StressOptions(out=args.out, setting=TinySudoku(seed=args.seed), config=args.config,
                         overrides=tuple(args.overrides), steps=args.steps, noise=args.noise,
                         sigma=args.sigma, parallel=args.parallel, likelihood=args.likelihood)
    print(format_stress(run(opts, log=lambda m: print(m, flush=True))))
    print(f"\nwritten: {args.out}/stress_summary.json, {args.out}/stress.png")
    return 0
