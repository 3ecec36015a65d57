"""Every load path verifies or refuses by name (issue #62, slice 1).

A Megatron checkpoint (converted or training) without ``checksums.json`` is refused by ``eval``,
``generate``, ``convert mcore-to-hf``, ``model.checkpoint=`` and a resume, in one line naming the
file and ``--trust-unverified`` / ``checkpoint.trust_unverified=true``, the one option that loads
it unverified; a link in it is refused either way. A FIFO in a checkpoint (``.metadata``, a shard)
or as a data path is refused by name before anything reads it (each such run in a subprocess under
a time limit: on main they hung). A conversion now writes ``checksums.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from hf_fixtures import write_hf_checkpoint

from stabledrl_mcore.checkpoint.integrity import CHECKSUM_FILE, CheckpointError, verify_checksums

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
SAMPLING = ["--gen-length", "8", "--block-length", "8", "--steps", "2", "--no-progress"]
LIMIT_S = 120  # a subprocess that would hang on a FIFO is killed past this


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A converted tiny LLaDA checkpoint (one process, as ``stabledrl convert hf-to-mcore`` writes it)."""
    from stabledrl_mcore.convert import convert as conv
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    root = tmp_path_factory.mktemp("verify")
    hf = write_hf_checkpoint(str(root / "hf"), "llada", seed=3)
    yield conv.hf_to_mcore(hf, str(root / "mcore"), model="llada", progress=False)
    bootstrap.destroy()
    cpu_compat.disable()


def _stabledrl(*argv):
    from stabledrl_mcore.cli.app import main

    return main([str(a) for a in argv])


def _unverified(ckpt, tmp_path, *, link=False):
    """A copy of ``ckpt`` without its ``checksums.json`` (the issue's ``rm CK/checksums.json``);
    ``link``: one shard moved out and linked back (``mv ...; ln -s``)."""
    copy = tmp_path / "CK"
    shutil.copytree(ckpt, copy)
    if os.path.exists(copy / CHECKSUM_FILE):
        os.remove(copy / CHECKSUM_FILE)
    if link:
        shard = sorted(n for n in os.listdir(copy) if n.endswith(".distcp"))[0]
        shutil.move(str(copy / shard), str(tmp_path / "x"))
        os.symlink(tmp_path / "x", copy / shard)
    return str(copy)


def _one_line(capsys, code, *parts):
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert all(p in err for p in parts), err
    return err


def _run(argv, timeout=LIMIT_S):
    """``stabledrl ARGV`` in a subprocess, bounded: ``(exit code, stderr)``; a hang fails the test."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "stabledrl_mcore.cli", *map(str, argv)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"stabledrl {' '.join(map(str, argv[:2]))} hung for {timeout} s")
    return done.returncode, done.stderr


def test_a_conversion_writes_checksums_and_they_verify(ckpt):
    manifest = json.load(open(os.path.join(ckpt, CHECKSUM_FILE)))
    assert ".metadata" in manifest["files"] and "stabledrl_model.json" in manifest["files"], manifest
    verify_checksums(ckpt)


def test_the_refusal_names_the_file_and_the_option_not_model_checkpoint(tmp_path):
    """What ``train --resume`` said on main pointed to ``model.checkpoint=``, which loaded it unchecked."""
    (tmp_path / "step_00000001").mkdir()
    with pytest.raises(CheckpointError) as err:
        verify_checksums(str(tmp_path / "step_00000001"))
    text = str(err.value)
    assert "\n" not in text and f"has no {CHECKSUM_FILE}" in text, text
    assert "--trust-unverified" in text and "checkpoint.trust_unverified=true" in text, text
    assert "model.checkpoint=" not in text, text


def test_eval_refuses_a_checkpoint_without_checksums_or_with_a_linked_shard(ckpt, tmp_path, capsys):
    """The issue's reproduction (checksums.json removed, a shard linked in): on main it loaded, exit 0."""
    path = _unverified(ckpt, tmp_path, link=True)
    argv = ["eval", "--task", "sudoku", "--limit", "1", *SAMPLING, "--out", tmp_path / "r.jsonl"]
    shard = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]
    for trust in ([], ["--trust-unverified"]):  # a link is refused either way
        code = _stabledrl(*argv, "--ckpt", path, *trust)
        _one_line(capsys, code, f"{os.path.join(path, shard)} is a symbolic link", "not trusted")
    os.remove(os.path.join(path, shard))
    shutil.move(str(tmp_path / "x"), os.path.join(path, shard))
    _one_line(capsys, _stabledrl(*argv, "--ckpt", path), f"{path} has no {CHECKSUM_FILE}", "--trust-unverified")
    assert not os.path.exists(tmp_path / "r.jsonl")


