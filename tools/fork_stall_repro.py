#!/usr/bin/env python
"""Many checkpoint saves in a row from ranks that run the threads a training rank runs, to catch a
forked checkpoint-write worker that stalls (issue 74), with the stack of the stalled worker.

Each of ``--nproc`` ranks (gloo, TP = nproc: every rank writes its own shards) builds ``--preset``
and, before its saves, starts what a real rank has alive:

- ``omp``: torch's OpenMP pool warmed by a matmul (``--threads`` intra-op threads), a matmul
  before every save, and a thread that keeps running matmuls (the pool busy when the rank forks);
- ``compile``: a tiny ``torch.compile`` (inductor) graph compiled and run (its compile workers);
- ``chatter``: a wandb-like thread that takes a lock, logs to stderr, prints, pickles, and imports
  modules lazily, in a loop;
- ``wandb``: an offline ``wandb.init`` logging every save (wandb's own threads and service);
- ``slowpipe``: the rank's ``sys.stdout`` is a pipe that a thread drains slowly while the chatter
  thread prints 4 KiB lines to it: that thread is inside a ``sys.stdout`` write (holding its
  lock) much of the time, as one printing to a busy log collector is.

Then it saves ``--saves`` times (:func:`stabledrl_mcore.checkpoint.writers.save_sharded`, the
writer every save uses), stopping early at ``--max-minutes``. A watchdog in every rank looks at
a save that has run for ``--stall-s``: for each write worker still alive it records
``/proc/PID/{status,wchan,stack}``, each thread's kernel wait channel, ``py-spy dump --native``
and ``gdb``'s backtrace of every thread under ``--out`` (the write limit is ``--stall-s`` + 120 s,
so the worker is still there), and ``py-spy dump`` of the rank itself; then the rank exits (status
3, its workers die with it) and the run ends. Prints one JSON line: saves done, save times, stalls
and where their evidence is; exit status 1 after a stall or an error.

    python tools/fork_stall_repro.py --saves 300 --max-minutes 20 --out /tmp/stall
    python tools/fork_stall_repro.py --stressors omp,chatter --saves 50    # fewer threads
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
_KEEP = {}
"""The slow pipe's stream, kept until the end (its finalizer flushes it)."""
STRESSORS = ("omp", "compile", "chatter", "wandb", "slowpipe")


def _tool(argv, timeout=90):
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{argv[0]}: {type(err).__name__}: {err}\n"


def _read(path):
    try:
        with open(path) as handle:
            return handle.read()
    except OSError as err:
        return f"({err})"


def capture(pid, path):
    """Write what the kernel, py-spy and gdb say about process ``pid`` to ``path``."""
    parts = [f"pid {pid}\n", "== status\n", _read(f"/proc/{pid}/status")]
    parts += ["\n== wchan\n", _read(f"/proc/{pid}/wchan"), "\n== kernel stack\n", _read(f"/proc/{pid}/stack")]
    for tid in sorted(os.listdir(f"/proc/{pid}/task")) if os.path.isdir(f"/proc/{pid}/task") else []:
        stat = _read(f"/proc/{pid}/task/{tid}/stat").split()
        parts.append(f"\n== thread {tid} state {stat[2] if len(stat) > 2 else '?'} ")
        parts.append(f"wchan {_read(f'/proc/{pid}/task/{tid}/wchan')}\n{_read(f'/proc/{pid}/task/{tid}/stack')}")
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    parts += ["\n== py-spy dump --native\n", _tool([spy, "dump", "--native", "--pid", str(pid)])]
    gdb = ["gdb", "-p", str(pid), "-batch", "-ex", "info threads", "-ex", "thread apply all bt 30"]
    parts += ["\n== gdb\n", _tool(gdb)]
    with open(path, "w") as handle:
        handle.write("".join(parts))


