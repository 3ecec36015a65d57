"""One optimizer step at TP/PP/DP layouts equals the single-process step (issue: foundation).

A small Megatron-Core transformer (our dLLM layer spec inside ``GPTModel``,
RMSNorm, GQA, SwiGLU, untied head) is trained for one step through Megatron's
DDP, optimizer (with gradient clipping across model-parallel ranks) and
pipeline schedules. The single-process run is the reference; every sharded
rank slices the reference's weights and compares its own shard.
"""

import os
import re

import pytest
import torch

from stabledrl_mcore.parallel.launch import spawn

VOCAB, SEQ, GLOBAL_BATCH, MICRO_BATCHES, LAYERS = 64, 12, 8, 2, 4


def _full_to_shard(name, full, param, tp_rank, tp_size, layer_offset):
    """Slice a full (TP=1) tensor to this rank's shard using Megatron's param attributes."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):  # SwiGLU: each rank holds [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim)[tp_rank], up.chunk(tp_size, dim)[tp_rank]], 0)
    return full.chunk(tp_size, dim)[tp_rank]


def _global_name(name, layer_offset):
    return re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + layer_offset}.", name)


def _worker(tp, pp, ref_dir, result_dir):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_helpers import build_tiny_gpt

    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(tp, pp, seed=7, model_shape=dict(num_layers=LAYERS, num_attention_heads=4, num_query_groups=2))
    config, model = build_tiny_gpt(tp, pp, layers=LAYERS, vocab=VOCAB, seq=SEQ)
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), tp
    offset = ps.get_pipeline_model_parallel_rank() * (LAYERS // pp)
    reference = tp == pp == 1 and torch.distributed.get_world_size() == 1
    if reference:
        torch.save(
            {k: v.clone() for k, v in model.state_dict().items() if v is not None and isinstance(v, torch.Tensor)},
            os.path.join(ref_dir, "before.pt"),
        )
    else:
        before = torch.load(os.path.join(ref_dir, "before.pt"))
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(_full_to_shard(name, before[_global_name(name, offset)], param, tp_rank, tp_size, offset))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="sgd",
            lr=0.5,
            sgd_momentum=0.0,
            weight_decay=0.0,
            clip_grad=0.05,
            bf16=False,
            params_dtype=torch.float32,
        ),
        [ddp],
    )

    gen = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    local = GLOBAL_BATCH // dp_size
    tokens, labels = (t[dp_rank * local : (dp_rank + 1) * local] for t in (tokens, labels))
    micro = local // MICRO_BATCHES
    batches = iter(
        [(tokens[i * micro : (i + 1) * micro], labels[i * micro : (i + 1) * micro]) for i in range(MICRO_BATCHES)]
    )

    def forward_step(data_iterator, module):
        tok, lab = next(data_iterator)
        pos = torch.arange(SEQ).unsqueeze(0).expand_as(tok)
        out = module(tok, pos, None, labels=lab)

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=[ddp],
        num_microbatches=MICRO_BATCHES,
        seq_length=SEQ,
        micro_batch_size=micro,
        forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    assert ok, "optimizer step was skipped"
    if reference:
        torch.save(
            {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
            os.path.join(ref_dir, "after.pt"),
        )
        torch.save({"grad_norm": grad_norm}, os.path.join(ref_dir, "grad_norm.pt"))
        return
    after = torch.load(os.path.join(ref_dir, "after.pt"))
    before = torch.load(os.path.join(ref_dir, "before.pt"))
    max_diff, max_move = 0.0, 0.0
    for name, param in model.named_parameters():
        gname = _global_name(name, offset)
        want = _full_to_shard(name, after[gname], param, tp_rank, tp_size, offset)
        start = _full_to_shard(name, before[gname], param, tp_rank, tp_size, offset)
        max_diff = max(max_diff, (param.detach() - want).abs().max().item())
        max_move = max(max_move, (param.detach() - start).abs().max().item())
    ref_norm = torch.load(os.path.join(ref_dir, "grad_norm.pt"))["grad_norm"]
    rank = torch.distributed.get_rank()
    torch.save(
        {"max_diff": max_diff, "max_move": max_move, "grad_norm": grad_norm, "ref_grad_norm": ref_norm},
        os.path.join(result_dir, f"rank{rank}.pt"),
    )


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    ref = tmp_path_factory.mktemp("reference")
    spawn(_worker, 1, (1, 1, str(ref), str(ref)), timeout=300)
    return ref


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "tp,pp,world", [(2, 1, 2), (1, 2, 2), (1, 1, 2), (2, 2, 4)], ids=["TP2", "PP2", "DP2", "TP2xPP2"]
)
def test_one_step_matches_single_process(reference_dir, tmp_path, tp, pp, world):
    spawn(_worker, world, (tp, pp, str(reference_dir), str(tmp_path)), timeout=400)
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["max_move"] > 1e-4, "weights did not move"
        assert result["max_diff"] < 1e-5, f"rank {rank}: max |param - reference| = {result['max_diff']}"
        assert abs(result["grad_norm"] - result["ref_grad_norm"]) < 1e-5 * max(1.0, result["ref_grad_norm"])
