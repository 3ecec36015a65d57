"""Checkpoints cross between the Transformer Engine and the local layer spec, both ways.

TE modules carry ``_extra_state`` (FP8 scaling history) that Megatron saves as a
``ShardedObject``; the local spec has one on its linears (``None``) but none on its norms,
where TE 2.x's ``RMSNorm`` has one. On the CPU a "TE-like" spec stands in for TE: the local
spec with linears and norms (q/k norms, the final norm) that carry an ``_extra_state`` of their
own, as TE's do. Where TE can be imported (a GPU with TE), the same transfers run with real TE.
"""

import contextlib
import json
import os

import pytest
import torch

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.models.linear import AutogradColumnParallelLinear, AutogradRowParallelLinear
from stabledrl_mcore.models.specs import te_unavailable_reason
from stabledrl_mcore.parallel.launch import spawn

REAL_TE_TOL = 1e-3
"""fp32 weights, TE vs local kernels: max |dlogit| over max |logit| (TF32 matmuls round at ~1e-3)."""


class _ExtraState:
    """What a TE module adds to a local one: ``_extra_state`` (bytes in a uint8 tensor, as TE's)."""

    payload = b"fresh"

    def get_extra_state(self):
        return torch.frombuffer(bytearray(self.payload), dtype=torch.uint8)

    def set_extra_state(self, state):
        self.payload = bytes(state.numpy().tobytes()) if isinstance(state, torch.Tensor) else b"none"


class _Column(_ExtraState, AutogradColumnParallelLinear):
    pass


class _Row(_ExtraState, AutogradRowParallelLinear):
    pass


class _Norm(_ExtraState, torch.nn.RMSNorm):
    pass


class _NormFactory:
    """Megatron builds norms as ``module(config=..., hidden_size=..., eps=...)``."""

    def __new__(cls, config, hidden_size, eps=1e-5):
        return _Norm(hidden_size, eps=eps)


@contextlib.contextmanager
def _te_like():
    from megatron.core.transformer import transformer_block

    from stabledrl_mcore.models import model as model_module

    plain, final_norm = model_module.dllm_layer_spec, transformer_block.LayerNormImpl

    def spec(**kwargs):
        built = plain(**kwargs)
        attention = built.submodules.self_attention.submodules
        attention.linear_qkv, attention.linear_proj = _Column, _Row
        attention.q_layernorm = attention.k_layernorm = _NormFactory
        return built

    model_module.dllm_layer_spec, transformer_block.LayerNormImpl = spec, _NormFactory
    try:
        yield
    finally:
        model_module.dllm_layer_spec, transformer_block.LayerNormImpl = plain, final_norm


def _build(cfg, te):
    from stabledrl_mcore.models import build_model

    with _te_like() if te == "like" else contextlib.nullcontext():
        return build_model(cfg, device="cpu" if te != "real" else None, use_te=True if te == "real" else False)


def _logits(model, cfg):
    ids = torch.randint(3, cfg.vocab_size - 2, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids.to(next(model.parameters()).device)).float().cpu()


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _payloads(model):
    return {n: m.payload for n, m in model.named_modules() if isinstance(m, _ExtraState)}


def _transfer_worker(out_dir, te):
    from stabledrl_mcore.checkpoint.mcore_io import load_model_weights, save_model_checkpoint
    from stabledrl_mcore.checkpoint.state import TrainState, load_checkpoint, save_checkpoint
    from stabledrl_mcore.models import get_preset
    from stabledrl_mcore.parallel import bootstrap

    tp = 1 if te == "real" else 2
    bootstrap.initialize(tp, 1, seed=7)
    rank = torch.distributed.get_rank()
    cfg = get_preset("sdar-tiny")  # q/k norms: where TE has _extra_state and local has none
    record = {}
    for name, src, dst, fmt in [
        ("converted local -> TE", "local", te, "model"),
        ("local training -> TE resume", "local", te, "train"),
        ("TE training -> resume without TE", te, "local", "train"),
        ("TE model -> local", te, "local", "model"),
        ("TE training -> TE resume", te, te, "train"),
    ]:
        torch.manual_seed(1)
        source = _build(cfg, src)
        for module in source.modules():
            if isinstance(module, _ExtraState):
                module.payload = b"saved by the source"
        target = _build(cfg, dst)
        path = os.path.join(out_dir, name.replace(" ", "_").replace(">", ""))
        if fmt == "model":
            save_model_checkpoint(source, path)
            load_model_weights(target, path)
        else:
            save_checkpoint(path, TrainState(step=1, world_size=tp, tensor_parallel=tp), source.sharded_state_dict)
            load_checkpoint(os.path.join(path, "step_00000001"), target)
        record[name] = {
            "max_rel_dlogit": _rel(_logits(target, cfg), _logits(source, cfg)),
            "payloads": sorted({p.decode() for p in _payloads(target).values()}),
        }
    if rank == 0:
        with open(os.path.join(out_dir, "record.json"), "w") as handle:
            json.dump(record, handle)


def _check(record, te):
    tolerance = 0.0 if te == "like" else REAL_TE_TOL  # TE's and the local kernels round differently
    for name, got in record.items():
        assert got["max_rel_dlogit"] <= tolerance, f"{name}: the target's logits differ from the source's: {got}"
    if te == "like":
        # a local source has no _extra_state on its norms: those keep their own ("fresh"), the linears
        # get the local spec's None; a TE source's state reaches a TE target unchanged
        assert record["converted local -> TE"]["payloads"] == ["fresh", "none"]
        assert record["local training -> TE resume"]["payloads"] == ["fresh", "none"]
        assert record["TE training -> TE resume"]["payloads"] == ["saved by the source"]


def test_checkpoints_cross_between_te_like_and_local_specs_at_tp2(tmp_path):
    spawn(_transfer_worker, 2, (str(tmp_path), "like"), timeout=400)
    _check(json.load(open(tmp_path / "record.json")), "like")


@pytest.mark.skipif(te_unavailable_reason() is not None, reason=str(te_unavailable_reason()))
def test_checkpoints_cross_between_real_te_and_local_specs(tmp_path):
    spawn(_transfer_worker, 1, (str(tmp_path), "real"), timeout=600)
    _check(json.load(open(tmp_path / "record.json")), "real")


def test_only_absent_extra_state_is_dropped_and_nothing_else_may_be_missing():
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from stabledrl_mcore.checkpoint.extra_state import check_model_fit, drop_absent_extra_state

    def obj(key):
        return ShardedObject(key, None, (4,), (0,), replica_id=0)

    sharded = {
        "model": {
            "a.q_layernorm._extra_state": obj("layers.a.q_layernorm._extra_state"),
            "a.linear_qkv._extra_state": obj("layers.a.linear_qkv._extra_state"),
            "a.other_object": obj("layers.a.other_object"),
        }
    }
    kept, dropped = drop_absent_extra_state(sharded, {"layers.a.linear_qkv._extra_state"})
    assert dropped == ["a.q_layernorm._extra_state"]
    assert sorted(kept["model"]) == [
        "a.linear_qkv._extra_state",
        "a.other_object",
    ]  # absent non-extra: Megatron's error
    check_model_fit(["a.q_layernorm._extra_state"], [], dropped, "ckpt", ConversionError)
    with pytest.raises(ConversionError, match=r"missing \['a.weight'\]"):
        check_model_fit(["a.q_layernorm._extra_state", "a.weight"], [], dropped, "ckpt", ConversionError)
    with pytest.raises(ConversionError, match="unexpected"):
        check_model_fit([], ["b.weight"], dropped, "ckpt", ConversionError)
