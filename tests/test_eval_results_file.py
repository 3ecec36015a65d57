"""Issue 62, slice 4: ``stabledrl eval`` writes its rows as they finish, so an eval stopped part-way
leaves every finished row on disk (before: the results file was written only at the end); a rerun
over the partial file is refused without ``--overwrite``, and a finished run's file is the same.
Issue 75: ``--resume`` goes on from those rows, and the final file and summary are an uninterrupted
run's; a resume with another checkpoint or other settings is refused by name."""

from __future__ import annotations

import json

import pytest

from stabledrl_mcore.cli.app import main

ROWS = [{"prompt": f"tok{10 + i}", "answer": "never"} for i in range(7)]
SAMPLING = ["--gen-length", "4", "--steps", "4", "--block-length", "4", "--no-progress"]


class Stopped(Exception):
    """What the injected fault raises (a kill, in-process)."""


def _rows(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_an_eval_stopped_part_way_leaves_its_finished_rows(llada_hf, qa_file, tmp_path, monkeypatch, capsys, sampled):
    from stabledrl_mcore.evaluation import distributed

    monkeypatch.chdir(tmp_path)
    flags = ["--n", "2", "--temperature", "1.0", "--batch-size", "4"] if sampled else ["--batch-size", "2"]
    argv = ["eval", "--ckpt", llada_hf, "--task", "qa", "--data-path", qa_file, *SAMPLING, *flags]
    assert main([*argv, "--out", "full.jsonl"]) == 0  # two examples per decoded batch either way
    full = _rows(tmp_path / "full.jsonl")
    assert [r["question"] for r in full] == [row["prompt"] for row in ROWS]
    real, calls = distributed.generate, []

    def generate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise Stopped("stopped after two batches")
        return real(*args, **kwargs)

    monkeypatch.setattr(distributed, "generate", generate)
    with pytest.raises(Stopped):
        main([*argv, "--out", "cut.jsonl"])
    header, *kept = _rows(tmp_path / "cut.jsonl.rank0.partial")
    assert header["stabledrl_eval_partial"]["world"] == 1  # the first line says what it is
    assert kept == full[:4]  # the rows of the two finished batches, as a full run writes them
    assert not (tmp_path / "cut.jsonl").exists() and not (tmp_path / "cut.summary.json").exists()
    capsys.readouterr()
    assert main([*argv, "--out", "cut.jsonl"]) == 2  # the partial file is not replaced unasked
    refused = capsys.readouterr().err
    assert "cut.jsonl.rank0.partial exists" in refused and "pass --resume to go on from them" in refused
    assert _rows(tmp_path / "cut.jsonl.rank0.partial")[1:] == full[:4]


def test_ranks_write_partial_files_merged_at_the_end(llada_hf, qa_file, tmp_path, monkeypatch, capsys):
    """With two data-parallel ranks each appends to ``<out>.rank<R>.partial``; the finished run
    merges them into ``--out`` (the single-rank rows) and removes them; one left by a stopped run
    is refused without ``--overwrite``."""
    monkeypatch.chdir(tmp_path)
    argv = ["eval", "--ckpt", llada_hf, "--task", "qa", "--data-path", qa_file, *SAMPLING, "--batch-size", "2"]
    assert main([*argv, "--out", "one.jsonl"]) == 0
    assert main([*argv, "--out", "two.jsonl", "--nproc", "2", "--threads", "1"]) == 0
    assert _rows(tmp_path / "two.jsonl") == _rows(tmp_path / "one.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("two")) == ["two.jsonl", "two.summary.json"]
    (tmp_path / "three.jsonl.rank1.partial").write_text("{}\n")
    capsys.readouterr()
    assert main([*argv, "--out", "three.jsonl", "--nproc", "2"]) == 2
    assert "three.jsonl.rank1.partial exists (the rows of a stopped run" in capsys.readouterr().err


def test_ctrl_c_of_eval_nproc_is_one_line(llada_hf, qa_file, tmp_path, monkeypatch, capsys):
    """The ``--nproc`` launcher stopped its ranks on Ctrl-C (``launch.Interrupted``): one line, 130."""
    from stabledrl_mcore.parallel import launch

    def interrupted(*args, **kwargs):
        raise launch.Interrupted()

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "spawn", interrupted)
    argv = ["eval", "--ckpt", llada_hf, "--task", "qa", "--data-path", qa_file, *SAMPLING, "--nproc", "2"]
    assert main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["stabledrl eval: interrupted"]


def _stopped_after(monkeypatch, batches):
    """``distributed.generate`` raising :class:`Stopped` at its call ``batches + 1`` (a kill, in-process)."""
    from stabledrl_mcore.evaluation import distributed

    real, calls = distributed.generate, []

    def generate(*args, **kwargs):
        calls.append(1)
        if len(calls) == batches + 1:
            raise Stopped(f"stopped after {batches} batches")
        return real(*args, **kwargs)

    monkeypatch.setattr(distributed, "generate", generate)


def _summary(path):
    body = json.load(open(path))
    body.pop("per_example")
    return body


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_stopped_eval_resumed_writes_the_uninterrupted_file(
    llada_hf, qa_file, tmp_path, monkeypatch, capsys, sampled
):
    monkeypatch.chdir(tmp_path)
    flags = ["--n", "2", "--temperature", "1.0", "--batch-size", "4"] if sampled else ["--batch-size", "2"]
    argv = ["eval", "--ckpt", llada_hf, "--task", "qa", "--data-path", qa_file, *SAMPLING, *flags]
    assert main([*argv, "--out", "full.jsonl"]) == 0
    with monkeypatch.context() as patch:
        _stopped_after(patch, 2)
        with pytest.raises(Stopped):
            main([*argv, "--out", "cut.jsonl"])
    # a kill while the third batch's rows were written: the cut row is dropped with its batch
    with open(tmp_path / "cut.jsonl.rank0.partial", "a") as handle:
        handle.write(json.dumps(_rows(tmp_path / "full.jsonl")[4])[:30])
    decoded = []
    from stabledrl_mcore.evaluation import distributed

    real = distributed.generate
    monkeypatch.setattr(distributed, "generate", lambda *a, **k: decoded.append(a[1].shape[0]) or real(*a, **k))
    capsys.readouterr()
    assert main([*argv, "--out", "cut.jsonl", "--resume"]) == 0
    assert "resuming" in capsys.readouterr().out
    assert _rows(tmp_path / "cut.jsonl") == _rows(tmp_path / "full.jsonl")
    assert _summary(tmp_path / "cut.summary.json") == _summary(tmp_path / "full.summary.json")
    assert len(decoded) == 2  # 7 examples, 2 per batch: 4 batches, the first 2 kept
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("cut")) == ["cut.jsonl", "cut.summary.json"]
    capsys.readouterr()
    assert main([*argv, "--out", "cut.jsonl", "--resume"]) == 2  # finished: nothing to resume
    assert "a finished evaluation, nothing to resume" in capsys.readouterr().err


