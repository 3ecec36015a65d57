"""Run directories, checkpoint safety and resume with a changed config (issue 23, cases 3-6).

One spawned single-rank worker trains a tiny run once and then, in the same process, tries
every fault on it (used directory, ``--overwrite``, resume from an earlier step with
``keep_last=1``, a changed LR, an already complete run, a corrupt shard, NaN weights, a
crafted RNG pickle, a crafted ``.metadata`` and ``common.pt`` with a matching manifest through
``stabledrl train --resume`` / ``model.checkpoint`` (issue 40)); the tests read its record.
Checks that read files only run here.
"""

import contextlib
import io
import json
import os
import pickle
import shutil
import sys
import time

import pytest
import torch

from stabledrl_mcore.parallel.launch import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
sys.path.insert(0, os.path.join(ROOT, "tests"))

TINY = {
    "logging.wandb_mode": "disabled",
    "logging.progress": False,
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 2,
    "rollout.gen_length": 4,
    "rollout.steps": 2,
    "rollout.block_length": 4,
    "parallel.micro_batch_size": 4,
    "algo.inner_iterations": 1,
    "algo.num_mc": 1,
    "checkpoint.save_every": 1,
    "checkpoint.keep_last": 5,
    "steps": 3,
    "optim.lr": 1e-3,
    "optim.decay_style": "linear",
}


def tiny_config(run_dir, **extra):
    from stabledrl_mcore.config.schema import load_config

    return load_config(CONFIG, [f"{k}={v}" for k, v in dict(TINY, **{"logging.run_dir": run_dir}, **extra).items()])


class _Exploit:
    """Unpickling this runs a shell command (what a crafted rng/rank00000.pt did on main)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_exploit(path, marker):
    with open(path, "wb") as handle:
        pickle.dump({"python": _Exploit(marker)}, handle, protocol=2)


def write_metadata_exploit(path, marker):
    """A ``.metadata`` shaped like torch's (a dict of its fields) whose unpickling runs a command."""
    with open(path, "wb") as handle:
        pickle.dump({"state_dict_metadata": {"embedding.word_embeddings.weight": _Exploit(marker)}}, handle)


def _steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line)["step"] for line in handle]


def _error(fn):
    start = time.perf_counter()
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - the record names the type (torch's CheckpointException too)
        return {"type": type(err).__name__, "message": str(err), "seconds": time.perf_counter() - start}
    return {"type": None, "message": "", "seconds": time.perf_counter() - start}


def _stabledrl(argv):
    """``stabledrl ARGV`` in this process: its exit status and the error lines it printed."""
    from stabledrl_mcore import cli

    err, status = io.StringIO(), {}
    with contextlib.redirect_stderr(err):
        outcome = _error(lambda: status.setdefault("code", cli.main(argv)))
    outcome["code"] = status.get("code")
    outcome["errors"] = [line for line in err.getvalue().splitlines() if ": error: " in line]
    return outcome


def _corrupt_tensor(ckpt, tensor, value=b"\xff" * 4000):
    """Write ``value`` over every stored copy of ``tensor`` (the model's, the optimizer's fp32 main
    weights) in the shard files, sizes unchanged; returns the file."""
    raw, hit = tensor.detach().contiguous().numpy().tobytes(), None
    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".distcp"):
            with open(os.path.join(ckpt, name), "r+b") as handle:
                data = handle.read()
                offset = data.find(raw[:256])
                while offset >= 0:
                    handle.seek(offset)
                    handle.write(value[: len(raw)])
                    hit, offset = hit or name, data.find(raw[:256], offset + 1)
    assert hit, "tensor not found in any shard"
    return hit


