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
        the self-test's assertions over a finished report (see run.sh selftest)
    report.py compare --results R
        interleaved rounds of ours and PyTorch (run names NAME-roundK, see cpu_rounds.sh):
        medians over the rounds and the per-round ratios, as markdown
"""

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import ncu_summary  # noqa: E402

RANK_PREFIX = re.compile(r"^\[rank \d+\]\s*")
STEP_FIELDS = ["impl", "mode", "model", "mixed_precision", "world_size", "batch_size", "context",
               "n_params", "n_params_matmul", "flops_per_token", "step_ms_median",
               "step_ms_mean", "tokens_per_s", "peak_tflops", "mfu", "final_loss", "data_first"]


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


def load(path):
    rows = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
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
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def config_key(r):
    return (r.get("model"), r.get("mixed_precision"), r.get("world_size"), r.get("batch_size"),
            r.get("context"), r.get("layers"), r.get("width"))


def label(r):
    precision = "f32" if r["mixed_precision"] == "no" else r["mixed_precision"]
    return (f"{r['model']} ({r['layers']}x{r['width']}) {precision}, "
            f"{r['world_size']} rank(s), batch {r['batch_size']} x {r['context']}")


def table(a):
    results = load(a.results)
    steps = [r for r in results if r.get("bench") == "step" and "error" not in r and r.get("rc") == 0]
    failed = [r for r in results if r.get("bench") == "step" and ("error" in r or r.get("rc") != 0)]
    ncu = [r for r in results if r.get("bench") == "ncu"]
    status = load_status(a.status)
    machine = Path(a.machine).read_text() if a.machine and Path(a.machine).exists() else ""
    out = ["# GPU step vs PyTorch (issue 29)", ""]
    gpu = next((r.get("gpu") for r in steps if r.get("gpu")), None)
    out.append(f"Device: {gpu or steps[0]['device'] if steps else 'no results'}.")
    if machine:
        out += ["", "```", machine.strip()[:3000], "```"]
    out += ["", "## Steps", "", "| step | status | exit | seconds | note |", "|---|---|---:|---:|---|"]
    for s in status:
        out.append(f"| {s['name']} | {s['status']} | {s['rc']} | {s['seconds']} | {s['note']} |")

    out += ["", "## Steady-state step", "",
            "Step time: each step ends with the loss read back to the host; median (mean) of the "
            "timed steps after the warm-up. tokens/s over all ranks = ranks x batch x context / "
            "mean step. MFU = (6 N + 12 L T width) x tokens/s / peak, N = parameters that "
            "multiply (all but the input embedding tables), the peak a bf16 8192^3 product "
            "measured by each program on the same GPU at start (f32 1024^3 on the CPU). Memory: "
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
    for r in sorted(steps, key=lambda r: (config_key(r), r["impl"] != "ours", r["mode"])):
        smi = (r["smi_peak_mib"] - r["smi_before_mib"]) if "smi_peak_mib" in r else None
        launches = r.get("launches_per_step")
        if r["impl"] == "ours":
            launches = ours_launches.get(tuple(config_key(r)))
        impl = "ours" if r["impl"] == "ours" else f"torch {r['mode']}"
        device = r.get("device")
        mem = r.get("mem_used_peak_mib") if device == "cuda" else r.get("rss_peak_mib")
        out.append(
            f"| {label(r)} | {impl} | {fmt(r['step_ms_median'], '.1f')} "
            f"({fmt(r['step_ms_mean'], '.1f')}) | {fmt(r['tokens_per_s'], ',.0f')} "
            f"| {fmt(100 * r['mfu'], '.1f')} % | {fmt(r['peak_tflops'], '.1f' if r['peak_tflops'] >= 10 else '.3f')} "
            f"| {fmt(mem, ',.0f')}{'' if device == 'cuda' else ' (RSS)'} | {fmt(smi, ',.0f')} "
            f"| {fmt(r.get('framework_peak_mib'), ',.0f')} | {fmt(launches, ',.0f')} "
            f"| {fmt(r['final_loss'], '.3f')} | {fmt(r.get('compile_s'), '.1f')} |")
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
        by_config.setdefault(config_key(r), {})[(r["impl"], r["mode"])] = r
    for key, runs in sorted(by_config.items(), key=lambda kv: str(kv[0])):
        ours = runs.get(("ours", "candle"))
        if not ours:
            continue
        cells = []
        for mode in ("eager", "compile"):
            theirs = runs.get(("torch", mode))
            if theirs:
                cells.append(fmt(ours["tokens_per_s"] / theirs["tokens_per_s"], ".2f"))
                mo, mt = ours.get("mem_used_peak_mib"), theirs.get("mem_used_peak_mib")
                if mo is None or mt is None:
                    mo, mt = ours.get("rss_peak_mib"), theirs.get("rss_peak_mib")
                cells.append(fmt(mo / mt if mo and mt else None, ".2f"))
            else:
                cells += ["–", "–"]
        out.append(f"| {label(ours)} | " + " | ".join(cells) + " |")

    out += ["", "## Checks", ""] + [f"- {c}" for c in checks(steps)]
    for r in ncu:
        out.append(f"- ncu ({r['run']}): " + (r.get("error") or
                   f"{r['launches']} launches over {r['profiled_steps']} steps = "
                   f"{r['launches_per_step']:.1f} per step, {r['gpu_ms_per_step']:.2f} GPU ms per step"))
    Path(a.out).write_text("\n".join(out) + "\n")


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
    firsts = {tuple(r["data_first"]) for r in steps}
    lines.append(f"first tokens of the data stream: {'the same in every run' if len(firsts) <= 1 else 'DIFFER'}"
                 f" {sorted(firsts)[:3]}")
    for r in steps:
        # Uniform random tokens cannot be predicted: a sound model stays near ln(vocab).
        ln_v = math.log(r["vocab"])
        if not abs(r["final_loss"] - ln_v) < 1.0:
            lines.append(f"{r['run']}: final loss {r['final_loss']:.3f} is far from ln(vocab) = "
                         f"{ln_v:.3f}")
    lines.append("final losses within 1.0 of ln(vocab) (uniform random tokens) unless listed above")
    return lines


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
        assert "DIFFER" not in line, line
    got = [s["status"] for s in load_status(a.status)]
    want = a.expect_statuses.split(",")
    assert got == want, f"statuses {got}, expected {want}"
    ncu = [r for r in results if r.get("bench") == "ncu"]
    assert ncu and all("error" not in r for r in ncu), ncu
    if a.expect_launches is not None:
        assert all(r["launches_per_step"] == a.expect_launches for r in ncu), ncu
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
    m = sub.add_parser("compare")
    m.add_argument("--results", required=True)
    a = ap.parse_args()
    if a.cmd == "compare":
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
