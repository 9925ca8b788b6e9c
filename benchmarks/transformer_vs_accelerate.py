#!/usr/bin/env python3
"""The transformer workloads side by side, in one run on one machine: accelerate-rs's `gpt` and
`llama` examples under `accelerate-launch` against the same models in PyTorch with Hugging Face
Accelerate under torchrun (benchmarks/torch_gpt.py: the gpt model written out as an nn.Module;
benchmarks/torch_llama.py: transformers' LlamaForCausalLM, attention 'sdpa'). AdamW, lr 3e-3.

    cargo build --release -p accelerate-launch -p accelerate-examples --bins --examples
    python3 benchmarks/transformer_vs_accelerate.py   # needs torch, accelerate, transformers

Configurations: workload (gpt, llama) x processes (1, 2) x K (1, 4) x size
  default: 2 layers, width 64, 4 heads, context 64, batch 16 per rank
  large:   4 layers, width 256, 4 heads, context 256, batch 32 per rank
(llama: 2 kv-heads, MLP width 2/3 of 4 x width rounded up to 8: 176 and 688). A run takes
--micro-steps-default (48) or --micro-steps-large (2) micro-steps per rank whatever K, so
steps = micro-steps / K, but at least one optimizer step (large, K=4: one step of 4 micro-steps).
A large micro-step takes seconds, so the first step's one-time costs weigh little; the step counts
keep the full run (3 rounds, both workloads) near 15 minutes on two quiet cores. Each round
runs every configuration, ours then theirs; the median over rounds is reported, in windows (rows) per second over all ranks, the ratio ours / theirs of those,
and tokens per second. Results go to benchmarks/transformer_vs_accelerate.json.

One compute thread per process on both sides: RAYON_NUM_THREADS=1 for ours, OMP_NUM_THREADS=1 for
theirs (torchrun sets it for several processes; it is set here for one process too).

llama is skipped, saying so, while target/release/examples/llama (or --bin-dir's) does not exist.

GPU (not run on a machine without one; written so that a session with a GPU runs it unchanged):

    scripts/gpu-build.sh build    # binaries in target/cuda/release
    python3 benchmarks/transformer_vs_accelerate.py --device cuda --processes 1
    python3 benchmarks/transformer_vs_accelerate.py --device cuda --mixed-precision bf16 --processes 1

Ours runs `accelerate-launch --num-gpus N [--mixed-precision bf16]` from --bin-dir (default
target/cuda/release under --device cuda); theirs runs torchrun with the same N, Accelerate picks
NCCL and `mixed_precision='bf16'`. N processes need N GPUs. The GPU step counts are larger
(defaults 2000 and 400 micro-steps) so that a run is not all start-up.
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "default": {"layers": 2, "width": 64, "heads": 4, "context": 64, "batch": 16},
    "large": {"layers": 4, "width": 256, "heads": 4, "context": 256, "batch": 32},
}
KV_HEADS = 2
MICRO_STEPS = {"cpu": {"default": 48, "large": 2}, "cuda": {"default": 2000, "large": 400}}
KS = (1, 4)


def intermediate(width):
    """Our llama's default MLP width: 2/3 of 4 x width rounded up to a multiple of 8."""
    return -(-(8 * width // 3) // 8) * 8


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_flags(workload, size, k, steps):
    s = SIZES[size]
    flags = ["--layers", s["layers"], "--width", s["width"], "--heads", s["heads"],
             "--context", s["context"], "--batch-size", s["batch"], "--grad-accum", k,
             "--max-steps", steps, "--lr", "3e-3"]
    if workload == "llama":
        flags += ["--kv-heads", KV_HEADS, "--intermediate", intermediate(s["width"])]
    return [str(f) for f in flags]


def measure(cmd, env):
    """Runs `cmd`; returns samples/s, tokens/s, the parameter count and the wall time."""
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, **env})
    wall = time.perf_counter() - t0
    rate = re.search(r"samples/s=([\d.]+) tokens/s=([\d.]+)", out.stdout)
    params = re.search(r"model: .*?(\d+) parameters", out.stdout)
    if out.returncode != 0 or not rate:
        sys.exit(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stdout}\n{out.stderr}")
    return {"samples_per_s": float(rate.group(1)), "tokens_per_s": float(rate.group(2)),
            "parameters": int(params.group(1)) if params else None, "wall_s": wall}


def ours(args, workload, n, k, size, steps):
    launch = [str(args.bin_dir / "accelerate-launch"), "--quiet", "--main-process-port", "0"]
    launch += ["--cpu", "--num-processes", str(n)] if args.device == "cpu" else \
        ["--num-gpus", str(n)]
    if args.mixed_precision != "no":
        launch += ["--mixed-precision", args.mixed_precision]
    # --epochs: far more than the steps need, so that --max-steps alone ends the run.
    cmd = launch + [str(args.bin_dir / "examples" / workload), "--epochs", "1000000"]
    return measure(cmd + model_flags(workload, size, k, steps), {"RAYON_NUM_THREADS": "1"})