def _safety_worker(base, record_path):
    try:
        from stabledrl_mcore.checkpoint.integrity import write_checksums
    except ImportError:  # main (b5f6cc5) writes no manifest: the worker still runs every case there
        write_checksums = lambda path: None  # noqa: E731
    from stabledrl_mcore.checkpoint.state import find_latest, list_checkpoints, load_checkpoint
    from stabledrl_mcore.engine.save_schedule import save_training_checkpoint
    from stabledrl_mcore.rl.trainer import train

    rec = {}
    run = os.path.join(base, "run")
    root = os.path.join(run, "checkpoints")
    train(tiny_config(run))  # steps 1..3, a checkpoint each
    rec["first_steps"] = _steps(run)
    rec["first_ckpts"] = [os.path.basename(p) for p in list_checkpoints(root)]
    # case 3: a fresh run into it is refused before anything is built (counted, not timed)
    from stabledrl_mcore.rl import trainer as rl_trainer

    real_build, builds = rl_trainer.build_training, []
    rl_trainer.build_training = lambda *a, **k: builds.append(1) or real_build(*a, **k)
    try:
        rec["fresh_again"] = _error(lambda: train(tiny_config(run, steps=1)))
    finally:
        rl_trainer.build_training = real_build
    rec["fresh_again"]["builds"] = len(builds)
    rec["after_refusal"] = {"steps": _steps(run), "ckpts": [os.path.basename(p) for p in list_checkpoints(root)]}
    # case 3: --overwrite moves it aside (a copy, so the run goes on below)
    over = os.path.join(base, "over")
    shutil.copytree(run, over)

    def overwrite():
        train(tiny_config(over, steps=1, **{"checkpoint.overwrite": True}))
        over_root = os.path.join(over, "checkpoints")
        aside = [d for d in os.listdir(over_root) if d.startswith("overwritten-")]
        rec["overwrite"] = {
            "steps": _steps(over),
            "listing": sorted(os.listdir(over)),
            "ckpts": sorted(os.listdir(over_root)),
            "attic": [
                sorted(os.listdir(os.path.join(over, "attic", d))) for d in os.listdir(os.path.join(over, "attic"))
            ],
            "moved_ckpts": sorted(os.listdir(os.path.join(over_root, aside[0]))) if aside else [],
        }

    rec["overwrite_error"] = _error(overwrite)
    # cases 3 + 6: resume from step 1 (a later history, steps 2 and 3, exists) with keep_last=1
    # and a changed LR and schedule length
    resumed = tiny_config(run, steps=4, **{"checkpoint.keep_last": 1, "optim.lr": 5e-3})

    def lr_after_first_resumed_step(setup, step):
        group = setup.optimizer.param_groups[0]
        rec.setdefault(
            "lr",
            {
                "lr": group["lr"],
                "max_lr": group["max_lr"],
                "scheduler_max_lr": setup.scheduler.max_lr,
                "decay_steps": setup.scheduler.lr_decay_steps,
                "num_steps": setup.scheduler.num_steps,
            },
        )
        return {}

    s = train(resumed, resume=os.path.join(root, "step_00000001"), hooks=[lr_after_first_resumed_step])
    rec["resumed_steps"] = _steps(run)
    rec["resumed_ckpts"] = [os.path.basename(p) for p in list_checkpoints(root)]
    rec["latest"] = os.path.basename(find_latest(root))
    abandoned = [d for d in os.listdir(root) if d.startswith("abandoned-")]
    rec["abandoned"] = {
        d: sorted(
            n for n in os.listdir(os.path.join(root, d)) if os.path.isfile(os.path.join(root, d, n, "train_state.json"))
        )
        for d in abandoned
    }
    # case 5: a run already at its steps trains nothing and says so
    before = _steps(run)
    train(resumed, resume="auto")
    rec["complete_unchanged"] = _steps(run) == before
    # case 5: a shard with 4000 bytes of 0xFF: a named error at load, not NaN parameters
    latest = find_latest(root)
    scratch = os.path.join(base, "scratch")
    shard = os.path.join(scratch, "step_00000004")
    shutil.copytree(latest, shard)
    rec["shard"] = _corrupt_tensor(shard, dict(s.model.named_parameters())["embedding.word_embeddings.weight"])
    rec["corrupt_load"] = _error(lambda: load_checkpoint(shard, s.model, optimizer=s.optimizer))
    from stabledrl_mcore.checkpoint.mcore_io import load_model_weights

    rec["corrupt_model_checkpoint"] = _error(lambda: load_model_weights(s.model, shard))
    rec["params_finite_after_refusal"] = all(torch.isfinite(p).all().item() for p in s.model.parameters())
    write_checksums(shard)  # the same NaN bytes with a matching manifest: the finite check names them
    rec["nan_load"] = _error(lambda: load_checkpoint(shard, s.model, optimizer=s.optimizer))
    # case 4: a crafted RNG pickle is refused and runs nothing
    rng = os.path.join(scratch, "rng_case", "step_00000004")
    shutil.copytree(latest, rng)
    marker = os.path.join(base, "exploit_ran")
    write_exploit(os.path.join(rng, "rng", "rank00000.pt"), marker)
    rec["rng_checksum"] = _error(lambda: load_checkpoint(rng, s.model, optimizer=s.optimizer))
    write_checksums(rng)
    rec["rng_unsafe"] = _error(lambda: load_checkpoint(rng, s.model, optimizer=s.optimizer))
    rec["exploit_ran"] = os.path.exists(marker)
    # issue 40: a crafted .metadata with a matching manifest, through every training-checkpoint opener
    from stabledrl_mcore.checkpoint.info import read_checkpoint_info

    evil_run = os.path.join(base, "evil_run")
    evil = os.path.join(evil_run, "checkpoints", "step_00000004")
    shutil.copytree(latest, evil)
    meta_marker = os.path.join(base, "metadata_exploit_ran")
    write_metadata_exploit(os.path.join(evil, ".metadata"), meta_marker)
    write_checksums(evil)
    args = ["train", "--config", CONFIG, *[f"{k}={v}" for k, v in TINY.items()], "steps=5"]
    rec["metadata_cli_resume"] = _stabledrl([*args, f"logging.run_dir={evil_run}", "--resume", evil])
    fresh = os.path.join(base, "fresh_run")
    rec["metadata_cli_model_checkpoint"] = _stabledrl([*args, f"logging.run_dir={fresh}", f"model.checkpoint={evil}"])
    rec["metadata_load"] = _error(lambda: load_checkpoint(evil, s.model, optimizer=s.optimizer))
    rec["metadata_model_checkpoint"] = _error(lambda: load_model_weights(s.model, evil))
    rec["metadata_info"] = _error(lambda: read_checkpoint_info(evil))
    rec["metadata_path"] = os.path.join(evil, ".metadata")
    rec["metadata_exploit_ran"] = os.path.exists(meta_marker)
    # issue 40: a crafted common.pt (torch.load's weights_only refuses it): one line, not a traceback
    common = os.path.join(scratch, "common_case", "step_00000004")
    shutil.copytree(latest, common)
    common_marker = os.path.join(base, "common_exploit_ran")
    # torch.save's format (a raw pickle is refused before it is read: test_checkpoint_trust)
    torch.save({"python": _Exploit(common_marker)}, os.path.join(common, "common.pt"))
    write_checksums(common)
    rec["common_load"] = _error(lambda: load_checkpoint(common, s.model, optimizer=s.optimizer))
    rec["common_model_checkpoint"] = _error(lambda: load_model_weights(s.model, common))
    rec["common_path"] = os.path.join(common, "common.pt")
    rec["common_exploit_ran"] = os.path.exists(common_marker)
    # case 5: a NaN parameter is never committed
    with torch.no_grad():
        next(s.model.parameters()).view(-1)[0] = float("nan")
    nan_root = os.path.join(base, "nan_root")
    rec["nan_save"] = _error(lambda: save_training_checkpoint(s, nan_root, 9))
    rec["nan_root_listing"] = sorted(os.listdir(nan_root)) if os.path.isdir(nan_root) else []
    with open(record_path, "w") as handle:
        json.dump(rec, handle, indent=1)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    base = tmp_path_factory.mktemp("safety")
    path = str(base / "record.json")
    spawn(_safety_worker, 1, (str(base), path), timeout=400)
    with open(path) as handle:
        return json.load(handle), str(base)


