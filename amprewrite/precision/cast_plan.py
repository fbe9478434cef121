"""The cast plan: which dtype every float value physically has, with the fewest bytes cast.

LOW, FP32 and PROMOTE nodes, graph inputs and parameters have a fixed label (low or high).
NEUTRAL nodes are exact in either dtype, so their label is free: a cast may sit before or after
them. An FP32 node whose kernel reads a low input and computes in fp32 (``meta[MIXED]``, a
signature the kernel probe confirmed; DESIGN.md, "Compute dtype is not storage dtype") needs no
fp32 copy of that input: a ``DTYPE_ARG`` node (softmax, sum) reads either dtype, a ``LOW_IO``
node (a norm) on a low value is free like a NEUTRAL one, storing its output as its input is
stored. The free labels are chosen by a minimum s-t cut (networkx), where

- the source side is "high", the sink side "low";
- casting value ``u`` to a dtype costs ``bytes(u)`` once, however many consumers share the cast
  (an auxiliary node per (value, direction) makes several consumers pay one edge);
- a value whose natural precision is high may become low only if none of its consumers needs it
  high (infinite edges): that would be a low->high round trip that loses precision;
- a tiny cost keeps a free node at its natural label when the cut is otherwise indifferent
  (a LOW_IO node: fp32, when that costs no more bytes);
- in training (``gm.training``), the bytes autograd keeps for backward count too: a free node
  that keeps a tensor of its output's size (``relu`` keeps its output, ``x * y`` both operands)
  costs ``numel * (4 - low itemsize)`` more per kept tensor when it runs fp32, and a cast whose
  readers keep their input (a conv, a matmul, an fp32 norm) costs the bytes of its output once
  more. So ``batch_norm -> relu -> conv`` with an fp32 BatchNorm casts before the relu (which
  then keeps a low output), where the bytes moved alone are indifferent.

Only free nodes connected through shared values interact, so the graph is cut per connected
component of free nodes: the work grows linearly with the graph. A small component is solved by
trying every labelling, once per distinct network (a model's blocks repeat the same few).
"""

from __future__ import annotations

import itertools
from collections import defaultdict

from torch import fx

from ..graph import meta as M
from ..graph.meta import HIGH, LOW, info
from .ops import Mixed, Precision, is_pointwise, kept_for_backward, reads_values

__all__ = ["float_inputs", "plan_labels", "requirement"]

_EPS = 1e-3
# A LOW_IO node computes in fp32: where storing its output fp32 costs no more bytes (a norm
# that is the model's output), it does (more than a few _EPS, less than one byte).
_PREFER_FP32 = 0.5
_TUPLE = 1e15
# The classes read once: an enum member costs ~0.1 us to look up (Python 3.11), and requirement
# and the plan ask for each node's.
_LOW_CLASS, _FP32_CLASS = Precision.LOW, Precision.FP32
_PROMOTE_CLASS, _NEUTRAL_CLASS = Precision.PROMOTE, Precision.NEUTRAL


def float_inputs(node: fx.Node) -> list[fx.Node]:
    """The distinct inputs of ``node`` holding floats (tensors or tuples), in argument order."""
    return [n for n in node.all_input_nodes if info(n).has_float()]


def requirement(consumer: fx.Node, value: fx.Node, keep_io_dtype: bool, low_dtype) -> str | None:
    """The label ``consumer`` needs ``value`` in, or None when any label will do (or no cast)."""
    cls = consumer.meta.get(M.CLASS)
    if consumer.meta.get(M.TIED) and float_inputs(consumer)[:1] == [value]:
        return None  # the tied input: same variable, never cast
    if cls == _LOW_CLASS:
        return LOW
    if cls == _FP32_CLASS:
        mixed = consumer.meta.get(M.MIXED)
        if mixed is not None and _reads_as_data(consumer, value):
            if mixed is Mixed.DTYPE_ARG:
                # Reads either dtype (dtype=torch.float32 when it is low) -- without rounding
                # only a value whose numbers are low ones (``x_low.float()``): another fp32
                # value must stay fp32 for it.
                return None if _holds_low_numbers(value) else HIGH
            return consumer.meta.get(M.LABEL, consumer.meta[M.NATURAL])  # LOW_IO: as stored
        return HIGH
    if cls == _PROMOTE_CLASS:
        return consumer.meta[M.NATURAL]
    if cls == _NEUTRAL_CLASS:
        return consumer.meta.get(M.LABEL, consumer.meta[M.NATURAL])
    # Graph outputs and ops amprewrite leaves alone see the dtype the original model had.
    if consumer.op == "output" and not keep_io_dtype:
        return None
    if not reads_values(consumer):
        return None
    orig = info(value).dtype
    if orig is None or (orig.is_floating_point and orig != low_dtype and orig.itemsize == 4):
        return HIGH
    if orig == low_dtype:
        return LOW
    return None


