"""The GPU path on a CPU: one device rule, eval-mode rollouts, spec selection, one-sync finiteness.

On this machine everything lands on the CPU anyway, so these tests check the
rule itself: every tensor and generator the library makes names the model's
device (``device_audit.DeviceAudit``), the model is placed on its target device
in ``params_dtype`` (a meta-device build of the 8B shapes), rollouts decode in
eval mode whatever the training mode (a KV cache cannot run under recompute),
TE is chosen only when Megatron itself can use it, and the gradient-finiteness
check synchronises the host once.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch
from test_models_hf import megatron_tp1  # noqa: F401  (module-scoped Megatron TP=1 state)

from stabledrl_mcore.parallel.launch import spawn


class CharTokenizer:
    """A tokenizer of characters (ids 3..202) for rollouts of tiny models."""

    pad_token_id, eos_token_id, chat_template = 0, 2, None

    def encode(self, text):
        return [3 + ord(ch) % 200 for ch in text]

    def decode(self, ids):
        return "".join(chr(i - 3) if 3 <= i < 203 else "" for i in ids)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")

SDAR_RECIPE_PATH = {
    "model.preset": "sdar-tiny",
    "algo.likelihood": "staircase",
    "rollout.threshold": 0.9,
    "model.recompute": True,
    "model.dtype": "bf16",
    "rollout.block_length": 4,
    "algo.num_mc": 1,
}


def _audited_step(run_dir, extra):
    """One training step plus held-out evaluation (both before and after) under the audit."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from device_audit import DeviceAudit

    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl.setup import build_training
    from stabledrl_mcore.rl.trainer import train

    base = {
        "logging.run_dir": run_dir,
        "logging.wandb_mode": "disabled",
        "logging.progress": False,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 4,
        "rollout.gen_length": 8,
        "rollout.steps": 4,
        "rollout.block_length": 8,
        "parallel.micro_batch_size": 4,
        "steps": 1,
        "eval.every": 1,
        "eval.num_examples": 4,
        "eval.micro_batch_size": 4,
    }
    base.update(extra)
    cfg = load_config(CONFIG, [f"{k}={v}" for k, v in base.items()])
    setup = build_training(cfg)
    device = next(setup.model.parameters()).device
    with DeviceAudit(device, skip=("stabledrl_mcore/checkpoint/", "stabledrl_mcore/convert/")) as audit:
        train(cfg, setup=setup)
    with open(os.path.join(run_dir, "audit.json"), "w") as handle:
        json.dump({"findings": sorted(set(audit.findings)), "checked": audit.checked}, handle)


@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", ["llada", "sdar"])
def test_every_phase_creates_its_tensors_on_the_model_device(tmp_path, arch):
    run_dir = str(tmp_path / arch)
    os.makedirs(run_dir)
    spawn(_audited_step, 1, (run_dir, {} if arch == "llada" else SDAR_RECIPE_PATH), timeout=300)
    with open(os.path.join(run_dir, "audit.json")) as handle:
        result = json.load(handle)
    assert result["checked"] > 50, "the audit saw almost no library tensor creation: is it active?"
    assert result["findings"] == [], "tensors created off the model's device:\n" + "\n".join(result["findings"])


def test_audit_catches_a_missing_device():
    """The audit itself can fail: a library-style call without ``device=`` is reported."""
    from device_audit import DeviceAudit

    from stabledrl_mcore.rl import rollout

    class Tok:
        pad_token_id = 0

        def encode(self, text):
            return [1, 2, 3][: len(text)]

    with DeviceAudit("cpu") as audit:
        rollout.encode_prompts(Tok(), ["ab", "abc"])  # names device="cpu": fine
        rollout.completion_mask_until_eos(torch.zeros(2, 3, dtype=torch.long), 2)
    assert audit.findings == [] and audit.checked >= 2
    code = compile(
        "import torch\ndef make():\n    return torch.zeros(3), torch.Generator()\n",
        os.path.join(ROOT, "stabledrl_mcore", "fake_module.py"),
        "exec",
    )
    namespace: dict = {}
    exec(code, namespace)  # a function whose frames look like library code
    with DeviceAudit("cpu") as audit:
        namespace["make"]()
    assert len(audit.findings) == 2 and "without device=" in audit.findings[0]


