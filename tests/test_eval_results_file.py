"""Issue 62, slice 4: ``stabledrl eval`` writes its rows as they finish, so an eval stopped part-way
leaves every finished row on disk (before: the results file was written only at the end); a rerun
over the partial file is refused without ``--overwrite``, and a finished run's file is the same."""

from __future__ import annotations

import json

import pytest

from stabledrl_mcore.cli.app import main

ROWS = [{"prompt": f"tok{10 + i}", "answer": "never"} for i in range(7)]
SAMPLING = ["--gen-length", "4", "--steps", "4", "--block-length", "4", "--no-progress"]


class Stopped(Exception):
    """What the injected fault raises (a kill, in-process)."""


@pytest.fixture
def qa_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return str(path)


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
    assert _rows(tmp_path / "cut.jsonl") == full[:4]  # the rows of the two finished batches, as a full run writes them
    assert not (tmp_path / "cut.summary.json").exists()
    capsys.readouterr()
    assert main([*argv, "--out", "cut.jsonl"]) == 2  # the partial file is not replaced unasked
    assert "cut.jsonl exists; pass --overwrite" in capsys.readouterr().err
    assert _rows(tmp_path / "cut.jsonl") == full[:4]


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
    assert "three.jsonl.rank1.partial exists; pass --overwrite" in capsys.readouterr().err


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
