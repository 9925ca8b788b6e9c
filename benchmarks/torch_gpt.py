#!/usr/bin/env python3
"""The `gpt` example's workload in PyTorch with Hugging Face Accelerate: the same decoder-only
transformer (token and learned position embeddings; pre-LayerNorm blocks of causal multi-head
self-attention, c_attn/c_proj with biases, and a GELU (tanh) MLP of 4x width; a final LayerNorm;
an untied head without bias; GPT-2's initialization) trained on the same data: Shakespeare's
sonnets (examples/data/sonnets.txt), one character per token, windows every context/2 characters
whose lengths are drawn between context/2 and context, each batch padded to its longest window.

The loss is item-weighted as ours: the cross-entropy summed over the real tokens of a micro-batch,
divided by the real-token count of the whole accumulation window over all ranks (one all-reduce
per window, as our `set_window_items`), so N ranks x K x B windows train as one batch. AdamW,
lr 3e-3, `accelerator.accumulate`. Run under torchrun, e.g.

    torchrun --nproc-per-node 2 benchmarks/torch_gpt.py --batch-size 16 --grad-accum 4

Prints `samples/s=... tokens/s=... final_loss=...` like `examples/gpt`: all ranks' windows and
real (non-padding) target tokens over the wall time of the training loop, timed as ours from just
before the first batch (no warm-up left out), data loading included; the final loss is the last
step's loss per token of the global batch.
"""

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from torch import nn

SONNETS = Path(__file__).resolve().parent.parent / "examples" / "data" / "sonnets.txt"


class Block(nn.Module):
    """Pre-LayerNorm block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, width, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def attn(self, x):
        b, t, w = x.shape
        hd = w // self.heads
        q, k, v = self.c_attn(x).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # written out, as our candle model computes it
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = scores.float().masked_fill(mask, float("-inf")).softmax(-1).to(q.dtype) @ v
        return self.attn_proj(y.transpose(1, 2).reshape(b, t, w))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    """GPT-2's architecture at toy size, as examples/src/gpt/model.rs."""

    def __init__(self, vocab, context, width, heads, layers, attention):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        # GPT-2: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 layers)), biases 0, LN 1/0.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_"):
                nn.init.ones_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * max(layers, 1)))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)).float()


class Windows(torch.utils.data.Dataset):
    """Windows every context/2 tokens, lengths seeded in ceil(context/2)..=context (as ours)."""

    def __init__(self, tokens, context, seed):
        stride, min_len = max(context // 2, 1), max((context + 1) // 2, 1)
        count = (len(tokens) - context - 1) // stride + 1
        lens = np.random.default_rng(seed).integers(min_len, context + 1, size=count)
        self.tokens = tokens
        self.windows = [(i * stride, int(n)) for i, n in enumerate(lens)]

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        start, n = self.windows[i]
        return self.tokens[start:start + n + 1]


def collate(items):
    """Inputs, targets and mask [B, longest], padded with token 0 (mask 0) at the end of a row."""
    width = max(len(w) - 1 for w in items)
    inputs = torch.zeros(len(items), width, dtype=torch.long)
    targets = torch.zeros_like(inputs)
    mask = torch.zeros(len(items), width)
    for r, w in enumerate(items):
        n = len(w) - 1
        inputs[r, :n], targets[r, :n], mask[r, :n] = w[:-1], w[1:], 1.0
    return inputs, targets, mask


def windows_of(loader, k):
    """The epoch in lists of k consecutive batches; a shorter last list is dropped (see main)."""
    window = []
    for batch in loader:
        window.append(batch)
        if len(window) == k:
            yield window
            window = []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", choices=["sdpa", "manual"], default="sdpa",
                    help="sdpa: F.scaled_dot_product_attention(is_causal=True), as nanoGPT; "
                         "manual: masked softmax written out, as our model")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    k = args.grad_accum
    # sync_with_dataloader=False: a window's K batches are fetched before its first backward (to
    # count its tokens), so the loader's end-of-epoch flag would come too early; the epoch's
    # incomplete last window is dropped instead (ours trains it as a shorter window).
    acc = Accelerator(
        cpu=args.device == "cpu",
        mixed_precision=args.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=k, sync_with_dataloader=False),
    )
    text = SONNETS.read_text(encoding="utf-8")
    vocab = sorted(set(text))
    ids = {c: i for i, c in enumerate(vocab)}
    tokens = torch.tensor([ids[c] for c in text], dtype=torch.long)
    dataset = Windows(tokens, args.context, args.seed)
    model = Gpt(len(vocab), args.context, args.width, args.heads, args.layers, args.attention)
    parameters = sum(p.numel() for p in model.parameters())
    acc.print(f"data: sonnets, {len(text)} characters, vocabulary {len(vocab)}; "
              f"{len(dataset)} windows; attention {args.attention}")
    acc.print(f"model: {args.layers} layers, width {args.width}, {args.heads} heads, "
              f"context {args.context}, {parameters} parameters")
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, opt, loader = acc.prepare(model, opt, loader)
    world = acc.num_processes
    steps, samples, counted_tokens, last_loss = 0, 0.0, 0.0, float("nan")
    start = time.perf_counter()
    while steps < args.max_steps:
        for window in windows_of(loader, k):
            local = sum(float(m.sum()) for _, _, m in window)
            window_tokens = acc.reduce(torch.tensor([local], device=acc.device), "sum").item()
            loss_sum = torch.zeros((), device=acc.device)
            for inputs, targets, mask in window:
                with acc.accumulate(model):
                    logits = model(inputs)
                    token_loss = F.cross_entropy(
                        logits.flatten(0, 1), targets.flatten(), reduction="none")
                    summed = (token_loss * mask.flatten()).sum()
                    # accelerate divides by K and DDP averages over ranks: undo both, so the
                    # gradient is that of the summed loss over the global window's tokens.
                    acc.backward(summed * (world * k / window_tokens))
                    opt.step()
                    opt.zero_grad()
                    loss_sum += summed.detach()
            # The loss per token of the global batch, read every step as ours does.
            window_samples = sum(inputs.shape[0] for inputs, _, _ in window)
            total = acc.reduce(torch.stack([
                loss_sum.float(), torch.tensor(float(window_samples), device=acc.device)]), "sum")
            last_loss = total[0].item() / window_tokens
            samples += total[1].item()
            counted_tokens += window_tokens
            steps += 1
            if steps >= args.max_steps:
                break
    if acc.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    acc.print(f"samples/s={samples / wall:.1f} tokens/s={counted_tokens / wall:.0f} "
              f"final_loss={last_loss:.6f} wall={wall:.2f}s steps={steps} "
              f"mixed_precision={args.mixed_precision}")


if __name__ == "__main__":
    main()