@pytest.mark.multiprocess
def test_fresh_run_into_a_used_run_dir_is_refused_before_building(record):
    rec, base = record
    assert rec["first_steps"] == [1, 2, 3] and rec["first_ckpts"] == [f"step_0000000{i}" for i in (1, 2, 3)]
    err = rec["fresh_again"]
    assert err["type"] == "RunDirInUseError" and "\n" not in err["message"], err
    for needle in (os.path.join(base, "run"), "--resume auto", "--overwrite", "metrics.jsonl"):
        assert needle in err["message"], err
    assert err["builds"] == 0, "refused only after the model and optimizer were built"
    assert rec["after_refusal"] == {"steps": [1, 2, 3], "ckpts": rec["first_ckpts"]}


@pytest.mark.multiprocess
def test_overwrite_moves_the_old_run_aside_and_starts_fresh(record):
    assert record[0]["overwrite_error"]["type"] is None, record[0]["overwrite_error"]
    over = record[0]["overwrite"]
    assert over["steps"] == [1]
    assert over["ckpts"][0].startswith("overwritten-") and over["ckpts"][1:] == ["step_00000001"], over
    assert over["moved_ckpts"] == ["step_00000001", "step_00000002", "step_00000003"], over
    assert "attic" in over["listing"] and over["attic"] == [
        ["checkpoint_timing.json", "config.yaml", "metrics.jsonl", "tokenizer"]
    ], over


