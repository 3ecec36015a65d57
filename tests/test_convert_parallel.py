"""A converted checkpoint really runs at TP=2 x PP=2, and the way back works from a TP2xPP2 save.

One 4-rank job (gloo, CPU) per test session: for LLaDA and SDAR it builds the
model at TP=2/PP=2, loads the single-process conversion (Megatron reshards on
load; LLaDA's 99 vocab rows become 100 at TP=2, ``allow_shape_mismatch``), checks
it against the same HF directory loaded straight into the sharded model, runs a
forward-only pipeline schedule and saves the model again from that layout.
The parent compares the logits with ``transformers`` references and converts
the TP2xPP2 save back to HF: tensors must equal the source bit for bit.
"""

import json
import os

import pytest
import torch
from hf_fixtures import load_all, write_hf_checkpoint

from stabledrl_mcore.parallel.launch import spawn

NAMES = ("llada", "sdar")
BATCH, SEQ = 2, 12


def _pipeline_logits(model, ids, layout):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, module):
        output = module(next(data_iterator), None, layout)

        def loss_func(logits):
            return logits.float().sum() * 0.0, {"logits": logits.detach()}

        return output, loss_func

    with torch.no_grad():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([ids]),
            model=[model],
            num_microbatches=1,
            seq_length=ids.shape[1],
            micro_batch_size=ids.shape[0],
            forward_only=True,
        )


def _tp2pp2_worker(root):
    from megatron.core import parallel_state as ps

    from stabledrl_mcore.checkpoint.info import read_checkpoint_info
    from stabledrl_mcore.checkpoint.mcore_io import load_model_weights, save_model_checkpoint
    from stabledrl_mcore.convert.loader import load_hf_weights
    from stabledrl_mcore.models import AttentionLayout, build_model
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(2, 2, seed=0)
    for name in NAMES:
        ckpt = os.path.join(root, f"{name}_mcore")
        info = read_checkpoint_info(ckpt)
        model = build_model(info.config).eval()
        assert model.padded_vocab_size == (100 if name == "llada" else 128)
        load_model_weights(model, ckpt)
        direct = build_model(info.config)  # the HF directory straight into the sharded model
        load_hf_weights(direct, os.path.join(root, f"{name}_hf"))
        for (key, a), (_, b) in zip(model.state_dict().items(), direct.state_dict().items()):
            assert not isinstance(a, torch.Tensor) or torch.equal(a, b), f"{name}: {key}"
        layout = AttentionLayout.block_causal(info.config.block_size) if name == "sdar" else None
        result = _pipeline_logits(model, torch.load(os.path.join(root, "ids.pt")), layout)
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
            torch.save(result[0]["logits"], os.path.join(root, f"{name}_tp2pp2_logits.pt"))
        save_model_checkpoint(
            model, os.path.join(root, f"{name}_resaved"), hf_assets=os.path.join(ckpt, "hf"), tied=info.tied_embeddings
        )


@pytest.mark.multiprocess
def test_tp2_pp2_load_forward_save_and_back(tmp_path):
    from megatron.core import dist_checkpointing

    from stabledrl_mcore.convert.convert import hf_to_mcore, mcore_to_hf
    from stabledrl_mcore.convert.hf_config import hf_to_dllm_config
    from stabledrl_mcore.convert.verify import public_reference, reference_logits

    torch.set_num_threads(1)
    root = str(tmp_path)
    ids = torch.randint(0, 90, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    torch.save(ids, os.path.join(root, "ids.pt"))
    sources = {}
    for seed, name in enumerate(NAMES):
        src = write_hf_checkpoint(os.path.join(root, f"{name}_hf"), name, seed=10 + seed, shards=2)
        hf_to_mcore(src, os.path.join(root, f"{name}_mcore"), model=name, tp=2, pp=2, progress=False)
        sources[name] = src

    spawn(_tp2pp2_worker, 4, (root,), timeout=600)

    for name, src in sources.items():
        cfg = hf_to_dllm_config(json.load(open(os.path.join(src, "config.json"))))
        want = reference_logits(public_reference(src), cfg, ids)
        got = torch.load(os.path.join(root, f"{name}_tp2pp2_logits.pt"))
        assert got.shape == want.shape == (BATCH, SEQ, cfg.vocab_size)
        diff = (got - want).abs().max().item()
        assert diff < 1e-4, f"{name}: TP2xPP2 logits differ from transformers by {diff}"

        resaved = os.path.join(root, f"{name}_resaved")
        marker = json.load(open(os.path.join(resaved, "stabledrl_model.json")))
        assert marker["suggested_layout"] == {"tensor_parallel": 2, "pipeline_parallel": 2}
        rows = dist_checkpointing.load_tensors_metadata(resaved)["embedding.word_embeddings.weight"]
        assert rows.global_shape[0] == (100 if name == "llada" else 128)
        back = mcore_to_hf(resaved, os.path.join(root, f"{name}_back"), progress=False)
        want_t, got_t = load_all(src), load_all(back)
        assert sorted(got_t) == sorted(want_t)
        assert all(torch.equal(got_t[k], want_t[k]) for k in want_t), f"{name}: not bit-identical"
        assert hf_to_dllm_config(json.load(open(os.path.join(back, "config.json")))) == cfg
