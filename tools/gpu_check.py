"""One prepared device check of the 8B recipes' code path (TE, flex attention, the MoE layer, bf16,
distributed optimizer, recompute, checkpoints, MFU): one table on stdout, one JSON file.

    python tools/gpu_check.py --json gpu_check.json          # one GPU, at most ~8 minutes on an H200
    python tools/gpu_check.py --cpu --json gpu_check.json    # the same checks shrunk, on the CPU (CI)

Exit status 0 when no check failed (a skipped check, e.g. TE not installed, is not a failure).
The checks: ``stabledrl_mcore/bench/device_check.py`` (the list), ``kernel_checks.py``,
``workload_checks.py``; their shapes and tolerances: ``check_sizes.py``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stabledrl_mcore.bench.device_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
