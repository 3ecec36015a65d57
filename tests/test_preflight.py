"""Issue 23, items 1 and 8: every check that needs no model runs once, before any rank starts.

``stabledrl train`` and ``--print-config`` (what slurm/common.sh runs in the batch shell) refuse
bad registry names, paths, layouts and data with one line naming the field or file, exit 2; the
data is read before any model is loaded; a truncated weight file names itself. In-process through
``stabledrl_mcore.cli.app`` except where the process boundary (``--nproc``) is the point.
"""

import json
import os
import subprocess
import sys

import pytest
from hf_fixtures import write_hf_checkpoint

from stabledrl_mcore.cli.app import main
from stabledrl_mcore.common.errors import DataError
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.tasks import get_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")


def _gsm8k_row(question, answer):
    return json.dumps({"question": question, "answer": answer}) + "\n"


@pytest.fixture
def gsm8k_file(tmp_path):
    path = tmp_path / "gsm8k_train.jsonl"
    path.write_text(
        _gsm8k_row("Tom has 3 apples and buys 4. How many?", "3 + 4 = 7\n#### 7")
        + _gsm8k_row("What is 6 x 7?", "6 x 7 = 42\n#### 42")
    )
    return str(path)


@pytest.fixture(scope="module")
def hf_llada(tmp_path_factory):
    """A tiny LLaDA directory in the upstream HF format (config.json, safetensors, tokenizer)."""
    return write_hf_checkpoint(str(tmp_path_factory.mktemp("hf") / "llada"), "llada")


def _refused(capsys, *argv):
    """``stabledrl *argv`` exits 2 with exactly one line on stderr and nothing on stdout; that line."""
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert lines[0].startswith(f"stabledrl {argv[0]}: error: "), lines
    return lines[0]


def _print_config(capsys, *overrides):
    return _refused(capsys, "train", "--config", CONFIG, *overrides, "--print-config")


# ------------------------------------------------------------------- item 1: --print-config refuses


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algo.loss=ppo", "algo.loss: unknown loss 'ppo'"),
        ("rollout.task=gsm9k", "rollout.task must be one of"),
        ("model.preset=llada-9b", "model.preset: unknown preset 'llada-9b'; did you mean llada-8b?"),
        ("parallel.tensor_parallel=3", "num_attention_heads (4) is not divisible by tensor_parallel (3)"),
        ("model.overrides.num_layerz=2", "'num_layerz' is not a DLLMConfig field; did you mean num_layers?"),
        ("algo.likelihood=staircase", "algo.likelihood=staircase needs a block-diffusion (SDAR) model"),
        ("parallel.pipeline_parallel=3", "num_layers (4) is not divisible by pipeline_parallel (3)"),
        ("checkpoint.resume=/no/such/step_00000005", "checkpoint.resume: /no/such/step_00000005 is not"),
    ],
)
def test_print_config_refuses_bad_names_and_layouts(capsys, override, expected):
    line = _print_config(capsys, override)
    assert expected in line, line
    if override.startswith("rollout.task"):
        assert "did you mean gsm8k?" in line
    if override.startswith("parallel.tensor"):
        assert "parallel.tensor_parallel=3" in line and "model.preset llada-tiny" in line


def test_print_config_refuses_options_a_pipeline_cannot_honour(capsys):
    line = _print_config(capsys, "parallel.pipeline_parallel=2", "parallel.retain_update_graph=true")
    assert "parallel.retain_update_graph=true" in line and "parallel.pipeline_parallel=2" in line
    assert main(["train", "--config", CONFIG, "parallel.pipeline_parallel=2", "--nproc", "2", "--print-config"]) == 0
    assert "world 2, data-parallel 1" in capsys.readouterr().out


def test_print_config_refuses_a_missing_checkpoint_or_tokenizer(capsys, tmp_path):
    missing = str(tmp_path / "no-such-model")
    line = _print_config(capsys, f"model.checkpoint={missing}")
    assert f"model.checkpoint: {missing} does not exist" in line and "tokenizer" not in line
    assert "model.tokenizer: no tokenizer at" in _print_config(capsys, f"model.tokenizer={missing}")
    assert "is not a model directory" in _print_config(capsys, f"model.checkpoint={tmp_path}")


def test_print_config_checks_the_layout_against_the_world_size(capsys, monkeypatch):
    # the world size comes from --nproc, else from the launcher (sbatch sets SLURM_NTASKS)
    assert "divisible by the data-parallel size 3" in _print_config(capsys, "--nproc", "3")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    assert "divisible by the data-parallel size 3" in _print_config(capsys)
    monkeypatch.delenv("SLURM_NTASKS")
    line = _print_config(capsys, "--nproc", "2", "parallel.micro_batch_size=48")
    assert "holds 64 sequences" in line and "parallel.micro_batch_size (48)" in line


