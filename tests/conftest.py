"""Suite-wide hygiene: no test module leaves a process group behind, and the suite ends with a
bounded number of live threads.

A Megatron start-up on gloo runs ~63 native threads (``pt_gloo_runloop``, ``gloo_tcp_loop``) until
``destroy_process_group``; a module that never tears down leaves them spinning beside every later
test (76 + 38 of them were left at the end of one whole-suite run, which then took 87 min)."""

from __future__ import annotations

import collections
import os
import sys

import pytest

THREAD_LIMIT = 32
"""Live native threads allowed in the pytest process when the suite ends (measured: 8 after a
Megatron start-up and its teardown; one start-up left behind adds ~60)."""


def native_threads() -> collections.Counter:
    """This process's native threads by name (``/proc/<pid>/task/*/comm``; Linux)."""
    names: collections.Counter = collections.Counter()
    task_dir = f"/proc/{os.getpid()}/task"
    for task in os.listdir(task_dir) if os.path.isdir(task_dir) else ():
        try:
            with open(os.path.join(task_dir, task, "comm")) as handle:
                names[handle.read().strip()] += 1
        except OSError:  # the thread ended meanwhile
            pass
    return names


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left_behind(request):
    """After each module (its own fixtures torn down first): destroy whatever process group and
    Megatron state it left, and restore the CPU redirections."""
    yield
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    bootstrap.destroy()
    cpu_compat.disable()


def pytest_sessionfinish(session, exitstatus):
    threads = native_threads()
    if sum(threads.values()) > THREAD_LIMIT and session.config.option.collectonly is False:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = f"{sum(threads.values())} live threads at the end of the suite (limit {THREAD_LIMIT}): {dict(threads.most_common(6))}"
        if reporter is not None:
            reporter.write_line(line, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
