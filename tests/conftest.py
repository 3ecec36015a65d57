"""Suite-wide hygiene: no test module leaves a process group behind, and the suite ends with a
bounded number of live threads.

A Megatron start-up on gloo runs ~63 native threads (``pt_gloo_runloop``, ``gloo_tcp_loop``) until
``destroy_process_group``; a module that never tears down leaves them spinning beside every later
test (76 + 38 of them were left at the end of one whole-suite run, which then took 87 min)."""

from __future__ import annotations

import collections
import gc
import json
import os
import sys

import pytest

GLOO_THREAD_LIMIT = 32
"""gloo threads (``pt_gloo_runloop``, ``gloo_tcp_loop``) allowed in the pytest process when the suite
ends: one Megatron start-up left alive holds 63 of them; after its teardown 6 stay (measured), and
24 were left at the end of the quick tier."""

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


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


def gloo_threads(threads: collections.Counter) -> int:
    """How many of ``threads`` (by name) are gloo's."""
    return sum(threads[name] for name in GLOO_THREADS)


@pytest.fixture(scope="module")
def llada_hf(tmp_path_factory) -> str:
    """A tiny LLaDA checkpoint in the Hugging Face format (``hf_fixtures``, seed 3), one per module."""
    from hf_fixtures import write_hf_checkpoint

    return write_hf_checkpoint(str(tmp_path_factory.mktemp("hf") / "llada"), "llada", seed=3)


@pytest.fixture
def qa_file(request, tmp_path) -> str:
    """The test module's ``ROWS`` (a list of dicts) as a JSON-lines data file in ``tmp_path``, one
    row a line: what ``--data-path`` of the qa task reads."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in request.module.ROWS))
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left_behind():
    """After each module (its own fixtures torn down first): destroy whatever process group and
    Megatron state it left, restore the CPU redirections, and collect the groups nothing holds
    (a group's threads stop when it is freed)."""
    yield
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available():
        return
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if torch.distributed.is_initialized() or (parallel_state and parallel_state.model_parallel_is_initialized()):
        from stabledrl_mcore.parallel import bootstrap, cpu_compat

        bootstrap.destroy()  # collects the freed groups itself
        cpu_compat.disable()
    else:
        gc.collect()


def pytest_sessionfinish(session, exitstatus):
    gc.collect()
    threads = native_threads()
    gloo = gloo_threads(threads)
    if gloo > GLOO_THREAD_LIMIT and not session.config.option.collectonly:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = (
            f"{gloo} gloo threads alive at the end of the suite (limit {GLOO_THREAD_LIMIT}): a test "
            f"module left a process group running; threads by name: {dict(threads.most_common(6))}"
        )
        if reporter is not None:
            reporter.write_line(line, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
