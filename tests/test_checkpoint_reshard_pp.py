"""Training checkpoints resume at another pipeline-parallel size (issue 27): PP=2 -> PP=1 -> PP=2.

One saved run per optimizer kind (Megatron's distributed optimizer with an fp32 and a bf16
model, the plain optimizer): two updates through Megatron's pipeline schedule at PP=2, saved;
loaded at PP=1 on one process, where every weight and every optimizer tensor (by global
parameter name: fp32 main params, Adam moments, the step count) and the LR schedule equal the
saver's own dump bit for bit, and one more update equals the saver's next update; that PP=1
state saved again and loaded back at PP=2, bit for bit. Before :mod:`stabledrl_mcore.checkpoint.
optimizer_reshard` the distributed optimizer refused any PP change ("reshards across
data-parallel sizes only"), and checkpoints without the bucket map still do. (The plain
optimizer's state already resharded; what is new for it is the one-line note.)
"""

import contextlib
import io
import json
import os
import re

import pytest
import torch
from megatron_helpers import assert_same_tensors

from stabledrl_mcore.parallel.launch import spawn

ROWS, SEQ, MICRO, LR, LAYERS = 4, 12, 2, 1e-2, 2
KINDS = ("dist", "dist-bf16", "plain")  # optim.distributed true (model.dtype fp32 / bf16) and false


# ---------------------------------------------------------------------------- helpers (in ranks)
def _build(kind, pp, seed):
    """Tiny LLaDA stage + Megatron DDP + Megatron AdamW + LR schedule, as rl/setup.py builds them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.set_seed(seed)
    distributed, dtype = kind.startswith("dist"), torch.bfloat16 if kind.endswith("bf16") else torch.float32
    model = build_model(get_preset("llada-tiny", num_layers=LAYERS), params_dtype=dtype)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
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
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=distributed,
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


def _train_step(model, ddp, opt, sched, step):
    """One update on a fixed global batch (split over DP ranks) through the pipeline schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(3, 250, (ROWS, SEQ), generator=gen)
    targets = torch.randint(3, 250, (ROWS, SEQ), generator=gen)
    rows = ROWS // ps.get_data_parallel_world_size()
    mine = slice(ps.get_data_parallel_rank() * rows, (ps.get_data_parallel_rank() + 1) * rows)
    micro = rows // MICRO
    batches = iter(
        [(tokens[mine][i * micro : (i + 1) * micro], targets[mine][i * micro : (i + 1) * micro]) for i in range(MICRO)]
    )

    def forward_step(data_iterator, module):
        tok, tgt = next(data_iterator)
        output = module(tok)

        def loss_func(logits):
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
            return loss, {"loss": loss.detach()}

        return output, loss_func

    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=[ddp],
        num_microbatches=MICRO,
        seq_length=SEQ,
        micro_batch_size=micro,
        forward_only=False,
    )
    assert opt.step()[0], "the optimizer skipped the update"
    sched.step(increment=1)


