#!/usr/bin/env python3
"""The report of a `benchmarks/gpu/run.sh device` run: collects each run's JSON line into
results.jsonl and writes results.md (steps and their status, the benchmark table, ours/theirs
ratios, consistency checks).

    report.py record --results R --name N --rc RC --wall S --log LOG [--smi FILE]
        appends the JSON line of LOG whose "bench" is "step" (bench_step's or torch_step.py's,
        the main process's) with the run's name, exit status and wall time, and the nvidia-smi
        samples of FILE (MiB, one per line; the first is taken before the run starts)
    report.py record-ncu --results R --name N --raw RAW --steps K
        appends the totals of the ncu per-kernel summary in RAW (see ncu_summary.py), with the
        configuration of the profiled run (its JSON line, which ncu passes through)
    report.py table --results R --status STATUS_TSV --machine MACHINE_TXT --out results.md
        writes the markdown report
    report.py check --results R --status STATUS_TSV --expect-runs N --expect-statuses S,S,...
            [--expect-launches L] [--expect-loss-agreements A]
        the self-test's assertions over a finished report (see run.sh selftest)
    report.py compare --results R
        interleaved rounds of ours and PyTorch (run names NAME-roundK, see cpu_rounds.sh):
        medians over the rounds and the per-round ratios, as markdown
    report.py self-test
        the table and the checks over made-up rows with the awkward cases (a non-finite loss,
        ...), asserting what they show (run.sh selftest runs it)
"""

import argparse
import json
import math
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import ncu_summary  # noqa: E402

RANK_PREFIX = re.compile(r"^\[rank \d+\]\s*")
STEP_FIELDS = ["impl", "mode", "model", "mixed_precision", "world_size", "batch_size", "context",
               "n_params", "n_params_matmul", "flops_per_token", "step_ms_median",
               "step_ms_mean", "tokens_per_s", "peak_tflops", "mfu", "final_loss", "data_first"]
# The numbers every result line has: each is finite in a sound run.
REQUIRED_NUMBERS = ["step_ms_median", "step_ms_mean", "tokens_per_s", "peak_tflops", "mfu",
                    "final_loss"]


def step_line(log_text):
    """The last JSON object line of a run's output whose "bench" is "step", or None. Lines may
    carry accelerate-launch's `[rank N] ` prefix."""
    found = None
    for line in log_text.splitlines():
        line = RANK_PREFIX.sub("", line.strip())
        if line.startswith("{") and '"bench"' in line:
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if value.get("bench") == "step":
                found = value
    return found


def record(a):
    log = Path(a.log).read_text(errors="replace") if Path(a.log).exists() else ""
    value = step_line(log) or {"bench": "step", "error": "no result line",
                               "tail": log.splitlines()[-8:]}
    value.update(run=a.name, rc=a.rc, run_wall_s=a.wall)
    if a.smi and Path(a.smi).exists():
        samples = [float(x) for x in Path(a.smi).read_text().split() if _number(x)]
        if samples:
            value["smi_before_mib"] = samples[0]
            value["smi_peak_mib"] = max(samples)
            value["smi_samples"] = len(samples)
    with open(a.results, "a") as f:
        f.write(json.dumps(value) + "\n")


def record_ncu(a):
    raw = Path(a.raw)
    kernels = ncu_summary.parse(raw.read_text(errors="replace")) if raw.exists() else {}
    value = ncu_summary.totals(kernels, a.steps) if kernels else {
        "bench": "ncu", "error": "no per-kernel summary in the ncu output"}
    value["run"] = a.name
    # The profiled program's own JSON line (ncu passes its output through) says which
    # configuration it was, so that the table puts its launches/step beside the timed run.
    profiled = step_line(raw.read_text(errors="replace")) if raw.exists() else None
    if profiled:
        value["config"] = list(config_key(profiled))
    with open(a.results, "a") as f:
        f.write(json.dumps(value) + "\n")


def _number(x):
    try:
        float(x)
        return True
    except ValueError:
        return False


def number(x):
    """A field's value as read from a result line: the strings that bench_step and
    torch_step.py write for non-finite floats ("NaN", "inf", "-inf"; JSON has no such numbers)
    become those floats; anything else is returned as it is."""
    if isinstance(x, str) and x.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        return float(x.strip().lower().replace("infinity", "inf"))
    if isinstance(x, list):
        return [number(v) for v in x]
    return x


def normalize(row):
    """A step record with its non-finite values as floats: the strings of `number`, and None in a
    field that every result line has a number in (REQUIRED_NUMBERS: serde_json writes a
    non-finite float as null, Python's json as NaN)."""
    if row.get("bench") != "step" or "error" in row:
        return row
    row = {k: number(v) for k, v in row.items()}
    for k in REQUIRED_NUMBERS:
        if k in row and row[k] is None:
            row[k] = math.nan
    return row


def nonfinite_fields(r):
    """The fields of REQUIRED_NUMBERS in which a step record holds NaN or an infinity."""
    return [k for k in REQUIRED_NUMBERS
            if isinstance(r.get(k), float) and not math.isfinite(r[k])]


def load(path):
    rows = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            if line.strip():
                rows.append(normalize(json.loads(line)))
    return rows


def load_status(path):
    rows = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 4:
                rows.append(dict(name=parts[0], status=parts[1], rc=parts[2], seconds=parts[3],
                                 note=parts[4] if len(parts) > 4 else ""))
    return rows


