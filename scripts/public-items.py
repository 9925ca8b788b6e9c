#!/usr/bin/env python3
"""Counts the public items a user of a crate can reach from its root, from rustdoc's JSON.

Method: build the crate's rustdoc JSON with nightly (`cargo +nightly rustdoc -p CRATE --lib --
-Z unstable-options --output-format json`; without `--document-private-items`, so the index
holds what the crate exports), then walk it from the root module:

- a module's items are followed; a `pub use` is followed to what it names (a glob to every
  item of the module it names), so an item re-exported at the root and reachable through its
  module too is counted once (items are counted by id);
- each reachable item that is public counts once: modules (the root excluded), structs, enums
  and their variants, unions, traits and their associated items, functions, constants, statics,
  type aliases, macros, and public fields of structs and variants;
- for a struct, enum or union, the public associated items (methods, constants, types) of its
  inherent impls count too;
- each item is also grouped by where a user first reaches it: under one of the root's public
  modules (`data::`, `comm::`, ...), or at the root (an item re-exported there, with its
  members). Trait impls (`impl Display for X`, blanket and auto-trait impls) do
  not: their methods are the trait's, counted with the trait if it is the crate's own.

Items of other crates that the crate re-exports are not in its index and are not counted.

Usage:
  scripts/public-items.py [CRATE] [--json PATH] [--methods TYPE ...] [--list]
    CRATE       the package (default accelerate-core); its JSON is built unless --json is given
    --json      read this rustdoc JSON instead of building it
    --methods   also print the public inherent methods of each TYPE (a path such as Accelerator)
    --list      print every counted item's path and kind
"""
import json
import os
import pathlib
import subprocess
import sys
from collections import Counter


def build_json(package):
    subprocess.run(
        ["cargo", "+nightly", "rustdoc", "-p", package, "--lib", "--", "-Z",
         "unstable-options", "--output-format", "json"],
        check=True,
    )
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", "target"))
    return target / "doc" / (package.replace("-", "_") + ".json")


def is_public(item):
    return item.get("visibility") == "public"


def kind_of(item):
    inner = item.get("inner") or {}
    return next(iter(inner), "unknown") if isinstance(inner, dict) else str(inner)


def count(doc, methods_of=(), listing=False):
    index = doc["index"]
    root = str(doc["root"])
    seen = set()
    counted = Counter()
    by_place = Counter()
    top_modules = {
        index[str(c)]["name"]
        for c in index[root]["inner"]["module"]["items"]
        if str(c) in index and kind_of(index[str(c)]) == "module" and is_public(index[str(c)])
    }
    lines = []
    methods = {name: [] for name in methods_of}

    def record(item_id, path, kind):
        counted[kind] += 1
        # Grouped by where a user reaches it: a public module of the root, or the root itself.
        first = path[0] if path else ""
        place = first if first in top_modules else "(root)"
        if kind == "module" and len(path) == 1:
            place = first
        by_place[place] += 1
        if listing:
            lines.append(f"{kind:14} {'::'.join(path)}")

    def walk(item_id, path):
        item_id = str(item_id)
        if item_id in seen or item_id not in index:
            return
        item = index[item_id]
        kind = kind_of(item)
        inner = item["inner"][kind] if isinstance(item.get("inner"), dict) else {}
        if kind == "use":
            # A re-export: what it names is reachable; the `use` itself is not an item.
            target = inner.get("id")
            if target is None:
                return
            if inner.get("is_glob"):
                tgt = index.get(str(target))
                if tgt and kind_of(tgt) == "module":
                    for child in tgt["inner"]["module"]["items"]:
                        walk(child, path)
                return
            name = inner.get("name")
            walk(target, path + [name] if name else path)
            return
        seen.add(item_id)
        if not is_public(item) and item_id != root and kind not in ("variant", "impl"):
            return
        name = item.get("name")
        here = path + [name] if name and item_id != root else path
        if kind == "module":
            if item_id != root:
                record(item_id, here, kind)
            for child in inner.get("items", []):
                walk(child, here)
        elif kind in ("struct", "enum", "union"):
            record(item_id, here, kind)
            if kind == "struct":
                fields = (inner.get("kind") or {})
                plain = fields.get("plain") if isinstance(fields, dict) else None
                for field in (plain or {}).get("fields", []):
                    walk(field, here)
            if kind == "enum":
                for variant in inner.get("variants", []):
                    walk(variant, here)
            if kind == "union":
                for field in inner.get("fields", []):
                    walk(field, here)
            for impl_id in inner.get("impls", []):
                impl = index.get(str(impl_id))
                if impl is None:
                    continue
                body = impl["inner"]["impl"]
                if body.get("trait") is not None or body.get("is_synthetic") \
                        or body.get("blanket_impl") is not None:
                    continue
                for assoc in body.get("items", []):
                    a = index.get(str(assoc))
                    if a is None or not is_public(a):
                        continue
                    if str(assoc) in seen:
                        continue
                    seen.add(str(assoc))
                    record(assoc, here + [a.get("name")], "method" if kind_of(a) == "function"
                           else "assoc_" + kind_of(a))
                    if name in methods and kind_of(a) == "function":
                        methods[name].append(a.get("name"))
        elif kind == "variant":
            record(item_id, here, kind)
            vkind = inner.get("kind") or {}
            if isinstance(vkind, dict):
                for key in ("tuple", "struct"):
                    body = vkind.get(key)
                    if isinstance(body, dict):
                        for field in body.get("fields", []):
                            walk(field, here)
                    elif isinstance(body, list):
                        for field in body:
                            if field is not None:
                                walk(field, here)
        elif kind == "trait":
            record(item_id, here, kind)
            for assoc in inner.get("items", []):
                a = index.get(str(assoc))
                if a is not None and str(assoc) not in seen:
                    seen.add(str(assoc))
                    record(assoc, here + [a.get("name")], "trait_" + kind_of(a))
        elif kind == "struct_field":
            record(item_id, here, "field")
        elif kind == "impl":
            return
        else:
            # function, constant, static, type_alias, macro, trait_alias, ...
            record(item_id, here, kind)

    walk(root, [])
    return counted, by_place, lines, methods


def main():
    args = sys.argv[1:]
    package, json_path, methods_of, listing = "accelerate-core", None, [], False
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--json":
            json_path = args[i + 1]
            i += 1
        elif a == "--methods":
            while i + 1 < len(args) and not args[i + 1].startswith("--"):
                methods_of.append(args[i + 1])
                i += 1
        elif a == "--list":
            listing = True
        elif a in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            package = a
        i += 1
    path = pathlib.Path(json_path) if json_path else build_json(package)
    doc = json.loads(path.read_text())
    counted, by_place, lines, methods = count(doc, methods_of, listing)
    for line in sorted(lines):
        print(line)
    total = sum(counted.values())
    print(f"{total} public items reachable from {package}'s root")
    for kind, n in sorted(counted.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {kind}: {n}")
    print("by where they are reached (the root's own items and their members, or a module):")
    for place, n in sorted(by_place.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {place}: {n}")
    for name, found in methods.items():
        print(f"{name}: {len(found)} public inherent methods")
        print("  " + " ".join(sorted(found)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
