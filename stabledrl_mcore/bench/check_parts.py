"""The device check's parts, each run in its own child process under its own time limit.

A lent GPU may be one 10-minute run, so no part may hang or hide the others (issue #50):

- :data:`PARTS` is the ordered registry: what matters most first (the 8B rollouts, then the recipe's
  training step, then the kernel checks), each a :class:`Part` with a ``target`` (``module:function``,
  called with the check's options :class:`PartOptions`) and a time limit per mode.
- :func:`run_parts` starts each part as ``python -m stabledrl_mcore.bench.check_parts`` in a new
  session (its own process group), waits at most ``min(limit, budget left)``, and records ``ok`` /
  ``FAIL`` (the part raised, or its process died) / ``TIMEOUT`` (past its limit: the whole group, the
  part and any process it started, is killed by the child's PID) / ``not run`` (the budget was
  spent before it could start), with the seconds it took. The others still run.
- The child imports the target's module, calls the target, and writes its result as JSON (a target
  that raises: ``FAIL`` with the traceback); the project's targets (:mod:`.part_targets`) set up
  Megatron's state themselves, so this module imports nothing beyond the standard library.

A test plants its own parts (``run_checks(parts=...)``, targets in a module of its own): the
registry is data, so nothing in the library changes for it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KILL_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL to a part's process group once it is past its limit."""
MIN_START_S = 5.0
"""A part is not started with less than this many seconds of the budget left."""


@dataclasses.dataclass(frozen=True)
class PartOptions:
    """What every part gets (JSON in the child's argv)."""

    cpu: bool
    workdir: str
    layers: Optional[int] = None
    """Layers of the full-depth parts (rollouts, TE vs local on the cached step); None: the 8B counts."""
    backend: Optional[str] = None
    """``torch.compile`` backend of the captured decoding step; None: inductor on GPU, eager on CPU."""
    rows: Optional[int] = None
    """Rows per decoding forward of the rollout parts; None: the recipe's (see :mod:`.rollout_checks`)."""


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    target: str
    """``module:function``; the function takes a :class:`PartOptions` and returns the result dict
    (``status`` ``ok`` / ``FAIL`` / ``skipped`` plus figures)."""
    gpu_limit_s: float
    cpu_limit_s: float

    def limit_s(self, cpu: bool) -> float:
        return self.cpu_limit_s if cpu else self.gpu_limit_s


def _p(
    name: str, function: str, gpu_s: float, cpu_s: float, module: str = "stabledrl_mcore.bench.part_targets"
) -> Part:
    return Part(name, f"{module}:{function}", gpu_s, cpu_s)


PARTS: Sequence[Part] = (
    _p("rollout_llada", "rollout_llada", 150, 600),
    _p("rollout_sdar", "rollout_sdar", 150, 600),
    _p("recipe_step_llada", "recipe_step_llada", 75, 600),
    _p("recipe_step_sdar", "recipe_step_sdar", 75, 600),
    _p("te_vs_local_decode", "te_vs_local_decode", 45, 300),
    _p("te_vs_local", "te_vs_local", 30, 300),
    _p("flex_vs_sdpa", "flex_vs_sdpa", 30, 300),
    _p("staircase_memory", "staircase_memory", 20, 300),
    _p("moe_layer", "moe_layer", 30, 300),
    _p("train_llada", "train_llada", 45, 600),
    _p("train_sdar", "train_sdar", 45, 600),
)
"""Most important first. GPU limits sum to 645 s against the 570 s default budget (:data:`GPU_BUDGET_S`):
a part that ends early leaves its time to the later ones; whatever is left when the budget is spent
is reported ``not run``. The GPU figures are estimates for one H200 (no GPU has been lent yet)."""

GPU_BUDGET_S = 570.0
"""The whole GPU check: 9.5 minutes of a 10-minute device call (the rest: start-up, copying back)."""
CPU_BUDGET_S = 3600.0
"""The CPU variant's (CI, on 2 shared cores): limits there catch a hang, not a slow machine."""


def run_parts(
    parts: Sequence[Part],
    options: PartOptions,
    budget_s: float,
    *,
    on_done: Optional[Callable[[str, Dict[str, Any]], None]] = None,
) -> Dict[str, Dict[str, Any]]:
    """Run ``parts`` in order, each in a child process, within ``budget_s`` seconds in all."""
    results: Dict[str, Dict[str, Any]] = {}
    start = time.perf_counter()
    for part in parts:
        left = budget_s - (time.perf_counter() - start)
        limit = min(part.limit_s(options.cpu), left)
        if left < MIN_START_S:
            results[part.name] = {
                "status": "not run",
                "ran": False,
                "detail": f"the check's {budget_s:g} s budget was spent ({max(left, 0):.0f} s left)",
                "seconds": 0.0,
                "limit_s": 0.0,
            }
        else:
            results[part.name] = run_part(part, options, limit)
        if on_done is not None:
            on_done(part.name, results[part.name])
    return results


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM then SIGKILL to the child's process group (its PID: ``start_new_session``)."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as handle:
            return handle.read()[-chars:]
    except OSError:
        return ""


def run_part(part: Part, options: PartOptions, limit_s: float) -> Dict[str, Any]:
    """One part in a child process (new session), stopped by its PID past ``limit_s``."""
    os.makedirs(options.workdir, exist_ok=True)
    out = os.path.join(options.workdir, f"part_{part.name}.json")
    log = os.path.join(options.workdir, f"part_{part.name}.log")
    if os.path.exists(out):
        os.remove(out)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    cmd = [
        sys.executable,
        "-m",
        "stabledrl_mcore.bench.check_parts",
        part.target,
        json.dumps(dataclasses.asdict(options)),
        out,
    ]
    start = time.perf_counter()
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = None
        except BaseException:  # the runner itself stopped (Ctrl-C, SIGTERM): the part goes with it
            _kill_group(proc)
            raise
    seconds = round(time.perf_counter() - start, 1)
    base = {"ran": True, "seconds": seconds, "limit_s": round(limit_s, 1), "pid": proc.pid}
    if code is None:
        return {
            **base,
            "status": "TIMEOUT",
            "value": f"past its {limit_s:.0f} s limit: process group {proc.pid} killed",
            "log_tail": _tail(log),
        }
    try:
        with open(out) as handle:
            result = json.load(handle)
    except (OSError, ValueError):
        return {
            **base,
            "status": "FAIL",
            "value": f"the part's process exited {code} with no result",
            "log_tail": _tail(log),
        }
    result.update(base)
    if result.get("status") == "FAIL":
        result.setdefault("log_tail", _tail(log))
    return result


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # KiB on Linux


def child_main(argv: List[str]) -> int:
    """``python -m stabledrl_mcore.bench.check_parts module:function OPTIONS_JSON OUT_JSON``: import the
    target's module (named by the registry, hence ``importlib``), call it, write its result."""
    target, options_json, out = argv
    options = PartOptions(**json.loads(options_json))
    module, function = target.split(":")
    try:
        result = getattr(importlib.import_module(module), function)(options)
    except Exception as err:  # noqa: BLE001 - the parent reports it as this part's failure
        first = str(err).splitlines()[0] if str(err) else ""
        result = {
            "status": "FAIL",
            "value": f"{type(err).__name__}: {first}" if first else type(err).__name__,
            "traceback": traceback.format_exc()[-4000:],
        }
    result.setdefault("peak_rss_gib", round(_peak_rss_gib(), 2))
    with open(out, "w") as handle:
        json.dump(result, handle, default=str)
    return 0 if result.get("status") != "FAIL" else 1


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
