"""The distributed optimizer's reshard across PP sizes at DP > 1 (issue #40, item 7).

``tests/test_checkpoint_reshard_pp.py`` changes PP at DP = 1, where every rank's optimizer shard
holds whole parameters, so the offset of a rank's part of a parameter inside the saved bucket
(``range_map["param"].start``) is always 0. Here a checkpoint of Megatron's distributed Adam at
PP=2 x DP=2 (world 4; each DP rank owns half of every bucket) resumes at PP=1 x DP=2 (world 2).
Grad buckets of 16000 elements (``overlap_grad_reduce``, as large runs bucket): with llada-tiny's
one bucket the halfway point happens to fall on a parameter boundary, with small buckets it
falls inside parameters (asserted), the case DP = 1 never has. The fp32 main params and both Adam moments of every
parameter, gathered to full tensors (``get_parameter_state_dp_zero``) and keyed by global name,
must equal what the saver gathered at save time bit for bit, and one more update must equal the
saver's next update.
"""

import pytest
import torch
from test_checkpoint_reshard_pp import LAYERS, LR, _assert_dumps, _global, _load, _merged, _save, _train_step, _write

from stabledrl_mcore.parallel.launch import spawn

BUCKET = 16000  # elements: several grad buckets, each cut in half over the DP ranks (inside parameters)


def _build(seed):
    """Tiny LLaDA stage + Megatron DDP (small buckets) + distributed AdamW + LR schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.set_seed(seed)
    model = build_model(get_preset("llada-tiny", num_layers=LAYERS), params_dtype=torch.float32)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET
        ),
        model,
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            min_lr=0.0,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.99,
            clip_grad=1.0,
            params_dtype=torch.float32,
            use_distributed_optimizer=True,
        ),
        [ddp],
    )
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=LR,
        min_lr=0.0,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="linear",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    return model, ddp, opt, sched


def _dump(model, opt):
    """{global name: weight, fp32 main param, exp_avg, exp_avg_sq}, Adam's step and the LR, the
    optimizer tensors gathered over the DP ranks by Megatron (``get_parameter_state_dp_zero``: per
    buffer the buckets' unpadded ranges one after the other, each parameter at its place in its
    bucket)."""
    from stabledrl_mcore.checkpoint.optimizer_state import inner_optimizers

    names = {p: _global(n) for n, p in model.named_parameters()}
    out = {name: {"weight": p.detach().clone()} for p, name in names.items()}
    steps, buckets = set(), 0
    for inner in inner_optimizers(opt):
        world = inner.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
        for index, buffer in enumerate(inner.buffers):
            (tensors,) = world[index].values()
            starts, at = [], 0
            for bucket in buffer.buckets:
                starts.append(at - bucket.offset)  # bucket position -> position in the gathered tensor
                at += bucket.numel_unpadded
            buckets += len(buffer.buckets)
            for param, (start, end, bucket_id) in buffer.param_index_map.items():
                lo, hi = starts[bucket_id] + start, starts[bucket_id] + end
                out[names[param]].update(
                    {k: tensors[k][lo:hi].view(param.shape).clone() for k in ("param", "exp_avg", "exp_avg_sq")}
                )
        steps |= {float(s["step"]) for s in inner.optimizer.state.values() if "step" in s}
    assert len(steps) == 1, steps
    return {"tensors": out, "step": steps.pop(), "lr": sorted({g["lr"] for g in opt.param_groups}), "buckets": buckets}


def _save_worker(root, out_dir):
    """PP=2 x DP=2: two updates, save, dump; one more update, dump."""
    from megatron.core import parallel_state as ps

    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 2, seed=3)
    assert ps.get_data_parallel_world_size() == 2
    model, ddp, opt, sched = _build(seed=3)
    for step in range(2):
        _train_step(model, ddp, opt, sched, step)
    _save(root, 2, model, opt, sched)
    _write(out_dir, "saved", _dump(model, opt))
    _train_step(model, ddp, opt, sched, 2)
    _write(out_dir, "next", _dump(model, opt))


def _load_worker(root, out_dir):
    """PP=1 x DP=2: load (another initialisation first), dump, one update, dump."""
    import os

    from megatron.core import parallel_state as ps

    from stabledrl_mcore.checkpoint.optimizer_state import distributed_parts
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1, seed=5)
    assert ps.get_data_parallel_world_size() == 2
    model, ddp, opt, sched = _build(seed=5)
    # the case under test: this rank's shard starts inside a parameter (it owns a part of it only)
    cut = [
        r["param"].start
        for _, inner in distributed_parts(opt)
        for ranges in inner.gbuf_ranges
        for per_bucket in ranges.values()
        for bucket in per_bucket
        for r in bucket["param_map"].values()
    ]
    assert ps.get_data_parallel_rank() == 0 or any(start > 0 for start in cut), cut
    printed = _load(os.path.join(root, "step_00000002"), model, opt, sched)
    assert torch.distributed.get_rank() or "resumed at PP=1 from a PP=2 checkpoint" in printed, printed
    _write(out_dir, "loaded", _dump(model, opt))
    _train_step(model, ddp, opt, sched, 2)
    _write(out_dir, "loaded_next", _dump(model, opt))


@pytest.mark.multiprocess
def test_pp2_dp2_distributed_optimizer_resumes_at_pp1_dp2_exactly(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path)
    spawn(_save_worker, 4, (ckpt, out), timeout=300)
    spawn(_load_worker, 2, (ckpt, out), timeout=300)
    saved = _merged(out, "saved")
    assert saved["step"] == 2.0 and all("exp_avg" in t for t in saved["tensors"].values())
    _assert_dumps(_merged(out, "loaded"), saved, "PP=2 x DP=2 -> PP=1 x DP=2 load")
    _assert_dumps(_merged(out, "loaded_next"), _merged(out, "next"), "the next update at PP=1 x DP=2", tol=1e-6)
