#!/usr/bin/env python3
"""The `llama` example's workload in PyTorch with Hugging Face Accelerate: transformers'
`LlamaForCausalLM` built from a `LlamaConfig` of the same size (RMSNorm, rotary embeddings, SwiGLU
MLP, grouped-query attention, untied head; transformers' default attention implementation, 'sdpa')
trained on Shakespeare's sonnets (examples/data/sonnets.txt), one character per token, cut into
rows of `context` tokens, with `labels = input_ids` (Hugging Face's shifted causal-LM loss).

Under accumulation the loss is item-weighted as ours: summed over the shifted tokens and divided
by the token count of the whole accumulation window over all ranks (transformers'
`num_items_in_batch`), so N ranks x K x B rows train as one batch of N*K*B. AdamW, lr 3e-3,
`accelerator.accumulate`. Run under torchrun, e.g.

    torchrun --nproc-per-node 2 benchmarks/torch_llama.py --batch-size 16 --grad-accum 4

Prints `samples/s=... tokens/s=... final_loss=...` like `examples/llama`: all ranks' rows and
tokens read (context per row, as ours counts them; the loss averages over context - 1 per row, the
shifted labels) over the wall time of the training loop,
timed from just before the first batch (no warm-up left out); the final loss is the last step's
loss per token of the global batch.
"""

import argparse
import contextlib
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

SONNETS = Path(__file__).resolve().parent.parent / "examples" / "data" / "sonnets.txt"


def windows_of(loader, k):
    """The epoch in lists of k consecutive batches, the last one possibly shorter (as ours: an
    epoch of fewer than k batches per rank, e.g. the large size on two ranks, is one short
    window)."""
    window = []
    for batch in loader:
        window.append(batch)
        if len(window) == k:
            yield window
            window = []
    if window:
        yield window


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=None,
                    help="MLP width (default: as ours, 2/3 of 4 x width rounded up to a "
                         "multiple of 8: 176 for width 64, 688 for 256)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    k = args.grad_accum
    # Windows are fetched whole (their token count comes first), and each window syncs on its
    # own last micro-step through DDP's no_sync, which is what accelerator.accumulate does
    # inside; a shorter last window of an epoch syncs too.
    acc = Accelerator(cpu=args.device == "cpu", mixed_precision=args.mixed_precision)
    text = SONNETS.read_text(encoding="utf-8")
    vocab = sorted(set(text))
    ids = {c: i for i, c in enumerate(vocab)}
    tokens = torch.tensor([ids[c] for c in text], dtype=torch.long)
    rows = tokens[: len(tokens) // args.context * args.context].view(-1, args.context)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=args.width,
        intermediate_size=args.intermediate or -(-(8 * args.width // 3) // 8) * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,  # Llama 2's, as ours for models built from flags
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    acc.print(f"data: sonnets, {len(text)} characters, vocabulary {len(vocab)}; "
              f"{rows.shape[0]} rows of {args.context} tokens; attention "
              f"{model.config._attn_implementation}")
    acc.print(f"model: {args.layers} layers, width {args.width}, {args.heads} heads, "
              f"{args.kv_heads} kv-heads, intermediate {config.intermediate_size}, "
              f"context {args.context}, {parameters} parameters")
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(rows), batch_size=args.batch_size, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, opt, loader = acc.prepare(model, opt, loader)
    world = acc.num_processes
    steps, samples, counted_tokens, last_loss = 0, 0.0, 0.0, float("nan")
    start = time.perf_counter()
    while steps < args.max_steps:
        for window in windows_of(loader, k):
            # The loss's items: the shifted labels, context - 1 per row, over all ranks.
            local = sum(ids_.shape[0] * (ids_.shape[1] - 1) for (ids_,) in window)
            window_tokens = acc.reduce(
                torch.tensor([float(local)], device=acc.device), "sum")
            read = sum(ids_.numel() for (ids_,) in window)
            loss_sum = torch.zeros((), device=acc.device)
            for i, (input_ids,) in enumerate(window):
                sync = i == len(window) - 1
                with contextlib.nullcontext() if sync else acc.no_sync(model):
                    # Summed over the row tokens, divided by the global window's tokens.
                    loss = model(input_ids=input_ids, labels=input_ids,
                                 num_items_in_batch=window_tokens[0]).loss
                    # DDP averages over ranks: undo it (K is 1 for Accelerate here).
                    acc.backward(loss * world)
                loss_sum += loss.detach().float()
            opt.step()
            opt.zero_grad()
            rows_read = sum(b[0].shape[0] for b in window)
            total = acc.reduce(torch.stack([loss_sum, torch.tensor(
                float(rows_read), device=acc.device), torch.tensor(
                float(read), device=acc.device)]), "sum")
            last_loss = total[0].item()
            samples += total[1].item()
            counted_tokens += total[2].item()
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
