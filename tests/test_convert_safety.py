"""The converter loses nothing and leaves nothing: non-finite weights refused by name, a failed
``--verify`` writes nothing, SIGTERM removes the temporary output, a SIGKILLed conversion leaves no
process behind and its temporary output is removed by the next conversion (only its own)."""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from hf_fixtures import upstream_config, upstream_shapes, write_hf_checkpoint

from stabledrl_mcore.checkpoint import convert as conv
from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.cli import convert as convert_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYER0_UP = "model.transformer.blocks.0.up_proj.weight"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A clean tiny LLaDA directory and one whose layer-0 up projection holds a NaN and an inf."""
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("safety")
    bad = torch.full(upstream_shapes("llada", upstream_config("llada"))[LAYER0_UP], 0.01)
    bad[0, 0], bad[1, 1] = float("nan"), float("inf")
    yield {
        "clean": write_hf_checkpoint(str(root / "clean"), "llada"),
        "nonfinite": write_hf_checkpoint(str(root / "nonfinite"), "llada", extra={LAYER0_UP: bad}),
    }
    bootstrap.destroy()
    cpu_compat.disable()


def _cli(*argv):
    parser = argparse.ArgumentParser()
    convert_cmd.add_convert_arguments(parser)
    return convert_cmd.run_convert(parser.parse_args(list(argv)))


def _leftovers(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith((".tmp-", ".old-")))


def test_nonfinite_weights_are_refused_by_name_unless_allowed(sources, tmp_path, capsys):
    out = str(tmp_path / "mcore")
    assert _cli("hf-to-mcore", "--model", "llada", "--hf-dir", sources["nonfinite"], "--out", out, "--no-progress") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{LAYER0_UP}' holds 1 NaN and 1 inf" in err
    assert "--allow-nonfinite" in err and not os.path.exists(out) and _leftovers(tmp_path) == []
    assert (
        _cli(
            "hf-to-mcore",
            "--model",
            "llada",
            "--hf-dir",
            sources["nonfinite"],
            "--out",
            out,
            "--no-progress",
            "--allow-nonfinite",
        )
        == 0
    )
    with pytest.raises(ConversionError, match=r"tensor 'decoder\.layers\.0\.mlp\.linear_fc1\.weight' holds 1 NaN"):
        conv.mcore_to_hf(out, str(tmp_path / "hf"), progress=False)
    assert not os.path.exists(tmp_path / "hf") and _leftovers(tmp_path) == []
    conv.mcore_to_hf(out, str(tmp_path / "hf"), progress=False, allow_nonfinite=True)


def test_failed_verify_writes_nothing_and_keeps_an_existing_output(sources, tmp_path, capsys):
    out = str(tmp_path / "mcore")
    args = ("hf-to-mcore", "--model", "llada", "--hf-dir", sources["clean"], "--out", out, "--no-progress")
    assert _cli(*args, "--verify", "--tolerance", "-1") == 1
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("stabledrl convert: error: --verify: max abs logit difference")
        and "nothing was written" in err
        and len(err.splitlines()) == 1
    )
    assert not os.path.exists(out) and _leftovers(tmp_path) == []
    assert _cli(*args) == 0
    before = open(os.path.join(out, "stabledrl_model.json")).read()
    assert _cli(*args, "--overwrite", "--dtype", "bf16", "--verify", "--tolerance", "-1") == 1
    assert open(os.path.join(out, "stabledrl_model.json")).read() == before, "the old output was replaced"
    assert _leftovers(tmp_path) == []


def test_sigterm_removes_the_temporary_output(sources, tmp_path, monkeypatch):
    monkeypatch.setattr(conv, "_fault_injection_pause", lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(5)))
    with pytest.raises(SystemExit) as info:
        _cli(
            "hf-to-mcore",
            "--model",
            "llada",
            "--hf-dir",
            sources["clean"],
            "--out",
            str(tmp_path / "m"),
            "--no-progress",
        )
    assert info.value.code == 128 + signal.SIGTERM and os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_sigkilled_conversion_leaves_no_process_and_the_next_run_removes_its_own_leftovers(sources, tmp_path):
    import psutil

    out = tmp_path / "mcore"
    cmd = [
        sys.executable,
        "-m",
        "stabledrl_mcore.cli",
        "convert",
        "hf-to-mcore",
        "--model",
        "llada",
        "--hf-dir",
        sources["clean"],
        "--out",
        str(out),
        "--no-progress",
    ]
    env = dict(os.environ, STABLEDRL_FAULT_PAUSE_BEFORE_COMMIT="60", PYTHONPATH=ROOT)
    proc, helpers = subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True), []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:  # written, waiting before the rename
            if any(os.path.isfile(tmp_path / n / "stabledrl_model.json") for n in _leftovers(tmp_path)):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
        helpers = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        alive = helpers
        while alive and time.monotonic() < deadline:
            alive = [p for p in helpers if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
            time.sleep(0.05)
        assert not alive, f"helper processes outlived the SIGKILLed converter: {alive}"
    finally:
        for pid in [proc.pid] + helpers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    stale = _leftovers(tmp_path)
    assert len(stale) == 2 and stale[1] == stale[0] + ".owner.json", stale
    foreign = tmp_path / ".tmp-mcore-someone-else"  # no owner file: not ours
    live = tmp_path / ".tmp-mcore-still-writing"  # owner alive (this process)
    foreign.mkdir()
    live.mkdir()
    (tmp_path / ".tmp-mcore-still-writing.owner.json").write_text(
        json.dumps({"out": str(out), "host": socket.gethostname(), "pid": os.getpid()})
    )
    conv.hf_to_mcore(sources["clean"], str(out), model="llada", progress=False)
    assert _leftovers(tmp_path) == sorted([foreign.name, live.name, live.name + ".owner.json"])
