"""checkpoint/integrity.py alone: every rank's share of a manifest is verified, and every kind of
non-finite value is named (the paths that use them are tested in test_run_safety.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from stabledrl_mcore.checkpoint.integrity import (
    CheckpointError,
    check_finite,
    nonfinite,
    verify_checksums,
    write_checksums,
)
from stabledrl_mcore.parallel.launch import spawn

FILES = [f"shard_{i}.bin" for i in range(5)]


def _verify_each_corruption_worker(directory, out_dir):
    """Rank r: the manifest is written by both ranks (each hashes its share); then each file in
    turn is corrupted (same size, one byte changed) and every rank records verify's message."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    write_checksums(directory)
    dist.barrier()
    seen = {}
    for name in FILES:
        path = os.path.join(directory, name)
        if rank == 0:
            original = open(path, "rb").read()
            open(path, "wb").write(bytes([original[0] ^ 1]) + original[1:])
        dist.barrier()
        try:
            verify_checksums(directory)
            seen[name] = ""
        except CheckpointError as err:
            seen[name] = str(err)
        dist.barrier()
        if rank == 0:
            open(path, "wb").write(original)
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(seen, handle)
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_every_file_is_verified_by_some_rank_at_two_ranks(tmp_path):
    """A corrupted file is named on every rank, whichever rank's share it is in (before: a rank
    hashing another rank's share left files unverified)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for i, name in enumerate(FILES):
        (ckpt / name).write_bytes(bytes(range(i, i + 64)))
    spawn(_verify_each_corruption_worker, 2, (str(ckpt), str(tmp_path)), timeout=180)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in FILES:
            assert name in seen[name] and "does not match" in seen[name], (rank, name, seen[name])


def test_the_advice_for_a_corrupt_file_fits_the_kind_of_checkpoint(tmp_path):
    """A training checkpoint (``train_state.json``) keeps 'resume from an earlier checkpoint'; one
    written by a save of the model alone (a marker without a conversion source) says write it again."""
    for kind, extra in (("train_state.json", "{}"), ("stabledrl_model.json", '{"source": {}}')):
        ckpt = tmp_path / kind
        ckpt.mkdir()
        (ckpt / "shard.bin").write_bytes(bytes(range(64)))
        (ckpt / kind).write_text(extra)
        write_checksums(str(ckpt))
        (ckpt / "shard.bin").write_bytes(bytes(range(1, 65)))
        with pytest.raises(CheckpointError) as err:
            verify_checksums(str(ckpt))
        text = str(err.value)
        assert f"{ckpt / 'shard.bin'} does not match its sha256" in text and "\n" not in text, text
        if kind == "train_state.json":
            assert text.endswith("; resume from an earlier checkpoint"), text
        else:
            assert "resume" not in text and "write it again" in text, text


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_and_both_infinities_are_named(bad, dtype):
    good = torch.ones(3, dtype=dtype)
    broken = torch.tensor([1.0, bad, 2.0, bad], dtype=dtype)
    named = [("ok.weight", good), ("ints", torch.tensor([1, 2])), ("bad.weight", broken)]
    assert nonfinite(named) == "bad.weight (2 of 4 values)"
    with pytest.raises(CheckpointError, match=r"^non-finite parameter bad.weight \(2 of 4 values\) on rank 0 after x$"):
        check_finite(named, "after x")
    assert nonfinite([("ok.weight", good), ("ints", torch.tensor([1, 2]))]) == ""
