"""Render graphs for people: a node table, Graphviz dot coloured by precision, SVG (when the
``dot`` program is installed) and one self-contained HTML page with before and after."""

from __future__ import annotations

import html
import shutil
import subprocess

from torch import fx

from . import meta as M

__all__ = ["COLORS", "graph_html", "node_rows", "node_table", "to_dot", "to_svg"]

COLORS = {
    "low": "#9ecae1",  # blue: runs in bf16/fp16
    "fp32": "#fdae6b",  # orange: kept in fp32
    "cast": "#d9d9d9",  # grey: a cast amprewrite inserted
    "rewritten": "#a1d99b",  # green: made by a pass of kind REWRITE (passes.rewrite_passes)
    "promote": "#ffffff",
    "neutral": "#f7f7f7",
    "nonfloat": "#ffffff",
    "": "#ffffff",
}


def _target(n: fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def node_rows(gm: fx.GraphModule, rewritten: set[str] = frozenset()) -> list[dict[str, str]]:
    """One dict per node: name, op, target, module, family, class, dtype, reason, colour key."""
    rows = []
    for n in gm.graph.nodes:
        cls = n.meta.get(M.CLASS)
        label = n.meta.get(M.LABEL)
        kind = "cast" if M.CAST in n.meta else ("rewritten" if n.name in rewritten else (
            cls.value if cls is not None else ""))
        dtype = {M.HIGH: "float32", M.LOW: "low"}.get(label, "")
        if M.CAST in n.meta:
            dtype = str(n.meta[M.CAST]).replace("torch.", "")
        rows.append({"name": n.name, "op": n.op, "target": _target(n),
                     "module": n.meta.get(M.MODULE_PATH, ""), "family": n.meta.get(M.FAMILY) or "",
                     "class": cls.value if cls is not None else "", "dtype": dtype,
                     "reason": n.meta.get(M.REASON, ""), "kind": kind})
    return rows


def node_table(gm: fx.GraphModule, rewritten: set[str] = frozenset()) -> str:
    cols = ["name", "op", "target", "module", "family", "class", "dtype", "reason"]
    rows = node_rows(gm, rewritten)
    widths = {c: min(max([len(c)] + [len(r[c]) for r in rows]), 40) for c in cols[:-1]}
    out = ["  ".join(c.ljust(widths[c]) for c in cols[:-1]) + "  reason"]
    for r in rows:
        out.append("  ".join(r[c][:40].ljust(widths[c]) for c in cols[:-1]) + "  " + r["reason"])
    return "\n".join(out)


def to_dot(gm: fx.GraphModule, title: str, rewritten: set[str] = frozenset()) -> str:
    """Graphviz source: data-flow edges, nodes filled by precision class."""
    lines = [f'digraph "{title}" {{', "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             f'  label="{title}"; labelloc=t;']
    for r in node_rows(gm, rewritten):
        text = f"{r['name']}\\n{r['target']}" + (f"\\n{r['dtype']}" if r["dtype"] else "")
        lines.append(f'  "{r["name"]}" [label="{_esc(text)}", fillcolor="{COLORS[r["kind"]]}"];')
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            lines.append(f'  "{a.name}" -> "{n.name}";')
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


def _legend() -> str:
    return " ".join(f'<span class="chip" style="background:{COLORS[k]}">{k}</span>'
                    for k in ("low", "fp32", "cast", "rewritten"))


def _panel(title: str, gm: fx.GraphModule, svg: str | None, rewritten: set[str]) -> str:
    rows = "".join(
        f'<tr style="background:{COLORS[r["kind"]]}">' + "".join(
            f"<td>{html.escape(r[c])}</td>" for c in ("name", "target", "module", "class",
                                                      "dtype", "reason")) + "</tr>"
        for r in node_rows(gm, rewritten))
    picture = f'<div class="svg">{svg}</div>' if svg else ""
    return (f'<section><h2>{html.escape(title)}</h2>{picture}'
            f"<details><summary>code</summary><pre>{html.escape(gm.code)}</pre></details>"
            "<table><tr><th>node</th><th>target</th><th>module</th><th>class</th><th>dtype</th>"
            f"<th>reason</th></tr>{rows}</table></section>")


def graph_html(before: fx.GraphModule, after: fx.GraphModule, report_text: str,
               svgs: tuple[str | None, str | None] = (None, None),
               rewritten: set[str] = frozenset(), title: str = "amprewrite") -> str:
    """One self-contained page: the graph before and after side by side, and the report."""
    style = ("body{font-family:Helvetica,Arial,sans-serif;margin:1em}"
             ".cols{display:flex;gap:1em;align-items:flex-start}section{flex:1;min-width:0}"
             "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;"
             "padding:2px 4px;text-align:left}pre{font-size:11px;overflow:auto}"
             ".svg{overflow:auto;max-height:80vh;border:1px solid #ddd}"
             ".chip{padding:2px 6px;border:1px solid #999;margin-right:4px}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>{_legend()}</p><div class='cols'>"
            f"{_panel('before', before, svgs[0], set())}"
            f"{_panel('after', after, svgs[1], rewritten)}</div>"
            f"<h2>report</h2><pre>{html.escape(report_text)}</pre></body></html>")
