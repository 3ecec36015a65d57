"""``stabledrl eval``: accuracy (greedy) or pass@k (sampled) of a checkpoint on a task, on the training layout: examples
sharded over data-parallel ranks, the model under tensor parallelism (``--tp``), one command from a laptop
(``--nproc``) to a cluster (torchrun / srun).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

import torch
import yaml

from stabledrl_mcore.cli.args import (
    PROMPT_FLAGS,
    add_config_args,
    add_sampling_arguments,
    cli_tokenizer,
    refuse_existing,
    sampling_options,
    world_size,
)
from stabledrl_mcore.cli.data_args import EVAL_FIELDS, command_config, command_task, names_a_task
from stabledrl_mcore.common.errors import DataError, UserError
from stabledrl_mcore.convert.loader import check_loadable, read_config
from stabledrl_mcore.engine.model_setup import load_initial_weights
from stabledrl_mcore.evaluation.at_k import check_ks, default_ks
from stabledrl_mcore.evaluation.distributed import data_parallel_position, evaluate_model
from stabledrl_mcore.evaluation.partial import checkpoint_fingerprint, open_partial, partial_files, resumable_rows
from stabledrl_mcore.evaluation.scoring import JsonlAppender, write_jsonl
from stabledrl_mcore.models.model import build_model
from stabledrl_mcore.parallel import bootstrap, launch
from stabledrl_mcore.tasks.base import GENERATED_TASKS, available_tasks
from stabledrl_mcore.tasks.from_config import check_prompt_lengths
from stabledrl_mcore.tasks.prompts import PromptFormat


def default_eval_out(task: str, split: str) -> str:
    """``./eval_<task>_<split>.jsonl`` in the working directory (never beside the checkpoint)."""
    return os.path.abspath(f"eval_{task}_{split}.jsonl")


def eval_config(args: argparse.Namespace):
    """The run config of this eval: ``--config`` + ``rollout.*`` / ``eval.*`` overrides + the shorthand
    flags (:mod:`~stabledrl_mcore.cli.data_args`); the same on every rank."""
    if not names_a_task(args):
        raise UserError(f"give --task NAME ({', '.join(available_tasks())}) or --config FILE (its rollout.task)")
    return command_config(args, "eval", EVAL_FIELDS, EVAL_FLAGS)


def run_eval(args: argparse.Namespace) -> int:
    """Distributed evaluation (``--nproc`` local ranks, or under torchrun/srun).

    The output file is chosen (and an existing one refused without ``--overwrite``) here, and the
    sampler's shape checked against the checkpoint's config, before any rank loads the model."""
    cfg = eval_config(args)
    args.out = args.out or default_eval_out(cfg.rollout.task, cfg.eval.split)
    args.summary = args.summary or summary_path(args.out)
    _check_sampling_flags(args)
    if _refuse_outputs(args):
        return 2
    _check_ckpt(args)
    command_task(cfg, args, EVAL_FLAGS)  # the task and prompt options (its data: _eval_inputs)
    sampling_options(args, read_config(args.ckpt))  # the sampler's shape rules, one line each
    r = cfg.rollout
    used = PromptFormat(r.system_prompt, r.prompt_template, r.chat_template)
    _note_training_prompts(args, used, r.task)  # once per job: here, not in every rank
    options = {key: value for key, value in vars(args).items() if key != "handler"}
    if args.resume:  # every partial file checked here, before any rank starts
        kept = resumable_rows(args.out, eval_fingerprint(args, cfg), _data_parallel_size(args))
        rows = sum(len(part) for part in kept.values())
        print(
            f"stabledrl eval: resuming {args.out}: {rows} row(s) kept from {len(kept)} partial file(s)"
            if kept
            else f"stabledrl eval: --resume: nothing kept for {args.out}; evaluating from the start"
        )
    if args.check:
        return _check_eval(args)
    if args.nproc > 1:
        _eval_inputs(args)  # a bad task or data file fails here, before any rank starts
        launch.spawn(_eval_rank, args.nproc, (options,), timeout=float("inf"), threads=args.threads)
        return 0
    return _eval_rank(options)


def _refuse_outputs(args: argparse.Namespace) -> bool:
    """Print the one-line refusal (and return True) of an output this run would replace unasked: a
    finished ``--out`` or summary, or (without ``--resume``) a stopped run's partial files."""
    if args.resume and args.overwrite:
        raise UserError("--resume goes on from the rows a stopped run kept, --overwrite discards them: pass one")
    if args.resume:
        for path in (args.out, args.summary):
            if os.path.exists(path):
                print(
                    f"stabledrl eval: error: {path} exists: a finished evaluation, nothing to resume; pass --overwrite "
                    f"to run it again or --out FILE to write elsewhere",
                    file=sys.stderr,
                )
                return True
        return False
    if any(refuse_existing("eval", path, args.overwrite) for path in (args.out, args.summary)):
        return True
    partial = [] if args.overwrite else partial_files(args.out)
    if partial:
        print(
            f"stabledrl eval: error: {partial[0]} exists (the rows of a stopped run of this evaluation); pass "
            f"--resume to go on from them, --overwrite to start again, or --out FILE to write elsewhere",
            file=sys.stderr,
        )
    return bool(partial)


