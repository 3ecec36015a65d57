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

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.cli import convert as convert_cmd
from stabledrl_mcore.convert import convert as conv

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


# ------------------------------------------------------------------ one writer per output (issue #62 slice 2)
@pytest.fixture(scope="module")
def mcore_ckpt(sources, tmp_path_factory):
    """A converted (Megatron) checkpoint of the clean tiny LLaDA, to export again and again."""
    return conv.hf_to_mcore(sources["clean"], str(tmp_path_factory.mktemp("ck") / "ck"), model="llada", progress=False)


def _claim(out, pid, **extra):
    """A claim on ``out`` as another conversion (process ``pid`` of this host) would hold it."""
    record = {"out": os.path.abspath(out), "tmp": "elsewhere", "host": socket.gethostname(), "pid": pid}
    record.update(started=time.time(), command="stabledrl convert mcore-to-hf --ckpt CK1 --out R")
    record.update(extra)
    path = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.claim.json")  # claim_path(out)
    with open(path, "w") as handle:
        json.dump(record, handle)
    return path


def test_a_second_conversion_into_one_output_is_refused_and_the_first_result_kept(mcore_ckpt, tmp_path, capsys):
    out = str(tmp_path / "R")
    other = subprocess.Popen(["sleep", "60"])  # a live conversion holding the claim
    try:
        claim = _claim(out, other.pid)
        before = open(claim).read()
        assert _cli("mcore-to-hf", "--ckpt", mcore_ckpt, "--out", out, "--no-progress") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"is being written by another conversion (pid {other.pid}" in err, err
        assert "wait for it to finish or choose another --out" in err and claim in err
        assert not os.path.exists(out) and open(claim).read() == before and _leftovers(tmp_path) == []
        os.remove(claim)
    finally:
        other.kill()
        other.wait()

    seen = []

    def second_while_first_runs(tmp):  # the first conversion is finished, not yet committed
        with pytest.raises(ConversionError, match=rf"{out} is being written by another conversion \(pid {os.getpid()}"):
            conv.mcore_to_hf(mcore_ckpt, out, dtype="bf16", progress=False)
        seen.append(tmp)

    conv.mcore_to_hf(mcore_ckpt, out, dtype="fp32", progress=False, before_commit=second_while_first_runs)
    assert seen and json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "float32"
    assert sorted(os.listdir(tmp_path)) == ["R"], "claim or temporary output left behind"


def test_overwrite_moves_the_earlier_output_aside_and_deletes_nothing(mcore_ckpt, tmp_path, capsys):
    out = tmp_path / "R"
    assert _cli("mcore-to-hf", "--ckpt", mcore_ckpt, "--out", str(out), "--no-progress") == 0
    (out / "precious.txt").write_text("keep me")
    earlier = sorted(os.listdir(out))
    capsys.readouterr()
    assert _cli("mcore-to-hf", "--ckpt", mcore_ckpt, "--out", str(out), "--no-progress", "--overwrite") == 0
    err = capsys.readouterr().err
    aside = [n for n in os.listdir(tmp_path) if n.startswith("R.overwritten-")]
    assert len(aside) == 1, os.listdir(tmp_path)
    assert f"moved the earlier contents of {out} to {tmp_path / aside[0]}" in err, err
    assert (tmp_path / aside[0] / "precious.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path / aside[0])) == earlier
    assert "precious.txt" not in os.listdir(out) and (out / "config.json").is_file()
    assert sorted(os.listdir(tmp_path)) == sorted(["R", aside[0]])


def test_a_stale_claim_of_a_dead_process_is_taken_over(mcore_ckpt, tmp_path, capsys):
    out = str(tmp_path / "R")
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid no longer runs: a conversion killed before it released its claim
    _claim(out, gone.pid)
    assert _cli("mcore-to-hf", "--ckpt", mcore_ckpt, "--out", out, "--no-progress") == 0
    err = capsys.readouterr().err
    assert f"took over the claim on {out} from pid {gone.pid}, which no longer runs" in err, err
    assert os.path.isfile(os.path.join(out, "config.json")) and sorted(os.listdir(tmp_path)) == ["R"]


def test_a_claim_whose_pid_now_runs_a_later_process_is_taken_over(mcore_ckpt, tmp_path, capsys):
    """A claim (and a temporary output) whose pid is alive but belongs to a process started after the
    claim was made (the claimer died, its pid was reused) is taken over, not honoured for ever; a
    live claimer's claim is refused with its date (issue #70, slice 4)."""
    out = str(tmp_path / "R")
    later = subprocess.Popen(["sleep", "60"])  # holds the pid now; it started after the claims below
    try:
        started = time.time() + 3600  # a claimer that started after `later`: alive, refused
        claim = _claim(out, later.pid, started=started)
        assert _cli("mcore-to-hf", "--ckpt", mcore_ckpt, "--out", out, "--no-progress") == 2
        err = capsys.readouterr().err
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
        assert f"(pid {later.pid}, since {since}:" in err and len(err.strip().splitlines()) == 1, err
        os.remove(claim)

        an_hour_ago = time.time() - 3600
        _claim(out, later.pid, started=an_hour_ago)
        leftover = tmp_path / ".tmp-R-killed"
        leftover.mkdir()
        owner = {"out": out, "host": socket.gethostname(), "pid": later.pid, "started": an_hour_ago}
        (tmp_path / ".tmp-R-killed.owner.json").write_text(json.dumps(owner))
        assert _cli("mcore-to-hf", "--ckpt", mcore_ckpt, "--out", out, "--no-progress") == 0
        err = capsys.readouterr().err
        assert f"took over the claim on {out} from pid {later.pid}" in err, err
        assert "now runs a process started after the claim" in err, err
        assert os.path.isfile(os.path.join(out, "config.json")) and sorted(os.listdir(tmp_path)) == ["R"]
        assert later.poll() is None  # the process that now has the pid is left alone
    finally:
        later.kill()
        later.wait()


def test_a_claim_from_another_host_is_honoured_whatever_its_pid_is_here(mcore_ckpt, tmp_path, capsys):
    """Issue 71 (4b): on a shared file system a claim (and a temporary output) written on another
    host is that host's: its pid says nothing here, neither not running nor running a later process,
    so the conversion is refused (naming the host) and the other host's temporary output stays."""
    out = str(tmp_path / "R")
    gone = subprocess.Popen(["true"])
    gone.wait()  # not running here
    later = subprocess.Popen(["sleep", "60"])  # running here, started after the claims below
    try:
        for pid in (gone.pid, later.pid):
            an_hour_ago = time.time() - 3600
            claim = _claim(out, pid, host="another-node", started=an_hour_ago)
            owner = {"out": out, "host": "another-node", "pid": pid, "started": an_hour_ago}
            (tmp_path / ".tmp-R-theirs.owner.json").write_text(json.dumps(owner))
            (tmp_path / ".tmp-R-theirs").mkdir(exist_ok=True)
            assert _cli("mcore-to-hf", "--ckpt", mcore_ckpt, "--out", out, "--no-progress") == 2
            err = capsys.readouterr().err
            assert f"is being written by another conversion (pid {pid} on another-node, since" in err, err
            assert len(err.strip().splitlines()) == 1 and "took over" not in err, err
            assert not os.path.exists(out) and os.path.isdir(tmp_path / ".tmp-R-theirs")
            os.remove(claim)
        assert later.poll() is None
    finally:
        later.kill()
        later.wait()
