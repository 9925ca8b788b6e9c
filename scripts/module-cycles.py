#!/usr/bin/env python3
"""Finds import circles between the top-level modules of a crate: prints each circle and exits 1,
or prints the dependency order and exits 0.

A module is a file `src/<m>.rs` or a directory `src/<m>/`; module `a` depends on `b` when any of
its files names `crate::b` in code (a `use` or a path; comments and doc links do not count). Tests (`#[cfg(test)]` files named
`tests.rs` or `*_tests.rs`, and the `fuzzing` module) are left out: test code may look anywhere.

Usage: scripts/module-cycles.py [CRATE_DIR]   (default: accelerate-core)
"""
import pathlib
import re
import sys

crate = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "accelerate-core") / "src"
modules = {p.stem: p for p in crate.glob("*.rs") if p.stem != "lib"}
modules.update({p.name: p for p in crate.iterdir() if p.is_dir()})
skip = {"fuzzing"}


def files(path):
    found = [path] if path.is_file() else sorted(path.rglob("*.rs"))
    return [f for f in found if f.name != "tests.rs" and not f.name.endswith("_tests.rs")]


def strip_test_modules(text):
    # Drops `#[cfg(test)] mod x { ... }` blocks by brace matching.
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\(crate\))?\s+)?mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def named_modules(text):
    names = set(re.findall(r"crate::(\w+)", text))
    # Grouped imports: `use crate::{a::X, b, c::{Y, Z}};` names a, b and c.
    for m in re.finditer(r"crate::\{", text):
        depth, j, item, items = 1, m.end(), "", []
        while j < len(text) and depth:
            ch = text[j]
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if depth == 1 and ch == ",":
                items.append(item)
                item = ""
            elif depth >= 1:
                item += ch
            j += 1
        items.append(item)
        names |= {re.split(r"\W", i.strip(), maxsplit=1)[0] for i in items if i.strip()}
    return names


# Names the crate root re-exports (`pub use m::{A, B}`) stand for their module.
reexports = {}
for m in re.finditer(r"pub use (\w+)::(\{[^}]*\}|\w+);", (crate / "lib.rs").read_text()):
    for item in re.findall(r"\w+", m.group(2)):
        reexports[item] = m.group(1)

deps = {}
for name, path in modules.items():
    if name in skip:
        continue
    named = set()
    for f in files(path):
        text = re.sub(r"//.*", "", strip_test_modules(f.read_text()))
        named |= {reexports.get(n, n) for n in named_modules(text)}
    deps[name] = sorted(d for d in named if d in modules and d != name and d not in skip)

# Strongly connected components (Tarjan).
index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]


def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in deps[v]:
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == v:
                break
        comps.append(sorted(comp))


sys.setrecursionlimit(10000)
for v in sorted(deps):
    if v not in index:
        visit(v)
circles = [c for c in comps if len(c) > 1]
if circles:
    for c in circles:
        print("import circle:", " <-> ".join(c))
        for m in c:
            print(f"  {m} -> {', '.join(d for d in deps[m] if d in c)}")
    sys.exit(1)
print("no import circles; modules in dependency order:", " ".join(m for c in comps for m in c))