@pytest.mark.multiprocess
def test_resume_from_an_earlier_step_keeps_the_abandoned_history_and_metrics_once(record):
    rec = record[0]
    # keep_last=1 pruned only the current history, after each new commit; the later branch of
    # the first run (steps 2, 3) is intact beside it and never picked by --resume auto
    assert rec["resumed_ckpts"] == ["step_00000004"] and rec["latest"] == "step_00000004", rec
    assert list(rec["abandoned"].values()) == [["step_00000002", "step_00000003"]], rec["abandoned"]
    assert list(rec["abandoned"])[0].endswith("-after-step_00000001")
    assert rec["resumed_steps"] == [1, 2, 3, 4], "metrics.jsonl must hold each step once"
    assert rec["complete_unchanged"], "an already complete run must not train or log"


@pytest.mark.multiprocess
def test_resume_with_a_changed_lr_uses_the_new_schedule(record):
    lr = record[0]["lr"]
    # the current config's schedule (5e-3, linear over 4 updates), progress from the checkpoint:
    # after step 2 two updates are done (main kept 1e-3 over 3 updates: 3.3e-4)
    assert lr["scheduler_max_lr"] == lr["max_lr"] == 5e-3 and lr["decay_steps"] == 4, lr
    assert lr["num_steps"] == 2 and lr["lr"] == pytest.approx(5e-3 * (1 - 2 / 4), rel=1e-9), lr


@pytest.mark.multiprocess
def test_corrupt_shard_and_nonfinite_weights_are_named_errors(record):
    rec = record[0]
    for key in ("corrupt_load", "corrupt_model_checkpoint"):
        err = rec[key]
        assert err["type"] == "CheckpointError" and rec["shard"] in err["message"], err
        assert "corrupt" in err["message"] and "\n" not in err["message"], err
    assert rec["params_finite_after_refusal"]
    assert rec["nan_load"]["type"] == "CheckpointError", rec["nan_load"]
    assert "embedding.word_embeddings.weight" in rec["nan_load"]["message"], rec["nan_load"]
    assert rec["nan_save"]["type"] == "CheckpointError" and "not saving" in rec["nan_save"]["message"]
    assert not any(n.startswith(("step_", ".tmp-")) for n in rec["nan_root_listing"]), rec["nan_root_listing"]


@pytest.mark.multiprocess
def test_a_crafted_rng_pickle_runs_no_code(record):
    rec = record[0]
    assert not rec["exploit_ran"], "loading the checkpoint ran code from its RNG file"
    assert rec["rng_checksum"]["type"] == "CheckpointError" and "rank00000.pt" in rec["rng_checksum"]["message"]
    err = rec["rng_unsafe"]
    assert err["type"] == "CheckpointError" and "not a safe RNG state file" in err["message"], err