def _global(name):
    """A stage's parameter name with the global layer number."""
    from megatron.core import parallel_state as ps

    offset = ps.get_pipeline_model_parallel_rank() * (LAYERS // ps.get_pipeline_model_parallel_world_size())
    return re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", name)


def _dump(model, opt):
    """{global name: weight and optimizer tensors}, Adam's step and the LR of this rank's stage."""
    from stabledrl_mcore.checkpoint.optimizer_state import inner_optimizers, is_distributed

    names = {p: _global(n) for n, p in model.named_parameters()}
    out = {name: {"weight": p.detach().clone()} for p, name in names.items()}
    steps = set()
    for inner in inner_optimizers(opt):
        if is_distributed(opt):
            world = inner.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
            for index, buffer in enumerate(inner.buffers):
                (tensors,) = world[index].values()
                for param, (start, end, _) in buffer.param_index_map.items():
                    out[names[param]].update(
                        {k: tensors[k][start:end].view(param.shape).clone() for k in ("param", "exp_avg", "exp_avg_sq")}
                    )
        else:
            for param, name in names.items():
                state = inner.optimizer.state[param]
                out[name].update({k: state[k].clone() for k in ("exp_avg", "exp_avg_sq")})
        per_param = {float(s["step"]) for s in inner.optimizer.state.values() if "step" in s}
        steps |= per_param or {float(g["step"]) for g in inner.optimizer.param_groups if "step" in g}
    assert len(steps) == 1, steps
    return {"tensors": out, "step": steps.pop(), "lr": sorted({g["lr"] for g in opt.param_groups})}


def _write(out_dir, tag, dump):
    torch.save(dump, os.path.join(out_dir, f"{tag}.rank{torch.distributed.get_rank()}.pt"))


def _save(root, step, model, opt, sched):
    from megatron.core import parallel_state as ps

    from stabledrl_mcore.checkpoint.state import TrainState, save_checkpoint

    state = TrainState(
        step=step,
        scheduler=sched.state_dict(),
        world_size=torch.distributed.get_world_size(),
        tensor_parallel=1,
        pipeline_parallel=ps.get_pipeline_model_parallel_world_size(),
    )
    return save_checkpoint(root, state, model.sharded_state_dict, optimizer=opt, keep_last=5)


def _load(path, model, opt, sched):
    """``load_checkpoint`` as the trainer resumes (the schedule advanced to the saved progress);
    returns what it printed."""
    from stabledrl_mcore.checkpoint.state import load_checkpoint

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        state = load_checkpoint(path, model, optimizer=opt)
    sched.step(increment=int(state.scheduler["num_steps"]))
    return printed.getvalue()


# ---------------------------------------------------------------------------- workers
def _save_worker(root, out_dir, kinds):
    """At PP=2: two updates, save, dump, one more update, dump."""
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 2, seed=3)
    for kind in kinds:
        model, ddp, opt, sched = _build(kind, 2, seed=3)
        for step in range(2):
            _train_step(model, ddp, opt, sched, step)
        _save(os.path.join(root, kind), 2, model, opt, sched)
        _write(out_dir, f"{kind}.saved", _dump(model, opt))
        _train_step(model, ddp, opt, sched, 2)
        _write(out_dir, f"{kind}.next", _dump(model, opt))


def _pp1_worker(root, out_dir, kinds):
    """At PP=1: load step 2 (a different initialisation first), dump, one update, dump, save step 3."""
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1, seed=5)
    for kind in kinds:
        model, ddp, opt, sched = _build(kind, 1, seed=5)
        printed = _load(os.path.join(root, kind, "step_00000002"), model, opt, sched)
        assert "resumed at PP=1 from a PP=2 checkpoint" in printed and printed.count("\n") == 1, printed
        if kind == "dist":
            _refused_without_the_map(root, model, opt)
        _write(out_dir, f"{kind}.pp1_loaded", _dump(model, opt))
        _train_step(model, ddp, opt, sched, 2)
        _write(out_dir, f"{kind}.pp1_next", _dump(model, opt))
        _save(os.path.join(root, kind), 3, model, opt, sched)


def _pp2_back_worker(root, out_dir, kinds):
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 2, seed=7)
    for kind in kinds:
        model, ddp, opt, sched = _build(kind, 2, seed=7)
        printed = _load(os.path.join(root, kind, "step_00000003"), model, opt, sched)
        assert torch.distributed.get_rank() or "resumed at PP=2 from a PP=1 checkpoint" in printed, printed
        _write(out_dir, f"{kind}.pp2_back", _dump(model, opt))


def _refused_without_the_map(root, model, opt):
    """A checkpoint from before the bucket map (its format file without it) keeps the old
    refusal at a PP change: one line, before anything is loaded."""
    import shutil

    from stabledrl_mcore.checkpoint.integrity import write_checksums
    from stabledrl_mcore.checkpoint.optimizer_state import OptimizerFormatError

    old = os.path.join(root, "no-map", "step_00000002")
    shutil.copytree(os.path.join(root, "dist", "step_00000002"), old)
    with open(os.path.join(old, "optimizer_format.json")) as handle:
        fmt = json.load(handle)
    fmt.pop("bucket_map", None)
    with open(os.path.join(old, "optimizer_format.json"), "w") as handle:
        json.dump(fmt, handle)
    write_checksums(old)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(OptimizerFormatError) as err:
        _load(old, model, opt, None)
    message = str(err.value)
    assert "\n" not in message and all(
        n in message for n in ("predates the bucket map", "pipeline_parallel=2", "1/1", "model.checkpoint=")
    ), message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a refused load changed weights"


# ---------------------------------------------------------------------------- parent
def _merged(out_dir, tag):
    """Every rank's dump of ``tag`` by global name (stages are disjoint, DP copies must agree)."""
    merged, steps, lrs = {}, set(), set()
    for name in sorted(os.listdir(out_dir)):
        if not name.startswith(tag + ".rank"):
            continue
        dump = torch.load(os.path.join(out_dir, name))
        steps.add(dump["step"])
        lrs.add(tuple(dump["lr"]))
        for key, tensors in dump["tensors"].items():
            if key in merged:
                assert_same_tensors(tensors, merged[key], f"{tag}: DP copies of {key}")
            merged[key] = tensors
    assert len(steps) == 1 and len(lrs) == 1, (steps, lrs)
    return {"tensors": merged, "step": steps.pop(), "lr": lrs.pop()}


