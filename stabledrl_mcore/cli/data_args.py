"""The task, data and prompt options ``eval`` and ``generate`` share with ``train``.

Both commands take ``--config FILE`` (a run config, e.g. the one a training run saved) and dotted
``rollout.*`` overrides, read into the same :class:`~stabledrl_mcore.config.schema.RunConfig` as
``train`` and built into the task by :func:`~stabledrl_mcore.tasks.from_config.build_task`, so
``rollout.prompt_key=question rollout.answer_key=gold rollout.task_options.verifier=numeric`` means
the same everywhere. The flags ``--task``, ``--data-path``, ``--split``, ``--prompt-style``,
``--system-prompt``, ``--prompt-template`` and ``--chat-template`` are shorthands of fields (the
table :data:`FLAG_FIELDS`); a flag and its field on one line are refused. Of a config file a
command reads only its fields (:data:`EVAL_FIELDS`, :data:`GENERATE_FIELDS`): the rest is the
training run's; an override of any other field is refused by name, naming the flag that does it.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Dict, Sequence, Tuple

from stabledrl_mcore.common.errors import ConfigError, UserError
from stabledrl_mcore.config.schema import RunConfig, load_config
from stabledrl_mcore.tasks import available_tasks
from stabledrl_mcore.tasks.from_config import build_task
from stabledrl_mcore.tasks.prompts import PROMPT_FIELDS, prompt_format

PROMPT_ONLY = ("rollout.prompt_style", "rollout.system_prompt", "rollout.prompt_template", "rollout.chat_template")
GENERATE_FIELDS = ("rollout.task", "rollout.task_options") + PROMPT_ONLY
"""What ``generate`` reads of a config: the task (its system prompt) and the prompt format."""
EVAL_FIELDS = GENERATE_FIELDS + (
    "rollout.prompt_key",
    "rollout.answer_key",
    "rollout.reward_fn",
    "rollout.reward_timeout_s",
    "rollout.reward_isolation",
    "eval.data_path",
    "eval.split",
)
"""What ``eval`` reads of a config: the task as train builds it, and the held-out data (``eval.data_path``,
never the training file ``rollout.data_path``) and split."""

FLAG_FIELDS: Dict[str, str] = {
    "--task": "rollout.task",
    "--data-path": "eval.data_path",
    "--split": "eval.split",
    "--prompt-style": "rollout.prompt_style",
    "--system-prompt": "rollout.system_prompt",
    "--prompt-template": "rollout.prompt_template",
    "--chat-template": "rollout.chat_template",
}
"""Each shorthand flag and the field it sets."""

OTHER_FLAGS: Dict[str, str] = {
    "rollout.data_path": "--data-path",
    "rollout.split": "--split",
    "rollout.gen_length": "--gen-length",
    "rollout.steps": "--steps",
    "rollout.block_length": "--block-length",
    "rollout.temperature": "--temperature",
    "rollout.threshold": "--threshold",
    "rollout.cache": "--cache",
    "rollout.compile": "--compile",
    "model.checkpoint": "--ckpt",
    "model.tokenizer": "--tokenizer",
    "parallel.seed": "--seed",
    "eval.seed": "--seed",
    "eval.num_examples": "--limit",
    "eval.micro_batch_size": "--batch-size",
    "parallel.tensor_parallel": "--tp",
    "parallel.threads": "--threads",
}
"""Fields whose job a flag of ``eval`` / ``generate`` does (named when the field is given instead)."""


def _attr(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _covers(fields: Sequence[str], key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in fields)


def given_flags(args: argparse.Namespace) -> Dict[str, object]:
    """The shorthand flags given on this line (flag -> value)."""
    return {flag: getattr(args, _attr(flag)) for flag in FLAG_FIELDS if getattr(args, _attr(flag), None) is not None}


def command_config(args: argparse.Namespace, command: str, fields: Sequence[str], flags: Sequence[str]) -> RunConfig:
    """``--config`` + overrides + shorthand flags as a checked :class:`RunConfig` (one line if bad).

    ``fields``: what ``command`` reads; ``flags``: the ones it has (a hint names only those)."""

    overrides = list(getattr(args, "overrides", None) or [])
    for text in overrides:
        key = text.split("=", 1)[0]
        if _covers(fields, key):
            continue
        flag = OTHER_FLAGS.get(key)
        if flag and flag.split()[0] in flags:
            raise UserError(f"{key}: stabledrl {command} sets it with {flag}, not an override")
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UserError(
            f"{key}: not an option of stabledrl {command} ({hint}its overrides: {', '.join(f + '.*' if f.endswith('options') else f for f in fields)})"
        )
    given = given_flags(args)
    for flag in given:
        clash = [t for t in overrides if _covers((FLAG_FIELDS[flag],), t.split("=", 1)[0])]
        if clash:
            raise UserError(f"{flag} and {clash[0].split('=', 1)[0]} both set: keep one")
    if "--task" in given and given["--task"] not in available_tasks():
        close = difflib.get_close_matches(str(given["--task"]), available_tasks(), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UserError(f"--task {given['--task']}: unknown task ({hint}valid tasks: {', '.join(available_tasks())})")
    cfg = load_config(args.config, overrides)
    for flag, value in given.items():
        section, name = FLAG_FIELDS[flag].split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg.validate()


def prompt_names(args: argparse.Namespace) -> Tuple[str, str, str]:
    """How to name the three prompt fields in an error: the flag when it was given, else the field."""
    given = given_flags(args)
    flags = ("--system-prompt", "--prompt-template", "--chat-template")
    return tuple(flag if flag in given else field for flag, field in zip(flags, PROMPT_FIELDS))


def command_task(cfg: RunConfig, args: argparse.Namespace, flags: Sequence[str]):
    """The task of ``cfg`` as ``train`` builds it (:func:`build_task`), its errors in one line naming
    the flag or field that was given (``flags``: the command's)."""

    r = cfg.rollout
    prompt_flags = [f for f in given_flags(args) if f in ("--system-prompt", "--prompt-template", "--chat-template")]
    if r.prompt_style == "compact" and prompt_flags:
        chat = "--prompt-style chat" if "--prompt-style" in flags else "rollout.prompt_style=chat"
        raise UserError(f"{'/'.join(prompt_flags)}: compact prompts are the bare question; set {chat} or drop them")
    prompt_format(r.system_prompt, r.prompt_template, r.chat_template, names=prompt_names(args))
    try:
        return build_task(cfg)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise UserError(f"rollout.task_options of task {r.task!r}: {err}") from None


def names_a_task(args: argparse.Namespace) -> bool:
    """Whether this line names a task: ``--task``, ``rollout.task=...`` or ``--config FILE``."""
    overrides = getattr(args, "overrides", None) or []
    return bool(getattr(args, "task", None) or args.config or any(t.startswith("rollout.task=") for t in overrides))
