#!/usr/bin/env python3
"""Reads the per-kernel summary that `ncu --metrics gpu__time_duration.sum --print-summary
per-kernel` prints, and tabulates it per kernel name: launches, GPU time, share.

ncu prints one entry per kernel name *and launch shape*:

      badd_bf16 (1, 1, 1)x(1024, 1, 1), Device 0, CC 9.0, Invocations 222
        Section: Command line profiler metrics
        ...
        gpu__time_duration.sum          us    2.30    3.36    2.58

The time of an entry is its average times its invocations; entries of one name are summed.
Kernel launches per step = all invocations / the number of profiled steps.

    ncu_summary.py RAW_NCU_OUTPUT STEPS            prints the table (markdown)
    ncu_summary.py --json RAW_NCU_OUTPUT STEPS     prints one JSON line of the totals
    ncu_summary.py --self-test                     checks the parser against testdata/
"""

import json
import re
import sys
from pathlib import Path

ENTRY = re.compile(
    r"^\s+(?P<name>.+?) \((?P<grid>\d+, \d+, \d+)\)x\((?P<block>\d+, \d+, \d+)\), "
    r"(?:Context \d+, (?:Stream \d+, )?)?Device \d+, CC [\d.]+, Invocations (?P<n>\d+)\s*$")
METRIC = re.compile(
    r"^\s+gpu__time_duration\.sum\s+(?P<unit>\S+)\s+(?P<min>[\d.,]+)\s+(?P<max>[\d.,]+)\s+"
    r"(?P<avg>[\d.,]+)\s*$")
TO_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0,
         "s": 1e3, "second": 1e3}


def parse(text):
    """{kernel name: [launches, GPU ms]} of an ncu per-kernel summary."""
    kernels, current = {}, None
    for line in text.splitlines():
        m = ENTRY.match(line)
        if m:
            current = (m["name"], int(m["n"]))
            continue
        m = METRIC.match(line)
        if m and current is not None:
            unit = m["unit"]
            if unit not in TO_MS:
                raise ValueError(f"unknown time unit {unit!r} in: {line.strip()}")
            avg = float(m["avg"].replace(",", "")) * TO_MS[unit]
            name, n = current
            row = kernels.setdefault(name, [0, 0.0])
            row[0] += n
            row[1] += avg * n
            current = None
    return kernels


def short(name, width=80):
    """The name up to its template or parameter list, cut to `width` characters."""
    cut = re.split(r"[<(]", name, maxsplit=1)[0].strip() or name
    return cut if len(cut) <= width else cut[: width - 1] + "…"


def totals(kernels, steps):
    launches = sum(n for n, _ in kernels.values())
    ms = sum(t for _, t in kernels.values())
    return {"bench": "ncu", "kernel_names": len(kernels), "launches": launches,
            "gpu_ms": ms, "profiled_steps": steps,
            "launches_per_step": launches / steps if steps else None,
            "gpu_ms_per_step": ms / steps if steps else None}


def table(kernels, steps, rows=30):
    """Markdown: the kernels with the most GPU time first, by name up to template arguments."""
    grouped = {}
    for name, (n, t) in kernels.items():
        row = grouped.setdefault(short(name), [0, 0.0])
        row[0] += n
        row[1] += t
    t = totals(kernels, steps)
    out = [f"ncu, {steps} profiled step(s): {t['launches']} kernel launches "
           f"({t['launches_per_step']:.1f} per step), {t['gpu_ms']:.2f} ms of GPU time "
           f"({t['gpu_ms_per_step']:.2f} per step), {len(grouped)} kernel names", "",
           "| kernel (name up to its template arguments) | GPU ms | share | launches | per step |",
           "|---|---:|---:|---:|---:|"]
    for name, (n, ms) in sorted(grouped.items(), key=lambda kv: -kv[1][1])[:rows]:
        share = 100 * ms / t["gpu_ms"] if t["gpu_ms"] else 0.0
        out.append(f"| `{name}` | {ms:.2f} | {share:.1f} % | {n} | {n / steps:.1f} |")
    if len(grouped) > rows:
        out.append(f"| ({len(grouped) - rows} more names) | | | | |")
    return "\n".join(out)


def self_test():
    """The parser against the ncu output of the 2026-11-27 H200 run (shared/gpu/PROFILE.md,
    whose table was summed independently): 6971 launches and 277.4 ms over 3 steps, badd_bf16
    2100 launches and 112.91 ms, causal_softmax_bf16 36 launches and 11.72 ms."""
    text = (Path(__file__).parent / "testdata" / "ncu-gpt-12x768-bf16.txt").read_text()
    kernels = parse(text)
    t = totals(kernels, 3)
    assert t["launches"] == 6971, t
    assert abs(t["gpu_ms"] - 277.4) < 0.1, t
    assert kernels["badd_bf16"][0] == 2100 and abs(kernels["badd_bf16"][1] - 112.91) < 0.01
    assert kernels["causal_softmax_bf16"][0] == 36
    assert abs(kernels["causal_softmax_bf16"][1] - 11.72) < 0.01
    assert "| `badd_bf16` | 112.9" in table(kernels, 3)
    assert parse("no kernels here\n") == {}
    print("ncu_summary self-test: 6971 launches, 277.4 ms, per-kernel sums as PROFILE.md: ok")


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    as_json = argv[:1] == ["--json"]
    args = argv[1:] if as_json else argv
    if len(args) != 2:
        sys.exit(__doc__)
    path, steps = Path(args[0]), int(args[1])
    kernels = parse(path.read_text(errors="replace"))
    if not kernels:
        sys.exit(f"{path}: no per-kernel ncu summary found (did ncu run and profile anything?)")
    print(json.dumps(totals(kernels, steps)) if as_json else table(kernels, steps))


if __name__ == "__main__":
    main(sys.argv[1:])
