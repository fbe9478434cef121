"""vectorize_loops: per-sample Python loops that dynamo unrolled become one batched op.

Matches (dynamo's unrolling of ``torch.stack([T[i][I[i]] for i in range(B)])``)::

    t0 = T[0]; i0 = I[0]; r0 = t0[i0]
    t1 = T[1]; i1 = I[1]; r1 = t1[i1]
    ...
    out = torch.stack([r0, r1, ...])           # or torch.cat([r0[None], r1[None], ...], 0)

Rewrite to: ``out = batch_index(T, I)``, i.e. ``T[arange(T.size(0)).view(-1, 1..), I]``.

The batch-gather family (``T[i][I[i]]``, ``T[i, I[i]]``, ``T[i].index_select(0, I[i])``,
``torch.index_select(T[i], 0, I[i])``, ``torch.gather(T[i], 0, I[i])``) becomes a direct batched
op. Any other body becomes ``torch.vmap`` of the per-iteration graph, extracted as a submodule.

Iteration ``i`` is the set of nodes between the stacked value and the slices ``X[i]`` it reads.
A loop is re-rolled only when every iteration reads slice ``i`` (and only slice i) of the same
batched inputs, in order 0..B-1 with B the inputs' batch size, every iteration is isomorphic to
the first (networkx, matching ops, constants and argument positions), and no node of an
iteration is used outside it. Anything else is left alone.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import fx

from ..graph import meta as M
from ..graph.meta import info
from ..graph.runtime import batch_gather, batch_index, vmap_call
from ..precision.report import record
from .base import Kind, Match, Pass, Replacement, Rule, apply_rules, arguments

if TYPE_CHECKING:  # imported where used: networkx costs `import amprewrite` 0.2-0.4 s
    import networkx as nx

__all__ = ["VectorizeLoops"]


# --- finding iterations -----------------------------------------------------------------------

_SELECT = {"select"}


def _slice_of(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``X[i]`` / ``X.select(0, i)`` with a constant i: (X, i)."""
    if node.op == "call_function" and node.target is operator.getitem:
        src, idx = node.args
        if isinstance(src, fx.Node) and type(idx) is int and info(src).kind == "tensor":
            return src, idx
    if (node.op == "call_method" and node.target in _SELECT) or (
            node.op == "call_function" and node.target is torch.select):
        src, dim, idx = [*node.args, None, None][:3]
        if isinstance(src, fx.Node) and dim == 0 and type(idx) is int:
            return src, idx
    return None


@dataclass
class _Iteration:
    root: fx.Node
    nodes: list[fx.Node] = field(default_factory=list)  # inner nodes, graph order, incl. root
    slices: dict[fx.Node, tuple[fx.Node, int]] = field(default_factory=dict)
    externals: list[fx.Node] = field(default_factory=list)


def _iteration(root: fx.Node, order: dict[fx.Node, int],
               reads: dict[fx.Node, bool]) -> _Iteration | None:
    """The nodes that compute ``root`` from slices X[i]; None if root reads no slice.

    ``reads`` memoises "depends on a slice" across iterations, so B iterations that share an
    upstream graph walk it once.
    """
    it = _Iteration(root)

    def reads_slice(n: fx.Node) -> bool:  # iterative DFS: loops may be thousands long
        stack = [n]
        while stack:
            cur = stack[-1]
            if cur in reads:
                stack.pop()
                continue
            if _slice_of(cur) is not None:
                reads[cur] = True
                stack.pop()
                continue
            pending = [a for a in cur.all_input_nodes if a not in reads]
            if pending:
                stack.extend(pending)
                continue
            reads[cur] = any(reads[a] for a in cur.all_input_nodes)
            stack.pop()
        return reads[n]

    if not reads_slice(root):
        return None
    seen, todo = set(), [root]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        sl = _slice_of(n)
        if sl is not None:
            it.slices[n] = sl
        elif reads[n]:
            it.nodes.append(n)
            todo.extend(n.all_input_nodes)
        else:
            it.externals.append(n)
    it.nodes.sort(key=order.__getitem__)
    return it


