#!/usr/bin/env python3
"""PyTorch's side of `bench_step`: the same training configurations in PyTorch with Hugging Face
Accelerate, printing the same JSON fields (one line, an object whose "bench" is "step") and a
readable line on the main process.

- gpt2: a plain nn.Module of exactly the `gpt` example's architecture (token and learned
  position embeddings; pre-LayerNorm blocks with a packed c_attn with bias,
  F.scaled_dot_product_attention(is_causal=True), c_proj with bias, a GELU (tanh) MLP of 4 x
  width; a final LayerNorm; an untied head without bias; GPT-2's initialization).
- smollm: transformers' LlamaForCausalLM(LlamaConfig(SmolLM-135M's shape,
  tie_word_embeddings=False), attn_implementation="sdpa"), loss from labels=input_ids.

Trained with `Accelerator(mixed_precision=...)`, `prepare` (model, AdamW, data loader),
`accelerator.backward`, torch.optim.AdamW with bench_step's hyper-parameters (PyTorch's default
implementation, foreach: a handful of multi-tensor kernels per step; `--fused-adamw` takes its
fused one, a single kernel per step as ours). `--mode compile`
compiles the model through Accelerate (`dynamo_backend="inductor"`, i.e. torch.compile of the
prepared model); shapes never change, so it compiles once, in the first warm-up step, whose time
is reported as compile_s and excluded like every warm-up step.

Data, timing, the FLOPs formula and the memory figures are bench_step's (see its doc comment):
the SplitMix64 token stream of --seed cut into rows of context + 1 tokens, global batch i to rank
i mod ranks; each step ends with loss.item(); the memory in use on the GPU is the driver's
total - free (torch.cuda.mem_get_info) polled every 2 ms, and torch's own
max_memory_allocated/max_memory_reserved are reported beside it. With --profile-steps K,
torch.profiler records K steps after the timed ones; kernel launches per step and a per-kernel
table (to --profile-out) come from it.

Several ranks on one GPU (torchrun --nproc-per-node 2 on a one-GPU machine): NCCL refuses two
ranks of one host on one GPU, so each rank gets a host id of its own (NCCL_HOSTID) before the
process group starts, and DDP is told not to pin a device index (Accelerate would pass
LOCAL_RANK, which does not exist).

Several ranks are data parallel through Accelerate (DDP) by default. `--fsdp2` (gpt2, eager,
under torchrun) shards the model instead, as bench_step's `--zero-stage 3`: PyTorch's FSDP2,
`fully_shard` on each transformer block and then on the root (which takes the embeddings, the
final LayerNorm and the head, left over), with `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)` under bf16 in place of Accelerate's autocast (parameters gathered in bf16,
gradients reduce-scattered in f32 into the f32 shards); Accelerate still starts the process
group and prepares the optimizer and the data loader, but not the model. The JSON line's
"sharding" says which ran: "none" (one process), "ddp" or "fsdp2".
"""

import argparse
import json
import math
import os
import resource
import socket
import sys
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

GAMMA = 0x9E3779B97F4A7C15


def splitmix64(seed, index):
    """Outputs `index` (uint64 array) of SplitMix64 seeded with `seed`, as
    accelerate_benchmarks::synthetic::splitmix64 (uint64 arithmetic wraps in NumPy arrays)."""
    m1, m2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    z = np.uint64(seed) + (index + np.uint64(1)) * np.uint64(GAMMA)
    z = (z ^ (z >> np.uint64(30))) * m1
    z = (z ^ (z >> np.uint64(27))) * m2
    return z ^ (z >> np.uint64(31))


def synthetic_tokens(seed, start, count, vocab):
    """Tokens start..start+count of the stream of `seed`, ids in 0..vocab."""
    index = np.arange(start, start + count, dtype=np.uint64)
    return (splitmix64(seed, index) % np.uint64(vocab)).astype(np.int64)


class Block(nn.Module):
    """Pre-LayerNorm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)) (GPT-2's names)."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.ModuleDict(dict(c_attn=nn.Linear(width, 3 * width),
                                       c_proj=nn.Linear(width, width)))
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(width, 4 * width),
                                      c_proj=nn.Linear(4 * width, width)))

    def forward(self, x):
        b, t, w = x.shape
        hd = w // self.heads
        q, k, v = self.attn.c_attn(self.ln_1(x)).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(b, t, w))
        h = F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp.c_proj(h)


class Gpt(nn.Module):
    """The `gpt` example's model (examples/src/gpt/model.rs)."""

    def __init__(self, vocab, context, width, heads, layers):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        # GPT-2: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 layers)), biases 0, LN 1/0.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_"):
                nn.init.ones_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * max(layers, 1)))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)).float()


