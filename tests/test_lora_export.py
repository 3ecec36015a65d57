"""The merged LoRA export is the adapted model at the run's precision, and ``--peft-out`` loads with
the real ``peft`` library (issue #52).

A tiny SDAR base in the upstream format stored in **bf16**; an fp32 LoRA "run" on it: the base loaded
into an fp32 Megatron model, adapters on every targeted linear with random (non-zero) ``A`` and ``B``,
saved as a training checkpoint is (adapters only, ``config.yaml`` naming the base, ``model.dtype:
fp32``), no training (one process, no rank launch). ``stabledrl convert mcore-to-hf --peft-out`` then:

- the merged export equals the unmerged adapted model at fp32 precision: logits (< 1e-5), and every
  adapted weight equals ``W + (alpha / r) B A`` computed in float64 from the stored bf16 ``W``;
- PEFT's ``PeftModel.from_pretrained`` of the adapter on ``Qwen3ForCausalLM`` of the base (SDAR exports
  load with the public Qwen3 classes, as ``--verify`` does) gives the merged export's logits.

Before the fix the merged weights were ``bf16(W + (alpha / r) B A)`` written as fp32.
"""

from __future__ import annotations

import os

import pytest
import torch
import yaml
from hf_fixtures import load_all, write_hf_checkpoint
from safetensors.torch import load_file
from test_models_hf import megatron_tp1  # noqa: F401  (module-scoped Megatron TP=1 state)

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # q/v of the fused qkv, up of gate/up
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def exported(megatron_tp1, tmp_path_factory):  # noqa: F811
    from stabledrl_mcore.checkpoint.state import TrainState, save_checkpoint
    from stabledrl_mcore.convert.convert import mcore_to_hf
    from stabledrl_mcore.convert.loader import InspectionModel, load_weights, read_config
    from stabledrl_mcore.models import build_model
    from stabledrl_mcore.models.lora import LoRASettings, adapters, apply_lora, checkpointed

    root = tmp_path_factory.mktemp("lora_export")
    base = write_hf_checkpoint(str(root / "base"), "sdar", dtype=torch.bfloat16)
    cfg = read_config(base)
    model = build_model(cfg)  # fp32: the run's model.dtype
    load_weights(model, base)
    apply_lora(model, LoRASettings(RANK, ALPHA, 0.0, tuple(TARGETS), seed=0))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, adapter in adapters(model):
            for param in adapter.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    config = {
        "model": {"checkpoint": base, "dtype": "fp32", "lora": {"rank": RANK, "alpha": ALPHA, "targets": TARGETS}},
        "parallel": {"seed": 0},
    }
    ckpt = save_checkpoint(
        str(root / "checkpoints"),
        TrainState(step=1),
        checkpointed(model).sharded_state_dict,
        config_yaml=yaml.safe_dump(config),
    )
    ids = torch.randint(0, cfg.vocab_size - 2, (2, 12), generator=generator)
    with torch.no_grad():
        adapted = InspectionModel(model.eval(), cfg)(ids)  # unmerged: W x + (alpha / r) B A x
    out, peft = str(root / "merged"), str(root / "peft")
    mcore_to_hf(ckpt, out, peft_out=peft, progress=False)
    return {"base": base, "out": out, "peft": peft, "ids": ids, "adapted": adapted}


def test_the_merged_export_is_the_adapted_model_at_fp32_precision(exported):
    from stabledrl_mcore.convert.loader import load_model

    merged, base = load_all(exported["out"]), load_all(exported["base"])
    assert {t.dtype for t in merged.values()} == {torch.float32}, "written in the run's model.dtype"
    assert {t.dtype for t in base.values()} == {torch.bfloat16}
    adapter = load_file(os.path.join(exported["peft"], "adapter_model.safetensors"))
    modules = sorted(k[len("base_model.model.") : -len(".lora_A.weight")] for k in adapter if ".lora_A." in k)
    changed = sorted(k[: -len(".weight")] for k in base if not torch.equal(base[k].float(), merged[k]))
    assert changed == modules and len(modules) % len(TARGETS) == 0, (changed, modules)
    for module in modules:  # W + (alpha / r) B A in float64 from the stored bf16 W, rounded once to fp32
        a = adapter[f"base_model.model.{module}.lora_A.weight"].double()
        b = adapter[f"base_model.model.{module}.lora_B.weight"].double()
        exact = base[module + ".weight"].double() + (ALPHA / RANK) * b @ a
        error = (merged[module + ".weight"].double() - exact).abs().max().item()
        assert error <= 2**-23 * exact.abs().max().item() * 4, (module, error)
    with torch.no_grad():
        logits = load_model(exported["out"])(exported["ids"])
        base_logits = load_model(exported["base"])(exported["ids"])
    diff = (logits - exported["adapted"]).abs().max().item()
    assert (exported["adapted"] - base_logits).abs().max() > 1e-2, "the adapters change the model"
    assert diff < 1e-5, f"merged export vs the unmerged adapted model: {diff:.3e}"


def test_the_peft_adapter_loads_with_peft_and_gives_the_merged_logits(exported):
    from peft import PeftModel

    from stabledrl_mcore.convert.verify import public_reference

    ids = exported["ids"]
    with torch.no_grad():
        merged = public_reference(exported["out"])(input_ids=ids).logits
        model = PeftModel.from_pretrained(public_reference(exported["base"]), exported["peft"]).eval()
        layers = len({k.split(".")[2] for k in load_all(exported["base"]) if k.startswith("model.layers.")})
        assert len([n for n, _ in model.named_modules() if n.endswith("lora_A")]) == len(TARGETS) * layers
        with_peft = model(input_ids=ids).logits
        plain = public_reference(exported["base"])(input_ids=ids).logits
    diff = (with_peft - merged).abs().max().item()
    assert (with_peft - plain).abs().max() > 1e-2, "the adapter changes the model"
    assert diff < 1e-5, f"PEFT on the base vs the merged export: {diff:.3e}"
