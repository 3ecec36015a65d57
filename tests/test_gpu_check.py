"""``tools/gpu_check.py --cpu``: the prepared device check runs end to end on the CPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

from stabledrl_mcore.bench import check_parts, device_check, kernel_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


PARTS = (
    "rollout_llada",
    "rollout_sdar",
    "recipe_step_llada",
    "recipe_step_sdar",
    "te_vs_local_decode",
    "te_vs_local",
    "flex_vs_sdpa",
    "staircase_memory",
    "moe_layer",
    "train_llada",
    "train_sdar",
)


@pytest.mark.multiprocess
def test_gpu_check_cpu_mode_passes(tmp_path):
    """Every part at the CPU sizes; the rollouts at 2 layers (``--layers``, the CLI's default being
    the 8B counts) to keep CI short."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--cpu", "--layers", "2", "--json", str(out)],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=3700,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    checks = result["checks"]
    assert tuple(checks) == PARTS and result["ran"] == list(PARTS) and not result["not_run"]
    assert result["ok"] and all(c["status"] in ("ok", "skipped") for c in checks.values()), checks
    assert all(c["seconds"] <= c["limit_s"] for c in checks.values())
    for arch in ("llada", "sdar"):
        roll = checks[f"rollout_{arch}"]
        assert roll["shape"]["layers"] == 2 and roll["shape"]["rows"] == 4, roll["shape"]
        for side in ("eager", "captured"):
            s = roll[side]
            assert s["tokens_per_s"] > 0 and s["forwards"] > 0, s
            assert s["host_ms_per_forward"] > 0 and s["device_ms_per_forward"] > 0, s
        assert roll["captured"]["graphs"] >= 1 and roll["captured"]["graphs_after_warmup"] == 0
        assert roll["captured"]["compile_s"] > 0 and roll["eager"]["graphs"] == 0
        assert roll["tokens_equal"], roll  # fp32, Dynamo's captured graph run eagerly: the same logits
    assert checks["rollout_llada"]["settings"]["cache"] == "none"  # the recipe's (exact) rollouts
    assert checks["rollout_sdar"]["settings"]["threshold"] == 0.9
    decode = checks["te_vs_local_decode"]
    assert decode["status"] == "skipped" and "CUDA" in decode["detail"]
    assert max(v for a in decode["stock_local"].values() for v in a.values()) < 1e-2
    assert checks["te_vs_local"]["status"] == "skipped" and "CUDA" in checks["te_vs_local"]["detail"]
    assert max(checks["te_vs_local"]["stock_local"].values()) < 1e-2  # the weight transfer path ran
    assert checks["train_llada"]["resume_bitwise"] and checks["train_sdar"]["resume_bitwise"]
    assert checks["flex_vs_sdpa"]["staircase"]["logits"] < 3e-2
    moe = checks["moe_layer"]
    assert moe["status"] == "ok" and "no TE: local only" in moe["value"], moe
    assert moe["tokens_per_expert_min"] >= 1 and moe["grads_finite"] and moe["layer_tokens_per_s"] > 0
    for arch, full in (("llada", 32), ("sdar", 36)):
        step = checks[f"recipe_step_{arch}"]
        assert (step["micro_batch"], step["recompute"], step["dtype"]) == (2, True, "bf16"), step
        assert 0 < step["layers_fit"]["layers"] <= full == step["layers_fit"]["of"]
        assert step["mfu"] > 0 and step["mfu_vs_measured"] > 0
    assert "all checks passed" in proc.stdout and "host ms/forward" in proc.stdout


def _planted(name, function, limit_s=60.0):
    return check_parts.Part(name, f"gpu_check_planted:{function}", limit_s, limit_s)


@pytest.fixture
def planted_env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "tests"))


def test_a_part_that_raises_fails_and_the_others_still_run(tmp_path, planted_env):
    parts = [_planted("first", "passes"), _planted("broken", "raises"), _planted("last", "passes")]
    result = device_check.run_checks(cpu=True, workdir=str(tmp_path), parts=parts, layers=3)
    checks = result["checks"]
    assert [checks[n]["status"] for n in ("first", "broken", "last")] == ["ok", "FAIL", "ok"]
    assert (
        checks["broken"]["value"] == "ValueError: planted failure"
        and "raise ValueError" in checks["broken"]["traceback"]
    )
    assert checks["last"]["value"] == "cpu=True layers=3"  # the options reach the part
    assert result["ran"] == ["first", "broken", "last"] and not result["ok"]
    assert "SOME CHECKS FAILED" in device_check.format_table(result)


def test_a_part_past_its_limit_is_stopped_and_reported(tmp_path, planted_env):
    parts = [_planted("hangs", "hangs", limit_s=3.0), _planted("after", "passes")]
    result = device_check.run_checks(cpu=True, workdir=str(tmp_path), parts=parts)
    hung = result["checks"]["hangs"]
    assert hung["status"] == "TIMEOUT" and "past its 3 s limit" in hung["value"], hung
    pid = int((tmp_path / "hangs.pid").read_text())
    assert pid == hung["pid"]
    with pytest.raises(ProcessLookupError):  # stopped (and reaped), not left running
        os.kill(pid, 0)
    assert result["checks"]["after"]["status"] == "ok" and not result["ok"]


def test_parts_past_the_budget_are_reported_not_run(tmp_path, planted_env):
    parts = [_planted("hangs", "hangs", limit_s=60.0), _planted("never", "passes")]
    result = device_check.run_checks(cpu=True, workdir=str(tmp_path), parts=parts, budget_s=6.0)
    assert result["checks"]["hangs"]["status"] == "TIMEOUT" and result["checks"]["hangs"]["limit_s"] <= 6.0
    never = result["checks"]["never"]
    assert never["status"] == "not run" and "budget" in never["detail"] and not never["ran"]
    assert result["ran"] == ["hangs"] and result["not_run"] == ["never"]


def test_the_docs_first_gpu_run_table_has_the_printed_columns():
    text = open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8").read()
    section = text[text.index("## First GPU run") :]
    for columns in (device_check.ROLLOUT_COLUMNS, device_check.STEP_COLUMNS):
        assert "| " + " | ".join(columns) + " |" in section, columns


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
    """The ``moe_layer`` part's check in this process (the tests patch it), with Megatron's state set
    up and torn down as the part's child process does (the CPU redirections go with it, as
    ``megatron_tp1`` leaves them)."""
    from stabledrl_mcore.bench.check_sizes import CPU
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    torch.set_num_threads(1)

    def run():
        torch.manual_seed(0)
        bootstrap.initialize(1, 1, seed=0)
        try:
            return kernel_checks.check_moe_layer(CPU, True)
        finally:
            bootstrap.destroy()

    yield run
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