def fmt(x, spec):
    """x formatted by spec; "–" for a value that is not there, "non-finite (nan)" and the like
    for a NaN or an infinity (say, the loss of a broken kernel)."""
    if x is None:
        return "–"
    if isinstance(x, float) and not math.isfinite(x):
        return f"non-finite ({x})"
    return format(x, spec)


def pct(x):
    """A fraction as a percentage (fmt's rules)."""
    if x is None or not math.isfinite(x):
        return fmt(x, "")
    return fmt(100 * x, ".1f") + " %"


def ratio(a, b):
    """a / b; NaN when either is not finite, None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b if math.isfinite(a) and math.isfinite(b) else math.nan


def config_key(r):
    return (r.get("model"), r.get("mixed_precision"), r.get("world_size"), r.get("batch_size"),
            r.get("context"), r.get("layers"), r.get("width"))


def zero_stage(r):
    """The ZeRO stage a row ran at: ours' own `zero_stage` (0 in lines from before the field);
    PyTorch's FSDP2 (`fully_shard`, parameters sharded) counts as stage 3, its DDP and a single
    process as stage 0."""
    if r.get("impl") == "ours":
        return r.get("zero_stage") or 0
    return 3 if r.get("sharding") == "fsdp2" else 0


def sharding_name(r):
    """How a row's ranks share the model: "ZeRO N" (ours), "DDP" or "FSDP2" (PyTorch), "–" for
    one process."""
    if r.get("impl") == "ours":
        return f"ZeRO {zero_stage(r)}" if r.get("world_size", 1) > 1 or zero_stage(r) else "–"
    return {"fsdp2": "FSDP2", "ddp": "DDP"}.get(r.get("sharding"),
                                                 "DDP" if r.get("world_size", 1) > 1 else "–")


def impl_name(r):
    """A row's implementation as the tables show it."""
    if r["impl"] == "ours":
        name = "ours" + (f", ZeRO {zero_stage(r)}" if zero_stage(r) else "")
    else:
        name = f"torch {r['mode']}" + (", FSDP2" if r.get("sharding") == "fsdp2" else "")
    if r.get("optimizer") == "fused":
        name += ", fused AdamW"
    return name


def in_ratios(r):
    """Whether a row is a reference of the ours/theirs ratios: PyTorch's default AdamW, and
    stage 0 (DDP); the sharded rows have their own section, the fused AdamW its own row."""
    return r.get("optimizer") != "fused" and zero_stage(r) == 0


# Losses of the same configuration at another stage (or FSDP2 against DDP) further apart than
# this fraction of the loss are flagged: the stages compute the same steps, up to float
# rounding (bf16's on a GPU) and nondeterministic kernels.
LOSS_GAP = 1e-3


def label(r):
    precision = "f32" if r["mixed_precision"] == "no" else r["mixed_precision"]
    return (f"{r['model']} ({r['layers']}x{r['width']}) {precision}, "
            f"{r['world_size']} rank(s), batch {r['batch_size']} x {r['context']}")


# The differences between the two sides that remain by design, stated under every report.
NOTES = [
    "Optimizer: ours updates every parameter of a step in one fused multi-tensor AdamW kernel "
    "(masters, state and the bf16 compute copies in one pass); PyTorch's rows use its default "
    "AdamW, foreach on a GPU (a few multi-tensor kernels per step, the bf16 copies made by "
    "autocast's casts in the next forward). The row 'torch eager, fused AdamW' "
    "(`torch_step.py --fused-adamw`, one kernel per step) shows what PyTorch's own fused "
    "kernel gives; the ratios compare with the default.",
    "Loss: PyTorch eager builds the logits of the whole batch in f32 for the cross-entropy "
    "(batch x context x vocab x 4 bytes: 1.6 GB at 8 x 1024 x 50,257, and their gradient) where "
    "ours computes the head and the loss together (fused_kernels::linear_cross_entropy) without "
    "holding them; torch.compile may fuse part of it. Part of the memory and time gap is this, "
    "not the runtime.",
]

# Measured peaks further apart than this are flagged: one side's matrix product ran below the
# GPU's rate (clocks, a slower cuBLAS algorithm), and its own MFU would have looked better.
PEAK_GAP = 0.05


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def measured_peaks(steps):
    """{"ours": TFLOP/s, "torch": TFLOP/s}: the highest peak each side measured in this run (each
    program times a matrix product at start; a side without a finite one is left out)."""
    peaks = {}
    for r in steps:
        p = r.get("peak_tflops")
        if finite(p) and p > 0:
            side = "ours" if r["impl"] == "ours" else "torch"
            peaks[side] = max(peaks.get(side, 0.0), p)
    return peaks


def reported_mfu(r, peak):
    """r's MFU against `peak` (TFLOP/s), the one peak of the whole run, so that both sides are
    divided by the same number; the program's own figure when there is no peak."""
    if peak is None or not (finite(r.get("flops_per_token")) and finite(r.get("tokens_per_s"))):
        return r.get("mfu")
    return r["flops_per_token"] * r["tokens_per_s"] / (peak * 1e12)


