#!/usr/bin/env python3
"""Checks the relative links of the book (docs/src/*.md) and of README.md: every linked file
exists, every `#anchor` names a heading of its target page, and every `{{#include FILE}}` exists.

mdbook build warns about a missing include but does not fail, and checks no link at all; this
script fails instead, naming each broken link. Anchors are derived from headings as mdBook does
(lowercase; spaces to `-`; only letters, digits, `-` and `_` kept; a repeated id gets `-1`, ...).

Usage: python3 scripts/check-book-links.py   (from the repository root; exit 1 on a broken link)
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INCLUDE = re.compile(r"\{\{#include ([^}\s]+)\s*\}\}")


def without_code(text):
    """The text outside fenced code blocks and inline code spans."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def expanded(path):
    """The page's text with its `{{#include}}`s replaced by the files they name."""
    text = path.read_text()
    return INCLUDE.sub(lambda m: (path.parent / m.group(1)).read_text(), text)


def anchors(path):
    """The ids mdBook gives the headings of `path`."""
    ids, seen, fenced = set(), {}, False
    for line in expanded(path).split("\n"):
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6} (.*)", line)
        if fenced or not m:
            continue
        title = re.sub(r"`", "", m.group(1)).strip()
        base = "".join(
            c if c.isalnum() or c in "-_" else ("-" if c.isspace() else "")
            for c in title.lower()
        )
        n = seen.get(base, 0)
        seen[base] = n + 1
        ids.add(base if n == 0 else f"{base}-{n}")
    return ids


def check(page):
    problems = []
    text = page.read_text()
    for m in INCLUDE.finditer(text):
        if not (page.parent / m.group(1)).is_file():
            problems.append(f"{page.relative_to(ROOT)}: include of a missing file {m.group(1)}")
    for m in LINK.finditer(without_code(text)):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            problems.append(f"{page.relative_to(ROOT)}: link to a missing file {target}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{page.relative_to(ROOT)}: link to a missing heading {target}")
    return problems


def main():
    pages = sorted((ROOT / "docs" / "src").rglob("*.md")) + [ROOT / "README.md"]
    problems = [p for page in pages for p in check(page)]
    for p in problems:
        print(p, file=sys.stderr)
    print(f"book links: {len(pages)} pages checked, {len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
