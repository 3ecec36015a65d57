"""``tools/gpu_check.py --cpu``: the prepared device check runs end to end on the CPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

from stabledrl_mcore.bench import device_check, kernel_checks

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
        "moe_layer",
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
    moe = checks["moe_layer"]
    assert moe["status"] == "ok" and "no TE: local only" in moe["value"], moe
    assert moe["tokens_per_expert_min"] >= 1 and moe["grads_finite"] and moe["layer_tokens_per_s"] > 0
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


@pytest.fixture
def only_moe_layer():
    """``run_checks(cpu=True, only=["moe_layer"])`` in this process (it sets up and tears down
    Megatron's state itself; the CPU redirections go with it, as ``megatron_tp1`` leaves them)."""
    from stabledrl_mcore.parallel import cpu_compat

    torch.set_num_threads(1)
    yield lambda: device_check.run_checks(cpu=True, only=["moe_layer"])["checks"]["moe_layer"]
    cpu_compat.disable()


def test_moe_layer_check_passes_and_reports_the_routing(only_moe_layer):
    moe = only_moe_layer()
    assert moe["status"] == "ok", moe
    assert (moe["preset"], moe["experts"], moe["topk"], moe["tokens"]) == ("sdar-moe-tiny", 4, 2, 128)
    assert 1 <= moe["tokens_per_expert_min"] <= moe["tokens_per_expert_even"] <= moe["tokens_per_expert_max"]
    assert moe["logits"] <= 3e-2 and moe["router_grad"] <= 5e-2 and moe["grads_nonzero"]
    assert "grouped GEMM vs sequential not compared (CUDA is not available)" in moe["value"]


def test_moe_layer_check_fails_when_an_expert_gets_no_token(only_moe_layer, monkeypatch):
    from megatron.core.transformer.moe.router import TopKRouter

    gating = TopKRouter.gating

    def collapsed(self, hidden):  # every token to experts 0 and 1
        logits = gating(self, hidden)
        return logits + torch.tensor([50.0, 50.0, -50.0, -50.0], device=logits.device)

    monkeypatch.setattr(TopKRouter, "gating", collapsed)
    moe = only_moe_layer()
    assert moe["status"] == "FAIL" and moe["tokens_per_expert_min"] == 0, moe
    assert moe["value"].startswith("4 (layer, expert) pairs got no token of 128"), moe["value"]


def test_moe_layer_check_fails_on_a_non_finite_gradient(only_moe_layer, monkeypatch):
    build = kernel_checks.build_model

    def poisoned(*args, **kwargs):  # the router's gradient becomes NaN
        model = build(*args, **kwargs)
        router = next(p for n, p in model.named_parameters() if n.endswith("router.weight"))
        router.register_hook(lambda grad: grad * float("nan"))
        return model

    monkeypatch.setattr(kernel_checks, "build_model", poisoned)
    moe = only_moe_layer()
    assert moe["status"] == "FAIL" and not moe["grads_finite"], moe
    assert moe["value"].startswith("non-finite gradients"), moe["value"]


def test_moe_layer_check_fails_when_the_twin_routes_otherwise(only_moe_layer, monkeypatch):
    """The comparison the GPU runs against TE's grouped experts, on the CPU's stock-local twin: a
    twin whose routers send the tokens elsewhere is caught (few tokens left alike to compare)."""
    from megatron.core.transformer.moe.router import TopKRouter

    build = kernel_checks.build_model

    def misrouted(*args, **kwargs):
        model = build(*args, **kwargs)
        if kwargs.get("stock_local"):  # the twin only
            for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
                gating = router.gating
                router.gating = lambda hidden, gating=gating: gating(hidden).flip(-1) * 1e3
        return model

    monkeypatch.setattr(kernel_checks, "build_model", misrouted)
    moe = only_moe_layer()
    assert moe["status"] == "FAIL" and moe["routed_alike"] < 0.5, moe
    assert "routed alike by stock_local and local" in moe["value"], moe["value"]