def test_print_config_passes_and_reports_what_it_checked(capsys, gsm8k_file, hf_llada):
    assert (
        main(
            [
                "train",
                "--config",
                CONFIG,
                "rollout.task=gsm8k",
                f"rollout.data_path={gsm8k_file}",
                f"model.checkpoint={hf_llada}",
                "--nproc",
                "2",
                "--print-config",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"checkpoint: {hf_llada}" in out
    assert out.strip().splitlines()[-1].startswith("# preflight ok: model.checkpoint")
    assert "world 2, data-parallel 2; train: 2 examples" in out


def test_heldout_evaluation_reads_its_own_split_never_the_training_file(capsys, tmp_path, gsm8k_file):
    """``eval.split`` takes effect for file tasks: the held-out set is ``eval.data_path`` or the
    split's default file, not ``rollout.data_path`` (it used to evaluate on the training file)."""
    from stabledrl_mcore.tasks.from_config import heldout_examples

    test_file = tmp_path / "gsm8k_test.jsonl"
    test_file.write_text(_gsm8k_row("What is 9 - 4?", "9 - 4 = 5\n#### 5"))
    train = ["rollout.task=gsm8k", f"rollout.data_path={gsm8k_file}", "eval.every=1"]
    cfg = load_config(CONFIG, train + [f"eval.data_path={test_file}"])
    assert [ex.reference for ex in heldout_examples(cfg, get_task("gsm8k"))] == ["5"]
    line = _print_config(capsys, *train, f"eval.data_path={tmp_path / 'none.jsonl'}")
    assert f"data file not found: {tmp_path / 'none.jsonl'}" in line


# --------------------------------------------------------------------- item 8: data errors, early


def test_missing_gsm8k_file_names_the_config_field_and_the_eval_flag(capsys, tmp_path):
    missing = tmp_path / "gsm8k" / "train.jsonl"
    line = _print_config(capsys, "rollout.task=gsm8k", f"rollout.data_path={missing}")
    assert f"data file not found: {missing}" in line
    assert "rollout.data_path=FILE" in line and "--data-path FILE" in line and "#### <number>" in line


def test_gsm8k_row_without_answer_line_names_file_and_line(capsys, tmp_path, gsm8k_file):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(gsm8k_file).read() + "\n" + _gsm8k_row("And 2 + 2?", "it is four"))
    with pytest.raises(DataError, match=f"{bad}:4: GSM8K answer has no '#### <number>' line"):
        get_task("gsm8k").load("train", path=str(bad))  # the library names it too
    line = _print_config(capsys, "rollout.task=gsm8k", f"rollout.data_path={bad}")
    assert f"{bad}:4: GSM8K answer has no" in line


def test_empty_training_data_is_an_error(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    line = _print_config(capsys, "rollout.task=gsm8k", f"rollout.data_path={empty}")
    assert f"{empty} holds no examples (empty file)" in line


def test_training_data_is_read_before_any_model_is_built(tmp_path, monkeypatch):
    from stabledrl_mcore.rl import setup

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the data was read")

    monkeypatch.setattr(setup, "build_policy", no_model)
    monkeypatch.setattr("stabledrl_mcore.parallel.bootstrap.initialize", no_model)
    cfg = load_config(CONFIG, ["rollout.task=gsm8k", f"rollout.data_path={tmp_path / 'none.jsonl'}"])
    with pytest.raises(FileNotFoundError, match="rollout.data_path=FILE"):
        setup.build_training(cfg)


def test_eval_refuses_an_empty_or_missing_file_before_loading_the_model(capsys, tmp_path, hf_llada):
    empty = tmp_path / "test.jsonl"
    empty.write_text("")
    line = _refused(capsys, "eval", "--ckpt", hf_llada, "--task", "gsm8k", "--data-path", str(empty), "--no-progress")
    assert f"{empty} holds no examples" in line
    line = _refused(
        capsys,
        "eval",
        "--ckpt",
        hf_llada,
        "--task",
        "gsm8k",
        "--data-path",
        str(tmp_path / "missing.jsonl"),
        "--no-progress",
    )
    assert "--data-path FILE" in line
    assert "valid tasks" in _refused(capsys, "eval", "--ckpt", hf_llada, "--task", "gsm9k")


# ------------------------------------------------------------------ item 8: checkpoints and layout


def test_train_names_a_missing_checkpoint_not_its_tokenizer(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("stabledrl_mcore.engine.preemption.install_preemption_handlers", lambda: None)
    missing = str(tmp_path / "llada-8b-instruct-mcore")
    line = _refused(
        capsys,
        "train",
        "--config",
        CONFIG,
        f"model.checkpoint={missing}",
        "steps=1",
        f"logging.run_dir={tmp_path / 'run'}",
    )
    assert f"model.checkpoint: {missing} does not exist" in line and "tokenizer" not in line


def test_truncated_safetensors_is_one_line_naming_the_file(capsys, tmp_path, hf_llada):
    import shutil

    from stabledrl_mcore.checkpoint.errors import ConversionError
    from stabledrl_mcore.convert.safetensors_io import SafetensorsReader

    broken = str(tmp_path / "broken")
    shutil.copytree(hf_llada, broken)
    weights = os.path.join(broken, "model.safetensors")
    reader = SafetensorsReader(broken)  # headers read while the file was whole
    with open(weights, "r+b") as handle:
        handle.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(ConversionError, match=f"{weights}: cannot read tensor"):
        reader.get(reader.keys()[-1])
    with pytest.raises(ConversionError, match=f"{weights} is truncated"):
        SafetensorsReader(broken)
    line = _print_config(capsys, f"model.checkpoint={broken}")
    assert f"{weights} is truncated" in line


def test_nproc_with_a_bad_layout_fails_before_any_rank_starts():
    """The process boundary is the point: one line, exit 2, no rank spawned."""
    import psutil

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stabledrl_mcore.cli",
            "train",
            "--config",
            CONFIG,
            "parallel.tensor_parallel=3",
            "steps=1",
            "--nproc",
            "3",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=60)  # a generous limit (about 5 s idle), not a timing check
    finally:  # the old code spawned three ranks that ran into a time-out: stop them by PID
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
                child.kill()
            proc.communicate()
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, err[-2000:]
    assert "num_attention_heads (4) is not divisible by tensor_parallel (3)" in lines[0]
    assert "rank" not in err  # spawned ranks would report themselves (and main's ran into the 60 s limit)


def test_shipped_recipes_are_refused_until_their_checkpoint_exists(capsys):
    """slurm/common.sh runs --print-config in the batch shell: a recipe whose converted checkpoint
    is not there yet fails there, before srun starts a rank (tests/test_recipes.py passes one)."""
    import glob

    recipes = sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "*_8b_*.yaml")))
    assert len(recipes) >= 10
    for recipe in recipes:
        line = _refused(capsys, "train", "--config", recipe, "--print-config")
        assert "model.checkpoint: checkpoints/" in line and "does not exist" in line, (recipe, line)


