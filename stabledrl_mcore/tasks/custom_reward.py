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
``rollout.reward_timeout_s`` seconds. A call that raises (anything: ``SystemExit`` too, only
``KeyboardInterrupt`` propagates), runs out of time or returns something that is not a finite
number (``10**400``, NaN, a string, ...) scores 0, is counted in the step's ``reward_errors``
metric, and the first such failure of each kind is printed once per process. A step whose share
of failed calls exceeds ``rollout.max_reward_error_frac`` ends the run
(:class:`RewardErrorsError`, raised by the trainer with :func:`check_reward_errors`). Pre-emption
(``SIGTERM``/``SIGUSR1``, :mod:`stabledrl_mcore.engine.preemption`) is a flag the signal handler
sets, never an exception, so no reward function can swallow it.

:meth:`CustomRewardTask.rewards` scores a batch with ``rollout.reward_workers`` calls in flight
at once (:func:`~stabledrl_mcore.common.thread_map.map_in_threads`; default
:func:`default_reward_workers`), each under its own time limit, the values in sample order: a
function that hangs on every call costs about one limit per ``reward_workers`` samples, not one
per sample. Calls overlap while they wait (a worker process, I/O, a sleep); pure-Python work in
``thread`` mode still takes turns on the interpreter lock.

``rollout.reward_isolation`` chooses where the calls run:

