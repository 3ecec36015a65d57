"""The SLURM job scripts, for real: a local cluster with two emulated nodes, tiny config, CPU.

About two minutes on an idle 2-core machine; the waits are bounded generously
(a loaded machine took five) and a timeout fails with the job's logs.

The module starts munged (unless one answers), slurmctld and ``slurmd -N n1`` /
``slurmd -N n2`` under a temp dir (``tools/slurm_local_cluster.py``), submits
``slurm/train_llada_8b.sh`` with ``sbatch`` and environment overrides that select
the tiny CPU config, and stops every daemon it started, by PID, also when a test
fails. SLURM is installed with ``tools/ensure_slurm.sh`` when missing; the tests
are skipped only where that is impossible (not root, or no apt-get).
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = "slurm/train_llada_8b.sh"
TINY = ("logging.wandb_mode=disabled logging.progress=false rollout.prompts_per_step=4 "
        "rollout.group_size=4 rollout.gen_length=8 rollout.steps=4 rollout.block_length=8 "
        "parallel.micro_batch_size=4 parallel.threads=1 checkpoint.save_every=1000 "
        "checkpoint.keep_last=5")
# Two emulated nodes x one task, no GPUs: --gpus-per-node=0 replaces the header's 8.
SBATCH_CPU = ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--time=00:15:00")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _load_cluster_module():
    spec = importlib.util.spec_from_file_location("slurm_local_cluster",
                                                  ROOT / "tools" / "slurm_local_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ensure_slurm() -> None:
    """Install SLURM if missing; skip only where it cannot be installed."""
    have = all(shutil.which(t) or shutil.which(t, path="/usr/sbin:/sbin")
               for t in ("sbatch", "slurmctld", "slurmd", "munged"))
    if not have:
        if os.geteuid() != 0:
            pytest.skip("SLURM is not installed and cannot be: not root (tools/ensure_slurm.sh needs root)")
        if shutil.which("apt-get") is None:
            pytest.skip("SLURM is not installed and cannot be: apt-get is not available")
    proc = subprocess.run([str(ROOT / "tools" / "ensure_slurm.sh")], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"tools/ensure_slurm.sh failed:\n{proc.stdout}{proc.stderr}")
    if os.geteuid() != 0:
        pytest.skip("a local SLURM cluster needs root (slurmd runs jobs as their users)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _ensure_slurm()
    module = _load_cluster_module()
    local = module.LocalSlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=("n1", "n2"))
    try:
        local.start()
        yield local
    finally:
        local.stop()


def _submit(cluster, run_dir: Path, steps: int = 0, *, script: str = TRAIN_SCRIPT, env_overrides=None,
            sbatch=SBATCH_CPU, script_args=()) -> str:
    """sbatch ``script`` (default: the LLaDA job with the tiny config) in CPU mode; returns the job id."""
    env = cluster.env()
    env.update(STABLEDRL_RUN_DIR=str(run_dir), STABLEDRL_PYTHON=sys.executable, STABLEDRL_DEVICE="cpu")
    env.update(env_overrides if env_overrides is not None else
               {"STABLEDRL_CONFIG": str(ROOT / "examples/configs/tiny_cpu.yaml"),
                "STABLEDRL_OVERRIDES": f"{TINY} steps={steps}"})
    env.pop("STABLEDRL_ROOT", None)  # the script finds the repository from the submit dir
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)  # the job derives its own rendezvous from SLURM, not from this shell
    proc = subprocess.run(["sbatch", "--parsable", *sbatch,
                           f"--output={run_dir.parent / (run_dir.name + '-slurm-%j.out')}", script, *script_args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def _job(cluster, job_id: str) -> dict:
    out = cluster.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _diagnostics(cluster, job_id: str, run_dir: Path) -> str:
    parts = [f"scontrol: {_job(cluster, job_id)}"]
    logs = sorted(run_dir.parent.glob(f"{run_dir.name}-slurm-{job_id}.out"))
    logs += sorted((run_dir / "logs").glob("**/*.log")) + sorted((run_dir / "logs").glob("**/command.txt"))
    for log in logs:
        parts.append(f"== {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))
    parts.append(cluster.logs(tail=20))
    return "\n".join(parts)


def _wait(cluster, job_id: str, run_dir: Path, ready, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} of job {job_id}\n"
                + _diagnostics(cluster, job_id, run_dir))


def _wait_final(cluster, job_id: str, run_dir: Path, timeout: float) -> dict:
    def final():
        info = _job(cluster, job_id)
        return info if info.get("JobState") in FINAL_STATES else None
    info = _wait(cluster, job_id, run_dir, final, "the end", timeout)
    assert info["JobState"] == "COMPLETED", _diagnostics(cluster, job_id, run_dir)
    return info


def _metric_steps(run_dir: Path):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _checkpoint_steps(run_dir: Path):
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")
                  if (p / "train_state.json").exists())


def test_train_job_completes_across_two_nodes(cluster, tmp_path):
    run_dir = tmp_path / "run"
    job_id = _submit(cluster, run_dir, steps=3)
    info = _wait_final(cluster, job_id, run_dir, timeout=420)
    assert info["NumNodes"] == "2" and info["NodeList"] == "n[1-2]", info

    assert _metric_steps(run_dir) == [1, 2, 3]
    assert _checkpoint_steps(run_dir) == [3]
    state = json.loads((run_dir / "checkpoints/step_00000003/train_state.json").read_text())
    assert state["world_size"] == 2

    logs = run_dir / "logs" / job_id / "restart_0"
    headers = [(logs / f"rank_{r}.log").read_text().splitlines()[0] for r in (0, 1)]
    assert "rank 0/2" in headers[0] and "node=n1" in headers[0], headers
    assert "rank 1/2" in headers[1] and "node=n2" in headers[1], headers
    command = (logs / "command.txt").read_text()
    assert "srun" in command and "stabledrl_mcore.cli train" in command and "--resume auto" in command
    assert f"run_dir: {run_dir}" in (logs / "config.yaml").read_text()


def test_preempted_job_checkpoints_requeues_and_resumes(cluster, tmp_path):
    run_dir, steps = tmp_path / "run", 24
    job_id = _submit(cluster, run_dir, steps=steps)
    _wait(cluster, job_id, run_dir, lambda: _metric_steps(run_dir), "the first metrics line", 300)
    # The signal SLURM sends before the time limit (--signal=B:USR1@...), now, to the batch shell.
    cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    info = _wait_final(cluster, job_id, run_dir, timeout=480)
    diag = lambda: _diagnostics(cluster, job_id, run_dir)  # noqa: E731

    assert int(info["Restarts"]) >= 1, diag()
    logs = run_dir / "logs" / job_id
    first = (logs / "restart_0" / "rank_0.log").read_text()
    match = re.search(r"pre-empted: checkpoint written at step (\d+)", first)
    assert match, diag()
    preempted_at = int(match.group(1))
    assert 1 <= preempted_at < steps, f"the job ended before the signal arrived\n{diag()}"
    assert _checkpoint_steps(run_dir) == [preempted_at, steps], diag()
    assert "restart=1" in (logs / "restart_1" / "rank_0.log").read_text().splitlines()[0]

    # The requeued attempt resumed from the checkpoint: steps continue, never restart at 1.
    assert _metric_steps(run_dir) == list(range(1, steps + 1)), diag()
    batch_log = (run_dir.parent / f"{run_dir.name}-slurm-{job_id}.out").read_text()
    assert "caught SIGUSR1" in batch_log and "requeueing job" in batch_log, batch_log
    assert "restart_count=1" in batch_log, batch_log


def test_convert_job_then_the_sdar_recipe_job(cluster, tmp_path):
    """slurm/convert.sh writes the checkpoint the SDAR recipe loads; slurm/train_sdar_8b.sh then runs
    its own recipe (bf16, recompute, staircase, TP) scaled down by shape and length, 2 nodes x 2 tasks."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_fixtures import write_hf_checkpoint

    hf = write_hf_checkpoint(str(tmp_path / "hf_sdar"), "sdar")
    converted, convert_dir = tmp_path / "sdar-mcore", tmp_path / "convert"
    job = _submit(cluster, convert_dir, script="slurm/convert.sh",
                  env_overrides={"STABLEDRL_MODEL": "sdar", "STABLEDRL_HF_DIR": hf, "STABLEDRL_OUT": str(converted)},
                  sbatch=("--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=00:10:00"))
    _wait_final(cluster, job, convert_dir, timeout=300)
    assert (converted / "stabledrl_model.json").is_file()

    run_dir = tmp_path / "sdar_run"
    scaled = (f"model.checkpoint={converted} parallel.tensor_parallel=2 parallel.threads=1 "
              "logging.wandb_mode=disabled logging.progress=false rollout.prompts_per_step=2 "
              "rollout.group_size=2 rollout.gen_length=8 "
              f"rollout.data_path={ROOT / 'tests/fixtures/math500_test.jsonl'} steps=1")
    job = _submit(cluster, run_dir, script="slurm/train_sdar_8b.sh", env_overrides={"STABLEDRL_OVERRIDES": scaled},
                  sbatch=("--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=0", "--time=00:15:00"))
    _wait_final(cluster, job, run_dir, timeout=480)
    assert _metric_steps(run_dir) == [1] and _checkpoint_steps(run_dir) == [1]
    resolved = (run_dir / "logs" / job / "restart_0" / "config.yaml").read_text()
    for line in ("dtype: bf16", "recompute: true", "likelihood: staircase", "tensor_parallel: 2"):
        assert line in resolved, resolved
    state = json.loads((run_dir / "checkpoints/step_00000001/train_state.json").read_text())
    assert state["world_size"] == 4 and state["tensor_parallel"] == 2