# ------------------------------------------------------- issue 70: where compiled decoding keeps its graphs
def _bad_cache_dirs(tmp_path):
    """``(path, what the line says)``: an existing file, a directory that cannot be created (under a
    file; under /proc/1, which no user may write in) and one that cannot be written in (/proc/1)."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    cases = [
        (str(afile), "is a file, not a directory"),
        (str(afile / "cache"), f"cannot be created: {afile} is a file"),
    ]
    if os.path.isdir("/proc/1"):  # Linux: not writable, not even by root
        cases += [
            ("/proc/1/cache", "cannot be created: /proc/1 is a directory this user cannot write in"),
            ("/proc/1", "is a directory this user cannot write in"),
        ]
    return cases


def test_a_compile_cache_dir_that_cannot_be_used_is_one_line_naming_it_before_any_rank_starts(capsys, tmp_path):
    """It was a 40- or 133-line traceback at the first rollout (os.makedirs in the ranks' set-up)."""
    for path, problem in _bad_cache_dirs(tmp_path):
        line = _print_config(capsys, "rollout.compile=default", f"rollout.compile_cache_dir={path}")
        assert f"rollout.compile_cache_dir={path} {problem}" in line, line
        assert "set rollout.compile_cache_dir=DIR" in line
    afile = tmp_path / "a-file"  # the default, <logging.run_dir>/inductor-cache, under a run_dir that is a file
    line = _print_config(capsys, "rollout.compile=default", f"logging.run_dir={afile}")
    assert f"rollout.compile_cache_dir (unset: <logging.run_dir>/inductor-cache = {afile}/inductor-cache)" in line
    assert "or another logging.run_dir" in line
    fine = tmp_path / "new" / "cache"
    argv = ["train", "--config", CONFIG, "rollout.compile=default", f"rollout.compile_cache_dir={fine}"]
    assert main([*argv, f"logging.run_dir={tmp_path / 'run'}", "--print-config"]) == 0
    assert not fine.parent.exists()  # checked, not created


def test_eval_and_generate_refuse_an_unusable_compile_cache_by_name(capsys, tmp_path, monkeypatch, hf_llada):
    """``--compile``'s graphs go to TORCHINDUCTOR_CACHE_DIR (torch's variable; eval and generate have
    no option of their own), which torch creates when a command imports ``torch._dynamo``: a bad one
    was a traceback there (FileExistsError, eager or compiled); a broken link, a bare ``[Errno 2]``."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    for path, problem in [*_bad_cache_dirs(tmp_path)[::2], (f"{link}/cache", f"cannot be created: {link} is a broken")]:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", path)
        line = _refused(
            capsys, "generate", "--ckpt", hf_llada, "--prompt", "tok5", "--gen-length", "4", "--compile", "default"
        )
        assert f"generate: error: TORCHINDUCTOR_CACHE_DIR={path} {problem}" in line, line
        out = str(tmp_path / "eval.jsonl")
        line = _refused(
            capsys, "eval", "--ckpt", hf_llada, "--task", "sudoku", "--limit", "2", "--out", out, "--compile", "default"
        )
        assert f"eval: error: TORCHINDUCTOR_CACHE_DIR={path} {problem}" in line, line
