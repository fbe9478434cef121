"""The HTML report: one self-contained page that starts with the answer.

Top to bottom: a summary (ops by class, casts and the bytes they move, rewrites, the largest fp32
regions, errors when ``amprewrite check`` ran), a per-module table (low / fp32 / casts per
module, collapsible by depth), then the graph, collapsed by module and expandable, with search,
before and after. The page has no dependency: the data is JSON in the page and a small script
draws it, so a 5,000-node graph opens with only its top-level modules laid out.

>>> import torch, amprewrite
>>> from amprewrite.show.html import report_page
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softmax(-1))
>>> x = (torch.randn(2, 8),)
>>> gm = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=x)
>>> from amprewrite.capture.trace import capture
>>> page = report_page(capture(model, x).gm, gm, title="mlp")
>>> page.startswith("<!DOCTYPE html>") and 'id="amp-data"' in page
True
"""

from __future__ import annotations

import html
import json
import math
from importlib import resources

from torch import fx

from .render import COLORS
from .views import GraphView, before_after, module_rows, summary

__all__ = ["page_data", "report_page"]

def _finite(x: object) -> object:
    """JSON has no inf/NaN: they travel as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _graph_data(view: GraphView) -> dict:
    return {
        "groups": view.groups, "parents": view.parents,
        "nodes": [{"n": v.name, "o": v.op, "t": v.target, "m": v.module, "g": v.group,
                   "f": v.family, "p": v.precision, "d": v.dtypes, "r": v.reason, "s": v.source,
                   "sh": v.shape, "b": v.nbytes, "i": list(v.inputs),
                   **({"w": 1} if v.rewritten else {}),
                   **({"e": v.error} if v.error is not None else {})} for v in view.nodes]}


def page_data(before: fx.GraphModule, after: fx.GraphModule, rewritten: set[str] | None = None,
              check: object | None = None, title: str = "amprewrite",
              report_text: str = "") -> dict:
    """Everything the page shows, as JSON-ready data (non-finite floats as strings)."""
    before_view, after_view = before_after(before, after, rewritten, check)
    # The captured graph shows the class its node got in the transformed graph (same names).
    classes = {v.name: v.precision for v in after_view.nodes}
    before_nodes = _graph_data(before_view)
    for row in before_nodes["nodes"]:
        row["p"] = classes.get(row["n"], "")
    return _finite({
        "title": title, "summary": summary(after, after_view, check),
        "modules": [vars(r) for r in module_rows(after_view)],
        "graphs": {"after": _graph_data(after_view), "before": before_nodes},
        "colors": COLORS, "report": report_text})


def report_page(before: fx.GraphModule, after: fx.GraphModule, rewritten: set[str] | None = None,
                check: object | None = None, title: str = "amprewrite",
                report_text: str = "") -> str:
    """The self-contained HTML page for ``before`` (captured) and ``after`` (transformed)."""
    data = json.dumps(page_data(before, after, rewritten, check, title, report_text),
                      separators=(",", ":")).replace("</", "<\\/")
    assets = resources.files("amprewrite") / "assets"
    style = (assets / "report.css").read_text()
    script = (assets / "report.js").read_text()
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title><style>{style}</style></head><body>"
            f'<script type="application/json" id="amp-data">{data}</script>'
            f'<div id="app"><noscript>This report needs JavaScript; report.txt next to it has '
            f"the same decisions as text.</noscript></div><script>{script}</script></body></html>")
