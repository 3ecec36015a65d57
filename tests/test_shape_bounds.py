"""Issue 62, slice 3: shapes and rows bounded before the run.

``--print-config`` (and so every ``train``) refuses a config whose per-rank memory, by ``stabledrl
plan``'s estimate, exceeds the memory of the ranks' device (the host's available memory on CPU),
naming the fields that drive it; a data row whose question is longer than the prompt budget allows
is refused by its row index and length before anything tokenises it. In-process through
``stabledrl_mcore.cli.app``; nothing here allocates what the configs ask for.
"""

import json
import os
import time
from collections import namedtuple

import pytest

from stabledrl_mcore.cli.app import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
T = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "parallel.micro_batch_size=4",
    "logging.wandb_mode=disabled",
    "logging.progress=false",
    "steps=1",
]
PROMPT_CHARS_PER_TOKEN = 16  # the documented rule (docs/data.md; tasks/from_config.py)


def _refused(capsys, tmp_path, *overrides):
    """``train --print-config`` exits 2 with one line on stderr; that line."""
    argv = ["train", "--config", CONFIG, *T, f"logging.run_dir={tmp_path / 'run'}", *overrides, "--print-config"]
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 2, captured.out[-2000:]
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    return lines[0]


def _tokenised(monkeypatch) -> list:
    """The length of every text any of the project's tokenizers is given from now on."""
    from stabledrl_mcore.tasks import tokenizer as tokenizer_module

    seen = []
    for cls in vars(tokenizer_module).values():
        if isinstance(cls, type) and "encode" in vars(cls):
            original = vars(cls)["encode"]

            def encode(self, text, *args, _original=original, **kwargs):
                seen.append(len(text))
                return _original(self, text, *args, **kwargs)

            monkeypatch.setattr(cls, "encode", encode)
    return seen


def test_a_completion_of_ten_million_tokens_is_refused_by_print_config(capsys, tmp_path):
    """The issue's first reproduction: said "preflight ok", then the run allocated ~10 GB and died in a
    raw RuntimeError. The estimate (over 1000 GiB) exceeds any host's memory."""
    line = _refused(capsys, tmp_path, "rollout.gen_length=10000000", "rollout.block_length=10000000")
    assert "memory: one rank needs at least" in line, line
    assert "rollout.gen_length=10000000" in line and "parallel.micro_batch_size=4" in line, line
    assert "at most 192 GiB on any GPU" in line, line  # parallel.backend=auto, no GPU: the largest GPU's
    line = _refused(
        capsys, tmp_path, "parallel.backend=gloo", "rollout.gen_length=10000000", "rollout.block_length=10000000"
    )
    assert "GiB of host memory available" in line, line  # a CPU run: this host's memory


def test_a_group_of_a_hundred_thousand_is_refused_where_it_cannot_fit(capsys, tmp_path, monkeypatch):
    """The issue's second reproduction (~8 GB, then a traceback): a decoding forward holds whole groups,
    so group_size 1e5 means 1e5 rows at once (about 6 GiB by the planner). A CPU run on a host with
    4 GiB available (a laptop; stubbed here, the test host may have more) is refused naming the field."""
    import psutil

    Memory = namedtuple("Memory", "available total")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(4 * 2**30, 8 * 2**30))
    line = _refused(
        capsys,
        tmp_path,
        "parallel.backend=gloo",  # a CPU run (with auto and no GPU visible, only > 192 GiB is refused)
        "rollout.group_size=100000",
        "rollout.gen_length=8",
        "rollout.block_length=8",
        "rollout.steps=4",
    )
    assert "memory: one rank needs at least" in line and "rollout.group_size=100000" in line, line
    assert "has 4.0 GiB of host memory available" in line, line


def test_the_tiny_config_still_passes(capsys, tmp_path):
    assert main(["train", "--config", CONFIG, f"logging.run_dir={tmp_path / 'run'}", "--print-config"]) == 0
    assert "preflight ok" in capsys.readouterr().out


