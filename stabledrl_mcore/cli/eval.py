"""``stabledrl eval``: accuracy (greedy) or pass@k (sampled) of a checkpoint on a task, on the training layout: examples
sharded over data-parallel ranks, the model under tensor parallelism (``--tp``), one command from a laptop
(``--nproc``) to a cluster (torchrun / srun).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import yaml

from stabledrl_mcore.checkpoint.loader import read_config
from stabledrl_mcore.cli.args import (
    PROMPT_FLAGS,
    add_sampling_arguments,
    cli_prompt_format,
    cli_tokenizer,
    refuse_existing,
    sampling_options,
)
from stabledrl_mcore.common.errors import DataError, UserError
from stabledrl_mcore.engine.model_setup import load_initial_weights
from stabledrl_mcore.evaluation.at_k import check_ks, default_ks
from stabledrl_mcore.evaluation.distributed import evaluate_model
from stabledrl_mcore.evaluation.scoring import write_jsonl
from stabledrl_mcore.models.model import build_model
from stabledrl_mcore.parallel import bootstrap, launch
from stabledrl_mcore.tasks.base import GENERATED_TASKS, get_task


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
    if refuse_existing("eval", args.out, args.overwrite) or refuse_existing("eval", args.summary, args.overwrite):
        return 2
    _note_training_prompts(args, cli_prompt_format(args))  # once per job: here, not in every rank
    options = {key: value for key, value in vars(args).items() if key != "handler"}
    if args.check:
        return _check_eval(args)
    if args.nproc > 1:
        _eval_inputs(args)  # a bad task or data file fails here, before any rank starts
        launch.spawn(_eval_rank, args.nproc, (options,), timeout=float("inf"), threads=args.threads)
        return 0
    return _eval_rank(options)


def _check_eval(args: argparse.Namespace) -> int:
    """``eval --check``: every input a rank would read (task, data, prompt format, checkpoint
    config, sampling flags, output files), checked in this one process; no model is built."""

    task, examples = _eval_inputs(args)
    cfg = read_config(args.ckpt)
    sampling_options(args, cfg)
    print(
        f"eval inputs ok: {len(examples)} {task.name}/{args.split} examples x {args.n} samples, {cfg.arch} "
        f"checkpoint {args.ckpt} -> {args.out}, {args.summary}"
    )
    return 0


def _note_training_prompts(args: argparse.Namespace, fmt) -> None:
    """A training checkpoint whose run configured other prompts than this eval uses: say so
    (once, rank 0), naming the flags that reproduce the training prompts."""

    path = os.path.join(args.ckpt, "config.yaml")
    if not os.path.isfile(path) or os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) not in ("", "0"):
        return
    try:
        rollout = (yaml.safe_load(open(path)) or {}).get("rollout") or {}
    except (OSError, yaml.YAMLError):
        return
    trained = {
        "--system-prompt": rollout.get("system_prompt"),
        "--prompt-template": rollout.get("prompt_template", "{question}"),
        "--chat-template": rollout.get("chat_template"),
    }
    used = {
        "--system-prompt": fmt.system_prompt,
        "--prompt-template": fmt.template,
        "--chat-template": fmt.chat_template,
    }
    differ = [f"{flag} {trained[flag]!r}" for flag in PROMPT_FLAGS if trained[flag] != used[flag]]
    if rollout.get("task") == args.task and differ:
        print(
            f"stabledrl eval: note: {path} trained with other prompts; to evaluate with them pass {' '.join(differ)}",
            file=sys.stderr,
        )


def summary_path(out: str) -> str:
    """``eval_x.jsonl`` -> ``eval_x.summary.json`` (beside the per-example file)."""
    stem = out[: -len(".jsonl")] if out.endswith(".jsonl") else out
    return stem + ".summary.json"


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """``--n`` / ``--k`` / ``--temperature``, refused by name before any rank starts; sets ``args.k``."""

    if args.n < 1:
        raise UserError(f"--n must be >= 1, got {args.n}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if args.n > 1 and args.temperature == 0:
        raise UserError(
            f"--n {args.n} at --temperature 0 decodes {args.n} identical greedy samples; "
            f"set --temperature > 0 (e.g. 0.6) or --n 1"
        )
    if args.k is None:
        args.k = default_ks(args.n)
        return
    try:
        args.k = check_ks([int(k) for k in str(args.k).split(",") if k.strip()], args.n)
    except ValueError as err:
        raise UserError(str(err) if "--k" in str(err) else f"--k {args.k}: give integers like 1,4,8") from None


def _eval_inputs(args: argparse.Namespace):
    """``(task, examples)`` of an eval, checked before any model is loaded; none is an error."""

    if not os.path.isdir(args.ckpt):
        raise FileNotFoundError(f"--ckpt {args.ckpt}: no such checkpoint directory")
    try:
        task = get_task(args.task, prompt_style=args.prompt_style)
        if args.prompt_style == "compact" and any(
            getattr(args, f[2:].replace("-", "_")) is not None for f in PROMPT_FLAGS
        ):
            raise UserError(
                f"{'/'.join(PROMPT_FLAGS)} need --prompt-style chat (compact prompts are the bare question)"
            )
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
        raise DataError(
            f"--task {args.task}: {source} holds no examples to evaluate"
            + (f" with --limit {args.limit}" if args.limit is not None else "")
        )
    return task, examples


def _eval_rank(options: dict) -> int:

    args = argparse.Namespace(**options)
    if args.threads:
        torch.set_num_threads(args.threads)
    task, examples = _eval_inputs(args)
    cfg = read_config(args.ckpt)
    bootstrap.initialize(
        args.tp,
        1,
        seed=args.seed,
        model_shape=dict(
            num_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=cfg.num_query_groups,
        ),
    )
    model = build_model(cfg)
    load_initial_weights(model, args.ckpt)
    tokenizer = cli_tokenizer(args)
    result = evaluate_model(
        model,
        tokenizer,
        task,
        examples,
        micro_batch=args.batch_size,
        seed=args.seed,
        progress=not args.no_progress,
        n=args.n,
        ks=args.k,
        **sampling_options(args, cfg),
    )
    if bootstrap.is_main_rank():
        out = args.out or default_eval_out(args.task, args.split)
        write_jsonl(out, result.records)
        summary = args.summary or summary_path(out)
        write_summary(summary, args, result)
        print(
            f"{args.task}/{args.split}: accuracy {result.accuracy:.4f} "
            f"(mean reward {result.mean_reward:.4f}, {result.num_examples} examples) -> {out}"
        )
        print(" ".join(f"{name} {value:.4f}" for name, value in result.metrics.items()) + f" -> {summary}")
    return 0


def write_summary(path: str, args: argparse.Namespace, result) -> None:
    """The run's figures and settings as one JSON object (atomically)."""

    settings = {
        key: getattr(args, key)
        for key in (
            "ckpt",
            "task",
            "split",
            "limit",
            "n",
            "k",
            "temperature",
            "gen_length",
            "steps",
            "block_length",
            "threshold",
            "cache",
            "seed",
            "batch_size",
            "system_prompt",
            "prompt_template",
            "chat_template",
            "prompt_style",
        )
    }
    body = {
        "accuracy": result.accuracy,
        "mean_reward": result.mean_reward,
        "num_examples": result.num_examples,
        "samples_per_example": result.n,
        **result.metrics,
        "per_example": os.path.abspath(args.out),
        "settings": settings,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump(body, handle, indent=2)
    os.replace(path + ".tmp", path)


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    add_sampling_arguments(parser)
    parser.add_argument("--task", required=True, help="gsm8k, math500, countdown or sudoku")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=None, help="first N examples")
    parser.add_argument("--data-path", metavar="PATH", help="local data file/root (GSM8K, MATH500)")
    parser.add_argument("--prompt-style", default="chat", choices=("chat", "compact"))
    parser.add_argument(
        "--out", metavar="FILE", help="per-example JSONL with the exact prompts (default: ./eval_<task>_<split>.jsonl)"
    )
    parser.add_argument(
        "--n", type=int, default=1, metavar="K", help="samples per prompt (default 1; > 1 needs --temperature > 0)"
    )
    parser.add_argument(
        "--k",
        default=None,
        metavar="K1,K2,..",
        help="the k of pass@k / maj@k / mean@k (default: powers of two up to --n)",
    )
    parser.add_argument("--summary", metavar="FILE", help="summary JSON (default: the --out file with .summary.json)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check every input (task, data, prompts, checkpoint, flags, outputs), load no model",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--nproc", type=int, default=1, help="local ranks (DP = nproc / tp)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--no-progress", action="store_true")