def test_generate_refuses_a_checkpoint_without_checksums_unless_trusted(ckpt, tmp_path, capsys):
    from stabledrl_mcore.convert.loader import load_model

    path = _unverified(ckpt, tmp_path)
    code = _stabledrl("generate", "--ckpt", path, "--prompt", "tok11", *SAMPLING)
    _one_line(capsys, code, f"{path} has no {CHECKSUM_FILE}", "--trust-unverified")
    with pytest.raises(CheckpointError, match=f"has no {CHECKSUM_FILE}"):
        load_model(path)
    assert load_model(path, trust_unverified=True) is not None  # the explicit option loads it


def test_convert_refuses_a_checkpoint_without_checksums_unless_trusted(ckpt, tmp_path, capsys):
    path = _unverified(ckpt, tmp_path)
    out = tmp_path / "hf_out"
    code = _stabledrl("convert", "mcore-to-hf", "--ckpt", path, "--out", out, "--no-progress")
    _one_line(capsys, code, f"{path} has no {CHECKSUM_FILE}", "--trust-unverified")
    assert not os.path.exists(out)
    assert (
        _stabledrl("convert", "mcore-to-hf", "--ckpt", path, "--out", out, "--no-progress", "--trust-unverified") == 0
    )
    assert os.path.isfile(out / "config.json")


def test_trusting_a_checkpoint_whose_tensors_do_not_fit_its_config_is_one_line(ckpt, tmp_path, capsys):
    """``--trust-unverified`` on a checkpoint whose model_config.json no longer fits its tensors (issue
    #70: before, Megatron's CheckpointingException, 56 lines): one line naming the tensor and both shapes."""
    path = _unverified(ckpt, tmp_path)
    config = os.path.join(path, "model_config.json")
    with open(config) as handle:
        fields = json.load(handle)
    fields["ffn_hidden_size"] *= 2
    with open(config, "w") as handle:
        json.dump(fields, handle)
    code = _stabledrl("generate", "--ckpt", path, "--prompt", "tok11", *SAMPLING, "--trust-unverified")
    err = _one_line(capsys, code, path, "decoder.layers.mlp.linear_fc1.weight", "do not match", "model_config.json")
    assert "CheckpointingException" not in err and "Traceback" not in err, err


def _flip_a_byte(path, offset=0):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 1]))


def test_a_corrupt_converted_checkpoint_says_convert_again_not_resume(ckpt, tmp_path, capsys):
    """A converted checkpoint has no earlier checkpoint to resume from (issue #70: its message said
    so): the advice is to run the conversion again, from the source it names."""
    path = str(tmp_path / "CK")
    shutil.copytree(ckpt, path)
    shard = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]
    _flip_a_byte(os.path.join(path, shard))
    code = _stabledrl("generate", "--ckpt", path, "--prompt", "tok11", *SAMPLING)
    source = json.load(open(os.path.join(path, "stabledrl_model.json")))["source"]["hf_dir"]
    err = _one_line(capsys, code, f"{os.path.join(path, shard)} does not match its sha256", "convert")
    assert "resume" not in err and f"--hf-dir {source}" in err and f"--out {path}" in err, err


def test_a_file_the_manifest_does_not_list_is_refused_by_name(ckpt, tmp_path, capsys):
    """The issue's reproduction (a shard's entry deleted from checksums.json, a byte of it flipped:
    generate loaded it unchecked, exit 0) and a file added after the save: each refused by name
    (issue #70, slice 4); the manifest and every file it lists still verify, and --trust-unverified
    loads a checkpoint with an added file."""
    from stabledrl_mcore.convert.loader import load_model

    path = str(tmp_path / "CK")
    shutil.copytree(ckpt, path)
    shard = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]
    manifest = json.load(open(os.path.join(path, CHECKSUM_FILE)))
    del manifest["files"][shard]
    with open(os.path.join(path, CHECKSUM_FILE), "w") as handle:
        json.dump(manifest, handle)
    _flip_a_byte(os.path.join(path, shard), os.path.getsize(os.path.join(path, shard)) - 1)  # a weight's byte
    code = _stabledrl("generate", "--ckpt", path, "--prompt", "tok11", *SAMPLING)
    _one_line(capsys, code, f"{os.path.join(path, shard)} is not listed in {CHECKSUM_FILE}", "--trust-unverified")

    path = str(tmp_path / "CK2")
    shutil.copytree(ckpt, path)
    os.makedirs(os.path.join(path, "hf", "notes"))
    with open(os.path.join(path, "hf", "notes", "README.txt"), "w") as handle:
        handle.write("added after the conversion\n")
    with pytest.raises(CheckpointError, match=f"{os.path.join(path, 'hf', 'notes', 'README.txt')} is not listed"):
        verify_checksums(path)
    assert load_model(path, trust_unverified=True) is not None
    os.remove(os.path.join(path, "hf", "notes", "README.txt"))
    verify_checksums(path)  # an empty directory is no file