* ``process`` (default): in persistent worker processes, ``rollout.reward_workers`` per rank
  (:class:`~stabledrl_mcore.common.isolated_calls.IsolatedFunction`), started at the first call.
  A call past its limit kills the worker (``SIGKILL``, its children too) and the next call starts
  a fresh one, so the limit holds for any function: one that catches ``BaseException`` and goes
  on, one blocked in C code, one that calls ``os._exit`` (a crash is counted like an error). The
  cost is a pipe round trip per call (tens of microseconds) and a worker start (an interpreter
  plus your module's imports) at its first call and after each timeout or crash; module-level
  state of your file lives in each worker separately and starts over with it. The workers ignore
  the job's signals and end with their rank.
* ``thread``: in the calling process. The limit is a ``SIGALRM`` deadline in the main thread
  (the training loop); off the main thread, or while another alarm is armed, the call runs in a
  helper thread that is abandoned (still running) when the limit passes. This cannot stop a
  function that catches ``BaseException`` (or uses a bare ``except:``) and keeps going: the
  deadline is re-raised every 50 ms and the call returns only when the function does. Nor can it
  interrupt one C call that does not return to the interpreter (a catastrophic regular
  expression, ``10**10**9``): signal handlers run between bytecodes. With ``reward_workers > 1``
  a batch's calls run in helper threads (the abandoned-thread limit above). An abandoned helper thread
  keeps its CPU and the GIL share it takes. A function that arms its own alarm (e.g.
  math-verify's default timeouts) replaces the deadline: call ``math_verify`` with
  ``parsing_timeout=None`` and ``timeout_seconds=None``, the reward's own limit covers it.
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
from typing import Any, Callable, List, Optional, Sequence, Tuple

from stabledrl_mcore.common.errors import RunFailed, UserError
from stabledrl_mcore.common.isolated_calls import CallFailed, IsolatedFunction, NotANumber, finite_float, raised
from stabledrl_mcore.common.thread_map import available_cpus, map_in_threads
from stabledrl_mcore.tasks.math_equiv import Deadline, call_with_deadline, signals_available
from stabledrl_mcore.tasks.shaping import anti_short_boxed_bonus

DEFAULT_REWARD_TIMEOUT_S = 10.0
FIELD = "rollout.reward_fn"
ISOLATION = ("process", "thread")
"""Values of ``rollout.reward_isolation`` (module docstring), the default first."""
_FILE_MODULE_PREFIX = "stabledrl_reward_"
TASK_REWARD_OPTIONS = ("format_weight", "solved_bonus")
"""Task options that only shape the task's own reward: refused with ``rollout.reward_fn``."""


MAX_DEFAULT_WORKERS = 8
"""The default ``rollout.reward_workers`` is ``min(MAX_DEFAULT_WORKERS, available CPUs)``."""


class RewardFunctionError(UserError):
    """``rollout.reward_fn`` cannot be loaded (path, module, function or signature)."""


class RewardErrorsError(RunFailed):
    """Too many ``rollout.reward_fn`` calls of one step failed (``rollout.max_reward_error_frac``)."""


def default_reward_workers() -> int:
    """``rollout.reward_workers`` when unset: ``min(8, CPUs this process may use)``, per rank."""
    return min(MAX_DEFAULT_WORKERS, available_cpus())


def check_reward_errors(
    limit: float, frac: float, errors: float, step: int, first_error: Callable[[], Optional[str]] = lambda: None
) -> None:
    """:class:`RewardErrorsError` when ``frac`` (the share of a step's reward calls that failed, over
    all data-parallel ranks; ``errors`` of them) exceeds ``limit`` (``rollout.max_reward_error_frac``;
    1 never stops). ``first_error()``: the step's first failure, as its warning shows it (called
    only then: it may be a collective, and ``frac`` is the same on every rank)."""
    if frac <= limit:
        return
    text = first_error()
    seen = f"; the first: {text}" if text else ""
    raise RewardErrorsError(
        f"step {step}: {errors:g} reward calls failed and scored 0, {frac:.3g} of the step's samples "
        f"(> rollout.max_reward_error_frac={limit:g}){seen}. Training would learn from zeros: fix the "
        f"function (call it on a few completions by hand), raise rollout.reward_timeout_s if its calls "
        f"time out, or raise rollout.max_reward_error_frac (1 never stops)"
    )


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
    module_name = f"{_FILE_MODULE_PREFIX}{hashlib.sha256(path.encode()).hexdigest()[:12]}"
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


_TIMED_OUT = object()


def _source_files(fn: Callable) -> dict[str, str]:
    """The reward file ``fn`` was loaded from, by its module name (a worker imports it from there)."""
    name = getattr(fn, "__module__", None) or ""
    module = sys.modules.get(name)
    if name.startswith(_FILE_MODULE_PREFIX) and getattr(module, "__file__", None):
        return {name: module.__file__}
    return {}


class CustomRewardTask:
    """``task`` with its reward replaced by ``fn`` (called under a time limit, in worker processes
    or in this one as ``isolation`` says, failures counted); :meth:`rewards` scores a batch with
    ``workers`` calls at once (None: :func:`default_reward_workers`).

    Every other attribute (load, prompt, extract_answer, is_correct, name, ...) is the task's own;
    setting one sets it on the task.
    """

    def __init__(
        self,
        task: Any,
        fn: Callable[[str, Any], Any],
        *,
        spec: str,
        timeout_s: float = DEFAULT_REWARD_TIMEOUT_S,
        isolation: str = ISOLATION[0],
        workers: Optional[int] = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"rollout.reward_timeout_s must be > 0, got {timeout_s}")
        if isolation not in ISOLATION:
            raise ValueError(f"rollout.reward_isolation must be one of {', '.join(ISOLATION)}, got {isolation!r}")
        workers = default_reward_workers() if workers is None else workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"rollout.reward_workers must be an integer >= 1 (or null), got {workers!r}")
        pool: List[IsolatedFunction] = []
        if isolation == "process":
            try:
                first = IsolatedFunction(fn, source_files=_source_files(fn))
            except TypeError as err:
                raise RewardFunctionError(
                    f"{FIELD}={spec}: {err}; rollout.reward_isolation=process needs a module-level "
                    f"function (or set rollout.reward_isolation=thread)"
                ) from None
            pool = [first] + [IsolatedFunction(fn, source_files=_source_files(fn)) for _ in range(workers - 1)]
        own = {
            "task": task,
            "fn": fn,
            "spec": spec,
            "timeout_s": float(timeout_s),
            "isolation": isolation,
            "worker": pool[0] if pool else None,  # the one serial calls use
            "pool": pool,  # process mode: one worker process per slot of a batch (started at its first call)
            "workers": workers,
            "failures": 0,
            "total_failures": 0,
            "first_failure": None,  # the first failure's message since the last pop
            "shown": set(),
            "lock": threading.Lock(),
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
        return self._score(completion, reference, 0)

    def rewards(self, completions: Sequence[str], references: Sequence[Any]) -> List[float]:
        """``[reward(c, r) ...]`` in order, ``workers`` calls at once (each under its own limit)."""
        if len(completions) != len(references):
            raise ValueError(f"got {len(completions)} completions but {len(references)} references")
        interrupted = threading.Event()

        def stop() -> None:  # Ctrl-C: the batch is abandoned and its workers killed
            interrupted.set()
            self.close()

        return map_in_threads(
            lambda slot, i: self._score(completions[i], references[i], slot, interrupted),
            len(completions),
            self.workers,
            on_interrupt=stop,
        )

    def _score(
        self, completion: str, reference: Any, slot: int, interrupted: Optional[threading.Event] = None
    ) -> float:
        try:
            value = self._call(completion, reference, slot)
        except CallFailed as failure:
            if interrupted is not None and interrupted.is_set():
                return 0.0  # its worker was killed by the Ctrl-C, not by the reward: an abandoned batch's
            self._failed(failure)
            value = 0.0
        if getattr(self.task, "anti_short_boxed", False):  # the shaping term of every task adds to yours
            value += anti_short_boxed_bonus(
                completion,
                min_chars=self.task.anti_short_boxed_min_chars,
                min_ratio=self.task.anti_short_boxed_min_ratio,
            )
        return value

    def _failed(self, failure: CallFailed) -> None:
        with self.lock:
            self.failures += 1
            self.total_failures += 1
            if self.first_failure is None:
                self.first_failure = f"{FIELD}={self.spec} {failure}"
            if failure.kind in self.shown:
                return
            self.shown.add(failure.kind)
            print(
                f"stabledrl: warning: {FIELD}={self.spec} {failure} (scored 0; every such failure is "
                f"counted in the reward_errors metric, this message is shown once)",
                file=sys.stderr,
                flush=True,
            )

    def pop_failures(self) -> int:
        """Failed calls since the last ``pop_failures`` (each step's ``reward_errors``)."""
        return self.pop_failure_report()[0]

    def pop_failure_report(self) -> Tuple[int, Optional[str]]:
        """Failed calls since the last pop and the first one's message (None when none failed)."""
        with self.lock:
            report = (self.failures, self.first_failure)
            self.failures, self.first_failure = 0, None
        return report

    def close(self) -> None:
        """Stop the worker processes (``isolation="process"``; the next call starts another)."""
        for worker in self.pool:
            worker.close()

    def _call(self, completion: str, reference: Any, slot: int = 0) -> float:
        """The checked value of one call (``slot``: the pool's worker process); :class:`CallFailed`
        naming what went wrong."""
        limit = f"took longer than rollout.reward_timeout_s={self.timeout_s:g} s"
        if self.pool:
            try:
                return self.pool[slot].call((completion, reference), self.timeout_s)
            except CallFailed as failure:
                if failure.kind == "timeout":
                    raise CallFailed("timeout", f"{limit} ({failure})") from None
                raise
        box: dict[str, Any] = {}

        def run() -> Any:  # the value is checked inside the limit too: a __float__ is user code
            try:
                value = self.fn(completion, reference)
                box["value"] = finite_float(value)
            except Deadline:  # the limit's own signal, for call_with_deadline
                raise
            except KeyboardInterrupt as err:  # re-raised by the calling thread
                box["interrupt"] = err
            except NotANumber as err:
                box["failure"] = CallFailed("value", str(err))
            except BaseException as err:  # noqa: BLE001 - the user's code, SystemExit included
                box["failure"] = CallFailed("error", raised(err))
            return box

        if signals_available():
            timed_out = call_with_deadline(run, self.timeout_s, _TIMED_OUT) is _TIMED_OUT
        else:  # off the main thread: a helper thread, abandoned if it overruns
            worker = threading.Thread(target=run, daemon=True, name="reward_fn")
            worker.start()
            worker.join(self.timeout_s)
            timed_out = worker.is_alive()
        if timed_out:
            raise CallFailed("timeout", limit)
        if "interrupt" in box:
            raise box["interrupt"]
        if "failure" in box:
            raise box["failure"]
        return box["value"]

    def __repr__(self) -> str:
        return f"CustomRewardTask({self.task!r}, reward_fn={self.spec!r})"