@pytest.mark.multiprocess
def test_a_crafted_metadata_or_common_state_runs_no_code(record):
    """``stabledrl train --resume``, ``model.checkpoint``, ``load_checkpoint``, ``load_model_weights``
    and ``read_checkpoint_info`` all refuse a ``.metadata`` that builds ``os.system``, by name."""
    rec = record[0]
    assert not rec["metadata_exploit_ran"], "loading the checkpoint ran code from its .metadata"
    assert not rec["common_exploit_ran"], "loading the checkpoint ran code from its common.pt"
    system = f"{os.system.__module__}.system"
    refusal = f"{rec['metadata_path']}: refused to unpickle {system} (not checkpoint metadata)"
    for key in ("metadata_cli_resume", "metadata_cli_model_checkpoint"):
        out = rec[key]
        assert out["type"] is None and out["code"] == 2, out  # exit status 2: a user error
        assert len(out["errors"]) == 1 and refusal in out["errors"][0], out
    for key in ("metadata_load", "metadata_model_checkpoint", "metadata_info"):
        err = rec[key]
        assert err["type"] == "CheckpointError" and refusal in err["message"], err
        assert "not trusted" in err["message"] and "\n" not in err["message"], err
    for key in ("common_load", "common_model_checkpoint"):
        err = rec[key]
        assert err["type"] == "CheckpointError", err
        assert f"{rec['common_path']}: refused to unpickle {system}" in err["message"], err
        assert "\n" not in err["message"], err


# ---------------------------------------------------------------------------- file-only checks
def test_rng_file_roundtrip_and_refusal(tmp_path):
    import random

    import numpy as np

    from stabledrl_mcore.checkpoint.integrity import CheckpointError, load_rng_file, save_rng_file

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {"model-parallel-rng": torch.get_rng_state()},
    }
    save_rng_file(str(tmp_path / "r.pt"), state)
    back = load_rng_file(str(tmp_path / "r.pt"))
    assert back["python"] == state["python"] and torch.equal(back["torch"], state["torch"])
    assert all(
        np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(back["numpy"], state["numpy"])
    )
    marker = tmp_path / "ran"
    write_exploit(str(tmp_path / "evil.pt"), marker)
    with pytest.raises(CheckpointError, match="not a safe RNG state file"):
        load_rng_file(str(tmp_path / "evil.pt"))
    assert not marker.exists()


def test_metrics_keep_steps_through_is_lossless(tmp_path):
    from stabledrl_mcore.engine.metrics import keep_steps_through

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2, 3)) + '{"step": 4, "lo')
    saved = keep_steps_through(str(path), 2, str(tmp_path / "attic"))
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2]
    assert open(saved).read().count("\n") == 4, "the old file is kept whole"
    assert keep_steps_through(str(path), 2, str(tmp_path / "attic2")) is None


