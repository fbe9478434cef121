"""Render graphs as text: a node table, Graphviz dot coloured by precision, and SVG (when the
``dot`` program is installed). The HTML report is :mod:`amprewrite.report_html`."""

from __future__ import annotations

import shutil
import subprocess

from torch import fx

from .views import graph_view

__all__ = ["COLORS", "color", "node_table", "to_dot", "to_svg"]

COLORS = {
    "low": "#9ecae1",  # blue: runs in bf16/fp16
    "fp32": "#fdae6b",  # orange: kept in fp32
    "cast": "#bdbdbd",  # grey: a cast amprewrite inserted
    "rewritten": "#a1d99b",  # green: made by a pass of kind REWRITE (passes.rewrite_passes)
    "promote": "#fff5eb",
    "neutral": "#f2f2f2",
}


def color(precision: str, rewritten: bool = False) -> str:
    """The fill colour of a node of class ``precision``; white for inputs, params, non-float."""
    if rewritten and precision != "cast":
        return COLORS["rewritten"]
    return COLORS.get(precision, "#ffffff")


def node_table(gm: fx.GraphModule, rewritten: set[str] = frozenset()) -> str:
    """One aligned text row per node: name, op, target, module, family, class, dtype, reason."""
    cols = ["name", "op", "target", "module", "family", "precision", "dtype"]
    view = graph_view(gm, rewritten)
    rows = [[str(getattr(v, "dtypes" if c == "dtype" else c)) for c in cols] + [v.reason]
            for v in view.nodes]
    head = [*cols[:5], "class", "dtype", "reason"]
    widths = [min(max([len(head[i])] + [len(r[i]) for r in rows]), 40) for i in range(len(cols))]
    return "\n".join("  ".join(c[:40].ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]
                     for r in [head, *rows])


def to_dot(gm: fx.GraphModule, title: str, rewritten: set[str] = frozenset()) -> str:
    """Graphviz source: data-flow edges, nodes filled by precision class."""
    lines = [f'digraph "{title}" {{', "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             f'  label="{title}"; labelloc=t;']
    view = graph_view(gm, rewritten)
    for v in view.nodes:
        text = f"{v.name}\\n{v.target}" + (f"\\n{v.dtypes}" if v.dtype else "")
        lines.append(f'  "{v.name}" [label="{_esc(text)}", '
                     f'fillcolor="{color(v.precision, v.rewritten)}"];')
    for v in view.nodes:
        for a in v.inputs:
            lines.append(f'  "{a}" -> "{v.name}";')
    lines.append("}")
    return "\n".join(lines)


def _esc(s: str) -> str:
    return s.replace('"', '\\"')


def to_svg(dot_source: str, timeout: float = 120) -> str | None:
    """SVG rendered by Graphviz's ``dot``, or None when it is not installed (or fails)."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "-Tsvg"], input=dot_source, capture_output=True, text=True,
                              timeout=timeout, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    svg = done.stdout
    return svg[svg.find("<svg"):] if "<svg" in svg else None
