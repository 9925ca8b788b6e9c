#!/usr/bin/env python3
"""All-reduce side by side, in one run on one machine: accelerate-rs's CPU communicator (shared
memory between ranks of one machine) against PyTorch's gloo backend, and one core's memcpy (and
one core's copy with streaming stores, the fastest single-core copy of large buffers).

    cargo build --release -p accelerate-launch -p accelerate-benchmarks --bins
    python3 benchmarks/allreduce.py            # needs torch, numpy, matplotlib (pip install)

For each world size (2, 3, 4 by default) and message size (1 KiB to 256 MiB, f32, sum) it prints
the median time and the algorithm bandwidth (size / time) of both, and writes
benchmarks/allreduce.json and benchmarks/allreduce.png (algbw against message size).

The copies are timed by our benchmark on rank 0 between its all-reduces, while the other ranks
wait, so each ratio to memcpy compares figures taken under the same conditions. Ours and gloo
alternate for --rounds rounds per world size, and each keeps its best round (the median of --iters
runs), so that a burst of other load on the machine does not decide the comparison.
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEASE = ROOT / "target" / "release"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours(world, min_kib, max_kib, iters):
    """Runs bench_allreduce (benchmarks/bench_allreduce.rs) under accelerate-launch; returns
    {bytes: (seconds, memcpy GB/s, stream copy GB/s)}."""
    cmd = [
        str(RELEASE / "accelerate-launch"), "--cpu", "--num-processes", str(world), "--quiet",
        str(RELEASE / "bench_allreduce"), "--op", "all-reduce",
        "--min-kib", str(min_kib), "--max-kib", str(max_kib), "--iters", str(iters),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout
    results = {}
    for line in out.splitlines():
        m = re.search(
            r"(\d+) (KiB|MiB)\s+all-reduce\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
            r"\s+([\d.]+)\s+([\d.]+)",
            line,
        )
        if m:
            # size, op, time ms, algbw, busbw, sent MiB, memcpy GB/s, stream GB/s
            size = int(m.group(1)) * (1024 if m.group(2) == "KiB" else 1024 * 1024)
            results[size] = (float(m.group(3)) / 1e3, float(m.group(7)), float(m.group(8)))
    if not results:
        sys.exit(f"no figures in the output of {' '.join(cmd)}:\n{out}")
    return results


def _gloo_worker(rank, world, port, sizes, iters, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = {}
    for size in sizes:
        t = torch.ones(size // 4, dtype=torch.float32)
        times = []
        for i in range(iters + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            if i > 0:
                times.append(time.perf_counter() - start)
        times.sort()
        results[size] = times[len(times) // 2]
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def gloo(world, sizes, iters):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_gloo_worker, args=(r, world, port, sizes, iters, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = queue.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    return results


def numpy_memcpy(size, iters):
    import numpy as np

    src = np.ones(size // 4, dtype=np.float32)
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(max(iters, 1)):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    times.sort()
    return size / times[len(times) // 2] / 1e9


def human(size):
    return f"{size // (1024 * 1024)} MiB" if size >= 1024 * 1024 else f"{size // 1024} KiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--min-kib", type=int, default=1)
    ap.add_argument("--max-kib", type=int, default=256 * 1024)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "allreduce")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    sizes = []
    kib = args.min_kib
    while kib <= args.max_kib:
        sizes.append(kib * 1024)
        kib *= 2

    report = {"machine": f"{os.cpu_count()} cores, {os.uname().machine}", "worlds": {}}
    for world in args.worlds:
        mine, theirs = {}, {}
        for _ in range(args.rounds):
            for size, row in ours(world, args.min_kib, args.max_kib, args.iters).items():
                if size not in mine or row[0] < mine[size][0]:
                    mine[size] = row
            for size, t in gloo(world, sizes, args.iters).items():
                theirs[size] = min(t, theirs.get(size, t))
        rows = []
        print(f"\n## {world} ranks (f32 sum; algbw = size / time; memcpy and stream copy: one core, "
              "same size, same run)")
        print("| size | ours ms | gloo ms | ours GB/s | gloo GB/s | ours/gloo | memcpy GB/s | "
              "ours/memcpy | stream GB/s | ours/stream |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for size in sizes:
            t_ours, memcpy, stream = mine[size]
            t_gloo = theirs[size]
            a_ours, a_gloo = size / t_ours / 1e9, size / t_gloo / 1e9
            rows.append({"bytes": size, "ours_s": t_ours, "gloo_s": t_gloo, "memcpy_gbps": memcpy,
                         "stream_gbps": stream})
            print(
                f"| {human(size)} | {t_ours * 1e3:.3f} | {t_gloo * 1e3:.3f} | {a_ours:.2f} | "
                f"{a_gloo:.2f} | {a_ours / a_gloo:.1f}x | {memcpy:.2f} | {a_ours / memcpy:.0%} | "
                f"{stream:.2f} | {a_ours / stream:.0%} |"
            )
        report["worlds"][world] = rows
    big = sizes[-1]
    report["numpy_memcpy_gbps_at_max"] = numpy_memcpy(big, args.iters)
    print(f"\nnumpy memcpy of {human(big)} (cross-check of the Rust figure): "
          f"{report['numpy_memcpy_gbps_at_max']:.2f} GB/s")
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {2: "tab:blue", 3: "tab:orange", 4: "tab:green"}
    for world, rows in report["worlds"].items():
        x = [r["bytes"] for r in rows]
        c = colors.get(world)
        ax.plot(x, [r["bytes"] / r["ours_s"] / 1e9 for r in rows], "-o", ms=3, color=c,
                label=f"accelerate-rs, {world} ranks")
        ax.plot(x, [r["bytes"] / r["gloo_s"] / 1e9 for r in rows], "--x", ms=3, color=c,
                label=f"PyTorch gloo, {world} ranks")
    rows = next(iter(report["worlds"].values()))
    ax.plot([r["bytes"] for r in rows], [r["memcpy_gbps"] for r in rows], ":", color="black",
            label="memcpy, one core")
    ax.plot([r["bytes"] for r in rows], [r["stream_gbps"] for r in rows], "-.", color="gray",
            label="streaming-store copy, one core")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes, f32)")
    ax.set_ylabel("algbw (GB/s) = size / time")
    ax.set_title(f"All-reduce on one machine ({report['machine']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