def test_a_row_of_a_million_characters_is_refused_by_index_before_any_tokenizer(capsys, tmp_path, monkeypatch):
    """The issue's third reproduction: one row of ~1M characters of real text (8 GB resident, then a
    traceback). It is refused by its row index and length, and no tokenizer ever sees more than the
    character cap (16 x the prompt budget in tokens)."""
    seen = _tokenised(monkeypatch)
    data = tmp_path / "qa.jsonl"
    text = "The quick brown fox jumps over the lazy dog. " * 23000  # 1,035,000 characters
    with open(data, "w") as handle:
        handle.write(json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
        handle.write(json.dumps({"prompt": text, "answer": "4"}) + "\n")
    start = time.monotonic()
    line = _refused(
        capsys,
        tmp_path,
        "rollout.task=qa",
        f"rollout.data_path={data}",
        "rollout.gen_length=8",
        "rollout.block_length=8",
        "rollout.steps=4",
    )
    assert f"rollout.data_path={data} row 1: the question is 1,035,000 characters" in line, line
    assert "refused, not truncated" in line, line
    budget = 512 - 8  # llada-tiny's max_position_embeddings - rollout.gen_length
    assert f"more than the {PROMPT_CHARS_PER_TOKEN * budget:,}" in line, line
    assert all(n <= PROMPT_CHARS_PER_TOKEN * budget for n in seen), seen
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("length", [100, 8000])
def test_rows_within_the_budget_pass(capsys, tmp_path, length):
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"prompt": "x" * length, "answer": "4"}) + "\n")
    argv = ["train", "--config", CONFIG, *T, f"logging.run_dir={tmp_path / 'run'}"]
    argv += ["rollout.task=qa", f"rollout.data_path={data}", "rollout.gen_length=8", "rollout.block_length=8"]
    assert main([*argv, "rollout.steps=4", "--print-config"]) == 0, capsys.readouterr().err


def test_gpu_ranks_are_checked_against_the_gpus_total_memory(capsys, tmp_path, monkeypatch):
    """parallel.backend=nccl: the GPU's total memory as nvidia-smi reports it (a stand-in script here:
    no GPU on the test host, and no CUDA context is created to read it); where no GPU memory can be
    read (a login node), nothing is refused."""
    from stabledrl_mcore.cli import memory_check as memory

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 81559\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    assert memory._gpu_total_bytes() == 81559 * 2**20
    line = _refused(
        capsys, tmp_path, "parallel.backend=nccl", "rollout.gen_length=10000000", "rollout.block_length=10000000"
    )
    assert "but has 79.6 GiB of GPU memory per rank" in line and "rollout.gen_length=10000000" in line, line
    monkeypatch.setattr(memory, "_gpu_total_bytes", lambda: None)
    cfg_argv = ["train", "--config", CONFIG, *T, f"logging.run_dir={tmp_path / 'run'}", "parallel.backend=nccl"]
    assert main([*cfg_argv, "rollout.gen_length=10000000", "rollout.block_length=10000000", "--print-config"]) == 0


# the tiny HF checkpoint: max_position_embeddings 64, so with --gen-length 4 a question holds
# 16 x (64 - 4) = 960 characters
SAMPLING = ["--gen-length", "4", "--steps", "4", "--block-length", "4", "--no-progress"]
TOO_LONG = "The quick brown fox jumps over the lazy dog. " * 30  # 1,350 characters