def _start_stressors(names, threads, out, rank, stop):
    import torch

    if "omp" in names:
        torch.set_num_threads(threads)
        a = torch.randn(256, 256)
        (a @ a).sum().item()

        def matmuls():
            x = torch.randn(192, 192)
            while not stop.is_set():
                (x @ x).sum()
                time.sleep(0.001)

        threading.Thread(target=matmuls, daemon=True, name="matmuls").start()
    if "compile" in names:

        def tiny(x):
            return torch.nn.functional.gelu(x * 2.0 + 1.0).sum()

        compiled = torch.compile(tiny, backend="inductor")
        compiled(torch.randn(64)).item()
    if "slowpipe" in names:
        drained, fed = os.pipe()

        def drain():  # slowly while the saves run, then at once until the end
            while os.read(drained, 1 << 14):
                time.sleep(0 if stop.is_set() else 0.01)

        threading.Thread(target=drain, daemon=True, name="drain").start()
        sys.stdout = _KEEP["stdout"] = open(fed, "w")
    if "chatter" in names:
        import logging
        import pickle
        import random

        log = logging.getLogger("wandb_like")
        handler = logging.StreamHandler(sys.stderr)
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
        lazy = ["csv", "decimal", "fractions", "statistics", "difflib", "email.mime.text", "xml.dom.minidom"]
        lazy += ["http.cookies", "sqlite3", "ftplib", "imaplib", "mailbox", "plistlib", "tomllib", "zoneinfo"]
        lock = threading.Lock()

        def chatter():
            step = 0
            while not stop.is_set():
                with lock:
                    blob = pickle.dumps({"step": step, "values": list(range(2000))})
                    log.info("wandb-like rank %d step %d %d bytes", rank, step, len(blob))
                    print(f"rank {rank} chatter {step} " + "." * (4096 if "slowpipe" in names else 0), flush=True)
                if lazy and random.random() < 0.05:
                    __import__(lazy.pop())
                step += 1
                time.sleep(random.random() * 0.002)

        threading.Thread(target=chatter, daemon=True, name="chatter").start()
    if "wandb" in names:
        import wandb

        return wandb.init(mode="offline", dir=out, project="fork-stall", name=f"rank{rank}", reinit=True)
    return None


def _rank(opts):
    import psutil
    import torch

    from stabledrl_mcore.checkpoint.writers import save_sharded
    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(opts["nproc"], 1, backend="gloo")
    rank = torch.distributed.get_rank()
    model = build_model(get_preset(opts["preset"]), device="cpu")
    stop = threading.Event()
    run = _start_stressors(opts["stressors"], opts["threads"], opts["out"], rank, stop)
    me = psutil.Process()
    my_cmdline = me.cmdline()
    current = {"save": None, "started": None, "captured": False}
    stalls = []

    def watchdog():
        while not stop.is_set():
            time.sleep(1.0)
            started, save = current["started"], current["save"]
            if started is None or current["captured"] or time.monotonic() - started < opts["stall_s"]:
                continue
            current["captured"] = True
            for child in me.children():
                try:
                    if child.cmdline() != my_cmdline:  # an inductor or wandb helper, not a forked writer
                        continue
                except psutil.Error:
                    continue
                path = os.path.join(opts["out"], f"stall-rank{rank}-save{save}-pid{child.pid}.txt")
                capture(child.pid, path)
                stalls.append({"save": save, "pid": child.pid, "evidence": path})
            path = os.path.join(opts["out"], f"stall-rank{rank}-save{save}-rank.txt")
            with open(path, "w") as handle:  # where the rank itself waits
                handle.write(
                    _tool([os.path.join(os.path.dirname(sys.executable), "py-spy"), "dump", "--pid", str(me.pid)])
                )
            if stalls:  # (a rank waiting on another's stalled save has none: it waits to be stopped)
                _record(opts["out"], rank, times, errors, stalls)
                os._exit(3)  # the run ends here (this rank's workers die with it)

    times, errors = [], []
    threading.Thread(target=watchdog, daemon=True, name="watchdog").start()
    deadline = opts["deadline"]
    scratch = tempfile.mkdtemp(prefix=f"stall-r{rank}-", dir=opts["out"])
    for save in range(opts["saves"]):
        go = torch.tensor([1 if time.time() < deadline else 0])
        torch.distributed.all_reduce(go, op=torch.distributed.ReduceOp.MIN)
        if not int(go):
            break
        if "omp" in opts["stressors"]:
            a = torch.randn(256, 256)
            (a @ a).sum().item()
        directory = os.path.join(opts["out"], f"save_{save:04d}")
        if rank == 0:
            os.makedirs(directory, exist_ok=True)
        torch.distributed.barrier()
        current.update(save=save, started=time.monotonic(), captured=False)
        try:
            save_sharded(model.sharded_state_dict(), directory, timeout_s=opts["stall_s"] + 120)
        except Exception as err:  # noqa: BLE001 - recorded, then the loop stops
            errors.append(f"save {save}: {type(err).__name__}: {err}")
        times.append(time.monotonic() - current["started"])
        current.update(started=None)
        if run is not None:
            run.log({"save": save, "seconds": times[-1]})
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
        failed = torch.tensor([1 if errors else 0])
        torch.distributed.all_reduce(failed)
        if int(failed):
            break
    stop.set()
    time.sleep(0.2)
    sys.stdout = sys.__stdout__
    shutil.rmtree(scratch, ignore_errors=True)
    if run is not None:
        run.finish()
    _record(opts["out"], rank, times, errors, stalls)