def peak_lines(peaks):
    """The checks' lines on the measured peaks: both, and their gap (flagged above PEAK_GAP)."""
    if not peaks:
        return ["no finite peak measured: MFU is each program's own figure"]
    shown = ", ".join(f"{side} {p:.1f}" for side, p in sorted(peaks.items()))
    hi, lo = max(peaks.values()), min(peaks.values())
    gap = (hi - lo) / hi
    line = (f"measured peaks (TFLOP/s, the highest of each side): {shown}; MFU is taken against "
            f"{hi:.1f} for every row")
    if gap > PEAK_GAP:
        line += (f"; a GAP of {100 * gap:.1f} % between the sides (above {100 * PEAK_GAP:.0f} %: "
                 "one side's matrix product ran below the GPU's rate)")
    elif len(peaks) > 1:
        line += f"; the sides within {100 * gap:.1f} %"
    return [line]


def provenance_banner(machine):
    """The report's first lines on which source the binaries were built from (run.sh's
    check_provenance writes its verdict into machine.txt): a loud warning when it is not this
    working tree, or when nothing says."""
    verdicts = [ln for ln in machine.splitlines()
                if ln.startswith(("PACK MISMATCH", "PACK UNKNOWN", "pack matches"))]
    sources = [ln for ln in machine.splitlines() if ln.startswith("pack source: commit")]
    where = f" ({sources[0].removeprefix('pack source: ')})" if sources else ""
    if any(v.startswith("PACK MISMATCH") for v in verdicts):
        return [f"**WARNING: THE BINARIES DO NOT MATCH THIS WORKING TREE.** {v}" for v in verdicts
                if v.startswith("PACK MISMATCH")] + [""]
    if not verdicts or verdicts[-1].startswith("PACK UNKNOWN"):
        why = verdicts[-1] if verdicts else "no provenance in machine.txt (was the pack unpacked?)"
        return [f"**WARNING: unknown which source the binaries were built from.** {why}", ""]
    return [f"Binaries built from this working tree{where}: {verdicts[-1]}.", ""]


