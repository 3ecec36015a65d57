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
TINY = (
    "logging.wandb_mode=disabled logging.progress=false rollout.prompts_per_step=4 "
    "rollout.group_size=4 rollout.gen_length=8 rollout.steps=4 rollout.block_length=8 "
    "parallel.micro_batch_size=4 parallel.threads=1 checkpoint.save_every=1000 "
    "checkpoint.keep_last=5"
)
# Two emulated nodes x one task, no GPUs: --gpus-per-node=0 and --cpus-per-task=1 replace the
# header's 8 and 8 (the headers' --exclusive --mem=0 stay). An hour, so that the train scripts'
# --signal=B:USR1@1800 comes after the test (a lead longer than the limit signals at once).
SBATCH_CPU = ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=01:00:00")
# A stand-in for pyxis: records every srun's container options, strips them, runs the real srun
# (in the --container-workdir, as pyxis does).
SRUN_STUB = """#!/bin/bash
args=() workdir=""
for arg in "$@"; do
    case "$arg" in
        --container-workdir=*) workdir=${arg#*=}; printf '%s ' "$arg" >>"$SRUN_STUB_LOG" ;;
        --container-*) printf '%s ' "$arg" >>"$SRUN_STUB_LOG" ;;
        *) args+=("$arg") ;;
    esac
done
echo >>"$SRUN_STUB_LOG"
if [[ -n "$workdir" ]]; then cd "$workdir"; fi
exec REAL_SRUN "${args[@]}"
"""
# The STABLEDRL_ENV_SETUP file: one marker line per shell that sourced it.
ENV_SETUP = """echo "step=${SLURM_STEP_ID:-batch} rank=${SLURM_PROCID:-batch} node=${SLURMD_NODENAME:-?} \
nccl_ib_timeout=${NCCL_IB_TIMEOUT:-unset} cmd=$*" >>"$(dirname "${BASH_SOURCE[0]}")/env_setup.marks"
export STABLEDRL_TEST_SETUP=sourced
"""
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def _load_cluster_module():
    spec = importlib.util.spec_from_file_location("slurm_local_cluster", ROOT / "tools" / "slurm_local_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ensure_slurm() -> None:
    """Install SLURM if missing; skip only where it cannot be installed."""
    have = all(
        shutil.which(t) or shutil.which(t, path="/usr/sbin:/sbin") for t in ("sbatch", "slurmctld", "slurmd", "munged")
    )
    if not have:
        if os.geteuid() != 0:
            pytest.skip("SLURM is not installed and cannot be: not root (tools/ensure_slurm.sh needs root)")
        if shutil.which("apt-get") is None:
            pytest.skip("SLURM is not installed and cannot be: apt-get is not available")
    proc = subprocess.run([str(ROOT / "tools" / "ensure_slurm.sh")], capture_output=True, text=True, timeout=600)
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


def _submit(
    cluster,
    run_dir: Path,
    steps: int = 0,
    *,
    script: str = TRAIN_SCRIPT,
    env_overrides=None,
    sbatch=SBATCH_CPU,
    submit=("sbatch",),
    cwd=ROOT,
    env_extra=None,
    script_args=(),
) -> str:
    """sbatch ``script`` (default: the LLaDA job with the tiny config) in CPU mode; returns the job id.
    ``submit`` is the command (e.g. slurm/submit.sh), run in ``cwd``; ``env_extra`` adds variables;
    ``script_args`` follow the script."""
    env = cluster.env()
    env.update(STABLEDRL_RUN_DIR=str(run_dir), STABLEDRL_PYTHON=sys.executable, STABLEDRL_DEVICE="cpu")
    env.update(
        env_overrides
        if env_overrides is not None
        else {
            "STABLEDRL_CONFIG": str(ROOT / "examples/configs/tiny_cpu.yaml"),
            "STABLEDRL_OVERRIDES": f"{TINY} steps={steps}",
        }
    )
    env.pop("STABLEDRL_ROOT", None)  # the script finds the repository from the submit dir
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)  # the job derives its own rendezvous from SLURM, not from this shell
    env.update(env_extra or {})
    proc = subprocess.run(
        [
            *submit,
            "--parsable",
            *sbatch,
            f"--output={run_dir.parent / (run_dir.name + '-slurm-%j.out')}",
            script,
            *script_args,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
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
    pytest.fail(
        f"timed out after {timeout:.0f} s waiting for {what} of job {job_id}\n" + _diagnostics(cluster, job_id, run_dir)
    )


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
    return sorted(
        int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*") if (p / "train_state.json").exists()
    )


def _cluster_environment(tmp_path: Path) -> dict:
    """A pyxis stand-in srun first on PATH, a container image and mounts, an env-setup file (given
    relative to the submit directory ``tmp_path/submit``), NCCL_IB_TIMEOUT set by the user."""
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    real = shutil.which("srun")
    (stub_dir / "srun").write_text(SRUN_STUB.replace("REAL_SRUN", real))
    (stub_dir / "srun").chmod(0o755)
    (tmp_path / "env_setup.sh").write_text(ENV_SETUP)
    return {
        "PATH": f"{stub_dir}{os.pathsep}{os.environ['PATH']}",
        "SRUN_STUB_LOG": str(tmp_path / "srun.log"),
        "STABLEDRL_CONTAINER": "/images/stabledrl.sqsh",
        "STABLEDRL_MOUNTS": f"{tmp_path}/data:/data",
        "STABLEDRL_ENV_SETUP": "../env_setup.sh",
        "NCCL_IB_TIMEOUT": "7",
    }  # relative to the submit dir


def test_train_job_completes_across_two_nodes(cluster, tmp_path):
    """Submitted with slurm/submit.sh from another directory, in a (stand-in) container, with an
    env-setup file; then the same job with plain sbatch from there fails with one line."""
    run_dir, submit_dir = tmp_path / "run", tmp_path / "submit"
    submit_dir.mkdir()
    job_id = _submit(
        cluster,
        run_dir,
        steps=3,
        submit=(str(ROOT / "slurm/submit.sh"),),
        cwd=submit_dir,
        script="train_llada_8b.sh",
        env_extra=_cluster_environment(tmp_path),
        sbatch=(*SBATCH_CPU, "--signal=B:USR1@1200"),
    )
    info = _wait_final(cluster, job_id, run_dir, timeout=420)
    assert info["NumNodes"] == "2" and info["NodeList"] == "n[1-2]", info
    diag = lambda: _diagnostics(cluster, job_id, run_dir)  # noqa: E731

    # every srun (the config check on one node, the ranks) ran in the container with the mounts
    calls = (tmp_path / "srun.log").read_text().splitlines()
    assert len(calls) == 2, calls
    for call in calls:
        assert "--container-image=/images/stabledrl.sqsh" in call and f"--container-workdir={submit_dir}" in call
        mounts = call.split("--container-mounts=")[1].split()[0].split(",")
        assert mounts[:4] == [
            f"{tmp_path}/data:/data",
            f"{ROOT}:{ROOT}",
            f"{submit_dir}:{submit_dir}",
            f"{tmp_path}/env_setup.sh:{tmp_path}/env_setup.sh",
        ], mounts
    assert f"{run_dir}:{run_dir}" in calls[1] and len(calls[0].split(",")) == 4, calls  # the run dir: known later
    # the env-setup file was sourced by the config check and by every rank, on its node, first
    marks = (tmp_path / "env_setup.marks").read_text().splitlines()
    ranks = sorted(
        m.split(" nccl")[0].split(" ", 1)[1] for m in marks if "cli train" in m and "--print-config" not in m
    )
    assert ranks == ["rank=0 node=n1", "rank=1 node=n2"], marks
    assert any("--print-config" in m for m in marks) and all("nccl_ib_timeout=7" in m for m in marks), marks
    batch_log = (run_dir.parent / f"{run_dir.name}-slurm-{job_id}.out").read_text()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 (default)" in batch_log and "NCCL_IB_TIMEOUT=7 (yours)" in batch_log, diag()
    assert "pre-emption lead time 1200 s (from STABLEDRL_SIGNAL_LEAD_S)" in batch_log, diag()  # submit.sh's

    # plain sbatch from a directory that is not the repository: the job fails at once, saying so
    other = tmp_path / "elsewhere"
    other.mkdir()
    bad = _submit(cluster, other / "run", submit=("sbatch",), cwd=other, script=str(ROOT / TRAIN_SCRIPT))
    _wait(cluster, bad, other, lambda: _job(cluster, bad).get("JobState") in FINAL_STATES, "the end", 120)
    out = (other / f"run-slurm-{bad}.out").read_text()
    assert f"stabledrl: error: {other} is not the stabledrl_mcore repository" in out, out

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
    resolved = (logs / "config.yaml").read_text()
    assert f"run_dir: {run_dir}" in resolved and "preemption_lead_s: 1200" in resolved, resolved


def test_preempted_job_checkpoints_requeues_and_resumes(cluster, tmp_path):
    run_dir, steps = tmp_path / "run", 24
    # a 1 s pre-emption lead, passed to the trainer as checkpoint.preemption_lead_s
    job_id = _submit(cluster, run_dir, steps=steps, env_extra={"STABLEDRL_SIGNAL_LEAD_S": "1"})
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
    # the lead reached the trainer and each save was timed; whether 1 s is too short depends on this
    # machine's save time, so the warning itself is tested with set times in test_save_schedule.py
    assert "preemption_lead_s: 1.0\n" in (logs / "restart_0" / "config.yaml").read_text(), diag()
    timing = json.loads((run_dir / "checkpoint_timing.json").read_text())
    assert timing["save_s"] > 0 and timing["max_save_s"] >= timing["save_s"], diag()

    # The requeued attempt resumed from the checkpoint: steps continue, never restart at 1.
    assert _metric_steps(run_dir) == list(range(1, steps + 1)), diag()
    batch_log = (run_dir.parent / f"{run_dir.name}-slurm-{job_id}.out").read_text()
    assert "caught SIGUSR1" in batch_log and "requeueing job" in batch_log, batch_log
    assert "restart_count=1" in batch_log, batch_log


def test_a_second_job_into_a_running_jobs_run_dir_is_refused_before_srun(cluster, tmp_path):
    """Two sbatch of one script into one run directory, one node each: the second fails in its
    config check naming the first (whose rank 0 holds <run_dir>/.lock); the first trains on."""
    run_dir, one_node = tmp_path / "run", ("--nodes=1", *SBATCH_CPU[1:])
    first, jobs = _submit(cluster, run_dir, steps=2000, sbatch=one_node), []
    jobs.append(first)
    try:
        _wait(cluster, first, run_dir, lambda: _metric_steps(run_dir), "the first metrics line", 300)
        second = _submit(cluster, run_dir, steps=2000, sbatch=one_node)
        jobs.append(second)
        info = _wait(
            cluster,
            second,
            run_dir,
            lambda: (lambda i: i if i.get("JobState") in FINAL_STATES else None)(_job(cluster, second)),
            "the end",
            240,
        )
        out = (tmp_path / f"run-slurm-{second}.out").read_text()
        assert info["JobState"] == "FAILED", out
        assert "is in use by another run" in out and f"SLURM job {first}" in out, out
        assert "running:" not in out, "the second job started its ranks"
        assert _job(cluster, first)["JobState"] == "RUNNING", _diagnostics(cluster, first, run_dir)
        steps = _metric_steps(run_dir)
        assert steps == list(range(1, len(steps) + 1)), steps
    finally:
        cluster.run("scancel", *jobs, check=False)
        deadline = time.monotonic() + 120  # the cluster free again for the next test
        while time.monotonic() < deadline and any(_job(cluster, j).get("JobState") not in FINAL_STATES for j in jobs):
            time.sleep(0.5)


def test_convert_job_then_the_sdar_recipe_job(cluster, tmp_path):
    """slurm/convert.sh writes the checkpoint the SDAR recipe loads; slurm/train_sdar_8b.sh then runs
    its own recipe (bf16, recompute, staircase, TP) scaled down by shape and length, 2 nodes x 2 tasks."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_fixtures import write_hf_checkpoint

    hf = write_hf_checkpoint(str(tmp_path / "hf_sdar"), "sdar")
    converted, convert_dir = tmp_path / "sdar-mcore", tmp_path / "convert"
    job = _submit(
        cluster,
        convert_dir,
        script="slurm/convert.sh",
        env_overrides={"STABLEDRL_MODEL": "sdar", "STABLEDRL_HF_DIR": hf, "STABLEDRL_OUT": str(converted)},
        sbatch=("--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=00:10:00"),
    )
    _wait_final(cluster, job, convert_dir, timeout=300)
    assert (converted / "stabledrl_model.json").is_file()

    run_dir = tmp_path / "sdar_run"
    scaled = (
        f"model.checkpoint={converted} parallel.tensor_parallel=2 parallel.threads=1 "
        "logging.wandb_mode=disabled logging.progress=false rollout.prompts_per_step=2 "
        "rollout.group_size=2 rollout.gen_length=8 "
        f"rollout.data_path={ROOT / 'tests/fixtures/math500_test.jsonl'} steps=1"
    )
    job = _submit(
        cluster,
        run_dir,
        script="slurm/train_sdar_8b.sh",
        env_overrides={"STABLEDRL_OVERRIDES": scaled},
        sbatch=("--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=01:00:00"),
    )
    _wait_final(cluster, job, run_dir, timeout=480)
    batch_log = (run_dir.parent / f"{run_dir.name}-slurm-{job}.out").read_text()
    assert "pre-emption lead time 1800 s (from the job script's #SBATCH --signal)" in batch_log, batch_log
    assert _metric_steps(run_dir) == [1] and _checkpoint_steps(run_dir) == [1]
    resolved = (run_dir / "logs" / job / "restart_0" / "config.yaml").read_text()
    for line in (
        "dtype: bf16",
        "recompute: true",
        "likelihood: staircase",
        "tensor_parallel: 2",
        "preemption_lead_s: 1800",
    ):
        assert line in resolved, resolved
    state = json.loads((run_dir / "checkpoints/step_00000001/train_state.json").read_text())
    assert state["world_size"] == 4 and state["tensor_parallel"] == 2


def test_bench_job_writes_its_json(cluster, tmp_path):
    run_dir = tmp_path / "bench"
    job = _submit(
        cluster,
        run_dir,
        script="slurm/bench_throughput.sh",
        env_overrides={"STABLEDRL_CONFIG": str(ROOT / "examples/configs/tiny_cpu.yaml"), "STABLEDRL_OVERRIDES": TINY},
        sbatch=("--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=00:10:00"),
    )
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
    for env, needle in (
        ({"STABLEDRL_TASK": "gsm8k"}, "STABLEDRL_CKPT"),
        ({"STABLEDRL_CKPT": "/x"}, "STABLEDRL_TASK"),
        ({"STABLEDRL_CKPT": "/x", "STABLEDRL_TASK": "gsm8k", "STABLEDRL_OVERRIDES": "steps=1"}, "STABLEDRL_OVERRIDES"),
    ):
        proc = subprocess.run(
            ["bash", "slurm/eval.sh"], cwd=ROOT, env=_eval_script_env(**env), capture_output=True, text=True, timeout=30
        )
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_eval_job_samples_across_two_nodes(cluster, tmp_path):
    """slurm/eval.sh on 2 nodes x 1 task (DP = 2): every sample of every example, and the summary."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_fixtures import write_hf_checkpoint

    hf = write_hf_checkpoint(str(tmp_path / "hf_llada"), "llada", seed=2)
    flags = [
        "--limit",
        "3",
        "--gen-length",
        "4",
        "--steps",
        "4",
        "--block-length",
        "4",
        "--n",
        "2",
        "--temperature",
        "1.0",
        "--k",
        "1,2",
        "--batch-size",
        "2",
        "--threads",
        "1",
    ]
    run_dir, out = tmp_path / "eval_run", tmp_path / "eval" / "sudoku.jsonl"
    job = _submit(
        cluster,
        run_dir,
        script="slurm/eval.sh",
        env_overrides={"STABLEDRL_CKPT": hf, "STABLEDRL_TASK": "sudoku"},
        sbatch=("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=00:10:00"),
        script_args=(*flags, "--out", str(out)),
    )
    _wait_final(cluster, job, run_dir, timeout=300)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads(out.with_name("sudoku.summary.json").read_text())
    assert len(records) == 3 and all(len(r["samples"]) == 2 for r in records) and "pass@2" in summary
    assert "stabledrl_mcore.cli eval" in (run_dir / "logs" / job / "restart_0" / "command.txt").read_text()


def test_submit_refuses_missing_files_before_anything_is_queued(tmp_path):
    """slurm/submit.sh checks at submit time (no cluster needed: it fails before sbatch)."""
    env = dict(os.environ, STABLEDRL_ENV_SETUP="missing_setup.sh")
    proc = subprocess.run(
        [str(ROOT / "slurm/submit.sh"), "--nodes=2", "train_llada_8b.sh"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc
    assert proc.stderr.strip() == (
        f"slurm/submit.sh: error: STABLEDRL_ENV_SETUP=missing_setup.sh is not a file "
        f"(relative paths are relative to {tmp_path})"
    )
    proc = subprocess.run(
        [str(ROOT / "slurm/submit.sh"), "--nodes=2", "no_such_job.sh"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "name a job script" in proc.stderr and "train_llada_8b.sh" in proc.stderr


# Stand-ins for SLURM's commands, for a job script run by bash outside any cluster: scontrol knows
# two nodes; srun runs a one-task step (the config check) with SLURM_NTASKS=1, as a real srun sets
# it for the step. The ranks' step is recorded and, standing in for ranks that ran the loop to its
# end, leaves this attempt's FINISHED record; with SRUN_STANDIN_RANKS=run it runs as one rank instead,
# with SRUN_STANDIN_RANKS=exit0 it stands in for ranks that all exit 0 without finishing (no record).
SCONTROL_STANDIN = """#!/bin/bash
case "$1 $2" in
    "show hostnames") printf 'n1\\nn2\\n' ;;
    "show node") echo "NodeName=$3 NodeAddr=127.0.0.1" ;;
    *) exit 1 ;;
esac
"""
SRUN_STANDIN = """#!/bin/bash
one_task=""
while [[ "$1" == -* ]]; do [[ "$1" == --ntasks=1 ]] && one_task=1; echo -n "$1 " >>"$SRUN_STUB_LOG"; shift; done
args="$*"; echo "| ${args//$'\\n'/ }" >>"$SRUN_STUB_LOG"
if [[ -n "$one_task" ]]; then SLURM_NTASKS=1 SLURM_NPROCS=1 exec "$@"; fi
if [[ "${SRUN_STANDIN_RANKS:-}" == run ]]; then SLURM_NTASKS=1 SLURM_NPROCS=1 SLURM_PROCID=0 SLURM_LOCALID=0 exec "$@"; fi
if [[ "${SRUN_STANDIN_RANKS:-}" == exit0 ]]; then exit 0; fi
printf '{"exit_status": 0, "slurm_job_id": "%s", "slurm_restart_count": "%s"}\\n' "$SLURM_JOB_ID" \\
    "${SLURM_RESTART_COUNT:-0}" >"$STABLEDRL_RUN_DIR/FINISHED"
"""


def _run_with_standins(tmp_path, script: str, *script_args: str, **env_extra):
    """bash ``script`` (with ``script_args``) outside any cluster with the stand-in srun/scontrol;
    returns the process."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL_STANDIN), ("srun", SRUN_STANDIN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = _eval_script_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SRUN_STUB_LOG=str(tmp_path / "srun.log"),
        SLURM_SUBMIT_DIR=str(ROOT),
        STABLEDRL_PYTHON=sys.executable,
        **env_extra,
    )
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH"):
        env.pop(name, None)
    return subprocess.run(
        ["bash", str(ROOT / script), *script_args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_pipelined_recipe_job_checks_the_whole_jobs_layout_in_a_container(tmp_path):
    """slurm/train_llada_8b.sh with the TP=4 x PP=2 recipe on 2 nodes x 8 tasks, in a container: the
    batch shell's config check (one srun task, where SLURM_NTASKS is 1) is given the job's 16 ranks
    and passes (DP 2); the ranks' srun gets the recipe. No cluster: SLURM's commands are stand-ins."""
    run_dir = tmp_path / "run"
    recipe = ROOT / "examples/configs/llada_8b_stabledrl_tp4pp2.yaml"
    proc = _run_with_standins(  # no 8B checkpoint here: a random init has the preset's shape
        tmp_path,
        TRAIN_SCRIPT,
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="n[1-2]",
        SLURM_NNODES="2",
        SLURM_NTASKS="16",
        STABLEDRL_CONFIG=str(recipe),
        STABLEDRL_OVERRIDES="model.checkpoint=null",
        STABLEDRL_RUN_DIR=str(run_dir),
        STABLEDRL_CONTAINER="/images/x.sqsh",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = (run_dir / "logs/4242/restart_0/config.yaml").read_text()
    assert "  tensor_parallel: 4\n  pipeline_parallel: 2\n" in resolved, resolved
    assert "; world 16, data-parallel 2;" in resolved.splitlines()[-1], resolved.splitlines()[-1]
    check, ranks = (tmp_path / "srun.log").read_text().splitlines()
    assert "--ntasks=1" in check and "--print-config --nproc 16" in check, check
    assert "--container-image=/images/x.sqsh" in ranks and f"--config {recipe}" in ranks, ranks


def test_moe_recipe_job_fits_its_default_node(tmp_path):
    """slurm/train_sdar_30b_a3b.sh as its #SBATCH header asks (1 node x 8 tasks): the batch shell
    checks its own recipe (SDAR-30B-A3B, EP=8, TP=1) for the job's 8 ranks (DP 8) and the ranks'
    srun gets that recipe. No cluster: SLURM's commands are stand-ins."""
    script = "slurm/train_sdar_30b_a3b.sh"
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", (ROOT / script).read_text(), re.M))
    assert (header["nodes"], header["ntasks-per-node"], header["gpus-per-node"]) == ("1", "8", "8"), header
    run_dir, recipe = tmp_path / "run", ROOT / "examples/configs/sdar_30b_a3b_stabledrl.yaml"
    data = ROOT / "tests/fixtures/math500_test.jsonl"  # no 30B checkpoint here: a random init has its shape
    proc = _run_with_standins(
        tmp_path,
        script,
        SLURM_JOB_ID="4343",
        SLURM_JOB_NODELIST="n1",
        SLURM_NNODES="1",
        SLURM_NTASKS="8",
        STABLEDRL_RUN_DIR=str(run_dir),
        STABLEDRL_OVERRIDES=f"model.checkpoint=null rollout.data_path={data}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = (run_dir / "logs/4343/restart_0/config.yaml").read_text()
    for line in (
        "  preset: sdar-30b-a3b\n",
        "  tensor_parallel: 1\n  pipeline_parallel: 1\n  expert_parallel: 8\n",
        "  likelihood: staircase\n",
        "  dtype: bf16\n",
        "  recompute: true\n",
        "  distributed: true\n",
        "preemption_lead_s: 1800",
    ):
        assert line in resolved, (line, resolved)
    assert "; world 8, data-parallel 8;" in resolved.splitlines()[-1], resolved.splitlines()[-1]
    (ranks,) = (tmp_path / "srun.log").read_text().splitlines()  # the check ran in the batch shell (no container)
    assert f"--config {recipe}" in ranks and "--resume auto" in ranks and "--print-config" not in ranks, ranks


EXIT_ZERO_REWARD = """
import os


def reward(completion, reference):
    os._exit(0)  # every rank leaves with status 0 mid-run, past every Python-level check
"""


@pytest.mark.parametrize("exits_early", [True, False])
def test_ranks_that_all_exit_0_before_the_end_fail_the_job(tmp_path, exits_early):
    """srun's status is 0 when every rank exits 0, also by ``os._exit(0)`` in a reward function
    (which no in-process check sees): the job script then requires this attempt's
    ``<run_dir>/FINISHED`` and exits 1 without it; a run that finished exits 0 (rank 0 wrote it)."""
    (tmp_path / "exit_zero_reward.py").write_text(EXIT_ZERO_REWARD)
    run_dir = tmp_path / "run"
    reward = (
        [f"rollout.reward_fn={tmp_path / 'exit_zero_reward.py'}:reward", "rollout.reward_isolation=thread"]
        if exits_early
        else []
    )
    proc = _run_with_standins(
        tmp_path,
        TRAIN_SCRIPT,
        SLURM_JOB_ID="4444",
        SLURM_JOB_NODELIST="n1",
        SLURM_NNODES="1",
        SLURM_NTASKS="1",
        SRUN_STANDIN_RANKS="run",
        STABLEDRL_DEVICE="cpu",
        STABLEDRL_CONFIG=str(ROOT / "examples/configs/tiny_cpu.yaml"),
        STABLEDRL_OVERRIDES=" ".join([TINY, "steps=1", *reward]),
        STABLEDRL_RUN_DIR=str(run_dir),
    )
    if exits_early:
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "FINISHED of this attempt is missing" in proc.stderr and "os._exit(0)" in proc.stderr, proc.stderr
        assert not (run_dir / "FINISHED").exists()
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        record = json.loads((run_dir / "FINISHED").read_text())
        assert (record["exit_status"], record["slurm_job_id"], record["slurm_restart_count"]) == (0, "4444", "0")


def test_a_requeue_does_not_take_the_earlier_attempts_finished_for_its_own(tmp_path):
    """Restart 1 of job 4444 finds restart 0's FINISHED in the run directory; its ranks all exit 0
    without finishing (no record of their own): the job exits 1 naming the missing marker instead
    of believing the run finished. The same restart whose ranks write its own record exits 0."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = {"exit_status": 0, "slurm_job_id": "4444", "slurm_restart_count": "0"}
    (run_dir / "FINISHED").write_text(json.dumps(earlier) + "\n")
    env = dict(
        SLURM_JOB_ID="4444",
        SLURM_RESTART_COUNT="1",
        SLURM_JOB_NODELIST="n1",
        SLURM_NNODES="1",
        SLURM_NTASKS="1",
        STABLEDRL_DEVICE="cpu",
        STABLEDRL_CONFIG=str(ROOT / "examples/configs/tiny_cpu.yaml"),
        STABLEDRL_OVERRIDES=TINY,
        STABLEDRL_RUN_DIR=str(run_dir),
    )
    for attempt in ("requeue", "finishes"):
        (tmp_path / attempt).mkdir()
    proc = _run_with_standins(tmp_path / "requeue", TRAIN_SCRIPT, SRUN_STANDIN_RANKS="exit0", **env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "FINISHED of this attempt is missing" in proc.stderr, proc.stderr[-3000:]
    proc = _run_with_standins(tmp_path / "finishes", TRAIN_SCRIPT, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((run_dir / "FINISHED").read_text())
    assert (record["slurm_job_id"], record["slurm_restart_count"]) == ("4444", "1"), record


def test_a_requeued_eval_job_resumes_the_rows_its_first_attempt_kept(tmp_path, monkeypatch):
    """slurm/eval.sh on a requeue (SLURM_RESTART_COUNT=1) passes --resume: the first attempt's kept
    rows are not decoded again and the results file is an uninterrupted run's; a first attempt does
    not. No cluster: SLURM's commands are stand-ins, the ranks one process."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_fixtures import write_hf_checkpoint

    from stabledrl_mcore.cli.app import main
    from stabledrl_mcore.evaluation import distributed

    hf = write_hf_checkpoint(str(tmp_path / "hf_llada"), "llada", seed=2)
    flags = ["--limit", "3", "--gen-length", "4", "--steps", "4", "--block-length", "4", "--batch-size", "1"]
    argv = ["eval", "--ckpt", hf, "--task", "sudoku", *flags, "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "full.jsonl")]) == 0
    out = tmp_path / "eval" / "sudoku.jsonl"
    real, calls = distributed.generate, []

    def stopped(*args, **kwargs):  # the first attempt is killed in its second batch
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(distributed, "generate", stopped)
    assert main([*argv, "--out", str(out)]) == 130  # a Ctrl-C: one line, the finished batch kept
    monkeypatch.undo()
    proc = _run_with_standins(
        tmp_path,
        "slurm/eval.sh",
        *flags,
        "--out",
        str(out),
        SLURM_JOB_ID="77",
        SLURM_JOB_NODELIST="n1",
        SLURM_NNODES="1",
        SLURM_NTASKS="1",
        SLURM_RESTART_COUNT="1",
        SRUN_STANDIN_RANKS="run",
        STABLEDRL_DEVICE="cpu",
        STABLEDRL_CKPT=hf,
        STABLEDRL_TASK="sudoku",
        STABLEDRL_RUN_DIR=str(tmp_path / "eval_run"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming" in proc.stdout and "1 row(s) kept" in proc.stdout, proc.stdout
    assert out.read_text() == (tmp_path / "full.jsonl").read_text()
    (ranks,) = (tmp_path / "srun.log").read_text().splitlines()  # the ranks' step (the check ran here)
    assert ranks.endswith(f"--out {out} --resume"), ranks
