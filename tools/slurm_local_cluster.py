"""Start and stop a throw-away SLURM cluster on this one machine (two emulated nodes).

Everything lives under one directory: ``slurm.conf``, state, spool, logs and
pid files. munged runs as user ``munge`` on its default socket (reused when one
already answers); then ``slurmctld`` and one ``slurmd -N <node>`` per emulated
node, all as root with no systemd and no cgroups. Daemons are stopped by the
PIDs in their pid files, never by name, and only the ones started here.

From Python (tests)::

    with LocalSlurmCluster(tmp_dir) as cluster:
        subprocess.run(["sbatch", ...], env=cluster.env())

From a shell::

    python tools/slurm_local_cluster.py up --dir /tmp/slurm   # prints export SLURM_CONF=...
    python tools/slurm_local_cluster.py down --dir /tmp/slurm

Needs root and Debian's ``slurm-wlm`` and ``munge`` (``tools/ensure_slurm.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
MUNGE_KEY = Path("/etc/munge/munge.key")
SBIN = ("/usr/sbin", "/sbin")


class ClusterError(RuntimeError):
    """The local cluster could not be started (the message says why)."""


def _free_ports(count: int) -> List[int]:
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def _which(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))
    if not path:
        raise ClusterError(f"{name} not found: install slurm-wlm and munge (tools/ensure_slurm.sh)")
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited already
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _read_pid(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stop_pid(pid: int, program: str, timeout: float = 15.0) -> None:
    """SIGTERM ``pid`` if it still runs ``program``; SIGKILL after ``timeout`` seconds."""
    if not _pid_alive(pid) or program not in _cmdline(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


def munge_works() -> bool:
    """True when a munged answers on the default socket."""
    if not MUNGE_SOCKET.exists():
        return False
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10, check=True).stdout
        subprocess.run(["unmunge"], input=cred, capture_output=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


class LocalSlurmCluster:
    """A SLURM cluster of ``nodes`` emulated nodes on this host, rooted at ``root``."""

    def __init__(
        self,
        root,
        nodes: Sequence[str] = ("n1", "n2"),
        cpus_per_node: int = 2,
        partition: str = "debug",
        timeout: float = 60.0,
    ):
        self.root = Path(root).resolve()
        self.nodes = list(nodes)
        self.cpus_per_node = cpus_per_node
        self.partition = partition
        self.timeout = timeout
        self.conf = self.root / "slurm.conf"
        self.state_file = self.root / "cluster.json"

    # ---- environment for clients (sbatch, squeue, scontrol, ...)
    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN])
        return env

    def run(self, *cmd: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster; returns the completed process."""
        return subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True, check=check, timeout=timeout)

    # ---- configuration
    def write_config(self) -> None:
        host = socket.gethostname().split(".")[0]
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        for sub in ("state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        lines = [
            f"ClusterName=local{os.getpid()}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            # cred_expire also sets how long a requeued job waits before it may start
            # again (default 120 s); 10 s keeps the pre-emption test short.
            "AuthInfo=cred_expire=10",
            "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "JobRequeue=1",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2",  # pick up requeued/pending jobs quickly
            "MinJobAge=600",
            "KillWait=10",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd.%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd.%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        for node, port in zip(self.nodes, node_ports):
            lines.append(
                f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={host} Port={port} "
                f"CPUs={self.cpus_per_node} State=UNKNOWN"
            )
        lines.append(
            f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")

    # ---- daemons
    def _ensure_munge(self) -> Optional[int]:
        """Start munged unless one answers; return the PID when this call started it."""
        if munge_works():
            return None
        try:
            munge_user = pwd.getpwnam("munge")
        except KeyError as err:
            raise ClusterError("user 'munge' missing: install munge (tools/ensure_slurm.sh)") from err
        if not MUNGE_KEY.exists():
            MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
            MUNGE_KEY.write_bytes(os.urandom(1024))
            os.chown(MUNGE_KEY, munge_user.pw_uid, munge_user.pw_gid)
            MUNGE_KEY.chmod(0o400)
        MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
        os.chown(MUNGE_SOCKET.parent, munge_user.pw_uid, munge_user.pw_gid)
        MUNGE_SOCKET.parent.chmod(0o755)
        pid_file = MUNGE_SOCKET.parent / "munged.pid"
        # --force: a stale socket left by a killed munged must not block the start.
        subprocess.run(
            ["runuser", "-u", "munge", "--", _which("munged"), "--force", f"--pid-file={pid_file}"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        self._wait(munge_works, "munged to answer")
        return _read_pid(pid_file)

    def start(self) -> "LocalSlurmCluster":
        if os.geteuid() != 0:
            raise ClusterError("a local SLURM cluster needs root (slurmd runs jobs as any user)")
        self.root.mkdir(parents=True, exist_ok=True)
        self.write_config()
        state = {"munged_pid": None, "nodes": self.nodes}
        try:
            state["munged_pid"] = self._ensure_munge()
            self.state_file.write_text(json.dumps(state))
            subprocess.run([_which("slurmctld"), "-f", str(self.conf)], check=True, capture_output=True, timeout=30)
            for node in self.nodes:
                subprocess.run(
                    [_which("slurmd"), "-f", str(self.conf), "-N", node], check=True, capture_output=True, timeout=30
                )
            self._wait(self._nodes_idle, "nodes to be idle")
        except BaseException:
            self.stop()
            raise
        return self

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(node) == "idle" for node in self.nodes)

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not ready():
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"timed out after {self.timeout:.0f} s waiting for {what}; logs: {self.root / 'log'}\n{self.logs()}"
                )
            time.sleep(0.2)

    def logs(self, tail: int = 30) -> str:
        """The last lines of every daemon log (for failure messages)."""
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"== {log.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel any job, then stop the daemons started here, by PID (idempotent)."""
        run_dir = self.root / "run"
        ctld_pid = _read_pid(run_dir / "slurmctld.pid")
        if ctld_pid and _pid_alive(ctld_pid):
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.monotonic() + 20
                while self.run("squeue", "-h", "-o", "%i", check=False).stdout.split() and time.monotonic() < deadline:
                    time.sleep(0.5)
        # Read every pid file first: slurmd removes its own on exit.
        daemons = [(_read_pid(run_dir / f"slurmd.{node}.pid"), "slurmd") for node in self._state_nodes()]
        daemons.append((ctld_pid, "slurmctld"))
        for pid, program in daemons:
            if pid:
                _stop_pid(pid, program)
        munged_pid = self._state().get("munged_pid")
        if munged_pid:
            _stop_pid(int(munged_pid), "munged")
        if self.state_file.exists():
            self.state_file.write_text(json.dumps({**self._state(), "munged_pid": None, "stopped": True}))

    def _state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def _state_nodes(self) -> List[str]:
        return list(self._state().get("nodes") or self.nodes)

    def __enter__(self) -> "LocalSlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("--dir", required=True, help="directory for config, state, logs, pid files")
    parser.add_argument("--nodes", default="n1,n2", help="emulated node names (default n1,n2)")
    parser.add_argument("--cpus-per-node", type=int, default=2)
    args = parser.parse_args(argv)
    cluster = LocalSlurmCluster(args.dir, nodes=args.nodes.split(","), cpus_per_node=args.cpus_per_node)
    if args.action == "down":
        cluster.stop()
        return 0
    try:
        cluster.start()
    except (ClusterError, subprocess.SubprocessError, OSError) as err:
        detail = getattr(err, "stderr", None)
        print(
            f"slurm_local_cluster: {err}{': ' + detail.decode(errors='replace') if isinstance(detail, bytes) else ''}",
            file=sys.stderr,
        )
        return 1
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