def _holds_low_numbers(value: fx.Node, depth: int = 16) -> bool:
    """Is every number of ``value`` one the low dtype holds exactly: a value low by nature, or
    a NEUTRAL op (an upcast, a view, a copy: exact) of such values only? Then reading it low
    rounds nothing. Factories and deeper chains than ``depth``: no."""
    if value.meta.get(M.NATURAL) == LOW:
        return True
    if depth == 0 or value.meta.get(M.CLASS) != Precision.NEUTRAL:
        return False
    inputs = float_inputs(value)
    return bool(inputs) and all(_holds_low_numbers(i, depth - 1) for i in inputs)


def _reads_as_data(consumer: fx.Node, value: fx.Node) -> bool:
    """Is ``value`` the data input (first argument) of a mixed-signature node?"""
    return bool(consumer.args) and consumer.args[0] is value


def _free_io(node: fx.Node) -> bool:
    """A LOW_IO node on a low value: it may store its output low or fp32 (the plan's choice);
    on an fp32 value it is fixed fp32 (rounding its input would change its arithmetic)."""
    mixed = node.meta.get(M.MIXED)
    return mixed is not None and mixed.stores_input_dtype and node.meta.get(M.NATURAL) == LOW


def _fixed(node: fx.Node) -> str | None:
    """The label of a node the plan may not change, or None for a free node (NEUTRAL, or a
    LOW_IO node on a low value)."""
    if node.meta.get(M.CLASS) == _NEUTRAL_CLASS or _free_io(node):
        return None
    return node.meta.get(M.NATURAL)


class _Flow:
    """An s-t flow network as ``{(u, v): capacity}`` (None = infinite)."""

    # Up to this many free variables, try every labelling instead of running networkx: a
    # transformer block's components have 1-3, and nx.minimum_cut costs ~0.3 ms a call.
    EXHAUSTIVE = 4

    def __init__(self) -> None:
        self.cap: dict[tuple, float | None] = {}

    def add(self, u, v, cap: float | None) -> None:
        """Add capacity ``cap`` (None = infinite) from u to v, summing parallel edges."""
        key = (u, v)
        if cap is not None and key in self.cap:  # (infinite plus anything is infinite)
            old = self.cap[key]
            cap = None if old is None else old + cap
        self.cap[key] = cap

    def source_side(self, variables: list[str], solved: dict) -> set[str]:
        """The variables on the source ("S") side of a minimum S-T cut. ``solved``: the
        labellings :meth:`_exhaustive` found before, kept by the caller for the next network."""
        if len(variables) <= self.EXHAUSTIVE:
            return self._exhaustive(variables, solved)
        import networkx as nx  # here, not at the top: it costs `import amprewrite` 0.2-0.4 s

        g = nx.DiGraph()
        g.add_nodes_from(["S", "T"])
        for (u, v), c in self.cap.items():
            g.add_edge(u, v) if c is None else g.add_edge(u, v, capacity=c)
        _, (high_side, _) = nx.minimum_cut(g, "S", "T")
        return {v for v in variables if v in high_side}

    def _exhaustive(self, variables: list[str], solved: dict) -> set[str]:
        """Every labelling of the variables; each other (auxiliary) node takes its cheaper
        side, which it can alone: auxiliary nodes only touch variables, S and T.

        The answer depends on the edges alone once their nodes are numbered (as below), so a
        network met before, as every block of a model repeats its few, is looked up in
        ``solved`` (its best labelling by the numbered edges) instead of solved again."""
        # A labelling is a bit mask over S, T and the variables (set: on the source side);
        # auxiliary nodes are numbered -1, -2, ... in order of appearance.
        number = {"S": 1, "T": 2, **{v: 4 << i for i, v in enumerate(variables)}}
        fresh = itertools.count(-1, -1)
        edges = []
        for (u, v), c in self.cap.items():
            if u not in number:
                number[u] = next(fresh)
            if v not in number:
                number[v] = next(fresh)
            edges.append((number[u], number[v], c))
        key = (len(variables), tuple(edges))
        if key not in solved:
            solved[key] = _best_labelling(len(variables), edges)
        bits = solved[key]
        return {v for i, v in enumerate(variables) if bits >> i & 1}


