#!/usr/bin/env python3
"""Finds import circles between the modules of a crate, at every level: prints each circle with the
files and lines that make its edges and exits 1, or prints the top-level dependency order and exits 0.

Top level: a module is a file `src/<m>.rs`, a directory `src/<m>/`, or both (`<m>.rs` with its
`<m>/` beside it); module `a` depends on `b` when any of its files names `crate::b` in code (a `use`
or a path), or a name the crate root re-exports from `b` (`pub use b::{X, Y};` in lib.rs:
`crate::X` stands for `b`).

Inside every directory module D at any depth (a folder with a mod.rs, or a folder `<d>/` next to a
`<d>.rs`), the children are D's `*.rs` files (other than mod.rs) and its subfolders with a mod.rs
(a folder of CUDA sources is no module); child `a` depends on its sibling `b` when any of a's files
names a path that resolves to `D::b`: `super::b` from `D/a.rs`, `super::super::b` from `D/a/x.rs`, `crate::<path to D>::b`, and grouped imports
(`use super::{b::X, c::{Y, Z}};` names b and c). Relative paths are resolved against the file's
module path (`D/a.rs` and `D/a/mod.rs` are D::a, `D/a/x.rs` is D::a::x), and against the inline
`mod x { ... }` blocks they sit in. D's own mod.rs is the parent, not a sibling: what it names
(its `pub use b::X;` re-exports included) makes no edge, and a name it re-exports is not followed
back to the sibling that defines it.

Left out everywhere: comments, doc links and string literals; `#[cfg(test)] mod x { ... }` blocks;
test files (`tests.rs`, `*_tests.rs`, and any file a `#[cfg(test)] mod x;` declares); the `fuzzing`
module; `main.rs` and `bin/` (other crate roots) below the top level. Test code may look anywhere.

Usage: scripts/module-cycles.py [CRATE_DIR]   (default: accelerate-core)
"""
import bisect
import pathlib
import re
import sys

crate = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "accelerate-core") / "src"
modules = {p.stem: p for p in crate.glob("*.rs") if p.stem != "lib"}
modules.update({p.name: p for p in crate.iterdir() if p.is_dir()})
skip = {"fuzzing"}


def blank(text, start, end):
    # Keeps newlines, so line numbers survive.
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def strip_comments_and_strings(text):
    out, i, n = [], 0, len(text)
    while i < n:
        ch = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
        elif (m := re.match(r'b?r(#*)"', text[i:i + 300])) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            close = '"' + m.group(1)
            j = text.find(close, i + m.end())
            j = n if j < 0 else j + len(close)
        elif ch == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
        elif ch == "'" and (m := re.match(r"'(\\.[^']*|[^\\'])'", text[i:i + 12])):
            j = i + m.end()
        else:
            out.append(ch)
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", text[i:j]))
        i = j
    return "".join(out)


def block_end(text, j):
    # `j` is just past an opening brace; returns the index just past its match.
    depth = 1
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return j


def strip_test_modules(text):
    # Blanks `#[cfg(test)] mod x { ... }` blocks by brace matching.
    for m in reversed(list(re.finditer(r"#\[cfg\(test\)\]\s*(pub(\([\w ]+\))?\s+)?mod\s+\w+\s*\{", text))):
        text = blank(text, m.start(), block_end(text, m.end()))
    return text


def clean(path):
    return strip_test_modules(strip_comments_and_strings(path.read_text()))


def test_declared(path):
    # Files that `#[cfg(test)] mod x;` in `path` declares.
    names = re.findall(r"#\[cfg\(test\)\]\s*(?:pub(?:\([\w ]+\))?\s+)?mod\s+(\w+)\s*;", clean(path))
    base = path.parent if path.name in ("mod.rs", "lib.rs", "main.rs") else path.with_suffix("")
    return {q for n in names for q in (base / f"{n}.rs", base / n)}


def is_test_file(f):
    return f.name == "tests.rs" or f.name.endswith("_tests.rs")


def module_path(f):
    parts = list(f.relative_to(crate).with_suffix("").parts)
    return parts[:-1] if parts[-1] in ("mod", "lib", "main") else parts


WS, IDENT, SEP, SELF = re.compile(r"\s*"), re.compile(r"(r#)?(\w+)"), re.compile(r"\s*::\s*"), re.compile(r"self\b")


def parse_path(text, j, prefix, out):
    # Reads a path at text[j:] (just past `prefix::`), appending (segments, their offsets) for every
    # full path it names to `out`; `prefix` is a list of (segment, offset).
    while True:
        j = WS.match(text, j).end()
        if text.startswith("{", j):
            j += 1
            while True:
                j = WS.match(text, j).end()
                if j >= len(text) or text.startswith("}", j):
                    return j + 1
                if text.startswith(",", j):
                    j += 1
                    continue
                m = SELF.match(text, j)
                if m and not SEP.match(text, m.end()):
                    out.append(prefix)
                    j = m.end()
                else:
                    j = parse_path(text, j, prefix, out)
        m = IDENT.match(text, j)
        if not m:
            out.append(prefix)
            return j
        prefix, j = prefix + [(m.group(2), m.start(2))], m.end()
        m = SEP.match(text, j)
        if not m or text.startswith("<", m.end()):
            out.append(prefix)
            return j
        j = m.end()


