"""The backbones at TP=2 and PP=2 (gloo, 2 ranks) match the ``transformers`` references.

One spawned job runs both layouts (re-initialising Megatron's parallel state in
between, ~10 s of start-up saved) and writes one result file per layout and
rank; each test reads its layout's files. Checks per layout:

- TP=2: LLaDA / SDAR logits (bidirectional, block-causal, staircase) vs HF;
  vocab-sharded logits + ``vocab_parallel_log_probs`` == gathered log-probs
  (values and gradients); KV-cached block decoding == full pass.
- PP=2: the same logits through Megatron's own pipeline schedule
  (``get_forward_backward_func(forward_only=True)``: ``model_type``,
  ``set_input_tensor``, p2p of hidden states), compared on the last stage.
"""

from __future__ import annotations

import os

import pytest
import torch

from stabledrl_mcore.parallel.launch import spawn


def _tp_checks(result):
    from megatron.core import parallel_state as ps
    from test_models_hf import hf_logits, hf_to_megatron, load_into, make_hf_model, reference_cases, tiny_cfg

    from stabledrl_mcore.models import AttentionLayout, KVCache, build_model, vocab_parallel_log_probs

    rank = ps.get_tensor_model_parallel_rank()
    for arch in ("llada", "sdar"):
        cfg = tiny_cfg(arch)
        hf = make_hf_model(cfg)
        model = build_model(cfg).eval()
        load_into(model, hf_to_megatron(hf.state_dict(), cfg, tp_size=2, tp_rank=rank))
        for name, ids, pos, ours, theirs in reference_cases(cfg):
            with torch.no_grad():
                got = model(ids, pos, ours)
            result[f"{arch}/{name}"] = (got - hf_logits(hf, ids, theirs, pos)).abs().max().item()

        ids, pos, ours = reference_cases(cfg)[-1][1:4]
        targets = torch.randint(0, cfg.vocab_size, ids.shape, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            full = model(ids, pos, ours).requires_grad_()
            shard = model(ids, pos, ours, gather_output=False).requires_grad_()
        assert shard.shape[-1] == cfg.vocab_size // 2
        lp_full, lp_shard = vocab_parallel_log_probs(full, targets), vocab_parallel_log_probs(shard, targets)
        lp_explicit = vocab_parallel_log_probs(shard, targets, vocab_parallel=True)
        (lp_full.sum() + lp_shard.sum()).backward()
        my_cols = full.grad.chunk(2, -1)[rank]
        result[f"{arch}/log_probs"] = max(
            (lp_full - lp_shard).abs().max().item(),
            (lp_full - lp_explicit).abs().max().item(),
            (my_cols - shard.grad).abs().max().item(),
        )

        if arch == "sdar":
            bs, ids = cfg.block_size, torch.randint(0, cfg.vocab_size, (2, 16))
            with torch.no_grad():
                want = model(ids, attention_mask=AttentionLayout.block_causal(bs))
                cache = KVCache()
                with cache.storing():
                    model(ids[:, :8], attention_mask=AttentionLayout.block_causal(bs), kv_cache=cache)
                worst = 0.0
                for lo in (8, 12):
                    step = model(ids[:, lo : lo + bs], kv_cache=cache)
                    worst = max(worst, (step - want[:, lo : lo + bs]).abs().max().item())
                    with cache.storing():
                        model(ids[:, lo : lo + bs], kv_cache=cache)
            result["sdar/kv_cache"] = worst


def _pp_checks(result):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from test_models_hf import hf_logits, hf_to_megatron, load_into, make_hf_model, reference_cases, tiny_cfg

    from stabledrl_mcore.models import build_model

    stage, last = ps.get_pipeline_model_parallel_rank(), ps.is_pipeline_last_stage()
    for arch in ("llada", "sdar"):
        cfg = tiny_cfg(arch)
        hf = make_hf_model(cfg)
        model = build_model(cfg).eval()
        per_stage = cfg.num_layers // 2
        load_into(
            model,
            hf_to_megatron(
                hf.state_dict(),
                cfg,
                layer_offset=stage * per_stage,
                num_local_layers=per_stage,
                pre_process=stage == 0,
                post_process=last,
            ),
        )
        for name, ids, pos, ours, theirs in reference_cases(cfg):

            def forward_step(data_iterator, module):
                batch = next(data_iterator)
                return module(batch[0], batch[1], batch[2]), None

            with torch.no_grad():
                outputs = get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=iter([(ids, pos, ours)]),
                    model=[model],
                    num_microbatches=1,
                    seq_length=ids.shape[1],
                    micro_batch_size=ids.shape[0],
                    forward_only=True,
                )
            if last:
                want = hf_logits(hf, ids, theirs, pos)
                result[f"{arch}/{name}"] = (outputs[0] - want).abs().max().item()


def _worker(result_dir):
    from megatron.core import parallel_state

    from stabledrl_mcore.parallel import bootstrap

    rank = int(os.environ["RANK"])
    for layout, (tp, pp), checks in (("tp2", (2, 1), _tp_checks), ("pp2", (1, 2), _pp_checks)):
        bootstrap.initialize(tp, pp, seed=0)
        result = {}
        checks(result)
        torch.save(result, os.path.join(result_dir, f"{layout}_rank{rank}.pt"))
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("models_parallel")
    spawn(_worker, 2, (str(out),), timeout=400)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout,ranks,expected",
    [
        (
            "tp2",
            (0, 1),
            {
                "llada/bidirectional",
                "llada/bidirectional_per_row_positions",
                "llada/log_probs",
                "sdar/block_causal",
                "sdar/block_causal_bool",
                "sdar/block_causal_per_row_positions",
                "sdar/staircase",
                "sdar/log_probs",
                "sdar/kv_cache",
            },
        ),
        (
            "pp2",
            (1,),
            {
                "llada/bidirectional",
                "llada/bidirectional_per_row_positions",
                "sdar/block_causal",
                "sdar/block_causal_bool",
                "sdar/block_causal_per_row_positions",
                "sdar/staircase",
            },
        ),
    ],
)
def test_parallel_layouts_match_transformers(parallel_results, layout, ranks, expected):
    for rank in ranks:
        result = torch.load(parallel_results / f"{layout}_rank{rank}.pt")
        assert set(result) == expected, f"rank {rank} ran {sorted(result)}"
        worst = {k: v for k, v in result.items() if not v < 1e-4}
        assert not worst, f"{layout} rank {rank}: max |diff| above 1e-4: {worst}"
