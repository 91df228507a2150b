#!/usr/bin/env python3
"""One floor each: fails when the crate's top-level modules import each other in a circle.

A top-level module is a file or a folder directly under src/ (`src/metrics.rs`,
`src/server.rs` with `src/server/`, `src/source/`). Module A depends on module B when any
file of A names `crate::B` (a `use` line, a grouped `use crate::{B, ...}`, or a path in
the code; comments are left out, tests are not). The graph must have no cycle: the metric
families sit below everything that counts, the exposition with the server above them
(docs/architecture.md). On a circle, prints it with one place in the code for each of its
imports, and exits 1.

    scripts/check-imports.py            check
    scripts/check-imports.py --floors   also print the modules floor by floor, lowest first
"""

import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"
IDENT = r"[a-z_][a-z0-9_]*"


def strip_comments(text):
    """The code without `//` comments (doc comments included) and `/* */` blocks."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def grouped(text, start):
    """The first names of the items of the `{...}` group opening at `start`."""
    depth, end = 0, start
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                break
    items, depth, current = [], 0, ""
    for c in text[start + 1 : end]:
        depth += c == "{"
        depth -= c == "}"
        if c == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += c
    items.append(current)
    return [m.group(0) for m in (re.match(IDENT, i.strip()) for i in items) if m]


def imports():
    """{module: {module it imports: [file:line, ...]}}."""
    edges = defaultdict(lambda: defaultdict(list))
    modules = set()
    for path in sorted(ROOT.rglob("*.rs")):
        rel = path.relative_to(ROOT)
        top = rel.parts[0].removesuffix(".rs")
        if top in ("lib", "main"):
            continue  # the crate's root and the binary: above every module
        modules.add(top)
        text = strip_comments(path.read_text())

        def add(name, at):
            if name not in (top, "self", "super"):
                line = text.count("\n", 0, at) + 1
                edges[top][name].append(f"src/{rel}:{line}")

        for m in re.finditer(rf"(?<![\w$])crate::({IDENT})", text):
            add(m.group(1), m.start())
        for m in re.finditer(r"(?<![\w$])crate::\{", text):
            for name in grouped(text, m.end() - 1):
                add(name, m.start())
    return modules, edges


def cycle(edges):
    """A circle of modules, as a list whose last element is its first; None if there is none."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def floors(modules, edges):
    """The modules by floor: each imports only modules of lower floors."""
    floor = {}

    def height(node):
        if node not in floor:
            floor[node] = 0
            floor[node] = 1 + max((height(n) for n in edges.get(node, ()) if n in modules), default=-1)
        return floor[node]

    by_floor = defaultdict(list)
    for node in modules:
        by_floor[height(node)].append(node)
    return [sorted(by_floor[f]) for f in sorted(by_floor)]


def main():
    modules, edges = imports()
    circle = cycle(edges)
    if circle:
        print("check-imports: the top-level modules of src/ import each other in a circle:", file=sys.stderr)
        print("  " + " -> ".join(circle), file=sys.stderr)
        for a, b in zip(circle, circle[1:]):
            places = edges[a][b]
            more = f" (and {len(places) - 1} more)" if len(places) > 1 else ""
            print(f"  {a} imports {b} at {places[0]}{more}", file=sys.stderr)
        print("Move what the lower module needs down, or what depends on the upper one up.", file=sys.stderr)
        return 1
    if "--floors" in sys.argv[1:]:
        for number, names in enumerate(floors(modules, edges)):
            print(f"{number}: {' '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
