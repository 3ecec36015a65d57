"""Planted parts for ``tests/test_gpu_check.py`` (targets run by the check's child processes; the
test puts this folder on ``PYTHONPATH``): one that raises, one that never ends, one that passes."""

import os
import time


def raises(options):
    raise ValueError("planted failure")


def hangs(options):
    with open(os.path.join(options.workdir, "hangs.pid"), "w") as handle:
        handle.write(str(os.getpid()))
    while True:
        time.sleep(0.5)


def passes(options):
    return {"status": "ok", "value": f"cpu={options.cpu} layers={options.layers}"}
