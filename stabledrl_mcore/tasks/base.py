"""Task protocol, the ``Example`` record and the task registry.

A task bundles three things the RL loop and the evaluator need:

* ``load(split, ...)``: the examples (question text, reference answer, meta),
* ``prompt(example, tokenizer)``: the chat-formatted prompt string,
* ``reward(completion, reference)``: a float in ``reward_range`` (the task's
  own ``base_reward_range`` = (0, 1), plus any shaping term below).

Rewards receive model output, which is hostile input: every ``reward`` and
``extract_answer`` must return quickly and never raise on any ``str``
completion (a malformed *reference* is a caller bug and raises ``ValueError``).

Options every task accepts (constructor keywords, or ``get_task`` /
``rollout.task_options`` keys), handled here once for all tasks:

* ``anti_short_boxed: bool = False``: add the StableDRL release's anti short
  boxed term (:func:`~.shaping.anti_short_boxed_bonus`, 1.0 unless the
  completion is short and essentially only a ``\\boxed{}``) to the reward:
  ``reward = base + bonus`` and ``reward_range = (lo, hi + 1)``. The release
  adds it to every task's reward; here it is off unless asked for.
  ``is_correct`` (accuracy) still means "full *base* reward".
* ``anti_short_boxed_min_chars: int = 200`` and
  ``anti_short_boxed_min_ratio: float = 0.85``: its two thresholds (the
  release's defaults).

Tasks register themselves by name with ``@register_task("name")``;
``get_task(name, **kwargs)`` builds one; an unknown option raises ``ValueError``
naming the valid ones.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from stabledrl_mcore.common.registry import Registry
from stabledrl_mcore.tasks.prompts import PromptFormat
from stabledrl_mcore.tasks.shaping import (
    ANTI_SHORT_BOXED_MIN_CHARS,
    ANTI_SHORT_BOXED_MIN_RATIO,
    anti_short_boxed_bonus,
    check_anti_short_boxed_thresholds,
)

logger = logging.getLogger(__name__)

REWARD_RANGE: tuple[float, float] = (0.0, 1.0)
BASE_TASK_OPTIONS: tuple[str, ...] = ("anti_short_boxed", "anti_short_boxed_min_chars", "anti_short_boxed_min_ratio")
"""Options of :class:`Task` itself, accepted by every task (see the module docstring)."""


@dataclass(frozen=True)
class Example:
    """One task instance.

    prompt:    the user question as plain text (no chat template applied).
    reference: what ``Task.reward`` compares against (str, or a dict for
               countdown / sudoku; see each task).
    meta:      JSON-serialisable extras; ``meta["index"]`` is the example's
               position in the full split (used to re-order gathered results).
    """

    prompt: str
    reference: Any
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class TaskProtocol(Protocol):
    """What every registered task provides."""

    name: str
    reward_range: tuple[float, float]

    def load(
        self, split: str, *, path: str | None = None, limit: int | None = None, seed: int = 0, n: int | None = None
    ) -> list[Example]: ...

    def prompt(self, example: Example, tokenizer: Any = None) -> str: ...

    def reward(self, completion: str, reference: Any) -> float: ...

    def extract_answer(self, completion: str) -> str | None: ...

    def is_correct(self, completion: str, reference: Any) -> bool: ...


class Task:
    """Base class with the shared plumbing (prompting, safe reward wrapper, reward shaping).

    Subclasses set ``name`` and ``system_prompt`` (and ``base_reward_range`` if
    not (0, 1)), implement ``load``, ``extract_answer``, ``check_reference`` and
    ``_reward``, and pass unknown keyword options on to ``super().__init__``
    (the class-level defaults below hold for subclasses that do not).
    """

    name: str = ""
    system_prompt: str = ""
    base_reward_range: tuple[float, float] = REWARD_RANGE
    """Range of the task's own reward (``_reward``, clamped into it)."""
    prompt_style: str = "chat"
    """``chat`` (system prompt + chat template) or ``compact`` (:meth:`compact_prompt`, for tiny models)."""
    anti_short_boxed: bool = False
    """Add :func:`~.shaping.anti_short_boxed_bonus` (0 or 1) to every reward."""
    anti_short_boxed_min_chars: int = ANTI_SHORT_BOXED_MIN_CHARS
    anti_short_boxed_min_ratio: float = ANTI_SHORT_BOXED_MIN_RATIO
    prompt_format: PromptFormat = PromptFormat()
    """System prompt override, user-turn template and chat template (``rollout.*``; :mod:`.prompts`)."""

    def __init__(
        self,
        *,
        anti_short_boxed: bool = False,
        anti_short_boxed_min_chars: int = ANTI_SHORT_BOXED_MIN_CHARS,
        anti_short_boxed_min_ratio: float = ANTI_SHORT_BOXED_MIN_RATIO,
    ) -> None:
        self.set_anti_short_boxed(
            anti_short_boxed, min_chars=anti_short_boxed_min_chars, min_ratio=anti_short_boxed_min_ratio
        )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A subclass written against the old protocol declares ``reward_range = (lo, hi)``: that is its
        # base range; the public ``reward_range`` stays the property that adds the shaping term.
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("reward_range")
        if own is not None and not isinstance(own, property):
            cls.base_reward_range = (float(own[0]), float(own[1]))
            delattr(cls, "reward_range")

    def set_anti_short_boxed(
        self,
        enabled: bool = True,
        *,
        min_chars: int = ANTI_SHORT_BOXED_MIN_CHARS,
        min_ratio: float = ANTI_SHORT_BOXED_MIN_RATIO,
    ) -> None:
        """Turn the anti short boxed term on or off and set its thresholds (validated)."""
        if not isinstance(enabled, bool):
            raise ValueError(f"anti_short_boxed must be true or false, got {enabled!r}")
        self.anti_short_boxed_min_chars, self.anti_short_boxed_min_ratio = check_anti_short_boxed_thresholds(
            min_chars, min_ratio
        )
        self.anti_short_boxed = enabled

    @property
    def reward_range(self) -> tuple[float, float]:
        """Range of :meth:`reward`: ``base_reward_range``, its top raised by 1 with ``anti_short_boxed``."""
        lo, hi = self.base_reward_range
        return (lo, hi + 1.0) if self.anti_short_boxed else (lo, hi)

    def load(
        self, split: str, *, path: str | None = None, limit: int | None = None, seed: int = 0, n: int | None = None
    ) -> list[Example]:
        raise NotImplementedError

    def prompt(self, example: Example, tokenizer: Any = None) -> str:
        """The full prompt: chat template of ``tokenizer`` if it has one, else plain text.

        With ``prompt_style == "compact"`` it is :meth:`compact_prompt` instead. ``prompt_format``
        (the run's system prompt, template and chat template) applies in train, eval and generate.
        """
        if self.prompt_style == "compact":
            return self.compact_prompt(example)
        return self.prompt_format.render(example.prompt, tokenizer, default_system=self.system_prompt)

    def compact_prompt(self, example: Example) -> str:
        """The bare question, no system prompt or template (tiny from-scratch models)."""
        return example.prompt

    def extract_answer(self, completion: str) -> str | None:
        raise NotImplementedError

    def check_reference(self, reference: Any) -> Any:
        """Validate (and normalise) a reference; raise ``ValueError`` if malformed."""
        return reference

    def _reward(self, completion: str, reference: Any) -> float:
        raise NotImplementedError

    def base_reward(self, completion: str, reference: Any) -> float:
        """The task's own score: a float in ``base_reward_range``, never raises on a str."""
        if not isinstance(completion, str):
            raise TypeError(f"{self.name}: completion must be str, got {type(completion).__name__}")
        ref = self.check_reference(reference)
        lo, hi = self.base_reward_range
        try:
            value = float(self._reward(completion, ref))
        except Exception:  # hostile completions must never crash training
            logger.debug("%s reward failed; scoring 0", self.name, exc_info=True)
            return lo
        if value != value:  # NaN
            return lo
        return min(max(value, lo), hi)

    def reward(self, completion: str, reference: Any) -> float:
        """Score one completion: ``base_reward`` plus the enabled shaping term; in ``reward_range``."""
        value = self.base_reward(completion, reference)
        if self.anti_short_boxed:
            value += anti_short_boxed_bonus(
                completion, min_chars=self.anti_short_boxed_min_chars, min_ratio=self.anti_short_boxed_min_ratio
            )
        return value

    def is_correct(self, completion: str, reference: Any) -> bool:
        """Strict correctness (used for accuracy): full *base* reward (shaping terms do not count)."""
        return self.base_reward(completion, reference) >= self.base_reward_range[1]

    def same_answer(self, a: str, b: str) -> bool:
        """Whether two extracted answers are the same (maj@k votes): equal up to whitespace."""
        return " ".join(str(a).split()) == " ".join(str(b).split())

    def __repr__(self) -> str:
        extra = ", anti_short_boxed=True" if self.anti_short_boxed else ""
        return f"{type(self).__name__}(name={self.name!r}{extra})"