def test_a_two_rank_eval_resumes_from_its_ranks_partial_files(llada_hf, qa_file, tmp_path, monkeypatch, capsys):
    """Each rank of a 2-rank run stopped after its first batch (run in this process as that rank), then
    the resume with --nproc 2 writes the uninterrupted file."""
    from stabledrl_mcore.evaluation import distributed

    monkeypatch.chdir(tmp_path)
    argv = ["eval", "--ckpt", llada_hf, "--task", "qa", "--data-path", qa_file, *SAMPLING, "--batch-size", "2"]
    assert main([*argv, "--out", "one.jsonl"]) == 0
    for rank in (0, 1):
        with monkeypatch.context() as patch:
            patch.setattr(distributed, "_dp_group", lambda rank=rank: (None, rank, 2))
            _stopped_after(patch, 1)
            with pytest.raises(Stopped):  # rank 1 leaves rank 0's file alone (--overwrite: not refused by it)
                main([*argv, "--out", "two.jsonl"] + (["--overwrite"] if rank else []))
    kept = [_rows(tmp_path / f"two.jsonl.rank{rank}.partial")[1:] for rank in (0, 1)]
    full = _rows(tmp_path / "one.jsonl")
    assert kept == [full[:2], full[4:6]]  # the shards are rows 0-3 and 4-6
    capsys.readouterr()
    assert main([*argv, "--out", "two.jsonl", "--resume"]) == 2  # one rank now: refused by name
    assert "was written by 2 data-parallel rank(s), this run has 1" in capsys.readouterr().err
    assert main([*argv, "--out", "two.jsonl", "--nproc", "2", "--threads", "1", "--resume"]) == 0
    assert _rows(tmp_path / "two.jsonl") == full
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("two")) == ["two.jsonl", "two.summary.json"]


def test_a_resume_with_another_checkpoint_or_settings_is_refused_by_name(
    llada_hf, qa_file, tmp_path, monkeypatch, capsys
):
    from hf_fixtures import write_hf_checkpoint

    monkeypatch.chdir(tmp_path)
    other = write_hf_checkpoint(str(tmp_path / "other"), "llada", seed=4)
    argv = ["eval", "--task", "qa", "--data-path", qa_file, *SAMPLING, "--batch-size", "2", "--out", "cut.jsonl"]
    with monkeypatch.context() as patch:
        _stopped_after(patch, 1)
        with pytest.raises(Stopped):
            main([*argv, "--ckpt", llada_hf])
    before = (tmp_path / "cut.jsonl.rank0.partial").read_text()
    capsys.readouterr()
    for flags, named in (
        (["--ckpt", other], "ckpt "),
        (["--ckpt", llada_hf, "--n", "2", "--temperature", "1.0"], "n 1 (now 2)"),
        (["--ckpt", llada_hf, "--seed", "5"], "seed 0 (now 5)"),
    ):
        assert main([*argv, *flags, "--resume"]) == 2
        err = capsys.readouterr().err
        assert "cut.jsonl.rank0.partial was written with another setting" in err and named in err, err
        assert len(err.strip().splitlines()) == 1
    assert (tmp_path / "cut.jsonl.rank0.partial").read_text() == before  # nothing lost
    assert main([*argv, "--ckpt", llada_hf, "--resume", "--overwrite"]) == 2
    assert "pass one" in capsys.readouterr().err