def test_bench_job_writes_its_json(cluster, tmp_path):
    run_dir = tmp_path / "bench"
    job = _submit(cluster, run_dir, script="slurm/bench_throughput.sh",
                  env_overrides={"STABLEDRL_CONFIG": str(ROOT / "examples/configs/tiny_cpu.yaml"),
                                 "STABLEDRL_OVERRIDES": TINY},
                  sbatch=("--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0", "--time=00:10:00"))
    _wait_final(cluster, job, run_dir, timeout=300)
    result = json.loads((run_dir / "logs" / job / "restart_0" / "bench.json").read_text())
    assert result["layout"]["world_size"] == 1 and result["phases"]["step"]["tokens_per_s"] > 0


def _eval_script_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STABLEDRL_", "SLURM_"))}
    env.update(extra)
    return env


def test_eval_script_parses_and_refuses_missing_or_training_inputs():
    """slurm/eval.sh: valid bash; without a checkpoint or task, or with training-only settings, it
    stops with one line (exit 2) before asking SLURM for anything."""
    assert subprocess.run(["bash", "-n", "slurm/eval.sh"], cwd=ROOT, timeout=30).returncode == 0
    for env, needle in (({"STABLEDRL_TASK": "gsm8k"}, "STABLEDRL_CKPT"),
                        ({"STABLEDRL_CKPT": "/x"}, "STABLEDRL_TASK"),
                        ({"STABLEDRL_CKPT": "/x", "STABLEDRL_TASK": "gsm8k", "STABLEDRL_OVERRIDES": "steps=1"},
                         "STABLEDRL_OVERRIDES")):
        proc = subprocess.run(["bash", "slurm/eval.sh"], cwd=ROOT, env=_eval_script_env(**env),
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_eval_job_samples_across_two_nodes(cluster, tmp_path):
    """slurm/eval.sh on 2 nodes x 1 task (DP = 2): every sample of every example, and the summary."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_fixtures import write_hf_checkpoint

    hf = write_hf_checkpoint(str(tmp_path / "hf_llada"), "llada", seed=2)
    flags = ["--limit", "3", "--gen-length", "4", "--steps", "4", "--block-length", "4", "--n", "2",
             "--temperature", "1.0", "--k", "1,2", "--batch-size", "2", "--threads", "1"]
    run_dir, out = tmp_path / "eval_run", tmp_path / "eval" / "sudoku.jsonl"
    job = _submit(cluster, run_dir, script="slurm/eval.sh",
                  env_overrides={"STABLEDRL_CKPT": hf, "STABLEDRL_TASK": "sudoku"},
                  sbatch=("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--time=00:10:00"),
                  script_args=(*flags, "--out", str(out)))
    _wait_final(cluster, job, run_dir, timeout=300)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads(out.with_name("sudoku.summary.json").read_text())
    assert len(records) == 3 and all(len(r["samples"]) == 2 for r in records) and "pass@2" in summary
    assert "stabledrl_mcore.cli eval" in (run_dir / "logs" / job / "restart_0" / "command.txt").read_text()