_REGISTRY: Registry[Callable[..., Task]] = Registry(
    "task", unknown=lambda name, valid: ValueError(f"unknown task {name!r}; valid tasks: {', '.join(valid)}")
)


def register_task(name: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Class/factory decorator: make ``get_task(name)`` build it."""
    return _REGISTRY.register(name)


def available_tasks() -> list[str]:
    """Sorted names of the registered tasks."""
    return list(_REGISTRY.names())


PROMPT_STYLES = ("chat", "compact")


def _constructor_options(factory: Callable[..., Task]) -> set[str] | None:
    """Keyword names ``factory`` takes; None when it takes arbitrary ``**kwargs`` (not checked here).

    A :class:`Task` subclass's ``**kwargs`` are taken to go to ``Task.__init__``, which only has
    :data:`BASE_TASK_OPTIONS`.
    """
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind == p.VAR_KEYWORD for p in params):
        if not (isinstance(factory, type) and issubclass(factory, Task)):
            return None
    return names | set(BASE_TASK_OPTIONS)


def get_task(name: str, *, prompt_style: str = "chat", **kwargs: Any) -> Task:
    """Build the task registered as ``name``.

    ``kwargs`` are its options: the constructor's own (e.g. sudoku's ``blanks``) and
    :data:`BASE_TASK_OPTIONS`, which are applied here for every task (so they work with any
    registered factory). An option neither takes raises ``ValueError`` listing the valid ones.
    """
    factory = _REGISTRY.get(name)  # an unknown name is reported first, as before
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
    valid = _constructor_options(factory)
    if valid is not None:
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise ValueError(
                f"task {name!r}: unknown option(s) {', '.join(map(repr, unknown))}; "
                f"valid options: {', '.join(sorted(valid))}"
            )
    base = {k: kwargs.pop(k) for k in BASE_TASK_OPTIONS if k in kwargs}
    task = factory(**kwargs)
    task.prompt_style = prompt_style
    if base:
        task.set_anti_short_boxed(
            base.get("anti_short_boxed", task.anti_short_boxed),
            min_chars=base.get("anti_short_boxed_min_chars", task.anti_short_boxed_min_chars),
            min_ratio=base.get("anti_short_boxed_min_ratio", task.anti_short_boxed_min_ratio),
        )
    return task


GENERATED_TASKS = ("countdown", "sudoku")
"""Tasks that generate their examples (no data files, no ``prompt_key`` / ``answer_key``)."""