class GptLoss(nn.Module):
    """GPT-2 and its mean token cross-entropy over a row batch [B, context + 1]."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, rows):
        logits = self.gpt(rows[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())


class LlamaLoss(nn.Module):
    """LlamaForCausalLM and its causal-LM loss with labels = input_ids."""

    def __init__(self, llama):
        super().__init__()
        self.llama = llama

    def forward(self, rows):
        return self.llama(input_ids=rows, labels=rows).loss


def shape_of(args):
    """The model's size: the preset of --model with the overrides applied (bench_step's rules)."""
    for flag in ("layers", "width", "heads", "kv_heads", "intermediate", "vocab"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            sys.exit(f"error: --{flag.replace('_', '-')} must be at least 1")
    if args.model == "gpt2":
        if args.kv_heads is not None or args.intermediate is not None:
            sys.exit("error: --kv-heads and --intermediate apply to --model smollm only")
        shape = dict(vocab=args.vocab or 50257, layers=args.layers or 12,
                     width=args.width or 768, heads=args.heads or 12)
    else:
        width, heads = args.width or 576, args.heads or 9
        kv = args.kv_heads or (3 if heads % 3 == 0 else heads)
        # Llama's rule (examples/src/llama/config.rs default_intermediate): 1536 at width 576.
        intermediate = args.intermediate or -(-(2 * 4 * width // 3) // 8) * 8
        shape = dict(vocab=args.vocab or 49152, layers=args.layers or 30, width=width,
                     heads=heads, kv_heads=kv, intermediate=intermediate)
    if shape["width"] % shape["heads"]:
        sys.exit(f"error: width {shape['width']} is not divisible by heads {shape['heads']}")
    return shape


def build_model(args, shape):
    """The model wrapped with its loss, and the names of its embedding tables."""
    if args.model == "gpt2":
        gpt = Gpt(shape["vocab"], args.context, shape["width"], shape["heads"], shape["layers"])
        return GptLoss(gpt), {"gpt.wte.weight", "gpt.wpe.weight"}
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["width"],
        intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["width"] // shape["heads"],
        # SmolLM's rotary tables cover 2048 positions; rows here hold context + 1.
        max_position_embeddings=max(2048, args.context + 1),
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
        attention_dropout=0.0, initializer_range=0.02)
    llama = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    return LlamaLoss(llama), {"llama.model.embed_tokens.weight"}


def measure_peak(device, size):
    """TFLOP/s of size x size products of normal random matrices (bf16 on a GPU, f32 on the
    CPU): 3 warm-up products, then timed ones in batches of 5 until 0.5 s or 50 products."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    start, products = time.perf_counter(), 0
    while products < 50 and time.perf_counter() - start < 0.5:
        for _ in range(5):
            a @ b
        sync()
        products += 5
    seconds = time.perf_counter() - start
    return 2 * size ** 3 * products / seconds / 1e12, "f32" if device.type == "cpu" else "bf16"


class MemoryWatch:
    """The largest device memory in use (driver's total - free) since the last reset, polled
    every 2 ms on a thread, as bench_step's MemoryWatch."""

    def __init__(self, device):
        self.device, self.peak, self.stop = device, self.used_now(), False
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def used_now(self):
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _poll(self):
        while not self.stop:
            self.peak = max(self.peak, self.used_now())
            time.sleep(0.002)

    def reset(self):
        self.peak = self.used_now()

    def finish(self):
        self.stop = True
        self.thread.join()
        return max(self.peak, self.used_now())


