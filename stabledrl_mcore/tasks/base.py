"""Task protocol, the ``Example`` record and the task registry.

A task bundles three things the RL loop and the evaluator need:

* ``load(split, ...)``: the examples (question text, reference answer, meta),
* ``prompt(example, tokenizer)``: the chat-formatted prompt string,
* ``reward(completion, reference)``: a float in ``reward_range`` = (0, 1).

Rewards receive model output, which is hostile input: every ``reward`` and
``extract_answer`` must return quickly and never raise on any ``str``
completion (a malformed *reference* is a caller bug and raises ``ValueError``).

Tasks register themselves by name with ``@register_task("name")``;
``get_task(name, **kwargs)`` builds one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from stabledrl_mcore.tasks.prompts import build_prompt

logger = logging.getLogger(__name__)

REWARD_RANGE: tuple[float, float] = (0.0, 1.0)


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

    def load(self, split: str, *, path: str | None = None, limit: int | None = None,
             seed: int = 0, n: int | None = None) -> list[Example]: ...

    def prompt(self, example: Example, tokenizer: Any = None) -> str: ...

    def reward(self, completion: str, reference: Any) -> float: ...

    def extract_answer(self, completion: str) -> str | None: ...

    def is_correct(self, completion: str, reference: Any) -> bool: ...


class Task:
    """Base class with the shared plumbing (prompting, safe reward wrapper).

    Subclasses set ``name`` and ``system_prompt`` and implement ``load``,
    ``extract_answer``, ``check_reference`` and ``_reward``.
    """

    name: str = ""
    system_prompt: str = ""
    reward_range: tuple[float, float] = REWARD_RANGE
    prompt_style: str = "chat"
    """``chat`` (system prompt + chat template) or ``compact`` (:meth:`compact_prompt`, for tiny models)."""

    def load(self, split: str, *, path: str | None = None, limit: int | None = None,
             seed: int = 0, n: int | None = None) -> list[Example]:
        raise NotImplementedError

    def prompt(self, example: Example, tokenizer: Any = None) -> str:
        """The full prompt: chat template of ``tokenizer`` if it has one, else plain text.

        With ``prompt_style == "compact"`` it is :meth:`compact_prompt` instead.
        """
        if self.prompt_style == "compact":
            return self.compact_prompt(example)
        return build_prompt(example.prompt, tokenizer, system_prompt=self.system_prompt)

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

    def reward(self, completion: str, reference: Any) -> float:
        """Score one completion; always a float in ``reward_range``, never raises on a str."""
        if not isinstance(completion, str):
            raise TypeError(f"{self.name}: completion must be str, got {type(completion).__name__}")
        ref = self.check_reference(reference)
        try:
            value = float(self._reward(completion, ref))
        except Exception:  # hostile completions must never crash training
            logger.debug("%s reward failed; scoring 0", self.name, exc_info=True)
            return self.reward_range[0]
        lo, hi = self.reward_range
        if value != value:  # NaN
            return lo
        return min(max(value, lo), hi)

    def is_correct(self, completion: str, reference: Any) -> bool:
        """Strict correctness (used for accuracy): full reward."""
        return self.reward(completion, reference) >= self.reward_range[1]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


_REGISTRY: dict[str, Callable[..., Task]] = {}


def register_task(name: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Class/factory decorator: make ``get_task(name)`` build it."""

    def deco(factory: Callable[..., Task]) -> Callable[..., Task]:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"task {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return deco


def available_tasks() -> list[str]:
    """Sorted names of the registered tasks."""
    return sorted(_REGISTRY)


PROMPT_STYLES = ("chat", "compact")


def get_task(name: str, *, prompt_style: str = "chat", **kwargs: Any) -> Task:
    """Build the task registered as ``name`` (kwargs go to its constructor)."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(available_tasks())}")
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
    task = _REGISTRY[name](**kwargs)
    task.prompt_style = prompt_style
    return task
