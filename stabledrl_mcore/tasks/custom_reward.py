"""Your own reward function (``rollout.reward_fn``), composed with any task.

``rollout.reward_fn`` is ``path/to/file.py:function`` (a relative path is taken from the
working directory) or ``package.module:function`` (importable on every rank). The file is
imported by every process that builds the task, so nothing has to be registered in Python
and ``python -m stabledrl_mcore.cli train`` under ``srun`` finds it; preflight imports it once
before any rank starts, so a wrong path, a missing function or a wrong signature is one line.

Signature::

    def score(completion: str, reference) -> float

``completion`` is the decoded model output, ``reference`` the example's reference answer as
the task holds it (``qa``, GSM8K, MATH500, AIME: the answer string; countdown and sudoku: their
dict). The value (a finite number; ``bool`` counts as 0/1) replaces the task's reward for
training (``reward_mean``, advantages); accuracy (``accuracy/<task>``) stays the task's own
verifier. The task option ``anti_short_boxed`` still adds its bonus; options that only shape the
task's own reward (:data:`TASK_REWARD_OPTIONS`) are refused. Each call has
``rollout.reward_timeout_s`` seconds. A call that raises, runs out of time or returns something
that is not a finite number scores 0, is counted in the step's ``reward_errors`` metric, and the
first such failure of each kind is printed once per process.

The time limit is a ``SIGALRM`` deadline in the main thread (the training loop); off the main
thread, or while another alarm is armed, the call runs in a helper thread that is abandoned
(still running) when the limit passes. A function that arms its own alarm (e.g. math-verify's
default timeouts) replaces the deadline: call ``math_verify`` with ``parsing_timeout=None`` and
``timeout_seconds=None``, the reward's own limit covers it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
import threading
from typing import Any, Callable

from stabledrl_mcore.common.errors import UserError, one_line
from stabledrl_mcore.tasks.math_equiv import call_with_deadline, signals_available
from stabledrl_mcore.tasks.shaping import anti_short_boxed_bonus

DEFAULT_REWARD_TIMEOUT_S = 10.0
FIELD = "rollout.reward_fn"
TASK_REWARD_OPTIONS = ("format_weight", "solved_bonus")
"""Task options that only shape the task's own reward: refused with ``rollout.reward_fn``."""


class RewardFunctionError(UserError):
    """``rollout.reward_fn`` cannot be loaded (path, module, function or signature)."""