def _data_parallel_size(args: argparse.Namespace) -> int:
    """Data-parallel ranks of this eval: ``--nproc`` (or the launcher's ranks) over ``--tp``."""
    return max(1, (world_size(args.nproc if args.nproc > 1 else None, 1) or 1) // args.tp)


def eval_fingerprint(args: argparse.Namespace, cfg) -> dict:
    """What shapes an evaluation's rows, recorded in its partial files and compared by ``--resume``:
    the summary's settings with the checkpoint's content (:func:`checkpoint_fingerprint`) for its
    path, the tokenizer and the tensor-parallel size."""
    settings = eval_settings(args, cfg)
    settings["ckpt"] = checkpoint_fingerprint(args.ckpt)
    settings.update(tokenizer=args.tokenizer, tp=args.tp)
    return settings


def _check_eval(args: argparse.Namespace) -> int:
    """``eval --check``: every input a rank would read (task, data, prompt format, checkpoint
    config, sampling flags, output files), checked in this one process; no model is built."""

    cfg, task, examples, mcfg = _eval_inputs(args)
    sampling_options(args, mcfg)
    print(
        f"eval inputs ok: {len(examples)} {task.name}/{cfg.eval.split} examples x {args.n} samples, {mcfg.arch} "
        f"checkpoint {args.ckpt} -> {args.out}, {args.summary}"
    )
    return 0


def _quote(value: str) -> str:
    """``value`` single-quoted for a POSIX shell (as typed after a flag)."""
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _note_training_prompts(args: argparse.Namespace, fmt, task: Optional[str] = None) -> None:
    """A training checkpoint whose run configured other prompts than this eval uses (``fmt``, a
    :class:`~stabledrl_mcore.tasks.prompts.PromptFormat`; ``task``: default ``args.task``): say so
    (once, rank 0), naming what to type to evaluate with them: the flags with their values, the
    flags to drop (a default: the task's own system prompt, the bare question, the tokenizer's
    template), or the training config itself."""

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
    differ = [flag for flag in PROMPT_FLAGS if trained[flag] != used[flag]]
    if rollout.get("task") != (task or args.task) or not differ:
        return
    defaults = (None, "{question}")
    add = [f"{flag} {_quote(str(trained[flag]))}" for flag in differ if trained[flag] not in defaults]
    drop = [flag for flag in differ if trained[flag] in defaults]
    fixes = (["pass " + " ".join(add)] if add else []) + (["drop " + " ".join(drop)] if drop else [])
    print(
        f"stabledrl eval: note: {path} trained with other prompts; to evaluate with them "
        f"{' and '.join(fixes)} (or pass --config {_quote(path)} and no prompt flags)",
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


def _check_ckpt(args: argparse.Namespace) -> None:
    if not os.path.isdir(args.ckpt):
        raise FileNotFoundError(f"--ckpt {args.ckpt}: no such checkpoint directory")
    check_loadable(args.ckpt, trust_unverified=args.trust_unverified)


def _eval_inputs(args: argparse.Namespace):
    """``(config, task, examples, model shape)`` of an eval (the run config, and the checkpoint's
    :class:`~stabledrl_mcore.models.DLLMConfig`), checked before any model is loaded; none is an error.

    The task is built as ``train`` builds it (``rollout.task``, ``task_options``, ``prompt_key`` /
    ``answer_key``, ``reward_fn``, the prompt fields); the examples are those of ``eval.split``
    (``--split``) from ``eval.data_path`` (``--data-path``) or the task's own data, a question too long
    for the model's positions refused by its row as ``train`` refuses it."""

    _check_ckpt(args)
    cfg = eval_config(args)
    task = command_task(cfg, args, EVAL_FLAGS)
    load_kwargs = {"limit": args.limit, "seed": args.seed}
    if cfg.eval.data_path:
        load_kwargs["path"] = cfg.eval.data_path
    if cfg.rollout.task in GENERATED_TASKS:
        load_kwargs["n"] = args.limit or 500
    try:
        examples = task.load(cfg.eval.split, **load_kwargs)
    except (DataError, FileNotFoundError):
        raise
    except ValueError as err:  # an unknown split or a path a generated task cannot read
        raise UserError(f"rollout.task={cfg.rollout.task}: {err}") from None
    if not examples:
        source = cfg.eval.data_path or f"the {cfg.eval.split} split"
        raise DataError(
            f"rollout.task={cfg.rollout.task}: {source} holds no examples to evaluate"
            + (f" with --limit {args.limit}" if args.limit is not None else "")
        )
    mcfg = read_config(args.ckpt)
    check_prompt_lengths(examples, cfg, mcfg, "eval", gen_length=args.gen_length)  # before tokenising
    return cfg, task, examples, mcfg


def _eval_rank(options: dict) -> int:

    args = argparse.Namespace(**options)
    if args.threads:
        torch.set_num_threads(args.threads)
    run, task, examples, cfg = _eval_inputs(args)
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
    model = build_model(cfg, use_te=False if args.compile != "none" else None)  # compile traces the local spec
    load_initial_weights(model, args.ckpt, trust_unverified=args.trust_unverified)
    tokenizer = cli_tokenizer(args)
    out = args.out or default_eval_out(run.rollout.task, run.eval.split)
    fingerprint = eval_fingerprint(args, run)
    kept = resumable_rows(out, fingerprint, data_parallel_position()[1]) if args.resume else {}
    rows = _row_file(out, fingerprint, kept)
    try:
        result = _evaluate(args, cfg, model, tokenizer, task, examples, rows, kept.get(data_parallel_position()[0], []))
    finally:
        if rows is not None:
            rows.close()
    if bootstrap.is_main_rank():
        write_jsonl(out + ".tmp", result.records)  # every rank's rows, in order
        os.replace(out + ".tmp", out)
        for path in partial_files(out):
            os.remove(path)
        summary = args.summary or summary_path(out)
        write_summary(summary, args, result, run)
        print(
            f"{run.rollout.task}/{run.eval.split}: accuracy {result.accuracy:.4f} "
            f"(mean reward {result.mean_reward:.4f}, {result.num_examples} examples) -> {out}"
        )
        print(" ".join(f"{name} {value:.4f}" for name, value in result.metrics.items()) + f" -> {summary}")
    return 0


def _row_file(out: str, fingerprint: dict, kept: dict) -> Optional[JsonlAppender]:
    """Where this rank appends its rows as they finish: ``<out>.rank<R>.partial``, its header line
    first (:mod:`~stabledrl_mcore.evaluation.partial`), then the rows ``kept[R]`` of a resumed run;
    None on a tensor-parallel peer (it decodes the same rows)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_rank() != 0:
        return None
    rank, world = data_parallel_position()
    return open_partial(out, rank, world, fingerprint, kept.get(rank, []))


def _evaluate(args: argparse.Namespace, cfg, model, tokenizer, task, examples, rows: Optional[JsonlAppender], kept=()):
    return evaluate_model(
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
        on_records=None if rows is None else rows.append,
        kept=kept,
    )


def write_summary(path: str, args: argparse.Namespace, result, cfg=None) -> None:
    """The run's figures and settings (:func:`eval_settings`) as one JSON object (atomically); ``cfg``:
    the eval's run config (:func:`eval_config`)."""
    body = {
        "accuracy": result.accuracy,
        "mean_reward": result.mean_reward,
        "num_examples": result.num_examples,
        "samples_per_example": result.n,
        **result.metrics,
        "per_example": os.path.abspath(args.out),
        "settings": eval_settings(args, cfg or eval_config(args)),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump(body, handle, indent=2)
    os.replace(path + ".tmp", path)


def eval_settings(args: argparse.Namespace, cfg) -> dict:
    """The settings of an eval as its summary records them: the task, data and prompt fields of
    ``cfg`` (the eval's run config) and the sampling flags."""
    r = cfg.rollout
    settings = {
        "task": r.task,
        "split": cfg.eval.split,
        "data_path": cfg.eval.data_path,
        "task_options": dict(r.task_options),
        "prompt_key": r.prompt_key,
        "answer_key": r.answer_key,
        "reward_fn": r.reward_fn,
        "system_prompt": r.system_prompt,
        "prompt_template": r.prompt_template,
        "chat_template": r.chat_template,
        "prompt_style": r.prompt_style,
        "config": args.config,
        "overrides": list(args.overrides or []),
    }
    settings.update(
        (key, getattr(args, key))
        for key in (
            "ckpt",
            "limit",
            "n",
            "k",
            "temperature",
            "gen_length",
            "steps",
            "block_length",
            "threshold",
            "cache",
            "compile",
            "seed",
            "batch_size",
        )
    )
    return settings


EVAL_FLAGS = (
    "--task",
    "--split",
    "--data-path",
    "--prompt-style",
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
    "--limit",
    "--batch-size",
    "--tp",
    "--threads",
)
"""The flags a hint of eval may name (tests/test_eval_options.py checks each against the parser)."""


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    add_sampling_arguments(parser)
    add_config_args(
        parser,
        "a run config whose task, data and prompt fields to use (e.g. a training run's config.yaml)",
        "rollout.* / eval.* overrides as in train, e.g. rollout.prompt_key=question rollout.task_options.verifier=numeric",
    )
    parser.add_argument(
        "--task",
        default=None,
        help=f"the task (rollout.task): {', '.join(available_tasks())}",
    )
    parser.add_argument("--split", default=None, help="the split (eval.split; default test)")
    parser.add_argument("--limit", type=int, default=None, help="first N examples")
    parser.add_argument(
        "--data-path", metavar="PATH", help="local data file/root to evaluate on (eval.data_path; docs/data.md)"
    )
    parser.add_argument(
        "--prompt-style", default=None, choices=("chat", "compact"), help="rollout.prompt_style (default chat)"
    )
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
    parser.add_argument(
        "--resume",
        action="store_true",
        help="go on from the rows a stopped run of this evaluation kept (<out>.rank<R>.partial), checked "
        "against its checkpoint, data and sampling settings; the final --out equals an uninterrupted run's "
        "(nothing kept: evaluate from the start)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--nproc", type=int, default=1, help="local ranks (DP = nproc / tp)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--no-progress", action="store_true")
