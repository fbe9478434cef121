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
component of free nodes: the work grows linearly with the graph.
"""

from __future__ import annotations

from collections import defaultdict

import networkx as nx
from torch import fx

from . import meta as M
from .meta import HIGH, LOW, info
from .ops import Mixed, Precision, is_pointwise, kept_for_backward, reads_values

__all__ = ["float_inputs", "plan_labels", "requirement"]

_EPS = 1e-3
# A LOW_IO node computes in fp32: where storing its output fp32 costs no more bytes (a norm
# that is the model's output), it does (more than a few _EPS, less than one byte).
_PREFER_FP32 = 0.5
_TUPLE = 1e15
def float_inputs(node: fx.Node) -> list[fx.Node]:
    """The distinct inputs of ``node`` holding floats (tensors or tuples), in argument order."""
    return [n for n in node.all_input_nodes if info(n).has_float()]


def requirement(consumer: fx.Node, value: fx.Node, keep_io_dtype: bool, low_dtype) -> str | None:
    """The label ``consumer`` needs ``value`` in, or None when any label will do (or no cast)."""
    cls = consumer.meta.get(M.CLASS)
    if consumer.meta.get(M.TIED) and float_inputs(consumer)[:1] == [value]:
        return None  # the tied input: same variable, never cast
    if cls == Precision.LOW:
        return LOW
    if cls == Precision.FP32:
        mixed = consumer.meta.get(M.MIXED)
        if mixed is not None and _reads_as_data(consumer, value):
            if mixed is Mixed.DTYPE_ARG:
                # Reads either dtype (dtype=torch.float32 when it is low) -- without rounding
                # only a value whose numbers are low ones (``x_low.float()``): another fp32
                # value must stay fp32 for it.
                return None if _holds_low_numbers(value) else HIGH
            return consumer.meta.get(M.LABEL, consumer.meta[M.NATURAL])  # LOW_IO: as stored
        return HIGH
    if cls == Precision.PROMOTE:
        return consumer.meta[M.NATURAL]
    if cls == Precision.NEUTRAL:
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
    if node.meta.get(M.CLASS) == Precision.NEUTRAL or _free_io(node):
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
        if (u, v) in self.cap:
            old = self.cap[(u, v)]
            self.cap[(u, v)] = None if old is None or cap is None else old + cap
        else:
            self.cap[(u, v)] = cap

    def source_side(self, variables: list[str]) -> set[str]:
        """The variables on the source ("S") side of a minimum S-T cut."""
        if len(variables) <= self.EXHAUSTIVE:
            return self._exhaustive(variables)
        g = nx.DiGraph()
        g.add_nodes_from(["S", "T"])
        for (u, v), c in self.cap.items():
            g.add_edge(u, v) if c is None else g.add_edge(u, v, capacity=c)
        _, (high_side, _) = nx.minimum_cut(g, "S", "T")
        return {v for v in variables if v in high_side}

    def _exhaustive(self, variables: list[str]) -> set[str]:
        """Every labelling of the variables; each other (auxiliary) node takes its cheaper
        side, which it can alone: auxiliary nodes only touch variables, S and T."""
        inf = float("inf")
        fixed = {"S": True, "T": False}
        aux_in: dict[object, list] = defaultdict(list)
        aux_out: dict[object, list] = defaultdict(list)
        direct = []
        known = set(variables) | {"S", "T"}
        for (u, v), c in self.cap.items():
            c = inf if c is None else c
            if v not in known:
                aux_in[v].append((u, c))
            elif u not in known:
                aux_out[u].append((v, c))
            else:
                direct.append((u, v, c))
        best: tuple | None = None
        for bits in range(1 << len(variables)):
            side = {**fixed, **{v: bool(bits >> i & 1) for i, v in enumerate(variables)}}
            total = sum(c for u, v, c in direct if side[u] and not side[v])
            for a in aux_in.keys() | aux_out.keys():
                on_source = sum(c for v, c in aux_out[a] if not side[v])
                on_sink = sum(c for u, c in aux_in[a] if side[u])
                total += min(on_source, on_sink)
            key = (total, bin(bits).count("1"))  # ties: the smallest source side, as networkx
            if best is None or key < best[0]:
                best = (key, {v for v in variables if side[v]})
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
        if depth and c.meta.get(M.CLASS) == Precision.NEUTRAL and _keeps_input(c.users,
                                                                              depth - 1):
            return True
    return False


def plan_labels(gm: fx.GraphModule, keep_io_dtype: bool, low_dtype, training: bool = False
                ) -> int:
    """Set ``meta[LABEL]`` on every float node; return the number of free nodes decided.
    ``training``: count the bytes autograd keeps for backward as well as the bytes cast."""
    nodes = list(gm.graph.nodes)
    rep: dict[fx.Node, fx.Node] = {}
    for n in nodes:  # tied nodes share their first input's variable
        first = float_inputs(n)[:1]
        rep[n] = rep.get(first[0], first[0]) if n.meta.get(M.TIED) and first else n
    free = {n for n in nodes if n.meta.get(M.NATURAL) is not None and _fixed(rep[n]) is None}
    for n in nodes:
        label = _fixed(rep[n])
        if label is not None:
            n.meta[M.LABEL] = label
        elif n.meta.get(M.NATURAL) is None:
            n.meta.pop(M.LABEL, None)
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

    touching: dict[fx.Node, set[fx.Node]] = defaultdict(set)  # value -> free variables around it
    for u in nodes:
        if not info(u).has_float() or u.meta.get(M.NATURAL) is None:
            continue
        around = {rep[u]} if rep[u] in free else set()
        around |= {rep[c] for c in u.users if rep[c] in free}
        if around:
            touching[u] = around
            first, *rest = around
            for r in rest:
                parent[find(r)] = find(first)
    by_component: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for u, around in touching.items():
        by_component[find(next(iter(around)))].append(u)

    for values in by_component.values():
        _solve(values, rep, free, keep_io_dtype, low_dtype, training)
    return len(free)


def _solve(values, rep, free, keep_io_dtype, low_dtype, training: bool) -> None:
    saving = 4 - low_dtype.itemsize  # bytes per element a low value keeps less than an fp32 one
    flow = _Flow()
    var = {}

    def side(n):  # the flow node standing for a label: a variable, or S / T when fixed
        r = rep[n]
        if r in free:
            var[r] = r.name
            return r.name
        return "S" if _fixed(r) == HIGH else "T"

    for u in values:
        # A tuple cannot be cast (its elements are tied to it): make casting it prohibitive.
        w = float(info(u).numel or 1) * 4 if info(u).kind == "tensor" else _TUPLE
        here = side(u)
        reqs = []
        for c in u.users:
            if rep[c] is rep[u]:
                continue
            if rep[c] in free and not c.meta.get(M.TIED) and (
                    c.meta.get(M.CLASS) == Precision.NEUTRAL
                    or (_free_io(c) and _reads_as_data(c, u))):
                reqs.append((side(c), c))
            else:
                r = requirement(c, u, keep_io_dtype, low_dtype)
                if r is not None:
                    reqs.append(("S" if r == HIGH else "T", c))
        wants_low = [(r, c) for r, c in reqs if r != "S"]
        wants_high = [(r, c) for r, c in reqs if r != "T"]
        down = up = w
        if training and w < _TUPLE:
            # The bytes each cast writes, and once more where a reader keeps it for backward.
            numel = float(info(u).numel or 1)
            down = numel * low_dtype.itemsize * (1 + _keeps_input(c for _, c in wants_low))
            up = numel * 4 * (1 + _keeps_input(c for _, c in wants_high))
        if here != "T" and wants_low:  # a cast down of u, shared by all who want it low
            a = ("down", u.name)
            flow.add(here, a, down)
            for r, _ in wants_low:
                flow.add(a, r, None)
        if here != "S" and wants_high:  # a cast up of u
            b = ("up", u.name)
            flow.add(b, here, up)
            for r, _ in wants_high:
                flow.add(r, b, None)
        if here not in ("S", "T") and u.meta.get(M.NATURAL) == HIGH:
            for r, _ in wants_high:  # high -> low -> high would lose precision: forbidden
                flow.add(r, here, None)
    for r, name in var.items():
        kept = kept_for_backward(r) if training and not _free_io(r) else 0
        if kept and info(r).kind == "tensor":
            # What autograd keeps for r's backward: fp32 costs `saving` bytes more per element.
            flow.add(name, "T", kept * float(info(r).numel or 1) * saving)
        if _free_io(r):
            flow.add("S", name, _PREFER_FP32)
        elif r.meta.get(M.NATURAL) == HIGH:
            flow.add("S", name, _EPS)
        else:
            flow.add(name, "T", _EPS)
    high_side = flow.source_side(list(var.values()))
    for r, name in var.items():
        r.meta[M.LABEL] = HIGH if name in high_side else LOW
    for u in values:  # tied members follow their representative
        if rep[u] in var:
            u.meta[M.LABEL] = rep[u].meta[M.LABEL]
        for c in u.users:
            if rep[c] in var:
                c.meta[M.LABEL] = rep[c].meta[M.LABEL]