def _best_labelling(count: int, edges: list[tuple[int, int, float | None]]) -> int:
    """The cheapest labelling (bit i: variable i on the source side) of ``count`` variables
    with ``edges`` between S (1), T (2), the variables (``4 << i``) and auxiliary nodes
    (negative), which each take their cheaper side."""
    inf = float("inf")
    aux: dict[int, list] = {}  # auxiliary node -> [edges into it, edges out of it, neighbours]
    direct = []
    for u, v, c in edges:
        c = inf if c is None else c
        if v < 0:
            a = aux.setdefault(v, [[], [], 0])
            a[0].append((u, c))
            a[2] |= u
        elif u < 0:
            a = aux.setdefault(u, [[], [], 0])
            a[1].append((v, c))
            a[2] |= v
        else:
            direct.append((u, v, c))
    # An auxiliary node's cost depends on its neighbours' sides only: computed once per
    # labelling of its neighbours (``seen``), not once per labelling of all the variables.
    seen: list[dict[int, float]] = [{} for _ in aux]
    best: tuple | None = None
    for bits in range(1 << count):
        side = bits << 2 | 1
        total = sum([c for u, v, c in direct if side & u and not side & v])
        for (into, out, around), costs in zip(aux.values(), seen):
            cost = costs.get(side & around)
            if cost is None:
                on_source = sum([c for v, c in out if not side & v])
                on_sink = sum([c for u, c in into if side & u])
                cost = costs[side & around] = min(on_source, on_sink)
            total += cost
        key = (total, bits.bit_count())  # ties: the smallest source side, as networkx
        if best is None or key < best[0]:
            best = (key, bits)
    return best[1]


def _keeps_input(readers, depth: int = 8) -> bool:
    """Does a reader other than a pointwise op (whose own term counts what it keeps) or a free
    LOW_IO node keep its input for backward: a conv, a matmul, a norm, a pooling? A neutral
    reader that keeps nothing (a view, a slice, ``cat``) passes its input on, so its own
    readers are asked: a cast before or after a view is then kept alike."""
    for c in readers:
        if is_pointwise(c) or _free_io(c):
            # A LOW_IO node on a low value reads an fp32 copy only to store its output fp32
            # (for a reader that needs it so): bytes kept must not make it round that output.
            continue
        if kept_for_backward(c):
            return True
        if depth and c.meta.get(M.CLASS) == _NEUTRAL_CLASS and _keeps_input(c.users,
                                                                            depth - 1):
            return True
    return False


def plan_labels(gm: fx.GraphModule, keep_io_dtype: bool, low_dtype, training: bool = False
                ) -> int:
    """Set ``meta[LABEL]`` on every float node; return the number of free nodes decided.
    ``training``: count the bytes autograd keeps for backward as well as the bytes cast."""
    nodes = list(gm.graph.nodes)
    fixed: dict[fx.Node, str | None] = {}  # _fixed of each node, asked once
    rep: dict[fx.Node, fx.Node] = {}
    free: set[fx.Node] = set()
    valued = []  # the nodes with a natural precision (the float values), in order
    for n in nodes:
        fixed[n] = label = _fixed(n)
        r = n
        if n.meta.get(M.TIED):  # tied nodes share their first input's variable
            first = float_inputs(n)[:1]
            if first:
                r = rep.get(first[0], first[0])
                # r is an input of n, so in fixed already unless the graph is out of order
                label = fixed[r] if r in fixed else _fixed(r)
        rep[n] = r
        natural = n.meta.get(M.NATURAL)
        if natural is not None:
            valued.append(n)
        if label is not None:
            n.meta[M.LABEL] = label
        elif natural is None:
            n.meta.pop(M.LABEL, None)
        else:
            free.add(n)
    if not free:
        return 0

    # Group free variables that share a value (their casts may be shared) into components.
    parent: dict[fx.Node, fx.Node] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    var_of = {n: r for n, r in rep.items() if r in free}  # node -> its free variable
    touching: dict[fx.Node, list[fx.Node]] = {}  # value -> free variables around it
    for u in valued:
        if u not in var_of and var_of.keys().isdisjoint(u.users):
            continue
        around = [var_of[c] for c in (u, *u.users) if c in var_of]
        if info(u).has_float():
            touching[u] = around
            first, *rest = around
            for r in rest:
                parent[find(r)] = find(first)
    by_component: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for u, around in touching.items():
        by_component[find(around[0])].append(u)

    solved: dict = {}  # the small networks solved, for _Flow.source_side
    for values in by_component.values():
        _solve(values, rep, free, fixed, keep_io_dtype, low_dtype, training, solved)
    return len(free)


