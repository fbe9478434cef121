"""The package's layers, read from its imports: the rule tests/test_layout.py checks, and the
picture in docs/architecture.md, regenerated from the code.

    python -m tools.architecture          # rewrite the picture in docs/architecture.md
    python -m tools.architecture --check  # exit 1 when the page's picture is stale

Every import counts, the ones inside functions and under ``TYPE_CHECKING`` too: a lazy import
that runs back up is a cycle waiting for the day it runs at import time.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "amprewrite"
PAGE = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- begin: python -m tools.architecture -->"
END = "<!-- end: python -m tools.architecture -->"

# Bottom to top. A module may import what stands on a lower layer and its own folder. Two
# names on one layer are siblings that may not import each other, except on the layers in
# OPEN: the base every stage uses, and the faces.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "progress"),  # base: import nothing of amprewrite but each other
    ("graph",),
    ("precision",),
    ("capture",),
    ("passes",),
    ("api",),
    ("compile", "deploy", "show"),  # siblings: none imports another
    ("trainers",),
    ("cli", "demo", "__init__", "__main__"),  # faces
    ("testing",),  # the zoo and harnesses, above all that they exercise
]
OPEN = {0, 8}

Edge = tuple[str, str, int]  # importer, imported, line


def part(module: str) -> str:
    """The folder or top-level module a module belongs to: 'amprewrite.graph.meta' -> 'graph'.

    >>> part("amprewrite.graph.meta"), part("amprewrite.api"), part("amprewrite")
    ('graph', 'api', '__init__')
    """
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def rank(name: str) -> int:
    for i, names in enumerate(LAYERS):
        if name in names:
            return i
    raise ValueError(
        f"amprewrite/{name} is on no layer of tools/architecture.py: put it on the layer its "
        "imports allow and say in docs/architecture.md what it is for")


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(mods: dict[str, Path]) -> list[Edge]:
    """(importer, imported, line) for every import of a package module, lazy ones included."""
    edges = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges += [(name, t, node.lineno) for t in targets if t in mods and t != name]
    return edges


def upward(edges: list[Edge]) -> list[str]:
    """The imports that run up a layer or across to a sibling, one readable line each."""
    bad = []
    for src, dst, line in edges:
        a, b = part(src), part(dst)
        if a == b:
            continue
        ra, rb = rank(a), rank(b)
        if rb > ra or (rb == ra and ra not in OPEN):
            bad.append(f"{src} (line {line}) imports {dst}: {a} is on layer {ra}, {b} on {rb}")
    return bad


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Groups of more than one module that import each other in a loop (Tarjan's algorithm).

    >>> cycles([("a", "b", 1), ("b", "a", 2), ("b", "c", 3)])
    [['a', 'b']]
    """
    graph: dict[str, set[str]] = {}
    for src, dst, _ in edges:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def picture(mods: dict[str, Path], edges: list[Edge]) -> str:
    """The layers as a table (the files of each part) and the part-to-part imports as a
    Mermaid graph, top layer first. Only structure, no sizes: the page changes when a file or
    an import between parts does."""
    files_of: dict[str, list[str]] = {}
    for name, path in mods.items():
        files_of.setdefault(part(name), []).append(path.relative_to(PACKAGE).as_posix())
    out = ["| layer | part | files |", "|---|---|---|"]
    for i in reversed(range(len(LAYERS))):
        for name in LAYERS[i]:
            if name not in files_of:
                continue
            shown = ", ".join(f"`{f}`" for f in files_of[name])
            out.append(f"| {i} | `{name}` | {shown} |")
    pairs = sorted({(part(s), part(d)) for s, d, _ in edges if part(s) != part(d)},
                   key=lambda p: (-rank(p[0]), p[0], -rank(p[1]), p[1]))
    node = {name: name.strip("_") or name for names in LAYERS for name in names}
    out += ["", "```mermaid", "flowchart TD"]
    out += [f"  {node[a]} --> {node[b]}" for a, b in pairs]
    out += ["```", "",
            f"{len(mods)} modules in {len({p for p in files_of if (PACKAGE / p).is_dir()})} "
            f"folders; {len(upward(edges))} imports running up a layer or across, "
            f"{len(cycles(edges))} cycles."]
    return "\n".join(out)


def section() -> str:
    mods = modules()
    return f"{BEGIN}\n{picture(mods, imports(mods))}\n{END}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when docs/architecture.md's picture is not the code's")
    args = parser.parse_args(argv)
    text = PAGE.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + section() + text[end:]
    if args.check:
        if new != text:
            print("docs/architecture.md is stale: run python -m tools.architecture",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    print(section())
    return 0


if __name__ == "__main__":
    sys.exit(main())
