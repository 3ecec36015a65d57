"""The ``stabledrl`` entry point: subcommands, one-line errors, exit code 2."""

import os
import subprocess
import sys

import pytest

from stabledrl_mcore.cli.app import main

SUBCOMMANDS = ("train", "convert", "generate", "eval", "stress", "study", "bench", "plan")


def run_cli(*args):
    proc = subprocess.run(
        [sys.executable, "-m", "stabledrl_mcore.cli", *args], capture_output=True, text=True, timeout=120
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_unknown_subcommand_is_one_line_exit_2():
    code, out, err = run_cli("trian")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "invalid choice: 'trian'" in err


def test_bad_flag_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--no-such-flag"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--no-such-flag" in err


def test_config_error_exit_2(capsys):
    assert main(["train", "algo.epz=0.1", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "did you mean algo.eps" in err and len(err.strip().splitlines()) == 1


def test_print_config_resolves_overrides(tmp_path, capsys):
    config = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "tiny_cpu.yaml")
    out_path = tmp_path / "resolved.yaml"
    assert main(["train", "--config", config, "algo.eps=0.3", "--print-config", "--save-config", str(out_path)]) == 0
    assert "eps: 0.3" in capsys.readouterr().out
    assert "eps: 0.3" in out_path.read_text()


def test_stress_bad_override_is_one_line_exit_2(tmp_path, capsys):
    config = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "tiny_cpu.yaml")
    assert main(["stress", "--config", config, "algo.epz=0.1", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "did you mean algo.eps" in err and len(err.strip().splitlines()) == 1


def test_overrides_may_follow_options(capsys):
    """Issue 23 item 8: ``--config X a=b --nproc 2 c=d`` (both overrides apply, in order)."""
    config = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "tiny_cpu.yaml")
    assert (
        main(["train", "--config", config, "algo.eps=0.1", "--nproc", "2", "steps=3", "algo.eps=0.3", "--print-config"])
        == 0
    )
    out = capsys.readouterr().out
    assert "eps: 0.3" in out and "\nsteps: 3\n" in out and "world 2" in out
    assert main(["train", "--config", config, "--nproc", "2", "not-an-override", "--print-config"]) == 2
    assert "'not-an-override' is not of the form section.key=value" in capsys.readouterr().err


def test_debug_shows_the_traceback_of_a_user_error(capsys, monkeypatch):
    from stabledrl_mcore.common.errors import ConfigError

    for argv in (
        ["--debug", "train", "rollout.task=gsm9k", "--print-config"],
        ["train", "rollout.task=gsm9k", "--print-config", "--debug"],
    ):
        with pytest.raises(ConfigError, match="did you mean gsm8k"):
            main(argv)
    monkeypatch.setenv("STABLEDRL_DEBUG", "1")
    with pytest.raises(ConfigError):
        main(["train", "rollout.task=gsm9k", "--print-config"])
    monkeypatch.setenv("STABLEDRL_DEBUG", "0")
    assert main(["train", "rollout.task=gsm9k", "--print-config"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "first_type, code", [("stabledrl_mcore.common.errors.ConfigError", 2), ("builtins.RuntimeError", 1)]
)
def test_a_failing_rank_under_nproc_is_one_line_and_its_traceback_under_debug(capsys, monkeypatch, first_type, code):
    """``--nproc``: the first failing rank's error once (exit 2 for input errors, 1 for bugs);
    ``--debug`` adds every rank's traceback."""
    from stabledrl_mcore.parallel import launch

    def failing_spawn(*args, **kwargs):
        raise launch.WorkerFailed(
            "rank 1: Boom: bad thing",
            "--- rank 1 ---\nTraceback (most recent call last)",
            first_type=first_type,
            exit_codes=[-9, 1],
        )

    monkeypatch.setattr(launch, "spawn", failing_spawn)
    config = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "configs", "tiny_cpu.yaml"
    )
    assert main(["train", "--config", config, "--nproc", "2", "steps=1"]) == code
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["stabledrl train: error: rank 1: Boom: bad thing"]
    assert main(["--debug", "train", "--config", config, "--nproc", "2", "steps=1"]) == code
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_run_that_trained_nothing_is_one_line_and_exit_1(capsys, monkeypatch, tmp_path):
    """``SkippedUpdatesError`` (a run that cannot go on) reaches the console as one line, exit 1."""
    from stabledrl_mcore.engine.gradients import SkippedUpdatesError
    from stabledrl_mcore.rl import trainer

    def diverged(config, overrides=()):
        raise SkippedUpdatesError("every one of this run's 4 optimizer updates was skipped (loss is nan)")

    monkeypatch.setattr(trainer, "train_rank", diverged)
    config = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "configs", "tiny_cpu.yaml"
    )
    assert main(["train", "--config", config, f"logging.run_dir={tmp_path / 'run'}", "steps=1"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "stabledrl train: error: every one of this run's 4 optimizer updates was skipped (loss is nan)"
    ]


def test_convert_help_says_remote_code_executes_the_file(capsys):
    """``--remote-code FILE.py`` and ``--reference remote`` run code: their help says so."""
    with pytest.raises(SystemExit) as info:
        main(["convert", "mcore-to-hf", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    remote_code = text[text.index("--remote-code FILE.py") :]
    assert "EXECUTES the file (and that configuration_*.py) as Python" in remote_code, remote_code[:600]
    reference = text[text.index("--reference {public,remote}") :]
    assert "runs that code as Python (trust_remote_code)" in reference, reference[:400]


def test_ctrl_c_of_any_command_is_one_line_and_exit_130(capsys, monkeypatch):
    """Ctrl-C during a command's checks (e.g. a long preflight generating data) or its work: one line,
    status 130 (issue #62; before: a KeyboardInterrupt traceback); ``--debug`` keeps the traceback."""
    from stabledrl_mcore.cli import plan

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan, "run_plan", interrupted)
    assert main(["plan", "--model", "llada-tiny"]) == 130
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["stabledrl plan: interrupted"] and captured.out == ""
    with pytest.raises(KeyboardInterrupt):
        main(["plan", "--model", "llada-tiny", "--debug"])


@pytest.mark.parametrize("phase", ["importing the command module", "parsing the arguments"])
def test_ctrl_c_before_the_command_runs_is_the_same_one_line_and_exit_130(capsys, monkeypatch, phase):
    """Ctrl-C in a command's first seconds, while ``main`` imports the command module (torch,
    Megatron: seconds) or parses its line, is the same line and status as a later one (issue #70;
    before: a 45-68 line KeyboardInterrupt traceback); ``--debug`` keeps the traceback."""
    from stabledrl_mcore.cli import app

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    if phase == "importing the command module":
        monkeypatch.setattr(app, "_command_module", interrupted)
    else:
        monkeypatch.setattr(app._Parser, "parse_known_args", interrupted)
    assert main(["plan", "--model", "llada-tiny"]) == 130
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["stabledrl plan: interrupted"] and captured.out == ""
    with pytest.raises(KeyboardInterrupt):
        main(["plan", "--model", "llada-tiny", "--debug"])


_INTERRUPT_THE_IMPORT = """
import sys

class Interrupts:
    def find_spec(self, name, path=None, target=None):
        if name == "stabledrl_mcore.cli.app":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupts())
from stabledrl_mcore.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("debug", [False, True])
def test_ctrl_c_while_the_command_line_is_imported_is_one_line_and_exit_130(debug):
    """Ctrl-C in the console script's first tenth of a second, while it imports ``cli.app`` (the
    last review: still a traceback there): one line and 130; ``--debug`` keeps the traceback."""
    argv = ["plan", "--model", "llada-tiny"] + (["--debug"] if debug else [])
    env = {k: v for k, v in os.environ.items() if k != "STABLEDRL_DEBUG"}
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_THE_IMPORT, *argv], capture_output=True, text=True, timeout=120, env=env
    )
    if debug:
        assert done.returncode != 130 and "KeyboardInterrupt" in done.stderr, done.stderr
    else:
        assert (done.returncode, done.stderr.splitlines(), done.stdout) == (130, ["stabledrl plan: interrupted"], "")


def test_output_piped_into_a_reader_that_stops_early_is_no_traceback():
    """``stabledrl plan ... | head -1``: the reader closes the pipe; the command ends
    with 141 (128 + SIGPIPE, as a shell reports it) and prints nothing to stderr (before: a
    BrokenPipeError traceback)."""
    reader, writer = os.pipe()
    code = "import sys; from stabledrl_mcore.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "plan", "--model", "llada-8b", "--nodes", "2"],
        stdout=writer,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(writer)
    os.close(reader)  # the reader has gone before the command prints: its output meets a closed pipe
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert (proc.returncode, err) == (141, ""), err
