#!/usr/bin/env python
"""Peak memory and wall time of checkpoint conversion on a synthetic >= 1B-parameter LLaDA.

Writes an upstream-format LLaDA checkpoint (OLMo names, ``config.json``,
safetensors shards + index) of random bf16 weights under ``--workdir``, then
runs ``tools/convert_checkpoint.py hf-to-mcore`` and ``mcore-to-hf`` each in a
subprocess while polling the process tree with psutil. Reports, per direction:

- ``peak_rss``: the converting process's own peak resident set (its
  ``ru_maxrss``; includes the memory-mapped source pages it touched; the
  synthetic checkpoint is made in another child so that no inherited
  high-water mark inflates it);
- ``peak_tree_pss``: peak proportional set size summed over the converter and
  its helper processes (dist_checkpointing's forked writers share pages, so
  PSS is what the machine actually holds);

against the budget ``1.3 x weights on disk + 1 GiB``, then checks that the
round trip is bit-identical (tensor by tensor) and deletes everything unless
``--keep``. Prints one JSON object.

    python tools/bench_convert.py                      # ~1.34B params, 2.7 GB bf16
    python tools/bench_convert.py --layers 32 --hidden 4096 --ffn 12288   # LLaDA-8B shape
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
GiB = 1024**3
# Runs the converter as __main__ and reports its own peak RSS (ru_maxrss of that process only).
WRAPPER = (
    "import resource, runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\nfinally:\n"
    "    print('BENCH_MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\n"
)


def make_checkpoint(path: str, args) -> dict:
    import torch

    from stabledrl_mcore.convert.engine import MappingEngine
    from stabledrl_mcore.convert.hf_config import dllm_to_hf_config
    from stabledrl_mcore.convert.mappings import table_for
    from stabledrl_mcore.convert.safetensors_io import SafetensorsWriter
    from stabledrl_mcore.models import get_preset

    cfg = get_preset(
        "llada-8b",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        num_query_groups=args.heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        **(
            {}
            if args.vocab > 126336
            else dict(  # keep the special ids in range
                mask_token_id=args.vocab - 1, eos_token_id=1, pad_token_id=1, bos_token_id=0
            )
        ),
    )
    os.makedirs(path)
    plan = MappingEngine(table_for("llada"), cfg).hf_plan(torch.bfloat16)
    writer = SafetensorsWriter(path, plan, max_shard_bytes=args.shard_gb * GiB)
    gen = torch.Generator().manual_seed(0)
    for name, shape, dtype in plan:
        writer.write(name, torch.randn(shape, generator=gen).mul_(0.02).to(dtype))
    writer.close()
    with open(os.path.join(path, "config.json"), "w") as handle:
        json.dump(dllm_to_hf_config(cfg, dtype="bfloat16"), handle, indent=2)
    return {"params": sum(torch.Size(s).numel() for _, s, _ in plan), "disk_bytes": writer.total_bytes}


def run_measured(argv) -> dict:
    """Run a conversion subprocess; sample the tree's RSS/PSS every 0.2 s."""
    import psutil

    start = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, os.path.join(ROOT, "tools", "convert_checkpoint.py"), *argv, "--no-progress"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    peak = {"tree_pss": 0, "tree_rss": 0, "main_rss": 0}
    handle = psutil.Process(proc.pid)

    def sample():
        while proc.poll() is None:
            try:
                procs = [handle] + handle.children(recursive=True)
                pss = rss = 0
                for p in procs:
                    try:
                        info = p.memory_full_info()
                        pss, rss = pss + info.pss, rss + info.rss
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        pass
                peak["tree_pss"] = max(peak["tree_pss"], pss)
                peak["tree_rss"] = max(peak["tree_rss"], rss)
                peak["main_rss"] = max(peak["main_rss"], handle.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    output, _ = proc.communicate()
    thread.join()
    if proc.returncode != 0:
        raise RuntimeError(f"conversion failed ({proc.returncode}):\n{output[-3000:]}")
    own = [int(line.split()[1]) * 1024 for line in output.splitlines() if line.startswith("BENCH_MAXRSS_KB")]
    return {
        "wall_s": round(time.time() - start, 1),
        "peak_rss": max(own + [peak["main_rss"]]),
        "peak_rss_sampled": peak["main_rss"],
        "peak_tree_pss": peak["tree_pss"],
        "peak_tree_rss_sum": peak["tree_rss"],
    }


def same_tensors(a: str, b: str) -> bool:
    import torch

    from stabledrl_mcore.convert.safetensors_io import SafetensorsReader

    ra, rb = SafetensorsReader(a), SafetensorsReader(b)
    if sorted(ra.keys()) != sorted(rb.keys()):
        return False
    return all(torch.equal(ra.get(k), rb.get(k)) for k in ra.keys())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=126464)
    parser.add_argument("--shard-gb", type=float, default=1.0, help="source shard size")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--keep", action="store_true", help="keep the files")
    parser.add_argument("--make-only", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_only:  # child mode: write the synthetic checkpoint, print its size
        print(json.dumps(make_checkpoint(args.make_only, args)))
        return

    work = tempfile.mkdtemp(prefix="bench_convert-", dir=args.workdir)
    try:
        src, ckpt, back = (os.path.join(work, n) for n in ("hf", "mcore", "hf_back"))
        t0 = time.time()
        # In a child: Linux carries ru_maxrss over fork/exec, so this process must stay small.
        made = subprocess.run(
            [sys.executable, __file__, "--make-only", src] + sys.argv[1:], check=True, capture_output=True, text=True
        )
        report = json.loads(made.stdout.strip().splitlines()[-1])
        report["make_s"] = round(time.time() - t0, 1)
        budget = 1.3 * report["disk_bytes"] + GiB
        report["budget_bytes"] = int(budget)
        for direction, argv in (
            ("hf_to_mcore", ["hf-to-mcore", "--model", "llada", "--hf-dir", src, "--out", ckpt, "--dtype", "bf16"]),
            ("mcore_to_hf", ["mcore-to-hf", "--ckpt", ckpt, "--out", back]),
        ):
            result = run_measured(argv)
            result["peak_rss_over_disk"] = round(result["peak_rss"] / report["disk_bytes"], 3)
            result["within_budget"] = max(result["peak_rss"], result["peak_tree_pss"]) < budget
            report[direction] = result
        report["round_trip_bit_identical"] = same_tensors(src, back)
        report["workdir"] = work if args.keep else None
        print(json.dumps(report, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