def table(a):
    results = load(a.results)
    # A run that printed its result line counts even if it then failed or overran its limit
    # (2 ranks tearing down NCCL, say): its numbers are the timed steps', and its row is marked.
    steps = [r for r in results if r.get("bench") == "step" and "error" not in r]
    failed = [r for r in results if r.get("bench") == "step" and "error" in r]
    ncu = [r for r in results if r.get("bench") == "ncu"]
    status = load_status(a.status)
    machine = Path(a.machine).read_text() if a.machine and Path(a.machine).exists() else ""
    out = ["# GPU step vs PyTorch (issue 29)", ""] + provenance_banner(machine)
    gpu = next((r.get("gpu") for r in steps if r.get("gpu")), None)
    out.append(f"Device: {gpu or steps[0]['device'] if steps else 'no results'}.")
    if machine:
        out += ["", "```", machine.strip()[:3000], "```"]
    out += ["", "## Steps", "", "| step | status | exit | seconds | note |", "|---|---|---:|---:|---|"]
    for s in status:
        out.append(f"| {s['name']} | {s['status']} | {s['rc']} | {s['seconds']} | {s['note']} |")

    peaks = measured_peaks(steps)
    peak = max(peaks.values()) if peaks else None
    out += ["", "## Steady-state step", "",
            "Step time: each step ends with the loss read back to the host; median (mean) of the "
            "timed steps after the warm-up. tokens/s over all ranks = ranks x batch x context / "
            "mean step. MFU = (6 N + 12 L T width) x tokens/s / peak, N = parameters that "
            "multiply (all but the input embedding tables), the peak a bf16 8192^3 product "
            "(f32 1024^3 on the CPU) that each program times on the same GPU at start (the "
            "column peak TFLOP/s); the MFU column divides every row by the same peak, the "
            "highest measured in this run"
            + (f" ({peak:.1f} TFLOP/s; per side: " +
               ", ".join(f"{side} {p:.1f}" for side, p in sorted(peaks.items())) + ")"
               if peak else "") + ". Memory: "
            "driver total - free polled every 2 ms in-process (both sides alike), nvidia-smi's "
            "device-wide memory.used polled every 100 ms by the script (peak - the sample before "
            "the run), and torch's max_memory_allocated.", "",
            "| configuration | impl | step ms | tokens/s | MFU | peak TFLOP/s | mem MiB (driver) "
            "| mem MiB (nvidia-smi) | torch alloc MiB | launches/step | loss | compile s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ours_launches = {}
    for r in ncu:
        if "error" not in r and r.get("config"):
            ours_launches[tuple(r["config"])] = r.get("launches_per_step")
    for r in sorted(steps, key=lambda r: (config_key(r), r["impl"] != "ours", r["mode"],
                                          zero_stage(r), r.get("optimizer") == "fused")):
        smi = (r["smi_peak_mib"] - r["smi_before_mib"]) if "smi_peak_mib" in r else None
        launches = r.get("launches_per_step")
        if r["impl"] == "ours":
            launches = ours_launches.get(tuple(config_key(r)))
        impl = impl_name(r)
        if r.get("rc") not in (0, None):
            impl += f" (exit {r['rc']} after its result)"
        device = r.get("device")
        mem = r.get("mem_used_peak_mib") if device == "cuda" else r.get("rss_peak_mib")
        own_peak = r.get("peak_tflops")
        peak_spec = ".1f" if finite(own_peak) and own_peak >= 10 else ".3f"
        out.append(
            f"| {label(r)} | {impl} | {fmt(r.get('step_ms_median'), '.1f')} "
            f"({fmt(r.get('step_ms_mean'), '.1f')}) | {fmt(r.get('tokens_per_s'), ',.0f')} "
            f"| {pct(reported_mfu(r, peak))} | {fmt(own_peak, peak_spec)} "
            f"| {fmt(mem, ',.0f')}{'' if device == 'cuda' else ' (RSS)'} | {fmt(smi, ',.0f')} "
            f"| {fmt(r.get('framework_peak_mib'), ',.0f')} | {fmt(launches, ',.0f')} "
            f"| {fmt(r.get('final_loss'), '.3f')} | {fmt(r.get('compile_s'), '.1f')} |")
    for r in failed:
        why = ", no result line" if "error" in r else ""
        out.append(f"| {r.get('run')} | failed (exit {r.get('rc')}{why}) | | | | | | | | | | |")

    out += ["", "## Ours / theirs", "",
            "tokens/s of ours divided by PyTorch's (above 1: ours faster); memory: ours / theirs "
            "(driver figure).", "",
            "| configuration | vs eager: tokens/s | vs eager: memory | vs compile: tokens/s "
            "| vs compile: memory |", "|---|---:|---:|---:|---:|"]
    by_config = {}
    for r in steps:
        # The ratios compare with PyTorch's default AdamW at stage 0 (DDP); the fused one's row
        # is in the table, the sharded rows in their own section.
        if in_ratios(r):
            by_config.setdefault(config_key(r), {})[(r["impl"], r["mode"])] = r
    for key, runs in sorted(by_config.items(), key=lambda kv: str(kv[0])):
        ours = runs.get(("ours", "candle"))
        if not ours:
            continue
        cells = []
        for mode in ("eager", "compile"):
            theirs = runs.get(("torch", mode))
            if theirs:
                cells.append(fmt(ratio(ours.get("tokens_per_s"), theirs.get("tokens_per_s")),
                                 ".2f"))
                mo, mt = ours.get("mem_used_peak_mib"), theirs.get("mem_used_peak_mib")
                if mo is None or mt is None:
                    mo, mt = ours.get("rss_peak_mib"), theirs.get("rss_peak_mib")
                cells.append(fmt(ratio(mo, mt), ".2f"))
            else:
                cells += ["–", "–"]
        out.append(f"| {label(ours)} | " + " | ".join(cells) + " |")

    out += sharded_section(steps)
    out += ["", "## Checks", ""] + [f"- {c}" for c in checks(steps) + peak_lines(peaks)]
    out += ["", "## Notes", ""] + [f"- {n}" for n in NOTES]
    for r in ncu:
        out.append(f"- ncu ({r['run']}): " + (r.get("error") or
                   f"{r['launches']} launches over {r['profiled_steps']} steps = "
                   f"{r['launches_per_step']:.1f} per step, {r['gpu_ms_per_step']:.2f} GPU ms per step"))
    Path(a.out).write_text("\n".join(out) + "\n")


def sharded_section(steps):
    """The sharded rows beside their stage-0 ones, for each configuration that has any: ours at
    ZeRO stages 0, 2 and 3, PyTorch's DDP and FSDP2 (eager, default AdamW), each stage's step
    time against its own side's stage 0, and ours / theirs at stage 0 (DDP) and 3 (FSDP2)."""
    groups = {}
    for r in steps:
        if r.get("optimizer") != "fused" and r["mode"] != "compile":
            groups.setdefault(config_key(r), []).append(r)
    groups = {k: rows for k, rows in groups.items() if any(zero_stage(r) for r in rows)}
    if not groups:
        return []
    out = ["", "## Sharded: ZeRO stages and FSDP2", "",
           "Ours at ZeRO stages 0, 2 and 3 (bench_step --zero-stage; the GPT computes through "
           "its units at every stage) and PyTorch eager with DDP and with FSDP2 (fully_shard per "
           "block and on the root; bf16: MixedPrecisionPolicy(param_dtype=bf16, "
           "reduce_dtype=fp32), which also runs the LayerNorms in bf16 where DDP's autocast "
           "runs them in f32), the same data and steps. With several ranks on one GPU the "
           "memory columns are the whole GPU's, every rank's together. \"vs stage 0\": this "
           "row's step time over its own side's stage-0 (DDP) row.", "",
           "| configuration | impl | sharding | step ms | tokens/s | mem MiB (driver) "
           "| mem MiB (nvidia-smi) | loss | vs stage 0: step time |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    pairs = []
    for key, rows in sorted(groups.items(), key=lambda kv: str(kv[0])):
        rows.sort(key=lambda r: (r["impl"] != "ours", zero_stage(r)))
        base = {side: next((r for r in rows if (r["impl"] == "ours") == (side == "ours")
                            and zero_stage(r) == 0), None) for side in ("ours", "torch")}
        for r in rows:
            b = base["ours" if r["impl"] == "ours" else "torch"]
            smi = (r["smi_peak_mib"] - r["smi_before_mib"]) if "smi_peak_mib" in r else None
            mem = r.get("mem_used_peak_mib") if r.get("device") == "cuda" else r.get("rss_peak_mib")
            out.append(
                f"| {label(r)} | {'ours' if r['impl'] == 'ours' else 'torch ' + r['mode']} "
                f"| {sharding_name(r)} "
                f"| {fmt(r.get('step_ms_median'), '.1f')} | {fmt(r.get('tokens_per_s'), ',.0f')} "
                f"| {fmt(mem, ',.0f')}{'' if r.get('device') == 'cuda' else ' (RSS)'} "
                f"| {fmt(smi, ',.0f')} | {fmt(r.get('final_loss'), '.4f')} "
                f"| {fmt(ratio(r.get('step_ms_median'), b['step_ms_median']) if b else None, '.2f')} |")
        for stage in (0, 3):
            ours = next((r for r in rows if r["impl"] == "ours" and zero_stage(r) == stage), None)
            theirs = next((r for r in rows if r["impl"] == "torch" and zero_stage(r) == stage),
                          None)
            if ours and theirs:
                pairs.append((label(ours), stage, ours, theirs))
    if pairs:
        out += ["", "| configuration | ours / torch at | tokens/s | memory (driver) |",
                "|---|---|---:|---:|"]
        for lab, stage, ours, theirs in pairs:
            mo, mt = ours.get("mem_used_peak_mib"), theirs.get("mem_used_peak_mib")
            if mo is None or mt is None:
                mo, mt = ours.get("rss_peak_mib"), theirs.get("rss_peak_mib")
            what = "ZeRO 3 / FSDP2" if stage == 3 else "ZeRO 0 / DDP"
            out.append(f"| {lab} | {what} | "
                       f"{fmt(ratio(ours.get('tokens_per_s'), theirs.get('tokens_per_s')), '.2f')} "
                       f"| {fmt(ratio(mo, mt), '.2f')} |")
    return out


def loss_lines(steps):
    """Each sharded row's final loss against its side's stage-0 (DDP) row of the same
    configuration: the same training up to rounding, so a gap above LOSS_GAP is flagged."""
    lines = []
    for r in steps:
        if not zero_stage(r) or r.get("optimizer") == "fused" or r["mode"] == "compile":
            continue
        base = next((b for b in steps if config_key(b) == config_key(r)
                     and b["impl"] == r["impl"] and b["mode"] == r["mode"]
                     and zero_stage(b) == 0 and b.get("optimizer") != "fused"), None)
        if base is None:
            lines.append(f"{r['run']}: no stage-0 row of its configuration to compare its loss "
                         "with")
            continue
        a, b = r.get("final_loss"), base.get("final_loss")
        if not (finite(a) and finite(b)):
            continue  # listed as NON-FINITE
        gap = abs(a - b)
        verdict = ("agree" if gap <= LOSS_GAP * abs(b)
                   else f"DIFFER (above {LOSS_GAP:g} of the loss)")
        lines.append(f"{r['run']} ({sharding_name(r)}) against {base['run']} "
                     f"({sharding_name(base)}): final losses {a:.5f} and {b:.5f} {verdict}, "
                     f"gap {gap:.2e}")
    return lines


def checks(steps):
    """Consistency of the two sides: same model size, same data, a loss near ln(vocab)."""
    lines = []
    models = {}
    for r in steps:
        models.setdefault((r["model"], r["layers"], r["width"], r["vocab"]), set()).add(
            (r["n_params"], r["n_params_matmul"]))
    for (model, layers, width, vocab), counts in sorted(models.items()):
        same = len(counts) == 1
        lines.append(f"{model} {layers}x{width}: parameter counts "
                     f"{'equal on both sides' if same else 'DIFFER'}: {sorted(counts)}")
    firsts = {tuple(r.get("data_first") or ()) for r in steps}
    lines.append(f"first tokens of the data stream: {'the same in every run' if len(firsts) <= 1 else 'DIFFER'}"
                 f" {sorted(firsts)[:3]}")
    for r in steps:
        if r.get("rc") not in (0, None):
            why = "overran its time limit" if r["rc"] in (124, 137) else f"exited with {r['rc']}"
            lines.append(f"{r['run']}: printed its result, then {why} (exit {r['rc']}; at "
                         "teardown): its numbers are kept, its row marked")
    for r in steps:
        bad = nonfinite_fields(r)
        if bad:
            # A broken kernel's signature: flagged before anything is read into its numbers.
            lines.append(f"{r['run']}: NON-FINITE " +
                         ", ".join(f"{k} ({r[k]})" for k in bad))
    for r in steps:
        # Uniform random tokens cannot be predicted: a sound model stays near ln(vocab).
        ln_v = math.log(r["vocab"])
        loss = r.get("final_loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss) and not abs(loss - ln_v) < 1.0:
            lines.append(f"{r['run']}: final loss {loss:.3f} is far from ln(vocab) = "
                         f"{ln_v:.3f}")
    lines.append("final losses within 1.0 of ln(vocab) (uniform random tokens) unless listed above"
                 " (a non-finite one is listed above, flagged)")
    return lines + loss_lines(steps)


def check(a):
    """The self-test's assertions: every run recorded with all fields, statuses as expected,
    both sides agreeing on model size and data."""
    results = load(a.results)
    steps = [r for r in results if r.get("bench") == "step"]
    assert len(steps) == a.expect_runs, f"{len(steps)} step records, expected {a.expect_runs}"
    for r in steps:
        assert "error" not in r and r["rc"] == 0, f"run {r.get('run')} failed: {r}"
        missing = [k for k in STEP_FIELDS if k not in r]
        assert not missing, f"run {r['run']} lacks {missing}"
        assert r["step_ms_median"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"], r
        assert len(r["step_ms"]) == r["steps"], r
    for line in checks(steps):
        assert "DIFFER" not in line and "NON-FINITE" not in line, line
    got = [s["status"] for s in load_status(a.status)]
    want = a.expect_statuses.split(",")
    assert got == want, f"statuses {got}, expected {want}"
    ncu = [r for r in results if r.get("bench") == "ncu"]
    assert ncu and all("error" not in r for r in ncu), ncu
    if a.expect_launches is not None:
        assert all(r["launches_per_step"] == a.expect_launches for r in ncu), ncu
    if a.expect_loss_agreements is not None:
        # Every sharded row compared with its stage-0 row (a missing one would pass silently).
        agree = [ln for ln in loss_lines(steps) if " agree, gap " in ln]
        assert len(agree) == a.expect_loss_agreements and len(agree) == len(loss_lines(steps)), (
            f"{len(agree)} sharded rows agree with stage 0, expected {a.expect_loss_agreements}: "
            f"{loss_lines(steps)}")
    print(f"report check: {len(steps)} runs with every field, statuses {','.join(got)}, "
          f"launches/step {[r['launches_per_step'] for r in ncu]}: ok")


def median(values):
    """The upper of the middle two for an even count, as the Rust benchmarks' median."""
    v = sorted(values)
    return v[len(v) // 2] if v else float("nan")


def compare(a):
    runs = [r for r in load(a.results) if r.get("bench") == "step" and "error" not in r]
    rounds = {}
    for r in runs:
        name, _, k = r["run"].rpartition("-round")
        rounds.setdefault(r["model"], {}).setdefault(r["impl"], {})[int(k)] = r
    out = ["| model | impl | rounds | step ms (median of rounds) | tokens/s | MFU | peak RSS MiB "
           "| ours / torch step time (per-round median, quartiles) |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for model, impls in sorted(rounds.items()):
        ours, theirs = impls.get("ours", {}), impls.get("torch", {})
        ratios = sorted(ours[k]["step_ms_median"] / theirs[k]["step_ms_median"]
                        for k in ours if k in theirs)
        for impl, by_round in (("ours", ours), ("torch", theirs)):
            if not by_round:
                continue
            rs = list(by_round.values())
            ratio = ""
            if impl == "ours" and ratios:
                q = lambda f: ratios[int((len(ratios) - 1) * f)]
                ratio = f"{median(ratios):.2f} ({q(0.25):.2f}–{q(0.75):.2f})"
            first = rs[0]
            out.append(
                f"| {model} ({first['layers']}x{first['width']}, vocab {first['vocab']}, batch "
                f"{first['batch_size']} x {first['context']}) | {impl} | {len(rs)} "
                f"| {median([r['step_ms_median'] for r in rs]):.1f} "
                f"| {median([r['tokens_per_s'] for r in rs]):,.0f} "
                f"| {100 * median([r['mfu'] for r in rs]):.1f} % "
                f"| {median([r['rss_peak_mib'] for r in rs]):,.0f} | {ratio} |")
    print("\n".join(out))


def _self_test_row(**fields):
    """A result line as bench_step or torch_step.py prints it, with `fields` changed."""
    row = {"bench": "step", "impl": "ours", "mode": "candle", "model": "gpt2",
           "mixed_precision": "bf16", "device": "cuda", "gpu": "Test GPU", "world_size": 1,
           "batch_size": 8, "context": 1024, "layers": 12, "width": 768, "heads": 12,
           "vocab": 50257, "n_params": 124_000_000, "n_params_matmul": 85_000_000,
           "flops_per_token": 6.0e8, "warmup": 5, "steps": 3, "profile_steps": 0,
           "step_ms_median": 100.0, "step_ms_mean": 100.0, "step_ms_min": 99.0,
           "step_ms": [100.0, 99.0, 101.0], "tokens_per_s": 81920.0, "peak_tflops": 700.0,
           "peak_dtype": "bf16", "peak_size": 8192, "mfu": 6.0e8 * 81920.0 / 700e12,
           "mem_used_before_mib": 500.0, "mem_used_peak_mib": 20000.0,
           "framework_peak_mib": None, "rss_peak_mib": 900.0, "final_loss": 10.9,
           "data_first": [1, 2, 3, 4], "compile_s": None, "launches_per_step": None,
           "run": "ours-gpt2-bf16", "rc": 0, "run_wall_s": 12.0}
    row.update(fields)
    return row


def self_test(_a=None):
    """The table and the checks over made-up rows, asserting what they show."""
    # PyTorch measured a higher peak (800 against ours' 700 TFLOP/s): every MFU is taken
    # against 800, and the 12.5 % gap is flagged.
    torch_row = dict(impl="torch", mode="eager", run="torch-eager-gpt2-bf16",
                     framework_peak_mib=18000.0, peak_tflops=800.0,
                     mfu=6.0e8 * 81920.0 / 800e12)
    rows = [
        _self_test_row(),
        _self_test_row(**torch_row),
        # A broken kernel: bench_step writes non-finite floats as strings, serde's default
        # (null) and Python's json (NaN) must read the same.
        _self_test_row(mixed_precision="no", run="ours-gpt2-f32", final_loss="NaN",
                       mfu="inf", tokens_per_s=None),
        _self_test_row(mixed_precision="no", run="torch-eager-gpt2-f32", impl="torch",
                       mode="eager", final_loss=float("nan")),
        # PyTorch's fused AdamW: its own row, not the ratios' reference.
        _self_test_row(**dict(torch_row, run="torch-eager-gpt2-bf16-fused-adamw",
                              optimizer="fused", tokens_per_s=4 * 81920.0)),
        # Two ranks that printed their result, then overran the time limit at teardown.
        _self_test_row(run="ours-gpt2-bf16-2ranks", world_size=2, rc=124,
                       tokens_per_s=2 * 81920.0),
        # A run that printed nothing stays a failure.
        {"bench": "step", "error": "no result line", "tail": [], "run": "torch-eager-gpt2-bf16-2ranks",
         "rc": 1, "run_wall_s": 3},
    ]
    # Four ranks: ours at ZeRO stages 0, 2 and 3, PyTorch's DDP and FSDP2. Stage 3 and FSDP2 take
    # 1.5 times their side's stage-0 step; stage 3's loss is 0.05 off stage 0's (flagged), stage
    # 2's 0.001 (within 1e-3 of the loss).
    four = dict(world_size=4, tokens_per_s=4 * 81920.0)
    rows += [
        _self_test_row(**dict(four, run="ours-4ranks", zero_stage=0, mem_used_peak_mib=30000.0)),
        _self_test_row(**dict(four, run="ours-4ranks-zero2", zero_stage=2, step_ms_median=110.0,
                              final_loss=10.901)),
        _self_test_row(**dict(four, run="ours-4ranks-zero3", zero_stage=3, step_ms_median=150.0,
                              tokens_per_s=4 * 81920.0 / 1.5, mem_used_peak_mib=15000.0,
                              final_loss=10.95)),
        _self_test_row(**dict(torch_row, world_size=4, run="torch-ddp-4ranks", sharding="ddp",
                              step_ms_median=80.0, tokens_per_s=4 * 81920.0 / 0.8,
                              mem_used_peak_mib=50000.0)),
        _self_test_row(**dict(torch_row, world_size=4, run="torch-fsdp2-4ranks", sharding="fsdp2",
                              step_ms_median=120.0, tokens_per_s=4 * 81920.0 / 1.2,
                              mem_used_peak_mib=20000.0)),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        results, status, out = (Path(tmp) / n for n in ("r.jsonl", "s.tsv", "r.md"))
        results.write_text("".join(json.dumps(r) + "\n" for r in rows))
        status.write_text("".join(f"{r['run']}\tpassed\t0\t1.0\t\n" for r in rows))
        machine = Path(tmp) / "machine.txt"
        machine.write_text("pack source: commit: 0123abc\nPACK MISMATCH: built from other "
                           "sources\n")
        table(argparse.Namespace(results=results, status=status, machine=machine, out=out))
        mismatch = out.read_text()
        machine.write_text("pack source: commit: 0123abc\npack matches the working tree\n")
        table(argparse.Namespace(results=results, status=status, machine=machine, out=out))
        matching = out.read_text()
        table(argparse.Namespace(results=results, status=status, machine=None, out=out))
        text = out.read_text()
    lines = text.splitlines()
    assert mismatch.splitlines()[2].startswith("**WARNING: THE BINARIES DO NOT MATCH"), mismatch
    assert matching.splitlines()[2].startswith("Binaries built from this working tree (commit: "
                                               "0123abc)"), matching
    assert lines[2].startswith("**WARNING: unknown which source"), text

    def row_of(run_config, impl):
        found = [ln for ln in lines if ln.startswith(f"| {run_config} | {impl}")
                 and ln.split("|")[2].strip().startswith(impl)
                 and (impl.endswith("AdamW") or "AdamW" not in ln.split("|")[2])]
        assert len(found) == 1, (run_config, impl, found)
        return found[0]

    f32 = "gpt2 (12x768) f32, 1 rank(s), batch 8 x 1024"
    ours_f32 = row_of(f32, "ours")
    assert "non-finite" in ours_f32 and ours_f32.count("non-finite") >= 3, ours_f32
    assert "non-finite" in row_of(f32, "torch eager"), row_of(f32, "torch eager")
    for run, what in (("ours-gpt2-f32", "final_loss"), ("ours-gpt2-f32", "tokens_per_s"),
                      ("ours-gpt2-f32", "mfu"), ("torch-eager-gpt2-f32", "final_loss")):
        assert any(run in ln and "NON-FINITE" in ln and what in ln for ln in lines), (run, what)
    bf16 = "gpt2 (12x768) bf16, 1 rank(s), batch 8 x 1024"
    assert "non-finite" not in row_of(bf16, "ours") + row_of(bf16, "torch eager")
    # 6e8 FLOP/token x 81,920 tokens/s / 800 TFLOP/s = 6.144 %, on both sides; the peak column
    # keeps each program's own measurement.
    for impl, own_peak in (("ours", "700.0"), ("torch eager", "800.0")):
        cells = [c.strip() for c in row_of(bf16, impl).split("|")]
        assert cells[5] == "6.1 %" and cells[6] == own_peak, (impl, cells)
    assert any("700.0" in ln and "800.0" in ln and "12.5 %" in ln and "GAP" in ln
               for ln in lines), "the peaks' gap is flagged"
    assert "327,680" in row_of(bf16, "torch eager, fused AdamW")
    ratios = [ln for ln in lines if ln.startswith(f"| {bf16} | ") and ln.count("|") == 6]
    assert len(ratios) == 1 and ratios[0].split("|")[2].strip() == "1.00", ratios
    assert any("foreach" in ln and "fused" in ln for ln in lines), "the optimizer note"
    assert any("1.6 GB" in ln for ln in lines), "the logits note"
    two = row_of("gpt2 (12x768) bf16, 2 rank(s), batch 8 x 1024", "ours")
    assert "163,840" in two and "exit 124 after its result" in two, two
    assert any("ours-gpt2-bf16-2ranks" in ln and "exit 124" in ln and "kept" in ln
               for ln in lines), "the teardown failure is listed in the checks"
    assert any(ln.startswith("| torch-eager-gpt2-bf16-2ranks | failed (exit 1, no result line)")
               for ln in lines), "a run without a result line is a failure"
    # The sharded section: each row's step time over its side's stage 0, ours / theirs at
    # stage 0 (DDP) and 3 (FSDP2), and the losses against stage 0.
    cfg4 = "gpt2 (12x768) bf16, 4 rank(s), batch 8 x 1024"
    start = lines.index("## Sharded: ZeRO stages and FSDP2")
    section = lines[start:lines.index("## Checks")]

    def sharded_row(impl, sharding):
        found = [ln for ln in section if ln.startswith(f"| {cfg4} | {impl} | {sharding} |")]
        assert len(found) == 1, (impl, sharding, section)
        return [c.strip() for c in found[0].split("|")]

    assert sharded_row("ours", "ZeRO 0")[9] == "1.00"
    assert sharded_row("ours", "ZeRO 2")[9] == "1.10"
    assert sharded_row("ours", "ZeRO 3")[9] == "1.50"
    assert sharded_row("torch eager", "DDP")[9] == "1.00"
    assert sharded_row("torch eager", "FSDP2")[9] == "1.50"
    assert sharded_row("ours", "ZeRO 3")[8] == "10.9500"
    # ours 327,680 / 1.5 against 327,680 / 1.2 tokens/s: 0.80; memory 15,000 / 20,000.
    assert f"| {cfg4} | ZeRO 3 / FSDP2 | 0.80 | 0.75 |" in section, section
    # 327,680 against 409,600 tokens/s; memory 30,000 / 50,000.
    assert f"| {cfg4} | ZeRO 0 / DDP | 0.80 | 0.60 |" in section, section
    # The ours/theirs ratios of that configuration take DDP, not FSDP2, and stage 0, not 3.
    four_ratio = [ln for ln in lines if ln.startswith(f"| {cfg4} | ") and ln.count("|") == 6]
    assert len(four_ratio) == 1 and four_ratio[0].split("|")[2].strip() == "0.80", four_ratio
    assert four_ratio[0].split("|")[3].strip() == "0.60", four_ratio
    loss = {ln.split(" ")[1]: ln for ln in lines if " against " in ln and "final losses" in ln}
    assert "DIFFER" in loss["ours-4ranks-zero3"] and "5.00e-02" in loss["ours-4ranks-zero3"], loss
    assert "agree" in loss["ours-4ranks-zero2"] and "agree" in loss["torch-fsdp2-4ranks"], loss
    assert "against torch-ddp-4ranks" in loss["torch-fsdp2-4ranks"], loss
    print("report self-test: non-finite fields shown and flagged, a result before a failed "
          "teardown kept and marked, MFU against one peak with the gap flagged, the pack's "
          "provenance at the top, PyTorch's fused AdamW apart, the sharded rows (ZeRO stages, "
          "FSDP2) in their own section with their losses checked, the notes: ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--results", required=True)
    r.add_argument("--name", required=True)
    r.add_argument("--rc", type=int, required=True)
    r.add_argument("--wall", type=float, required=True)
    r.add_argument("--log", required=True)
    r.add_argument("--smi")
    n = sub.add_parser("record-ncu")
    n.add_argument("--results", required=True)
    n.add_argument("--name", required=True)
    n.add_argument("--raw", required=True)
    n.add_argument("--steps", type=int, required=True)
    t = sub.add_parser("table")
    t.add_argument("--results", required=True)
    t.add_argument("--status", required=True)
    t.add_argument("--machine")
    t.add_argument("--out", required=True)
    c = sub.add_parser("check")
    c.add_argument("--results", required=True)
    c.add_argument("--status", required=True)
    c.add_argument("--expect-runs", type=int, required=True)
    c.add_argument("--expect-statuses", required=True)
    c.add_argument("--expect-launches", type=float)
    c.add_argument("--expect-loss-agreements", type=int,
                   help="how many sharded rows must agree on the loss with their stage-0 row")
    m = sub.add_parser("compare")
    m.add_argument("--results", required=True)
    sub.add_parser("self-test")
    a = ap.parse_args()
    if a.cmd == "self-test":
        self_test(a)
    elif a.cmd == "compare":
        compare(a)
    elif a.cmd == "record":
        record(a)
    elif a.cmd == "record-ncu":
        record_ncu(a)
    elif a.cmd == "table":
        table(a)
    else:
        check(a)


if __name__ == "__main__":
    main()
