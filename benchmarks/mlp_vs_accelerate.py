#!/usr/bin/env python3
"""The MLP workload side by side, in one run on one machine: accelerate-rs's `mlp` example under
`accelerate-launch` against the same model in PyTorch with Hugging Face Accelerate under torchrun
(gloo, one thread per process, as torchrun sets). CPU, AdamW, 60 optimizer steps per run.

    cargo build --release -p accelerate-launch -p accelerate-examples --bins --examples
    python3 benchmarks/mlp_vs_accelerate.py        # needs torch and accelerate (pip install)

Configurations (processes, per-rank batch, K) run in interleaved rounds; the median of each is
reported, in samples per second over all ranks.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEASE = ROOT / "target" / "release"
CONFIGS = [(1, 64, 1), (1, 32, 1), (1, 32, 4), (2, 32, 1), (2, 32, 4), (2, 8, 4)]


def samples_per_s(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    m = re.search(r"samples/s=([\d.]+)", out.stdout)
    if out.returncode != 0 or not m:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    return float(m.group(1))


def ours(n, b, k, steps):
    return samples_per_s([
        str(RELEASE / "accelerate-launch"), "--cpu", "--num-processes", str(n), "--quiet",
        str(RELEASE / "examples" / "mlp"),
        "--batch-size", str(b), "--grad-accum", str(k), "--max-steps", str(steps),
    ])


def theirs(n, b, k, steps):
    return samples_per_s([
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
        "--master-port", "29517", str(ROOT / "benchmarks" / "torch_mlp.py"),
        "--batch-size", str(b), "--grad-accum", str(k), "--max-steps", str(steps),
    ])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "mlp_vs_accelerate.json")
    args = ap.parse_args()
    results = {c: {"ours": [], "pytorch+accelerate": []} for c in CONFIGS}
    for r in range(args.rounds):
        for c in CONFIGS:
            results[c]["ours"].append(ours(*c, args.steps))
            results[c]["pytorch+accelerate"].append(theirs(*c, args.steps))
            print(f"round {r + 1}: {c}: ours {results[c]['ours'][-1]:.0f}, "
                  f"pytorch+accelerate {results[c]['pytorch+accelerate'][-1]:.0f}", flush=True)
    print("\n| processes | batch per rank | K | ours samples/s | PyTorch + Accelerate samples/s | ours / theirs |")
    print("|---:|---:|---:|---:|---:|---:|")
    table = []
    for (n, b, k), r in results.items():
        a, t = statistics.median(r["ours"]), statistics.median(r["pytorch+accelerate"])
        table.append({"processes": n, "batch": b, "k": k, "ours": a, "theirs": t})
        print(f"| {n} | {b} | {k} | {a:,.0f} | {t:,.0f} | {a / t:.2f} |")
    args.out.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