def _assert_dumps(got, ref, what, tol=0.0):
    assert_same_tensors(got["tensors"], ref["tensors"], what, tol)
    assert got["step"] == ref["step"], f"{what}: Adam step {got['step']} != {ref['step']}"
    assert got["lr"] == pytest.approx(ref["lr"], abs=tol), f"{what}: lr {got['lr']} != {ref['lr']}"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """The PP=2 run (world 2; DP=2 x PP=2 would double the test's time), its PP=1 continuation (which also checks the refusal
    of a checkpoint without the bucket map) and the way back to PP=2."""
    root = tmp_path_factory.mktemp("reshard")
    ckpt, out = str(root / "ckpt"), str(root)
    spawn(_save_worker, 2, (ckpt, out, KINDS), timeout=240)
    spawn(_pp1_worker, 1, (ckpt, out, KINDS), timeout=240)
    spawn(_pp2_back_worker, 2, (ckpt, out, KINDS), timeout=240)
    return ckpt, out


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_pp2_checkpoint_resumes_at_pp1_and_back_exactly(saved_run, kind):
    ckpt, out = saved_run
    saved, moved = _merged(out, f"{kind}.saved"), _merged(out, f"{kind}.next")
    assert saved["step"] == 2.0 and len(saved["tensors"]) > 10
    assert ("param" in saved["tensors"]["embedding.word_embeddings.weight"]) == kind.startswith("dist")
    _assert_dumps(_merged(out, f"{kind}.pp1_loaded"), saved, f"{kind}: PP=2 -> PP=1 load")
    pp1_next = _merged(out, f"{kind}.pp1_next")
    _assert_dumps(pp1_next, moved, f"{kind}: the next update at PP=1 vs PP=2", tol=1e-6)
    _assert_dumps(_merged(out, f"{kind}.pp2_back"), pp1_next, f"{kind}: PP=1 -> PP=2 load")
    fmt = json.load(open(os.path.join(ckpt, kind, "step_00000002", "optimizer_format.json")))
    assert fmt["kind"] == ("distributed" if kind.startswith("dist") else "plain")
    if kind.startswith("dist"):
        assert fmt["pipeline_parallel"] == 2
        assert sorted(fmt["bucket_map"]) == ["0:0", "0:1"], sorted(fmt["bucket_map"])


def test_a_layout_the_optimizer_state_cannot_be_read_at_is_refused_before_any_rank(tmp_path):
    """``plan_resume`` (the CLI runs it before any rank starts) reads ``optimizer_format.json``:
    another TP size, or another PP size without the bucket map, is refused by name."""
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.engine.resume import ResumeConfigError, plan_resume

    config = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "configs", "tiny_cpu.yaml"
    )
    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    (ckpt / "train_state.json").write_text(json.dumps({"step": 2, "pipeline_parallel": 2}))
    fmt = {"version": 1, "kind": "distributed", "tensor_parallel": 1, "pipeline_parallel": 2, "bucket_map": {}}

    def plan(**overrides):
        (ckpt / "optimizer_format.json").write_text(json.dumps(fmt))
        # a hand-made checkpoint has no checksums.json: trusted (issue #62 refuses it otherwise)
        values = dict(
            {"logging.run_dir": str(tmp_path / "run"), "steps": 4, "checkpoint.trust_unverified": "true"}, **overrides
        )
        return plan_resume(load_config(config, [f"{k}={v}" for k, v in values.items()]), str(ckpt))

    assert plan().state.step == 2  # PP=2 -> PP=1 with the map: accepted
    with pytest.raises(ResumeConfigError, match=r"parallel.tensor_parallel=2: .* saved at tensor_parallel=1"):
        plan(**{"parallel.tensor_parallel": 2})
    del fmt["bucket_map"]
    with pytest.raises(ResumeConfigError, match=r"parallel.pipeline_parallel=1: .*predates the bucket map"):
        plan()
    assert plan(**{"parallel.pipeline_parallel": 2}).state.step == 2
    fmt["kind"] = "plain"  # the plain optimizer's state is keyed by the parameters' sharded tensors
    assert plan(**{"parallel.tensor_parallel": 2}).state.step == 2