def _one_error_line(capsys, argv) -> str:
    assert main(argv) == 2, argv
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_eval_refuses_a_too_long_row_by_index_before_any_tokenizer(llada_hf, capsys, tmp_path, monkeypatch):
    """``eval --data-path`` applies train's rule (it tokenised the whole row and decoded it)."""
    monkeypatch.chdir(tmp_path)  # eval's default results file
    data = tmp_path / "qa.jsonl"
    rows = [{"prompt": "tok5", "answer": "4"}, {"prompt": TOO_LONG, "answer": "4"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    seen = _tokenised(monkeypatch)
    line = _one_error_line(capsys, ["eval", "--ckpt", llada_hf, "--task", "qa", "--data-path", str(data), *SAMPLING])
    assert f"eval.data_path={data} row 1: the question is 1,350 characters, more than the 960" in line, line
    assert "max_position_embeddings 64 - --gen-length 4" in line and "refused, not truncated" in line, line
    assert seen == [], "nothing was tokenised"
    # a file of rows within the budget passes
    data.write_text(json.dumps(rows[0]) + "\n")
    assert main(["eval", "--ckpt", llada_hf, "--task", "qa", "--data-path", str(data), *SAMPLING, "--check"]) == 0


def test_generate_refuses_a_too_long_prompt_and_a_fifo_by_name(llada_hf, capsys, tmp_path, monkeypatch):
    seen = _tokenised(monkeypatch)
    base = ["generate", "--ckpt", llada_hf, *SAMPLING]
    line = _one_error_line(capsys, [*base, "--prompt", "tok5", "--prompt", TOO_LONG])
    assert line.endswith(
        "--prompt #2: the question is 1,350 characters, more than the 960 a prompt may hold (16 characters per "
        "token of the prompt budget, 60 tokens = the model's max_position_embeddings 64 - --gen-length 4); such "
        "rows are refused, not truncated: shorten or drop the row (docs/data.md)"
    ), line
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"tok5\n\n{TOO_LONG}\n")
    line = _one_error_line(capsys, [*base, "--prompts", str(prompts)])
    assert f"--prompts {prompts} line 3: the question is 1,350 characters" in line, line
    assert seen == [], "nothing was tokenised"
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    line = _one_error_line(capsys, [*base, "--prompts", str(fifo)])
    assert line.endswith(
        f"--prompts {fifo} is a FIFO (named pipe), not a regular file; give a text file, one prompt a line"
    )
    assert time.monotonic() - start < 60


def test_the_host_memory_is_shared_by_the_ranks_of_the_host(monkeypatch):
    """Issue 71 (4a): on CPU each rank is checked against its share of the host's available memory:
    4 ranks on this host (``LOCAL_WORLD_SIZE``, or ``--nproc`` where no launcher says) are refused
    where the host holds twice one rank's estimate, which 4 hosts of one rank each may use."""
    from types import SimpleNamespace

    from stabledrl_mcore.cli import memory_check as memory
    from stabledrl_mcore.cli.preflight import model_shape
    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.schema import load_config

    overrides = [*T, "rollout.prompts_per_step=8", "parallel.backend=gloo"]
    cfg = load_config(CONFIG, overrides)
    mcfg = model_shape(cfg)[0]
    available = [1e15]
    monkeypatch.setattr(
        memory, "psutil", SimpleNamespace(virtual_memory=lambda: SimpleNamespace(available=available[0]))
    )
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    one_rank = memory.check_memory(cfg, mcfg, 4)["total"]  # a rank of a job of 4
    available[0] = 2 * one_rank
    assert memory.rank_memory(cfg, 4)[:2] == (
        one_rank / 2,
        f"{2 * one_rank / memory.GIB:.1f} GiB of host memory available / 4 ranks on this host",
    )
    with pytest.raises(ConfigError, match=r"but has [0-9.]+ GiB of host memory available / 4 ranks on this host"):
        memory.check_memory(cfg, mcfg, 4)  # --nproc 4: every rank here
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="/ 4 ranks on this host"):
        memory.check_memory(cfg, mcfg, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank on each of 4 hosts: the whole host each
    assert memory.rank_memory(cfg, 4)[0] == 2 * one_rank and memory.check_memory(cfg, mcfg, 4)["total"] == one_rank
