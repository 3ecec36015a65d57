"""``tools/gpu_check.py --cpu``: the prepared device check runs end to end on the CPU."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
def test_gpu_check_cpu_mode_passes(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--cpu", "--json", str(out)],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    checks = result["checks"]
    assert set(checks) == {
        "te_vs_local",
        "flex_vs_sdpa",
        "staircase_memory",
        "train_llada",
        "train_sdar",
        "bench_llada",
        "bench_sdar",
    }
    assert result["ok"] and all(c["status"] in ("ok", "skipped") for c in checks.values()), checks
    assert checks["te_vs_local"]["status"] == "skipped" and "CUDA" in checks["te_vs_local"]["detail"]
    assert max(checks["te_vs_local"]["stock_local"].values()) < 1e-2  # the weight transfer path ran
    assert checks["train_llada"]["resume_bitwise"] and checks["train_sdar"]["resume_bitwise"]
    assert checks["flex_vs_sdpa"]["staircase"]["logits"] < 3e-2
    assert 0 < checks["bench_llada"]["mfu"] and checks["bench_sdar"]["model_flops_per_s"] > 0
    assert "check" in proc.stdout and "all checks passed" in proc.stdout


def test_gpu_check_refuses_unknown_checks(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "gpu_check.py"),
            "--cpu",
            "--only",
            "bogus",
            "--json",
            str(tmp_path / "x.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "unknown check(s) bogus" in proc.stderr
