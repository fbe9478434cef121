"""What the graph views show, computed once: one row per node, the module tree, the summary.

The HTML report (:mod:`amprewrite.show.html`) and the Model Explorer export
(:mod:`amprewrite.show.explorer`) both read these, so their numbers agree with each other and with
:func:`amprewrite.report`.

>>> import torch, amprewrite
>>> from amprewrite.show.views import graph_view, summary
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softmax(-1))
>>> gm = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=(torch.randn(2, 8),))
>>> view = graph_view(gm)
>>> [v.precision for v in view.nodes if v.family in ("linear", "softmax")]
['low', 'fp32']
>>> summary(gm, view)["counts"]["low"] == amprewrite.report(gm).counts()["low"]
True
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import fx

from ..graph import meta as M
from ..precision.report import REPORT_KEY, Report

__all__ = ["GraphView", "ModuleRow", "NodeView", "before_after", "graph_view", "module_rows",
           "namespace", "rewritten_nodes", "summary"]

OP_NODES = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class NodeView:
    """One node as the views show it."""

    name: str
    op: str
    target: str
    module: str  # dotted module path; "" is the model itself
    group: int  # index into GraphView.groups of the innermost module group
    family: str
    precision: str  # the report's class (low, fp32, cast, param, ...); "" before the passes
    dtype: str  # the dtype the value is computed in ("bfloat16", "float32"); "" if not float
    reason: str
    source: str
    shape: str  # "2x32x16x16"; "" when unknown or not a tensor
    nbytes: int | None  # bytes of the value as stored (``storage``); None when unknown
    inputs: tuple[str, ...]
    rewritten: bool = False
    error: float | None = None  # relative error against the fp32 graph (amprewrite check)
    # The dtype the value is stored in: differs from ``dtype`` for an fp32 op that reads and
    # writes the low dtype (a norm after a conv); "" if not float.
    storage: str = ""

    @property
    def dtypes(self) -> str:
        """``dtype``, or ``compute->storage`` where they differ (``float32->bfloat16``)."""
        return self.dtype if self.storage in ("", self.dtype) else f"{self.dtype}->{self.storage}"


@dataclass
class GraphView:
    """The nodes of one graph and the module groups they sit in (group 0 is the model)."""

    nodes: list[NodeView]
    groups: list[str] = field(default_factory=list)  # module paths, parents before children
    parents: list[int] = field(default_factory=list)  # parent group index; -1 for group 0


def levels(path: str) -> list[str]:
    """The module groups enclosing ``path``, outermost first; a numeric part stays with its
    container so ``layers.0`` is one level.

    >>> levels("model.layers.0.self_attn")
    ['model', 'model.layers.0', 'model.layers.0.self_attn']
    """
    if not path:
        return []
    parts: list[str] = []
    for part in path.split("."):
        if parts and re.fullmatch(r"\d+", part):
            parts[-1] += "." + part
        else:
            parts.append(part)
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def namespace(path: str) -> str:
    """Model Explorer's namespace for a module path: one level per group, joined by "/".

    >>> namespace("model.layers.0.self_attn")
    'model/layers.0/self_attn'
    """
    out, prev = [], ""
    for level in levels(path):
        out.append(level[len(prev):].lstrip("."))
        prev = level
    return "/".join(out)


def _dtype_name(dtype: object) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else ""


def _nbytes(info: M.ValueInfo, dtype: str) -> int | None:
    if info.kind != "tensor" or info.numel is None or not dtype:
        return None
    return info.numel * getattr(torch, dtype).itemsize


def _target(n: fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def rewritten_nodes(gm: fx.GraphModule) -> set[str]:
    """Nodes of ``gm`` that a rewrite pass made (a re-rolled loop, an upsample subgraph), casts
    aside: the ones the views draw green."""
    from ..passes import rewrite_passes

    rewrites = rewrite_passes()
    rep: Report | None = getattr(gm, "meta", {}).get(REPORT_KEY)
    named = {r.node for r in rep.rewrites if r.pass_name in rewrites} if rep else set()
    return {n.name for n in gm.graph.nodes if M.CAST not in n.meta and (
        n.name in named or n.meta.get(M.MADE_BY) in rewrites)}


def graph_view(gm: fx.GraphModule, rewritten: set[str] = frozenset(),
               errors: dict[str, float] | None = None) -> GraphView:
    """The rows of ``gm``'s nodes. Classes, dtypes and reasons come from the report when ``gm``
    was transformed; a captured graph shows its fp32 dtypes and no class."""
    rep: Report | None = getattr(gm, "meta", {}).get(REPORT_KEY)
    decided = {d.node: d for d in rep.decisions} if rep is not None else {}
    errors = errors or {}
    groups, parents, index = [""], [-1], {"": 0}

    def group_of(path: str) -> int:
        parent = 0
        for level in levels(path):
            if level not in index:
                index[level] = len(groups)
                groups.append(level)
                parents.append(parent)
            parent = index[level]
        return parent

    nodes = []
    for n in gm.graph.nodes:
        info = n.meta.get(M.ORIG, M.UNKNOWN_TENSOR)
        d = decided.get(n.name)
        if d is not None:
            precision, dtype, reason = d.precision, _dtype_name(d.dtype), d.reason
            storage = _dtype_name(d.storage) if d.storage is not None else dtype
        else:
            precision, reason = "", n.meta.get(M.REASON, "")
            dtype = _dtype_name(info.dtype) if info.dtype is not None and (
                info.dtype.is_floating_point) else ""
            storage = dtype
        module = n.meta.get(M.MODULE_PATH, "")
        shape = ("x".join("?" if s is None else str(s) for s in info.shape)
                 if info.kind == "tensor" and info.shape is not None else "")
        nodes.append(NodeView(
            name=n.name, op=n.op, target=_target(n), module=module, group=group_of(module),
            family=(n.meta.get(M.FAMILY) or "") if d is None else (d.family or ""),
            precision=precision, dtype=dtype, reason=reason, source=M.source_line(n) or "",
            shape=shape, nbytes=_nbytes(info, storage),
            inputs=tuple(a.name for a in n.all_input_nodes), rewritten=n.name in rewritten,
            error=errors.get(n.name), storage=storage))
    return GraphView(nodes, groups, parents)


def before_after(before: fx.GraphModule, after: fx.GraphModule,
                 rewritten: set[str] | None = None,
                 check: object | None = None) -> tuple[GraphView, GraphView]:
    """The views of the captured and the transformed graph, with the per-node errors of
    ``check`` (a :class:`~amprewrite.CheckResult`) and, by default, the nodes rewrite passes
    made marked."""
    errors = ({r.node: r.rel_err for r in check.nodes if r.rel_err is not None}
              if check is not None else None)
    if rewritten is None:
        rewritten = rewritten_nodes(after)
    return graph_view(before, errors=errors), graph_view(after, rewritten, errors)


@dataclass(frozen=True)
class ModuleRow:
    """Totals of one module (its own nodes and its submodules')."""

    path: str
    depth: int
    group: int
    ops: int  # call nodes, casts included
    low: int
    fp32: int
    casts: int
    cast_bytes: int
    fp32_bytes: int  # bytes of the values computed in float32 by op nodes (casts excluded)
    max_error: float | None


def module_rows(view: GraphView) -> list[ModuleRow]:
    """One row per module group, in tree order (a parent before its children)."""
    n_groups = len(view.groups)
    tot = [[0, 0, 0, 0, 0, 0] for _ in range(n_groups)]
    err: list[float | None] = [None] * n_groups
    for v in view.nodes:
        if v.op not in OP_NODES:
            continue
        is_cast = v.precision == "cast"
        row = (1, v.precision == "low", v.precision == "fp32", is_cast,
               (v.nbytes or 0) if is_cast else 0,
               (v.nbytes or 0) if v.storage == "float32" and not is_cast else 0)
        g = v.group
        while g >= 0:
            tot[g] = [a + int(b) for a, b in zip(tot[g], row)]
            if v.error is not None and v.error == v.error:  # NaN is not an error figure
                err[g] = v.error if err[g] is None else max(err[g], v.error)
            g = view.parents[g]
    children: list[list[int]] = [[] for _ in range(n_groups)]
    for g in range(1, n_groups):
        children[view.parents[g]].append(g)
    out: list[ModuleRow] = []

    def walk(g: int, depth: int) -> None:
        out.append(ModuleRow(view.groups[g], depth, g, *tot[g], err[g]))
        for c in children[g]:
            walk(c, depth + 1)

    walk(0, 0)
    return out


def fp32_regions(view: GraphView, top: int = 5) -> list[dict[str, object]]:
    """Connected regions of op nodes computed in float32 in a transformed graph, largest first by
    the bytes of the values they produce."""
    fp32 = {v.name: v for v in view.nodes
            if v.op in OP_NODES and v.dtype == "float32" and v.precision not in ("cast", "")}
    parent = {name: name for name in fp32}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for v in fp32.values():
        for a in v.inputs:
            if a in fp32:
                parent[find(a)] = find(v.name)
    regions: dict[str, list[NodeView]] = {}
    for name, v in fp32.items():
        regions.setdefault(find(name), []).append(v)
    rows = []
    for members in regions.values():
        modules: dict[str, int] = {}
        families: dict[str, int] = {}
        for v in members:
            modules[v.module] = modules.get(v.module, 0) + 1
            if v.family:
                families[v.family] = families.get(v.family, 0) + 1
        rows.append({"bytes": sum(v.nbytes or 0 for v in members), "ops": len(members),
                     "first": members[0].name,
                     "modules": sorted(modules, key=lambda m: -modules[m])[:3],
                     "families": sorted(families, key=lambda f: -families[f])[:4],
                     "reason": next((v.reason for v in members if v.precision == "fp32"), "")})
    rows.sort(key=lambda r: (-int(r["bytes"]), -int(r["ops"])))
    return rows[:top]


def summary(gm: fx.GraphModule, view: GraphView, check: object | None = None) -> dict:
    """The numbers the report page starts with. ``check`` is a :class:`~amprewrite.CheckResult`.

    ``counts`` and ``casts`` are :func:`amprewrite.report`'s own figures.
    """
    rep: Report = gm.meta[REPORT_KEY]
    casts = [v for v in view.nodes if v.precision == "cast"]
    out: dict[str, object] = {
        "dtype": rep.dtype, "capture": rep.capture, "nodes": len(view.nodes),
        "counts": rep.counts(), "casts": len(rep.casts),
        "cast_bytes": sum(v.nbytes or 0 for v in casts),
        "cast_bytes_unknown": sum(v.nbytes is None for v in casts),
        "rewrites": [{"pass": r.pass_name, "node": r.node, "action": r.action,
                      "reason": r.reason, "module": r.module_path}
                     for r in rep.rewrites if not r.action.startswith("cast")],
        "fp32_regions": fp32_regions(view), "notes": list(rep.notes),
    }
    if check is not None:
        worst = [r for r in check.nodes if r.rel_err is not None and r.precision not in (
            "placeholder", "get_attr", "input", "param")][:10]
        first = check.first_nonfinite
        out["check"] = {
            "output_error": check.output_error, "finite": check.finite,
            "first_nonfinite": None if first is None else first.node,
            "worst": [{"node": r.node, "error": r.rel_err, "precision": r.precision,
                       "family": r.family or "", "module": r.module_path} for r in worst]}
    return out