def inline_modules(text):
    # (start, end, name) of every inline `mod x { ... }`.
    return [(m.end(), block_end(text, m.end()), m.group(1)) for m in re.finditer(r"\bmod\s+(\w+)\s*\{", text)]


def named_paths(f):
    """Yields (absolute module path, line of each of its segments) for every path the file names."""
    text = clean(f)
    here = module_path(f)
    inline = inline_modules(text)
    starts = [m.start() for m in re.finditer("\n", text)]

    def line(pos):
        return bisect.bisect_left(starts, pos) + 1

    for m in re.finditer(r"(?<![\w:])(crate|super|self)\s*::", text):
        found = []
        parse_path(text, m.end(), [(m.group(1), m.start())], found)
        scope = here + [name for (s, e, name) in inline if s <= m.start() < e]
        for p in found:
            if p[0][0] == "crate":
                resolved, rest = [], p[1:]
            else:
                resolved, rest = list(scope), p
                if rest[0][0] == "self":
                    rest = rest[1:]
                while rest and rest[0][0] == "super" and resolved:
                    resolved, rest = resolved[:-1], rest[1:]
            lines = [line(m.start())] * len(resolved) + [line(pos) for _, pos in rest]
            yield resolved + [name for name, _ in rest], lines


def tarjan(deps):
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

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return comps


sys.setrecursionlimit(10000)

# Every source file, less tests and the skipped modules.
test_files = set()
for f in crate.rglob("*.rs"):
    test_files |= test_declared(f)
sources = []
for f in sorted(crate.rglob("*.rs")):
    rel = f.relative_to(crate)
    if is_test_file(f) or any(t == f or t in f.parents for t in test_files):
        continue
    if skip & set(rel.with_suffix("").parts):
        continue
    sources.append(f)

# Directory modules at any depth below the root, with their children.
dirs = {}
for d in sorted(p for p in crate.rglob("*") if p.is_dir()):
    rel = d.relative_to(crate)
    if rel.parts[0] == "bin" or skip & set(rel.parts) or any(t == d or t in d.parents for t in test_files):
        continue
    if not ((d / "mod.rs").exists() or d.with_suffix(".rs").exists()):
        continue
    # Subfolders without Rust (CUDA sources, fonts) are no modules; `x/` beside `x.rs` is child x.
    kids = {p.stem for p in d.glob("*.rs") if p.name != "mod.rs"} | {p.name for p in d.iterdir() if (p / "mod.rs").exists()}
    kids = {k for k in kids if k not in skip and (d / f"{k}.rs") not in test_files and (d / k) not in test_files
            and not (k == "tests" or k.endswith("_tests"))}
    if not kids:
        continue
    dirs[tuple(rel.parts)] = kids

# Names the crate root re-exports (`pub use m::{A, B}`) stand for their module.
reexports = {}
for m in re.finditer(r"pub use (\w+)::(\{[^}]*\}|\w+);", strip_comments_and_strings((crate / "lib.rs").read_text())):
    for item in re.findall(r"\w+", m.group(2)):
        reexports[item] = m.group(1)

# levels[D] = {child: {sibling: [(file, line), ...]}}; D = () is the crate root.
levels = {(): {name: {} for name in modules if name not in skip}}
levels.update({d: {k: {} for k in kids} for d, kids in dirs.items()})
for f in sources:
    rel = f.relative_to(crate)
    here = module_path(f)
    top = rel.parts[0] if len(rel.parts) > 1 else rel.stem
    nested = rel.parts[0] != "bin" and rel.name != "main.rs"
    for p, lines in named_paths(f):
        if top in levels[()] and p:
            target = reexports.get(p[0], p[0])
            if target in levels[()] and target != top:
                levels[()][top].setdefault(target, []).append((f, lines[0]))
        if not nested:
            continue
        for k in range(1, len(here)):
            d = tuple(here[:k])
            if d in dirs and len(p) > k and tuple(p[:k]) == d and p[k] != here[k] and p[k] in dirs[d]:
                levels[d][here[k]].setdefault(p[k], []).append((f, lines[k]))

found = False
for d, deps in levels.items():
    graph = {v: sorted(deps[v]) for v in deps}
    comps = tarjan(graph)
    if d == ():
        order = [m for c in comps for m in c]
    for c in (c for c in comps if len(c) > 1):
        found = True
        where = "crate root" if d == () else "/".join(d) + "/"
        print(f"import circle in {where}:", " <-> ".join(c))
        for a in c:
            for b in graph[a]:
                if b in c:
                    refs = sorted(set(deps[a][b]))
                    spots = ", ".join(f"{f.relative_to(crate)}:{line}" for f, line in refs[:6])
                    more = f" (+{len(refs) - 6} more)" if len(refs) > 6 else ""
                    print(f"  {a} -> {b}: {spots}{more}")
if found:
    sys.exit(1)
print("no import circles; modules in dependency order:", " ".join(order))
print(f"no import circles inside {len(dirs)} directory modules")