def load_reward_fn(spec: str) -> Callable[[str, Any], Any]:
    """The function ``spec`` names (module docstring); :class:`RewardFunctionError` naming the field."""
    target, _, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not target or not name.isidentifier():
        raise RewardFunctionError(f"{FIELD}={spec}: expected path/to/file.py:function or package.module:function")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _import_file(target, spec)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise RewardFunctionError(
                f"{FIELD}={spec}: cannot import module {target!r} ({err}); give a file "
                f"path (path/to/file.py:{name}) or install the package"
            ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise RewardFunctionError(
            f"{FIELD}={spec}: {target} has no function {name!r} (its functions: {', '.join(found) or 'none'})"
        )
    _check_signature(fn, spec)
    return fn


def _import_file(target: str, spec: str):
    path = os.path.abspath(target)
    if not os.path.isfile(path):
        raise RewardFunctionError(
            f"{FIELD}={spec}: file {path} not found (a relative path is taken from the working directory {os.getcwd()})"
        )
    module_name = f"stabledrl_reward_{hashlib.sha256(path.encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - the user's file: show what it raised, as one line
        raise RewardFunctionError(f"{FIELD}={spec}: importing {path} raised {type(err).__name__}: {err}") from None
    sys.modules[module_name] = module
    return module


def _check_signature(fn: Callable, spec: str) -> None:
    try:
        inspect.signature(fn).bind("completion", "reference")
    except TypeError:
        raise RewardFunctionError(
            f"{FIELD}={spec}: {getattr(fn, '__name__', fn)}{inspect.signature(fn)} cannot "
            f"be called as fn(completion, reference) -> float"
        ) from None
    except ValueError:  # builtins without a signature: accept, a bad call is counted at run time
        pass


class _Failure(Exception):
    """A call that raised, timed out or returned a non-number: ``kind`` and the message to show."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


_TIMED_OUT = object()


class CustomRewardTask:
    """``task`` with its reward replaced by ``fn`` (called under a time limit, failures counted).

    Every other attribute (load, prompt, extract_answer, is_correct, name, ...) is the task's own;
    setting one sets it on the task.
    """

    def __init__(
        self, task: Any, fn: Callable[[str, Any], Any], *, spec: str, timeout_s: float = DEFAULT_REWARD_TIMEOUT_S
    ):
        if not timeout_s > 0:
            raise ValueError(f"rollout.reward_timeout_s must be > 0, got {timeout_s}")
        own = {
            "task": task,
            "fn": fn,
            "spec": spec,
            "timeout_s": float(timeout_s),
            "failures": 0,
            "total_failures": 0,
            "shown": set(),
        }
        self.__dict__.update(own)

    def __getattr__(self, name: str) -> Any:
        if "task" not in self.__dict__:  # half-built (copy, pickle)
            raise AttributeError(name)
        return getattr(self.__dict__["task"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:
            self.__dict__[name] = value
        else:
            setattr(self.task, name, value)

    @property
    def reward_range(self) -> tuple[float, float]:
        return (-math.inf, math.inf)  # whatever the function returns

    def reward(self, completion: str, reference: Any) -> float:
        """``fn(completion, reference)`` as a float; 0.0 (counted, first of each kind shown) on failure."""
        try:
            value = self._call(completion, reference)
        except _Failure as failure:
            self.failures += 1
            self.total_failures += 1
            if failure.kind not in self.shown:
                self.shown.add(failure.kind)
                print(
                    f"stabledrl: warning: {FIELD}={self.spec} {failure} (scored 0; every such failure is "
                    f"counted in the reward_errors metric, this message is shown once)",
                    file=sys.stderr,
                    flush=True,
                )
            value = 0.0
        if getattr(self.task, "anti_short_boxed", False):  # the shaping term of every task adds to yours
            value += anti_short_boxed_bonus(
                completion,
                min_chars=self.task.anti_short_boxed_min_chars,
                min_ratio=self.task.anti_short_boxed_min_ratio,
            )
        return value

    def pop_failures(self) -> int:
        """Failed calls since the last ``pop_failures`` (each step's ``reward_errors``)."""
        count, self.failures = self.failures, 0
        return count

    def _call(self, completion: str, reference: Any) -> float:
        box: dict[str, Any] = {}

        def run() -> Any:
            try:
                box["value"] = self.fn(completion, reference)
            except Exception as err:  # noqa: BLE001 - the user's code: counted and shown
                box["error"] = err
            return box

        if signals_available():
            timed_out = call_with_deadline(run, self.timeout_s, _TIMED_OUT) is _TIMED_OUT
        else:  # off the main thread: a helper thread, abandoned if it overruns
            worker = threading.Thread(target=run, daemon=True, name="reward_fn")
            worker.start()
            worker.join(self.timeout_s)
            timed_out = worker.is_alive()
        if timed_out:
            raise _Failure("timeout", f"took longer than rollout.reward_timeout_s={self.timeout_s:g} s")
        if "error" in box:
            err = box["error"]
            raise _Failure("error", f"raised {type(err).__name__}: {one_line(err)[:300]}")
        value = box.get("value")
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, (str, bytes)) or not math.isfinite(number):
            raise _Failure("value", f"returned {value!r}, not a finite number")
        return number

    def __repr__(self) -> str:
        return f"CustomRewardTask({self.task!r}, reward_fn={self.spec!r})"
