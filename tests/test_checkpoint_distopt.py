"""Megatron's distributed (ZeRO-1) optimizer on CPU/gloo: it takes effect, and its checkpoints
save, load across data-parallel sizes (DP=2 -> DP=1 -> DP=2), resume bit for bit, and refuse
a mismatched optimizer in one line.

Before :mod:`stabledrl_mcore.checkpoint.optimizer_state`, ``rl/setup.py`` ignored
``optim.distributed`` on CPU, and a distributed-optimizer checkpoint could neither be
saved (Megatron's default ``fully_sharded_model_space``: ``ShardedTensor.flattened_range
is not supported``) nor loaded into a fresh optimizer without TE/apex (torch AdamW:
``DistributedOptimizer.state_dict`` asserts one step value in an empty state). The
first test reproduces both on Megatron itself and then runs our round trip.
"""

import json
import os

import pytest
import torch
from megatron_helpers import assert_same_tensors

from stabledrl_mcore.parallel.launch import spawn

GLOBAL_ROWS, SEQ, LR = 4, 12, 1e-2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------- helpers (in ranks)
def _build(distributed, dtype="fp32", *, tp=1, init=True, name="adam"):
    """Tiny LLaDA backbone + Megatron DDP + Megatron optimizer (AdamW, weight decay, clipping)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    if init:
        bootstrap.initialize(tp, 1, seed=3)
    else:
        bootstrap.set_seed(3)
    params_dtype = DTYPES[dtype]
    model = build_model(get_preset("llada-tiny", num_layers=2), params_dtype=params_dtype)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
        model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=name,
            lr=LR,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.99,
            clip_grad=1.0,
            bf16=params_dtype == torch.bfloat16,
            params_dtype=params_dtype,
            use_distributed_optimizer=distributed,
        ),
        [ddp],
    )
    return model, ddp, opt


def _train_step(model, ddp, opt, step):
    """One update on a fixed global batch of GLOBAL_ROWS sequences, split over DP ranks."""
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(3, 250, (GLOBAL_ROWS, SEQ), generator=gen)
    targets = torch.randint(3, 250, (GLOBAL_ROWS, SEQ), generator=gen)
    rows = GLOBAL_ROWS // ps.get_data_parallel_world_size()
    mine = slice(ps.get_data_parallel_rank() * rows, (ps.get_data_parallel_rank() + 1) * rows)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    logits = model(tokens[mine])
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets[mine].flatten()).backward()
    ddp.finish_grad_sync()
    assert opt.step()[0], "the optimizer skipped the update"


def _weights(model):
    return {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and "_extra_state" not in k
    }


def _optimizer_dump(model, opt):
    """Main params and Adam moments per model parameter name (full tensors), plus Adam's step."""
    from stabledrl_mcore.checkpoint.optimizer_state import inner_optimizers, is_distributed

    names = {p: n for n, p in model.named_parameters()}
    out, steps = {}, set()
    assert is_distributed(opt)
    for dist in inner_optimizers(opt):
        world = dist.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
        for index, buffer in enumerate(dist.buffers):
            (tensors,) = world[index].values()
            for param, (start, end, _) in buffer.param_index_map.items():
                out[names[param]] = {
                    k: tensors[k][start:end].view(param.shape).clone() for k in ("param", "exp_avg", "exp_avg_sq")
                }
        per_param = {float(s["step"]) for s in dist.optimizer.state.values() if "step" in s}
        steps |= per_param or {float(g["step"]) for g in dist.optimizer.param_groups if "step" in g}
    assert len(steps) == 1, steps
    return out, steps.pop()


def _rank():
    return torch.distributed.get_rank()


def _save(root, step, model, opt):
    from stabledrl_mcore.checkpoint.state import TrainState, save_checkpoint

    return save_checkpoint(
        root,
        TrainState(step=step, world_size=torch.distributed.get_world_size()),
        model.sharded_state_dict,
        optimizer=opt,
        keep_last=5,
    )


