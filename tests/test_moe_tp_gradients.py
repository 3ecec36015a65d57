"""MoE backward reductions at tensor_parallel=2 vs one process (issue #40, item 7).

At TP > 1 without sequence parallelism ``models.moe.DLLMMoELayer`` routes each TP rank's share
of the (replicated) tokens: ``_TokenShard``'s backward all-reduces the shares' input gradients,
``_GatherTokens`` undoes the split, and the router (replicated, seeing one share) has its gradient
scaled by TP and TP-averaged in ``finalize_model_grads``. ``tests/test_moe_rl.py`` compares whole
runs; here one forward + backward of a fixed loss through Megatron DDP and the trainer's
``sync_gradients``: the gradients of every router, every expert weight and the embedding rows a
rank holds at TP=2 (9 tokens: uneven shares 5 / 4, two MoE layers so one layer's ``_TokenShard``
backward feeds the layer below) must equal the single process's to float32 tolerance, on both
TP ranks. Layouts: expert_tensor_parallel = TP (Megatron's default), expert_tensor_parallel=1
(experts whole on every TP rank: their gradients were each rank's share only, never summed over
the TP ranks, before ``DLLMMoELayer`` marked them like the router), and expert_parallel=2 on the
same two ranks.
"""

import os

import pytest
import torch

from stabledrl_mcore.parallel.launch import spawn

SEQ, BATCH = 9, 3


def _model_and_ddp():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from stabledrl_mcore.models import build_model, get_preset

    model = build_model(get_preset("sdar-moe-tiny", init_std=0.2))
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False), model
    )
    return model, ddp


def _compared(name):
    return "router" in name or ".experts." in name or "word_embeddings" in name


def _grads(model, ddp):
    """One forward + backward of a fixed linear function of the logits, gradients synced as the
    trainer syncs them; ``{name: main_grad}`` of the compared parameters."""
    from stabledrl_mcore.engine.gradients import sync_gradients

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 250, (BATCH, SEQ), generator=g)
    weights = torch.randn(BATCH, SEQ, 256, generator=g)
    ddp.zero_grad_buffer()
    model.train()
    logits = ddp(ids)
    (logits.float() * weights).sum().backward()
    sync_gradients(ddp)
    return {n: p.main_grad.detach().clone() for n, p in model.named_parameters() if _compared(n)}


def _single_worker(root):
    """One process: a random model (routers perturbed so every expert is used), saved; its gradients."""
    from stabledrl_mcore.checkpoint.mcore_io import save_model_checkpoint
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1, seed=3)
    model, ddp = _model_and_ddp()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "router" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
    save_model_checkpoint(model, os.path.join(root, "start"))
    torch.save(_grads(model, ddp), os.path.join(root, "single.pt"))


def _tp2_worker(root, layout, expert_parallel, expert_tensor_parallel):
    from megatron.core import parallel_state as ps

    from stabledrl_mcore.checkpoint.mcore_io import load_model_weights
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(2, 1, seed=5, expert_parallel=expert_parallel, expert_tensor_parallel=expert_tensor_parallel)
    assert ps.get_tensor_model_parallel_world_size() == 2
    model, ddp = _model_and_ddp()
    load_model_weights(model, os.path.join(root, "start"))
    grads = _grads(model, ddp)
    meta = {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "local_experts": model.config.num_moe_experts // expert_parallel,
        "etp_rank": ps.get_expert_tensor_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
    }
    torch.save(
        {"grads": grads, "meta": meta},
        os.path.join(root, f"{layout}.rank{ps.get_tensor_model_parallel_rank()}.pt"),
    )


def _single_name(name, meta):
    """The single process's name of a TP=2 rank's parameter (its experts numbered globally)."""
    if ".local_experts." not in name:
        return name
    head, rest = name.split(".local_experts.")
    local, tail = rest.split(".", 1)
    return f"{head}.local_experts.{meta['ep_rank'] * meta['local_experts'] + int(local)}.{tail}"


def _local_part(name, full, meta, tp_rank):
    """This rank's part of the single process's gradient ``full``: its vocab rows of the embedding;
    with expert tensor parallelism its slice of each expert (fc1: SwiGLU's gate and up halves,
    each split by rows; fc2: split by columns)."""
    if "word_embeddings" in name:
        rows = full.shape[0] // 2
        return full[tp_rank * rows : (tp_rank + 1) * rows]
    etp, r = meta["etp"], meta["etp_rank"]
    if ".experts." not in name or etp == 1:
        return full
    if "linear_fc1" in name:
        gate, up = full.chunk(2, 0)
        n = gate.shape[0] // etp
        return torch.cat([gate[r * n : (r + 1) * n], up[r * n : (r + 1) * n]])
    assert "linear_fc2" in name, name
    n = full.shape[1] // etp
    return full[:, r * n : (r + 1) * n]


LAYOUTS = {  # name: (expert_parallel, expert_tensor_parallel); None = tensor_parallel (Megatron's default)
    "tp2": (1, None),
    "tp2_etp1": (1, 1),
    "tp2_ep2": (2, 1),
}


@pytest.fixture(scope="module")
def gradients(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe_tp"))
    spawn(_single_worker, 1, (root,), timeout=120)
    for layout, (ep, etp) in LAYOUTS.items():
        spawn(_tp2_worker, 2, (root, layout, ep, etp), timeout=180)
    return root, torch.load(os.path.join(root, "single.pt"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_gradients_at_tp2_equal_one_process(gradients, layout):
    root, single = gradients
    routers = [n for n in single if "router" in n]
    assert len(routers) == 2 and any(".experts." in n for n in single), sorted(single)
    idle = [n for n, g in single.items() if not g.abs().max() > 0]
    assert len(idle) <= 2, f"experts without tokens: {idle}"  # the comparison sees routed experts
    for rank in (0, 1):
        saved = torch.load(os.path.join(root, f"{layout}.rank{rank}.pt"))
        got, meta = saved["grads"], saved["meta"]
        assert meta["tp_rank"] == rank
        assert any(".experts." in n for n in got) and all(n in got for n in routers), sorted(got)
        for name, grad in got.items():
            want = _local_part(name, single[_single_name(name, meta)], meta, rank)
            assert grad.shape == want.shape, (name, grad.shape, want.shape)
            scale = want.abs().max().item()
            assert scale > 0 or ".experts." in name, f"{name}: no gradient in the single process"
            diff = (grad - want).abs().max().item()
            assert diff <= 1e-4 * scale + 1e-6, f"{layout} rank {rank}: {name} differs by {diff} (max {scale})"