def kernel_table(prof):
    """[(kernel name, launches, total device µs)] of the profiled steps, most time first."""
    from torch.autograd import DeviceType
    rows = []
    for e in prof.key_averages():
        if e.device_type != DeviceType.CUDA:
            continue
        if e.key.startswith("Memcpy") or e.key.startswith("Memset"):
            continue
        total = getattr(e, "self_device_time_total", None)
        if total is None:
            total = e.self_cuda_time_total
        rows.append((e.key, e.count, total))
    rows.sort(key=lambda r: -r[2])
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["gpt2", "smollm"], required=True)
    ap.add_argument("--mixed-precision", choices=["no", "bf16"], default="bf16")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=0)
    ap.add_argument("--profile-out", help="write the profiled steps' per-kernel table here")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (CPU runs)")
    ap.add_argument("--fused-adamw", action="store_true",
                    help="torch.optim.AdamW(fused=True) instead of the default (foreach)")
    ap.add_argument("--fsdp2", action="store_true",
                    help="shard the model with FSDP2's fully_shard (each block, then the root) "
                         "instead of DDP; gpt2 and --mode eager, under torchrun")
    for flag in ("layers", "width", "heads", "kv-heads", "intermediate", "vocab", "peak-size"):
        ap.add_argument(f"--{flag}", type=int)
    args = ap.parse_args()
    if min(args.batch_size, args.context, args.steps) < 1 or min(args.warmup, args.profile_steps) < 0:
        sys.exit("error: --batch-size, --context and --steps must be at least 1")
    shape = shape_of(args)
    if args.fsdp2 and (args.model != "gpt2" or args.mode != "eager"):
        sys.exit("error: --fsdp2 is wired for --model gpt2 --mode eager only (bench_step's "
                 "--zero-stage 3 rows); drop --fsdp2 or use those")
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("error: --device cuda but torch sees no GPU; use --device cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cuda and local_world > torch.cuda.device_count():
        # Several ranks per GPU: see the module docs.
        os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-rank{os.environ.get('RANK', '0')}"
        os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = "true"
    from accelerate import Accelerator
    acc = Accelerator(cpu=not cuda, mixed_precision=args.mixed_precision,
                      dynamo_backend="inductor" if args.mode == "compile" else "no")
    device, world = acc.device, acc.num_processes
    if args.fsdp2 and not torch.distributed.is_initialized():
        sys.exit("error: --fsdp2 needs a process group: run under torchrun "
                 "(python -m torch.distributed.run --nproc-per-node N ...)")
    sharding = "fsdp2" if args.fsdp2 else ("ddp" if world > 1 else "none")
    torch.manual_seed(args.seed)

    memory = MemoryWatch(device) if cuda else None
    mem_before = memory.used_now() if memory else None
    peak_size = args.peak_size or (1024 if not cuda else 8192)
    peak = measure_peak(device, peak_size) if acc.is_main_process else None
    barrier(acc)
    if memory:
        memory.reset()
        torch.cuda.reset_peak_memory_stats(device)

    model, tables = build_model(args, shape)
    n_params = sum(p.numel() for p in model.parameters())
    n_matmul = sum(p.numel() for n, p in model.named_parameters() if n not in tables)
    total_steps = args.warmup + args.steps + args.profile_steps
    rows = world * args.batch_size * total_steps
    row_len = args.context + 1
    stream = synthetic_tokens(args.seed, 0, rows * row_len, shape["vocab"])
    data = torch.from_numpy(stream.reshape(rows, row_len))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=False)
    adamw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # What AdamW runs: the fused kernel when asked; by default foreach on a GPU, a loop over the
    # parameters on the CPU (torch's own choice).
    optimizer = "fused" if args.fused_adamw else ("foreach" if cuda else "for-loop")
    if args.fsdp2:
        model = fully_shard_gpt(model, device, args.mixed_precision)
    opt = torch.optim.AdamW(model.parameters(), **adamw, **({"fused": True} if args.fused_adamw else {}))
    if args.fsdp2:
        # The model is FSDP2's; Accelerate would wrap it in DDP and autocast its forward.
        opt, loader = acc.prepare(opt, loader)
    else:
        model, opt, loader = acc.prepare(model, opt, loader)
    if len(loader) != total_steps:
        sys.exit(f"error: the prepared loader holds {len(loader)} batches, not {total_steps}")

    step_ms, final_loss, first_step_s, prof = [], float("nan"), None, None
    last = time.perf_counter()
    for i, batch in enumerate(loader):
        if i == args.warmup + args.steps and args.profile_steps:
            if cuda:
                torch.cuda.synchronize()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=activities)
            prof.start()
        loss = model(batch)
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        final_loss = loss.item()  # waits for the step's work on the device
        now = time.perf_counter()
        if i == 0:
            first_step_s = now - last
        if args.warmup <= i < args.warmup + args.steps:
            step_ms.append((now - last) * 1e3)
        last = now
    launches_per_step, table = None, None
    if prof is not None:
        prof.stop()
        table = kernel_table(prof)
        launches_per_step = sum(r[1] for r in table) / args.profile_steps if cuda else None
    if len(step_ms) != args.steps:
        sys.exit(f"error: timed {len(step_ms)} steps of the {args.steps} asked for")

    mem_peak = memory.finish() if memory else None
    framework_peak = torch.cuda.max_memory_allocated(device) if cuda else None
    framework_reserved = torch.cuda.max_memory_reserved(device) if cuda else None
    # The upper of the middle two for an even count, as bench_step's median.
    step_median = sorted(step_ms)[len(step_ms) // 2]
    step_mean = sum(step_ms) / len(step_ms)
    tokens_per_s = world * args.batch_size * args.context / (step_mean / 1e3)
    flops_per_token = 6.0 * n_matmul + 12.0 * shape["layers"] * args.context * shape["width"]
    barrier(acc)
    if not acc.is_main_process:
        finish(acc)
        return
    peak_tflops, peak_dtype = peak
    mfu = flops_per_token * tokens_per_s / (peak_tflops * 1e12)
    mib = lambda b: None if b is None else b / 2 ** 20
    if table is not None and args.profile_out:
        write_profile(args.profile_out, prof, table, args.profile_steps, cuda)
    line = {
        "bench": "step", "impl": "torch", "mode": args.mode, "model": args.model,
        "mixed_precision": args.mixed_precision, "device": args.device,
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "world_size": world, "sharding": sharding, "batch_size": args.batch_size,
        "context": args.context,
        "layers": shape["layers"], "width": shape["width"], "heads": shape["heads"],
        "vocab": shape["vocab"], "n_params": n_params, "n_params_matmul": n_matmul,
        "flops_per_token": flops_per_token, "warmup": args.warmup, "steps": args.steps,
        "profile_steps": args.profile_steps, "step_ms_median": step_median,
        "step_ms_mean": step_mean, "step_ms_min": min(step_ms), "step_ms": step_ms,
        "tokens_per_s": tokens_per_s, "peak_tflops": peak_tflops, "peak_dtype": peak_dtype,
        "peak_size": peak_size, "mfu": mfu, "mem_used_before_mib": mib(mem_before),
        "mem_used_peak_mib": mib(mem_peak), "framework_peak_mib": mib(framework_peak),
        "framework_reserved_mib": mib(framework_reserved),
        "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "final_loss": final_loss, "data_first": [int(x) for x in stream[:4]],
        "compile_s": first_step_s if args.mode == "compile" else None,
        "launches_per_step": launches_per_step,
        "wall_s": time.perf_counter() - started, "threads": torch.get_num_threads(),
        "adamw": {"lr": adamw["lr"], "betas": list(adamw["betas"]), "eps": adamw["eps"],
                  "weight_decay": adamw["weight_decay"]},
        "optimizer": optimizer,
        "versions": {"torch": torch.__version__, "accelerate": __import__("accelerate").__version__},
    }
    print(json.dumps(json_safe(line), allow_nan=False), flush=True)
    memory_text = (f"peak device memory {mib(mem_peak):.0f} MiB (torch allocated "
                   f"{mib(framework_peak):.0f})" if cuda else f"peak RSS {line['rss_peak_mib']:.0f} MiB")
    print(f"torch_step: {args.model} {args.mixed_precision} torch {args.mode} ({sharding}), "
          f"{world} rank(s) x "
          f"batch {args.batch_size} x context {args.context}: step {step_median:.2f} ms median "
          f"({step_mean:.2f} mean), {tokens_per_s:.0f} tokens/s, MFU {mfu * 100:.2f} % of "
          f"{peak_tflops:.{3 if peak_tflops < 10 else 1}f} TFLOP/s ({peak_dtype} {peak_size}^3), {memory_text}, "
          f"loss {final_loss:.4f}", flush=True)
    finish(acc)


def fully_shard_gpt(model, device, mixed_precision):
    """`model` (GptLoss, on the CPU) moved to `device`, given rank 0's weights, and sharded over
    every rank with FSDP2: `fully_shard` on each block, then on the root, which takes the
    parameters left over (the embeddings, ln_f, the head). Under bf16, parameters are gathered
    in bf16 and gradients reduce-scattered in f32 (as bench_step's stage 3: the compute dtype
    for the gather, f32 for the reduction); in f32 no policy is needed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model.to(device)
    # Rank 0's initial weights everywhere, as DDP broadcasts them: the ranks' random streams
    # differ by now (the main process alone drew the peak's matrices), and each rank keeps its
    # own shard of what it built.
    with torch.no_grad():
        for p in model.parameters():
            torch.distributed.broadcast(p, src=0)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision == "bf16" else MixedPrecisionPolicy())
    for block in model.gpt.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def json_safe(x):
    """x with every non-finite float written as "NaN", "inf" or "-inf", as bench_step writes them
    (benchmarks/src/json_float.rs): strict JSON has no such numbers, and report.py reads these
    strings back as the floats."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def barrier(acc):
    """All ranks meet. Not acc.wait_for_everyone(), which names device LOCAL_RANK to NCCL and
    so fails when ranks share a GPU."""
    if acc.num_processes > 1:
        torch.distributed.barrier()


def finish(acc):
    if acc.num_processes > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def write_profile(path, prof, table, steps, cuda):
    """The per-kernel table of the profiled steps, and torch.profiler's own."""
    with open(path, "w") as f:
        total = sum(r[2] for r in table)
        f.write(f"torch.profiler, {steps} steps: {sum(r[1] for r in table)} kernel launches, "
                f"{total / 1e3:.3f} ms of kernel time\n\n")
        f.write(f"{'kernel':<100} {'launches':>9} {'ms':>10} {'share':>7}\n")
        for name, count, us in table:
            f.write(f"{name[:100]:<100} {count:>9} {us / 1e3:>10.3f} "
                    f"{100 * us / max(total, 1e-9):>6.1f}%\n")
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        f.write("\n" + prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")


if __name__ == "__main__":
    main()
