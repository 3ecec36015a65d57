"""Training-state checkpoints: atomic, pruned, complete round trip, resharding TP2 -> TP1."""

import json
import os

import pytest
import torch

from stabledrl_mcore.checkpoint.state import TrainState, find_latest, list_checkpoints, step_dir_name
from stabledrl_mcore.parallel.launch import spawn

VOCAB, SEQ = 64, 12


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def _logits(model):
    with torch.no_grad():
        tok = _tokens()
        return model(tok, torch.arange(SEQ)[None].expand_as(tok), None)


def _save_worker(root, out_dir):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron_helpers import build_tiny_gpt

    from stabledrl_mcore.checkpoint.state import load_checkpoint, save_checkpoint
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(2, 1, seed=3)
    config, model = build_tiny_gpt(2, 1, vocab=VOCAB, seq=SEQ, parallel_output=False)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, bf16=False, params_dtype=torch.float32), [ddp]
    )
    for step in (1, 2, 3):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        _logits_grad = model(_tokens(), torch.arange(SEQ)[None].expand(2, SEQ), None)
        _logits_grad.float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]
        save_checkpoint(
            root,
            TrainState(step=step, data_position=step * 16, world_size=2, tensor_parallel=2),
            model.sharded_state_dict,
            optimizer=opt,
            config_yaml="steps: 3\n",
            keep_last=2,
        )
    reference = _logits(model)
    exp_avg = [opt.optimizer.state[p]["exp_avg"].clone() for p in opt.optimizer.param_groups[0]["params"]]
    after_save_rand = torch.rand(3)
    with torch.no_grad():  # scramble, then restore
        for p in model.parameters():
            p.add_(1.0)
        for p in opt.optimizer.param_groups[0]["params"]:
            opt.optimizer.state[p]["exp_avg"].zero_()
    torch.rand(10)
    state = load_checkpoint(find_latest(root), model, optimizer=opt)
    assert state.step == 3 and state.data_position == 48
    assert torch.equal(torch.rand(3), after_save_rand), "RNG streams were not restored"
    assert torch.equal(_logits(model), reference)
    restored = [opt.optimizer.state[p]["exp_avg"] for p in opt.optimizer.param_groups[0]["params"]]
    assert all(torch.equal(a, b) for a, b in zip(exp_avg, restored))
    if torch.distributed.get_rank() == 0:
        torch.save(reference, os.path.join(out_dir, "logits_tp2.pt"))


def _load_tp1_worker(root, out_dir):
    from megatron_helpers import build_tiny_gpt

    from stabledrl_mcore.checkpoint.state import load_checkpoint
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1, seed=11)
    _, model = build_tiny_gpt(1, 1, vocab=VOCAB, seq=SEQ, parallel_output=False)
    state = load_checkpoint(find_latest(root), model)
    assert state.step == 3 and state.world_size == 2
    diff = (_logits(model) - torch.load(os.path.join(out_dir, "logits_tp2.pt"))).abs().max().item()
    assert diff < 1e-5, f"TP2 -> TP1 logits differ by {diff}"


@pytest.mark.multiprocess
def test_save_prune_restore_and_reshard(tmp_path):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    spawn(_save_worker, 2, (str(root), str(out)), timeout=300)
    names = [os.path.basename(p) for p in list_checkpoints(str(root))]
    assert names == [step_dir_name(2), step_dir_name(3)], "keep_last=2 must prune step 1"
    latest = find_latest(str(root))
    assert json.load(open(os.path.join(latest, "train_state.json")))["step"] == 3
    assert open(os.path.join(latest, "config.yaml")).read() == "steps: 3\n"
    assert sorted(os.listdir(os.path.join(latest, "rng"))) == ["rank00000.pt", "rank00001.pt"]
    fmt = json.load(open(os.path.join(latest, "optimizer_format.json")))
    assert fmt["kind"] == "plain" and fmt["optimizer"] == "AdamW", fmt
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
    spawn(_load_tp1_worker, 1, (str(root), str(out)), timeout=300)


def test_incomplete_checkpoints_are_never_picked(tmp_path):
    root = tmp_path
    (root / step_dir_name(5)).mkdir()
    (root / step_dir_name(5) / "train_state.json").write_text('{"step": 5}')
    (root / ".tmp-step_00000009").mkdir()  # a save killed mid-write
    (root / step_dir_name(7)).mkdir()  # renamed but no state file: not complete
    (root / "step_12").mkdir()  # not our naming
    assert find_latest(str(root)) == str(root / step_dir_name(5))
    assert find_latest(str(root / "missing")) is None


def test_save_verification_names_what_is_missing(tmp_path):
    """A save whose files are not all there is not committed; the message names them."""
    from stabledrl_mcore.checkpoint.state import _missing_files

    (tmp_path / "rng").mkdir()
    (tmp_path / "rng" / "rank00000.pt").write_bytes(b"")
    problem = _missing_files(str(tmp_path), world=2)
    assert "\n" not in problem and "not committed" in problem
    for name in ("metadata.json", ".metadata", "common.pt", "optimizer_format.json", "rng/rank00001.pt"):
        assert name in problem, problem
    assert "rank00000" not in problem
