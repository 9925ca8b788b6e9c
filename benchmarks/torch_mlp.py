#!/usr/bin/env python3
"""The `mlp` example's workload in PyTorch with Hugging Face Accelerate: 784 -> H -> H -> 10 with
ReLU, cross-entropy, AdamW (lr 1e-3), synthetic labels argmax(x . W). Run under torchrun, e.g.

    torchrun --nproc-per-node 2 benchmarks/torch_mlp.py --batch-size 32 --grad-accum 4

Prints `samples/s=...` (all ranks' samples over the wall time of the training loop, data loading
included), as the Rust example does, so benchmarks/mlp_vs_accelerate.py can read both.
"""

import argparse
import time

import torch
from accelerate import Accelerator
from torch import nn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--max-steps", type=int, default=60)
    args = ap.parse_args()
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=args.grad_accum)
    samples = args.batch_size * args.grad_accum * acc.num_processes * args.max_steps
    g = torch.Generator().manual_seed(0)
    x = torch.rand(samples, 784, generator=g) * 2 - 1
    w = torch.randn(784, 10, generator=g)
    y = (x @ w).argmax(dim=1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size, shuffle=True
    )
    model = nn.Sequential(
        nn.Linear(784, args.hidden), nn.ReLU(),
        nn.Linear(args.hidden, args.hidden), nn.ReLU(),
        nn.Linear(args.hidden, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = acc.prepare(model, opt, loader)
    loss_fn = nn.CrossEntropyLoss()
    steps, counted = 0, 0
    start = time.perf_counter()
    for xb, yb in loader:
        with acc.accumulate(model):
            loss = loss_fn(model(xb), yb)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        counted += xb.shape[0] * acc.num_processes
        if acc.sync_gradients:
            steps += 1
            if steps >= args.max_steps:
                break
    wall = time.perf_counter() - start
    acc.print(f"samples/s={counted / wall:.1f} final_loss={loss.item():.6f} steps={steps}")


if __name__ == "__main__":
    main()
