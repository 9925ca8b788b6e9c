"""Writes tests/fixtures/param_groups/: what PyTorch's optimizers compute with two parameter groups
under a LambdaLR schedule, so the Rust optimizers are compared with an independent implementation.

Three parameters, split as Hugging Face Trainer splits a transformer's: "l1.weight" in the group with
weight decay (group 0), "l1.bias" and "norm.weight" in the group without (group 1). Each optimizer
takes STEPS steps on seeded gradients; the schedule is transformers' linear warm-up then decay
(warmup 2, total 5), applied by torch.optim.lr_scheduler.LambdaLR, which scales each group's own
initial rate. Everything is float64.

  groups.json             the groups' hyper-parameters and members, the schedule, the steps
  param_groups.safetensors
      init.<name>                  the initial value of every parameter
      grad.<step>.<name>           the gradient given at step <step> (0-based)
      sgd.<step>.<name>            the parameter after SGD step <step>
      adamw.<step>.<name>          the parameter after AdamW step <step>

Usage (from the repository root): python3 tests/python/make_param_groups_fixture.py [OUT_DIR]
Needs torch and safetensors.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

STEPS = 4
WARMUP, TOTAL = 2, 5
SHAPES = {"l1.weight": (3, 4), "l1.bias": (3,), "norm.weight": (4,)}
GROUPS = [["l1.weight"], ["l1.bias", "norm.weight"]]
SGD = [
    {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01, "nesterov": True},
    {"lr": 0.05, "momentum": 0.5, "dampening": 0.1, "weight_decay": 0.0, "nesterov": False},
]
ADAMW = [
    {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1},
    {"lr": 0.03, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.0},
]


def factor(step: int) -> float:
    """transformers' get_linear_schedule_with_warmup."""
    if step < WARMUP:
        return step / max(1, WARMUP)
    return max(0.0, (TOTAL - step) / max(1, TOTAL - WARMUP))


def run(make, init, grads, prefix, out):
    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    groups = [dict(cfg, params=[params[n] for n in members]) for members, cfg in make()]
    opt = groups[0].pop("opt")(groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    for step in range(STEPS):
        for n, p in params.items():
            p.grad = grads[step][n].clone()
        opt.step()
        sched.step()
        for n, p in params.items():
            out[f"{prefix}.{step}.{n}"] = p.detach().clone()


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/param_groups"
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(14)
    init = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}
    grads = [
        {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}
        for _ in range(STEPS)
    ]
    out = {f"init.{n}": t for n, t in init.items()}
    for step, g in enumerate(grads):
        out.update({f"grad.{step}.{n}": t for n, t in g.items()})

    def sgd():
        cfgs = [dict(c) for c in SGD]
        cfgs[0]["opt"] = lambda groups: torch.optim.SGD(groups, foreach=False)
        return list(zip(GROUPS, cfgs))

    def adamw():
        cfgs = [dict(c, betas=tuple(c["betas"])) for c in ADAMW]
        cfgs[0]["opt"] = lambda groups: torch.optim.AdamW(groups, foreach=False)
        return list(zip(GROUPS, cfgs))

    run(sgd, init, grads, "sgd", out)
    run(adamw, init, grads, "adamw", out)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, "param_groups.safetensors"))
    meta = {
        "steps": STEPS,
        "schedule": {"kind": "linear_warmup_decay", "warmup_steps": WARMUP, "total_steps": TOTAL},
        "groups": GROUPS,
        "sgd": SGD,
        "adamw": ADAMW,
        "torch": torch.__version__,
    }
    with open(os.path.join(out_dir, "groups.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