def test_model_checkpoint_refuses_a_checkpoint_without_checksums_unless_trusted(ckpt, tmp_path, capsys):
    from stabledrl_mcore.checkpoint.info import read_checkpoint_info
    from stabledrl_mcore.checkpoint.mcore_io import build_shell, ensure_single_process
    from stabledrl_mcore.convert.loader import load_weights

    path = _unverified(ckpt, tmp_path)
    base = ["train", "--config", CONFIG, f"logging.run_dir={tmp_path / 'run'}", f"model.checkpoint={path}"]
    _one_line(capsys, _stabledrl(*base, "--print-config"), f"{path} has no {CHECKSUM_FILE}")
    assert _stabledrl(*base, "checkpoint.trust_unverified=true", "--print-config") == 0
    capsys.readouterr()
    ensure_single_process()
    shell = build_shell(read_checkpoint_info(path).config, read_checkpoint_info(path).dtype)
    with pytest.raises(CheckpointError, match="checkpoint.trust_unverified=true"):
        load_weights(shell, path)  # what the ranks run for model.checkpoint=
    load_weights(shell, path, trust_unverified=True)


def test_resume_refuses_a_checkpoint_without_checksums_before_any_rank_starts(tmp_path):
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.engine.resume import plan_resume

    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    (step / "train_state.json").write_text(json.dumps({"step": 1}))
    cfg = load_config(CONFIG, [f"logging.run_dir={tmp_path / 'run'}", "steps=4"])
    with pytest.raises(CheckpointError) as err:
        plan_resume(cfg, str(step))
    assert f"{step} has no {CHECKSUM_FILE}" in str(err.value) and "checkpoint.trust_unverified=true" in str(err.value)
    trusted = load_config(
        CONFIG, [f"logging.run_dir={tmp_path / 'run'}", "steps=4", "checkpoint.trust_unverified=true"]
    )
    assert plan_resume(trusted, str(step)).path == str(step)


@pytest.mark.parametrize("name", [".metadata", "shard"])
def test_a_fifo_in_a_checkpoint_is_refused_by_name(ckpt, tmp_path, name):
    """On main ``eval`` hung on it (the shard one without checksums.json, the .metadata one always)."""
    path = _unverified(ckpt, tmp_path) if name == "shard" else shutil.copytree(ckpt, tmp_path / "CK")
    name = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0] if name == "shard" else name
    os.remove(os.path.join(path, name))
    os.mkfifo(os.path.join(path, name))
    argv = ["eval", "--ckpt", path, "--task", "sudoku", "--limit", "1", *SAMPLING]  # named before the checksums
    code, err = _run([*argv, "--out", tmp_path / "r.jsonl"])
    assert code == 2 and f"{os.path.join(path, name)} is a FIFO (named pipe), not a regular file" in err, (code, err)
    with pytest.raises(CheckpointError, match="is a FIFO"):
        verify_checksums(str(path), trust_unverified=True)


def test_a_fifo_as_the_data_path_is_refused_by_name(tmp_path):
    """On main ``--print-config`` hung on it forever."""
    fifo = tmp_path / "f.jsonl"
    os.mkfifo(fifo)
    run = ["train", "--config", CONFIG, f"logging.run_dir={tmp_path / 'run'}", "rollout.task=qa"]
    code, err = _run([*run, f"rollout.data_path={fifo}", "--print-config"])
    assert code == 2 and f"rollout.data_path={fifo} is a FIFO (named pipe), not a regular file" in err, (code, err)
    folder = tmp_path / "data"
    folder.mkdir()
    os.mkfifo(folder / "train.jsonl")  # found as the split's file, refused by name
    code, err = _run([*run, f"rollout.data_path={folder}", "--print-config"])
    assert code == 2 and f"{folder / 'train.jsonl'} is a FIFO" in err, (code, err)


def test_a_fifo_as_an_hf_weight_file_is_named(tmp_path):
    """An HF directory has no manifest; its weight file was already never opened unless a regular
    file, and is now named rather than reported missing."""
    from stabledrl_mcore.checkpoint.errors import ConversionError
    from stabledrl_mcore.convert.safetensors_io import SafetensorsReader

    hf = write_hf_checkpoint(str(tmp_path / "hf"), "llada", seed=3)
    weights = sorted(n for n in os.listdir(hf) if n.endswith(".safetensors"))[0]
    os.remove(os.path.join(hf, weights))
    os.mkfifo(os.path.join(hf, weights))
    with pytest.raises(ConversionError, match="is a FIFO"):
        SafetensorsReader(hf)
