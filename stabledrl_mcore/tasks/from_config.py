"""A run's task and its data, built from the run config's rollout / eval sections (train, eval and the preflight build them the same way)."""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Tuple

from stabledrl_mcore.common.errors import ConfigError, DataError
from stabledrl_mcore.tasks.base import GENERATED_TASKS, Example, get_task
from stabledrl_mcore.tasks.custom_reward import TASK_REWARD_OPTIONS, CustomRewardTask, load_reward_fn
from stabledrl_mcore.tasks.prompts import rollout_prompt_format


def build_task(cfg):
    """The task of ``cfg.rollout``: ``task`` with ``task_options``, the ``prompt_key`` / ``answer_key``
    columns, and ``reward_fn`` in place of its reward. Fields that cannot apply to the task are
    refused by name (:class:`~stabledrl_mcore.common.errors.ConfigError`); a bad task option raises ``ValueError``."""

    r = cfg.rollout
    options = dict(r.task_options)
    for name in ("prompt_key", "answer_key"):
        value = getattr(r, name)
        if value is None:
            continue
        if r.task in GENERATED_TASKS:
            raise ConfigError(
                f"rollout.{name}={value}: task {r.task} generates its examples (no data columns); "
                f"it applies to file-backed tasks such as qa, gsm8k, math500, aime2024"
            )
        if name in options:
            raise ConfigError(f"rollout.{name} and rollout.task_options.{name} both set: keep rollout.{name}")
        options[name] = value
    if not r.reward_timeout_s > 0:
        raise ConfigError(f"rollout.reward_timeout_s must be > 0, got {r.reward_timeout_s}")
    if r.reward_timeout_s != type(r).reward_timeout_s and not r.reward_fn:
        raise ConfigError("rollout.reward_timeout_s limits rollout.reward_fn calls: set rollout.reward_fn too")
    if r.reward_isolation != type(r).reward_isolation and not r.reward_fn:
        raise ConfigError(
            f"rollout.reward_isolation={r.reward_isolation} chooses where rollout.reward_fn runs: set rollout.reward_fn too"
        )
    task = get_task(r.task, prompt_style=r.prompt_style, **options)
    task.prompt_format = rollout_prompt_format(r)  # the prompts eval and generate use too
    if r.reward_fn:
        shaping = [k for k in TASK_REWARD_OPTIONS if k in options]
        if shaping:
            raise ConfigError(
                f"rollout.task_options.{shaping[0]} shapes the task's own reward, which "
                f"rollout.reward_fn replaces: drop one of them"
            )
        task = CustomRewardTask(
            task,
            load_reward_fn(r.reward_fn),
            spec=r.reward_fn,
            timeout_s=r.reward_timeout_s,
            isolation=r.reward_isolation,
            workers=r.reward_workers,
        )
    return task


def generates_examples(cfg) -> bool:
    """The run's task generates its training examples (no data file is read)."""
    return cfg.rollout.task in GENERATED_TASKS and not cfg.rollout.data_path


def load_train_examples(cfg, task, *, sample: Optional[int] = None) -> List[Example]:
    """The training examples of ``cfg``. A data file is read whole. A generated task draws
    ``max(rollout.generated_prompts x steps, 64)`` (``sample`` when given): enough that the prompt
    stream never wraps within the run. Its generators are prefix-stable (the first ``k`` of ``n``
    are the ``k`` of a smaller draw) and the stream takes a generated set in order
    (:class:`~stabledrl_mcore.rl.setup.PromptStream`), so the prompts of a step do not depend on
    ``steps``: a resume that raises it continues the same data."""
    kwargs = {"path": cfg.rollout.data_path} if cfg.rollout.data_path else {}
    if generates_examples(cfg):
        kwargs["n"] = sample or max(cfg.rollout.generated_prompts * max(cfg.steps, 1), 64)
    seed = cfg.parallel.seed if cfg.rollout.data_seed is None else cfg.rollout.data_seed
    return task.load(cfg.rollout.split, seed=seed, **kwargs)


def heldout_examples(cfg, task) -> List[Example]:
    """``eval.num_examples`` examples of ``eval.split`` (generated with ``eval.seed``, or read from
    ``eval.data_path`` / the task's default file of that split)."""
    e = cfg.eval
    kwargs = {"path": e.data_path} if e.data_path else {}  # held out: never the training file
    if cfg.rollout.task in GENERATED_TASKS:  # a generated task refuses a file unless it reads one
        return task.load(e.split, n=e.num_examples, seed=e.seed, **kwargs)
    return task.load(e.split, limit=e.num_examples, **kwargs)


PROMPT_CHARS_PER_TOKEN = 16
"""A question may hold at most this many characters per token of the prompt budget
(:func:`prompt_budget`): generous (English text is about 4 characters a token), and it bounds the
text a tokenizer is ever given."""


def prompt_budget(mcfg, gen_length: int, gen_name: str = "rollout.gen_length") -> tuple:
    """``(tokens, why)``: the prompt tokens a sequence has room for, the model's
    ``max_position_embeddings`` less the completion's ``gen_length`` (named ``gen_name`` in the
    reason; the positions alone when the completion takes them all: the memory check judges such a
    completion), and how that number was found."""
    positions = mcfg.max_position_embeddings
    if gen_length < positions:
        return positions - gen_length, f"the model's max_position_embeddings {positions} - {gen_name} {gen_length}"
    return positions, f"the model's max_position_embeddings {positions}"


def refuse_long_questions(
    questions: Iterable[Tuple[Any, str]], source: str, mcfg, gen_length: int, gen_name: str = "rollout.gen_length"
) -> None:
    """Refuse (:class:`DataError`, naming ``source``, the row and its length) the first ``(row, text)``
    (``row`` as the message names it, e.g. ``"row 3"``) whose text is longer than
    ``PROMPT_CHARS_PER_TOKEN x`` :func:`prompt_budget` characters. Checked on the text as loaded,
    before anything tokenises it: a row is refused, never truncated (a cut question is another
    question). ``train``, ``eval`` and ``generate`` all apply it."""
    budget, why = prompt_budget(mcfg, gen_length, gen_name)
    limit = PROMPT_CHARS_PER_TOKEN * budget
    for row, text in questions:
        if len(text) > limit:
            raise DataError(
                f"{source} {row}: the question is {len(text):,} characters, more than the {limit:,} a prompt "
                f"may hold ({PROMPT_CHARS_PER_TOKEN} characters per token of the prompt budget, {budget} tokens = "
                f"{why}); such rows are refused, not truncated: shorten or drop the row (docs/data.md)"
            )


def check_prompt_lengths(
    examples: List[Example], cfg, mcfg, section: str = "rollout", gen_length: Optional[int] = None
) -> None:
    """:func:`refuse_long_questions` on a task's examples (their row index where the task recorded it).
    ``section``: ``rollout`` (training data) or ``eval`` (held-out data); ``gen_length``: the
    completion's length when it is not ``rollout.gen_length`` (``eval --gen-length``)."""
    path = getattr(getattr(cfg, section), "data_path", None)
    source = f"{section}.data_path={path}" if path else f"task {cfg.rollout.task}"
    rows = (
        (f"row {example.meta.get('index', position) if isinstance(example.meta, dict) else position}", example.prompt)
        for position, example in enumerate(examples)
    )
    if gen_length is None:
        refuse_long_questions(rows, source, mcfg, cfg.rollout.gen_length)
    else:
        refuse_long_questions(rows, source, mcfg, gen_length, "--gen-length")
