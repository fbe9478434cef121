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

import networkx as nx
import torch
from networkx.algorithms.isomorphism import DiGraphMatcher
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from .. import meta as M
from ..meta import info
from ..ops import Family, Precision, register_family
from ..report import record

__all__ = ["batch_gather", "batch_index", "vectorize_loops", "vmap_call"]


# --- what the rewritten graph calls -----------------------------------------------------------


def _batch_arange(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.arange(t.size(0), device=t.device).view(-1, *([1] * (index.dim() - 1)))


@torch.fx.wrap
def batch_index(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``torch.stack([t[i][index[i]] for i in range(t.size(0))])`` in one indexing op.

    >>> t, idx = torch.arange(12.0).reshape(2, 3, 2), torch.tensor([[2, 0], [1, 1]])
    >>> torch.equal(batch_index(t, idx), torch.stack([t[i][idx[i]] for i in range(2)]))
    True
    """
    return t[_batch_arange(t, index), index]


@torch.fx.wrap
def batch_gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``torch.stack([torch.gather(t[i], 0, index[i]) for i in ...])`` as one gather."""
    return torch.gather(t, 1, index)


@torch.fx.wrap
def vmap_call(body: torch.nn.Module, in_dims: tuple, *args):
    """``torch.stack([body(*per_sample_args(i)) for i in ...])`` as ``torch.vmap(body)``."""
    return torch.vmap(body, in_dims=in_dims)(*args)


for _fn in (batch_index, batch_gather):
    register_family(Family(_fn.__name__, Precision.NEUTRAL, (_fn,), numeric=False))


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
    first = _as_graph(its[0])
    for it in its[1:]:
        matcher = DiGraphMatcher(first, _as_graph(it),
                                 node_match=lambda a, b: a["label"] == b["label"],
                                 edge_match=lambda a, b: a["pos"] == b["pos"])
        if not matcher.is_isomorphic():
            return False
    return True


# --- rewriting --------------------------------------------------------------------------------


def _direct(it: _Iteration) -> tuple[object, tuple] | None:
    """The batched op for a one-op batch-gather body: (function, (T, I))."""
    if len(it.nodes) != 1:
        return None
    (n,) = it.nodes
    srcs = {leaf: x for leaf, (x, _) in it.slices.items()}
    if n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2:
        t, idx = n.args
        if t in srcs and idx in srcs:
            return batch_index, (srcs[t], srcs[idx])
    if (n.target in ("index_select", torch.index_select) and len(n.args) == 3
            and n.args[1] == 0 and n.args[0] in srcs and n.args[2] in srcs):
        return batch_index, (srcs[n.args[0]], srcs[n.args[2]])
    if (n.target in ("gather", torch.gather) and len(n.args) == 3 and n.args[1] == 0
            and n.args[0] in srcs and n.args[2] in srcs and not n.kwargs):
        return batch_gather, (srcs[n.args[0]], srcs[n.args[2]])
    return None


def _split_int_tuple_index(gm: fx.GraphModule) -> None:
    """``T[i, idx]`` -> ``T[i][idx]`` (same values) so the slice ``T[i]`` is visible."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is operator.getitem and isinstance(
                n.args[1], tuple) and len(n.args[1]) == 2 and type(n.args[1][0]) is int and (
                isinstance(n.args[1][1], fx.Node) and info(n.args[0]).kind == "tensor"):
            with gm.graph.inserting_before(n):
                row = gm.graph.call_function(operator.getitem, (n.args[0], n.args[1][0]))
            row.meta.update({k: n.meta[k] for k in (M.MODULE_PATH, M.MODULE_TYPES) if k in n.meta})
            shape = info(n.args[0]).shape
            row.meta[M.ORIG] = M.ValueInfo("tensor", info(n.args[0]).dtype,
                                           shape=shape[1:] if shape else None)
            n.args = (row, n.args[1][1])


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


def vectorize_loops(gm: fx.GraphModule) -> PassResult:
    """Re-roll unrolled per-sample loops (see module docstring)."""
    _split_int_tuple_index(gm)
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
            record(gm, join, "vectorize_loops", "left alone", why)
            continue
        first = its[0]
        sources = sorted({x for x, _ in first.slices.values()}, key=order.__getitem__)
        direct = _direct(first)
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
        new.meta.update(join.meta)
        join.replace_all_uses_with(new)
        dead = [join, *{w for w in join.all_input_nodes if w not in rows}]
        for it in its:
            dead += it.nodes + list(it.slices)
        for n in sorted(set(dead), key=order.__getitem__, reverse=True):
            if not n.users:
                gm.graph.erase_node(n)
        record(gm, new, "vectorize_loops", f"re-rolled {len(its)} iterations -> {pattern}",
               f"an unrolled per-sample loop over {', '.join(s.name for s in sources)}")
        changed = True
    return PassResult(gm, changed)