def _solve(values, rep, free, fixed, keep_io_dtype, low_dtype, training: bool, solved: dict
           ) -> None:
    saving = 4 - low_dtype.itemsize  # bytes per element a low value keeps less than an fp32 one
    flow = _Flow()
    add = flow.add
    var = {}

    def side(r):  # the flow node standing for a representative's label: a variable, or S / T
        if r in free:
            var[r] = r.name
            return r.name
        return "S" if fixed[r] == HIGH else "T"

    for u in values:
        vi = info(u)
        # A tuple cannot be cast (its elements are tied to it): make casting it prohibitive.
        w = float(vi.numel or 1) * 4 if vi.kind == "tensor" else _TUPLE
        ru = rep[u]
        here = side(ru)
        wants_low, wants_high = [], []  # (flow node, reader): who needs u low, who high
        for c in u.users:
            rc = rep[c]
            if rc is ru:
                continue
            if rc in free and not c.meta.get(M.TIED) and (
                    c.meta.get(M.CLASS) == _NEUTRAL_CLASS
                    or (_free_io(c) and _reads_as_data(c, u))):
                r = side(rc)
            else:
                need = requirement(c, u, keep_io_dtype, low_dtype)
                if need is None:
                    continue
                r = "S" if need == HIGH else "T"
            if r != "S":
                wants_low.append((r, c))
            if r != "T":
                wants_high.append((r, c))
        down = up = w
        if training and w < _TUPLE:
            # The bytes each cast writes, and once more where a reader keeps it for backward.
            numel = float(vi.numel or 1)
            down = numel * low_dtype.itemsize * (1 + _keeps_input(c for _, c in wants_low))
            up = numel * 4 * (1 + _keeps_input(c for _, c in wants_high))
        if here != "T" and wants_low:  # a cast down of u, shared by all who want it low
            a = ("down", u.name)
            add(here, a, down)
            for r, _ in wants_low:
                add(a, r, None)
        if here != "S" and wants_high:  # a cast up of u
            b = ("up", u.name)
            add(b, here, up)
            for r, _ in wants_high:
                add(r, b, None)
        if here not in ("S", "T") and u.meta.get(M.NATURAL) == HIGH:
            for r, _ in wants_high:  # high -> low -> high would lose precision: forbidden
                add(r, here, None)
    for r, name in var.items():
        kept = kept_for_backward(r) if training and not _free_io(r) else 0
        if kept and info(r).kind == "tensor":
            # What autograd keeps for r's backward: fp32 costs `saving` bytes more per element.
            add(name, "T", kept * float(info(r).numel or 1) * saving)
        if _free_io(r):
            add("S", name, _PREFER_FP32)
        elif r.meta.get(M.NATURAL) == HIGH:
            add("S", name, _EPS)
        else:
            add(name, "T", _EPS)
    high_side = flow.source_side(list(var.values()), solved)
    for r, name in var.items():
        r.meta[M.LABEL] = HIGH if name in high_side else LOW
    for u in values:  # tied members follow their representative
        if rep[u] in var:
            u.meta[M.LABEL] = rep[u].meta[M.LABEL]
        for c in u.users:
            if rep[c] in var:
                c.meta[M.LABEL] = rep[c].meta[M.LABEL]
