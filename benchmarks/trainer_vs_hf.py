#!/usr/bin/env python3
"""The article's table on the CPU, both Trainers side by side: Hugging Face's `Trainer` and ours
(`target/release/bench_trainer`), each at batch 4 and at batch 1 x gradient accumulation 4 on the
`gpt` workload (benchmarks/torch_gpt.py's model, the same as examples/src/gpt; every window full,
so both configurations compute on the same tokens). Every run is a process of its own, rounds
interleave the four configurations, and the medians are printed: peak resident memory (the
process's maximum RSS) and `train_samples_per_second` (samples of all optimizer steps over the
wall time of `train()`, as Hugging Face reports it).

    cargo build --release -p accelerate-benchmarks
    python3 benchmarks/trainer_vs_hf.py [--rounds 3] [--steps 20]

Needs torch, transformers and accelerate. Both sides use every core (torch's and rayon's
defaults); set OMP_NUM_THREADS and RAYON_NUM_THREADS to change that.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES_PER_STEP = 4
# The article's figures: Hugging Face's Trainer on one GPU (GPU memory MB, samples/s).
ARTICLE = {4: (14949.0, 8.86), 1: (8681.0, 7.75)}


def hf_child(args):
    """One Hugging Face Trainer run; prints a JSON report."""
    import torch
    from torch import nn
    from transformers import Trainer, TrainingArguments

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from torch_gpt import Gpt, SONNETS

    text = SONNETS.read_text()
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    windows = args.steps * SAMPLES_PER_STEP
    stride = max(args.context // 2, 1)
    needed = (windows - 1) * stride + args.context + 1
    tokens = ids.repeat(needed // len(ids) + 1)[:needed]

    class FullWindows(torch.utils.data.Dataset):
        def __len__(self):
            return windows

        def __getitem__(self, i):
            w = tokens[i * stride:i * stride + args.context + 1]
            return {"input_ids": w[:-1], "labels": w[1:]}

    class LmLoss(nn.Module):
        """The gpt model with the mean token cross-entropy as its loss, as the Trainer wants."""

        def __init__(self):
            super().__init__()
            self.gpt = Gpt(len(vocab), args.context, args.width, args.heads, args.layers, "sdpa")

        def forward(self, input_ids, labels):
            logits = self.gpt(input_ids)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return {"loss": loss}

    torch.manual_seed(0)
    batch = args.child_batch
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=SAMPLES_PER_STEP // batch,
            learning_rate=3e-4,
            max_steps=args.steps,
            save_strategy="no",
            report_to="none",
            logging_steps=args.steps,
            disable_tqdm=True,
            use_cpu=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(model=LmLoss(), args=training, train_dataset=FullWindows())
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"samples_per_second": windows / wall, "peak_kib": peak_kib}))


def run(cmd, what):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"{what} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def ours(args, batch):
    cmd = [str(args.bench_trainer), "--layers", str(args.layers), "--width", str(args.width),
           "--heads", str(args.heads), "--context", str(args.context), "--steps",
           str(args.steps), "--child-batch", str(batch)]
    out = run(cmd, f"bench_trainer --child-batch {batch}")
    values = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return float(values["peak_hwm_kib"]), float(values["samples_per_second"])


def theirs(args, batch):
    cmd = [sys.executable, __file__, "--child-batch", str(batch), "--layers", str(args.layers),
           "--width", str(args.width), "--heads", str(args.heads), "--context",
           str(args.context), "--steps", str(args.steps)]
    report = json.loads(run(cmd, f"Hugging Face Trainer, batch {batch}").strip().splitlines()[-1])
    return float(report["peak_kib"]), float(report["samples_per_second"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bench-trainer", type=Path,
                    default=ROOT / "target" / "release" / "bench_trainer")
    ap.add_argument("--child-batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_batch is not None:
        return hf_child(args)
    if not args.bench_trainer.exists():
        sys.exit(f"{args.bench_trainer} is missing: cargo build --release -p accelerate-benchmarks")
    results = {(side, b): [] for side in ("ours", "hf") for b in (4, 1)}
    for r in range(args.rounds):
        for b in (4, 1):
            results[("ours", b)].append(ours(args, b))
            results[("hf", b)].append(theirs(args, b))
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    print(f"gpt: {args.layers} layers, width {args.width}, {args.heads} heads, context "
          f"{args.context} (every window full), {args.steps} optimizer steps of "
          f"{SAMPLES_PER_STEP} windows, {args.rounds} rounds (medians), {os.cpu_count()} cores")
    print(f"{'configuration':<14} {'ours MiB':>9} {'HF MiB':>8} {'ours samples/s':>15} "
          f"{'HF samples/s':>13} {'speed ours/HF':>14}   {'article MB':>10} {'samples/s':>9}")
    for b in (4, 1):
        name = "batch 4" if b == 4 else "batch 1 x 4"
        o_mem = statistics.median(x[0] for x in results[("ours", b)]) / 1024
        o_rate = statistics.median(x[1] for x in results[("ours", b)])
        h_mem = statistics.median(x[0] for x in results[("hf", b)]) / 1024
        h_rate = statistics.median(x[1] for x in results[("hf", b)])
        a_mem, a_rate = ARTICLE[b]
        print(f"{name:<14} {o_mem:>9.0f} {h_mem:>8.0f} {o_rate:>15.2f} {h_rate:>13.2f} "
              f"{o_rate / h_rate:>13.2f}x   {a_mem:>10.0f} {a_rate:>9.2f}")


if __name__ == "__main__":
    main()