def _label(n: fx.Node, it: _Iteration) -> tuple:
    if n in it.slices:
        return ("slice", it.slices[n][0])
    if n in it.nodes:
        consts = fx.node.map_aggregate((n.args, n.kwargs), lambda a: None if isinstance(
            a, fx.Node) else (type(a).__name__, repr(a)))
        return (n.op, n.target, repr(consts))
    return ("external", n)


def _flat_inputs(n: fx.Node) -> list[fx.Node]:
    """Every node argument of ``n`` in order, repeats included (edge positions matter)."""
    flat: list[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), flat.append)
    return flat


def _as_graph(it: _Iteration) -> nx.DiGraph:
    import networkx as nx

    g = nx.DiGraph()
    for n in [*it.nodes, *it.slices, *it.externals]:
        g.add_node(n, label=_label(n, it))
    for n in it.nodes:
        for pos, a in enumerate(_flat_inputs(n)):
            g.add_edge(a, n, pos=(g.edges[a, n]["pos"] + (pos,)) if g.has_edge(a, n) else (pos,))
    return g


def _rows(join: fx.Node) -> list[fx.Node] | None:
    """The per-iteration values a join stacks along a new dim 0, or None."""
    if join.op != "call_function":
        return None
    tensors = join.args[0] if join.args else join.kwargs.get("tensors")
    dim = join.args[1] if len(join.args) > 1 else join.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or dim != 0 or not tensors:
        return None
    if not all(isinstance(t, fx.Node) for t in tensors):
        return None
    if join.target is torch.stack:
        return list(tensors)
    if join.target in (torch.cat, torch.concat):
        rows = []
        for t in tensors:  # cat of unsqueezed rows is a stack
            if t.op == "call_method" and t.target == "unsqueeze" and t.args[1:] == (0,):
                rows.append(t.args[0])
            elif t.op == "call_function" and t.target is operator.getitem and t.args[1] in (
                    None, (None,)):
                rows.append(t.args[0])
            else:
                return None
        return rows
    return None


def _near_miss(join: fx.Node, its: list[_Iteration]) -> str | None:
    """Why these iterations are not one loop over the batch, or None if they are."""
    sources = sorted({x for x, _ in its[0].slices.values()}, key=lambda n: n.name)
    for i, it in enumerate(its):
        if {x for x, _ in it.slices.values()} != set(sources):
            return f"iteration {i} reads other tensors than iteration 0"
        if any(idx != i for _, idx in it.slices.values()):
            return f"iteration {i} does not read slice {i} (missing, repeated or out of order)"
    for x in sources:
        shape = info(x).shape
        if not shape or shape[0] != len(its):
            return f"{x.name} has batch size {shape[0] if shape else '?'}, the loop {len(its)}"
    wrappers = set(join.all_input_nodes)
    for it in its:
        inside = set(it.nodes) | set(it.slices)
        for n in inside:
            allowed = inside | ({join} | wrappers if n is it.root else set())
            if any(u not in allowed for u in n.users):
                return f"{n.name} is used outside its iteration"
    return None


def _isomorphic(its: list[_Iteration]) -> bool:
    from networkx.algorithms.isomorphism import DiGraphMatcher

    first = _as_graph(its[0])
    for it in its[1:]:
        matcher = DiGraphMatcher(first, _as_graph(it),
                                 node_match=lambda a, b: a["label"] == b["label"],
                                 edge_match=lambda a, b: a["pos"] == b["pos"])
        if not matcher.is_isomorphic():
            return False
    return True


# --- rewriting --------------------------------------------------------------------------------


# A one-op body that is a batch gather: (op, its (tensor, index) parameters) -> batched op.
_GATHERS = {
    (operator.getitem, None): ("a", "b", batch_index),
    (torch.index_select, 0): ("input", "index", batch_index),
    (torch.gather, 0): ("input", "index", batch_gather),
}


def _direct(gm: fx.GraphModule, it: _Iteration) -> tuple[object, tuple] | None:
    """The batched op for a one-op batch-gather body: (function, (T, I))."""
    if len(it.nodes) != 1:
        return None
    (n,) = it.nodes
    srcs = {leaf: x for leaf, (x, _) in it.slices.items()}
    # operator.getitem's parameters are positional-only: no keywords to normalise to
    args = (dict(zip("ab", n.args)) if n.target is operator.getitem and len(n.args) == 2
            else arguments(gm, n))
    if args is None:
        return None
    target = n.target if n.op == "call_function" else getattr(torch, str(n.target), None)
    dim = args.get("dim")
    spec = _GATHERS.get((target, dim))
    if spec is None or set(args) - {spec[0], spec[1], "dim", "sparse_grad"} or args.get(
            "sparse_grad"):
        return None
    t, idx = args[spec[0]], args[spec[1]]
    if t in srcs and idx in srcs:
        return spec[2], (srcs[t], srcs[idx])
    return None