def _record(out, rank, times, errors, stalls):
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump({"rank": rank, "times": times, "errors": errors, "stalls": stalls}, handle)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--preset", default="llada-tiny")
    parser.add_argument("--saves", type=int, default=300)
    parser.add_argument("--max-minutes", type=float, default=20.0, help="no save starts after this")
    parser.add_argument("--stall-s", type=float, default=30.0, help="a save this long is a stall: capture it")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op (OpenMP) threads per rank")
    parser.add_argument("--stressors", default=",".join(STRESSORS), help=f"comma list of {', '.join(STRESSORS)}")
    parser.add_argument("--out", default=None, help="where saves and evidence go (default: a temp dir)")
    args = parser.parse_args(argv)
    from stabledrl_mcore.parallel.launch import WorkerFailed, spawn

    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="fork-stall-"))
    os.makedirs(out, exist_ok=True)
    stressors = [s for s in args.stressors.split(",") if s]
    unknown = sorted(set(stressors) - set(STRESSORS))
    if unknown:
        parser.error(f"unknown stressor(s) {', '.join(unknown)}; choose from {', '.join(STRESSORS)}")
    opts = dict(vars(args), out=out, stressors=stressors, deadline=time.time() + 60 * args.max_minutes)
    started = time.monotonic()
    failure = None
    try:
        spawn(_rank, args.nproc, (opts,), timeout=60 * args.max_minutes + args.stall_s + 600, threads=args.threads)
    except WorkerFailed as err:
        failure = str(err)
    records = []
    for rank in range(args.nproc):
        path = os.path.join(out, f"rank{rank}.json")
        records.append(json.load(open(path)) if os.path.exists(path) else {"rank": rank, "missing": True})
    times = [t for r in records for t in r.get("times", [])]
    print(
        json.dumps(
            {
                "saves": min((len(r["times"]) for r in records if "times" in r), default=0),
                "wall_s": round(time.monotonic() - started, 1),
                "save_s_mean": round(sum(times) / len(times), 3) if times else None,
                "save_s_max": round(max(times), 3) if times else None,
                "stalls": [s for r in records for s in r.get("stalls", [])],
                "errors": [e for r in records for e in r.get("errors", [])],
                "failure": failure,
                "stressors": stressors,
                "out": out,
            }
        )
    )
    return 1 if failure or any(r.get("stalls") or r.get("errors") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