@pytest.mark.multiprocess
def test_train_state_and_config_checks_before_any_rank(record, tmp_path, monkeypatch, capsys):
    """train_state.json vs its directory, steps past the checkpoint, frozen keys, the CLI refusal."""
    from stabledrl_mcore import cli
    from stabledrl_mcore.checkpoint.integrity import CheckpointError
    from stabledrl_mcore.engine import preemption
    from stabledrl_mcore.engine.resume import ResumeConfigError, plan_resume

    base = record[1]
    run = os.path.join(base, "run")
    latest = os.path.join(run, "checkpoints", "step_00000004")
    cfg = tiny_config(run, steps=4, **{"checkpoint.keep_last": 1, "optim.lr": 1e-2})
    plan = plan_resume(cfg, "auto")
    assert plan.path == latest and plan.complete and "optim.lr: 0.005 -> 0.01" in plan.describe_changes()
    with pytest.raises(ResumeConfigError, match=r"step 4, past steps=2; raise steps"):
        plan_resume(tiny_config(run, steps=2), "auto")
    with pytest.raises(ResumeConfigError, match=r"model.overrides.hidden_size: <unset> -> 32"):
        plan_resume(tiny_config(run, steps=4, **{"model.overrides.hidden_size": 32}), "auto")
    with pytest.raises(ResumeConfigError, match=r"model.preset"):
        plan_resume(tiny_config(run, steps=4, **{"model.preset": "llada-8b"}), "auto")
    wrong = tmp_path / "ckpts" / "step_00000006"
    shutil.copytree(latest, wrong)
    state = json.loads((wrong / "train_state.json").read_text())
    (wrong / "train_state.json").write_text(json.dumps(dict(state, step=1000)))
    with pytest.raises(CheckpointError, match=r"says step 1000 but its directory is step_00000006"):
        plan_resume(cfg, str(wrong))
    # the CLI refuses a used run directory in one line, exit 2, before any rank starts
    from stabledrl_mcore.rl import trainer as rl_trainer

    monkeypatch.setattr(preemption, "install_preemption_handlers", lambda: None)
    builds = []  # counted, not timed: nothing is built before the refusal
    monkeypatch.setattr(rl_trainer, "build_training", lambda *a, **k: builds.append(1) or 1 / 0)
    code = cli.main(["train", "--config", CONFIG, f"logging.run_dir={run}", "logging.wandb_mode=disabled"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--overwrite" in err and run in err, err
    assert builds == []


def test_a_generated_task_read_from_a_file_takes_its_first_epoch_in_the_seeded_order(tmp_path):
    """Issue 71 (3d): Countdown with ``rollout.data_path`` (the release's file) reads its rows in
    file order; only a generated set (already a random draw) is taken in order, a file is shuffled
    like any task's: step 0's prompts are the seeded permutation's, not the file's first rows."""
    from stabledrl_mcore.engine.seeding import derive_seed
    from stabledrl_mcore.rl.setup import prompt_stream
    from stabledrl_mcore.tasks.from_config import build_task, load_train_examples

    data = tmp_path / "countdown.jsonl"
    data.write_text(
        "".join(json.dumps({"input": f"{n},{n + 1},{n + 2}", "output": str(3 * n + 3)}) + "\n" for n in range(40))
    )
    extra = {"rollout.task": "countdown", "rollout.task_options.reward_rule": "release", "rollout.data_path": str(data)}
    cfg = tiny_config(str(tmp_path), **extra, **{"rollout.prompts_per_step": 8, "parallel.seed": 3})
    examples = load_train_examples(cfg, build_task(cfg))
    assert [e.reference["numbers"][0] for e in examples] == list(range(40)), "the file, in its order"
    order = torch.randperm(40, generator=torch.Generator().manual_seed(derive_seed(3, 0))).tolist()
    assert sorted(order[:8]) != list(range(8))
    for rank in (0, 1):
        step0 = prompt_stream(cfg, examples, rank, 2).for_step(0)
        assert [e.reference["numbers"][0] for e in step0] == order[4 * rank : 4 * rank + 4]


@pytest.mark.parametrize("task", ["sudoku", "countdown"])
def test_a_generated_tasks_prompts_do_not_depend_on_steps(tmp_path, task):
    """``--resume ... steps=20`` after a 12-step run: steps 0..11 get the prompts the 12-step run
    got, on every data-parallel rank (the set drawn for 20 steps begins with the one for 12 and the
    stream takes it in order); later steps continue the draw."""
    from stabledrl_mcore.rl.setup import prompt_stream
    from stabledrl_mcore.tasks.from_config import build_task, load_train_examples

    streams, drawn = {}, {}
    for steps in (12, 20):
        cfg = tiny_config(str(tmp_path), **{"rollout.task": task, "rollout.prompts_per_step": 8, "steps": steps})
        drawn[steps] = load_train_examples(cfg, build_task(cfg))
        assert len(drawn[steps]) == 8 * steps
        streams[steps] = [prompt_stream(cfg, drawn[steps], rank, 2) for rank in (0, 1)]

    def prompts(stream, step):
        return [(e.prompt, json.dumps(e.reference, sort_keys=True)) for e in stream.for_step(step)]

    for step in range(12):
        for rank in (0, 1):
            assert prompts(streams[12][rank], step) == prompts(streams[20][rank], step), (step, rank)
    seen = [p for step in range(20) for rank in (0, 1) for p in prompts(streams[20][rank], step)]
    assert len(set(seen)) == len(seen) == 160, "a run's prompts are distinct until the set is used up"