def theirs(args, workload, n, k, size, steps):
    cmd = [args.python, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
           "--master-port", str(free_port()), str(ROOT / "benchmarks" / f"torch_{workload}.py"),
           "--device", args.device, "--mixed-precision", args.mixed_precision]
    return measure(cmd + model_flags(workload, size, k, steps), {"OMP_NUM_THREADS": "1"})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default="gpt,llama", help="comma-separated: gpt, llama")
    ap.add_argument("--sizes", default="default,large", help="comma-separated: default, large")
    ap.add_argument("--processes", default="1,2", help="comma-separated process counts")
    ap.add_argument("--grad-accum", default="1,4", help="comma-separated K values")
    ap.add_argument("--micro-steps-default", type=int, help="micro-steps per rank, default size")
    ap.add_argument("--micro-steps-large", type=int, help="micro-steps per rank, large size")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--mixed-precision", choices=["no", "bf16"], default="no")
    ap.add_argument("--bin-dir", type=Path,
                    help="where accelerate-launch and examples/ are (default target/release, or "
                         "target/cuda/release with --device cuda: scripts/gpu-build.sh build)")
    ap.add_argument("--python", default=sys.executable,
                    help="Python with torch, accelerate and transformers (default: this one)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "transformer_vs_accelerate.json")
    args = ap.parse_args()
    if args.bin_dir is None:
        args.bin_dir = ROOT / "target" / ("release" if args.device == "cpu" else "cuda/release")
    micro = dict(MICRO_STEPS[args.device])
    micro["default"] = args.micro_steps_default or micro["default"]
    micro["large"] = args.micro_steps_large or micro["large"]

    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in ("gpt", "llama"):
            sys.exit(f"--workloads: unknown workload {w!r}; give gpt, llama or both")
        binary = args.bin_dir / "examples" / w
        if not binary.exists():
            if w == "gpt":
                sys.exit(f"{binary} does not exist: build it first (cargo build --release "
                         "-p accelerate-launch -p accelerate-examples --bins --examples)")
            print(f"skipping llama: {binary} does not exist (build examples/llama first)",
                  flush=True)
    workloads = [w for w in workloads if (args.bin_dir / "examples" / w).exists()]
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:
        if s not in SIZES:
            sys.exit(f"--sizes: unknown size {s!r}; give default, large or both")
    configs = [(w, n, k, s) for w in workloads for s in sizes
               for n in map(int, args.processes.split(",")) for k in map(int, args.grad_accum.split(","))]
    if not configs:
        sys.exit("nothing to run")

    results = {c: {"ours": [], "theirs": []} for c in configs}
    params = {}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for c in configs:
            w, n, k, s = c
            steps = max(1, micro[s] // k)
            a, t = ours(args, w, n, k, s, steps), theirs(args, w, n, k, s, steps)
            results[c]["ours"].append(a)
            results[c]["theirs"].append(t)
            params[(w, s)] = (a["parameters"], t["parameters"])
            print(f"round {r + 1}: {w} {s} processes={n} K={k} steps={steps}: "
                  f"ours {a['samples_per_s']:.1f} samples/s ({a['wall_s']:.0f} s), "
                  f"pytorch+accelerate {t['samples_per_s']:.1f} samples/s ({t['wall_s']:.0f} s)",
                  flush=True)
    total_wall = time.perf_counter() - t0
    for (w, s), (a, t) in params.items():
        note = "" if a == t else "  <- NOT THE SAME SIZE"
        print(f"parameters, {w} {s}: ours {a}, pytorch+accelerate {t}{note}")

    print(f"\n{args.device}, mixed precision {args.mixed_precision}, {args.rounds} round(s), "
          f"medians; samples = windows (gpt) or rows (llama) over all ranks\n")
    print("| workload | size | processes | K | ours samples/s | PyTorch + Accelerate samples/s "
          "| ours / theirs | ours tokens/s | theirs tokens/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    table = []
    for (w, n, k, s), r in results.items():
        med = {side: {key: statistics.median(x[key] for x in runs)
                      for key in ("samples_per_s", "tokens_per_s")} for side, runs in r.items()}
        a, t = med["ours"], med["theirs"]
        ratio = a["samples_per_s"] / t["samples_per_s"]
        table.append({"workload": w, "size": s, **SIZES[s], "processes": n, "k": k,
                      "steps": max(1, micro[s] // k), "device": args.device,
                      "mixed_precision": args.mixed_precision,
                      "ours": a, "theirs": t, "ratio": ratio,
                      "parameters": params[(w, s)][0],
                      "runs": {side: [x["samples_per_s"] for x in runs] for side, runs in r.items()}})
        print(f"| {w} | {s} | {n} | {k} | {a['samples_per_s']:,.1f} | {t['samples_per_s']:,.1f} "
              f"| {ratio:.2f} | {a['tokens_per_s']:,.0f} | {t['tokens_per_s']:,.0f} |")
    print(f"\nwall time of the whole run: {total_wall:.0f} s")
    tmp = args.out.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