def _split_row_index(m: Match) -> Replacement | None:
    """``T[i, idx]`` -> ``T[i][idx]`` (same values), so the slice ``T[i]`` of a loop is visible."""
    src, index = m.node.args
    if not (isinstance(index, tuple) and len(index) == 2 and type(index[0]) is int
            and isinstance(index[1], fx.Node) and info(src).kind == "tensor"):
        return None
    shape = info(src).shape
    row = m.build.call(operator.getitem, src, index[0], value=M.ValueInfo(
        "tensor", info(src).dtype, shape=shape[1:] if shape else None))
    new = m.build.call(operator.getitem, row, index[1], value=info(m.node))
    return Replacement(new, "T[i, idx] -> T[i][idx]", "exposes the per-sample slice T[i]")


def _vmap_body(gm: fx.GraphModule, it: _Iteration, sources: list[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for x in sources:
        env[x] = graph.placeholder(x.name)
    for e in it.externals:
        env[e] = graph.placeholder(e.name)
    for leaf, (x, _) in it.slices.items():
        env[leaf] = env[x]  # vmap hands the body slice i of x
    for n in it.nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[it.root])
    return fx.GraphModule(gm, graph)


class VectorizeLoops(Pass):
    """Re-roll unrolled per-sample loops (see module docstring)."""

    name, kind = "vectorize_loops", Kind.REWRITE
    requires = (M.ORIG,)
    writes = (M.ORIG,)

    def run(self, gm: fx.GraphModule) -> bool:
        split = apply_rules(gm, (Rule((operator.getitem,), _split_row_index, normalize=False),),
                            record_now=False)
        rerolled = _reroll(gm)
        for node, done in split:  # the splits a re-roll did not consume stay: record those
            if node.graph is gm.graph and not node._erased:
                record(gm, node, done.action, done.reason)
        return rerolled or bool(split)


def _reroll(gm: fx.GraphModule) -> bool:
    changed = False
    loops = 0
    reads: dict[fx.Node, bool] = {}
    for join in M.each_node(gm.graph, "call_function"):
        rows = _rows(join)
        if rows is None or join.graph is not gm.graph:
            continue
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        its = [_iteration(r, order, reads) for r in rows]
        if any(it is None for it in its) or len({it.root for it in its}) != len(its):
            continue
        why = _near_miss(join, its)
        if why is None and not _isomorphic(its):
            why = "iterations compute different things"
        if why is not None:
            record(gm, join, "left alone", why)
            continue
        first = its[0]
        sources = sorted({x for x, _ in first.slices.values()}, key=order.__getitem__)
        direct = _direct(gm, first)
        with gm.graph.inserting_before(join):
            if direct is not None:
                fn, args = direct
                new = gm.graph.call_function(fn, args)
                pattern = fn.__name__
            else:
                name = f"amp_loop_{loops}"
                gm.add_submodule(name, _vmap_body(gm, first, sources))
                body = gm.graph.get_attr(name)
                body.meta[M.ORIG] = M.OTHER
                in_dims = (0,) * len(sources) + (None,) * len(first.externals)
                new = gm.graph.call_function(vmap_call, (body, in_dims, *sources,
                                                         *first.externals))
                pattern = f"torch.vmap of {len(first.nodes)}-node body ({name})"
                loops += 1
        M.copy_provenance(join, new, value=True)
        join.replace_all_uses_with(new)
        dead = [join, *{w for w in join.all_input_nodes if w not in rows}]
        for it in its:
            dead += it.nodes + list(it.slices)
        for n in sorted(set(dead), key=order.__getitem__, reverse=True):
            if not n.users:
                gm.graph.erase_node(n)
        record(gm, new, f"re-rolled {len(its)} iterations -> {pattern}",
               f"an unrolled per-sample loop over {', '.join(s.name for s in sources)}")
        changed = True
    return changed
