"""guard_autocast: a transformed graph turns an enclosing ``torch.autocast`` off while it runs.

Matches:    every graph (its first node after the inputs, its output)
Rewrite to: ``entered = autocast_off()`` first, ``autocast_on_again(entered)`` before the output
            (:func:`amprewrite.graph.runtime.autocast_off`)

The plan's casts are explicit; an enclosing autocast (transformers' Trainer, accelerate and
Lightning put one around every forward) would recast what the plan decided: a matmul kept fp32
because its values pass fp16's range, run in fp16 again, is inf. In the graph rather than
around the call, so every way a graph runs keeps it: its own call, ``torch.compile`` of it
(dynamo traces the two calls and the autocast state they read), the backend's compiled graphs
(traced by the inner compiler in the state of the call that compiles them) and region bodies
inside it. Without an enclosing autocast it costs two flag reads a call, and an export (which
runs outside autocast) keeps nothing of it.
"""

from __future__ import annotations

from torch import fx

from ..graph import meta as M
from ..graph import runtime
from ..precision.ops import Precision
from .base import Kind, Pass, new_node

__all__ = ["GuardAutocast"]

_REASON = ("turns an enclosing torch.autocast off while the graph runs: the plan's casts are "
           "explicit, and autocast's would undo them")


class GuardAutocast(Pass):
    """Put :func:`~amprewrite.graph.runtime.autocast_off` first and
    :func:`~amprewrite.graph.runtime.autocast_on_again` last in the graph."""

    name, kind = "guard_autocast", Kind.REWRITE

    def run(self, gm: fx.GraphModule) -> bool:
        graph = gm.graph
        if any(n.op == "call_function" and n.target is runtime.autocast_off
               for n in graph.nodes):
            return False  # guarded already (a graph transformed again)
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        (out,) = [n for n in graph.nodes if n.op == "output"]
        anchor = inputs[-1].next if inputs else next(iter(graph.nodes))
        with graph.inserting_before(anchor):
            entered = new_node(graph, "call_function", runtime.autocast_off, (), {})
        with graph.inserting_before(out):
            again = new_node(graph, "call_function", runtime.autocast_on_again, (entered,), {})
        for node in (entered, again):  # listed in the report as non-float calls, with why
            node.meta[M.CLASS] = Precision.NONFLOAT
            node.meta[M.REASON] = _REASON
        return True