# ---------------------------------------------------------------------------- workers
def _reproduce_and_roundtrip_worker(root):
    """DP=2: Megatron's two failures, then our save -> load into a fresh optimizer."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.optimizer import distrib_optimizer

    from stabledrl_mcore.checkpoint.optimizer_state import SHARDING_TYPE, is_distributed
    from stabledrl_mcore.checkpoint.state import load_checkpoint

    model, ddp, opt = _build(True)
    assert is_distributed(opt)
    _train_step(model, ddp, opt, 0)
    # failure 1: no metadata -> fully_sharded_model_space -> flattened ranges are refused
    with pytest.raises(CheckpointingException, match="flattened_range is not supported"):
        opt.sharded_state_dict(model.sharded_state_dict())
    path = _save(root, 1, model, opt)
    weights, (moments, step) = _weights(model), _optimizer_dump(model, opt)

    fresh_model, _, fresh = _build(True, init=False)
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        # failure 2: a fresh torch-AdamW distributed optimizer cannot build its load template
        with pytest.raises(AssertionError):
            fresh.sharded_state_dict(
                fresh_model.sharded_state_dict(),
                is_loading=True,
                metadata={"distrib_optim_sharding_type": SHARDING_TYPE},
            )
    load_checkpoint(path, fresh_model, optimizer=fresh)
    assert_same_tensors(_weights(fresh_model), weights, "weights")
    got, got_step = _optimizer_dump(fresh_model, fresh)
    assert_same_tensors(got, moments, "optimizer state")
    assert got_step == step == 1.0
    steps = [s["step"] for s in fresh.chained_optimizers[0].optimizer.state.values() if "step" in s]
    assert len({id(s) for s in steps}) == len(steps), "parameters share one Adam step tensor"


def _parity_worker(out_dir, distributed):
    from stabledrl_mcore.checkpoint.optimizer_state import inner_optimizers, is_distributed

    model, ddp, opt = _build(distributed)
    assert is_distributed(opt) == distributed
    if distributed:  # each DP rank holds only its shard of the fp32 state
        local = sum(p.numel() for o in inner_optimizers(opt) for g in o.optimizer.param_groups for p in g["params"])
        assert local < sum(p.numel() for p in model.parameters()) * 0.75, "the state is not sharded"
    init = _weights(model)
    for step in range(3):
        _train_step(model, ddp, opt, step)
    if _rank() == 0:
        torch.save((init, _weights(model)), os.path.join(out_dir, f"{'dist' if distributed else 'plain'}.pt"))


def _save_dp2_worker(root, out_dir, dtype):
    model, ddp, opt = _build(True, dtype)
    for step in range(2):
        _train_step(model, ddp, opt, step)
    _save(root, 2, model, opt)
    dump = (_weights(model), *_optimizer_dump(model, opt))
    if _rank() == 0:
        torch.save(dump, os.path.join(out_dir, "dp2.pt"))


def _dp1_load_then_save_worker(root, out_dir, dtype):
    from stabledrl_mcore.checkpoint.state import load_checkpoint

    model, ddp, opt = _build(True, dtype)
    state = load_checkpoint(os.path.join(root, "step_00000002"), model, optimizer=opt)
    assert state.step == 2 and state.world_size == 2
    weights, moments, step = torch.load(os.path.join(out_dir, "dp2.pt"))
    assert_same_tensors(_weights(model), weights, "DP=2 -> DP=1 weights")
    got, got_step = _optimizer_dump(model, opt)
    assert_same_tensors(got, moments, "DP=2 -> DP=1 optimizer state")
    assert got_step == step == 2.0
    _train_step(model, ddp, opt, 2)
    _save(root, 3, model, opt)
    torch.save((_weights(model), *_optimizer_dump(model, opt)), os.path.join(out_dir, "dp1.pt"))


def _dp2_load_worker(root, out_dir, dtype):
    from stabledrl_mcore.checkpoint.state import load_checkpoint

    model, ddp, opt = _build(True, dtype)
    load_checkpoint(os.path.join(root, "step_00000003"), model, optimizer=opt)
    weights, moments, step = torch.load(os.path.join(out_dir, "dp1.pt"))
    assert_same_tensors(_weights(model), weights, "DP=1 -> DP=2 weights")
    got, got_step = _optimizer_dump(model, opt)
    assert_same_tensors(got, moments, "DP=1 -> DP=2 optimizer state")
    assert got_step == step == 3.0


def _resume_worker(root, out_dir, dtype, phase):
    from stabledrl_mcore.checkpoint.state import load_checkpoint

    model, ddp, opt = _build(True, dtype)
    if phase == "straight":
        for step in range(4):
            _train_step(model, ddp, opt, step)
            if step + 1 == 2:
                _save(root, 2, model, opt)  # saving must not disturb the run either
    else:
        load_checkpoint(os.path.join(root, "step_00000002"), model, optimizer=opt)
        for step in range(2, 4):
            _train_step(model, ddp, opt, step)
    dump = (_weights(model), *_optimizer_dump(model, opt))
    torch.save(dump, os.path.join(out_dir, f"{phase}.rank{_rank()}.pt"))


def _mismatch_save_worker(root):
    """World 2 at TP=2: a distributed-optimizer checkpoint (and a plain one)."""
    model, ddp, opt = _build(True, tp=2)
    _train_step(model, ddp, opt, 0)
    _save(os.path.join(root, "tp2"), 1, model, opt)


def _mismatch_load_worker(root):
    from stabledrl_mcore.checkpoint.optimizer_state import OptimizerFormatError
    from stabledrl_mcore.checkpoint.state import load_checkpoint

    model, ddp, dist = _build(True)
    _train_step(model, ddp, dist, 0)
    dist_path = _save(os.path.join(root, "dist"), 1, model, dist)
    plain_model, plain_ddp, plain = _build(False, init=False)
    _train_step(plain_model, plain_ddp, plain, 0)
    plain_path = _save(os.path.join(root, "plain"), 1, plain_model, plain)
    _, _, bf16 = _build(True, "bf16", init=False)
    sgd_model, _, sgd = _build(False, init=False, name="sgd")

    def refused(path, into, *needles):
        with pytest.raises(OptimizerFormatError) as err:
            load_checkpoint(path, model, optimizer=into)
        message = str(err.value)
        assert "\n" not in message and all(n in message for n in needles), message

    refused(dist_path, plain, "distributed (ZeRO-1)", "optim.distributed=true", "model.checkpoint=")
    refused(plain_path, dist, "plain (non-distributed)", "optim.distributed=false")
    refused(os.path.join(root, "tp2", "step_00000001"), dist, "tensor_parallel=2", "1/1")
    refused(dist_path, bf16, "bucket layout", "model.dtype")
    refused(plain_path, sgd, "AdamW", "SGD", "optim.name")
    # the weights of a distributed-optimizer checkpoint load anywhere (no optimizer)
    load_checkpoint(os.path.join(root, "tp2", "step_00000001"), sgd_model)
    assert json.load(open(os.path.join(dist_path, "optimizer_format.json")))["kind"] == "distributed"


# ---------------------------------------------------------------------------- tests
@pytest.mark.multiprocess
def test_reproduction_and_roundtrip_at_dp2(tmp_path):
    spawn(_reproduce_and_roundtrip_worker, 2, (str(tmp_path / "ckpt"),), timeout=120)
    fmt = json.load(open(tmp_path / "ckpt" / "step_00000001" / "optimizer_format.json"))
    assert fmt["kind"] == "distributed" and fmt["sharding_type"] == "dp_reshardable"
    assert fmt["data_parallel"] == 2 and fmt["tensor_parallel"] == 1


@pytest.mark.multiprocess
def test_distributed_optimizer_trains_like_the_plain_one(tmp_path):
    spawn(_parity_worker, 2, (str(tmp_path), True), timeout=120)
    spawn(_parity_worker, 2, (str(tmp_path), False), timeout=120)
    (init, dist), (plain_init, plain) = torch.load(tmp_path / "dist.pt"), torch.load(tmp_path / "plain.pt")
    assert_same_tensors(init, plain_init, "initial weights")
    moved = max((plain[k] - init[k]).abs().max().item() for k in init)
    assert moved > 1e-3, "training did not move the weights"
    assert_same_tensors(dist, plain, "distributed vs plain weights", tol=2e-6)


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_reshard_dp2_to_dp1_to_dp2(tmp_path, dtype):
    root, out = str(tmp_path / "ckpt"), str(tmp_path)
    spawn(_save_dp2_worker, 2, (root, out, dtype), timeout=120)
    spawn(_dp1_load_then_save_worker, 1, (root, out, dtype), timeout=120)
    spawn(_dp2_load_worker, 2, (root, out, dtype), timeout=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_at_dp2_is_bitwise(tmp_path, dtype):
    root, out = str(tmp_path / "ckpt"), str(tmp_path)
    spawn(_resume_worker, 2, (root, out, dtype, "straight"), timeout=120)
    spawn(_resume_worker, 2, (root, out, dtype, "resumed"), timeout=120)
    for rank in (0, 1):
        a = torch.load(os.path.join(out, f"straight.rank{rank}.pt"))
        b = torch.load(os.path.join(out, f"resumed.rank{rank}.pt"))
        assert_same_tensors(b[0], a[0], f"rank {rank} weights")
        assert_same_tensors(b[1], a[1], f"rank {rank} optimizer state")
        assert a[2] == b[2] == 4.0


@pytest.mark.multiprocess
def test_mismatched_optimizer_is_refused_in_one_line(tmp_path):
    spawn(_mismatch_save_worker, 2, (str(tmp_path),), timeout=120)
    spawn(_mismatch_load_worker, 1, (str(tmp_path),), timeout=120)


@pytest.mark.multiprocess
def test_trainer_resume_at_dp2_is_bitwise(tmp_path):
    """The RL loop with optim.distributed (the default) on gloo: DP=2 resumes bit for bit."""
    from test_trainer import _metrics, _train_worker

    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    extra = {"steps": 2, "checkpoint.save_every": 1, "optim.lr": 1e-3, "optim.distributed": True}
    spawn(_train_worker, 2, (straight, extra, "final"), timeout=300)
    spawn(_train_worker, 2, (resumed, extra, None, 1), timeout=300)  # stops after step 1
    spawn(_train_worker, 2, (resumed, extra, "final", None, "auto"), timeout=300)
    fmt = json.load(open(os.path.join(resumed, "checkpoints", "step_00000001", "optimizer_format.json")))
    assert fmt["kind"] == "distributed" and fmt["data_parallel"] == 2, fmt
    assert [r["step"] for r in _metrics(resumed)] == [1, 2]
    assert _metrics(straight) == _metrics(resumed), "metrics differ after resume"
    assert _metrics(straight)[-1]["skipped_updates"] == 0 and _metrics(straight)[-1]["grad_norm"] > 0
    for rank in (0, 1):
        a = torch.load(os.path.join(straight, f"final.rank{rank}.pt"))
        b = torch.load(os.path.join(resumed, f"final.rank{rank}.pt"))
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {rank}: parameters are not bitwise equal"


def test_adapter_state_materialization_changes_no_update():
    """Item 1 of the adapter: pre-created torch-Adam state == the state Adam creates lazily."""
    from stabledrl_mcore.checkpoint.optimizer_state import _materialize_torch_adam_state, _set_torch_steps

    def run(materialize):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
        adam = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, betas=(0.9, 0.99))
        if materialize:
            assert _materialize_torch_adam_state(adam) == 2
            assert _materialize_torch_adam_state(adam) == 0  # idempotent
        for step in range(3):
            for p in params:
                p.grad = torch.full_like(p, 0.1 * (step + 1)) + p.detach()
            adam.step()
        return params, adam

    (a, adam_a), (b, _) = run(False), run(True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    _set_torch_steps(adam_a, 7.0)  # item 2: one tensor per parameter, the checkpoint's count
    steps = [adam_a.state[p]["step"] for p in a]
    assert [float(s) for s in steps] == [7.0, 7.0] and steps[0] is not steps[1]