# ------------------------------------------------------------------ placement and dtype
@pytest.mark.parametrize("preset", ["llada-8b", "sdar-8b"])
def test_meta_build_of_the_8b_shapes_lands_every_tensor_on_the_target(megatron_tp1, preset):
    from stabledrl_mcore.models import build_model, get_preset, model_device

    cfg = get_preset(preset)
    model = build_model(cfg, params_dtype=torch.bfloat16, device="meta")
    places = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
    dtypes = {p.dtype for p in model.parameters()}
    assert places == {"meta"} and dtypes == {torch.bfloat16}, (places, dtypes)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    assert model_device(model).type == "meta"


def test_bf16_build_keeps_every_parameter_norms_included_in_params_dtype(megatron_tp1):
    from stabledrl_mcore.models import build_model, get_preset

    model = build_model(get_preset("sdar-tiny"), params_dtype=torch.bfloat16)
    wrong = [n for n, p in model.named_parameters() if p.dtype != torch.bfloat16]
    assert wrong == [], f"parameters not in bf16: {wrong}"
    norms = [n for n, _ in model.named_parameters() if "layernorm" in n]
    assert norms, "expected norm weights in the local spec"
    ids = torch.randint(0, 200, (2, 8))
    assert model(ids).dtype == torch.bfloat16


# ------------------------------------------------------------------ eval-mode rollouts
def test_rollouts_decode_in_eval_mode_under_recompute(megatron_tp1):
    """The SDAR-8B recipe path: recompute on, model in training mode, KV-cached block decoding."""
    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.rl.rollout import generate_rollouts
    from stabledrl_mcore.tasks import get_task

    model = build_model(get_preset("sdar-tiny"), recompute=True).train()
    task = get_task("sudoku", prompt_style="compact")
    examples = task.load("train", n=2, seed=0)
    batch = generate_rollouts(
        model,
        CharTokenizer(),
        task,
        examples,
        group_size=2,
        gen_length=8,
        steps=2,
        block_length=4,
        temperature=1.0,
        threshold=0.9,
        micro_batch=4,
        chunk_generator=lambda k: torch.Generator(device="cpu").manual_seed(k),
    )
    assert batch.sequences.shape[0] == 4 and len(batch.completions) == 4
    assert model.training, "the training mode must be restored after the rollout"


# ------------------------------------------------------------------ spec selection
def test_te_spec_only_when_megatron_can_use_it(megatron_tp1, monkeypatch):
    """A TE that imports but that Megatron cannot use (HAVE_TE False) must not be picked."""
    from megatron.core.models.gpt import gpt_layer_specs

    from stabledrl_mcore.models import specs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", False, raising=False)
    local = specs.dllm_layer_spec(qk_layernorm=True)  # default: falls back to the local spec
    assert local.submodules.self_attention.module is specs.HeadsMajorRotarySelfAttention
    assert not specs.te_available()
    assert "does not import" in specs.te_unavailable_reason()
    with pytest.raises(specs.SpecError, match="use_te=True but the Transformer Engine spec cannot be built"):
        specs.dllm_layer_spec(qk_layernorm=True, use_te=True)
    monkeypatch.delitem(sys.modules, "transformer_engine")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(specs.SpecError, match="CUDA is not available"):
        specs.dllm_layer_spec(use_te=True)


# ------------------------------------------------------------------ grads_finite
class _SyncCounter(torch.overrides.TorchFunctionMode):
    """Counts tensor -> host reads (each one a device synchronisation on a GPU)."""

    READS = {"item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_grads_finite_reduces_once_and_syncs_once(megatron_tp1, monkeypatch):
    from stabledrl_mcore.engine.gradients import grads_finite
    from stabledrl_mcore.models import build_model, get_preset

    model = build_model(get_preset("llada-tiny"))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    calls = []
    real = torch.distributed.all_reduce
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    with _SyncCounter() as counter:
        assert grads_finite(model)
    assert len(params) > 10 and counter.reads == 1 and len(calls) == 1, (counter.reads, len(calls))
    params[len(params) // 2].grad[0] = float("nan")
    assert not grads_finite(model)
    params[len(params) // 2].grad[0] = 0.0
    params[-1].main_grad = torch.full_like(params[-1], float("inf"))  # Megatron DDP's buffer wins
    assert not grads_finite(model)
